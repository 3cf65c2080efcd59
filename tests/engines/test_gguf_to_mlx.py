"""engines/gguf_to_mlx.py: the built-in GGUF model made into an MLX directory, without loss."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from engines import gguf_to_mlx

SCRIPT = Path(gguf_to_mlx.__file__).resolve()


def llama_cpp_permute(weights: Any, n_head: int) -> Any:
    """What llama.cpp's convert_hf_to_gguf.py (LlamaModel.permute) does to Q and K rows."""
    return (
        weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def test_unpermute_undoes_llama_cpps_rotary_permutation() -> None:
    """Rows permuted as llama.cpp does come back in Hugging Face order, per head, for any trailing shape."""
    np = pytest.importorskip("numpy")
    # One head of 4 rows: llama.cpp interleaves the two halves (0 1 | 2 3 -> 0 2 1 3).
    assert gguf_to_mlx.unpermute_rows(np.array([0, 2, 1, 3]), 1).tolist() == [0, 1, 2, 3]
    # Three heads of 8 rows, with columns (a weight, or its scales and biases): rows move whole.
    rows = np.arange(24 * 5).reshape(24, 5)
    permuted = llama_cpp_permute(rows, 3)
    assert not (permuted == rows).all()
    assert (gguf_to_mlx.unpermute_rows(permuted, 3) == rows).all()
    # Each head's rows stay within the head.
    assert sorted(gguf_to_mlx.unpermute_rows(permuted, 3)[:8, 0].tolist()) == sorted(permuted[:8, 0].tolist())


def test_unpermute_refuses_rows_that_do_not_split_into_heads() -> None:
    """A row count that is not heads times an even head size is an error, not a silent reshape."""
    np = pytest.importorskip("numpy")
    with pytest.raises(ValueError, match="do not split into 4 heads"):
        gguf_to_mlx.unpermute_rows(np.zeros((6, 2)), 4)


@pytest.mark.parametrize(
    ("gguf", "hf"),
    [
        ("token_embd.weight", "model.embed_tokens.weight"),
        ("token_embd.scales", "model.embed_tokens.scales"),
        ("output_norm.weight", "model.norm.weight"),
        ("output.biases", "lm_head.biases"),
        ("blk.0.attn_q.weight", "model.layers.0.self_attn.q_proj.weight"),
        ("blk.29.attn_k.biases", "model.layers.29.self_attn.k_proj.biases"),
        ("blk.3.attn_output.scales", "model.layers.3.self_attn.o_proj.scales"),
        ("blk.1.attn_norm.weight", "model.layers.1.input_layernorm.weight"),
        ("blk.1.ffn_norm.weight", "model.layers.1.post_attention_layernorm.weight"),
        ("blk.2.ffn_gate.weight", "model.layers.2.mlp.gate_proj.weight"),
        ("blk.2.ffn_up.weight", "model.layers.2.mlp.up_proj.weight"),
        ("blk.2.ffn_down.weight", "model.layers.2.mlp.down_proj.weight"),
        ("rope_freqs.weight", None),
        ("blk.x.attn_q.weight", None),
        ("blk.0.attn_q.bias", None),
    ],
)
def test_tensor_names_map_to_hugging_face_llama(gguf: str, hf: str | None) -> None:
    """llama.cpp's tensor names become the names mlx_lm.models.llama loads; others are not guessed."""
    assert gguf_to_mlx.hf_name(gguf) == hf


class Shaped:
    """An array stand-in with a shape and dtype only."""

    def __init__(self, *shape: int) -> None:
        self.shape = shape


def test_quantization_names_the_8_bit_embedding_beside_the_4_bit_default() -> None:
    """The most common bits are the default; a module packed otherwise gets its own entry."""
    weights = {
        "model.embed_tokens.weight": Shaped(49152, 144),  # 576 values in 144 words: 8 bits
        "model.embed_tokens.scales": Shaped(49152, 18),
        "model.layers.0.self_attn.q_proj.weight": Shaped(576, 72),  # 4 bits
        "model.layers.0.self_attn.q_proj.scales": Shaped(576, 18),
        "model.layers.0.mlp.down_proj.weight": Shaped(576, 192),  # 1536 values: 4 bits
        "model.layers.0.mlp.down_proj.scales": Shaped(576, 48),
        "model.norm.weight": Shaped(576),
    }
    assert gguf_to_mlx.quantization(weights) == {
        "group_size": 32,
        "bits": 4,
        "mode": "affine",
        "model.embed_tokens": {"group_size": 32, "bits": 8, "mode": "affine"},
    }
    assert gguf_to_mlx.quantization({"model.norm.weight": Shaped(576)}) is None


def smollm2_metadata() -> dict[str, Any]:
    """The GGUF metadata that matters, as mx.load returns it (scalars as plain values here)."""
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "a", "b", "ab"]

    class Types:
        def tolist(self) -> list[int]:
            return [3, 3, 3, 1, 1, 1]

    return {
        "general.architecture": "llama",
        "llama.embedding_length": 576,
        "llama.feed_forward_length": 1536,
        "llama.block_count": 30,
        "llama.attention.head_count": 9,
        "llama.attention.head_count_kv": 3,
        "llama.attention.layer_norm_rms_epsilon": 9.999999747378752e-06,
        "llama.rope.freq_base": 100000.0,
        "llama.context_length": 8192,
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "smollm",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": Types(),
        "tokenizer.ggml.merges": ["a b"],
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.padding_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
        "tokenizer.ggml.add_bos_token": False,
        "tokenizer.chat_template": "{{ '<|im_start|>system\nYou are a helpful AI assistant' }}",
    }


def test_config_is_smollm2s_llama_shape_with_tied_embeddings() -> None:
    """config.json has the GGUF's shape, short floats, tied embeddings (no output tensor), quantization."""
    weights = {"model.embed_tokens.weight": Shaped(6, 144), "model.embed_tokens.scales": Shaped(6, 18)}
    config = gguf_to_mlx.config(smollm2_metadata(), weights)
    assert config["model_type"] == "llama"
    assert (config["hidden_size"], config["num_hidden_layers"], config["head_dim"]) == (576, 30, 64)
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (9, 3)
    assert config["rms_norm_eps"] == 1e-05 and config["rope_theta"] == 100000.0
    assert config["tie_word_embeddings"] is True
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)
    assert config["quantization"]["bits"] == 8
    untied = gguf_to_mlx.config(smollm2_metadata(), {**weights, "lm_head.weight": Shaped(6, 72)})
    assert untied["tie_word_embeddings"] is False


def test_other_architectures_are_refused() -> None:
    """Only llama is converted: another architecture's names and shapes would load wrong."""
    with pytest.raises(ValueError, match="architecture is 'qwen2'"):
        gguf_to_mlx.config({**smollm2_metadata(), "general.architecture": "qwen2"}, {})


def test_tokenizer_config_is_a_fast_tokenizer_with_the_gguf_template_and_specials() -> None:
    """PreTrainedTokenizerFast (not GPT2Tokenizer), BOS/EOS by id, no BOS added, the GGUF's own template."""
    config = gguf_to_mlx.tokenizer_config(smollm2_metadata())
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert (config["bos_token"], config["eos_token"]) == ("<|im_start|>", "<|im_end|>")
    assert (config["pad_token"], config["unk_token"]) == ("<|im_end|>", "<|endoftext|>")
    assert config["add_bos_token"] is False
    assert sorted(config["added_tokens_decoder"]) == ["0", "1", "2"]
    assert config["chat_template"].startswith("{{ '<|im_start|>system\nYou are a helpful")
    assert config["model_max_length"] == 8192


def test_is_current_needs_the_marker_the_source_hash_and_every_file(tmp_path: Path) -> None:
    """A directory is current only with this converter's marker, the same source sha256, all files there."""
    out = tmp_path / "m"
    out.mkdir()
    assert not gguf_to_mlx.is_current(out, "abc")
    marker = {"converter_version": gguf_to_mlx.CONVERTER_VERSION, "source_sha256": "abc", "files": ["x"]}
    (out / gguf_to_mlx.MARKER_NAME).write_text(json.dumps(marker))
    assert not gguf_to_mlx.is_current(out, "abc")  # x is missing
    (out / "x").write_text("")
    assert gguf_to_mlx.is_current(out, "abc")
    assert not gguf_to_mlx.is_current(out, "def")
    marker["converter_version"] = gguf_to_mlx.CONVERTER_VERSION + 1
    (out / gguf_to_mlx.MARKER_NAME).write_text(json.dumps(marker))
    assert not gguf_to_mlx.is_current(out, "abc")


def test_script_imports_and_parses_arguments_without_mlx(tmp_path: Path) -> None:
    """Run by path with mlx and tokenizers unimportable, the script still imports and answers --help."""
    blocker = tmp_path / "sitecustomize.py"
    blocker.write_text(
        "import sys\n"
        "class _Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('numpy', 'tokenizers', 'mlx', 'mlx_lm', 'transformers'):\n"
        "            raise ImportError(f'{name} is blocked in this test')\n"
        "        return None\n"
        "sys.meta_path.insert(0, _Block())\n"
    )
    helped = subprocess.run(
        [sys.executable, str(SCRIPT), "--help"],
        env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert helped.returncode == 0, helped.stderr
    assert "--gguf" in helped.stdout


@pytest.mark.skipif(
    not os.environ.get("BLAZAR_TEST_ENGINE_PYTHON"),
    reason="needs an mlx engine venv: set BLAZAR_TEST_ENGINE_PYTHON to its python (scripts/test does)",
)
def test_a_file_that_is_not_gguf_fails_in_one_line(tmp_path: Path) -> None:
    """A source that mlx cannot read as GGUF is exit code 1 and one line on stderr, without a traceback."""
    source = tmp_path / "x.gguf"
    source.write_bytes(b"not gguf")
    result = subprocess.run(
        [
            os.environ["BLAZAR_TEST_ENGINE_PYTHON"],
            str(SCRIPT),
            "--gguf",
            str(source),
            "--out",
            str(tmp_path / "o"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [f"gguf_to_mlx: {source}: [load_gguf] gguf_init failed"]
    assert result.stdout == "" and not (tmp_path / "o").exists()
