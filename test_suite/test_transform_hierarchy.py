"""call_hierarchy after the transforms that follow Dynamo (RFC-0051, issue 4 item 7).

Needs the patched torch (``.venv``).  Models: the tiny Hugging Face Qwen2 of
``scripts.hierarchy_profiler.models.qwen2`` (random weights, seed 0, no download) and
small synthetic modules.  Golden files under ``golden/transforms/`` pin, one line per node
(or kernel), what each lowered graph carries:

* ``aten_inference_*``: the ATen forward graph after decomposition (aot_autograd, no_grad);
* ``train_forward_*`` / ``train_backward_*``: training graphs of aot_autograd (default
  partitioner); backward lines show ``fwd_call_hierarchy`` (forward origin), the node's own
  ``call_hierarchy`` where it has one, and the ``recompute`` / gradient-accumulation markers;
* ``checkpoint_*``: a ``torch.utils.checkpoint`` block with the min-cut partitioner
  (recomputed forward ops in the backward graph);
* ``inductor_kernels_*``: Inductor CPU kernels, each mapped to the common scope of its
  origin post-grad nodes;
* ``export_strict_nested``: ``torch.export.export(..., strict=True)``.
* ``flex_attention_dynamo``: Dynamo's graph of a flex_attention call and its ``score_mod`` /
  ``mask_fn`` HOP subgraphs.

Regenerate with ``EXPECTTEST_ACCEPT=1 .venv/bin/python -m pytest test_suite/test_transform_hierarchy.py``;
without that variable a difference fails the test and the files are left alone.
"""

from __future__ import annotations

import copy
import dataclasses
import io
import operator
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import torch  # noqa: E402
import torch.fx.call_hierarchy as call_hierarchy  # noqa: E402  (the patched torch: fail, never skip)

from torch import nn  # noqa: E402
from torch._dynamo.backends.common import aot_autograd  # noqa: E402
from torch._functorch.aot_autograd import make_boxed_func  # noqa: E402
from torch._functorch.partitioners import min_cut_rematerialization_partition  # noqa: E402

from scripts.hierarchy_profiler import models  # noqa: E402
from test_suite import golden  # noqa: E402
from scripts.hierarchy_profiler.inductor import _kernels, inductor_config  # noqa: E402

common_call_hierarchy = call_hierarchy.common_call_hierarchy
format_call_hierarchy = call_hierarchy.format_call_hierarchy

GOLDEN_DIR = Path(__file__).parent / "golden" / "transforms"


# --------------------------------------------------------------------------- golden files


def assert_golden(name: str, actual: str) -> None:
    """Compare with ``golden/transforms/<name>.txt``; EXPECTTEST_ACCEPT=1 rewrites it."""
    golden.assert_golden(GOLDEN_DIR / f"{name}.txt", actual)


def fmt(hierarchy: Any) -> str:
    return format_call_hierarchy(hierarchy) or "<root>"


def target(node: "torch.fx.Node") -> str:
    if node.op != "call_function":
        return node.op
    if isinstance(node.target, torch._ops.OpOverload):
        return str(node.target)  # aten.add.Tensor
    return getattr(node.target, "__name__", str(node.target))  # getitem


def render(gm: "torch.fx.GraphModule") -> str:
    """``name target: hierarchy`` per node (forward / inference graphs)."""
    lines = []
    for node in gm.graph.nodes:
        hierarchy = fmt(node.meta["call_hierarchy"]) if "call_hierarchy" in node.meta else "<absent>"
        lines.append(f"{node.name} {target(node)}: {hierarchy}")
    return "".join(line + "\n" for line in lines)


def render_backward(gm: "torch.fx.GraphModule") -> str:
    """Per node: ``fwd=`` forward origin, ``own=`` its own call_hierarchy, and markers."""
    lines = []
    for node in gm.graph.nodes:
        parts = []
        if "fwd_call_hierarchy" in node.meta:
            parts.append(f"fwd={fmt(node.meta['fwd_call_hierarchy'])}")
        if "call_hierarchy" in node.meta:
            parts.append(f"own={fmt(node.meta['call_hierarchy'])}")
        if node.meta.get("recompute") is not None:
            parts.append(f"[recompute={getattr(node.meta['recompute'], 'name', node.meta['recompute'])}]")
        if node.meta.get("is_gradient_acc"):
            parts.append("[gradient_acc]")
        lines.append(f"{node.name} {target(node)}: {' '.join(parts) or '<absent>'}")
    return "".join(line + "\n" for line in lines)


# --------------------------------------------------------------------------- capture helpers


@pytest.fixture(autouse=True, scope="module")
def _dynamo_reset() -> Iterator[None]:
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


class Captured:
    """The Dynamo graph and the ATen graphs aot_autograd hands to its compilers."""

    def __init__(self) -> None:
        self.dynamo: list[torch.fx.GraphModule] = []
        self.forward: list[torch.fx.GraphModule] = []
        self.backward: list[torch.fx.GraphModule] = []

    def backend(self, **kwargs: Any) -> Callable[..., Any]:
        def fw_compiler(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
            self.forward.append(gm)
            return make_boxed_func(gm)

        def bw_compiler(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
            self.backward.append(gm)
            return make_boxed_func(gm)

        aot = aot_autograd(fw_compiler=fw_compiler, bw_compiler=bw_compiler, **kwargs)

        def backend(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
            self.dynamo.append(gm)
            return aot(gm, example_inputs)

        return backend


def compile_aot(workload: models.Workload, train: bool, **aot_kwargs: Any) -> Captured:
    captured = Captured()
    workload.model.train(train)
    torch._dynamo.reset()
    compiled = torch.compile(workload.model, backend=captured.backend(**aot_kwargs), fullgraph=True)
    with torch._dynamo.config.patch(record_call_hierarchy=True):
        if train:
            workload.loss_of(compiled(*workload.args, **workload.kwargs)).backward()
        else:
            with torch.no_grad():
                compiled(*workload.args, **workload.kwargs)
    torch._dynamo.reset()
    assert len(captured.dynamo) == len(captured.forward) == 1
    assert len(captured.backward) == (1 if train else 0)
    return captured


def qwen2() -> models.Workload:
    return models.qwen2(seed=0, seq_len=8)


def nested() -> models.Workload:
    workload = models.nested(seed=0)
    workload.args = (workload.args[0].requires_grad_(),)
    return workload


# --------------------------------------------------------------------------- soundness checks


def dynamo_origin(node: "torch.fx.Node", dynamo: "torch.fx.GraphModule") -> "torch.fx.Node":
    """The Dynamo node (of the graph or of a HOP body) an ATen node was traced from,
    through ``from_node`` provenance."""
    sources = node.meta.get("from_node")
    assert sources, f"{node.format_node()} has no from_node"
    source = sources[-1]
    while source.from_node:
        source = source.from_node[-1]
    # the Dynamo graph or a HOP body of it (autograd.Function, checkpoint)
    graphs = {id(m.graph): m.graph for m in dynamo.modules() if isinstance(m, torch.fx.GraphModule)}
    assert source.graph_id in graphs, node.format_node()
    origins = [n for n in graphs[source.graph_id].nodes if n.name == source.name]
    assert len(origins) == 1, (node.name, source.name)
    return origins[0]


def assert_aten_forward_keeps_dynamo_hierarchy(captured: Captured) -> int:
    """Every ATen op of the forward graph comes (via from_node) from a Dynamo node, and
    carries exactly that node's call_hierarchy when it has one (RNG-functionalized ops
    included).  Returns the count checked."""
    (dynamo,) = captured.dynamo
    (forward,) = captured.forward
    checked = 0
    for node in forward.graph.nodes:
        if node.op != "call_function":
            continue
        origin = dynamo_origin(node, dynamo)
        if "call_hierarchy" in origin.meta:
            assert node.meta.get("call_hierarchy") == origin.meta["call_hierarchy"], (
                node.format_node(), origin.format_node())
            checked += 1
        else:
            assert "call_hierarchy" not in node.meta, node.format_node()
    return checked


def forward_hierarchies_by_seq_nr(captured: Captured) -> dict[int, set[Any]]:
    by_seq: dict[int, set[Any]] = {}
    for gm in (*captured.forward, *captured.backward):
        for node in gm.graph.nodes:
            if "seq_nr" in node.meta and "call_hierarchy" in node.meta:
                by_seq.setdefault(node.meta["seq_nr"], set()).add(node.meta["call_hierarchy"])
    return by_seq


def assert_backward_has_forward_origins(captured: Captured) -> dict[str, int]:
    """Over the whole backward graph: every op with a forward origin (``seq_nr``) carries
    ``fwd_call_hierarchy`` -- the call_hierarchy of a forward op with the same seq_nr, or for a
    gradient accumulation the common scope of the gradients it sums -- and no call_hierarchy
    of its own, except recomputed forward ops, which keep their own and the recompute tag."""
    (backward,) = captured.backward
    by_seq = forward_hierarchies_by_seq_nr(captured)
    counts = {"formula": 0, "gradient_acc": 0, "recomputed": 0, "recompute_tagged": 0, "matched_seq_nr": 0}
    for node in backward.graph.nodes:
        if node.op != "call_function" or "seq_nr" not in node.meta:
            continue
        meta = node.meta
        if meta.get("recompute") is not None or meta.get("partitioner_tag") == "is_forward":
            # a forward op recomputed in the backward graph (checkpointed region: with a
            # recompute tag; or a cheap op the min-cut partitioner chose to recompute)
            assert "call_hierarchy" in meta and "fwd_call_hierarchy" not in meta, node.format_node()
            assert meta["call_hierarchy"] in by_seq[meta["seq_nr"]], node.format_node()
            counts["recomputed"] += 1
            counts["recompute_tagged"] += meta.get("recompute") is not None
            continue
        assert "fwd_call_hierarchy" in meta, node.format_node()
        if meta.get("is_gradient_acc"):
            summed = [a.meta["fwd_call_hierarchy"] for a in node.all_input_nodes if "fwd_call_hierarchy" in a.meta]
            assert meta["fwd_call_hierarchy"] == common_call_hierarchy(summed), node.format_node()
            counts["gradient_acc"] += 1
            continue
        if "call_hierarchy" not in meta:
            counts["formula"] += 1
        if meta["seq_nr"] in by_seq:
            assert meta["fwd_call_hierarchy"] in by_seq[meta["seq_nr"]], node.format_node()
            counts["matched_seq_nr"] += 1
    return counts


# --------------------------------------------------------------------------- 1. ATen forward (inference)


@pytest.fixture(scope="module")
def qwen2_inference() -> Captured:
    return compile_aot(qwen2(), train=False)


def test_qwen2_aten_inference_golden(qwen2_inference: Captured) -> None:
    assert_golden("aten_inference_qwen2", render(qwen2_inference.forward[0]))


def test_qwen2_aten_inference_keeps_dynamo_hierarchy(qwen2_inference: Captured) -> None:
    (forward,) = qwen2_inference.forward
    ops = [n for n in forward.graph.nodes if n.op == "call_function"]
    assert len(ops) > 150
    assert assert_aten_forward_keeps_dynamo_hierarchy(qwen2_inference) == len(ops)


def test_nested_aten_inference_golden() -> None:
    captured = compile_aot(models.nested(seed=0), train=False)
    assert_aten_forward_keeps_dynamo_hierarchy(captured)
    assert_golden("aten_inference_nested", render(captured.forward[0]))


# --------------------------------------------------------------------------- 2. training: forward + backward


@pytest.fixture(scope="module")
def qwen2_training() -> Captured:
    return compile_aot(qwen2(), train=True)


def test_qwen2_train_forward_golden(qwen2_training: Captured) -> None:
    assert_golden("train_forward_qwen2", render(qwen2_training.forward[0]))


def test_qwen2_train_backward_golden(qwen2_training: Captured) -> None:
    assert_golden("train_backward_qwen2", render_backward(qwen2_training.backward[0]))


def test_qwen2_train_every_aten_forward_node_keeps_dynamo_hierarchy(qwen2_training: Captured) -> None:
    (forward,) = qwen2_training.forward
    ops = [n for n in forward.graph.nodes if n.op == "call_function"]
    assert len(ops) > 150
    assert assert_aten_forward_keeps_dynamo_hierarchy(qwen2_training) == len(ops)


def test_qwen2_train_every_backward_node_has_forward_origin(qwen2_training: Captured) -> None:
    (backward,) = qwen2_training.backward
    ops = [n for n in backward.graph.nodes if n.op == "call_function"]
    # every backward op of this model has a forward origin, so the check below is total
    assert all("seq_nr" in n.meta for n in ops)
    counts = assert_backward_has_forward_origins(qwen2_training)
    assert counts["formula"] + counts["gradient_acc"] + counts["recomputed"] == len(ops) > 250
    assert counts["gradient_acc"] > 0 and counts["recomputed"] == 0  # default partitioner
    assert counts["matched_seq_nr"] > 0.9 * counts["formula"]


def test_qwen2_saved_activations_keep_forward_hierarchy(qwen2_training: Captured) -> None:
    # Placeholders of the backward graph for saved activations share the forward node's meta.
    (forward,) = qwen2_training.forward
    (backward,) = qwen2_training.backward
    fw_nodes = {n.name: n for n in forward.graph.nodes}
    saved = [n for n in backward.graph.nodes if n.op == "placeholder" and n.name in fw_nodes
             and fw_nodes[n.name].op == "call_function"]
    assert len(saved) > 20
    for node in saved:
        assert node.meta.get("call_hierarchy") == fw_nodes[node.name].meta["call_hierarchy"], node.name
        assert "fwd_call_hierarchy" not in node.meta


def clamp_grad(g: "torch.Tensor") -> "torch.Tensor":
    return g.clamp(-1.0, 1.0) * 0.5


class ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: "torch.Tensor") -> "torch.Tensor":
        return x * 2.0

    @staticmethod
    def backward(ctx: Any, grad: "torch.Tensor") -> "torch.Tensor":
        return clamp_grad(grad)


class CustomFunctionModel(nn.Module):
    """A custom autograd.Function (traced backward body) and a tensor used twice
    (gradient accumulation)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.out = nn.Linear(8, 2)

    def forward(self, x: "torch.Tensor") -> "torch.Tensor":
        h = self.proj(x)
        return self.out(ScaleGrad.apply(h) + h.sin())


def test_nested_train_golden() -> None:
    captured = compile_aot(nested(), train=True)
    assert_aten_forward_keeps_dynamo_hierarchy(captured)
    counts = assert_backward_has_forward_origins(captured)
    assert counts["gradient_acc"] > 0
    assert_golden("train_forward_nested", render(captured.forward[0]))
    assert_golden("train_backward_nested", render_backward(captured.backward[0]))


def test_custom_function_backward_golden() -> None:
    torch.manual_seed(0)
    workload = models.Workload(CustomFunctionModel(), (torch.randn(4, 8, requires_grad=True),))
    captured = compile_aot(workload, train=True)
    assert_aten_forward_keeps_dynamo_hierarchy(captured)
    counts = assert_backward_has_forward_origins(captured)
    assert counts["gradient_acc"] == 1
    (backward,) = captured.backward
    # user code of ScaleGrad.backward: its own hierarchy plus the forward origin
    own = [n for n in backward.graph.nodes if n.op == "call_function" and "call_hierarchy" in n.meta]
    assert own and all("fwd_call_hierarchy" in n.meta for n in own)
    assert {fmt(n.meta["call_hierarchy"]) for n in own} == {"ScaleGrad.backward#0 > clamp_grad#0"}
    assert_golden("train_backward_custom_function", render_backward(backward))


def test_custom_function_backward_forward_origin_is_the_function() -> None:
    torch.manual_seed(0)
    workload = models.Workload(CustomFunctionModel(), (torch.randn(4, 8, requires_grad=True),))
    captured = compile_aot(workload, train=True)
    (backward,) = captured.backward
    body = [n for n in backward.graph.nodes if "call_hierarchy" in n.meta and n.op == "call_function"]
    assert body
    for node in body:
        assert fmt(node.meta["fwd_call_hierarchy"]) == "ScaleGrad.forward#0", node.name


class Gated(nn.Module):
    """A ``torch.cond`` between two methods that call ``lin``."""

    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.lin = nn.Linear(dim, dim)

    def positive(self, x: "torch.Tensor") -> "torch.Tensor":
        return self.lin(x).sin()

    def negative(self, x: "torch.Tensor") -> "torch.Tensor":
        return self.lin(x).cos()

    def forward(self, x: "torch.Tensor") -> "torch.Tensor":
        return torch.cond(x.sum() > 0, self.positive, self.negative, (x,)) * 2


class Holder(nn.Module):
    """A root that calls one child module, so that the HOP call is inside ``<attr> (<class>)``."""

    def __init__(self, attr: str, child: nn.Module) -> None:
        super().__init__()
        self.attr = attr
        self.add_module(attr, child)

    def forward(self, x: "torch.Tensor") -> "torch.Tensor":
        return getattr(self, self.attr)(x)


def render_with_subgraphs(gm: "torch.fx.GraphModule", render_one: Callable[["torch.fx.GraphModule"], str]) -> str:
    return "".join(f"--- {name or '<graph>'}\n{render_one(sub)}" for name, sub in gm.named_modules()
                   if isinstance(sub, torch.fx.GraphModule))


def test_cond_backward_golden() -> None:
    """What a ``torch.cond`` branch's backward carries (RFC "Transforms", cond row): each backward
    op the ``fwd_call_hierarchy`` of the branch op it was generated for, matched by the sequence
    numbers of the autograd nodes the recomputed branch creates (patch 0014; before it, every op
    had the cond call's scope), and the forward ops the backward branch recomputes their own
    ``call_hierarchy`` (before: none)."""
    torch.manual_seed(0)
    workload = models.Workload(Holder("gate", Gated()), (torch.randn(4, 8, requires_grad=True),))
    captured = compile_aot(workload, train=True)
    (forward,), (backward,) = captured.forward, captured.backward
    branches = [sub for name, sub in forward.named_modules() if name]
    bw_branches = [sub for name, sub in backward.named_modules() if name]
    assert len(branches) == len(bw_branches) == 2

    def ops(gm: "torch.fx.GraphModule") -> list["torch.fx.Node"]:
        return [n for n in gm.graph.nodes if n.op == "call_function"]

    for method, branch, bw_branch in zip(("positive", "negative"), branches, bw_branches):
        scopes = {fmt(n.meta["call_hierarchy"]) for n in ops(branch)}
        assert scopes == {f"gate (Gated) > Gated.{method}#0", f"gate (Gated) > Gated.{method}#0 > lin (Linear)"}
        origins = {fmt(n.meta["fwd_call_hierarchy"]) for n in ops(bw_branch) if "fwd_call_hierarchy" in n.meta}
        assert origins == scopes, origins
        recomputed = [n for n in ops(bw_branch) if "fwd_call_hierarchy" not in n.meta]
        assert [str(n.target) for n in recomputed] == ["aten.t.default", "aten.addmm.default"]
        assert {fmt(n.meta["call_hierarchy"]) for n in recomputed} == {f"gate (Gated) > Gated.{method}#0 > lin (Linear)"}
    assert_golden("cond_forward", render_with_subgraphs(forward, render))
    assert_golden("cond_backward", render_with_subgraphs(backward, render_backward))


class Recurrent(nn.Module):
    """A ``scan`` over a step that calls ``lin``."""

    def __init__(self, dim: int = 4) -> None:
        super().__init__()
        self.lin = nn.Linear(dim, dim)

    def step(self, h: "torch.Tensor", x: "torch.Tensor") -> tuple["torch.Tensor", "torch.Tensor"]:
        h = self.lin(h).tanh() + x
        return h.clone(), h.sin()

    def forward(self, xs: "torch.Tensor") -> "torch.Tensor":
        from torch._higher_order_ops.scan import scan

        return scan(self.step, torch.zeros(xs.shape[1:]), xs)[1]


@pytest.mark.parametrize("train", [False, True], ids=["inference", "train"])
def test_scan_body_hierarchy(train: bool) -> None:
    """A ``scan`` body (RFC "Transforms", scan row): each op has its own hierarchy, in inference and
    in training, where the body goes through the HOP partitioner (a joint graph, a functionalizing
    retrace, the min-cut split, a retrace of the backward body): backward ops get the body op
    they were generated for (patch 0015; before it, every op had only the scan call's scope)."""
    torch.manual_seed(0)
    workload = models.Workload(Holder("rnn", Recurrent()), (torch.randn(3, 2, 4, requires_grad=train),))
    captured = compile_aot(workload, train=train)

    def body_scopes(gm: "torch.fx.GraphModule", key: str) -> dict[str, set[str]]:
        (body,) = [sub for name, sub in gm.named_modules() if name]
        scopes: dict[str, set[str]] = {}
        for n in body.graph.nodes:
            if n.op == "call_function":
                scopes.setdefault(fmt(n.meta[key]) if key in n.meta else "<absent>", set()).add(str(n.target))
        return scopes

    step, lin = "rnn (Recurrent) > Recurrent.step#0", "rnn (Recurrent) > Recurrent.step#0 > lin (Linear)"
    forward = body_scopes(captured.forward[0], "call_hierarchy")
    assert forward[step] >= {"aten.tanh.default", "aten.add.Tensor", "aten.clone.default", "aten.sin.default"}
    assert "aten.addmm.default" in forward[lin]
    if not train:
        assert set(forward) == {step, lin}
        return
    # the scan's own clone of a carry it saves; the weight's transpose for the backward, which the
    # partitioner moved into the forward body: a backward op, with no call_hierarchy
    assert forward["rnn (Recurrent)"] == {"aten.clone.default"}
    assert set(forward) == {step, lin, "rnn (Recurrent)", "<absent>"}
    assert forward["<absent>"] == {"aten.t_copy.default"}
    backward = body_scopes(captured.backward[0], "fwd_call_hierarchy")
    assert backward[step] >= {"aten.cos.default", "aten.mul.Tensor", "aten.tanh_backward.default"}
    assert backward[lin] >= {"aten.mm.default", "aten.sum.dim_IntList"}
    # the gradient accumulations (of h, and of the additional inputs over the steps): the call's
    assert backward["rnn (Recurrent)"] == {"aten.add.Tensor"}


class Prefix(nn.Module):
    """An ``associative_scan`` (generic mode, as on CPU) of a combine method over ``lin``'s output."""

    def __init__(self, dim: int = 4) -> None:
        super().__init__()
        self.lin = nn.Linear(dim, dim)

    def combine(self, a: "torch.Tensor", b: "torch.Tensor") -> "torch.Tensor":
        return a * b.sigmoid() + b

    def forward(self, x: "torch.Tensor") -> "torch.Tensor":
        from torch._higher_order_ops.associative_scan import associative_scan

        return associative_scan(self.combine, self.lin(x), dim=0, combine_mode="generic")


def test_associative_scan_generic_body_hierarchy() -> None:
    """``associative_scan`` in generic mode (RFC "Transforms", cond/map/while_loop row) is traced
    inline: each call of the combine function is counted, its ops and their backward ops carry it,
    the scan's own slicing and concatenation the call's scope."""
    torch.manual_seed(0)
    workload = models.Workload(Holder("prefix", Prefix()), (torch.randn(5, 4, requires_grad=True),))
    captured = compile_aot(workload, train=True)

    def scopes(gm: "torch.fx.GraphModule", key: str) -> set[str]:
        return {fmt(n.meta[key]) for mod in gm.modules() if isinstance(mod, torch.fx.GraphModule)
                for n in mod.graph.nodes if n.op == "call_function" and key in n.meta}

    combines = {s for s in scopes(captured.forward[0], "call_hierarchy") if "Prefix.combine#" in s}
    assert len(combines) >= 2 and all(s.startswith("prefix (Prefix) > Prefix.combine#") for s in combines)
    assert {"prefix (Prefix)", "prefix (Prefix) > lin (Linear)"} <= scopes(captured.forward[0], "call_hierarchy")
    assert combines <= scopes(captured.backward[0], "fwd_call_hierarchy")


# --------------------------------------------------------------------------- 3. checkpoint + min-cut


class CheckpointedModel(nn.Module):
    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.block = models.Block(dim, graph_break=False)
        self.head = nn.Linear(dim, 4)

    def forward(self, x: "torch.Tensor") -> "torch.Tensor":
        h = torch.utils.checkpoint.checkpoint(self.block, x, use_reentrant=False)
        return self.head(h)


@pytest.fixture(scope="module")
def checkpointed() -> Captured:
    torch.manual_seed(0)
    workload = models.Workload(CheckpointedModel(), (torch.randn(4, 16, requires_grad=True),))
    return compile_aot(workload, train=True, partition_fn=min_cut_rematerialization_partition)


def test_checkpoint_recomputed_nodes_keep_own_hierarchy(checkpointed: Captured) -> None:
    (backward,) = checkpointed.backward
    recomputed = [n for n in backward.graph.nodes if n.meta.get("recompute") is not None]
    assert len(recomputed) >= 5
    for node in recomputed:
        hierarchy = node.meta.get("call_hierarchy")
        assert hierarchy is not None and "fwd_call_hierarchy" not in node.meta, node.format_node()
        # the body runs inside block (Block), called from the checkpoint in the root's forward
        assert fmt(hierarchy).startswith("block (Block)"), fmt(hierarchy)
    counts = assert_backward_has_forward_origins(checkpointed)
    assert counts["recompute_tagged"] == len([n for n in recomputed if n.op == "call_function"])


def test_checkpoint_golden(checkpointed: Captured) -> None:
    assert_aten_forward_keeps_dynamo_hierarchy(checkpointed)
    assert_golden("checkpoint_forward", render(checkpointed.forward[0]))
    assert_golden("checkpoint_backward", render_backward(checkpointed.backward[0]))


@pytest.fixture(scope="module")
def qwen2_checkpointed() -> Captured:
    # Hugging Face's own activation checkpointing: torch.utils.checkpoint(use_reentrant=False)
    # around each decoder layer.
    # Attention dropout makes each layer's SDPA random, so that AOTAutograd functionalizes its RNG for the
    # recomputation (run_and_save_rng_state / run_with_rng_state); with dropout_p=0, torch 2.15 traces no RNG op.
    workload = qwen2()
    for layer in workload.model.model.layers:
        layer.self_attn.attention_dropout = 0.1
    workload.model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    return compile_aot(workload, train=True, partition_fn=min_cut_rematerialization_partition)


def test_qwen2_checkpointed_whole_graphs(qwen2_checkpointed: Captured) -> None:
    (backward,) = qwen2_checkpointed.backward
    checked = assert_aten_forward_keeps_dynamo_hierarchy(qwen2_checkpointed)
    assert checked > 150
    counts = assert_backward_has_forward_origins(qwen2_checkpointed)
    assert counts["recompute_tagged"] > 100 and counts["gradient_acc"] > 0
    # recomputed ops are those of the checkpointed decoder layers, under their own scope
    for node in backward.graph.nodes:
        if node.meta.get("recompute") is not None:
            layers = tuple(f"model (Qwen2Model) > layers.{i} (Qwen2DecoderLayer)" for i in range(2))
            assert fmt(node.meta["call_hierarchy"]).startswith(layers), node.format_node()
    # every backward op has a seq_nr, the RNG-functionalized recomputation included
    assert not [n for n in backward.graph.nodes if n.op == "call_function" and "seq_nr" not in n.meta]


def test_qwen2_checkpointed_rng_nodes_keep_hierarchy(qwen2_checkpointed: Captured) -> None:
    rng_prims = torch._prims.rng_prims
    nodes = [n for gm in (*qwen2_checkpointed.forward, *qwen2_checkpointed.backward) for n in gm.graph.nodes
             if n.target in (rng_prims.run_and_save_rng_state, rng_prims.run_with_rng_state)]
    assert len(nodes) == 4  # SDPA of each checkpointed layer, forward and backward
    for node in nodes:
        assert fmt(node.meta.get("call_hierarchy", ())).endswith(
            "self_attn (Qwen2Attention) > sdpa_attention_forward#0"), node.format_node()
        if node.target is rng_prims.run_with_rng_state:
            assert node.meta.get("recompute") is not None, node.format_node()


# --------------------------------------------------------------------------- 4. Inductor kernels


def compile_inductor_kernels(workload: models.Workload, train: bool = False) -> str:
    """``kernel: common hierarchy (n origins)`` for each kernel of a compile (inference, or
    training: forward kernels then backward kernels, marked ``(bw)``, mapped through the
    origins' ``fwd_call_hierarchy`` -- recomputed forward ops' ``call_hierarchy``).

    Reuses the profiler's mapping (scripts/hierarchy_profiler/inductor.py): Inductor's
    provenance tracking (``trace.provenance_tracking_level=1``) records, at codegen, each
    kernel's origin post-grad node names in ``torch._inductor.debug.
    _inductor_triton_kernel_to_post_grad_node_info`` (fused C++ kernels and extern kernels
    alike), and ``_kernels`` maps them to ``common_call_hierarchy`` of the origins'
    hierarchies in the post-grad graph handed to ``inner_compile``.  ``inductor_config``
    turns that on and the FX graph / AOTAutograd caches off (a hit skips codegen).  The
    dict is read right after ``compile_fx_inner``, while ``compile_fx`` still holds it
    (it is reset per ``compile_fx`` call), in the same order ``_kernels`` iterates it.
    """
    import torch._inductor.debug as inductor_debug
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner

    rows: list[str] = []

    def inner_compile(gm: torch.fx.GraphModule, example_inputs: Any, **kwargs: Any) -> Any:
        # compile_fx resets the provenance dict around the forward compile only; a lazily compiled
        # backward runs outside it and would see what earlier compiles left in the process
        inductor_debug._inductor_triton_kernel_to_post_grad_node_info.clear()
        compiled = compile_fx_inner(gm, example_inputs, **kwargs)
        origins = list(inductor_debug._inductor_triton_kernel_to_post_grad_node_info.values())
        kernels = _kernels(gm, bool(kwargs.get("is_backward")))
        assert len(kernels) == len(origins) > 0
        # every origin is a node of this graph (no stale entries of another compile)
        names_here = {n.name for n in gm.graph.nodes}
        assert all(name in names_here for names in origins for name in names)
        for (kernel, hierarchy), names in zip(kernels, origins):
            rows.append(f"{kernel}: {fmt(hierarchy)} ({len(names)} origins)\n")
        return compiled

    def backend(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        return compile_fx(gm, example_inputs, inner_compile=inner_compile)

    torch._dynamo.reset()
    compiled = torch.compile(workload.model.train(train), backend=backend, fullgraph=True)
    with torch._dynamo.config.patch(record_call_hierarchy=True), inductor_config():
        if train:
            workload.loss_of(compiled(*workload.args, **workload.kwargs)).backward()
        else:
            with torch.no_grad():
                compiled(*workload.args, **workload.kwargs)
    torch._dynamo.reset()
    return "".join(rows)


@pytest.fixture(scope="module")
def qwen2_kernels() -> str:
    return compile_inductor_kernels(qwen2())


def test_inductor_kernels_qwen2_golden(qwen2_kernels: str) -> None:
    assert (
        "extern_kernels.mm: model (Qwen2Model) > layers.1 (Qwen2DecoderLayer) > mlp (Qwen2MLP) > down_proj (Linear)"
        " (1 origins)"
    ) in qwen2_kernels
    assert_golden("inductor_kernels_qwen2", qwen2_kernels)


def test_inductor_kernels_nested_golden() -> None:
    kernels = compile_inductor_kernels(models.nested(seed=0))
    assert "gate#0" in kernels
    assert_golden("inductor_kernels_nested", kernels)


def test_inductor_kernels_nested_train_golden() -> None:
    # the backward is compiled lazily, after compile_fx has reset the provenance dict, so the
    # backward compile sees its own kernels only
    kernels = compile_inductor_kernels(nested(), train=True)
    assert "(bw): layers.0 (Block) > mlp (MLP) > gate#0" in kernels
    assert_golden("inductor_kernels_nested_train", kernels)


def test_inductor_sdpa_kernel_attributed_to_attention(qwen2_kernels: str) -> None:
    for layer in range(2):
        assert (
            "torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default: model (Qwen2Model) > "
            f"layers.{layer} (Qwen2DecoderLayer) > self_attn (Qwen2Attention) > sdpa_attention_forward#0"
        ) in qwen2_kernels


def post_grad_nodes_without_hierarchy(model: nn.Module, args: tuple[Any, ...], dynamic: bool,
                                      frozen: bool = False) -> list[list[str]]:
    """Compile a training step with Inductor (``frozen``: an inference step with ``freezing``) and return, per
    post-grad graph (forward, then backward), its ``call_function`` nodes that carry neither ``call_hierarchy``
    nor ``fwd_call_hierarchy``: what the kernels are made of, so what a profile would show without a scope.
    Read once the compile is done: the passes after the custom post pass (reinplacing, the decompositions of
    auto_functionalized and of scatters) edit the same graph before Inductor lowers it."""
    from torch._inductor.custom_graph_pass import CustomGraphPass

    graphs: list[torch.fx.Graph] = []

    class Record(CustomGraphPass):
        def __call__(self, graph: torch.fx.Graph) -> None:
            graphs.append(graph)

        def uuid(self) -> Any:
            return "record-post-grad-nodes-without-hierarchy"

    torch._dynamo.reset()
    with (torch._dynamo.config.patch(record_call_hierarchy=True), inductor_config(),
          torch._inductor.config.patch(post_grad_custom_post_pass=Record(), freezing=frozen)):
        if frozen:
            with torch.no_grad():
                torch.compile(model.eval(), dynamic=dynamic)(*args)
        else:
            torch.compile(model.train(), dynamic=dynamic)(*args).sum().backward()
    torch._dynamo.reset()
    return [[f"{n.name} {target(n)}" for n in graph.nodes if n.op == "call_function"
             and "call_hierarchy" not in n.meta and "fwd_call_hierarchy" not in n.meta] for graph in graphs]


def test_inductor_post_grad_nodes_of_a_dynamic_shape_training_step_all_carry_a_hierarchy() -> None:
    # With dynamic shapes each RMSNorm's float eps is a graph input, and the ops using it are rewritten by
    # AOTAutograd's tensorify_python_scalars (0021).
    workload = qwen2()
    model = workload.model

    class Logits(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = model

        def forward(self, *args: Any) -> Any:
            return self.inner(*args).logits

    missing = post_grad_nodes_without_hierarchy(Logits(), workload.args, dynamic=True)
    assert len(missing) == 2 and missing == [[], []], missing


def test_inductor_post_grad_nodes_of_a_batchnorm_training_step_all_carry_a_hierarchy() -> None:
    # BatchNorm's running statistics are written back with copy_ nodes traced after the function (0022).
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU())
    missing = post_grad_nodes_without_hierarchy(model, (torch.randn(2, 3, 8, 8),), dynamic=False)
    assert len(missing) == 2 and missing == [[], []], missing


def test_inductor_post_grad_nodes_of_a_frozen_inference_graph_all_carry_a_hierarchy() -> None:
    # Freezing (inference) adds layout nodes to a graph with convolutions: inductor_force_stride_order on each
    # output, on the input of each as_strided (0023).
    torch.manual_seed(0)

    class Restrided(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 3)
            self.lin = nn.Linear(6, 6)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = torch.relu(self.conv(x))
            return self.lin(torch.as_strided(y, (4, 6), (36, 1)) * 2), self.conv(x)

    missing = post_grad_nodes_without_hierarchy(Restrided(), (torch.randn(1, 3, 8, 8),), dynamic=False, frozen=True)
    assert len(missing) == 1 and missing == [[]], missing



def test_inductor_post_grad_nodes_of_a_chunk_filled_buffer_all_carry_a_hierarchy() -> None:
    # Inductor's last post-grad passes rewrite view scatters: a new buffer filled chunk by chunk becomes a slice
    # and a copy_ per chunk, each other scatter (a slice's gradient) a _generalized_scatter, then ops again (0025).
    torch.manual_seed(0)

    class Chunked(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(4, 4)
            self.b = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out = torch.empty(x.shape[0], 8)
            out[:, :4] = self.a(x)
            out[:, 4:] = self.b(x)
            return out[:, 1:] * 2

    missing = post_grad_nodes_without_hierarchy(Chunked(), (torch.randn(2, 4),), dynamic=False)
    assert len(missing) == 2 and missing == [[], []], missing

# --------------------------------------------------------------------------- 5. persistence


def hierarchies(gm: "torch.fx.GraphModule") -> list[tuple[str, Any, Any]]:
    return [(n.name, n.meta.get("call_hierarchy"), n.meta.get("fwd_call_hierarchy")) for n in gm.graph.nodes]


def test_deepcopy_keeps_hierarchies(qwen2_training: Captured) -> None:
    for gm in (*qwen2_training.forward, *qwen2_training.backward):
        before = hierarchies(gm)
        assert sum(h is not None or f is not None for _, h, f in before) > 200
        assert hierarchies(copy.deepcopy(gm)) == before


def test_graph_pickler_round_trip_keeps_hierarchies(qwen2_training: Captured) -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx._graph_pickler import GraphPickler

    for gm in (*qwen2_training.forward, *qwen2_training.backward):
        loaded = GraphPickler.loads(GraphPickler.dumps(gm), FakeTensorMode())
        assert isinstance(loaded, torch.fx.GraphModule)
        assert hierarchies(loaded) == hierarchies(gm)
        for node in loaded.graph.nodes:
            for key in ("call_hierarchy", "fwd_call_hierarchy"):
                for entry in node.meta.get(key, ()):
                    assert isinstance(entry, (call_hierarchy.ModuleCallEntry, call_hierarchy.FunctionCallEntry))


@pytest.fixture(scope="module")
def exported() -> "torch.export.ExportedProgram":
    workload = models.nested(seed=0)
    torch._dynamo.reset()
    with torch._dynamo.config.patch(record_call_hierarchy=True):
        ep = torch.export.export(workload.model, workload.args, strict=True)
    torch._dynamo.reset()
    return ep


def test_export_strict_golden(exported: "torch.export.ExportedProgram") -> None:
    assert_golden("export_strict_nested", render(exported.graph_module))


def test_export_strict_paths_have_no_export_root(exported: "torch.export.ExportedProgram") -> None:
    ops = [n for n in exported.graph.nodes if n.op == "call_function"]
    assert ops and all("call_hierarchy" in n.meta for n in ops)
    # Higher-order op bodies included: strict export traces them in its wrapper's frame too.
    bodies = [m for m in exported.graph_module.modules() if isinstance(m, torch.fx.GraphModule)]
    for node in (node for body in bodies for node in body.graph.nodes):
        for entry in node.meta.get("call_hierarchy", ()):
            assert "_export_root" not in "".join(str(v) for v in entry.values()), (node.name, dict(entry))
    for node in ops:
        # module entries agree with the cleaned nn_module_stack
        modules = [e["path"] for e in node.meta["call_hierarchy"] if e["type"] == "module"]
        stack = [path for path, _cls in node.meta.get("nn_module_stack", {}).values() if path]
        assert modules == stack, node.name


def test_export_strict_cond_branches_have_the_scopes_compile_gives_them() -> None:
    """Strict export traces a cond's branches in its wrapper's frame too: their ops carry the
    scopes torch.compile gives them (``test_cond_backward_golden``), without the wrapper (RFC
    "Export and serde"; before patch 0009 cleaned bodies, ``_export_root (Holder) > gate ...``)."""
    torch.manual_seed(0)
    model = Holder("gate", Gated())
    torch._dynamo.reset()
    with torch._dynamo.config.patch(record_call_hierarchy=True):
        ep = torch.export.export(model, (torch.randn(4, 8),), strict=True)
    torch._dynamo.reset()
    branches = [sub for name, sub in ep.graph_module.named_modules() if name and isinstance(sub, torch.fx.GraphModule)]
    scopes = [{fmt(n.meta["call_hierarchy"]) for n in sub.graph.nodes if n.op == "call_function"} for sub in branches]
    assert scopes == [{f"gate (Gated) > Gated.{method}#0", f"gate (Gated) > Gated.{method}#0 > lin (Linear)"}
                      for method in ("positive", "negative")], scopes


def test_export_save_load_keeps_operator_hierarchies(exported: "torch.export.ExportedProgram") -> None:
    buffer = io.BytesIO()
    torch.export.save(exported, buffer)
    buffer.seek(0)
    loaded = torch.export.load(buffer)
    before = {n.name: n.meta.get("call_hierarchy") for n in exported.graph.nodes if n.op == "call_function"}
    after = {n.name: n.meta.get("call_hierarchy") for n in loaded.graph.nodes if n.op == "call_function"}
    # The archive names a function entry's source file by its basename (no absolute path in a .pt2).
    saved = {name: tuple(dataclasses.replace(e, filename=os.path.basename(e.filename))
                         if isinstance(e, call_hierarchy.FunctionCallEntry) else e for e in h)
             for name, h in before.items()}
    assert after == saved and all(h is not None for h in after.values())
    assert any(isinstance(e, call_hierarchy.FunctionCallEntry) for h in after.values() for e in h)
    # Placeholders (lifted parameters included) carry none, as they carry no nn_module_stack (0017),
    # so nothing is lost where the serialized format keeps metadata of operator nodes only.
    for program in (exported, loaded):
        assert not any("call_hierarchy" in n.meta for n in program.graph.nodes if n.op == "placeholder")


def test_export_run_decompositions_keeps_hierarchies(exported: "torch.export.ExportedProgram") -> None:
    # core-ATen decomposition (linear -> permute + addmm, layer_norm -> native_layer_norm ...):
    # every decomposed op carries the hierarchy of the op it came from.
    decomposed = exported.run_decompositions()
    before = {n.name: n.meta["call_hierarchy"] for n in exported.graph.nodes if n.op == "call_function"}
    ops = [n for n in decomposed.graph.nodes if n.op == "call_function"]
    assert len(ops) > len(before)
    for node in ops:
        source = node.meta["from_node"][-1]
        assert node.meta.get("call_hierarchy") == before[source.name], node.format_node()
    assert_golden("export_strict_nested_decomposed", render(decomposed.graph_module))


def test_export_non_strict_records_what_strict_records(exported: "torch.export.ExportedProgram") -> None:
    # Non-strict export (the default) records with FrameRecorder (0018): on this workload every op
    # has the hierarchy strict export gives it.
    workload = models.nested(seed=0)
    with torch._dynamo.config.patch(record_call_hierarchy=True):
        ep = torch.export.export(workload.model, workload.args)
    strict = [(n.target, n.meta.get("call_hierarchy")) for n in exported.graph.nodes if n.op == "call_function"]
    non_strict = [(n.target, n.meta.get("call_hierarchy")) for n in ep.graph.nodes if n.op == "call_function"]
    assert non_strict == strict and all(h for _, h in strict)



# --------------------------------------------------------------------------- HOP bodies, asserts


def relative_position(q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
    return (q - kv).float() * 0.1


def relative_bias(score: torch.Tensor, b: torch.Tensor, h: torch.Tensor, q: torch.Tensor,
                  kv: torch.Tensor) -> torch.Tensor:
    return score + relative_position(q, kv)


class FlexAttention(nn.Module):
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        from torch.nn.attention.flex_attention import flex_attention

        return flex_attention(q, k, v, score_mod=relative_bias)


class FlexBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = FlexAttention()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.attn(x, x, x)


def dynamo_graphs(fn: Callable[..., Any], *args: Any, dynamic: bool | None = None) -> list["torch.fx.GraphModule"]:
    from torch._dynamo.testing import EagerAndRecordGraphs

    torch._dynamo.reset()
    backend = EagerAndRecordGraphs()
    with torch._dynamo.config.patch(record_call_hierarchy=True, capture_scalar_outputs=True):
        torch.compile(fn, backend=backend, fullgraph=True, dynamic=dynamic)(*args)
    return backend.graphs


def test_flex_attention_bodies_golden() -> None:
    # The score_mod body is traced into a HOP subgraph: its ops carry the scope of the
    # flex_attention call (attn) followed by the body's own user functions.
    (gm,) = dynamo_graphs(FlexBlock(), torch.randn(1, 2, 8, 4))
    blocks = [f"== {name or 'graph'}\n{render(mod)}" for name, mod in gm.named_modules()
              if isinstance(mod, torch.fx.GraphModule)]
    assert_golden("flex_attention_dynamo", "".join(blocks))
    body = gm.get_submodule("score_mod_0")
    ops = {n.name: fmt(n.meta["call_hierarchy"]) for n in body.graph.nodes if n.op.startswith("call")}
    assert ops["sub"] == "attn (FlexAttention) > relative_bias#0 > relative_position#0"
    assert ops["add"] == "attn (FlexAttention) > relative_bias#0"


def checked_length(n: torch.Tensor) -> int:
    k = n.item()
    torch._check(k >= 1)
    return k


def test_torch_check_assert_nodes_carry_the_scope_of_the_check() -> None:
    # torch._check on an unbacked value: Dynamo emits the comparison and _assert_scalar
    # into the graph itself, in the scope of the function that wrote the check.
    (gm,) = dynamo_graphs(lambda x, n: x[: checked_length(n)].cos(), torch.randn(3, 4), torch.tensor(2))
    by_target = {target(n): fmt(n.meta["call_hierarchy"]) for n in gm.graph.nodes if n.op == "call_function"}
    assert by_target["aten._assert_scalar.default"] == "checked_length#0"
    assert by_target["ge"] == "checked_length#0"
    assert by_target["getitem"] == "<root>"



def scaled_by_rows(x: torch.Tensor) -> torch.Tensor:
    return x * x.size(0)


class DynamicRows(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return scaled_by_rows(self.lin(x)).reshape(x.size(0) * 2, 2)


def test_symbolic_size_nodes_carry_the_scope_they_are_computed_in() -> None:
    # dynamic=True: the SymInt placeholder of x's size follows x (first used in lin);
    # arithmetic on sizes is a node of the scope that computes it.
    (gm,) = dynamo_graphs(DynamicRows(), torch.randn(3, 4), dynamic=True)
    nodes = list(gm.graph.nodes)
    symbols = [n for n in nodes if n.op == "placeholder" and isinstance(n.meta["example_value"], torch.SymInt)]
    assert len(symbols) == 1 and fmt(symbols[0].meta["call_hierarchy"]) == "lin (Linear)"
    size_math = [n for n in nodes if n.op == "call_function" and n.target is operator.mul
                 and not isinstance(n.meta["example_value"], torch.Tensor)]
    assert [fmt(n.meta["call_hierarchy"]) for n in size_math] == ["<root>"]
    scaled = [n for n in nodes if n.op == "call_function" and n.target is operator.mul
              and isinstance(n.meta["example_value"], torch.Tensor)]
    assert [fmt(n.meta["call_hierarchy"]) for n in scaled] == ["scaled_by_rows#0"]


# --------------------------------------------------------------------------- golden hygiene


def test_golden_files_are_deterministic_text() -> None:
    files = sorted(GOLDEN_DIR.glob("*.txt"))
    assert files
    for path in files:
        text = path.read_text()
        assert "0x" not in text and "\\" not in text and "/work" not in text and "/tmp" not in text, path
        assert "graph_id" not in text, path
