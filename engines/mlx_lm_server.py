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

Nor does mlx_lm.server compare a prompt with the model's context: a 200 KB
chat message was 200,000 tokens of prefill for a 32768-token model, and
every other request waited behind it. Only the tokenizer knows a prompt's
length in tokens, and the gateway has none.

This file, run with the engine venv's Python in place of
``python -m mlx_lm.server`` and with the same arguments:

- wraps ``LRUPromptCache.fetch_nearest_cache``: on an exact hit it trims the
  (copied) cache by one token and returns the last token as the rest to
  process, which is what a hit on a longer entry already does
  (cache.py:1666). A cache that cannot be trimmed is not used: the whole
  prompt is processed;
- wraps ``ResponseGenerator._tokenize`` (server.py:522, inside the
  generation thread's per-request ``try``): a prompt whose tokens and
  ``max_tokens`` exceed the model's context (config.json's
  ``max_position_embeddings``) raises ``PromptPastContext`` before any
  prefill, and the handler's answer to it is a 400 (mlx answers every
  failed request 404, server.py:1426) naming the lengths, as OpenAI's
  ``context_length_exceeded``.

- wraps ``ResponseGenerator._run_generate`` (server.py:446): when the
  generation thread dies of an error the wraps above do not foresee, the
  process exits (status 70) instead of serving on with ``/health`` 503 and
  every request a 404 "generation thread died" until the gateway's health
  checks notice (three failed checks, 5 s apart): the gateway sees the exit
  at once, answers 503 while it starts the child again, and logs why.

Everything else is mlx_lm.server itself. It may use only the standard library and what mlx-lm
installs; it imports nothing from this repository. It is written for 0.32.0
and checked there by tests/e2e/test_engine_mlx_hostile.py (the exact hit) and
tests/e2e/test_replica_sets.py (a second turn still served from the cache).
"""

from __future__ import annotations

import json
import os
import sys
import threading
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


class PromptPastContext(ValueError):
    """A prompt that cannot be generated from: empty, or with max_tokens past the model's context."""


def context_length(argv: list[str]) -> int | None:
    """The context of the model ``--model`` names: config.json's max_position_embeddings."""
    model = next((argv[i + 1] for i, arg in enumerate(argv[:-1]) if arg == "--model"), None)
    if model is None:
        return None
    try:
        with open(os.path.join(model, "config.json"), encoding="utf-8") as file:
            config = json.load(file)
    except (OSError, ValueError):
        return None
    for table in (config, config.get("text_config") if isinstance(config, dict) else None):
        size = table.get("max_position_embeddings") if isinstance(table, dict) else None
        if isinstance(size, int) and not isinstance(size, bool) and size > 0:
            return size
    return None


Tokenize = Callable[[Any, Any, Any, Any], tuple[Any, ...]]


def fit_the_context(tokenize: Tokenize, context: int | None) -> Tokenize:
    """Wrap ``ResponseGenerator._tokenize``: an empty prompt, or one that with its max_tokens exceeds
    ``context`` (where known), raises."""

    def _tokenize(self: Any, tokenizer: Any, request: Any, args: Any) -> tuple[Any, ...]:
        tokenized = tokenize(self, tokenizer, request, args)
        prompt_tokens, max_tokens = len(tokenized[0]), int(args.max_tokens or 0)
        if prompt_tokens == 0:
            # insert_segments raises on it outside any try (generate.py:1669): a model without a
            # chat template renders messages of blanks with role_mapping {"stop": ""} as "".
            raise PromptPastContext("the prompt is empty once rendered: send some text")
        if context is not None and prompt_tokens + max_tokens > context:
            raise PromptPastContext(
                f"this model's context is {context} tokens; the prompt is {prompt_tokens} tokens "
                f"and max_tokens {max_tokens}: shorten the prompt or lower max_tokens"
            )
        return tokenized

    return _tokenize


def answer_400(
    generate: Callable[..., Any], set_headers: Callable[..., None]
) -> tuple[Callable[..., Any], Callable[..., None]]:
    """Wrap ``ResponseGenerator.generate`` and ``APIHandler._set_completion_headers``: PromptPastContext, 400.

    The handler answers every exception of ``generate`` with 404 in the same
    thread (one thread per request): the wrapped generate marks that thread,
    and the wrapped header writer turns that 404 into 400.
    """
    refused = threading.local()

    def wrapped_generate(self: Any, *args: Any, **kwargs: Any) -> Any:
        refused.now = False
        try:
            return generate(self, *args, **kwargs)
        except PromptPastContext:
            refused.now = True
            raise

    def wrapped_set_headers(self: Any, status_code: int = 200) -> None:
        if status_code == 404 and getattr(refused, "now", False):
            refused.now = False
            status_code = 400
        set_headers(self, status_code)

    return wrapped_generate, wrapped_set_headers


GENERATION_DIED = 70  # EX_SOFTWARE


def exit_when_generation_dies(
    run: Callable[[Any], None], exit_now: Callable[[int], None]
) -> Callable[[Any], None]:
    """Wrap ``ResponseGenerator._run_generate``: a generation thread that died (not stopped) exits.

    The line it exits with names the exception: the gateway quotes a child's last few lines, and the
    main thread's own (a warning, "Starting httpd") may come between the traceback and this one.
    """

    def _run_generate(self: Any) -> None:
        failures: list[BaseException] = []
        generate = getattr(self, "_generate", None)
        if generate is not None:

            def _generate() -> None:
                try:
                    generate()
                except BaseException as exc:
                    failures.append(exc)
                    raise

            self._generate = _generate
        run(self)
        if getattr(self, "_generation_failed", False) and not getattr(self, "_stop", False):
            # run() has logged the traceback; the gateway restarts a child that exits.
            why = f" ({type(failures[-1]).__name__}: {failures[-1]})" if failures else ""
            # One write: a print's text and its newline are two, and another thread's line can fall between.
            sys.stderr.write(f"mlx_lm_server: the generation thread died{why}: exiting\n")
            sys.stderr.flush()
            exit_now(GENERATION_DIED)

    return _run_generate


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
    generator = server.ResponseGenerator
    generator._run_generate = exit_when_generation_dies(generator._run_generate, os._exit)
    handler = server.APIHandler
    generator._tokenize = fit_the_context(generator._tokenize, context_length(sys.argv))
    generator.generate, handler._set_completion_headers = answer_400(
        generator.generate, handler._set_completion_headers
    )
    server.main()


if __name__ == "__main__":
    main()
