"""call_hierarchy under torch.compile on more Hugging Face families (tiny configs, random weights).

Needs the patched torch (``.venv``). The benchmark's families (Llama, Qwen2/3, Gemma, Qwen3-MoE, BERT, ViT,
GPT-2) and the export families (``test_export_hierarchy.py``) are covered elsewhere; these are others whose
code takes other paths through Dynamo and AOTAutograd: sliding-window and soft-capped attention (Mistral,
Gemma2), partial rotary embeddings (Phi3, GPT-NeoX), learned positions (OPT, CLIP), an encoder-decoder with cross-attention and a relative position bias
computed once and passed down each stack (T5), convolutions and
normalization layers (ConvNeXt, ResNet), a selective scan with ``associative_scan`` (Mamba). Each family is
compiled as a training step, shapes dynamic after a recompile for a second input shape (the way a user's
second batch arrives), through AOTAutograd (``aot_eager``'s graphs, kept), with the flag off and on:

- the flag compiles the same program: the same Dynamo, forward and backward graphs (code), the same loss;
- with the flag off no node carries a hierarchy key;
- with it on, every op of a Dynamo graph has a ``call_hierarchy``, whose module entries are its
  ``nn_module_stack`` where it has one; every op of an AOTAutograd graph has ``call_hierarchy`` or ``fwd_call_hierarchy``
  (backward ops, and the backward's size computations the partitioner moves into the forward graph).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import pytest

import torch
import torch._dynamo
import torch.fx.call_hierarchy  # noqa: F401  (the patched torch: fail, never skip, without it)
import transformers
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd

VOCAB = 64
HIERARCHY_KEYS = ("call_hierarchy", "fwd_call_hierarchy")


def _ids(length: int) -> dict[str, torch.Tensor]:
    return {"input_ids": torch.randint(0, VOCAB, (2, length))}


def _seq2seq_ids(length: int) -> dict[str, torch.Tensor]:
    return {"input_ids": torch.randint(0, VOCAB, (2, length)),
            "decoder_input_ids": torch.randint(0, VOCAB, (2, length // 2 + 1))}


def _images(batch: int) -> dict[str, torch.Tensor]:
    return {"pixel_values": torch.randn(batch, 3, 32, 32)}


def _decoder(model_class: Callable[..., Any], config: Any) -> tuple[Any, Callable[[int], dict[str, torch.Tensor]]]:
    return model_class(config), _ids


FAMILIES: dict[str, Callable[[], tuple[Any, Callable[[int], dict[str, torch.Tensor]]]]] = {
    "mistral": lambda: _decoder(transformers.MistralForCausalLM, transformers.MistralConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, sliding_window=4)),
    "gemma2": lambda: _decoder(transformers.Gemma2ForCausalLM, transformers.Gemma2Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=64)),
    "phi3": lambda: _decoder(transformers.Phi3ForCausalLM, transformers.Phi3Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0, eos_token_id=1, bos_token_id=1)),
    "gpt_neox": lambda: _decoder(transformers.GPTNeoXForCausalLM, transformers.GPTNeoXConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=64, rotary_pct=0.5)),
    "opt": lambda: _decoder(transformers.OPTForCausalLM, transformers.OPTConfig(
        vocab_size=VOCAB, hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=64, word_embed_proj_dim=32)),
    "clip_text": lambda: _decoder(transformers.CLIPTextModel, transformers.CLIPTextConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        max_position_embeddings=64)),
    "t5": lambda: (transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, decoder_start_token_id=0)),
        _seq2seq_ids),
    "mamba": lambda: _decoder(transformers.MambaForCausalLM, transformers.MambaConfig(
        vocab_size=VOCAB, hidden_size=32, state_size=4, num_hidden_layers=2, expand=2, conv_kernel=4)),
    "convnext": lambda: (transformers.ConvNextForImageClassification(transformers.ConvNextConfig(
        num_channels=3, num_stages=2, hidden_sizes=[8, 16], depths=[1, 1], num_labels=4)), _images),
    "resnet": lambda: (transformers.ResNetForImageClassification(transformers.ResNetConfig(
        num_channels=3, embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], num_labels=4)), _images),
}

# The two inputs of each step: the second shape makes Dynamo recompile with dynamic sizes.
SHAPES = {"_ids": (8, 12), "_seq2seq_ids": (8, 12), "_images": (2, 3)}


def loss_of(output: Any) -> torch.Tensor:
    tensor = output.logits if getattr(output, "logits", None) is not None else output.last_hidden_state
    return tensor.float().pow(2).mean()


def compile_steps(family: str, record: bool) -> dict[str, Any]:
    """A fresh model of the family (seeded), a training step per input shape, compiled with the flag
    ``record``: the graphs in the order they were compiled, as ``(kind, GraphModule)``, and the losses."""
    torch.manual_seed(0)
    model, make_inputs = FAMILIES[family]()
    model.train()
    graphs: list[tuple[str, torch.fx.GraphModule]] = []

    def keep(kind: str) -> Callable[..., Any]:
        def compiler(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
            graphs.append((kind, gm))
            return make_boxed_func(gm.forward)
        return compiler

    lower = aot_autograd(fw_compiler=keep("forward"), bw_compiler=keep("backward"))

    def backend(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        graphs.append(("dynamo", gm))
        return lower(gm, example_inputs)

    torch._dynamo.reset()
    losses = []
    with torch._dynamo.config.patch(record_call_hierarchy=record):
        compiled = torch.compile(model, backend=backend)
        for size in SHAPES[make_inputs.__name__]:
            torch.manual_seed(1)
            loss = loss_of(compiled(**make_inputs(size)))
            loss.backward()
            losses.append(loss.detach())
    torch._dynamo.reset()
    return {"graphs": graphs, "losses": losses}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def compiled(request: pytest.FixtureRequest) -> dict[str, Any]:
    return {"family": request.param, "off": compile_steps(request.param, False),
            "on": compile_steps(request.param, True)}


def ops(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    return [n for n in gm.graph.nodes if n.op in ("call_function", "call_method")]


def module_paths_of_stack(node: torch.fx.Node) -> list[str]:
    """The module paths of a Dynamo node's ``nn_module_stack`` as call_hierarchy writes them:
    ``L['self'].model.layers[0]`` is ``model.layers.0``."""
    paths = []
    for source_name, _ in node.meta.get("nn_module_stack", {}).values():
        path = re.sub(r"^L\['self'\]\.?", "", source_name)
        path = re.sub(r"\[(\d+)\]", r".\1", path)
        path = re.sub(r"\[['\"]([^'\"]+)['\"]\]", r".\1", path)
        paths.append(path)
    return paths


def test_the_flag_compiles_the_same_program(compiled: dict[str, Any]) -> None:
    off, on = compiled["off"], compiled["on"]
    assert [kind for kind, _ in on["graphs"]] == [kind for kind, _ in off["graphs"]]
    assert [kind for kind, _ in on["graphs"]].count("dynamo") == 2, "the second shape recompiles"
    for (kind, a), (_, b) in zip(off["graphs"], on["graphs"]):
        assert b.code == a.code, f"{compiled['family']}: a {kind} graph differs with the flag on"
    assert all(torch.equal(a, b) for a, b in zip(off["losses"], on["losses"]))


def test_flag_off_records_nothing(compiled: dict[str, Any]) -> None:
    for kind, gm in compiled["off"]["graphs"]:
        assert not any(key in n.meta for n in gm.graph.nodes for key in HIERARCHY_KEYS), kind
        assert "call_hierarchy_root" not in gm.meta


def test_every_dynamo_op_has_a_call_hierarchy_whose_modules_are_its_nn_module_stack(
        compiled: dict[str, Any]) -> None:
    checked = 0
    for kind, gm in compiled["on"]["graphs"]:
        if kind != "dynamo":
            continue
        for n in ops(gm):
            assert "call_hierarchy" in n.meta, n.format_node()
            if "nn_module_stack" not in n.meta:
                # A grad mode switch: Dynamo records no module stack for it (RFC.md, "Invariant (0017)").
                continue
            modules = [e.path for e in n.meta["call_hierarchy"] if e["type"] == "module"]
            assert modules == module_paths_of_stack(n), n.format_node()
            checked += 1
    assert checked > 40


def test_every_aot_op_has_a_hierarchy(compiled: dict[str, Any]) -> None:
    for kind, gm in compiled["on"]["graphs"]:
        if kind == "dynamo":
            continue
        missing = [n.format_node() for n in ops(gm) if not any(key in n.meta for key in HIERARCHY_KEYS)]
        assert not missing, f"{kind}: {missing[:5]}"
        if kind == "forward":
            # A forward graph's own ops carry call_hierarchy; fwd_call_hierarchy alone only the backward's
            # size computations the partitioner places in it.
            alone = [n for n in ops(gm) if "call_hierarchy" not in n.meta]
            assert all(n.meta.get("autograd_backward") for n in alone), [n.format_node() for n in alone]
