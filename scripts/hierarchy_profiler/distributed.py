"""``--nproc N``: profile the model trained with ``DistributedDataParallel`` (or, with ``--fsdp``, FSDP2)
across N local processes.

Each rank is a process of ``torch.multiprocessing.spawn`` in a gloo (CPU) or NCCL (GPU) process group,
as ``torchrun`` would start it: it builds the same workload (same seed), wraps the model in DDP (or
shards each block and then the model with ``fully_shard`` and compiles each block on its own, the
shape torchtitan trains in: see :func:`blocks_of`), compiles and profiles it with :class:`~.api.CallHierarchyProfiler` exactly as one process does, and
hands back its tree. The parent prints one tree (per scope the median over ranks, then the slowest
rank and its time, see :func:`.tree.merge_ranks`) and each rank's attribution, and writes the
scope table, and folded stacks and a flame graph that carry the rank.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import pickle
import socket
import sys
import tempfile
from pathlib import Path

import torch

from .tree import Scope, format_tree, merge_ranks


@dataclasses.dataclass
class RankResult:
    """What a rank hands back: its tree and its summary lines."""

    rank: int
    root: Scope
    summary: str
    kernel_calls: float  # per iteration
    outside: Scope | None = None  # communication and eager ops outside the compiled graphs


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def blocks_of(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's blocks: the modules of its outermost ``nn.ModuleList``s (a transformer's layers),
    each sharded and compiled on its own with ``--fsdp``."""
    blocks: list[torch.nn.Module] = []
    inside: list[str] = []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.ModuleList) and not any(name.startswith(f"{p}.") for p in inside):
            inside.append(name)
            blocks.extend(module)
    return blocks


def _rank(rank: int, nproc: int, port: int, args: argparse.Namespace, out: str) -> None:
    """One rank: join the group, profile the DDP-wrapped model, write its result to ``out``."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from . import cli, models

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(nproc))
    cuda = torch.cuda.is_available() and torch.cuda.device_count() >= nproc
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=nproc)
    try:
        workload = models.build(args.model)
        blocks = None
        model: torch.nn.Module
        if args.fsdp:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            blocks = blocks_of(workload.model)  # cli.run checked that there are some
            mesh = init_device_mesh("cuda" if cuda else "cpu", (nproc,))
            for block in blocks:
                fully_shard(block, mesh=mesh)
            model = fully_shard(workload.model, mesh=mesh)  # type: ignore[assignment]
        else:
            model = DistributedDataParallel(workload.model, device_ids=[rank] if cuda else None)
        profiled = cli.profile_workload(args, workload, model, blocks)
        if isinstance(profiled, int):
            raise SystemExit(profiled)
        result = profiled[0]
        with open(Path(out) / f"rank{rank}.pkl", "wb") as f:
            pickle.dump(RankResult(rank, result.root, result.summary(), result.root.total_count, result.outside), f)
    finally:
        dist.destroy_process_group()


def run_ranks(args: argparse.Namespace) -> int:
    """``--nproc N``: 0, or 2 with a one-line error."""
    import torch.multiprocessing as mp

    from .api import prepare_out
    from .cli import OUTSIDE_HEADING, _write
    from .output import ranks_root, write_flamegraph, write_ranked_folded, write_scope_table

    with tempfile.TemporaryDirectory(prefix="call_hierarchy_ranks_") as out:
        try:
            mp.spawn(_rank, args=(args.nproc, _free_port(), args, out), nprocs=args.nproc, join=True)
        except mp.ProcessRaisedException as e:
            last = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
            print(f"error: --nproc {args.nproc}: a rank failed: {last}", file=sys.stderr)
            return 2
        except mp.ProcessExitedException as e:
            print(f"error: --nproc {args.nproc}: a rank exited with status {e.exit_code}", file=sys.stderr)
            return 2
        results = {}
        for rank in range(args.nproc):
            with open(Path(out) / f"rank{rank}.pkl", "rb") as f:
                results[rank] = pickle.load(f)
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
