"""What the call-hierarchy profiler costs (figures for README.md): not run by the tests.

1. Runtime: the same compiled tiny Qwen2 (Inductor, training), measured iterations under
   ``torch.profiler`` with the profiler's ranges and runtime module stacks on ("annotating")
   and off ("plain"), in interleaved rounds; the median of the per-round ratios.  Process CPU
   time with one intra-op thread: on a shared machine wall time mostly measures the neighbours.
2. Post-processing: a 24-layer tiny Qwen2 training profile: export + attribution + tree
   (``CallHierarchyProfiler.annotate``) against the profiled run (its iterations and
   torch.profiler's own start and stop), wall and process CPU time; then, on a second profile
   of the same run, CPU time of each step: the profiler's JSON export, parsing it back,
   attribution + tree.

Usage: .venv/bin/python -m scripts.profile_cost [--rounds 7] [--iters 5]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from scripts.hierarchy_profiler import CallHierarchyProfiler, capture, jsonio, models
from scripts.hierarchy_profiler.annotate import annotate
from scripts.hierarchy_profiler.tree import build_tree


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


def steps(hp: CallHierarchyProfiler, prof: torch.profiler.profile, iters: int) -> tuple[float, float, float]:
    """CPU seconds of the steps of ``hp.annotate``: export, parse, attribution + tree."""
    scopes = hp.capture.scopes
    for cache in (scopes._memo, scopes._entries, scopes._rebased):
        cache.clear()  # as cold as for the first annotate
    gc.disable()  # as annotate does
    try:
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "trace.json"
            t0 = time.process_time()
            prof.export_chrome_trace(str(path))
            t1 = time.process_time()
            doc, _strict = jsonio.load(path)
            t2 = time.process_time()
        report = annotate(doc, hp.capture)
        build_tree(report.samples, iters, hp.capture.scopes.root_label)
        t3 = time.process_time()
    finally:
        gc.enable()
    return t1 - t0, t2 - t1, t3 - t2


def postprocessing(iters: int, layers: int) -> dict[str, float]:
    """Wall and CPU seconds of the profiled run (mean of two) and of its post-processing."""
    torch._dynamo.reset()
    workload = models.qwen2(layers=layers)
    workload.model.train(True)
    hp = CallHierarchyProfiler(workload.model)
    out: dict[str, float] = {}
    with hp:
        compiled = torch.compile(workload.model)
        _step(workload, compiled)
        runs, run_cpus = [], []
        for again in (False, True):  # twice, the mean: the shared machine's load moves
            prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
            start, start_cpu = time.perf_counter(), time.process_time()
            with prof:  # the iterations and the profiler's own start/stop
                for _ in range(iters):
                    _step(workload, compiled)
            runs.append(time.perf_counter() - start)
            run_cpus.append(time.process_time() - start_cpu)
            if not again:
                start, start_cpu = time.perf_counter(), time.process_time()
                result = hp.annotate(prof, iters)
                out["post_s"], out["post_cpu"] = time.perf_counter() - start, time.process_time() - start_cpu
            else:
                out["export_cpu"], out["parse_cpu"], out["attribution_cpu"] = steps(hp, prof, iters)
        out["run_s"], out["run_cpu"] = statistics.mean(runs), statistics.mean(run_cpus)
    out["events"] = len(result.trace["traceEvents"])
    return out


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
    c = postprocessing(args.iters, layers=24)
    print(f"post-processing: 24-layer tiny Qwen2 training, {args.iters} iterations, {c['events']:.0f} trace events: "
          f"profiled run {c['run_s']:.3f} s wall, {c['run_cpu']:.3f} s CPU; export + attribution + tree "
          f"{c['post_s']:.3f} s wall, {c['post_cpu']:.3f} s CPU (ratio {c['post_s'] / c['run_s']:.2f} wall, "
          f"{c['post_cpu'] / c['run_cpu']:.2f} CPU)")
    parser = "json" if jsonio.orjson is None else "orjson"
    print(f"post-processing steps (second profile, CPU): export_chrome_trace {c['export_cpu']:.3f} s, "
          f"parsing it ({parser}) {c['parse_cpu']:.3f} s, attribution + tree {c['attribution_cpu']:.3f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
