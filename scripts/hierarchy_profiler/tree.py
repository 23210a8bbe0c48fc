"""The scope tree: op counts of one iteration and mean times over the measured ones."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence

from .capture import GraphRun


@dataclasses.dataclass
class Scope:
    label: str
    children: dict[str, Scope] = dataclasses.field(default_factory=dict)
    # op label -> [count per iteration, mean ns per iteration]
    ops: dict[str, list[float]] = dataclasses.field(default_factory=dict)
    order: int = 0  # first appearance, to print in execution order
    total_count: int = 0
    self_count: int = 0
    total_ns: float = 0.0
    self_ns: float = 0.0

    def child(self, label: str, order: int) -> Scope:
        node = self.children.get(label)
        if node is None:
            node = self.children[label] = Scope(label, order=order)
        return node

    def walk(self, depth: int = 0) -> Iterator[tuple[int, Scope]]:
        yield depth, self
        for child in self.children.values():
            yield from child.walk(depth + 1)


def build_tree(iterations: Sequence[Sequence[GraphRun]]) -> Scope:
    """Counts from the first iteration (all iterations run the same ops); times are means."""
    if not iterations:
        raise ValueError("no recorded iteration")
    root: Scope | None = None
    order = 0
    n = len(iterations)
    for i, runs in enumerate(iterations):
        for run in runs:
            for op in run.ops:
                if root is None:
                    root = Scope(op.scope[0])
                node = root
                for label in op.scope[1:]:
                    order += 1
                    node = node.child(label, order)
                stat = node.ops.setdefault(op.op, [0, 0])
                if i == 0:
                    stat[0] += 1
                stat[1] += op.end_ns - op.start_ns
    if root is None:
        raise ValueError("the compiled graphs ran no op")
    _sum(root, n)
    return root


def _sum(node: Scope, iterations: int) -> None:
    for stat in node.ops.values():
        stat[1] /= iterations
    node.self_count = int(sum(count for count, _ in node.ops.values()))
    node.self_ns = sum(ns for _, ns in node.ops.values())
    node.total_count = node.self_count
    node.total_ns = node.self_ns
    for child in node.children.values():
        _sum(child, iterations)
        node.total_count += child.total_count
        node.total_ns += child.total_ns


def format_tree(root: Scope, timed: bool, max_depth: int | None = None, unit: str = "op") -> str:
    """One line per scope, indented; children by total time (timed) or execution order."""
    width = max(len(s.label) + 2 * d for d, s in root.walk()) + 2
    width = min(width, 100)
    header = f"{'scope':<{width}} {unit + 's':>7}"
    if timed:
        header += f" {'total ms':>10} {'self ms':>10} {'total %':>8}"
    lines = [header, "-" * len(header)]

    def emit(node: Scope, depth: int) -> None:
        if max_depth is not None and depth > max_depth:
            return
        name = ("  " * depth + node.label)[:width]
        line = f"{name:<{width}} {node.total_count:>7}"
        if timed:
            share = 100.0 * node.total_ns / root.total_ns if root.total_ns else 0.0
            line += f" {node.total_ns / 1e6:>10.3f} {node.self_ns / 1e6:>10.3f} {share:>7.1f}%"
        lines.append(line)
        children = list(node.children.values())
        children.sort(key=(lambda c: -c.total_ns) if timed else (lambda c: c.order))
        for child in children:
            emit(child, depth + 1)

    emit(root, 0)
    return "\n".join(lines)
