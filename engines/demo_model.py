"""Write a small random-weight Qwen2 model in MLX format, for tests and benchmarks.

No model hub is reachable where this project is built and tested, so the gateway makes
its own model. This file is run as a script by path with an engine venv's interpreter:

    <engine-venv>/bin/python engines/demo_model.py --out DIR --preset tiny [--seed N]

There it may use only the standard library and what mlx-lm installs (numpy, tokenizers);
it imports nothing from this repository. The gateway imports it too, for its constants,
from a venv without numpy or tokenizers: those imports stay inside functions.

What it writes, into DIR, atomically and byte for byte the same for the same seed:
``config.json``, ``generation_config.json``, ``model.safetensors`` (float32, the names
``mlx_lm.models.qwen2`` loads with ``tie_word_embeddings`` false), ``tokenizer.json``,
``tokenizer_config.json`` (ChatML template, EOS ``<|im_end|>``), ``special_tokens_map.json``
and a marker, ``blazar_demo_model.json``, written last.

The tokenizer is byte-level BPE without merges (one token per byte, token id == byte
value) plus ``<|endoftext|>``, ``<|im_start|>`` and ``<|im_end|>``. Any text in NFC
round-trips; other text comes back in NFC, as with the real Qwen2 tokenizer (transformers'
``Qwen2Tokenizer`` adds an NFC normaliser whatever tokenizer.json says).

Random weights would emit EOS at random and end replies before ``max_tokens``. So only
printable ASCII and newline have non-zero rows in ``lm_head``; every other row (the
special tokens included) is zero and its logit is exactly 0. The hidden state reaching
``lm_head`` has RMS 1 (final norm weights are 1), and ``lm_head`` is independent of it, so
the logits of the emittable tokens are close to i.i.d. normal with a standard deviation
of ``_LOGIT_STD`` (16); their maximum is far above 0, and a special token is sampled
with a probability of about 1e-12 a token at temperature 1 (1e-7 at temperature 2).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import struct
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

if TYPE_CHECKING:
    from collections.abc import Sequence

    import numpy as np  # type: ignore[import-not-found,unused-ignore]

# Bump whenever the files written for a given preset and seed change.
GENERATOR_VERSION: Final = 1

# Shapes of the presets, measured with mlx-cpu 0.32.2 on two cores at batch 1. "tiny" is
# what the test suite serves: it loads in 10 ms and decodes at ~750 tok/s (1.3 ms a token).
# "bench" decodes at ~250 tok/s (4 ms a token), a stand-in for a real engine in benchmarks;
# its decode time grows with layers more than with width on a CPU (per-op overhead).
PRESETS: Final[dict[str, dict[str, int]]] = {
    "tiny": {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
    },
    "bench": {
        "hidden_size": 256,
        "intermediate_size": 768,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
    },
}

MARKER_NAME: Final = "blazar_demo_model.json"

_SPECIAL_TOKENS: Final = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
_VOCAB_SIZE: Final = 256 + len(_SPECIAL_TOKENS)
_ENDOFTEXT_ID: Final = 256
_IM_END_ID: Final = 258

# Large enough that a zero logit is never sampled (see the module docstring), small
# enough that temperature still changes what is sampled.
_LOGIT_STD: Final = 16.0
_BIAS_SCALE: Final = 0.1

# The Qwen2 ChatML template, less tools and the default system prompt. Content may be a
# string, None or a list of text parts (mlx_lm.server flattens those; other callers may not).
_CHAT_TEMPLATE: Final = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- elif message['content'] %}"
    "{%- for part in message['content'] %}{%- if part['type'] == 'text' %}{{- part['text'] }}{%- endif %}"
    "{%- endfor %}"
    "{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Qwen2's pre-tokenizer split; without merges it changes no token, only keeps the
# tokenizer looking like the real thing.
_PRETOKENIZE_REGEX: Final = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def demo_model_dir_name(preset: str) -> str:
    """Return the directory name of the demo model for ``preset``, e.g. blazar-demo-qwen2-tiny."""
    if preset not in PRESETS:
        raise ValueError(f"unknown demo model preset {preset!r}; known: {', '.join(PRESETS)}")
    return f"blazar-demo-qwen2-{preset}"


def _config(preset: str) -> dict[str, Any]:
    shape = PRESETS[preset]
    return {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        **shape,
        "vocab_size": _VOCAB_SIZE,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "max_position_embeddings": 32768,
        "tie_word_embeddings": False,
        "use_sliding_window": False,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "bos_token_id": None,
        "eos_token_id": _IM_END_ID,
    }


def _uniform(bits: np.random.PCG64, shape: tuple[int, ...], std: float) -> np.ndarray[Any, Any]:
    """Draw float32 uniform noise with the given standard deviation.

    Built from the raw 64-bit stream, which numpy keeps stable across releases (NEP 19),
    unlike its distribution methods: the weights stay byte-identical on any numpy.
    """
    import numpy as np

    count = 1
    for dim in shape:
        count *= dim
    raw = bits.random_raw(count)
    # The top 24 bits give a float32-exact value in [0, 1); centre it, scale to std.
    unit = (raw >> np.uint64(40)).astype(np.float32) * np.float32(2.0**-24) - np.float32(0.5)
    return (unit * np.float32(std * 12.0**0.5)).reshape(shape)


def _weights(preset: str, seed: int) -> dict[str, np.ndarray[Any, Any]]:
    """Return the weights, named as mlx_lm.models.qwen2 loads them (Linear is [out, in])."""
    import numpy as np

    shape = PRESETS[preset]
    hidden = shape["hidden_size"]
    inter = shape["intermediate_size"]
    heads = shape["num_attention_heads"]
    kv_dim = shape["num_key_value_heads"] * (hidden // heads)
    bits = np.random.PCG64(seed)
    ones = np.ones(hidden, dtype=np.float32)

    weights: dict[str, np.ndarray[Any, Any]] = {
        "model.embed_tokens.weight": _uniform(bits, (_VOCAB_SIZE, hidden), 1.0),
    }
    for i in range(shape["num_hidden_layers"]):
        p = f"model.layers.{i}."
        weights[p + "input_layernorm.weight"] = ones
        weights[p + "post_attention_layernorm.weight"] = ones
        for name, out_dim in (("q_proj", hidden), ("k_proj", kv_dim), ("v_proj", kv_dim)):
            weights[p + f"self_attn.{name}.weight"] = _uniform(bits, (out_dim, hidden), hidden**-0.5)
            weights[p + f"self_attn.{name}.bias"] = _uniform(bits, (out_dim,), _BIAS_SCALE)
        weights[p + "self_attn.o_proj.weight"] = _uniform(bits, (hidden, hidden), hidden**-0.5)
        weights[p + "mlp.gate_proj.weight"] = _uniform(bits, (inter, hidden), hidden**-0.5)
        weights[p + "mlp.up_proj.weight"] = _uniform(bits, (inter, hidden), hidden**-0.5)
        weights[p + "mlp.down_proj.weight"] = _uniform(bits, (hidden, inter), inter**-0.5)
    weights["model.norm.weight"] = ones

    lm_head = _uniform(bits, (_VOCAB_SIZE, hidden), _LOGIT_STD * hidden**-0.5)
    emittable = np.zeros(_VOCAB_SIZE, dtype=bool)
    emittable[0x20:0x7F] = True
    emittable[ord("\n")] = True
    lm_head[~emittable] = 0.0
    weights["lm_head.weight"] = lm_head
    return weights


def _safetensors(weights: dict[str, np.ndarray[Any, Any]]) -> bytes:
    """Serialise float32 tensors in the safetensors format, keys and data in sorted order."""
    header: dict[str, Any] = {"__metadata__": {"format": "mlx"}}
    chunks: list[bytes] = []
    offset = 0
    for name in sorted(weights):
        data = weights[name].astype("<f4").tobytes()
        header[name] = {
            "dtype": "F32",
            "shape": list(weights[name].shape),
            "data_offsets": [offset, offset + len(data)],
        }
        chunks.append(data)
        offset += len(data)
    header_bytes = json.dumps(header, separators=(",", ":")).encode()
    header_bytes += b" " * (-len(header_bytes) % 8)  # keeps the tensor data 8-byte aligned
    return struct.pack("<Q", len(header_bytes)) + header_bytes + b"".join(chunks)


def _tokenizer_json() -> str:
    """Build the byte-level BPE tokenizer with the tokenizers library and serialise it."""
    from tokenizers import (  # type: ignore[import-not-found,unused-ignore]
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
    )

    symbols = _byte_symbols()
    if set(symbols) != set(pre_tokenizers.ByteLevel.alphabet()):
        raise RuntimeError("tokenizers' byte-level alphabet is not GPT-2's")
    vocab = {symbol: byte for byte, symbol in enumerate(symbols)}
    tokenizer = Tokenizer(
        models.BPE(vocab=vocab, merges=[], unk_token=None, fuse_unk=False, byte_fallback=False)
    )
    # transformers' Qwen2Tokenizer normalises to NFC whatever tokenizer.json says; say the
    # same here so that both views of this tokenizer agree.
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in _SPECIAL_TOKENS])
    return str(tokenizer.to_str(pretty=True)) + "\n"


def _byte_symbols() -> list[str]:
    """Return the GPT-2 byte-level symbol of each byte, in byte order (token id == byte)."""
    printable = {
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    }
    symbols: list[str] = []
    shifted = 0
    for byte in range(256):
        if byte in printable:
            symbols.append(chr(byte))
        else:
            symbols.append(chr(256 + shifted))
            shifted += 1
    return symbols


def _tokenizer_config() -> dict[str, Any]:
    return {
        "tokenizer_class": "Qwen2Tokenizer",
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": {
            str(256 + i): {
                "content": token,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": True,
            }
            for i, token in enumerate(_SPECIAL_TOKENS)
        },
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "bos_token": None,
        "chat_template": _CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": 32768,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "unk_token": None,
    }


def _special_tokens_map() -> dict[str, Any]:
    return {
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
    }


def _generation_config() -> dict[str, Any]:
    return {"eos_token_id": [_IM_END_ID, _ENDOFTEXT_ID], "pad_token_id": _ENDOFTEXT_ID, "bos_token_id": None}


def _json(obj: Any) -> bytes:
    return (json.dumps(obj, indent=2, ensure_ascii=False) + "\n").encode()


def _marker(preset: str, seed: int) -> dict[str, Any]:
    return {"generator_version": GENERATOR_VERSION, "preset": preset, "seed": seed}


def is_current(out: Path, preset: str, seed: int) -> bool:
    """Tell whether ``out`` already holds this generator's model for ``preset`` and ``seed``."""
    try:
        marker = json.loads((out / MARKER_NAME).read_text())
    except (OSError, ValueError):
        return False
    if not isinstance(marker, dict):
        return False
    files = marker.get("files", {})
    return (
        {k: marker.get(k) for k in ("generator_version", "preset", "seed")} == _marker(preset, seed)
        and isinstance(files, dict)
        and all((out / name).is_file() for name in files)
    )


def _files(preset: str, seed: int) -> dict[str, bytes]:
    return {
        "config.json": _json(_config(preset)),
        "generation_config.json": _json(_generation_config()),
        "model.safetensors": _safetensors(_weights(preset, seed)),
        "tokenizer.json": _tokenizer_json().encode(),
        "tokenizer_config.json": _json(_tokenizer_config()),
        "special_tokens_map.json": _json(_special_tokens_map()),
    }


def write_demo_model(out: Path, preset: str, seed: int = 0) -> bool:
    """Write the model into ``out`` unless it is already there; return whether it wrote."""
    demo_model_dir_name(preset)  # validates the preset
    if is_current(out, preset, seed):
        print(f"demo model: {out} is current (preset {preset}, seed {seed})", file=sys.stderr)
        return False
    out.parent.mkdir(parents=True, exist_ok=True)
    build = Path(tempfile.mkdtemp(prefix=f".{out.name}.build-", dir=out.parent))
    try:
        build.chmod(0o755)  # mkdtemp makes it 0o700
        hashes: dict[str, str] = {}
        for name, data in _files(preset, seed).items():
            _write(build / name, data)
            hashes[name] = hashlib.sha256(data).hexdigest()
            print(f"demo model: wrote {name} ({len(data)} bytes)", file=sys.stderr)
        # Written last: its presence says the directory is complete.
        _write(build / MARKER_NAME, _json({**_marker(preset, seed), "files": hashes}))
        _swap_in(build, out, preset, seed)
    finally:
        shutil.rmtree(build, ignore_errors=True)
    print(f"demo model: {out} ready (preset {preset}, seed {seed})", file=sys.stderr)
    return True


def _write(path: Path, data: bytes) -> None:
    # Synced before the rename, so that a crash cannot leave a complete-looking
    # directory holding truncated files.
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _swap_in(build: Path, out: Path, preset: str, seed: int) -> None:
    """Rename ``build`` to ``out``, moving aside whatever stale directory is there."""
    try:
        os.rename(build, out)
        return
    except OSError:
        if not out.exists():
            raise
    if is_current(out, preset, seed):
        return  # another writer got there first with the same model
    stale = Path(tempfile.mkdtemp(prefix=f".{out.name}.stale-", dir=out.parent))
    try:
        os.rename(out, stale / out.name)
        os.rename(build, out)
    finally:
        shutil.rmtree(stale, ignore_errors=True)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--out", type=Path, required=True, help="the model directory to write")
    parser.add_argument("--preset", choices=sorted(PRESETS), required=True)
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights (default 0)")
    args = parser.parse_args(argv)
    if args.seed < 0:
        parser.error("--seed must be >= 0")
    write_demo_model(args.out, args.preset, args.seed)
    return 0


if __name__ == "__main__":
    # Run by path, Python puts engines/ first on sys.path, where a gateway module could
    # shadow a package that numpy or tokenizers import; this script needs nothing there.
    if sys.path and Path(sys.path[0] or ".").resolve() == Path(__file__).resolve().parent:
        del sys.path[0]
    sys.exit(main())
