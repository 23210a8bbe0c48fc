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
