"""Profile a tiny Llama-style training step on CUDA with inductor_trace_handler (RFC-0051 patch 0019) and
report, per trace, which device kernels carry call_hierarchy.

    python profile_cuda.py MODE OUTDIR      # MODE: a torch.compile mode or default; writes OUTDIR/*.json traces

``max-autotune-no-cudagraphs`` has Triton GEMM templates (``triton_tem_*``): ``template_scopes`` lists
the scope of each, which should be its Linear's (or its epilogue's module), not an outer one.
    python profile_cuda.py --report DIR...  # the report only, for traces written earlier
"""
from __future__ import annotations

import glob
import gzip
import json
import os
import sys
import time
from collections import Counter


def graph_call_kernels(events: list[dict]) -> list[dict]:
    calls = [e for e in events if e["name"].startswith("## Call CompiledFxGraph")]
    launches = {e["args"]["correlation"]: e for e in events
                if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
    out = []
    for k in events:
        launch = launches.get(k.get("args", {}).get("correlation"))
        if k.get("cat") != "kernel" or launch is None:
            continue
        if any(c["ts"] <= launch["ts"] <= c["ts"] + c["dur"] and c["tid"] == launch["tid"] for c in calls):
            out.append(k)
    return out


def scope_path(event: dict) -> str:
    """An annotated event's scope: the paths and names of its entries (module paths are absolute)."""
    entries = event["args"]["call_hierarchy"]
    modules = [d["path"] for d in entries if d.get("type") == "module"]
    functions = [f"{d['name']}#{d['count']}" for d in entries if d.get("type") == "function"]
    return " > ".join(modules[-1:] + functions) or "<root>"


def report(path: str) -> dict:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        trace = json.load(f)
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    kernels = [e for e in events if e.get("cat") == "kernel"]
    in_calls = graph_call_kernels(events)
    has = lambda e: "call_hierarchy" in e.get("args", {})  # noqa: E731
    triton = [k for k in kernels if k["name"].startswith("triton_")]
    templates = [k for k in kernels if k["name"].startswith("triton_tem_")]
    host_triton = [e for e in events if e.get("cat") == "cpu_op" and e["name"].startswith("triton_")]
    externs = [e for e in events if e.get("cat") == "cpu_op" and e["name"].startswith("aten::")
               and any(c["ts"] <= e["ts"] <= c["ts"] + c["dur"] and c["tid"] == e["tid"]
                       for c in events if c["name"].startswith("## Call CompiledFxGraph"))]
    return {
        "trace": os.path.basename(path),
        "steps": sum(1 for e in events if e["name"].startswith("ProfilerStep#")),
        "graph_calls": sum(1 for e in events if e["name"].startswith("## Call CompiledFxGraph")),
        "cudaGraphLaunch": sum(1 for e in events if e["name"] == "cudaGraphLaunch"),
        "device_kernels": [len(kernels), sum(map(has, kernels))],
        "graph_call_kernels": [len(in_calls), sum(map(has, in_calls))],
        "triton_device": [len(triton), sum(map(has, triton))],
        "triton_host": [len(host_triton), sum(map(has, host_triton))],
        "aten_ops_in_graph_calls": [len(externs), sum(map(has, externs))],
        "triton_templates": [len(templates), sum(map(has, templates))],
        "template_scopes": sorted(Counter(scope_path(k) for k in templates if has(k)).items()),
        "unannotated_in_calls": Counter(k["name"][:60] for k in in_calls if not has(k)).most_common(8),
        "unannotated_device": Counter(k["name"][:60] for k in kernels if not has(k)).most_common(8),
        "sample": sorted({(k["name"][:40], " > ".join(f"{d.get('attr') or d.get('name')}" for d in k["args"]["call_hierarchy"]))
                          for k in kernels if has(k)})[:12],
    }


def model_and_step(mode: str):
    import torch

    torch.manual_seed(0)
    try:
        from transformers import LlamaConfig, LlamaForCausalLM

        cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
        model = LlamaForCausalLM(cfg).cuda()
        ids = torch.randint(0, 128, (2, 16), device="cuda")
        print("model: transformers LlamaForCausalLM (2 layers)", flush=True)

        def loss(m):
            return m(input_ids=ids, labels=ids).loss
    except Exception as e:  # noqa: BLE001
        print("transformers unavailable:", repr(e)[:200], "; a torch-only model", flush=True)

        class Block(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.norm = torch.nn.RMSNorm(64)
                self.qkv = torch.nn.Linear(64, 192)
                self.mlp = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.SiLU(), torch.nn.Linear(128, 64))

            def forward(self, x):
                q, k, v = self.qkv(self.norm(x)).view(2, 16, 3, 4, 16).unbind(2)
                a = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                                                     v.transpose(1, 2), is_causal=True)
                x = x + a.transpose(1, 2).reshape(2, 16, 64)
                return x + self.mlp(x)

        model = torch.nn.Sequential(Block(), Block()).cuda()
        xin = torch.randn(2, 16, 64, device="cuda")

        def loss(m):
            return m(xin).pow(2).mean()

    compiled = torch.compile(model, mode=None if mode == "default" else mode)
    return lambda: loss(compiled).backward()


def main() -> None:
    if sys.argv[1] == "--report":
        for d in sys.argv[2:]:
            for p in sorted(glob.glob(os.path.join(d, "*.json*"))):
                print(json.dumps(report(p)))
        return
    mode, out = sys.argv[1], sys.argv[2]
    import torch
    from torch._inductor.profiler import inductor_trace_handler

    torch._dynamo.config.record_call_hierarchy = True
    torch._inductor.config.trace.provenance_tracking_to_timeline = True
    step = model_and_step(mode)
    t = time.time()
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    print(f"{mode}: compile and 3 steps {time.time() - t:.1f} s", flush=True)
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    sched = torch.profiler.schedule(wait=1, warmup=1, active=1, repeat=2)
    with torch.profiler.profile(activities=acts, schedule=sched, on_trace_ready=inductor_trace_handler(out)) as prof:
        for _ in range(6):
            step()
            prof.step()
    for p in sorted(glob.glob(os.path.join(out, "*.json"))):
        print(json.dumps(report(p)), flush=True)


if __name__ == "__main__":
    main()
