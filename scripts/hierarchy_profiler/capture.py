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
  Where patch 0019 recorded a kernel's scope (``CompiledFxGraph._kernel_call_hierarchies``,
  what a cache hit of the graph reads), that scope is taken: it leaves out of a GEMM
  template's the nodes that computed its inputs, which provenance lists among its origins.
* aot_eager: every ``call_function`` node with an ATen target of the ATen graph, in order.

Three ``record_function`` ranges (visible only while the profiler runs) link profiler events
to this record: ``## call_hierarchy dynamo graph D @ S ##`` around each run of a Dynamo graph
(``S`` numbers the module-call stack of the running program at that call, which graph
breaks and shared graphs need), ``## call_hierarchy graph G <kind> ##`` around each call
of a compiled graph ``G``, and ``## call_hierarchy branch <name> ##`` around each call of a
subgraph that a higher-order op calls a number of times known only at run time (a
``torch.cond`` branch, a ``torch.while_loop``'s cond_fn and body_fn).  The compiled code
itself is not changed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
from torch import fx, nn

Hierarchy = tuple[Any, ...]  # call_hierarchy entries (torch.fx.call_hierarchy), outermost first
Labels = tuple[str, ...]

RANGE_PREFIX = "## call_hierarchy "
DYNAMO_RANGE = re.compile(r"^## call_hierarchy dynamo graph (\d+) @ (\d+) ##$")
GRAPH_RANGE = re.compile(r"^## call_hierarchy graph (\d+) (\w+) ##$")
BRANCH_RANGE = re.compile(r"^## call_hierarchy branch (\S+) ##$")
OUTSIDE_SUFFIX = " (outside the model)"  # the label of code outside the model: printed beside its root


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


@dataclasses.dataclass(frozen=True)
class Outside:
    """A Dynamo graph run outside the model, under ``label`` below the model's root in the scopes
    (the trace's ``args["call_hierarchy"]``); the tree, folded stacks and flame graph show it
    beside the model's root (:func:`.tree.top_level`)."""

    label: str  # e.g. "train_step (outside the model)"
    # True: nothing of the run is the model's (an optimizer step, another model): every kernel
    # goes under the label.  False: a function that calls the model (a step function): only its
    # kernels that enter no module of the model do (the loss, the optimizer step).
    whole: bool = False


def _unwrapped(module: Any) -> Any:
    """The module that torch.compile's ``OptimizedModule`` wraps, else ``module``."""
    while isinstance(module, torch._dynamo.eval_frame.OptimizedModule):
        module = module._orig_mod
    return module


def _without_wrappers(path: str) -> str:
    """``path`` without the ``_orig_mod`` levels of torch.compile's wrapper modules."""
    return ".".join(p for p in path.split(".") if p != "_orig_mod") if "_orig_mod" in path else path


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
        model = _unwrapped(model)
        self.root_label = type(model).__name__
        # torch.compile's wrapper (``layers.0 = torch.compile(layer)``) is not a scope: it has
        # its module's path, and ``_orig_mod`` is left out of paths
        self.modules: dict[str, nn.Module] = {
            _without_wrappers(p): m for p, m in model.named_modules() if _unwrapped(m) is m}
        self.path_of: dict[int, str] = {id(m): p for p, m in self.modules.items()}
        for m in model.modules():
            if _unwrapped(m) is not m and id(_unwrapped(m)) in self.path_of:
                self.path_of[id(m)] = self.path_of[id(_unwrapped(m))]
        # by the identity of the entries: hashing entries is slow (no cached hash), and a
        # model's graphs share one entry object per scope; the parts kept alive with the result
        self._memo: dict[tuple[Any, ...], tuple[tuple[Hierarchy, ...], Labels]] = {}
        # what absolute() reads of each entry (id -> entry, is a module entry, class as recorded,
        # class label, path, count), and _rebase's answers by (base, id(entry)): one pass over
        # a model's entries instead of one per hierarchy that holds them
        self._entries: dict[int, tuple[Any, bool, Any, str, str, Any]] = {}
        self._rebased: dict[tuple[str, int], str] = {}

    def clear_caches(self) -> None:
        """Forget the labels computed so far: the next :meth:`absolute` calls are as cold as the
        first ones (to measure post-processing, ``scripts/profile_cost.py``)."""
        for cache in (self._memo, self._entries, self._rebased):
            cache.clear()

    def module_stack(self) -> tuple[str, ...] | None:
        """Paths of the model's modules whose frames are running, outermost first.

        A frame belongs to the module bound to one of its arguments (``self`` of
        ``forward``/``_call_impl``/a decorator wrapper, or a live local passed to a
        Dynamo resume function); with several, the outermost (shortest path) one.
        ``None``: no module of the model runs at all (none is the ``self`` of a running frame,
        and none but the model itself is an argument of one): code outside the model, such as
        an optimizer step.
        """
        stack: list[str] = []
        inside = False  # a method of one of the model's modules runs
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
                    if path is not None:
                        inside = inside or name == "self"
                        if owner is None or len(path) < len(owner):
                            owner = path
            if owner is not None and (not stack or stack[-1] != owner):
                stack.append(owner)
            frame = frame.f_back
        stack.reverse()
        paths = tuple(p for i, p in enumerate(stack) if p and p not in stack[:i])
        return paths if paths or inside else None

    def _rebase(self, base: str, rel: str, cls: Any) -> str:
        """Absolute path of a module entry recorded relative to the running module ``base``.

        A compiled frame that reaches its module through a local rather than as its root
        (a Dynamo resume function: ``self.mlp``; a torch.nn module's bound method compiled
        from Dynamo's wrapper frame: ``fn.__self__.0``; a bound method: ``forward.__self__.mlp``)
        records that access path as the leading path components: they are dropped until the
        path resolves under ``base`` to a module of the recorded class.
        """
        parts = rel.split(".") if rel else []
        for i in range(len(parts) + 1):
            path = ".".join(p for p in (base, ".".join(parts[i:])) if p)
            module = self.modules.get(path)
            if module is not None and type(module).__name__ == cls:
                return path
        return ".".join(p for p in (base, rel) if p)

    def _entry(self, entry: Any) -> tuple[Any, bool, Any, str, str, Any]:
        """(entry, is a module entry, class as recorded, class label, path, count), read once."""
        found = self._entries.get(id(entry))
        if found is None or found[0] is not entry:
            if is_module_entry(entry):
                raw_class = _field(entry, "class_name", "class")
                found = (entry, True, raw_class, str(raw_class or "?"), _without_wrappers(_field(entry, "path") or ""),
                         _field(entry, "count"))
            else:
                found = (entry, False, None, "", "", None)
            self._entries[id(entry)] = found  # keeps the entry alive: its id stays its own
        return found

    def absolute(self, stack: tuple[str, ...], *parts: Hierarchy, outside: Outside | None = None) -> Labels:
        """Labels from the model root: the running module stack, then each part rebased.

        ``outside``: the label of a function outside the model that the graph ran under
        (``train_step (outside the model)``); it goes after the root when the run is wholly
        outside the model (:attr:`Outside.whole`) or when no part enters a
        module of the model (the loss, a loss module, the optimizer step).
        """
        key = ((stack, outside, tuple(map(id, parts[0]))) if len(parts) == 1
               else (stack, outside, *[tuple(map(id, p)) for p in parts]))
        found = self._memo.get(key)
        if found is not None:
            return found[1]
        out = [self.root_label]
        parent = ""
        modules = self.modules
        for path in stack:
            out.append(module_label(path, parent, type(modules[path]).__name__))
            parent = path
        previous_class: str | None = None
        rebased = self._rebased
        entered = False  # a module entry resolved to a module of the model
        for hierarchy in parts:
            # paths of one part are relative to the module running it: the innermost module so far
            base = parent
            hierarchy = _below_call_site(hierarchy, previous_class)
            for entry in hierarchy:
                _, is_module, raw_class, cls, own, count = self._entry(entry)
                if is_module:
                    module = modules.get(own)
                    if (previous_class is not None and own and module is not None
                            and type(module).__name__ == cls and (parent == own or parent.startswith(own + "."))):
                        entered = True
                        continue  # a body naming a module its call site is already inside
                    path = rebased.get((base, id(entry)))
                    if path is None:
                        path = rebased[(base, id(entry))] = self._rebase(base, own, raw_class)
                    previous_class = cls
                    entered = entered or path in modules
                    if path == parent or path == base:
                        continue  # the running module itself: the root, or already on the stack
                    out.append(module_label(path, parent, cls, int(count or 0)))
                    parent = path
                else:
                    out.append(entry_label(entry, parent))
        if outside is not None and (outside.whole or not entered):
            out.insert(1, outside.label)
        result = tuple(out)
        self._memo[key] = (parts, result)
        return result


def _below_call_site(body: Hierarchy, site_class: str | None) -> Hierarchy:
    """The part of an invoke_subgraph body's hierarchy below its call site's module.

    A body records either hierarchies relative to the region (nothing to drop) or, as
    traced for its first caller, the whole path down to that caller's module (``model >
    layers.0 > ...``): that prefix names one caller only, so it is dropped, up to the last
    module entry of the call site's class.
    """
    if site_class is None:
        return body
    last = -1
    for i, entry in enumerate(body):
        if is_module_entry(entry) and str(_field(entry, "class_name", "class")) == site_class:
            last = i
    return body[last + 1:] if last >= 0 else body


# --------------------------------------------------------------------------- compiled graphs


@dataclasses.dataclass
class Kernel:
    """One kernel call of a compiled graph, in the order the graph calls them."""

    key: str  # the profiler event it appears as, normalized (see event_key)
    name: str  # the name to show, e.g. "cpp_fused_add_mul_0" or "aten::mm"
    hierarchy: Hierarchy  # common scope of its source nodes, relative to the graph (or body) it is in
    sources: tuple[Hierarchy, ...] = ()  # the distinct source scopes when they differ (fusion)
    # invoke_subgraph call sites (outermost first) when the kernel is in a body called from them:
    # its scope is call site(s) + body hierarchy
    sites: tuple[Hierarchy, ...] = ()
    # a backward graph's kernel made only from forward ops it recomputes (activation checkpointing,
    # the partitioner's recomputation): none of its nodes differentiates one
    recompute: bool = False


@dataclasses.dataclass
class Branch:
    """A subgraph that a higher-order op calls a number of times known only at run time (a
    ``torch.cond`` branch, a ``torch.while_loop``'s cond_fn or body_fn; with aot_eager a scan's
    step, a map's body), or a whole scan or map call (aot_eager): each call is seen from its
    range (``## call_hierarchy branch <name> ##``) around the call of its code."""

    call: Kernel  # the call itself, at the cond's scope (its own time is Python's, not a kernel's)
    kernels: list[Kernel] = dataclasses.field(default_factory=list)  # its kernel calls, in run order
    # A whole scan or map call (aot_eager): the ATen ops of its own loop (slicing, stacking) match
    # no kernel of a graph; each is the call's, by op name, at the call's scope.
    own: dict[str, Kernel] | None = None

    def own_kernel(self, key: str) -> Kernel | None:
        """The call's own op ``key`` (a scan's or map's loop), or ``None`` for other ranges."""
        if self.own is None:
            return None
        kernel = self.own.get(key)
        if kernel is None:
            kernel = self.own[key] = Kernel(key, key, self.call.hierarchy, sites=self.call.sites)
        return kernel


@dataclasses.dataclass
class CompiledGraph:
    index: int
    dynamo_graph: int
    kind: str  # "forward", "backward" or "inference"
    backend: str
    # every kernel call of one run, in run order (invoke_subgraph bodies expanded per call)
    kernels: list[Kernel] = dataclasses.field(default_factory=list)
    # subgraphs called at run time (torch.cond branches, a while_loop's cond_fn and body_fn) by the
    # name of their function, matched when their range is in the trace
    branches: dict[str, Branch] = dataclasses.field(default_factory=dict)
    # events the graph's code makes any number of times among its kernel calls, by event key: a
    # while_loop reads its predicate once per iteration (``aten::is_nonzero``); Inductor's wrapper
    # reads device scalars (``aten::item``, see add_host_reads)
    repeats: dict[str, Kernel] = dataclasses.field(default_factory=dict)

    @property
    def common_scope(self) -> Hierarchy:
        """The lowest scope holding every kernel of the graph (an invoke_subgraph body's: its call site's)."""
        return common_prefix(k.sites[0] if k.sites else k.hierarchy for k in self.kernels)

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
    # a fallback (``torch.ops.aten.add.Tensor``) or an extern kernel named by its op
    # (``aten.randint.low_out``: Inductor's RNG seeds); generated kernels have no dots
    parts = name.removeprefix("torch.ops.").split(".")
    if len(parts) >= 2 and "::" not in name:
        return f"{parts[0]}::{parts[1]}"
    return name


def aten_key(target: Any) -> str | None:
    if isinstance(target, torch._ops.OpOverload):
        return f"{target.namespace}::{target._opname}"
    return None


def wrapper_op_name(target: Any) -> str:
    """How Inductor's generated wrapper names the op ``target`` when it calls it as a fallback."""
    if isinstance(target, torch._ops.HigherOrderOperator):  # str() is its bare name
        return f"torch.ops.{target.namespace}.{target.name()}"
    return f"torch.ops.{target}"


# Higher-order ops that run an op with the RNG state saved or restored (a random op under
# activation checkpointing, and its recomputation).  They run in Python and record no profiler
# event: the op they run does.
_RNG_STATE_OPS = frozenset({"run_and_save_rng_state", "run_with_rng_state", "graphsafe_run_with_rng_state"})


def ran_op_key(node: fx.Node) -> str | None:
    """The event key of the op that an RNG-state higher-order op node runs; ``None`` for other nodes."""
    target = node.target
    if isinstance(target, torch._ops.HigherOrderOperator) and target.name() in _RNG_STATE_OPS:
        return next((aten_key(a) for a in node.args if isinstance(a, torch._ops.OpOverload)), None)
    return None


def _node_hierarchy(node: fx.Node, backward: bool) -> Hierarchy | None:
    meta = node.meta
    if backward and meta.get("fwd_call_hierarchy") is not None:
        return tuple(meta["fwd_call_hierarchy"])
    if meta.get("call_hierarchy") is not None:
        return tuple(meta["call_hierarchy"])
    return None


def _is_invoke_subgraph(node: fx.Node) -> bool:
    return node.op == "call_function" and "invoke_subgraph" in str(node.target)


def _body_name(node: fx.Node) -> str | None:
    body = node.args[0] if node.args else None
    return str(body.target) if isinstance(body, fx.Node) and body.op == "get_attr" else None


# Higher-order ops that call subgraphs a number of times known only at run time, and the
# arguments that are the subgraphs: torch.cond's branches, torch.while_loop's cond_fn and body_fn.
_RUNTIME_SUBGRAPHS = {"cond": slice(1, 3), "while_loop": slice(0, 2)}
# In an ``aot_eager`` graph also a scan's step (called once per step) and a map's body (once per
# slice): ATen runs them as Python loops over the subgraph.  (Inductor's CPU lowering of both fails
# in torch 2.13, the flag off too, so the names its wrapper would call them by are not known here.)
_EAGER_RUNTIME_SUBGRAPHS = {**_RUNTIME_SUBGRAPHS, "scan": slice(0, 1), "map_impl": slice(0, 1)}
_LOOPS = frozenset({"scan", "map_impl"})


@dataclasses.dataclass(frozen=True)
class _Subgraph:
    name: str  # the attribute of the graph module
    op: str  # the higher-order op: "cond", "while_loop", "scan", "map_impl"
    hierarchy: Hierarchy  # the op node's (the subgraph's nodes record their own whole hierarchies)


def _runtime_subgraphs(gm: fx.GraphModule, backward: bool,
                       ops: dict[str, slice] = _RUNTIME_SUBGRAPHS) -> dict[str, _Subgraph]:
    """The subgraphs that higher-order ops of ``gm`` (those in ``ops``) call at run time, by the
    names Inductor's wrapper gives their functions (a cond's: the attribute's; a while_loop's:
    ``<node>_<attribute>``) and by their attributes."""
    found: dict[str, _Subgraph] = {}
    for node in gm.graph.nodes:
        target = node.target
        if node.op != "call_function" or not isinstance(target, torch._ops.HigherOrderOperator):
            continue
        args = ops.get(target.name())
        for arg in node.args[args] if args is not None else ():
            if isinstance(arg, fx.Node) and arg.op == "get_attr":
                sub = _Subgraph(str(arg.target), target.name(), _node_hierarchy(node, backward) or ())
                found[sub.name] = found[f"{node.name}_{sub.name}"] = sub
    return found


def _predicate(sub: _Subgraph, site_prefix: tuple[Hierarchy, ...]) -> Kernel:
    """The read of a cond's or a while_loop's predicate on the host (``bool(tensor)``)."""
    return Kernel("aten::is_nonzero", "aten::is_nonzero", sub.hierarchy, sites=site_prefix)


def _branch(name: str, sub: _Subgraph, site_prefix: tuple[Hierarchy, ...]) -> Branch:
    return Branch(Kernel(f"{RANGE_PREFIX}branch {name} ##", f"{name} (torch.{sub.op})", sub.hierarchy,
                         sites=site_prefix))


def _call_sites(gm: fx.GraphModule, backward: bool) -> dict[str, list[Hierarchy]]:
    """invoke_subgraph body name -> the call sites' hierarchies, in graph order."""
    sites: dict[str, list[Hierarchy]] = {}
    for node in gm.graph.nodes:
        name = _body_name(node) if _is_invoke_subgraph(node) else None
        if name is not None:
            sites.setdefault(name, []).append(_node_hierarchy(node, backward) or ())
    return sites


def _make_kernel(name: str, nodes: Sequence[fx.Node], backward: bool) -> Kernel:
    hierarchies = [h for h in (_node_hierarchy(n, backward) for n in nodes) if h is not None]
    distinct: list[Hierarchy] = []
    for h in hierarchies:
        if h not in distinct:
            distinct.append(h)
    common = common_prefix(distinct)
    # as patch 0019 marks it: nodes with a hierarchy, none of them a backward op's
    recompute = backward and bool(hierarchies) and all(n.meta.get("fwd_call_hierarchy") is None for n in nodes)
    return Kernel(kernel_key(name), name if name.startswith("aten::") else kernel_key(name), common,
                  tuple(distinct) if len(distinct) > 1 else (), recompute=recompute)


_DEF = re.compile(r"^(\s*)def (\w+)\(")
_COND_ITEM = re.compile(r"^\s*if .+\.item\(\):\s*$")  # a torch.cond's predicate, read on the host
_HANDLE = re.compile(r"# \[Provenance debug handles\] (\S+):(\d+)\s*$")


def wrapper_calls(source: str, functions: Iterable[str]) -> dict[str, list[tuple[str, str]]]:
    """Per function of Inductor's generated wrapper, its kernel calls and body calls in order.

    Items: ``("kernel", "<name>:<handle>")`` from the provenance comment Inductor writes
    before each kernel call, ``("body", "<function>")`` for a call of an invoke_subgraph body
    or a torch.cond branch, ``("item", "")`` where a cond's predicate is read (``aten::item``).
    Functions that are not bodies are pooled under ``""`` (the graph's ``call``).
    """
    bodies = set(functions)
    call_of = re.compile(r"\b(" + "|".join(re.escape(b) for b in sorted(bodies)) + r")\(") if bodies else None
    out: dict[str, list[tuple[str, str]]] = {"": []}
    current = ""
    indent = -1
    for line in source.splitlines():
        m = _DEF.match(line)
        if m:
            if len(m.group(1)) <= indent or indent < 0 or current == "":
                name = m.group(2)
                current, indent = (name, len(m.group(1))) if name in bodies else ("", -1)
                out.setdefault(current, [])
            continue
        if current and line.strip() and len(line) - len(line.lstrip()) <= indent:
            current, indent = "", -1
        h = _HANDLE.search(line)
        if h:
            out[current].append(("kernel", f"{h.group(1)}:{h.group(2)}"))
        elif _COND_ITEM.match(line):
            out[current].append(("item", ""))
        elif call_of is not None and not line.lstrip().startswith("#"):
            c = call_of.search(line)
            if c:
                out[current].append(("body", c.group(1)))
    return out


# The entries made from a cache entry's dicts, by the dicts' items: the kernels of a cached graph
# then share one entry object per scope, as a compiled graph's share its nodes' (the labels are
# made once per entry and per hierarchy, by identity: RuntimeScopes.absolute).  One per distinct
# entry of the models profiled in the process.
_ENTRY_OF_ITEMS: dict[tuple[tuple[str, Any], ...], Any] = {}


def _entries_from_dicts(dicts: Sequence[dict[str, Any]]) -> Hierarchy:
    """``call_hierarchy_from_dicts(dicts)``, one entry object for equal dicts."""
    from torch.fx.call_hierarchy import call_hierarchy_from_dicts

    out = []
    for d in dicts:
        items = tuple(d.items())
        try:
            entry = _ENTRY_OF_ITEMS.get(items)
        except TypeError:  # a value that is not hashable: an entry of its own
            entry = items = None
        if entry is None:
            entry = call_hierarchy_from_dicts([d])[0]
            if items is not None:
                _ENTRY_OF_ITEMS[items] = entry
        out.append(entry)
    return tuple(out)


def cached_kernel(key: str, info: dict[str, Any] | None) -> Kernel:
    """A kernel of a graph loaded from the FX graph cache, which ran no codegen: its scope is the
    one the cache entry carries (patch 0019's ``CompiledFxGraph._kernel_call_hierarchies``)."""
    name = key.rpartition(":")[0] or key
    hierarchy: Hierarchy = ()
    sources: tuple[Hierarchy, ...] = ()
    recompute = False
    if info is not None:
        hierarchy = _entries_from_dicts(info["call_hierarchy"])
        sources = tuple(_entries_from_dicts(h) for h in info.get("call_hierarchy_sources", ()))
        recompute = bool(info.get("call_hierarchy_recomputed"))
    return Kernel(kernel_key(name), name if name.startswith("aten::") else kernel_key(name), hierarchy, sources,
                  recompute=recompute)


def cached_provenance(compiled: Any) -> tuple[dict[str, list[str]], dict[str, Any]] | None:
    """For a graph loaded from the FX graph cache: its kernel keys in code order (from the
    provenance comments of its cached code) and the scopes its entry carries; ``None`` if the
    entry carries none (written with ``record_call_hierarchy`` off, or without patch 0019) or
    carries another program's: the cache keys leave hierarchies out, so an entry serves every
    program that compiles to its graph (a helper renamed, another model of the same shape), and
    patch 0019 keeps a digest of the hierarchies its scopes were made from."""
    from torch._inductor import debug as inductor_debug

    recorded = getattr(compiled, "_kernel_call_hierarchies", None)
    source = getattr(compiled, "source_code", None)
    if recorded is None or not source:
        return None
    if recorded.get("program") != inductor_debug._program_call_hierarchies_digest():
        return None
    keys = [f"{m.group(1)}:{m.group(2)}" for m in map(_HANDLE.search, source.splitlines()) if m]
    return {key: [] for key in keys}, recorded["kernels"]


# the functions at the top level of Inductor's Python wrapper that are not a subgraph's (an
# invoke_subgraph body, a cond branch, a while_loop's body): its ``call`` is Runner's method
_WRAPPER_FUNCTIONS = frozenset({"call", "get_args", "benchmark_compiled_module"})
_TOP_LEVEL_DEF = re.compile(r"^def (\w+)\(", re.MULTILINE)


def has_subgraph_functions(source: str) -> bool:
    """Whether Inductor's wrapper code defines functions of subgraphs, whose call sites only the
    post-grad graph gives."""
    return any(m.group(1) not in _WRAPPER_FUNCTIONS for m in _TOP_LEVEL_DEF.finditer(source))


def inductor_kernels(graph: CompiledGraph, gm: fx.GraphModule | None, provenance: dict[str, list[str]],
                     source: str | None, cached: dict[str, Any] | None = None,
                     recorded: dict[str, Any] | None = None) -> None:
    """Fill ``graph.kernels`` from Inductor's kernel -> post-grad node provenance, in call order;
    for a graph loaded from the FX graph cache, from the scopes its entry carries (``cached``).
    ``gm`` is ``None`` for a graph the AOTAutograd cache loaded (no post-grad graph): it then
    has no subgraph function (see :func:`has_subgraph_functions`) and ``cached`` is given.
    ``recorded``: for a graph compiled here, the scopes patch 0019 recorded for its kernels, which
    its cache entry will carry: a kernel's scope is the one recorded for it, so that a warm hit
    gives what the cold compile gave (provenance lists among a template kernel's origins the
    GEMMs that computed its inputs, whose scopes 0019 leaves out); its name, and the scope of a
    kernel with none recorded, come from provenance."""
    named = gm.named_modules() if gm is not None else ()
    modules = {name: m for name, m in named if isinstance(m, fx.GraphModule)}
    tables = {name: {n.name: n for n in m.graph.nodes} for name, m in modules.items()}
    sites = {name: _call_sites(m, graph.backward) for name, m in modules.items()}
    bodies = {b for s in sites.values() for b in s}
    conds = {name: _runtime_subgraphs(m, graph.backward) for name, m in modules.items()}
    branches = {b for c in conds.values() for b in c}

    def kernel(key: str, table: dict[str, fx.Node]) -> Kernel:
        if cached is not None:
            return cached_kernel(key, cached.get(key))
        kernel_name = key.rpartition(":")[0] or key
        found = [table[o] for o in provenance.get(key, ()) if o in table]
        # A fallback extern kernel also lists the nodes that computed its inputs: keep the
        # node whose op it runs.
        own = [n for n in found if wrapper_op_name(n.target) == kernel_name]
        ran = ran_op_key(own[0]) if len(own) == 1 else None
        made = _make_kernel(ran or kernel_name, own or found, graph.backward)
        info = recorded.get(key) if recorded is not None else None
        if info is not None:
            scoped = cached_kernel(key, info)
            made.hierarchy, made.sources, made.recompute = scoped.hierarchy, scoped.sources, scoped.recompute
        return made

    if source is None or not (bodies or branches):
        def handle(key: str) -> int:
            tail = key.rpartition(":")[2]
            return int(tail) if tail.isdigit() else 0

        graph.kernels = [kernel(k, tables.get("", {})) for k in sorted(provenance, key=handle)]
        apply_recorded_names(graph, source)
        return
    calls = wrapper_calls(source, bodies | branches)
    counts: dict[str, int] = {}

    def expand(function: str, module: str, site_prefix: tuple[Hierarchy, ...], depth: int,
               into: list[Kernel]) -> None:
        table = tables.get(module, tables[""])
        items = calls.get(function, [])
        for i, (what, name) in enumerate(items):
            if what == "kernel":
                k = kernel(name, table)
                k.sites = site_prefix
                into.append(k)
            elif what == "item":  # the predicate of the cond whose branches are called next
                branch = next((b for w, b in items[i + 1:] if w == "body" and b in branches), None)
                owner = next((m for m, c in conds.items() if branch in c), "")
                sub = conds.get(owner, {}).get(branch or "")
                into.append(Kernel("aten::item", "aten::item", sub.hierarchy if sub else (), sites=site_prefix))
            elif name in branches:
                owner = next((m for m, c in conds.items() if name in c), "")
                sub = conds[owner][name]
                if sub.op == "while_loop":
                    graph.repeats.setdefault("aten::is_nonzero", _predicate(sub, site_prefix))
                if name not in graph.branches and depth < 8:
                    graph.branches[name] = _branch(name, sub, site_prefix)
                    branch_module = f"{owner}.{sub.name}" if owner else sub.name
                    expand(name, branch_module, site_prefix, depth + 1, graph.branches[name].kernels)
            elif depth < 8:
                owner = next((m for m, s in sites.items() if name in s), "")
                call = counts.get(name, 0)
                counts[name] = call + 1
                owner_sites = sites.get(owner, {}).get(name, [])
                site = owner_sites[call % len(owner_sites)] if owner_sites else ()
                body_module = f"{owner}.{name}" if owner else name
                expand(name, body_module, site_prefix + (site,), depth + 1, into)

    expand("", "", (), 0, graph.kernels)
    apply_recorded_names(graph, source)


_CPP_KERNEL_DEF = re.compile(r"^(\w+) = async_compile\.cpp_pybinding\(", re.M)
_RECORD_FUNCTION = re.compile(r'RAIIAtenRecordFunctionHandle \w+\("([^"]+)"')


def apply_recorded_names(graph: CompiledGraph, source: str | None) -> None:
    """Match a CPU kernel by the name its code records, where that is not the wrapper's name for
    it: a C++ template (flex attention, a GEMM template) records ``graph_N_kernel``."""
    if not source:
        return
    starts = list(_CPP_KERNEL_DEF.finditer(source))
    recorded: dict[str, str] = {}
    ends = [m.start() for m in starts[1:]] + [len(source)]
    for m, end in zip(starts, ends):
        found = _RECORD_FUNCTION.search(source, m.end(), end)
        if found and event_key(found.group(1)) != m.group(1):
            recorded[m.group(1)] = event_key(found.group(1))
    if recorded:
        for k in (*graph.kernels, *(k for b in graph.branches.values() for k in b.kernels)):
            k.key = recorded.get(k.key, k.key)


# Inductor's wrapper reads a device scalar into a Python number among its kernel calls (on CUDA:
# ``.item()`` of a scalar input or of an unbacked size)
HOST_READS = ("aten::item", "aten::_local_scalar_dense")


def add_host_reads(graph: CompiledGraph) -> None:
    """Match the graph's host scalar reads wherever they come among its kernel calls: no node's
    kernel, they are the graph's as a whole (its common scope)."""
    scope = graph.common_scope
    for key in HOST_READS:
        graph.repeats.setdefault(key, Kernel(key, key, scope))


def aten_graph_kernels(graph: CompiledGraph, gm: fx.GraphModule) -> list[tuple[fx.GraphModule, fx.Node, str]]:
    """Fill ``graph.kernels`` with the ATen ops of an ``aot_eager`` graph, in run order.  Returns
    the scan and map calls to put in a range each: (module, node, name in ``graph.branches``)."""
    loops: list[tuple[fx.GraphModule, fx.Node, str]] = []

    def expand(module: fx.GraphModule, site_prefix: tuple[Hierarchy, ...], depth: int, into: list[Kernel],
               prefix: str) -> None:
        conds = _runtime_subgraphs(module, graph.backward, _EAGER_RUNTIME_SUBGRAPHS)
        for node in module.graph.nodes:
            if node.op != "call_function":
                continue
            target = node.target
            if isinstance(target, torch._ops.HigherOrderOperator) and target.name() in _LOOPS:
                name = prefix + node.name  # the whole call, its loop included: a range around the op
                graph.branches[name] = Branch(
                    Kernel(f"{RANGE_PREFIX}branch {name} ##", f"{node.name} (torch.{target.name()})",
                           _node_hierarchy(node, graph.backward) or (), sites=site_prefix), own={})
                loops.append((module, node, name))
            if _is_invoke_subgraph(node) and depth < 8:
                body = getattr(module, _body_name(node) or "", None)
                if isinstance(body, fx.GraphModule):
                    site = _node_hierarchy(node, graph.backward) or ()
                    expand(body, site_prefix + (site,), depth + 1, into, f"{prefix}{_body_name(node)}.")
                continue
            names = [str(a.target) for a in node.args if isinstance(a, fx.Node) and str(a.target) in conds]
            if names and depth < 8:  # a cond (its predicate read as a bool, then one branch), a loop
                predicate = node.args[0]
                if (conds[names[0]].op == "cond" and isinstance(predicate, fx.Node)
                        and isinstance(predicate.meta.get("val"), torch.Tensor)):
                    into.append(_predicate(conds[names[0]], site_prefix))
                if conds[names[0]].op == "while_loop":
                    graph.repeats.setdefault("aten::is_nonzero", _predicate(conds[names[0]], site_prefix))
                for name in names:
                    body = getattr(module, name, None)
                    if isinstance(body, fx.GraphModule) and prefix + name not in graph.branches:
                        graph.branches[prefix + name] = _branch(prefix + name, conds[name], site_prefix)
                        expand(body, site_prefix, depth + 1, graph.branches[prefix + name].kernels, f"{prefix}{name}.")
                continue
            key = aten_key(node.target) or ran_op_key(node)
            if key is not None:
                k = _make_kernel(key, [node], graph.backward)
                k.sites = site_prefix
                into.append(k)

    expand(gm, (), 0, graph.kernels, "")
    return loops


# --------------------------------------------------------------------------- the capture


# Turned off only to measure what the ranges cost (scripts/profile_cost.py).
ANNOTATE = True


def _profiling() -> bool:
    return ANNOTATE and bool(torch.autograd.profiler._is_profiler_enabled)


def _ranged(fn: Callable[..., Any], label: str) -> Callable[..., Any]:
    """``fn``, inside a range named ``label`` while profiling."""
    record = torch._C._profiler._RecordFunctionFast

    def run(*args: Any, **kwargs: Any) -> Any:
        if not _profiling():
            return fn(*args, **kwargs)
        with record(label):
            return fn(*args, **kwargs)

    run.__wrapped__ = fn  # type: ignore[attr-defined]
    return run


class AttributionNeedsCompile(Exception):
    """Raised by the load of an AOTAutograd cache entry whose graphs only a compile attributes:
    AOTAutograd bypasses the entry and compiles."""


class Capture:
    """What was compiled while installed, and the runtime module stacks of Dynamo graph runs."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.scopes = RuntimeScopes(model)
        self.graphs: list[CompiledGraph] = []
        self.num_dynamo_graphs = 0
        # hits of the FX graph cache whose entries carry no kernel scopes, compiled again
        self.recompiled_hits = 0
        # hits of the AOTAutograd cache whose graphs are attributed from their entries, and hits
        # turned into a compile (see aot_cache_hits)
        self.aot_hits = 0
        self.bypassed_aot_hits = 0
        # the Dynamo graph whose compile_fx runs (an AOTAutograd cache hit loads its graphs there)
        self._compiling: list[int] = []
        self.stacks: list[tuple[str, ...]] = []
        self._stack_ids: dict[tuple[tuple[str, ...], str | None], int] = {}
        # per stack id: the label of the function outside the model a Dynamo graph run was
        # called from (see note_frame), or None
        self.outside: list[Outside | None] = []
        # functions that call the model (``step(model, batch)``), by (filename, first line, name)
        # of their code: a namesake in the same file is another function
        self._outside_functions: dict[tuple[str, int, str], Outside] = {}

    def note_frame(self, gm: fx.GraphModule) -> Outside | None:
        """The label of the frame Dynamo compiled (``gm.meta["call_hierarchy_root"]``) for a run of
        its graph outside the model (``opt_step (outside the model)``); records the function if
        it calls the model itself (``torch.compile(step)(model, batch)``: a module entry that is
        the model's root).

        Graph runs made while such a function runs, and not inside a module of the model
        (its own graph, its resume functions', an optimizer step it calls), run outside the
        model: their ops that enter no module (loss, optimizer) are labelled so.
        """
        root = gm.meta.get("call_hierarchy_root")
        if not isinstance(root, dict):
            return None
        module = str(root.get("module"))
        if module.startswith("torch._dynamo."):
            # Dynamo's wrapper of a torch.nn module it compiles (``nn.Sequential``: ``wrap_inline``):
            # the model's own call, though no frame of the model runs
            return None
        if root.get("module_class") is not None:  # a module's forward: outside the model if not the model's
            return Outside(f"{str(root['module_class']).rpartition('.')[2]}{OUTSIDE_SUFFIX}", whole=True)
        name = str(root.get("qualname") or root.get("name")).rpartition("<locals>.")[2]
        label = f"{name}{OUTSIDE_SUFFIX}"
        paths = self._model_paths(gm)
        # torch's own code that calls the model calls it for the model, not as a user's step
        # function does
        if module.partition(".")[0] != "torch":
            key = (str(root.get("filename")), int(root.get("lineno") or 0), str(root.get("name")))
            if key not in self._outside_functions and "" in paths:
                self._outside_functions[key] = Outside(label)
        # a function that calls modules of the model without the model (``model.layers[0](x)``)
        # keeps their scopes; one that calls none of them (an optimizer step) is wholly outside
        return Outside(label, whole=not paths)

    def _model_paths(self, gm: fx.GraphModule) -> set[str]:
        """The model's modules that the graph's nodes enter first (their outermost module
        entries), by path: ``""`` is the model itself."""
        scopes = self.scopes
        paths: set[str] = set()
        checked: set[int] = set()  # a graph's nodes share their entries: each module entry is checked once
        for node in gm.graph.nodes:
            for entry in node.meta.get("call_hierarchy") or ():
                _, is_module, raw_class, cls, path, _ = scopes._entry(entry)
                if is_module:
                    if id(entry) not in checked:
                        checked.add(id(entry))
                        path = scopes._rebase("", path, raw_class)
                        module = scopes.modules.get(path)
                        if module is not None and type(module).__name__ == cls:
                            paths.add(path)
                    break
        return paths

    def _outside_caller(self) -> Outside | None:
        """The label of the innermost running function that calls the model, if any."""
        functions = self._outside_functions
        if not functions:
            return None
        frame = sys._getframe(2)
        while frame is not None:
            code = frame.f_code
            label = functions.get((code.co_filename, code.co_firstlineno, code.co_name))
            if label is not None:
                return label
            frame = frame.f_back
        return None

    def stack_id(self, stack: tuple[str, ...], outside: Outside | None = None) -> int:
        sid = self._stack_ids.get((stack, outside))
        if sid is None:
            sid = self._stack_ids[(stack, outside)] = len(self.stacks)
            self.stacks.append(stack)
            self.outside.append(outside)
        return sid

    def new_graph(self, dynamo_graph: int, kind: str, backend: str) -> CompiledGraph:
        graph = CompiledGraph(len(self.graphs), dynamo_graph, kind, backend)
        self.graphs.append(graph)
        return graph

    def wrap_dynamo_graph(self, compiled: Callable[..., Any], dynamo_graph: int,
                          own: Outside | None = None) -> Callable[..., Any]:
        """Each run of a Dynamo graph, while profiling, inside a range naming its module stack.

        ``own``: the label of the graph's frame (:meth:`note_frame`) for a run while no module
        of the model runs and no function that calls the model does either.
        """
        scopes = self.scopes
        record = torch._C._profiler._RecordFunctionFast

        def run(*args: Any) -> Any:
            if not _profiling():
                return compiled(*args)
            stack = scopes.module_stack()
            if stack is None:  # outside the model: in a step function that calls it, or on its own
                sid = self.stack_id((), self._outside_caller() or own)
            else:
                sid = self.stack_id(stack, None if stack else self._outside_caller())
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
        own = self.note_frame(gm)
        kwargs["inner_compile"] = self._inner_compile(dynamo_graph, kwargs.get("inner_compile"))
        self._compiling.append(dynamo_graph)
        try:
            compiled = compile_fx(gm, example_inputs, **kwargs)
        finally:
            self._compiling.pop()
        return self.wrap_dynamo_graph(compiled, dynamo_graph, own)

    @contextlib.contextmanager
    def aot_cache_hits(self) -> Iterator[None]:
        """Attribute the graphs an AOTAutograd cache hit loads, while installed.

        A hit runs no ``inner_compile``: its forward and backward ``CompiledFxGraph`` come from
        the FX graph cache (or the entry itself) with the kernel scopes patch 0019 put in them.
        Where they carry none (written with ``record_call_hierarchy`` off) or another program's
        (see :func:`cached_provenance`), or where the wrapper has subgraph functions (whose call
        sites only the post-grad graph gives), the load
        raises, and AOTAutograd takes it as a bypass: it compiles, and its FX graph cache hit
        reaches ``inner_compile`` with the post-grad graph.  The cache's entries and keys are
        not changed either way.
        """
        from torch._functorch._aot_autograd import aot_autograd_result

        entries = aot_autograd_result.GenericAOTAutogradResult
        original = entries._load_and_post_compile
        capture = self

        def load_and_post_compile(entry: Any, args: Any, fx_config: Any) -> Any:
            if not capture._compiling:  # not a compile of ours
                return original(entry, args, fx_config)
            dynamo_graph = capture._compiling[-1]
            parts = [(entry.compiled_fw, "inference" if entry.compiled_bw is None else "forward")]
            if entry.compiled_bw is not None:
                parts.append((entry.compiled_bw, "backward"))
            loaded: list[tuple[str, Any, tuple[dict[str, list[str]], dict[str, Any]]]] = []

            def checked(load: Callable[..., Any], kind: str) -> Callable[..., Any]:
                def load_checked(example_inputs: Any) -> Any:
                    result = load(example_inputs)
                    found = cached_provenance(result)
                    if found is None or has_subgraph_functions(result.source_code):
                        capture.bypassed_aot_hits += 1
                        raise AttributionNeedsCompile(
                            "call_hierarchy profiler: this AOTAutograd cache entry's graphs are attributed "
                            "from their post-grad graphs (no kernel scopes in it, or subgraphs)")
                    loaded.append((kind, result, found))
                    return result

                return load_checked

            for part, kind in parts:
                part.load = checked(part.load, kind)  # this entry's own; the class is not changed
            try:
                out = original(entry, args, fx_config)
            finally:
                for part, _ in parts:
                    vars(part).pop("load", None)
            capture.aot_hits += 1
            for kind, compiled, (provenance, cached) in loaded:
                graph = capture.new_graph(dynamo_graph, kind, "inductor")
                inductor_kernels(graph, None, provenance, compiled.source_code, cached)
                add_host_reads(graph)
                capture._label_calls(compiled, graph)
            return out

        entries._load_and_post_compile = load_and_post_compile  # type: ignore[method-assign,assignment]
        try:
            yield
        finally:
            entries._load_and_post_compile = original  # type: ignore[method-assign]

    def _inner_compile(self, dynamo_graph: int, inner: Callable[..., Any] | None) -> Callable[..., Any]:
        import torch._inductor.debug as inductor_debug
        from torch._dynamo.utils import counters
        from torch._inductor.compile_fx import compile_fx_inner

        inner = inner or compile_fx_inner

        def inner_compile(gm: fx.GraphModule, example_inputs: Any, **kwargs: Any) -> Any:
            before = set(inductor_debug._inductor_triton_kernel_to_post_grad_node_info)
            hits = counters["inductor"]["fxgraph_cache_hit"]
            compiled = inner(gm, example_inputs, **kwargs)
            info = inductor_debug._inductor_triton_kernel_to_post_grad_node_info
            provenance = {k: list(v) for k, v in info.items() if k not in before}
            cached = recorded = None
            if counters["inductor"]["fxgraph_cache_hit"] > hits:  # from the FX graph cache: no codegen ran
                found = cached_provenance(compiled)
                if found is None:
                    # an entry that carries no scopes (record_call_hierarchy is not in the cache
                    # key) or another program's: compile the graph again, without the cache
                    self.recompiled_hits += 1
                    context = torch._guards.TracingContext.try_get()
                    if context is not None and context.output_strides:
                        context.output_strides.clear()  # the hit set them; the compile sets them again
                    with torch._inductor.config.patch(fx_graph_cache=False):
                        compiled = inner(gm, example_inputs, **kwargs)
                    provenance = {k: list(v) for k, v in info.items() if k not in before}
                else:
                    provenance, cached = found
            if cached is None:  # compiled here: the scopes its cache entry will carry
                found = cached_provenance(compiled)
                recorded = found[1] if found is not None else None
            kind = "backward" if kwargs.get("is_backward") else (
                "inference" if kwargs.get("is_inference") else "forward")
            graph = self.new_graph(dynamo_graph, kind, "inductor")
            inductor_kernels(graph, gm, provenance, getattr(compiled, "source_code", None), cached, recorded)
            add_host_reads(graph)
            self._label_calls(compiled, graph)
            return compiled

        inner_compile._call_hierarchy_capture = True  # type: ignore[attr-defined]
        return inner_compile

    def _label_calls(self, compiled: Any, graph: CompiledGraph) -> None:
        """Name each call of the compiled graph with a range (the generated code is unchanged),
        and each call of a torch.cond branch's function (the module's global it calls)."""
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
        namespace = getattr(getattr(current, "__func__", current), "__globals__", {})
        for name, branch in graph.branches.items():
            if callable(namespace.get(name)):
                namespace[name] = _ranged(namespace[name], branch.call.key)

    # ---- aot_eager

    def aot_eager_backend(self) -> Callable[..., Any]:
        """A Dynamo backend: ``aot_eager`` (AOTAutograd, ATen graphs run as they are)."""
        from torch._dynamo.backends.common import aot_autograd
        from torch._functorch.aot_autograd import make_boxed_func

        def backend(gm: fx.GraphModule, example_inputs: list[Any]) -> Any:
            dynamo_graph = self.num_dynamo_graphs
            self.num_dynamo_graphs += 1
            own = self.note_frame(gm)

            def compiler(kind: str) -> Callable[[fx.GraphModule, Any], Any]:
                def compile_graph(aten_gm: fx.GraphModule, _inputs: Any) -> Any:
                    graph = self.new_graph(dynamo_graph, kind, "aot_eager")
                    loops = aten_graph_kernels(graph, aten_gm)
                    for name, branch in graph.branches.items():  # the cond calls the branch module
                        if branch.own is not None:  # a scan's or map's call: ranged below
                            continue
                        body = aten_gm.get_submodule(name)
                        _ = body.code  # a lazy GraphModule makes its forward when its code is read
                        body.forward = _ranged(body.forward, branch.call.key)  # type: ignore[method-assign]
                    for module, node, name in loops:  # the graph calls the scan or map op
                        node.target = _ranged(node.target, graph.branches[name].call.key)
                        module.recompile()
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
            return self.wrap_dynamo_graph(compiled, dynamo_graph, own)

        return backend
