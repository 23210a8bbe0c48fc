"""Tests of scripts.series on small temporary repositories, fake wheels and fake venvs."""

from __future__ import annotations

import functools
import importlib
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import zipfile
from pathlib import Path

import pytest

from scripts import series as S

from .conftest import BASE_FILES, FAKE_COMMIT, edit, git, install_wheel, make_wheel, numbered, tree_hashes


@pytest.fixture
def make_checkout(make_checkout):  # noqa: F811 - the conftest fixture, with PyTorch's version.txt added
    """A fake PyTorch checkout: the fake torch files plus version.txt naming 2.13 (PyTorch keeps its
    version there), as `apply` requires of a checkout that lacks the base commit."""
    def make(name: str = "pytorch", files: dict[str, str] | None = None) -> Path:
        return make_checkout(name, {"version.txt": "2.13.0a0\n", **(files or BASE_FILES)})
    return make


def snapshot(layout: S.Layout) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(layout.patches.iterdir())}


# --------------------------------------------------------------------------- workspace / export


def test_series_fixture_has_normalized_patches(series_layout: S.Layout) -> None:
    names = S.series_names(series_layout.patches)
    assert names == ["0001-dynamo-add-record_call_hierarchy-config.patch", "0002-fx-mark-node-meta.patch",
                     "0003-Add-torch.fx.call_hierarchy.patch"]
    text = (series_layout.patches / names[0]).read_text()
    assert text.startswith("From 0000000000000000000000000000000000000000 Mon Sep 17 00:00:00 2001\n")
    assert "Subject: [PATCH] [dynamo] add record_call_hierarchy config" in text
    assert "\n-- \n" not in text  # no signature carrying the git version
    assert " 1 file changed" not in text  # no diffstat
    assert any(len(line.split()[1].split("..")[1]) == 40 for line in text.splitlines() if line.startswith("index "))


def test_round_trip_is_byte_identical(series_layout: S.Layout) -> None:
    root = series_layout.root
    git(root, "init", "-q", "-b", "main")
    (root / ".gitignore").write_text((S.REPO_ROOT / ".gitignore").read_text())
    git(root, "add", "patches", ".gitignore")
    git(root, "commit", "-qm", "series")
    before = snapshot(series_layout)
    S.build_workspace(series_layout, force=True)  # re-import with git am, one commit per patch
    log = git(series_layout.workspace, "log", "--format=%s", "base..HEAD").splitlines()
    assert log == ["Add torch.fx.call_hierarchy", "[fx] mark node meta", "[dynamo] add record_call_hierarchy config"]
    S.export(series_layout)
    assert snapshot(series_layout) == before
    assert git(root, "status", "--porcelain") == ""


def test_workspace_baseline_is_reproducible(layout: S.Layout) -> None:
    first = git(S.build_workspace(layout), "rev-parse", "base").strip()
    second = git(S.build_workspace(layout, force=True), "rev-parse", "base").strip()
    assert first == second
    assert not (layout.workspace / "torch/lib/libtorch_fake.so").exists()  # binaries are skipped
    assert git(layout.workspace, "config", "series.upstream").strip() == FAKE_COMMIT


def test_export_refuses_uncommitted_edits(series_layout: S.Layout) -> None:
    before = snapshot(series_layout)
    ws = series_layout.workspace
    edit(ws / "torch/fx/node.py", "node_5 = 5\n", "node_5 = 6\n")
    with pytest.raises(S.SeriesError, match="(?s)uncommitted changes.*torch/fx/node.py"):
        S.export(series_layout)
    (ws / "torch/fx/new.py").write_text("x = 1\n")
    git(ws, "checkout", "torch/fx/node.py")
    with pytest.raises(S.SeriesError, match="torch/fx/new.py"):  # untracked files count too
        S.export(series_layout)
    assert snapshot(series_layout) == before
    assert (ws / "torch/fx/new.py").read_text() == "x = 1\n"


def test_export_rewrites_list_and_removes_stale_patches(series_layout: S.Layout) -> None:
    ws = series_layout.workspace
    git(ws, "reset", "-q", "--hard", "HEAD~1")
    edit(ws / "torch/fx/node.py", "node_12 = 12\n", "node_12 = 13\n")
    git(ws, "commit", "-qa", "--fixup", "HEAD")
    git(ws, "-c", "sequence.editor=true", "rebase", "-q", "-i", "--autosquash", "base")
    S.export(series_layout)
    names = ["0001-dynamo-add-record_call_hierarchy-config.patch", "0002-fx-mark-node-meta.patch"]
    assert (series_layout.patches / ".patches").read_text() == "".join(n + "\n" for n in names)
    assert sorted(p.name for p in series_layout.patches.glob("*.patch")) == names
    assert "+node_12 = 13" in (series_layout.patches / names[1]).read_text()


def test_workspace_refuses_to_replace_unexported_work(series_layout: S.Layout) -> None:
    ws = series_layout.workspace
    edit(ws / "torch/fx/node.py", "node_1 = 1\n", "node_1 = 2\n")
    git(ws, "commit", "-qam", "unexported work")
    with pytest.raises(S.SeriesError, match="not exported.*\n.*rm -rf") as err:
        S.build_workspace(series_layout, force=True)
    assert "scripts.series export" in str(err.value)
    assert git(ws, "log", "-1", "--format=%s").strip() == "unexported work"
    S.export(series_layout)
    S.build_workspace(series_layout, force=True)  # exported: now safe to rebuild
    assert git(ws, "log", "-1", "--format=%s").strip() == "unexported work"


def test_workspace_requires_force_and_refuses_dirty(series_layout: S.Layout) -> None:
    with pytest.raises(S.SeriesError, match="--force"):
        S.build_workspace(series_layout)
    (series_layout.workspace / "scratch.txt").write_text("notes")
    with pytest.raises(S.SeriesError, match="uncommitted changes"):
        S.build_workspace(series_layout, force=True)
    assert (series_layout.workspace / "scratch.txt").read_text() == "notes"


def test_empty_series_everywhere(layout: S.Layout, site_packages: Path, make_checkout) -> None:
    S.build_workspace(layout)
    assert S.export(layout) == []
    assert (layout.patches / ".patches").read_text() == ""
    checkout = make_checkout()
    assert S.apply_to_checkout(layout, checkout) == 0
    assert S.install(site_packages, [], "2.13.0").startswith("already installed")
    assert S.install_state(site_packages, [], "2.13.0").state == "current"
    assert not (site_packages / S.STAMP_DIR).exists()


def test_series_list_must_match_files(series_layout: S.Layout) -> None:
    (series_layout.patches / "0009-stray.patch").write_text("From x\n")
    with pytest.raises(S.SeriesError, match="not listed.*0009-stray.patch"):
        S.load_series(series_layout.patches)
    (series_layout.patches / "0009-stray.patch").unlink()
    (series_layout.patches / ".patches").write_text("0001-missing.patch\n")
    with pytest.raises(S.SeriesError, match="lists 0001-missing.patch"):
        S.series_names(series_layout.patches)


# --------------------------------------------------------------------------- apply to a checkout


def test_apply_then_apply_again_is_noop(series_layout: S.Layout, make_checkout, capsys) -> None:
    checkout = make_checkout()
    S.apply_to_checkout(series_layout, checkout)
    head = git(checkout, "rev-parse", "HEAD")
    assert git(checkout, "log", "--format=%s", "-3").splitlines()[0] == "Add torch.fx.call_hierarchy"
    assert "record_call_hierarchy = False" in (checkout / "torch/_dynamo/config.py").read_text()
    S.apply_to_checkout(series_layout, checkout)
    assert "nothing to do" in capsys.readouterr().out
    assert git(checkout, "rev-parse", "HEAD") == head


def test_apply_finishes_a_partially_applied_series(series_layout: S.Layout, make_checkout) -> None:
    checkout = make_checkout()
    first = series_layout.patches / S.series_names(series_layout.patches)[0]
    # By hand, with a plain `git am` (as shared/hooks/before-stop does): the file's `From:` has a name and
    # no address, which git accepts.
    git(checkout, "am", "-q", "--3way", str(first))
    assert authors(checkout, 1)[0].split("|")[0] == "RFC-0051 patch series <>"
    S.apply_to_checkout(series_layout, checkout)
    subjects = git(checkout, "log", "--format=%s").splitlines()
    # (a plain `git am` drops the subject's "[dynamo] ", as git does; found by its patch-id)
    assert [s.endswith("add record_call_hierarchy config") for s in subjects].count(True) == 1
    assert len(subjects) == 4


def test_apply_refuses_dirty_checkout(series_layout: S.Layout, make_checkout) -> None:
    checkout = make_checkout()
    edit(checkout / "torch/fx/node.py", "node_3 = 3\n", "node_3 = 'my work'\n")
    head = git(checkout, "rev-parse", "HEAD")
    with pytest.raises(S.SeriesError, match="uncommitted changes.*commit or stash"):
        S.apply_to_checkout(series_layout, checkout)
    assert "node_3 = 'my work'" in (checkout / "torch/fx/node.py").read_text()
    assert git(checkout, "rev-parse", "HEAD") == head


def test_apply_conflict_leaves_recoverable_am_state(series_layout: S.Layout, make_checkout) -> None:
    files = dict(BASE_FILES, **{"torch/fx/node.py": numbered("node").replace("node_10 = 10\n", "node_10 = 'upstream'\n")})
    checkout = make_checkout(files=files)
    (checkout / "untracked-notes.txt").write_text("keep me")
    head = git(checkout, "rev-parse", "HEAD").strip()
    with pytest.raises(S.SeriesConflict) as err:
        S.apply_to_checkout(series_layout, checkout)
    msg = str(err.value)
    assert "patch 2/3 0002-fx-mark-node-meta.patch" in msg
    assert "conflicted files: torch/fx/node.py" in msg
    assert "am --continue" in msg and "am --abort" in msg
    assert (checkout / ".git" / "rebase-apply").is_dir()
    git(checkout, "am", "--abort")
    assert git(checkout, "rev-parse", "HEAD").strip() == head
    assert git(checkout, "status", "--porcelain", "--untracked-files=no") == ""
    assert (checkout / "untracked-notes.txt").read_text() == "keep me"
    with pytest.raises(S.SeriesConflict):  # again, then resolve by hand and continue
        S.apply_to_checkout(series_layout, checkout)
    (checkout / "torch/fx/node.py").write_text(files["torch/fx/node.py"].replace(
        "node_10 = 'upstream'\n", "node_10 = 'upstream'  # call_hierarchy\n"))
    git(checkout, "add", "torch/fx/node.py")
    git(checkout, "am", "--continue")
    assert git(checkout, "log", "-1", "--format=%s").strip() == "Add torch.fx.call_hierarchy"
    # 0002 as resolved has another patch-id: its subject and message still say it is there
    assert S.apply_to_checkout(series_layout, checkout) == 0
    assert git(checkout, "log", "-1", "--format=%s").strip() == "Add torch.fx.call_hierarchy"


def test_apply_refuses_when_am_in_progress(series_layout: S.Layout, make_checkout) -> None:
    files = dict(BASE_FILES, **{"torch/fx/node.py": numbered("node").replace("node_10 = 10\n", "x\n")})
    checkout = make_checkout(files=files)
    with pytest.raises(S.SeriesConflict):
        S.apply_to_checkout(series_layout, checkout)
    with pytest.raises(S.SeriesError, match="in progress"):
        S.apply_to_checkout(series_layout, checkout)


def truncate_mid_hunk(path: Path) -> None:
    lines = path.read_text().splitlines(keepends=True)
    path.write_text("".join(lines[:-2]))


def truncate_mid_line(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-7])


def garbage(path: Path) -> None:
    path.write_text("this is not a patch\n")


def empty(path: Path) -> None:
    path.write_text("")


@pytest.mark.parametrize("corrupt", [truncate_mid_hunk, truncate_mid_line, garbage, empty])
def test_corrupt_patch_is_refused_and_nothing_changes(series_layout: S.Layout, make_checkout, site_packages: Path,
                                                     corrupt) -> None:
    name = S.series_names(series_layout.patches)[1]
    corrupt(series_layout.patches / name)
    checkout = make_checkout()
    head = git(checkout, "rev-parse", "HEAD")
    with pytest.raises(S.SeriesError, match=name):
        S.apply_to_checkout(series_layout, checkout)
    assert git(checkout, "rev-parse", "HEAD") == head
    assert not (checkout / ".git" / "rebase-apply").exists()
    before = tree_hashes(site_packages)
    with pytest.raises(S.SeriesError, match=name):
        S.install(site_packages, S.load_series(series_layout.patches), "2.13.0")
    assert tree_hashes(site_packages) == before


def test_patch_missing_a_whole_hunk_is_caught_by_blob_check(series_layout: S.Layout, site_packages: Path) -> None:
    """A cut exactly between two hunks still parses; the full-index blob ids catch it."""
    path = series_layout.patches / S.series_names(series_layout.patches)[0]
    text = path.read_text()
    path.write_text(text[: text.rindex("@@ -")])  # drop the second hunk of torch/_dynamo/config.py
    before = tree_hashes(site_packages)
    with pytest.raises(S.SeriesError, match="truncated or was edited by hand"):
        S.install(site_packages, S.load_series(series_layout.patches), "2.13.0")
    assert tree_hashes(site_packages) == before


# --------------------------------------------------------------------------- install / status / revert


def test_install_status_revert(series_layout: S.Layout, site_packages: Path) -> None:
    series = S.load_series(series_layout.patches)
    pristine = tree_hashes(site_packages)
    assert S.install_state(site_packages, series, "2.13.0").state == "pristine"
    assert S.install(site_packages, series, "2.13.0").startswith("installed series")
    assert "record_call_hierarchy = False" in (site_packages / "torch/_dynamo/config.py").read_text()
    assert (site_packages / "torch/fx/call_hierarchy.py").exists()
    assert not (site_packages / "test").exists()  # upstream tests are not installed
    assert S.install_state(site_packages, series, "2.13.0").state == "current"
    installed = tree_hashes(site_packages)
    assert S.install(site_packages, series, "2.13.0").startswith("already installed")
    assert tree_hashes(site_packages) == installed
    S.revert(site_packages, "2.13.0")
    assert tree_hashes(site_packages) == pristine
    record = S.record_hashes(site_packages / "torch-2.13.0+cpu.dist-info")
    for rel in ("torch/_dynamo/config.py", "torch/fx/node.py", "torch/__init__.py"):
        assert S.sha256_file(site_packages / rel) == record[rel]
    assert S.install_state(site_packages, series, "2.13.0").state == "pristine"


def test_stale_series_is_replaced(series_layout: S.Layout, site_packages: Path) -> None:
    S.install(site_packages, S.load_series(series_layout.patches), "2.13.0")
    ws = series_layout.workspace
    git(ws, "reset", "-q", "--hard", "HEAD~1")  # drop 0003 (which added torch/fx/call_hierarchy.py)
    S.export(series_layout)
    series = S.load_series(series_layout.patches)
    assert S.install_state(site_packages, series, "2.13.0").state == "stale"
    S.install(site_packages, series, "2.13.0")
    assert S.install_state(site_packages, series, "2.13.0").state == "current"
    assert not (site_packages / "torch/fx/call_hierarchy.py").exists()
    assert (site_packages / "torch/__init__.py").read_text() == BASE_FILES["torch/__init__.py"]


def test_install_refuses_hand_edited_files(series_layout: S.Layout, site_packages: Path) -> None:
    series = S.load_series(series_layout.patches)
    S.install(site_packages, series, "2.13.0")
    target = site_packages / "torch/fx/node.py"
    target.write_text(target.read_text() + "# my debugging\n")
    assert S.install_state(site_packages, series, "2.13.0").state == "modified"
    with pytest.raises(S.SeriesError, match="torch/fx/node.py"):
        S.install(site_packages, series, "2.13.0")
    assert target.read_text().endswith("# my debugging\n")
    # issue 15 case 6: --revert never discards hand edits silently: it refuses, or saves them first
    with pytest.raises(S.SeriesError, match=r"(?s)refusing to revert: torch/fx/node.py .*--force to save them"):
        S.revert(site_packages, "2.13.0")
    assert target.read_text().endswith("# my debugging\n")
    msg = S.revert(site_packages, "2.13.0", force=True)
    saved = Path(re.search(r"saved your edits to torch/fx/node.py in (\S+)", msg).group(1))
    assert (saved / "torch/fx/node.py").read_text().endswith("# my debugging\n")
    assert target.read_text() == BASE_FILES["torch/fx/node.py"]


def test_wrong_torch_version_is_refused_naming_both(series_layout: S.Layout, tmp_path: Path) -> None:
    wheel = make_wheel(tmp_path / "other" / "torch-2.14.1-cp311-cp311-linux_x86_64.whl", "2.14.1", BASE_FILES)
    sp = install_wheel(wheel, tmp_path / "venv214")
    before = tree_hashes(sp)
    for call in (lambda: S.install(sp, S.load_series(series_layout.patches), "2.13.0"),
                 lambda: S.install_state(sp, [], "2.13.0"), lambda: S.revert(sp, "2.13.0")):
        with pytest.raises(S.SeriesError, match=r"is 2\.14\.1, but the series is pinned to torch 2\.13\.0"):
            call()
    assert tree_hashes(sp) == before


def run_cli(layout: S.Layout, *args: str) -> subprocess.CompletedProcess[str]:
    """`python3 -m scripts.series --repo-root <layout> ARGS`, captured."""
    return subprocess.run([sys.executable, "-m", "scripts.series", "--repo-root", str(layout.root), *args],
                          cwd=S.REPO_ROOT, capture_output=True, text=True)


def test_cli_install_status_and_errors(series_layout: S.Layout, site_packages: Path) -> None:
    cli = functools.partial(run_cli, series_layout)
    sp = ["--site-packages", str(site_packages)]
    assert cli("status", *sp).stdout.startswith("pristine")
    assert cli("install", *sp).returncode == 0
    assert cli("status", *sp).stdout.startswith("current")
    assert cli("install", "--revert", *sp).returncode == 0
    bad = cli("apply", str(series_layout.root / "no-such-checkout"))
    assert bad.returncode == 2 and bad.stderr.startswith("error: ") and "not a git checkout" in bad.stderr
    listed = cli("upstream-tests", "--list")
    assert listed.stdout.split() == ["test/dynamo/test_fake_hierarchy.py"]


# --------------------------------------------------------------------------- radar, upstream tests


def test_radar_reports_clean_fuzz_and_conflict(series_layout: S.Layout, base_wheel: Path, tmp_path: Path) -> None:
    target_files = dict(BASE_FILES)
    target_files["torch/_dynamo/config.py"] = "# new header\n" * 5 + numbered("option")  # offsets only
    target_files["torch/fx/node.py"] = numbered("node").replace("node_10 = 10\n", "node_10 = 'changed'\n")
    target = make_wheel(tmp_path / "t" / "torch-2.14.1-cp311-cp311-linux_x86_64.whl", "2.14.1", target_files)
    results = {name: (status, files) for name, status, files in
               S.radar(S.load_series(series_layout.patches), base_wheel, target)}
    assert results["0001-dynamo-add-record_call_hierarchy-config.patch"] == (
        "fuzz (offsets in torch/_dynamo/config.py)", ["torch/_dynamo/config.py"])
    assert results["0002-fx-mark-node-meta.patch"] == ("conflict", ["torch/fx/node.py"])
    assert results["0003-Add-torch.fx.call_hierarchy.patch"][0] == "clean"
    same = S.radar(S.load_series(series_layout.patches), base_wheel, base_wheel)
    assert [status for _, status, _ in same] == ["clean"] * 3


def test_radar_follows_files_the_series_creates(series_layout: S.Layout, base_wheel: Path) -> None:
    ws = series_layout.workspace
    edit(ws / "torch/fx/call_hierarchy.py", "HIERARCHY = []\n", "HIERARCHY: list[str] = []\n")
    edit(ws / "test/dynamo/test_fake_hierarchy.py", "import unittest\n", "import unittest  # upstream\n")
    git(ws, "commit", "-qam", "Type HIERARCHY")
    S.export(series_layout)
    results = S.radar(S.load_series(series_layout.patches), base_wheel, base_wheel)
    assert results[-1] == ("0004-Type-HIERARCHY.patch", "clean",
                           ["test/dynamo/test_fake_hierarchy.py", "torch/fx/call_hierarchy.py"])
    assert len(results) == 4  # nothing reported as skipped


def test_radar_three_way_merge_is_fuzz(series_layout: S.Layout, base_wheel: Path, tmp_path: Path) -> None:
    target_files = dict(BASE_FILES)  # a change right next to the patched line: context differs, merge is clean
    target_files["torch/_dynamo/config.py"] = numbered("option").replace("option_22 = 22\n", "option_22 = 'x'\n")
    target = make_wheel(tmp_path / "t" / "torch-2.14.1-cp311-cp311-linux_x86_64.whl", "2.14.1", target_files)
    results = S.radar(S.load_series(series_layout.patches), base_wheel, target)
    assert results[0][1] == "fuzz (3-way merge)"


def test_upstream_tests_run_against_installed_torch(series_layout: S.Layout, tmp_path: Path) -> None:
    series = S.load_series(series_layout.patches)
    assert S.upstream_test_files(series) == ["test/dynamo/test_fake_hierarchy.py"]
    fake_torch = tmp_path / "fake_torch_site"
    (fake_torch / "torch" / "_dynamo").mkdir(parents=True)
    (fake_torch / "torch" / "__init__.py").write_text("__version__ = 'fake'\n")
    config = fake_torch / "torch" / "_dynamo" / "config.py"
    config.write_text("record_call_hierarchy = False\n")
    python = tmp_path / "python"
    python.write_text(f"#!/bin/sh\nPYTHONPATH={fake_torch} exec {sys.executable} \"$@\"\n")
    python.chmod(0o755)
    assert S.run_upstream_tests(series, python, None, []) == 0
    assert S.run_upstream_tests(series, python, None, [], pytest=True) == 0
    config.write_text("record_call_hierarchy = True\n")
    assert S.run_upstream_tests(series, python, None, []) == 1
    assert S.run_upstream_tests(series, python, None, [], pytest=True) == 1



TORCH_RUN_TESTS = """from torch.testing._internal.common_utils import TestCase, run_tests


class T(TestCase):
    def test_runs(self):
        self.assertEqual(1 + 1, 2)


if __name__ == "__main__":
    run_tests()
"""


def test_upstream_tests_pass_under_a_ci_environment(series_layout: S.Layout, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    # With CI set, torch's run_tests writes JUnit XML through xmlrunner, which the venv lacks
    # (the series' tests need only torch and expecttest): CI=true failed this project's CI once.
    python = S.Layout(S.REPO_ROOT).venv / "bin" / "python"
    if not python.exists():
        pytest.skip("no .venv here (run `python3 -m scripts.series setup`)")
    tree = tmp_path / "tree"
    (tree / "test" / "dynamo").mkdir(parents=True)
    (tree / "test" / "dynamo" / "test_fake_hierarchy.py").write_text(TORCH_RUN_TESTS)
    monkeypatch.setenv("CI", "true")
    assert S.run_upstream_tests(S.load_series(series_layout.patches), python, tree, []) == 0


# --------------------------------------------------------------------------- the real series and environment


def test_real_series_applies_to_pinned_wheel_sources() -> None:
    """What shared/hooks/before-stop checks: the committed series applies with git am to pristine sources."""
    layout = S.Layout(S.REPO_ROOT)
    series = S.load_series(layout.patches)
    base = layout.base()
    assert base["torch_version"] == "2.15.0" and base["commit"] == "d0f2af8b66b20da4baa50644c0cd3f887a2eae2e"
    if not series:
        return
    try:
        wheel = S.find_wheel(base["torch_version"], layout.wheels)
    except S.SeriesError as exc:
        pytest.skip(f"pinned wheel not available: {exc}")
    work = S.REPO_ROOT / "build" / "test-real-series"
    if work.exists():
        import shutil
        shutil.rmtree(work)
    S.init_repo(work)
    S.extract_wheel_sources(wheel, work, [p for patch in series for p in patch.paths()])
    S.commit_all(work, "base")
    S.run_am(work, series, S.isolated_env(), len(series))
    commits = git(work, "rev-list", "--reverse", f"HEAD~{len(series)}..HEAD").split()
    S.verify_postimages(work, commits, series)


def test_repo_venv_has_current_series() -> None:
    layout = S.Layout(S.REPO_ROOT)
    if not (layout.venv / "bin" / "python").exists():
        pytest.skip("no .venv here (run `python3 -m scripts.series setup`)")
    state = S.install_state(S.site_packages(layout.venv), S.load_series(layout.patches), layout.base()["torch_version"])
    assert state.state == "current", state.detail


def test_base_json_keys() -> None:
    data = json.loads((S.REPO_ROOT / "patches" / "base.json").read_text())
    assert {"torch_version", "commit", "python"} <= set(data)
    assert data["python"] == "3.11"
    assert os.path.exists(S.REPO_ROOT / "patches" / ".patches")


def test_workspace_from_a_checkout(series_layout: S.Layout, make_checkout) -> None:
    checkout = make_checkout()
    edit(checkout / "torch/fx/node.py", "node_39 = 39\n", "node_39 = 'later upstream work'\n")
    git(checkout, "commit", "-qam", "later upstream commit")
    base_json = series_layout.patches / "base.json"
    with pytest.raises(S.SeriesError, match="does not contain the base commit"):
        S.build_workspace(series_layout, checkout=checkout, force=True)
    upstream = git(checkout, "rev-parse", "HEAD~1").strip()
    base_json.write_text(json.dumps({"torch_version": "2.13.0", "commit": upstream, "python": "3.11"}))
    before = snapshot(series_layout)
    S.build_workspace(series_layout, checkout=checkout, force=True)
    ws = series_layout.workspace
    assert git(ws, "rev-parse", "base").strip() == upstream
    assert len(git(ws, "rev-list", f"{upstream}..HEAD").split()) == 3
    S.export(series_layout)
    assert snapshot(series_layout) == before
    assert git(checkout, "log", "-1", "--format=%s").strip() == "later upstream commit"  # checkout untouched


# --------------------------------------------------------------------------- install a prefix (--through)


def test_install_through_a_prefix(series_layout: S.Layout, site_packages: Path) -> None:
    series = S.load_series(series_layout.patches)
    assert S.prefix_length(series, "0002") == 2
    assert S.prefix_length(series, "0002-fx-mark-node-meta.patch") == 2
    assert S.prefix_length(series, "0002-fx-mark-node-meta") == 2
    assert S.prefix_length(series, None) == 3
    with pytest.raises(S.SeriesError, match=r"--through 0007: no such patch.*0001-dynamo"):
        S.prefix_length(series, "0007")
    pristine = tree_hashes(site_packages)
    assert "patches 0001..0002 of 3" in S.install(site_packages, series, "2.13.0", "0002")
    assert "# call_hierarchy" in (site_packages / "torch/fx/node.py").read_text()
    assert not (site_packages / "torch/fx/call_hierarchy.py").exists()  # 0003 is not installed
    assert (site_packages / "torch/__init__.py").read_text() == BASE_FILES["torch/__init__.py"]
    st = S.install_state(site_packages, series, "2.13.0", follow_stamp=True)  # what `status` reports
    assert (st.state, st.detail.split(":")[0]) == ("current", "patches 0001..0002 of 3")
    assert S.install_state(site_packages, series, "2.13.0", "0002").state == "current"
    assert S.install_state(site_packages, series, "2.13.0").state == "stale"  # not the whole series
    assert S.install(site_packages, series, "2.13.0", "0002").startswith("already installed")
    S.install(site_packages, series, "2.13.0", "0001")  # a shorter prefix replaces it
    assert "# call_hierarchy" not in (site_packages / "torch/fx/node.py").read_text()
    assert S.install_state(site_packages, series, "2.13.0", follow_stamp=True).detail.startswith("patch 0001 of 3")
    assert "patches 0001..0003 of 3" in S.install(site_packages, series, "2.13.0")  # no --through: everything
    assert (site_packages / "torch/fx/call_hierarchy.py").exists()
    assert S.install_state(site_packages, series, "2.13.0", follow_stamp=True).state == "current"
    S.revert(site_packages, "2.13.0")
    assert tree_hashes(site_packages) == pristine


def test_cli_through(series_layout: S.Layout, site_packages: Path) -> None:
    cli = functools.partial(run_cli, series_layout)
    sp = ["--site-packages", str(site_packages)]
    before = tree_hashes(site_packages)
    bad = cli("install", "--through", "0009", *sp)
    assert bad.returncode == 2 and "no such patch" in bad.stderr
    assert tree_hashes(site_packages) == before
    assert cli("install", "--through", "0002", *sp).returncode == 0
    assert cli("status", *sp).stdout.startswith("current: patches 0001..0002 of 3")
    assert cli("status", "--through", "0003", *sp).stdout.startswith("stale: patches 0001..0002 of 3")
    bad = cli("setup", "--venv", str(series_layout.root / "v"), "--through", "nope")
    assert bad.returncode == 2 and "no such patch" in bad.stderr and not (series_layout.root / "v").exists()


# --------------------------------------------------------------------------- Python matrix (--python 3.X)


def fake_pyenv(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, versions: list[str]) -> Path:
    """A `pyenv` on PATH whose root holds versions/<v>/bin/python for each version."""
    root, bindir = tmp_path / "pyenv-root", tmp_path / "bin"
    bindir.mkdir()
    for v in versions:
        (root / "versions" / v / "bin").mkdir(parents=True)
        (root / "versions" / v / "bin" / "python").write_text("#!/bin/sh\n")
    (bindir / "pyenv").write_text(f"#!/bin/sh\n[ \"$1\" = root ] && echo {root}\n")
    (bindir / "pyenv").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bindir}:/usr/bin:/bin")
    return root


def test_find_python_uses_pyenv_and_names_what_is_missing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = fake_pyenv(tmp_path, monkeypatch, ["3.13.2", "3.13.10", "3.12.1", "3.130.0"])
    assert S.find_python("3.13") == str(root / "versions/3.13.10/bin/python")  # newest patch release
    assert S.find_python("3.12") == str(root / "versions/3.12.1/bin/python")
    assert S.find_python(f"3.{sys.version_info[1]}") == sys.executable
    with pytest.raises(S.SeriesError, match=r"Python 3\.9 is not available.*versions/3\.9\.\*/bin/python.*pyenv install 3\.9"):
        S.find_python("3.9")
    with pytest.raises(S.SeriesError, match="give a Python version"):
        S.find_python("ten")


def test_setup_for_a_missing_python_creates_nothing(series_layout: S.Layout, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    fake_pyenv(tmp_path, monkeypatch, ["3.12.1"])
    with pytest.raises(S.SeriesError, match=r"Python 3\.99 is not available"):
        S.setup(series_layout, python="3.99")
    assert not (series_layout.root / ".venv-py3.99").exists()


def test_setup_refuses_a_python_older_than_the_base_supports(series_layout: S.Layout, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """The pinned torch (2.15) needs Python 3.11 or newer: --python 3.10 is refused before anything is
    created, even where a 3.10 interpreter is at hand."""
    fake_pyenv(tmp_path, monkeypatch, ["3.10.13"])
    for old in ("3.10", "3.9"):
        with pytest.raises(S.SeriesError, match=rf"--python {re.escape(old)}: torch 2\.13\.0 "
                                                r"\(patches/base\.json\) needs Python 3\.11 or newer"):
            S.setup(series_layout, python=old)
        assert not (series_layout.root / f".venv-py{old}").exists()
    assert S.OLDEST_PYTHON == (3, 11)


FAKE_PIP = """
import json, os, sys
args = sys.argv[1:]
with open(os.environ["PIP_LOG"], "a") as log:
    log.write(json.dumps(args) + "\\n")
with open(os.environ["PIP_LOG"] + ".env", "a") as log:  # what pip would read as its constraints file
    log.write(json.dumps(os.environ.get("PIP_CONSTRAINT")) + "\\n")
if "--report" in args:
    install = [{"metadata": {"name": n, "version": v}} for n, v in (("torch", "2.13.0"), ("nvidia-cublas", "13.1"))]
    with open(args[args.index("--report") + 1], "w") as fh:
        json.dump({"install": install}, fh)
sys.exit(1 if os.environ.get("PIP_FAIL", "-") in args else 0)
"""


def test_other_python_installs_one_wheel_at_a_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """pip resolves once (--dry-run --report), installs each resolved distribution alone, then checks the set:
    a single install would keep every CUDA wheel (GBs) on disk beside what it installs; every call runs with
    PIP_CONSTRAINT=/dev/null."""
    (fake := tmp_path / "pip.py").write_text(FAKE_PIP)
    monkeypatch.setenv("PIP_LOG", str(log := tmp_path / "log"))
    monkeypatch.setenv("PIP_CONSTRAINT", "/etc/xdg/pip/constraints.txt")  # as a configured cap would have it
    pip = [sys.executable, str(fake), "-q"]
    assert S.pip_install_one_at_a_time(pip, ["torch==2.13.0", "pytest==9.2.0"], "c.txt").returncode == 0
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    assert calls[0][:2] == ["-q", "--dry-run"] and calls[0][4:] == ["torch==2.13.0", "pytest==9.2.0", "-c", "c.txt"]
    assert calls[1:] == [["-q", "--no-deps", "torch==2.13.0", "-c", "c.txt"],
                         ["-q", "--no-deps", "nvidia-cublas==13.1", "-c", "c.txt"],
                         ["-q", "torch==2.13.0", "pytest==9.2.0", "-c", "c.txt"]]
    # every call past any constraints file of the machine's pip configuration (the pin is the -c file)
    assert [json.loads(line) for line in Path(f"{log}.env").read_text().splitlines()] == ["/dev/null"] * 4
    log.unlink()
    monkeypatch.setenv("PIP_FAIL", "torch==2.13.0")  # the first wheel fails: nothing after it is tried
    assert S.pip_install_one_at_a_time(pip, ["torch==2.13.0"], "c.txt").returncode == 1
    assert [c[1] for c in map(json.loads, log.read_text().splitlines())] == ["--dry-run"]


def test_other_python_venv_is_refused_on_a_full_disk(series_layout: S.Layout, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    fake_pyenv(tmp_path, monkeypatch, ["3.12.1"])
    free = S.CUDA_VENV_FREE_BYTES - 1
    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10 * free, 9 * free, free))
    with pytest.raises(S.SeriesError, match=r"creating .*\.venv-py3\.12 needs about 7\.0 GB of free disk .*CUDA "
                                            r"build.*only 7\.0 GB is free on .*; free some and rerun"):
        S.setup(series_layout, python="3.12")
    assert not (series_layout.root / ".venv-py3.12").exists()


def test_repo_venv_is_refused_on_a_full_disk(series_layout: S.Layout, tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """.venv (Python 3.11) gets the registry's CUDA build of torch too (about 5.4 GB): creating it is refused
    with less than CUDA_VENV_FREE_BYTES free, before anything is created or downloaded."""
    fake_pyenv(tmp_path, monkeypatch, ["3.11.9"])
    assert S.CUDA_VENV_FREE_BYTES >= 7_000_000_000
    free = S.CUDA_VENV_FREE_BYTES - 1
    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10 * free, 9 * free, free))
    with pytest.raises(S.SeriesError, match=r"creating .*/\.venv needs about 7\.0 GB of free disk \(the pinned torch "
                                            r"is the registry's CUDA build, about 5\.4 GB installed.*\), but only "
                                            r"7\.0 GB is free on .*; free some and rerun"):
        S.setup(series_layout)
    assert not series_layout.venv.exists()


def test_only_venvs_that_pip_fills_need_the_free_disk(series_layout: S.Layout, tmp_path: Path) -> None:
    """.venv and another Python's venv are filled by pip (GBs); a further 3.11 venv is not when .venv holds
    exactly its requirements, as seed_from then makes it of hard links (megabytes: CI's disk is small)."""
    root = series_layout.root
    (root / "requirements.txt").write_text("torch==2.13.0\nexpecttest==0.3.0\nnumpy==2.4.6\npytest==9.2.0\n")
    extra = tmp_path / "venv-whole"
    assert S.pip_fills(series_layout, series_layout.venv, "3.11")
    assert S.pip_fills(series_layout, root / ".venv-py3.12", "3.12")
    assert S.pip_fills(series_layout, extra, "3.11")  # no .venv to seed from
    series_layout.venv.mkdir()
    stamp = series_layout.venv / ".workbench-requirements"
    stamp.write_text("an older requirements.txt\n")
    assert S.pip_fills(series_layout, extra, "3.11")
    stamp.write_text(S.venv_requirements(series_layout, "3.11")[2] + "\n")
    assert not S.pip_fills(series_layout, extra, "3.11")
    assert S.pip_fills(series_layout, series_layout.venv, "3.11") and S.pip_fills(series_layout, extra, "3.12")


FAKE_VENV_PYTHON = """
import os, runpy, sys
if sys.argv[1:2] == ["-c"]:  # setup's probe of the venv's Python version
    print("3.11")
    sys.exit(0)
assert sys.argv[1:3] == ["-m", "pip"], sys.argv
sys.argv = [os.environ["FAKE_PIP"], *sys.argv[3:]]
runpy.run_path(os.environ["FAKE_PIP"], run_name="__main__")
"""


def test_repo_venv_pip_calls_lift_a_configured_constraint(series_layout: S.Layout, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """setup's pip for .venv: one wheel at a time (the CUDA build), no cache, the pin as -c, and every call with
    PIP_CONSTRAINT=/dev/null, so a constraints file in the machine's pip configuration (torch<=2.14.1 on one
    machine) cannot refuse the pinned torch."""
    root = series_layout.root
    (root / "requirements.txt").write_text("torch==2.13.0\npytest==9.2.0\n")
    (root / "requirements-nodeps.txt").write_text("hta==0.2\n")
    (fake_pip := tmp_path / "pip.py").write_text(FAKE_PIP)
    (series_layout.venv / "bin").mkdir(parents=True)
    (series_layout.venv / "lib" / "python3.11" / "site-packages").mkdir(parents=True)
    py = series_layout.venv / "bin" / "python"
    py.write_text(f"#!/bin/sh\nexec {sys.executable} {tmp_path / 'py.py'} \"$@\"\n")
    py.chmod(0o755)
    (tmp_path / "py.py").write_text(FAKE_VENV_PYTHON)
    monkeypatch.setenv("FAKE_PIP", str(fake_pip))
    monkeypatch.setenv("PIP_LOG", str(log := tmp_path / "log"))
    monkeypatch.setenv("PIP_CONSTRAINT", "/etc/xdg/pip/constraints.txt")
    envs = importlib.import_module("scripts.series.envs")
    monkeypatch.setattr(envs, "install_actionlint", lambda folder: None)
    monkeypatch.setattr(envs, "install", lambda *args, **kwargs: "installed")
    assert S.setup(series_layout) == "installed"
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    req, nodeps = str(root / "requirements.txt"), str(root / "requirements-nodeps.txt")
    head = ["install", "-q", "--disable-pip-version-check", "--no-cache-dir"]
    assert [c[:4] for c in calls] == [head] * 5
    assert calls[0][4:7] == ["--dry-run", "--report", calls[0][6]] and calls[0][7:10] == ["-r", req, "-c"]
    assert [c[4:-1] for c in calls[1:]] == [["--no-deps", "torch==2.13.0", "-c"],
                                            ["--no-deps", "nvidia-cublas==13.1", "-c"],
                                            ["-r", req, "-c"], ["--no-deps", "-r", nodeps, "-c"]]
    assert len({c[-1] for c in calls}) == 1  # one constraints file for all: the pin
    assert [json.loads(line) for line in Path(f"{log}.env").read_text().splitlines()] == ["/dev/null"] * 5
    assert (series_layout.venv / ".workbench-requirements").exists()


def test_find_wheel_downloads_past_a_configured_constraint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """find_wheel's `pip download` runs with PIP_CONSTRAINT=/dev/null too."""
    seen: list[dict[str, str]] = []

    def fake_run(cmd: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
        assert cmd[1:4] == ["-m", "pip", "download"] and "torch==2.15.0" in cmd
        seen.append(kwargs["env"])  # type: ignore[arg-type]
        dest = Path(cmd[cmd.index("-d") + 1])
        (dest / "torch-2.15.0-cp311-cp311-manylinux_2_28_x86_64.whl").write_bytes(b"")
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setenv("PIP_CONSTRAINT", "/etc/xdg/pip/constraints.txt")
    monkeypatch.setattr(importlib.import_module("scripts.series.git").subprocess, "run", fake_run)
    assert S.find_wheel("2.15.0", tmp_path / "wheels").name.startswith("torch-2.15.0-")
    assert [env["PIP_CONSTRAINT"] for env in seen] == ["/dev/null"]
    assert S.find_wheel("2.15.0", tmp_path / "wheels") and len(seen) == 1  # cached: no second download


def test_matrix_venvs_and_pins(series_layout: S.Layout, tmp_path: Path) -> None:
    root = series_layout.root
    assert S.matrix_venv(series_layout, None) == S.matrix_venv(series_layout, "3.11") == root / ".venv"
    assert S.matrix_venv(series_layout, "3.12") == root / ".venv-py3.12"
    with pytest.raises(S.SeriesError, match=r"no venv for Python 3\.12 .*setup --python 3\.12"):
        S.upstream_python(series_layout, "3.12")
    (root / ".venv-py3.12" / "bin").mkdir(parents=True)
    (root / ".venv-py3.12" / "bin" / "python").write_text("")
    assert S.upstream_python(series_layout, "3.12") == root / ".venv-py3.12" / "bin" / "python"
    assert S.upstream_python(series_layout, "/opt/py/bin/python") == Path("/opt/py/bin/python")  # a path, as before
    req = tmp_path / "requirements.txt"
    req.write_text("# pins\ntorch==2.13.0\npytest==9.2.0\nexpecttest==0.3.0  # why\n"
                   'numpy==2.4.6; python_version >= "3.11"\nnumpy==2.2.6; python_version < "3.11"\n')
    assert S.pinned_requirements(req, S.UPSTREAM_TEST_REQUIREMENTS) == [
        "torch==2.13.0", "expecttest==0.3.0", 'numpy==2.4.6; python_version >= "3.11"',
        'numpy==2.2.6; python_version < "3.11"', "pytest==9.2.0"]
    real = S.pinned_requirements(S.REPO_ROOT / "requirements.txt", S.UPSTREAM_TEST_REQUIREMENTS)
    assert real[0] == f"torch=={S.Layout(S.REPO_ROOT).base()['torch_version']}"
    assert not any("python_version" in line for line in real)  # one pin each: no Python older than 3.11
    req.write_text("torch==2.13.0\n")
    with pytest.raises(S.SeriesError, match="pins no exact version of expecttest, numpy, pytest"):
        S.pinned_requirements(req, S.UPSTREAM_TEST_REQUIREMENTS)


def test_seeded_venv_shares_files_and_switching_it_leaves_the_source_alone(series_layout: S.Layout,
                                                                          base_wheel: Path) -> None:
    """A second 3.11 venv is hard links to .venv's site-packages (CI's disk is small); installing another
    prefix of the series into it replaces files there and never writes through a link into .venv."""
    root = series_layout.root
    src = install_wheel(base_wheel, root / ".venv")
    S.install(src, S.load_series(series_layout.patches), "2.13.0")
    (root / ".venv" / ".workbench-requirements").write_text("want\n")
    before = tree_hashes(src)
    other = root / "build" / "venv-fixes"
    dst = other / "lib" / "python3.11" / "site-packages"
    dst.mkdir(parents=True)
    (dst / "pip").mkdir()  # what `python -m venv` puts there: replaced by the seed
    S.seed_from(root / ".venv", other, "stale")  # .venv has other requirements: pip's job
    assert list(dst.iterdir()) == [dst / "pip"] and not (other / ".workbench-requirements").exists()
    S.seed_from(root / ".venv", other, "want")
    assert (other / ".workbench-requirements").read_text() == "want\n"
    assert tree_hashes(dst) == before
    lib = "torch/lib/libtorch_fake.so"
    assert (dst / lib).stat().st_ino == (src / lib).stat().st_ino
    print(S.install(dst, S.load_series(series_layout.patches), "2.13.0", through="0001"))
    assert S.install_state(dst, S.load_series(series_layout.patches), "2.13.0", "0001").state == "current"
    assert tree_hashes(src) == before  # .venv still holds the whole series
    assert S.install_state(src, S.load_series(series_layout.patches), "2.13.0").state == "current"


# --------------------------------------------------------------------------- issue 15: integrity, atomic install


INSTALL_MODULE = importlib.import_module("scripts.series.install")


def fake_wheel_source(base_wheel: Path):
    return lambda: base_wheel


def checkout_state(repo: Path) -> tuple[str, str, bool]:
    return (git(repo, "rev-parse", "HEAD"), git(repo, "status", "--porcelain"), (repo / ".git" / "rebase-apply").exists())


def test_case1_patch_cut_before_a_section_is_refused_everywhere(series_layout: S.Layout, site_packages: Path,
                                                                make_checkout) -> None:
    name = S.series_names(series_layout.patches)[2]  # 0003: torch/__init__.py, then torch/fx/call_hierarchy.py
    path = series_layout.patches / name
    text = path.read_text()
    path.write_text(text[: text.index("diff --git a/torch/fx/call_hierarchy.py")])
    S.parse_patch(path)  # still a well-formed patch: only the integrity record tells what is missing
    before, checkout = tree_hashes(site_packages), make_checkout()
    state = checkout_state(checkout)
    for call in (lambda: S.install(site_packages, S.load_series(series_layout.patches), "2.13.0"),
                 lambda: S.apply_to_checkout(series_layout, checkout)):
        with pytest.raises(S.SeriesError, match=rf"(?s)patch {name}: the `diff --git` section for "
                                                r"torch/fx/call_hierarchy.py is missing.*Nothing was changed"):
            call()
    assert tree_hashes(site_packages) == before and checkout_state(checkout) == state
    status = subprocess.run([sys.executable, "-m", "scripts.series", "--repo-root", str(series_layout.root), "status",
                             "--site-packages", str(site_packages)], cwd=S.REPO_ROOT, capture_output=True, text=True)
    assert status.returncode == 2 and "call_hierarchy.py is missing" in status.stderr and "current" not in status.stdout


def test_case2_install_of_a_patch_that_no_longer_applies_keeps_the_working_install(
        series_layout: S.Layout, site_packages: Path) -> None:
    S.install(site_packages, S.load_series(series_layout.patches), "2.13.0")
    installed = tree_hashes(site_packages)
    name = S.series_names(series_layout.patches)[1]
    edit(series_layout.patches / name, " node_9 = 9\n", " node_9 = 'nine'\n")  # a context line
    with pytest.raises(S.SeriesError, match=rf"patch {name}: the section for torch/fx/node.py differs"):
        S.load_series(series_layout.patches)
    # even past the integrity check (as after `workspace --accept-patches`), nothing is reverted first
    S.write_integrity(series_layout.patches, S.series_names(series_layout.patches))
    series = S.load_series(series_layout.patches)
    with pytest.raises(S.SeriesError, match=rf"(?s)patch {name} does not apply.*nothing was changed"):
        S.install(site_packages, series, "2.13.0")
    assert tree_hashes(site_packages) == installed
    assert S.install_state(site_packages, series, "2.13.0").state == "stale"  # the old series, whole


def test_case3_no_loop_between_install_and_revert(series_layout: S.Layout, site_packages: Path,
                                                  base_wheel: Path) -> None:
    series = S.load_series(series_layout.patches)
    target = site_packages / "torch/fx/node.py"
    target.write_text(target.read_text() + "# my debugging\n")  # no series installed, a hand edit
    state = S.install_state(site_packages, series, "2.13.0")
    assert state.state == "modified" and state.edited == ["torch/fx/node.py"]
    for call in (lambda: S.install(site_packages, series, "2.13.0"), lambda: S.revert(site_packages, "2.13.0", series)):
        with pytest.raises(S.SeriesError, match="(?s)edited by hand.*--force to save them.*force-reinstall") as err:
            call()
        assert "--revert" not in str(err.value)  # never sends the user round in a loop
    msg = S.revert(site_packages, "2.13.0", series, force=True, wheel=fake_wheel_source(base_wheel))
    assert "saved your edits to torch/fx/node.py" in msg
    assert target.read_text() == BASE_FILES["torch/fx/node.py"]
    assert S.install_state(site_packages, series, "2.13.0").state == "pristine"
    # after `pip install --force-reinstall torch` over an installed series, status says pristine
    S.install(site_packages, series, "2.13.0")
    with zipfile.ZipFile(base_wheel) as z:
        z.extractall(site_packages)
    (site_packages / "torch/fx/call_hierarchy.py").unlink()  # pip removes what the wheel does not have
    assert S.install_state(site_packages, series, "2.13.0").state == "pristine"
    S.install(site_packages, series, "2.13.0")
    assert S.install_state(site_packages, series, "2.13.0").state == "current"


def interrupt_after(monkeypatch: pytest.MonkeyPatch, calls: int, action) -> None:
    """Run action() at the main thread's calls-th os.replace (1: the journal, 2: the first file, ...),
    once.  The patch is the os module's: another thread's os.replace (a compile worker left by an
    earlier test) is not counted."""
    real, seen = os.replace, [0]

    def replace(src, dst):
        if threading.current_thread() is threading.main_thread():
            seen[0] += 1
            if seen[0] == calls:
                action()
        return real(src, dst)
    monkeypatch.setattr(INSTALL_MODULE.os, "replace", replace)


def test_case4_interrupted_install_leaves_old_or_new(series_layout: S.Layout, site_packages: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    series = S.load_series(series_layout.patches)
    pristine = tree_hashes(site_packages)

    def boom() -> None:
        raise KeyboardInterrupt
    interrupt_after(monkeypatch, 3, boom)  # after the first of the series' files was switched
    with pytest.raises(KeyboardInterrupt):
        S.install(site_packages, series, "2.13.0")
    monkeypatch.undo()
    assert tree_hashes(site_packages) == pristine  # rolled back: the old state
    assert S.install_state(site_packages, series, "2.13.0").state == "pristine"
    # Ctrl-C (a real SIGINT) in the middle of the switch lands after it: the new state, whole.  Sent
    # to the main thread (os.kill may deliver it to another thread, whose handler can run after the
    # switch), with Python's own handler whatever an earlier test left
    interrupt_after(monkeypatch, 3, lambda: signal.pthread_kill(threading.main_thread().ident, signal.SIGINT))
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            S.install(site_packages, series, "2.13.0")
    finally:
        signal.signal(signal.SIGINT, previous)
    monkeypatch.undo()
    assert S.install_state(site_packages, series, "2.13.0").state == "current"
    S.revert(site_packages, "2.13.0")
    # cut harder (SIGKILL: no rollback in the process): status says so; the next command rolls back
    monkeypatch.setattr(INSTALL_MODULE, "roll_back", lambda sp: "")
    interrupt_after(monkeypatch, 3, boom)
    with pytest.raises(KeyboardInterrupt):
        S.install(site_packages, series, "2.13.0")
    monkeypatch.undo()
    state = S.install_state(site_packages, series, "2.13.0")
    assert state.state == "interrupted" and "after switching 1 of 4 torch file(s)" in state.detail, state.detail
    assert not state.edited
    msg = S.revert(site_packages, "2.13.0", series)
    assert msg.startswith("rolled back an interrupted install") and "saved your edits" not in msg
    assert tree_hashes(site_packages) == pristine


def test_case5_apply_checks_series_and_target_first(series_layout: S.Layout, make_checkout, tmp_path: Path) -> None:
    name = S.series_names(series_layout.patches)[0]
    edit(series_layout.patches / name, "+record_call_hierarchy = False\n", "+record_call_hierarchy = True\n")
    checkout = make_checkout()
    state = checkout_state(checkout)
    with pytest.raises(S.SeriesError, match=rf"patch {name}: the section for torch/_dynamo/config.py differs"):
        S.apply_to_checkout(series_layout, checkout)
    assert checkout_state(checkout) == state
    git(series_layout.root, "init", "-q")  # restore the patch: rebuild it from the workspace
    S.export(series_layout)
    other = make_checkout("not-pytorch", files={"README.md": "my project\n", "version.txt": "1.0\n"})
    state = checkout_state(other)
    with pytest.raises(S.SeriesError, match=r"(?s)not a PyTorch checkout at or near the base.*lacks 3 file\(s\) "
                                            r"the series changes.*Nothing was changed"):
        S.apply_to_checkout(series_layout, other)
    assert checkout_state(other) == state and sorted(p.name for p in other.iterdir()) == [".git", "README.md",
                                                                                         "version.txt"]
    far = make_checkout("pytorch-1.0", files={**BASE_FILES, "version.txt": "1.0.0\n"})
    with pytest.raises(S.SeriesError, match=r"does not contain the base commit .* names 1\.0, not 2\.13\.0"):
        S.apply_to_checkout(series_layout, far)
    empty = tmp_path / "empty"
    empty.mkdir()
    git(empty, "init", "-q")
    with pytest.raises(S.SeriesError, match="has no commits; it is not a PyTorch checkout"):
        S.apply_to_checkout(series_layout, empty)
    assert git(empty, "status", "--porcelain") == ""


def test_case6_install_force_saves_hand_edits(series_layout: S.Layout, site_packages: Path) -> None:
    series = S.load_series(series_layout.patches)
    S.install(site_packages, series, "2.13.0", "0001")
    target = site_packages / "torch/_dynamo/config.py"
    target.write_text(target.read_text() + "debug = True\n")
    with pytest.raises(S.SeriesError, match="refusing to install: torch/_dynamo/config.py"):
        S.install(site_packages, series, "2.13.0")
    msg = S.install(site_packages, series, "2.13.0", force=True)
    saved = Path(re.search(r"saved your edits to torch/_dynamo/config.py in (\S+)", msg).group(1))
    assert (saved / "torch/_dynamo/config.py").read_text().endswith("debug = True\n")
    assert S.install_state(site_packages, series, "2.13.0").state == "current"


def test_stale_integrity_is_regenerated_by_export(series_layout: S.Layout) -> None:
    """Patches exported elsewhere (another branch, merged): refused until re-recorded by workspace + export."""
    ws = series_layout.workspace
    edit(ws / "torch/fx/node.py", "node_30 = 30\n", "node_30 = 'other branch'\n")
    git(ws, "commit", "-qam", "work of another branch")
    integrity = (series_layout.patches / S.INTEGRITY).read_text()
    S.export(series_layout)
    (series_layout.patches / S.INTEGRITY).write_text(integrity)  # the merge kept the old record
    with pytest.raises(S.SeriesError, match=r"(?s)not exported: 0004-work-of-another-branch.patch.*--accept-patches"):
        S.build_workspace(series_layout, force=True)
    S.build_workspace(series_layout, force=True, accept_patches=True)
    S.export(series_layout)
    assert len(S.load_series(series_layout.patches)) == 4


def mutate(rng: random.Random, path: Path) -> str:
    data = path.read_bytes()
    how = rng.choice(["truncate", "flip", "drop-line"])
    if how == "truncate":
        cut = rng.randrange(len(data))
        path.write_bytes(data[:cut])
        return f"{how} {path.name} at {cut}"
    if how == "flip":
        at = rng.randrange(len(data))
        path.write_bytes(data[:at] + bytes([data[at] ^ rng.randrange(1, 256)]) + data[at + 1:])
        return f"{how} {path.name} byte {at}"
    lines = data.splitlines(keepends=True)
    i = rng.randrange(len(lines))
    path.write_bytes(b"".join(lines[:i] + lines[i + 1:]))
    return f"{how} {path.name} line {i}"


def test_fuzz_damaged_series_never_installs_or_applies(series_layout: S.Layout, site_packages: Path,
                                                       make_checkout) -> None:
    rng = random.Random(15)
    S.install(site_packages, S.load_series(series_layout.patches), "2.13.0", "0002")  # a working install to keep
    installed = tree_hashes(site_packages)
    checkout = make_checkout()
    state = checkout_state(checkout)
    originals = {p: p.read_bytes() for p in series_layout.patches.iterdir()}
    targets = sorted(p for p in originals if p.suffix == ".patch") + [series_layout.patches / S.INTEGRITY]
    for _ in range(20):
        for p, data in originals.items():
            p.write_bytes(data)
        what = mutate(rng, rng.choice(targets))
        if what.startswith(("flip integrity.json", "drop-line integrity.json")):
            try:  # JSON whitespace may change without changing the record: then the series is unchanged
                same = json.loads((series_layout.patches / S.INTEGRITY).read_text()) == json.loads(
                    originals[series_layout.patches / S.INTEGRITY])
            except ValueError:
                same = False
            if same:
                S.load_series(series_layout.patches)
                continue
        with pytest.raises(S.SeriesError):
            S.install(site_packages, S.load_series(series_layout.patches), "2.13.0", "0002")
        with pytest.raises(S.SeriesError):
            S.apply_to_checkout(series_layout, checkout)
        assert tree_hashes(site_packages) == installed, what
        assert checkout_state(checkout) == state, what


# --------------------------------------------------------------------------- issue 26: no identity in the series


IDENTITY_VARS = [f"GIT_{role}_{key}" for role in ("AUTHOR", "COMMITTER") for key in ("NAME", "EMAIL")]


def without_identity(monkeypatch: pytest.MonkeyPatch) -> None:
    """No git identity at all: none in the environment, none in any config (conftest sets GIT_CONFIG_GLOBAL
    to /dev/null and GIT_CONFIG_NOSYSTEM)."""
    for var in IDENTITY_VARS:
        monkeypatch.delenv(var, raising=False)


def authors(repo: Path, n: int) -> list[str]:
    return git(repo, "log", f"-{n}", "--format=%an <%ae>|%cn <%ce>").splitlines()


def test_exported_patches_carry_no_author_or_date(series_layout: S.Layout) -> None:
    """The workspace's commits are by `Test Dev <dev@example.invalid>` (conftest): none of it is exported,
    and the files stay byte-identical when the commits are rewritten by someone else at another time."""
    ws = series_layout.workspace
    assert set(git(ws, "log", "--format=%an <%ae>", "base..HEAD").splitlines()) == {"Test Dev <dev@example.invalid>"}
    before = snapshot(series_layout)
    for name in S.series_names(series_layout.patches):
        data = (series_layout.patches / name).read_bytes()
        header = data.split(b"\n\n", 1)[0].decode()
        assert header.startswith("From 0000000000000000000000000000000000000000 Mon Sep 17 00:00:00 2001\n"
                                 "From: RFC-0051 patch series <>\nSubject: [PATCH]")
        assert re.findall(r"^(?:From|Date):.*", header, re.M) == ["From: RFC-0051 patch series <>"], header
        assert b"Test Dev" not in data and b"example.invalid" not in data
        assert S.identity_problems(data) == []
        patch = S.parse_patch(series_layout.patches / name)  # still a mail git reads: subject, message, diff
        assert patch.subject and patch.changes
    env = dict(os.environ, GIT_AUTHOR_NAME="Someone Else", GIT_AUTHOR_EMAIL="someone@else.org",
               GIT_COMMITTER_NAME="Someone Else", GIT_COMMITTER_EMAIL="someone@else.org",
               GIT_AUTHOR_DATE="2031-05-06T07:08:09+0200", GIT_COMMITTER_DATE="2031-05-06T07:08:09+0200")
    subprocess.run(["git", "rebase", "-q", "--exec", "git commit -q --amend --no-edit --reset-author", "base"],
                   cwd=ws, env=env, check=True, capture_output=True)
    assert set(git(ws, "log", "--format=%an %ad", "base..HEAD").splitlines()) == {
        "Someone Else Tue May 6 07:08:09 2031 +0200"}
    S.export(series_layout)
    assert snapshot(series_layout) == before  # byte-stable: who committed when is not in the files
    S.export(series_layout)
    assert snapshot(series_layout) == before


def test_apply_commits_as_the_appliers_git_identity(series_layout: S.Layout, make_checkout,
                                                   monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    checkout, other = make_checkout(), make_checkout("pytorch-2")  # "upstream" commits by conftest's identity
    without_identity(monkeypatch)
    git(checkout, "config", "user.name", "Ada Lovelace")
    git(checkout, "config", "user.email", "ada@lovelace.org")
    start = int(time.time())
    S.apply_to_checkout(series_layout, checkout)
    assert authors(checkout, 3) == ["Ada Lovelace <ada@lovelace.org>|Ada Lovelace <ada@lovelace.org>"] * 3
    dates = [int(t) for t in git(checkout, "log", "-3", "--format=%at %ct").split()]
    assert all(start - 1 <= t <= time.time() + 1 for t in dates), dates  # dated when applied
    assert "as Ada Lovelace <ada@lovelace.org>" in capsys.readouterr().out
    # --author: the commits are that person's; the committer stays the configured identity
    git(other, "config", "user.name", "Ada Lovelace")
    git(other, "config", "user.email", "ada@lovelace.org")
    S.apply_to_checkout(series_layout, other, author="Grace Hopper <grace@navy.mil>")
    assert authors(other, 3) == ["Grace Hopper <grace@navy.mil>|Ada Lovelace <ada@lovelace.org>"] * 3
    assert git(other, "log", "-4", "--format=%s").splitlines()[-1] == "upstream"


def test_apply_author_option_without_a_configured_identity(series_layout: S.Layout, make_checkout,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    checkout = make_checkout()
    without_identity(monkeypatch)
    state = checkout_state(checkout)
    bad = run_cli(series_layout, "apply", str(checkout))
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1, bad.stderr  # one line
    assert bad.stderr.startswith(f"error: no git identity in {checkout}")
    assert f"git -C {checkout} config user.name" in bad.stderr and "--author" in bad.stderr
    assert "Nothing was changed" in bad.stderr and checkout_state(checkout) == state
    ok = run_cli(series_layout, "apply", "--author", "Grace Hopper <grace@navy.mil>", str(checkout))
    assert ok.returncode == 0, ok.stderr
    assert authors(checkout, 3) == ["Grace Hopper <grace@navy.mil>|Grace Hopper <grace@navy.mil>"] * 3


@pytest.mark.parametrize("author", ["Grace Hopper", "grace@navy.mil", "<grace@navy.mil>", "Grace Hopper <grace>",
                                    "Grace Hopper <grace@navy.mil> <x@y.z>", "Grace <grace hopper@navy.mil>", ""])
def test_apply_refuses_a_malformed_author(series_layout: S.Layout, make_checkout, author: str) -> None:
    checkout = make_checkout()
    state = checkout_state(checkout)
    with pytest.raises(S.SeriesError, match=r"--author .* is not `Name <email@host>`.*Nothing was changed"):
        S.apply_to_checkout(series_layout, checkout, author=author)
    assert checkout_state(checkout) == state
    bad = run_cli(series_layout, "apply", "--author", author, str(checkout))
    assert bad.returncode == 2 and bad.stderr.startswith("error: --author") and bad.stderr.count("\n") == 1
    assert checkout_state(checkout) == state


@pytest.mark.parametrize("where", ["trailer", "seed-name", "code"])
def test_export_refuses_personal_data_or_a_placeholder_identity(series_layout: S.Layout, where: str) -> None:
    ws = series_layout.workspace
    before = snapshot(series_layout)
    edit(ws / "torch/fx/node.py", "node_30 = 30\n", "node_30 = 31\n")
    message = "[fx] renumber"
    if where == "trailer":
        message += "\n\nSigned-off-by: Ada Lovelace <ada@lovelace.org>"
    elif where == "seed-name":
        message += "\n\nCo-written with Seed 5ce6a553 maintainers."
    else:
        edit(ws / "torch/fx/node.py", "node_31 = 31\n",
             "node_31 = 31  # maintainers@users.noreply.a-seed-5ce6a553.example\n")
    git(ws, "commit", "-qam", message)
    with pytest.raises(S.SeriesError, match=r"(?s)refusing to export: .*personal data or a placeholder identity.*"
                                            r"0004-fx-renumber.patch: .*Nothing was changed") as err:
        S.export(series_layout)
    assert {"trailer": "ada@lovelace.org", "seed-name": "Seed 5ce6a553",
            "code": "noreply"}[where] in str(err.value)
    assert snapshot(series_layout) == before


def test_export_refuses_git_comment_lines_in_a_message(series_layout: S.Layout) -> None:
    """A conflict resolved with `git commit --no-edit` keeps git's `# Conflicts:` note in the message; the
    export refuses it (nothing written) and takes the message once it is stripped."""
    ws = series_layout.workspace
    before = snapshot(series_layout)
    edit(ws / "torch/fx/node.py", "node_30 = 30\n", "node_30 = 31\n")
    git(ws, "commit", "-qam", "[fx] renumber\n\nFor issue 9, #12 in the tracker.\n\n# Conflicts:\n#\ttorch/fx/node.py")
    with pytest.raises(S.SeriesError, match=r"(?s)refusing to export: .*git's comment lines.*0004-fx-renumber.patch: "
                                            r"a git comment line on line \d+ \('# Conflicts:'\).*"
                                            r"0004-fx-renumber.patch: a git comment line .*'#\\ttorch/fx/node.py'.*"
                                            r"Nothing was changed") as err:
        S.export(series_layout)
    assert "#12" not in str(err.value) and snapshot(series_layout) == before
    git(ws, "commit", "-q", "--amend", "--no-edit", "--cleanup=strip")
    S.export(series_layout)
    data = (series_layout.patches / "0004-fx-renumber.patch").read_bytes()
    assert S.message_problems(data) == [] and b"#12 in the tracker" in data


def test_committed_patches_carry_no_git_comment_lines() -> None:
    pdir = S.REPO_ROOT / "patches"
    assert {name: S.message_problems((pdir / name).read_bytes()) for name in S.series_names(pdir)
            if S.message_problems((pdir / name).read_bytes())} == {}


def test_identity_problems_and_strip_identity() -> None:
    old = (b"From 0000000000000000000000000000000000000000 Mon Sep 17 00:00:00 2001\n"
           b"From: Seed 5ce6a553 maintainers\n <maintainers@users.noreply.a-seed-5ce6a553.example>\n"
           b"Date: Mon, 23 Nov 2026 14:50:31 +0000\nSubject: [PATCH] [fx] x\n\nBody, with a seed value.\n\n"
           b"diff --git a/f b/f\nindex 1..2 100644\n--- a/f\n+++ b/f\n@@ -1 +1 @@\n-a\n+b  # From: kept, Date: kept\n")
    problems = S.identity_problems(old)
    assert any("From: header" in p for p in problems) and any("Date: header" in p for p in problems)
    assert any("Seed 5ce6a553" in p for p in problems) and any("noreply" in p for p in problems)
    new = S.strip_identity(old)
    assert new == (b"From 0000000000000000000000000000000000000000 Mon Sep 17 00:00:00 2001\n"
                   b"From: RFC-0051 patch series <>\n"
                   b"Subject: [PATCH] [fx] x\n" + old.split(b"+0000\nSubject: [PATCH] [fx] x\n", 1)[1])
    assert S.identity_problems(new) == [] and S.strip_identity(new) == new
    mail = S.with_author(old, "Jöhn Dœ", "john@doe.org")
    assert mail.split(b"\n")[1] == b"From: =?utf-8?b?SsO2aG4gRMWT?= <john@doe.org>"
    assert b"Date:" not in mail.split(b"\n\n", 1)[0] and mail.endswith(b"+b  # From: kept, Date: kept\n")


def test_patches_of_an_older_export_still_work_and_lose_their_identity(series_layout: S.Layout, make_checkout,
                                                                        site_packages: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """patches/ as an export before issue 26 wrote it (From:/Date: of a placeholder identity): read, installed and
    applied as the applier; `workspace --force` + `export` rewrites them without it."""
    pdir = series_layout.patches
    names = S.series_names(pdir)
    for name in names:
        data = (pdir / name).read_bytes()
        first, rest = data.split(b"\n", 1)
        (pdir / name).write_bytes(first + b"\nFrom: Seed 5ce6a553 maintainers\n <maintainers@users.noreply.a-seed-"
                                  b"5ce6a553.example>\nDate: Mon, 23 Nov 2026 14:50:31 +0000\n" + rest)
    S.write_integrity(pdir, names)
    series = S.load_series(pdir)
    assert [p.subject for p in series][0] == "[dynamo] add record_call_hierarchy config"
    assert S.install(site_packages, series, "2.13.0").startswith("installed series")
    checkout = make_checkout()
    without_identity(monkeypatch)
    git(checkout, "config", "user.name", "Ada Lovelace")
    git(checkout, "config", "user.email", "ada@lovelace.org")
    S.apply_to_checkout(series_layout, checkout)
    assert authors(checkout, 3) == ["Ada Lovelace <ada@lovelace.org>|Ada Lovelace <ada@lovelace.org>"] * 3
    assert S.apply_to_checkout(series_layout, checkout) == 0  # already there: found by patch-id
    S.build_workspace(series_layout, force=True)  # no identity configured: the neutral one, never exported
    assert set(authors(series_layout.workspace, 3)) == {f"{S.BOT['name']} <{S.BOT['email']}>|"
                                                        f"{S.BOT['name']} <{S.BOT['email']}>"}
    S.export(series_layout)
    for name in names:
        data = (pdir / name).read_bytes()
        assert S.identity_problems(data) == [] and b"Seed" not in data and S.BOT["email"].encode() not in data
    S.load_series(pdir)

