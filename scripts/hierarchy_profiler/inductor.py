"""Inductor (CPU): static kernel -> scope mapping of one compile (used by test_transform_hierarchy).

The profiler itself does this per kernel *call*, in call order, in :mod:`.capture`.

Each kernel Inductor generates (fused C++ kernels and extern kernels such as
``extern_kernels.mm``) is attributed, through its origin nodes in the post-grad
graph (Inductor's provenance tracking), to the lowest common scope of their
hierarchies (``torch.fx.call_hierarchy.common_call_hierarchy``).  Backward
kernels use the origins' ``fwd_call_hierarchy`` (recomputed forward ops their
``call_hierarchy``) and are marked ``(bw)``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import fx
from torch.fx.call_hierarchy import common_call_hierarchy

from .capture import Hierarchy, wrapper_op_name


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
        own = [o for o in origins if o in nodes and wrapper_op_name(nodes[o].target) == kernel_name]
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
