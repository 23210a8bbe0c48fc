"""Writers: Chrome trace JSON (Perfetto), folded stacks and an SVG flame graph."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from xml.sax.saxutils import escape

from .capture import GraphRun
from .tree import Scope

PID = 1
TID = 1


def _us(ns: int, base: int) -> float:
    return round((ns - base) / 1000.0, 3)


def _complete(name: str, cat: str, start: int, end: int, base: int, args: dict[str, Any]) -> dict[str, Any]:
    ts = _us(start, base)
    return {
        "name": name, "cat": cat, "ph": "X", "pid": PID, "tid": TID,
        "ts": ts, "dur": round(_us(end, base) - ts, 3), "args": args,
    }


def trace_events(runs: Sequence[GraphRun]) -> list[dict[str, Any]]:
    """Graph runs as nested complete events: graph > model scopes > ops.

    A scope's range spans the consecutive ops of one graph run under it, so the
    ranges nest exactly like the hierarchy.
    """
    if not runs:
        return []
    base = runs[0].start_ns
    events: list[dict[str, Any]] = [
        {"name": "process_name", "ph": "M", "pid": PID, "args": {"name": "call_hierarchy profile"}},
        {"name": "thread_name", "ph": "M", "pid": PID, "tid": TID, "args": {"name": "compiled graphs"}},
    ]
    for run in runs:
        events.append(_complete(run.name, "graph", run.start_ns, run.end_ns, base, {}))
        open_scopes: list[list[Any]] = []  # [label, start_ns, end_ns]
        backward = run.name.endswith("backward")
        cat = "scope.backward" if backward else "scope"

        def close(keep: int) -> None:
            while len(open_scopes) > keep:
                depth = len(open_scopes)
                label, start, end = open_scopes.pop()
                path = [s[0] for s in open_scopes] + [label]
                events.append(_complete(label, cat, start, end, base, {"scope": path, "depth": depth}))

        for op in run.ops:
            keep = 0
            while keep < min(len(open_scopes), len(op.scope)) and open_scopes[keep][0] == op.scope[keep]:
                keep += 1
            close(keep)
            for label in op.scope[keep:]:
                open_scopes.append([label, op.start_ns, op.end_ns])
            for scope in open_scopes:
                scope[2] = op.end_ns
            events.append(_complete(op.op, "op.backward" if op.backward else "op", op.start_ns, op.end_ns, base,
                                    {"scope": list(op.scope)}))
        close(0)
    return events


def write_trace(path: Path, runs: Sequence[GraphRun], metadata: dict[str, Any]) -> None:
    doc = {"traceEvents": trace_events(runs), "displayTimeUnit": "ms", "otherData": metadata}
    path.write_text(json.dumps(doc) + "\n")


def _frame(label: str) -> str:
    return label.replace(";", ":")


def folded_lines(root: Scope, timed: bool) -> list[str]:
    """``scope;scope;op weight`` lines; weight = op count per iteration, or microseconds."""
    lines: list[str] = []

    def visit(node: Scope, prefix: str) -> None:
        stack = f"{prefix};{_frame(node.label)}" if prefix else _frame(node.label)
        for op, (count, ns) in node.ops.items():
            weight = max(1, round(ns / 1000)) if timed else int(count)
            lines.append(f"{stack};{_frame(op)} {weight}")
        for child in node.children.values():
            visit(child, stack)

    visit(root, "")
    return lines


def write_folded(path: Path, root: Scope, timed: bool = False) -> None:
    path.write_text("\n".join(folded_lines(root, timed)) + "\n")


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
    unit = "ms" if timed else "ops"

    def weight_of(node: Scope) -> float:
        return node.total_ns / 1e6 if timed else float(node.total_count)

    def depth_of(node: Scope) -> int:
        return 1 + max([depth_of(c) for c in node.children.values()] + [1 if node.ops else 0])

    total = weight_of(root) or 1.0
    depth = depth_of(root)
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
        for op, (count, ns) in node.ops.items():
            weight = ns / 1e6 if timed else float(count)
            frame(op, x, level + 1, weight)
            x += weight * scale
        for child in node.children.values():
            visit(child, x, level + 1)
            x += weight_of(child) * scale

    visit(root, PAD, 0)
    svg = (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" '
        f'viewBox="0 0 {WIDTH} {height}" font-family="monospace" font-size="11">\n'
        f'<rect width="100%" height="100%" fill="#fdfdf6"/>\n'
        f'<text x="{WIDTH / 2}" y="{PAD + 12}" text-anchor="middle" font-size="14">{escape(title)}</text>\n'
        + "\n".join(rects)
        + "\n</svg>\n"
    )
    path.write_text(svg)
