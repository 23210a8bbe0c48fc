"""Post-processing: attribute the events of a ``torch.profiler`` Chrome trace to the model's scopes.

Input: the trace ``export_chrome_trace`` wrote, and the :class:`~.capture.Capture` of the
compiled graphs.  Per thread, complete events (``ph: "X"``) nest by time.  Inside each
``## call_hierarchy graph G <kind> ##`` range, the direct children are the kernel calls of
graph ``G`` in the order its generated code makes them (Inductor: ``graph_N_cpp_fused_*``
CPU kernels, ``aten::*`` extern kernels and fallbacks; Triton kernels by name;
``aot_eager``: ATen ops); they are matched in order, by name, against the graph's kernel
list; each call of a subgraph that a higher-order op calls at run time (a ``torch.cond``
branch, a ``torch.while_loop`` body) is a range ``## call_hierarchy branch <name> ##`` among
them, whose direct children are matched against that subgraph's kernel list.  Every
event below a matched kernel call (ATen ops an extern kernel dispatches) gets
that kernel's attribution; a device (GPU) event gets the attribution of the CPU event that
launched it (``args.correlation``).  A call that replayed a CUDA graph (``cudaGraphLaunch``)
has no kernel calls on the host: its events are the graph's as a whole, and the device
kernels of the replay are matched in run order against the graph's kernel list
(:func:`_replayed`).  An ATen op that a compiled frame runs eagerly outside its graphs (at a
graph break, in AOTAutograd's runtime wrappers) is ``<op> (eager)`` at the module stack of the
frame's graph run (:func:`_eager_in_compiled_frames`).

Attribution written into the trace, on every event inside a compiled graph call:

* ``args["call_hierarchy"]``: list of scope labels from the model root, outermost first,
  e.g. ``["Qwen2ForCausalLM", "model (Qwen2Model)", "layers.0 (Qwen2DecoderLayer)",
  "self_attn (Qwen2Attention)", "q_proj (Linear)"]`` (the labels of
  ``torch.fx.call_hierarchy.format_call_hierarchy``, made absolute with the runtime module
  stack).  An event that cannot be attributed gets the scope it ran in plus
  ``"(unattributed)"`` and ``args["call_hierarchy_unattributed"]`` saying why.
* ``args["call_hierarchy_kernel"]``: the kernel's name, with `` (bw)`` for backward kernels
  (`` (re)`` for those that recompute forward ops); ``args["call_hierarchy_backward"]: true`` for
  a backward kernel (attributed to the forward op it differentiates);
  ``args["call_hierarchy_recomputed"]: true`` for one that recomputes forward ops (attributed to
  them); ``args["call_hierarchy_sources"]``: the distinct source scopes of a
  kernel fused across scopes (it is attributed to their common scope);
  ``args["call_hierarchy_graph"]``: ``"graph G <kind>"``.
* The events of one attribution (every call of a kernel under one runtime module stack) share
  these lists: copy one before changing it in place.

Scope slices: for every compiled graph call, the scopes of its consecutive kernel calls are
added as nested complete events (``cat: "call_hierarchy"``) on the same thread, inside the
call's range and around the kernel events, so Perfetto shows the model's structure above
the kernels; the device events a call launched get theirs on their own track (stream).
Nothing of the original trace is removed or changed except the added ``args``.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterable
from operator import itemgetter
from typing import Any

from .capture import (
    BRANCH_RANGE,
    DYNAMO_RANGE,
    GRAPH_RANGE,
    RANGE_PREFIX,
    Branch,
    Capture,
    CompiledGraph,
    Kernel,
    Labels,
    Outside,
    common_prefix,
    event_key,
)

UNATTRIBUTED = "(unattributed)"
EAGER_GRAPH = "eager in a compiled frame"
DYNAMO_RANGE_PREFIX = "## call_hierarchy dynamo graph "
DYNAMO_REGION = "Torch-Compiled Region"
BRANCH_PREFIX = "## call_hierarchy branch "
SCOPE_CAT = "call_hierarchy"
GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset", "gpu_user_annotation")
# A compiled graph run as a CUDA graph (mode="reduce-overhead") launches its kernels in one call
GRAPH_LAUNCHES = frozenset({"cudaGraphLaunch", "cuGraphLaunch", "hipGraphLaunch"})
# Compiled code runs inside these: Dynamo's frames, our Dynamo graph runs and compiled-graph calls,
# Inductor's.  Not every "## ...": a range the user adds around an iteration (the CLI's
# "## call_hierarchy iteration i ##") would make every eager op "compiled".
REGION_PREFIXES = ("Torch-Compiled Region", "## call_hierarchy graph ", "## call_hierarchy dynamo graph ",
                   "## Call CompiledFxGraph")
STEP_PREFIX = "ProfilerStep#"


@dataclasses.dataclass
class Attribution:
    scope: Labels
    kernel: str
    backward: bool = False
    sources: tuple[Labels, ...] = ()
    graph: str = ""
    reason: str | None = None  # why it is unattributed
    recompute: bool = False  # a backward kernel that recomputes forward ops (see capture.Kernel)

    @property
    def attributed(self) -> bool:
        return self.reason is None

    @functools.cached_property
    def trace_args(self) -> dict[str, Any]:
        """What goes into the ``args`` of each of its events: built once, its lists shared by them."""
        args: dict[str, Any] = {"call_hierarchy": list(self.scope), "call_hierarchy_kernel": self.kernel,
                                "call_hierarchy_graph": self.graph}
        if self.backward:
            args["call_hierarchy_backward"] = True
        if self.recompute:
            args["call_hierarchy_recomputed"] = True
        if self.sources:
            args["call_hierarchy_sources"] = [list(s) for s in self.sources]
        if self.reason is not None:
            args["call_hierarchy_unattributed"] = self.reason
        return args


@dataclasses.dataclass
class Sample:
    """One kernel call (a direct child of a compiled-graph range, or a device event)."""

    attribution: Attribution
    dur_us: float  # inclusive duration of the kernel call
    self_us: float  # self time of all events of the call (kernel + what it dispatched)
    device: bool = False
    start_us: float = 0.0  # when the call started (a device kernel: its launch), to tell iterations apart


@dataclasses.dataclass
class Report:
    samples: list[Sample]
    compiled_self_us: float  # self time of all events inside compiled-graph calls
    attributed_self_us: float
    unattributed_events: int
    graph_calls: int
    eager_self_us: float  # self time of ATen ops outside compiled regions
    unknown_stacks: int  # backward calls whose forward was not in the trace
    # self time of ATen ops in compiled regions that hold no graph of ours: code compiled
    # before the capture was installed (Dynamo reused it), not captured
    uncaptured_self_us: float = 0.0
    # what ran outside the compiled regions: communication and eager ops (see outside_samples)
    outside: list[Sample] = dataclasses.field(default_factory=list)
    # the trace's ProfilerStep#N ranges, (start, end) in time order, and how many names they have
    step_windows: list[tuple[float, float]] = dataclasses.field(default_factory=list)
    recorded_steps: int = 0

    @property
    def share(self) -> float:
        return self.attributed_self_us / self.compiled_self_us if self.compiled_self_us else 0.0


@dataclasses.dataclass
class _Nesting:
    """The complete events (``ph: "X"``) of every thread, nested by time; lists are by event index."""

    outside: list[int]  # events outside compiled regions, in time order on each thread
    parent: list[int]  # -1: none
    children: list[list[int] | None]
    # fields of the complete events, read once ("", None, 0.0 for the others)
    name: list[str]
    cat: list[Any]
    start: list[float]
    dur: list[float]
    self_us: list[float]  # duration minus the children's durations, at least 0
    in_region: list[bool]  # some ancestor is a compiled region ("Torch-Compiled Region", "## ...")
    calls: list[tuple[float, tuple[Any, Any], int]]  # compiled-graph calls, in time order
    device: list[int]  # device (GPU) events, in trace order
    graph_launches: list[int]  # CUDA graph replays (cudaGraphLaunch)
    steps: list[int]  # the host's ProfilerStep#N ranges (a profiler with a schedule marks each step)


def _nest(events: list[dict[str, Any]]) -> _Nesting:
    """Nest the complete events of each thread by containment.

    The profiler writes each thread's events in time order, the longer first of two that start
    together: one pass reads each event's fields and nests it.  A trace in another order (one
    that was edited, merged) is nested again in the order of ``(start, -duration)``.
    """
    nesting = _nest_in_order(events, range(len(events)))
    if nesting is None:
        untimed = [i for i, e in enumerate(events) if e.get("ph") != "X" or "ts" not in e]
        timed = sorted((float(e["ts"]), -float(e.get("dur", 0.0)), i) for i, e in enumerate(events)
                       if e.get("ph") == "X" and "ts" in e)
        nesting = _nest_in_order(events, untimed + [i for _ts, _neg_dur, i in timed])
        assert nesting is not None, "events in time order"
    return nesting


def _nest_in_order(events: list[dict[str, Any]], order: Iterable[int]) -> _Nesting | None:
    """:func:`_nest`, visiting the events in ``order``; ``None`` if a thread's are not in time order."""
    n = len(events)
    names = [""] * n
    cats: list[Any] = [None] * n
    starts = [0.0] * n
    dur = [0.0] * n
    parent = [-1] * n
    children: list[list[int] | None] = [None] * n
    child_dur = [0.0] * n
    in_region = [False] * n
    outside: list[int] = []
    regions: set[int] = set()
    calls: list[tuple[float, tuple[Any, Any], int]] = []
    device: list[int] = []
    graph_launches: list[int] = []
    steps: list[int] = []
    gpu_cats = frozenset(GPU_CATS)
    marked = (*REGION_PREFIXES, STEP_PREFIX)  # the names of interest: one test rules out the others
    fields = itemgetter("ph", "cat", "name", "pid", "tid", "ts", "dur")  # one call reads a complete event
    # Per thread: the open events (each an ancestor of the next), their ends, and the last
    # event's start and duration.  Most events are on the thread of the event before them: the
    # current thread's are locals, its last start and duration saved when another's event comes.
    threads: dict[tuple[Any, Any], tuple[list[int], list[float], list[float]]] = {}
    thread: tuple[Any, Any] = (None, None)
    cur_pid: Any = object()  # no thread yet: unequal to every pid
    cur_tid: Any = None
    stack: list[int] = []
    ends: list[float] = []
    last: list[float] = [float("-inf"), 0.0]
    last_start, last_dur = last
    for i in order:
        e = events[i]
        try:
            ph, cat, name, pid, tid, ts, d = fields(e)
        except KeyError:  # not every field (metadata, flows, instant events): one by one
            ph = e.get("ph")
            if ph != "X":
                continue
            cat = e.get("cat")
            if "ts" not in e:
                if cat in gpu_cats:
                    device.append(i)
                continue
            name, pid, tid, ts, d = e.get("name", ""), e.get("pid"), e.get("tid"), e["ts"], e.get("dur", 0.0)
        if ph != "X":
            continue
        if tid != cur_tid or pid != cur_pid:
            last[0] = last_start
            last[1] = last_dur
            thread = (pid, tid)
            found = threads.get(thread)
            if found is None:
                found = threads[thread] = ([], [], [float("-inf"), 0.0])
            stack, ends, last = found
            last_start, last_dur = last
            cur_pid, cur_tid = pid, tid
        start = float(ts)
        d = float(d)
        if start < last_start or (start == last_start and d > last_dur):
            return None  # not in time order: it may be inside an event already closed
        last_start = start
        last_dur = d
        if cat in gpu_cats:
            device.append(i)
        if not isinstance(name, str):
            name = str(name)
        names[i] = name
        cats[i] = cat
        starts[i] = start
        dur[i] = d
        if cat == "cuda_runtime" and name in GRAPH_LAUNCHES:
            graph_launches.append(i)
        if name.startswith(marked):
            if name.startswith(STEP_PREFIX):
                if cat not in gpu_cats:
                    steps.append(i)
            else:
                regions.add(i)
                if GRAPH_RANGE.match(name):
                    calls.append((start, thread, i))
        end = start + d
        limit = end - 1e-6
        while ends and ends[-1] < limit:
            stack.pop()  # ended before this event does: not its parent
            ends.pop()
        if stack:
            p = stack[-1]
            parent[i] = p
            kids = children[p]
            if kids is None:
                children[p] = [i]
            else:
                kids.append(i)
            child_dur[p] += d
            if in_region[p] or p in regions:
                in_region[i] = True
            else:
                outside.append(i)
        else:
            outside.append(i)
        stack.append(i)
        ends.append(end)
    calls.sort()
    self_us = [d - c if d > c else 0.0 for d, c in zip(dur, child_dur)]  # max(0.0, d - c)
    return _Nesting(outside, parent, children, names, cats, starts, dur, self_us, in_region, calls, device, graph_launches,
                    steps)


class _Matcher:
    """Matches the kernel calls of one compiled-graph call, in order, against its kernel list.

    Kernels a run skips (none in generated code today) are passed over; an event that is
    not the next kernel nor one of the following ``LOOKAHEAD`` stays unattributed.
    """

    LOOKAHEAD = 64

    def __init__(self, kernels: list[Kernel]) -> None:
        self.kernels = kernels
        self.pos = 0

    def match(self, key: str) -> Kernel | None:
        """The next kernel whose :func:`~.capture.event_key` is ``key``."""
        kernels = self.kernels
        pos = self.pos
        if pos < len(kernels) and kernels[pos].key == key:  # the usual case: the next one
            self.pos = pos + 1
            return kernels[pos]
        for j in range(pos + 1, min(len(kernels), pos + self.LOOKAHEAD)):
            if kernels[j].key == key:
                self.pos = j + 1
                return kernels[j]
        return None


def annotate(doc: dict[str, Any], capture: Capture) -> Report:
    """Attribute every event inside a compiled graph call; add scope slices.  Mutates ``doc``."""
    return _Annotator(doc["traceEvents"], capture).run()


@dataclasses.dataclass
class _GraphCall:
    """One compiled-graph call: its graph, the runtime module stack it ran under, and the
    attributions of its kernels (one per kernel and stack, shared by every call: ``memo``)."""

    graph: CompiledGraph | None
    stack: tuple[str, ...] | None
    outside: Outside | None  # the run is outside the model
    name: str
    memo: dict[int, Attribution]  # by id(kernel)
    kernel_events: list[tuple[int, Attribution]] = dataclasses.field(default_factory=list)


class _Annotator:
    """:func:`annotate` in steps: the compiled-graph calls (:meth:`graph_call`), the ops compiled
    frames ran eagerly (:meth:`eager_ops`), the device events (:meth:`device_events`), and what
    ran outside the compiled regions (:func:`outside_samples`)."""

    def __init__(self, events: list[dict[str, Any]], capture: Capture) -> None:
        self.events = events
        self.capture = capture
        self.graphs = {g.index: g for g in capture.graphs}
        self.nesting = _nest(events)
        self.attributions: dict[int, Attribution] = {}
        self.samples: list[Sample] = []
        self.new_events: list[dict[str, Any]] = []
        self.compiled_self = self.attributed_self = 0.0
        self.unattributed_events = self.unknown_stacks = 0
        self.graph_ranges: set[int] = set()
        # the runtime stacks of each Dynamo graph's forward runs not yet matched by a backward run
        self.pending: dict[int, list[tuple[tuple[str, ...] | None, Outside | None]]] = {}
        # one Attribution per (runtime stack, kernel): shared by every call of that kernel
        self.memo: dict[tuple[tuple[str, ...] | None, Outside | None], dict[int, Attribution]] = {}
        self.keys: dict[str, str] = {}  # event name -> event_key
        # Compiled-graph calls that replayed a CUDA graph (mode="reduce-overhead"): their kernels
        # ran with no host event each, all launched by the replay
        parent = self.nesting.parent
        call_set = {r for _ts, _t, r in self.nesting.calls}
        self.replays: dict[int, list[int]] = {}
        for launch in self.nesting.graph_launches:
            p = parent[launch]
            while p >= 0 and p not in call_set:
                p = parent[p]
            if p >= 0:
                self.replays.setdefault(p, []).append(launch)
        self.replay_of: dict[int, tuple[Callable[[Kernel | None, str], Attribution], list[Kernel]]] = {}
        self.whole: dict[tuple[int, str], Kernel] = {}  # (graph, event name) -> the graph as one kernel

    def run(self) -> Report:
        nesting = self.nesting
        for _ts, t, r in nesting.calls:
            self.graph_call(t, r)
        uncaptured = self.eager_ops()
        launched_here = self.device_events()
        _write_claimed(self.events, self.attributions)
        eager = sum(nesting.self_us[i] for i in nesting.outside
                    if i not in self.graph_ranges and nesting.cat[i] == "cpu_op")
        self.events.extend(self.new_events)
        return Report(self.samples, self.compiled_self, self.attributed_self, self.unattributed_events,
                      len(nesting.calls), eager, self.unknown_stacks, uncaptured,
                      outside_samples(nesting, self.graph_ranges | launched_here), step_windows(nesting),
                      len({nesting.name[i] for i in nesting.steps}))

    def claim(self, call: int, att: Attribution) -> None:
        """``call`` (a kernel call, an eager op) and every event below it are ``att``'s: one sample."""
        children, self_us, attributions = self.nesting.children, self.nesting.self_us, self.attributions
        attributions[call] = att
        total_self = self_us[call]
        todo = children[call]
        if todo:  # what it dispatched, depth first
            todo = todo[:]
            while todo:
                j = todo.pop()
                attributions[j] = att
                total_self += self_us[j]
                kids = children[j]
                if kids:
                    todo.extend(kids)
        self.compiled_self += total_self
        if att.attributed:
            self.attributed_self += total_self
        else:
            self.unattributed_events += 1
        self.samples.append(Sample(att, self.nesting.dur[call], total_self, start_us=self.nesting.start[call]))

    def as_a_whole(self, graph: CompiledGraph, name: str) -> Kernel:
        """A host op of a CUDA-graph replay's call (the input copy, the launch): the graph's as a whole."""
        kernel = self.whole.get((graph.index, name))
        if kernel is None:
            kernel = self.whole[(graph.index, name)] = Kernel(name, name, graph.common_scope)
        return kernel

    def runtime_stack(self, r: int, graph: CompiledGraph | None) -> tuple[tuple[str, ...] | None, Outside | None]:
        """The runtime module stack of graph call ``r``: from the enclosing Dynamo graph run, or
        (backward) the latest forward run of the same Dynamo graph."""
        names, parent, capture = self.nesting.name, self.nesting.parent, self.capture
        stack: tuple[str, ...] | None = None
        outside: Outside | None = None
        p = parent[r]
        while p >= 0:
            sid = _stack_id(names[p])
            if sid is not None:
                if sid < len(capture.stacks):
                    stack, outside = capture.stacks[sid], capture.outside[sid]
                break
            p = parent[p]
        if graph is not None and graph.kind == "forward":
            self.pending.setdefault(graph.dynamo_graph, []).append((stack, outside))
        elif graph is not None and graph.kind == "backward":
            waiting = self.pending.get(graph.dynamo_graph)
            stack, outside = waiting.pop() if waiting else (None, None)
            if stack is None:
                self.unknown_stacks += 1
        return stack, outside

    def graph_call(self, t: tuple[Any, Any], r: int) -> None:
        """Attribute the kernel calls of compiled-graph call ``r`` (on thread ``t``) and add its scope slices."""
        nesting = self.nesting
        m = GRAPH_RANGE.match(nesting.name[r])
        assert m is not None
        graph = self.graphs.get(int(m.group(1)))
        stack, outside = self.runtime_stack(r, graph)
        call = _GraphCall(graph, stack, outside, f"graph {graph.index} {graph.kind}" if graph else nesting.name[r],
                          self.memo.setdefault((stack, outside), {}))
        if r in self.replays and graph is not None:
            # The host's part of a replay (copying the inputs, the launch) is the graph's as a whole
            for outer, c in _look_through_python(nesting, nesting.children[r] or ()):
                name = nesting.name[c]
                call.kernel_events.append((outer, self.attribution(call, self.as_a_whole(graph, name), name)))
            for launch in self.replays[r]:
                self.replay_of[launch] = (functools.partial(self.attribution, call), graph.kernels)
        else:
            self.match(call, nesting.children[r] or (), _Matcher(graph.kernels) if graph is not None else None)
        for c, att in call.kernel_events:
            self.claim(c, att)
        # the range's own self time (the Python wrapper around the generated code)
        self.graph_ranges.add(r)
        self.new_events.extend(_scope_slices(nesting, t, call.kernel_events))

    def attribution(self, call: _GraphCall, kernel: Kernel | None, name: str) -> Attribution:
        """The attribution of ``kernel``'s event ``name`` in ``call``."""
        graph, capture = call.graph, self.capture
        base = call.stack or ()
        if kernel is None or graph is None:
            why = "not a kernel of this graph" if graph is not None else "graph not captured"
            return Attribution(capture.scopes.absolute(base) + (UNATTRIBUTED,), name, graph=call.name, reason=why)
        found = call.memo.get(id(kernel))
        if found is None:
            scope = capture.scopes.absolute(base, *kernel.sites, kernel.hierarchy, outside=call.outside)
            sources = tuple(capture.scopes.absolute(base, *kernel.sites, s, outside=call.outside)
                            for s in kernel.sources)
            if call.stack is None and graph.backward:
                scope = scope[:1] + ("(forward call not in trace)",) + scope[1:]
            recompute = graph.backward and kernel.recompute
            label = kernel.name + (" (re)" if recompute else " (bw)" if graph.backward else "")
            found = call.memo[id(kernel)] = Attribution(scope, label, graph.backward, sources, call.name,
                                                        recompute=recompute)
        return found

    def match(self, call: _GraphCall, calls: Iterable[int], matcher: _Matcher | None,
              within: Branch | None = None) -> None:
        """The kernel calls among ``calls`` (events of one graph call, or of a cond branch's call,
        or of a whole scan's or map's call: ``within``)."""
        graph, names, keys = call.graph, self.nesting.name, self.keys
        for outer, c in _look_through_python(self.nesting, calls):
            name = names[c]
            if graph is not None and graph.branches and name.startswith(BRANCH_PREFIX):
                b = BRANCH_RANGE.match(name)
                branch = graph.branches.get(b.group(1)) if b else None
                if branch is not None:  # the branch that ran: its own time is Python's, not a kernel's
                    _write([(self.events[c], self.attribution(call, branch.call, name))])
                    self.match(call, self.nesting.children[c] or (), _Matcher(branch.kernels), branch)
                    continue
            kernel = None
            if matcher is not None:
                key = keys.get(name)
                if key is None:
                    key = keys[name] = event_key(name)
                kernel = matcher.match(key)
                if kernel is None and graph is not None:
                    kernel = graph.repeats.get(key)  # a loop's predicate, a host scalar read
                if kernel is None and within is not None:
                    kernel = within.own_kernel(key)  # a scan's or map's own loop
            call.kernel_events.append((outer, self.attribution(call, kernel, name)))

    def eager_ops(self) -> float:
        """ATen ops that ran eagerly inside a compiled frame, outside its graphs (at a graph break, in
        AOTAutograd's runtime wrappers): the module stack of the frame's graph run beside or around
        them.  Returns the self time of those of frames in which no graph of ours ran."""
        nesting, capture, names = self.nesting, self.capture, self.nesting.name
        eager_ops, uncaptured = _eager_in_compiled_frames(nesting, self.graph_ranges)
        eager_memo: dict[tuple[tuple[int, ...], str], Attribution] = {}
        for op, runs in eager_ops:
            name = names[op]
            sids = {sid for sid in map(_stack_id, (names[run] for run in runs))
                    if sid is not None and sid < len(capture.stacks)}
            key = (tuple(sorted(sids)), name)
            att = eager_memo.get(key)
            if att is None:
                if sids:  # several: the op's frame is not known, their common scope is
                    scope = common_prefix(capture.scopes.absolute(capture.stacks[sid], outside=capture.outside[sid])
                                          for sid in key[0])
                    att = Attribution(scope, f"{name} (eager)", graph=EAGER_GRAPH)
                else:
                    att = Attribution((capture.scopes.root_label, UNATTRIBUTED), f"{name} (eager)",
                                      graph=EAGER_GRAPH,
                                      reason="ran eagerly in a compiled frame in which no graph of ours ran")
                eager_memo[key] = att
            self.claim(op, att)
            e = self.events[op]
            self.new_events.extend(_scope_slices(nesting, (e.get("pid"), e.get("tid")), [(op, att)]))
        return uncaptured

    def device_events(self) -> set[int]:
        """Device events: the attribution of the CPU event that launched them (args.correlation), and
        scope slices on their own track (a stream), per compiled-graph call: a stream runs the
        kernels of one call in launch order, and nothing else comes between them but what that
        call launched.  Returns the device events so attributed."""
        nesting, events = self.nesting, self.events
        device_events: list[tuple[dict[str, Any], Attribution]] = []
        launched_here: set[int] = set()
        if nesting.device:
            by_corr: dict[Any, int] = {}
            for i in self.attributions:
                corr = (events[i].get("args") or {}).get("correlation")
                if corr is not None:
                    by_corr[corr] = i
            launched_by = [(d, by_corr.get((events[d].get("args") or {}).get("correlation"))) for d in nesting.device]
            replayed: dict[int, Attribution] = {}
            if self.replay_of:
                runs: dict[int, list[int]] = {}
                for d, launcher in launched_by:
                    if launcher in self.replay_of:
                        runs.setdefault(launcher, []).append(d)
                for launcher, run in runs.items():
                    run.sort(key=nesting.start.__getitem__)
                    replayed.update(_replayed(events, run, *self.replay_of[launcher]))
            tracks: dict[tuple[Any, Any, int], list[tuple[int, Attribution]]] = {}
            for d, launcher in launched_by:
                if launcher is None:
                    continue
                launched_here.add(d)
                e = events[d]
                launched = replayed.get(d) or self.attributions[launcher]
                device_events.append((e, launched))
                dur = float(e.get("dur", 0.0))
                self.samples.append(Sample(dataclasses.replace(launched, kernel=launched.kernel + " [device]"), dur,
                                           dur, device=True, start_us=nesting.start[launcher]))
                call = launcher
                while call >= 0 and call not in self.graph_ranges:
                    call = nesting.parent[call]
                if "ts" in e:
                    tracks.setdefault((e.get("pid"), e.get("tid"), call), []).append((d, launched))
            for (pid, tid, _call), kernels in tracks.items():
                kernels.sort(key=lambda k: nesting.start[k[0]])
                self.new_events.extend(_scope_slices(nesting, (pid, tid), kernels))
        _write(device_events)
        return launched_here

OUTSIDE_GRAPHS = "(outside compiled graphs)"
COMMUNICATION = "communication"
EAGER_OPS = "eager ops"
COMPILE_RUNTIME = "torch.compile runtime"
# torch.compile's own work around the compiled graphs: guard checks, the compiled regions' own Python
_COMPILE_RUNTIME_NAMES = ("TorchDynamo Cache Lookup", *REGION_PREFIXES)
# Collectives as the profiler records them: c10d's ops (the launch), the process group's own
# ranges (gloo's work; NCCL's), FSDP2's copies in and out of its all-gather and reduce-scatter
# buffers, and NCCL's device kernels
_COLLECTIVE_PREFIXES = ("c10d::", "c10d_functional::", "_c10d_functional::", "gloo:", "nccl:", "fsdp::",
                        "record_param_comms")
_COLLECTIVE_KERNELS = ("ncclDevKernel", "ncclKernel")


def outside_samples(nesting: _Nesting, claimed: set[int]) -> list[Sample]:
    """The ATen ops and collectives that ran outside the compiled regions (an eager model's parts,
    the loss, the optimizer, DDP's and FSDP2's communication), each a sample of
    ``(outside compiled graphs) > communication``, ``> torch.compile runtime`` (guard checks, the
    compiled regions' own Python) or ``> eager ops`` by its name: self times, so a collective's
    range and the op it runs in count once.  ``claimed``: events of the compiled
    graphs' samples (their calls' ranges, the device kernels their calls launched)."""
    out: list[Sample] = []
    gpu_cats = frozenset(GPU_CATS)
    names, cats, durs, self_us, starts = nesting.name, nesting.cat, nesting.dur, nesting.self_us, nesting.start
    # one attribution per name and category, shared by its samples (the ops of every iteration)
    atts: dict[tuple[str, Any], Attribution] = {}
    for i in nesting.outside:
        if i in claimed:
            continue
        name, cat = names[i], cats[i]
        device = cat in gpu_cats
        att = atts.get((name, cat))
        if att is None:
            if device:
                if not name.startswith(_COLLECTIVE_KERNELS):
                    continue  # a compiled graph's kernel: attributed by its launch
                att = Attribution((OUTSIDE_GRAPHS, COMMUNICATION), f"{name} [device]")
            elif name.startswith(_COLLECTIVE_PREFIXES):
                att = Attribution((OUTSIDE_GRAPHS, COMMUNICATION), name)
            elif name.startswith(_COMPILE_RUNTIME_NAMES):
                att = Attribution((OUTSIDE_GRAPHS, COMPILE_RUNTIME), name)
            elif cat == "cpu_op":
                att = Attribution((OUTSIDE_GRAPHS, EAGER_OPS), name)
            else:
                continue
            atts[(name, cat)] = att
        if device:
            out.append(Sample(att, durs[i], durs[i], device=True, start_us=starts[i]))
        else:
            out.append(Sample(att, durs[i], self_us[i], start_us=starts[i]))
    return out


def step_windows(nesting: _Nesting) -> list[tuple[float, float]]:
    """The trace's ``ProfilerStep#N`` ranges on the host, ``(start, end)`` in time order."""
    start, dur = nesting.start, nesting.dur
    return sorted((start[i], start[i] + dur[i]) for i in nesting.steps)


def _look_through_python(nesting: _Nesting, calls: Iterable[int]) -> list[tuple[int, int]]:
    """The calls among ``calls``, looking through the Python function events of ``with_stack=True``.

    Returns ``(outer, call)`` pairs: ``call`` is the event to match (a kernel call, a branch
    range), ``outer`` the event that is claimed for it: the outermost Python function event
    whose only call it is (a Python wrapper around one op: its time is the call's, and the
    scope slices then enclose the wrapper), else ``call`` itself.  A Python function event
    around several calls (the generated code's ``call``) is neither: its own time is Python's,
    as the graph call's range's own is without ``with_stack``.
    """
    out: list[tuple[int, int]] = []
    children, cats = nesting.children, nesting.cat
    for c in calls:
        if cats[c] != "python_function":
            out.append((c, c))
            continue
        inner = _look_through_python(nesting, children[c] or ())
        if len(inner) == 1:
            out.append((c, inner[0][1]))
        else:
            out.extend(inner)
    return out


def _replayed(events: list[dict[str, Any]], run: list[int], attribution: Callable[[Kernel | None, str], Attribution],
              kernels: list[Kernel]) -> dict[int, Attribution]:
    """The device kernels of one CUDA-graph replay, in run order, matched against the graph's kernels.

    The graph runs the kernels it captured in the order the compiled code launched them.  A
    Triton kernel runs under its own name and is matched by it; the device kernels between two
    matches ran for the graph's kernels between them that are not Triton's (an extern kernel
    such as ``aten::mm`` runs library kernels of other names): one such kernel, its
    attribution; several, their common scope, with theirs as sources.
    """
    out: dict[int, Attribution] = {}
    matcher = _Matcher(kernels)
    waiting: list[int] = []

    def settle(start: int, upto: int) -> None:
        """The waiting device kernels ran for ``kernels[start:upto]``, the ones passed over."""
        if waiting:
            between = [attribution(k, k.name) for k in kernels[start:upto]]
            att = _common(between) if between else attribution(None, str(events[waiting[0]].get("name", "")))
            for d in waiting:
                out[d] = att
            waiting.clear()

    for d in run:
        name = str(events[d].get("name", ""))
        start = matcher.pos
        kernel = matcher.match(name)
        if kernel is None:
            waiting.append(d)
            continue
        settle(start, matcher.pos - 1)
        out[d] = attribution(kernel, name)
    settle(matcher.pos, len(kernels))
    return out


def _common(atts: list[Attribution]) -> Attribution:
    """One attribution for device kernels that ran for any of several kernels: their common scope."""
    scopes = list(dict.fromkeys(a.scope for a in atts))
    if len(scopes) == 1 and len({a.kernel for a in atts}) == 1:
        return atts[0]
    kernel = " + ".join(dict.fromkeys(a.kernel for a in atts))
    return Attribution(common_prefix(scopes), kernel, atts[0].backward, tuple(scopes) if len(scopes) > 1 else (),
                       atts[0].graph, recompute=all(a.recompute for a in atts))


def _stack_id(name: str) -> int | None:
    """``S`` of a Dynamo graph run's range ``## call_hierarchy dynamo graph D @ S ##`` (its module
    stack in :attr:`Capture.stacks`); ``None`` for any other event name."""
    m = DYNAMO_RANGE.match(name)
    return int(m.group(2)) if m else None


def _eager_in_compiled_frames(nesting: _Nesting, graph_ranges: set[int]) -> tuple[list[tuple[int, tuple[int, ...]]], float]:
    """The ATen ops that ran eagerly in Dynamo's compiled regions, outside our graph calls.

    Returns, for each outermost such op of a region in which a graph of ours ran, the Dynamo
    graph run (``## call_hierarchy dynamo graph D @ S ##``) whose module stack is the op's: the
    one around it (AOTAutograd's runtime wrappers), else the latest one of its frame before it
    (an op at a graph break runs in the frame of the graph before it), else the first after it,
    else (a frame with no graph) the one of the frame that called it; else, the frame not being
    known, every run of the outermost region (their common scope is the op's); and the self time of the ATen ops of regions in which none
    of our ranges ran (code compiled before the capture, see :attr:`Report.uncaptured_self_us`).
    """
    children, self_us, names, cats = nesting.children, nesting.self_us, nesting.name, nesting.cat
    ops: list[tuple[int, tuple[int, ...]]] = []
    uncaptured = 0.0
    seen: list[int] = []  # the runs of the region being visited

    def visit(node: int, run: int) -> tuple[int, list[int]]:
        """Visit ``node``'s children with ``run`` the Dynamo graph run so far (-1: none yet).

        Returns the last run seen, and the ops seen before any run: they wait for the next one
        (Dynamo's pregraph bytecode runs before the graph it prepares).
        """
        waiting: list[int] = []
        for c in children[node] or ():
            if c in graph_ranges:
                continue
            name = names[c]
            if name.startswith(DYNAMO_RANGE_PREFIX):
                ops.extend((w, (c,)) for w in waiting)
                waiting.clear()
                run = c
                seen.append(c)
                visit(c, c)
            elif name.startswith("aten::") and cats[c] == "cpu_op":
                if run >= 0:
                    ops.append((c, (run,)))
                else:
                    waiting.append(c)
            elif name.startswith(DYNAMO_REGION):  # another frame Dynamo ran (a callee, a resumed frame)
                _, before = visit(c, -1)  # its own runs are not this frame's
                if run >= 0:
                    ops.extend((w, (run,)) for w in before)
                else:
                    waiting.extend(before)
            else:  # this frame's: Dynamo's pregraph bytecode, a runtime wrapper, ...
                run, before = visit(c, run)
                waiting.extend(before)
        return run, waiting

    for i in nesting.outside:  # the outermost regions (an event outside regions, or a region's root)
        if not names[i].startswith(DYNAMO_REGION):
            continue
        aten: list[int] = []
        todo = [i]
        while todo:
            j = todo.pop()
            name = names[j]
            if name.startswith(RANGE_PREFIX):  # a graph of ours ran in it: captured
                seen.clear()
                _, alone = visit(i, -1)
                ops.extend((w, tuple(seen)) for w in alone)
                break
            if name.startswith("aten::"):
                aten.append(j)
            todo.extend(children[j] or ())
        else:
            uncaptured += sum(self_us[j] for j in aten)
    return ops, uncaptured


def _write(pairs: Iterable[tuple[dict[str, Any], Attribution]]) -> None:
    """Add each attribution to its event's ``args``."""
    for e, att in pairs:
        args = e.get("args")
        if args is None:
            e["args"] = dict(att.trace_args)
        else:
            args.update(att.trace_args)


def _write_claimed(events: list[dict[str, Any]], attributions: dict[int, Attribution]) -> None:
    """:func:`_write` of the claimed events (by index): one loop over tens of thousands."""
    for i, att in attributions.items():
        e = events[i]
        args = e.get("args")
        if args is None:
            e["args"] = dict(att.trace_args)
        else:
            args.update(att.trace_args)


def _scope_slices(nesting: _Nesting, thread: tuple[Any, Any],
                  kernel_events: list[tuple[int, Attribution]]) -> list[dict[str, Any]]:
    """Nested scope slices around consecutive kernel calls of one compiled-graph call."""
    pid, tid = thread
    out: list[dict[str, Any]] = []
    # The open scopes are the previous kernel's scope: its labels, with their starts and ends.
    # Only the innermost end is kept current: an outer scope's end is the latest of its own
    # kernels' and of its inner scopes' ends, taken as each inner scope closes.
    labels: Labels = ()
    starts: list[float] = []  # us, as the kernels' events
    ends: list[int] = []  # ns

    def close(keep: int) -> None:
        while len(starts) > keep:
            depth = len(starts)
            start, end = starts.pop(), ends.pop()
            # ends in whole nanoseconds, the trace's resolution: microsecond floats of a
            # timestamp this large cannot hold every nanosecond, and their sums round
            out.append({"name": labels[depth - 1], "cat": SCOPE_CAT, "ph": "X", "pid": pid, "tid": tid,
                        "ts": start, "dur": (end - round(start * 1000)) / 1000,
                        "args": {"call_hierarchy": list(labels[:depth])}})
            if ends and ends[-1] < end:
                ends[-1] = end

    event_start, dur = nesting.start, nesting.dur
    for c, att in kernel_events:
        start = event_start[c]
        end = round(start * 1000) + round(dur[c] * 1000)  # ns
        scope = att.scope
        if scope is not labels:
            keep = 0
            depth = min(len(labels), len(scope))
            while keep < depth and labels[keep] == scope[keep]:
                keep += 1
            close(keep)
            labels = scope
            for _ in range(keep, len(scope)):
                starts.append(start)
                ends.append(end)
        if ends and ends[-1] < end:
            ends[-1] = end
    close(0)
    return out
