"""Writers: the scope table (CSV, dataframe), folded stacks and an SVG flame graph (the trace is
the profiler's own, see annotate)."""

from __future__ import annotations

import csv
import dataclasses
import hashlib
from pathlib import Path
from typing import Any
from xml.sax.saxutils import escape

from .tree import Scope, slowest_rank, top_level


def _frame(label: str) -> str:
    return label.replace(";", ":")


def _ops(node: Scope, timed: bool) -> dict[str, list[float]]:
    """The frames above a scope: its kernel calls; timed, also the device kernels they launched."""
    return {**node.ops, **node.device_ops} if timed and node.device_ops else node.ops


def folded_lines(root: Scope, timed: bool) -> list[str]:
    """``scope;scope;kernel weight`` lines; weight = calls per iteration, or mean microseconds
    (timed: host and device time, each device kernel a frame ``<kernel> [device]``).  A scope
    outside the model starts its own stacks, beside the model's root."""
    lines: list[str] = []

    def visit(node: Scope, prefix: str) -> None:
        stack = f"{prefix};{_frame(node.label)}" if prefix else _frame(node.label)
        for op, (count, ns) in _ops(node, timed).items():
            weight = max(1, round(ns / 1000)) if timed else max(1, round(count))
            lines.append(f"{stack};{_frame(op)} {weight}")
        for child in node.children.values():
            visit(child, stack)

    for top in top_level(root):
        visit(top, "")
    return lines


def write_folded(path: Path, root: Scope, timed: bool = False, outside: Scope | None = None) -> None:
    """Folded stacks of the tree, then those of ``outside`` (what ran outside the compiled graphs)."""
    lines = folded_lines(root, timed) + (folded_lines(outside, timed) if outside is not None else [])
    path.write_text("\n".join(lines) + "\n")


def write_ranked_folded(path: Path, trees: dict[int, Scope], timed: bool = False,
                        outside: dict[int, Scope] | None = None) -> None:
    """Folded stacks of several ranks, each stack starting with its rank's frame (``rank N``);
    each rank's ``outside`` tree after its own."""
    lines = []
    for rank in sorted(trees):
        lines += [f"rank {rank};{line}" for line in folded_lines(trees[rank], timed)]
        if outside and rank in outside:
            lines += [f"rank {rank};{line}" for line in folded_lines(outside[rank], timed)]
    path.write_text("\n".join(lines) + "\n")


def ranks_root(trees: dict[int, Scope]) -> Scope:
    """One tree whose children are the ranks' own trees (``rank N``), for a flame graph that
    carries the rank."""
    root = Scope("all ranks")
    for order, rank in enumerate(sorted(trees)):
        child = root.children[f"rank {rank}"] = dataclasses.replace(trees[rank], label=f"rank {rank}",
                                                                     order=order)
        for name in ("total_count", "total_ns", "total_device_ns", "total_bw_ns", "total_re_ns"):
            setattr(root, name, getattr(root, name) + getattr(child, name))
    return root


# --------------------------------------------------------------------------- scope table

# One row per scope, in the tree's order; times are milliseconds per iteration (the tree's), the
# step columns empty where the iterations are not known apart, "device_ms" where no device ran.
SCOPE_COLUMNS = ("scope", "depth", "label", "kernels", "self_kernels", "total_ms", "self_ms", "fwd_ms", "bw_ms",
                 "re_ms", "device_ms", "median_ms", "min_ms", "max_ms", "slowest_rank", "slowest_rank_ms")


def scope_rows(root: Scope) -> list[dict[str, Any]]:
    """The scope table: ``scope`` is the path of labels from the top (``a > b``), as in the tree."""
    rows: list[dict[str, Any]] = []

    def visit(node: Scope, path: tuple[str, ...]) -> None:
        path = (*path, node.label)
        steps = node.total_steps_ns
        slowest = slowest_rank(node)
        rows.append({
            "scope": " > ".join(path), "depth": len(path) - 1, "label": node.label,
            "kernels": node.total_count, "self_kernels": node.self_count,
            "total_ms": node.total_ns / 1e6, "self_ms": node.self_ns / 1e6,
            "fwd_ms": (node.total_ns - node.total_bw_ns - node.total_re_ns) / 1e6, "bw_ms": node.total_bw_ns / 1e6,
            "re_ms": node.total_re_ns / 1e6,
            "device_ms": node.total_device_ns / 1e6,
            "median_ms": node.median_ns / 1e6 if node.median_ns is not None else None,
            "min_ms": min(steps) / 1e6 if steps else None, "max_ms": max(steps) / 1e6 if steps else None,
            "slowest_rank": slowest[0] if slowest else None, "slowest_rank_ms": slowest[1] / 1e6 if slowest else None,
        })
        for child in sorted(node.children.values(), key=lambda c: c.order):
            visit(child, path)

    for top in top_level(root):
        visit(top, ())
    return rows


def write_scope_table(path: Path, root: Scope) -> None:
    """The scope table as CSV, for pandas, spreadsheets or HolisticTraceAnalysis notebooks."""
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=SCOPE_COLUMNS)
        writer.writeheader()
        writer.writerows(scope_rows(root))


def scope_dataframe(root: Scope) -> Any:
    """The scope table as a pandas DataFrame (pandas is in the workbench's requirements)."""
    import pandas

    frame = pandas.DataFrame(scope_rows(root), columns=list(SCOPE_COLUMNS))
    # figures a tree does not have (the spread of one iteration, the ranks of one process) are NaN
    for column in SCOPE_COLUMNS[3:]:
        frame[column] = pandas.to_numeric(frame[column])
    return frame


# --------------------------------------------------------------------------- SVG flame graph

WIDTH = 1200
ROW = 17
PAD = 10


def _color(label: str) -> str:
    h = int(hashlib.md5(label.encode()).hexdigest()[:6], 16)
    if label.endswith("(bw)"):
        return f"rgb({60 + h % 40},{120 + (h >> 8) % 60},{200 + (h >> 16) % 55})"
    return f"rgb({205 + h % 50},{90 + (h >> 8) % 120},{40 + (h >> 16) % 40})"


def write_flamegraph(path: Path, root: Scope, timed: bool, title: str) -> None:
    """An icicle-free classic flame graph: root at the bottom, ops as the top frames."""
    unit = "ms" if timed else "calls"

    def weight_of(node: Scope) -> float:
        return (node.total_ns + node.total_device_ns) / 1e6 if timed else float(node.total_count)

    def depth_of(node: Scope) -> int:
        return 1 + max([depth_of(c) for c in node.children.values()] + [1 if _ops(node, timed) else 0])

    tops = top_level(root)  # the model's root, then the scopes outside the model beside it
    total = sum(weight_of(top) for top in tops) or 1.0
    depth = max(depth_of(top) for top in tops)
    height = depth * ROW + 3 * PAD + 20
    scale = (WIDTH - 2 * PAD) / total
    rects: list[str] = []

    def frame(label: str, x: float, level: int, weight: float) -> None:
        w = weight * scale
        if w < 0.1:
            return
        y = height - PAD - (level + 1) * ROW
        share = 100.0 * weight / total
        text = escape(label) if w > 7 * min(len(label), 3) else ""
        if text and len(label) * 7 > w:
            text = escape(label[: max(1, int(w / 7) - 2)]) + ".."
        rects.append(
            f'<g><title>{escape(label)}: {weight:.3f} {unit} ({share:.1f}%)</title>'
            f'<rect x="{x:.2f}" y="{y}" width="{w:.2f}" height="{ROW - 1}" fill="{_color(label)}" rx="2"/>'
            f'<text x="{x + 3:.2f}" y="{y + ROW - 5}">{text}</text></g>'
        )

    def visit(node: Scope, x: float, level: int) -> None:
        frame(node.label, x, level, weight_of(node))
        for op, (count, ns) in _ops(node, timed).items():
            weight = ns / 1e6 if timed else float(count)
            frame(op, x, level + 1, weight)
            x += weight * scale
        for child in node.children.values():
            visit(child, x, level + 1)
            x += weight_of(child) * scale

    x = float(PAD)
    for top in tops:
        visit(top, x, 0)
        x += weight_of(top) * scale
    svg = (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" '
        f'viewBox="0 0 {WIDTH} {height}" font-family="monospace" font-size="11">\n'
        f'<rect width="100%" height="100%" fill="#fdfdf6"/>\n'
        f'<text x="{WIDTH / 2}" y="{PAD + 12}" text-anchor="middle" font-size="14">{escape(title)}</text>\n'
        + "\n".join(rects)
        + "\n</svg>\n"
    )
    path.write_text(svg)
