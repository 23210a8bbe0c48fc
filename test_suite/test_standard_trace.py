"""The profiler as a consumer of standard traces: PyTorch's ``inductor_trace_handler`` writes
``args["call_hierarchy"]`` into kernel events (patch 0019), from any training script with no
code of this project; ``--trace`` builds the tree, folded stacks and flame graph from that file."""

from __future__ import annotations

import copy
import hashlib
import importlib.util
import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

from scripts.hierarchy_profiler.standard_trace import (
    TraceError,
    profile_from_events,
    read_trace,
    scope_labels,
)
from scripts.hierarchy_profiler.tree import format_tree

ROOT = Path(__file__).resolve().parent.parent


def scaled(x: torch.Tensor) -> torch.Tensor:
    return torch.relu(x) * 2


class Layer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return scaled(self.proj(x)) + x.sin()


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([Layer(), Layer()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x.sum()


class CheckpointedNet(Net):
    """Net with each layer under activation checkpointing: its Linear runs again in the backward."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False)
        return x.sum()


def paths(root) -> dict[str, dict[str, float]]:
    """Scope path -> {kernel: calls per iteration}, below the root."""
    out = {}
    for _, scope, path in _walk(root, ()):
        out[" > ".join(path)] = {k: round(v[0], 6) for k, v in scope.ops.items()}
    return out


def _walk(node, path):
    yield 0, node, path
    for child in node.children.values():
        yield from _walk(child, (*path, child.label))


def profile_with_upstream_handler(out: Path, steps: int = 3, record: bool = True,
                                  model_class: type[Net] = Net, per_block: bool = False) -> Path:
    """What a user's own training script does: flag, upstream's handler, no code of this project
    (``per_block``: each of the model's layers compiled on its own, the model not)."""
    from torch._inductor.profiler import inductor_trace_handler

    torch._dynamo.reset()
    model = model_class()
    x = torch.randn(4, 8, requires_grad=True)
    with (torch._dynamo.config.patch(record_call_hierarchy=record),
          torch._inductor.config.patch({"trace.provenance_tracking_to_timeline": True,
                                        "cpp.enable_kernel_profile": True, "fx_graph_cache": False}),
          torch._functorch.config.patch(enable_autograd_cache=False)):
        if per_block:
            for layer in model.layers:
                layer.compile()
            compiled = model
        else:
            compiled = torch.compile(model)
        compiled(x).backward()
        # PyTorch's recipe: a schedule (whose steps are ProfilerStep#N ranges in the trace)
        schedule = torch.profiler.schedule(wait=0, warmup=1, active=steps, repeat=1)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], schedule=schedule,
                                    on_trace_ready=inductor_trace_handler(str(out))) as prof:
            for _ in range(steps + 1):
                compiled(x).backward()
                prof.step()
    (trace,) = out.glob("*.pt.trace.json")
    return trace


@pytest.fixture(scope="module")
def handler_trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return profile_with_upstream_handler(tmp_path_factory.mktemp("handler"))


def test_upstream_handler_trace_gives_the_scope_tree(handler_trace: Path) -> None:
    doc = json.loads(handler_trace.read_text())
    kernels = [e for e in doc["traceEvents"] if e.get("ph") == "X" and e["name"].startswith("graph_")]
    assert kernels and all("call_hierarchy" in e["args"] for e in kernels)
    profile = read_trace(handler_trace)
    assert profile.iterations == 3
    assert profile.without_hierarchy == 0
    tree = paths(profile.root)
    # forward and backward kernels of each layer's Linear, at the Linear (backward marked)
    for i in (0, 1):
        ops = tree[f"layers.{i} (Layer) > proj (Linear)"]
        assert ops.get("aten::addmm") == 1
        assert any(k.endswith(" (bw)") for k in ops)
    # every kernel call of the trace is in the tree, once per iteration
    calls = sum(sum(ops.values()) for ops in tree.values())
    annotated = [e for e in doc["traceEvents"] if e.get("ph") == "X" and "call_hierarchy" in e.get("args", {})]
    assert calls * profile.iterations == pytest.approx(len(annotated))
    text = format_tree(profile.root, timed=True, unit="kernel")
    assert "layers.1 (Layer)" in text and "median ms" in text
    # forward and backward side by side: the backward part is the time of the (bw) kernel calls
    assert text.splitlines()[0].split()[8:10] == ["fwd", "ms"] and "bw ms" in text.splitlines()[0]
    bw_us = sum(float(e["dur"]) for e in annotated if is_backward_call(doc, e)) / profile.iterations
    assert (profile.root.total_bw_ns + profile.root.total_re_ns) / 1000 == pytest.approx(bw_us)
    assert 0 < profile.root.total_bw_ns < profile.root.total_ns


def is_backward_call(doc: dict[str, Any], event: dict[str, Any]) -> bool:
    """A host event inside a ``CompiledFunctionBackward`` range of its thread."""
    return any(r.get("ph") == "X" and r.get("name") == "CompiledFunctionBackward" and r["tid"] == event["tid"]
               and r["ts"] <= event["ts"] <= r["ts"] + r["dur"] for r in doc["traceEvents"])


def test_trace_without_call_hierarchy_is_refused(tmp_path: Path) -> None:
    trace = profile_with_upstream_handler(tmp_path, steps=1, record=False)
    with pytest.raises(TraceError, match="record_call_hierarchy"):
        read_trace(trace)


def test_bad_trace_files_are_refused(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(TraceError, match="cannot read a JSON trace"):
        read_trace(bad)
    bad.write_text('{"events": []}')
    with pytest.raises(TraceError, match="no traceEvents"):
        read_trace(bad)
    with pytest.raises(TraceError, match="cannot read"):
        read_trace(tmp_path / "missing.json")
    bad.write_text('{"traceEvents": [], "callHierarchy": {}}')
    with pytest.raises(TraceError, match="annotated trace.json"):
        read_trace(bad)


def test_device_kernels_count_apart_and_backward_is_marked() -> None:
    # CUDA-shaped (no GPU needed): the handler annotates device kernels; their launch says
    # which host thread and iteration ran them, and whether in a backward graph call
    lin = [{"type": "module", "attr": "proj", "path": "proj", "class": "Linear",
            "class_qualname": "torch.nn.Linear", "count": 0}]

    def x(name, ts, dur, tid=1, cat="cpu_op", **args):
        return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur, "pid": 0, "tid": tid, "args": args}

    events = []
    for step, t0 in enumerate((0, 1000)):
        events += [
            x(f"ProfilerStep#{step}", t0, 900),
            x("Torch-Compiled Region: 0/0", t0 + 10, 300),
            x("cudaLaunchKernel", t0 + 20, 5, cat="cuda_runtime", correlation=10 + step),
            x("triton_poi_fused_0", t0 + 40, 3, tid=7, cat="kernel", correlation=10 + step, call_hierarchy=lin),
            x("CompiledFunctionBackward", t0 + 400, 300),
            x("cudaLaunchKernel", t0 + 420, 5, cat="cuda_runtime", correlation=20 + step),
            x("triton_poi_fused_1", t0 + 450, 2 if step == 0 else 20, tid=7, cat="kernel", correlation=20 + step,
              call_hierarchy=lin),
            x("triton_poi_fused_2", t0 + 460, 2, tid=7, cat="kernel", correlation=30 + step),
        ]
    profile = profile_from_events(events)
    assert profile.iterations == 2
    proj = profile.root.children["proj (Linear)"]
    assert proj.device_ops == {"triton_poi_fused_0 [device]": [1.0, 3000.0],
                               "triton_poi_fused_1 (bw) [device]": [1.0, 11000.0]}
    assert profile.device_kernels == 4 and profile.kernel_calls == 0
    # the unannotated kernel has no launch in the trace: not known to be a compiled graph's
    assert profile.without_hierarchy == 0


def test_cli_reads_a_trace_from_another_process(handler_trace: Path, tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "scripts.profile_hierarchy", "--trace", str(handler_trace),
                           "--out", str(tmp_path / "out")], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          check=False)
    assert proc.returncode == 0, proc.stderr
    assert "layers.1 (Layer)" in proc.stdout and "per iteration" in proc.stdout
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "flamegraph.svg", "hierarchy.folded", "hierarchy_us.folded", "scopes.csv"]
    folded = (tmp_path / "out" / "hierarchy.folded").read_text()
    assert "(compiled frame);layers.0 (Layer);proj (Linear);aten::addmm 1" in folded
    table = (tmp_path / "out" / "scopes.csv").read_text().splitlines()
    assert table[0].startswith("scope,depth,label,kernels,")
    assert any(row.startswith("(compiled frame) > layers.0 (Layer) > proj (Linear),2,") for row in table)


def test_forward_backward_and_recomputation_are_the_kernels_own_phases(tmp_path: Path) -> None:
    """On a checkpointed model, per scope: the forward column is the time of the forward's kernel
    events, the backward column that of the backward's that differentiate, the recomputation column
    that of those the handler marks as recomputing forward ops."""
    trace = profile_with_upstream_handler(tmp_path, model_class=CheckpointedNet)
    doc = json.loads(trace.read_text())
    profile = read_trace(trace)
    phases: dict[tuple[str, ...], list[float]] = {}
    for e in doc["traceEvents"]:
        args = e.get("args", {})
        if e.get("ph") != "X" or "call_hierarchy" not in args or e.get("cat") == "kernel":
            continue
        phase = 2 if args.get("call_hierarchy_recomputed") else 1 if is_backward_call(doc, e) else 0
        scope = (profile.root.label, *scope_labels(args["call_hierarchy"]))
        for depth in range(1, len(scope) + 1):
            phases.setdefault(scope[:depth], [0.0, 0.0, 0.0])[phase] += float(e["dur"]) / profile.iterations
    recomputed = [e for e in doc["traceEvents"] if e.get("args", {}).get("call_hierarchy_recomputed")]
    assert recomputed and all(is_backward_call(doc, e) for e in recomputed)
    for _, node, path in _walk(profile.root, ()):
        fwd, bw, re_ = phases[(profile.root.label, *path)]
        assert (node.total_ns - node.total_bw_ns - node.total_re_ns) / 1000 == pytest.approx(fwd)
        assert node.total_bw_ns / 1000 == pytest.approx(bw) and node.total_re_ns / 1000 == pytest.approx(re_)
    assert "re ms" in format_tree(profile.root, timed=True, unit="kernel").splitlines()[0]
    assert any(op.endswith(" (re)") for _, node, _ in _walk(profile.root, ()) for op in node.ops)


def test_scope_table_is_the_tree(handler_trace: Path, tmp_path: Path) -> None:
    """scopes.csv and to_dataframe() hold the tree's figures, one row per scope in the tree's order."""
    import pandas

    from scripts.hierarchy_profiler.output import SCOPE_COLUMNS, write_scope_table

    profile = read_trace(handler_trace)
    frame = profile.to_dataframe()
    assert list(frame.columns) == list(SCOPE_COLUMNS)
    nodes = {(profile.root.label, *path): node for _, node, path in _walk(profile.root, ())}
    assert len(frame) == len(nodes)
    for row in frame.itertuples():
        node = nodes[tuple(row.scope.split(" > "))]
        assert row.total_ms == node.total_ns / 1e6 and row.self_ms == node.self_ns / 1e6
        assert row.kernels == node.total_count and row.depth == row.scope.count(" > ")
        assert abs(row.fwd_ms + row.bw_ms + row.re_ms - row.total_ms) < 1e-9
        assert row.median_ms == node.median_ns / 1e6
    assert frame["bw_ms"].sum() > 0  # the trace is of a training step
    write_scope_table(tmp_path / "scopes.csv", profile.root)
    pandas.testing.assert_frame_equal(pandas.read_csv(tmp_path / "scopes.csv"), frame, check_dtype=False)


# --------------------------------------------------------------------------- flag off: upstream's output


def wheel_profiler() -> ModuleType:
    """torch 2.15.0's own torch/_inductor/profiler.py (the copy `install` keeps, checked by hash),
    loaded beside the patched one."""
    sp = Path(torch.__file__).resolve().parent.parent
    stamp = json.loads((sp / ".rfc0051-series" / "stamp.json").read_text())
    rel = "torch/_inductor/profiler.py"
    source = (sp / ".rfc0051-series" / "pristine" / rel).read_bytes()
    assert hashlib.sha256(source).hexdigest() == stamp["files"][rel]["pristine"]
    spec = importlib.util.spec_from_loader("wheel_inductor_profiler", loader=None)
    module = importlib.util.module_from_spec(spec)
    exec(compile(source, "wheel:" + rel, "exec"), module.__dict__)  # noqa: S102 (the wheel's own file)
    return module


def through(module: Any, trace: dict[str, Any], kernel_info: dict[str, Any]) -> bytes:
    from torch._inductor.debug import get_kernel_information_jsons

    jsons = get_kernel_information_jsons()
    jsons.clear()
    jsons.update(copy.deepcopy(kernel_info))
    try:
        return json.dumps(module._InductorTraceProcessor().add_to_chrome_trace(copy.deepcopy(trace)),
                          indent=1).encode()
    finally:
        jsons.clear()


def cuda_shaped_trace() -> tuple[dict[str, Any], dict[str, Any]]:
    """A compiled region launching a Triton kernel and an extern mm (flows link launches to kernels)."""
    def x(name, cat, ts, dur, tid=1, **args):
        return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur, "pid": 0, "tid": tid, "args": args}

    def flow(ph, id_, ts, tid):
        return {"ph": ph, "id": id_, "pid": 0, "tid": tid, "ts": ts, "cat": "ac2g", "name": "ac2g"}

    events = [x("Torch-Compiled Region: 0/0", "cpu_op", 0, 100), x("cudaLaunchKernel", "cuda_runtime", 10, 5),
              flow("s", 1, 10, 1), x("triton_poi_fused_add_0", "kernel", 20, 3, tid=7), flow("f", 1, 20, 7),
              x("aten::mm", "cpu_op", 30, 20), x("cudaLaunchKernel", "cuda_runtime", 35, 5), flow("s", 2, 35, 1),
              x("sm90_gemm", "kernel", 40, 9, tid=7), flow("f", 2, 40, 7)]
    lin = {"type": "module", "attr": "lin", "path": "lin", "class": "Linear", "class_qualname": "torch.nn.Linear",
           "count": 0}
    info = {str(("Torch-Compiled Region: 0/0", False)): {
        "triton_poi_fused_add_0:1": {"stack_traces": ["add"], "post_grad_nodes": ["add"],
                                     "call_hierarchy": [lin], "call_hierarchy_sources": [[lin], []]},
        "extern_kernels.mm:2": {"stack_traces": ["mm"], "post_grad_nodes": ["mm"], "call_hierarchy": [lin]}}}
    return {"traceEvents": events}, info


def without_call_hierarchy(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: without_call_hierarchy(v) for k, v in value.items()
                if k not in ("call_hierarchy", "call_hierarchy_sources", "call_hierarchy_candidates")}
    if isinstance(value, list):
        return [without_call_hierarchy(v) for v in value]
    return value


def test_handler_output_is_upstreams_where_no_kernel_has_a_call_hierarchy(tmp_path: Path) -> None:
    import torch._inductor.profiler as patched
    from torch._guards import CompileContext, CompileId, compile_context
    from torch._inductor.debug import register_kernel_call_hierarchies

    wheel = wheel_profiler()
    trace, info = cuda_shaped_trace()
    flag_off = without_call_hierarchy(info)
    upstream = through(wheel, trace, flag_off)
    assert b'"stack"' in upstream  # the device kernels were annotated
    # the stack pass is upstream's, whatever the kernel information holds
    assert through(patched, trace, flag_off) == upstream
    assert through(patched, trace, info) == through(wheel, trace, info)
    # no graph registered (flag off): the hierarchy pass writes the trace as it was
    assert patched._add_kernel_call_hierarchies(copy.deepcopy(trace)) == trace

    # flag on: a live graph of the region, named by its graph call's range, adds the keys
    # to its Triton kernel, its host mm and the device kernel that mm launched, and nothing else
    class Graph:
        _fx_graph_cache_key = "fkey"
        _kernel_call_hierarchies = {
            "kernels": {k: {key: v for key, v in i.items() if key.startswith("call_hierarchy")}
                        for k, i in info[str(("Torch-Compiled Region: 0/0", False))].items()},
            "calls_in_code_order": True}

    called = copy.deepcopy(trace)
    called["traceEvents"].insert(1, {"ph": "X", "name": "## Call CompiledFxGraph fkey ##", "cat": "cpu_op",
                                     "ts": 5, "dur": 90, "pid": 0, "tid": 1, "args": {}})
    graph = Graph()
    import torch._dynamo
    # a graph with hierarchies (a cache entry written with the flag on) registered by a process with the
    # flag off: nothing is registered, the trace is written as it was
    with compile_context(CompileContext(CompileId(frame_id=0, frame_compile_id=0))):
        register_kernel_call_hierarchies(graph, is_backward=False)
    assert patched._add_kernel_call_hierarchies(copy.deepcopy(called)) == called
    with (compile_context(CompileContext(CompileId(frame_id=0, frame_compile_id=0))),
          torch._dynamo.config.patch(record_call_hierarchy=True)):
        register_kernel_call_hierarchies(graph, is_backward=False)
    on = patched._add_kernel_call_hierarchies(copy.deepcopy(called))
    assert without_call_hierarchy(on) == called
    annotated = {e["name"] for e in on["traceEvents"] if "call_hierarchy" in e.get("args", {})}
    assert annotated == {"triton_poi_fused_add_0", "aten::mm", "sm90_gemm"}
    del graph  # the graph's hierarchies go with it
    assert patched._add_kernel_call_hierarchies(copy.deepcopy(called)) == called


# --------------------------------------------------------------------------- the same figures either way


def kernel_figures(root, skip_eager: bool = False) -> dict[tuple[str, ...], dict[str, tuple[float, float]]]:
    """Scope path below the root -> {kernel: (calls, ns) per iteration}."""
    out = {}
    for _, scope, path in _walk(root, ()):
        ops = {k: (round(v[0], 6), round(v[1], 3)) for k, v in scope.ops.items()
               if not (skip_eager and k.endswith(" (eager)"))}
        if ops:
            out[path] = ops
    return out


def test_tree_from_the_handler_trace_equals_the_profilers_own(tmp_path: Path) -> None:
    # One run, two consumers: the profiler's capture, and upstream's handler with the trace it writes
    from torch._inductor.profiler import inductor_trace_handler

    from scripts.hierarchy_profiler import CallHierarchyProfiler

    torch._dynamo.reset()
    model = Net()
    x = torch.randn(4, 8, requires_grad=True)
    hp = CallHierarchyProfiler(model)
    with hp, torch._inductor.config.patch({"trace.provenance_tracking_to_timeline": True}):
        compiled = torch.compile(model)
        compiled(x).backward()
        schedule = torch.profiler.schedule(wait=0, warmup=1, active=3, repeat=1)
        with hp.profile(schedule=schedule, on_trace_ready=inductor_trace_handler(str(tmp_path))) as prof:
            for _ in range(4):
                compiled(x).backward()
                prof.step()
    (trace,) = tmp_path.glob("*.pt.trace.json")
    from_trace = read_trace(trace)
    assert hp.result is not None and from_trace.iterations == hp.result.iterations == 3
    own = kernel_figures(hp.result.root, skip_eager=True)
    assert own and kernel_figures(from_trace.root) == own


def test_handler_trace_loads_in_holistic_trace_analysis(handler_trace: Path, tmp_path: Path) -> None:
    """HTA (a tool users have) reads the trace with the kernels' structured args.call_hierarchy."""
    from hta.common.trace import Trace

    (tmp_path / "rank0.json").write_text(handler_trace.read_text())
    trace = Trace(trace_dir=str(tmp_path))
    trace.parse_traces()
    df = trace.get_trace(0)
    symbols = trace.symbol_table.get_sym_table()
    labels = {symbols[i] for i in df["name"]}
    doc = json.loads(handler_trace.read_text())
    annotated = {e["name"] for e in doc["traceEvents"] if "call_hierarchy" in e.get("args", {})}
    assert annotated and annotated <= labels


def rewritten(trace: Path, out: Path, keep: Callable[[dict[str, Any]], bool],
              change: Callable[[dict[str, Any]], None] = lambda e: None) -> Path:
    doc = json.loads(trace.read_text())
    doc["traceEvents"] = [e for e in doc["traceEvents"] if keep(e)]
    for e in doc["traceEvents"]:
        change(e)
    out.write_text(json.dumps(doc))
    return out


def test_a_trace_without_profiler_steps_warns_that_times_are_totals(handler_trace: Path, tmp_path: Path) -> None:
    assert read_trace(handler_trace).stepped and read_trace(handler_trace).warnings() == []
    flat = rewritten(handler_trace, tmp_path / "flat.json", lambda e: not str(e.get("name", "")).startswith("ProfilerStep#"))
    profile = read_trace(flat)
    assert not profile.stepped and profile.iterations == 1
    assert "not means per iteration" in profile.warnings()[0]
    proc = subprocess.run([sys.executable, "-m", "scripts.profile_hierarchy", "--trace", str(flat), "--out",
                           str(tmp_path / "out")], cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr
    assert "totals over the whole trace" in proc.stdout and "warning: the trace has no ProfilerStep#N" in proc.stdout


def test_a_frame_compiled_for_each_block_is_said_to_merge_their_kernels(tmp_path: Path) -> None:
    """Each layer compiled on its own: one compiled frame runs for both, and the trace does not say
    which layer ran a kernel; the tree says so rather than presenting one layer's scopes as the
    model's (a whole-model compile, ``handler_trace``, gets no such warning)."""
    trace = profile_with_upstream_handler(tmp_path / "traces", per_block=True)
    profile = read_trace(trace)
    assert profile.repeated_frames == {"0/0": 2.0}
    (warning,) = profile.warnings()
    assert "0/0 2 times" in warning and "merged" in warning
    proc = subprocess.run([sys.executable, "-m", "scripts.profile_hierarchy", "--trace", str(trace), "--out",
                           str(tmp_path / "out")], cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr
    assert "warning: compiled frame(s) entered more than once per iteration (0/0 2 times)" in proc.stdout


def test_compiled_kernels_without_scopes_name_every_cause(handler_trace: Path, tmp_path: Path) -> None:
    """Flags on but graphs from a flag-off cache entry, or freed: the error does not only blame the flags."""
    stripped = rewritten(handler_trace, tmp_path / "stripped.json", lambda e: True,
                         lambda e: (e.get("args") or {}).pop("call_hierarchy", None))
    with pytest.raises(TraceError, match="kernel event.s. of compiled graphs are in it") as info:
        read_trace(stripped)
    assert "warm FX-graph or AOTAutograd cache" in str(info.value) and "were freed" in str(info.value)


# --------------------------------------------------------------------------- the way people run training

_TRAIN_TWICE = """
import json, os, re, sys
import torch
from torch._dynamo.utils import counters
from torch._inductor.profiler import inductor_trace_handler
from scripts.hierarchy_profiler import models

out = sys.argv[1]
torch._dynamo.config.record_call_hierarchy = True
torch._inductor.config.trace.provenance_tracking_to_timeline = True
torch._inductor.config.cpp.enable_kernel_profile = True
workload = models.qwen2(layers=2)
model = workload.model.train()
opt = torch.optim.SGD(model.parameters(), lr=0.01)
compiled = torch.compile(model)
schedule = torch.profiler.schedule(wait=1, warmup=1, active=1, repeat=2)
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], schedule=schedule,
                            on_trace_ready=inductor_trace_handler(out)) as prof:
    for _ in range(6):
        workload.loss_of(compiled(*workload.args, **workload.kwargs)).backward()
        opt.step()
        opt.zero_grad()
        prof.step()
print(json.dumps(counters["inductor"]["fxgraph_cache_hit"] + counters["aot_autograd"]["autograd_cache_hit"]))
"""


def compiled_kernel_events(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """The host events of compiled kernels: C++ kernels and the extern matmuls."""
    return [e for e in doc["traceEvents"] if e.get("ph") == "X" and (
        re.fullmatch(r"(graph_\d+_)?cpp_\w+", e["name"]) or e["name"] in ("aten::addmm", "aten::mm", "aten::bmm"))]


def test_training_script_run_twice_annotates_every_kernel_of_every_trace(tmp_path: Path) -> None:
    """A user's training script, PyTorch's compile caches at their defaults, profiled periodically
    (``schedule(..., repeat=2)``), run twice: the second process hits the FX-graph and AOTAutograd
    caches. Every compiled kernel event of all four traces carries its scope, the same in both;
    ``--trace`` reads a process's two traces as one profile."""
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "cache"),
           "PYTHONPATH": str(ROOT)}
    runs = []
    for run in ("cold", "warm"):
        out = tmp_path / run
        proc = subprocess.run([sys.executable, "-c", _TRAIN_TWICE, str(out)], env=env, capture_output=True,
                              text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        hits = json.loads(proc.stdout.strip().splitlines()[-1])
        traces = [json.loads(p.read_text()) for p in sorted(out.glob("*.pt.trace.json"))]
        assert len(traces) == 2, run
        runs.append((hits, [[(e["name"], e["args"].get("call_hierarchy")) for e in compiled_kernel_events(t)]
                            for t in traces]))
    (cold_hits, cold), (warm_hits, warm) = runs
    assert cold_hits == 0 and warm_hits > 0
    for events in (*cold, *warm):
        assert len(events) > 20
        assert [name for name, h in events if h is None] == []
    assert warm == cold and cold[0] == cold[1]
    # The two traces of a process are its profile, averaged, not two ranks; each run is a process.
    from scripts.hierarchy_profiler.standard_trace import RankedProfile, read_traces

    one = read_traces([tmp_path / "cold"])
    assert isinstance(one, RankedProfile) and len(one.ranks) == 1 and one.traces == 2
    assert len(read_traces([tmp_path / "cold", tmp_path / "warm"]).ranks) == 2


# --------------------------------------------------------------------------- several ranks


def as_rank(trace: Path, out: Path, rank: int, scale: float) -> Path:
    """A copy of ``trace`` as rank ``rank`` wrote it, its events ``scale`` times as long."""
    doc = json.loads(trace.read_text())
    doc["distributedInfo"] = {"backend": "gloo", "rank": rank, "world_size": 2}
    for event in doc["traceEvents"]:
        if "dur" in event:
            event["dur"] = event["dur"] * scale
    path = out / f"rank{rank}.pt.trace.json"
    path.write_text(json.dumps(doc))
    return path


def test_traces_of_several_ranks_give_one_tree_with_the_slowest_rank(handler_trace: Path, tmp_path: Path) -> None:
    from scripts.hierarchy_profiler.output import folded_lines, scope_rows
    from scripts.hierarchy_profiler.standard_trace import RankedProfile, read_traces
    from scripts.hierarchy_profiler.tree import slowest_rank

    # rank 1 is three times as slow; the files' order is not the ranks'
    slow = as_rank(handler_trace, tmp_path, 1, 3.0)
    fast = as_rank(handler_trace, tmp_path, 0, 1.0)
    profile = read_traces([tmp_path])  # a directory, as each rank's handler writes into it
    assert isinstance(profile, RankedProfile) and sorted(profile.ranks) == [0, 1]
    assert read_traces([slow, fast]).ranks.keys() == profile.ranks.keys()
    one = {rank: read_trace(path).root for rank, path in ((0, fast), (1, slow))}
    assert paths(profile.ranks[0]) == paths(one[0]) and paths(profile.ranks[1]) == paths(one[1])
    merged, fast_paths = paths(profile.root), paths(one[0])
    assert merged.keys() == fast_paths.keys()

    def check(node: Any, fast_node: Any) -> None:
        # the median of t and 3t is 2t; the slowest rank is 1, with 3t
        assert node.total_ns == pytest.approx(2 * fast_node.total_ns)
        assert node.total_count == fast_node.total_count
        if fast_node.total_ns > 0:
            assert slowest_rank(node) == (1, pytest.approx(3 * fast_node.total_ns))
        for label, child in node.children.items():
            check(child, fast_node.children[label])

    check(profile.root, one[0])
    printed = format_tree(profile.root, timed=True, unit="kernel")
    assert "slowest" in printed.splitlines()[0] and "rank 1" in printed
    # the table names the slowest rank of each scope
    rows = {row["scope"]: row for row in scope_rows(profile.root)}
    assert rows["(compiled frame) > layers.0 (Layer) > proj (Linear)"]["slowest_rank"] == 1
    # folded stacks and the flame graph carry the rank
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "scripts.profile_hierarchy", "--trace", str(slow), str(fast),
                           "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr
    assert "2 rank(s)" in proc.stdout and "slowest" in proc.stdout
    folded = (out / "hierarchy.folded").read_text().splitlines()
    assert {line.split(";", 1)[0] for line in folded} == {"rank 0", "rank 1"}
    rank0 = [line.split(";", 1)[1] for line in folded if line.startswith("rank 0;")]
    assert [line for line in rank0 if not line.startswith("(outside compiled graphs);")] == folded_lines(one[0], False)
    assert "rank 1" in (out / "flamegraph.svg").read_text()


def test_ranks_are_read_from_a_directory_of_traces_only(tmp_path: Path) -> None:
    from scripts.hierarchy_profiler.standard_trace import read_traces

    (tmp_path / "notes.txt").write_text("not a trace")
    with pytest.raises(TraceError, match="no trace file"):
        read_traces([tmp_path])


TORCHRUN_SCRIPT = '''
import os, sys
import torch
import torch.distributed as dist
from torch._inductor.profiler import inductor_trace_handler
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, {root!r})
from test_suite.test_standard_trace import Net

dist.init_process_group("gloo")
torch._dynamo.config.record_call_hierarchy = True
torch._inductor.config.trace.provenance_tracking_to_timeline = True
torch._inductor.config.cpp.enable_kernel_profile = True
torch.manual_seed(0)
model = torch.compile(DistributedDataParallel(Net()))
x = torch.randn(4, 8)
model(x).backward()
schedule = torch.profiler.schedule(wait=0, warmup=1, active=2, repeat=1)
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], schedule=schedule,
                            on_trace_ready=inductor_trace_handler({out!r})) as prof:
    for _ in range(3):
        model(x).backward()
        prof.step()
dist.destroy_process_group()
'''


FSDP_SCRIPT = '''
import sys
import torch
import torch.distributed as dist
from torch._inductor.profiler import inductor_trace_handler
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

sys.path.insert(0, {root!r})
from scripts.hierarchy_profiler import models

dist.init_process_group("gloo")
torch._dynamo.config.record_call_hierarchy = True
torch._inductor.config.trace.provenance_tracking_to_timeline = True
torch._inductor.config.cpp.enable_kernel_profile = True
workload = models.build("nested")


class OtherBlock(models.Block):  # a block class of its own: its forward is a compiled frame of its own
    def forward(self, x):
        return x + self.mlp(self.norm(x))


if {other_block!r}:
    workload.model.layers[1].__class__ = OtherBlock
mesh = init_device_mesh("cpu", (dist.get_world_size(),))
for layer in workload.model.layers:  # torchtitan's shape: each block sharded and compiled on its own
    fully_shard(layer, mesh=mesh)
    layer.compile()
model = fully_shard(workload.model, mesh=mesh)
model(*workload.args).sum().backward()
schedule = torch.profiler.schedule(wait=0, warmup=1, active=2, repeat=1)
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], schedule=schedule,
                            on_trace_ready=inductor_trace_handler({out!r})) as prof:
    for _ in range(3):
        model(*workload.args).sum().backward()
        prof.step()
dist.destroy_process_group()
'''


@pytest.mark.parametrize("other_block", [False, True], ids=["one-frame", "a-frame-per-block-class"])
def test_fsdp2_blocks_compiled_each_are_placed_by_fsdp_s_ranges(tmp_path: Path, other_block: bool) -> None:
    """FSDP2 with each block compiled on its own, launched with torchrun on 2 CPU processes: one
    compiled frame serves both blocks (or, the second block of a class of its own, each has its
    frame, whose scopes are as relative to its block), and each kernel call (forward and backward)
    is placed under the block whose FSDP2 hook range precedes it."""
    from scripts.hierarchy_profiler.standard_trace import RankedProfile, read_traces

    out = tmp_path / "traces"
    script = tmp_path / "train.py"
    script.write_text(FSDP_SCRIPT.format(root=str(ROOT), out=str(out), other_block=other_block))
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCHINDUCTOR_FX_GRAPH_CACHE="0", TORCHINDUCTOR_AUTOGRAD_CACHE="0")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600,
                          check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    profile = read_traces([out])
    assert isinstance(profile, RankedProfile) and sorted(profile.ranks) == [0, 1]
    for tree in profile.ranks.values():
        assert sorted(tree.children) == ["layers.0 (FSDP block)", "layers.1 (FSDP block)"], sorted(tree.children)
        first, second = (paths(tree.children[f"layers.{i} (FSDP block)"]) for i in (0, 1))
        assert any(" (bw)" in op for ops in first.values() for op in ops), first
        assert first["mlp (MLP) > up (Linear)"] == second["mlp (MLP) > up (Linear)"], (first, second)
        if other_block:  # each block its own kernels: the second's norm is not fused with a tanh
            assert any("tanh" in op for op in first[""]) and not any("tanh" in op for op in second[""]), (first, second)
        else:
            assert first == second, (first, second)
    assert profile.repeated_frames == ({} if other_block else {"0/0": 2.0})
    if not other_block:
        assert profile.placed_in_blocks == 2 * 2 * 24  # 2 ranks, 2 iterations, 24 kernel calls each
    (warning,) = profile.warnings()
    assert "placed under the FSDP2 block" in warning


def test_torchrun_job_traces_give_every_rank_the_same_scopes(tmp_path: Path) -> None:
    """A DDP training script, launched with torchrun on 2 CPU processes (gloo), profiled with
    PyTorch's handler on each rank and no code of this project: one tree, scope for scope each
    rank's own."""
    from scripts.hierarchy_profiler.standard_trace import RankedProfile, read_traces

    out = tmp_path / "traces"
    script = tmp_path / "train.py"
    script.write_text(TORCHRUN_SCRIPT.format(root=str(ROOT), out=str(out)))
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCHINDUCTOR_FX_GRAPH_CACHE="0", TORCHINDUCTOR_AUTOGRAD_CACHE="0")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600,
                          check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    profile = read_traces([out])
    assert isinstance(profile, RankedProfile) and sorted(profile.ranks) == [0, 1]
    scopes = {rank: paths(tree).keys() for rank, tree in profile.ranks.items()}
    assert scopes[0] == scopes[1] == paths(profile.root).keys()
    assert any("layers.1 (Layer)" in scope for scope in scopes[0])
    assert all(profile.kernel_calls[rank] > 0 for rank in (0, 1))
    # DDP's gradient all-reduce, outside the compiled graphs, is a communication row of each rank
    for rank in (0, 1):
        communication = profile.outside[rank].children["communication"]
        assert "c10d::allreduce_" in communication.ops and communication.total_ns > 0, communication.ops
    # HolisticTraceAnalysis reads the same traces: each C++ kernel of its breakdown of a rank is a
    # kernel of that rank's tree, which says its scope
    from hta.trace_analysis import TraceAnalysis

    analysis = TraceAnalysis(trace_dir=str(out))
    assert sorted(analysis.t.traces) == [0, 1]
    for rank in (0, 1):
        frame = analysis.t.get_trace(rank)
        names = {analysis.t.symbol_table.sym_table[i] for i in frame["name"]}
        kernels = {re.sub(r"^graph_\d+_", "", name) for name in names if re.match(r"graph_\d+_cpp_", name)}
        assert kernels, names
        ops = {op.removesuffix(" (bw)").removesuffix(" (re)") for _, node, _ in _walk(profile.ranks[rank], ())
               for op in node.ops}
        assert kernels <= ops, kernels - ops
