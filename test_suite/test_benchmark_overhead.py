"""The overhead benchmark: its goal checks (from synthetic rows), its fixes-only baseline, and the --quick
mode (CI) end to end.

No timing is asserted. The first quick run builds build/bench/venv-{fixes,whole} with
`scripts.series setup` (pip install of the pinned requirements from the local wheels); later runs reuse them.
"""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest

from scripts import benchmark_overhead as B
from scripts import series as S

ROOT = Path(__file__).resolve().parent.parent
BASE_TORCH = S.Layout(ROOT).base()["torch_version"]  # the pinned torch of patches/base.json


# --------------------------------------------------------------------------- goal checks, no torch


def rows_for(off_pct: float, on_pct: float, mem_on: int, nodes_on: int = 100) -> list[dict[str, str]]:
    """Raw rows of one workload: fixes 1e9 Ir, off and on the given percentages above it / above off."""
    fixes = 1_000_000_000
    off = round(fixes * (1 + off_pct / 100))
    on = round(off * (1 + on_pct / 100))
    base = {f: "" for f in B.CSV_FIELDS}

    def row(variant: str, **kw: object) -> dict[str, str]:
        return dict(base, workload="w", variant=variant, nodes="100", **{k: str(v) for k, v in kw.items()})

    return [row("unpatched", instructions=fixes + 5000), row("fixes", instructions=fixes),
            row("disabled", instructions=off, instructions_repeat=off + 10_000, mem_retained_bytes=100_000,
                mem_nodes=100),
            row("enabled", instructions=on, mem_retained_bytes=mem_on, mem_nodes=nodes_on)]


def summary_of(rows: list[dict[str, str]]) -> str:
    B.derive(rows)
    return "\n".join(B.summary(rows))


def test_goals_met() -> None:
    text = summary_of(rows_for(off_pct=0.04, on_pct=0.08, mem_on=100_900))
    assert "**Flag off vs fixes only** (goal < 0.05% of compile instructions): met" in text
    assert "**Flag on vs off** (goal <= 0.1% on every workload): met" in text
    assert "retain): met. Largest 0.90% on w (9.0 B/node" in text
    assert "+0.0010% on w" in text  # the repeat: 10 Ir of 1.0004e9
    assert "Same FX graphs (node counts) in every variant: yes" in text


def test_goals_missed() -> None:
    rows = rows_for(off_pct=0.06, on_pct=0.3, mem_on=101_100)
    rows[3]["nodes"] = "101"
    text = summary_of(rows)
    assert "compile instructions): MISSED. Largest increase +0.0600% on w (+6000 Ir/node)" in text
    assert "every workload): MISSED" in text and "over the goal: w +0.300%" in text
    assert "retain): MISSED. Largest 1.10% on w" in text
    assert "NO, differ on w" in text


def test_export_workloads_are_reported_apart_from_the_compile_goal() -> None:
    """Non-strict export has a goal of its own (0.30%): its line gives on vs off beside its own stack_trace
    capture."""
    exported = [dict(r, workload="e", family="export") for r in rows_for(off_pct=0.01, on_pct=1.0, mem_on=103_000)]
    no_st = dict(exported[2], variant="no_stack_trace", instructions=str(round(int(exported[2]["instructions"]) * 0.9)))
    text = summary_of(rows_for(off_pct=0.01, on_pct=0.08, mem_on=100_500) + exported + [no_st])
    assert "**Flag on vs off** (goal <= 0.1% on every workload): met. Largest +0.0800% on w" in text
    assert "**Non-strict export, flag on vs off** (goal <= 0.3%): MISSED. e +1.000%" in text
    assert "e +1.000% (+100010 Ir/node; stack_trace capture 10.000%; memory 3.00% of the program's bytes)" in text
    assert "per node 5.0 to 5.0 B" in text
    assert "retain): met. Largest 0.50% on w" in text
    # Flag off does no added work in either kind of workload: both are in the off-vs-fixes goal.
    assert "over 2 workloads" in text


def test_goal_not_resolved_above_the_noise_floor() -> None:
    rows = rows_for(off_pct=0.01, on_pct=0.1, mem_on=100_000)
    rows[2]["instructions_repeat"] = str(round(int(rows[2]["instructions"]) * 1.0006))
    assert "compile instructions): NOT RESOLVED (noise floor 0.0600% >= the goal)" in summary_of(rows)
    rows = rows_for(off_pct=-0.2, on_pct=0.1, mem_on=100_000)
    assert "met; flag off does measurably less work than fixes only" in summary_of(rows)


def test_processes_give_each_build_the_median_and_the_spread_is_the_floor() -> None:
    """--processes N: a build's count is the median of its N processes, and the widest spread of a build's
    processes is the noise floor the off-vs-fixes verdict is held against."""
    instr = {("fixes", "w", 1): 1_000_000_000, ("fixes", "w", 2): 1_000_900_000, ("fixes", "w", 3): 1_000_100_000,
             ("disabled", "w", 1): 1_000_200_000, ("disabled", "w", 2): 1_000_100_000,
             ("disabled", "w", 3): 1_000_300_000}
    fixes = B.instruction_columns(instr, "fixes", "w", 3)
    assert fixes == {"instructions": 1_000_100_000, "instructions_processes": "1000000000 1000900000 1000100000"}
    assert B.instruction_columns(instr, "enabled", "w", 3) == {}
    # One process: its count and the repeat process's, as before.
    assert B.instruction_columns(instr, "disabled", "w", 1) == {"instructions": 1_000_200_000,
                                                                 "instructions_repeat": 1_000_100_000}
    base = {f: "" for f in B.CSV_FIELDS}
    rows = [dict(base, workload="w", variant=v, nodes="100", **{k: str(x) for k, x in
                                                                 B.instruction_columns(instr, v, "w", 3).items()})
            for v in ("fixes", "disabled")]
    text = summary_of(rows)
    by = {r["variant"]: r for r in rows}
    assert by["fixes"]["spread_pct"] == "0.0900" and by["disabled"]["spread_pct"] == "0.0200"
    assert by["disabled"]["instr_vs_baseline_pct"] == "0.0100"  # median vs median
    assert "NOT RESOLVED (noise floor 0.0900% >= the goal)" in text
    assert "the processes of one build differ by up to 0.0900% (w); the ratios compare medians" in text


def test_processes_need_callgrind() -> None:
    with pytest.raises(SystemExit, match="must be at least 1"):
        B.main(["--processes", "0"])
    with pytest.raises(SystemExit, match="not with --quick or --no-callgrind"):
        B.main(["--quick", "--processes", "3"])
    with pytest.raises(SystemExit, match="--hash-seeds .* use it with --processes N, N >= 2"):
        B.main(["--hash-seeds", "--workloads", "vit_l1"])


def test_processes_are_paired_by_index_for_the_per_process_ratios() -> None:
    """Process k of a build is compared with process k of its baseline (with --hash-seeds: the same seed), so
    the table shows how far the layout moves the ratio beside the ratio of the medians."""
    instr = {("disabled", "w", 1): 1_000_000_000, ("disabled", "w", 2): 1_002_000_000,
             ("disabled", "w", 3): 1_001_000_000, ("enabled", "w", 1): 1_001_000_000,
             ("enabled", "w", 2): 1_003_002_000, ("enabled", "w", 3): 1_001_000_000}
    base = {f: "" for f in B.CSV_FIELDS}
    rows = [dict(base, workload="w", variant=v, nodes="100", **{k: str(x) for k, x in
                                                                 B.instruction_columns(instr, v, "w", 3).items()})
            for v in ("disabled", "enabled")]
    B.derive(rows)
    by = {r["variant"]: r for r in rows}
    assert by["enabled"]["instr_vs_baseline_processes_pct"] == "+0.1000 +0.1000 +0.0000"
    # The ratio of the medians can hide what the pairs show: both medians are 1_001_000_000.
    assert by["enabled"]["instr_vs_baseline_pct"] == "0.0000"
    assert by["disabled"]["instr_vs_baseline_processes_pct"] == ""  # no baseline rows


@pytest.mark.parametrize("hash_seeds, seeds", [(True, [0, 1, 2]), (False, [0, 0, 0])])
def test_hash_seeds_give_process_k_the_seed_k_minus_1(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                       hash_seeds: bool, seeds: list[int]) -> None:
    calls: list[tuple[str, int]] = []

    def parent(tag: str, variant: str, *args: object) -> dict[str, int]:
        calls.append((tag, int(args[-1])))  # type: ignore[call-overload]
        return {"w": 1}

    monkeypatch.setattr(B, "callgrind_parent", parent)
    monkeypatch.setattr(B, "BENCH_DIR", tmp_path)
    B.measure_instructions(["disabled"], ["w"], "none", False, 1, "key", False, 3, hash_seeds)
    assert sorted(calls) == [("disabled", seeds[0]), ("disabled-p2", seeds[1]), ("disabled-p3", seeds[2])]


def test_derive_compares_with_the_right_baseline() -> None:
    rows = rows_for(off_pct=0.01, on_pct=0.1, mem_on=100_000)
    B.derive(rows)
    by = {r["variant"]: r for r in rows}
    assert by["fixes"]["baseline"] == "unpatched" and float(by["fixes"]["instr_vs_baseline_pct"]) < 0
    assert by["disabled"]["baseline"] == "fixes" and by["disabled"]["instr_vs_baseline_pct"] == "0.0100"
    assert by["enabled"]["baseline"] == "disabled" and by["enabled"]["instr_vs_baseline_pct"] == "0.1000"
    assert by["unpatched"]["instr_vs_baseline_pct"] == ""


def test_report_names_the_base_torch(tmp_path: Path) -> None:
    """overhead.md names the torch of its builds from patches/base.json (no torch needed to render it)."""
    meta = {"date": "d", "machine": "m", "torch": BASE_TORCH, "commit": "c", "series_hash": "0" * 64,
            "patches": "3", "fixes": "0001-a.patch", "mode": "quick", "valgrind": "v"}
    B.write_csv(tmp_path, [dict(row, **meta) for row in rows_for(off_pct=0.01, on_pct=0.1, mem_on=100_000)])
    B.render_from_csv(tmp_path)
    text = (tmp_path / "overhead.md").read_text()
    assert B.base_torch_version() == BASE_TORCH
    assert f"- Builds: `venv-fixes` = torch {BASE_TORCH} with the leading patches" in text
    assert f"- torch: {BASE_TORCH};" in text


def test_fix_prefix_stops_at_the_first_patch_whose_diff_mentions_call_hierarchy(tmp_path: Path) -> None:
    class P:
        def __init__(self, name: str, message: str, diff: str) -> None:
            self.path = tmp_path / name
            self.path.write_text(f"Subject: {message}\n\n---\ndiff --git a/x b/x\n{diff}\n")

    fix_a = P("0001-a.patch", "fix, needed by call_hierarchy later", "+x = 1")  # the message does not count
    fix_b = P("0002-b.patch", "fix", "+y = 2")
    feature = P("0003-c.patch", "feature", "+meta['call_hierarchy'] = h")
    late_fix = P("0004-d.patch", "flag-free but above the feature", "+z = 3")
    assert B.fix_prefix([fix_a, fix_b, feature, late_fix]) == [fix_a, fix_b]
    assert B.fix_prefix([feature, fix_a]) == []


def test_fix_prefix_of_this_series() -> None:
    layout = S.Layout(ROOT)
    patches = S.load_series(layout.patches)
    fixes = B.fix_prefix(patches)
    assert len(fixes) < len(patches)
    assert B.HIERARCHY_MODULE in patches[len(fixes)].path.read_text()
    for p in fixes:
        text = p.path.read_text()
        assert B.HIERARCHY_MODULE not in text[text.index("\ndiff --git "):], p.name


def test_bad_lists_are_named() -> None:
    with pytest.raises(SystemExit, match="unknown qwen2_l9; known: a, b"):
        B.parse_list("a,qwen2_l9", ["a", "b"], "workloads")
    assert B.parse_list("b, a", ["a", "b"], "workloads") == ["b", "a"]


def test_full_workloads_are_the_chosen_set() -> None:
    full = {n for n, s in B.workload_table(quick=False).items() if s["measure"]}
    families = {f"{f}{kind}" for f in ("llama", "qwen3", "gemma", "qwen3_moe", "bert", "vit", "gpt2")
                for kind in ("_l1", "_train_l1")}
    exports = {f"{f}_export_l1" for f in ("qwen2", "llama", "qwen3", "gemma", "qwen3_moe", "bert", "vit", "gpt2")}
    assert full == families | exports | {"qwen2_l1", "qwen2_train_l1", "nested_modules_d1", "nested_modules_d24",
                                         "helper_chain_d1", "helper_chain_d24", "wide_w100", "export_wide_w100"}
    assert {n for n, s in B.workload_table(quick=False).items() if s["export"]} == exports | {"export_wide_w100"}


def test_venv_folder_names_have_the_same_length() -> None:
    assert len({len(v.name) for v in B.VENVS.values()}) == 1


# --------------------------------------------------------------------------- --quick end to end


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("overhead")
    proc = subprocess.run([sys.executable, "-m", "scripts.benchmark_overhead", "--quick", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Same FX graphs (node counts) in every variant" in proc.stdout
    return out


def test_csv_structure(quick_run: Path) -> None:
    with open(quick_run / "overhead.csv", newline="") as fh:
        reader = csv.DictReader(fh)
        assert reader.fieldnames == B.CSV_FIELDS
        rows = list(reader)
    workloads = [n for n, s in B.workload_table(quick=True).items() if s["measure"]]
    assert {r["workload"] for r in rows} == set(workloads)
    assert {r["variant"] for r in rows} == set(B.QUICK_VARIANTS)
    assert len(rows) == len(workloads) * len(B.QUICK_VARIANTS)
    fixes = " ".join(p.name for p in B.fix_prefix(S.load_series(S.Layout(ROOT).patches)))
    for row in rows:
        assert int(row["nodes"]) > 0
        assert row["mode"] == "quick" and row["instructions"] == ""
        assert row["torch"].startswith(BASE_TORCH)
        assert len(row["series_hash"]) == 64
        assert row["commit"] != ""
        assert row["fixes"] == fixes
        if row["variant"] == "enabled":
            assert float(row["wall_ratio_vs_disabled"]) > 0
            # the flag really records: hierarchy objects are retained with the graphs
            assert float(row["mem_attributed_bytes_per_node"]) > 0
            float(row["mem_share_pct"])
        if row["variant"] == "disabled":
            assert int(row["mem_retained_bytes"]) > 0


def test_every_variant_compiles_the_same_graphs(quick_run: Path) -> None:
    with open(quick_run / "overhead.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    for name in {r["workload"] for r in rows}:
        counts = {r["variant"]: r["nodes"] for r in rows if r["workload"] == name}
        assert len(set(counts.values())) == 1, (name, counts)


def test_markdown_structure(quick_run: Path) -> None:
    text = (quick_run / "overhead.md").read_text()
    for needle in ("# RFC-0051 call_hierarchy: compile-time overhead", "- machine:", f"- torch: {BASE_TORCH}",
                   "series hash:", "- fixes-only baseline:", "## Summary", "## Per workload", "## Method",
                   "Flag off vs fixes only (goal < 0.05%): no instruction counts in this run",
                   "Flag on vs off (goal <= 0.1%): no instruction counts in this run",
                   "**Memory, flag on vs off** (goal <= 1.0% of the bytes the compiled graphs retain)",
                   "Same FX graphs (node counts) in every variant: yes"):
        assert needle in text, needle
    header = next(line for line in text.splitlines() if line.startswith("| workload |"))
    cols = header.count("|") - 1
    table = [line for line in text.splitlines() if line.startswith("| ") and not line.startswith("| workload")]
    assert len(table) == len([n for n, s in B.workload_table(quick=True).items() if s["measure"]])
    assert all(line.count("|") - 1 == cols for line in table)


def test_variant_refuses_the_wrong_torch() -> None:
    """The monkeypatches are built from the installed torch's own source, and a variant never runs on a
    torch that cannot be it."""
    torch = pytest.importorskip("torch")
    variant = B.Variant()
    assert callable(variant.no_st_create_node) and callable(variant.proto_create_proxy)
    patched = hasattr(torch._dynamo.config, "record_call_hierarchy")
    with pytest.raises(RuntimeError, match="needs a torch without" if patched else "needs the whole series"):
        variant.set("fixes" if patched else "enabled")


def test_callgrind_worker_forks_training_compiles() -> None:
    """The callgrind worker forks one child per measured compile: a training compile must run there (since
    torch 2.15 a child forked after its parent ran the autograd engine cannot run it). Run in a process of
    its own, as under valgrind; valgrind's toggle is a no-op without it."""
    pytest.importorskip("torch")
    job = {"mode": "callgrind", "quick": True, "variant": "disabled", "workloads": ["nested_train_d2"],
           "measure": "1", "transformers": False}
    code = f"from scripts import benchmark_overhead as B; print(B.worker_callgrind({job!r}))"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "'workload': 'nested_train_d2'" in proc.stdout


def test_bytecode_report_names_the_functions_that_differ() -> None:
    counts = {
        "fixes": {"w": {"a.py:f": 100, "b.py:g": 900}},
        "disabled": {"w": {"a.py:f": 101, "b.py:g": 900}},
        "enabled": {"w": {"a.py:f": 101, "b.py:g": 900, "c.py:h": 9}},
    }
    text = "\n".join(B.bytecode_report(counts))
    assert "| w | 1,000 | 1,001 | +1 (+0.1000%) | 1,010 | +9 (+0.8991%) |" in text
    assert "- w: `a.py:f` +1" in text and "- w: `c.py:h` +9" in text
    assert "**Flag off vs fixes only, bytecodes** (goal <= 0.01%): MISSED. Largest +0.1000% on w." in text
    assert "**Flag on vs off, bytecodes** (goal <= 0.1%): MISSED. Range +0.8991% to +0.8991%; over the goal" in text
    # an export workload is held to its own goal
    # the saved form (only the functions that differ) gives the same report
    assert B.bytecode_report(B.differing(counts)) == B.bytecode_report(counts)
    assert B.differing(counts)["fixes"]["w"] == {"a.py:f": 100, B.SAME_IN_EVERY_BUILD: 900}
    text = "\n".join(B.bytecode_report(counts, export=["w"]))
    assert "**Non-strict export, flag on vs off, bytecodes** (goal <= 0.3%): MISSED" in text
    assert "**Flag on vs off, bytecodes**" not in text


def test_function_key_is_the_same_in_every_venv() -> None:
    code = compile("pass", "/x/build/bench/venv-fixes/lib/python3.11/site-packages/torch/fx/node.py", "exec")
    assert B.function_key(code) == "torch/fx/node.py:<module>"
    assert B.function_key(compile("pass", "<string>", "exec")) == "<string>:<module>"


def test_measured_venv_is_one_link_at_a_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(B, "MEASURED_VENV", tmp_path / "venv-measured")
    monkeypatch.setattr(B, "VENVS", {"fixes": tmp_path / "venv-fixes", "whole": tmp_path / "venv-whole"})
    with B.measured_venv("fixes") as venv:
        assert venv.is_symlink() and os.readlink(venv) == "venv-fixes"
        with pytest.raises(SystemExit, match="another benchmark run is measuring"):
            with B.measured_venv("enabled"):
                pass
        assert os.readlink(venv) == "venv-fixes"  # the refused run changed nothing
    assert not (tmp_path / "venv-measured").exists()
    with B.measured_venv("enabled") as venv:
        assert os.readlink(venv) == "venv-whole"


def test_family_workloads_build_and_run_a_training_step() -> None:
    # Each transformers family of RFC.md's table builds from a tiny config (nothing downloaded) and runs
    # the step the benchmark compiles: forward, the loss, backward.
    for name in B.FAMILY_CONFIGS:
        spec = B.workload_table(quick=False)[f"{name}_train_l1"]
        assert spec["family"] == name and spec["train"]
        model, args, kwargs = spec["build"]()
        loss = B._loss(model(*args, **kwargs))
        loss.backward()
        assert loss.dim() == 0 and any(p.grad is not None for p in model.parameters()), name


def test_memory_counts_what_the_series_keeps_while_the_model_lives(monkeypatch: pytest.MonkeyPatch) -> None:
    # The module entries kept per compiled root module live as long as the model (RFC.md, "Memos"): the
    # model must outlive the measured graphs, so that the memo is still there to be freed with them.
    import torch._dynamo.call_hierarchy as hierarchy

    memos_at_release: list[int] = []
    forget = B.forget_root_module_entries

    def forget_and_note() -> None:
        # Between compiles a model's entries are kept packed, without their keys (RFC.md, "Memos").
        memos_at_release.append(sum(len(entries) + len(getattr(entries, "packed_entries", ()))
                                    for entries in hierarchy._ROOT_ENTRIES.values()))
        forget()

    monkeypatch.setattr(B, "forget_root_module_entries", forget_and_note)
    out = B.worker_memory({"quick": True, "workloads": ["nested_modules_d1"]})
    rows = out["nested_modules_d1"]["retained"]
    assert len(rows["disabled"]) == len(rows["enabled"]) == 1
    # Called before each compile (nothing kept yet) and after it, once its graphs are dropped.
    assert memos_at_release == [0, 0, 0, memos_at_release[3]] and memos_at_release[3] > 0, memos_at_release
