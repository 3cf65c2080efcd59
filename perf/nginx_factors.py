"""What makes nginx's added time in the matrix what it is: one factor changed at a time.

    python -m perf.nginx_factors [--rounds 3] [--duration 3] [--cpu 0] [--out FILE] [NAME ...]

Each variant starts its upstream(s) and nginx, then measures direct and
nginx at C=1 (wrk -t1, ``--rounds`` interleaved runs of ``--duration`` s,
the order alternating) and once at C=64; it prints nginx's added p50, its
CPU per request and both req/s. The variants start from the matrix's old
json setup (two fake engines, nginx round-robin over both with
``proxy_request_buffering off``, a 99-byte request with an ``x-fake``
header, all pinned to one core, access log on) and from the outside
reference's (one fast upstream, one server, nginx's default request
buffering, the ~800-byte request), and change one thing each. NAME
picks variants by a part of their name.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from perf import surfaces
from perf.loadgen import wrk_load
from perf.matrix import PATH, body, chat_body


@dataclass(frozen=True)
class Variant:
    name: str
    upstream: str  # "fast" (perf/fast_upstream.py) or "fake" (tests/fake_engine.py)
    servers: int
    request_buffering: bool
    big_body: bool  # the ~800-byte chat request and no x-fake, else the 99-byte one with x-fake
    pinned: bool
    access_log: bool


VARIANTS = (
    Variant("old json setup", "fake", 2, False, False, True, True),
    Variant("old, fast upstream", "fast", 2, False, False, True, True),
    Variant("old, one server", "fake", 1, False, False, True, True),
    Variant("old, request buffering on", "fake", 2, True, False, True, True),
    Variant("old, 800-byte body, no x-fake", "fake", 2, False, True, True, True),
    Variant("old, access log off", "fake", 2, False, False, True, False),
    Variant("old, unpinned", "fake", 2, False, False, False, True),
    Variant("reference", "fast", 1, True, True, True, True),
    Variant("reference, two servers", "fast", 2, True, True, True, True),
    Variant("reference, proxy_request_buffering off", "fast", 1, False, True, True, True),
    Variant("reference, 99-byte body + x-fake", "fast", 1, True, False, True, True),
    Variant("reference, access log off", "fast", 1, True, True, True, False),
    Variant("reference, unpinned", "fast", 1, True, True, False, True),
    Variant("reference, fake engine upstream", "fake", 1, True, True, True, True),
)


def measure(variant: Variant, cpu: int, rounds: int, duration_s: float, work: Path) -> str:
    """One variant: a markdown table row."""
    pin = cpu if variant.pinned else None
    os.sched_setaffinity(0, {cpu} if variant.pinned else set(range(os.cpu_count() or 1)))
    work.mkdir(parents=True, exist_ok=True)
    ups = [
        surfaces.start_fast_upstream(pin, work)
        if variant.upstream == "fast"
        else surfaces.start_fake_engine(pin, work)
        for _ in range(variant.servers)
    ]
    nginx = surfaces.start_nginx(
        [u.port for u in ups],
        pin,
        work,
        request_buffering=variant.request_buffering,
        access_log=variant.access_log,
    )
    payload = chat_body() if variant.big_body else body("m1", False)
    headers = {} if variant.big_body else {"x-fake": "chunks=16"}
    pairs = {"direct": ups[0], "nginx": nginx}
    p50: dict[str, list[float]] = {"direct": [], "nginx": []}
    cpu_us: list[float] = []
    rps: dict[str, float] = {}

    def load(surface: surfaces.Process, connections: int, seconds: float) -> tuple[float, float, float]:
        before = surface.cpu_s()
        result = wrk_load(
            surface.url + PATH,
            [payload],
            connections=connections,
            duration_s=seconds,
            cpu=pin,
            headers=headers,
        )
        used = (surface.cpu_s() - before) * 1e6 / max(1, result.requests)
        return (result.p50_ms or 0.0) * 1000, result.rps, used

    try:
        for surface in pairs.values():
            load(surface, 1, 1.0)  # warm
        for index in range(rounds):
            order = list(pairs.items())
            for name, surface in order[::-1] if index % 2 else order:
                latency, _, used = load(surface, 1, duration_s)
                p50[name].append(latency)
                if name == "nginx":
                    cpu_us.append(used)
        for name, surface in pairs.items():
            rps[name] = load(surface, 64, duration_s)[1]
    finally:
        nginx.stop()
        for up in ups:
            up.stop()
    direct, via = statistics.median(p50["direct"]), statistics.median(p50["nginx"])
    per_round = ", ".join(f"{b - a:+.0f}" for a, b in zip(p50["direct"], p50["nginx"], strict=True))
    return (
        f"| {variant.name} | {direct:.0f} | {via:.0f} | **{via - direct:+.0f}** ({per_round}) | "
        f"{statistics.median(cpu_us):.1f} | {rps['direct']:,.0f} | {rps['nginx']:,.0f} |"
    )


HEADER = (
    "| variant | direct p50 µs | nginx p50 µs | nginx added p50 µs (each round) | nginx CPU µs/req, C=1 | "
    "direct req/s, C=64 | nginx req/s, C=64 |\n|---|---|---|---|---|---|---|"
)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m perf.nginx_factors", description=__doc__)
    parser.add_argument("names", nargs="*", help="variants whose name contains one of these [all]")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--duration", type=float, default=3.0)
    parser.add_argument("--cpu", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="also write the table here")
    args = parser.parse_args(argv)
    chosen = [v for v in VARIANTS if not args.names or any(n in v.name for n in args.names)]
    lines = [HEADER]
    print(HEADER, flush=True)
    with tempfile.TemporaryDirectory(prefix="nginx-factors-") as tmp:
        for variant in chosen:
            row = measure(variant, args.cpu, args.rounds, args.duration, Path(tmp) / str(time.monotonic_ns()))
            lines.append(row)
            print(row, flush=True)
    if args.out is not None:
        args.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
