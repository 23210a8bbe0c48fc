"""Post-processing: attribute the events of a ``torch.profiler`` Chrome trace to the model's scopes.

Input: the trace ``export_chrome_trace`` wrote, and the :class:`~.capture.Capture` of the
compiled graphs.  Per thread, complete events (``ph: "X"``) nest by time.  Inside each
``## call_hierarchy graph G <kind> ##`` range, the direct children are the kernel calls of
graph ``G`` in the order its generated code makes them (Inductor: ``graph_N_cpp_fused_*``
CPU kernels, ``aten::*`` extern kernels and fallbacks; Triton kernels by name;
``aot_eager``: ATen ops); they are matched in order, by name, against the graph's kernel
list.  Every event below a matched kernel call (ATen ops an extern kernel dispatches) gets
that kernel's attribution; a device (GPU) event gets the attribution of the CPU event that
launched it (``args.correlation``).

Attribution written into the trace, on every event inside a compiled graph call:

* ``args["call_hierarchy"]``: list of scope labels from the model root, outermost first,
  e.g. ``["Qwen2ForCausalLM", "model (Qwen2Model)", "layers.0 (Qwen2DecoderLayer)",
  "self_attn (Qwen2Attention)", "q_proj (Linear)"]`` (the labels of
  ``torch.fx.call_hierarchy.format_call_hierarchy``, made absolute with the runtime module
  stack).  An event that cannot be attributed gets the scope it ran in plus
  ``"(unattributed)"`` and ``args["call_hierarchy_unattributed"]`` saying why.
* ``args["call_hierarchy_kernel"]``: the kernel's name, with `` (bw)`` for backward kernels;
  ``args["call_hierarchy_backward"]: true`` for a backward kernel (attributed to the forward
  op it differentiates); ``args["call_hierarchy_sources"]``: the distinct source scopes of a
  kernel fused across scopes (it is attributed to their common scope);
  ``args["call_hierarchy_graph"]``: ``"graph G <kind>"``.

Scope slices: for every compiled graph call, the scopes of its consecutive kernel calls are
added as nested complete events (``cat: "call_hierarchy"``) on the same thread, inside the
call's range and around the kernel events, so Perfetto shows the model's structure above
the kernels.  Nothing of the original trace is removed or changed except the added ``args``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

from .capture import DYNAMO_RANGE, GRAPH_RANGE, Capture, CompiledGraph, Kernel, Labels, event_key

UNATTRIBUTED = "(unattributed)"
SCOPE_CAT = "call_hierarchy"
GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset", "gpu_user_annotation")


@dataclasses.dataclass
class Attribution:
    scope: Labels
    kernel: str
    backward: bool = False
    sources: tuple[Labels, ...] = ()
    graph: str = ""
    reason: str | None = None  # why it is unattributed

    @property
    def attributed(self) -> bool:
        return self.reason is None


@dataclasses.dataclass
class Sample:
    """One kernel call (a direct child of a compiled-graph range, or a device event)."""

    attribution: Attribution
    dur_us: float  # inclusive duration of the kernel call
    self_us: float  # self time of all events of the call (kernel + what it dispatched)
    device: bool = False


@dataclasses.dataclass
class Report:
    samples: list[Sample]
    compiled_self_us: float  # self time of all events inside compiled-graph calls
    attributed_self_us: float
    unattributed_events: int
    graph_calls: int
    eager_self_us: float  # self time of ATen ops outside compiled regions
    unknown_stacks: int  # backward calls whose forward was not in the trace

    @property
    def share(self) -> float:
        return self.attributed_self_us / self.compiled_self_us if self.compiled_self_us else 0.0


def _threads(events: list[dict[str, Any]]) -> dict[tuple[Any, Any], list[int]]:
    by_thread: dict[tuple[Any, Any], list[int]] = {}
    for i, e in enumerate(events):
        if e.get("ph") == "X" and "ts" in e:
            by_thread.setdefault((e.get("pid"), e.get("tid")), []).append(i)
    return by_thread


def _end(e: dict[str, Any]) -> float:
    return float(e["ts"]) + float(e.get("dur", 0.0))


def nest(events: list[dict[str, Any]], indices: list[int]) -> tuple[list[int], dict[int, int], dict[int, list[int]]]:
    """Order one thread's complete events by time; parent and children of each by containment."""
    order = sorted(indices, key=lambda i: (float(events[i]["ts"]), -float(events[i].get("dur", 0.0))))
    parent: dict[int, int] = {}
    children: dict[int, list[int]] = {}
    stack: list[int] = []
    for i in order:
        end = _end(events[i])
        while stack and _end(events[stack[-1]]) < end - 1e-6:
            stack.pop()  # ended before this event does: not its parent
        if stack:
            parent[i] = stack[-1]
            children.setdefault(stack[-1], []).append(i)
        stack.append(i)
    return order, parent, children


class _Matcher:
    """Matches the kernel calls of one compiled-graph call, in order, against its kernel list.

    Kernels a run skips (none in generated code today) are passed over; an event that is
    not the next kernel nor one of the following ``LOOKAHEAD`` stays unattributed.
    """

    LOOKAHEAD = 64

    def __init__(self, graph: CompiledGraph) -> None:
        self.kernels = graph.kernels
        self.pos = 0

    def match(self, name: str) -> Kernel | None:
        key = event_key(name)
        kernels = self.kernels
        for j in range(self.pos, min(len(kernels), self.pos + self.LOOKAHEAD)):
            if kernels[j].key == key:
                self.pos = j + 1
                return kernels[j]
        return None


def annotate(doc: dict[str, Any], capture: Capture) -> Report:
    """Attribute every event inside a compiled graph call; add scope slices.  Mutates ``doc``."""
    events: list[dict[str, Any]] = doc["traceEvents"]
    graphs = {g.index: g for g in capture.graphs}
    threads = _threads(events)
    nesting = {t: nest(events, idx) for t, idx in threads.items()}

    # Compiled-graph calls in time order over all threads (backward pops its forward's stack).
    calls: list[tuple[float, tuple[Any, Any], int]] = []
    for t, (order, _parent, _children) in nesting.items():
        for i in order:
            if GRAPH_RANGE.match(str(events[i].get("name", ""))):
                calls.append((float(events[i]["ts"]), t, i))
    calls.sort()

    pending: dict[int, list[tuple[str, ...] | None]] = {}
    attributions: dict[int, Attribution] = {}
    samples: list[Sample] = []
    new_events: list[dict[str, Any]] = []
    compiled_self = attributed_self = 0.0
    unattributed_events = unknown_stacks = 0
    inside_compiled: set[int] = set()
    scope_memo: dict[tuple[tuple[str, ...], int], tuple[Any, Any]] = {}

    def self_time(i: int, children: dict[int, list[int]]) -> float:
        return max(0.0, float(events[i].get("dur", 0.0)) - sum(float(events[c].get("dur", 0.0))
                                                              for c in children.get(i, ())))

    def subtree(i: int, children: dict[int, list[int]]) -> Iterator[int]:
        todo = [i]
        while todo:
            j = todo.pop()
            yield j
            todo.extend(children.get(j, ()))

    for _ts, t, r in calls:
        order, parent, children = nesting[t]
        m = GRAPH_RANGE.match(events[r]["name"])
        assert m is not None
        graph = graphs.get(int(m.group(1)))
        # The runtime module stack: from the enclosing Dynamo graph run, or (backward) the
        # latest forward run of the same Dynamo graph.
        stack: tuple[str, ...] | None = None
        p = parent.get(r)
        while p is not None:
            dm = DYNAMO_RANGE.match(str(events[p].get("name", "")))
            if dm:
                sid = int(dm.group(2))
                stack = capture.stacks[sid] if sid < len(capture.stacks) else None
                break
            p = parent.get(p)
        if graph is not None and graph.kind == "forward":
            pending.setdefault(graph.dynamo_graph, []).append(stack)
        elif graph is not None and graph.kind == "backward":
            waiting = pending.get(graph.dynamo_graph)
            stack = waiting.pop() if waiting else None
            if stack is None:
                unknown_stacks += 1
        base = stack or ()
        graph_name = f"graph {graph.index} {graph.kind}" if graph else events[r]["name"]
        matcher = _Matcher(graph) if graph is not None else None
        kernel_events: list[tuple[int, Attribution]] = []
        for c in children.get(r, ()):
            name = str(events[c].get("name", ""))
            kernel = matcher.match(name) if matcher is not None else None
            if kernel is None or graph is None:
                why = "not a kernel of this graph" if graph is not None else "graph not captured"
                att = Attribution(capture.scopes.absolute(base) + (UNATTRIBUTED,), name, graph=graph_name, reason=why)
            else:
                memo_key = (base, id(kernel))
                memo = scope_memo.get(memo_key)
                if memo is None:
                    memo = scope_memo[memo_key] = (
                        capture.scopes.absolute(base, *kernel.sites, kernel.hierarchy),
                        tuple(capture.scopes.absolute(base, *kernel.sites, s) for s in kernel.sources),
                    )
                scope, sources = memo
                if stack is None and graph.backward:
                    scope = scope[:1] + ("(forward call not in trace)",) + scope[1:]
                label = kernel.name + (" (bw)" if graph.backward else "")
                att = Attribution(scope, label, graph.backward, sources, graph_name)
            kernel_events.append((c, att))

        for c, att in kernel_events:
            total_self = 0.0
            for j in subtree(c, children):
                attributions[j] = att
                inside_compiled.add(j)
                s = self_time(j, children)
                total_self += s
            compiled_self += total_self
            if att.attributed:
                attributed_self += total_self
            else:
                unattributed_events += 1
            samples.append(Sample(att, float(events[c].get("dur", 0.0)), total_self))
        # the range's own self time (the Python wrapper around the generated code)
        inside_compiled.add(r)
        new_events.extend(_scope_slices(events, t, kernel_events))

    # Device events: the attribution of the CPU event that launched them.
    by_corr: dict[Any, Attribution] = {}
    for i, att in attributions.items():
        corr = (events[i].get("args") or {}).get("correlation")
        if corr is not None:
            by_corr[corr] = att
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in GPU_CATS:
            corr = (e.get("args") or {}).get("correlation")
            att = by_corr.get(corr)
            if att is not None:
                _write(e, att)
                samples.append(Sample(dataclasses.replace(att, kernel=att.kernel + " [device]"),
                                      float(e.get("dur", 0.0)), float(e.get("dur", 0.0)), device=True))

    for i, att in attributions.items():
        _write(events[i], att)

    eager = 0.0
    for t, (order, parent, children) in nesting.items():
        for i in order:
            e = events[i]
            if i in inside_compiled or e.get("cat") != "cpu_op":
                continue
            if _inside_compiled_region(events, parent, i):
                continue
            eager += self_time(i, children)

    events.extend(new_events)
    return Report(samples, compiled_self, attributed_self, unattributed_events, len(calls), eager, unknown_stacks)


def _inside_compiled_region(events: list[dict[str, Any]], parent: dict[int, int], i: int) -> bool:
    p = parent.get(i)
    while p is not None:
        name = str(events[p].get("name", ""))
        if name.startswith("Torch-Compiled Region") or name.startswith("## "):
            return True
        p = parent.get(p)
    return False


def _write(e: dict[str, Any], att: Attribution) -> None:
    args = e.setdefault("args", {})
    args["call_hierarchy"] = list(att.scope)
    args["call_hierarchy_kernel"] = att.kernel
    args["call_hierarchy_graph"] = att.graph
    if att.backward:
        args["call_hierarchy_backward"] = True
    if att.sources:
        args["call_hierarchy_sources"] = [list(s) for s in att.sources]
    if att.reason is not None:
        args["call_hierarchy_unattributed"] = att.reason


def _scope_slices(events: list[dict[str, Any]], thread: tuple[Any, Any],
                  kernel_events: list[tuple[int, Attribution]]) -> list[dict[str, Any]]:
    """Nested scope slices around consecutive kernel calls of one compiled-graph call."""
    pid, tid = thread
    out: list[dict[str, Any]] = []
    open_scopes: list[list[Any]] = []  # [label, start, end]

    def close(keep: int) -> None:
        while len(open_scopes) > keep:
            label, start, end = open_scopes.pop()
            path = [s[0] for s in open_scopes] + [label]
            out.append({"name": label, "cat": SCOPE_CAT, "ph": "X", "pid": pid, "tid": tid,
                        "ts": start, "dur": round(end - start, 3),
                        "args": {"call_hierarchy": path}})

    for c, att in kernel_events:
        e = events[c]
        start, end = float(e["ts"]), _end(e)
        scope = att.scope
        keep = 0
        while keep < min(len(open_scopes), len(scope)) and open_scopes[keep][0] == scope[keep]:
            keep += 1
        close(keep)
        for label in scope[keep:]:
            open_scopes.append([label, start, end])
        for s in open_scopes:
            s[2] = max(s[2], end)
    close(0)
    return out
