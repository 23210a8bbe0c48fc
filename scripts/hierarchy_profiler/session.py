"""Compile a workload, run warm-up and measured iterations, return what was recorded."""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import warnings
from collections.abc import Callable, Iterator
from typing import Any, TextIO

import torch

from .capture import Recorder, RuntimeScopes, aot_eager_backend
from .models import Workload

BACKENDS = ("aot_eager", "inductor")


@dataclasses.dataclass
class Options:
    backend: str = "aot_eager"
    train: bool = False
    warmup: int = 1
    iters: int = 1
    fullgraph: bool = False


@dataclasses.dataclass
class Result:
    recorder: Recorder
    options: Options

    @property
    def iterations(self) -> list[Any]:
        return self.recorder.iterations


def progress(phase: str, stream: TextIO = sys.stderr) -> Callable[[int, int], None]:
    def update(done: int, total: int) -> None:
        bar = "#" * (20 * done // max(total, 1))
        stream.write(f"\r{phase:<9} [{bar:<20}] {done}/{total}")
        if done == total:
            stream.write("\n")
        stream.flush()

    return update


@contextlib.contextmanager
def _recording_config(backend: str) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch._dynamo.config.patch(record_call_hierarchy=True))
        stack.enter_context(warnings.catch_warnings())
        # TimedGraph takes boxed and unboxed inputs; a lazily compiled backward
        # reaches it through a wrapper that hides ``_boxed_call``.
        warnings.filterwarnings("ignore", message="Your compiler for AOTAutograd is returning a function")
        if backend == "inductor":
            from .inductor import inductor_config

            stack.enter_context(inductor_config())
        yield


def make_backend(name: str, recorder: Recorder) -> Callable[..., Any]:
    if name == "aot_eager":
        return aot_eager_backend(recorder)
    if name == "inductor":
        from .inductor import inductor_backend

        return inductor_backend(recorder)
    raise ValueError(f"unknown backend {name!r}: use one of {', '.join(BACKENDS)}")


def run(workload: Workload, options: Options, show_progress: bool = False) -> Result:
    """Compile ``workload.model`` and run ``options.warmup`` + ``options.iters`` iterations.

    The first warm-up iteration compiles.  Only the measured iterations are recorded.
    """
    if options.warmup < 1 or options.iters < 1:
        raise ValueError("--warmup and --iters must be at least 1")
    torch._dynamo.reset()
    model = workload.model
    model.train(options.train)
    recorder = Recorder(RuntimeScopes(model))
    compiled = torch.compile(model, backend=make_backend(options.backend, recorder), fullgraph=options.fullgraph)

    def iteration() -> None:
        if options.train:
            model.zero_grad(set_to_none=True)
            output = compiled(*workload.args, **workload.kwargs)
            workload.loss_of(output).backward()
        else:
            with torch.no_grad():
                compiled(*workload.args, **workload.kwargs)

    with _recording_config(options.backend):
        for phase, count, record in (("warm-up", options.warmup, False), ("measure", options.iters, True)):
            update = progress(phase) if show_progress else None
            recorder.recording = record
            for i in range(count):
                if record:
                    recorder.start_iteration()
                iteration()
                if update is not None:
                    update(i + 1, count)
        recorder.recording = False
    return Result(recorder, options)
