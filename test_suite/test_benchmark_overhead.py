"""The overhead benchmark's --quick mode (CI): it runs end to end and writes the table and CSV.

No timing is asserted. The first run builds build/bench/venv-base and build/bench/venv-0051
(pip install of the pinned torch/transformers from the local wheels); later runs reuse them.
"""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

import pytest

from scripts import benchmark_overhead as B

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("overhead")
    proc = subprocess.run([sys.executable, "-m", "scripts.benchmark_overhead", "--quick", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out


def test_csv_structure(quick_run: Path) -> None:
    with open(quick_run / "overhead.csv", newline="") as fh:
        reader = csv.DictReader(fh)
        assert reader.fieldnames == B.CSV_FIELDS
        rows = list(reader)
    workloads = [n for n, s in B.workload_table(quick=True).items() if s["measure"]]
    assert {r["workload"] for r in rows} == set(workloads)
    assert {r["variant"] for r in rows} == set(B.VARIANTS)
    assert len(rows) == len(workloads) * len(B.VARIANTS)
    for row in rows:
        assert int(row["nodes"]) > 0
        assert row["mode"] == "quick"
        assert row["torch"].startswith("2.13.0")
        assert len(row["series_hash"]) == 64
        assert row["commit"] != ""
        if row["variant"] == "enabled":
            float(row["mem_bytes_per_node_vs_disabled"])
            assert float(row["wall_ratio_vs_disabled"]) > 0
        if row["variant"] in ("prototype", "no_stack_trace", "unpatched"):
            assert float(row["wall_ratio_vs_disabled"]) > 0


def test_markdown_structure(quick_run: Path) -> None:
    text = (quick_run / "overhead.md").read_text()
    for needle in ("# RFC-0051 call_hierarchy: compile-time overhead", "- machine:", "- torch: 2.13.0",
                   "series hash:", "## Targets", "## Method", "memory at most 16 B/node"):
        assert needle in text, needle
    header = next(line for line in text.splitlines() if line.startswith("| workload |"))
    cols = header.count("|") - 1
    table = [line for line in text.splitlines() if line.startswith("| ") and not line.startswith("| workload")]
    assert len(table) == len([n for n, s in B.workload_table(quick=True).items() if s["measure"]])
    assert all(line.count("|") - 1 == cols for line in table)


def test_no_stack_trace_rewrite_and_prototype_build() -> None:
    """The monkeypatches are built from the installed torch's own source (checked without compiling)."""
    pytest.importorskip("torch")
    variant = B.Variant()
    assert callable(variant.no_st_create_node) and callable(variant.proto_create_proxy)
