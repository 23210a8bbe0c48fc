"""Golden files with expecttest's convention: ``EXPECTTEST_ACCEPT=1`` rewrites them.

Without that variable a difference fails the test with a unified diff and the file is
left as it is, so a golden file only changes when someone asks for it and reviews the diff.
"""

from __future__ import annotations

import difflib
import os
from pathlib import Path

import pytest


def assert_golden(path: Path, actual: str) -> None:
    """Compare ``actual`` with the golden file at ``path`` (or rewrite it when accepting)."""
    if os.environ.get("EXPECTTEST_ACCEPT"):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(actual)
        return
    assert path.exists(), f"{path} is missing: run with EXPECTTEST_ACCEPT=1 to create it"
    expected = path.read_text()
    if actual != expected:
        diff = "".join(difflib.unified_diff(
            expected.splitlines(keepends=True), actual.splitlines(keepends=True),
            fromfile=str(path), tofile="actual"))
        pytest.fail(f"{path.name} differs from its golden file (EXPECTTEST_ACCEPT=1 to accept):\n{diff}")
