"""engines.formats: a model's format read from its files, and the engine that serves it."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from engines.formats import FormatError, describe, detect_format, newest_engine, pick_engine
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
    """Among engines serving the format, the highest version wins, compared as numbers (0.3.36 > 0.3.9)."""
    base = load("llamacpp-0.3.36")
    candidates = [
        replace(base, name=f"llamacpp-{version}", version=version)
        for version in ("0.3.9", "0.3.36", "0.2.90")
    ]
    assert newest_engine("gguf", [load("mlx-0.32.0"), *candidates]) == "llamacpp-0.3.36"
    assert newest_engine("mlx", [load("mlx-0.32.0"), *candidates]) == "mlx-0.32.0"


def test_no_serving_engine_names_the_format_and_the_engines() -> None:
    """When no engine serves the format, the error names the format and the engines looked at."""
    with pytest.raises(FormatError, match=r"no engine serves gguf models; engines looked at: mlx-0\.32\.0"):
        newest_engine("gguf", [load("mlx-0.32.0")])
