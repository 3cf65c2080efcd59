"""proxy.startup.configfile: the TOML file read into model settings, each error naming file, key, reason."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from proxy.startup.configfile import ConfigError, FileConfig, ModelConfig, check_names, load

UPSTREAM = "http://127.0.0.1:9/v1"


def check_gateway(key: str, value: Any) -> tuple[str, Any]:
    """A stand-in for the command line's check: knows port and max-loaded, rejects the rest."""
    name = key.replace("-", "_")
    if name not in ("port", "max_loaded"):
        raise ValueError("not a gateway setting")
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{value!r} is not a valid integer")
    return name, value


def load_text(tmp_path: Path, text: str) -> FileConfig:
    path = tmp_path / "blazar.toml"
    path.write_text(text, encoding="utf-8")
    return load(path, check_gateway)


def error_of(tmp_path: Path, text: str) -> str:
    """The ConfigError message for a file; it always starts with the file's path."""
    with pytest.raises(ConfigError) as caught:
        load_text(tmp_path, text)
    message = str(caught.value)
    assert message.startswith(f"{tmp_path / 'blazar.toml'}: "), message
    return message


def test_full_file_parses_into_model_configs(tmp_path: Path) -> None:
    """Every model key, in dash or underscore spelling, lands in its ModelConfig field."""
    config = load_text(
        tmp_path,
        f"""
        [gateway]
        port = 8001
        max-loaded = 2

        [models.qwen]
        engine = "mlx-0.32.0"
        model = "~/models/qwen-mlx"
        aliases = ["gpt-4o-mini", "qwen-latest"]
        replicas = 2
        engine-args = ["--max-tokens", "1024"]
        ttl = 600
        max-in-flight = 4
        variant = "cpu"

        [models.pinned]
        engine = "auto"
        model = "org/repo"
        engine_args = ["--trust-remote-code"]
        always_loaded = true
        max_in_flight = 1

        [models."org/remote"]
        upstream = "{UPSTREAM}"
        aliases = "remote"
        max-in-flight = 8
        """,
    )
    assert config.path == tmp_path / "blazar.toml"
    assert dict(config.gateway) == {"port": 8001, "max_loaded": 2}
    assert config.models == (
        ModelConfig(
            name="qwen",
            engine="mlx-0.32.0",
            model="~/models/qwen-mlx",
            aliases=("gpt-4o-mini", "qwen-latest"),
            replicas=2,
            engine_args=("--max-tokens", "1024"),
            ttl_s=600.0,
            max_in_flight=4,
            variant="cpu",
        ),
        ModelConfig(
            name="pinned",
            engine="auto",
            model="org/repo",
            engine_args=("--trust-remote-code",),
            always_loaded=True,
            max_in_flight=1,
        ),
        ModelConfig(name="org/remote", upstream=UPSTREAM, aliases=("remote",), max_in_flight=8),
    )


def test_empty_file_has_no_gateway_settings_and_no_models(tmp_path: Path) -> None:
    """An empty file is valid: no [gateway] settings, no models."""
    config = load_text(tmp_path, "")
    assert dict(config.gateway) == {} and config.models == ()


def test_engine_without_model_means_the_default_builtin_model(tmp_path: Path) -> None:
    """An engine given by version needs no model (the built-in SmolLM2); defaults fill the rest."""
    (config,) = load_text(tmp_path, '[models.demo]\nengine = "mlx-0.32.0"\n').models
    assert config == ModelConfig(name="demo", engine="mlx-0.32.0")
    assert (config.replicas, config.ttl_s, config.always_loaded, config.variant) == (1, 0.0, False, "auto")


def test_equal_files_give_equal_model_configs(tmp_path: Path) -> None:
    """Reading the same file twice gives equal ModelConfigs: what a reload compares to find changes."""
    text = f'[models.a]\nupstream = "{UPSTREAM}"\naliases = ["x"]\n[models.b]\nengine = "mlx-0.32.0"\n'
    assert load_text(tmp_path, text).models == load_text(tmp_path, text).models


def test_missing_file_names_it(tmp_path: Path) -> None:
    """A file that cannot be read is an error naming the path and why."""
    path = tmp_path / "absent.toml"
    with pytest.raises(ConfigError, match=r"absent\.toml: cannot read it: No such file"):
        load(path, check_gateway)


def test_invalid_toml_names_the_file_and_the_line(tmp_path: Path) -> None:
    """A TOML syntax error names the file and says where the syntax broke."""
    message = error_of(tmp_path, '[models.a]\nupstream = "http://h:1"\nreplicas = \n')
    assert "not valid TOML" in message and "line 3" in message


def test_file_that_is_not_utf8_is_a_config_error(tmp_path: Path) -> None:
    """Bytes that are not UTF-8 are a ConfigError naming the file, not a traceback."""
    path = tmp_path / "blazar.toml"
    path.write_bytes(b'[models.a]\nupstream = "http://h:1"\n# \xff\xfe\n')
    with pytest.raises(ConfigError, match="not valid TOML"):
        load(path, check_gateway)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("[model.a]\nupstream = 'http://h:1'\n", "unknown table 'model'"),
        ("port = 8000\n", "unknown table 'port'"),
        ("gateway = 5\n", "gateway: expected a table"),
        ("models = 5\n", "models: expected tables [models.NAME]"),
        ("[models]\na = 5\n", "[models.a]: expected a table of settings, got 5"),
    ],
)
def test_wrong_tables_are_named(tmp_path: Path, text: str, expected: str) -> None:
    """An unknown top-level table, or a table that is not one, is named with what the file should have."""
    assert expected in error_of(tmp_path, text)


@pytest.mark.parametrize(
    ("key", "hint"),
    [
        ("alias", "did you mean 'aliases'?"),
        ("upstreams", "did you mean 'upstream'?"),
        ("engine_arg", "did you mean 'engine-args'?"),
        ("always-load", "did you mean 'always-loaded'?"),
        ("colour", "known: engine, model, upstream, aliases"),
    ],
)
def test_unknown_model_key_suggests_the_right_one(tmp_path: Path, key: str, hint: str) -> None:
    """An unknown model key is named with its table and a did-you-mean (or the known keys)."""
    message = error_of(tmp_path, f'[models.a]\nupstream = "{UPSTREAM}"\n{key} = 1\n')
    assert f"[models.a] {key}: unknown key" in message
    assert hint in message


@pytest.mark.parametrize("body", ["aliases = ['x']\n", ""])
def test_a_model_needs_an_engine_or_an_upstream(tmp_path: Path, body: str) -> None:
    """A model with neither engine nor upstream is refused."""
    message = error_of(tmp_path, f"[models.a]\n{body}")
    assert "[models.a]: give engine (with model), or upstream" in message


def test_engine_beside_upstream_names_the_engine_that_server_runs(tmp_path: Path) -> None:
    """engine and upstream together: a model served by that server, with that engine's spec."""
    (model,) = load_text(tmp_path, f'[models.a]\nengine = "mlx-0.32.0"\nupstream = "{UPSTREAM}"\n').models
    assert (model.engine, model.upstream) == ("mlx-0.32.0", UPSTREAM)


def test_engine_auto_beside_upstream_is_refused(tmp_path: Path) -> None:
    """engine = "auto" picks from a model's files; beside an upstream there are none to look at."""
    message = error_of(tmp_path, f'[models.a]\nengine = "auto"\nupstream = "{UPSTREAM}"\n')
    assert '[models.a] engine: "auto" picks an engine' in message
    assert "name the engine the upstream runs" in message


@pytest.mark.parametrize(
    ("line", "key"),
    [
        ("replicas = 2", "replicas"),
        ("ttl = 60", "ttl"),
        ("engine-args = ['--x']", "engine"),
        ("always-loaded = true", "always"),
        ("model = 'org/repo'", "model"),
        ("variant = 'cpu'", "variant"),
    ],
)
def test_engine_only_keys_on_an_upstream(tmp_path: Path, line: str, key: str) -> None:
    """Keys that only mean something for an engine model are refused on an upstream, naming the key."""
    message = error_of(tmp_path, f'[models.remote]\nupstream = "{UPSTREAM}"\n{line}\n')
    assert f"[models.remote] {key}" in message
    assert "upstream" in message


@pytest.mark.parametrize("key", ["engine-args", "always-loaded"])
def test_engine_only_key_on_an_upstream_is_named_as_written(tmp_path: Path, key: str) -> None:
    """The error names the key as the file spells it, so that searching the file for it finds it."""
    value = "['--x']" if key == "engine-args" else "true"
    message = error_of(tmp_path, f'[models.remote]\nupstream = "{UPSTREAM}"\n{key} = {value}\n')
    assert f"[models.remote] {key}:" in message


@pytest.mark.parametrize(
    "url",
    ["https://h:1/v1", "http://h:0", "ftp://h", "http://user:pw@h:1", "http://:1", "not a url"],
)
def test_bad_upstream_url_names_the_key(tmp_path: Path, url: str) -> None:
    """An upstream URL that cannot be used is named with its model, key and the URL's problem."""
    message = error_of(tmp_path, f'[models.remote]\nupstream = "{url}"\n')
    assert "[models.remote] upstream: upstream URL" in message


@pytest.mark.parametrize(
    ("line", "key", "reason"),
    [
        ("replicas = 0", "replicas", "a whole number of at least 1, got 0"),
        ("replicas = true", "replicas", "a whole number of at least 1, got True"),
        ("replicas = 1.5", "replicas", "a whole number of at least 1, got 1.5"),
        ("max-in-flight = 0", "max-in-flight", "a whole number of at least 1, got 0"),
        ("ttl = -1", "ttl", "seconds (a number, 0 or more), got -1"),
        ("ttl = '10'", "ttl", "seconds (a number, 0 or more), got '10'"),
        ("aliases = [1, 2]", "aliases", "a list of non-empty strings, got [1, 2]"),
        ("aliases = ['ok', '']", "aliases", "a list of non-empty strings"),
        ("aliases = 5", "aliases", "a list of non-empty strings, got 5"),
        ("engine-args = '--x'", None, None),
        ("engine-args = [1]", "engine-args", "a list of non-empty strings, got [1]"),
        ("always-loaded = 'yes'", "always-loaded", "true or false, got 'yes'"),
        ("variant = 'rocm'", "variant", "one of auto, cpu, cuda12, cuda13, metal, got 'rocm'"),
        ("model = ''", "model", "a non-empty string, got ''"),
        ("model = 3", "model", "a non-empty string, got 3"),
    ],
)
def test_bad_types_name_the_key_and_what_was_expected(
    tmp_path: Path, line: str, key: str | None, reason: str | None
) -> None:
    """A value of the wrong type or range names the model, the key, what was expected and what came."""
    text = f'[models.m]\nengine = "mlx-0.32.0"\n{line}\n'
    if key is None:
        # One string where a list is expected is a list of one.
        (config,) = load_text(tmp_path, text).models
        assert config.engine_args == ("--x",)
        return
    assert reason is not None
    message = error_of(tmp_path, text)
    assert f"[models.m] {key}: expected {reason}" in message


def test_empty_engine_is_refused(tmp_path: Path) -> None:
    """engine = "" is not an engine."""
    message = error_of(tmp_path, '[models.m]\nengine = "  "\n')
    assert "[models.m] engine: expected a non-empty string, got '  '" in message


def test_ttl_nan_is_refused(tmp_path: Path) -> None:
    """ttl = nan (valid TOML) is not a number of seconds and is refused."""
    message = error_of(tmp_path, '[models.m]\nengine = "mlx-0.32.0"\nttl = nan\n')
    assert "[models.m] ttl" in message


def test_ttl_inf_is_accepted_as_never(tmp_path: Path) -> None:
    """ttl = inf is a number of seconds, 0 or more: the model is never unloaded for idleness."""
    (config,) = load_text(tmp_path, '[models.m]\nengine = "mlx-0.32.0"\nttl = inf\n').models
    assert math.isinf(config.ttl_s)


def test_auto_engine_needs_a_model(tmp_path: Path) -> None:
    """engine = "auto" picks the engine from the model, so a model is required."""
    message = error_of(tmp_path, '[models.m]\nengine = "auto"\n')
    assert '[models.m] engine: "auto" picks the engine from the model, so model is needed' in message


def test_always_loaded_with_ttl_is_a_contradiction(tmp_path: Path) -> None:
    """always-loaded with a ttl is refused naming ttl; with ttl = 0 it is fine."""
    message = error_of(tmp_path, '[models.m]\nengine = "mlx-0.32.0"\nalways-loaded = true\nttl = 60\n')
    assert "[models.m] ttl: an always-loaded model is never unloaded" in message
    (config,) = load_text(
        tmp_path, '[models.m]\nengine = "mlx-0.32.0"\nalways-loaded = true\nttl = 0\n'
    ).models
    assert config.always_loaded and config.ttl_s == 0


@pytest.mark.parametrize("name", [" padded", "", "trailing "])
def test_model_name_without_surrounding_spaces(tmp_path: Path, name: str) -> None:
    """A model name that is empty or has surrounding spaces is refused."""
    message = error_of(tmp_path, f'[models."{name}"]\nupstream = "{UPSTREAM}"\n')
    assert "a model name must be non-empty, without surrounding spaces" in message


@pytest.mark.parametrize(
    ("text", "name", "first", "second"),
    [
        (
            f'[models.a]\nupstream = "{UPSTREAM}"\naliases = ["x"]\n'
            f'[models.b]\nupstream = "{UPSTREAM}"\naliases = ["x"]\n',
            "x",
            "a",
            "b",
        ),
        (
            f'[models.a]\nupstream = "{UPSTREAM}"\n[models.b]\nupstream = "{UPSTREAM}"\naliases = ["a"]\n',
            "a",
            "a",
            "b",
        ),
        (
            f'[models.a]\nupstream = "{UPSTREAM}"\naliases = ["b"]\n[models.b]\nupstream = "{UPSTREAM}"\n',
            "b",
            "a",
            "b",
        ),
    ],
)
def test_a_name_or_alias_used_by_two_models(
    tmp_path: Path, text: str, name: str, first: str, second: str
) -> None:
    """The same name or alias on two models is refused, naming it and both models."""
    message = error_of(tmp_path, text)
    assert f"model name {name!r} is used by both {first!r} and {second!r}" in message


def test_check_names_skips_the_unnamed_command_line_engine_model() -> None:
    """check_names ignores a model without a name (the --engine one, named later after its directory)."""
    check_names((ModelConfig(name=None, engine="mlx-0.32.0"), ModelConfig(name="a", upstream=UPSTREAM)), "x")
    with pytest.raises(ConfigError, match=r"^where: model name 'a' is used by both 'a' and 'b'$"):
        check_names(
            (
                ModelConfig(name="a", upstream=UPSTREAM),
                ModelConfig(name="b", upstream=UPSTREAM, aliases=("a",)),
            ),
            "where",
        )


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ("prot = 1", "[gateway] prot: not a gateway setting"),
        ("port = 'abc'", "[gateway] port: 'abc' is not a valid integer"),
        ("max-loaded = true", "[gateway] max-loaded: True is not a valid integer"),
    ],
)
def test_gateway_key_the_callback_rejects(tmp_path: Path, line: str, expected: str) -> None:
    """A [gateway] entry the command line rejects is named as [gateway] KEY with the callback's reason."""
    assert expected in error_of(tmp_path, f"[gateway]\n{line}\n")


def test_gateway_entries_become_option_names(tmp_path: Path) -> None:
    """The callback's option names and values are what FileConfig.gateway holds."""
    config = load_text(tmp_path, "[gateway]\nmax-loaded = 3\nport = 0\n")
    assert dict(config.gateway) == {"max_loaded": 3, "port": 0}


def test_first_error_wins_even_after_a_good_model(tmp_path: Path) -> None:
    """A good model before a bad one does not make the file half-valid: load raises."""
    message = error_of(
        tmp_path,
        f'[models.good]\nupstream = "{UPSTREAM}"\n[models.bad]\nupstream = "{UPSTREAM}"\nreplicas = 3\n',
    )
    assert "[models.bad] replicas" in message


def test_a_list_of_upstream_urls_is_a_replica_set(tmp_path: Path) -> None:
    """upstream = [URL, …] keeps every URL, the first as upstream; one URL in a list is one server."""
    config = load_text(
        tmp_path, '[models.m]\nupstream = ["http://a:8000/v1", "http://b:8000"]\nengine = "mlx-0.32.0"\n'
    ).models[0]
    assert config.upstream == "http://a:8000/v1"
    assert config.upstreams == ("http://a:8000/v1", "http://b:8000")
    one = load_text(tmp_path, '[models.m]\nupstream = ["http://a:8000"]\n').models[0]
    assert (one.upstream, one.upstreams) == ("http://a:8000", ())


@pytest.mark.parametrize(
    ("value", "wanted"),
    [
        ("[]", "expected a URL or a list of URLs"),
        ("[1]", "expected a URL or a list of URLs"),
        ('["http://a:1", "http://a:1"]', "a URL is given twice"),
        ('["http://a:1", "ftp://b:2"]', "only http://"),
    ],
)
def test_a_bad_list_of_upstream_urls_is_refused(tmp_path: Path, value: str, wanted: str) -> None:
    """Each URL of a set is checked; an empty list, a non-string or a repeated URL is refused."""
    message = error_of(tmp_path, f"[models.m]\nupstream = {value}\n")
    assert "[models.m] upstream" in message and wanted in message


def test_replicas_beside_a_list_of_upstreams_is_still_refused(tmp_path: Path) -> None:
    """replicas is for engine children; a set of servers is a list of URLs, which the error shows."""
    message = error_of(tmp_path, '[models.m]\nupstream = ["http://a:1", "http://b:2"]\nreplicas = 2\n')
    assert "[models.m] replicas" in message and 'upstream = ["http://a:8000"' in message


def test_allow_fields_is_a_list_of_field_names(tmp_path: Path) -> None:
    """allow-fields (or allow_fields) reads into the model's allow_fields; a number is refused by key."""
    config = load_text(
        tmp_path, '[models.q]\nengine = "mlx-0.32.0"\nallow-fields = ["adapters", "draft_model"]\n'
    )
    assert config.models[0].allow_fields == ("adapters", "draft_model")
    assert "allow-fields: expected a list of non-empty strings" in error_of(
        tmp_path, '[models.q]\nengine = "mlx-0.32.0"\nallow-fields = 5\n'
    )


def test_max_tokens_and_native_apis_are_model_settings(tmp_path: Path) -> None:
    """max-tokens (a count) and native-apis (a list of known APIs) are read per model."""
    config = load_text(
        tmp_path,
        f'[models.a]\nupstream = "{UPSTREAM}"\nmax-tokens = 512\nnative-apis = ["messages", "responses"]\n',
    )
    (model,) = config.models
    assert model.max_tokens == 512 and model.native_apis == ("messages", "responses")


@pytest.mark.parametrize(
    ("setting", "expected"),
    [
        ("max-tokens = 0", "max-tokens: expected a whole number of at least 1, got 0"),
        ('max-tokens = "many"', "max-tokens: expected a whole number"),
        ('native-apis = ["chat"]', "native-apis: expected a list of the APIs the server serves itself"),
        ('native-apis = "messages"', "native-apis: expected a list"),
    ],
)
def test_bad_max_tokens_and_native_apis_are_named(tmp_path: Path, setting: str, expected: str) -> None:
    """A cap that is not a positive count, or an API the gateway does not know, names the key and why."""
    message = error_of(tmp_path, f'[models.a]\nupstream = "{UPSTREAM}"\n{setting}\n')
    assert expected in message
