"""The gateway's own checks of a request the protocol offers before any task (``Gateway.fast``).

The lean protocol offers a POST to one of the relay's paths, head and body
whole (or its head first, ``serves_head``), to ``FastEntry.fast``, which makes
the checks ``Gateway.__call__`` would make of it (CORS, the drain, the browser
checks, the key) and gives it to the relay's fast path, counted in flight. A
request they would refuse, or the relay declines, is served as any other (an
ASGI task), which refuses it. Compiled with the rest of the request path
(``proxy/compiled.py``).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, Final

from proxy.asgi import Scope
from proxy.auth import ApiKeys
from proxy.browser import BrowserChecks
from proxy.protocol import FastClient
from proxy.relay import HeadFields, Relay

# The scope's key for the head's walk that ``serves_head`` made, for ``fast_after_head``.
_FIELDS: Final = "blazar.head_fields"


@dataclass
class GatewayState:
    """What the gateway as a whole is doing; written by the server's drain, read per request."""

    draining: bool = False
    in_flight: int = 0
    _idle: asyncio.Event | None = field(default=None, repr=False)

    def leave(self) -> None:
        self.in_flight -= 1
        if not self.in_flight and self._idle is not None:
            self._idle.set()

    async def wait_idle(self) -> None:
        """Return once no relayed request is in flight."""
        while self.in_flight:
            idle = self._idle = asyncio.Event()
            await idle.wait()


class FastEntry:
    """``Gateway.fast``, ``fast_after_head`` and ``serves_head``: see the module's docstring."""

    def __init__(
        self, relay: Relay, state: GatewayState, browser: BrowserChecks, keys: ApiKeys, with_cors: bool
    ) -> None:
        self.relay = relay
        self.state = state
        self.browser = browser
        self.keys = keys
        # Asked once: each is a Python __bool__ the request would otherwise call.
        self._with_keys = bool(keys)
        self._with_cors = with_cors

    def fast(self, scope: Scope, data: bytes | bytearray, client: FastClient) -> bool:
        """Serve a POST to one of the fast paths whose body ``data`` came whole from the protocol's
        callback (``proxy/relay/fast.py``); False, having changed nothing, when the request is
        to be served as any other (an ASGI task): the checks ``Gateway.__call__`` makes first, then
        the relay's."""
        if self.relay.declines(data, client):
            return False
        fields = self._fast_head(scope)
        if fields is None:
            return False
        return self._try_fast(scope, data, client, fields, False)

    def fast_after_head(self, scope: Scope, data: bytes | bytearray, client: FastClient) -> bool:
        """``fast`` for a request whose head ``serves_head`` passed as it came, before its body (the
        SDKs write them apart): its head is not checked again, as ``__call__`` checks a head once.
        A drain begun since is: such a request then goes to the full protocol, which answers it 503
        (nothing counts its upload as in flight, so the drain may not wait for it)."""
        relay = self.relay
        if self.state.draining or relay.declines(data, client):
            return False
        fields: Any = scope.get(_FIELDS)
        if fields is None:
            fields = HeadFields(scope["headers"], relay.request_drop)
        return self._try_fast(scope, data, client, fields, True)

    def serves_head(self, scope: Scope) -> bool:
        """Whether ``fast`` may take a request as far as its head tells, its body still coming:
        False where ``__call__`` would refuse it at its head (a browser check, the key, the relay's
        checks), so that the protocol gives it to the full protocol, which refuses it at once.
        The head's walk is kept in the scope for ``fast_after_head``."""
        fields = self._fast_head(scope)
        if fields is None or not self.relay.serves_head(scope, fields):
            return False
        scope[_FIELDS] = fields
        return True

    def _try_fast(
        self,
        scope: Scope,
        data: bytes | bytearray,
        client: FastClient,
        fields: HeadFields,
        head_checked: bool,
    ) -> bool:
        state = self.state
        state.in_flight += 1
        taken = False
        try:
            taken = self.relay.try_fast(scope, data, client, state.leave, fields, head_checked)
        finally:
            if not taken:
                state.in_flight -= 1
        return taken

    def _fast_head(self, scope: Scope) -> HeadFields | None:
        """The head's fields, walked once (``HeadFields``), where ``__call__``'s checks of the head
        (CORS, the drain, the browser checks, the key) let it on; else None."""
        if self._with_cors or self.state.draining:
            return None
        fields = HeadFields(scope["headers"], self.relay.request_drop)
        if fields.hosts > 1:
            refusal = self.browser.refusal(scope)
        else:
            refusal = self.browser.refusal_of(fields.host, fields.origin, fields.origins > 1, fields.site)
        if refusal is not None or (self._with_keys and not self.keys.allows(scope)):
            return None
        return fields
