"""The scope tree of a standard profiler trace, written by any process.

With ``torch._dynamo.config.record_call_hierarchy`` and
``torch._inductor.config.trace.provenance_tracking_to_timeline`` on, PyTorch's own
``torch._inductor.profiler.inductor_trace_handler`` (with the series' patch 0019) writes each
compiled kernel's scope into its event: ``args["call_hierarchy"]``, a list of ``dict(entry)``,
outermost first, relative to the frame Dynamo compiled (``args["call_hierarchy_sources"]`` for a
kernel fused across scopes). Such a trace, from any process, is read here with no capture of
the compile: each event that has the key is a kernel call in its scope. Device kernels count apart from the
host's calls (``<kernel> [device]``); a host kernel call inside ``CompiledFunctionBackward``,
or a device kernel launched from one, is marked `` (bw)``.

What such a trace does not say, this profiler's own capture adds (``CallHierarchyProfiler``):
the module stack that a graph shared by several call sites ran under (the trace has its scopes
relative to the compiled frame), which branch of a ``cond`` ran, the eager ops of compiled
frames, and the compiled-region time no kernel event covers.
"""

from __future__ import annotations

import bisect
import dataclasses
import re
import statistics
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from . import jsonio
from .annotate import OUTSIDE_GRAPHS, Attribution, Sample, _nest, outside_samples
from .tree import Scope, build_tree, merge_ranks, merge_trees

# Inductor's C++ kernel events (cpp.enable_kernel_profile) are named graph_<id>_<kernel>
_GRAPH_PREFIX = re.compile(r"^graph_\d+_")
COMPILED_FRAME = "(compiled frame)"


class TraceError(Exception):
    """The trace cannot be read as a call-hierarchy profile; the message says why."""


@dataclasses.dataclass
class TraceProfile:
    root: Scope
    iterations: int
    kernel_calls: int  # host kernel calls with a call hierarchy, all iterations
    device_kernels: int
    # kernel events of compiled graphs that have no call hierarchy: Inductor C++ kernels
    # (graph_N_*) and device kernels launched inside a compiled region
    without_hierarchy: int
    # whether the iterations are the trace's ProfilerStep#N ranges (False: one, the whole trace)
    stepped: bool = True
    # the process's rank in a distributed job (the trace's distributedInfo), None outside one
    rank: int | None = None
    # the process that wrote the trace (host name, pid of its ops), None if it has no op
    process: tuple[Any, Any] | None = None
    # communication and eager ops outside the compiled regions (see annotate.outside_samples)
    outside: Scope | None = None
    # compiled frames (Dynamo's "F/C" id) entered more than once per iteration: runs per iteration
    repeated_frames: dict[str, float] = dataclasses.field(default_factory=dict)
    # host kernel calls of FSDP2 blocks' own compiled frames placed under the block that ran them (see _FsdpBlocks)
    placed_in_blocks: int = 0

    def summary(self) -> str:
        per = self.iterations
        line = (f"{self.kernel_calls / per:g} host kernel call(s) per iteration with a call hierarchy, "
                f"{self.device_kernels / per:g} device kernel(s), over {per} iteration(s) (scopes relative to the compiled frames)")
        if self.without_hierarchy:
            line += (f"\n{self.without_hierarchy} kernel event(s) of compiled graphs have no call hierarchy "
                     f"({NO_SCOPE_CAUSES})")
        return line

    def to_dataframe(self) -> Any:
        """The tree as a pandas DataFrame, one row per scope (see ``output.SCOPE_COLUMNS``)."""
        from .output import scope_dataframe

        return scope_dataframe(self.root)

    def warnings(self) -> list[str]:
        """What the reader of the tree must know about its figures."""
        found = [] if self.stepped else [(
            "the trace has no ProfilerStep#N range around its kernels (profile with a "
            "torch.profiler.schedule, or call prof.step() each iteration): the times are totals over the "
            "whole trace, not means per iteration")]
        return found + repeated_frames_warning(self.repeated_frames, self.placed_in_blocks)


def repeated_frames_warning(repeated: dict[str, float], placed: int = 0) -> list[str]:
    """Say where the kernels of FSDP2 blocks' own compiled frames were placed, or that a compiled frame
    run several times per iteration may be several call sites, merged."""
    runs = ", ".join(f"{frame} {n:g} times" for frame, n in sorted(repeated.items()))
    if placed:
        entered = f"compiled frame(s) entered more than once per iteration ({runs}): " if repeated else ""
        return [(f"{entered}scopes relative to FSDP2 blocks compiled on their own: each kernel call is placed under "
                 f"the FSDP2 block whose FSDP::pre_forward or FSDP::pre_backward range comes last before it on its "
                 f"thread, '<block> (FSDP block)' ({placed} kernel call(s))")]
    if not repeated:
        return []
    return [(f"compiled frame(s) entered more than once per iteration ({runs}): if those are different call sites "
             "(each block compiled on its own, as with FSDP2), the trace does not say which ran each kernel, and "
             "their kernels are merged under the frame's relative scopes; CallHierarchyProfiler (the main command, "
             "--nproc N --fsdp) places each run under the module stack it ran under")]


# FSDP2's ranges around a block's hooks: ``FSDP::pre_forward (layers.0)``, ``FSDP::post_backward_reshard
# (layers.0)``; a block's forward and backward run between its pre_ and post_ ranges
_FSDP_HOOK = re.compile(r"^FSDP::(pre|post)_\w+ \((.+)\)$")


class _FsdpBlocks:
    """The FSDP2 block each host thread is in, from FSDP2's hook ranges: after a block's
    ``pre_forward``/``pre_backward`` range and before the next hook range of any block, the thread
    runs that block's forward or backward."""

    def __init__(self, events: list[dict[str, Any]]) -> None:
        marks: dict[Any, list[tuple[float, str | None]]] = defaultdict(list)
        for e in events:
            if e.get("ph") == "X":
                m = _FSDP_HOOK.match(str(e.get("name", "")))
                if m:
                    marks[e.get("tid")].append((float(e["ts"]), m.group(2) if m.group(1) == "pre" else None))
        self.starts = {tid: sorted(ms, key=lambda m: m[0]) for tid, ms in marks.items()}
        self.times = {tid: [t for t, _ in ms] for tid, ms in self.starts.items()}
        self.names = {name for ms in self.starts.values() for _, name in ms if name is not None}

    def __bool__(self) -> bool:
        return bool(self.starts)

    def block_at(self, tid: Any, ts: float) -> str | None:
        times = self.times.get(tid)
        if not times:
            return None
        i = bisect.bisect_right(times, ts) - 1
        return self.starts[tid][i][1] if i >= 0 else None

    def named_in(self, events: list[dict[str, Any]]) -> bool:
        """Whether a kernel's call hierarchy names a block (a module entry at its path or inside it):
        its compiled frame is the whole model's, whose scopes name the blocks already."""
        prefixes = tuple(f"{name}." for name in self.names)
        for e in events:
            hierarchy = (e.get("args") or {}).get("call_hierarchy")
            for entry in hierarchy if isinstance(hierarchy, list) else ():
                path = entry.get("path") if isinstance(entry, dict) else None
                if isinstance(path, str) and (path in self.names or path.startswith(prefixes)):
                    return True
        return False


_FRAME_REGION = re.compile(r"^Torch-Compiled Region: (\d+/\d+)$")


def _repeated_frames(events: list[dict[str, Any]], steps: list[tuple[float, float]] | None,
                     iterations: int) -> dict[str, float]:
    """Compiled frames entered more than once per iteration (within ``steps``, if given)."""
    counts: dict[str, int] = defaultdict(int)
    for e in events:
        if e.get("ph") != "X":
            continue
        m = _FRAME_REGION.match(str(e.get("name", "")))
        if m and (steps is None or _within(steps, float(e["ts"])) >= 0):
            counts[m.group(1)] += 1
    return {frame: n / iterations for frame, n in counts.items() if n > iterations}


# Why kernel events of compiled graphs can lack a call hierarchy, whatever the flags are now.
NO_SCOPE_CAUSES = (
    "record_call_hierarchy or trace.provenance_tracking_to_timeline off when the graphs were compiled; graphs "
    "loaded from a warm FX-graph or AOTAutograd cache entry written with record_call_hierarchy off (the flag is "
    "not part of the cache key: run once with TORCHINDUCTOR_FX_GRAPH_CACHE=0 TORCHINDUCTOR_AUTOGRAD_CACHE=0); "
    "a trace written after the compiled graphs were freed (inductor_trace_handler reads the hierarchies of live "
    "graphs); or kernels the handler does not match (kernels replayed inside CUDA graphs)")


def scope_labels(call_hierarchy: Sequence[Any]) -> tuple[str, ...]:
    """Labels of a ``call_hierarchy`` of ``dict(entry)``s, as
    ``torch.fx.call_hierarchy.format_call_hierarchy`` labels the entries."""
    from torch.fx.call_hierarchy import ModuleCallEntry, call_hierarchy_from_dicts

    try:
        entries = call_hierarchy_from_dicts(call_hierarchy)
    except (ValueError, AttributeError, TypeError) as e:
        raise TraceError(f"an args.call_hierarchy is not a list of call_hierarchy entries: {e}") from None
    labels = []
    parent_path = ""
    for entry in entries:
        labels.append(entry.label(parent_path))
        if isinstance(entry, ModuleCallEntry):
            parent_path = entry.path
    return tuple(labels)


def _ranges(events: list[dict[str, Any]], name: str | re.Pattern[str]) -> dict[Any, list[tuple[float, float]]]:
    """(start, end) of the complete events named ``name`` (or matching it), per thread, by start."""
    out: dict[Any, list[tuple[float, float]]] = defaultdict(list)
    for e in events:
        n = e.get("name", "")
        if e.get("ph") == "X" and (n == name if isinstance(name, str) else name.match(n)):
            out[e.get("tid")].append((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0))))
    for spans in out.values():
        spans.sort()
    return out


def _within(spans: list[tuple[float, float]], ts: float) -> int:
    """The index of the span that holds ``ts`` (spans do not overlap), or -1."""
    i = bisect.bisect_right(spans, (ts, float("inf"))) - 1
    return i if i >= 0 and spans[i][0] <= ts <= spans[i][1] else -1


def read_trace(path: str | Path) -> TraceProfile:
    """The scope tree of the trace at ``path`` (JSON, or gzip as ``use_gzip=True`` writes it)."""
    try:
        doc, _ = jsonio.load(path)
    except (OSError, ValueError) as e:
        raise TraceError(f"--trace {path}: cannot read a JSON trace ({e})") from None
    events = doc.get("traceEvents") if isinstance(doc, dict) else None
    if not isinstance(events, list):
        raise TraceError(f"--trace {path}: not a Chrome trace (no traceEvents list)")
    if isinstance(doc.get("callHierarchy"), dict):
        raise TraceError(f"--trace {path} is this profiler's annotated trace.json, whose tree it printed when it "
                         "wrote it; --trace reads a trace written by torch.profiler's on_trace_ready handlers")
    profile = profile_from_events(events)
    info = doc.get("distributedInfo")
    if isinstance(info, dict) and isinstance(info.get("rank"), int):
        profile.rank = info["rank"]
    op = next((e for e in events if e.get("cat") == "cpu_op"), None)
    if op is not None:
        profile.process = (doc.get("host_name"), op.get("pid"))
    return profile


# The names torch.profiler's handlers give trace files (tensorboard_trace_handler: .pt.trace.json[.gz]).
TRACE_SUFFIXES = (".json", ".json.gz")


def trace_files(paths: Sequence[str | Path]) -> list[Path]:
    """The trace files named: a file, or a directory's ``*.json`` and ``*.json.gz`` files (one or
    more per rank, as ``inductor_trace_handler`` or ``tensorboard_trace_handler`` write them on
    each rank of a ``torchrun`` job)."""
    files: list[Path] = []
    for path in map(Path, paths):
        if path.is_dir():
            found = sorted(p for p in path.iterdir() if p.is_file() and p.name.endswith(TRACE_SUFFIXES))
            if not found:
                raise TraceError(f"--trace {path}: a directory with no trace file (*.json, *.json.gz) in it")
            files += found
        else:
            files.append(path)
    return list(dict.fromkeys(files))


@dataclasses.dataclass
class RankedProfile:
    """The traces of a distributed run: each rank's profile (several traces of one rank, such as
    those of a schedule's ``repeat``, are averaged) and their tree (per scope the median over
    ranks, and the slowest rank)."""

    ranks: dict[int, Scope]
    root: Scope
    traces: int
    kernel_calls: dict[int, float]  # host kernel calls per iteration with a call hierarchy, per rank
    without_hierarchy: int
    stepped: bool
    # each rank's communication and eager ops outside the compiled regions
    outside: dict[int, Scope] = dataclasses.field(default_factory=dict)
    # compiled frames entered more than once per iteration, on some rank (the most runs)
    repeated_frames: dict[str, float] = dataclasses.field(default_factory=dict)
    placed_in_blocks: int = 0  # host kernel calls placed under an FSDP2 block, all traces

    def summary(self) -> str:
        calls = ", ".join(f"rank {r}: {n:g}" for r, n in sorted(self.kernel_calls.items()))
        line = (f"{self.traces} trace(s) of {len(self.ranks)} rank(s); host kernel calls per iteration with a "
                f"call hierarchy: {calls} (scopes relative to the compiled frames)")
        if self.without_hierarchy:
            line += (f"\n{self.without_hierarchy} kernel event(s) of compiled graphs have no call hierarchy "
                     f"({NO_SCOPE_CAUSES})")
        return line

    def to_dataframe(self) -> Any:
        """The tree as a pandas DataFrame, one row per scope (see ``output.SCOPE_COLUMNS``)."""
        from .output import scope_dataframe

        return scope_dataframe(self.root)

    def warnings(self) -> list[str]:
        found = [] if self.stepped else [(
            "a trace has no ProfilerStep#N range around its kernels: its times are totals over the whole trace, "
            "not means per iteration")]
        return found + repeated_frames_warning(self.repeated_frames, self.placed_in_blocks)


def read_traces(paths: Sequence[str | Path]) -> TraceProfile | RankedProfile:
    """One trace's profile, or the profile of several: one per rank (the trace's
    ``distributedInfo.rank``; outside a distributed job, one per process that wrote traces, in the
    order of the files), several traces of a rank (a schedule's ``repeat``) averaged."""
    files = trace_files(paths)
    if len(files) == 1:
        return read_trace(files[0])
    profiles = [read_trace(f) for f in files]
    known = all(p.rank is not None for p in profiles)
    by_rank: dict[int, list[TraceProfile]] = defaultdict(list)
    processes: dict[Any, int] = {}
    for i, profile in enumerate(profiles):
        if known and profile.rank is not None:
            by_rank[profile.rank].append(profile)
        else:
            process = profile.process if profile.process is not None else ("file", i)
            by_rank[processes.setdefault(process, len(processes))].append(profile)
    trees = {rank: merge_trees([p.root for p in ps], statistics.mean) if len(ps) > 1 else ps[0].root
             for rank, ps in by_rank.items()}
    calls = {rank: statistics.mean(p.kernel_calls / p.iterations for p in ps) for rank, ps in by_rank.items()}
    outside = {}
    for rank, ps in by_rank.items():
        found = [p.outside for p in ps if p.outside is not None]
        if found:
            outside[rank] = merge_trees(found, statistics.mean) if len(found) > 1 else found[0]
    repeated: dict[str, float] = {}
    for p in profiles:
        for frame, n in p.repeated_frames.items():
            repeated[frame] = max(n, repeated.get(frame, 0.0))
    return RankedProfile(trees, merge_ranks(trees), len(files), calls,
                         sum(p.without_hierarchy for p in profiles), all(p.stepped for p in profiles), outside,
                         repeated, sum(p.placed_in_blocks for p in profiles))


def profile_from_events(events: list[dict[str, Any]]) -> TraceProfile:
    """The scope tree of the events that have ``args.call_hierarchy``; iterations are the
    ``ProfilerStep#N`` ranges that hold them (one if there are none)."""
    steps = [span for spans in _ranges(events, re.compile(r"ProfilerStep#\d+$")).values() for span in spans]
    steps.sort()
    backward = _ranges(events, "CompiledFunctionBackward")
    regions = _ranges(events, re.compile(r"Torch-Compiled Region|CompiledFunctionBackward$"))
    # a device kernel's launch (same args.correlation) says where and when the host ran it
    launches = {(e.get("args") or {}).get("correlation"): e for e in events
                if e.get("ph") == "X" and e.get("cat") in ("cuda_runtime", "cuda_driver")
                and (e.get("args") or {}).get("correlation") is not None}
    samples: list[Sample] = []
    step_of: list[int] = []
    labels: dict[tuple[Any, ...], tuple[str, ...]] = {}
    without = 0
    # A frame compiled for an FSDP2 block (one for every block, or one per block class) has scopes
    # relative to the block, which FSDP2's hook ranges name; never placed where the scopes name the
    # blocks already (a whole-model compile), unless a frame repeats (then it is a block's)
    blocks = _FsdpBlocks(events)
    if blocks and not _repeated_frames(events, steps or None, max(len(steps), 1)) and blocks.named_in(events):
        blocks = _FsdpBlocks([])
    placed = 0
    for e in events:
        if e.get("ph") != "X":
            continue
        args = e.get("args") or {}
        device = e.get("cat") == "kernel"
        host = launches.get(args.get("correlation")) if device else e
        tid, ts = (host.get("tid"), float(host["ts"])) if host is not None else (None, float(e["ts"]))
        hierarchy = args.get("call_hierarchy")
        if not isinstance(hierarchy, list):
            if _GRAPH_PREFIX.match(e.get("name", "")) or (device and _within(regions.get(tid, []), ts) >= 0):
                without += 1
            continue
        block = blocks.block_at(tid, ts) if blocks else None
        key = (block, *map(str, hierarchy))
        scope = labels.get(key)
        if scope is None:
            scope = labels[key] = scope_labels(hierarchy)
            if block is not None:
                scope = labels[key] = (f"{block} (FSDP block)", *scope)
        if block is not None and not device:
            placed += 1
        kernel = _GRAPH_PREFIX.sub("", e.get("name", ""))
        is_backward = _within(backward.get(tid, []), ts) >= 0
        recompute = is_backward and bool(args.get("call_hierarchy_recomputed"))
        if is_backward:
            kernel += " (re)" if recompute else " (bw)"
        if device:
            kernel += " [device]"
        dur = float(e.get("dur", 0))
        samples.append(Sample(Attribution(scope, kernel, is_backward, recompute=recompute), dur, dur, device, ts))
        step_of.append(_within(steps, ts))
    if not samples:
        if without:
            raise TraceError(f"no event of the trace has args.call_hierarchy, but {without} kernel event(s) of "
                             f"compiled graphs are in it. Possible causes: {NO_SCOPE_CAUSES}")
        raise TraceError("no event of the trace has args.call_hierarchy: profile with "
                         "torch._dynamo.config.record_call_hierarchy = True and "
                         "torch._inductor.config.trace.provenance_tracking_to_timeline = True, and write the "
                         "trace with torch._inductor.profiler.inductor_trace_handler")
    measured = [i for i in step_of if i >= 0]
    if steps and measured:
        # only the steps that ran compiled kernels are iterations of the profile
        used = sorted(set(measured))
        index = {s: i for i, s in enumerate(used)}
        kept = [(s, index[i]) for s, i in zip(samples, step_of) if i >= 0]
        samples = [s for s, _ in kept]
        iterations, by_step = len(used), [i for _, i in kept]
    else:
        iterations, by_step = 1, None
    root = build_tree(samples, iterations, COMPILED_FRAME, by_step)
    host_calls = sum(1 for s in samples if not s.device)
    outside = outside_samples(_nest(events), set())
    if by_step is not None:  # the ops of the iterations the tree holds
        outside_steps = [index.get(_within(steps, s.start_us), -1) for s in outside]
        outside = [s for s, i in zip(outside, outside_steps) if i >= 0]
        outside_by_step: list[int] | None = [i for i in outside_steps if i >= 0]
    else:
        outside_by_step = None
    outside_root = build_tree(outside, iterations, OUTSIDE_GRAPHS, outside_by_step) if outside else None
    used_steps = [steps[i] for i in sorted(index)] if by_step is not None else None
    return TraceProfile(root, iterations, host_calls, len(samples) - host_calls, without, by_step is not None,
                        outside=outside_root, repeated_frames=_repeated_frames(events, used_steps, iterations),
                        placed_in_blocks=placed)
