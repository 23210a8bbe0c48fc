"""Compile-time overhead of node.meta["call_hierarchy"] (RFC-0051): instructions, wall clock, memory.

Usage (from a fresh clone, any Python 3.11; it builds its own environments under build/bench/):

    python3 -m scripts.benchmark_overhead --jobs 1 --bytecodes   # RFC.md's run (about 36 min): results/overhead/
    python3 -m scripts.benchmark_overhead            # faster (two valgrind processes at a time), less exact
    python3 -m scripts.benchmark_overhead --quick    # CI: tiny workloads, no valgrind, about 2 min once set up
    python3 -m scripts.benchmark_overhead --processes 3 --workloads llama_l1,bert_l1   # medians of 3 processes
    python3 -m scripts.benchmark_overhead --processes 3 --hash-seeds --workloads vit_l1   # 3 layouts per build
    python3 -m scripts.benchmark_overhead --workloads qwen2_l1,nested_modules_d1 --out /tmp/o   # a subset

Variants (``--variants``; default ``fixes,disabled,enabled``; ``unpatched,fixes,disabled,enabled`` adds the
fixes' own effect for about 5 more minutes):

* ``unpatched``      the pinned torch (``torch_version`` of ``patches/base.json``) as the wheel installed it
                     (build/bench/venv-wheel)
* ``fixes``          the flag-free upstream fixes only: the leading patches of ``patches/.patches`` whose
                     diff does not contain ``call_hierarchy`` (build/bench/venv-fixes, made with
                     ``python3 -m scripts.series setup --through <last fix>``); the baseline of "flag off"
* ``disabled``       the whole series (build/bench/venv-whole), ``record_call_hierarchy = False`` (the default)
* ``enabled``        the whole series, ``record_call_hierarchy = True``
* ``prototype``      (opt-in) flag off plus the original RFC's approach monkeypatched in: every node walks
                     the translator chain and builds a list of dicts
* ``no_stack_trace`` (opt-in) flag off with ``SubgraphTracer.create_node`` recompiled from its own source
                     plus ``node.meta["stack_trace"] = ""``: ``disabled - no_stack_trace`` is what building
                     stack_trace costs today, for scale

The three venv folder names have the same length: Dynamo looks at torch's file paths, and the same files
at another depth changed counts by ~0.1%. With ``--jobs 1`` (and for ``--bytecodes`` always) the variants
run one at a time through one symlink, build/bench/venv-measured, so that torch's paths are the same
strings in every variant (see ``measured_venv``).

Measurements:

* instructions: one measured compile per process, ``valgrind --tool=callgrind --collect-atstart=no``,
  ``PYTHONHASHSEED=0``. One valgrind process per variant imports torch (and transformers), compiles two
  tiny warm-up functions (lazy imports), then per workload forks a child (its own callgrind file) that
  compiles the workload once unmeasured (priming: Dynamo's per-code-object caches survive ``reset()``) and
  then exactly once bracketed by ``torch._C._valgrind_toggle()``, cyclic GC off (the first call, plus
  ``backward()`` for training). Every measured process runs the same program up to the variant, so counts
  compare across processes; ``repeat`` = ``disabled`` measured again by another valgrind process (the
  noise floor). With ``--processes N`` every build is measured by N valgrind processes, each count is their
  median, and the table gives the spread of each build's processes beside the ratios. Several measured compiles in one process instead differ by up to 0.3% with their position.
  ``--jobs`` valgrind processes run at a time; importing torch under valgrind (minutes) is paid once per
  variant, not per workload.
* wall clock: disabled / enabled (/ prototype / no_stack_trace) interleaved in one process, median of the
  per-round ratios; a second view only on a shared machine.
* bytecodes (``--bytecodes``): the Python bytecodes of one primed compile, counted per function with
  ``sys.settrace`` opcode events, for fixes / disabled / enabled (``bytecodes.md``). Exact and repeatable:
  each difference is code one build runs and the other does not, where two builds' instruction counts
  also differ by C-level layout (CPython's type attribute cache, the allocator's arenas). Each frame's
  counter is a mark of the series' non-strict recorder, which otherwise keeps frames as themselves under a
  trace function: it runs the path it runs untraced, less the marks it would make (a few bytecodes per
  user frame).
* memory: ``tracemalloc`` bytes retained by the graph modules of one compile (held minus released),
  enabled minus disabled: per FX node and as a share of the bytes the graphs retain with the flag off.
  The module entries the series keeps per compiled root module (while the model lives) are dropped
  before and after each compile, so they count too (``forget_root_module_entries``).

Workloads are ``torch.compile`` compiles, except the ``export`` family: a non-strict ``torch.export.export``
(make_fx runs the model's code; ``FrameRecorder`` records), whose flag-on cost is reported beside what its
own per-node stack_trace capture costs (``no_stack_trace`` also sets ``torch.fx.config.do_not_emit_stack_traces``).

Goals (checked in overhead.md's Summary and printed; with ``--bytecodes`` also on bytecodes, in bytecodes.md):
flag off vs fixes-only < 0.05% of compile instructions (the instruction counts of two processes differ by up to
~0.15%) and <= 0.01% of bytecodes (exact); flag on vs off <= 0.10% on every compile workload; non-strict export
on vs off <= 0.30%; flag-on memory <= 1% of the retained graphs' bytes. The workloads include the transformers
families of RFC.md's table (``FAMILY_CONFIGS``: inference and training, one layer each).

Writes ``overhead.md`` and ``overhead.csv`` (machine, torch version, repository commit, series hash).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import csv
import datetime
import fcntl
import functools
import gc
import inspect
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

ROOT = Path(__file__).resolve().parent.parent
BENCH_DIR = ROOT / "build" / "bench"
# Same-length folder names, so that the torch file paths Dynamo looks at have the same length in all.
VENVS = {"wheel": BENCH_DIR / "venv-wheel", "fixes": BENCH_DIR / "venv-fixes", "whole": BENCH_DIR / "venv-whole"}
MEASURED_VENV = BENCH_DIR / "venv-measured"  # a symlink to the measured variant's venv, see measured_venv
VARIANTS = ("unpatched", "fixes", "disabled", "enabled", "prototype", "no_stack_trace")
# unpatched (the fixes' own effect) is opt-in: a fourth valgrind process adds about a fifth to the run.
DEFAULT_VARIANTS = ("fixes", "disabled", "enabled")
QUICK_VARIANTS = ("fixes", "disabled", "enabled")  # --quick measures no instructions: no wheel venv needed
FLAG_FREE = ("unpatched", "fixes")
VENV_OF = {"unpatched": "wheel", "fixes": "fixes"}  # every other variant: "whole"
# What each variant's instruction count is compared with.
BASELINE = {"fixes": "unpatched", "disabled": "fixes", "enabled": "disabled", "prototype": "disabled",
            "no_stack_trace": "disabled"}
GOAL_OFF_PCT = 0.05  # flag off vs fixes-only, share of the compile's instructions (above their noise floor)
GOAL_OFF_BYTECODES_PCT = 0.01  # flag off vs fixes-only, share of the compile's bytecodes (exact)
GOAL_ON_PCT = 0.10  # flag on vs flag off, on every compile workload (instructions and bytecodes)
GOAL_EXPORT_ON_PCT = 0.30  # flag on vs flag off, non-strict export
GOAL_MEM_SHARE_PCT = 1.0  # flag on vs off, share of the bytes the compiled graphs retain
HIERARCHY_MODULE = "call_hierarchy"  # a patch whose diff mentions it belongs to the feature, not the fixes


# =========================================================================== workloads (worker side)


def _ops(x: Any, n: int) -> Any:
    for i in range(n):
        x = x * 1.001 if i % 2 else x + 0.5
    return x


@functools.cache
def _nested_classes() -> tuple[type, type]:
    """The module classes of `_nested_modules`, made once per process as a model's classes are: a
    recompile sees the same classes (and Dynamo's per-class state), not new ones per build."""
    import torch

    class Leaf(torch.nn.Module):
        def __init__(self, ops: int) -> None:
            super().__init__()
            self.ops = ops

        def forward(self, x):
            return _ops(x, self.ops)

    class Level(torch.nn.Module):
        def __init__(self, inner: torch.nn.Module) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, x):
            return self.inner(x) + 1

    return Leaf, Level


def _nested_modules(depth: int, ops: int) -> tuple[Any, tuple, dict]:
    import torch

    leaf, level = _nested_classes()
    mod: torch.nn.Module = leaf(ops)
    for _ in range(depth):
        mod = level(mod)
    return mod, (torch.randn(4, 4),), {}


def _helper_chain(depth: int, ops: int) -> tuple[Any, tuple, dict]:
    import torch

    def leaf(x):
        return _ops(x, ops)

    def make(inner: Callable[[Any], Any]) -> Callable[[Any], Any]:
        def helper(x):
            return inner(x) + 1

        return helper

    fn = leaf
    for _ in range(depth):
        fn = make(fn)

    def root(x):
        return fn(x)

    return root, (torch.randn(4, 4),), {}


def _wide(width: int) -> tuple[Any, tuple, dict]:
    """One module, `width` calls of a small helper: 4 nodes and one inlined call per step."""
    import torch

    def gate(x, y):
        return x * torch.sigmoid(y)

    class Wide(torch.nn.Module):
        def forward(self, x):
            out = x
            for _ in range(width):
                out = out + gate(x, out.sin())
            return out

    return Wide(), (torch.randn(2, 8),), {}


def _qwen2(layers: int) -> tuple[Any, tuple, dict]:
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.Qwen2Config(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )
    model = transformers.Qwen2ForCausalLM(config)
    return model, (torch.randint(0, 128, (1, 16)),), {"use_cache": False}


# The transformers families of RFC.md's table: one layer, tiny configs, random weights (nothing downloaded).
FAMILY_CONFIGS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 16}),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", {"head_dim": 16}),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  {"head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}),
    "bert": ("BertConfig", "BertModel", {}),
    "vit": ("ViTConfig", "ViTModel", {}),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", {}),
}


def _family(name: str) -> tuple[Any, tuple, dict]:
    import torch
    import transformers

    config_name, model_name, extra = FAMILY_CONFIGS[name]
    torch.manual_seed(0)
    if name == "vit":
        config = transformers.ViTConfig(image_size=32, patch_size=8, hidden_size=64, num_hidden_layers=1,
                                        num_attention_heads=4, intermediate_size=128)
        return transformers.ViTModel(config), (torch.randn(1, 3, 32, 32),), {}
    if name == "gpt2":
        config = transformers.GPT2Config(vocab_size=128, n_positions=64, n_embd=64, n_layer=1, n_head=4,
                                         bos_token_id=0, eos_token_id=0)
        return transformers.GPT2LMHeadModel(config), (torch.randint(0, 128, (1, 16)),), {"use_cache": False}
    config = getattr(transformers, config_name)(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
        **({} if name == "bert" else {"num_key_value_heads": 2}), max_position_embeddings=64, **extra)
    model = getattr(transformers, model_name)(config)
    kwargs = {} if name == "bert" else {"use_cache": False}
    return model, (torch.randint(0, 128, (1, 16)),), kwargs


def _loss(out: Any) -> Any:
    if hasattr(out, "logits"):
        out = out.logits
    elif hasattr(out, "last_hidden_state"):
        out = out.last_hidden_state
    return out.float().pow(2).mean()


# name -> (family, builder, train, size description); the warm-up of a family uses its "warmup" entry.
def workload_table(quick: bool) -> dict[str, dict[str, Any]]:
    t: dict[str, dict[str, Any]] = {}

    def add(name: str, family: str, build: Callable[[], tuple], train: bool = False, measure: bool = True,
            export: bool = False) -> None:
        t[name] = {"family": family, "build": build, "train": train, "measure": measure, "export": export}

    if quick:  # CI: seconds each, no transformers import
        add("nested_modules_d1", "nested", lambda: _nested_modules(1, 20))
        add("nested_modules_d4", "nested", lambda: _nested_modules(4, 20))
        add("helper_chain_d4", "chain", lambda: _helper_chain(4, 20))
        add("wide_w10", "wide", lambda: _wide(10))
        add("nested_train_d2", "train", lambda: _nested_modules(2, 8), train=True)
        add("export_nested_d4", "export", lambda: _nested_modules(4, 20), export=True)
    else:
        ops = 60
        # Ordered by cost (most expensive first), so that parallel valgrind processes finish together.
        for fam in FAMILY_CONFIGS:
            add(f"{fam}_train_l1", fam, lambda fam=fam: _family(fam), train=True)
            add(f"{fam}_l1", fam, lambda fam=fam: _family(fam))
        add("qwen2_train_l1", "train", lambda: _qwen2(1), train=True)
        add("qwen2_l1", "qwen2", lambda: _qwen2(1))
        add("qwen2_export_l1", "export", lambda: _qwen2(1), export=True)
        for fam in FAMILY_CONFIGS:
            add(f"{fam}_export_l1", "export", lambda fam=fam: _family(fam), export=True)
        add("export_wide_w100", "export", lambda: _wide(100), export=True)
        add("wide_w100", "wide", lambda: _wide(100))
        for d in (24, 1):
            add(f"nested_modules_d{d}", "nested", lambda d=d: _nested_modules(d, ops))
            add(f"helper_chain_d{d}", "chain", lambda d=d: _helper_chain(d, ops))
    add("warmup", "warmup", lambda: _helper_chain(2, 2), measure=False)
    add("warmup_train", "warmup", lambda: _nested_modules(2, 2), train=True, measure=False)
    return t


# =========================================================================== variants (worker side)


class Variant:
    """Switch the installed torch to one variant in-process.

    The whole series (venv-whole) serves disabled / enabled / prototype / no_stack_trace; the fixes-only
    prefix (venv-fixes) serves `fixes` and the wheel (venv-wheel) `unpatched`: neither has the flag.
    """

    def __init__(self) -> None:
        import torch
        from torch._dynamo import output_graph

        self.torch = torch
        self.tracer = output_graph.SubgraphTracer
        self.orig_create_proxy = self.tracer.create_proxy
        self.orig_create_node = self.tracer.create_node
        self.patched = hasattr(torch._dynamo.config, "record_call_hierarchy")
        self.proto_create_proxy = make_prototype(self.orig_create_proxy)
        self.no_st_create_node = make_no_stack_trace(output_graph, self.orig_create_node)
        self.current = "disabled" if self.patched else "fixes"

    def set(self, name: str) -> None:
        if name not in VARIANTS:
            raise RuntimeError(f"unknown variant {name!r}; known: {', '.join(VARIANTS)}")
        if name in FLAG_FREE:
            if self.patched:
                raise RuntimeError(f"variant {name!r} needs a torch without the call_hierarchy patches; "
                                   "this one has record_call_hierarchy")
        elif not self.patched:
            raise RuntimeError(f"variant {name!r} needs the whole series; this torch has no record_call_hierarchy")
        if self.patched:
            self.torch._dynamo.config.record_call_hierarchy = name == "enabled"
        self.tracer.create_proxy = self.proto_create_proxy if name == "prototype" else self.orig_create_proxy
        self.tracer.create_node = self.no_st_create_node if name == "no_stack_trace" else self.orig_create_node
        # Non-strict export's tracer (make_fx) captures stack traces unless this is set.
        self.torch.fx.config.do_not_emit_stack_traces = name == "no_stack_trace"
        self.current = name


def make_prototype(orig_create_proxy: Callable[..., Any]) -> Callable[..., Any]:
    """The original RFC's design: per node, walk the tx chain and build a list of dicts."""
    import torch

    torch_dir = os.path.join(os.path.dirname(torch.__file__), "")
    call_counts: dict[tuple[int, Any], int] = {}
    tx_counts: dict[int, int] = {}

    def create_proxy(self: Any, *args: Any, **kwargs: Any) -> Any:
        proxy = orig_create_proxy(self, *args, **kwargs)
        frames = []
        tx = self.output_graph.current_tx
        while tx:
            frames.append(tx)
            tx = getattr(tx, "parent", None)
        frames.reverse()
        hierarchy: list[dict[str, Any]] = []
        prev_keys: dict[str, Any] = {}
        parent = None
        for tx in frames:
            stack = tx.nn_module_stack
            for key, (path, cls) in stack.items():
                if key not in prev_keys:  # a module entered in this frame
                    _, _, n = key.partition("@")
                    hierarchy.append({"type": "module", "class": cls.__name__,
                                      "attr": path.rpartition(".")[2], "count": int(n) if n else 0})
            prev_keys = stack
            code = tx.f_code
            if parent is not None and not code.co_filename.startswith(torch_dir):
                # function_call_counts: assigned once per inlining translator
                count = tx_counts.get(id(tx))
                if count is None:
                    ckey = (id(parent), code)
                    count = tx_counts[id(tx)] = call_counts.get(ckey, 0)
                    call_counts[ckey] = count + 1
                hierarchy.append({"type": "function", "name": code.co_name, "count": count})
            parent = tx
        proxy.node.meta["call_hierarchy_prototype"] = hierarchy
        return proxy

    return create_proxy


def make_no_stack_trace(module: Any, orig: Callable[..., Any]) -> Callable[..., Any]:
    """SubgraphTracer.create_node recompiled from its source with node.meta["stack_trace"] = "" added."""
    src = textwrap.dedent(inspect.getsource(orig))
    pattern = re.compile(r"^(\s+)(node = super\(\)\.create_node\(.*\))$", re.M)
    if not pattern.search(src):
        raise RuntimeError("SubgraphTracer.create_node does not look as expected; cannot build no_stack_trace")
    src = pattern.sub(r'\1\2\n\1node.meta["stack_trace"] = ""', src, count=1)
    src = src.replace("super().create_node(", "super(SubgraphTracer, self).create_node(")
    namespace = dict(vars(module))
    exec(compile(src, module.__file__, "exec"), namespace)
    return namespace[orig.__name__]


# =========================================================================== one compile (worker side)


def count_nodes(gms: list[Any]) -> int:
    import torch

    total = 0
    for gm in gms:
        for mod in gm.modules():
            if isinstance(mod, torch.fx.GraphModule):
                total += len(mod.graph.nodes)
    return total


def compile_once(spec: dict[str, Any], keep: list[Any] | None = None,
                 around: Callable[[], Any] | None = None, built: tuple | None = None) -> None:
    """Build the workload (not measured; `built`: already built, `spec["build"]()`'s result), then compile
    it: `around()` is called right before and after."""
    import torch
    from torch._dynamo.backends.common import aot_autograd
    from functorch.compile import make_boxed_func

    fn, args, kwargs = built if built is not None else spec["build"]()
    if spec.get("export"):
        export_once(fn, args, kwargs, keep, around)
        return
    if spec["train"]:
        for a in args:
            if a.is_floating_point():
                a.requires_grad_(True)

        def compiler(gm: Any, example_inputs: Any) -> Any:
            if keep is not None:
                keep.append(gm)
            return make_boxed_func(gm)

        backend: Any = aot_autograd(fw_compiler=compiler, bw_compiler=compiler)  # = aot_eager, keeping graphs
    else:
        def backend(gm: Any, example_inputs: Any) -> Any:  # = "eager", keeping graphs
            if keep is not None:
                keep.append(gm)
            return gm.forward

    torch._dynamo.reset()
    gc.collect()
    compiled = torch.compile(fn, backend=backend, fullgraph=False)
    if around:
        # The cyclic GC is off inside the bracket: one full collection (of torch's whole object graph)
        # landing in one compile and not the other moves the count by several percent.
        gc.disable()
        around()
    try:
        out = compiled(*args, **kwargs)
        if spec["train"]:
            _loss(out).backward()
    finally:
        if around:
            around()
            gc.enable()
    del compiled, out, fn


def export_once(mod: Any, args: tuple, kwargs: dict, keep: list[Any] | None,
                around: Callable[[], Any] | None) -> None:
    """Non-strict torch.export of `mod` (the default mode: make_fx runs the model's code, no Dynamo)."""
    import torch

    torch._dynamo.reset()
    gc.collect()
    if around:
        gc.disable()
        around()
    try:
        ep = torch.export.export(mod, args, kwargs, strict=False)
    finally:
        if around:
            around()
            gc.enable()
    if keep is not None:
        keep.append(ep.graph_module)


def dynamo_nodes(spec: dict[str, Any]) -> int:
    keep: list[Any] = []
    spec = dict(spec, train=False)
    compile_once(spec, keep)
    return count_nodes(keep)


# =========================================================================== worker modes


def warm_up(table: dict[str, dict[str, Any]], train: bool = True) -> None:
    """Compile two tiny functions (inference and training) first, so that lazy imports are not measured.

    ``train=False``: the inference one only, for a process that then forks the measured compiles. Since
    torch 2.15 a child forked after the parent's autograd engine ran cannot run it ("Unable to handle
    autograd's threading in combination with fork-based multiprocessing"), and compiling for training runs
    it (AOTAutograd traces the joint graph with ``torch.autograd.grad``); each child's unmeasured priming
    compile pays the training imports instead.
    """
    compile_once(table["warmup"])
    if train:
        compile_once(table["warmup_train"])


def worker_callgrind(job: dict[str, Any]) -> dict[str, Any]:
    """Run under valgrind: import and warm up once, then per workload fork a child process that primes
    and makes exactly one bracketed compile; each child writes a callgrind file of its own (`%p`)."""
    import traceback

    import torch

    table = workload_table(job["quick"])
    variant = Variant()
    if job["transformers"]:
        import transformers  # noqa: F401  (imported in every process alike, whatever it measures)
    # Warmed up alike in every process (flag off), then switched: warming up with the flag on had left the
    # processes' heaps different enough to move counts by up to 0.4% either way.
    warm_up(table, train=False)  # the children fork from here: no autograd in this process
    variant.set(job["variant"].strip())
    gc.collect()
    children = []
    for name, flag in zip(job["workloads"], job["measure"]):
        if flag != "1":
            continue
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # the measured process
            code = 1
            try:
                # priming compile (not measured): Dynamo's per-code-object caches survive reset(), so the
                # first compile of a workload's code in a process costs more than the next ones
                compile_once(table[name])
                compile_once(table[name], around=torch._C._valgrind_toggle)
                code = 0
            except BaseException:
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        if status != 0:
            raise RuntimeError(f"the measured child process for {name} failed (wait status {status})")
        children.append({"workload": name, "pid": pid})
    return {"children": children}


def worker_wall(job: dict[str, Any]) -> dict[str, Any]:
    table = workload_table(job["quick"])
    variant = Variant()
    variant.set(job["variants"][0])
    warm_up(table)
    times: dict[str, dict[str, list[float]]] = {}
    stamps: list[float] = []

    def stamp() -> None:
        stamps.append(time.perf_counter())

    for name in job["workloads"]:
        compile_once(table[name])  # priming, as for callgrind
        per = times.setdefault(name, {v: [] for v in job["variants"]})
        for _ in range(job["reps"]):
            for v in job["variants"]:
                variant.set(v)
                stamps.clear()
                compile_once(table[name], around=stamp)
                per[v].append(stamps[1] - stamps[0])
    return {"times": times}


def worker_memory(job: dict[str, Any]) -> dict[str, Any]:
    import tracemalloc

    import torch

    table = workload_table(job["quick"])
    variant = Variant()
    variant.set("disabled")
    warm_up(table)
    out: dict[str, Any] = {}
    for name in job["workloads"]:
        rows: dict[str, list[int]] = {"disabled": [], "enabled": []}
        attributed: list[int] = []
        nodes = {}
        for v in ("disabled", "enabled") if job["quick"] else ("disabled", "enabled", "enabled", "disabled"):
            variant.set(v)
            keep: list[Any] = []
            forget_root_module_entries()
            # The model is built before tracing and lives until the graphs and the memos are measured,
            # as a user's model outlives its compile: what the series keeps while the model lives (its
            # module entries, by root module) counts, and the model's own objects do not.
            built = table[name]["build"]()
            gc.collect()
            tracemalloc.start()
            compile_once(table[name], keep, built=built)
            torch._dynamo.reset()
            gc.collect()
            held = tracemalloc.get_traced_memory()[0]
            snapshot = tracemalloc.take_snapshot() if v == "enabled" else None
            nodes[v] = count_nodes(keep)
            keep.clear()
            forget_root_module_entries()
            gc.collect()
            released = tracemalloc.get_traced_memory()[0]
            if snapshot is not None:
                attributed.append(hierarchy_bytes(snapshot, tracemalloc.take_snapshot()))
            tracemalloc.stop()
            del built
            rows[v].append(held - released)
        variant.set("disabled")
        out[name] = {"retained": rows, "nodes": nodes, "attributed": attributed}
    return out


def function_key(code: Any) -> str:
    """`path/inside/site-packages.py:co_name` (the same in every venv), else the file name as it is."""
    filename = code.co_filename
    return f"{filename.rpartition('site-packages/')[2]}:{code.co_name}"


def count_bytecodes(spec: dict[str, Any]) -> dict[str, int]:
    """Python bytecodes executed by one compile of the workload, per function (sys.settrace opcode events).

    Exact and repeatable (PYTHONHASHSEED=0): it tells what code the series adds to a compile, function by
    function, where the instruction count also moves with the C-level layout of two builds (CPython's
    type attribute cache, the allocator's arenas)."""
    counts: dict[str, int] = {}
    keys: dict[Any, str] = {}
    try:
        # The series' non-strict export recorder knows the frames it keeps by a mark, their local trace
        # function, and keeps the frames themselves where a trace function is set: each frame's counter is
        # a mark, so that the recorder runs the path it runs untraced.
        from torch._dynamo.call_hierarchy import _CallMark as Base  # type: ignore[attr-defined]
    except ImportError:
        Base = object

    class FrameCounter(Base):  # type: ignore[misc, valid-type]
        """The local trace function of one frame: counts its opcode events."""

        __slots__ = ()

        def __call__(self, frame: Any, event: str, arg: Any) -> Any:
            if event == "opcode":
                code = frame.f_code
                key = keys.get(code)
                if key is None:
                    key = keys[code] = function_key(code)
                counts[key] = counts.get(key, 0) + 1
            return self

    def tracer(frame: Any, event: str, arg: Any) -> Any:
        frame.f_trace_opcodes = True
        frame.f_trace_lines = False
        return FrameCounter()

    def around(state: list[int] = [0]) -> None:  # noqa: B006 - the bracket's own call counter
        sys.settrace(tracer if state[0] == 0 else None)
        state[0] += 1

    compile_once(spec, around=around)
    return counts


def worker_bytecodes(job: dict[str, Any]) -> dict[str, Any]:
    """Per workload: the bytecodes of one compile, per function, primed as for callgrind."""
    table = workload_table(job["quick"])
    variant = Variant()
    variant.set(job["variant"])
    if job["transformers"]:
        import transformers  # noqa: F401  (imported in every process alike)
    warm_up(table)
    out = {}
    for name in job["workloads"]:
        compile_once(table[name])  # priming, as for callgrind
        out[name] = count_bytecodes(table[name])
    return out


@contextlib.contextmanager
def measured_venv(variant: str) -> Iterator[Path]:
    """MEASURED_VENV, a symlink to the variant's venv, for one variant at a time: torch's files then have the
    same path in every variant. Equal-length paths are not enough: Dynamo iterates over sets of torch paths
    (`trace_rules.is_torch_inline_allowed`), whose order follows the strings' hashes, and venv-fixes vs
    venv-whole alone moved a Qwen2 compile by 5,940 bytecodes. Held under a lock: another run switching the
    link under a running measurement would mix two torches."""
    with open(MEASURED_VENV.with_name(MEASURED_VENV.name + ".lock"), "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise SystemExit(f"another benchmark run is measuring through {MEASURED_VENV}; wait for it to end") from None
        if MEASURED_VENV.is_symlink():
            MEASURED_VENV.unlink()
        elif MEASURED_VENV.exists():
            raise SystemExit(f"{MEASURED_VENV} exists and is not a symlink: move it away")
        MEASURED_VENV.symlink_to(venv_of(variant).name)
        try:
            yield MEASURED_VENV
        finally:
            MEASURED_VENV.unlink()


def measure_bytecodes(variant: str, workloads: list[str], quick: bool) -> dict[str, dict[str, int]]:
    with measured_venv(variant) as venv:
        return spawn(variant, {"mode": "bytecodes", "quick": quick, "variant": variant, "workloads": workloads,
                               "transformers": not quick}, venv=venv)


SAME_IN_EVERY_BUILD = "(functions that run the same bytecodes in every build)"


def differing(counts: dict[str, dict[str, dict[str, int]]]) -> dict[str, dict[str, dict[str, int]]]:
    """The counts per function where the builds differ, the others summed in one entry: the same totals and
    differences, a small file."""
    out: dict[str, dict[str, dict[str, int]]] = {v: {} for v in counts}
    for name in counts["disabled"]:
        per = {v: counts[v][name] for v in counts}
        keys = set().union(*per.values())
        same = {k for k in keys if len({c.get(k, 0) for c in per.values()}) == 1}
        for v, c in per.items():
            out[v][name] = {k: n for k, n in c.items() if k not in same}
            out[v][name][SAME_IN_EVERY_BUILD] = sum(c.get(k, 0) for k in same)
    return out


def bytecode_report(counts: dict[str, dict[str, dict[str, int]]], top: int = 8,
                    export: Iterable[str] = ()) -> list[str]:
    """bytecodes.md: per workload, flag off vs fixes only and flag on vs off, with the functions that differ;
    ``export`` names the non-strict export workloads (their own on-vs-off goal)."""
    lines = ["# Python bytecodes executed per compile", "",
             "One compile per workload, primed as for the instruction counts, every bytecode counted with "
             "`sys.settrace` opcode events (`PYTHONHASHSEED=0`): exact and repeatable, so each difference is "
             "code that one build runs and the other does not. Each frame's counter is a mark of the non-strict "
             "recorder (`_CallMark`), so that it runs the path it runs untraced, less making the marks.", "",
             "| workload | fixes | flag off | off vs fixes | flag on | on vs off |", "|---|---|---|---|---|---|"]
    pairs = (("fixes", "disabled"), ("disabled", "enabled"))
    pct: dict[tuple[str, str], float] = {}
    for name in counts["disabled"]:
        totals = {v: sum(counts[v][name].values()) for v in ("fixes", "disabled", "enabled")}
        cells = [f"{totals[v]:,}" for v in ("fixes", "disabled", "enabled")]
        for a, b in pairs:
            pct[b, name] = 100 * (totals[b] - totals[a]) / totals[a]
        deltas = [f"{totals[b] - totals[a]:+,} ({pct[b, name]:+.4f}%)" for a, b in pairs]
        lines.append(f"| {name} | {cells[0]} | {cells[1]} | {deltas[0]} | {cells[2]} | {deltas[1]} |")
    off = {n: v for (variant, n), v in pct.items() if variant == "disabled"}
    on = {n: v for (variant, n), v in pct.items() if variant == "enabled"}
    worst = max(off, key=off.__getitem__)
    lines += ["", f"- **Flag off vs fixes only, bytecodes** (goal <= {GOAL_OFF_BYTECODES_PCT}%): "
              f"{'met' if off[worst] <= GOAL_OFF_BYTECODES_PCT else 'MISSED'}. Largest {off[worst]:+.4f}% on {worst}."]
    exported = set(export)
    for title, goal, names in (("Flag on vs off, bytecodes", GOAL_ON_PCT, [n for n in on if n not in exported]),
                               ("Non-strict export, flag on vs off, bytecodes", GOAL_EXPORT_ON_PCT,
                                [n for n in on if n in exported])):
        if names:
            over = [f"{n} {on[n]:+.4f}%" for n in names if on[n] > goal]
            lines.append(f"- **{title}** (goal <= {goal}%): {'MISSED' if over else 'met'}. Range "
                         f"{min(on[n] for n in names):+.4f}% to {max(on[n] for n in names):+.4f}%"
                         + (f"; over the goal: {', '.join(over)}" if over else "") + ".")
    for a, b in pairs:
        lines += ["", f"## {b} minus {a}: the functions that differ most", ""]
        for name in counts["disabled"]:
            ca, cb = counts[a][name], counts[b][name]
            diff = sorted(((cb.get(k, 0) - ca.get(k, 0), k) for k in set(ca) | set(cb)), key=lambda t: (-abs(t[0]), t[1]))
            shown = ", ".join(f"`{k}` {d:+,}" for d, k in diff[:top] if d)
            lines.append(f"- {name}: {shown or 'no difference'}")
    return lines


def forget_root_module_entries() -> None:
    """Drop the module entries the series keeps per compiled root module (while the model lives, also
    across ``torch._dynamo.reset()``): freed here, the entries a compile makes and the memo holding them
    count as retained by that compile, as they did when ``reset()`` cleared them (no-op on builds
    without the memo)."""
    module = sys.modules.get("torch._dynamo.call_hierarchy")
    roots = getattr(module, "_ROOT_ENTRIES", None)
    if roots is not None:
        roots.clear()


def hierarchy_bytes(held: Any, released: Any) -> int:
    """Bytes freed with the graphs that were allocated by the two call_hierarchy modules: the entries,
    tuples and path strings themselves, without the run-to-run noise of the whole-heap difference."""
    diff = held.compare_to(released, "filename")
    return sum(stat.size_diff for stat in diff
               if stat.traceback[0].filename.endswith(("_dynamo/call_hierarchy.py", "fx/call_hierarchy.py")))


def worker_nodes(job: dict[str, Any]) -> dict[str, Any]:
    """FX nodes of each workload's Dynamo graphs, per variant of this torch (flag on must not change them)."""
    table = workload_table(job["quick"])
    variant = Variant()
    out: dict[str, dict[str, int]] = {}
    for v in job["variants"]:
        variant.set(v)
        out[v] = {name: dynamo_nodes(table[name]) for name in job["workloads"]}
    return out


def worker_main(job_json: str) -> int:
    job = json.loads(job_json)
    mode = {"callgrind": worker_callgrind, "wall": worker_wall, "memory": worker_memory,
            "nodes": worker_nodes, "bytecodes": worker_bytecodes}[job["mode"]]
    result = mode(job)
    Path(job["result"]).write_text(json.dumps(result))
    return 0


# =========================================================================== environments


def base_torch_version() -> str:
    """The torch release the series is based on: `torch_version` of patches/base.json."""
    return json.loads((ROOT / "patches" / "base.json").read_text())["torch_version"]


def run(cmd: list[str], **kw: Any) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, check=True, **kw)


def venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def venv_of(variant: str) -> Path:
    return VENVS[VENV_OF.get(variant, "whole")]


def fix_prefix(patches: list[Any]) -> list[Any]:
    """The flag-free fixes: the leading patches whose diff (not their message) never mentions call_hierarchy."""
    fixes = []
    for p in patches:
        text = p.path.read_text(errors="replace")
        start = text.find("\ndiff --git ")
        if HIERARCHY_MODULE in (text[start:] if start >= 0 else text):
            break
        fixes.append(p)
    return fixes


def ensure_venvs(variants: list[str]) -> dict[str, Any]:
    """build/bench/venv-{whole,fixes,wheel} as the variants need them, made and checked with scripts.series."""
    sys.path.insert(0, str(ROOT))
    from scripts import series

    layout = series.Layout(ROOT)
    pinned = layout.base()["torch_version"]
    patches = series.load_series(layout.patches)
    fixes = fix_prefix(patches)
    if len(fixes) == len(patches):
        raise SystemExit(f"every patch of {layout.patches / '.patches'} is free of {HIERARCHY_MODULE}: "
                         "there is no feature to measure")
    needed = list(dict.fromkeys(VENV_OF.get(v, "whole") for v in variants))
    setup = [sys.executable, "-m", "scripts.series", "setup", "--venv"]
    for key in needed:
        venv = VENVS[key]
        if key == "whole":
            run([*setup, str(venv)], cwd=ROOT)
        elif key == "fixes" and fixes:
            run([*setup, str(venv), "--through", fixes[-1].name], cwd=ROOT)
        else:  # the wheel's torch (also `fixes` for a series with no fix at the bottom): set up, then revert
            sp = series.site_packages(venv) if venv_python(venv).exists() else None
            if sp is None or series.install_state(sp, patches, pinned).state != "pristine":
                run([*setup, str(venv), "--through", patches[0].name], cwd=ROOT)
                run([sys.executable, "-m", "scripts.series", "install", "--venv", str(venv), "--revert"], cwd=ROOT)
        sp = series.site_packages(venv)
        want, through = (("current", fixes[-1].name) if key == "fixes" and fixes else
                         ("current", None) if key == "whole" else ("pristine", None))
        state = series.install_state(sp, patches, pinned, through)
        if state.state != want:
            raise SystemExit(f"{venv}: expected the torch to be {want} ({key}), found {state.state}: {state.detail}")
    return {"series_hash": series.series_hash(patches), "patches": len(patches),
            "fixes": [p.name for p in fixes],
            "fixes_hash": series.series_hash(fixes) if fixes else ""}


def no_aslr_prefix() -> list[str]:
    """`setarch <arch> -R` where the machine allows turning address randomization off, else nothing."""
    setarch = shutil.which("setarch")
    if setarch is None:
        return []
    cmd = [setarch, platform.machine(), "-R"]
    ok = subprocess.run([*cmd, "true"], capture_output=True).returncode == 0
    return cmd if ok else []


def spawn(variant: str, job: dict[str, Any], valgrind: Path | None = None, venv: Path | None = None,
          hash_seed: int = 0) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        job = dict(job, result=os.path.join(tmp, "result.json"))
        cmd = [str(venv_python(venv or venv_of(variant))), "-m", "scripts.benchmark_overhead", "--worker",
               json.dumps(job)]
        # No on-disk compile caches: a cache written by an earlier process would change what a later one runs.
        env = dict(os.environ, PYTHONHASHSEED=str(hash_seed), OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
                   TRANSFORMERS_NO_ADVISORY_WARNINGS="1", HF_HUB_OFFLINE="1", TORCHINDUCTOR_FX_GRAPH_CACHE="0",
                   TORCHINDUCTOR_AUTOGRAD_CACHE="0")
        if valgrind is not None:
            cmd = ["valgrind", "--tool=callgrind", "--collect-atstart=no", f"--callgrind-out-file={valgrind}.%p",
                   f"--log-file={valgrind}.%p.log"] + cmd
            # Without address randomization: object addresses order id()-hashed sets and dicts, and two runs of
            # the same program with randomization differed by ~0.05%.
            if no_aslr_prefix():
                cmd = no_aslr_prefix() + cmd
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"worker {job['mode']} ({variant}) failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
        return json.loads(Path(job["result"]).read_text())


# =========================================================================== instructions


def callgrind_total(path: Path) -> int | None:
    """The instruction total of a callgrind output file (None if it has none)."""
    if not path.exists():
        return None
    for line in path.read_text(errors="replace").splitlines():
        if line.startswith(("totals:", "summary:")):
            return int(line.split()[1])
    return None


def callgrind_parent(tag: str, variant: str, workloads: list[str], all_workloads: list[str], quick: bool,
                     transformers: bool, cg_dir: Path, key: str, reuse: bool, n_jobs: int,
                     hash_seed: int = 0) -> dict[str, int]:
    """Instructions of one compile of each workload in `variant`: one valgrind process imports torch once
    and forks one child per workload, which is measured alone (see worker_callgrind)."""
    record = cg_dir / f"{tag}.json"
    key = json.dumps([key, hash_seed])
    if reuse and record.exists():
        done = json.loads(record.read_text())
        if done.get("key") == key and set(workloads) <= set(done["instructions"]):
            print(f"  callgrind {tag}: reusing {record}", flush=True)
            return {n: done["instructions"][n] for n in workloads}
    for old in cg_dir.glob(f"{tag}.*"):
        old.unlink()
    base = cg_dir / tag
    t0 = time.time()
    # Every valgrind process gets a job of the same length (padded variant name, the whole run's workload
    # list and a mask of those it measures): a different heap layout before the measured compile moves
    # its count by up to ~1%.
    job = {"mode": "callgrind", "quick": quick, "variant": variant.ljust(max(map(len, VARIANTS))),
           "workloads": all_workloads, "measure": "".join("1" if n in workloads else "0" for n in all_workloads),
           "transformers": transformers}
    if n_jobs == 1:  # one variant at a time: all through the same path
        with measured_venv(variant) as venv:
            result = spawn(variant, job, valgrind=base, venv=venv, hash_seed=hash_seed)
    else:
        result = spawn(variant, job, valgrind=base, hash_seed=hash_seed)
    counts = {}
    for child in result["children"]:
        n = callgrind_total(Path(f"{base}.{child['pid']}"))
        if not n:
            raise RuntimeError(f"callgrind wrote no instruction total for {child['workload']} to {base}.{child['pid']}")
        counts[child["workload"]] = n
    record.write_text(json.dumps({"key": key, "instructions": counts}))
    print(f"  callgrind {tag}: {len(counts)} compiles in {time.time() - t0:.0f}s: "
          + ", ".join(f"{n} {c:,}" for n, c in counts.items()), flush=True)
    return counts


def measure_instructions(variants: list[str], workloads: list[str], repeat: str, quick: bool, n_jobs: int,
                         key: str, reuse: bool, processes: int = 1,
                         hash_seeds: bool = False) -> dict[tuple[str, str, int], int]:
    """`processes` valgrind processes per variant (keys 1..processes), --jobs at a time; with one, one more of
    `disabled` (key 2) measures the workloads up to the repeat workload again. With `hash_seeds`, process k
    of every build runs with PYTHONHASHSEED=k-1 (see --hash-seeds)."""
    cg_dir = BENCH_DIR / "callgrind"
    cg_dir.mkdir(parents=True, exist_ok=True)
    # Every full run's parent imports transformers, whichever workloads it measures (the families need it).
    transformers = not quick
    parents = [(v if k == 1 else f"{v}-p{k}", v, workloads, k) for v in variants for k in range(1, processes + 1)]
    if repeat != "none" and processes == 1:
        # The same children up to the repeated workload: a measured compile's count moves by ~0.1-0.3% with
        # the compiles forked before it (the parent's heap, hence id-hashed dicts and sets, differs).
        parents.append(("disabled-repeat", "disabled", workloads[: workloads.index(repeat) + 1], 2))
    counts: dict[tuple[str, str, int], int] = {}
    with concurrent.futures.ThreadPoolExecutor(max_workers=n_jobs) as pool:
        futs = {pool.submit(callgrind_parent, tag, v, ws, workloads, quick, transformers, cg_dir, key, reuse,
                            n_jobs, r - 1 if hash_seeds else 0): (v, r)
                for tag, v, ws, r in parents}
        for fut in concurrent.futures.as_completed(futs):
            v, r = futs[fut]
            for n, c in fut.result().items():
                counts[(v, n, r)] = c
    return counts


# =========================================================================== report


def instruction_columns(instr: dict[tuple[str, str, int], int], variant: str, workload: str,
                        processes: int) -> dict[str, Any]:
    """The CSV's instruction columns of one build and workload: with several processes, their median and
    each count; with one, its count and the repeat process's (key 2), if any."""
    if processes == 1:
        return {"instructions": instr.get((variant, workload, 1), ""),
                "instructions_repeat": instr.get((variant, workload, 2), "")}
    each = [instr[(variant, workload, k)] for k in range(1, processes + 1) if (variant, workload, k) in instr]
    if not each:
        return {}
    return {"instructions": round(statistics.median(each)), "instructions_processes": " ".join(map(str, each))}


def git_commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "scripts/benchmark_overhead.py", "patches"],
                               cwd=ROOT, capture_output=True, text=True).stdout.strip()
        return out.stdout.strip() + ("+local-edits" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = ""
    try:
        kb = int(Path("/proc/meminfo").read_text().split()[1])
        mem = f", {kb / 2**20:.0f} GiB"
    except (OSError, ValueError, IndexError):
        pass
    return f"{platform.system()} {platform.machine()}, {cpu}, {os.cpu_count()} cores{mem}, Python {platform.python_version()}"


def pct(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return 100.0 * (a - b) / b


def fmt(v: float | None, spec: str, suffix: str = "") -> str:
    return "n/a" if v is None else format(v, spec) + suffix


def median_pair_ratio(a: list[float], b: list[float]) -> float | None:
    pairs = [x / y for x, y in zip(a, b) if y > 0]
    return statistics.median(pairs) if pairs else None


CSV_FIELDS = ["workload", "family", "variant", "nodes", "instructions", "instructions_repeat",
              "instructions_processes", "spread_pct", "baseline", "instr_vs_baseline_pct", "instr_delta_per_node",
              "instr_vs_baseline_processes_pct",
              "repeat_pct", "wall_ratio_vs_disabled", "wall_pairs",
              "mem_retained_bytes", "mem_delta_bytes_per_node", "mem_share_pct", "mem_attributed_bytes_per_node",
              "mem_nodes", "date", "machine", "torch", "commit", "series_hash", "patches", "fixes", "mode",
              "valgrind"]


def write_csv(out_dir: Path, rows: list[dict[str, Any]]) -> None:
    with open(out_dir / "overhead.csv", "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=CSV_FIELDS)
        writer.writeheader()
        for row in rows:
            writer.writerow({k: row.get(k, "") for k in CSV_FIELDS})


def _num(s: Any) -> float | None:
    try:
        return float(s)
    except (TypeError, ValueError):
        return None


def derive(rows: list[dict[str, Any]]) -> None:
    """Fill the comparison columns from the raw ones (instructions, retained bytes, nodes)."""
    by = {(r["workload"], r["variant"]): r for r in rows}
    for r in rows:
        ir = _num(r["instructions"])
        base = BASELINE.get(r["variant"])
        b = by.get((r["workload"], base)) if base else None
        bi = _num(b["instructions"]) if b else None
        r["baseline"] = base if b else ""
        p = pct(ir, bi)
        r["instr_vs_baseline_pct"] = fmt(p, ".4f") if p is not None else ""
        nodes = _num(r["nodes"])
        r["instr_delta_per_node"] = f"{(ir - bi) / nodes:.1f}" if p is not None and nodes else ""
        rep = pct(_num(r["instructions_repeat"]), ir)
        r["repeat_pct"] = f"{rep:.4f}" if rep is not None else ""
        each = [int(x) for x in str(r.get("instructions_processes") or "").split()]
        r["spread_pct"] = f"{100 * (max(each) - min(each)) / ir:.4f}" if len(each) > 1 and ir else ""
        # Process k of a build against process k of its baseline: with --hash-seeds, the same seed.
        base_each = [int(x) for x in str(b.get("instructions_processes") or "").split()] if b else []
        r["instr_vs_baseline_processes_pct"] = " ".join(
            f"{pct(x, y):+.4f}" for x, y in zip(each, base_each)) if len(each) > 1 and len(base_each) == len(each) else ""
        if r["variant"] == "enabled" and (d := by.get((r["workload"], "disabled"))):
            on, off, n = _num(r["mem_retained_bytes"]), _num(d["mem_retained_bytes"]), _num(r["mem_nodes"])
            if on is not None and off is not None:
                r["mem_delta_bytes_per_node"] = f"{(on - off) / n:.2f}" if n else ""
                r["mem_share_pct"] = f"{100 * (on - off) / off:.3f}" if off > 0 else ""


def summary(rows: list[dict[str, Any]]) -> list[str]:
    """The goal lines of overhead.md (also printed at the end of a run)."""
    def col(variant: str, field: str, export: bool | None = None) -> list[tuple[str, float]]:
        """`export`: only the non-strict export workloads (True), only the compile ones (False), or all."""
        return [(r["workload"], v) for r in rows if r["variant"] == variant
                and export in (None, r["family"] == "export") and (v := _num(r[field])) is not None]

    out = []
    off = col("disabled", "instr_vs_baseline_pct")
    per_node = dict(col("disabled", "instr_delta_per_node"))
    floor = col("disabled", "repeat_pct")
    floor_txt = ("noise floor: the same build in two processes differs by "
                 + ", ".join(f"{v:+.4f}% on {n}" for n, v in floor)) if floor else "noise floor not measured"
    spreads = [t for v in ("fixes", "disabled", "enabled") for t in col(v, "spread_pct")]
    if spreads:
        # Medians of several processes per build: the floor is the widest spread of a build's processes.
        widest_spread = max(spreads, key=lambda t: t[1])
        floor = [widest_spread]
        floor_txt = (f"noise floor: the processes of one build differ by up to {widest_spread[1]:.4f}% "
                     f"({widest_spread[0]}); the ratios compare medians")
    if off:
        worst = max(off, key=lambda t: t[1])
        widest = max(off, key=lambda t: abs(t[1]))
        noise = max((abs(v) for _, v in floor), default=0.0)
        verdict = ("MISSED" if worst[1] >= GOAL_OFF_PCT + noise else
                   f"NOT RESOLVED (noise floor {noise:.4f}% >= the goal)" if noise >= GOAL_OFF_PCT else "met")
        if widest[1] <= -max(GOAL_OFF_PCT, noise):
            verdict += "; flag off does measurably less work than fixes only: the builds differ beyond the flag"
        out.append(f"- **Flag off vs fixes only** (goal < {GOAL_OFF_PCT}% of compile instructions): {verdict}. "
                   f"Largest increase {worst[1]:+.4f}% on {worst[0]} ({per_node.get(worst[0], 0):+.0f} Ir/node); "
                   f"range {min(v for _, v in off):+.4f}% to {max(v for _, v in off):+.4f}% over {len(off)} "
                   f"workloads (largest |Δ| {widest[1]:+.4f}% on {widest[0]}); {floor_txt}.")
    else:
        out.append(f"- Flag off vs fixes only (goal < {GOAL_OFF_PCT}%): no instruction counts in this run.")
    on = col("enabled", "instr_vs_baseline_pct", export=False)
    if on:
        worst = max(on, key=lambda t: t[1])
        verdict = "met" if all(v <= GOAL_ON_PCT for _, v in on) else "MISSED"
        over = [f"{n} {v:+.3f}%" for n, v in on if v > GOAL_ON_PCT]
        out.append(f"- **Flag on vs off** (goal <= {GOAL_ON_PCT}% on every workload): {verdict}. Largest "
                   f"{worst[1]:+.4f}% on {worst[0]}; range {min(v for _, v in on):+.4f}% to {worst[1]:+.4f}%"
                   + (f"; over the goal: {', '.join(over)}" if over else "") + ".")
    else:
        out.append(f"- Flag on vs off (goal <= {GOAL_ON_PCT}%): no instruction counts in this run.")
    exported = col("enabled", "instr_vs_baseline_pct", export=True)
    if exported:
        no_st = dict(col("no_stack_trace", "instr_vs_baseline_pct", export=True))
        on_per_node = dict(col("enabled", "instr_delta_per_node", export=True))
        mem = dict(col("enabled", "mem_share_pct", export=True))
        verdict = "met" if all(v <= GOAL_EXPORT_ON_PCT for _, v in exported) else "MISSED"
        out.append(f"- **Non-strict export, flag on vs off** (goal <= {GOAL_EXPORT_ON_PCT}%): {verdict}. " + "; ".join(
                       f"{n} {v:+.3f}% ({on_per_node.get(n, 0):+.0f} Ir/node"
                       + (f"; stack_trace capture {-no_st[n]:.3f}%" if n in no_st else "")
                       + (f"; memory {mem[n]:.2f}% of the program's bytes" if n in mem else "") + ")"
                       for n, v in exported) + ".")
    share = col("enabled", "mem_share_pct", export=False)
    bpn = dict(col("enabled", "mem_delta_bytes_per_node", export=False))
    objs = dict(col("enabled", "mem_attributed_bytes_per_node"))
    if share:
        worst = max(share, key=lambda t: t[1])
        verdict = "met" if all(v <= GOAL_MEM_SHARE_PCT for _, v in share) else "MISSED"
        out.append(f"- **Memory, flag on vs off** (goal <= {GOAL_MEM_SHARE_PCT}% of the bytes the compiled graphs "
                   f"retain): {verdict}. Largest {worst[1]:.2f}% on {worst[0]} ({fmt(bpn.get(worst[0]), '.1f')} B/node, "
                   f"{fmt(objs.get(worst[0]), '.1f')} B/node of hierarchy objects); per node "
                   f"{min(bpn.values(), default=0):.1f} to {max(bpn.values(), default=0):.1f} B.")
    fx = col("fixes", "instr_vs_baseline_pct")
    if fx:
        out.append(f"- Fixes vs the unpatched wheel (their own effect): {min(v for _, v in fx):+.4f}% to "
                   f"{max(v for _, v in fx):+.4f}% of compile instructions.")
    mismatched = sorted({r["workload"] for r in rows if r["nodes"] != next(
        x["nodes"] for x in rows if x["workload"] == r["workload"])})
    out.append("- Same FX graphs (node counts) in every variant: "
               + ("yes" if not mismatched else f"NO, differ on {', '.join(mismatched)}") + ".")
    return out


def render_from_csv(out_dir: Path) -> list[str]:
    """Recompute the derived columns of overhead.csv and write overhead.md; returns the summary lines."""
    with open(out_dir / "overhead.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    if not rows:
        raise SystemExit(f"{out_dir / 'overhead.csv'} has no rows")
    derive(rows)
    write_csv(out_dir, rows)
    order = list(dict.fromkeys(r["workload"] for r in rows))
    by = {(r["workload"], r["variant"]): r for r in rows}
    present = {r["variant"] for r in rows}

    def val(n: str, v: str, field: str) -> float | None:
        return _num(by[(n, v)][field]) if (n, v) in by else None

    meta = rows[0]
    cols: list[tuple[str, Callable[[str], str]]] = [
        ("nodes", lambda n: by[(n, "disabled")]["nodes"]),
        ("Ir fixes", lambda n: fmt(val(n, "fixes", "instructions"), ",.0f")),
    ]
    if "unpatched" in present:
        cols.append(("fixes vs unpatched", lambda n: fmt(val(n, "fixes", "instr_vs_baseline_pct"), "+.4f", "%")))
    cols += [
        ("off vs fixes", lambda n: fmt(val(n, "disabled", "instr_vs_baseline_pct"), "+.4f", "%")),
        ("off Δ/node", lambda n: fmt(val(n, "disabled", "instr_delta_per_node"), "+.0f")),
        ("on vs off", lambda n: fmt(val(n, "enabled", "instr_vs_baseline_pct"), "+.4f", "%")),
        ("on Δ/node", lambda n: fmt(val(n, "enabled", "instr_delta_per_node"), "+.0f")),
        ("repeat", lambda n: fmt(val(n, "disabled", "repeat_pct"), "+.4f", "%") if val(n, "disabled", "repeat_pct")
         is not None else ""),
    ]
    if any(r["spread_pct"] for r in rows):
        cols.append(("spread fixes / off / on", lambda n: " / ".join(
            fmt(val(n, v, "spread_pct"), ".4f", "%") for v in ("fixes", "disabled", "enabled"))))
        cols.append(("on vs off by process", lambda n: ", ".join(
            f"{x}%" for x in str(by[(n, "enabled")].get("instr_vs_baseline_processes_pct") or "").split())
            if (n, "enabled") in by else ""))
    if "prototype" in present:
        cols.append(("prototype vs off", lambda n: fmt(val(n, "prototype", "instr_vs_baseline_pct"), "+.3f", "%")))
    if "no_stack_trace" in present:
        cols.append(("stack_trace share", lambda n: fmt(None if (s := val(n, "no_stack_trace", "instr_vs_baseline_pct"))
                                                        is None else -s, ".2f", "%")))
    cols += [
        ("wall on/off", lambda n: fmt(val(n, "enabled", "wall_ratio_vs_disabled"), ".3f")),
        ("memory on-off B/node", lambda n: fmt(val(n, "enabled", "mem_delta_bytes_per_node"), ".1f")),
        ("memory % of graphs", lambda n: fmt(val(n, "enabled", "mem_share_pct"), ".2f", "%")),
        ("objects B/node", lambda n: fmt(val(n, "enabled", "mem_attributed_bytes_per_node"), ".1f")),
        ("graphs KB (off)", lambda n: fmt(None if (b := val(n, "disabled", "mem_retained_bytes")) is None else b / 1024,
                                          ".0f")),
    ]
    fixes = meta["fixes"].split() if meta["fixes"] else []
    summary_lines = summary(rows)
    lines = [
        "# RFC-0051 call_hierarchy: compile-time overhead",
        "",
        f"- date: {meta['date']}; mode: {meta['mode']}",
        f"- machine: {meta['machine']}",
        f"- torch: {meta['torch']}; repository commit: `{meta['commit']}`; "
        f"series hash: `{meta['series_hash'][:16]}` ({meta['patches']} patches)",
        f"- fixes-only baseline: {', '.join(fixes) if fixes else 'none (no flag-free fix at the bottom: the wheel)'}",
        f"- instructions: {meta['valgrind']}",
        "- reproduce: `python3 -m scripts.benchmark_overhead` (builds build/bench/venv-{wheel,fixes,whole} with "
        "`scripts.series setup` on first use; `--quick` for CI)",
        "",
        "## Summary",
        "",
        *summary_lines,
        "",
        "## Per workload",
        "",
        "off = the whole series with `record_call_hierarchy = False` (disabled), on = with True (enabled), "
        "fixes = only the flag-free fixes at the bottom of the series. `x vs y` = (Ir x - Ir y) / Ir y, "
        "instructions of one compile, each measured in a valgrind process of its own (with `--processes N`, "
        "the median of N processes per build; spread = (max - min) / median of a build's processes, the noise "
        "floor beside each ratio); Δ/node = the extra "
        "instructions per Dynamo FX node; repeat = the same build measured again in another process (noise "
        "floor); wall = median of interleaved on/off pair ratios (shared machine: a second view only); memory "
        "= bytes retained by the compiled graphs, on minus off, per FX node of those graphs and as a share of "
        "what they retain with the flag off (graphs KB); objects = of those, the bytes allocated by the "
        "call_hierarchy modules per node. n/a = not measured in this run.",
        "",
        "| workload | " + " | ".join(c for c, _ in cols) + " |",
        "|---|" + "---:|" * len(cols),
    ]
    for n in order:
        lines.append(f"| {n} | " + " | ".join(f(n) for _, f in cols) + " |")
    lines += [
        "",
        "## Method",
        "",
        f"- Builds: `venv-fixes` = torch {base_torch_version()} with the leading patches of `patches/.patches` "
        "whose diff does not contain `call_hierarchy` (`python3 -m scripts.series setup --through <last fix>`); "
        "`venv-whole` = the whole series; `venv-wheel` = the wheel's files. Equal folder-name lengths: Dynamo "
        "reads torch's file paths, and a tree laid out at another depth changes counts by ~0.1%.",
        "- Instructions: `valgrind --tool=callgrind --collect-atstart=no`, `PYTHONHASHSEED=0`, one measured "
        "compile per process. One valgrind process per build and flag imports torch (and transformers), "
        "compiles two tiny different functions (inference and training: lazy imports), then per workload forks "
        "a child with a callgrind file of its own, which compiles the workload once unmeasured (Dynamo's "
        "per-code-object caches survive `reset()`), then after `torch._dynamo.reset()`, `gc.collect()` and "
        "model construction exactly once bracketed by `torch._C._valgrind_toggle()` with the cyclic GC off "
        "(the first call; for training also `backward()`, so AOTAutograd's graphs and the backward metadata "
        "copy count). Every measured process runs the same program up to the variant, so counts of different "
        "processes compare (each gets a job of the same length, no on-disk compile cache is used, and address "
        "randomization is off where `setarch -R` is allowed: with a job of another length the same build "
        "differed by 0.85%, with randomization by 0.05%); `repeat` is `disabled` "
        "measured again by a second valgrind process. With `--hash-seeds`, process k of every build runs with "
        "`PYTHONHASHSEED=k-1` instead: string hashes order dicts and sets, and so what is allocated where; "
        "`on vs off by process` pairs the processes of one seed. Several "
        "measured compiles in one process instead differ by up to 0.3% with their position, which cannot "
        "resolve a 0.05% goal.",
        "- Wall clock: the flag-on and flag-off compiles interleaved in one process, median over rounds of the "
        "ratio.",
        "- Memory: `tracemalloc` size with the graph modules of one compile held (Dynamo reset before), minus "
        "after releasing them: what the retained graph modules (Dynamo's graph and, for training, AOT "
        "forward/backward) pin; on and off are the means of two compiles each (order off on on off).",
    ]
    (out_dir / "overhead.md").write_text("\n".join(lines) + "\n")
    return summary_lines


# =========================================================================== orchestration


def parse_list(text: str | None, known: list[str], what: str) -> list[str] | None:
    if text is None:
        return None
    items = [s.strip() for s in text.split(",") if s.strip()]
    unknown = [s for s in items if s not in known]
    if unknown or not items:
        raise SystemExit(f"--{what}: unknown {', '.join(unknown) or '(empty list)'}; known: {', '.join(known)}")
    return items


def orchestrate(args: argparse.Namespace) -> int:
    t_start = time.time()
    quick = args.quick
    table = workload_table(quick)
    known = [n for n, s in table.items() if s["measure"]]
    measured = parse_list(args.workloads, known, "workloads") or known
    variants = parse_list(args.variants, list(VARIANTS), "variants") or list(QUICK_VARIANTS if quick else DEFAULT_VARIANTS)
    for need in ("fixes", "disabled", "enabled"):
        if need not in variants:
            raise SystemExit(f"--variants must include {need} (the goals compare fixes, disabled and enabled)")
    variants = [v for v in VARIANTS if v in variants]
    if args.processes < 1:
        raise SystemExit(f"--processes {args.processes}: must be at least 1")
    if args.hash_seeds and args.processes < 2:
        raise SystemExit("--hash-seeds gives each of several valgrind processes a seed of its own: use it with "
                         "--processes N, N >= 2")
    if args.processes > 1 and (quick or args.no_callgrind):
        raise SystemExit("--processes counts instructions in several valgrind processes: not with --quick or "
                         "--no-callgrind")
    repeat = args.repeat if args.repeat is not None else ("qwen2_l1" if "qwen2_l1" in measured else measured[0])
    if repeat != "none" and repeat not in measured:
        raise SystemExit(f"--repeat {repeat}: not among the measured workloads ({', '.join(measured)}) or 'none'")
    out_dir = Path(args.out).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    info = ensure_venvs(variants)
    print(f"series {info['series_hash'][:12]} ({info['patches']} patches); fixes-only baseline: "
          f"{', '.join(info['fixes']) or 'none'}", flush=True)
    use_valgrind = not quick and not args.no_callgrind
    if use_valgrind and shutil.which("valgrind") is None:
        raise SystemExit("valgrind is not installed: install it (apt-get install valgrind) or pass --no-callgrind")

    # --- nodes per workload and variant (Dynamo graphs): every variant must compile the same graphs
    nodes: dict[str, dict[str, int]] = {}
    for venv in dict.fromkeys(VENV_OF.get(v, "whole") for v in variants):
        vs = [v for v in variants if VENV_OF.get(v, "whole") == venv]
        nodes.update(spawn(vs[0], {"mode": "nodes", "quick": quick, "variants": vs, "workloads": measured}))
    print(f"nodes: {nodes['disabled']}", flush=True)

    # --- instructions: one measured compile per process
    instr: dict[tuple[str, str, int], int] = {}
    if use_valgrind:
        key = json.dumps([info["series_hash"], info["fixes_hash"], git_commit()])
        instr = measure_instructions(variants, measured, repeat, quick, args.jobs, key, args.reuse_callgrind,
                                     args.processes, args.hash_seeds)
        print(f"callgrind done at {time.time() - t_start:.0f}s", flush=True)

    # --- Python bytecodes per function (opt-in): what each variant runs that the other does not
    if args.bytecodes:
        bytecodes = {v: measure_bytecodes(v, measured, quick) for v in ("fixes", "disabled", "enabled")}
        export = [n for n in measured if table[n]["export"]]
        # the counts themselves too, so that --render can rewrite bytecodes.md
        (out_dir / "bytecodes.json").write_text(json.dumps({"export": export, "counts": differing(bytecodes)}) + "\n")
        (out_dir / "bytecodes.md").write_text("\n".join(bytecode_report(bytecodes, export=export)) + "\n")
        print(f"bytecodes done at {time.time() - t_start:.0f}s: {out_dir / 'bytecodes.md'}", flush=True)

    # --- wall clock: the whole series' variants interleaved in one process
    whole = [v for v in variants if VENV_OF.get(v, "whole") == "whole"]
    wall = spawn("disabled", {"mode": "wall", "quick": quick, "variants": whole, "workloads": measured,
                              "reps": 1 if quick else args.reps})["times"]
    print(f"wall clock done at {time.time() - t_start:.0f}s", flush=True)

    # --- memory
    memory = spawn("disabled", {"mode": "memory", "quick": quick, "workloads": measured})
    print(f"memory done at {time.time() - t_start:.0f}s", flush=True)

    torch_version = subprocess.run([str(venv_python(VENVS["whole"])), "-c", "import torch; print(torch.__version__)"],
                                   capture_output=True, text=True).stdout.strip()
    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine(),
        "torch": torch_version,
        "commit": git_commit(),
        "series_hash": info["series_hash"],
        "patches": info["patches"],
        "fixes": " ".join(info["fixes"]),
        "mode": "quick" if quick else "full",
        "valgrind": (subprocess.run(["valgrind", "--version"], capture_output=True, text=True).stdout.strip()
                     + ", `--collect-atstart=no`, one measured compile per process, "
                     + (f"`PYTHONHASHSEED=k-1` in process k of each build (k = 1..{args.processes}), "
                        if args.hash_seeds else "`PYTHONHASHSEED=0`, ")
                     + ("address randomization off (`setarch -R`)" if no_aslr_prefix() else
                        "address randomization ON (setarch -R not allowed here: expect a ~0.05% floor)"))
        if use_valgrind else "not measured (no valgrind in this mode)",
    }
    rows = []
    for n in measured:
        mem = memory[n]
        for v in variants:
            row: dict[str, Any] = {"workload": n, "family": table[n]["family"], "variant": v, "nodes": nodes[v][n],
                                   **instruction_columns(instr, v, n, args.processes)}
            if v in wall[n] and v != "disabled":
                row["wall_ratio_vs_disabled"] = fmt(median_pair_ratio(wall[n][v], wall[n]["disabled"]), ".4f")
            if v in wall[n]:
                row["wall_pairs"] = len(wall[n][v])
            if v in ("disabled", "enabled"):
                row["mem_retained_bytes"] = round(statistics.mean(mem["retained"][v]))
                row["mem_nodes"] = mem["nodes"].get(v, "")
            if v == "enabled" and mem["attributed"] and mem["nodes"].get(v):
                row["mem_attributed_bytes_per_node"] = f"{statistics.mean(mem['attributed']) / mem['nodes'][v]:.2f}"
            row.update(meta)
            rows.append(row)
    write_csv(out_dir, rows)
    lines = render_from_csv(out_dir)
    print("\n".join(lines))
    print(f"wrote {out_dir / 'overhead.md'} and {out_dir / 'overhead.csv'} in {time.time() - t_start:.0f}s")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python3 -m scripts.benchmark_overhead", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny workloads, no valgrind (CI)")
    ap.add_argument("--out", default=str(ROOT / "results" / "overhead"), help="output folder")
    ap.add_argument("--workloads", metavar="A,B", help="comma-separated subset of the workloads (default: all)")
    ap.add_argument("--variants", metavar="A,B", help=f"comma-separated, from {', '.join(VARIANTS)} "
                    f"(default: {','.join(DEFAULT_VARIANTS)}; --quick: {','.join(QUICK_VARIANTS)})")
    ap.add_argument("--repeat", metavar="WORKLOAD", help="measure `disabled` of this workload in a second valgrind "
                    "process too, for the noise floor (default: qwen2_l1 if measured, else the first; 'none')")
    ap.add_argument("--jobs", type=int, default=2, help="valgrind processes at a time (default 2)")
    ap.add_argument("--processes", type=int, default=1, metavar="N",
                    help="valgrind processes per build: the instruction count of each compile is the median of N "
                         "(the table shows their spread beside each ratio; replaces --repeat)")
    ap.add_argument("--hash-seeds", action="store_true",
                    help="with --processes N, process k of each build runs with PYTHONHASHSEED=k-1: N hash and heap "
                         "layouts rather than one layout N times (identical processes count alike, so their spread "
                         "says nothing of how far the layout moves a ratio)")
    ap.add_argument("--reps", type=int, default=5, help="interleaved wall-clock rounds")
    ap.add_argument("--no-callgrind", action="store_true", help="skip the instruction counts")
    ap.add_argument("--reuse-callgrind", action="store_true",
                    help="reuse callgrind outputs in build/bench/callgrind made for the same series and commit")
    ap.add_argument("--bytecodes", action="store_true", help="also count the Python bytecodes of each compile per "
                    "function (fixes, disabled, enabled): bytecodes.md")
    ap.add_argument("--render", metavar="DIR", help="only rewrite DIR/overhead.md from DIR/overhead.csv (and "
                    "DIR/bytecodes.md from DIR/bytecodes.json)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return worker_main(args.worker)
    if args.render:
        print("\n".join(render_from_csv(Path(args.render))))
        saved = Path(args.render) / "bytecodes.json"
        if saved.is_file():
            data = json.loads(saved.read_text())
            (saved.parent / "bytecodes.md").write_text(
                "\n".join(bytecode_report(data["counts"], export=data["export"])) + "\n")
        return 0
    return orchestrate(args)


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
