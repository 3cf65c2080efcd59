"""The fleet's command-line options: --affinity-slack N|off and --health-interval, checked at parse time."""

from __future__ import annotations

from pathlib import Path

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


@pytest.mark.parametrize(
    ("args", "env", "wanted"),
    [
        (
            ["--port", "eight"],
            {},
            "--port: 'eight' is not a port number; give 1-65535, or 0 for any free port",
        ),
        ([], {"BLAZAR_PORT": "eight"}, "BLAZAR_PORT: 'eight' is not a port number; give 1-65535"),
        (["--port", "70000"], {}, "--port: '70000' is not a port number; give 1-65535"),
        (["--max-body-bytes", "lots"], {}, "--max-body-bytes: 'lots' is not a whole number; give 1 or more"),
        ([], {"BLAZAR_MAX_IN_FLIGHT": "0"}, "BLAZAR_MAX_IN_FLIGHT: '0' is too small; give 1 or more"),
        (
            ["--affinity-slack", "lots"],
            {},
            "--affinity-slack: 'lots' is neither a whole number nor off; give 0 or more, or off",
        ),
        (
            [],
            {"BLAZAR_AFFINITY_SLACK": "-1"},
            "BLAZAR_AFFINITY_SLACK: '-1' is too small; give 0 or more, or off",
        ),
    ],
)
def test_a_bad_integer_says_what_is_wrong_and_what_to_give(
    args: list[str], env: dict[str, str], wanted: str
) -> None:
    """A bad integer option names where it came from (the flag or its variable), what is wrong and
    what to give, not click's "integer range"; a usage error, exit 2, no traceback."""
    result = CliRunner().invoke(main, [*args, "--upstream", "m=http://127.0.0.1:9"], env=env)
    assert result.exit_code == 2, result.output
    assert isinstance(result.exception, SystemExit)
    assert wanted in result.output
    assert "integer range" not in result.output and "env var" not in result.output


@pytest.mark.parametrize(
    ("args", "env", "wanted"),
    [
        (["--queue-timeout", "soon"], {}, "--queue-timeout: 'soon' is not a number; give more than 0"),
        ([], {"BLAZAR_READ_TIMEOUT": "-1"}, "BLAZAR_READ_TIMEOUT: '-1' is too small; give more than 0"),
        (["--drain-timeout", "-2"], {}, "--drain-timeout: '-2' is too small; give 0 or more"),
    ],
)
def test_a_bad_number_of_seconds_says_what_is_wrong_and_what_to_give(
    args: list[str], env: dict[str, str], wanted: str
) -> None:
    """As for integers: the flag or variable, what is wrong, what to give; not click's "float range"."""
    result = CliRunner().invoke(main, [*args, "--upstream", "m=http://127.0.0.1:9"], env=env)
    assert result.exit_code == 2, result.output
    assert isinstance(result.exception, SystemExit)
    assert wanted in result.output
    assert "float range" not in result.output and "env var" not in result.output


def test_a_bad_port_in_the_config_file_is_worded_the_same(tmp_path: Path) -> None:
    """port = "eight" in [gateway]: the file, its table and key, and what to give."""
    config = tmp_path / "blazar.toml"
    config.write_text('[gateway]\nport = "eight"\n\n[models.m]\nupstream = "http://127.0.0.1:9"\n')
    result = CliRunner().invoke(main, ["--config", str(config)])
    assert result.exit_code == 1, result.output
    assert (
        "[gateway] port: 'eight' is not a port number; give 1-65535, or 0 for any free port" in result.output
    )
