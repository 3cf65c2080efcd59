"""engines/mlx_lm_server.py: mlx_lm.server's prompt cache never answers an exact hit with nothing left."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from engines.mlx_lm_server import (
    GENERATION_DIED,
    PromptPastContext,
    answer_400,
    context_length,
    exit_when_generation_dies,
    fit_the_context,
    leave_a_token,
)


class Layer:
    """A stand-in for one layer of mlx's KV cache: its length in tokens, trimmable or not."""

    def __init__(self, tokens: int, trimmable: bool = True) -> None:
        self.tokens, self.trimmable = tokens, trimmable

    def trim(self, n: int) -> int:
        n = min(n, self.tokens)
        self.tokens -= n
        return n


def can_trim(cache: list[Layer]) -> bool:
    return all(layer.trimmable for layer in cache)


def trim(cache: list[Layer], n: int) -> int:
    trimmed = [layer.trim(n) for layer in cache] if can_trim(cache) else []
    return trimmed[0] if trimmed else 0


def fetching(cache: list[Layer] | None, rest: list[int]) -> Any:
    """A fetch_nearest_cache that answers (cache, rest) whatever it is asked."""

    def fetch(self: Any, model: Any, tokens: list[int]) -> tuple[Any, list[int]]:
        return cache, rest

    return fetch


def test_an_exact_hit_is_trimmed_by_one_token_left_to_prefill() -> None:
    """An exact hit (the whole cache, no rest) becomes the cache less one token and the last token."""
    cache = [Layer(4), Layer(4)]
    got, rest = leave_a_token(fetching(cache, []), can_trim, trim)(None, "m", [1, 2, 3, 4])
    assert got is cache and rest == [4]
    assert [layer.tokens for layer in cache] == [3, 3]


def test_an_exact_hit_on_a_cache_that_cannot_be_trimmed_prefills_the_whole_prompt() -> None:
    """A cache that cannot be trimmed is not used: no cache, every token to process."""
    cache = [Layer(4, trimmable=False)]
    assert leave_a_token(fetching(cache, []), can_trim, trim)(None, "m", [1, 2, 3, 4]) == (None, [1, 2, 3, 4])


def test_other_answers_pass_as_they_are() -> None:
    """A partial hit, a miss and an empty prompt are mlx's own answers."""
    cache = [Layer(2)]
    assert leave_a_token(fetching(cache, [3, 4]), can_trim, trim)(None, "m", [1, 2, 3, 4]) == (cache, [3, 4])
    assert leave_a_token(fetching(None, [1, 2]), can_trim, trim)(None, "m", [1, 2]) == (None, [1, 2])
    assert leave_a_token(fetching(cache, []), can_trim, trim)(None, "m", []) == (cache, [])
    assert cache[0].tokens == 2


def test_the_context_is_read_from_the_config_of_the_model_argv_names(tmp_path: Path) -> None:
    """--model DIR: DIR/config.json's max_position_embeddings (or text_config's); else None."""
    (tmp_path / "config.json").write_text('{"max_position_embeddings": 32768}')
    assert context_length(["--model", str(tmp_path), "--port", "1"]) == 32768
    (tmp_path / "config.json").write_text('{"text_config": {"max_position_embeddings": 8192}}')
    assert context_length(["--model", str(tmp_path)]) == 8192
    (tmp_path / "config.json").write_text("[1]")
    assert context_length(["--model", str(tmp_path)]) is None
    assert context_length(["--model", str(tmp_path / "absent")]) is None
    assert context_length(["--port", "1", "--model"]) is None


def tokenizing(tokens: int) -> Any:
    """A ResponseGenerator._tokenize that makes a prompt of ``tokens`` tokens."""

    def tokenize(self: Any, tokenizer: Any, request: Any, args: Any) -> tuple[Any, ...]:
        return [0] * tokens, [], [], "normal"

    return tokenize


def test_a_prompt_that_with_max_tokens_exceeds_the_context_raises_before_any_prefill() -> None:
    """The 200,000-token prompt regression: prompt + max_tokens past the context raises; up to it, passes."""
    with pytest.raises(PromptPastContext, match="context is 32768 tokens; the prompt is 200000 tokens"):
        fit_the_context(tokenizing(200_000), 32768)(None, None, None, SimpleNamespace(max_tokens=4))
    with pytest.raises(PromptPastContext):
        fit_the_context(tokenizing(32700), 32768)(None, None, None, SimpleNamespace(max_tokens=69))
    fitted = fit_the_context(tokenizing(32700), 32768)(None, None, None, SimpleNamespace(max_tokens=68))
    assert len(fitted[0]) == 32700


def test_the_handler_s_404_for_a_prompt_past_the_context_is_a_400_and_only_that_one() -> None:
    """PromptPastContext out of generate turns the handler's next 404 into 400; other errors stay 404."""
    sent: list[int] = []

    def generate(self: Any, fail: Exception) -> None:
        raise fail

    def set_headers(self: Any, status_code: int = 200) -> None:
        sent.append(status_code)

    wrapped_generate, wrapped_headers = answer_400(generate, set_headers)
    for fail in (PromptPastContext("long"), RuntimeError("generation thread died")):
        with pytest.raises(type(fail)):
            wrapped_generate(None, fail)
        wrapped_headers(None, 404)
    wrapped_headers(None)
    assert sent == [400, 404, 200]


@pytest.mark.parametrize(
    ("failed", "stopped", "exits"), [(True, False, [GENERATION_DIED]), (False, True, []), (False, False, [])]
)
def test_a_generation_thread_that_died_ends_the_process_and_one_stopped_does_not(
    failed: bool, stopped: bool, exits: list[int]
) -> None:
    """After the thread's run: the process exits when it failed, not when it was stopped or returned."""
    seen: list[int] = []

    def run(self: Any) -> None:
        self._generation_failed, self._stop = failed, stopped

    exit_when_generation_dies(run, seen.append)(SimpleNamespace())
    assert seen == exits


def test_the_line_a_dying_generation_thread_exits_with_names_its_exception(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The gateway quotes a child's last three lines; the main thread's may come after the
    traceback, so the exit's own line says what failed."""
    seen: list[int] = []

    def _generate() -> None:
        raise RuntimeError("[load_safetensors] Invalid json header length")

    def run(self: Any) -> None:  # as mlx_lm's: the exception logged and swallowed
        try:
            self._generate()
        except Exception:
            self._generation_failed, self._stop = True, False

    exit_when_generation_dies(run, seen.append)(SimpleNamespace(_generate=_generate))
    assert seen == [GENERATION_DIED]
    line = capsys.readouterr().err
    assert line == (
        "mlx_lm_server: the generation thread died (RuntimeError: [load_safetensors] "
        "Invalid json header length): exiting\n"
    )


@pytest.mark.parametrize("context", [32768, None])
def test_an_empty_prompt_raises_per_request_whatever_the_context(context: int | None) -> None:
    """A prompt rendered to no tokens (role_mapping {"stop": ""} and blank messages, without a chat
    template) raises in the request's own try, not in insert_segments; a model of unknown context too."""
    with pytest.raises(PromptPastContext, match="empty"):
        fit_the_context(tokenizing(0), context)(None, None, None, SimpleNamespace(max_tokens=4))
    assert (
        len(fit_the_context(tokenizing(5), None)(None, None, None, SimpleNamespace(max_tokens=10**9))[0]) == 5
    )
