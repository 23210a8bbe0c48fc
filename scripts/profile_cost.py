"""What the call-hierarchy profiler costs (figures for README.md): not run by the tests.

1. Runtime: the same compiled tiny Qwen2 (Inductor, training), measured iterations under
   ``torch.profiler`` with the profiler's ranges and runtime module stacks on ("annotating")
   and off ("plain"), in interleaved rounds; the median of the per-round ratios.  Process CPU
   time with one intra-op thread: on a shared machine wall time mostly measures the neighbours.
2. Post-processing: a 24-layer tiny Qwen2 training profile: export + attribution + tree
   (``CallHierarchyProfiler.annotate``) against the wall time of the profiled run (its
   iterations and torch.profiler's own start and stop).

Usage: .venv/bin/python -m scripts.profile_cost [--rounds 7] [--iters 5]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from scripts.hierarchy_profiler import CallHierarchyProfiler, capture, models


def _step(workload: models.Workload, compiled: Callable[..., object]) -> None:
    workload.model.zero_grad(set_to_none=True)
    workload.loss_of(compiled(*workload.args, **workload.kwargs)).backward()


def runtime_overhead(rounds: int, iters: int, layers: int) -> tuple[float, float, float]:
    torch._dynamo.reset()
    workload = models.qwen2(layers=layers)
    workload.model.train(True)
    hp = CallHierarchyProfiler(workload.model)
    times: dict[bool, list[float]] = {True: [], False: []}
    with hp:
        compiled = torch.compile(workload.model)
        for _ in range(3):
            _step(workload, compiled)
        for r in range(rounds):
            for annotate in ((True, False) if r % 2 == 0 else (False, True)):
                capture.ANNOTATE = annotate
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
                    start = time.process_time()
                    for _ in range(iters):
                        _step(workload, compiled)
                    times[annotate].append((time.process_time() - start) / iters)
    capture.ANNOTATE = True
    ratios = [a / p for a, p in zip(times[True], times[False])]
    return statistics.median(times[True]), statistics.median(times[False]), statistics.median(ratios)


def postprocessing(iters: int, layers: int) -> tuple[float, float, int]:
    torch._dynamo.reset()
    workload = models.qwen2(layers=layers)
    workload.model.train(True)
    hp = CallHierarchyProfiler(workload.model)
    with hp:
        compiled = torch.compile(workload.model)
        _step(workload, compiled)
        runs = []
        for again in (False, True):  # twice, the mean: the shared machine's load moves
            prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
            start = time.perf_counter()
            with prof:  # the iterations and the profiler's own start/stop
                for _ in range(iters):
                    _step(workload, compiled)
            runs.append(time.perf_counter() - start)
            if not again:
                start = time.perf_counter()
                result = hp.annotate(prof, iters)
                post_s = time.perf_counter() - start
        run_s = statistics.mean(runs)
    return run_s, post_s, len(result.trace["traceEvents"])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--iters", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    annotated, plain, ratio = runtime_overhead(args.rounds, args.iters, layers=2)
    print(f"runtime: tiny Qwen2 (2 layers) training step under torch.profiler, CPU time: annotating {annotated * 1e3:.2f} ms, "
          f"plain {plain * 1e3:.2f} ms, median ratio of {args.rounds} interleaved rounds {ratio:.3f} "
          f"({100 * (ratio - 1):+.1f}%)")
    run_s, post_s, n = postprocessing(args.iters, layers=24)
    print(f"post-processing: 24-layer tiny Qwen2 training, {args.iters} iterations: profiled run {run_s:.2f} s, "
          f"export + attribution + tree {post_s:.2f} s ({n} trace events; ratio {post_s / run_s:.2f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
