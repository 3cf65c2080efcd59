"""The reference relay: the same job on Starlette + httpx, for the matrix only.

Kept so that the transport decision stays visible in every benchmark run:
blazar-proxy's hot path uses its own asyncio+httptools client because this
one, the obvious way to write a gateway in Python, costs several times more.
It routes by the JSON `model` field like the real one, and streams the
response back as it arrives; it has none of the real one's error handling.

    python -m perf.httpx_gateway --upstream NAME=URL [...] --port P
"""

from __future__ import annotations

import argparse
from collections.abc import AsyncIterator

import httpx
import orjson
import uvicorn
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

_HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "te", "upgrade", "content-length", "host"}


def build(upstreams: dict[str, str]) -> Starlette:
    client = httpx.AsyncClient(
        trust_env=False,
        timeout=httpx.Timeout(600.0, connect=5.0),
        limits=httpx.Limits(max_connections=1000, max_keepalive_connections=256),
    )

    async def relay(request: Request) -> Response:
        body = await request.body()
        model = orjson.loads(body).get("model")
        base = upstreams.get(model) if isinstance(model, str) else None
        if base is None:
            return Response(b'{"error": {"message": "unknown model"}}', status_code=404)
        headers = {k: v for k, v in request.headers.items() if k not in _HOP_BY_HOP}
        upstream = client.build_request("POST", base + request.url.path, content=body, headers=headers)
        response = await client.send(upstream, stream=True)

        async def chunks() -> AsyncIterator[bytes]:
            async for chunk in response.aiter_raw():
                yield chunk

        out_headers = {k: v for k, v in response.headers.items() if k not in _HOP_BY_HOP}
        return StreamingResponse(
            chunks(),
            status_code=response.status_code,
            headers=out_headers,
            background=BackgroundTask(response.aclose),
        )

    return Starlette(routes=[Route("/v1/chat/completions", relay, methods=["POST"])])


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m perf.httpx_gateway")
    parser.add_argument("--upstream", action="append", default=[], metavar="NAME=URL")
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    upstreams = dict(spec.split("=", 1) for spec in args.upstream)
    uvicorn.run(
        build({name: url.rstrip("/") for name, url in upstreams.items()}),
        host="127.0.0.1",
        port=args.port,
        loop="uvloop",
        http="httptools",
        ws="none",
        access_log=False,
        log_level="warning",
    )


if __name__ == "__main__":
    main()
