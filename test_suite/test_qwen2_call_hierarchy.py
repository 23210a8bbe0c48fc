"""Golden call hierarchies of a real third-party model: Hugging Face Qwen2 (tiny config, random weights).

Needs the patched torch (``.venv``).  The golden file lists one line per node of the
Dynamo graph (fullgraph, inference, no_grad): ``node_name: <format_call_hierarchy>``.
Regenerate it with ``EXPECTTEST_ACCEPT=1 .venv/bin/python -m pytest test_suite/test_qwen2_call_hierarchy.py``;
without that variable a difference fails the test and the file is left alone.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from test_suite.golden import assert_golden

import torch
import torch.fx.call_hierarchy as call_hierarchy  # the patched torch: fail, never skip, without it
import transformers

GOLDEN = Path(__file__).parent / "golden" / "qwen2_dynamo_graph.txt"
SCHEMA_GOLDEN = Path(__file__).parent / "golden" / "qwen2_schema_example.json"
NUM_LAYERS = 2
DISPATCH_NAMES = {"wrapper", "forward", "_call_impl", "_wrapped_call_impl", "__call__"}


def tiny_qwen2() -> "torch.nn.Module":
    torch.manual_seed(0)
    config = transformers.Qwen2Config(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=NUM_LAYERS,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )
    return transformers.Qwen2ForCausalLM(config).eval()


@pytest.fixture(scope="module")
def graph() -> "torch.fx.Graph":
    graphs: list[torch.fx.GraphModule] = []

    def capture(gm: torch.fx.GraphModule, example_inputs: list[object]) -> torch.fx.GraphModule:
        graphs.append(gm)
        return gm

    model = tiny_qwen2()
    input_ids = torch.randint(0, 128, (1, 8))
    torch._dynamo.reset()
    with torch._dynamo.config.patch(record_call_hierarchy=True), torch.no_grad():
        torch.compile(model, backend=capture, fullgraph=True)(input_ids, use_cache=False)
    torch._dynamo.reset()
    assert len(graphs) == 1
    return graphs[0].graph


def render(node: "torch.fx.Node") -> str:
    if "call_hierarchy" not in node.meta:
        return f"{node.name}: <not recorded>"
    hierarchy = node.meta["call_hierarchy"]
    return f"{node.name}: {call_hierarchy.format_call_hierarchy(hierarchy) if hierarchy else '()'}"


def test_golden(graph: "torch.fx.Graph") -> None:
    assert_golden(GOLDEN, "".join(render(node) + "\n" for node in graph.nodes))


def test_schema_example_golden(graph: "torch.fx.Graph") -> None:
    """The full entries of one node (RFC.md's schema example) and the graph's root record."""
    (node,) = [n for n in graph.nodes if n.name == "x1_1"]  # rotate_half#1 in layers.0

    def portable(entry: dict[str, object]) -> dict[str, object]:
        if isinstance(entry.get("filename"), str):
            entry["filename"] = str(entry["filename"]).rpartition("site-packages/")[2]
        return entry

    example = {
        "node": node.name,
        "call_hierarchy": [portable(dict(entry)) for entry in node.meta["call_hierarchy"]],
        "graph_meta_call_hierarchy_root": portable(dict(graph.owning_module.meta["call_hierarchy_root"])),
    }
    assert_golden(SCHEMA_GOLDEN, json.dumps(example, indent=2) + "\n")


def test_golden_is_deterministic_text() -> None:
    text = GOLDEN.read_text()
    assert "0x" not in text and "/" not in text and "\\" not in text


def module_stack_paths(node: "torch.fx.Node") -> list[str]:
    paths = []
    for path, _cls in node.meta.get("nn_module_stack", {}).values():
        assert path.startswith("L['self']"), path
        paths.append(path[len("L['self']"):].lstrip("."))
    return paths


def test_module_entries_agree_with_nn_module_stack(graph: "torch.fx.Graph") -> None:
    nodes = [n for n in graph.nodes if n.op in ("call_function", "call_method")]
    assert len(nodes) > 100
    for node in nodes:
        assert "call_hierarchy" in node.meta, node.name
        modules = [e["path"] for e in node.meta["call_hierarchy"] if e["type"] == "module"]
        assert modules == module_stack_paths(node), node.name


def test_no_dispatch_or_decorator_entries(graph: "torch.fx.Graph") -> None:
    for node in graph.nodes:
        for entry in node.meta.get("call_hierarchy", ()):
            if entry["type"] == "function":
                assert entry["name"] not in DISPATCH_NAMES, (node.name, dict(entry))
                assert entry["qualname"].rpartition(".")[2] not in DISPATCH_NAMES, (node.name, dict(entry))


def test_modules_are_not_duplicated(graph: "torch.fx.Graph") -> None:
    for node in graph.nodes:
        paths = [e["path"] for e in node.meta.get("call_hierarchy", ()) if e["type"] == "module"]
        assert len(paths) == len(set(paths)), node.name


@pytest.mark.parametrize("layer", range(NUM_LAYERS))
def test_rotate_half_inside_apply_rotary_pos_emb(graph: "torch.fx.Graph", layer: int) -> None:
    prefix = (
        f"model (Qwen2Model) > layers.{layer} (Qwen2DecoderLayer) > self_attn (Qwen2Attention) "
        "> apply_rotary_pos_emb#0"
    )
    scopes = {
        call_hierarchy.format_call_hierarchy(n.meta["call_hierarchy"])
        for n in graph.nodes if n.op == "call_function"
    }
    assert prefix in scopes
    assert f"{prefix} > rotate_half#0" in scopes
    assert f"{prefix} > rotate_half#1" in scopes
    assert not any(s.startswith(f"{prefix} > rotate_half#2") for s in scopes)
