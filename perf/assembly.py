"""`python -m perf assembly`: the CPU a non-stream reply built from a stream costs the gateway.

For engines whose non-stream requests go as streams (``[nonstream] via_stream``
in the spec: mlx), the gateway parses each event and builds the reply
(``proxy/assembly.py``). This times that work alone, in this process, on
streams shaped like mlx_lm.server's (one read per event, a usage event,
``[DONE]``), for several reply lengths: CPU µs per request and per event.
The relay's own cost per request is the matrix's figure; this is what comes
on top of it for a built reply.
"""

from __future__ import annotations

import time
from pathlib import Path

import orjson

from proxy.assembly import ReplyAssembler

_TOP = {
    "id": "chatcmpl-0b1c2d3e-aaaa-bbbb-cccc-0123456789ab",
    "system_fingerprint": "0.32.0-0.32.2-Linux-x86_64",
    "object": "chat.completion.chunk",
    "model": "SmolLM2-135M-Instruct",
    "created": 1796116798,
}


def mlx_stream(tokens: int) -> list[bytes]:
    """The reads of an mlx_lm.server chat stream of ``tokens`` tokens, one event each."""

    def event(doc: dict[str, object]) -> bytes:
        return b"data: " + orjson.dumps(doc) + b"\n\n"

    delta = {"role": "assistant", "content": " word"}
    reads = [event({**_TOP, "choices": [{"index": 0, "finish_reason": None, "delta": delta}]})] * tokens
    reads.append(
        event({**_TOP, "choices": [{"index": 0, "finish_reason": "length", "delta": {"role": "assistant"}}]})
    )
    usage = {"prompt_tokens": 30, "completion_tokens": tokens, "total_tokens": 30 + tokens}
    reads.append(event({**_TOP, "object": "chat.completion", "choices": [], "usage": usage}))
    reads.append(b"data: [DONE]\n\n")
    return reads


def cpu_per_request_s(reads: list[bytes], repeat: int) -> float:
    """The best of three: CPU seconds to feed ``reads`` and build the reply, per request."""
    best = float("inf")
    for _ in range(3):
        started = time.process_time()
        for _ in range(repeat):
            assembler = ReplyAssembler(chat=True)
            for chunk in reads:
                assembler.feed(chunk)
            assembler.reply()
        best = min(best, (time.process_time() - started) / repeat)
    return best


def run_assembly(out: Path, *, quick: bool = False) -> str:
    lines = [
        "# Built non-stream replies: the gateway's added CPU",
        "",
        "One process, `time.process_time()`, best of three; streams shaped like mlx_lm.server's.",
        "",
        "| tokens | CPU µs per request | CPU µs per event |",
        "|---:|---:|---:|",
    ]
    for tokens in (16, 128, 512):
        reads = mlx_stream(tokens)
        per_request = cpu_per_request_s(reads, 50 if quick else 400)
        lines.append(f"| {tokens} | {per_request * 1e6:.0f} | {per_request * 1e6 / len(reads):.2f} |")
    text = "\n".join(lines) + "\n"
    (out / "assembly.md").write_text(text)
    return text
