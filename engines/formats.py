"""What format a model on disk is in, and which engine serves it (``engine = "auto"``).

Two formats are known: an MLX model directory (``config.json`` and
``*.safetensors``, what mlx_lm.server loads) and a GGUF file (what llama.cpp
loads). The evidence is read from the files, not guessed from names alone: a
``.gguf`` file must start with the GGUF magic, and a directory's config.json
must be a JSON object.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Literal

from engines import kinds
from engines import spec as specs
from engines.spec import EngineSpec

Format = Literal["mlx", "gguf"]

GGUF_MAGIC = b"GGUF"
# One side of a hub repo id (huggingface_hub's characters): starts with a
# letter or digit, so nothing a path starts with (~, ., /) passes.
_HUB_PART = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
# Names that are files, never hub repos.
_FILE_SUFFIXES = (".gguf", ".safetensors", ".json")
_FORMAT_NAMES = {"mlx": "an MLX model directory", "gguf": "a GGUF file"}


class FormatError(ValueError):
    """A path that is not a model in a known format; the message says what was found."""


def detect_format(path: str | Path) -> Format:
    """Return the format of the model at ``path``, or raise FormatError saying what is there."""
    model = Path(path).expanduser()
    if model.is_dir():
        return _directory_format(model)
    if model.is_file():
        return _file_format(model)
    if model.exists():
        raise FormatError(f"{model} is neither a file nor a directory")
    raise FormatError(f"{model} does not exist")


def vocab_size(path: str | Path) -> int | None:
    """The vocabulary size an MLX model directory's config.json declares; None where it is unknown.

    A token id a request names (logit_bias, top_k) must be below it:
    mlx_lm.server 0.32.0 writes the bias at that index unchecked, and past
    the end of the logits its process dies. GGUF files and hub repos are not
    read (None).
    """
    return _config_size(path, "vocab_size")


def context_length(path: str | Path) -> int | None:
    """The context length (max_position_embeddings) an MLX directory's config.json gives; None if unknown.

    A request's max_tokens may not exceed it (OpenAI answers 400 past a
    model's limit; mlx_lm.server takes any number and generates for it).
    """
    return _config_size(path, "max_position_embeddings")


def _config_size(path: str | Path, key: str) -> int | None:
    """A positive integer of config.json, at its top or in its text_config (multimodal models)."""
    config = Path(path).expanduser() / "config.json"
    try:
        data = json.loads(config.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict):
        return None
    for table in (data, data.get("text_config")):
        size = table.get(key) if isinstance(table, dict) else None
        if isinstance(size, int) and not isinstance(size, bool) and size > 0:
            return size
    return None


def is_hub_repo_id(value: str) -> bool:
    """Whether ``value`` is shaped like a hub repo id, ``org/name``, rather than like a path.

    Exactly one slash with a name on each side, neither starting with what a
    path starts with (``~``, ``.``, ``/``), and no file suffix (``x/m.gguf``).
    ``models/x`` has the shape: whether it is a path is for the caller to
    find out on disk (``check_model``).
    """
    org, slash, name = value.partition("/")
    if not slash or name.lower().endswith(_FILE_SUFFIXES):
        return False
    return all(_HUB_PART.fullmatch(part) and ".." not in part for part in (org, name))


def check_model(model: str, engine: EngineSpec | None) -> Format | Literal["hub"]:
    """What ``model`` is, checked before any engine is installed: ``mlx``, ``gguf`` or ``hub``.

    ``engine`` is the spec of the engine asked for (None: ``auto``, which
    picks one by the model's format). Raises ``FormatError`` saying what is
    wrong with ``model`` and what the engine takes instead.
    """
    try:
        path = Path(model).expanduser()
    except RuntimeError:
        raise FormatError(f"{model}: there is no such user's home directory") from None
    # mlx_lm.server downloads what is not a local path; llama-server serves a local file only.
    downloads = engine is not None and engine.model_field != "alias"
    if not path.exists():
        org = model.partition("/")[0]
        # An existing first part ("models/x" in a directory holding models/) is a mistyped path.
        if downloads and is_hub_repo_id(model) and not Path(org).is_dir():
            return "hub"
        raise FormatError(f"{path.resolve()} does not exist; {_takes(engine)}")
    try:
        found = detect_format(path)
    except FormatError as exc:
        raise FormatError(f"{exc}; {_takes(engine)}") from None
    if engine is not None and found not in engine.model_formats:
        others = [specs.load(name) for name in specs.available()]
        hint = ""
        with contextlib.suppress(FormatError):
            hint = f" (engine {newest_engine(found, others)}, or auto, serves it)"
        raise FormatError(
            f"{path} is {_FORMAT_NAMES[found]}; {engine.name} serves "
            f"{' or '.join(_FORMAT_NAMES.get(f, f'a {f} model') for f in engine.model_formats)}{hint}"
        )
    return found


def _takes(engine: EngineSpec | None) -> str:
    """What an engine takes as its model, for a "does not exist" message."""
    if engine is None:
        return "engine auto picks the engine by the format of a local MLX model directory or GGUF file"
    local = " or ".join(_FORMAT_NAMES.get(f, f"a {f} model") for f in engine.model_formats)
    if engine.model_field == "alias":
        return f"{engine.name} serves {local} (it downloads nothing)"
    return f"{engine.name} serves {local}, or a hub repo id (org/name) that it downloads"


def describe(path: str | Path) -> str:
    """One line of evidence for the format of ``path`` (for startup messages)."""
    model = Path(path).expanduser()
    kind = detect_format(model)
    if kind == "gguf":
        return f"{model.name}: GGUF file ({model.stat().st_size / 1e6:.1f} MB)"
    config = json.loads((model / "config.json").read_text(encoding="utf-8"))
    quantized = config.get("quantization") or config.get("quantization_config")
    bits = f", {quantized.get('bits')}-bit quantized" if isinstance(quantized, dict) else ""
    return f"{model.name}: MLX directory, model_type {config.get('model_type', '?')}{bits}"


def pick_engine(path: str | Path) -> str:
    """The name of the newest shipped engine version that serves the format of the model at ``path``."""
    kind = detect_format(path)
    try:
        return newest_engine(kind, [specs.load(name) for name in specs.available()])
    except FormatError as exc:
        raise FormatError(f"{Path(path)}: {exc}") from None


def newest_engine(kind: str, candidates: Iterable[EngineSpec]) -> str:
    """The newest version, of the first engine kind (``engines.kinds.KINDS``) that serves format ``kind``.

    Versions compare within a kind only: mlx-lm's numbers and llama.cpp's
    build numbers are not on one scale.
    """
    looked_at = list(candidates)
    serving = [spec for spec in looked_at if kind in spec.model_formats]
    if not serving:
        names = ", ".join(spec.name for spec in looked_at) or "none"
        raise FormatError(f"no engine serves {kind} models; engines looked at: {names}")
    order = list(kinds.KINDS)
    first = min(serving, key=lambda spec: order.index(spec.kind) if spec.kind in order else len(order)).kind
    same = [spec for spec in serving if spec.kind == first]
    version_key = kinds.KINDS.get(first, kinds.Kind(first)).version_key
    return max(same, key=lambda spec: (version_key(spec.version), spec.name)).name


def _directory_format(model: Path) -> Format:
    config = model / "config.json"
    weights = sorted(p.name for p in model.glob("*.safetensors"))
    ggufs = sorted(p.name for p in model.glob("*.gguf"))
    if config.is_file() and weights:
        try:
            doc = json.loads(config.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise FormatError(f"{model}: config.json is not readable JSON ({exc})") from None
        if not isinstance(doc, dict):
            raise FormatError(f"{model}: config.json is not a JSON object")
        return "mlx"
    found = ", ".join(sorted(p.name for p in model.iterdir())[:8]) or "nothing"
    if ggufs:
        raise FormatError(
            f"{model} is a directory holding GGUF files ({', '.join(ggufs)}): give the .gguf file itself"
        )
    missing = "config.json" if not config.is_file() else "*.safetensors weights"
    raise FormatError(f"{model} is not an MLX model directory: it has no {missing} (found: {found})")


def _file_format(model: Path) -> Format:
    try:
        with model.open("rb") as f:
            head = f.read(len(GGUF_MAGIC))
    except OSError as exc:
        raise FormatError(f"{model} cannot be read: {exc}") from None
    if head == GGUF_MAGIC:
        return "gguf"
    if model.suffix == ".gguf":
        raise FormatError(f"{model} is named .gguf but does not start with the GGUF magic (found {head!r})")
    if model.suffix == ".safetensors":
        raise FormatError(f"{model} is a weights file: give the MLX model directory that holds it")
    raise FormatError(f"{model} is not a GGUF file (it starts with {head!r}) nor an MLX model directory")
