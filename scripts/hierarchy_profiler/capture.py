"""Compile-time capture: what each compiled graph runs, and which scope each of its kernels belongs to.

Nothing here times anything: timing comes from ``torch.profiler`` (see :mod:`.annotate`).
While a :class:`Capture` is installed, every graph Dynamo hands to the backend is compiled
by the real backend (Inductor's ``compile_fx`` or AOTAutograd with ``aot_eager``'s no-op
compilers) and, on the side, we record for each compiled forward/backward/inference graph
the ordered list of kernels it calls and, per kernel, its scope:

* Inductor: the provenance that Inductor itself records at codegen
  (``torch._inductor.config.trace.provenance_tracking_level = 1`` fills
  ``torch._inductor.debug._inductor_triton_kernel_to_post_grad_node_info``: one entry per
  kernel *call* in the generated wrapper, ``"<kernel>:<handle>" -> [post-grad node names]``,
  handles in call order).  The post-grad nodes carry ``call_hierarchy`` (and, in a backward
  graph, ``fwd_call_hierarchy``: the forward op the gradient belongs to).  A kernel fused
  from several nodes gets their lowest common scope, and keeps the distinct source scopes.
* aot_eager: every ``call_function`` node with an ATen target of the ATen graph, in order.

Two ``record_function`` ranges (visible only while the profiler runs) link profiler events
to this record: ``## call_hierarchy dynamo graph D @ S ##`` around each run of a Dynamo graph
(``S`` numbers the module-call stack of the running program at that call, which graph
breaks and shared graphs need), and ``## call_hierarchy graph G <kind> ##`` around each call
of a compiled graph ``G``.  The compiled code itself is not changed.
"""

from __future__ import annotations

import dataclasses
import re
import sys
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import fx, nn

Hierarchy = tuple[Any, ...]  # call_hierarchy entries (torch.fx.call_hierarchy), outermost first
Labels = tuple[str, ...]

RANGE_PREFIX = "## call_hierarchy "
DYNAMO_RANGE = re.compile(r"^## call_hierarchy dynamo graph (\d+) @ (\d+) ##$")
GRAPH_RANGE = re.compile(r"^## call_hierarchy graph (\d+) (\w+) ##$")


# --------------------------------------------------------------------------- entries


def _field(entry: Any, *names: str) -> Any:
    """A field of a call_hierarchy entry, by attribute or mapping key (entry types evolve)."""
    for name in names:
        value = getattr(entry, name, None)
        if value is not None:
            return value
        try:
            return entry[name]
        except (KeyError, TypeError, IndexError):
            continue
    return None


def is_module_entry(entry: Any) -> bool:
    kind = _field(entry, "TYPE", "type")
    return kind == "module" and isinstance(_field(entry, "path"), str)


def module_label(path: str, parent_path: str, class_name: str, count: int = 0) -> str:
    if parent_path and path.startswith(parent_path + "."):
        path = path[len(parent_path) + 1:]
    return f"{path}{f'#{count}' if count else ''} ({class_name})"


def entry_label(entry: Any, parent_path: str) -> str:
    """``entry.label(parent_path)``; an entry type we do not know still renders (never crashes)."""
    label = getattr(entry, "label", None)
    if callable(label):
        try:
            return str(label(parent_path))
        except Exception:
            pass
    return str(entry)


def labels(hierarchy: Sequence[Any], parent_path: str = "") -> Labels:
    """The labels of ``format_call_hierarchy``, one per entry."""
    out = []
    for entry in hierarchy:
        out.append(entry_label(entry, parent_path))
        if is_module_entry(entry):
            parent_path = _field(entry, "path")
    return tuple(out)


def common_prefix(hierarchies: Iterable[Hierarchy]) -> Hierarchy:
    common: Hierarchy | None = None
    for h in hierarchies:
        if common is None:
            common = tuple(h)
            continue
        n = 0
        for a, b in zip(common, h):
            if a != b:
                break
            n += 1
        common = common[:n]
    return common or ()


# --------------------------------------------------------------------------- runtime module stack


class RuntimeScopes:
    """Absolute scopes: runtime module-call stack + the hierarchies a kernel's graph records.

    A graph's hierarchy is relative to the frame Dynamo compiled (the root module's
    ``forward``, a module compiled as its own root after a graph break, a resume
    function), and one graph may serve several callers (``layers.0`` and ``layers.1``).
    Each Dynamo graph run reads the module-call stack of the running program (Python
    frames whose arguments hold modules of the model, outermost first); module paths of
    the graph are rebased onto the innermost running module.  A kernel of an
    ``invoke_subgraph`` body composes the call site's hierarchy and the body's.
    """

    def __init__(self, model: nn.Module) -> None:
        self.root_label = type(model).__name__
        self.modules: dict[str, nn.Module] = dict(model.named_modules())
        self.path_of: dict[int, str] = {id(m): p for p, m in self.modules.items()}
        self._memo: dict[tuple[Any, ...], Labels] = {}

    def module_stack(self) -> tuple[str, ...]:
        """Paths of the model's modules whose frames are running, outermost first.

        A frame belongs to the module bound to one of its arguments (``self`` of
        ``forward``/``_call_impl``/a decorator wrapper, or a live local passed to a
        Dynamo resume function); with several, the outermost (shortest path) one.
        """
        stack: list[str] = []
        frame = sys._getframe(1)
        path_of = self.path_of
        while frame is not None:
            code = frame.f_code
            nargs = code.co_argcount + code.co_kwonlyargcount
            owner: str | None = None
            if nargs:
                f_locals = frame.f_locals
                for name in code.co_varnames[:nargs]:
                    path = path_of.get(id(f_locals.get(name)))
                    if path is not None and (owner is None or len(path) < len(owner)):
                        owner = path
            if owner is not None and (not stack or stack[-1] != owner):
                stack.append(owner)
            frame = frame.f_back
        stack.reverse()
        return tuple(p for i, p in enumerate(stack) if p and p not in stack[:i])

    def _rebase(self, base: str, entry: Any) -> str:
        """Absolute path of a module entry recorded relative to the running module ``base``.

        A compiled frame that reaches its module through a local rather than as its root
        (a Dynamo resume function: ``self.mlp``; a module compiled from a wrapper frame:
        ``fn.0``) records that local's name as the first path component: when the path does
        not resolve under ``base``, it is dropped.
        """
        rel = _field(entry, "path") or ""
        cls = _field(entry, "class_name", "class")
        for candidate in (rel, rel.partition(".")[2]):
            path = ".".join(p for p in (base, candidate) if p)
            module = self.modules.get(path)
            if module is not None and type(module).__name__ == cls:
                return path
        return ".".join(p for p in (base, rel) if p)

    def absolute(self, stack: tuple[str, ...], *parts: Hierarchy) -> Labels:
        """Labels from the model root: the running module stack, then each part rebased."""
        key = (stack, parts)
        result = self._memo.get(key)
        if result is not None:
            return result
        out = [self.root_label]
        parent = ""
        for path in stack:
            out.append(module_label(path, parent, type(self.modules[path]).__name__))
            parent = path
        for hierarchy in parts:
            # paths of one part are relative to the module running it: the innermost module so far
            base = parent
            for entry in hierarchy:
                if is_module_entry(entry):
                    path = self._rebase(base, entry)
                    if path == parent or path == base:
                        continue  # the running module itself: the root, or already on the stack
                    cls = _field(entry, "class_name", "class") or "?"
                    out.append(module_label(path, parent, str(cls), int(_field(entry, "count") or 0)))
                    parent = path
                else:
                    out.append(entry_label(entry, parent))
        result = tuple(out)
        self._memo[key] = result
        return result


# --------------------------------------------------------------------------- compiled graphs


@dataclasses.dataclass
class Kernel:
    """One kernel call of a compiled graph, in the order the graph calls them."""

    key: str  # the profiler event it appears as, normalized (see event_key)
    name: str  # the name to show, e.g. "cpp_fused_add_mul_0" or "aten::mm"
    hierarchy: Hierarchy  # common scope of its source nodes, relative to the graph's frame
    sources: tuple[Hierarchy, ...] = ()  # the distinct source scopes when they differ (fusion)
    subgraph: str | None = None  # name of the invoke_subgraph body it belongs to


@dataclasses.dataclass
class CompiledGraph:
    index: int
    dynamo_graph: int
    kind: str  # "forward", "backward" or "inference"
    backend: str
    kernels: list[Kernel] = dataclasses.field(default_factory=list)
    # invoke_subgraph bodies: name -> their kernels, and the call sites' hierarchies in call order
    subgraphs: dict[str, list[Kernel]] = dataclasses.field(default_factory=dict)
    call_sites: dict[str, list[Hierarchy]] = dataclasses.field(default_factory=dict)

    @property
    def label(self) -> str:
        return f"{RANGE_PREFIX}graph {self.index} {self.kind} ##"

    @property
    def backward(self) -> bool:
        return self.kind == "backward"


_GRAPH_PREFIX = re.compile(r"^graph_\d+_")


def event_key(name: str) -> str:
    """Normalize a profiler event name: Inductor's CPU kernel profiling prefixes ``graph_N_``."""
    return _GRAPH_PREFIX.sub("", name)


def kernel_key(name: str) -> str:
    """The profiler event name of a kernel named as in Inductor's generated wrapper."""
    if name.startswith("extern_kernels."):
        return "aten::" + name[len("extern_kernels."):]
    if name.startswith("torch.ops."):
        parts = name[len("torch.ops."):].split(".")
        if len(parts) >= 2:
            return f"{parts[0]}::{parts[1]}"
    return name


def aten_key(target: Any) -> str | None:
    if isinstance(target, torch._ops.OpOverload):
        return f"{target.namespace}::{target._opname}"
    return None


def _node_hierarchy(node: fx.Node, backward: bool) -> Hierarchy | None:
    meta = node.meta
    if backward and meta.get("fwd_call_hierarchy") is not None:
        return tuple(meta["fwd_call_hierarchy"])
    if meta.get("call_hierarchy") is not None:
        return tuple(meta["call_hierarchy"])
    return None


def _subgraph_call_sites(gm: fx.GraphModule) -> dict[str, list[fx.Node]]:
    sites: dict[str, list[fx.Node]] = {}
    for node in gm.graph.nodes:
        if node.op == "call_function" and "invoke_subgraph" in str(node.target) and node.args:
            body = node.args[0]
            if isinstance(body, fx.Node) and body.op == "get_attr":
                sites.setdefault(str(body.target), []).append(node)
    return sites


def _make_kernel(name: str, nodes: Sequence[fx.Node], backward: bool, subgraph: str | None) -> Kernel:
    hierarchies = [h for h in (_node_hierarchy(n, backward) for n in nodes) if h is not None]
    distinct: list[Hierarchy] = []
    for h in hierarchies:
        if h not in distinct:
            distinct.append(h)
    common = common_prefix(distinct)
    return Kernel(kernel_key(name), name if name.startswith("aten::") else kernel_key(name), common,
                  tuple(distinct) if len(distinct) > 1 else (), subgraph)


def inductor_kernels(graph: CompiledGraph, gm: fx.GraphModule, provenance: dict[str, list[str]]) -> None:
    """Fill ``graph.kernels`` from Inductor's kernel -> post-grad node provenance, in call order."""
    nodes = {n.name: n for n in gm.graph.nodes}
    sites = _subgraph_call_sites(gm)
    sub_nodes: dict[str, dict[str, fx.Node]] = {}
    for name in sites:
        sub = getattr(gm, name, None)
        if isinstance(sub, fx.GraphModule):
            sub_nodes[name] = {n.name: n for n in sub.graph.nodes}
    for name, calls in sites.items():
        graph.call_sites[name] = [tuple(n.meta.get("call_hierarchy") or ()) for n in calls]

    def handle(key: str) -> int:
        tail = key.rpartition(":")[2]
        return int(tail) if tail.isdigit() else 0

    for key in sorted(provenance, key=handle):
        kernel_name = key.rpartition(":")[0] or key
        origins = provenance[key]
        # Which graph the origins live in: the outer graph, or one invoke_subgraph body.
        subgraph = None
        table = nodes
        if origins and not all(o in nodes for o in origins):
            for sub_name, sub_table in sub_nodes.items():
                if all(o in sub_table for o in origins):
                    subgraph, table = sub_name, sub_table
                    break
        found = [table[o] for o in origins if o in table]
        # A fallback extern kernel also lists the nodes that computed its inputs: keep the
        # node whose op it runs.
        own = [n for n in found if f"torch.ops.{n.target}" == kernel_name]
        kernel = _make_kernel(kernel_name, own or found, graph.backward, subgraph)
        if subgraph is None:
            graph.kernels.append(kernel)
        else:
            graph.subgraphs.setdefault(subgraph, []).append(kernel)


def aten_graph_kernels(graph: CompiledGraph, gm: fx.GraphModule) -> None:
    """Fill ``graph.kernels`` with the ATen ops of an ``aot_eager`` graph, in run order."""
    sites = _subgraph_call_sites(gm)
    for name, calls in sites.items():
        graph.call_sites[name] = [tuple(n.meta.get("call_hierarchy") or ()) for n in calls]
        sub = getattr(gm, name, None)
        if isinstance(sub, fx.GraphModule):
            body = []
            for node in sub.graph.nodes:
                key = aten_key(node.target) if node.op == "call_function" else None
                if key is not None:
                    body.append(_make_kernel(key, [node], graph.backward, name))
            graph.subgraphs[name] = body
    for node in gm.graph.nodes:
        key = aten_key(node.target) if node.op == "call_function" else None
        if key is not None:
            graph.kernels.append(_make_kernel(key, [node], graph.backward, None))


# --------------------------------------------------------------------------- the capture


def _profiling() -> bool:
    return bool(torch.autograd.profiler._is_profiler_enabled)


class Capture:
    """What was compiled while installed, and the runtime module stacks of Dynamo graph runs."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.scopes = RuntimeScopes(model)
        self.graphs: list[CompiledGraph] = []
        self.num_dynamo_graphs = 0
        self.stacks: list[tuple[str, ...]] = []
        self._stack_ids: dict[tuple[str, ...], int] = {}

    def stack_id(self, stack: tuple[str, ...]) -> int:
        sid = self._stack_ids.get(stack)
        if sid is None:
            sid = self._stack_ids[stack] = len(self.stacks)
            self.stacks.append(stack)
        return sid

    def new_graph(self, dynamo_graph: int, kind: str, backend: str) -> CompiledGraph:
        graph = CompiledGraph(len(self.graphs), dynamo_graph, kind, backend)
        self.graphs.append(graph)
        return graph

    def wrap_dynamo_graph(self, compiled: Callable[..., Any], dynamo_graph: int) -> Callable[..., Any]:
        """Each run of a Dynamo graph, while profiling, inside a range naming its module stack."""
        scopes = self.scopes
        record = torch._C._profiler._RecordFunctionFast

        def run(*args: Any) -> Any:
            if not _profiling():
                return compiled(*args)
            sid = self.stack_id(scopes.module_stack())
            with record(f"{RANGE_PREFIX}dynamo graph {dynamo_graph} @ {sid} ##"):
                return compiled(*args)

        run.__wrapped__ = compiled  # type: ignore[attr-defined]
        return run

    # ---- Inductor

    def inductor_backend(self) -> Callable[..., Any]:
        """A Dynamo backend: Inductor's ``compile_fx`` with our ``inner_compile`` hook."""
        from torch._inductor.compile_fx import compile_fx

        def backend(gm: fx.GraphModule, example_inputs: list[Any], **kwargs: Any) -> Any:
            return self._compile_inductor(compile_fx, gm, example_inputs, **kwargs)

        return backend

    def _compile_inductor(self, compile_fx: Callable[..., Any], gm: fx.GraphModule,
                          example_inputs: Any, **kwargs: Any) -> Any:
        dynamo_graph = self.num_dynamo_graphs
        self.num_dynamo_graphs += 1
        kwargs["inner_compile"] = self._inner_compile(dynamo_graph, kwargs.get("inner_compile"))
        return self.wrap_dynamo_graph(compile_fx(gm, example_inputs, **kwargs), dynamo_graph)

    def _inner_compile(self, dynamo_graph: int, inner: Callable[..., Any] | None) -> Callable[..., Any]:
        import torch._inductor.debug as inductor_debug
        from torch._inductor.compile_fx import compile_fx_inner

        inner = inner or compile_fx_inner

        def inner_compile(gm: fx.GraphModule, example_inputs: Any, **kwargs: Any) -> Any:
            before = set(inductor_debug._inductor_triton_kernel_to_post_grad_node_info)
            compiled = inner(gm, example_inputs, **kwargs)
            info = inductor_debug._inductor_triton_kernel_to_post_grad_node_info
            provenance = {k: list(v) for k, v in info.items() if k not in before}
            kind = "backward" if kwargs.get("is_backward") else (
                "inference" if kwargs.get("is_inference") else "forward")
            graph = self.new_graph(dynamo_graph, kind, "inductor")
            inductor_kernels(graph, gm, provenance)
            self._label_calls(compiled, graph)
            return compiled

        inner_compile._call_hierarchy_capture = True  # type: ignore[attr-defined]
        return inner_compile

    def _label_calls(self, compiled: Any, graph: CompiledGraph) -> None:
        """Name each call of the compiled graph with a range (the generated code is unchanged)."""
        current = getattr(compiled, "current_callable", None)
        if current is None:
            return
        label = graph.label
        record = torch._C._profiler._RecordFunctionFast

        def call(inputs: Any) -> Any:
            if not _profiling():
                return current(inputs)
            with record(label):
                return current(inputs)

        compiled.current_callable = call

    # ---- aot_eager

    def aot_eager_backend(self) -> Callable[..., Any]:
        """A Dynamo backend: ``aot_eager`` (AOTAutograd, ATen graphs run as they are)."""
        from torch._dynamo.backends.common import aot_autograd
        from torch._functorch.aot_autograd import make_boxed_func

        def backend(gm: fx.GraphModule, example_inputs: list[Any]) -> Any:
            dynamo_graph = self.num_dynamo_graphs
            self.num_dynamo_graphs += 1

            def compiler(kind: str) -> Callable[[fx.GraphModule, Any], Any]:
                def compile_graph(aten_gm: fx.GraphModule, _inputs: Any) -> Any:
                    graph = self.new_graph(dynamo_graph, kind, "aot_eager")
                    aten_graph_kernels(graph, aten_gm)
                    label = graph.label
                    record = torch._C._profiler._RecordFunctionFast
                    forward = aten_gm.forward

                    def run(*args: Any) -> Any:
                        if not _profiling():
                            return forward(*args)
                        with record(label):
                            return forward(*args)

                    return make_boxed_func(run)

                return compile_graph

            compiled = aot_autograd(
                fw_compiler=compiler("forward"),
                bw_compiler=compiler("backward"),
                inference_compiler=compiler("inference"),
                keep_inference_input_mutations=True,
            )(gm, example_inputs)
            return self.wrap_dynamo_graph(compiled, dynamo_graph)

        return backend
