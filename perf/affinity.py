"""`python -m perf affinity`: conversations and their prompt cache, over two replicas of a real engine.

The real engine (mlx-0.32.0, the installed one under ``$BLAZAR_HOME``) serves
one model as a config file's table with ``replicas = 2`` behind the gateway.
8 conversations of 4 turns run at once, each its turns in order and each
with its own system prompt of about 1,500 tokens, so that routing by load
spreads them. Each turn is a stream with ``stream_options.include_usage``:
its time to the first ``data:`` event (TTFT) and the usage's
``prompt_tokens_details.cached_tokens`` out of ``prompt_tokens`` are kept.

Modes, each on freshly started children (empty prompt caches):

- ``single``: one replica alone, the reference for the cached fraction;
- ``least-busy``: two replicas routed as the gateway does without affinity
  (``AFFINITY_FLAG off`` once the gateway has the flag);
- ``affinity``: two replicas, the gateway started with ``AFFINITY_FLAG N``;
  measured only when ``python -m proxy --help`` lists the flag;
- ``client-affinity``: the same two children, but this harness routes each
  turn itself with ``proxy.affinity.Affinity`` straight to a child's port,
  counting its own requests in flight: the decision measured on the real
  engine before the gateway carries it.

Which child served what is counted from the children's own access logs
(mlx_lm.server writes a line per request), as a difference over the run;
the gateway's readiness probe (a 1-token generation per child each 60 s)
lands there too. The report also gives the decision's CPU cost per request.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import random
import re
import statistics
import subprocess
import sys
import threading
import time
import timeit
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from perf import report, surfaces
from proxy.affinity import DEFAULT_SLACK, Affinity, conversation_key
from tests.helpers import free_port

ENGINE = "mlx-0.32.0"
# SmolLM2 prefills at 5-7 tokens/s on these CPUs (4-bit weights): a 1,500-token
# system prompt would take minutes. builtin:tiny prefills 1,500 tokens in ~0.8 s
# and its byte-level tokenizer makes a character one token.
DEFAULT_MODEL = "builtin:tiny"
# The gateway's routing switch (not in proxy/startup/cli.py yet): an integer N >= 0 turns
# prompt-cache affinity on with a slack of N requests; "off" routes by load alone.
AFFINITY_FLAG = "--affinity-slack"
AFFINITY_OFF = "off"
MODES = ("single", "least-busy", "affinity", "client-affinity")
MODEL_TABLE = "perf-affinity"
# mlx_lm.server's prompt cache (0.32.0): --prompt-cache-size distinct KV caches
# (10 by default), --prompt-cache-bytes in total (unbounded by default). A user
# whose memory bounds the cache sets them through the model's engine-args.
PROMPT_CACHE_DEFAULT_SIZE = 10
PROMPT_CACHE_DEFAULT_BYTES = None
_WORDS = (
    "river", "stone", "light", "market", "winter", "garden", "letter", "engine", "silver", "window",
    "paper", "forest", "harbor", "signal", "morning", "thread", "copper", "island", "mirror", "valley",
    "bridge", "lantern", "orbit", "meadow", "candle", "rocket", "canyon", "feather", "planet", "compass",
)  # fmt: skip


class AffinityError(RuntimeError):
    """The measurement cannot run as asked (an engine or gateway that does not start)."""


@dataclass
class AffinityPlan:
    model: str = DEFAULT_MODEL
    variant: str = "cpu"
    conversations: int = 8
    turns: int = 4
    system_tokens: int = 1500
    max_tokens: int = 32
    slack: int = DEFAULT_SLACK
    modes: tuple[str, ...] = MODES
    seed: int = 14
    # A user reads a reply before the next turn: a pause drawn per (conversation,
    # turn) from the seed, uniform in [0, 2 × think_s], the same in every mode.
    # Without it least-busy is sticky by accident in a closed loop (the replica
    # that just answered is the least busy when the next turn comes at once).
    think_s: float = 0.5
    # Each mode this many times, the order rotating; figures pool the rounds.
    rounds: int = 1
    # The children's prompt cache: None leaves the engine's default.
    prompt_cache_size: int | None = None
    # A size as mlx_lm.server reads it ("512M", "2G", or bytes); None leaves the default.
    prompt_cache_bytes: str | None = None


def engine_args(plan: AffinityPlan) -> list[str]:
    """The engine children's extra arguments: the prompt cache's bounds, when the plan sets them."""
    args = []
    if plan.prompt_cache_size is not None:
        args += ["--prompt-cache-size", str(plan.prompt_cache_size)]
    if plan.prompt_cache_bytes is not None:
        args += ["--prompt-cache-bytes", plan.prompt_cache_bytes]
    return args


def prompt_cache(plan: AffinityPlan) -> dict[str, Any]:
    """The prompt cache each child runs with, and the engine's default, for the report."""
    return {
        "size": plan.prompt_cache_size,
        "bytes": plan.prompt_cache_bytes,
        "default_size": PROMPT_CACHE_DEFAULT_SIZE,
        "default_bytes": PROMPT_CACHE_DEFAULT_BYTES,
        "engine_args": engine_args(plan),
    }


def prompt_cache_text(cache: dict[str, Any]) -> str:
    """The cache setting in words: what was set, and the engine's default beside it."""
    size = cache["size"]
    limit = cache["bytes"]
    default = f"{cache['default_size']} caches, bytes unbounded"
    if size is None and limit is None:
        return f"the engine's default ({default})"
    parts = []
    if size is not None:
        parts.append(f"`--prompt-cache-size {size}`")
    if limit is not None:
        parts.append(f"`--prompt-cache-bytes {limit}`")
    return " ".join(parts) + f" (engine default: {default})"


@dataclass(frozen=True)
class Turn:
    """One turn of one conversation as the client saw it."""

    conversation: int
    turn: int
    prompt_tokens: int
    cached_tokens: int
    ttft_s: float
    total_s: float
    completion_tokens: int
    # The child's index where the harness routed it (client-affinity); None through the gateway.
    replica: int | None = None


@dataclass
class ModeResult:
    mode: str
    turns: list[Turn] = field(default_factory=list)
    # Requests each child served during the run (its access log's lines).
    served: list[int] = field(default_factory=list)
    wall_s: float = 0.0
    skipped: str | None = None
    affinity: dict[str, list[int]] | None = None
    # The most prompt caches each child held during the run (its log's "Prompt Cache:" lines).
    cache_peak: list[int] = field(default_factory=list)


def chars_per_token(model: str) -> float:
    """About how many characters of the generated text make one token of ``model``."""
    return 1.0 if model in ("builtin:tiny", "builtin:bench") else 4.0


def system_prompt(conversation: int, chars: int, seed: int) -> str:
    """A system prompt of about ``chars`` characters, its own for each conversation."""
    rng = random.Random(seed * 1000 + conversation)
    words = [f"You are assistant number {conversation}. Keep to these notes:"]
    size = len(words[0])
    while size < chars:
        word = rng.choice(_WORDS)
        words.append(word)
        size += len(word) + 1
    return " ".join(words)[:chars]


def think_time(conversation: int, turn: int, plan: AffinityPlan) -> float:
    """The pause before ``turn`` of ``conversation``: the same in every mode."""
    if turn == 1 or plan.think_s <= 0:
        return 0.0
    return random.Random(f"{plan.seed}/{conversation}/{turn}").uniform(0, 2 * plan.think_s)


def user_message(conversation: int, turn: int) -> str:
    return f"Turn {turn} of conversation {conversation}: tell me more about the {_WORDS[turn % len(_WORDS)]}."


# ---- the run ------------------------------------------------------------------------------------


class _Router:
    """Where each request goes: the gateway, or (client-affinity) a child chosen by ``Affinity``."""

    def __init__(self, urls: Sequence[str], slack: int | None) -> None:
        self.urls = list(urls)
        self.affinity = Affinity(len(urls), slack=slack) if slack is not None else None
        self.loads = [0] * len(urls)
        self._lock = threading.Lock()

    def enter(self, doc: dict[str, Any]) -> int:
        if self.affinity is None:
            return 0
        with self._lock:
            index = self.affinity.choose(doc, self.loads)
            assert index is not None
            self.loads[index] += 1
            return index

    def leave(self, index: int) -> None:
        if self.affinity is not None:
            with self._lock:
                self.loads[index] -= 1


def _stream_turn(
    client: httpx.Client, url: str, doc: dict[str, Any]
) -> tuple[float, float, str, dict[str, Any]]:
    """(TTFT s, total s, content, usage) of one stream."""
    started = time.perf_counter()
    first = 0.0
    content: list[str] = []
    usage: dict[str, Any] = {}
    with client.stream("POST", f"{url}/v1/chat/completions", json=doc) as response:
        if response.status_code != 200:
            response.read()
            raise AffinityError(f"{url}: {response.status_code} {response.text[:300]}")
        for line in response.iter_lines():
            if not line.startswith("data:"):
                continue  # SSE comments (": keepalive") are not the first token
            if not first:
                first = time.perf_counter()
            data = line[5:].strip()
            if data == "[DONE]":
                break
            event = json.loads(data)
            if "error" in event:
                raise AffinityError(f"{url}: error event {event['error']}")
            content += [(c.get("delta") or {}).get("content") or "" for c in event.get("choices") or ()]
            if event.get("usage"):
                usage = event["usage"]
    return first - started, time.perf_counter() - started, "".join(content), usage


def _converse(plan: AffinityPlan, served: str, router: _Router, conversation: int) -> list[Turn]:
    chars = int(plan.system_tokens * chars_per_token(plan.model))
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": system_prompt(conversation, chars, plan.seed)}
    ]
    turns = []
    with httpx.Client(trust_env=False, timeout=900) as client:
        for turn in range(1, plan.turns + 1):
            time.sleep(think_time(conversation, turn, plan))
            messages.append({"role": "user", "content": user_message(conversation, turn)})
            doc = {
                "model": served,
                "messages": messages,
                "max_tokens": plan.max_tokens,
                "temperature": 0,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            index = router.enter(doc)
            try:
                ttft, total, content, usage = _stream_turn(client, router.urls[index], doc)
            finally:
                router.leave(index)
            details = usage.get("prompt_tokens_details") or {}
            turns.append(
                Turn(
                    conversation=conversation,
                    turn=turn,
                    prompt_tokens=int(usage.get("prompt_tokens", 0)),
                    cached_tokens=int(details.get("cached_tokens", 0)),
                    ttft_s=ttft,
                    total_s=total,
                    completion_tokens=int(usage.get("completion_tokens", 0)),
                    replica=index if router.affinity is not None else None,
                )
            )
            messages.append({"role": "assistant", "content": content})
    return turns


def gateway_flags() -> str:
    """The gateway's --help text (to see whether it has AFFINITY_FLAG)."""
    result = subprocess.run(
        [sys.executable, "-m", "proxy", "--help"],
        cwd=surfaces.ROOT,
        env=surfaces.child_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    return result.stdout


def _config(plan: AffinityPlan, replicas: int) -> str:
    args = engine_args(plan)
    return (
        f"[models.{MODEL_TABLE}]\n"
        f'engine = "{ENGINE}"\n'
        f'variant = "{plan.variant}"\n'
        f'model = "{plan.model}"\n'
        f"replicas = {replicas}\n"
        "always-loaded = true\n" + (f"engine-args = {json.dumps(args)}\n" if args else "")
    )


def _children(gateway_pid: int) -> list[tuple[int, int]]:
    """(pid, port) of each engine child under the gateway: the descendants started with ``--port``."""
    found = []
    pending, seen = [gateway_pid], set()
    while pending:
        pid = pending.pop()
        seen.add(pid)
        with contextlib.suppress(OSError, ValueError, IndexError):
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            if pid != gateway_pid and b"--port" in argv:
                found.append((pid, int(argv[argv.index(b"--port") + 1])))
                continue
            for task in os.listdir(f"/proc/{pid}/task"):
                children = Path(f"/proc/{pid}/task/{task}/children").read_text().split()
                pending += [int(c) for c in children if int(c) not in seen]
    return sorted(found, key=lambda child: child[1])


def _child_logs(replicas: int) -> list[Path]:
    """The children's log files, as the gateway names them (``<engine>--<model>[-<index>].log``)."""
    from engines.home import Home, blazar_home

    logs = Home(blazar_home()).logs
    if replicas == 1:
        return [logs / f"{ENGINE}--{MODEL_TABLE}.log"]
    return [logs / f"{ENGINE}--{MODEL_TABLE}-{index}.log" for index in range(replicas)]


def _served_requests(log: Path) -> int:
    """Requests a child has answered so far: mlx_lm.server's access lines in its log."""
    with contextlib.suppress(OSError):
        return log.read_bytes().count(b'"POST /v1/chat/completions')
    return 0


def _log_size(log: Path) -> int:
    with contextlib.suppress(OSError):
        return log.stat().st_size
    return 0


_CACHE_LINE = re.compile(rb"Prompt Cache: (\d+) sequences")


def cache_peak(text: bytes) -> int:
    """The most prompt caches a child reported holding in ``text`` (mlx_lm.server logs it per request)."""
    return max((int(n) for n in _CACHE_LINE.findall(text)), default=0)


def _cache_peak(log: Path, offset: int) -> int:
    with contextlib.suppress(OSError), log.open("rb") as file:
        file.seek(offset)
        return cache_peak(file.read())
    return 0


def _start(
    plan: AffinityPlan, replicas: int, extra: list[str], log_dir: Path
) -> tuple[surfaces.Process, list[Path], list[str], str]:
    """The gateway and its children, all ready: (gateway, children's logs, their URLs, served name)."""
    port = free_port()
    config = log_dir / f"affinity-{port}.toml"
    config.write_text(_config(plan, replicas))
    log_path = log_dir / f"affinity-gateway-{port}.log"
    argv = [sys.executable, "-m", "proxy", "--config", str(config), "--port", str(port), *extra]
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            argv, cwd=surfaces.ROOT, env=surfaces.child_env(), stdout=log, stderr=subprocess.STDOUT
        )
    gateway = surfaces.Process("blazar", proc, port)
    try:
        surfaces.wait_until_ready(f"{gateway.url}/readyz", proc, timeout_s=900)
        deadline = time.monotonic() + 300
        children = _children(proc.pid)
        while len(children) < replicas and time.monotonic() < deadline:
            time.sleep(0.2)
            children = _children(proc.pid)
        if len(children) != replicas:
            raise AffinityError(f"{len(children)} engine children under the gateway, not {replicas}")
        urls = [f"http://127.0.0.1:{child_port}" for _, child_port in children]
        logs = _child_logs(replicas)
        with httpx.Client(trust_env=False, timeout=600) as client:
            served = str(client.get(f"{gateway.url}/v1/models").json()["data"][0]["id"])
            for url in urls:  # each child answers a generation: ready, its kernels compiled
                body = {"model": served, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
                while True:
                    with contextlib.suppress(httpx.TransportError):
                        if client.post(f"{url}/v1/chat/completions", json=body).status_code == 200:
                            break
                    if time.monotonic() > deadline:
                        raise AffinityError(f"{url} does not answer a generation")
                    time.sleep(0.5)
    except Exception as exc:
        gateway.stop()
        raise AffinityError(
            f"the gateway did not get ready ({exc}); its log, {log_path}:\n"
            + log_path.read_text(errors="replace")[-3000:]
        ) from exc
    return gateway, logs, urls, served


def run_mode(mode: str, plan: AffinityPlan, log_dir: Path, flags: str) -> ModeResult:
    """One mode on freshly started children."""
    result = ModeResult(mode)
    has_flag = AFFINITY_FLAG in flags
    if mode == "affinity" and not has_flag:
        result.skipped = f"the gateway has no {AFFINITY_FLAG} yet"
        return result
    extra: list[str] = []
    if mode == "least-busy" and has_flag:
        extra = [AFFINITY_FLAG, AFFINITY_OFF]
    if mode == "affinity":
        extra = [AFFINITY_FLAG, str(plan.slack)]
    gateway, logs, urls, served = _start(plan, 1 if mode == "single" else 2, extra, log_dir)
    try:
        router = _Router(urls, plan.slack) if mode == "client-affinity" else _Router([gateway.url], None)
        before = [_served_requests(log) for log in logs]
        offsets = [_log_size(log) for log in logs]
        started = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(plan.conversations) as pool:
            runs = list(pool.map(lambda n: _converse(plan, served, router, n), range(plan.conversations)))
        result.wall_s = time.perf_counter() - started
        result.served = [_served_requests(log) - b for log, b in zip(logs, before, strict=True)]
        result.cache_peak = [_cache_peak(log, o) for log, o in zip(logs, offsets, strict=True)]
        result.turns = [turn for run in runs for turn in run]
        if router.affinity is not None:
            a = router.affinity
            result.affinity = {"hits": a.hits, "misses": a.misses, "spills": a.spills}
    finally:
        gateway.stop()
    return result


def merge(into: ModeResult, result: ModeResult) -> None:
    """Pool one round of a mode into the figures of the rounds before."""
    into.skipped = result.skipped
    into.turns += result.turns
    into.served = (
        [a + b for a, b in zip(into.served, result.served, strict=True)] if into.served else result.served
    )
    into.wall_s += result.wall_s
    into.cache_peak = (
        [max(a, b) for a, b in zip(into.cache_peak, result.cache_peak, strict=True)]
        if into.cache_peak
        else result.cache_peak
    )
    if result.affinity is not None:
        if into.affinity is None:
            into.affinity = {name: list(counts) for name, counts in result.affinity.items()}
        else:
            for name, counts in result.affinity.items():
                into.affinity[name] = [a + b for a, b in zip(into.affinity[name], counts, strict=True)]


# ---- figures ------------------------------------------------------------------------------------


def cached_fraction(turns: Sequence[Turn]) -> float | None:
    """Cached prompt tokens over prompt tokens, all turns together."""
    prompt = sum(t.prompt_tokens for t in turns)
    return sum(t.cached_tokens for t in turns) / prompt if prompt else None


def ttft_p50_ms(turns: Sequence[Turn]) -> float | None:
    return statistics.median(t.ttft_s for t in turns) * 1000 if turns else None


def ttft_p90_ms(turns: Sequence[Turn]) -> float | None:
    """The 90th percentile (inclusive: within the values seen), or the one value."""
    if len(turns) < 2:
        return turns[0].ttft_s * 1000 if turns else None
    return statistics.quantiles((t.ttft_s for t in turns), n=10, method="inclusive")[-1] * 1000


def ttft_mean_ms(turns: Sequence[Turn]) -> float | None:
    return statistics.fmean(t.ttft_s for t in turns) * 1000 if turns else None


def misses(turns: Sequence[Turn]) -> int:
    """Turns that found less than half their prompt cached: a prefill of most of the prompt."""
    return sum(1 for t in turns if t.cached_tokens * 2 < t.prompt_tokens)


def max_share(served: Sequence[int]) -> float | None:
    """The busiest replica's share of the requests."""
    total = sum(served)
    return max(served) / total if total and len(served) > 1 else None


def summarize(results: Sequence[ModeResult], turns: int) -> dict[str, Any]:
    """Per mode and turn: cached fraction and TTFT p50; turns 2+ together; the load split; the goals."""
    modes: dict[str, Any] = {}
    for result in results:
        if result.skipped:
            modes[result.mode] = {"skipped": result.skipped}
            continue
        later = [t for t in result.turns if t.turn > 1]
        per_turn = {}
        for number in range(1, turns + 1):
            these = [t for t in result.turns if t.turn == number]
            per_turn[str(number)] = {
                "cached_fraction": cached_fraction(these),
                "ttft_p50_ms": ttft_p50_ms(these),
                "prompt_tokens_mean": statistics.fmean(t.prompt_tokens for t in these) if these else None,
            }
        modes[result.mode] = {
            "turns": per_turn,
            "later_cached_fraction": cached_fraction(later),
            "later_ttft_p50_ms": ttft_p50_ms(later),
            "later_ttft_p90_ms": ttft_p90_ms(later),
            "later_ttft_mean_ms": ttft_mean_ms(later),
            "later_misses": misses(later),
            "later_turns": len(later),
            "served": result.served,
            "max_share": max_share(result.served),
            "cache_peak": result.cache_peak,
            "wall_s": result.wall_s,
            "affinity": result.affinity,
        }
    return {"modes": modes, "goals": goals(modes)}


def goals(modes: dict[str, Any]) -> list[dict[str, Any]]:
    """The three goals (cached fraction, TTFT against least-busy, busiest share) per affinity mode."""
    rows: list[dict[str, Any]] = []
    single = modes.get("single", {})
    least = modes.get("least-busy", {})
    for name in ("affinity", "client-affinity"):
        mode = modes.get(name)
        if not mode or "skipped" in mode:
            continue
        ref = single.get("later_cached_fraction")
        got = mode["later_cached_fraction"]
        ratio = got / ref if got is not None and ref else None
        rows.append(_goal(name, "cached fraction, turns 2+, vs one replica alone", ratio, 0.9, ">="))
        lb, aff = least.get("later_ttft_p50_ms"), mode["later_ttft_p50_ms"]
        rows.append(
            _goal(
                name, "TTFT p50, turns 2+: least-busy / affinity", lb / aff if lb and aff else None, 2.0, ">="
            )
        )
        rows.append(_goal(name, "busiest replica's share of requests", mode["max_share"], 0.6, "<="))
    return rows


def _goal(mode: str, goal: str, value: float | None, limit: float, sense: str) -> dict[str, Any]:
    met = None if value is None else (value >= limit if sense == ">=" else value <= limit)
    return {"mode": mode, "goal": goal, "value": value, "limit": f"{sense} {limit:g}", "met": met}


def decision_cost(repeat: int = 5, number: int = 2000) -> dict[str, float]:
    """CPU µs per request of the key and of ``choose``: a 1,500-token system prompt and three turns."""
    import orjson

    messages: list[dict[str, Any]] = [{"role": "system", "content": system_prompt(0, 6000, 14)}]
    for turn in (1, 2, 3):
        messages += [
            {"role": "user", "content": user_message(0, turn)},
            {"role": "assistant", "content": "word " * 60},
        ]
    messages.append({"role": "user", "content": user_message(0, 4)})
    body = orjson.dumps({"model": "m", "messages": messages, "max_tokens": 32})

    def best(call: Callable[[Any], object]) -> float:
        # Fresh documents, as the relay has: a parsed str caches its hash.
        times = []
        for _ in range(repeat):
            docs = iter([orjson.loads(body) for _ in range(number)])

            def once(docs: Iterator[Any] = docs) -> None:
                call(next(docs))

            times.append(timeit.timeit(once, number=number) / number * 1e6)
        return min(times)

    affinity = Affinity(2)
    affinity.choose(orjson.loads(body), [0, 0])
    return {
        "body_bytes": float(len(body)),
        "parse_us": best(lambda doc: doc),
        "key_us": best(conversation_key),
        "choose_us": best(lambda doc: affinity.choose(doc, [1, 0])),
    }


# ---- report -------------------------------------------------------------------------------------


def _f(value: float | None, digits: int = 2) -> str:
    return "—" if value is None else f"{value:.{digits}f}"


def markdown(data: dict[str, Any]) -> str:
    summary = data["summary"]
    modes = summary["modes"]
    measured = [name for name in MODES if name in modes and "skipped" not in modes[name]]
    plan = data["plan"]
    lines = [
        "# Prompt-cache affinity: conversations over two replicas",
        "",
        f"{plan['conversations']} conversations × {plan['turns']} turns at once, each with its own "
        f"system prompt (~{plan['system_tokens']} tokens), {plan['max_tokens']} tokens a reply, "
        f"a pause of 0–{2 * plan['think_s']:g} s before each later turn, {plan['rounds']} round(s), "
        f"engine {data['engine']}, model {plan['model']} ({data['model']}), slack {plan['slack']}. "
        f"Git {data['environment'].get('git_sha', '?')}.",
    ]
    if data.get("prompt_cache"):
        lines += ["", f"Prompt cache per child: {prompt_cache_text(data['prompt_cache'])}."]
    lines += [
        "",
        "## Per turn: cached fraction of the prompt, and TTFT p50",
        "",
        "| turn | prompt tokens | " + " | ".join(f"{m} cached | {m} TTFT p50" for m in measured) + " |",
        "|---|---|" + "---|---|" * len(measured),
    ]
    for number in range(1, plan["turns"] + 1):
        first = modes[measured[0]]["turns"][str(number)] if measured else {}
        cells = []
        for name in measured:
            row = modes[name]["turns"][str(number)]
            cells += [_f(row["cached_fraction"]), f"{_f(row['ttft_p50_ms'], 0)} ms"]
        lines.append(f"| {number} | {_f(first.get('prompt_tokens_mean'), 0)} | " + " | ".join(cells) + " |")
    cells = []
    for name in measured:
        cells += [_f(modes[name]["later_cached_fraction"]), f"{_f(modes[name]['later_ttft_p50_ms'], 0)} ms"]
    lines += ["| 2+ | | " + " | ".join(cells) + " |", ""]
    lines += [
        "## Turns 2+: misses (under half the prompt cached) and the TTFT spread",
        "",
        "| mode | misses | TTFT p50 | TTFT p90 | TTFT mean |",
        "|---|---|---|---|---|",
    ]
    for name in measured:
        mode = modes[name]
        if "later_misses" not in mode:
            continue
        lines.append(
            f"| {name} | {mode['later_misses']} of {mode['later_turns']} | "
            f"{_f(mode['later_ttft_p50_ms'], 0)} ms | {_f(mode['later_ttft_p90_ms'], 0)} ms | "
            f"{_f(mode['later_ttft_mean_ms'], 0)} ms |"
        )
    lines.append("")
    lines += [
        "## Load split (requests each child served)",
        "",
        "| mode | per replica | busiest share | most caches held, per replica | wall |",
    ]
    lines.append("|---|---|---|---|---|")
    for name in measured:
        mode = modes[name]
        peak = " / ".join(str(n) for n in mode.get("cache_peak") or ()) or "—"
        lines.append(
            f"| {name} | {' / '.join(str(n) for n in mode['served'])} | {_f(mode['max_share'])} "
            f"| {peak} | {_f(mode['wall_s'], 1)} s |"
        )
    for name in MODES:
        if name in modes and "skipped" in modes[name]:
            lines.append(f"| {name} | not measured: {modes[name]['skipped']} | | | |")
    if summary["goals"]:
        lines += [
            "",
            "## Goals",
            "",
            "| mode | goal | value | limit | met |",
            "|---|---|---|---|---|",
        ]
        for goal in summary["goals"]:
            met = {True: "yes", False: "**no**", None: "—"}[goal["met"]]
            lines.append(
                f"| {goal['mode']} | {goal['goal']} | {_f(goal['value'])} | {goal['limit']} | {met} |"
            )
    cost = data.get("decision_cost")
    if cost:
        lines += [
            "",
            "## The decision's cost (in this process, best of 5 runs)",
            "",
            f"A {cost['body_bytes']:.0f}-byte chat (a 1,500-token system prompt, three turns): "
            f"the key {cost['key_us']:.1f} µs, `choose` (key, two replicas' lookup, remembering) "
            f"{cost['choose_us']:.1f} µs a request.",
        ]
    return "\n".join(lines) + "\n"


def run_affinity(plan: AffinityPlan, out_dir: Path) -> dict[str, Any]:
    log_dir = out_dir / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    flags = gateway_flags()
    results = {mode: ModeResult(mode) for mode in plan.modes}
    for round_index in range(plan.rounds):
        shift = round_index % len(plan.modes)
        for mode in plan.modes[shift:] + plan.modes[:shift]:
            print(f"affinity: round {round_index + 1}, {mode} ...", flush=True)
            result = run_mode(mode, plan, log_dir, flags)
            merge(results[mode], result)
            if result.skipped:
                print(f"affinity: {mode}: skipped ({result.skipped})", flush=True)
                continue
            print(
                f"affinity: {mode}: {len(result.turns)} turns in {result.wall_s:.1f} s, "
                f"cached {_f(cached_fraction([t for t in result.turns if t.turn > 1]))} on turns 2+, "
                f"served {result.served}",
                flush=True,
            )
    return {
        "kind": "affinity",
        "engine": ENGINE,
        "model": MODEL_TABLE,
        "flag": {"name": AFFINITY_FLAG, "in_gateway": AFFINITY_FLAG in flags, "off": AFFINITY_OFF},
        "plan": asdict(plan),
        "prompt_cache": prompt_cache(plan),
        "summary": summarize(list(results.values()), plan.turns),
        "runs": {r.mode: [asdict(t) for t in r.turns] for r in results.values()},
        "decision_cost": decision_cost(),
        "environment": report.environment(),
    }
