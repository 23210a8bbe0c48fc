"""Profile your own ``torch.compile``'d model by call hierarchy, with ``torch.profiler``.

Example (the CLI, :mod:`.cli`, is built on this)::

    import torch
    from scripts.hierarchy_profiler import CallHierarchyProfiler

    model = MyModel()
    hp = CallHierarchyProfiler(model)
    with hp:                                  # flag, provenance tracking, kernel profiling
        compiled = torch.compile(model)       # default backend (Inductor)
        compiled(x)                           # warm-up: compiles inside `with hp`
        with hp.profile() as prof:            # torch.profiler.profile; annotated on exit
            for _ in range(3):
                compiled(x)
                prof.step()                   # one step per measured iteration
    print(hp.result.format_tree())
    print(hp.result.summary())                # "... attributed to a scope"
    hp.result.save("out")                     # trace.json, folded stacks, flame graph

While ``with hp`` is active: ``torch._dynamo.config.record_call_hierarchy`` is on,
Inductor records kernel provenance (``trace.provenance_tracking_level = 1``) and profiles its
CPU kernels (``cpp.enable_kernel_profile``), PyTorch's compile caches stay on (a hit's graphs
carry their kernels' scopes, patch 0019; an entry written with the flag off is compiled again,
and an AOTAutograd entry with subgraphs is compiled from its FX graph cache entries), and every
graph Inductor compiles
for the default backend goes through :class:`~.capture.Capture`.  Compile inside it: graphs
compiled before are not known (their events are reported as unattributed).  For the
``aot_eager`` backend pass ``backend=hp.backend("aot_eager")`` to ``torch.compile``.
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import gc
import gzip
import os
import re
import shutil
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from . import jsonio
from .annotate import OUTSIDE_GRAPHS, Report, Sample, annotate
from .capture import DYNAMO_RANGE, OUTSIDE_SUFFIX, Capture, CompiledGraph
from .tree import Scope, build_tree, format_tree

BACKENDS = ("inductor", "aot_eager")
UNCAPTURED = ("code compiled before `with hp` (Dynamo reused it, so its graphs were not captured): compile "
              "inside `with hp`, or call torch._dynamo.reset() before it")
OUTPUT_FILES = ("trace.json", "scopes.csv", "hierarchy.folded", "hierarchy_us.folded", "flamegraph.svg")


class ProfileError(Exception):
    """The profile cannot be made or read; the message says why."""


@dataclasses.dataclass
class ProfileResult:
    root: Scope
    report: Report
    trace: dict[str, Any]
    iterations: int
    num_dynamo_graphs: int
    num_compiled_graphs: int
    eager_frames: list[str]
    graphs: list[CompiledGraph] = dataclasses.field(default_factory=list)
    title: str = "call hierarchy profile"
    # the trace parsed as strict JSON (see .jsonio): save() writes it with orjson; set it to False
    # after putting a NaN or an infinity into the trace (orjson would write null)
    strict_json: bool = False
    # wall seconds of post-processing: "export" (torch.profiler's export_chrome_trace), "parse",
    # "attribution" (events to scopes, scope slices), "tree"
    timings: dict[str, float] = dataclasses.field(default_factory=dict)
    # what ran outside the compiled regions, apart from the tree of the compiled graphs' kernels:
    # ``(outside compiled graphs)`` with ``communication`` and ``eager ops`` (None: nothing)
    outside: Scope | None = None
    # AOTAutograd cache hits attributed from the scopes their entries keep, and hits bypassed (their
    # graphs compiled again) because an entry keeps none or has subgraph functions (see Capture)
    aot_cache_hits: int = 0
    bypassed_aot_cache_hits: int = 0

    def format_tree(self, max_depth: int | None = None) -> str:
        return format_tree(self.root, timed=True, max_depth=max_depth, unit="kernel")

    def format_outside(self) -> str:
        """The ops that ran outside the compiled graphs, by kind and name ("" if none ran)."""
        return format_tree(self.outside, timed=True, unit="op") if self.outside is not None else ""

    def summary(self) -> str:
        r = self.report
        line = (f"attributed: {100.0 * r.share:.2f}% of compiled-region kernel self time to a scope "
                f"({r.attributed_self_us / 1000.0 / self.iterations:.3f} of "
                f"{r.compiled_self_us / 1000.0 / self.iterations:.3f} ms per iteration; "
                f"{r.unattributed_events} unattributed kernel call(s) in {r.graph_calls} compiled-graph call(s))")
        device = [s for s in r.samples if s.device]
        if device:
            line += (f"\ndevice: {sum(s.dur_us for s in device) / 1000.0 / self.iterations:.3f} ms per iteration "
                     f"in {len(device)} device kernel(s) launched by those calls (column 'device ms')")
        if r.uncaptured_self_us:
            line += (f"\nnot captured: {r.uncaptured_self_us / 1000.0 / self.iterations:.3f} ms per iteration of "
                     f"ATen ops in {UNCAPTURED}")
        return line

    def to_dataframe(self) -> Any:
        """The tree as a pandas DataFrame, one row per scope (see ``output.SCOPE_COLUMNS``)."""
        from .output import scope_dataframe

        return scope_dataframe(self.root)

    def save(self, out: str | os.PathLike[str]) -> list[Path]:
        """Write trace.json (the annotated profiler trace), the scope table (scopes.csv), folded
        stacks and the flame graph."""
        from .output import write_flamegraph, write_folded, write_scope_table

        out = prepare_out(Path(out))
        written = []
        trace = out / "trace.json"
        trace.write_bytes(jsonio.dumps(self.trace, self.strict_json))
        written.append(trace)
        table = out / "scopes.csv"
        write_scope_table(table, self.root)
        written.append(table)
        folded = out / "hierarchy.folded"
        write_folded(folded, self.root, timed=False, outside=self.outside)
        written.append(folded)
        folded_us = out / "hierarchy_us.folded"
        write_folded(folded_us, self.root, timed=True, outside=self.outside)
        written.append(folded_us)
        svg = out / "flamegraph.svg"
        write_flamegraph(svg, self.root, timed=True, title=self.title)
        written.append(svg)
        return written


def check_out(out: Path) -> None:
    """Refuse an output directory we cannot write, before any work is done."""
    if out.exists() and not out.is_dir():
        raise ProfileError(f"--out {out} exists and is not a directory")
    probe = out
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir():
        raise ProfileError(f"--out {out}: {probe} is not a directory")
    # Create a file there rather than ask os.access: root passes every permission check but
    # not a read-only or virtual file system (/sys, /proc, a read-only mount)
    try:
        with tempfile.NamedTemporaryFile(dir=probe, prefix=".call_hierarchy-probe-"):
            pass
    except OSError as e:
        raise ProfileError(f"--out {out}: {probe} is not writable ({e.strerror or e})") from None


def prepare_out(out: Path) -> Path:
    """Create ``out``; remove this profiler's outputs of an earlier run so none is left mixed in."""
    check_out(out)
    out.mkdir(parents=True, exist_ok=True)
    for name in OUTPUT_FILES:
        (out / name).unlink(missing_ok=True)
    return out


def _dynamo_counters() -> dict[str, dict[str, int]]:
    from torch._dynamo.utils import counters

    return {name: dict(counters[name]) for name in ("frames", "graph_break", "unimplemented", "stats")}


def _dynamo_eager_frames(before: dict[str, dict[str, int]]) -> list[str]:
    """Frames Dynamo gave up on (ran eagerly) since ``before``, with the graph breaks it logged since."""
    now = _dynamo_counters()
    frames, old = now["frames"], before.get("frames", {})
    skipped = (frames.get("total", 0) - old.get("total", 0)) - (frames.get("ok", 0) - old.get("ok", 0))
    out = []
    if skipped > 0:
        def new(counter: str) -> list[str]:
            return [str(k) for k, n in now[counter].items() if n > before.get(counter, {}).get(k, 0)]

        # Dynamo's message for a frame it gave up on ends with the last graph break, naming the frame
        frames = []
        for message in new("unimplemented"):
            m = re.search(r"frame skipped: ([^\n]*)", message)
            if m:
                frames.append(f"{m.group(1).strip()}: {message.rsplit('***', 1)[-1].strip().splitlines()[0]}")
        reasons = frames or [r.splitlines()[0] for r in new("graph_break")]
        label = "frames skipped" if frames else "graph breaks"
        reason = f" ({label}: {'; '.join(reasons[:3])})" if reasons else ""
        out.append(f"{skipped} frame(s) ran eagerly, not compiled{reason}")
    return out


class CallHierarchyProfiler:
    """Turns on what attribution needs, captures compiled graphs, profiles and annotates."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.capture = Capture(model)
        self.result: ProfileResult | None = None
        self.results: list[ProfileResult] = []  # one per trace (schedule cycle) of the last profile()
        self._stack: contextlib.ExitStack | None = None
        self._counters_before: dict[str, dict[str, int]] = {}

    # ---- configuration and capture

    def backend(self, name: str = "inductor") -> Callable[..., Any]:
        """A Dynamo backend for ``torch.compile(backend=...)``: ``inductor`` or ``aot_eager``."""
        if name == "inductor":
            return self.capture.inductor_backend()
        if name == "aot_eager":
            return self.capture.aot_eager_backend()
        raise ProfileError(f"unknown backend {name!r}: use one of {', '.join(BACKENDS)}")

    def __enter__(self) -> CallHierarchyProfiler:
        stack = contextlib.ExitStack()
        stack.enter_context(torch._dynamo.config.patch(record_call_hierarchy=True))
        stack.enter_context(torch._inductor.config.patch({
            "trace.provenance_tracking_level": 1,
            "cpp.enable_kernel_profile": True,
        }))
        stack.enter_context(self.capture.aot_cache_hits())
        stack.enter_context(warnings.catch_warnings())
        warnings.filterwarnings("ignore", message="Your compiler for AOTAutograd is returning a function")
        stack.enter_context(self._default_backend())
        self._counters_before = _dynamo_counters()
        self._stack = stack
        return self

    def __exit__(self, *exc: Any) -> None:
        assert self._stack is not None
        self._stack.close()
        self._stack = None

    @contextlib.contextmanager
    def _default_backend(self) -> Iterator[None]:
        """Route the default backend's ``compile_fx`` (``torch.compile(model)``) through the capture."""
        import torch._inductor.compile_fx as compile_fx_module

        original = compile_fx_module.compile_fx
        capture = self.capture

        def compile_fx(model_: Any, example_inputs_: Any, **kwargs: Any) -> Any:
            if getattr(kwargs.get("inner_compile"), "_call_hierarchy_capture", False):
                return original(model_, example_inputs_, **kwargs)  # already ours (recursive call)
            return capture._compile_inductor(original, model_, example_inputs_, **kwargs)

        compile_fx_module.compile_fx = compile_fx  # type: ignore[assignment]
        try:
            yield
        finally:
            compile_fx_module.compile_fx = original  # type: ignore[assignment]

    # ---- profiling

    @contextlib.contextmanager
    def profile(self, iterations: int | None = None, title: str | None = None,
                **profile_kwargs: Any) -> Iterator[torch.profiler.profile]:
        """``torch.profiler.profile(**profile_kwargs)``; its trace is annotated on exit.

        Times are means over ``iterations`` (default: the number of ``prof.step()`` calls,
        at least 1).  The result is in :attr:`result`.  With a ``schedule``, each trace the
        schedule completes is annotated as it is ready (:attr:`results`, one per cycle;
        :attr:`result` is the last) and times are means over the steps it recorded (its
        ``ProfilerStep#N`` ranges).  An ``on_trace_ready`` handler is called as the profiler
        calls it; a trace it exports (``tensorboard_trace_handler``) is the one annotated, so the
        profiler exports each trace once.  After the profile, ``prof.export_chrome_trace(path)``
        writes the annotated trace of :attr:`result`.
        """
        if self._stack is None:
            raise ProfileError("hp.profile() must be used inside `with hp:` (compile and run the model inside it "
                               "too): it needs what `with hp` turns on and captures")
        user_handler = profile_kwargs.pop("on_trace_ready", None)
        profile_kwargs.setdefault("activities", _activities())
        results: list[ProfileResult] = []
        self.results = results
        scheduled = profile_kwargs.get("schedule") is not None
        errors: list[ProfileError] = []
        files = _TraceFiles()

        def on_trace_ready(prof: torch.profiler.profile) -> None:
            files.ready(prof, user_handler)
            if not scheduled:
                return  # annotated once the profiler has stopped
            try:
                results.append(self._annotate_file(files, iterations, title))
            except ProfileError as e:  # e.g. stopped in a cycle's warm-up: its trace holds no step
                errors.append(e)
                return
            self.result = results[-1]
            files.annotated = self.result

        if not scheduled:
            profile_kwargs["schedule"] = _record_every_step
        prof = torch.profiler.profile(on_trace_ready=on_trace_ready, **profile_kwargs)
        with _frozen_gc(), _custom_ops_recorded(), files.exporting(prof):
            with prof:
                yield prof
            if not scheduled:
                self.result = self._annotate_file(
                    files, iterations if iterations is not None else max(1, prof.step_num), title)
                files.annotated = self.result
                results.append(self.result)
                if iterations is None and prof.step_num == 0:
                    _warn_if_unstepped(self.result)
            elif not results:
                why = f": {errors[-1]}" if errors else " (it stopped before an active step): run more steps"
                raise ProfileError(f"no trace of the profiler's schedule in the {prof.step_num} step(s) run could be "
                                   f"annotated{why}")

    def annotate(self, prof: torch.profiler.profile, iterations: int | None, title: str | None = None) -> ProfileResult:
        """Export ``prof``'s Chrome trace, attribute its events, build the tree.

        ``iterations``: how many iterations the trace holds, for the means; ``None``: its
        ``ProfilerStep#N`` ranges (a profiler with a schedule records them), else 1.
        """
        files = _TraceFiles()
        with files.exporting(prof):
            return self._annotate_file(files, iterations, title)

    def _annotate_file(self, files: _TraceFiles, iterations: int | None, title: str | None) -> ProfileResult:
        """Annotate the trace ``files`` holds (exported by the profiler's export, or now)."""
        # Post-processing allocates many small objects: a process that just compiled a model
        # holds millions of objects, which full collections would scan again and again.
        enabled = gc.isenabled()
        gc.disable()
        try:
            return self._annotate(files, iterations, title)
        finally:
            if _heap_frozen:
                # Inside _frozen_gc, whose end unfreezes everything: what post-processing made (the
                # trace's tens of thousands of dicts) lives as long as the result, so it joins the
                # frozen objects, else the first young collection after gc.enable() scans it all
                # (about 60 ms for a 24-layer model's trace, a fifth of its profiled run).
                gc.freeze()
            if enabled:
                gc.enable()

    def _annotate(self, files: _TraceFiles, iterations: int | None, title: str | None) -> ProfileResult:
        path, export_s = files.take()
        start = time.perf_counter()
        try:
            doc, strict = jsonio.load(path)
        finally:
            path.unlink(missing_ok=True)  # read once: a schedule's cycles would pile up
        timings = {"export": export_s, "parse": time.perf_counter() - start}
        eager = _dynamo_eager_frames(self._counters_before)
        start = time.perf_counter()
        report = annotate(doc, self.capture)
        timings["attribution"] = time.perf_counter() - start
        if iterations is None:
            iterations = report.recorded_steps or 1
        if not report.samples:
            graphs = _dynamo_counters()["stats"].get("unique_graphs", 0) - self._counters_before.get(
                "stats", {}).get("unique_graphs", 0)
            if graphs > 0 and not self.capture.graphs:
                raise ProfileError(
                    f"Dynamo compiled {graphs} graph(s) inside `with hp`, none through the profiler: compile with "
                    "the default backend (torch.compile(model)) or backend=hp.backend('aot_eager'); a backend "
                    "given by name is not captured")
            if report.uncaptured_self_us:
                raise ProfileError(f"no graph compiled inside `with hp` ran: the compiled code that ran is {UNCAPTURED}")
            why = f"; Dynamo: {'; '.join(eager)}" if eager else ""
            raise ProfileError("the compiled graphs ran no kernel or op in the profiled iterations "
                               f"(nothing to attribute){why}")
        _warn_if_another_instance(report, self.capture.scopes.root_label)
        start = time.perf_counter()
        windows = report.step_windows
        root = build_tree(report.samples, iterations, self.capture.scopes.root_label,
                          _steps_of(report.samples, windows, iterations))
        outside = None
        if report.outside:
            outside = build_tree(report.outside, iterations, OUTSIDE_GRAPHS,
                                 _steps_of(report.outside, windows, iterations))
        timings["tree"] = time.perf_counter() - start
        doc["callHierarchy"] = {
            "format": "args.call_hierarchy: scope labels from the model root, outermost first",
            "measured_iterations": iterations,
            "note": f"the trace holds the {iterations} measured iteration(s) after warm-up; "
                    "the printed times are means over them",
            "attributed_share": report.share,
            "eager_frames": eager,
        }
        return ProfileResult(root, report, doc, iterations, self.capture.num_dynamo_graphs,
                             len(self.capture.graphs), eager, list(self.capture.graphs),
                             title or "call hierarchy profile", strict, timings, outside,
                             self.capture.aot_hits, self.capture.bypassed_aot_hits)


class _TraceFiles:
    """The profiler's trace exports during one profile, each exported once.

    ``prof.export_chrome_trace`` is wrapped: an export made while the profiler's trace is ready
    (by a user's ``on_trace_ready`` handler, or by :meth:`take` when none exported) is the
    profiler's own, and a copy (a hard link where it can) is kept to be annotated: the handler
    may remove or compress its file afterwards.  An export outside that, once a trace is
    annotated (after ``hp.profile``: the profiler's trace is already saved), writes the
    annotated trace of :attr:`annotated`.
    """

    def __init__(self) -> None:
        self._original: Callable[..., Any] | None = None  # the profile's own export_chrome_trace
        self._dir = Path()
        self._count = 0
        self._in_handler = False
        self._kept: Path | None = None
        self._export_s = 0.0
        self.annotated: ProfileResult | None = None

    @contextlib.contextmanager
    def exporting(self, prof: torch.profiler.profile) -> Iterator[None]:
        """Wrap ``prof.export_chrome_trace``; the kept copies are removed on exit."""
        self._original = prof.export_chrome_trace  # the bound method
        prof.export_chrome_trace = self.export  # type: ignore[method-assign]
        with tempfile.TemporaryDirectory(prefix="call_hierarchy-") as tmp:
            self._dir = Path(tmp)
            yield

    def export(self, path: str, *args: Any, **kwargs: Any) -> None:
        """``export_chrome_trace``: the profiler's export, a copy kept; or the annotated trace."""
        if not self._in_handler and self.annotated is not None:
            data = jsonio.dumps(self.annotated.trace, self.annotated.strict_json)
            Path(path).write_bytes(gzip.compress(data) if str(path).endswith(".gz") else data)
            return
        assert self._original is not None
        start = time.perf_counter()
        self._original(path, *args, **kwargs)
        self._export_s += time.perf_counter() - start
        self._count += 1
        kept = self._dir / f"trace{self._count}.json"
        try:
            os.link(path, kept)
        except OSError:  # another file system, or no hard links there
            shutil.copyfile(path, kept)
        self._kept = kept

    def ready(self, prof: torch.profiler.profile, handler: Callable[[Any], Any] | None) -> None:
        """The trace is ready: call the user's ``on_trace_ready``, whose export is kept."""
        self._kept = None
        self._export_s = 0.0
        if handler is None:
            return
        self._in_handler = True
        try:
            handler(prof)
        finally:
            self._in_handler = False

    def take(self) -> tuple[Path, float]:
        """The kept export of the ready trace (exported now if no handler did) and its seconds."""
        if self._kept is None:
            self._in_handler = True  # the profiler's own export of this trace
            try:
                self.export(str(self._dir / "export.json"))
            finally:
                self._in_handler = False
            (self._dir / "export.json").unlink()  # its link is kept
        kept, self._kept = self._kept, None
        assert kept is not None
        return kept, self._export_s


# Whether a _frozen_gc froze the heap and will unfreeze it: then post-processing freezes what it
# makes too (see CallHierarchyProfiler._annotate_file).
_heap_frozen = False


@contextlib.contextmanager
def _frozen_gc() -> Iterator[None]:
    """Collect what compiling left (a 24-layer model: about 350,000 objects in cycles, a second
    of full collection) before the profile, and keep the objects alive then out of the
    collections during it and its post-processing: else a full collection in the middle of
    them scans and frees it all.  A process that froze objects itself is left as it is."""
    global _heap_frozen
    if gc.get_freeze_count() or _heap_frozen:
        yield
        return
    gc.collect()
    gc.freeze()
    _heap_frozen = True
    try:
        yield
    finally:
        _heap_frozen = False
        gc.unfreeze()


@contextlib.contextmanager
def _custom_ops_recorded() -> Iterator[None]:
    """Python custom ops (``torch.library.custom_op``) through the dispatcher while profiling.

    PyTorch 2.15 calls them on a fast path that bypasses the C++ dispatcher, and with it the
    profiler's ``RecordFunction``: a call records no event of its own, so the ATen ops its kernel
    runs appear beside the compiled graph's kernels, as if they were kernels of the graph (a
    Mixture-of-Experts model's ``transformers::grouped_mm_fallback`` runs an ``aten::mm`` per
    expert).  Through the dispatcher each call is an event around its ops, attributed as the
    graph's kernel of that op; the same kernel runs, at the dispatcher's cost of a few
    microseconds per call."""
    try:
        from torch._library.custom_ops import OPDEFS
    except ImportError:  # no custom_op, no fast path
        yield
        return
    ops = [d._opoverload for d in list(OPDEFS.values())]
    fast = [op for op in ops if getattr(op, "_is_pyobj_dispatcher_enabled", lambda: False)()]
    for op in fast:
        op._enable_pyobj_dispatch(False)
    try:
        yield
    finally:
        for op in fast:
            op._enable_pyobj_dispatch(True)


def _warn_if_unstepped(result: ProfileResult) -> None:
    """Warn when the profile seems to hold several iterations but no ``prof.step()`` was called.

    Each Dynamo graph run at one module stack (``## call_hierarchy dynamo graph D @ S ##``)
    runs once per iteration in most models: when every one ran more than once, the means
    "per iteration" are likely sums over several.
    """
    runs: dict[str, int] = {}
    for e in result.trace.get("traceEvents", ()):
        name = e.get("name")
        if e.get("ph") == "X" and isinstance(name, str) and DYNAMO_RANGE.match(name):
            runs[name] = runs.get(name, 0) + 1
    if runs and min(runs.values()) > 1:
        warnings.warn(f"hp.profile(): no prof.step() was called, but every compiled graph of the model ran at least "
                      f"{min(runs.values())} times: the times 'per iteration' are totals over them; call prof.step() "
                      "once per iteration, or pass hp.profile(iterations=N)", stacklevel=4)


def _warn_if_another_instance(report: Report, root_label: str) -> None:
    """Warn when the graphs that ran are another instance's of the model's class, not the model's.

    Dynamo graphs of a module that is not the profiled model are outside the model
    (``HNet (outside the model)``): when nothing else ran, the profiled instance did not run.
    """
    label = root_label + OUTSIDE_SUFFIX
    tops = {s.attribution.scope[1] if len(s.attribution.scope) > 1 else "" for s in report.samples}
    if label in tops and all(top.endswith(OUTSIDE_SUFFIX) for top in tops):
        warnings.warn(f"the {root_label} given to CallHierarchyProfiler did not run in the profile: the compiled graphs "
                      f"that ran are another {root_label} instance's (shown as '{label}'); give the profiler the "
                      "instance you compile and run", stacklevel=2)


def _steps_of(samples: list[Sample], windows: list[tuple[float, float]], iterations: int) -> list[int] | None:
    """The measured iteration of each sample, by the ``ProfilerStep#N`` range (of
    :attr:`Report.step_windows`) it started in; ``None`` unless the samples lie in exactly
    ``iterations`` such ranges."""
    starts = [start for start, _ in windows]
    found: list[int] = []
    for sample in samples:
        w = bisect.bisect_right(starts, sample.start_us) - 1
        if w < 0 or sample.start_us > windows[w][1]:
            return None  # outside every step
        found.append(w)
    used = sorted(set(found))
    if len(used) != iterations:
        return None
    index = {w: i for i, w in enumerate(used)}
    return [index[w] for w in found]


def _record_every_step(_step: int) -> torch.profiler.ProfilerAction:
    """torch.profiler's default (record from start to stop), as a schedule: with one it marks
    each ``prof.step()`` with a ``ProfilerStep#N`` range, which tells the iterations apart."""
    return torch.profiler.ProfilerAction.RECORD


def _activities() -> list[torch.profiler.ProfilerActivity]:
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    return activities
