"""engines.formats: a model's format read from its files, and the engine that serves it."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from engines import kinds
from engines.formats import (
    FormatError,
    check_model,
    context_length,
    describe,
    detect_format,
    is_hub_repo_id,
    newest_engine,
    pick_engine,
    vocab_size,
)
from engines.spec import available, load


def mlx_dir(
    root: Path, config: object | None = None, weights: tuple[str, ...] = ("model.safetensors",)
) -> Path:
    model = root / "Qwen2-0.5B-4bit"
    model.mkdir()
    doc = {"model_type": "qwen2", "quantization": {"group_size": 64, "bits": 4}} if config is None else config
    (model / "config.json").write_text(json.dumps(doc))
    for name in weights:
        (model / name).write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    return model


def gguf_file(root: Path, name: str = "tiny.gguf", head: bytes = b"GGUF\x03\x00\x00\x00") -> Path:
    path = root / name
    path.write_bytes(head + bytes(24))
    return path


def test_mlx_directory_is_mlx(tmp_path: Path) -> None:
    """A directory with config.json and sharded *.safetensors is an MLX model."""
    model = mlx_dir(
        tmp_path, weights=("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
    )
    assert detect_format(model) == "mlx"
    assert detect_format(str(model)) == "mlx"


def test_gguf_file_is_gguf_by_its_magic(tmp_path: Path) -> None:
    """A file starting with the GGUF magic is GGUF, whatever its name."""
    assert detect_format(gguf_file(tmp_path)) == "gguf"
    assert detect_format(gguf_file(tmp_path, "model.bin")) == "gguf"


def test_gguf_name_without_the_magic_is_rejected(tmp_path: Path) -> None:
    """A .gguf file that does not start with GGUF is an error that names the path and the bytes found."""
    path = gguf_file(tmp_path, head=b"<htm")
    with pytest.raises(FormatError, match="does not start with the GGUF magic") as info:
        detect_format(path)
    assert str(path) in str(info.value) and "<htm" in str(info.value)


def test_empty_file_is_rejected(tmp_path: Path) -> None:
    """An empty .gguf (an interrupted download) is not taken for a model."""
    path = tmp_path / "partial.gguf"
    path.write_bytes(b"")
    with pytest.raises(FormatError, match="GGUF magic"):
        detect_format(path)


def test_directory_without_weights_is_rejected(tmp_path: Path) -> None:
    """config.json alone is not an MLX model: the error says the weights are missing and lists the files."""
    model = mlx_dir(tmp_path, weights=())
    with pytest.raises(FormatError, match=r"no \*\.safetensors weights \(found: config\.json\)"):
        detect_format(model)


def test_directory_without_config_is_rejected(tmp_path: Path) -> None:
    """Weights without config.json are not an MLX model: the error names config.json."""
    model = tmp_path / "weights-only"
    model.mkdir()
    (model / "model.safetensors").write_bytes(b"x")
    with pytest.raises(FormatError, match=r"no config\.json") as info:
        detect_format(model)
    assert str(model) in str(info.value)


def test_directory_of_gguf_files_asks_for_the_file(tmp_path: Path) -> None:
    """A directory holding GGUF files says to give the file itself, naming it."""
    gguf_file(tmp_path, "q4.gguf")
    with pytest.raises(FormatError, match=r"give the \.gguf file itself") as info:
        detect_format(tmp_path)
    assert "q4.gguf" in str(info.value)


def test_config_that_is_not_an_object_is_rejected(tmp_path: Path) -> None:
    """A config.json that is JSON but not an object is not an MLX model."""
    with pytest.raises(FormatError, match="not a JSON object"):
        detect_format(mlx_dir(tmp_path, config=["qwen2"]))


def test_missing_path_and_weights_file_are_rejected(tmp_path: Path) -> None:
    """A missing path, and a lone .safetensors file, get errors that say what to give instead."""
    with pytest.raises(FormatError, match="does not exist"):
        detect_format(tmp_path / "nope.gguf")
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"\x08\x00")
    with pytest.raises(FormatError, match="give the MLX model directory"):
        detect_format(weights)


def test_describe_notes_the_evidence(tmp_path: Path) -> None:
    """describe() names the format, the model type and the quantization found in config.json."""
    assert describe(mlx_dir(tmp_path)) == "Qwen2-0.5B-4bit: MLX directory, model_type qwen2, 4-bit quantized"
    assert describe(gguf_file(tmp_path)).startswith("tiny.gguf: GGUF file (")


def test_pick_engine_maps_each_format_to_its_shipped_engine(tmp_path: Path) -> None:
    """A GGUF file picks the llama.cpp engine and an MLX directory the mlx one, among the shipped specs."""
    gguf_engine = pick_engine(gguf_file(tmp_path))
    mlx_engine = pick_engine(mlx_dir(tmp_path))
    assert load(gguf_engine).kind == "llamacpp" and "gguf" in load(gguf_engine).model_formats
    assert load(mlx_engine).kind == "mlx"
    assert {gguf_engine, mlx_engine} <= set(available())


def test_newest_engine_compares_versions_as_numbers() -> None:
    """Among one kind's versions serving the format, the highest wins, compared as numbers."""
    base = load("llamacpp-b11434")
    candidates = [
        replace(base, name=f"llamacpp-{version}", version=version) for version in ("b9093", "b11434", "b999")
    ]
    assert newest_engine("gguf", [load("mlx-0.32.0"), *candidates]) == "llamacpp-b11434"
    assert newest_engine("mlx", [load("mlx-0.32.0"), *candidates]) == "mlx-0.32.0"
    mlx = load("mlx-0.32.0")
    older = [
        replace(mlx, name=f"mlx-{version}", version=version) for version in ("0.3.9", "0.3.36", "0.2.90")
    ]
    assert newest_engine("mlx", older) == "mlx-0.3.36"


def test_newest_engine_picks_the_kind_first_then_the_version_within_it() -> None:
    """Two kinds serving a format: the first in engines.kinds.KINDS wins, whatever the other's numbers."""
    assert list(kinds.KINDS)[:2] == ["mlx", "llamacpp"]
    mlx = replace(load("mlx-0.32.0"), model_formats=("mlx", "gguf"))
    llamacpp = load("llamacpp-b11434")  # 11434 > 0.32.0 as numbers, but another scale
    assert newest_engine("gguf", [llamacpp, mlx]) == "mlx-0.32.0"
    newer_mlx = replace(mlx, name="mlx-0.33.1", version="0.33.1")
    assert newest_engine("gguf", [llamacpp, mlx, newer_mlx]) == "mlx-0.33.1"


def test_no_serving_engine_names_the_format_and_the_engines() -> None:
    """When no engine serves the format, the error names the format and the engines looked at."""
    with pytest.raises(FormatError, match=r"no engine serves gguf models; engines looked at: mlx-0\.32\.0"):
        newest_engine("gguf", [load("mlx-0.32.0")])


@pytest.mark.parametrize(
    "value",
    [
        "org/name",
        "mlx-community/Qwen2.5-0.5B-Instruct-4bit",
        "HuggingFaceTB/SmolLM2-135M-Instruct",
        "models/x",
    ],
)
def test_org_slash_name_is_shaped_like_a_hub_repo_id(value: str) -> None:
    """Exactly one slash with a name on each side is the shape of a hub repo id."""
    assert is_hub_repo_id(value)


@pytest.mark.parametrize(
    "value",
    [
        "x",
        "./x",
        "../x",
        "~/x",
        "~user/x",
        "/x",
        "/org/name",
        "x.gguf",
        "org/m.gguf",
        "org/m.safetensors",
        "a/b/c",
        "org/",
        "/name",
        ".org/name",
        "org/.name",
        "org/..",
        "o rg/name",
        "builtin:tiny",
        "",
    ],
)
def test_paths_are_not_shaped_like_hub_repo_ids(value: str) -> None:
    """What starts like a path (~, ., /), has two slashes, a file suffix or odd characters is no hub id."""
    assert not is_hub_repo_id(value)


def test_a_missing_relative_path_does_not_exist_as_resolved(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A relative path naming nothing: "does not exist", the path resolved, and what the engine takes."""
    monkeypatch.chdir(tmp_path)
    for value in ("./nope", "nope", "x.gguf", "../nope/model"):
        with pytest.raises(FormatError, match="does not exist") as info:
            check_model(value, load("mlx-0.32.0"))
        assert str((tmp_path / value).resolve()) in str(info.value)
        assert "MLX model directory, or a hub repo id (org/name)" in str(info.value)


def test_a_hub_shaped_name_goes_to_the_hub_only_for_an_engine_that_downloads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """org/name is a hub repo for mlx; llama.cpp and auto need a local file, so for them it does not exist."""
    monkeypatch.chdir(tmp_path)
    assert check_model("org/name", load("mlx-0.32.0")) == "hub"
    with pytest.raises(
        FormatError, match=r"does not exist; llamacpp-b11434 serves a GGUF file \(it downloads"
    ):
        check_model("org/name", load("llamacpp-b11434"))
    with pytest.raises(FormatError, match="does not exist; engine auto picks"):
        check_model("org/name", None)


def test_a_hub_shaped_path_under_an_existing_directory_is_a_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """models/x where models/ is a local directory is a mistyped path, not a hub repo."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models").mkdir()
    with pytest.raises(FormatError, match="does not exist"):
        check_model("models/x", load("mlx-0.32.0"))


def test_a_model_in_another_format_names_the_engine_that_serves_it(tmp_path: Path) -> None:
    """A GGUF file for the mlx engine (and an MLX directory for llama.cpp) says which engine serves it."""
    with pytest.raises(
        FormatError, match=r"is a GGUF file; mlx-0\.32\.0 serves an MLX model directory"
    ) as info:
        check_model(str(gguf_file(tmp_path)), load("mlx-0.32.0"))
    assert "engine llamacpp-b11434, or auto, serves it" in str(info.value)
    with pytest.raises(FormatError, match=r"is an MLX model directory; llamacpp-b11434 serves a GGUF file"):
        check_model(str(mlx_dir(tmp_path)), load("llamacpp-b11434"))


def test_a_file_in_no_known_format_says_what_the_engine_takes(tmp_path: Path) -> None:
    """notes.txt for llama.cpp: not a GGUF file, and the engine serves a GGUF file."""
    notes = tmp_path / "notes.txt"
    notes.write_text("hello")
    with pytest.raises(FormatError, match=r"not a GGUF file .*; llamacpp-b11434 serves a GGUF file"):
        check_model(str(notes), load("llamacpp-b11434"))


def test_models_in_the_engines_format_pass(tmp_path: Path) -> None:
    """An MLX directory for mlx, a GGUF file for llama.cpp, and either for auto, are what they are."""
    assert check_model(str(mlx_dir(tmp_path)), load("mlx-0.32.0")) == "mlx"
    assert check_model(str(gguf_file(tmp_path)), load("llamacpp-b11434")) == "gguf"
    assert check_model(str(gguf_file(tmp_path)), None) == "gguf"


def test_vocab_size_is_read_from_an_mlx_directory_s_config(tmp_path: Path) -> None:
    """config.json's vocab_size (or text_config's) is the model's; anything else is unknown (None)."""
    (tmp_path / "config.json").write_text('{"model_type": "qwen2", "vocab_size": 259}')
    assert vocab_size(tmp_path) == 259
    (tmp_path / "config.json").write_text('{"text_config": {"vocab_size": 32000}}')
    assert vocab_size(tmp_path) == 32000
    for text in ('{"vocab_size": "259"}', "[259]", "not json", '{"vocab_size": true}'):
        (tmp_path / "config.json").write_text(text)
        assert vocab_size(tmp_path) is None, text
    assert vocab_size(tmp_path / "absent") is None
    assert vocab_size("org/repo") is None


def test_context_length_is_read_from_an_mlx_directory_s_config(tmp_path: Path) -> None:
    """config.json's max_position_embeddings (or text_config's) is the model's context; else None."""
    (tmp_path / "config.json").write_text('{"vocab_size": 259, "max_position_embeddings": 32768}')
    assert context_length(tmp_path) == 32768
    (tmp_path / "config.json").write_text('{"text_config": {"max_position_embeddings": 8192}}')
    assert context_length(tmp_path) == 8192
    for text in ('{"max_position_embeddings": 0}', '{"vocab_size": 259}', "not json"):
        (tmp_path / "config.json").write_text(text)
        assert context_length(tmp_path) is None, text
    assert context_length("org/repo") is None
