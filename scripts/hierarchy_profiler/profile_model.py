"""What the command runs for a model, in its process or on each rank of ``--nproc``: compile it, warm it
up and profile the measured iterations with :class:`~.api.CallHierarchyProfiler`."""

from __future__ import annotations

import argparse
import sys
from typing import Any, TextIO

import torch

from .api import CallHierarchyProfiler, ProfileError, ProfileResult
from .models import ModelError, Workload


def _progress(phase: str, done: int, total: int, stream: TextIO = sys.stderr) -> None:
    bar = "#" * (20 * done // max(total, 1))
    stream.write(f"\r{phase:<9} [{bar:<20}] {done}/{total}")
    if done == total:
        stream.write("\n")
    stream.flush()


def profile_model(args: argparse.Namespace, workload: Workload, model: torch.nn.Module,
                  blocks: list[torch.nn.Module] | None = None) -> tuple[ProfileResult, int, int]:
    """Compile ``model`` (the workload's model, or a wrapper of it such as DDP's), run the warm-up and
    profile the measured iterations, as ``args`` (the command line) say: the result and the numbers of
    warm-up and measured iterations, or a ``ProfileError`` that says what went wrong.  With
    ``blocks``, each block is compiled in place (``nn.Module.compile``) and ``model`` runs as it is."""
    warmup = args.warmup if args.profile else 1
    iters = args.iters if args.profile else 1
    workload.model.train(args.train)
    mode = "train (forward + backward)" if args.train else "inference (no_grad)"
    torch._dynamo.reset()
    hp = CallHierarchyProfiler(model)

    def iteration(compiled: Any) -> None:
        if args.train:
            workload.model.zero_grad(set_to_none=True)
            output = compiled(*workload.args, **workload.kwargs)
            workload.loss_of(output).backward()
        else:
            with torch.no_grad():
                compiled(*workload.args, **workload.kwargs)

    title = f"{args.model} / {args.backend} / {mode}"
    try:
        with hp:
            # the default backend: torch.compile's own, routed through the profiler
            backend = "inductor" if args.backend == "inductor" else hp.backend(args.backend)
            compiled: Any
            if blocks is not None:
                for block in blocks:
                    block.compile(backend=backend, fullgraph=args.fullgraph)
                compiled = model
            else:
                compiled = torch.compile(model, backend=backend, fullgraph=args.fullgraph)
            for i in range(warmup):
                iteration(compiled)
                if args.profile:
                    _progress("warm-up", i + 1, warmup)
            with hp.profile(iterations=iters, title=title) as prof:
                for i in range(iters):
                    with torch.profiler.record_function(f"## call_hierarchy iteration {i} ##"):
                        iteration(compiled)
                    prof.step()
                    if args.profile:
                        _progress("measure", i + 1, iters)
    except ModelError as e:
        raise ProfileError(str(e)) from None
    except torch._dynamo.exc.Unsupported as e:  # only fullgraph=True lets a graph break out of Dynamo
        if not args.fullgraph:
            raise
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ProfileError(f"--fullgraph: {args.model} has a graph break ({first}); profile it without --fullgraph "
                           "(each graph's scopes are still kept)") from None
    result = hp.result
    assert result is not None
    return result, warmup, iters
