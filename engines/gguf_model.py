"""Write a small random-weight llama model as one GGUF file, for tests and benchmarks.

The GGUF counterpart of ``demo_model.py`` (which writes an MLX directory): no model hub
is reachable where this project is built and tested, so the gateway makes its own model.
This file is run as a script by path with a llama.cpp engine venv's interpreter:

    <engine-venv>/bin/python engines/gguf_model.py --out FILE.gguf --preset tiny [--seed N]

There it may use only the standard library and what that venv installs (numpy, and
``gguf``, the writer from llama.cpp's own repository); it imports nothing from this
repository. The gateway imports it too, for its constants, from a venv without them:
those imports stay inside functions.

What it writes, atomically and byte for byte the same for the same preset and seed: a
``llama`` architecture model, all tensors float32, with its tokenizer in the metadata,
and ``blazar.generator_version``, ``blazar.preset`` and ``blazar.seed`` keys that tell a
later run the file is current.

The tokenizer is GPT-2 style byte-level BPE (``tokenizer.ggml.model = "gpt2"``, Qwen2's
pre-tokenizer): one token per byte (token id == byte value), a few merges (llama.cpp
refuses a BPE vocabulary without any), and the control tokens ``<|endoftext|>``,
``<|im_start|>`` and ``<|im_end|>`` (EOS). The chat template is ChatML, the same as the
MLX demo model's.

Random weights would emit EOS at random and end replies before ``max_tokens``. As in
``demo_model.py``, only printable ASCII and newline have non-zero rows in the output
matrix, so every other token (EOS, the merges) has a logit of exactly 0 while the
emittable ones are close to i.i.d. normal with a standard deviation of ``_LOGIT_STD``.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

if TYPE_CHECKING:
    from collections.abc import Sequence

    import numpy as np  # type: ignore[import-not-found,unused-ignore]

# Bump whenever the file written for a given preset and seed changes.
GENERATOR_VERSION: Final = 1

# The same shapes as demo_model.PRESETS: "tiny" is what the test suite serves.
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

CONTEXT_LENGTH: Final = 4096
SPECIAL_TOKENS: Final = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
ENDOFTEXT_ID: Final = 256
IM_END_ID: Final = 258
# Pairs of GPT-2 byte symbols ("Ġ" is the space); their merged tokens follow the specials.
MERGES: Final = ("Ġ t", "Ġ a", "h e", "i n", "t h", "e r")
VOCAB_SIZE: Final = 256 + len(SPECIAL_TOKENS) + len(MERGES)

_LOGIT_STD: Final = 16.0
# GGUF token types (gguf.TokenType): NORMAL and CONTROL.
_NORMAL: Final = 1
_CONTROL: Final = 3

CHAT_TEMPLATE: Final = (
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


def demo_model_file_name(preset: str) -> str:
    """Return the file name of the GGUF demo model for ``preset``, e.g. blazar-demo-llama-tiny.gguf."""
    if preset not in PRESETS:
        raise ValueError(f"unknown demo model preset {preset!r}; known: {', '.join(PRESETS)}")
    return f"blazar-demo-llama-{preset}.gguf"


def byte_symbols() -> list[str]:
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


def tokens() -> tuple[list[str], list[int]]:
    """Return the vocabulary and each token's GGUF type, in id order."""
    merged = [merge.replace(" ", "") for merge in MERGES]
    vocab = [*byte_symbols(), *SPECIAL_TOKENS, *merged]
    types = [_NORMAL] * 256 + [_CONTROL] * len(SPECIAL_TOKENS) + [_NORMAL] * len(merged)
    return vocab, types


def _uniform(bits: np.random.PCG64, shape: tuple[int, ...], std: float) -> np.ndarray[Any, Any]:
    """Draw float32 uniform noise with the given standard deviation from numpy's stable raw stream."""
    import numpy as np

    count = 1
    for dim in shape:
        count *= dim
    raw = bits.random_raw(count)
    unit = (raw >> np.uint64(40)).astype(np.float32) * np.float32(2.0**-24) - np.float32(0.5)
    return (unit * np.float32(std * 12.0**0.5)).reshape(shape)


def weights(preset: str, seed: int) -> dict[str, np.ndarray[Any, Any]]:
    """Return the tensors under llama.cpp's names, each as numpy [out, in] (GGUF reverses the dims)."""
    import numpy as np

    shape = PRESETS[preset]
    hidden = shape["hidden_size"]
    inter = shape["intermediate_size"]
    heads = shape["num_attention_heads"]
    kv_dim = shape["num_key_value_heads"] * (hidden // heads)
    bits = np.random.PCG64(seed)
    ones = np.ones(hidden, dtype=np.float32)
    tensors: dict[str, np.ndarray[Any, Any]] = {
        "token_embd.weight": _uniform(bits, (VOCAB_SIZE, hidden), 1.0),
    }
    for i in range(shape["num_hidden_layers"]):
        p = f"blk.{i}."
        tensors[p + "attn_norm.weight"] = ones
        tensors[p + "attn_q.weight"] = _uniform(bits, (hidden, hidden), hidden**-0.5)
        tensors[p + "attn_k.weight"] = _uniform(bits, (kv_dim, hidden), hidden**-0.5)
        tensors[p + "attn_v.weight"] = _uniform(bits, (kv_dim, hidden), hidden**-0.5)
        tensors[p + "attn_output.weight"] = _uniform(bits, (hidden, hidden), hidden**-0.5)
        tensors[p + "ffn_norm.weight"] = ones
        tensors[p + "ffn_gate.weight"] = _uniform(bits, (inter, hidden), hidden**-0.5)
        tensors[p + "ffn_up.weight"] = _uniform(bits, (inter, hidden), hidden**-0.5)
        tensors[p + "ffn_down.weight"] = _uniform(bits, (hidden, inter), inter**-0.5)
    tensors["output_norm.weight"] = ones
    output = _uniform(bits, (VOCAB_SIZE, hidden), _LOGIT_STD * hidden**-0.5)
    emittable = np.zeros(VOCAB_SIZE, dtype=bool)
    emittable[0x20:0x7F] = True
    emittable[ord("\n")] = True
    output[~emittable] = 0.0
    tensors["output.weight"] = output
    return tensors


def is_current(out: Path, preset: str, seed: int) -> bool:
    """Tell whether ``out`` is this generator's model for ``preset`` and ``seed``."""
    import gguf  # type: ignore[import-not-found,unused-ignore]

    try:
        reader = gguf.GGUFReader(out)
    except (OSError, ValueError):
        return False

    def value(key: str) -> Any:
        field = reader.get_field(key)
        return None if field is None else field.contents()

    return (value("blazar.generator_version"), value("blazar.preset"), value("blazar.seed")) == (
        GENERATOR_VERSION,
        preset,
        seed,
    )


def _write_gguf(path: Path, preset: str, seed: int) -> None:
    import gguf  # type: ignore[import-not-found,unused-ignore]

    shape = PRESETS[preset]
    vocab, types = tokens()
    writer = gguf.GGUFWriter(path, arch="llama")
    writer.add_name(f"blazar demo llama {preset}")
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_context_length(CONTEXT_LENGTH)
    writer.add_embedding_length(shape["hidden_size"])
    writer.add_block_count(shape["num_hidden_layers"])
    writer.add_feed_forward_length(shape["intermediate_size"])
    writer.add_head_count(shape["num_attention_heads"])
    writer.add_head_count_kv(shape["num_key_value_heads"])
    writer.add_rope_dimension_count(shape["hidden_size"] // shape["num_attention_heads"])
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_vocab_size(VOCAB_SIZE)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(vocab)
    writer.add_token_types(types)
    writer.add_token_merges(list(MERGES))
    writer.add_bos_token_id(ENDOFTEXT_ID)
    writer.add_eos_token_id(IM_END_ID)
    writer.add_pad_token_id(ENDOFTEXT_ID)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)
    writer.add_uint32("blazar.generator_version", GENERATOR_VERSION)
    writer.add_string("blazar.preset", preset)
    writer.add_uint64("blazar.seed", seed)
    for name, tensor in weights(preset, seed).items():
        writer.add_tensor(name, tensor)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def write_demo_model(out: Path, preset: str, seed: int = 0) -> bool:
    """Write the model to ``out`` unless it is already there; return whether it wrote."""
    demo_model_file_name(preset)  # validates the preset
    if out.is_file() and is_current(out, preset, seed):
        print(f"demo model: {out} is current (preset {preset}, seed {seed})", file=sys.stderr)
        return False
    out.parent.mkdir(parents=True, exist_ok=True)
    handle, name = tempfile.mkstemp(prefix=f".{out.name}.build-", dir=out.parent)
    os.close(handle)
    build = Path(name)
    try:
        _write_gguf(build, preset, seed)
        with open(build, "rb") as f:
            # Synced before the rename: a crash cannot leave a truncated model under its name.
            os.fsync(f.fileno())
        build.chmod(0o644)  # mkstemp makes it 0o600
        os.replace(build, out)
    finally:
        build.unlink(missing_ok=True)
    print(
        f"demo model: {out} ready (preset {preset}, seed {seed}, {out.stat().st_size} bytes)", file=sys.stderr
    )
    return True


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--out", type=Path, required=True, help="the .gguf file to write")
    parser.add_argument("--preset", choices=sorted(PRESETS), required=True)
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights (default 0)")
    args = parser.parse_args(argv)
    if args.seed < 0:
        parser.error("--seed must be >= 0")
    write_demo_model(args.out, args.preset, args.seed)
    return 0


if __name__ == "__main__":
    # Run by path, Python puts engines/ first on sys.path, where a gateway module could
    # shadow a package that numpy or gguf import; this script needs nothing there.
    if sys.path and Path(sys.path[0] or ".").resolve() == Path(__file__).resolve().parent:
        del sys.path[0]
    sys.exit(main())
