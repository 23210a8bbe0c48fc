"""scripts.lint: the upstream lint settings find what they should, and only new findings fail."""

from __future__ import annotations

from pathlib import Path

from scripts import lint

VENV = lint.ROOT / ".venv"

BAD = '''import torch
import os
from typing import Optional


def f(x: Optional[int]) -> int:
    assert x is not None
    return x + {}
'''

GOOD = '''import os

import torch


def f(x: int | None) -> int:
    if x is None:
        raise ValueError("x is None")
    return x + len(os.sep) + torch.ones(1).numel()
'''


def lint_one(tmp_path: Path, text: str) -> list[lint.Finding]:
    tree = tmp_path / "tree"
    files = lint.write_tree(tree, ["torch/fx/example.py"], lambda path: text.encode())
    findings, shown = lint.lint_tree(tree, files, files, VENV)
    assert len(findings) == len(shown)
    return findings


def test_upstream_settings_find_new_code_problems(tmp_path: Path) -> None:
    codes = {code for _, code, _ in lint_one(tmp_path, BAD)}
    # usort: torch before os; ruff: unused import, Optional (UP045), assert in torch/ (S101);
    # mypy: int + dict.
    assert "usort" in codes
    assert {"ruff:F401", "ruff:UP045", "ruff:S101"} <= codes
    assert "mypy:operator" in codes


def test_clean_code_has_no_findings(tmp_path: Path) -> None:
    assert lint_one(tmp_path, GOOD) == []


def test_only_findings_the_base_lacks_are_new() -> None:
    base = [("a.py", "ruff:F401", "import os")]
    findings = [("a.py", "ruff:F401", "import os"), ("a.py", "ruff:F401", "import os"),
                ("a.py", "ruff:S101", "assert x")]
    shown = ["first F401", "second F401", "S101"]
    assert lint.new_findings(base, findings, shown) == ["second F401", "S101"]


def test_leftover_files_in_the_series_are_findings(tmp_path: Path) -> None:
    from scripts import series

    def patch(name: str, path: str) -> series.Patch:
        text = (f"From 0 Mon Sep 17 00:00:00 2001\nSubject: [PATCH] x\n\n---\n"
                f"diff --git a/{path} b/{path}\nnew file mode 100644\nindex 0000000..e69de29\n")
        (tmp_path / name).write_text(text)
        return series.parse_patch(tmp_path / name)

    kept = [patch("0001.patch", "test/dynamo/test_call_hierarchy.py"), patch("0002.patch", "torch/fx/x.py.orig")]
    assert lint.stray_files(kept) == [
        "torch/fx/x.py.orig: an editor or merge leftover in the series; remove it in the workspace and export"]
    assert lint.stray_files(kept[:1]) == []
