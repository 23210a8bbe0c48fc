"""Differential test of ``node.meta["call_hierarchy"]`` across graph breaks (RFC-0051, issue 5).

Needs the patched torch (``.venv``).  For every model and every graph-break insertion point, under
the default config and ``nested_graph_breaks=True``, the model runs through a recording backend
that logs, each time a compiled graph runs, that graph: its ops (call_function / call_method
nodes) with their hierarchy and the graph's ``call_hierarchy_root``.  The executed op sequence is
aligned with the op sequence of the ``fullgraph=True`` run (same targets, same innermost source
line, same order) and each executed op's hierarchy B is checked against its fullgraph hierarchy F:

* The graph's root record names a frame.  If it is the model's own ``forward`` (the root frame,
  resumed or not), B is relative to the same root as F; otherwise the frame is the scope
  ``F[k-1]`` with ``k = len(F) - len(B)``: a module entry of the root record's ``module_class``
  (or, for a resume function whose ``self`` is dead, a module whose class defines the function),
  or a function entry with the root record's name/qualname/module/filename/lineno.
* ``B[i]`` corresponds to ``F[k+i]``: function entries are equal but for the count; module entries
  have the same attr/class/class_qualname and their path is F's path relative to the scope B is
  relative to (``""`` for the root frame, the anchor module for an inner module frame); a function
  entry in B may stand for a module entry in F only under ``nested_graph_breaks`` in a resumed
  graph (the inlined rest of a module's frame): it must name a method of that module's class, and
  module paths below it are relative to that module (its instance is not known statically).
* Counts: a graph compiled from the start of its frame has F's counts; any graph tells calls
  apart, i.e. within one execution of a graph, (B prefix with counts) <-> (F prefix with counts)
  is a bijection at every depth.  A graph served to several callers is checked against each.

Golden files (``golden/graph_breaks/*.txt``) pin every node of every graph for the named scenarios.
Regenerate them with ``EXPECTTEST_ACCEPT=1 .venv/bin/python -m pytest test_suite/test_graph_break_hierarchy.py``.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import difflib
import importlib
import inspect
import logging
import re
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import torch  # noqa: E402
import torch.fx.call_hierarchy as call_hierarchy  # noqa: E402  (the patched torch: fail, never skip)

from torch import nn  # noqa: E402

from test_suite.golden import assert_golden  # noqa: E402
from test_suite.test_qwen2_call_hierarchy import render, tiny_qwen2  # noqa: E402

GOLDEN_DIR = Path(__file__).parent / "golden" / "graph_breaks"
CONFIGS = {"default": False, "nested": True}


# --------------------------------------------------------------------------------------------
# Synthetic model: a break can be inserted at every site named in SITES.
# --------------------------------------------------------------------------------------------

BREAK_AT: set[str] = set()


def maybe_break(site: str) -> None:
    if site in BREAK_AT:
        torch._dynamo.graph_break()


def inner_helper(x):
    x = x.sin()
    maybe_break("inner_helper")
    return x + 2


def helper(x):
    x = x * 3
    maybe_break("helper.before")
    x = inner_helper(x)
    maybe_break("helper.after")
    return x - 1


class Shared(nn.Module):
    """One instance, reachable as ``shared`` and as ``layers.N.block.shared``."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        maybe_break("shared")
        return self.lin(x).tanh()


class Block(nn.Module):
    def __init__(self, shared: Shared) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.shared = shared

    def forward(self, x):
        x = self.lin(x)
        maybe_break("block")
        x = helper(x)
        return self.shared(x)


class Layer(nn.Module):
    def __init__(self, shared: Shared) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(4)
        self.block = Block(shared)

    def forward(self, x):
        x = self.norm(x)
        maybe_break("layer.start")
        x = self.block(x)
        maybe_break("layer.mid")
        x = helper(x)
        maybe_break("layer.end")
        return x.relu()


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.shared = Shared()
        self.layers = nn.ModuleList([Layer(self.shared), Layer(self.shared)])

    def forward(self, x):
        x = helper(x + 1)
        maybe_break("root")
        x = helper(x)
        x = self.layers[0](x)
        maybe_break("between_layers")
        x = self.layers[1](x)
        x = self.shared(x)
        return x * 2


def _sites() -> list[str]:
    """Every site named in a maybe_break call of this file's model code."""
    found = []
    for obj in (inner_helper, helper, Shared.forward, Block.forward, Layer.forward, Model.forward):
        found += re.findall(r'maybe_break\("([^"]+)"\)', inspect.getsource(obj))
    return found


SITES = _sites()


# --------------------------------------------------------------------------------------------
# Recording backend
# --------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Op:
    node: str
    target: str
    line: tuple[str, int] | None  # innermost user frame (file, line) of the node's stack trace
    hierarchy: tuple[Any, ...]
    tensor: bool  # whether it computes a tensor (not a size, a tuple item of sizes, ...)


@dataclasses.dataclass
class Graph:
    index: int
    gm: Any
    root: dict[str, Any]
    ops: list[Op]


_FRAME = re.compile(r'File "([^"]+)", line (\d+), in ')


def _target(node: Any) -> str:
    if node.op == "call_method":
        return f"method {node.target}"
    t = node.target
    return f"{getattr(t, '__module__', None)}.{getattr(t, '__qualname__', None) or getattr(t, '__name__', repr(t))}"


def _innermost_line(node: Any) -> tuple[str, int] | None:
    frames = _FRAME.findall(node.meta.get("stack_trace") or "")
    return (frames[-1][0], int(frames[-1][1])) if frames else None


class Recorder:
    """A backend whose compiled callables log, each time they run, which graph ran."""

    def __init__(self) -> None:
        self.graphs: list[Graph] = []
        self.executions: list[int] = []

    def __call__(self, gm: Any, example_inputs: list[Any]) -> Callable[..., Any]:
        ops = [Op(n.name, _target(n), _innermost_line(n), tuple(n.meta.get("call_hierarchy", ())),
                  isinstance(n.meta.get("example_value"), torch.Tensor))
               for n in gm.graph.nodes if n.op in ("call_function", "call_method")]
        for n in gm.graph.nodes:
            if n.op in ("call_function", "call_method"):
                assert "call_hierarchy" in n.meta, (n.name, "no call_hierarchy")
        graph = Graph(len(self.graphs), gm, dict(gm.meta["call_hierarchy_root"]), ops)
        self.graphs.append(graph)

        def run(*args: Any) -> Any:
            self.executions.append(graph.index)
            return gm.forward(*args)

        return run

    def executed(self) -> list[tuple[int, Graph, Op]]:
        """(execution number, graph, op) for every op that ran, in order."""
        return [(i, self.graphs[g], op) for i, g in enumerate(self.executions) for op in self.graphs[g].ops]


# --------------------------------------------------------------------------------------------
# Cases
# --------------------------------------------------------------------------------------------

@dataclasses.dataclass
class ModelSpec:
    name: str
    make: Callable[[], Any]
    inputs: Callable[[int], tuple[tuple[Any, ...], dict[str, Any]]]  # size -> (args, kwargs)
    sites: Callable[[], list[str]]
    inserting: Callable[[str], contextlib.AbstractContextManager[None]]
    sizes: tuple[int, int]  # the input size of every run, and another one for recompilation


@contextlib.contextmanager
def synthetic_break(site: str) -> Iterator[None]:
    BREAK_AT.add(site)
    try:
        yield
    finally:
        BREAK_AT.discard(site)


def synthetic_model() -> Any:
    torch.manual_seed(0)
    return Model().eval()


SYNTHETIC = ModelSpec(
    "synthetic", synthetic_model, lambda n: ((torch.randn(n, 4),), {}),
    lambda: SITES, synthetic_break, (2, 3),
)


def _qwen2_module() -> types.ModuleType:
    return importlib.import_module("transformers.models.qwen2.modeling_qwen2")


def _attention_function() -> Callable[..., Any]:
    mod = _qwen2_module()
    impl = tiny_qwen2().config._attn_implementation
    return mod.ALL_ATTENTION_FUNCTIONS.get_interface(impl, mod.eager_attention_forward)


def qwen2_insertion_points() -> dict[str, Callable[..., Any]]:
    """Every module-level function of modeling_qwen2, the attention function in use, and the
    forward of every nn.Module class of modeling_qwen2 (innermost function, under decorators)."""
    mod = _qwen2_module()
    points: dict[str, Callable[..., Any]] = {}
    for name, obj in sorted(vars(mod).items()):
        if inspect.isfunction(obj) and obj.__module__ == mod.__name__:
            points[name] = obj
        elif (inspect.isclass(obj) and issubclass(obj, nn.Module) and obj.__module__ == mod.__name__
              and "forward" in vars(obj)):
            points[f"{name}.forward"] = inspect.unwrap(vars(obj)["forward"])
    attn = inspect.unwrap(_attention_function())
    points.setdefault(attn.__name__, attn)
    return points


def with_break_first(fn: types.FunctionType) -> types.CodeType:
    """fn's code with ``torch._dynamo.graph_break()`` as its first statement, and otherwise the
    same code identity (name, qualname, filename, first line, line numbers): the break is
    inserted in the function itself, so no wrapper frame appears that the fullgraph run lacks."""
    code = fn.__code__
    assert not code.co_freevars, (fn, code.co_freevars)
    # Parse the whole file, as the interpreter did, so that line numbers are the original ones.
    with open(code.co_filename, encoding="utf-8") as f:
        module_tree = ast.parse(f.read())
    (fdef,) = [n for n in ast.walk(module_tree) if isinstance(n, ast.FunctionDef) and n.name == code.co_name
               and min([n.lineno] + [d.lineno for d in n.decorator_list]) == code.co_firstlineno]
    tree = ast.Module(body=[fdef], type_ignores=[])
    fdef.decorator_list = []
    fdef.lineno = code.co_firstlineno  # the first decorator's line, as in the original code
    body = fdef.body
    first = 1 if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) else 0
    assert fn.__globals__.get("torch") is torch, f"{fn.__qualname__}: its module has no global `torch`"
    stmt = ast.parse("torch._dynamo.graph_break()").body[0]
    ast.copy_location(stmt, body[first])
    ast.fix_missing_locations(stmt)
    for n in ast.walk(stmt):
        ast.copy_location(n, body[first])
    body.insert(first, stmt)
    module_code = compile(tree, code.co_filename, "exec")
    (new,) = [c for c in module_code.co_consts if isinstance(c, types.CodeType) and c.co_name == code.co_name]
    assert new.co_firstlineno == code.co_firstlineno
    return new.replace(co_qualname=code.co_qualname)


@contextlib.contextmanager
def qwen2_break(point: str) -> Iterator[None]:
    fn = qwen2_insertion_points()[point]
    original = fn.__code__
    fn.__code__ = with_break_first(fn)
    try:
        yield
    finally:
        fn.__code__ = original


QWEN2 = ModelSpec(
    "qwen2", tiny_qwen2,
    lambda n: ((torch.randint(0, 128, (1, n), generator=torch.Generator().manual_seed(n)),), {"use_cache": False}),
    lambda: list(qwen2_insertion_points()), qwen2_break, (8, 11),
)


def run_model(spec: ModelSpec, *, site: str | None, nested: bool, sizes: tuple[int, ...] | None = None,
              dynamic: bool | None = None) -> Recorder:
    sizes = sizes or spec.sizes[:1]
    rec = Recorder()
    model = spec.make()
    torch._dynamo.reset()
    try:
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch._dynamo.config.patch(record_call_hierarchy=True, nested_graph_breaks=nested))
            stack.enter_context(torch.no_grad())
            if site is not None:
                stack.enter_context(spec.inserting(site))
            compiled = torch.compile(model, backend=rec, fullgraph=site is None, dynamic=dynamic)
            for n in sizes:
                args, kwargs = spec.inputs(n)
                compiled(*args, **kwargs)
    finally:
        torch._dynamo.reset()
    return rec


# --------------------------------------------------------------------------------------------
# The expected relation between a graph-broken op's hierarchy and its fullgraph hierarchy
# --------------------------------------------------------------------------------------------

def _fmt(h: tuple[Any, ...]) -> str:
    return call_hierarchy.format_call_hierarchy(h) if h else "<root>"


def _resolve(qualified: str) -> type | None:
    """A class from ``<module>.<QualName>`` (None when it cannot be imported)."""
    parts = qualified.split(".")
    for i in range(len(parts) - 1, 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        try:
            for attr in parts[i:]:
                obj = getattr(obj, attr)
        except AttributeError:
            return None
        return obj
    return None


def _defines(cls_qualified: str, module: str, qualname: str) -> bool:
    """Whether a class in the MRO of the class named ``cls_qualified`` is ``<module>.<qualname's
    class part>``, i.e. the function ``qualname`` is a method of that module class."""
    owner = qualname.rpartition(".")[0]
    if not owner:
        return False
    cls = _resolve(cls_qualified)
    if cls is None:
        return cls_qualified == f"{module}.{owner}"
    return any(c.__module__ == module and c.__qualname__ == owner for c in cls.__mro__)


def _rel(path: str, base: str | None) -> str | None:
    """F's module path relative to base (None: unknown base, any dotted suffix accepted)."""
    if base is None:
        return None
    if base == "":
        return path
    if path.startswith(base + "."):
        return path[len(base) + 1:]
    return "<not under " + base + ">"


def _same_function(a: Any, b: Any) -> bool:
    return all(a[k] == b[k] for k in ("name", "qualname", "module", "filename", "lineno"))


def _anchor_problem(anchor: Any, root: dict[str, Any]) -> str | None:
    """Why the frame named by the root record is not the scope ``anchor`` of the fullgraph."""
    if anchor["type"] == "module":
        if root["module_class"] is not None:
            if root["module_class"] == anchor["class_qualname"]:
                return None
            return f"root module_class {root['module_class']} is not {anchor['class_qualname']}"
        if root["resume_lineno"] is not None and _defines(anchor["class_qualname"], root["module"], root["qualname"]):
            return None  # resume function of a method whose self is dead after the break
        return f"root {root['qualname']} (no module_class) does not continue a method of {anchor['class_qualname']}"
    if all(root[k] == anchor[k] for k in ("name", "qualname", "module", "filename", "lineno")):
        return None
    return f"root {root['qualname']} is not the function {anchor['qualname']}"


_FRAME_KEYS = ("name", "qualname", "module", "filename", "lineno")


def _is_root_frame(root: dict[str, Any], top: dict[str, Any]) -> bool:
    """Whether the graph's frame is the compiled model's own frame: the frame of the fullgraph
    run (``top``, e.g. a decorator wrapper of the model's forward) or a resume function of it, or a
    frame whose first argument is the model (its forward compiled on its own)."""
    if root["module_class"] is not None and root["module_class"] == top["module_class"]:
        return True
    if all(root[k] == top[k] for k in _FRAME_KEYS):
        return True
    return root["resume_lineno"] is not None and _defines(top["module_class"], root["module"], root["qualname"])


def relation_problem(f: tuple[Any, ...], b: tuple[Any, ...], root: dict[str, Any],
                     top: dict[str, Any], nested: bool) -> str | None:
    """None when B (graph-broken) is a sound relative version of F (fullgraph), else why not."""
    if any(e["type"] == "unknown_frames" for e in b):
        return unknown_frames_problem(f, b, root, top, nested)
    k = len(f) - len(b)
    if (k < 0 or k == 0 and not _is_root_frame(root, top)) and b and b[0]["type"] == "function" and nested \
            and root["resume_lineno"] is not None:
        # The inlined rest of the frame's own forward (the frame is a decorator wrapper of a module's
        # forward, which the fullgraph absorbs into that module's scope): it stands for no F entry.
        k += 1
        anchor_class = top["module_class"] if k == 0 else (f[k - 1]["class_qualname"] if f[k - 1]["type"] == "module" else None)
        if anchor_class is None or not _defines(anchor_class, b[0]["module"], b[0]["qualname"]):
            return f"entry 0: function entry {b[0]['qualname']} is neither in the fullgraph nor the absorbed forward"
        b = b[1:]
    if k < 0:
        return "deeper than the fullgraph hierarchy"
    if k == 0:
        if not _is_root_frame(root, top):
            return f"same depth as fullgraph but the graph's frame is {root['qualname']}, not the root frame"
        base: str | None = ""
    else:
        anchor = f[k - 1]
        why = _anchor_problem(anchor, root)
        if why:
            return f"relative to F[{k - 1}]: {why}"
        base = anchor["path"] if anchor["type"] == "module" else None
    for i, (fe, be) in enumerate(zip(f[k:], b)):
        why, base = _entry_problem(f"entry {i}", fe, be, base, root, nested)
        if why:
            return why
    return None


def _entry_problem(where: str, fe: Any, be: Any, base: str | None, root: dict[str, Any],
                   nested: bool) -> tuple[str | None, str | None]:
    """Why B's entry ``be`` does not stand for F's entry ``fe`` (None if it does), and the module
    path that the following B entries are relative to."""
    if be["type"] == "unknown_frames":
        return f"{where}: marker of unknown frames for {fe['type']} entry", base
    if be["type"] == "module":
        if fe["type"] != "module":
            return f"{where}: module entry for a function call", base
        for key in ("attr", "class", "class_qualname"):
            if fe[key] != be[key]:
                return f"{where}: {key} {be[key]!r} != {fe[key]!r}", base
        expected = _rel(fe["path"], base)
        if expected is None:
            if not (fe["path"] == be["path"] or fe["path"].endswith("." + be["path"])):
                return f"{where}: path {be['path']!r} is not a suffix of {fe['path']!r}", base
        elif be["path"] != expected:
            return f"{where}: path {be['path']!r} != {expected!r} (fullgraph {fe['path']!r})", base
    elif fe["type"] == "function":
        if not _same_function(fe, be):
            return f"{where}: function {be['qualname']} != {fe['qualname']}", base
    else:
        # function entry standing for a module call: the inlined rest of a module's frame
        if not nested:
            return f"{where}: function entry {be['qualname']} for module {fe['path']} without nested_graph_breaks", base
        if root["resume_lineno"] is None:
            return f"{where}: function entry {be['qualname']} for module {fe['path']} in a graph that is not a resume", base
        if not _defines(fe["class_qualname"], be["module"], be["qualname"]):
            return f"{where}: {be['qualname']} is not a method of {fe['class_qualname']}", base
        base = fe["path"]
    return None, base


def unknown_frames_problem(f: tuple[Any, ...], b: tuple[Any, ...], root: dict[str, Any],
                           top: dict[str, Any], nested: bool) -> str | None:
    return unknown_frames_alignment(f, b, root, top, nested)[0]


def unknown_frames_alignment(f: tuple[Any, ...], b: tuple[Any, ...], root: dict[str, Any],
                             top: dict[str, Any], nested: bool) -> tuple[str | None, list[int]]:
    """None when B, which has ``<frames not known statically>`` markers, is a sound version of F.

    A marker (patch 0005: frames between a resume function and the nested one it calls) stands for
    zero or more F entries; module paths after it are relative to an unknown local (any dotted
    suffix). Every other B entry must stand for the F entry it is aligned with, except the
    continued rest of a module's own ``forward`` that the fullgraph absorbed into the module's
    scope (a method of the class of the module entry before, or of the root module), which stands
    for no F entry; and B must end where F ends. Also returns, for each B entry, how many F entries B's prefix up to it covers."""
    if not nested or root["resume_lineno"] is None:
        return "marker of unknown frames outside a resume graph with nested_graph_breaks", []
    last = "no alignment"
    ends: list[int] = [0] * len(b)

    def match(fi: int, bj: int, base: str | None) -> bool:
        nonlocal last
        if bj == len(b):
            if fi == len(f):
                return True
            last = f"B ends {len(f) - fi} entries above F"
            return False
        if b[bj]["type"] == "unknown_frames":
            for skip in range(len(f) - fi + 1):
                ends[bj] = fi + skip
                if match(fi + skip, bj + 1, None):
                    return True
            return False
        if b[bj]["type"] == "function" and bj > 0 and b[bj - 1]["type"] == "unknown_frames":
            owner = top["module_class"] if fi == 0 else (
                f[fi - 1]["class_qualname"] if f[fi - 1]["type"] == "module" else None)
            if owner is not None and _defines(owner, b[bj]["module"], b[bj]["qualname"]):
                ends[bj] = fi
                if match(fi, bj + 1, base):
                    return True
        if fi == len(f):
            last = f"entry {bj}: deeper than the fullgraph hierarchy"
            return False
        why, next_base = _entry_problem(f"entry {bj}", f[fi], b[bj], base, root, nested)
        if why:
            last = why
            return False
        ends[bj] = fi + 1
        return match(fi + 1, bj + 1, next_base)

    return (None, ends) if match(0, 0, None) else (last, [])


# --------------------------------------------------------------------------------------------
# Alignment and checks
# --------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Pair:
    execution: int
    graph: Graph
    full: Op
    broken: Op


def align(full: list[Op], executed: list[tuple[int, Graph, Op]]) -> tuple[list[Pair], list[str]]:
    """Pair executed ops with fullgraph ops (same target and innermost source line, in order)."""
    key_f = [(op.target, op.line) for op in full]
    key_b = [(op.target, op.line) for _, _, op in executed]
    problems = []
    pairs = []
    lines_b = {op.line for _, _, op in executed}
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(None, key_f, key_b, autojunk=False).get_opcodes():
        if tag == "equal":
            pairs += [Pair(executed[j][0], executed[j][1], full[i], executed[j][2]) for i, j in zip(range(i1, i2), range(j1, j2))]
            continue
        for j in range(j1, j2):
            _, g, op = executed[j]
            if op.tensor:
                problems.append(f"graph {g.index} op {op.node} ({op.target} at {op.line}) has no fullgraph counterpart")
        for i in range(i1, i2):
            op = full[i]
            # a fullgraph op with no counterpart must have run eagerly: a frame Dynamo skipped
            # (a graph break in a loop skips the whole frame), so no compiled op comes from its line
            if op.tensor and op.line in lines_b:
                problems.append(f"fullgraph op {op.node} ({op.target} at {op.line}) is missing from the graph-broken run")
    return pairs, problems


def _key(h: tuple[Any, ...]) -> tuple[Any, ...]:
    return tuple(tuple(dict(e).items()) for e in h)


def check_case(full: Graph, rec: Recorder, nested: bool) -> list[str]:
    """Every problem of a graph-broken run against the fullgraph run's only graph."""
    pairs, problems = align(full.ops, rec.executed())
    assert pairs, "nothing was compiled"
    for p in pairs:
        why = relation_problem(p.full.hierarchy, p.broken.hierarchy, p.graph.root, full.root, nested)
        if why:
            problems.append(
                f"graph {p.graph.index} ({p.graph.root['qualname']}, resume_lineno={p.graph.root['resume_lineno']}) "
                f"node {p.broken.node}: {why}\n    broken:    {_fmt(p.broken.hierarchy)}\n"
                f"    fullgraph: {_fmt(p.full.hierarchy)}")
        elif p.graph.root["resume_lineno"] is None:
            # compiled from the frame's start: same counts as the fullgraph
            k = len(p.full.hierarchy) - len(p.broken.hierarchy)
            fc = [e["count"] for e in p.full.hierarchy[k:]]
            bc = [e["count"] for e in p.broken.hierarchy]
            if fc != bc:
                problems.append(f"graph {p.graph.index} node {p.broken.node}: counts {bc} != fullgraph {fc}")
    # Within one execution of a graph, distinct calls stay distinct and one call stays one call.
    by_exec: dict[int, dict[tuple[Any, ...], set[tuple[Any, ...]]]] = {}
    back: dict[int, dict[tuple[Any, ...], set[tuple[Any, ...]]]] = {}
    for p in pairs:
        k = len(p.full.hierarchy) - len(p.broken.hierarchy)
        ends = [k + d for d in range(1, len(p.broken.hierarchy) + 1)]
        if any(e["type"] == "unknown_frames" for e in p.broken.hierarchy):
            ends = unknown_frames_alignment(p.full.hierarchy, p.broken.hierarchy, p.graph.root, full.root,
                                            nested)[1]
        for d in range(1, len(p.broken.hierarchy) + 1):
            if p.broken.hierarchy[d - 1]["type"] == "unknown_frames" or d > len(ends):
                continue  # a marker stands for whatever frames the chain passed through
            bk, fk = _key(p.broken.hierarchy[:d]), _key(p.full.hierarchy[:ends[d - 1]])
            by_exec.setdefault(p.execution, {}).setdefault(bk, set()).add(fk)
            back.setdefault(p.execution, {}).setdefault(fk, set()).add(bk)
    for ex, table in by_exec.items():
        for bk, fks in table.items():
            if len(fks) > 1:
                problems.append(f"execution {ex}: one scope {bk} stands for {len(fks)} fullgraph calls")
    for ex, table in back.items():
        for fk, bks in table.items():
            if len(bks) > 1:
                problems.append(f"execution {ex}: one fullgraph call {fk} is split into {len(bks)} scopes")
    return problems


_FULL: dict[str, Graph] = {}


def fullgraph(spec: ModelSpec) -> Graph:
    if spec.name not in _FULL:
        rec = run_model(spec, site=None, nested=False)
        assert len(rec.graphs) == 1 and rec.executions == [0]
        _FULL[spec.name] = rec.graphs[0]
    return _FULL[spec.name]


def _case(model: str, site: str, config: str) -> Any:
    return pytest.param(model, site, config, id=f"{model}-{site}-{config}")


def _qwen2_reached_points() -> list[str]:
    """The insertion points the model actually reaches: a function entry of that function or a
    module entry of that class in the fullgraph hierarchies (the model's own class: its frame)."""
    points = qwen2_insertion_points()
    mod = _qwen2_module()
    reached = []
    full = fullgraph(QWEN2)
    entries = {e for op in full.ops for e in op.hierarchy}
    for name, fn in points.items():
        code = fn.__code__
        if name.endswith(".forward"):
            cls = f"{mod.__name__}.{name.rpartition('.')[0]}"
            hit = cls == full.root["module_class"] or any(
                e["type"] == "module" and e["class_qualname"] == cls for e in entries)
        else:
            hit = any(e["type"] == "function" and e["qualname"] == code.co_qualname
                      and e["filename"] == code.co_filename and e["lineno"] == code.co_firstlineno for e in entries)
        if hit:
            reached.append(name)
    return reached


# Qwen2 insertion points are enumerated at collection time from the module (no model is built for
# that); the test of each checks that it is reached, and test_qwen2_insertion_points_are_reached
# pins which ones are.
QWEN2_UNREACHED = {"eager_attention_forward", "repeat_kv"}  # with the default (sdpa) attention

CASES = [_case("synthetic", s, c) for c in CONFIGS for s in SITES]
CASES += [_case("qwen2", p, c) for c in CONFIGS
          for p in qwen2_insertion_points() if p not in QWEN2_UNREACHED]
SPECS = {"synthetic": SYNTHETIC, "qwen2": QWEN2}

_RUNS: dict[tuple[str, str, bool], Recorder] = {}


def broken_run(model: str, site: str, nested: bool) -> Recorder:
    key = (model, site, nested)
    if key not in _RUNS:
        _RUNS[key] = run_model(SPECS[model], site=site, nested=nested)
    return _RUNS[key]


@pytest.fixture(scope="module", autouse=True)
def _clean_dynamo() -> Iterator[None]:
    # Dynamo's structured trace logs at DEBUG; with pytest's log capture they cost a lot of time.
    trace = logging.getLogger("torch.__trace")
    level = trace.level
    trace.setLevel(logging.INFO)
    yield
    trace.setLevel(level)
    _RUNS.clear()
    torch._dynamo.reset()


def test_sites_are_enumerated() -> None:
    assert SITES == ["inner_helper", "helper.before", "helper.after", "shared", "block",
                     "layer.start", "layer.mid", "layer.end", "root", "between_layers"]


def test_qwen2_insertion_points_are_reached() -> None:
    points = set(qwen2_insertion_points())
    assert set(_qwen2_reached_points()) == points - QWEN2_UNREACHED
    assert {"rotate_half", "apply_rotary_pos_emb", "sdpa_attention_forward", "Qwen2Attention.forward",
            "Qwen2MLP.forward", "Qwen2DecoderLayer.forward", "Qwen2RMSNorm.forward",
            "Qwen2RotaryEmbedding.forward", "Qwen2Model.forward", "Qwen2ForCausalLM.forward"} <= points


@pytest.mark.parametrize(("model", "site", "config"), CASES)
def test_differential(model: str, site: str, config: str) -> None:
    nested = CONFIGS[config]
    full = fullgraph(SPECS[model])
    rec = broken_run(model, site, nested)
    assert len(rec.graphs) > 1 or rec.graphs[0].root["resume_lineno"] is not None, f"no graph break at {site}"
    problems = check_case(full, rec, nested)
    assert not problems, f"{len(problems)} problem(s):\n" + "\n".join(problems[:20])


# --------------------------------------------------------------------------------------------
# One graph, several callers; recompilation
# --------------------------------------------------------------------------------------------

_LAYER_INDEX = re.compile(r"(^|\.)layers\.\d")


@pytest.mark.parametrize(("model", "site"), [
    ("synthetic", "layer.start"), ("synthetic", "layer.mid"), ("synthetic", "block"),
    ("synthetic", "helper.after"), ("synthetic", "shared"),
    ("qwen2", "Qwen2MLP.forward"), ("qwen2", "Qwen2Attention.forward"), ("qwen2", "rotate_half"),
])
def test_graph_served_to_two_callers_names_no_caller(model: str, site: str) -> None:
    """A graph compiled for an inner frame runs for layers.0 and for layers.1: nothing in it may
    name either (its hierarchy is relative to the frame; the differential test checks it against
    both callers' fullgraph hierarchies)."""
    full = fullgraph(SPECS[model])
    rec = broken_run(model, site, False)
    pairs, _ = align(full.ops, rec.executed())
    callers: dict[int, dict[int, set[tuple[Any, ...]]]] = {}
    for p in pairs:
        k = len(p.full.hierarchy) - len(p.broken.hierarchy)
        callers.setdefault(p.graph.index, {}).setdefault(p.execution, set()).add(_key(p.full.hierarchy[:k]))
    shared = [g for g, by_exec in callers.items() if len({frozenset(c) for c in by_exec.values()}) > 1]
    assert shared, "no graph ran for two different callers"
    layer_callers = [g for g in shared if any(_LAYER_INDEX.search(e[2][1]) for c in callers[g].values()
                                              for prefix in c for e in prefix if e[0] == ("type", "module"))]
    assert layer_callers, "no graph ran for two layers"
    for g in shared:
        graph = rec.graphs[g]
        assert graph.root["resume_lineno"] is not None or graph.root["qualname"] != full.root["qualname"]
        for op in graph.ops:
            for e in op.hierarchy:
                text = e["path"] if e["type"] == "module" else e["qualname"]
                assert not _LAYER_INDEX.search(text), (g, op.node, _fmt(op.hierarchy))


@pytest.mark.parametrize(("model", "site", "config", "dynamic"), [
    ("synthetic", "root", "default", None), ("synthetic", "layer.mid", "default", False),
    ("synthetic", "layer.mid", "nested", None), ("synthetic", "helper.after", "nested", None),
    ("qwen2", "Qwen2MLP.forward", "default", None),
])
def test_recompilation_gives_the_same_hierarchies(model: str, site: str, config: str, dynamic: bool | None) -> None:
    """A second input size recompiles every frame (dynamic=None: automatic dynamic shapes;
    dynamic=False: a static guard failure): each recompiled graph's ops carry the hierarchies of
    the first compilation of that frame (ops only in one of them are size computations)."""
    spec = SPECS[model]
    rec = run_model(spec, site=site, nested=CONFIGS[config], sizes=spec.sizes, dynamic=dynamic)
    # Graphs of one code object (Dynamo's frame id); the root record alone does not tell apart two
    # resume functions of a frame at the same line that continue different inner frames.
    by_frame: dict[Any, list[Graph]] = {}
    for g in rec.graphs:
        by_frame.setdefault(g.gm.meta["dynamo_compile_id"].frame_id, []).append(g)
    recompiled = {k: gs for k, gs in by_frame.items() if len(gs) > 1}
    assert recompiled, "nothing was recompiled"
    for key, (first, *others) in recompiled.items():
        for other in others:
            a = [(op.target, op.line) for op in first.ops]
            b = [(op.target, op.line) for op in other.ops]
            matched = 0
            for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes():
                if tag == "equal":
                    for i, j in zip(range(i1, i2), range(j1, j2)):
                        assert first.ops[i].hierarchy == other.ops[j].hierarchy, (
                            key, first.ops[i].node, _fmt(first.ops[i].hierarchy), _fmt(other.ops[j].hierarchy))
                    matched += i2 - i1
                else:
                    unmatched = [op for op in first.ops[i1:i2] + other.ops[j1:j2] if op.tensor]
                    assert not unmatched, (key, [(op.node, op.target) for op in unmatched])
            assert matched, key


# --------------------------------------------------------------------------------------------
# Golden files: every node of every graph, per scenario
# --------------------------------------------------------------------------------------------

GOLDEN_SCENARIOS = {
    "root_frame": "root",                        # Model.forward
    "nested_module": "block",                    # Block.forward, called as layers.N.block
    "helper_in_nested_module": "helper.after",   # helper, called from Block.forward, Layer.forward and Model.forward
    "frame_returning_a_call": "shared",          # Shared.forward, reached through `return self.shared(x)` in Block
}


def render_graphs(rec: Recorder) -> str:
    """Each graph once, at its first run, with what its hierarchies are relative to (line numbers
    relative to the function's first line), then the order in which the graphs ran."""
    out = [f"graphs run in this order: {' '.join(map(str, rec.executions))}"]
    for index in dict.fromkeys(rec.executions):
        g = rec.graphs[index]
        root = g.root
        header = f"graph {index}: {root['qualname']}"
        if root["resume_lineno"] is not None:
            header += f", resumed at +{root['resume_lineno'] - root['lineno']}"
        if root["module_class"] is not None:
            header += f" (self: {root['module_class'].rpartition('.')[2]})"
        out.append(header)
        out += ["  " + render(node) for node in g.gm.graph.nodes]
    return "\n".join(out) + "\n"


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("scenario", list(GOLDEN_SCENARIOS))
def test_golden(scenario: str, config: str) -> None:
    site = GOLDEN_SCENARIOS[scenario]
    text = render_graphs(broken_run("synthetic", site, CONFIGS[config]))
    assert "/" not in text and "0x" not in text
    assert_golden(GOLDEN_DIR / f"{scenario}.{config}.txt", text)


def test_golden_files_are_the_scenarios() -> None:
    expected = {f"{s}.{c}.txt" for s in GOLDEN_SCENARIOS for c in CONFIGS}
    assert {p.name for p in GOLDEN_DIR.glob("*.txt")} == expected
