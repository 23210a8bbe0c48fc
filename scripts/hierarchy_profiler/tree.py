"""The scope tree: kernel calls per iteration and mean profiler time per iteration."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence

from .annotate import Sample


@dataclasses.dataclass
class Scope:
    label: str
    children: dict[str, Scope] = dataclasses.field(default_factory=dict)
    # op label -> [count per iteration, mean ns per iteration]
    ops: dict[str, list[float]] = dataclasses.field(default_factory=dict)
    # device (GPU) kernels launched from the scope's ops, ``<op> [device]``: counted apart from
    # the host's kernel calls and time, which their launches already are
    device_ops: dict[str, list[float]] = dataclasses.field(default_factory=dict)
    order: int = 0  # first appearance, to print in execution order
    total_count: int = 0
    self_count: int = 0
    total_ns: float = 0.0
    self_ns: float = 0.0
    device_ns: float = 0.0  # self
    total_device_ns: float = 0.0

    def child(self, label: str, order: int) -> Scope:
        node = self.children.get(label)
        if node is None:
            node = self.children[label] = Scope(label, order=order)
        return node

    def walk(self, depth: int = 0) -> Iterator[tuple[int, Scope]]:
        yield depth, self
        for child in self.children.values():
            yield from child.walk(depth + 1)


def build_tree(samples: Sequence[Sample], iterations: int, root_label: str) -> Scope:
    """Kernel calls per scope: counts per iteration and mean time per iteration (ns)."""
    if iterations < 1:
        raise ValueError("no measured iteration")
    root = Scope(root_label)
    order = 0
    for sample in samples:
        scope = sample.attribution.scope
        node = root
        for label in scope[1:] if scope and scope[0] == root_label else scope:
            order += 1
            node = node.child(label, order)
        stat = (node.device_ops if sample.device else node.ops).setdefault(sample.attribution.kernel, [0, 0])
        stat[0] += 1
        stat[1] += sample.self_us * 1000.0
    if not samples:
        raise ValueError("the compiled graphs ran no kernel or op in the profiled iterations")
    _sum(root, iterations)
    return root


def _sum(node: Scope, iterations: int) -> None:
    for stat in (*node.ops.values(), *node.device_ops.values()):
        stat[0] /= iterations
        stat[1] /= iterations
    node.self_count = round(sum(count for count, _ in node.ops.values()))
    node.self_ns = sum(ns for _, ns in node.ops.values())
    node.device_ns = sum(ns for _, ns in node.device_ops.values())
    node.total_count = node.self_count
    node.total_ns = node.self_ns
    node.total_device_ns = node.device_ns
    for child in node.children.values():
        _sum(child, iterations)
        node.total_count += child.total_count
        node.total_ns += child.total_ns
        node.total_device_ns += child.total_device_ns


def format_tree(root: Scope, timed: bool, max_depth: int | None = None, unit: str = "op") -> str:
    """One line per scope, indented; children by total time (timed) or execution order.

    Times are the host's (kernel calls and what they dispatch); where device kernels ran, a
    last column gives the scope's total device time.
    """
    width = max(len(s.label) + 2 * d for d, s in root.walk()) + 2
    width = min(width, 100)
    device = timed and root.total_device_ns > 0
    header = f"{'scope':<{width}} {unit + 's':>7}"
    if timed:
        header += f" {'total ms':>10} {'self ms':>10} {'total %':>8}"
    if device:
        header += f" {'device ms':>10}"
    lines = [header, "-" * len(header)]

    def emit(node: Scope, depth: int) -> None:
        if max_depth is not None and depth > max_depth:
            return
        name = ("  " * depth + node.label)[:width]
        line = f"{name:<{width}} {node.total_count:>7}"
        if timed:
            share = 100.0 * node.total_ns / root.total_ns if root.total_ns else 0.0
            line += f" {node.total_ns / 1e6:>10.3f} {node.self_ns / 1e6:>10.3f} {share:>7.1f}%"
        if device:
            line += f" {node.total_device_ns / 1e6:>10.3f}"
        lines.append(line)
        children = list(node.children.values())
        children.sort(key=(lambda c: -(c.total_ns + c.total_device_ns)) if timed else (lambda c: c.order))
        for child in children:
            emit(child, depth + 1)

    emit(root, 0)
    return "\n".join(lines)
