"""The fault catalogue the suite prints at its end (tests/conftest.py), run on small suites of its own."""

from __future__ import annotations

import ast
import uuid
from pathlib import Path

import pytest

from tests.conftest import CATALOGUE

pytest_plugins = ["pytester"]

CONFTEST = Path(__file__).with_name("conftest.py")

FAULTS = """
import pytest

pytestmark = pytest.mark.fault("drain", "the drain deadline")


@pytest.mark.fault("upstreams", "heads too large or ambiguously framed")
def test_survives():
    pass


@pytest.mark.fault("upstreams", "heads too large or ambiguously framed")
def test_loses():
    assert False, "a request was lost"


def test_by_its_module():
    pass


@pytest.mark.fault("clients", "a client that leaves mid-request")
def test_skipped():
    pytest.skip("no engine here")


@pytest.mark.fault("clients", "a client that leaves mid-request")
@pytest.mark.parametrize("n", [1, 2])
def test_each_parameter(n):
    pass
"""


@pytest.fixture
def suite(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> pytest.Pytester:
    """A directory with the suite's own conftest.py, whose run counts only the processes it starts."""
    monkeypatch.setenv("BLAZAR_TEST_RUN", f"catalogue-{uuid.uuid4().hex}")
    pytester.makeconftest(CONFTEST.read_text())
    return pytester


def test_a_failing_fault_test_is_listed_as_lost_under_its_case(suite: pytest.Pytester) -> None:
    """Each case with passed of ran, the failed test's id under its case, then the closing line."""
    suite.makepyfile(test_faults=FAULTS, test_plain="def test_not_a_fault():\n    pass\n")
    result = suite.runpytest()
    result.assert_outcomes(passed=5, failed=1, skipped=1)
    result.stdout.fnmatch_lines(
        [
            "*- fault catalogue -*",
            "clients",
            "  a client that leaves mid-request * 2/2 passed, 1 skipped",
            "upstreams",
            "  heads too large or ambiguously framed * 1/2 passed",
            "      lost: test_faults.py::test_loses",
            "drain",
            "  the drain deadline * 1/1 passed",
            "faults injected 5, survived 4, requests lost 1, orphans 0",
        ],
        consecutive=True,
    )
    assert "test_not_a_fault" not in result.stdout.str().split("fault catalogue")[1].split("short test")[0]
    assert result.ret == pytest.ExitCode.TESTS_FAILED


def test_a_case_whose_tests_all_were_deselected_or_skipped_is_not_run(suite: pytest.Pytester) -> None:
    """A case none of whose tests ran says "not run" with why (skipped, deselected), never "0/0 passed"."""
    suite.makepyfile(test_faults=FAULTS)
    result = suite.runpytest("-k", "test_by_its_module or test_skipped")
    result.assert_outcomes(passed=1, skipped=1, deselected=4)
    result.stdout.fnmatch_lines(["*- fault catalogue -*"])
    result.stdout.fnmatch_lines(
        [
            "clients",
            "  a client that leaves mid-request * not run, 1 skipped, 2 deselected",
            "upstreams",
            "  heads too large or ambiguously framed * not run, 2 deselected",
            "drain",
            "  the drain deadline * 1/1 passed",
            "faults injected 1, survived 1, requests lost 0, orphans 0",
        ],
        consecutive=True,
    )
    assert "0/0" not in result.stdout.str()


def test_a_run_without_fault_tests_prints_no_catalogue(suite: pytest.Pytester) -> None:
    """Without a fault test among those run, neither the catalogue nor the closing line is printed."""
    suite.makepyfile(test_plain="def test_not_a_fault():\n    pass\n")
    result = suite.runpytest()
    result.assert_outcomes(passed=1)
    assert "fault catalogue" not in result.stdout.str()
    assert "faults injected" not in result.stdout.str()


@pytest.mark.parametrize(
    "marker",
    [
        "pytest.mark.fault",
        'pytest.mark.fault("upstreams")',
        'pytest.mark.fault("upstream", "heads too large or ambiguously framed")',
        'pytest.mark.fault("upstreams", "a head too large")',
    ],
)
def test_a_fault_marker_outside_the_catalogue_stops_the_run(suite: pytest.Pytester, marker: str) -> None:
    """A bare marker, a missing case, or a group or case not in the catalogue is an error, not a new line."""
    suite.makepyfile(test_faults=f"import pytest\n\n@{marker}\ndef test_fault():\n    pass\n")
    result = suite.runpytest()
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*test_faults.py::test_fault: *fault*"])


def test_every_case_of_the_catalogue_has_a_test() -> None:
    """No case is in the catalogue without a test in the suite that provokes it."""
    marked: set[tuple[str, str]] = set()
    for path in CONFTEST.parent.rglob("test_*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and ast.unparse(node.func) == "pytest.mark.fault":
                group, case = (ast.literal_eval(arg) for arg in node.args)
                marked.add((str(group), str(case)))
    listed = {(group, case) for group, cases in CATALOGUE.items() for case in cases}
    assert listed - marked == set()
