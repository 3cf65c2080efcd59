"""The request path: one request in, the original bytes out, the response relayed.

Per request and nothing more: read the body once (bounded), find ``model``
with one ``orjson.loads``, pick the route, admit, send the client's bytes
with one Content-Length, relay the response bytes as they arrive, release
what the request held in one place, and record how it went once. No
per-chunk parsing or logging: the only look at the relayed bytes is a
``[DONE]`` check on the last few bytes of a stream.

The modules, by job (proxy/DESIGN.md has the table): ``handler`` (the ASGI
entry, which reads as the story), ``request`` (the body), ``routes`` (route
entries, rebuilt on reload; replica choice), ``ticket`` (admission: the
gate, the slot and the peer a request holds, and the waits for them),
``exchange`` (the upstream exchange) with ``heartbeat``, ``sse``, ``body``
and ``built`` (the ways a response is relayed or built), ``watch`` (the
disconnect and stall watchers), ``failures`` (what the client is told),
``outcome`` (the one record), ``drain``, ``ids``, ``timing``, ``settings``;
``fast`` (the common case run from the protocols' callbacks, handed to the
rest wherever it is not common) with ``head`` (its one walk of the fields).
"""

from proxy.endpoints import ENDPOINTS
from proxy.relay.handler import Relay
from proxy.relay.head import HeadFields
from proxy.relay.ids import RequestIds
from proxy.relay.routes import ModelLoad, PeerLoad, deployment_path
from proxy.relay.settings import RelaySettings
from proxy.relay.timing import server_timing

__all__ = [
    "ENDPOINTS",
    "HeadFields",
    "ModelLoad",
    "PeerLoad",
    "Relay",
    "RelaySettings",
    "RequestIds",
    "deployment_path",
    "server_timing",
]
