"""The scope tree: kernel calls per iteration and mean profiler time per iteration."""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable, Iterator, Sequence

from .annotate import Sample
from .capture import OUTSIDE_SUFFIX


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
    # host ns of backward kernel calls (attributed to their forward's scope), self and total, apart
    # from those of backward kernels that recompute forward ops (activation checkpointing, the
    # partitioner's recomputation): the rest of ``self_ns``/``total_ns`` is the forward's
    self_bw_ns: float = 0.0
    total_bw_ns: float = 0.0
    self_re_ns: float = 0.0
    total_re_ns: float = 0.0
    # host ns of each measured iteration, self and total (None: the iterations are not known
    # apart, e.g. ``iterations=N`` without ``prof.step()``): one slow iteration moves the
    # mean, not the median
    self_steps_ns: list[float] | None = None
    total_steps_ns: list[float] | None = None
    # in a tree of several ranks (:func:`merge_ranks`): each rank's total host ns of the scope
    rank_ns: dict[int, float] | None = None

    def child(self, label: str, order: int) -> Scope:
        node = self.children.get(label)
        if node is None:
            node = self.children[label] = Scope(label, order=order)
        return node

    def walk(self, depth: int = 0) -> Iterator[tuple[int, Scope]]:
        yield depth, self
        for child in self.children.values():
            yield from child.walk(depth + 1)

    @property
    def median_ns(self) -> float | None:
        """Median over the measured iterations of the scope's total host time."""
        return statistics.median(self.total_steps_ns) if self.total_steps_ns else None


def is_outside(scope: Scope) -> bool:
    """A scope of code outside the model (a step function, an optimizer step, another model)."""
    return scope.label.endswith(OUTSIDE_SUFFIX)


def top_level(root: Scope) -> list[Scope]:
    """The scopes printed at the top: the model's root without its ``(outside the model)``
    children, then those (they ran outside the model, so they are not nested under it)."""
    outside = [c for c in root.children.values() if is_outside(c)]
    if not outside:
        return [root]
    model = dataclasses.replace(root, children={k: c for k, c in root.children.items() if not is_outside(c)})
    model.total_count -= sum(c.total_count for c in outside)
    model.total_ns -= sum(c.total_ns for c in outside)
    model.total_device_ns -= sum(c.total_device_ns for c in outside)
    model.total_bw_ns -= sum(c.total_bw_ns for c in outside)
    model.total_re_ns -= sum(c.total_re_ns for c in outside)
    if model.total_steps_ns is not None:
        model.total_steps_ns = [t - sum(c.total_steps_ns[i] for c in outside if c.total_steps_ns)
                                for i, t in enumerate(model.total_steps_ns)]
    return [model, *outside]


def build_tree(samples: Sequence[Sample], iterations: int, root_label: str,
               steps: Sequence[int] | None = None) -> Scope:
    """Kernel calls per scope: counts per iteration and mean time per iteration (ns).

    ``steps``: the measured iteration (0 to ``iterations - 1``) of each sample, if known: each
    scope then also has its time per iteration (:attr:`Scope.total_steps_ns`).
    """
    if iterations < 1:
        raise ValueError("no measured iteration")
    root = Scope(root_label)
    order = 0
    for i, sample in enumerate(samples):
        scope = sample.attribution.scope
        node = root
        for label in scope[1:] if scope and scope[0] == root_label else scope:
            order += 1
            node = node.child(label, order)
        stat = (node.device_ops if sample.device else node.ops).setdefault(sample.attribution.kernel, [0, 0])
        stat[0] += 1
        stat[1] += sample.self_us * 1000.0
        if sample.attribution.backward and not sample.device:
            if sample.attribution.recompute:
                node.self_re_ns += sample.self_us * 1000.0
            else:
                node.self_bw_ns += sample.self_us * 1000.0
        if steps is not None and not sample.device:
            if node.self_steps_ns is None:
                node.self_steps_ns = [0.0] * iterations
            node.self_steps_ns[steps[i]] += sample.self_us * 1000.0
    if not samples:
        raise ValueError("the compiled graphs ran no kernel or op in the profiled iterations")
    _sum(root, iterations, steps is not None)
    return root


def _sum(node: Scope, iterations: int, by_step: bool) -> None:
    for stat in (*node.ops.values(), *node.device_ops.values()):
        stat[0] /= iterations
        stat[1] /= iterations
    node.self_count = round(sum(count for count, _ in node.ops.values()))
    node.self_ns = sum(ns for _, ns in node.ops.values())
    node.device_ns = sum(ns for _, ns in node.device_ops.values())
    node.self_bw_ns /= iterations
    node.total_bw_ns = node.self_bw_ns
    node.self_re_ns /= iterations
    node.total_re_ns = node.self_re_ns
    node.total_count = node.self_count
    node.total_ns = node.self_ns
    node.total_device_ns = node.device_ns
    if by_step:
        if node.self_steps_ns is None:
            node.self_steps_ns = [0.0] * iterations
        node.total_steps_ns = list(node.self_steps_ns)
    for child in node.children.values():
        _sum(child, iterations, by_step)
        node.total_count += child.total_count
        node.total_ns += child.total_ns
        node.total_device_ns += child.total_device_ns
        node.total_bw_ns += child.total_bw_ns
        node.total_re_ns += child.total_re_ns
        if node.total_steps_ns is not None and child.total_steps_ns is not None:
            node.total_steps_ns = [a + b for a, b in zip(node.total_steps_ns, child.total_steps_ns)]


# The figures of a scope that :func:`merge_trees` reduces over trees.
_FIGURES = ("total_count", "self_count", "total_ns", "self_ns", "device_ns", "total_device_ns", "self_bw_ns",
            "total_bw_ns", "self_re_ns", "total_re_ns")


def merge_trees(trees: Sequence[Scope], reduce: Callable[[list[float]], float],
                ranks: Sequence[int] | None = None) -> Scope:
    """One tree for several trees of one program: per scope and per op, ``reduce`` of the figures
    of every tree (0 in a tree without the scope or op), so the columns of a merged scope need not
    add up.  ``ranks``: the rank of each tree, kept per scope in :attr:`Scope.rank_ns`.  The
    per-iteration spread is not merged."""
    if not trees:
        raise ValueError("no tree to merge")
    return _merge(trees[0].label, list(trees), reduce, ranks)


def _merge(label: str, nodes: list[Scope | None], reduce: Callable[[list[float]], float],
           ranks: Sequence[int] | None) -> Scope:
    present = [n for n in nodes if n is not None]
    out = Scope(label, order=min(n.order for n in present))
    for name in _FIGURES:
        value = reduce([getattr(n, name) if n is not None else 0.0 for n in nodes])
        setattr(out, name, round(value) if name.endswith("count") else value)
    for field in ("ops", "device_ops"):
        stats: dict[str, list[float]] = getattr(out, field)
        for op in dict.fromkeys(op for n in present for op in getattr(n, field)):
            pairs = [getattr(n, field).get(op, (0.0, 0.0)) if n is not None else (0.0, 0.0) for n in nodes]
            stats[op] = [reduce([p[0] for p in pairs]), reduce([p[1] for p in pairs])]
    if ranks is not None:
        out.rank_ns = {rank: n.total_ns if n is not None else 0.0 for rank, n in zip(ranks, nodes)}
    for child in dict.fromkeys(c for n in present for c in n.children):
        out.children[child] = _merge(child, [n.children.get(child) if n is not None else None for n in nodes],
                                     reduce, ranks)
    return out


def merge_ranks(trees: dict[int, Scope]) -> Scope:
    """The tree of a distributed run: per scope the median over ranks of each figure, and each
    rank's total (:attr:`Scope.rank_ns`, for the slowest rank)."""
    ranks = sorted(trees)
    return merge_trees([trees[r] for r in ranks], statistics.median, ranks)


def slowest_rank(node: Scope) -> tuple[int, float] | None:
    """The rank whose total of ``node`` is the largest, and that total (ns); None for one process."""
    if not node.rank_ns:
        return None
    rank = max(node.rank_ns, key=lambda r: (node.rank_ns[r], -r))  # type: ignore[index]
    return rank, node.rank_ns[rank]


def format_tree(root: Scope, timed: bool, max_depth: int | None = None, unit: str = "op") -> str:
    """One line per scope, indented; children by total time (timed) or execution order.

    Times are the host's (kernel calls and what they dispatch): the mean per iteration, and,
    where the iterations are known apart (two or more), the median, min and max over them of
    the scope's total; where backward kernels ran, the total's forward and backward parts
    (a backward kernel counts under the scope of the forward ops it differentiates), and, where
    some recompute forward ops, their part apart from the backward's ("re ms"); in a tree of
    several ranks (:func:`merge_ranks`), the figures are medians over the ranks, followed by the
    slowest rank and its total; where device kernels ran, a last column gives the scope's total
    device time.  Scopes outside the
    model are printed beside the model's root, not below it.
    """
    tops = top_level(root)
    width = max(len(s.label) + 2 * d for top in tops for d, s in top.walk()) + 2
    width = min(width, 100)
    device = timed and root.total_device_ns > 0
    phases = timed and root.total_bw_ns + root.total_re_ns > 0
    recomputed = timed and root.total_re_ns > 0
    spread = timed and root.total_steps_ns is not None and len(root.total_steps_ns) > 1
    ranked = timed and root.rank_ns is not None
    header = f"{'scope':<{width}} {unit + 's':>7}"
    if timed:
        header += f" {'total ms':>10} {'self ms':>10} {'total %':>8}"
    if phases:
        header += f" {'fwd ms':>10} {'bw ms':>10}"
    if recomputed:
        header += f" {'re ms':>10}"
    if spread:
        header += f" {'median ms':>10} {'min ms':>10} {'max ms':>10}"
    if ranked:
        header += f" {'slowest':>8} {'its ms':>10}"
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
        if phases:
            fwd_ns = node.total_ns - node.total_bw_ns - node.total_re_ns
            line += f" {fwd_ns / 1e6:>10.3f} {node.total_bw_ns / 1e6:>10.3f}"
        if recomputed:
            line += f" {node.total_re_ns / 1e6:>10.3f}"
        if spread:
            steps = node.total_steps_ns or [0.0]
            line += f" {statistics.median(steps) / 1e6:>10.3f} {min(steps) / 1e6:>10.3f} {max(steps) / 1e6:>10.3f}"
        if ranked:
            rank, ns = slowest_rank(node) or (0, 0.0)
            line += f" {'rank ' + str(rank):>8} {ns / 1e6:>10.3f}"
        if device:
            line += f" {node.total_device_ns / 1e6:>10.3f}"
        lines.append(line)
        children = list(node.children.values())
        children.sort(key=(lambda c: -(c.total_ns + c.total_device_ns)) if timed else (lambda c: c.order))
        for child in children:
            emit(child, depth + 1)

    for top in tops:
        emit(top, 0)
    return "\n".join(lines)
