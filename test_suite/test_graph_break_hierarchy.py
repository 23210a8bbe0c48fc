"""Differential test of ``node.meta["call_hierarchy"]`` against the fullgraph compile of the model
(RFC-0051, issues 5 and 11): the hierarchy of every op under each way users compile a model equals,
for the same op occurrence, its fullgraph hierarchy, or a weaker sound answer RFC.md documents.

Corpus: a synthetic model (helpers, a module shared between the root and every layer), tiny
Hugging Face Qwen2 and tiny GPT-2 (random weights, two layers).  Shapes:

* step function, ``torch.compile(step)(model, batch)`` with ``step`` calling ``model(batch)``: the
  call is an ordinary module call named from its source, so each op's hierarchy is
  ``model (Cls)`` followed by its fullgraph hierarchy with ``model.`` before every path
  (``step_expected``), and module entries equal ``nn_module_stack`` read with ``L['model']`` as
  ``model``;
* regional compilation, ``torch.compiler.nested_compile_region`` on the layer class's ``forward``:
  one ``invoke_subgraph`` body serves every layer; a body op's full hierarchy is the call node's
  hierarchy followed by the body op's hierarchy relative to the region (``compose_region``), and
  must equal the fullgraph hierarchy exactly;
* the same, every call inlined (``torch._dynamo.config.inline_invoke_subgraph``, as vLLM compiles):
  each inlined op's hierarchy, module paths included, must equal its fullgraph hierarchy;
* graph breaks at every insertion point, default and ``nested_graph_breaks=True``: see below;
  an ``unknown_frames`` entry (frames a nested resume function cannot know statically) stands
  for zero or more fullgraph entries (``weaker_relation_problem``).

Each in inference (Dynamo graph) and training (AOTAutograd forward ops' ``call_hierarchy`` and
backward ops' ``fwd_call_hierarchy``, with ``invoke_subgraph`` bodies composed in both).  Ops
are paired by target and innermost source line, in order; gradient accumulations (their forward
origin is the common scope of what they sum, which the graph split decides) and, in ATen graphs,
ops that only move data (chosen by strides) need not have a counterpart and are not compared.

Graph breaks.  Needs the patched torch (``.venv``).  For every model and every graph-break insertion point, under
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
import itertools
import logging
import operator
import re
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import torch  # noqa: E402
import torch.fx.call_hierarchy as call_hierarchy  # noqa: E402  (the patched torch: fail, never skip)

from torch import nn  # noqa: E402
from torch._dynamo.backends.common import aot_autograd  # noqa: E402
from torch._functorch.aot_autograd import make_boxed_func  # noqa: E402

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
    gradient_acc: bool = False  # a backward op summing the gradients of a tensor used several times


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


# Nodes Dynamo inserts itself (grad mode, autocast), not user code: left out of the ops compared,
# since whether Dynamo emits them is incidental; they carry the scope they are made in, as every node.
DYNAMO_INSERTED = {torch._C._set_grad_enabled, torch.amp.autocast_mode._enter_autocast,
                   torch.amp.autocast_mode._exit_autocast}


class Recorder:
    """A backend whose compiled callables log, each time they run, which graph ran."""

    def __init__(self) -> None:
        self.graphs: list[Graph] = []
        self.executions: list[int] = []

    def __call__(self, gm: Any, example_inputs: list[Any]) -> Callable[..., Any]:
        nodes = [n for n in gm.graph.nodes if n.op in ("call_function", "call_method")
                 and n.target not in DYNAMO_INSERTED]
        ops = [Op(n.name, _target(n), _innermost_line(n), tuple(n.meta.get("call_hierarchy", ())),
                  isinstance(n.meta.get("example_value"), torch.Tensor))
               for n in nodes]
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
def break_first_in(fn: types.FunctionType) -> Iterator[None]:
    original = fn.__code__
    fn.__code__ = with_break_first(fn)
    try:
        yield
    finally:
        fn.__code__ = original


def qwen2_break(point: str) -> contextlib.AbstractContextManager[None]:
    return break_first_in(qwen2_insertion_points()[point])


def token_inputs(n: int) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """A Hugging Face causal LM's inputs: `n` random token ids (seeded by `n`), no KV cache."""
    return (torch.randint(0, 128, (1, n), generator=torch.Generator().manual_seed(n)),), {"use_cache": False}


QWEN2 = ModelSpec(
    "qwen2", tiny_qwen2,
    token_inputs,
    lambda: list(qwen2_insertion_points()), qwen2_break, (8, 11),
)


def tiny_gpt2() -> Any:
    """A second real architecture, unlike Qwen2: Conv1D projections, LayerNorm, dropout."""
    transformers = importlib.import_module("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=128, n_positions=64, n_embd=32, n_layer=2, n_head=2,
                                     bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(config).eval()


def gpt2_insertion_points() -> dict[str, Callable[..., Any]]:
    """The forward of each module class that GPT2LMHeadModel runs, and the attention function in
    use (the model's other functions and heads are not reached)."""
    mod = importlib.import_module("transformers.models.gpt2.modeling_gpt2")
    points = {f"{cls.__name__}.forward": inspect.unwrap(vars(cls)["forward"])
              for cls in (mod.GPT2LMHeadModel, mod.GPT2Model, mod.GPT2Block, mod.GPT2Attention, mod.GPT2MLP)}
    impl = tiny_gpt2().config._attn_implementation
    attn = inspect.unwrap(mod.ALL_ATTENTION_FUNCTIONS.get_interface(impl, mod.eager_attention_forward))
    points[attn.__name__] = attn
    return points


def gpt2_break(point: str) -> contextlib.AbstractContextManager[None]:
    return break_first_in(gpt2_insertion_points()[point])


GPT2 = ModelSpec(
    "gpt2", tiny_gpt2,
    token_inputs,
    lambda: list(gpt2_insertion_points()), gpt2_break, (8, 11),
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
        where = f"entry {i}"
        if be["type"] == "module":
            if fe["type"] != "module":
                return f"{where}: module entry for a function call"
            for key in ("attr", "class", "class_qualname"):
                if fe[key] != be[key]:
                    return f"{where}: {key} {be[key]!r} != {fe[key]!r}"
            expected = _rel(fe["path"], base)
            if expected is None:
                if not (fe["path"] == be["path"] or fe["path"].endswith("." + be["path"])):
                    return f"{where}: path {be['path']!r} is not a suffix of {fe['path']!r}"
            elif be["path"] != expected:
                return f"{where}: path {be['path']!r} != {expected!r} (fullgraph {fe['path']!r})"
        elif fe["type"] == "function":
            if not _same_function(fe, be):
                return f"{where}: function {be['qualname']} != {fe['qualname']}"
        else:
            # function entry standing for a module call: the inlined rest of a module's frame
            if not nested:
                return f"{where}: function entry {be['qualname']} for module {fe['path']} without nested_graph_breaks"
            if root["resume_lineno"] is None:
                return f"{where}: function entry {be['qualname']} for module {fe['path']} in a graph that is not a resume"
            if not _defines(fe["class_qualname"], be["module"], be["qualname"]):
                return f"{where}: {be['qualname']} is not a method of {fe['class_qualname']}"
            base = fe["path"]
    return None


UNKNOWN_FRAMES = "unknown_frames"


def weaker_relation_problem(f: tuple[Any, ...], b: tuple[Any, ...], root: dict[str, Any],
                            top: dict[str, Any], nested: bool) -> str | None:
    """relation_problem, where each ``unknown_frames`` entry of B (RFC.md, graph breaks: with
    ``nested_graph_breaks`` the frames between a resume function and the nested resume function
    it calls are not known statically) stands for zero or more consecutive entries of F."""
    unknown = [i for i, e in enumerate(b) if e["type"] == UNKNOWN_FRAMES]
    if not unknown:
        return relation_problem(f, b, root, top, nested)
    if not (nested and root["resume_lineno"] is not None):
        return f"entry {unknown[0]}: {UNKNOWN_FRAMES} outside a resumed graph under nested_graph_breaks"
    rest = tuple(e for e in b if e["type"] != UNKNOWN_FRAMES)
    spare = len(f) - len(rest)
    first = None
    # B may also be longer than F (a function entry for the inlined rest of an absorbed forward,
    # see relation_problem): then every unknown entry stands for nothing.
    for counts in itertools.product(range(max(spare, 0) + 1), repeat=len(unknown)):
        if sum(counts) > max(spare, 0):
            continue
        # B is aligned with F's tail: walk both from the end, each unknown entry taking its slice.
        dropped: set[int] = set()
        pos = len(f)
        taken = iter(reversed(counts))
        for e in reversed(b):
            if e["type"] == UNKNOWN_FRAMES:
                m = next(taken)
                if m and pos - m < 0:
                    break
                dropped.update(range(pos - m, pos))
                pos -= m
            else:
                pos -= 1
        else:
            why = relation_problem(tuple(e for x, e in enumerate(f) if x not in dropped), rest, root, top, nested)
            if why is None:
                return None
            first = first or f"{UNKNOWN_FRAMES} standing for {counts} entries: {why}"
    return first or f"{UNKNOWN_FRAMES}: no slice of F it can stand for"


# --------------------------------------------------------------------------------------------
# Alignment and checks
# --------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Pair:
    execution: int
    graph: Graph
    full: Op
    broken: Op


# ATen ops that only move or alias data: AOTAutograd picks them by the strides it sees, which
# depend on where graphs are split (a ``view`` in one graph is ``clone`` + ``_unsafe_view`` in
# another). Dynamo graphs have none of these targets, so they stay strict there.
LAYOUT_OPS = {f"aten.{name}.default" for name in (
    "view", "_unsafe_view", "clone", "detach", "alias", "t", "expand", "permute", "transpose",
    "reshape", "contiguous")} | {"aten.transpose.int"}


def _must_match(op: Op) -> bool:
    """Whether an op must have a counterpart in the other run: a tensor op that neither sums
    gradients (its place depends on the graph split) nor only moves data in an ATen graph."""
    return op.tensor and not op.gradient_acc and op.target not in LAYOUT_OPS


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
            if _must_match(op):
                problems.append(f"graph {g.index} op {op.node} ({op.target} at {op.line}) has no fullgraph counterpart")
        for i in range(i1, i2):
            op = full[i]
            # a fullgraph op with no counterpart must have run eagerly: a frame Dynamo skipped
            # (a graph break in a loop skips the whole frame), so no compiled op comes from its line
            if _must_match(op) and op.line in lines_b:
                problems.append(f"fullgraph op {op.node} ({op.target} at {op.line}) is missing from the graph-broken run")
    return pairs, problems


def _key(h: tuple[Any, ...]) -> tuple[Any, ...]:
    return tuple(tuple(dict(e).items()) for e in h)


def check_case(full: Graph, rec: Recorder, nested: bool) -> list[str]:
    """Every problem of a graph-broken run against the fullgraph run's only graph."""
    pairs, problems = align(full.ops, rec.executed())
    assert pairs, "nothing was compiled"
    # A gradient accumulation's fwd_call_hierarchy is the common scope of the gradients it sums,
    # which are the ones of its own graph: it depends on where graphs are split, by definition.
    pairs = [p for p in pairs if not (p.full.gradient_acc or p.broken.gradient_acc)]
    for p in pairs:
        why = weaker_relation_problem(p.full.hierarchy, p.broken.hierarchy, p.graph.root, full.root, nested)
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
        if any(e["type"] == UNKNOWN_FRAMES for e in p.broken.hierarchy):
            continue  # its depth does not say which F prefix a B prefix stands for
        k = len(p.full.hierarchy) - len(p.broken.hierarchy)
        for d in range(1, len(p.broken.hierarchy) + 1):
            bk, fk = _key(p.broken.hierarchy[:d]), _key(p.full.hierarchy[:k + d])
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
CASES += [_case("gpt2", p, c) for c in CONFIGS for p in gpt2_insertion_points()]
SPECS = {"synthetic": SYNTHETIC, "qwen2": QWEN2, "gpt2": GPT2}

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
    _SHAPE_RUNS.clear()
    _TRAIN_FULL.clear()
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
                text = e["path"] if e["type"] == "module" else e.get("qualname", "")
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
# Compile shapes: a step function taking the model, regional compilation of the layers;
# inference (the Dynamo graph) and training (AOTAutograd forward and backward graphs)
# --------------------------------------------------------------------------------------------
#
# For each shape the hierarchy of every op, composed where the shape splits it in two (a region
# body relative to its region, under the hierarchy of the invoke_subgraph call that runs it), must
# equal what the fullgraph compile of the model itself gives for the same op occurrence, up to
# what the shape changes by definition (the step function's ``model`` scope).  Ops are paired as
# in the graph-break test (same target and innermost source line, in order).


@dataclasses.dataclass(frozen=True)
class Corpus:
    """A model of the shape tests: how to build and run it, its repeated layer class, its loss."""

    spec: ModelSpec
    layer_class: Callable[[], type]
    loss: Callable[[Any], Any]


def _qwen2_layer() -> type:
    return _qwen2_module().Qwen2DecoderLayer


def _gpt2_layer() -> type:
    return importlib.import_module("transformers.models.gpt2.modeling_gpt2").GPT2Block


CORPUS = {
    "synthetic": Corpus(SYNTHETIC, lambda: Layer, lambda out: out.sum()),
    "qwen2": Corpus(QWEN2, _qwen2_layer, lambda out: out.logits.sum()),
    "gpt2": Corpus(GPT2, _gpt2_layer, lambda out: out.logits.sum()),
}


def step(model: Any, batch: Any, **kwargs: Any) -> Any:
    """The training-loop shape: a compiled function that takes the model."""
    return model(batch, **kwargs)


@contextlib.contextmanager
def regional(layer_class: type) -> Iterator[None]:
    """``torch.compiler.nested_compile_region`` on the layer class's ``forward``: Dynamo traces
    one ``invoke_subgraph`` body and calls it for every layer."""
    original = vars(layer_class)["forward"]
    layer_class.forward = torch.compiler.nested_compile_region(original)
    try:
        yield
    finally:
        layer_class.forward = original


@dataclasses.dataclass
class Compiled:
    """The graphs of one compile: Dynamo's, and AOTAutograd's forward/backward when training."""

    dynamo: list[Any]
    forward: list[Any]
    backward: list[Any]


def compile_shape(corpus: Corpus, shape: str, train: bool) -> Compiled:
    """Compile and run (forward, and backward of the loss when training) one model in one shape:
    ``full`` (the model, fullgraph), ``step`` (``torch.compile(step)(model, batch)``),
    ``regional`` (the model, its layer class under ``nested_compile_region``) or ``inlined``
    (``regional`` with every call of the body inlined into the graph)."""
    spec = corpus.spec
    out = Compiled([], [], [])

    def fw_compiler(gm: Any, example_inputs: Any) -> Any:
        out.forward.append(gm)
        return make_boxed_func(gm)

    def bw_compiler(gm: Any, example_inputs: Any) -> Any:
        out.backward.append(gm)
        return make_boxed_func(gm)

    aot = aot_autograd(fw_compiler=fw_compiler, bw_compiler=bw_compiler)

    def backend(gm: Any, example_inputs: list[Any]) -> Any:
        out.dynamo.append(gm)
        return aot(gm, example_inputs) if train else gm.forward

    model = spec.make().train(train)
    args, kwargs = spec.inputs(spec.sizes[0])
    if train:
        # a float input needs grad, so that every layer's input does and one region serves all
        args = tuple(a.requires_grad_() if a.is_floating_point() else a for a in args)
    torch._dynamo.reset()
    try:
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch._dynamo.config.patch(record_call_hierarchy=True))
            if not train:
                stack.enter_context(torch.no_grad())
            if shape in ("regional", "inlined"):
                stack.enter_context(regional(corpus.layer_class()))
            if shape == "inlined":
                stack.enter_context(torch._dynamo.config.patch(inline_invoke_subgraph=True))
            if shape == "step":
                result = torch.compile(step, backend=backend, fullgraph=True)(model, *args, **kwargs)
            else:
                result = torch.compile(model, backend=backend, fullgraph=True)(*args, **kwargs)
            if train:
                corpus.loss(result).backward()
    finally:
        torch._dynamo.reset()
    assert len(out.dynamo) == 1, f"{spec.name} {shape}: {len(out.dynamo)} Dynamo graphs"
    assert len(out.forward) == len(out.backward) == (1 if train else 0)
    return out


# The hierarchy under a shape, from the ones it splits it into ---------------------------------

def _entry_dicts(h: Any) -> list[dict[str, Any]]:
    return [dict(e) for e in h]


def _entries(dicts: list[dict[str, Any]]) -> tuple[Any, ...]:
    return tuple(call_hierarchy.call_hierarchy_from_dicts(dicts))


def _rebase(body: list[dict[str, Any]], base: str) -> list[dict[str, Any]]:
    """Module paths of ``body`` (relative to the module at ``base``) made relative to the root."""
    return [dict(e, path=f"{base}.{e['path']}" if base else e["path"]) if e["type"] == "module" else e
            for e in body]


def compose_region(call_site: Any, body: Any, body_gm: Any) -> tuple[Any, ...]:
    """The full context of a node of an ``invoke_subgraph`` body: the hierarchy of the call node
    that runs the body, followed by the body node's hierarchy, relative to its region.

    The region is the layer's ``forward`` (a method of the module that the call site's innermost
    entry names, e.g. ``model (Qwen2Model) > layers.1 (Qwen2DecoderLayer)``), so module paths of
    the body are relative to that module.  Where the series records the region (``body_gm.meta``,
    key ``call_hierarchy_root`` as for compiled frames), its ``module_class`` must be that
    module's class."""
    site = _entry_dicts(call_site)
    region = body_gm.meta.get("call_hierarchy_root")
    base = ""
    if site and site[-1]["type"] == "module":
        base = site[-1]["path"]
        if region is not None and region.get("module_class") not in (None, site[-1]["class_qualname"]):
            raise AssertionError(f"region {dict(region)} is not a method of the call site {_fmt(call_site)}")
    return _entries(site + _rebase(_entry_dicts(body), base))


def step_expected(full: Any, model_class: type) -> tuple[Any, ...]:
    """The fullgraph hierarchy of an op as seen from ``step``: the call ``model(batch)`` is a module
    call named from its source, ``model (Cls)``, and every path below it starts with ``model.``."""
    entry = {"type": "module", "attr": "model", "path": "model", "class": model_class.__name__,
             "class_qualname": f"{model_class.__module__}.{model_class.__qualname__}", "count": 0}
    return _entries([entry] + _rebase(_entry_dicts(full), "model"))


_INVOKE_SUBGRAPH = torch.ops.higher_order.invoke_subgraph


def _op_target(node: Any) -> str:
    return str(node.target) if isinstance(node.target, torch._ops.OpOverload) else _target(node)


def flat_ops(gm: Any, key: str = "call_hierarchy", region: Callable[[Any], tuple[Any, ...]] | None = None) -> list[Op]:
    """The ops of a graph in order, each ``invoke_subgraph`` call replaced by its body's ops with
    composed hierarchies (the call node and the ``getitem``s of its results are plumbing with no
    fullgraph counterpart).  ``key``: ``call_hierarchy``, or ``fwd_call_hierarchy`` for backward
    graphs.  An op without ``key`` gets the hierarchy ``None``."""
    ops: list[Op] = []
    for n in gm.graph.nodes:
        if n.op not in ("call_function", "call_method"):
            continue
        if n.target is _INVOKE_SUBGRAPH:
            body = getattr(gm, n.args[0].target)
            site = n.meta.get(key)
            assert site is not None, (n.name, f"invoke_subgraph call without {key}")
            outer = region
            ops += flat_ops(body, key, lambda h, site=site, body=body, outer=outer: (
                compose_region(outer(site) if outer else site, h, body)))
            continue
        if n.target is operator.getitem and getattr(n.args[0], "target", None) is _INVOKE_SUBGRAPH:
            continue
        h = n.meta.get(key)
        if h is not None:
            h = tuple(h) if region is None else region(h)
        value = n.meta.get("val", n.meta.get("example_value"))
        ops.append(Op(n.name, _op_target(n), _innermost_line(n), h, isinstance(value, torch.Tensor),
                      bool(n.meta.get("is_gradient_acc"))))
    return ops


def shape_problems(full: list[Op], ops: list[Op], expected: Callable[[tuple[Any, ...]], tuple[Any, ...]]) -> tuple[int, list[str]]:
    """(pairs checked, problems) of a shape's ops against the fullgraph ops."""
    key_f = [(op.target, op.line) for op in full]
    key_b = [(op.target, op.line) for op in ops]
    problems = []
    checked = 0
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(None, key_f, key_b, autojunk=False).get_opcodes():
        if tag != "equal":
            # Where the gradients of a tensor used several times are summed depends on the graph
            # structure (inside a region body or at its call sites): such sums may differ.
            for op in ops[j1:j2]:
                if _must_match(op):
                    problems.append(f"op {op.node} ({op.target} at {op.line}) has no fullgraph counterpart")
            for op in full[i1:i2]:
                if _must_match(op):
                    problems.append(f"fullgraph op {op.node} ({op.target} at {op.line}) is missing")
            continue
        for f, b in zip(full[i1:i2], ops[j1:j2]):
            if f.hierarchy is None:
                continue  # nothing to compare with (e.g. a backward op with no forward origin)
            if f.gradient_acc or b.gradient_acc:
                continue  # the common scope of the gradients it sums, which the graph split decides
            checked += 1
            want = expected(f.hierarchy)
            if b.hierarchy != want:
                problems.append(f"op {b.node} ({b.target}):\n    got:      {_fmt(b.hierarchy or ())}"
                                f"{' (absent)' if b.hierarchy is None else ''}\n    expected: {_fmt(want)}")
    return checked, problems


SHAPES = ("step", "regional", "inlined")
MODES = ("inference", "training")
_SHAPE_RUNS: dict[tuple[str, str, str], Compiled] = {}


def shape_run(model: str, shape: str, mode: str) -> Compiled:
    key = (model, shape, mode)
    if key not in _SHAPE_RUNS:
        _SHAPE_RUNS[key] = compile_shape(CORPUS[model], shape, mode == "training")
    return _SHAPE_RUNS[key]


def graph_ops(compiled: Compiled, mode: str) -> dict[str, list[Op]]:
    """The ops to compare, per graph kind: Dynamo's (inference) or AOTAutograd's (training;
    backward ops by their forward origin, ``fwd_call_hierarchy``)."""
    if mode == "inference":
        return {"dynamo": flat_ops(compiled.dynamo[0])}
    return {"forward": flat_ops(compiled.forward[0]),
            "backward": flat_ops(compiled.backward[0], "fwd_call_hierarchy")}


def _shape_case(model: str, shape: str, mode: str) -> Any:
    return pytest.param(model, shape, mode, id=f"{model}-{shape}-{mode}")


SHAPE_CASES = [_shape_case(m, s, mode) for m in CORPUS for s in SHAPES for mode in MODES]


@pytest.mark.parametrize(("model", "shape", "mode"), SHAPE_CASES)
def test_shape_equals_fullgraph(model: str, shape: str, mode: str) -> None:
    full = graph_ops(shape_run(model, "full", mode), mode)
    compiled = shape_run(model, shape, mode)
    if shape == "inlined":
        assert not any(n.target is _INVOKE_SUBGRAPH for n in compiled.dynamo[0].graph.nodes)
    got = graph_ops(compiled, mode)
    if shape == "step":
        model_class = type(CORPUS[model].spec.make())

        def expected(h: tuple[Any, ...]) -> tuple[Any, ...]:
            return step_expected(h, model_class)
    else:
        def expected(h: tuple[Any, ...]) -> tuple[Any, ...]:
            return h
    report = []
    for kind in full:
        checked, problems = shape_problems(full[kind], got[kind], expected)
        assert checked > 0.9 * len(full[kind]), f"{kind}: only {checked} of {len(full[kind])} ops compared"
        report += [f"[{kind}] {p}" for p in problems]
    assert not report, f"{len(report)} problem(s):\n" + "\n".join(report[:20])


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("model", list(CORPUS))
def test_regional_compilation_shares_one_body(model: str, mode: str) -> None:
    """The regional shape is what it claims: one invoke_subgraph body called for every layer,
    kept as such by AOTAutograd when training (so the test above sees composed hierarchies)."""
    compiled = shape_run(model, "regional", mode)
    for gm in compiled.dynamo + compiled.forward + compiled.backward:
        calls = [n for n in gm.graph.nodes if n.target is _INVOKE_SUBGRAPH]
        assert len(calls) == 2, [n.format_node() for n in calls]
        assert len({n.args[0].target for n in calls}) == 1, [n.format_node() for n in calls]


@pytest.mark.parametrize("model", list(CORPUS))
def test_step_root_is_the_function_and_modules_agree_with_nn_module_stack(model: str) -> None:
    """Under ``step``, the frame is a plain function (no ``module_class``), and every op's module
    entries are its ``nn_module_stack``, reading ``L['model']`` as ``model``."""
    (gm,) = shape_run(model, "step", "inference").dynamo
    assert gm.meta["call_hierarchy_root"]["qualname"] == "step"
    assert gm.meta["call_hierarchy_root"]["module_class"] is None
    for n in gm.graph.nodes:
        if n.op in ("call_function", "call_method"):
            stack = [p.replace("L['model']", "model", 1) for p, _ in n.meta.get("nn_module_stack", {}).values()]
            assert [e["path"] for e in n.meta["call_hierarchy"] if e["type"] == "module"] == stack, n.name


# --------------------------------------------------------------------------------------------
# Graph breaks in training: AOTAutograd forward ops (call_hierarchy) and backward ops
# (fwd_call_hierarchy) of each graph, against the fullgraph training compile
# --------------------------------------------------------------------------------------------

class TrainingRecorder(Recorder):
    """A Recorder whose graphs go through AOTAutograd; keeps each Dynamo graph's forward and
    (compiled when backward first reaches it) backward graph."""

    def __init__(self) -> None:
        super().__init__()
        self.aot: dict[str, dict[int, Any]] = {"forward": {}, "backward": {}}

    def __call__(self, gm: Any, example_inputs: list[Any]) -> Callable[..., Any]:
        index = len(self.graphs)
        super().__call__(gm, example_inputs)

        def fw_compiler(g: Any, inputs: Any) -> Any:
            self.aot["forward"][index] = g
            return make_boxed_func(g)

        def bw_compiler(g: Any, inputs: Any) -> Any:
            self.aot["backward"][index] = g
            return make_boxed_func(g)

        compiled = aot_autograd(fw_compiler=fw_compiler, bw_compiler=bw_compiler)(gm, example_inputs)

        def run(*args: Any) -> Any:
            self.executions.append(index)
            return compiled(*args)

        return run

    def lowered(self, kind: str) -> Recorder:
        """The AOTAutograd graphs of one kind as a Recorder of their own: same indices and root
        records as the Dynamo graphs they come from; backward graphs run in the reverse order."""
        key = "call_hierarchy" if kind == "forward" else "fwd_call_hierarchy"
        rec = Recorder()
        for g in self.graphs:
            gm = self.aot[kind].get(g.index)
            ops = [op for op in flat_ops(gm, key) if op.hierarchy is not None] if gm is not None else []
            rec.graphs.append(Graph(g.index, gm, g.root, ops))
        order = self.executions if kind == "forward" else self.executions[::-1]
        rec.executions = [i for i in order if i in self.aot[kind]]
        return rec


def run_training(spec: ModelSpec, *, site: str | None, nested: bool) -> TrainingRecorder:
    rec = TrainingRecorder()
    model = spec.make().train()
    args, kwargs = spec.inputs(spec.sizes[0])
    args = tuple(a.requires_grad_() if a.is_floating_point() else a for a in args)
    torch._dynamo.reset()
    try:
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch._dynamo.config.patch(record_call_hierarchy=True, nested_graph_breaks=nested))
            if site is not None:
                stack.enter_context(spec.inserting(site))
            compiled = torch.compile(model, backend=rec, fullgraph=site is None)
            CORPUS[spec.name].loss(compiled(*args, **kwargs)).backward()
    finally:
        torch._dynamo.reset()
    return rec


_TRAIN_FULL: dict[str, TrainingRecorder] = {}


def training_fullgraph(spec: ModelSpec, kind: str) -> Graph:
    if spec.name not in _TRAIN_FULL:
        rec = run_training(spec, site=None, nested=False)
        assert len(rec.graphs) == 1 and rec.executions == [0]
        _TRAIN_FULL[spec.name] = rec
    (graph,) = _TRAIN_FULL[spec.name].lowered(kind).graphs
    return graph


# Every synthetic site; Qwen2 and GPT-2 points where a break splits the layers, the attention, helpers.
TRAIN_CASES = [_case("synthetic", s, c) for c in CONFIGS for s in SITES]
TRAIN_CASES += [_case("qwen2", p, c) for c in CONFIGS for p in (
    "Qwen2DecoderLayer.forward", "Qwen2Attention.forward", "Qwen2MLP.forward", "rotate_half")]
TRAIN_CASES += [_case("gpt2", p, c) for c in CONFIGS for p in ("GPT2Block.forward", "GPT2Attention.forward")]


@pytest.mark.parametrize(("model", "site", "config"), TRAIN_CASES)
def test_differential_training(model: str, site: str, config: str) -> None:
    nested = CONFIGS[config]
    spec = SPECS[model]
    rec = run_training(spec, site=site, nested=nested)
    assert len(rec.graphs) > 1, f"no graph break at {site}"
    report = []
    for kind in ("forward", "backward"):
        lowered = rec.lowered(kind)
        assert lowered.executions, f"no {kind} graph ran"
        report += [f"[{kind}] {p}" for p in check_case(training_fullgraph(spec, kind), lowered, nested)]
    assert not report, f"{len(report)} problem(s):\n" + "\n".join(report[:20])


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


# --------------------------------------------------------------------------------------------
# A module held on the stack at a break: `self.down(breaking(self.gate(x)))`
# --------------------------------------------------------------------------------------------

def _breaking(x):
    torch._dynamo.graph_break()
    return x.cos()


class StackSlotMLP(nn.Module):
    """``self.down`` is loaded before its argument is computed, so at a break in that argument
    (a graph break, a ``torch._dynamo.disable``d call) it is a value on the stack, which the
    resume function receives as its local ``___stack0``."""

    def __init__(self, eager: bool) -> None:
        super().__init__()
        self.gate = nn.Linear(4, 4)
        self.down = nn.Linear(4, 4)
        self.eager = eager

    @torch._dynamo.disable
    def eager_part(self, x):
        return x.sin()

    def forward(self, x):
        return self.down((self.eager_part if self.eager else _breaking)(self.gate(x)))


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("eager", [False, True], ids=["graph_break", "disable"])
def test_module_on_the_stack_at_a_break_is_named_by_the_resume_local(config: str, eager: bool) -> None:
    # One resume function serves every path that reaches the break (ContinueExecutionCache), and
    # its graph serves every module instance of the slot's type: which of the root's modules the
    # slot holds is not known statically. The module entry is named by the resume function's
    # local, as nn_module_stack names it (L['___stack0']), never by one caller's path; RFC.md,
    # "Graph breaks". Fullgraph names it `down`.
    rec = Recorder()
    torch._dynamo.reset()
    try:
        with torch._dynamo.config.patch(record_call_hierarchy=True, nested_graph_breaks=CONFIGS[config]):
            torch.compile(StackSlotMLP(eager), backend=rec)(torch.randn(2, 4))
    finally:
        torch._dynamo.reset()
    linears = {}
    for g in rec.graphs:
        for node in g.gm.graph.nodes:
            if node.op == "call_function" and node.target is torch._C._nn.linear:
                (entry,) = (e for e in node.meta["call_hierarchy"] if e["type"] == "module")
                (name, _), *_ = reversed(node.meta["nn_module_stack"].values())
                linears[entry["path"]] = (entry["attr"], entry["class"], name)
    assert set(linears) == {"gate", "___stack0"}, linears
    assert linears["gate"] == ("gate", "Linear", "L['self'].gate")
    assert linears["___stack0"] == ("___stack0", "Linear", "L['___stack0']")
