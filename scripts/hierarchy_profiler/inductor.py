"""Inductor (CPU): static attribution of generated kernels to the model's scopes.

Each kernel Inductor generates (fused C++ kernels and extern kernels such as
``extern_kernels.mm``) is attributed, through its origin nodes in the post-grad
graph (Inductor's provenance tracking), to the lowest common scope of their
hierarchies (``torch.fx.call_hierarchy.common_call_hierarchy``).  Backward
kernels use the origins' ``fwd_call_hierarchy`` (recomputed forward ops their
``call_hierarchy``) and are marked ``(bw)``.

Kernels are counted, not timed: every run of a compiled forward/inference graph
records its kernels (and, in training, those of its backward) under the runtime
module stack of that run, so graph breaks are attributed like on the aot_eager path.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import fx
from torch.fx.call_hierarchy import common_call_hierarchy

from .capture import GraphRun, Hierarchy, OpEvent, Recorder


@contextlib.contextmanager
def inductor_config() -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        # provenance tracking fills kernel -> post-grad node names during codegen;
        # caches would skip codegen (and our compiler hook) on a hit
        stack.enter_context(torch._inductor.config.patch(
            {"fx_graph_cache": False, "trace.provenance_tracking_level": 1}))
        stack.enter_context(torch._functorch.config.patch(enable_autograd_cache=False))
        yield


def _kernels(gm: fx.GraphModule, backward: bool) -> list[tuple[str, Hierarchy]]:
    import torch._inductor.debug as inductor_debug

    nodes = {n.name: n for n in gm.graph.nodes}
    kernels = []
    for key, origins in inductor_debug._inductor_triton_kernel_to_post_grad_node_info.items():
        kernel_name = key.rpartition(":")[0]
        # A fallback extern kernel (no origin_node) also lists the nodes that computed its
        # inputs; the op it runs is the one whose scope it belongs to.
        own = [o for o in origins if o in nodes and f"torch.ops.{nodes[o].target}" == kernel_name]
        if own:
            origins = own
        hierarchies = []
        for name in origins:
            meta = nodes[name].meta if name in nodes else {}
            if backward and "fwd_call_hierarchy" in meta:
                hierarchies.append(meta["fwd_call_hierarchy"])
            elif "call_hierarchy" in meta:
                hierarchies.append(meta["call_hierarchy"])
        kernel = kernel_name + (" (bw)" if backward else "")
        kernels.append((kernel, common_call_hierarchy(hierarchies)))
    return kernels


class InductorGraph:
    def __init__(self, recorder: Recorder, graph_id: int) -> None:
        self.recorder = recorder
        self.graph_id = graph_id
        self.forward: list[tuple[str, Hierarchy]] = []
        self.backward: list[tuple[str, Hierarchy]] = []
        self.kind = "inference"

    def inner_compile(self, gm: fx.GraphModule, example_inputs: list[Any], **kwargs: Any) -> Any:
        from torch._inductor.compile_fx import compile_fx_inner

        compiled = compile_fx_inner(gm, example_inputs, **kwargs)
        backward = bool(kwargs.get("is_backward"))
        if backward:
            self.backward = _kernels(gm, True)
        else:
            self.forward = _kernels(gm, False)
            self.kind = "inference" if kwargs.get("is_inference") else "forward"
        return compiled

    @property
    def num_ops(self) -> int:
        return len(self.forward) + len(self.backward)

    def wrap(self, compiled: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any) -> Any:
            if not self.recorder.recording:
                return compiled(*args)
            stack = self.recorder.scopes.module_stack()
            start = time.perf_counter_ns()
            result = compiled(*args)
            end = time.perf_counter_ns()
            kernels = self.forward + (self.backward if torch.is_grad_enabled() else [])
            ops = [OpEvent(self.recorder.scopes.absolute(stack, h), name, name.endswith("(bw)"), start, start)
                   for name, h in kernels]
            self.recorder.iterations[-1].append(GraphRun(f"graph {self.graph_id} {self.kind}", start, end, ops))
            return result

        return run


def inductor_backend(recorder: Recorder) -> Callable[..., Any]:
    from torch._inductor.compile_fx import compile_fx

    recorder.unit = "kernel"
    recorder.timed = False

    def backend(gm: fx.GraphModule, example_inputs: list[Any]) -> Any:
        graph = InductorGraph(recorder, recorder.num_dynamo_graphs)
        recorder.num_dynamo_graphs += 1
        recorder.graphs.append(graph)  # type: ignore[arg-type]
        return graph.wrap(compile_fx(gm, example_inputs, inner_compile=graph.inner_compile))

    return backend
