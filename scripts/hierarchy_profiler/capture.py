"""Compile a model with ``record_call_hierarchy`` on and time every ATen op under its scope.

The ``aot_eager`` path: a Dynamo backend built on AOTAutograd whose forward,
backward and inference compilers return a :class:`TimedGraph`, an
``fx.Interpreter`` that times each ``call_function`` node of the ATen graph.
Forward/inference nodes are attributed to ``node.meta["call_hierarchy"]``,
backward nodes to ``node.meta["fwd_call_hierarchy"]`` (their forward origin)
and marked ``(bw)``.

Graph breaks: a graph's hierarchy is relative to the frame Dynamo compiled
(e.g. ``Block.forward`` or a resume function inside it), and one graph may
serve several callers (``layers.0`` and ``layers.1``).  Each time a graph runs,
:class:`RuntimeScopes` reads the module-call stack of the running program (the
Python frames whose arguments hold modules of the model, outermost first) and
prefixes the graph's relative hierarchy with it, rebasing relative module paths
onto the innermost running module.  Backward graphs run after the forward, so
each forward run pushes its runtime context and the matching backward run pops
it (backward runs in reverse order of the forward runs of a graph).
"""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import fx, nn
from torch.fx.call_hierarchy import CallHierarchyEntry, FunctionCallEntry, ModuleCallEntry, UnknownFramesEntry

Hierarchy = tuple[CallHierarchyEntry, ...]


@dataclasses.dataclass(frozen=True)
class OpEvent:
    scope: tuple[str, ...]  # labels, outermost first (the model root first)
    op: str
    backward: bool
    start_ns: int
    end_ns: int


@dataclasses.dataclass
class GraphRun:
    name: str  # e.g. "graph 0 forward"
    start_ns: int
    end_ns: int
    ops: list[OpEvent]


def op_name(node: fx.Node) -> str:
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        name = f"{target.namespace}.{target._opname}"
        return name if target._overloadname == "default" else f"{name}.{target._overloadname}"
    return getattr(target, "__name__", str(target))


def labels(hierarchy: Sequence[CallHierarchyEntry]) -> tuple[str, ...]:
    """The labels of ``format_call_hierarchy``, one per entry."""
    out = []
    parent_path = ""
    for entry in hierarchy:
        out.append(entry.label(parent_path))
        if isinstance(entry, ModuleCallEntry):
            parent_path = entry.path
    return tuple(out)


def _module_entry(path: str, module: nn.Module, count: int = 0) -> ModuleCallEntry:
    cls = type(module)
    return ModuleCallEntry(
        path.rpartition(".")[2], path, cls.__name__, f"{cls.__module__}.{cls.__qualname__}", count
    )


class RuntimeScopes:
    """Absolute scopes of the model: runtime module-call stack + a graph's relative hierarchy."""

    def __init__(self, model: nn.Module) -> None:
        self.root_label = type(model).__name__
        self.modules: dict[str, nn.Module] = dict(model.named_modules())
        self.path_of: dict[int, str] = {id(m): p for p, m in self.modules.items()}
        self._memo: dict[tuple[tuple[str, ...], Hierarchy], tuple[str, ...]] = {}

    def module_stack(self) -> tuple[str, ...]:
        """Paths of the model's modules whose frames are running, outermost first.

        A frame belongs to the module bound to one of its arguments (``self`` of
        ``forward``/``_call_impl``/a decorator wrapper, or a live local passed to a
        Dynamo resume function); with several, the outermost (shortest path) one.
        """
        stack: list[str] = []
        frame = sys._getframe(1)
        while frame is not None:
            code = frame.f_code
            nargs = code.co_argcount + code.co_kwonlyargcount
            owner: str | None = None
            if nargs:
                f_locals = frame.f_locals
                for name in code.co_varnames[:nargs]:
                    path = self.path_of.get(id(f_locals.get(name)))
                    if path is not None and (owner is None or len(path) < len(owner)):
                        owner = path
            if owner is not None and (not stack or stack[-1] != owner):
                stack.append(owner)
            frame = frame.f_back
        stack.reverse()
        return tuple(p for i, p in enumerate(stack) if p and p not in stack[:i])

    def _rebase(self, base: str, entry: ModuleCallEntry) -> str:
        """Absolute path of a module entry recorded relative to the running module ``base``.

        A compiled frame that reaches its module through a local rather than as
        its root (a Dynamo resume function: ``self.mlp``; a module compiled from
        a wrapper frame: ``fn.0``) records that local's name as the first path
        component: when the path does not resolve under ``base``, it is dropped.
        """
        rel = entry.path
        for candidate in (rel, rel.partition(".")[2]):
            path = ".".join(p for p in (base, candidate) if p)
            module = self.modules.get(path)
            if module is not None and type(module).__name__ == entry["class"]:
                return path
        return ".".join(p for p in (base, rel) if p)

    def absolute(self, stack: tuple[str, ...], hierarchy: Hierarchy) -> tuple[str, ...]:
        key = (stack, hierarchy)
        result = self._memo.get(key)
        if result is None:
            entries: list[CallHierarchyEntry] = [
                _module_entry(p, self.modules[p]) for p in stack
            ]
            base = stack[-1] if stack else ""
            for entry in hierarchy:
                if isinstance(entry, ModuleCallEntry):
                    path = self._rebase(base, entry)
                    if path == base:
                        continue  # the running module itself: the root, or already on the stack
                    entries.append(
                        ModuleCallEntry(entry["attr"], path, entry["class"], entry["class_qualname"], entry.count)  # type: ignore[arg-type]
                    )
                else:
                    # a function, or frames a shared resume function cannot name (kept as such)
                    assert isinstance(entry, (FunctionCallEntry, UnknownFramesEntry))
                    entries.append(entry)
            result = (self.root_label, *labels(entries))
            self._memo[key] = result
        return result


class Recorder:
    """Collects graph runs while ``recording`` is on; one list of runs per iteration."""

    def __init__(self, scopes: RuntimeScopes) -> None:
        self.scopes = scopes
        self.recording = False
        self.iterations: list[list[GraphRun]] = []
        self.graphs: list[TimedGraph] = []
        self.num_dynamo_graphs = 0
        self.unit = "op"  # what one event is: an ATen "op" or an Inductor "kernel"
        self.timed = True  # False: events are counted, not timed (Inductor)

    def start_iteration(self) -> None:
        self.iterations.append([])


class TimedGraph:
    """Runs an ATen graph with an ``fx.Interpreter``, timing each op while recording."""

    def __init__(
        self, recorder: Recorder, gm: fx.GraphModule, graph_id: int, kind: str, pending: list[tuple[str, ...]]
    ) -> None:
        self.recorder = recorder
        self.gm = gm
        self.graph_id = graph_id
        self.kind = kind  # "inference", "forward" or "backward"
        self.pending = pending
        self.name = f"graph {graph_id} {kind}"
        backward = kind == "backward"
        key = "fwd_call_hierarchy" if backward else "call_hierarchy"
        self.ops: dict[fx.Node, tuple[Hierarchy, str]] = {}
        for node in gm.graph.nodes:
            if node.op == "call_function":
                name = op_name(node) + (" (bw)" if backward else "")
                self.ops[node] = (tuple(node.meta.get(key, ())), name)
        self.interpreter = _TimingInterpreter(gm, self)
        self._run_ops: list[OpEvent] = []
        self._stack: tuple[str, ...] = ()
        recorder.graphs.append(self)

    # AOTAutograd passes the inputs as one list (which we free); some of its
    # wrappers (torch._dynamo.disable around a lazily compiled backward) hide
    # this attribute and call with the inputs unpacked.  Graph inputs are never lists.
    _boxed_call = True

    @property
    def num_ops(self) -> int:
        return len(self.ops)

    def __call__(self, *call_args: Any) -> Any:
        if len(call_args) == 1 and isinstance(call_args[0], list):
            args = tuple(call_args[0])
            call_args[0].clear()
        else:
            args = call_args
        if self.kind == "backward":
            stack = self.pending.pop() if self.pending else ()
        else:
            stack = self.recorder.scopes.module_stack()
            if self.kind == "forward":
                self.pending.append(stack)
        self._stack = stack
        recording = self.recorder.recording
        self._run_ops = []
        start = time.perf_counter_ns()
        result = self.interpreter.run(*args) if recording else self.gm(*args)
        end = time.perf_counter_ns()
        if recording:
            self.recorder.iterations[-1].append(GraphRun(self.name, start, end, self._run_ops))
        return result

    def record(self, node: fx.Node, start_ns: int, end_ns: int) -> None:
        hierarchy, name = self.ops[node]
        scope = self.recorder.scopes.absolute(self._stack, hierarchy)
        self._run_ops.append(OpEvent(scope, name, self.kind == "backward", start_ns, end_ns))


class _TimingInterpreter(fx.Interpreter):
    def __init__(self, gm: fx.GraphModule, owner: TimedGraph) -> None:
        super().__init__(gm, garbage_collect_values=True)
        self.owner = owner

    def run_node(self, n: fx.Node) -> Any:
        if n.op != "call_function":
            return super().run_node(n)
        start = time.perf_counter_ns()
        result = super().run_node(n)
        end = time.perf_counter_ns()
        self.owner.record(n, start, end)
        return result


def aot_eager_backend(recorder: Recorder) -> Callable[..., Any]:
    """A Dynamo backend: AOTAutograd with timed ATen forward/backward/inference graphs."""
    from torch._dynamo.backends.common import aot_autograd

    def backend(gm: fx.GraphModule, example_inputs: list[Any]) -> Any:
        graph_id = recorder.num_dynamo_graphs
        recorder.num_dynamo_graphs += 1
        pending: list[tuple[str, ...]] = []

        def compiler(kind: str) -> Callable[[fx.GraphModule, list[Any]], TimedGraph]:
            return lambda aten_gm, _inputs: TimedGraph(recorder, aten_gm, graph_id, kind, pending)

        return aot_autograd(
            fw_compiler=compiler("forward"),
            bw_compiler=compiler("backward"),
            inference_compiler=compiler("inference"),
        )(gm, example_inputs)

    return backend
