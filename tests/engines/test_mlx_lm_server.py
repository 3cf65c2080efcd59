"""engines/mlx_lm_server.py: mlx_lm.server's prompt cache never answers an exact hit with nothing left."""

from __future__ import annotations

from typing import Any

from engines.mlx_lm_server import leave_a_token


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
