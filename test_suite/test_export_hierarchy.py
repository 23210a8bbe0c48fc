"""call_hierarchy in torch.export on real third-party models (Hugging Face, tiny configs, random weights).

Needs the patched torch (``.venv``). For each family, the model is exported strict (Dynamo) and non-strict
(the default: make_fx runs the model's code), with recording on, and checked for what issue 28 asks:

- every node that has an ``nn_module_stack`` has a ``call_hierarchy`` whose module entries are that stack;
- the two modes agree: ops that correspond (the two op sequences aligned by target) and have the same
  ``nn_module_stack`` have the same ``call_hierarchy``, unless strict export's says its scope is not known;
- ``torch.export.save``/``load`` of the non-strict program keeps every hierarchy;
- with the flag off, non-strict export records nothing and exports the same program.
- with a dynamic dimension (six of the families), every op has a ``call_hierarchy``: the nodes export makes
  from the inputs alone, which have no module stack, say that their scope below the root is not known.
"""

from __future__ import annotations

import difflib
import io
from typing import Any, Callable

import pytest

import torch
import torch.fx.call_hierarchy as call_hierarchy  # the patched torch: fail, never skip, without it
import transformers

VOCAB = 64


def _ids() -> tuple[Any, ...]:
    return (torch.randint(0, VOCAB, (1, 8)),)


def _llama() -> tuple[Any, tuple[Any, ...]]:
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, use_cache=False)
    return transformers.LlamaForCausalLM(config), _ids()


def _qwen3() -> tuple[Any, tuple[Any, ...]]:
    config = transformers.Qwen3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, use_cache=False)
    return transformers.Qwen3ForCausalLM(config), _ids()


def _gpt2() -> tuple[Any, tuple[Any, ...]]:
    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=2,
                                     use_cache=False, bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(config), _ids()


def _bert() -> tuple[Any, tuple[Any, ...]]:
    config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=64)
    return transformers.BertModel(config), _ids()


def _vit() -> tuple[Any, tuple[Any, ...]]:
    config = transformers.ViTConfig(image_size=16, patch_size=8, hidden_size=32, num_hidden_layers=2,
                                    num_attention_heads=2, intermediate_size=64)
    return transformers.ViTModel(config), (torch.randn(1, 3, 16, 16),)


def _mixtral() -> tuple[Any, tuple[Any, ...]]:
    """A sparse mixture of experts: tokens routed to the top 2 of 4 experts."""
    config = transformers.MixtralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                        use_cache=False)
    return transformers.MixtralForCausalLM(config), _ids()


def _bart() -> tuple[Any, tuple[Any, ...]]:
    """An encoder-decoder: the decoder's inputs are the encoder's shifted right, cross-attention."""
    config = transformers.BartConfig(vocab_size=VOCAB, d_model=32, encoder_layers=1, decoder_layers=1,
                                     encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=64,
                                     decoder_ffn_dim=64, max_position_embeddings=32, use_cache=False)
    return transformers.BartModel(config), _ids()


def _deberta_v2() -> tuple[Any, tuple[Any, ...]]:
    """Disentangled relative-position attention (position-to-content and content-to-position)."""
    config = transformers.DebertaV2Config(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                                          num_attention_heads=2, intermediate_size=64, relative_attention=True,
                                          pos_att_type=["p2c", "c2p"], max_position_embeddings=32)
    return transformers.DebertaV2Model(config), _ids()


def _t5_encoder() -> tuple[Any, tuple[Any, ...]]:
    """Relative position buckets computed in the first layer's attention and shared by the others."""
    config = transformers.T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                                   use_cache=False)
    return transformers.T5EncoderModel(config), _ids()


def _falcon() -> tuple[Any, tuple[Any, ...]]:
    """Attention and MLP in parallel from one layer norm, a fused query-key-value projection."""
    config = transformers.FalconConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                       use_cache=False)
    return transformers.FalconForCausalLM(config), _ids()


def _swin() -> tuple[Any, tuple[Any, ...]]:
    """Shifted-window attention: windows partitioned, rolled and merged back by helper functions."""
    config = transformers.SwinConfig(image_size=32, patch_size=8, embed_dim=16, depths=[1, 1], num_heads=[2, 4],
                                     window_size=2)
    return transformers.SwinModel(config), (torch.randn(1, 3, 32, 32),)


def _segformer() -> tuple[Any, tuple[Any, ...]]:
    """Overlapping convolutional patch embeddings, attention over spatially reduced keys and values."""
    config = transformers.SegformerConfig(num_encoder_blocks=2, depths=[1, 1], sr_ratios=[2, 1], hidden_sizes=[16, 32],
                                          num_attention_heads=[1, 2], patch_sizes=[7, 3], strides=[4, 2],
                                          mlp_ratios=[2, 2], decoder_hidden_size=32)
    return transformers.SegformerModel(config), (torch.randn(1, 3, 32, 32),)


FAMILIES: dict[str, Callable[[], tuple[Any, tuple[Any, ...]]]] = {
    "llama": _llama, "qwen3": _qwen3, "gpt2": _gpt2, "bert": _bert, "vit": _vit,
    "mixtral": _mixtral, "bart": _bart, "deberta_v2": _deberta_v2,
    "t5_encoder": _t5_encoder, "falcon": _falcon, "swin": _swin, "segformer": _segformer,
}


# The nn_module_stack export's metadata hook gives a node none of whose arguments has one.
EMPTY_NN_MODULE_STACK = "_empty_nn_module_stack_from_metadata_hook"


def module_chain(node: torch.fx.Node) -> list[str]:
    """The module paths of an exported node's nn_module_stack, without the root ("")."""
    return [path for path, _ in node.meta["nn_module_stack"].values() if path]


def hierarchy_chain(node: torch.fx.Node) -> list[str]:
    return [e.path for e in node.meta["call_hierarchy"] if isinstance(e, call_hierarchy.ModuleCallEntry)]


def label(node: torch.fx.Node) -> str:
    return call_hierarchy.format_call_hierarchy(node.meta["call_hierarchy"]) or "<root>"


def is_grad_mode_wrapper(node: torch.fx.Node) -> bool:
    """A ``wrap_with_set_grad_enabled`` call or the ``get_attr`` of its body. Strict export gives it the root's
    nn_module_stack (Dynamo gives the grad mode switch it replaces none); its call_hierarchy names the scope that
    switched, as non-strict export's nn_module_stack does (RFC.md, Invariant (0017))."""
    call = next(iter(node.users), None) if node.op == "get_attr" else node
    return call is not None and call.target is torch.ops.higher_order.wrap_with_set_grad_enabled


def ops(ep: torch.export.ExportedProgram) -> list[torch.fx.Node]:
    return [n for n in ep.graph.nodes if n.op == "call_function"]


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def exported(request: pytest.FixtureRequest) -> dict[str, Any]:
    torch.manual_seed(0)
    model, args = FAMILIES[request.param]()
    model.eval()
    programs = {}
    with torch._dynamo.config.patch(record_call_hierarchy=True):
        for mode in ("strict", "non_strict"):
            torch._dynamo.reset()
            programs[mode] = torch.export.export(model, args, strict=mode == "strict")
    torch._dynamo.reset()
    programs["non_strict_off"] = torch.export.export(model, args, strict=False)
    return programs


@pytest.mark.parametrize("mode", ["strict", "non_strict"])
def test_every_node_with_nn_module_stack_has_the_same_modules_in_call_hierarchy(exported: dict[str, Any],
                                                                              mode: str) -> None:
    checked = 0
    for mod in exported[mode].graph_module.modules():
        if not isinstance(mod, torch.fx.GraphModule):
            continue
        for node in mod.graph.nodes:
            if "nn_module_stack" not in node.meta:
                continue
            assert "call_hierarchy" in node.meta, node.format_node()
            if mode == "strict" and not module_chain(node) and is_grad_mode_wrapper(node):
                continue  # test_grad_mode_wrappers_have_the_same_hierarchy_in_both_modes
            assert hierarchy_chain(node) == module_chain(node), node.format_node()
            checked += 1
    assert checked > 50


def test_grad_mode_wrappers_have_the_same_hierarchy_in_both_modes(exported: dict[str, Any]) -> None:
    def wrappers(ep: torch.export.ExportedProgram) -> list[str]:
        return [label(n) for n in ep.graph.nodes if n.op in ("call_function", "get_attr") and is_grad_mode_wrapper(n)]

    assert wrappers(exported["strict"]) == wrappers(exported["non_strict"])


def test_strict_and_non_strict_agree(exported: dict[str, Any]) -> None:
    strict, non_strict = ops(exported["strict"]), ops(exported["non_strict"])
    matcher = difflib.SequenceMatcher(None, [str(n.target) for n in strict], [str(n.target) for n in non_strict],
                                      autojunk=False)
    pairs = [pair for i, j, size in matcher.get_matching_blocks()
             for pair in zip(strict[i:i + size], non_strict[j:j + size])]
    # The modes decompose alike: a few nodes are one mode's own (inserted checks, views).
    assert len(pairs) >= 0.9 * min(len(strict), len(non_strict))
    compared, differing = 0, []
    for a, b in pairs:
        if module_chain(a) != module_chain(b):
            continue
        if any(e["type"] == "unknown_frames" for e in a.meta["call_hierarchy"]):
            continue
        compared += 1
        if label(a) != label(b):
            differing.append(f"{a.target}: strict {label(a)!r}, non-strict {label(b)!r}")
    assert not differing, "\n".join(differing[:20])
    assert compared >= 0.9 * len(pairs)


def test_non_strict_save_and_load_keep_every_hierarchy(exported: dict[str, Any]) -> None:
    ep = exported["non_strict"]
    buffer = io.BytesIO()
    torch.export.save(ep, buffer)
    buffer.seek(0)
    loaded = torch.export.load(buffer)
    assert [label(n) for n in ops(loaded)] == [label(n) for n in ops(ep)]
    assert any(n.meta["call_hierarchy"] for n in ops(ep))


def test_non_strict_flag_off_records_nothing_and_exports_the_same_program(exported: dict[str, Any]) -> None:
    on, off = exported["non_strict"], exported["non_strict_off"]
    assert off.graph_module.code == on.graph_module.code
    assert off.graph_signature == on.graph_signature
    assert not any("call_hierarchy" in n.meta for m in off.graph_module.modules()
                   if isinstance(m, torch.fx.GraphModule) for n in m.graph.nodes)


def _dynamic(args: tuple[Any, ...]) -> tuple[tuple[Any, ...], tuple[dict[int, Any], ...]]:
    """The arguments, each with a dynamic dimension: the token ids' sequence, the images' batch (of 2: export
    specializes a dimension of size 1)."""
    if args[0].dtype == torch.long:
        return args, ({1: torch.export.Dim.AUTO},)
    return (torch.cat([args[0]] * 2),), ({0: torch.export.Dim.AUTO},)


@pytest.mark.parametrize("family", ["llama", "gpt2", "bert", "deberta_v2", "bart", "vit"])
@pytest.mark.parametrize("mode", ["strict", "non_strict"])
def test_dynamic_shapes_every_op_has_a_call_hierarchy(family: str, mode: str) -> None:
    """With a dynamic dimension, export also makes nodes from the inputs alone (their sizes), to which its metadata
    hook gives an empty module stack: they say their scope below the root is not known; every other node's
    module entries are its nn_module_stack."""
    torch.manual_seed(0)
    model, args = FAMILIES[family]()
    args, shapes = _dynamic(args)
    torch._dynamo.reset()
    with torch._dynamo.config.patch(record_call_hierarchy=True):
        ep = torch.export.export(model.eval(), args, dynamic_shapes=shapes, strict=mode == "strict")
    made_for_inputs = 0
    for node in ep.graph.nodes:
        if node.op != "call_function":
            continue
        assert "call_hierarchy" in node.meta, node.format_node()
        if EMPTY_NN_MODULE_STACK in node.meta["nn_module_stack"]:
            assert node.meta["call_hierarchy"] == (call_hierarchy.UnknownFramesEntry(),), node.format_node()
            made_for_inputs += 1
        elif not (mode == "strict" and not module_chain(node) and is_grad_mode_wrapper(node)):
            assert hierarchy_chain(node) == module_chain(node), node.format_node()
    assert made_for_inputs > 0


def test_a_module_in_a_global_of_a_python_module_is_named_by_that_module() -> None:
    """RoBERTa's LM head calls `gelu`, a module held in a global of its Python module: Dynamo reads it through
    its alias of that module (`__import_transformers_dot_models_...`), and strict export names it by the module,
    as Python does; non-strict export, whose nn_module_stack has no entry for it, records its `forward` as a
    function call."""
    torch.manual_seed(0)
    config = transformers.RobertaConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                        intermediate_size=64, max_position_embeddings=32)
    model = transformers.RobertaForMaskedLM(config).eval()
    labels = {}
    with torch._dynamo.config.patch(record_call_hierarchy=True):
        for strict in (True, False):
            torch._dynamo.reset()
            ep = torch.export.export(model, _ids(), strict=strict)
            labels[strict] = {label(n) for n in ops(ep) if label(n).startswith("lm_head (RobertaLMHead) > ")}
    torch._dynamo.reset()
    assert "lm_head (RobertaLMHead) > transformers.models.roberta.modeling_roberta.gelu (GELUActivation)" in labels[True]
    assert not any("__import_" in text for text in labels[True]), labels[True]
    assert "lm_head (RobertaLMHead) > GELUActivation.forward#0" in labels[False]
