"""mlx_lm.server, where an exact prompt-cache hit leaves a token to prefill.

mlx_lm.server 0.32.0 keeps each finished request's prompt and generated
tokens in its prompt cache (``LRUPromptCache`` in ``mlx_lm/models/cache.py``).
A request whose prompt is exactly such an entry (a completion of "The quick
brown fox" that answered "Q", then one of "The quick brown foxQ") is an exact
hit: ``fetch_nearest_cache`` returns the whole cache and no tokens left to
process (cache.py:1656), the batched path then drops every segment
(server.py:721-729), and ``insert_segments`` raises "empty prompt"
(generate.py:1669) outside any ``try``: the generation thread dies for good,
and every later request gets 404 "generation thread died". No check of the
request can stop it: the body is an ordinary one, and the hit depends on what
the cache holds.

This file, run with the engine venv's Python in place of
``python -m mlx_lm.server`` and with the same arguments, wraps
``LRUPromptCache.fetch_nearest_cache``: on an exact hit it trims the (copied)
cache by one token and returns the last token as the rest to process, which
is what a hit on a longer entry already does (cache.py:1666). A cache that
cannot be trimmed is not used: the whole prompt is processed. Everything else
is mlx_lm.server itself. It may use only the standard library and what mlx-lm
installs; it imports nothing from this repository. It is written for 0.32.0
and checked there by tests/e2e/test_engine_mlx_hostile.py (the exact hit) and
tests/e2e/test_replica_sets.py (a second turn still served from the cache).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

Fetch = Callable[[Any, Any, list[int]], tuple[Any, list[int]]]


def leave_a_token(fetch: Fetch, can_trim: Callable[[Any], bool], trim: Callable[[Any, int], int]) -> Fetch:
    """Wrap ``LRUPromptCache.fetch_nearest_cache`` so that its rest is never empty for a non-empty prompt.

    ``can_trim`` and ``trim`` are mlx_lm's ``can_trim_prompt_cache`` and ``trim_prompt_cache``.
    """

    def fetch_nearest_cache(self: Any, model: Any, tokens: list[int]) -> tuple[Any, list[int]]:
        cache, rest = fetch(self, model, tokens)
        if cache is None or len(rest) > 0 or len(tokens) == 0:
            return cache, rest
        # The cache is the caller's own copy (a deepcopy of the entry): trimming it leaves the entry whole.
        if can_trim(cache) and trim(cache, 1) == 1:
            return cache, tokens[-1:]
        return None, tokens

    return fetch_nearest_cache


def main() -> None:
    # Run as a script, this file's folder is first on sys.path: its modules
    # (engines/*.py) must not shadow what mlx_lm imports.
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    from mlx_lm import server  # type: ignore[import-not-found,unused-ignore]
    from mlx_lm.models import cache  # type: ignore[import-not-found,unused-ignore]

    lru = cache.LRUPromptCache
    lru.fetch_nearest_cache = leave_a_token(
        lru.fetch_nearest_cache, cache.can_trim_prompt_cache, cache.trim_prompt_cache
    )
    server.main()


if __name__ == "__main__":
    main()
