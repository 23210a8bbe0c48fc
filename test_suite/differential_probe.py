"""What torch.compile compiles for a small corpus of programs, as normalized text (issue 12).

Run by ``test_suite/test_differential.py`` once per build, each in its own process::

    PYTHON -m test_suite.differential_probe --flag absent|off|on --out FILE.json

``absent``: the torch of the flag-free fixes only (``torch._dynamo.config`` has no
``record_call_hierarchy``); ``off``/``on``: the whole series with the flag off/on (set globally
before anything is compiled, so a lazily compiled backward sees it too).  For every program of
the corpus the output maps an artifact name to its text:

* ``dynamo graph N: code`` / ``: meta`` / ``: FX graph cache key`` — each graph Dynamo hands the
  backend (submodules of HOPs included), its node meta and ``gm.meta``;
* ``aot graph N forward|backward|inference: ...`` — the same for AOTAutograd's graphs
  (min-cut partitioner, as Inductor uses);
* ``cache entry CODE #K: bytecode`` / ``: guards`` — every Dynamo cache entry of every code object
  Dynamo converted (the resume functions included): the transformed bytecode and the guard tree;
  ``resume function CODE: bytecode`` — the generated resume function itself;
* ``export: ...`` — the strict-export program; ``counts`` — graphs, cache entries, Dynamo counters.

Node meta is compared apart from the call_hierarchy keys (``call_hierarchy``,
``fwd_call_hierarchy``, ``gm.meta["call_hierarchy_root"]``), which only the flag adds.  Values are
written in a normalized repr; the normalizations (see ``Normalizer``) remove only what differs
between any two processes: object addresses and ids, uuids, process-global counters (renumbered
by first appearance within a program, so that which nodes share a ``seq_nr`` is still compared)
and the venv's path.
"""

from __future__ import annotations

import argparse
import contextlib
import dis
import json
import re
import sys
import sysconfig
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch._dynamo
import torch._dynamo.convert_frame
import torch._inductor.codecache
import torch.utils.checkpoint
from torch import nn
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.eval_frame import _debug_get_cache_entry_list
from torch._dynamo.utils import counters
from torch._functorch._aot_autograd.autograd_cache import sanitize_gm_for_cache
from torch._functorch._aot_autograd.utils import make_boxed_func
from torch._functorch.partitioners import min_cut_rematerialization_partition

REPO_ROOT = Path(__file__).resolve().parent.parent
# Only the flag adds these; everything else in node.meta / gm.meta must be equal.
HIERARCHY_NODE_KEYS = frozenset({"call_hierarchy", "fwd_call_hierarchy"})
HIERARCHY_GM_KEYS = frozenset({"call_hierarchy_root"})


# --------------------------------------------------------------------------------------------
# Normalization
# --------------------------------------------------------------------------------------------


class Normalizer:
    """Removes from text what differs between two processes compiling the same program.

    Counters are renumbered by first appearance, so identity relations are still compared:
    ``__compiled_fn_7`` becomes ``__compiled_fn_<1>`` wherever it appears in the program, and a
    reference to another graph or resume function than before is still a difference.
    """

    # (pattern, family): group 1 is renumbered within the family, for the whole program.
    PROGRAM_COUNTERS: ClassVar[list[tuple[re.Pattern[str], str]]] = [
        # Dynamo's unique_id(): one process-global counter behind the names of compiled graphs,
        # resume functions and installed globals.
        (re.compile(r"(?:__compiled_fn|__resume_at_\d+|__builtins_dict__|__warnings_warn_wrapper|"
                    r"__gen_rand_values|__comprehension_\w+?_at_\d+|___context_manager_\d+)_(\d+)"), "unique_id"),
        # install_global_by_id names: {prefix}_{id}_c{OutputGraph.compile_id}, a process-global counter.
        (re.compile(r"_\d{9,}_c(\d+)"), "compile_id"),
        (re.compile(r"<eval_with_key>\.(\d+)"), "eval_with_key"),
        (re.compile(r"_tensor_constant(\d+)"), "tensor_constant"),
    ]
    # id() of objects (nn_module_stack keys, ID_MATCH/TYPE_MATCH guards, NodeSource.graph_id,
    # names such as G['_140185255909456_c0']): addresses, renumbered within each artifact (an
    # extra object early in a program would otherwise renumber every later artifact).
    ID = re.compile(r"(?<![0-9A-Za-z.])(\d{9,})(?![0-9A-Za-z.])")
    FIXED: ClassVar[list[tuple[re.Pattern[str], str]]] = [
        (re.compile(r"0x[0-9a-fA-F]+"), "0x?"),
        # uuids, also as the suffix of __compiled_fn_N_<uuid with underscores>
        (re.compile(r"[0-9a-f]{8}([-_])[0-9a-f]{4}\1[0-9a-f]{4}\1[0-9a-f]{4}\1[0-9a-f]{12}"), "<uuid>"),
        # A DICT_VERSION guard compares a dict's version tag with the one it had when compiled: on
        # CPython 3.11 a snapshot of a process-global counter of dict changes, not a property of
        # the program; the dict guarded is still compared.
        (re.compile(r"(___dict_version\(.*?\) == )\d+"), r"\1<version>"),
    ]

    def __init__(self, edited_torch_files: list[str]) -> None:
        self.families: dict[str, dict[str, int]] = {}
        self.paths = sorted({sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}, key=len,
                            reverse=True)
        # The series edits these torch files, so the line numbers of their frames (in stack traces
        # and in the source comments of guards) move between the fixes-only build and the whole
        # series; file, function and source line are still compared.
        files = "|".join(re.escape(f.removeprefix("torch/")) for f in edited_torch_files)
        self.edited_lines = [
            re.compile(rf'(File "<site-packages>/torch/(?:{files})", line )\d+'),
            re.compile(rf"((?<![\w/])(?:{files}):)\d+(?= in )"),
        ] if files else []

    @staticmethod
    def renumber(pattern: re.Pattern[str], table: dict[str, int], text: str) -> str:
        def sub(m: re.Match[str]) -> str:
            n = table.setdefault(m.group(1), len(table) + 1)
            return m.group(0)[: m.start(1) - m.start(0)] + f"<{n}>" + m.group(0)[m.end(1) - m.start(0):]
        return pattern.sub(sub, text)

    def __call__(self, text: str) -> str:
        for path in self.paths:  # the venv differs between builds (a) and (b)/(c)
            text = text.replace(path, "<site-packages>")
        text = text.replace(str(REPO_ROOT), "<repo>")
        for pattern in self.edited_lines:
            text = pattern.sub(r"\1?", text)
        for pattern, repl in self.FIXED:
            text = pattern.sub(repl, text)
        for pattern, family in self.PROGRAM_COUNTERS:
            text = self.renumber(pattern, self.families.setdefault(family, {}), text)
        return self.renumber(self.ID, {}, text)


def norm_value(value: Any, seq: Callable[[int], str], depth: int = 0) -> str:
    """A repr of a meta value that names no address; tensors by their metadata."""
    if depth > 8:
        return "..."

    def rec(v: Any) -> str:
        return norm_value(v, seq, depth + 1)

    if isinstance(value, torch.Tensor):
        try:
            stride = tuple(value.stride())
        except RuntimeError:  # sparse, nested
            stride = None
        return (f"Tensor({tuple(value.shape)}, {value.dtype}, stride={stride}, "
                f"requires_grad={value.requires_grad}, {type(value).__name__})")
    if isinstance(value, torch.fx.Node):
        return f"%{value.name}"
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return f"{type(value).__name__}({value})"
    if isinstance(value, dict):
        # Insertion order is part of the value (nn_module_stack: outermost first).
        return "{" + ", ".join(f"{rec(k)}: {rec(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        inner = ", ".join(rec(v) for v in value)
        name = type(value).__name__
        if hasattr(value, "_fields"):  # NamedTuple
            inner = ", ".join(f"{f}={rec(v)}" for f, v in zip(value._fields, value))
        return f"{name}({inner})"
    if isinstance(value, type):
        return f"<class {value.__module__}.{value.__qualname__}>"
    if isinstance(value, torch.fx.traceback.NodeSource):
        return (f"NodeSource(name={value.name}, target={value.target}, graph_id={value.graph_id}, "
                f"pass={value.pass_name}, action={rec(getattr(value, 'action', None))}, "
                f"from_node={rec(value.from_node)})")
    if isinstance(value, types.FunctionType):
        return f"<function {value.__module__}.{value.__qualname__}>"
    return repr(value)


def graph_meta(gm: torch.fx.GraphModule, seq: Callable[[int], str]) -> str:
    """Node meta (and gm.meta) of gm and of its GraphModule submodules, one node a line."""
    lines = []
    for name, mod in gm.named_modules():
        if not isinstance(mod, torch.fx.GraphModule):
            continue
        gm_meta = {k: v for k, v in mod.meta.items() if k not in HIERARCHY_GM_KEYS}
        lines.append(f"[module {name or '<root>'}] gm.meta = {norm_value(gm_meta, seq)}")
        for node in mod.graph.nodes:
            lines.append(f"{node.name} ({node.op}):")
            for key in sorted(node.meta):
                if key in HIERARCHY_NODE_KEYS:
                    continue
                value = node.meta[key]
                if key == "seq_nr":
                    text = seq(value)
                elif key == "grad_fn_seq_nr":
                    text = "[" + ", ".join(seq(v) for v in value) + "]"
                else:
                    text = norm_value(value, seq)
                lines.append(f"    {key} = {text}")
    return "\n".join(lines)


def graph_code(gm: torch.fx.GraphModule) -> str:
    return gm.print_readable(print_output=False, include_stride=True, include_device=True)


def fx_cache_key(gm: torch.fx.GraphModule, example_inputs: list[Any], is_backward: bool) -> str:
    """The FX graph cache key of gm with its per-field hashes.  For a Dynamo graph this stands for
    AOTAutograd's cache key, whose details extend the same FxGraphHashDetails and which is
    computed on the graph with gm.meta cleared (it holds the graph's unique backend_id)."""
    try:
        with sanitize_gm_for_cache(gm):
            key, lines = torch._inductor.codecache.compiled_fx_graph_hash(
                gm, example_inputs, {"is_backward": is_backward, "static_input_idxs": []}, [])
    except torch._inductor.codecache.BypassFxGraphCache as exc:  # uncacheable: comparable too
        return f"uncacheable: {exc}"
    return "\n".join([key, *lines])


def bytecode(code: types.CodeType) -> str:
    """The full listing of a code object and every code object in its constants."""
    out = [(f"code {code.co_qualname} (firstlineno {code.co_firstlineno}, argcount {code.co_argcount}, "
            f"flags {code.co_flags}, nlocals {code.co_nlocals}, stacksize {code.co_stacksize})"),
           f"  varnames {code.co_varnames}", f"  freevars {code.co_freevars}",
           f"  cellvars {code.co_cellvars}", f"  names {code.co_names}",
           ("  consts " + ", ".join(c.co_qualname if isinstance(c, types.CodeType) else repr(c)
                                    for c in code.co_consts)),
           dis.Bytecode(code, show_caches=False).dis()]
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            out.append(bytecode(const))
    return "\n".join(out)


# --------------------------------------------------------------------------------------------
# Recording one program's compilation
# --------------------------------------------------------------------------------------------


class Recorder:
    def __init__(self) -> None:
        self.artifacts: dict[str, str] = {}
        self.codes: list[types.CodeType] = []  # codes Dynamo converted, in order, no duplicates
        self.graphs = 0
        self.seq_numbers: dict[int, int] = {}
        # As Inductor compiles: input mutations stay in the graph, as copy_ nodes.
        self.keep_input_mutations = False

    def add(self, name: str, text: str) -> None:
        assert name not in self.artifacts, name
        self.artifacts[name] = text

    def bytecode_hook(self, code: types.CodeType, new_code: types.CodeType) -> None:
        if code not in self.codes:
            self.codes.append(code)

    def backend(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        n = self.graphs
        self.graphs += 1
        self.add(f"dynamo graph {n}: code", graph_code(gm))
        self.add(f"dynamo graph {n}: meta", graph_meta(gm, self.seq))
        self.add(f"dynamo graph {n}: FX graph cache key", fx_cache_key(gm, example_inputs, False))

        def compiler(kind: str) -> Callable[[torch.fx.GraphModule, list[Any]], Any]:
            def compile_aot(aot_gm: torch.fx.GraphModule, inputs: list[Any]) -> Any:
                self.add(f"aot graph {n} {kind}: code", graph_code(aot_gm))
                self.add(f"aot graph {n} {kind}: meta", graph_meta(aot_gm, self.seq))
                self.add(f"aot graph {n} {kind}: FX graph cache key",
                         fx_cache_key(aot_gm, inputs, kind == "backward"))
                return make_boxed_func(aot_gm.forward)
            return compile_aot

        return aot_autograd(fw_compiler=compiler("forward"), bw_compiler=compiler("backward"),
                            inference_compiler=compiler("inference"),
                            partition_fn=min_cut_rematerialization_partition,
                            keep_inference_input_mutations=self.keep_input_mutations)(gm, example_inputs)

    def seq(self, value: int) -> str:
        """seq_nr is a process-global autograd counter: renumber it by first appearance within the
        program (the text normalizer cannot tell these small integers from other values)."""
        return f"seq<{self.seq_numbers.setdefault(value, len(self.seq_numbers) + 1)}>"

    def record_cache_entries(self) -> None:
        seen: dict[str, int] = {}
        for code in self.codes:
            base = f"{code.co_qualname}@{code.co_firstlineno}"
            k = seen[base] = seen.get(base, -1) + 1
            label = base if k == 0 else f"{base} [{k}]"  # two code objects of one name and line
            if code.co_name.startswith("torch_dynamo_resume_in_"):
                self.add(f"resume function {label}: bytecode", bytecode(code))
            entries = _debug_get_cache_entry_list(code)
            for i, entry in enumerate(entries):
                # an entry without code runs the frame as it is (Dynamo made no graph for those guards)
                code_listing = "(no code: the frame runs as it is)" if entry.code is None else bytecode(entry.code)
                self.add(f"cache entry {label} #{i}: bytecode", code_listing)
                self.add(f"cache entry {label} #{i}: guards", str(entry.guard_manager))


@contextlib.contextmanager
def recording(rec: Recorder) -> Iterator[None]:
    torch._dynamo.reset()
    counters.clear()
    handle = torch._dynamo.convert_frame.register_bytecode_hook(rec.bytecode_hook)
    try:
        yield
        rec.record_cache_entries()
        frames = dict(counters["frames"])
        stats = dict(counters["stats"])
        rec.add("counts", "\n".join([
            f"dynamo graphs: {rec.graphs}",
            f"converted code objects: {len(rec.codes)}",
            "cache entries: " + ", ".join(str(len(_debug_get_cache_entry_list(c))) for c in rec.codes),
            f"frames: {sorted(frames.items())}",
            f"stats: {sorted(stats.items())}",
            f"recompiles: {sorted(dict(counters['recompiles']).items())}",
            f"resumes: {sum(dict(counters['resumes']).values())}",
            f"graph breaks: {sum(dict(counters['graph_break']).values())}",
        ]))
    finally:
        handle.remove()
        torch._dynamo.reset()


# --------------------------------------------------------------------------------------------
# The corpus
# --------------------------------------------------------------------------------------------


def tiny_qwen2(layers: int) -> nn.Module:
    import transformers

    torch.manual_seed(0)
    config = transformers.Qwen2Config(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )
    return transformers.Qwen2ForCausalLM(config)


def helper(x: torch.Tensor) -> torch.Tensor:
    x = x * 3
    torch._dynamo.graph_break()
    return x - 1


class BreakingLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.lin(x)
        x = helper(x)
        return torch.relu(x)


class BreakingModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([BreakingLayer(), BreakingLayer()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + 1
        x = self.layers[0](x)
        x = self.layers[1](x)
        return x * 2


class Shared(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.sin()
        torch._dynamo.graph_break()
        return x + 1


class BlockA(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.shared = Shared()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.shared(x)  # its rest is its return: Dynamo does not resume this frame


class BlockB(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.shared = Shared()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.shared(x * 2)


class PolyLayer(nn.Module):
    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.lin(x)
        x = self.block(x)  # the polymorphic call site: BlockA.forward or BlockB.forward
        return x.cos()


class PolyModel(nn.Module):
    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.layer = PolyLayer(block)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x) * 2


class ScaledSin(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return x.sin() * 2

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        return grad * x.cos() * 2


class CustomFunctionModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.out = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(ScaledSin.apply(self.lin(x)))


class Router(nn.Module):
    """In-place normalization, as Hugging Face MoE routers do."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, _ = torch.topk(self.gate(x).softmax(-1), 2)
        weights /= weights.sum(-1, keepdim=True)
        weights.mul_(2)
        return weights


class NormModel(nn.Module):
    """BatchNorm, whose running statistics a graph that keeps input mutations writes back with copy_
    (patch 0022), and a float eps that dynamic shapes make a graph input, whose uses
    tensorify_python_scalars rewrites (patch 0021)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.bn = nn.BatchNorm1d(8)
        self.eps = 1e-5

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.bn(self.lin(x))
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)


class CondModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.lin(x)
        return torch.cond(x.sum() > 0, lambda t: t.sin(), lambda t: t.cos(), (x,))


class HopBody(nn.Module):
    """A trained torch.cond, map or scan body: each HOP's backward is traced from its body (patches
    0014 and 0015 run the body node by node when the flag is on).  A while_loop's backward here
    falls back to eager (aten._local_scalar_dense in the aot_eager backend): nothing to compare."""

    def __init__(self, hop: str) -> None:
        super().__init__()
        self.hop = hop
        self.lin = nn.Linear(8, 8)

    def step(self, h: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.lin(h).tanh() + x
        return h.clone(), h.sin()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch._higher_order_ops import map as hop_map
        from torch._higher_order_ops.scan import scan

        if self.hop == "cond":
            return torch.cond(x.sum() > 0, lambda t: self.lin(t).sin(), lambda t: t.cos(), (x,))
        if self.hop == "map":
            return hop_map(lambda t: self.lin(t).relu(), x)
        return scan(self.step, torch.zeros(x.shape[1:]), x)[1]


class CheckpointModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin1 = nn.Linear(8, 8)
        self.lin2 = nn.Linear(8, 8)

    def block(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.lin2(torch.relu(self.lin1(x))))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.utils.checkpoint.checkpoint(self.block, x, use_reentrant=False).sum(-1)


def scale(x: torch.Tensor) -> torch.Tensor:
    return torch.relu(x) * 3


class ExportModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = CustomFunctionModel()
        self.norm = nn.LayerNorm(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(scale(self.inner.out(self.inner.lin(x))))


def inputs(*shape: int, requires_grad: bool = False) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1)
    return torch.randn(*shape, generator=gen, requires_grad=requires_grad)


def compiled(rec: Recorder, model: nn.Module) -> Callable[..., Any]:
    return torch.compile(model, backend=rec.backend)


def qwen2_inference(rec: Recorder) -> None:
    model = tiny_qwen2(layers=2).eval()
    ids = torch.randint(0, 128, (1, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        fn = compiled(rec, model)
        fn(ids, use_cache=False)
        fn(ids, use_cache=False)  # guards pass: no recompile


def qwen2_training(rec: Recorder) -> None:
    model = tiny_qwen2(layers=1).train()
    ids = torch.randint(0, 128, (1, 8), generator=torch.Generator().manual_seed(1))
    compiled(rec, model)(ids, labels=ids, use_cache=False).loss.backward()


def train(rec: Recorder, model: nn.Module, calls: int = 1) -> None:
    fn = compiled(rec, model)
    for _ in range(calls):
        fn(inputs(2, 8, requires_grad=True)).sum().backward()


def graph_breaks_default(rec: Recorder) -> None:
    train(rec, BreakingModel(), calls=2)


def graph_breaks_nested(rec: Recorder) -> None:
    with torch._dynamo.config.patch(nested_graph_breaks=True):
        train(rec, BreakingModel(), calls=2)


def polymorphic_call_site_nested(rec: Recorder) -> None:
    # One call site (PolyLayer.forward's self.block(x)) reaches the graph break in Shared.forward
    # through BlockA.forward for the first model and BlockB.forward for the second; neither Block
    # frame is resumed. Both models share the code objects, hence Dynamo's cache.
    torch.manual_seed(0)
    with torch._dynamo.config.patch(nested_graph_breaks=True):
        for model in (PolyModel(BlockA()), PolyModel(BlockB())):
            train(rec, model)


def custom_autograd_function(rec: Recorder) -> None:
    torch.manual_seed(0)
    train(rec, CustomFunctionModel())


def inplace_router(rec: Recorder) -> None:
    torch.manual_seed(0)
    train(rec, Router())


def norm_dynamic_input_mutations(rec: Recorder) -> None:
    torch.manual_seed(0)
    rec.keep_input_mutations = True
    torch.compile(NormModel(), backend=rec.backend, dynamic=True)(inputs(4, 8, requires_grad=True)).sum().backward()


def hop_cond(rec: Recorder) -> None:
    torch.manual_seed(0)
    with torch.no_grad():
        compiled(rec, CondModel())(inputs(2, 8))


def hop_training(rec: Recorder) -> None:
    for hop in ("cond", "map", "scan"):
        torch.manual_seed(0)
        train(rec, HopBody(hop))


def hop_checkpoint(rec: Recorder) -> None:
    torch.manual_seed(0)
    train(rec, CheckpointModel())


def strict_export(rec: Recorder) -> None:
    torch.manual_seed(0)
    ep = torch.export.export(ExportModel(), (inputs(2, 8),), strict=True)
    rec.add("export: code", graph_code(ep.graph_module))
    rec.add("export: meta", graph_meta(ep.graph_module, rec.seq))
    rec.add("export: signature", str(ep.graph_signature))
    rec.add("export: module call graph", norm_value(
        [(e.fqn, str(e.signature)) for e in ep.module_call_graph], rec.seq))


CORPUS: dict[str, Callable[[Recorder], None]] = {
    "qwen2_inference": qwen2_inference,
    "qwen2_training": qwen2_training,
    "graph_breaks_default": graph_breaks_default,
    "graph_breaks_nested": graph_breaks_nested,
    "polymorphic_call_site_nested": polymorphic_call_site_nested,
    "custom_autograd_function": custom_autograd_function,
    "inplace_router": inplace_router,
    "norm_dynamic_input_mutations": norm_dynamic_input_mutations,
    "hop_cond": hop_cond,
    "hop_training": hop_training,
    "hop_checkpoint": hop_checkpoint,
    "strict_export": strict_export,
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--flag", choices=["absent", "off", "on"], required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--only", nargs="*", help="run only these programs")
    args = ap.parse_args(argv)
    has_flag = hasattr(torch._dynamo.config, "record_call_hierarchy")
    if has_flag != (args.flag != "absent"):
        print(f"error: --flag {args.flag} but this torch ({torch.__file__}) "
              f"{'has' if has_flag else 'has no'} torch._dynamo.config.record_call_hierarchy", file=sys.stderr)
        return 2
    if has_flag:
        torch._dynamo.config.record_call_hierarchy = args.flag == "on"
    # torch_key() hashes torch's own source files, which differ between the fixes-only build and
    # the whole series by construction; every other field of the cache keys must be equal.
    torch._inductor.codecache.torch_key = lambda: b"torch_key"  # type: ignore[assignment]
    sys.path.insert(0, str(REPO_ROOT))
    from scripts import series

    edited = series.torch_paths(series.load_series(REPO_ROOT / "patches"))
    result: dict[str, dict[str, str]] = {}
    for name, program in CORPUS.items():
        if args.only and name not in args.only:
            continue
        rec = Recorder()
        with recording(rec):
            program(rec)
        normalize = Normalizer(edited)
        result[name] = {key: normalize(text) for key, text in rec.artifacts.items()}
    args.out.write_text(json.dumps(result, indent=1, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
