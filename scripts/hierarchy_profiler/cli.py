"""Command line: profile a model by its call hierarchy (RFC-0051)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from . import models
from .output import write_flamegraph, write_folded, write_trace
from .session import BACKENDS, Options, run
from .tree import build_tree, format_tree

DESCRIPTION = """\
Compile a model with torch._dynamo.config.record_call_hierarchy on, run it, and
show where its ops (and, with --profile, their time) sit in the model's
module/function call hierarchy.  Writes a Chrome trace (open it in
https://ui.perfetto.dev), folded stacks and an SVG flame graph to --out."""


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m scripts.profile_hierarchy", description=DESCRIPTION)
    p.add_argument(
        "--model", default=models.DEFAULT_MODEL,
        help=f"built-in model ({models.describe_builtins()}; default %(default)s) "
        "or 'module:factory' returning a Workload or (module, args[, kwargs])",
    )
    p.add_argument("--backend", choices=BACKENDS, default="aot_eager",
                   help="aot_eager: every ATen op timed; inductor: CPU kernels attributed to the "
                   "common scope of their origin nodes (default %(default)s)")
    p.add_argument("--train", action="store_true",
                   help="forward + backward; backward ops appear under their forward origin, marked (bw)")
    p.add_argument("--profile", action="store_true", help="time warm-up + measured iterations; show times")
    p.add_argument("--warmup", type=int, default=3, help="warm-up iterations with --profile (default %(default)s)")
    p.add_argument("--iters", type=int, default=10, help="measured iterations with --profile (default %(default)s)")
    p.add_argument("--fullgraph", action="store_true", help="compile with fullgraph=True (no graph breaks)")
    p.add_argument("--depth", type=int, default=None, help="print the tree down to this depth")
    p.add_argument("--out", type=Path, default=Path("build/profile_hierarchy"),
                   help="output directory (default %(default)s)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        workload = models.build(args.model)
    except models.ModelError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.profile and args.backend == "inductor":
        print("error: --profile needs --backend aot_eager (Inductor kernels are attributed, not timed)",
              file=sys.stderr)
        return 2
    options = Options(
        backend=args.backend,
        train=args.train,
        warmup=args.warmup if args.profile else 1,
        iters=args.iters if args.profile else 1,
        fullgraph=args.fullgraph,
    )
    try:
        result = run(workload, options, show_progress=args.profile)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    runs = result.iterations[-1]
    root = build_tree(result.iterations)
    mode = "train (forward + backward)" if args.train else "inference (no_grad)"
    graphs = result.recorder.graphs
    print(f"model {args.model} ({type(workload.model).__name__}), backend {args.backend}, {mode}")
    print(f"{result.recorder.num_dynamo_graphs} Dynamo graph(s) -> {len(graphs)} compiled graph(s), "
          f"{len(runs)} graph run(s) and {root.total_count} {result.recorder.unit}s per iteration")
    if args.profile:
        print(f"times: mean of {options.iters} measured iterations after {options.warmup} warm-up")
    print()
    print(format_tree(root, timed=args.profile, max_depth=args.depth, unit=result.recorder.unit))
    print()

    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    trace = out / "trace.json"
    folded = out / "hierarchy.folded"
    svg = out / "flamegraph.svg"
    written = []
    if result.recorder.timed:
        write_trace(trace, runs, {"model": args.model, "backend": args.backend, "mode": mode})
        written.append(trace)
    write_folded(folded, root)
    written.append(folded)
    if args.profile:
        folded_time = out / "hierarchy_us.folded"
        write_folded(folded_time, root, timed=True)
        written.append(folded_time)
    weight = "time" if args.profile else f"{result.recorder.unit} count"
    write_flamegraph(svg, root, timed=args.profile, title=f"{args.model} / {args.backend} / {mode} ({weight})")
    written.append(svg)
    print("wrote:")
    for path in written:
        print(f"  {path}")
    if result.recorder.timed:
        print("open the trace in https://ui.perfetto.dev (or chrome://tracing), the SVG in a browser")
    return 0
