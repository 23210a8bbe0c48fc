"""``--nproc N``: profile the model trained with ``DistributedDataParallel`` (or, with ``--fsdp``, FSDP2)
across N local processes.

Each rank is a process of ``torch.multiprocessing.spawn`` in a gloo (CPU) or NCCL (GPU) process group,
as ``torchrun`` would start it: it builds the same workload (same seed), wraps the model in DDP (or
shards each block and then the model with ``fully_shard`` and compiles each block on its own, the
shape torchtitan trains in: see :func:`blocks_of`), compiles and profiles it with :class:`~.api.CallHierarchyProfiler` exactly as one process does, and
hands back its tree. The parent prints one tree (per scope the median over ranks, then the slowest
rank and its time, see :func:`.tree.merge_ranks`) and each rank's attribution, and writes the
scope table, and folded stacks and a flame graph that carry the rank (see ``cli.run_distributed``).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import pickle
import socket
import tempfile
from pathlib import Path

import torch

from .tree import Scope


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

    from . import models
    from .profile_model import profile_model

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
        result = profile_model(args, workload, model, blocks)[0]
        with open(Path(out) / f"rank{rank}.pkl", "wb") as f:
            pickle.dump(RankResult(rank, result.root, result.summary(), result.root.total_count, result.outside), f)
    finally:
        dist.destroy_process_group()


def run_ranks(args: argparse.Namespace) -> dict[int, RankResult]:
    """``--nproc N``: each rank's result, or a ``ProfileError`` that says which rank failed and why."""
    import torch.multiprocessing as mp

    from .api import ProfileError

    with tempfile.TemporaryDirectory(prefix="call_hierarchy_ranks_") as out:
        try:
            mp.spawn(_rank, args=(args.nproc, _free_port(), args, out), nprocs=args.nproc, join=True)
        except mp.ProcessRaisedException as e:
            last = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
            raise ProfileError(f"--nproc {args.nproc}: a rank failed: {last}") from None
        except mp.ProcessExitedException as e:
            raise ProfileError(f"--nproc {args.nproc}: a rank exited with status {e.exit_code}") from None
        results = {}
        for rank in range(args.nproc):
            with open(Path(out) / f"rank{rank}.pkl", "rb") as f:
                results[rank] = pickle.load(f)
    return results
