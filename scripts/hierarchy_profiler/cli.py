"""Command line: profile a compiled model by its call hierarchy (RFC-0051) with torch.profiler."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from . import models
from .api import BACKENDS, ProfileError, check_out, prepare_out
from .profile_model import profile_model
from .tree import format_tree, merge_ranks

DESCRIPTION = """\
Compile a model with torch._dynamo.config.record_call_hierarchy on, run it under
torch.profiler, and attribute every kernel of the compiled code (Inductor's generated
kernels, extern kernels and fallbacks; aot_eager's ATen ops) to the model's
module/function call hierarchy.  Prints self/total time per scope and the share of
compiled-region kernel time attributed; writes the profiler's own Chrome trace annotated
with the scopes (open it in https://ui.perfetto.dev), folded stacks and a flame graph."""

OUTSIDE_HEADING = ("outside the compiled graphs' kernels (not in the tree above; self time per iteration): "
                   "communication, torch.compile's runtime, eager ops")

# the repository's build directory, wherever the command runs from
DEFAULT_OUT = Path(__file__).resolve().parents[2] / "build" / "profile_hierarchy"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m scripts.profile_hierarchy", description=DESCRIPTION)
    p.add_argument(
        "--model", default=models.DEFAULT_MODEL,
        help=f"built-in model ({models.describe_builtins()}; default %(default)s) "
        "or 'module:factory' returning a Workload or (module, args[, kwargs])",
    )
    p.add_argument("--backend", choices=BACKENDS, default="inductor",
                   help="inductor: torch.compile's default backend, its generated kernels timed; "
                   "aot_eager: the ATen graphs' ops timed (default %(default)s)")
    p.add_argument("--train", action="store_true",
                   help="forward + backward; backward kernels appear under their forward origin, marked (bw)")
    p.add_argument("--profile", action="store_true",
                   help="time --warmup + --iters iterations (without it: 1 warm-up, 1 profiled iteration)")
    p.add_argument("--warmup", type=int, default=3, help="warm-up iterations with --profile (default %(default)s)")
    p.add_argument("--iters", type=int, default=10, help="measured iterations (default %(default)s with --profile)")
    p.add_argument("--fullgraph", action="store_true", help="compile with fullgraph=True (no graph breaks)")
    p.add_argument("--nproc", type=int, default=1, metavar="N",
                   help="train with DistributedDataParallel across N local processes (gloo on CPU, NCCL on GPU; "
                   "implies --train): one tree, per scope the median over ranks and the slowest rank")
    p.add_argument("--fsdp", action="store_true",
                   help="with --nproc N: shard the model with FSDP2 (fully_shard) instead of DDP, each block "
                   "(every module of the model's nn.ModuleLists) sharded and compiled on its own, as torchtitan "
                   "does; a block's kernels are placed under the block that ran them")
    p.add_argument("--depth", type=int, default=None, help="print the tree down to this depth (at least 1)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT,
                   help="output directory, relative to the current directory (default %(default)s)")
    p.add_argument("--trace", type=Path, nargs="+", default=None, metavar="FILE",
                   help="compile nothing: read FILE, a profiler trace in which PyTorch's inductor_trace_handler "
                   "wrote args.call_hierarchy (any process, record_call_hierarchy and "
                   "trace.provenance_tracking_to_timeline on), and print and write its tree, folded stacks "
                   "and flame graph. Several files or directories (the traces of each rank of a torchrun "
                   "job): one tree, per scope the median over ranks and the slowest rank")
    return p


def validate(args: argparse.Namespace) -> str | None:
    if args.iters < 1:
        return f"--iters must be at least 1 (got {args.iters})"
    if args.warmup < 1:
        return f"--warmup must be at least 1: the first iteration compiles (got {args.warmup})"
    if args.nproc < 1:
        return f"--nproc must be at least 1 (got {args.nproc})"
    if args.fsdp and args.nproc < 2:
        return f"--fsdp shards the model across processes: give --nproc 2 or more (got {args.nproc})"
    if args.depth is not None and args.depth < 1:
        return f"--depth must be at least 1 (got {args.depth})"
    try:
        check_out(args.out)
    except ProfileError as e:
        return str(e)
    return None


def main(argv: list[str] | None = None) -> int:
    try:
        return run(parser().parse_args(argv))
    except KeyboardInterrupt:  # Ctrl-C: the run's state is of no use, a traceback neither
        print("error: interrupted (Ctrl-C); nothing was written", file=sys.stderr)
        return 130


def _trainable(workload: models.Workload) -> bool:
    """Whether ``--train`` has something to differentiate: a parameter or an input that requires grad."""
    inputs = (*workload.args, *workload.kwargs.values())
    return (any(p.requires_grad for p in workload.model.parameters())
            or any(isinstance(x, torch.Tensor) and x.requires_grad for x in inputs))


def run(args: argparse.Namespace) -> int:
    """The command on parsed arguments: 0, or 2 with a one-line error."""
    problem = validate(args)
    if problem is not None:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    if args.trace is not None:
        return run_trace(args)
    try:
        workload = models.build(args.model)
    except models.ModelError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.nproc > 1:
        args.train = True  # DDP trains: its reducer runs in the backward
    if args.train and not _trainable(workload):
        print(f"error: --train: {args.model} has no parameter that requires grad and no input that does: "
              "nothing to differentiate (profile it without --train, or give it an input with requires_grad=True)",
              file=sys.stderr)
        return 2
    if args.nproc > 1:
        from .distributed import blocks_of

        if args.fsdp and not blocks_of(workload.model):
            print(f"error: --fsdp: {args.model} has no nn.ModuleList of blocks to shard and compile on their own",
                  file=sys.stderr)
            return 2
        return run_distributed(args)
    try:
        result, warmup, iters = profile_model(args, workload, workload.model)
    except ProfileError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    model = workload.model
    mode = "train (forward + backward)" if args.train else "inference (no_grad)"

    print(f"model {args.model} ({type(model).__name__}), backend {args.backend}, {mode}")
    print(f"{result.num_dynamo_graphs} Dynamo graph(s) -> {result.num_compiled_graphs} compiled graph(s), "
          f"{result.report.graph_calls // iters} compiled-graph call(s) and "
          f"{round(result.root.total_count)} kernel call(s) per iteration")
    if result.aot_cache_hits or result.bypassed_aot_cache_hits:
        print(f"AOTAutograd cache: {result.aot_cache_hits} hit(s), their kernels' scopes read from the entries, "
              f"{result.bypassed_aot_cache_hits} compiled again (entries without scopes, or with subgraphs)")
    print(f"times: torch.profiler self/total time per scope, mean of {iters} measured iteration(s) "
          f"after {warmup} warm-up")
    for frame in result.eager_frames:
        print(f"warning: Dynamo: {frame}; their ops are not in the tree "
              f"(eager ATen self time outside compiled regions: "
              f"{result.report.eager_self_us / 1000.0 / iters:.3f} ms per iteration)")
    print()
    print(result.format_tree(max_depth=args.depth))
    print()
    if result.outside is not None:
        print(OUTSIDE_HEADING)
        print(result.format_outside())
        print()
    print(result.summary())
    print()
    if not _write(args.out, lambda: result.save(args.out)):
        return 2
    print("open the trace in https://ui.perfetto.dev (or chrome://tracing), the SVG in a browser")
    return 0


def _write(out: Path, save: Callable[[], list[Path]]) -> bool:
    """Run ``save`` and list what it wrote; False with a one-line error if it could not write."""
    try:
        written = save()
    except (OSError, ProfileError) as e:
        print(f"error: cannot write to {out}: {e}", file=sys.stderr)
        return False
    print("wrote:")
    for path in written:
        print(f"  {path}")
    return True


def run_distributed(args: argparse.Namespace) -> int:
    """``--nproc N``: one tree of every rank's profile (see :mod:`.distributed`); 0, or 2 with a one-line error."""
    from .distributed import run_ranks
    from .output import (
        ranks_root,
        write_flamegraph,
        write_ranked_folded,
        write_scope_table,
    )

    try:
        results = run_ranks(args)
    except ProfileError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    trees = {rank: r.root for rank, r in results.items()}
    root = merge_ranks(trees)
    outside = {rank: r.outside for rank, r in results.items() if r.outside is not None}
    wrapper = "FSDP2 (fully_shard), each block compiled," if args.fsdp else "DistributedDataParallel"
    print(f"model {args.model}, backend {args.backend}, train with {wrapper} on {args.nproc} "
          f"processes ({'NCCL' if torch.cuda.is_available() else 'gloo'})")
    print("times: torch.profiler self/total time per scope, per iteration; per scope the median over the ranks, "
          "then the slowest rank and its total")
    print()
    print(format_tree(root, timed=True, max_depth=args.depth))
    print()
    if outside:
        print(OUTSIDE_HEADING)
        print(format_tree(merge_ranks(outside), timed=True))
        print()
    for rank, r in sorted(results.items()):
        print(f"rank {rank}: {r.summary.splitlines()[0]}")
    print()

    def save() -> list[Path]:
        out_dir = prepare_out(args.out)
        written = [out_dir / "scopes.csv", out_dir / "hierarchy.folded", out_dir / "hierarchy_us.folded",
                   out_dir / "flamegraph.svg"]
        write_scope_table(written[0], root)
        write_ranked_folded(written[1], trees, timed=False, outside=outside)
        write_ranked_folded(written[2], trees, timed=True, outside=outside)
        write_flamegraph(written[3], ranks_root(trees), timed=True,
                         title=f"call hierarchy of {args.model} on {args.nproc} ranks")
        return written

    return 0 if _write(args.out, save) else 2


def run_trace(args: argparse.Namespace) -> int:
    """``--trace FILE...``: the tree of standard traces (see :mod:`.standard_trace`); writes no trace."""
    from .output import (
        ranks_root,
        write_flamegraph,
        write_folded,
        write_ranked_folded,
        write_scope_table,
    )
    from .standard_trace import RankedProfile, TraceError, read_traces

    try:
        profile = read_traces(args.trace)
    except TraceError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    named = ", ".join(str(p) for p in args.trace)
    if isinstance(profile, RankedProfile):
        per = "means of the iterations (their ProfilerStep#N ranges)" if profile.stepped else "totals"
        print(f"traces {named}: {len(profile.ranks)} rank(s); kernel events annotated by inductor_trace_handler; "
              f"times: the events' own durations, {per}; per scope the median over the ranks, then the "
              "slowest rank and its time")
    else:
        per = (f"mean of {profile.iterations} iteration(s) (its ProfilerStep#N ranges)" if profile.stepped
               else "totals over the whole trace")
        print(f"trace {named}: kernel events annotated by inductor_trace_handler; times: the events' own "
              f"durations, {per}")
    for warning in profile.warnings():
        print(f"warning: {warning}")
    print()
    print(format_tree(profile.root, timed=True, max_depth=args.depth, unit="kernel"))
    print()
    if isinstance(profile, RankedProfile):
        outside = merge_ranks(profile.outside) if profile.outside else None
    else:
        outside = profile.outside
    if outside is not None:
        print(OUTSIDE_HEADING)
        print(format_tree(outside, timed=True))
        print()
    print(profile.summary())
    print()
    title = f"call hierarchy of {named}"

    def save() -> list[Path]:
        out = prepare_out(args.out)
        written = [out / "scopes.csv", out / "hierarchy.folded", out / "hierarchy_us.folded", out / "flamegraph.svg"]
        write_scope_table(written[0], profile.root)
        if isinstance(profile, RankedProfile):
            write_ranked_folded(written[1], profile.ranks, timed=False, outside=profile.outside)
            write_ranked_folded(written[2], profile.ranks, timed=True, outside=profile.outside)
            write_flamegraph(written[3], ranks_root(profile.ranks), timed=True, title=title)
        else:
            write_folded(written[1], profile.root, timed=False, outside=profile.outside)
            write_folded(written[2], profile.root, timed=True, outside=profile.outside)
            write_flamegraph(written[3], profile.root, timed=True, title=title)
        return written

    return 0 if _write(args.out, save) else 2
