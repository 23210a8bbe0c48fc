"""Tests of the call-hierarchy profiler (scripts.profile_hierarchy); need the patched torch (.venv)."""

from __future__ import annotations

import contextlib
import io
import csv
import json
import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest

import torch  # noqa: E402
import torch.fx.call_hierarchy  # noqa: E402,F401  (the patched torch: fail, never skip)
from torch.fx.call_hierarchy import common_call_hierarchy  # noqa: E402

from scripts.hierarchy_profiler import CallHierarchyProfiler, models  # noqa: E402
from scripts.hierarchy_profiler.api import ProfileResult  # noqa: E402
from scripts.hierarchy_profiler.capture import (  # noqa: E402
    CompiledGraph, Kernel, RuntimeScopes, apply_recorded_names, wrapper_calls,
)
from scripts.hierarchy_profiler.cli import main  # noqa: E402
from scripts.hierarchy_profiler.tree import Scope  # noqa: E402

REPO = Path(__file__).resolve().parent.parent


def profile(model: str, backend: str = "inductor", train: bool = False, iters: int = 2,
            fullgraph: bool = False, **profile_kwargs: Any) -> ProfileResult:
    """What the CLI does, through the API: compile inside the profiler, 1 warm-up, ``iters`` measured
    (``profile_kwargs``: for ``hp.profile``)."""
    torch._dynamo.reset()
    workload = models.build(model)
    module = workload.model
    module.train(train)
    hp = CallHierarchyProfiler(module)

    def step(fn: Any) -> None:
        if train:
            module.zero_grad(set_to_none=True)
            workload.loss_of(fn(*workload.args, **workload.kwargs)).backward()
        else:
            with torch.no_grad():
                fn(*workload.args, **workload.kwargs)

    with hp:
        if backend == "inductor":
            compiled = torch.compile(module, fullgraph=fullgraph)
        else:
            compiled = torch.compile(module, backend=hp.backend(backend), fullgraph=fullgraph)
        step(compiled)
        with hp.profile(**profile_kwargs) as prof:
            for _ in range(iters):
                step(compiled)
                prof.step()
    assert hp.result is not None
    assert hp.result.report.uncaptured_self_us == 0.0, hp.result.summary()  # all compiled inside `with hp`
    return hp.result


def profile_module(model: torch.nn.Module, *args: Any, backend: str = "inductor",
                   call_kwargs: dict[str, Any] | None = None, **compile_kwargs: Any) -> ProfileResult:
    """Inference of ``model(*args, **call_kwargs)`` compiled inside the profiler (``torch.compile``
    with ``compile_kwargs``): one warm-up, one measured call."""
    call_kwargs = call_kwargs or {}
    torch._dynamo.reset()
    hp = CallHierarchyProfiler(model)
    with hp, torch.no_grad():
        if backend != "inductor":
            compile_kwargs["backend"] = hp.backend(backend)
        compiled = torch.compile(model, **compile_kwargs)
        compiled(*args, **call_kwargs)
        with hp.profile() as prof:
            compiled(*args, **call_kwargs)
            prof.step()
    assert hp.result is not None
    return hp.result


def profile_steps(model: torch.nn.Module, inputs: tuple[torch.Tensor, ...], backend: str,
                  train: bool) -> ProfileResult:
    """``model`` compiled inside the profiler; one warm-up step, one measured: a step calls it once
    per input (training: on the sum of its output, backward)."""
    torch._dynamo.reset()
    model.train(train)
    hp = CallHierarchyProfiler(model)
    with hp:
        compiled = torch.compile(model) if backend == "inductor" else torch.compile(model, backend=hp.backend(backend))

        def step() -> None:
            for x in inputs:
                if train:
                    model.zero_grad(set_to_none=True)
                    compiled(x).sum().backward()
                else:
                    with torch.no_grad():
                        compiled(x)

        step()
        with hp.profile() as prof:
            step()
            prof.step()
    assert hp.result is not None
    return hp.result


def scope_at(root: Scope, *labels: str) -> Scope:
    node = root
    for label in labels:
        assert label in node.children, (label, list(node.children))
        node = node.children[label]
    return node


def counts_by_path(root: Scope, graphs_only: bool = False) -> dict[tuple[str, ...], float]:
    """Kernel calls per iteration below each scope; ``graphs_only``: without the ops a compiled
    frame ran eagerly (``<op> (eager)``)."""
    out: dict[tuple[str, ...], float] = {}

    def visit(node: Scope, path: tuple[str, ...]) -> float:
        count = sum(c for op, (c, _) in node.ops.items() if not (graphs_only and op.endswith(" (eager)")))
        count += sum(visit(child, path + (child.label,)) for child in node.children.values())
        out[path] = count
        return count

    visit(root, ())
    return out


def kernels_under(node: Scope) -> list[str]:
    return [op for _, n in node.walk() for op in n.ops]


def check_tree_adds_up(result: ProfileResult) -> None:
    for _, node in result.root.walk():
        assert node.total_ns == pytest.approx(node.self_ns + sum(c.total_ns for c in node.children.values()))
    # the tree holds every compiled-region kernel call of the trace: mean time per iteration
    total_us = sum(s.self_us for s in result.report.samples if not s.device)
    assert result.root.total_ns == pytest.approx(total_us * 1000.0 / result.iterations)


# --------------------------------------------------------------------------- backends x modes


@pytest.mark.parametrize("backend", ["inductor", "aot_eager"])
@pytest.mark.parametrize("train", [False, True], ids=["inference", "train"])
def test_nested_model_attributed(backend: str, train: bool) -> None:
    result = profile("nested", backend=backend, train=train, fullgraph=True)
    assert result.report.share >= 0.99, result.summary()
    assert result.report.unattributed_events == 0
    assert [g.kind for g in result.graphs] == (["forward", "backward"] if train else ["inference"])
    check_tree_adds_up(result)
    root = result.root
    assert root.label == "Nested"
    for layer in ("layers.0 (Block)", "layers.1 (Block)"):
        # the matmuls of each Linear stay in that Linear (extern kernels / ATen ops)
        assert scope_at(root, layer, "mlp (MLP)", "up (Linear)").total_count >= 1
        assert scope_at(root, layer, "mlp (MLP)", "down (Linear)").total_count >= 1
    backward = [op for op in kernels_under(root) if op.endswith(" (bw)")]
    assert bool(backward) == train
    if train:  # backward kernels sit under their forward origin
        assert any(op.endswith("(bw)") for op in kernels_under(scope_at(root, "layers.1 (Block)", "mlp (MLP)")))
    if backend == "aot_eager":
        # every ATen op of a layer, with its helper functions, is in its scope
        assert set(scope_at(root, "layers.0 (Block)").children) == {"norm (LayerNorm)", "scaled_tanh#0", "mlp (MLP)"}
        assert set(scope_at(root, "layers.0 (Block)", "mlp (MLP)", "gate#0").children) == {"scaled_tanh#0"}
    if backend == "inductor":
        assert all(not op.startswith("aten::") or op.split(" ")[0] in ("aten::addmm", "aten::mm")
                   for op in kernels_under(root)), kernels_under(root)
        assert any(op.startswith("cpp_fused_") for op in kernels_under(root))


@pytest.mark.parametrize("backend", ["inductor", "aot_eager"])
def test_graph_break_per_layer_counts_match_fullgraph(backend: str) -> None:
    full = profile("nested", backend=backend, train=True, fullgraph=True)
    broken = profile("nested-graph-break", backend=backend, train=True)
    assert full.num_dynamo_graphs == 1
    assert broken.num_dynamo_graphs == 2  # compiled once before and once after the break, shared by the layers
    assert broken.report.share >= 0.99
    # the graphs' kernels: the frames' own eager ops (AOTAutograd's output detach) differ with the break
    full_counts, broken_counts = counts_by_path(full.root, True), counts_by_path(broken.root, True)
    for layer in ("layers.0 (Block)", "layers.1 (Block)"):
        layer_paths = {p for p in broken_counts if p[:1] == (layer,)}
        assert layer_paths and layer_paths <= set(full_counts)
        if backend == "aot_eager":  # same ATen ops; Inductor fuses differently across the break
            assert layer_paths == {p for p in full_counts if p[:1] == (layer,)}
            for path in layer_paths:
                assert broken_counts[path] == full_counts[path], path
    # the frame Dynamo gave up on (the loop over the layers) is reported, not silently missing
    assert broken.eager_frames and "ran eagerly" in broken.eager_frames[0]


# --------------------------------------------------------------------------- the main job on tiny Qwen2


@pytest.fixture(scope="module")
def qwen2_train(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    out = tmp_path_factory.mktemp("qwen2_train")
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(io.StringIO()):
        rc = main(["--backend", "inductor", "--train", "--profile", "--warmup", "1", "--iters", "2",
                   "--out", str(out)])
    assert rc == 0
    return out, buf.getvalue()


def attributed_share(stdout: str) -> float:
    line = next(line for line in stdout.splitlines() if line.startswith("attributed: "))
    return float(line.split("attributed: ")[1].split("%")[0])


def test_qwen2_train_prints_scopes_and_share(qwen2_train: tuple[Path, str]) -> None:
    out, stdout = qwen2_train
    assert attributed_share(stdout) >= 99.0, stdout
    for text in ("layers.1 (Qwen2DecoderLayer)", "self_attn (Qwen2Attention)", "q_proj (Linear)",
                 "total ms", "self ms", "mean of 2 measured iteration(s)"):
        assert text in stdout
    for name in ("trace.json", "scopes.csv", "hierarchy.folded", "hierarchy_us.folded", "flamegraph.svg"):
        assert (out / name).is_file()
        assert str(out / name) in stdout
    # the scope table: a training run's backward time shows beside the forward's
    with (out / "scopes.csv").open(newline="") as f:
        rows = list(csv.DictReader(f))
    layer = next(r for r in rows if r["scope"].endswith("> layers.1 (Qwen2DecoderLayer)"))
    assert float(layer["bw_ms"]) > 0 and float(layer["fwd_ms"]) > 0


def _complete(doc: dict[str, Any]) -> list[dict[str, Any]]:
    return [e for e in doc["traceEvents"] if e.get("ph") == "X"]


def test_trace_is_the_profilers_trace_annotated(qwen2_train: tuple[Path, str]) -> None:
    doc = json.loads((qwen2_train[0] / "trace.json").read_text())
    events = _complete(doc)
    names = {e["name"] for e in events}
    # the profiler's own events are there: Inductor's CPU kernels, extern kernels, its range
    assert any(n.startswith("graph_") and "cpp_fused_" in n for n in names)
    assert "aten::mm" in names or "aten::addmm" in names
    assert any(n.startswith("## Call CompiledFxGraph") for n in names)
    assert doc["callHierarchy"]["measured_iterations"] == 2
    kernels = [e for e in events if "call_hierarchy_kernel" in e.get("args", {})]
    assert kernels
    for e in kernels:
        scope = e["args"]["call_hierarchy"]
        assert scope[0] == "Qwen2ForCausalLM" and all(isinstance(s, str) and s for s in scope)
        assert "call_hierarchy_unattributed" not in e["args"], e
    backward = [e for e in kernels if e["args"].get("call_hierarchy_backward")]
    assert backward and all(e["args"]["call_hierarchy_kernel"].endswith(" (bw)") for e in backward)
    layers = {e["args"]["call_hierarchy"][2] for e in kernels if len(e["args"]["call_hierarchy"]) > 2}
    assert {"layers.0 (Qwen2DecoderLayer)", "layers.1 (Qwen2DecoderLayer)"} <= layers
    # fused kernels name their source scopes when those differ
    fused = [e for e in kernels if "call_hierarchy_sources" in e["args"]]
    assert fused
    for e in fused:
        assert all(s[: len(e["args"]["call_hierarchy"])] == e["args"]["call_hierarchy"]
                   for s in e["args"]["call_hierarchy_sources"])


def test_trace_events_lie_inside_their_scope_slices(qwen2_train: tuple[Path, str]) -> None:
    check_inside_scope_slices(json.loads((qwen2_train[0] / "trace.json").read_text()))


def check_inside_scope_slices(doc: dict[str, Any]) -> None:
    """Every attributed event lies inside the slices of its scope, on its own track, at the
    trace's own resolution (whole nanoseconds: no slice ends before its last kernel)."""
    def ns(e: dict[str, Any]) -> tuple[int, int]:
        start = round(e["ts"] * 1000)
        return start, start + round(e.get("dur", 0) * 1000)

    events = _complete(doc)
    slices: dict[tuple[Any, Any, tuple[str, ...]], list[tuple[int, int]]] = {}
    for e in events:
        if e.get("cat") == "call_hierarchy":
            assert e["name"] == e["args"]["call_hierarchy"][-1]
            key = (e["pid"], e["tid"], tuple(e["args"]["call_hierarchy"]))
            slices.setdefault(key, []).append(ns(e))
    assert slices
    attributed = [e for e in events if "call_hierarchy" in e.get("args", {}) and e.get("cat") != "call_hierarchy"]
    for e in attributed:
        path = tuple(e["args"]["call_hierarchy"])
        start, end = ns(e)
        for depth in range(1, len(path) + 1):
            ranges = slices.get((e["pid"], e["tid"], path[:depth]), [])
            assert any(s <= start and end <= t for s, t in ranges), (e["name"], path[:depth], start, end, ranges)


def test_device_kernels_take_their_launch_attribution(monkeypatch: pytest.MonkeyPatch) -> None:
    """A CUDA-shaped trace (no GPU here): each CPU kernel of the profile launches a device kernel.

    The launch (``cudaLaunchKernel``, inside the kernel call) and the device event (on a stream's
    track, later) share ``args.correlation``, as Kineto writes them; one more device event has no
    launch in a compiled graph.
    """
    from scripts.hierarchy_profiler import jsonio

    loads = jsonio.loads
    injected: list[dict[str, Any]] = []

    def cuda_shaped(data: bytes) -> tuple[Any, bool]:
        doc, strict = loads(data)
        events = doc["traceEvents"]
        clock = 0.0
        for e in sorted((e for e in events if e.get("ph") == "X" and "cpp_fused_" in str(e.get("name"))),
                        key=lambda e: e["ts"]):
            corr = 1000 + len(injected)
            launch = e["ts"] + e["dur"] / 4
            events.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": e["pid"],
                           "tid": e["tid"], "ts": launch, "dur": e["dur"] / 2, "args": {"correlation": corr}})
            clock = max(clock, launch + 1.0)
            injected.append({"ph": "X", "cat": "kernel", "name": e["name"].split("cpp_", 1)[1], "pid": 0, "tid": 7,
                             "ts": clock, "dur": 1.5, "args": {"correlation": corr, "stream": 7}})
            clock += 1.6
        orphan = {"ph": "X", "cat": "kernel", "name": "eager_kernel", "pid": 0, "tid": 7, "ts": clock + 5.0,
                  "dur": 1.0, "args": {"correlation": 1}}
        nccl = {"ph": "X", "cat": "kernel", "name": "ncclDevKernel_AllReduce_Sum_f32_RING_LL", "pid": 0, "tid": 8,
                "ts": clock + 5.0, "dur": 4.0, "args": {"correlation": 2}}
        events.extend(injected + [orphan, nccl])
        return doc, strict

    monkeypatch.setattr(jsonio, "loads", cuda_shaped)
    result = profile("nested", train=True)
    assert injected
    events = result.trace["traceEvents"]
    launcher = {e["args"]["correlation"]: e for e in events if e.get("name") == "cudaLaunchKernel"}
    kernel_of = {e["ts"]: e for e in events if e.get("ph") == "X" and "cpp_fused_" in str(e.get("name"))}
    for device in injected:
        launch = launcher[device["args"]["correlation"]]
        cpu_kernel = next(k for ts, k in kernel_of.items() if ts <= launch["ts"] <= ts + k["dur"])
        assert device["args"]["call_hierarchy"] == cpu_kernel["args"]["call_hierarchy"]
        assert device["args"]["call_hierarchy_kernel"] == cpu_kernel["args"]["call_hierarchy_kernel"]
    assert not any("call_hierarchy" in e["args"] for e in events if e.get("name") == "eager_kernel")
    check_inside_scope_slices(result.trace)
    assert any(e.get("cat") == "call_hierarchy" and e["tid"] == 7 for e in events)
    # device time is its own column, not host time: the host tree adds up without it
    check_tree_adds_up(result)
    device_ns = sum(d["dur"] for d in injected) * 1000.0 / result.iterations
    assert result.root.total_device_ns == pytest.approx(device_ns)
    assert scope_at(result.root, "layers.0 (Block)", "mlp (MLP)").total_device_ns > 0
    assert "device ms" in result.format_tree().splitlines()[0]
    assert f"in {len(injected)} device kernel(s)" in result.summary()
    # NCCL's kernel, launched outside the compiled graphs, is communication; the graphs' are not
    assert result.outside is not None
    communication = result.outside.children["communication"]
    assert list(communication.device_ops) == ["ncclDevKernel_AllReduce_Sum_f32_RING_LL [device]"]
    assert communication.total_device_ns == pytest.approx(4000.0 / result.iterations)
    assert not any(op in node.device_ops for _, node in result.outside.walk()
                   for op in (f"{name} [device]" for name in ("eager_kernel", *(d["name"] for d in injected))))


def _kernel_calls(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Inductor's kernel calls on CPU: its C++ kernels (``graph_N_cpp_fused_*``) and extern kernels."""
    return sorted((e for e in events if e.get("ph") == "X" and e.get("cat") != "call_hierarchy"
                   and (str(e.get("name")).startswith("graph_") or e.get("name") in ("aten::addmm", "aten::mm"))),
                  key=lambda e: e["ts"])


@pytest.mark.parametrize("train", [False, True], ids=["inference", "train"])
def test_cuda_graph_replay_attributed_in_run_order(train: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """A trace shaped as a CUDA graph replay (mode="reduce-overhead"; no GPU here) gets what the
    host kernel calls got: inside each compiled-graph call, one ``cudaGraphLaunch`` and an input copy
    instead of the kernel calls, then the device kernels, all correlated with the launch. A C++
    kernel's device kernel is named as Triton's are, after it; an extern kernel runs two library
    kernels of other names."""
    from scripts.hierarchy_profiler import jsonio

    plain = profile("nested", train=train)
    calls = [e for e in plain.trace["traceEvents"] if str(e.get("name")).startswith("## call_hierarchy graph ")]
    in_call = [e for e in _kernel_calls(plain.trace["traceEvents"])
               if calls[0]["ts"] <= e["ts"] <= calls[0]["ts"] + calls[0]["dur"]]
    assert all(e["name"].endswith(e["args"]["call_hierarchy_kernel"].removeprefix("aten::")) for e in in_call)
    expected = []
    for e in in_call:
        expected += [e["args"]["call_hierarchy"]] * (1 if e["name"].startswith("graph_") else 2)
    assert len({tuple(s) for s in expected}) > 3

    loads = jsonio.loads

    def replayed(data: bytes) -> tuple[Any, bool]:
        doc, strict = loads(data)
        events = doc["traceEvents"]
        drop: set[int] = set()
        extra: list[dict[str, Any]] = []
        for n, r in enumerate(e for e in events if str(e.get("name")).startswith("## call_hierarchy graph ")):
            inside = [e for e in events if e.get("ph") == "X" and e is not r and (e["pid"], e["tid"]) == (r["pid"], r["tid"])
                      and r["ts"] <= e["ts"] and e["ts"] + e["dur"] <= r["ts"] + r["dur"]]
            drop.update(id(e) for e in inside)
            host = {"pid": r["pid"], "tid": r["tid"], "ph": "X"}
            extra.append({**host, "cat": "cpu_op", "name": "aten::_foreach_copy_", "ts": r["ts"] + r["dur"] * 0.1,
                          "dur": r["dur"] * 0.2, "args": {}})
            extra.append({**host, "cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": r["ts"] + r["dur"] * 0.5,
                          "dur": r["dur"] * 0.3, "args": {"correlation": 9000 + n}})
            clock = r["ts"] + r["dur"]
            for k in _kernel_calls(inside):
                names = [k["name"].split("_", 2)[2]] if k["name"].startswith("graph_") else ["gemm_fake", "splitK_fake"]
                for name in names:
                    extra.append({"ph": "X", "cat": "kernel", "name": name, "pid": 0, "tid": 7, "ts": clock, "dur": 1.0,
                                  "args": {"correlation": 9000 + n, "stream": 7}})
                    clock += 1.1
        doc["traceEvents"] = [e for e in events if id(e) not in drop] + extra
        return doc, strict

    monkeypatch.setattr(jsonio, "loads", replayed)
    result = profile("nested", train=train)
    assert result.report.share == 1.0 and result.report.unattributed_events == 0, result.summary()
    events = result.trace["traceEvents"]
    device = sorted((e for e in events if e.get("cat") == "kernel"), key=lambda e: e["ts"])
    assert device and all("call_hierarchy" in e["args"] for e in device)
    first = [e["args"]["call_hierarchy"] for e in device if e["args"]["correlation"] == 9000]
    assert first == expected
    assert not any(e["args"]["call_hierarchy_kernel"].endswith("(bw)") for e in device
                   if e["args"]["correlation"] == 9000)  # the forward's, though attributed after the backward's
    launch = next(e for e in events if e.get("name") == "cudaGraphLaunch")
    assert launch["args"]["call_hierarchy"] == ["Nested"]  # the graph as a whole
    check_inside_scope_slices(result.trace)
    assert scope_at(result.root, "layers.0 (Block)", "mlp (MLP)", "up (Linear)").total_device_ns > 0
    if train:  # the backward graph's replay: its device kernels under their forward origin
        assert any(e["args"]["call_hierarchy_kernel"].endswith(" (bw)") and len(e["args"]["call_hierarchy"]) > 2
                   for e in device)


def test_host_scalar_read_of_the_graph_code_attributed(monkeypatch: pytest.MonkeyPatch) -> None:
    """Inductor's CUDA wrapper reads a device scalar on the host (``.item()`` for a scalar input or
    an unbacked size) among its kernel calls; no node's kernel, so the graph's as a whole (its
    common scope), not unattributed. Injected into a CPU profile (CPU kernels read it themselves)."""
    from scripts.hierarchy_profiler import jsonio

    loads = jsonio.loads
    injected: list[dict[str, Any]] = []

    def with_item(data: bytes) -> tuple[Any, bool]:
        doc, strict = loads(data)
        events = doc["traceEvents"]
        for r in [e for e in events if str(e.get("name")).startswith("## call_hierarchy graph ")]:
            first = min((e["ts"] for e in events if e.get("ph") == "X" and e is not r and e.get("tid") == r["tid"]
                         and r["ts"] < e["ts"] <= r["ts"] + r["dur"]), default=r["ts"] + r["dur"])
            gap = first - r["ts"]
            if gap > 0.02:
                host = {"ph": "X", "cat": "cpu_op", "pid": r["pid"], "tid": r["tid"], "args": {}}
                injected.append({**host, "name": "aten::item", "ts": r["ts"] + gap / 4, "dur": gap / 2})
                events.append({**host, "name": "aten::_local_scalar_dense", "ts": r["ts"] + gap / 3, "dur": gap / 4})
        events.extend(injected)
        return doc, strict

    monkeypatch.setattr(jsonio, "loads", with_item)
    result = profile("nested", train=True)
    assert injected
    assert result.report.unattributed_events == 0, result.summary()
    for e in injected:
        assert e["args"]["call_hierarchy"] == ["Nested"] and "call_hierarchy_unattributed" not in e["args"], e
    check_inside_scope_slices(result.trace)


def test_trace_loads_in_holistic_trace_analysis(qwen2_train: tuple[Path, str], tmp_path: Path) -> None:
    """An independent consumer: HTA parses the annotated trace; slices nest properly per thread."""
    from hta.common.trace import Trace

    (tmp_path / "rank0.json").write_text((qwen2_train[0] / "trace.json").read_text())
    trace = Trace(trace_dir=str(tmp_path))
    trace.parse_traces()
    df = trace.get_trace(0)
    symbols = trace.symbol_table.get_sym_table()
    df = df.assign(label=[symbols[i] for i in df["name"]])
    doc = json.loads((tmp_path / "rank0.json").read_text())
    scope_slices = [e for e in _complete(doc) if e.get("cat") == "call_hierarchy"]
    assert scope_slices
    # HTA keeps every complete event on a CPU thread, scope slices included
    loaded = df[df["label"].isin({e["name"] for e in scope_slices})]
    assert len(loaded) >= len(scope_slices)
    # properly nested per thread: any two slices are disjoint or one contains the other
    for tid, group in df.groupby("tid"):
        rows = sorted(zip(group["ts"].tolist(), (group["ts"] + group["dur"]).tolist()),
                      key=lambda r: (r[0], -r[1]))
        stack: list[float] = []
        for start, end in rows:
            while stack and stack[-1] <= start:
                stack.pop()
            assert not stack or end <= stack[-1], (tid, start, end, stack[-1])
            stack.append(end)


def test_folded_and_svg(qwen2_train: tuple[Path, str]) -> None:
    out, _ = qwen2_train
    for name in ("hierarchy.folded", "hierarchy_us.folded"):
        lines = (out / name).read_text().splitlines()
        assert lines
        tops = set()
        for line in lines:
            stack, _, weight = line.rpartition(" ")
            tops.add(stack.split(";")[0])
            assert int(weight) >= 1
        # the model's stacks, then those of what ran outside the compiled graphs (the loss, its backward seed)
        assert tops == {"Qwen2ForCausalLM", "(outside compiled graphs)"}, tops
        assert lines[0].startswith("Qwen2ForCausalLM;")
    tree = ET.parse(out / "flamegraph.svg")
    ns = "{http://www.w3.org/2000/svg}"
    titles = [t.text or "" for t in tree.getroot().iter(f"{ns}title")]
    assert any(t.startswith("layers.1 (Qwen2DecoderLayer)") for t in titles)
    assert any("(bw)" in t for t in titles)


@pytest.mark.parametrize("backend", ["inductor", "aot_eager"])
def test_qwen2_inference_attributed(backend: str) -> None:
    result = profile("qwen2", backend=backend, iters=1)
    assert result.report.share >= 0.99, result.summary()
    # post-processing's steps, each timed (scripts/profile_cost.py reports them)
    assert list(result.timings) == ["export", "parse", "attribution", "tree"], result.timings
    assert all(seconds > 0.0 for seconds in result.timings.values()), result.timings
    root = result.root
    attn = scope_at(root, "model (Qwen2Model)", "layers.1 (Qwen2DecoderLayer)", "self_attn (Qwen2Attention)")
    assert scope_at(attn, "q_proj (Linear)").total_count >= 1


def test_regional_compilation_attributes_each_layer_call() -> None:
    """nested_compile_region on the decoder layers: one body, called per layer, each call in its layer."""
    result = profile("qwen2-regional", backend="inductor", train=True, iters=1)
    assert result.report.share >= 0.99, result.summary()
    model = scope_at(result.root, "model (Qwen2Model)")
    layer0 = scope_at(model, "layers.0 (Qwen2DecoderLayer)")
    layer1 = scope_at(model, "layers.1 (Qwen2DecoderLayer)")
    assert layer0.total_count == layer1.total_count > 0
    for layer in (layer0, layer1):
        assert scope_at(layer, "self_attn (Qwen2Attention)", "q_proj (Linear)").total_count >= 1
        assert scope_at(layer, "mlp (Qwen2MLP)", "down_proj (Linear)").total_count >= 1
        assert set(layer.children) <= {"self_attn (Qwen2Attention)", "mlp (Qwen2MLP)",
                                       "input_layernorm (Qwen2RMSNorm)", "post_attention_layernorm (Qwen2RMSNorm)"}


class _DropoutBlock(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(16, 16)
        self.drop = torch.nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(torch.relu(self.lin(x)))


def dropout_model() -> tuple[torch.nn.Module, tuple[torch.Tensor]]:
    """Two blocks with dropout: Inductor draws one tensor of RNG seeds per graph for both."""
    torch.manual_seed(0)
    return torch.nn.Sequential(_DropoutBlock(), _DropoutBlock()), (torch.randn(4, 16),)


def test_inductor_rng_seeds_attributed_to_the_common_scope() -> None:
    """Training with dropout: the wrapper's seed kernel (``aten.randint.low_out``, an event
    ``aten::randint``) serves every dropout of the graph, so it sits at their common scope."""
    result = profile(f"{__name__}:dropout_model", backend="inductor", train=True, iters=1)
    assert result.report.unattributed_events == 0, result.summary()
    assert result.report.share == 1.0, result.summary()
    forward = next(g for g in result.graphs if g.kind == "forward")
    seeds = [k for k in forward.kernels if k.key == "aten::randint"]
    # the common scope of both blocks (the model), not the first dropout's: since torch 2.15 the fused
    # seeds node takes the first seed's metadata, and the series' transforms patch merges its hierarchy
    blocks = common_call_hierarchy(k.hierarchy for k in forward.kernels if k.key == "aten::addmm")
    assert len(seeds) == 1 and seeds[0].hierarchy == blocks == (), seeds  # the compiled Sequential: the root
    assert "aten::randint" in result.root.ops  # the root: both blocks' dropouts draw from it
    # torch.compile(nn.Sequential) compiles torch's wrapper frame around the call: still the model
    assert not any(node.label.endswith("(outside the model)") for _, node in result.root.walk())
    for block in ("0 (_DropoutBlock)", "1 (_DropoutBlock)"):
        assert scope_at(result.root, block, "lin (Linear)").total_count >= 1


class _Attention(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = torch.nn.Linear(16, 48)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).view(2, 4, 3, 2, 8).permute(2, 0, 3, 1, 4)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(2, 4, 16)


class _CheckpointedAttention(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = _Attention()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.utils.checkpoint.checkpoint(self.attn, x, use_reentrant=False)


def checkpointed_attention_model() -> tuple[torch.nn.Module, tuple[torch.Tensor]]:
    torch.manual_seed(0)
    return torch.nn.Sequential(_CheckpointedAttention(), _CheckpointedAttention()), (torch.randn(2, 4, 16),)


@pytest.mark.parametrize("backend", ["inductor", "aot_eager"])
def test_checkpointed_random_op_attributed(backend: str) -> None:
    """Activation checkpointing of a random op (SDPA is one even without dropout): AOTAutograd
    runs it inside ``run_and_save_rng_state`` and its recomputation inside
    ``run_with_rng_state``; the profiler records the op they run, which is the kernel."""
    result = profile(f"{__name__}:checkpointed_attention_model", backend=backend, train=True, iters=1)
    assert result.report.unattributed_events == 0, result.summary()
    assert result.report.share == 1.0, result.summary()
    for block in ("0 (_CheckpointedAttention)", "1 (_CheckpointedAttention)"):
        ops = scope_at(result.root, block, "attn (_Attention)").ops
        assert any(op.startswith("aten::_scaled_dot_product") and not op.endswith("(bw)") for op in ops), ops
        assert any(op.startswith("aten::_scaled_dot_product") and op.endswith("(bw)") for op in ops), ops


class _Branchy(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(16, 16)
        self.b = torch.nn.Linear(16, 16)
        self.out = torch.nn.Linear(16, 4)

    def positive(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x).relu()

    def negative(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(x).sin()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.cond(x.sum() > 0, self.positive, self.negative, (x,)))


class _CondModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = _Branchy()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x) * 2.0


@pytest.mark.parametrize("backend", ["inductor", "aot_eager"])
@pytest.mark.parametrize("train", [False, True])
def test_cond_branch_that_ran_is_attributed(backend: str, train: bool) -> None:
    """torch.cond: which branch runs is known only at run time.  Each iteration runs both (one
    input each way): every kernel is in its own branch's scope, none in the scope of the op
    after the cond (Inductor names the branches' node like the outer graph's)."""
    torch.manual_seed(0)
    model = _CondModel()
    x = torch.randn(4, 16).abs()
    result = profile_steps(model, (x, -x), backend, train)  # the positive branch, then the negative one
    assert result.report.unattributed_events == 0, result.summary()
    assert result.report.share == 1.0, result.summary()
    check_tree_adds_up(result)
    inner = scope_at(result.root, "inner (_Branchy)")
    branches = {label: node for label, node in inner.children.items() if label not in ("out (Linear)",)}
    assert sorted(branches) == ["_Branchy.negative#0", "_Branchy.positive#0"], list(inner.children)
    assert scope_at(inner, "_Branchy.positive#0", "a (Linear)").total_count >= 1
    assert scope_at(inner, "_Branchy.negative#0", "b (Linear)").total_count >= 1
    # the op after the cond ran once per call, twice per iteration: no branch kernel among its calls
    assert scope_at(inner, "out (Linear)").ops["aten::addmm"][0] == 2, scope_at(inner, "out (Linear)").ops
    if train:  # a branch's backward kernels under the branch op they differentiate (patch 0014)
        for branch, linear in (("_Branchy.positive#0", "a (Linear)"), ("_Branchy.negative#0", "b (Linear)")):
            assert any(op.endswith(" (bw)") for op in kernels_under(scope_at(inner, branch, linear))), branch


def test_cpu_kernel_is_matched_by_the_name_its_code_records() -> None:
    """A C++ template kernel (flex attention, a GEMM template) records ``graph_N_kernel``, not the
    wrapper's name for it; a kernel whose code records nothing takes no later kernel's name."""
    graph = CompiledGraph(0, 0, "inference", "inductor", kernels=[
        Kernel("cpp_fused_a_0", "cpp_fused_a_0", ()), Kernel("cpp_fused_b_1", "cpp_fused_b_1", ()),
        Kernel("cpp_fused_c_2", "cpp_fused_c_2", ()), Kernel("aten::mm", "aten::mm", ())])
    source = "\n".join([
        "cpp_fused_a_0 = async_compile.cpp_pybinding(['float*'], r'''",
        'RAIIAtenRecordFunctionHandle record_graph_0_cpp_fused_a_0_("graph_0_cpp_fused_a_0", nullptr);',
        "''')",
        "cpp_fused_b_1 = async_compile.cpp_pybinding(['float*'], r'''",  # profiling off: no record
        "''')",
        "cpp_fused_c_2 = async_compile.cpp_pybinding(['float*'], r'''",
        'RAIIAtenRecordFunctionHandle record_graph_0_kernel_("graph_0_kernel", nullptr);',
        "''')",
    ])
    apply_recorded_names(graph, source)
    assert [k.key for k in graph.kernels] == ["cpp_fused_a_0", "cpp_fused_b_1", "kernel", "aten::mm"]
    assert graph.kernels[2].name == "cpp_fused_c_2"  # shown by the wrapper's name


def _rel_bias(score: torch.Tensor, b: torch.Tensor, h: torch.Tensor, q: torch.Tensor,
              kv: torch.Tensor) -> torch.Tensor:
    return score + (q - kv) * 0.1


class _FlexModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q = torch.nn.Linear(16, 16)
        self.attn = _FlexAttention()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.attn(self.q(x).view(1, 2, 8, 8))


class _FlexAttention(torch.nn.Module):
    def forward(self, q: torch.Tensor) -> torch.Tensor:
        from torch.nn.attention.flex_attention import flex_attention

        return flex_attention(q, q, q, score_mod=_rel_bias)


def test_flex_attention_template_kernel_is_attributed() -> None:
    """Inductor's CPU flex attention is a C++ template whose code records ``graph_N_kernel``: it is
    matched all the same, to the attention's scope, not to that of the view of ``q`` it reads or of
    the Linear before it, whose origins its buffer takes (patch 0019 leaves them out of a template
    kernel's scope; a cold compile has the scopes a warm cache hit reads).  (Flex attention's
    backward is not supported on CPU.)"""
    torch.manual_seed(0)
    result = profile_module(_FlexModel().eval(), torch.randn(8, 16))
    assert result.report.unattributed_events == 0, result.summary()
    assert result.report.share == 1.0, result.summary()
    template = [e for e in result.trace["traceEvents"] if str(e.get("name", "")).endswith("_kernel")
                and "call_hierarchy" in e.get("args", {})]
    assert template and all(e["args"]["call_hierarchy"] == ["_FlexModel", "attn (_FlexAttention)"]
                            and "call_hierarchy_sources" not in e["args"] for e in template), [e["args"] for e in template]


class _GemmBlock(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(64, 64)
        self.lin2 = torch.nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin2(torch.relu(self.lin(x)))


class _GemmBlocks(torch.nn.Module):
    """Four Linears of one shape: frozen and max-autotuned, Inductor's C++ GEMM template computes each."""

    def __init__(self) -> None:
        super().__init__()
        self.a = _GemmBlock()
        self.b = _GemmBlock()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x))


def test_gemm_template_kernels_have_their_linears_scope_cold_and_warm() -> None:
    """A GEMM template's buffer takes the origins of the views it reads, which name every GEMM
    before it in a chain: each template kernel still has the scope of its own Linear and epilogue
    (patch 0019), from a cold compile as from a warm FX graph cache hit of its entries."""
    from torch._inductor.cpu_vec_isa import valid_vec_isa_list
    from torch._inductor.utils import fresh_cache

    if not valid_vec_isa_list():
        pytest.skip("the C++ GEMM template needs a vector ISA")
    options = {"freezing": True, "max_autotune": True, "max_autotune_gemm_backends": "CPP"}
    torch.manual_seed(0)
    model = _GemmBlocks().eval()
    scopes = []
    with fresh_cache(), torch._inductor.config.patch(options):
        for _ in range(2):  # cold, then warm
            result = profile_module(model, torch.randn(32, 64))
            assert result.report.share == 1.0, result.summary()
            events = sorted((e for e in result.trace["traceEvents"]
                             if re.fullmatch(r"graph_\d+_gemm_\w+_kernel", str(e.get("name", "")))),
                            key=lambda e: e["ts"])
            scopes.append([e["args"]["call_hierarchy"][1:] for e in events])
    assert scopes[0] == scopes[1] == [["a (_GemmBlock)"], ["a (_GemmBlock)", "lin2 (Linear)"],
                                      ["b (_GemmBlock)"], ["b (_GemmBlock)", "lin2 (Linear)"]], scopes


class _Looping(torch.nn.Module):
    """A scan over a step and a map over a body, each calling ``lin``."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(16, 16)

    def step(self, h: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.lin(h).tanh() + x
        return h.clone(), h.sin()

    def body(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x).relu()

    def forward(self, xs: torch.Tensor) -> torch.Tensor:
        from torch._higher_order_ops.scan import scan

        return torch._higher_order_ops.map(self.body, scan(self.step, torch.zeros(xs.shape[1:]), xs)[1])


@pytest.mark.parametrize("train", [False, True])
def test_scan_and_map_bodies_are_attributed_in_aot_eager(train: bool) -> None:
    """aot_eager runs a scan's step and a map's body as Python loops over the subgraph: each
    call's kernels are in the scope of the step's or the body's ops (backward ones under the op
    they differentiate, patch 0015 for the scan); the loops' own slicing and stacking, no node's,
    are the scan's or map's call's, at its scope.  (Inductor cannot compile either on CPU in 2.13.)"""
    torch.manual_seed(0)
    result = profile_steps(_Looping(), (torch.randn(6, 4, 16, requires_grad=train),), "aot_eager", train)
    check_tree_adds_up(result)
    root = result.root
    for fn in ("_Looping.step#0", "_Looping.body#0"):
        lin = scope_at(root, fn, "lin (Linear)")
        assert lin.total_count >= 6, (fn, result.format_tree())  # once per step / slice at least
        if train:
            assert any(op.endswith(" (bw)") for op in kernels_under(lin)), (fn, result.format_tree())
    assert result.report.unattributed_events == 0, result.summary()
    assert result.report.share == 1.0, result.summary()
    # the scan and the map are called at the model's root: their loops' own ops are there
    assert {"aten::select", "aten::stack"} <= {op.removesuffix(" (bw)") for op in root.ops}, sorted(root.ops)


class _Loop(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.out = torch.nn.Linear(8, 2)

    def step(self, i: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return i + 1, self.lin(h).tanh()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _, h = torch._higher_order_ops.while_loop(lambda i, h: i < 3, self.step, (torch.tensor(0), x))
        return self.out(h)


@pytest.mark.parametrize("backend", ["inductor", "aot_eager"])
def test_while_loop_body_attributed_per_iteration(backend: str) -> None:
    """torch.while_loop: its body runs a number of times known only at run time (3 here); each
    run of its kernels is in the body's scope, the predicate reads in the loop's."""
    result = profile_module(_Loop(), torch.randn(2, 8), backend=backend)
    assert result.report.unattributed_events == 0, result.summary()
    check_tree_adds_up(result)
    linear = scope_at(result.root, "_Loop.step#0", "lin (Linear)").ops
    assert linear["aten::addmm"][0] == 3, linear  # once per run of the body
    assert scope_at(result.root, "out (Linear)").ops["aten::addmm"][0] == 1


class _ItemBreak(torch.nn.Module):
    """A graph break on a data-dependent value: ``.item()`` and ``nonzero`` run eagerly in the frame."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(16, 16)
        self.b = torch.nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        scale = 1.0 if h.sum().item() > 0 else 2.0
        return self.b(h + torch.nonzero(h > 0).shape[0]) * scale


@pytest.mark.parametrize("backend", ["inductor", "aot_eager"])
def test_ops_run_eagerly_at_a_graph_break_are_attributed(backend: str) -> None:
    """The ATen ops a compiled frame runs eagerly between its graphs are in the tree and the
    trace, at the module stack of the frame (the layer), marked ``(eager)``: not dropped."""
    result = profile_module(torch.nn.Sequential(_ItemBreak(), _ItemBreak()), torch.randn(8, 16), backend=backend)
    assert result.report.share == 1.0 and result.report.unattributed_events == 0, result.summary()
    check_tree_adds_up(result)
    for layer in ("0 (_ItemBreak)", "1 (_ItemBreak)"):
        ops = scope_at(result.root, layer).ops
        assert ops["aten::item (eager)"][0] == 1 and ops["aten::nonzero (eager)"][0] == 1, ops
    events = result.trace["traceEvents"]
    for name in ("aten::item", "aten::nonzero", "aten::_local_scalar_dense"):
        ran = [e for e in events if e.get("name") == name]
        assert len(ran) == 2 and all(e["args"]["call_hierarchy"][1].endswith("(_ItemBreak)") for e in ran), ran
    check_inside_scope_slices(result.trace)


class _Inner(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        return h * h.abs().sum().item()  # a graph break in a frame of its own


class _Outer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = _Inner()
        self.out = torch.nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.inner(x)
        count = torch.nonzero(y)  # the outer frame's own graph break, with no graph of its own before it
        return self.out(y) + count.float().mean()


def test_eager_ops_stay_in_their_own_frame() -> None:
    """An op the outer frame runs eagerly after an inner module's frame (compiled on its own,
    with its own graphs) returned is not the inner module's; with no graph of its own frame
    before or after it at its level, it is at the common scope of the frames around it."""
    result = profile_module(_Outer(), torch.randn(8, 16))
    events = result.trace["traceEvents"]
    assert [e["args"]["call_hierarchy"] for e in events if e.get("name") == "aten::item"] == [
        ["_Outer", "inner (_Inner)"]]
    assert [e["args"]["call_hierarchy"] for e in events if e.get("name") == "aten::nonzero"] == [["_Outer"]]
    assert result.report.unattributed_events == 0, result.summary()


def test_pregraph_ops_of_a_dynamic_frame_are_its_own() -> None:
    """With dynamic shapes Dynamo's pregraph bytecode makes tensors (``aten::lift_fresh``) before
    the graph it prepares runs: they are the frame's ops, at its module stack, not unattributed."""
    workload = models.qwen2()
    result = profile_module(workload.model, *workload.args, call_kwargs=workload.kwargs, dynamic=True)
    pregraph = [e for e in result.trace["traceEvents"] if e.get("name") == "aten::lift_fresh"]
    assert pregraph, "no pregraph op: the test no longer covers what it is for"
    assert all(e["args"]["call_hierarchy"] == ["Qwen2ForCausalLM"] for e in pregraph), pregraph
    assert result.report.unattributed_events == 0, result.summary()


class _Relu(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x).relu()


class _LoopBreak(torch.nn.Module):
    """A graph break inside a loop: Dynamo runs ``forward`` eagerly and compiles each layer's frame."""

    def __init__(self, layer: type[torch.nn.Module]) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(layer() for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x) * 2.0
            torch._dynamo.graph_break()
            x = torch.tanh(x) + x.sin().cos()
        return x


def loop_break_model() -> tuple[torch.nn.Module, tuple[torch.Tensor]]:
    torch.manual_seed(0)
    return _LoopBreak(_Relu), (torch.randn(64, 32),)


def loop_break_linear_model() -> tuple[torch.nn.Module, tuple[torch.Tensor]]:
    """As above with plain ``nn.Linear`` layers, whose frames Dynamo skips: nothing is compiled."""
    torch.manual_seed(0)
    return _LoopBreak(lambda: torch.nn.Linear(32, 32)), (torch.randn(64, 32),)


def test_frame_run_eagerly_is_reported_with_its_time(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The eager ops are timed even inside the CLI's own per-iteration range (not a compiled region)."""
    torch._dynamo.reset()
    assert main(["--model", f"{__name__}:loop_break_model", "--out", str(tmp_path / "a")]) == 0
    out = capsys.readouterr().out
    warning = next(line for line in out.splitlines() if line.startswith("warning: Dynamo:"))
    assert "ran eagerly" in warning and "frames skipped: forward (" in warning and "graph break in loop" in warning
    eager_ms = float(warning.split("outside compiled regions: ")[1].split(" ms")[0])
    assert eager_ms > 0.0, warning  # tanh, sin, cos, mul of the eager forward
    assert "layers.1 (_Relu)" in out
    torch._dynamo.reset()
    assert main(["--model", f"{__name__}:loop_break_linear_model", "--out", str(tmp_path / "b")]) == 2
    err = capsys.readouterr().err
    assert "ran no kernel" in err and "ran eagerly" in err and "Traceback" not in err


def test_compiled_step_function_ops_outside_the_model() -> None:
    """``torch.compile(train_step)(model, x)``: the loss and the optimizer step are the step
    function's, not the model's; the model's ops keep the model's scopes."""
    torch._dynamo.reset()
    workload = models.nested()
    model, (x,) = workload.model, workload.args
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    criterion = torch.nn.MSELoss()  # a module, but not one of the model's

    def train_step(model: torch.nn.Module, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        loss = criterion(model(x), target)
        loss.backward()  # a graph break: the optimizer step runs in the resume function
        opt.step()
        opt.zero_grad()
        return loss

    hp = CallHierarchyProfiler(model)
    with hp:
        step = torch.compile(train_step)
        target = torch.ones(4, 4)
        step(model, x, target)
        with hp.profile() as prof:
            step(model, x, target)
            prof.step()
    result = hp.result
    assert result is not None and result.report.share >= 0.99, result.summary()
    check_tree_adds_up(result)
    outside = "train_step (outside the model)"
    assert scope_at(result.root, "layers.1 (Block)", "mlp (MLP)", "up (Linear)").total_count >= 1
    assert [depth for depth, node in result.root.walk() if node.label == outside] == [1]
    by_graph: dict[str, set[str]] = {}
    for sample in result.report.samples:
        kind = sample.attribution.graph.rsplit(" ", 1)[1]
        by_graph.setdefault(kind, set()).add(sample.attribution.scope[1] if len(sample.attribution.scope) > 1 else "")
    assert by_graph["inference"] == {outside}, by_graph  # the optimizer step
    assert outside in by_graph["forward"] and outside in by_graph["backward"]  # the loss and its gradient
    assert "head (Linear)" in by_graph["forward"]
    assert scope_at(result.root, outside, "criterion (MSELoss)").total_count >= 1


def test_compiled_function_run_outside_the_model() -> None:
    """An optimizer step compiled on its own and run after backward, while no module of the
    model runs: its kernels are outside the model (by the function Dynamo compiled), not the
    model's root's own."""
    torch._dynamo.reset()
    workload = models.nested()
    model, (x,) = workload.model, workload.args
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    hp = CallHierarchyProfiler(model)
    with hp:
        compiled = torch.compile(model)
        opt_step = torch.compile(opt.step)

        def train() -> None:
            opt.zero_grad(set_to_none=True)
            compiled(x).sum().backward()
            opt_step()

        train()
        with hp.profile() as prof:
            train()
            prof.step()
    result = hp.result
    assert result is not None and result.report.share >= 0.99, result.summary()
    check_tree_adds_up(result)
    tops: dict[str, set[str]] = {}  # graph kind -> the labels below the root of its kernels
    for sample in result.report.samples:
        scope = sample.attribution.scope
        tops.setdefault(sample.attribution.graph.rsplit(" ", 1)[1], set()).add(scope[1] if len(scope) > 1 else "")
    assert tops["inference"] == {"Adam.step (outside the model)"}, tops  # the optimizer step
    assert not any("outside the model" in label for label in tops["forward"] | tops["backward"]), tops
    assert scope_at(result.root, "layers.1 (Block)", "mlp (MLP)", "up (Linear)").total_count >= 1


def test_compiled_function_calling_a_module_of_the_model() -> None:
    """A compiled function that calls one of the model's modules, not the model
    (``torch.compile(fn)`` with ``fn`` calling ``model.layers[1]``): the module's kernels keep
    its scope; only the function's own go outside the model."""
    torch._dynamo.reset()
    workload = models.nested()
    model = workload.model
    hidden = torch.randn(4, 32)

    def run_layer(h: torch.Tensor) -> torch.Tensor:
        return model.layers[1](h).relu()

    hp = CallHierarchyProfiler(model)
    with hp, torch.no_grad():
        compiled = torch.compile(run_layer)
        compiled(hidden)
        with hp.profile() as prof:
            compiled(hidden)
            prof.step()
    result = hp.result
    assert result is not None and result.report.share >= 0.99, result.summary()
    assert scope_at(result.root, "layers.1 (Block)", "mlp (MLP)", "up (Linear)").total_count == 1
    labels = {node.label for _, node in result.root.walk()}
    assert "run_layer (outside the model)" in labels, labels  # its relu (fused or not): the function's


def test_another_models_graphs_are_outside_the_model() -> None:
    """Distillation: a compiled teacher of the student's architecture runs in the student's
    step.  No module of the (student) model runs then: the teacher's kernels are outside the
    model, not in the student's modules of the same paths."""
    torch._dynamo.reset()
    student, teacher = models.nested(), models.nested()
    (x,) = student.args
    hp = CallHierarchyProfiler(student.model)
    with hp:
        compiled_student, compiled_teacher = torch.compile(student.model), torch.compile(teacher.model)

        def step() -> None:
            student.model.zero_grad(set_to_none=True)
            with torch.no_grad():
                target = compiled_teacher(x)
            torch.nn.functional.mse_loss(compiled_student(x), target).backward()

        step()
        with hp.profile() as prof:
            step()
            prof.step()
    result = hp.result
    assert result is not None and result.report.share >= 0.99, result.summary()
    check_tree_adds_up(result)
    outside = f"{type(teacher.model).__name__} (outside the model)"
    tops: dict[str, set[str]] = {}  # graph kind -> the labels below the root of its kernels
    for sample in result.report.samples:
        scope = sample.attribution.scope
        tops.setdefault(sample.attribution.graph.rsplit(" ", 1)[1], set()).add(scope[1] if len(scope) > 1 else "")
    assert tops["inference"] == {outside}, tops  # the teacher's, every kernel
    assert outside not in tops["forward"] | tops["backward"], tops  # the student's
    # the student's Linear ran once in the iteration: the teacher's is not counted in it
    up = scope_at(result.root, "layers.1 (Block)", "mlp (MLP)", "up (Linear)")
    assert sum(count for op, (count, _) in up.ops.items() if not op.endswith("(bw)")) == 1, up.ops
    assert scope_at(result.root, outside, "layers.1 (Block)", "mlp (MLP)", "up (Linear)").total_count == 1


@pytest.mark.parametrize("shape", ["layers wrapped", "profiler given the compiled model"])
def test_torch_compile_wrapper_is_not_a_scope(shape: str) -> None:
    """``layers[i] = torch.compile(layer)`` (torchtitan's regional compilation) and
    ``CallHierarchyProfiler(torch.compile(model))``: torch.compile's ``OptimizedModule`` and its
    ``_orig_mod`` are not scopes; the layer is ``layers.1 (Block)``."""
    torch._dynamo.reset()
    workload = models.nested()
    model, (x,) = workload.model, workload.args
    if shape == "layers wrapped":
        for i, layer in enumerate(model.layers):
            model.layers.register_module(str(i), torch.compile(layer))
        run, hp = model, CallHierarchyProfiler(model)
    else:
        run = torch.compile(model)
        hp = CallHierarchyProfiler(run)
    with hp:
        run(x).sum().backward()
        with hp.profile() as prof:
            run(x).sum().backward()
            prof.step()
    result = hp.result
    assert result is not None and result.report.share >= 0.99, result.summary()
    assert result.root.label == type(model).__name__
    labels = {node.label for _, node in result.root.walk()}
    assert not any("OptimizedModule" in label or "_orig_mod" in label for label in labels), labels
    assert scope_at(result.root, "layers.1 (Block)", "mlp (MLP)", "up (Linear)").total_count >= 1


def test_code_compiled_before_the_profiler_is_reported() -> None:
    """Compiled code that Dynamo reuses from before ``with hp`` was not captured: with nothing
    else, a clear error; beside captured graphs, its ATen time is reported, not dropped."""
    from scripts.hierarchy_profiler.api import ProfileError

    torch._dynamo.reset()
    workload = models.nested()
    model, (x,) = workload.model, workload.args
    before = torch.compile(model)
    with torch.no_grad():
        before(x)
    hp = CallHierarchyProfiler(model)
    with hp, torch.no_grad(), pytest.raises(ProfileError, match="compiled before `with hp`"):
        with hp.profile() as prof:
            before(x)
            prof.step()

    torch._dynamo.reset()
    helper, y = torch.compile(_Relu()), torch.randn(2, 32)  # another module's code, compiled before
    with torch.no_grad():
        helper(y)
    hp = CallHierarchyProfiler(model)
    with hp, torch.no_grad():
        compiled = torch.compile(model)
        compiled(x)
        with hp.profile() as prof:
            compiled(x)
            helper(y)
            prof.step()
    result = hp.result
    assert result is not None and result.report.share == 1.0, result.summary()
    assert result.report.uncaptured_self_us > 0
    assert "not captured" in result.summary() and "compiled before `with hp`" in result.summary()


def _step_calling_the_model() -> Any:
    def step(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        return model(x).sum()  # the sum is the step function's: outside the model

    return step


class _Namesake:
    def step(self, y: torch.Tensor) -> torch.Tensor:  # same file, same name, another function
        return (y * y).sum()


def test_outside_function_told_apart_from_a_namesake() -> None:
    """A function outside the model is known by its code's file, first line and name: a compiled
    function of the same name in the same file, which does not call the model, is not taken for it."""
    torch._dynamo.reset()
    workload = models.nested()
    model, (x,) = workload.model, workload.args
    hp = CallHierarchyProfiler(model)
    with hp, torch.no_grad():
        step, namesake = torch.compile(_step_calling_the_model()), torch.compile(_Namesake().step)
        step(model, x)
        namesake(x)
        with hp.profile() as prof:
            step(model, x)
            namesake(x)
            prof.step()
    result = hp.result
    assert result is not None and result.report.share >= 0.99, result.summary()
    assert [g.kind for g in result.graphs] == ["inference", "inference"]
    tops: dict[str, set[str]] = {}  # graph -> the labels below the root of its kernels
    for sample in result.report.samples:
        scope = sample.attribution.scope
        tops.setdefault(sample.attribution.graph, set()).add(scope[1] if len(scope) > 1 else "")
    assert "step (outside the model)" in tops["graph 0 inference"], tops  # the step function's sum
    # the namesake runs outside the model on its own, not as the step function
    assert tops["graph 1 inference"] == {"_Namesake.step (outside the model)"}, tops


def test_profile_with_a_schedule_annotates_each_cycle() -> None:
    """``schedule(wait, warmup, active, repeat)``: each cycle's trace is annotated when it is ready,
    and its means are over the steps it recorded, not over every ``prof.step()``."""
    plain = profile("nested", iters=2)
    torch._dynamo.reset()
    workload = models.nested()
    hp = CallHierarchyProfiler(workload.model)
    with hp, torch.no_grad():
        compiled = torch.compile(workload.model)
        compiled(*workload.args)
        schedule = torch.profiler.schedule(wait=1, warmup=1, active=2, repeat=2)
        with hp.profile(schedule=schedule) as prof:
            for _ in range(9):  # two cycles of 4 steps, then one waiting step
                compiled(*workload.args)
                prof.step()
        assert [(r.iterations, r.report.graph_calls) for r in hp.results] == [(2, 2), (2, 2)]
        assert hp.result is hp.results[-1]
        assert hp.result.root.total_count == plain.root.total_count  # per iteration, as without a schedule


def _kernels_by_scope(result: ProfileResult) -> list[tuple[tuple[str, ...], str]]:
    return sorted((s.attribution.scope, s.attribution.kernel) for s in result.report.samples)


def test_with_stack_and_record_shapes_attributed_alike() -> None:
    """``hp.profile(with_stack=True, record_shapes=True)``, as profiler recipes do: the Python
    function events it adds (the generated code's ``call`` around the kernel calls) are looked
    through; every kernel gets the attribution it gets without them."""
    plain = profile("nested", train=True, iters=1)
    stacked = profile("nested", train=True, iters=1, with_stack=True, record_shapes=True)
    assert any(e.get("cat") == "python_function" for e in stacked.trace["traceEvents"])
    assert stacked.report.share >= 0.99, stacked.summary()
    assert stacked.report.unattributed_events == 0
    assert _kernels_by_scope(stacked) == _kernels_by_scope(plain)
    check_tree_adds_up(stacked)
    check_inside_scope_slices(stacked.trace)


def test_profile_outside_with_hp_is_a_clear_error() -> None:
    """``hp.profile()`` outside ``with hp:``: a one-line ProfileError before the profiler starts."""
    from scripts.hierarchy_profiler.api import ProfileError

    hp = CallHierarchyProfiler(models.nested().model)
    with pytest.raises(ProfileError, match=r"hp.profile\(\) must be used inside `with hp:`") as raised, hp.profile():
        pass
    assert "\n" not in str(raised.value)
    assert not torch.autograd.profiler._is_profiler_enabled


def test_forgotten_prof_step_is_warned() -> None:
    """Three iterations in one ``hp.profile()`` without ``prof.step()`` are one "iteration" to the
    means: warned; not when the steps are called, nor with ``iterations=``."""
    import warnings

    torch._dynamo.reset()
    workload = models.nested()
    hp = CallHierarchyProfiler(workload.model)

    def run(steps: bool, **kwargs: Any) -> list[str]:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with hp.profile(**kwargs) as prof:
                for _ in range(3):
                    compiled(*workload.args)
                    if steps:
                        prof.step()
        return [str(w.message) for w in caught if "prof.step()" in str(w.message)]

    with hp, torch.no_grad():
        compiled = torch.compile(workload.model)
        compiled(*workload.args)
        forgotten = run(steps=False)
        assert len(forgotten) == 1 and "iterations=N" in forgotten[0], forgotten
        assert run(steps=True) == []
        assert hp.result is not None and len(hp.result.root.total_steps_ns or ()) == 3  # told apart
        assert run(steps=False, iterations=3) == []
        assert hp.result is not None and hp.result.iterations == 3


def test_on_trace_ready_handler_called_and_its_trace_annotated(tmp_path: Path) -> None:
    """A user's ``on_trace_ready`` (``tensorboard_trace_handler``) is called, with and without a
    schedule; the trace it exported is the one annotated (a second export of a profiler trace
    fails), and ``prof.export_chrome_trace`` after the profile writes the annotated trace."""
    torch._dynamo.reset()
    workload = models.nested()
    hp = CallHierarchyProfiler(workload.model)
    with hp, torch.no_grad():
        compiled = torch.compile(workload.model)
        compiled(*workload.args)
        handler = torch.profiler.tensorboard_trace_handler(str(tmp_path / "tb"), use_gzip=True)
        with hp.profile(on_trace_ready=handler) as prof:
            compiled(*workload.args)
            prof.step()
        assert len(list((tmp_path / "tb").glob("*.pt.trace.json.gz"))) == 1
        assert hp.result is not None and hp.result.report.share >= 0.99, hp.result.summary()
        prof.export_chrome_trace(str(tmp_path / "after.json"))
        after = json.loads((tmp_path / "after.json").read_text())
        assert after["callHierarchy"]["measured_iterations"] == 1
        assert any("call_hierarchy" in e.get("args", {}) for e in after["traceEvents"])
        schedule = torch.profiler.schedule(wait=0, warmup=1, active=1, repeat=2)
        handler = torch.profiler.tensorboard_trace_handler(str(tmp_path / "scheduled"))
        with hp.profile(schedule=schedule, on_trace_ready=handler) as prof:
            for _ in range(4):
                compiled(*workload.args)
                prof.step()
        assert len(list((tmp_path / "scheduled").glob("*.pt.trace.json"))) == 2
        assert [(r.iterations, r.report.graph_calls) for r in hp.results] == [(1, 1), (1, 1)]
        assert all(r.report.share >= 0.99 for r in hp.results)


def _sample(scope: tuple[str, ...], kernel: str, self_us: float, start_us: float = 0.0) -> Any:
    from scripts.hierarchy_profiler.annotate import Attribution, Sample

    when = {"start_us": start_us} if start_us else {}
    return Sample(Attribution(scope, kernel), self_us, self_us, **when)


def test_forward_and_backward_time_side_by_side() -> None:
    """A backward kernel counts under the scope of the forward ops it differentiates; the tree
    gives each scope's total in forward and backward parts (only where a backward ran)."""
    from scripts.hierarchy_profiler.annotate import Attribution, Sample
    from scripts.hierarchy_profiler.tree import build_tree, format_tree

    lin0 = ("Nested", "layers.0 (Block)")
    samples = [_sample(lin0, "cpp_fused_a_0", 30.0), _sample(("Nested", "layers.1 (Block)"), "cpp_fused_b_1", 10.0),
               Sample(Attribution(lin0, "cpp_fused_c_0 (bw)", True), 20.0, 20.0)]
    text = format_tree(build_tree(samples, 1, "Nested"), timed=True)
    header, _, *rows = text.splitlines()
    assert header.split()[8:] == ["fwd", "ms", "bw", "ms"], header
    by_label = {row.split()[0]: row.split()[-2:] for row in rows}
    assert by_label["Nested"] == ["0.040", "0.020"] and by_label["layers.0"] == ["0.030", "0.020"], rows
    assert by_label["layers.1"] == ["0.010", "0.000"], rows
    assert "bw ms" not in format_tree(build_tree(samples[:2], 1, "Nested"), timed=True)  # inference: no columns


class _CheckpointedBlock(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.gelu(self.proj(x))


class _Checkpointed(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList([_CheckpointedBlock(), _CheckpointedBlock()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
        return x


@pytest.mark.parametrize("fx_graph_cache", [False, True])
def test_recomputation_has_its_own_column(fx_graph_cache: bool) -> None:
    """Activation checkpointing recomputes each block's Linear in the backward: those kernel calls
    are the "re ms" column (and `(re)` ops, `call_hierarchy_recomputed` events), apart from the
    backward's and the forward's, the same from a warm FX graph cache entry as from a cold compile."""
    with torch._inductor.config.patch(fx_graph_cache=fx_graph_cache):
        if fx_graph_cache:  # warm: the entries of a first compile are what the profiled compile loads
            profile_steps(_Checkpointed(), (torch.randn(4, 8, requires_grad=True),), "inductor", train=True)
        result = profile_steps(_Checkpointed(), (torch.randn(4, 8, requires_grad=True),), "inductor", train=True)
    root = result.root
    assert root.total_re_ns > 0 and root.total_bw_ns > 0 and root.total_ns > root.total_bw_ns + root.total_re_ns
    recomputed = [(node.label, op) for _, node in root.walk() for op in node.ops if op.endswith(" (re)")]
    assert recomputed and all(label == "proj (Linear)" for label, _ in recomputed), recomputed
    re_us = sum(s.self_us for s in result.report.samples if s.attribution.recompute)
    assert root.total_re_ns / 1000 == pytest.approx(re_us)
    events = [e for e in result.trace["traceEvents"] if e.get("args", {}).get("call_hierarchy_recomputed")]
    assert events and all(e["args"].get("call_hierarchy_backward") for e in events)
    assert "re ms" in result.format_tree().splitlines()[0]


def test_objects_from_before_the_profile_are_frozen_during_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """What compiling left alive is kept out of the collections while the profile runs and is
    post-processed, and given back after; a process's own frozen objects are left frozen (neither
    collected, refrozen nor unfrozen: the freeze count itself drops whenever a frozen object is
    freed, so it is not compared)."""
    import gc

    from scripts.hierarchy_profiler.api import _frozen_gc

    assert gc.get_freeze_count() == 0
    before = object()  # noqa: F841 (alive before the profile)
    with _frozen_gc():
        assert gc.get_freeze_count() > 0
    assert gc.get_freeze_count() == 0
    gc.freeze()
    try:
        calls: list[str] = []
        monkeypatch.setattr(gc, "collect", lambda *args: calls.append("collect") or 0)
        monkeypatch.setattr(gc, "freeze", lambda: calls.append("freeze"))
        monkeypatch.setattr(gc, "unfreeze", lambda: calls.append("unfreeze"))
        with _frozen_gc():
            pass
        assert calls == []
    finally:
        monkeypatch.undo()
        gc.unfreeze()


def test_objects_post_processing_makes_are_frozen_with_the_heap(monkeypatch: pytest.MonkeyPatch) -> None:
    """Inside ``hp.profile()`` (which froze the heap), the parsed trace that post-processing makes
    is frozen too before the collector is enabled again, so no young collection scans its dicts;
    after the profile nothing is left frozen."""
    import gc

    from scripts.hierarchy_profiler import api

    frozen_at_enable: list[int] = []
    enable = gc.enable
    monkeypatch.setattr(gc, "enable", lambda: (frozen_at_enable.append(gc.get_freeze_count()), enable())[1])
    before: list[int] = []
    annotate = api.CallHierarchyProfiler._annotate
    monkeypatch.setattr(api.CallHierarchyProfiler, "_annotate",
                        lambda self, *args: (before.append(gc.get_freeze_count()), annotate(self, *args))[1])
    result = profile_steps(_Checkpointed(), (torch.randn(4, 8, requires_grad=True),), "aot_eager", train=True)
    monkeypatch.undo()
    events = len(result.trace["traceEvents"])
    assert len(before) == 1 and len(frozen_at_enable) == 1, (before, frozen_at_enable)
    assert frozen_at_enable[0] >= before[0] + events, (before, frozen_at_enable, events)
    assert gc.get_freeze_count() == 0 and gc.isenabled()


@torch.library.custom_op("call_hierarchy_test::mixed_mm", mutates_args=())
def _mixed_mm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """A Python custom op whose kernel runs ATen ops of its own (as transformers'
    ``grouped_mm_fallback``, an ``aten::mm`` per expert)."""
    out = x.new_zeros(x.size(0), w.size(1))
    for start in range(0, x.size(0), 2):
        torch.mm(x[start : start + 2], w, out=out[start : start + 2])
    return out


@_mixed_mm.register_fake
def _(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.size(0), w.size(1))


class _Experts(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(8, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _mixed_mm(x, self.w)


class _ExpertsThenHead(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.experts = _Experts()
        self.head = torch.nn.Linear(8, 8, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.experts(x).relu())


def test_custom_op_kernel_owns_the_ops_it_runs() -> None:
    """A Python custom op records no profiler event of its own on torch 2.15's fast path, so the
    ``aten::mm`` its kernel runs looked like the graph's next extern ``mm``, the head's: the
    head's scope went to the expert's op and the head's own ``mm`` went unattributed.  Profiled
    through the dispatcher, the op is an event around its ops, the expert's; the head keeps its
    ``mm``; the fast path is back after the profile."""
    op = torch.ops.call_hierarchy_test.mixed_mm.default
    assert op._is_pyobj_dispatcher_enabled()
    result = profile_module(_ExpertsThenHead().eval(), torch.randn(4, 8))
    assert result.report.unattributed_events == 0, result.summary()
    root = result.root
    assert kernels_under(scope_at(root, "experts (_Experts)")) == ["call_hierarchy_test::mixed_mm"]
    assert kernels_under(scope_at(root, "head (Linear)")) == ["aten::mm"]
    assert op._is_pyobj_dispatcher_enabled()


def test_scopes_outside_the_model_printed_beside_its_root() -> None:
    """``torch.compile(train_step)(model, batch)``: the step function's own scope is printed beside
    the model's root (tree, folded stacks, flame graph), not as a child of it; the model's root
    line counts only the model's kernels."""
    from scripts.hierarchy_profiler.output import folded_lines
    from scripts.hierarchy_profiler.tree import build_tree, format_tree

    outside = "train_step (outside the model)"
    samples = [_sample(("Nested", "layers.0 (Block)"), "cpp_fused_a_0", 30.0),
               _sample(("Nested", outside, "criterion (MSELoss)"), "cpp_fused_mse_1", 10.0)]
    root = build_tree(samples, 1, "Nested")
    lines = format_tree(root, timed=True).splitlines()[2:]
    assert [line.split("  ")[0] for line in lines if not line.startswith(" ")] == ["Nested", outside], lines
    model_line = next(line for line in lines if line.startswith("Nested "))
    assert model_line.split()[1:3] == ["1", "0.030"], model_line  # the model's kernel only
    folded = folded_lines(root, timed=False)
    assert f"{outside};criterion (MSELoss);cpp_fused_mse_1 1" in folded, folded
    assert not any(line.startswith(f"Nested;{outside}") for line in folded), folded


def test_profiling_another_instance_is_warned() -> None:
    """The profiler given one instance, another instance of the class compiled and run: a
    one-line warning naming the class; its scopes are printed at the top level."""
    import warnings

    torch._dynamo.reset()
    given, other = models.nested(), models.nested()
    hp = CallHierarchyProfiler(given.model)
    with hp, torch.no_grad():
        compiled = torch.compile(other.model)
        compiled(*other.args)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with hp.profile() as prof:
                compiled(*other.args)
                prof.step()
    messages = [str(w.message) for w in caught if "CallHierarchyProfiler" in str(w.message)]
    assert len(messages) == 1 and "the Nested given to CallHierarchyProfiler did not run" in messages[0], messages
    assert "\n" not in messages[0]
    assert hp.result is not None and hp.result.report.share >= 0.99
    lines = hp.result.format_tree().splitlines()[2:]
    assert any(line.startswith("Nested (outside the model) ") for line in lines), lines


def test_median_and_spread_unmoved_by_an_outlier_iteration() -> None:
    """Three identical layers over three iterations (``ProfilerStep#N`` ranges), one 8 ms outlier
    in one layer's second iteration: its mean is many times its siblings', its median is theirs."""
    from scripts.hierarchy_profiler.annotate import _nest, step_windows
    from scripts.hierarchy_profiler.api import _steps_of
    from scripts.hierarchy_profiler.tree import build_tree, format_tree

    # the trace's step ranges, among a device annotation of the same name (not the host's step) and
    # other events on two threads
    events = [{"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{i}", "pid": 1, "tid": 1,
               "ts": 1000.0 * i, "dur": 999.0 if i < 3 else 10.0} for i in range(4)]
    events[1:1] = [{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "tid": 1, "ts": 10.0, "dur": 5.0},
                   {"ph": "X", "cat": "gpu_user_annotation", "name": "ProfilerStep#0", "pid": 0, "tid": 7,
                    "ts": 20.0, "dur": 900.0},
                   {"ph": "i", "name": "marker", "pid": 1, "tid": 1, "ts": 30.0}]
    samples = []
    for step in range(3):
        for layer in range(3):
            slow = 8000.0 if (step, layer) == (1, 1) else 0.0
            samples.append(_sample(("Nested", f"layers.{layer} (Block)"), "cpp_fused_0", 100.0 + slow,
                                   1000.0 * step + 10.0 * layer))
    windows = step_windows(_nest(events))
    assert windows == [(0.0, 999.0), (1000.0, 1999.0), (2000.0, 2999.0), (3000.0, 3010.0)]
    steps = _steps_of(samples, windows, 3)
    assert steps == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert _steps_of(samples, windows, 2) is None  # three iterations ran: not two
    root = build_tree(samples, 3, "Nested", steps)
    layers = [root.children[f"layers.{i} (Block)"] for i in range(3)]
    assert layers[1].total_ns > 20 * layers[0].total_ns  # the mean
    assert [layer.median_ns for layer in layers] == [100_000.0] * 3
    assert layers[1].total_steps_ns == [100_000.0, 8_100_000.0, 100_000.0]
    text = format_tree(root, timed=True)
    assert "median ms" in text.splitlines()[0] and "total ms" in text.splitlines()[0]
    row = next(line for line in text.splitlines() if line.strip().startswith("layers.1 (Block)")).split()
    assert row[2:] == ["1", "2.767", "2.767", "93.3%", "0.100", "0.100", "8.100"], row
    assert "median ms" not in format_tree(build_tree(samples, 3, "Nested"), timed=True)  # iterations not known apart


def test_wrapper_calls_splits_bodies() -> None:
    source = "\n".join([
        "def repeated_subgraph0(args):",
        "    # [Provenance debug handles] cpp_fused_a_0:3",
        "    cpp_fused_a_0(x)",
        "    # [Provenance debug handles] extern_kernels.mm:4",
        "    extern_kernels.mm(x, y, out=z)",
        "def call(self, args):",
        "    # [Provenance debug handles] cpp_fused_b_1:1",
        "    cpp_fused_b_1(x)",
        "    buf = repeated_subgraph0([a, b])",
        "    buf2 = repeated_subgraph0([c, d])",
        "    # [Provenance debug handles] extern_kernels.mm:2",
        "    extern_kernels.mm(a, b, out=c)",
    ])
    calls = wrapper_calls(source, {"repeated_subgraph0"})
    assert calls["repeated_subgraph0"] == [("kernel", "cpp_fused_a_0:3"), ("kernel", "extern_kernels.mm:4")]
    assert calls[""] == [("kernel", "cpp_fused_b_1:1"), ("body", "repeated_subgraph0"),
                         ("body", "repeated_subgraph0"), ("kernel", "extern_kernels.mm:2")]


def test_trace_events_in_any_order_attributed_alike(monkeypatch: pytest.MonkeyPatch) -> None:
    """The profiler writes each thread's events in time order, and the nesting reads them in one
    pass; a trace in another order (edited, merged) is nested by time instead: every event gets the
    same attribution, and the same scope slices are added."""
    import copy

    from scripts.hierarchy_profiler import annotate as annotate_module
    from scripts.hierarchy_profiler import api

    runs: list[tuple[list[dict[str, Any]], list[dict[str, Any]], Any, Any]] = []

    def both_orders(doc: dict[str, Any], capture: Any) -> Any:
        events = doc["traceEvents"]
        # a stable sort on a hash of (start, duration): any order, but events that start and end
        # together (their nesting is their order in the trace) keep theirs
        order = sorted(range(len(events)), key=lambda i: hash((events[i].get("ts"), events[i].get("dur"))))
        assert order != list(range(len(events)))
        shuffled = {"traceEvents": [copy.deepcopy(events[i]) for i in order]}
        shuffled_report = annotate_module.annotate(shuffled, capture)
        report = annotate_module.annotate(doc, capture)
        n = len(order)
        unshuffled = [None] * n
        for k, i in enumerate(order):
            unshuffled[i] = shuffled["traceEvents"][k]
        runs.append((events[:n], unshuffled, report, shuffled_report))
        assert events[n:] and shuffled["traceEvents"][n:]
        slices = sorted(json.dumps(e, sort_keys=True) for e in events[n:])
        assert slices == sorted(json.dumps(e, sort_keys=True) for e in shuffled["traceEvents"][n:])
        return report

    monkeypatch.setattr(api, "annotate", both_orders)
    result = profile("nested-graph-break", train=True)
    assert result.report.share >= 0.99
    (events, unshuffled, report, shuffled_report), = runs
    assert sum("call_hierarchy" in e.get("args", {}) for e in events) > 100
    assert events == unshuffled
    assert (shuffled_report.share, shuffled_report.unattributed_events) == (report.share, report.unattributed_events)
    assert sorted((s.attribution.scope, s.attribution.kernel) for s in shuffled_report.samples) == sorted(
        (s.attribution.scope, s.attribution.kernel) for s in report.samples)


def test_trace_json_same_values_with_orjson_json_or_neither(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """jsonio: orjson (pinned) and json give the same values; what orjson refuses or would change goes to json."""
    import math

    from scripts.hierarchy_profiler import jsonio

    assert jsonio.orjson is not None  # requirements.txt pins it: the fast path is what runs here
    data = (b'{"traceEvents": [{"ph": "X", "ts": 4650338959230.193, "dur": 1.001, "name": "aten::mm \\u00e9",'
            b' "args": {"Ev Idx": 18446744073709551615, "x": -0.0, "y": 1e-07, "z": 1e16}}], "n": null}')
    value, strict = jsonio.loads(data)
    assert strict and value == json.loads(data)
    assert [type(v) for v in value["traceEvents"][0]["args"].values()] == [int, float, float, float]
    assert json.loads(jsonio.dumps(value, strict)) == value
    nan, strict = jsonio.loads(b'{"a": NaN, "b": [Infinity]}')  # not strict JSON: json parses it, and writes it
    assert not strict and math.isnan(nan["a"]) and jsonio.dumps(nan, strict) == b'{"a": NaN, "b": [Infinity]}'
    assert jsonio.dumps({1: 2**70}, True) == json.dumps({1: 2**70}).encode()  # orjson refuses: json writes it
    (tmp_path / "trace.json").write_bytes(data)  # a file (the profiler's export), mapped: the same values
    (tmp_path / "nan.json").write_bytes(b'{"a": NaN, "b": [Infinity]}')
    assert jsonio.load(tmp_path / "trace.json") == (value, True)
    assert str(jsonio.load(tmp_path / "nan.json")) == str((nan, False))
    monkeypatch.setattr(jsonio, "orjson", None)  # a venv without orjson: json does everything, same values
    assert jsonio.loads(data) == (value, False)
    assert jsonio.load(tmp_path / "trace.json") == (value, False)
    assert jsonio.dumps(value, True) == json.dumps(value).encode()


def test_unknown_entry_type_renders_its_label() -> None:
    class Future:
        TYPE = "region"

        def label(self, parent_path: str = "") -> str:
            return "region<decoder>"

    class Broken:
        def label(self, parent_path: str = "") -> str:
            raise RuntimeError("no label")

        def __str__(self) -> str:
            return "broken-entry"

    model = models.nested().model
    scopes = RuntimeScopes(model)
    hierarchy = (Future(), Broken())
    labels = scopes.absolute(("layers.1",), hierarchy)
    assert labels == ("Nested", "layers.1 (Block)", "region<decoder>", "broken-entry")
    assert scopes.absolute(("layers.1",), hierarchy) is labels  # remembered
    scopes.clear_caches()
    again = scopes.absolute(("layers.1",), hierarchy)
    assert again == labels and again is not labels  # computed anew


# --------------------------------------------------------------------------- the API from a user's script


def test_api_from_a_user_script(tmp_path: Path) -> None:
    script = tmp_path / "user_script.py"
    script.write_text(f"""
import sys, torch
sys.path.insert(0, {str(REPO)!r})
from scripts.hierarchy_profiler import CallHierarchyProfiler

model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
x = torch.randn(4, 8)
hp = CallHierarchyProfiler(model)
with hp:
    compiled = torch.compile(model)
    compiled(x)
    with hp.profile() as prof:
        for _ in range(2):
            compiled(x)
            prof.step()
print(hp.result.format_tree())
print(hp.result.summary())
hp.result.save({str(tmp_path / "out")!r})
""")
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "0 (Linear)" in proc.stdout and "2 (Linear)" in proc.stdout
    assert attributed_share(proc.stdout) >= 99.0
    assert (tmp_path / "out" / "trace.json").is_file()


def test_api_from_a_script_in_another_directory(tmp_path: Path) -> None:
    """The README's one step: ``PYTHONPATH=<clone> <clone>/.venv/bin/python my_script.py``, run from
    the script's own directory (not the clone, no ``sys.path`` edit in the script)."""
    (tmp_path / "my_script.py").write_text("""
import torch
from scripts.hierarchy_profiler import CallHierarchyProfiler

model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
x = torch.randn(4, 8)
hp = CallHierarchyProfiler(model)
with hp:
    compiled = torch.compile(model, backend=hp.backend("aot_eager"))
    compiled(x)
    with hp.profile() as prof:
        compiled(x)
        prof.step()
print(hp.result.summary())
hp.result.save("out")
""")
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.run([str(REPO / ".venv" / "bin" / "python"), "my_script.py"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert attributed_share(proc.stdout) >= 99.0
    assert (tmp_path / "out" / "trace.json").is_file()


def test_backend_given_by_name_is_a_clear_error() -> None:
    """``torch.compile(model, backend="aot_eager")`` bypasses the capture: say so, not "ran no kernel"."""
    from scripts.hierarchy_profiler.api import ProfileError

    torch._dynamo.reset()
    workload = models.nested()
    hp = CallHierarchyProfiler(workload.model)
    with hp, torch.no_grad():
        compiled = torch.compile(workload.model, backend="aot_eager")
        compiled(*workload.args)
        with pytest.raises(ProfileError, match=r"compiled 1 graph\(s\) inside `with hp`, none through the profiler"):
            with hp.profile() as prof:
                compiled(*workload.args)
                prof.step()


# --------------------------------------------------------------------------- bad input


def run_cli(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "scripts.profile_hierarchy", *argv],
                          cwd=REPO, capture_output=True, text=True, timeout=600)


def test_refusals_before_compiling(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a_file = tmp_path / "a_file"
    a_file.write_text("keep me\n")
    cases = [
        (["--out", str(a_file)], "is not a directory"),
        (["--out", str(a_file / "sub")], "is not a directory"),
        (["--iters", "0"], "--iters must be at least 1"),
        (["--iters", "0", "--profile"], "--iters must be at least 1"),
        (["--depth", "0"], "--depth must be at least 1"),
        (["--warmup", "0", "--profile"], "--warmup must be at least 1"),
    ]
    for argv, message in cases:
        assert main(["--model", "no-such-model-is-built-first", *argv]) == 2, argv
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err, (argv, err)
    assert a_file.read_text() == "keep me\n"


def test_unwritable_out_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    # root passes permission checks: it cannot create files in /sys (a virtual file system)
    parent = Path("/sys") if os.geteuid() == 0 else locked
    try:
        assert main(["--model", "no-such-model-is-built-first", "--out", str(parent / "out")]) == 2
        err = capsys.readouterr().err
        assert f"{parent} is not writable" in err and "Traceback" not in err, err
    finally:
        locked.chmod(0o700)


def test_no_stale_outputs_and_one_line_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "trace.json").write_text("old")
    (out / "notes.txt").write_text("the user's file")
    (tmp_path / "user_models.py").write_text(
        "import torch\n"
        "def identity():\n    return torch.nn.Identity(), (torch.randn(2, 3),)\n"
        "class ArgMax(torch.nn.Module):\n"
        "    def __init__(self):\n        super().__init__()\n        self.lin = torch.nn.Linear(3, 4)\n"
        "    def forward(self, x):\n        return self.lin(x).argmax(-1)\n"
        "def argmax():\n    return ArgMax(), (torch.randn(2, 3),)\n"
        "def tiny():\n    return torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.ReLU()), (torch.randn(2, 3),)\n")
    env_path = f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"
    monkeypatch.setenv("PYTHONPATH", env_path)
    proc = run_cli("--model", "user_models:identity", "--out", str(out))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "ran no kernel" in proc.stderr and len(proc.stderr.strip().splitlines()[-1]) > 20
    proc = run_cli("--model", "user_models:argmax", "--train", "--out", str(out))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "no floating-point tensor" in proc.stderr
    assert (out / "trace.json").read_text() == "old"  # failed runs leave the earlier outputs alone
    proc = run_cli("--model", "user_models:tiny", "--backend", "aot_eager", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads((out / "trace.json").read_text())["callHierarchy"]["measured_iterations"] == 1
    assert (out / "notes.txt").read_text() == "the user's file"


USER_MODULE = ("import torch\n"
               "def factory():\n"
               "    return torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.ReLU()), (torch.randn(2, 3),)\n")


def test_cli_from_another_directory(tmp_path: Path) -> None:
    """``scripts/main.py`` run from the user's directory: their ``module:factory`` is imported from
    it (a ``scripts`` package of theirs does not shadow the repository's), a relative ``--out`` is
    relative to it; the default output directory is the repository's."""
    from scripts.hierarchy_profiler.cli import parser
    from scripts.main import child_command

    assert parser().parse_args([]).out == REPO / "build" / "profile_hierarchy"
    (tmp_path / "mymodule.py").write_text(USER_MODULE)
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "__init__.py").write_text("raise ImportError('the user\'s own scripts package')\n")
    argv, env = child_command(tmp_path, dict(os.environ))
    assert Path(argv[0]) == REPO / ".venv" / "bin" / "python"
    proc = subprocess.run([*argv, "--model", "mymodule:factory", "--backend", "aot_eager", "--out", "rel_out"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (tmp_path / "rel_out" / "trace.json").is_file()
    assert not (REPO / "rel_out").exists()


def test_train_without_parameters_and_ctrl_c_are_one_line_errors(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """``--train`` on a model with nothing to differentiate: a one-line error before compiling
    (an input that requires grad makes it work); Ctrl-C during the run: exit 130, one line."""
    (tmp_path / "free_models.py").write_text(
        "import torch\n"
        "def relu():\n    return torch.nn.ReLU(), (torch.randn(2, 3),)\n"
        "def relu_grad():\n    return torch.nn.ReLU(), (torch.randn(2, 3, requires_grad=True),)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    out = tmp_path / "out"
    assert main(["--model", "free_models:relu", "--train", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "--train" in err and "nothing to differentiate" in err and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1, err
    assert main(["--model", "free_models:relu_grad", "--train", "--backend", "aot_eager", "--out", str(out)]) == 0
    assert "-> 2 compiled graph(s)" in capsys.readouterr().out  # forward and backward

    def interrupted(spec: str) -> Any:
        raise KeyboardInterrupt

    monkeypatch.setattr(models, "build", interrupted)
    assert main(["--model", "free_models:relu", "--out", str(out)]) == 130
    err = capsys.readouterr().err
    assert err.strip().splitlines() == ["error: interrupted (Ctrl-C); nothing was written"], err


def test_unknown_model_is_a_clear_error() -> None:
    proc = run_cli("--model", "no-such-model")
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


def test_fullgraph_on_a_model_with_a_graph_break_is_one_line(tmp_path: Path) -> None:
    proc = run_cli("--model", "nested-graph-break", "--fullgraph", "--backend", "aot_eager", "--out", str(tmp_path / "o"))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --fullgraph: nested-graph-break has a graph break ("), (
        proc.stderr)
    assert "Traceback" not in proc.stderr and "without --fullgraph" in lines[0]


@pytest.mark.parametrize("model,train", [("nested", False), ("nested", True), ("qwen2-regional", True)])
def test_compile_caches_stay_on(model: str, train: bool) -> None:
    """The API keeps PyTorch's FX graph and AOTAutograd caches on. A warm AOTAutograd hit is
    attributed from the kernel scopes its graphs carry (patch 0019), as the cold compile was; one
    whose graphs have subgraphs (the regional model's shared layer body) is compiled from its FX
    graph cache entries; an entry written with the flag off (the flag is not in the cache key) is
    compiled again, and attributed all the same."""
    from torch._dynamo.utils import counters
    from torch._inductor.utils import fresh_cache

    def run() -> tuple[ProfileResult, dict[str, int]]:
        counters.clear()
        result = profile(model, train=train)
        assert result.report.share >= 0.99, result.summary()
        return result, {**counters["aot_autograd"], "fx_hit": counters["inductor"]["fxgraph_cache_hit"]}

    with fresh_cache():
        (cold, cold_hits), (warm, warm_hits) = run(), run()
    assert cold_hits.get("autograd_cache_hit", 0) == cold_hits["fx_hit"] == 0, cold_hits
    if model == "qwen2-regional":
        assert warm_hits.get("autograd_cache_bypass", 0) > 0 and warm_hits["fx_hit"] > 0, warm_hits
    else:
        assert warm_hits.get("autograd_cache_hit", 0) > 0, warm_hits
    assert counts_by_path(warm.root, True) == counts_by_path(cold.root, True)
    if model != "nested":
        return
    with fresh_cache():
        torch._dynamo.reset()
        plain = models.build(model)
        plain.model.train(train)
        with torch._inductor.config.patch({"trace.provenance_tracking_level": 1, "cpp.enable_kernel_profile": True}):
            compiled = torch.compile(plain.model)
            if train:
                plain.loss_of(compiled(*plain.args)).backward()  # the flag off: entries without scopes
            else:
                with torch.no_grad():
                    compiled(*plain.args)
        after_flag_off, hits = run()
    assert hits.get("autograd_cache_bypass", 0) > 0 and hits["fx_hit"] > 0, hits
    assert counts_by_path(after_flag_off.root, True) == counts_by_path(cold.root, True)


def test_nproc_trains_with_ddp_and_attributes_every_rank(tmp_path: Path) -> None:
    """``--nproc 2``: the model trained with DistributedDataParallel on two CPU processes (gloo), one
    tree with the median over ranks and the slowest rank, every rank's compiled kernel time
    attributed; folded stacks per rank."""
    out = tmp_path / "out"
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-P", "-m", "scripts.profile_hierarchy", "--nproc", "2", "--model",
                           "nested", "--out", str(out)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert "DistributedDataParallel on 2 processes (gloo)" in proc.stdout
    header = next(line for line in lines if line.startswith("scope"))
    assert "bw ms" in header and "slowest" in header
    for rank in (0, 1):
        assert any(line.startswith(f"rank {rank}: attributed: 100.00%") for line in lines), proc.stdout
    folded = (out / "hierarchy.folded").read_text().splitlines()
    assert {line.split(";", 1)[0] for line in folded} == {"rank 0", "rank 1"}
    assert any("(bw)" in line for line in folded)
    # DDP's gradient all-reduce runs outside the compiled graphs: a row of its own on every rank
    assert "communication" in proc.stdout.split("outside the compiled graphs", 1)[1], proc.stdout
    for rank in (0, 1):
        assert any(line.startswith(f"rank {rank};(outside compiled graphs);communication;c10d::allreduce_ ")
                   for line in folded), folded
    assert sorted(p.name for p in out.iterdir()) == ["flamegraph.svg", "hierarchy.folded", "hierarchy_us.folded",
                                                     "scopes.csv"]


_DDP_BUCKETS_OF_ONE_GRAPH = """
import json, sys, torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
sys.path.insert(0, sys.argv[1])
from scripts.hierarchy_profiler import CallHierarchyProfiler

class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = torch.nn.LayerNorm(256)
        self.lin1 = torch.nn.Linear(256, 512)
        self.lin2 = torch.nn.Linear(512, 256)

    def forward(self, x):
        return x + self.lin2(F.gelu(self.lin1(self.norm(x))))

class Blocks(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(Block() for _ in range(3))
        self.head = torch.nn.Linear(256, 4)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x)

dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
ddp = DistributedDataParallel(Blocks(), bucket_cap_mb=1)  # about a block a bucket
x = torch.randn(4, 256)
hp = CallHierarchyProfiler(ddp)
with hp:
    compiled = torch.compile(ddp)
    compiled(x).sum().backward()
    with hp.profile() as prof:
        compiled(x).sum().backward()
        prof.step()
from torch._dynamo.utils import counters
df = hp.result.to_dataframe()
print(json.dumps({"hits": counters["inductor"]["fxgraph_cache_hit"],
                  "fwd_ms": {row.scope[row.scope.index("layers."):]: row.fwd_ms for row in df.itertuples()
                             if "layers." in row.scope}}))
dist.destroy_process_group()
"""


def test_ddp_buckets_of_one_graph_attribute_each_block_its_kernels(tmp_path: Path) -> None:
    """DDPOptimizer compiles the buckets of one Dynamo graph in one tracing context; two of these
    blocks' buckets are the same graph, and one hits the FX-graph cache entry the other wrote in a
    cold process. Each block's Linears still have their own forward kernels (until patch 0019 gave
    each bucket its own digest, the second took the writer's scopes: layers.1's went to layers.0)."""
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", _DDP_BUCKETS_OF_ONE_GRAPH, str(REPO)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["hits"] >= 1, result
    for block in ("layers.0 (Block)", "layers.1 (Block)", "layers.2 (Block)"):
        for linear in ("lin1 (Linear)", "lin2 (Linear)"):
            assert result["fwd_ms"].get(f"{block} > {linear}", 0) > 0, (block, linear, result)


def test_fsdp_places_each_block_s_kernels_under_the_block_that_ran_them(tmp_path: Path) -> None:
    """``--nproc 2 --fsdp``: each block sharded with FSDP2 and compiled on its own; each kernel call is placed under the block that ran it, every rank attributes
    100%, and the all-gathers and reduce-scatters are communication rows."""
    out = tmp_path / "out"
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-P", "-m", "scripts.profile_hierarchy", "--nproc", "2", "--fsdp",
                           "--model", "nested", "--out", str(out)], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "FSDP2 (fully_shard), each block compiled, on 2 processes (gloo)" in proc.stdout
    for rank in (0, 1):
        assert any(line.startswith(f"rank {rank}: attributed: 100.00%") for line in proc.stdout.splitlines())
    folded = (out / "hierarchy.folded").read_text().splitlines()
    for rank in (0, 1):
        per_block = {}
        for block in ("layers.0 (FSDPBlock)", "layers.1 (FSDPBlock)"):
            prefix = f"rank {rank};FSDPNested;{block};"
            per_block[block] = sorted(line[len(prefix):] for line in folded if line.startswith(prefix))
        assert per_block["layers.0 (FSDPBlock)"], folded
        assert per_block["layers.0 (FSDPBlock)"] == per_block["layers.1 (FSDPBlock)"]
        assert any(line.startswith(f"rank {rank};FSDPNested;layers.0 (FSDPBlock);mlp (MLP);down (Linear);")
                   and "(bw)" in line for line in folded)
        collectives = {line.split(";")[3].rpartition(" ")[0] for line in folded
                       if line.startswith(f"rank {rank};(outside compiled graphs);communication;")}
        assert {"c10d::_allgather_base_", "c10d::_reduce_scatter_base_"} <= collectives, collectives


def test_ops_outside_the_compiled_graphs_are_their_own_tree() -> None:
    """The loss and the backward's seed run eagerly, outside the compiled graphs: rows of
    ``(outside compiled graphs) > eager ops``, never in the compiled graphs' tree or its share;
    Dynamo's guard checks are ``> torch.compile runtime``."""
    result = profile("nested", train=True)
    assert result.outside is not None and result.outside.label == "(outside compiled graphs)"
    eager = result.outside.children["eager ops"]
    assert "aten::sum" in eager.ops and "aten::ones_like" in eager.ops, sorted(eager.ops)
    assert "communication" not in result.outside.children
    # Dynamo's guard checks and the compiled region's own Python are torch.compile's, not eager ops
    runtime = result.outside.children["torch.compile runtime"]
    assert "TorchDynamo Cache Lookup" in runtime.ops, sorted(runtime.ops)
    assert not any(op.startswith(("TorchDynamo", "Torch-Compiled Region")) for op in eager.ops), sorted(eager.ops)
    assert all(s.attribution.scope[0] != "(outside compiled graphs)" for s in result.report.samples)
    assert "eager ops" in result.format_outside()


def test_fsdp_needs_several_processes(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--fsdp"]) == 2
    assert "--fsdp shards the model across processes: give --nproc 2 or more" in capsys.readouterr().err


def test_blocks_of_a_model_are_its_outermost_module_lists_modules() -> None:
    from scripts.hierarchy_profiler.distributed import blocks_of

    inner = torch.nn.ModuleList([torch.nn.Linear(2, 2)])
    outer = torch.nn.ModuleList([torch.nn.Sequential(torch.nn.Linear(2, 2)), torch.nn.ModuleDict({"l": inner})])
    model = torch.nn.Module()
    model.layers = outer
    model.head = torch.nn.Linear(2, 2)
    assert blocks_of(model) == list(outer)
    assert blocks_of(torch.nn.Linear(2, 2)) == []


def test_nproc_below_one_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--nproc", "0"]) == 2
    assert "--nproc must be at least 1" in capsys.readouterr().err


_WARM_PROCESS = """
import json, sys, torch
sys.path.insert(0, sys.argv[1])
from torch._dynamo.utils import counters
from test_profile_hierarchy import counts_by_path, profile
result = profile("nested", train=True)
assert result.aot_cache_hits == counters["aot_autograd"]["autograd_cache_hit"], result.aot_cache_hits
print(json.dumps({"share": result.report.share, "hits": result.aot_cache_hits,
                  "counts": sorted([list(k), v] for k, v in counts_by_path(result.root, True).items())}))
"""


def test_a_second_process_hits_the_caches_and_attributes_the_same(tmp_path: Path) -> None:
    """The same training profile run twice in two processes with one cache folder: the second
    loads its graphs from the AOTAutograd cache and gives the tree the first compiled."""
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "cache"), "PYTHONPATH": str(REPO),
           "OMP_NUM_THREADS": "1"}
    runs = []
    for _ in range(2):
        proc = subprocess.run([sys.executable, "-c", _WARM_PROCESS, str(REPO / "test_suite")], cwd=tmp_path,
                              env=env, capture_output=True, text=True, timeout=600, check=False)
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    cold, warm = runs
    assert cold["hits"] == 0 and warm["hits"] > 0, (cold["hits"], warm["hits"])
    assert cold["share"] >= 0.99 and warm["share"] >= 0.99
    assert warm["counts"] == cold["counts"]


def test_a_cache_entry_of_another_program_is_not_read() -> None:
    """A cache entry serves every program that compiles to its graph (the keys leave hierarchies
    out): its kernel scopes are read only in a compile whose hierarchies have the digest patch 0019
    keeps beside them (else the graph is compiled again, see ``Capture.aot_cache_hits``)."""
    import types

    import torch._inductor.debug as inductor_debug

    from scripts.hierarchy_profiler.capture import cached_provenance

    kernels = {"cpp_fused_relu_0:1": {"call_hierarchy": []}}
    compiled = types.SimpleNamespace(_kernel_call_hierarchies={"kernels": kernels, "program": "written"},
                                     source_code="def call(args):\n    pass\n")
    assert cached_provenance(compiled) is None  # no compile: no program to compare with
    context = torch._guards.TracingContext(None)
    with torch._guards.tracing(context):
        program = inductor_debug._ProgramCallHierarchies  # its digest, structure and hierarchies
        bucket = inductor_debug._ddp_bucket(context)  # -1: no DDPOptimizer bucket
        inductor_debug._program_call_hierarchies[context] = {bucket: program("written", "", [])}
        assert cached_provenance(compiled) == ({}, kernels)
        inductor_debug._program_call_hierarchies[context] = {bucket: program("another program", "", [])}
        assert cached_provenance(compiled) is None


def test_kernels_of_a_cache_entry_share_the_entries_of_a_scope() -> None:
    """A cache entry stores each kernel's scope as dicts: its kernels are given one entry object per
    distinct dict, as a compiled graph's kernels share their nodes' entries, so the labels of a
    24-layer model's kernels are made once per scope, not once per kernel (the attribution reads
    entries by identity)."""
    from scripts.hierarchy_profiler.capture import cached_kernel

    layer = {"type": "module", "attr": "0", "path": "layers.0", "class": "Block",
             "class_qualname": "m.Block", "count": 0}
    lin = {"type": "module", "attr": "lin", "path": "layers.0.lin", "class": "Linear",
           "class_qualname": "torch.nn.modules.linear.Linear", "count": 0}
    first = cached_kernel("cpp_fused_relu_0:1", {"call_hierarchy": [dict(layer), dict(lin)]})
    second = cached_kernel("cpp_fused_add_1:2", {"call_hierarchy": [dict(layer)],
                                                 "call_hierarchy_sources": [[dict(layer), dict(lin)]]})
    assert first.hierarchy[0] is second.hierarchy[0] is second.sources[0][0]
    assert first.hierarchy[1] is second.sources[0][1]
    assert [dict(e) for e in first.hierarchy] == [layer, lin]
    other = cached_kernel("cpp_fused_relu_2:3", {"call_hierarchy": [dict(layer, count=1)]})
    assert other.hierarchy[0] is not first.hierarchy[0] and dict(other.hierarchy[0])["count"] == 1


def test_profiler_modules_import_one_way() -> None:
    """The profiler is one pipeline (compile-time facts, trace, attribution, tree, outputs): no module
    imports, at its top or in a function, a module that imports it back, however indirectly."""
    import ast
    import graphlib

    package = Path(__file__).resolve().parent.parent / "scripts" / "hierarchy_profiler"
    names = {p.stem for p in package.glob("*.py")} - {"__init__"}
    graph: dict[str, set[str]] = {}
    for name in names:
        tree = ast.parse((package / f"{name}.py").read_text())
        imported: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                found = [node.module] if node.module else [alias.name for alias in node.names]
                imported.update(m for m in found if m in names)
        graph[name] = imported
    assert graph["cli"] >= {"api", "distributed", "profile_model"}, graph  # the walk sees what it must
    try:
        graphlib.TopologicalSorter(graph).static_order()
        cycle = None
    except graphlib.CycleError as e:
        cycle = e.args[1]
    assert cycle is None, f"modules that import each other: {' -> '.join(cycle)}"
