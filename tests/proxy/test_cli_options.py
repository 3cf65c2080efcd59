"""The fleet's command-line options: --affinity-slack N|off and --health-interval, checked at parse time."""

from __future__ import annotations

import click
import pytest
from click.testing import CliRunner

from proxy.startup.cli import main
from proxy.startup.options import IntOrOff


@pytest.mark.parametrize(("given", "wanted"), [("4", 4), ("0", 0), (7, 7), ("off", None), (" OFF ", None)])
def test_affinity_slack_is_a_count_or_off(given: object, wanted: int | None) -> None:
    """A whole number of at least 0 is the slack; off (any case) turns affinity off."""
    assert IntOrOff(0).convert(given, None, None) == wanted


@pytest.mark.parametrize("given", ["-1", -1, "x", "1.5"])
def test_a_bad_affinity_slack_is_refused(given: object) -> None:
    """Below 0, or neither a whole number nor off: a usage error naming the value."""
    with pytest.raises(click.BadParameter):
        IntOrOff(0).convert(given, None, None)


@pytest.mark.parametrize(
    ("args", "wanted"),
    [
        (["--affinity-slack", "sometimes"], "--affinity-slack"),
        (["--health-interval", "-2"], "--health-interval"),
        (["--upstream", "m=http://127.0.0.1:9"], "already given for m"),
    ],
)
def test_the_command_refuses_bad_fleet_options_before_starting(args: list[str], wanted: str) -> None:
    """The command exits 2 with the option's name before it serves anything."""
    result = CliRunner().invoke(main, [*args, "--upstream", "m=http://127.0.0.1:9"])
    assert result.exit_code == 2, result.output
    assert wanted in result.output
