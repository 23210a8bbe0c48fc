"""What the call-hierarchy profiler costs (figures for docs/profiler.md, "Cost"): not run by the tests.

1. Runtime: the same compiled tiny Qwen2 (Inductor, training), measured iterations under
   ``torch.profiler`` with the profiler's ranges and runtime module stacks on ("annotating")
   and off ("plain"), in interleaved rounds; the median of the per-round ratios.  Process CPU
   time with one intra-op thread: on a shared machine wall time mostly measures the neighbours.
2. Post-processing: 24-layer tiny Qwen2 training profiles of ``--profile-iters`` iterations
   (default 10, as the CLI's ``--profile``), with torch's default intra-op threads as the CLI
   (``--threads`` to choose): ``CallHierarchyProfiler.annotate`` (export, parse, attribution,
   tree; its label caches emptied first, as cold as in a CLI run) against the profiled run (its
   iterations and torch.profiler's own start and stop), wall and process CPU time, for each of
   ``--post-rounds`` profiles in one process, with the steps' wall times.  The first profile is
   the CLI's case (one per process); later ones show what profiling again in one process does.

Usage: .venv/bin/python -m scripts.profile_cost [--rounds 7] [--iters 5] [--profile-iters 10] [--post-rounds 3]
       [--threads N]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from collections.abc import Callable

import torch

from scripts.hierarchy_profiler import CallHierarchyProfiler, capture, jsonio, models
from scripts.hierarchy_profiler.api import _frozen_gc


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


@dataclasses.dataclass
class PostProcessing:
    """One profile: its profiled run and its post-processing (wall and process CPU seconds),
    and the steps of post-processing (:attr:`ProfileResult.timings`, wall seconds)."""

    events: int
    run_s: float
    run_cpu: float
    post_s: float
    post_cpu: float
    steps: dict[str, float]

    @property
    def ratio(self) -> float:
        return self.post_s / self.run_s


def postprocessing(iters: int, layers: int, rounds: int) -> list[PostProcessing]:
    """``rounds`` profiles of ``iters`` training steps in one process, each profiled run
    against its post-processing.  The first is what a CLI run makes (one profile per process)."""
    torch._dynamo.reset()
    workload = models.qwen2(layers=layers)
    workload.model.train(True)
    hp = CallHierarchyProfiler(workload.model)
    out: list[PostProcessing] = []
    with hp:
        compiled = torch.compile(workload.model)
        _step(workload, compiled)
        for _ in range(rounds):
            prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
            with _frozen_gc():  # as hp.profile(): what compiling left is collected first
                start, start_cpu = time.perf_counter(), time.process_time()
                with prof:  # the iterations and the profiler's own start/stop
                    for _ in range(iters):
                        _step(workload, compiled)
                run_s, run_cpu = time.perf_counter() - start, time.process_time() - start_cpu
                hp.capture.scopes.clear_caches()  # as cold as the first annotate of a process
                start, start_cpu = time.perf_counter(), time.process_time()
                result = hp.annotate(prof, iters)
                post_s, post_cpu = time.perf_counter() - start, time.process_time() - start_cpu
            out.append(PostProcessing(len(result.trace["traceEvents"]), run_s, run_cpu, post_s, post_cpu,
                                      result.timings))
            del prof, result
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=7, help="interleaved rounds of the runtime figure")
    ap.add_argument("--iters", type=int, default=5, help="training steps per round of the runtime figure")
    ap.add_argument("--profile-iters", type=int, default=10,
                    help="training steps per profile of the post-processing figure (the CLI's default)")
    ap.add_argument("--post-rounds", type=int, default=3, help="profiles of the post-processing figure")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads(),
                    help="intra-op threads of the post-processing figure's runs (default: torch's, as the CLI)")
    args = ap.parse_args()
    for name in ("rounds", "iters", "profile_iters", "post_rounds", "threads"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1")
    torch.set_num_threads(1)
    annotated, plain, ratio = runtime_overhead(args.rounds, args.iters, layers=2)
    print(f"runtime: tiny Qwen2 (2 layers) training step under torch.profiler, CPU time: annotating {annotated * 1e3:.2f} ms, "
          f"plain {plain * 1e3:.2f} ms, median ratio of {args.rounds} interleaved rounds {ratio:.3f} "
          f"({100 * (ratio - 1):+.1f}%)")
    torch.set_num_threads(args.threads)
    profiles = postprocessing(args.profile_iters, 24, args.post_rounds)
    parser = "json" if jsonio.orjson is None else "orjson"
    print(f"post-processing: 24-layer tiny Qwen2 training, {args.profile_iters} iterations, "
          f"{profiles[0].events} trace events, {args.threads} intra-op thread(s); steps: export_chrome_trace / "
          f"parsing it ({parser}) / attribution / tree")
    for i, c in enumerate(profiles):
        steps = " / ".join(f"{c.steps[k]:.3f}" for k in ("export", "parse", "attribution", "tree"))
        print(f"  profile {i + 1}: profiled run {c.run_s:.3f} s wall, {c.run_cpu:.3f} s CPU; post-processing "
              f"{c.post_s:.3f} s wall, {c.post_cpu:.3f} s CPU (ratio {c.ratio:.2f} wall, {c.post_cpu / c.run_cpu:.2f} "
              f"CPU); steps {steps} s")
    ratios = [c.ratio for c in profiles]
    print(f"  wall ratio: first profile of the process (a CLI run) {ratios[0]:.2f}; all: median "
          f"{statistics.median(ratios):.2f}, range {min(ratios):.2f}-{max(ratios):.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
