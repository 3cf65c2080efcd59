"""llama_cpp.server, where a client that leaves ends its generation within a token.

llama_cpp.server 0.3.36 runs a non-stream request to its end in a worker thread
(``run_in_threadpool(llama.create_chat_completion, ...)`` in
``llama_cpp/server/app.py``) and looks for a disconnect only before it starts:
a client that has gone costs the whole generation, up to ``max_tokens``
(measured here behind the gateway: 2.97 s of the child's CPU in the 3 s after
the client left). Its streams carry no token counts, so the gateway cannot
send such requests as streams, as it does for mlx (see the spec's
``[nonstream]``). This file, run with the engine venv's Python in place of
``python -m llama_cpp.server`` and with the same arguments, adds two things:

- an ASGI wrapper around the server's app that, once a POST's body has been
  read, watches its connection and sets a per-request flag when the client
  has gone (the app's own reads of ``receive`` are served from the same
  watch, so nothing is read twice);
- a wrapper around ``Llama.generate``, the token loop every completion and
  chat completion runs, that ends the loop at the next token once the flag
  of the request it runs for is set. The flag reaches the worker thread as a
  context variable: anyio's ``to_thread.run_sync`` runs the call in a copy of
  the request's context.

Everything else is llama_cpp.server itself. It may use only the standard
library and what llama-cpp-python installs; it imports nothing from this
repository. It is written for 0.3.36 and checked there by
tests/e2e/test_engine_llamacpp.py (the child's CPU time after a client left).
"""

from __future__ import annotations

import asyncio
import contextvars
import threading
from collections.abc import Awaitable, Callable, Iterator, MutableMapping
from typing import Any

Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[MutableMapping[str, Any], Receive, Send], Awaitable[None]]

# Set while a request runs: the event is set once its client has gone.
_client_gone: contextvars.ContextVar[threading.Event | None] = contextvars.ContextVar(
    "blazar_client_gone", default=None
)


class LeaveWatch:
    """ASGI wrapper: a POST whose client leaves sets that request's ``_client_gone`` event."""

    def __init__(self, app: App) -> None:
        self.app = app

    async def __call__(self, scope: MutableMapping[str, Any], receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        gone = threading.Event()
        gone_here = asyncio.Event()
        watch: asyncio.Task[None] | None = None

        async def watch_connection() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            gone.set()
            gone_here.set()

        async def app_receive() -> Message:
            nonlocal watch
            if watch is None:
                message = await receive()
                if message["type"] == "http.disconnect":
                    gone.set()
                elif not message.get("more_body", False):
                    watch = asyncio.ensure_future(watch_connection())
                return message
            # The body is read: what is left to learn is the client leaving.
            await gone_here.wait()
            return {"type": "http.disconnect"}

        token = _client_gone.set(gone)
        try:
            await self.app(scope, app_receive, send)
        finally:
            _client_gone.reset(token)
            if watch is not None:
                watch.cancel()


def _stop_when_client_gone(generate: Callable[..., Iterator[int]]) -> Callable[..., Iterator[int]]:
    def generate_until_gone(self: Any, *args: Any, **kwargs: Any) -> Iterator[int]:
        gone = _client_gone.get()
        for token in generate(self, *args, **kwargs):
            yield token
            if gone is not None and gone.is_set():
                return

    return generate_until_gone


def main() -> None:
    import llama_cpp  # type: ignore[import-not-found,unused-ignore]
    from llama_cpp.server import __main__ as server  # type: ignore[import-not-found,unused-ignore]

    llama_cpp.Llama.generate = _stop_when_client_gone(llama_cpp.Llama.generate)
    create_app = server.create_app

    def create_watched_app(**settings: Any) -> Any:
        return LeaveWatch(create_app(**settings))

    server.create_app = create_watched_app
    server.main()


if __name__ == "__main__":
    main()
