"""python -m perf receipt|engine-ladder|matrix|paired|inproc|assembly|translation|affinity|accesslog
[--smoke]; python -m perf compiled --out DIR [--modules A,B]"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from perf import report

# --cpu not given: each command's own default.
_UNSET = -1


def _cpu(text: str) -> int | None:
    return None if text == "none" else int(text)


def _names(text: str) -> tuple[str, ...]:
    return tuple(name.strip() for name in text.split(",") if name.strip())


def _numbers(text: str) -> tuple[int, ...]:
    return tuple(int(n) for n in _names(text))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m perf", description=__doc__)
    parser.add_argument(
        "what",
        choices=(
            "receipt", "engine-ladder", "matrix", "paired", "inproc", "assembly", "translation", "affinity",
            "accesslog", "compiled",
        ),
    )  # fmt: skip
    parser.add_argument("--out", type=Path, default=None, help="output folder [perf/results/<what>-<time>]")
    parser.add_argument(
        "--cpu",
        type=_cpu,
        default=_UNSET,
        help="core to pin every process to, or 'none' [0; engine-ladder: none]; receipt, engine-ladder: "
        "the client and the gateway, the engine child going to CPU 1",
    )
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="a short version (tox -e perf)")
    size.add_argument("--smoke", action="store_true", help="a few seconds, to prove the harness runs")
    parser.add_argument(
        "--duration", type=float, default=None, help="seconds per matrix, paired or translation run"
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=None,
        help="matrix, paired or translation rounds; affinity: rounds of each mode",
    )
    parser.add_argument(
        "--baseline",
        type=Path,
        default=None,
        help="matrix, paired, inproc: also run blazar-proxy from this checkout, as blazar-base "
        "(e.g. a worktree of main: before and after in one run)",
    )
    parser.add_argument(
        "--surfaces", type=_names, default=None, help="matrix: comma-separated surfaces (also blazar-no-log)"
    )
    parser.add_argument(
        "--workloads", type=_names, default=None, help="matrix: comma-separated workloads; paired: one"
    )
    parser.add_argument(
        "--ladder",
        type=_numbers,
        default=None,
        help="matrix, paired, translation, engine-ladder: comma-separated concurrencies",
    )
    parser.add_argument(
        "--engine",
        default=None,
        help="receipt, engine-ladder: the engine [receipt: mlx-0.32.0; engine-ladder: llamacpp-b11434]",
    )
    parser.add_argument(
        "--max-tokens", type=int, default=None, help="receipt, engine-ladder: max_tokens [128]"
    )
    parser.add_argument(
        "--stream", action="store_true", help="engine-ladder: streamed requests too, in their own cells"
    )
    parser.add_argument("--runs", type=int, default=None, help="receipt runs per surface")
    parser.add_argument(
        "--model",
        default=None,
        help="receipt, affinity, engine-ladder: builtin:NAME (smollm2, the real model; tiny or bench: random "
        "weights) or a model directory or file [receipt: builtin:smollm2, --smoke: builtin:tiny; affinity: "
        "builtin:tiny; engine-ladder: the engine's default (no --model), --smoke: builtin:tiny]",
    )
    parser.add_argument("--modes", default=None, help="affinity: comma-separated modes [all four]")
    parser.add_argument("--slack", type=int, default=None, help="affinity: the affinity slack [4]")
    parser.add_argument("--conversations", type=int, default=None, help="affinity: conversations at once [8]")
    parser.add_argument(
        "--think", type=float, default=None, help="affinity: mean pause in s before a later turn [0.5]"
    )
    parser.add_argument(
        "--prompt-cache-size",
        type=int,
        default=None,
        help="affinity: each engine child's --prompt-cache-size, through engine-args [engine default, 10]",
    )
    parser.add_argument(
        "--prompt-cache-bytes",
        default=None,
        help="affinity: each engine child's --prompt-cache-bytes (e.g. 512M) [engine default, unbounded]",
    )
    parser.add_argument(
        "--concurrent", type=int, default=None, help="receipt: also aggregate tok/s at C=N [off]"
    )
    parser.add_argument(
        "--modules",
        default=None,
        help="compiled: comma-separated modules to compile, e.g. proxy/lean.py [those an install compiles]",
    )
    args = parser.parse_args(argv)
    if args.cpu == _UNSET:
        # Pinned by default, except the engine ladder: it measures as a user runs it.
        args.cpu = None if args.what == "engine-ladder" else 0

    if args.what == "compiled":
        from perf.compiled import build

        if args.out is None:
            parser.error("compiled: --out DIR (a new folder, or one an earlier run made: emptied first)")
        modules = [m.strip() for m in args.modules.split(",") if m.strip()] if args.modules else None
        print(build(args.out.resolve(), *([modules] if modules else [])), end="")
        return 0
    out = args.out or Path(__file__).parent / "results" / f"{args.what}-{time.strftime('%Y%m%d-%H%M%S')}"
    # Absolute: nginx reads its config relative to its prefix, which is under it.
    out = out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    if args.what == "assembly":
        from perf.assembly import run_assembly

        print(run_assembly(out, quick=args.quick or args.smoke), end="")
        return 0
    if args.what == "translation":
        from perf.translation import run_translation

        print(
            run_translation(
                out,
                quick=args.quick,
                smoke=args.smoke,
                cpu=args.cpu,
                duration_s=args.duration,
                rounds=args.rounds,
                ladder=args.ladder or (1, 16),
            ),
            end="",
        )
        return 0
    if args.what == "affinity":
        return _affinity(args, out)
    if args.what == "engine-ladder":
        return _engine_ladder(args, out)
    if args.what == "paired":
        from perf.paired import run_paired

        kwargs: dict[str, Any] = {"baseline": args.baseline, "cpu": args.cpu}
        if args.smoke:
            kwargs.update(ladder=(1,), rounds=1, duration_s=0.5)
        elif args.quick:
            kwargs.update(rounds=3, duration_s=1.0)
        if args.ladder:
            kwargs["ladder"] = args.ladder
        if args.rounds:
            kwargs["rounds"] = args.rounds
        if args.duration:
            kwargs["duration_s"] = args.duration
        if args.workloads:
            from perf.matrix import WORKLOADS

            if len(args.workloads) != 1 or args.workloads[0] not in WORKLOADS:
                parser.error(f"paired measures one workload: one of {', '.join(WORKLOADS)}")
            kwargs["workload"] = args.workloads[0]
        run_paired(out, **kwargs)
        print((out / "paired.md").read_text(), end="")
        return 0
    if args.what == "inproc":
        from perf.inproc import run_inproc

        print(
            run_inproc(out, baseline=args.baseline, quick=args.quick, smoke=args.smoke, cpu=args.cpu),
            end="",
        )
        return 0
    if args.what == "accesslog":
        from perf.accesslog import run_accesslog

        print(run_accesslog(out, quick=args.quick or args.smoke), end="")
        return 0
    if args.what == "matrix":
        from perf.matrix import SURFACES, WORKLOADS, Plan, run_matrix

        plan = Plan(cpu=args.cpu)
        if args.quick:
            plan = Plan(ladder=(1, 16, 64), duration_s=1.0, rounds=1, cpu=args.cpu)
        if args.smoke:
            plan = Plan(
                ladder=(1,),
                workloads=("json", "sse"),
                surfaces=("direct", "blazar", "nginx", "floor", "fused", "blazar-httpx"),
                duration_s=1.0,
                rounds=1,
                cpu=args.cpu,
                # No longer goal cells: the smoke proves the harness runs, it judges nothing.
                goal_duration_s=0.0,
                goal_rounds=0,
            )
        if args.duration:
            plan.duration_s = args.duration
        if args.rounds:
            plan.rounds = args.rounds
        if args.surfaces:
            plan.surfaces = args.surfaces
        if args.workloads:
            plan.workloads = args.workloads
        if args.ladder:
            plan.ladder = args.ladder
        if args.baseline is not None:
            plan.baseline = str(args.baseline.resolve())
            if "blazar-base" not in plan.surfaces:
                at = plan.surfaces.index("blazar") + 1 if "blazar" in plan.surfaces else 1
                plan.surfaces = (*plan.surfaces[:at], "blazar-base", *plan.surfaces[at:])
        unknown = [s for s in plan.surfaces if s not in SURFACES] + [
            w for w in plan.workloads if w not in WORKLOADS
        ]
        if unknown:
            parser.error(f"unknown surface or workload: {', '.join(unknown)}")
        if "blazar-base" in plan.surfaces and plan.baseline is None:
            parser.error("the surface blazar-base needs --baseline DIR")
        data = run_matrix(plan, out)
        data["environment"] = report.environment(
            {"baseline_request_path": report.request_path(Path(plan.baseline))} if plan.baseline else None
        )
        report.write_json(out / "matrix.json", data)
        (out / "matrix.md").write_text(report.matrix_markdown(data))
        plotted = report.matrix_plot(data, out / "matrix.png")
        print(report.matrix_markdown(data))
        print(
            f"written: {out / 'matrix.md'}, {out / 'matrix.json'}"
            + (f", {out / 'matrix.png'}" if plotted else "")
        )
    else:
        from perf.receipt import ReceiptError, ReceiptPlan, run_receipt

        rplan = ReceiptPlan(cpu=args.cpu)
        if args.quick:
            rplan = ReceiptPlan(cpu=args.cpu, runs=2, stream_runs=2, max_tokens=32)
        if args.smoke:
            rplan = ReceiptPlan(
                cpu=args.cpu,
                model="builtin:tiny",
                runs=1,
                stream_runs=1,
                stream_max_tokens=4,
                max_tokens=8,
                concurrent=2,
            )
        if args.engine:
            rplan.engine = args.engine
        if args.model:
            rplan.model = args.model
        if args.max_tokens:
            rplan.max_tokens = args.max_tokens
        if args.runs:
            rplan.runs = args.runs
        if args.concurrent is not None:
            rplan.concurrent = args.concurrent
        try:
            data = run_receipt(rplan, out)
        except ReceiptError as exc:
            print(f"perf receipt: {exc}", file=sys.stderr)
            return 2
        report.write_json(out / "receipt.json", data)
        (out / "receipt.md").write_text(report.receipt_markdown(data))
        print(report.receipt_markdown(data))
        print(f"written: {out / 'receipt.md'}, {out / 'receipt.json'}")
    return 0


def _engine_ladder(args: argparse.Namespace, out: Path) -> int:
    from perf.engine_ladder import LadderError, LadderPlan, markdown, run_engine_ladder

    plan = LadderPlan(cpu=args.cpu)
    if args.quick:
        plan = LadderPlan(cpu=args.cpu, rounds=2, warmup_s=2.0, duration_s=6.0)
    if args.smoke:
        plan = LadderPlan(
            cpu=args.cpu,
            model="builtin:tiny",
            ladder=(1, 2),
            rounds=1,
            max_tokens=8,
            warmup_s=0.5,
            duration_s=1.5,
        )
    if args.engine:
        plan.engine = args.engine
    if args.model:
        plan.model = args.model
    if args.ladder:
        plan.ladder = args.ladder
    if args.rounds:
        plan.rounds = args.rounds
    if args.duration:
        plan.duration_s = args.duration
    if args.max_tokens:
        plan.max_tokens = args.max_tokens
    if args.stream:
        plan.stream = True
    try:
        data = run_engine_ladder(plan, out)
    except LadderError as exc:
        print(f"perf engine-ladder: {exc}", file=sys.stderr)
        return 2
    report.write_json(out / "engine-ladder.json", data)
    (out / "engine-ladder.md").write_text(markdown(data))
    print(markdown(data))
    print(f"written: {out / 'engine-ladder.md'}, {out / 'engine-ladder.json'}")
    return 0


def _affinity(args: argparse.Namespace, out: Path) -> int:
    from perf.affinity import MODES, AffinityError, AffinityPlan, markdown, run_affinity

    plan = AffinityPlan()
    if args.quick:
        plan = AffinityPlan(conversations=4, turns=3, max_tokens=16)
    if args.smoke:
        plan = AffinityPlan(conversations=2, turns=2, system_tokens=200, max_tokens=4, think_s=0)
    if args.model:
        plan.model = args.model
    if args.slack is not None:
        plan.slack = args.slack
    if args.rounds:
        plan.rounds = args.rounds
    if args.think is not None:
        plan.think_s = args.think
    if args.conversations:
        plan.conversations = args.conversations
    if args.prompt_cache_size is not None:
        plan.prompt_cache_size = args.prompt_cache_size
    if args.prompt_cache_bytes is not None:
        plan.prompt_cache_bytes = args.prompt_cache_bytes
    if args.modes:
        plan.modes = tuple(args.modes.split(","))
        unknown = set(plan.modes) - set(MODES)
        if unknown:
            print(
                f"perf affinity: unknown modes {sorted(unknown)}; known: {', '.join(MODES)}", file=sys.stderr
            )
            return 2
    try:
        data = run_affinity(plan, out)
    except AffinityError as exc:
        print(f"perf affinity: {exc}", file=sys.stderr)
        return 2
    report.write_json(out / "affinity.json", data)
    (out / "affinity.md").write_text(markdown(data))
    print(markdown(data))
    print(f"written: {out / 'affinity.md'}, {out / 'affinity.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
