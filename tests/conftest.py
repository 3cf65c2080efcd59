"""Shared fixtures, and the fault catalogue's one-line summary at the end of a run.

Tests that inject a fault (a dying engine, a stalled stream, a slowloris
client, a drain, ...) carry the `fault` marker. The run ends with

    faults injected N, survived N, requests lost 0, orphans 0

where "survived" counts fault tests that passed (each asserts that its
requests were answered, none silently cut), "requests lost" the fault tests
that failed, and "orphans" the engine or fake-engine processes left running
by the suite once it is over.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest

_FAULT_FILES = {
    "test_disconnect.py",
    "test_review_regressions.py",
    "test_admission.py",
    "test_drain.py",
    "test_client_limits.py",
    "test_child.py",
    "test_send_limits.py",
    "test_heartbeat.py",
    "test_review5_regressions.py",
    "test_load_balancer.py",
}
_FAULT_TESTS = {
    "test_broken_upstream_is_502",
    "test_truncated_stream_ends_with_error_event",
    "test_non_stream_body_cut_short_is_not_a_clean_response",
    "test_first_byte_timeout_is_504",
    "test_upstream_down_is_503_with_retry_after",
    "test_stream_that_dies_raises_api_error",
    "test_empty_reply_is_internal_server_error_502",
    "test_bad_field_type_gets_400_not_a_hang",
    "test_crashed_child_comes_back_and_requests_meanwhile_get_503",
    "test_sigterm_stops_gateway_and_reaps_child",
    "test_sigkill_of_gateway_leaves_no_orphan",
    "test_sigterm_lets_a_real_stream_finish_then_reaps_the_child",
    "test_load_wait_holds_requests_until_the_child_is_back",
    "test_a_draining_gateways_503_is_retried_and_its_check_takes_it_out",
    "test_a_gateway_that_died_is_retried_on_the_other",
    "test_sigterm_under_load_loses_nothing_and_the_gateway_rejoins",
    "test_upstream_error_status_through_a_is_bs_error",
    "test_stream_that_breaks_behind_b_is_one_error_event_at_a",
    "test_error_after_bs_heartbeats_is_one_error_event_at_a",
    "test_bs_refused_upstream_reaches_the_client_as_bs_503_with_retry_after",
    "test_draining_b_reaches_the_client_as_503_draining_with_retry_after",
    "test_client_leaving_a_mid_stream_closes_b_and_the_engine",
    "test_client_leaving_a_during_prefill_closes_b_and_the_engine",
}


# Every process this run starts inherits this mark (the gateway passes its
# environment on to engine children), so that the closing line counts only
# the run's own leftovers, not engines that belong to something else.
_RUN_MARK = "BLAZAR_TEST_RUN"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "fault: the test injects a fault and checks that nothing is lost")
    os.environ.setdefault(_RUN_MARK, f"{os.getpid()}-{uuid.uuid4().hex}")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        name = getattr(item, "originalname", item.name)
        if Path(str(item.fspath)).name in _FAULT_FILES or name in _FAULT_TESTS:
            item.add_marker(pytest.mark.fault)


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


_ENGINE_PROGRAMS = (b"tests.fake_engine", b"mlx_lm.server", b"llama_cpp.server")


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    stats = terminalreporter.stats

    def faults(outcome: str) -> set[str]:
        return {r.nodeid for r in stats.get(outcome, []) if "fault" in getattr(r, "keywords", {})}

    passed = faults("passed")
    lost = faults("failed") | faults("error")
    injected = len(passed | lost)
    if not injected:
        return
    terminalreporter.write_line(
        f"faults injected {injected}, survived {len(passed - lost)}, requests lost {len(lost)}, "
        f"orphans {_orphans()}"
    )


@pytest.fixture
def anyio_backend() -> str:
    # The gateway runs on asyncio (uvloop in production); trio is not a target.
    return "asyncio"
