"""Convert a llama-architecture GGUF file into an MLX model directory, without loss.

Made for the built-in model (SmolLM2-135M-Instruct, Q4_1 with a Q8_0 embedding):
mlx_lm.server cannot read GGUF, llama.cpp serves the file as it is. This file is run
as a script by path with an mlx engine venv's interpreter:

    <engine-venv>/bin/python engines/gguf_to_mlx.py --gguf FILE.gguf --out DIR

There it may use only the standard library and what mlx-lm installs (mlx, tokenizers);
it imports nothing from this repository. The gateway imports it too, for its constants
and ``is_current``, from a venv without mlx: those imports stay inside functions.

Why it is lossless and takes a second or two: mlx's ``mx.load(path,
return_metadata=True)`` reads GGUF and returns Q4_0, Q4_1 and Q8_0 tensors already
packed as mlx affine quantized weights (uint32 weight, float16 scales and biases,
group size 32), which ``nn.QuantizedLinear`` and ``nn.QuantizedEmbedding`` take as
they are. What is left to do:

- rename llama.cpp's tensors to the Hugging Face Llama names mlx_lm loads;
- undo the row permutation llama.cpp's converter applies to the Q and K projections
  (its rotary embedding pairs neighbouring rows, Hugging Face's pairs the two halves
  of each head): rows move, so weights, scales and biases move together;
- keep the norms float32, as the file has them: on mlx's CPU backend float16
  activations make a decode step ~30x slower;
- say which modules are quantized with which bits (the embedding is 8-bit, the rest
  4-bit) in config.json, in mlx-lm's per-layer form;
- rebuild the tokenizer from the metadata: GPT-2 style byte-level BPE, with the
  ``smollm`` pre-tokenizer (each digit alone, then GPT-2's byte-level split), and
  declare it ``PreTrainedTokenizerFast``: transformers 5 rebuilds the pre-tokenizer
  of a ``GPT2Tokenizer`` and drops the digit split.

What it writes, into DIR, atomically: ``config.json``, ``model.safetensors``,
``tokenizer.json``, ``tokenizer_config.json``, ``special_tokens_map.json``,
``generation_config.json``, and a marker, ``blazar_gguf_to_mlx.json`` (converter
version, the source file's name, size and sha256), written last.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, Protocol, TypeVar

if TYPE_CHECKING:
    from collections.abc import Sequence

# Bump whenever the files written for a given source change.
CONVERTER_VERSION: Final = 1
MARKER_NAME: Final = "blazar_gguf_to_mlx.json"
WEIGHTS_NAME: Final = "model.safetensors"

# llama.cpp's tensor names (blk.N.<name>) to Hugging Face Llama's (model.layers.N.<name>).
_BLOCK_NAMES: Final = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_NAMES: Final = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
# The parts of one tensor: an mlx quantized weight comes as three arrays.
_PARTS: Final = ("weight", "scales", "biases")
# mlx's GGUF reader packs Q4_0, Q4_1 and Q8_0 blocks of 32 values.
_GROUP_SIZE: Final = 32
# GGUF token types (gguf.TokenType).
_CONTROL: Final = 3
_USER_DEFINED: Final = 4


class _Rows(Protocol):
    """What ``unpermute_rows`` needs of an array: numpy's and mlx's both have it."""

    @property
    def shape(self) -> Any: ...

    def reshape(self, *shape: int) -> Any: ...

    def swapaxes(self, a: int, b: int) -> Any: ...


_A = TypeVar("_A", bound=_Rows)


def hf_name(gguf_name: str) -> str | None:
    """The Hugging Face Llama name of a llama.cpp tensor name, or None for one mlx_lm does not load."""
    base, _, part = gguf_name.rpartition(".")
    if part not in _PARTS:
        return None
    pieces = base.split(".")
    if len(pieces) == 3 and pieces[0] == "blk" and pieces[1].isdigit() and pieces[2] in _BLOCK_NAMES:
        return f"model.layers.{pieces[1]}.{_BLOCK_NAMES[pieces[2]]}.{part}"
    if base in _TOP_NAMES:
        return f"{_TOP_NAMES[base]}.{part}"
    return None


def unpermute_rows(rows: _A, n_head: int) -> _A:
    """Undo llama.cpp's rotary row permutation of a Q or K projection (rows are output features).

    llama.cpp's ``convert_hf_to_gguf.py`` stores ``w.reshape(n_head, 2, d // 2, ...)
    .swapaxes(1, 2)``: within each head, row ``i`` of the first half and row ``i`` of
    the second half become neighbours. This is the inverse. It applies unchanged to a
    quantized weight's scales and biases, whose rows are the weight's rows.
    """
    shape = tuple(rows.shape)
    head_dim = shape[0] // n_head
    if head_dim * n_head != shape[0] or head_dim % 2:
        raise ValueError(f"{shape[0]} rows do not split into {n_head} heads of an even size")
    split = rows.reshape(n_head, head_dim // 2, 2, *shape[1:]).swapaxes(1, 2)
    result: _A = split.reshape(*shape)
    return result


def quantization(weights: dict[str, Any]) -> dict[str, Any] | None:
    """mlx-lm's quantization section: the most common bits as the default, others per module."""
    bits_of: dict[str, int] = {}
    for name, array in weights.items():
        if name.endswith(".scales"):
            module = name.removesuffix(".scales")
            # uint32 words per group of the weight, times 32 bits, over the group size.
            bits_of[module] = weights[f"{module}.weight"].shape[-1] * 32 // (array.shape[-1] * _GROUP_SIZE)
    if not bits_of:
        return None
    default = Counter(bits_of.values()).most_common(1)[0][0]
    section: dict[str, Any] = {"group_size": _GROUP_SIZE, "bits": default, "mode": "affine"}
    for module in sorted(bits_of):
        if bits_of[module] != default:
            section[module] = {"group_size": _GROUP_SIZE, "bits": bits_of[module], "mode": "affine"}
    return section


def _scalar(meta: dict[str, Any], key: str) -> Any:
    value = meta[key]
    return value.item() if hasattr(value, "item") else value


def _short_float(value: float) -> float:
    """A float32 read from GGUF as the short decimal it was written from (9.99999974e-06 → 1e-05)."""
    return float(f"{value:.7g}")


def config(meta: dict[str, Any], weights: dict[str, Any]) -> dict[str, Any]:
    """config.json for mlx_lm.models.llama, from the GGUF metadata."""
    arch = _scalar(meta, "general.architecture")
    if arch != "llama":
        raise ValueError(f"the GGUF file's architecture is {arch!r}; only llama is converted")

    def get(key: str) -> Any:
        return _scalar(meta, f"llama.{key}")

    hidden, heads = int(get("embedding_length")), int(get("attention.head_count"))
    tokens = meta["tokenizer.ggml.tokens"]
    result: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length")),
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv")),
        "head_dim": hidden // heads,
        "rms_norm_eps": _short_float(float(get("attention.layer_norm_rms_epsilon"))),
        "rope_theta": _short_float(float(get("rope.freq_base"))),
        "max_position_embeddings": int(get("context_length")),
        "vocab_size": len(tokens),
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": "lm_head.weight" not in weights,
        "bos_token_id": int(_scalar(meta, "tokenizer.ggml.bos_token_id")),
        "eos_token_id": int(_scalar(meta, "tokenizer.ggml.eos_token_id")),
    }
    quantized = quantization(weights)
    if quantized is not None:
        result["quantization"] = quantized
        result["quantization_config"] = quantized
    return result


def convert_weights(raw: dict[str, Any], n_head: int, n_head_kv: int) -> dict[str, Any]:
    """Rename the tensors and undo the Q/K permutation; every tensor keeps its dtype."""
    weights: dict[str, Any] = {}
    for name, array in raw.items():
        target = hf_name(name)
        if target is None:
            raise ValueError(f"the GGUF file has a tensor {name!r} that a llama model does not load")
        if ".self_attn.q_proj." in target:
            array = unpermute_rows(array, n_head)
        elif ".self_attn.k_proj." in target:
            array = unpermute_rows(array, n_head_kv)
        weights[target] = array
    return weights


def _special_ids(meta: dict[str, Any]) -> list[int]:
    types = meta["tokenizer.ggml.token_type"].tolist()
    return [i for i, kind in enumerate(types) if kind in (_CONTROL, _USER_DEFINED)]


def tokenizer_json(meta: dict[str, Any]) -> str:
    """tokenizer.json for the GGUF's GPT-2 style BPE vocabulary and merges."""
    from tokenizers import (  # type: ignore[import-not-found,unused-ignore]
        AddedToken,
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        processors,
    )

    model, pre = _scalar(meta, "tokenizer.ggml.model"), _scalar(meta, "tokenizer.ggml.pre")
    if model != "gpt2":
        raise ValueError(f"the GGUF file's tokenizer is {model!r}; only gpt2 (byte-level BPE) is converted")
    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    merges = [tuple(merge.split(" ", 1)) for merge in meta["tokenizer.ggml.merges"]]
    tokenizer = Tokenizer(
        models.BPE(
            vocab={token: i for i, token in enumerate(tokens)},
            merges=merges,
            unk_token=None,
            fuse_unk=False,
            byte_fallback=False,
        )
    )
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "smollm":
        # llama.cpp's "smollm": \p{N} alone first, then GPT-2's split.
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level]
        )
    elif pre in ("gpt2", "default"):
        tokenizer.pre_tokenizer = byte_level
    else:
        raise ValueError(f"the GGUF file's pre-tokenizer {pre!r} is not one this converter knows")
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    tokenizer.add_special_tokens(
        [AddedToken(tokens[i], special=True, normalized=False) for i in _special_ids(meta)]
    )
    return str(tokenizer.to_str(pretty=True)) + "\n"


def tokenizer_config(meta: dict[str, Any]) -> dict[str, Any]:
    """tokenizer_config.json: the chat template and special tokens of the GGUF file."""
    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])

    def token(key: str) -> str | None:
        return tokens[int(_scalar(meta, key))] if key in meta else None

    bos, eos = token("tokenizer.ggml.bos_token_id"), token("tokenizer.ggml.eos_token_id")
    add_bos = "tokenizer.ggml.add_bos_token" in meta and bool(_scalar(meta, "tokenizer.ggml.add_bos_token"))
    result: dict[str, Any] = {
        # Not GPT2Tokenizer: transformers 5 would rebuild its pre-tokenizer without the digit split.
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": add_bos,
        "add_eos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": {
            str(i): {
                "content": tokens[i],
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": True,
            }
            for i in _special_ids(meta)
        },
        "additional_special_tokens": [t for t in (bos, eos) if t is not None],
        "bos_token": bos,
        "eos_token": eos,
        "pad_token": token("tokenizer.ggml.padding_token_id"),
        "unk_token": token("tokenizer.ggml.unknown_token_id"),
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(_scalar(meta, "llama.context_length")),
    }
    if "tokenizer.chat_template" in meta:
        result["chat_template"] = str(meta["tokenizer.chat_template"])
    return result


def _special_tokens_map(tok_config: dict[str, Any]) -> dict[str, Any]:
    keys = ("bos_token", "eos_token", "pad_token", "unk_token", "additional_special_tokens")
    return {key: tok_config[key] for key in keys if tok_config.get(key) is not None}


def _generation_config(model_config: dict[str, Any]) -> dict[str, Any]:
    return {"bos_token_id": model_config["bos_token_id"], "eos_token_id": model_config["eos_token_id"]}


def _json(obj: Any) -> bytes:
    return (json.dumps(obj, indent=2, ensure_ascii=False) + "\n").encode()


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def is_current(out: Path, source_sha256: str) -> bool:
    """Tell whether ``out`` holds this converter's output for the GGUF file with that sha256."""
    try:
        marker = json.loads((out / MARKER_NAME).read_text())
    except (OSError, ValueError):
        return False
    if not isinstance(marker, dict):
        return False
    files = marker.get("files")
    return (
        marker.get("converter_version") == CONVERTER_VERSION
        and marker.get("source_sha256") == source_sha256
        and isinstance(files, list)
        and all((out / str(name)).is_file() for name in files)
    )


def convert(gguf: Path, out: Path) -> bool:
    """Write the MLX directory for ``gguf`` into ``out`` unless it is already there; whether it wrote."""
    source_sha256 = sha256_file(gguf)
    if is_current(out, source_sha256):
        return False
    import mlx.core as mx  # type: ignore[import-not-found,unused-ignore]

    raw, meta = mx.load(str(gguf), return_metadata=True)
    heads = int(_scalar(meta, "llama.attention.head_count"))
    weights = convert_weights(raw, heads, int(_scalar(meta, "llama.attention.head_count_kv")))
    model_config = config(meta, weights)
    tok_config = tokenizer_config(meta)
    files = {
        "config.json": _json(model_config),
        "generation_config.json": _json(_generation_config(model_config)),
        "tokenizer.json": tokenizer_json(meta).encode(),
        "tokenizer_config.json": _json(tok_config),
        "special_tokens_map.json": _json(_special_tokens_map(tok_config)),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    build = Path(tempfile.mkdtemp(prefix=f".{out.name}.build-", dir=out.parent))
    try:
        build.chmod(0o755)  # mkdtemp makes it 0o700
        mx.save_safetensors(str(build / WEIGHTS_NAME), weights, metadata={"format": "mlx"})
        _sync(build / WEIGHTS_NAME)
        for name, data in files.items():
            _write(build / name, data)
        marker = {
            "converter_version": CONVERTER_VERSION,
            "source": gguf.name,
            "source_size": gguf.stat().st_size,
            "source_sha256": source_sha256,
            "files": [WEIGHTS_NAME, *files],
        }
        # Written last: its presence says the directory is complete.
        _write(build / MARKER_NAME, _json(marker))
        _swap_in(build, out, source_sha256)
    finally:
        shutil.rmtree(build, ignore_errors=True)
    return True


def _sync(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _write(path: Path, data: bytes) -> None:
    # Synced before the rename, so that a crash cannot leave a complete-looking
    # directory holding truncated files.
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _swap_in(build: Path, out: Path, source_sha256: str) -> None:
    """Rename ``build`` to ``out``, moving aside whatever stale directory is there."""
    try:
        os.rename(build, out)
        return
    except OSError:
        if not out.exists():
            raise
    if is_current(out, source_sha256):
        return  # another writer got there first with the same model
    stale = Path(tempfile.mkdtemp(prefix=f".{out.name}.stale-", dir=out.parent))
    try:
        os.rename(out, stale / out.name)
        os.rename(build, out)
    finally:
        shutil.rmtree(stale, ignore_errors=True)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--gguf", type=Path, required=True, help="the llama GGUF file to convert")
    parser.add_argument("--out", type=Path, required=True, help="the MLX model directory to write")
    args = parser.parse_args(argv)
    try:
        convert(args.gguf, args.out)
    except (OSError, ValueError, RuntimeError) as exc:  # RuntimeError: mlx cannot read the file
        print(f"gguf_to_mlx: {args.gguf}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    # Run by path, Python puts engines/ first on sys.path, where a gateway module could
    # shadow a package that mlx or tokenizers import; this script needs nothing there.
    if sys.path and Path(sys.path[0] or ".").resolve() == Path(__file__).resolve().parent:
        del sys.path[0]
    sys.exit(main())
