"""Tests of the call-hierarchy profiler (scripts.profile_hierarchy); need the patched torch (.venv)."""

from __future__ import annotations

import json
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest

import torch  # noqa: E402
import torch.fx.call_hierarchy  # noqa: E402,F401  (the patched torch: fail, never skip)

from scripts.hierarchy_profiler import models  # noqa: E402
from scripts.hierarchy_profiler.cli import main  # noqa: E402
from scripts.hierarchy_profiler.session import Options, Result, run  # noqa: E402
from scripts.hierarchy_profiler.tree import Scope, build_tree  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
EPS_US = 0.002  # the trace rounds times to 1 ns


def profile(model: str, **options: Any) -> tuple[Result, Scope]:
    result = run(models.build(model), Options(**options))
    return result, build_tree(result.iterations)


def scope_at(root: Scope, *labels: str) -> Scope:
    node = root
    for label in labels:
        node = node.children[label]
    return node


def counts_by_path(root: Scope) -> dict[tuple[str, ...], int]:
    out: dict[tuple[str, ...], int] = {}

    def visit(node: Scope, path: tuple[str, ...]) -> None:
        out[path] = node.total_count
        for child in node.children.values():
            visit(child, path + (child.label,))

    visit(root, ())
    return out


@pytest.mark.parametrize("train", [False, True], ids=["inference", "train"])
def test_tree_totals_equal_graph_nodes(train: bool) -> None:
    result, root = profile("nested", train=train, fullgraph=True)
    graphs = result.recorder.graphs
    assert [g.kind for g in graphs] == (["forward", "backward"] if train else ["inference"])
    assert root.total_count == sum(g.num_ops for g in graphs) > 0
    for _, node in root.walk():
        assert node.total_count == node.self_count + sum(c.total_count for c in node.children.values())
    layer = scope_at(root, "layers.0 (Block)")
    assert set(layer.children) == {"norm (LayerNorm)", "scaled_tanh#0", "mlp (MLP)"}
    assert set(scope_at(layer, "mlp (MLP)", "gate#0").children) == {"scaled_tanh#0"}
    backward_ops = [op for _, n in root.walk() for op in n.ops if op.endswith(" (bw)")]
    assert bool(backward_ops) == train
    if train:  # backward ops sit under their forward origin
        assert any(op.endswith("(bw)") for op in scope_at(layer, "mlp (MLP)", "up (Linear)").ops)


def test_graph_break_per_layer_totals_match_fullgraph() -> None:
    full_result, full = profile("nested", train=True, fullgraph=True)
    broken_result, broken = profile("nested-graph-break", train=True)
    # the layer graphs are compiled once (before and after the break) and shared by both layers
    assert broken_result.recorder.num_dynamo_graphs == 2
    assert full_result.recorder.num_dynamo_graphs == 1
    full_counts, broken_counts = counts_by_path(full), counts_by_path(broken)
    for layer in ("layers.0 (Block)", "layers.1 (Block)"):
        layer_paths = {p for p in full_counts if p[:1] == (layer,)}
        assert layer_paths == {p for p in broken_counts if p[:1] == (layer,)}
        for path in layer_paths:
            assert broken_counts[path] == full_counts[path], path


def test_times_add_up() -> None:
    result, root = profile("nested", warmup=1, iters=3)
    assert len(result.iterations) == 3
    op_ns = sum(op.end_ns - op.start_ns for runs in result.iterations for run in runs for op in run.ops)
    assert root.total_ns == pytest.approx(op_ns / 3)
    for _, node in root.walk():
        assert node.total_ns == pytest.approx(node.self_ns + sum(c.total_ns for c in node.children.values()))


@pytest.fixture(scope="module")
def cli_out(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    out = tmp_path_factory.mktemp("profile")
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(io.StringIO()):
        rc = main(["--model", "nested-graph-break", "--train", "--profile", "--warmup", "1", "--iters", "2",
                   "--out", str(out)])
    assert rc == 0
    return out, buf.getvalue()


def test_cli_prints_tree_and_paths(cli_out: tuple[Path, str]) -> None:
    out, stdout = cli_out
    assert "layers.1 (Block)" in stdout and "total ms" in stdout
    for name in ("trace.json", "hierarchy.folded", "hierarchy_us.folded", "flamegraph.svg"):
        assert (out / name).is_file()
        assert str(out / name) in stdout


def test_trace_ops_lie_inside_their_scopes(cli_out: tuple[Path, str]) -> None:
    events = json.loads((cli_out[0] / "trace.json").read_text())["traceEvents"]
    complete = [e for e in events if e["ph"] == "X"]
    scopes: dict[tuple[str, ...], list[tuple[float, float]]] = {}
    for e in complete:
        if e["cat"].startswith("scope"):
            assert e["name"] == e["args"]["scope"][-1]
            scopes.setdefault(tuple(e["args"]["scope"]), []).append((e["ts"], e["ts"] + e["dur"]))
    ops = [e for e in complete if e["cat"].startswith("op")]
    assert ops and any(e["cat"] == "op.backward" for e in ops)
    layers = {e["args"]["scope"][1] for e in ops if len(e["args"]["scope"]) > 1}
    assert layers == {"layers.0 (Block)", "layers.1 (Block)"}
    for op in ops:
        start, end = op["ts"], op["ts"] + op["dur"]
        path = tuple(op["args"]["scope"])
        for depth in range(1, len(path) + 1):
            ranges = scopes.get(path[:depth], [])
            assert any(s - EPS_US <= start and end <= e + EPS_US for s, e in ranges), (op, path[:depth])


def test_folded_file_parses(cli_out: tuple[Path, str]) -> None:
    out, _ = cli_out
    total = 0
    for line in (out / "hierarchy.folded").read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        assert frames[0] == "Nested" and all(frames), line
        total += int(count)
    for line in (out / "hierarchy_us.folded").read_text().splitlines():
        assert int(line.rpartition(" ")[2]) >= 1
    assert total > 0


def test_svg_is_well_formed(cli_out: tuple[Path, str]) -> None:
    tree = ET.parse(cli_out[0] / "flamegraph.svg")
    ns = "{http://www.w3.org/2000/svg}"
    assert tree.getroot().tag == f"{ns}svg"
    titles = [t.text or "" for t in tree.getroot().iter(f"{ns}title")]
    assert any(t.startswith("layers.1 (Block)") for t in titles)
    assert any("(bw)" in t for t in titles)


def test_unknown_model_is_a_clear_error() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "scripts.profile_hierarchy", "--model", "no-such-model"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2
    assert "unknown model 'no-such-model'" in proc.stderr and "qwen2" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_failing_factory_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "my_models.py").write_text(
        "def broken():\n    raise RuntimeError('weights not found')\n\nnot_callable = 3\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["--model", "my_models:broken", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "my_models:broken" in err and "RuntimeError: weights not found" in err
    assert main(["--model", "my_models:not_callable", "--out", str(tmp_path)]) == 2
    assert "no callable 'not_callable'" in capsys.readouterr().err
    assert main(["--model", "no_such_module_xyz:f", "--out", str(tmp_path)]) == 2
    assert "cannot import module 'no_such_module_xyz'" in capsys.readouterr().err


def test_user_factory_tuple(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "user_model.py").write_text(
        "import torch\n\ndef make():\n    return torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.ReLU()), "
        "(torch.randn(2, 3),)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    result = run(models.build("user_model:make"), Options())
    root = build_tree(result.iterations)
    assert root.label == "Sequential"
    assert set(root.children) == {"0 (Linear)", "1 (ReLU)"}


def test_default_qwen2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--out", str(tmp_path)]) == 0
    stdout = capsys.readouterr().out
    result_line = next(line for line in stdout.splitlines() if line.startswith("Qwen2ForCausalLM"))
    assert int(result_line.split()[1]) > 100
    assert "apply_rotary_pos_emb#0" in stdout and "rotate_half#1" in stdout
    assert (tmp_path / "trace.json").is_file()


def test_inductor_kernels_attributed_to_common_scope(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    result, root = profile("nested", backend="inductor", fullgraph=True)
    (graph,) = result.recorder.graphs
    assert root.total_count == graph.num_ops == len(graph.forward) > 0
    # extern matmuls keep their Linear's scope; fused kernels land at the common scope of their origins
    assert scope_at(root, "layers.1 (Block)", "mlp (MLP)", "down (Linear)").total_count >= 1
    assert main(["--model", "nested", "--backend", "inductor", "--profile", "--out", str(tmp_path)]) == 2
    assert "--profile needs --backend aot_eager" in capsys.readouterr().err
