"""Tests of `peer-tests` (scripts/series/peer.py) that need no torch run: JUnit parsing, the verdict, the
pristine overlay on a fake site-packages, the flag hook on a fake torch, where the test files come from."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from scripts.series import SeriesError, peer, upstream

FILES = ["dynamo/test_a.py", "fx/test_b.py", "fx/test_b_more.py"]

JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" errors="2" failures="1" skipped="2" tests="8">
<testcase classname="dynamo.test_a.ATests" name="test_pass" time="0.1"/>
<testcase classname="dynamo.test_a.ATests" name="test_fail"><failure message="boom">tb</failure></testcase>
<testcase classname="dynamo.test_a.ATests" name="test_skip"><skipped type="pytest.skip" message="no"/></testcase>
<testcase classname="dynamo.test_a.ATests" name="test_xfail"><skipped type="pytest.xfail" message="x"/></testcase>
<testcase classname="fx.test_b.BTests" name="test_teardown"/>
<testcase classname="fx.test_b.BTests" name="test_teardown"><error message="teardown">tb</error></testcase>
<testcase classname="test.fx.test_b_more.Outer.Inner" name="test_nested"/>
<testcase classname="" name="fx.test_b_more"><error message="collection failure">tb</error></testcase>
</testsuite></testsuites>
"""


def test_parse_junit_outcome_per_test_id(tmp_path: Path) -> None:
    (tmp_path / "r.xml").write_text(JUNIT)
    assert peer.parse_junit(tmp_path / "r.xml", FILES) == {
        "dynamo/test_a.py::ATests::test_pass": "passed",
        "dynamo/test_a.py::ATests::test_fail": "failed",
        "dynamo/test_a.py::ATests::test_skip": "skipped",
        "dynamo/test_a.py::ATests::test_xfail": "skipped",
        "fx/test_b.py::BTests::test_teardown": "error",  # a pass then a teardown error: the worse
        # rootdir at the checkout's root (classname `test.fx...`); the longest module wins over fx/test_b.py
        "fx/test_b_more.py::Outer::Inner::test_nested": "passed",
        "fx/test_b_more.py::<collection>": "error",
    }


def test_parse_junit_unreadable_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "r.xml").write_text("<testsuites><testcase")
    with pytest.raises(SeriesError, match="cannot read the JUnit XML"):
        peer.parse_junit(tmp_path / "r.xml", FILES)


def test_compare_regressions_and_pristine_failures() -> None:
    results = {
        "pristine": {"t::ok": "passed", "t::fails_off": "passed", "t::errors_on": "passed", "t::gone": "passed",
                     "t::skipped_on": "passed", "t::broken": "failed", "t::broken_err": "error",
                     "t::skip": "skipped"},
        "off": {"t::ok": "passed", "t::fails_off": "failed", "t::errors_on": "passed", "t::skipped_on": "passed",
                "t::broken": "failed", "t::broken_err": "passed", "t::skip": "failed", "t::new": "failed"},
        "on": {"t::ok": "passed", "t::fails_off": "passed", "t::errors_on": "error", "t::skipped_on": "skipped",
               "t::broken": "failed", "t::broken_err": "error", "t::skip": "skipped", "t::new": "failed"},
    }
    verdict = peer.compare(results)
    assert verdict.regressions == {
        "t::fails_off": {"off": "failed", "on": "passed"},
        "t::errors_on": {"off": "passed", "on": "error"},
        "t::gone": {"off": "missing", "on": "missing"},
        "t::skipped_on": {"off": "passed", "on": "skipped"},
    }
    assert verdict.fails_on_pristine == {
        "t::broken": {"pristine": "failed", "off": "failed", "on": "failed"},
        "t::broken_err": {"pristine": "error", "off": "passed", "on": "error"},
    }
    clean = {c: {"t::ok": "passed", "t::broken": "failed"} for c in ("pristine", "off", "on")}
    assert peer.compare(clean).regressions == {}


def test_table_counts_per_file_and_config() -> None:
    results = {"pristine": {"fx/test_b.py::T::a": "passed", "fx/test_b.py::T::b": "error",
                            "fx/test_b.py::T::c": "skipped", "dynamo/test_a.py::T::a": "failed"},
               "off": {"fx/test_b.py::T::a": "passed"}}
    assert peer.counts(results["pristine"], "fx/test_b.py") == (1, 1, 1)
    assert peer.counts(results["pristine"], "dynamo/test_a.py") == (0, 1, 0)
    lines = peer.table(results, ["dynamo/test_a.py", "fx/test_b.py"]).splitlines()
    assert lines[1].split() == ["dynamo/test_a.py", "0/1/0", "0/0/0"]
    assert lines[2].split() == ["fx/test_b.py", "1/1/1", "1/0/0"]
    assert lines[3].split() == ["total", "1/2/1", "1/0/0"]


# --------------------------------------------------------------------------- the pristine overlay

WHEEL = {"torch/__init__.py": b"init\n", "torch/fx/proxy.py": b"pristine proxy\n",
         "torch/_dynamo/config.py": b"flag-free config\n"}
SERIES = {"torch/fx/proxy.py": b"patched proxy\n", "torch/_dynamo/config.py": b"config with the flag\n",
          "torch/fx/call_hierarchy.py": b"added by the series\n"}


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def fake_site_packages(root: Path) -> tuple[Path, dict[str, str]]:
    sp = root / "site-packages"
    for rel, data in {**WHEEL, **SERIES}.items():
        (sp / rel).parent.mkdir(parents=True, exist_ok=True)
        (sp / rel).write_bytes(data)
    (sp / "torch/fx/__pycache__").mkdir()
    (sp / "torch/fx/__pycache__/proxy.cpython-311.pyc").write_bytes(b"bytecode of the patched proxy")
    return sp, {rel: sha(data) for rel, data in WHEEL.items()}


def snapshot(sp: Path) -> dict[str, tuple[bytes, int]]:
    return {str(p.relative_to(sp)): (p.read_bytes(), p.stat().st_ino) for p in sorted(sp.rglob("*")) if p.is_file()}


def test_overlay_replaces_changed_files_removes_added_ones_and_leaves_the_venv_alone(tmp_path: Path) -> None:
    sp, record = fake_site_packages(tmp_path)
    before = snapshot(sp)
    paths = ["torch/fx/proxy.py", "torch/_dynamo/config.py", "torch/fx/call_hierarchy.py"]
    pristine = {rel: WHEEL[rel] for rel in paths if rel in WHEEL}
    dest = peer.build_overlay(sp, tmp_path / "overlay", paths, record, pristine)
    torch = dest / "torch"
    assert (torch / "fx/proxy.py").read_bytes() == b"pristine proxy\n"
    assert (torch / "_dynamo/config.py").read_bytes() == b"flag-free config\n"
    assert not (torch / "fx/call_hierarchy.py").exists()
    assert not (torch / "fx/__pycache__/proxy.cpython-311.pyc").exists()  # bytecode of the patched file
    assert (torch / "__init__.py").stat().st_ino == (sp / "torch/__init__.py").stat().st_ino  # a hard link
    assert (torch / "fx/proxy.py").stat().st_ino != (sp / "torch/fx/proxy.py").stat().st_ino
    assert snapshot(sp) == before  # the venv: same bytes, same inodes
    # built again over an old overlay: same result, venv still untouched
    peer.build_overlay(sp, dest, paths, record, pristine)
    assert (torch / "fx/proxy.py").read_bytes() == b"pristine proxy\n"
    assert snapshot(sp) == before


def test_check_overlay_refuses_series_files(tmp_path: Path) -> None:
    sp, record = fake_site_packages(tmp_path)
    with pytest.raises(SeriesError, match=r"torch/fx/proxy.py is not the wheel's.*call_hierarchy.py exists"):
        peer.check_overlay(sp, ["torch/fx/proxy.py", "torch/__init__.py", "torch/fx/call_hierarchy.py"], record)


# --------------------------------------------------------------------------- the flag hook and the probe


def fake_torch(root: Path, flag: bool = True) -> Path:
    (root / "torch/_dynamo").mkdir(parents=True)
    (root / "torch/__init__.py").write_text("__version__ = '0.0'\n")
    (root / "torch/_dynamo/__init__.py").write_text("")
    (root / "torch/_dynamo/config.py").write_text("record_call_hierarchy = False\n" if flag else "other = 1\n")
    return root


CHILD = ("import subprocess, sys, torch._dynamo.config as c; print(c.record_call_hierarchy); "
         "print(subprocess.run([sys.executable, '-c', 'import torch._dynamo.config as c; "
         "print(c.record_call_hierarchy)'], capture_output=True, text=True).stdout.strip())")


def run_with(pythonpath: list[Path], code: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = os.pathsep.join(map(str, pythonpath))
    return subprocess.run([sys.executable, "-c", code], env=env, cwd=cwd, capture_output=True, text=True)


def test_sitecustomize_forces_the_flag_in_the_process_and_its_children(tmp_path: Path) -> None:
    fake = fake_torch(tmp_path / "fake")
    hook = tmp_path / "force_on"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(peer.SITECUSTOMIZE)
    assert run_with([fake], CHILD, tmp_path).stdout.split() == ["False", "False"]  # the control
    proc = run_with([hook, fake], CHILD, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["True", "True"]
    # other modules load as usual
    assert run_with([hook, fake], "import json, torch; print(torch.__version__)", tmp_path).stdout.strip() == "0.0"


def test_probe_plugin_records_torch_and_flag(tmp_path: Path) -> None:
    fake = fake_torch(tmp_path / "fake")
    probe = tmp_path / "probe"
    probe.mkdir()
    (probe / f"{peer.PROBE_PLUGIN}.py").write_text(peer.PROBE)
    proc = run_with([probe, fake], f"import {peer.PROBE_PLUGIN} as p, json; print(json.dumps(p.probe()))", tmp_path)
    got = json.loads(proc.stdout)
    assert Path(got["torch"]) == fake / "torch/__init__.py" and got["flag"] is False
    peer.check_probe("off", got, fake, tmp_path / "overlay", "the test")
    with pytest.raises(SeriesError, match="expected .* with True"):
        peer.check_probe("on", got, fake, tmp_path / "overlay", "the test")
    with pytest.raises(SeriesError, match="imported torch from"):
        peer.check_probe("pristine", got, fake, tmp_path / "overlay", "the test")
    peer.check_probe("pristine", {**got, "flag": None}, tmp_path / "x", fake, "the test")


# --------------------------------------------------------------------------- where the test files come from


def git(cwd: Path, *args: str) -> None:
    subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True)


def test_default_tests_from_beside_repo_or_beside_local_origin(tmp_path: Path) -> None:
    origin = tmp_path / "a" / "main"
    origin.mkdir(parents=True)
    git(origin, "init", "-q")
    with pytest.raises(SeriesError, match="no stored upstream test files") as info:
        peer.default_tests_from(origin)
    assert info.value.exit_code == 3  # ci/run_tests.sh reports the suite as skipped on 3 only
    (tmp_path / "a/shared/upstream-tests/test").mkdir(parents=True)
    assert peer.default_tests_from(origin) == tmp_path / "a/shared/upstream-tests"
    clone = tmp_path / "b" / "clone"
    clone.parent.mkdir()
    git(tmp_path, "clone", "-q", str(origin), str(clone))
    assert peer.default_tests_from(clone) == (tmp_path / "a/shared/upstream-tests").resolve()


UNIT_TEST = "import unittest\n\n\nclass T(unittest.TestCase):\n    def test_one(self):\n        pass\n"


def test_tests_under_a_folder_with_a_pytest_ini_above_it_keep_their_ids(tmp_path: Path) -> None:
    # A tests folder inside another project (here, one whose pytest.ini would select nothing and set its own
    # rootdir), as build/workspace is inside this repository: pytest runs it as the stored folder, rootdir
    # test/, ids by file.
    (tmp_path / "pytest.ini").write_text("[pytest]\npython_classes = Nothing\npython_functions = nothing\n")
    test_dir = tmp_path / "build" / "tree" / "test"
    (test_dir / "fx").mkdir(parents=True)
    (test_dir / "fx" / "test_t.py").write_text(UNIT_TEST)
    xml = tmp_path / "r.xml"
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                    *upstream.pytest_config_args(test_dir), f"--junitxml={xml}", "fx/test_t.py"],
                   cwd=test_dir, check=True, capture_output=True)
    assert peer.file_outcomes(xml, "fx/test_t.py", "on") == {"fx/test_t.py::T::test_one": "passed"}
    # A PyTorch checkout's own pytest.ini, at its root, configures its tests.
    (test_dir.parent / "pytest.ini").write_text("[pytest]\n")
    assert upstream.pytest_config_args(test_dir) == []


def test_test_ids_that_name_no_test_of_the_file_are_an_error(tmp_path: Path) -> None:
    (tmp_path / "r.xml").write_text('<testsuites><testsuite><testcase classname="build.tree.test.fx.test_t.T" '
                                    'name="test_one"/></testsuite></testsuites>')
    with pytest.raises(SeriesError, match=r"pytest named a test of fx/test_t.py 'build.tree.test.fx.test_t.T::"
                                          r"test_one', which is not under fx/test_t.py: was it run with another "
                                          r"rootdir"):
        peer.file_outcomes(tmp_path / "r.xml", "fx/test_t.py", "on")


def test_select_files(tmp_path: Path) -> None:
    with pytest.raises(SeriesError, match=f"{tmp_path}/test does not exist"):
        peer.select_files(tmp_path, [])
    for f in FILES + ["fx/helper.py"]:
        (tmp_path / "test" / f).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "test" / f).write_text("")
    assert peer.select_files(tmp_path, []) == sorted(FILES)
    assert peer.select_files(tmp_path, ["test/fx/test_b.py", "dynamo/test_a.py"]) == ["fx/test_b.py",
                                                                                        "dynamo/test_a.py"]
    with pytest.raises(SeriesError, match="test/fx/test_gone.py does not exist"):
        peer.select_files(tmp_path, ["test/fx/test_gone.py"])
    (tmp_path / "torch").mkdir()  # a PyTorch checkout: name the files
    with pytest.raises(SeriesError, match="is a PyTorch checkout: name the test files"):
        peer.select_files(tmp_path, [])


def test_bad_configs_are_refused(tmp_path: Path) -> None:
    from scripts.series import Layout
    with pytest.raises(SeriesError, match="--configs takes"):
        peer.run_peer_tests(Layout(tmp_path), tmp_path, [], ["pristine", "flag"], [])


def test_cli_names_a_missing_folder_or_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from scripts.series import main
    assert main(["peer-tests", "--tests-from", str(tmp_path / "nope")]) == 2
    assert f"{tmp_path / 'nope'}" in capsys.readouterr().err
    (tmp_path / "tests/test").mkdir(parents=True)
    assert main(["peer-tests", "--tests-from", str(tmp_path / "tests"), "test/fx/test_gone.py"]) == 2
    assert f"{tmp_path}/tests/test/fx/test_gone.py does not exist" in capsys.readouterr().err


# --------------------------------------------------------------------------- selection.txt


def stored_folder(root: Path, selection: str | None) -> Path:
    for f in FILES + ["fx/helper.py"]:
        (root / "test" / f).parent.mkdir(parents=True, exist_ok=True)
        (root / "test" / f).write_text(f"# {f}\n")
    if selection is not None:
        (root / peer.SELECTION).write_text(selection)
    return root


def test_selection_lists_the_files_with_their_k_expression_and_timeout(tmp_path: Path) -> None:
    root = stored_folder(tmp_path, "# file | -k | timeout\nfx/test_b.py|not slow and not big|300\n\n"
                                   "dynamo/test_a.py||\n")
    assert peer.select(root, []) == [peer.Selected("fx/test_b.py", "not slow and not big", 300),
                                     peer.Selected("dynamo/test_a.py", "", None)]
    assert peer.select_files(root, []) == ["fx/test_b.py", "dynamo/test_a.py"]  # helpers and unlisted files: no
    assert peer.Selected("fx/test_b.py", "not slow", 300).pytest_args() == ["-k", "not slow", "--timeout=300"]
    assert peer.Selected("fx/test_b.py").pytest_args() == []
    # a named file takes its line's -k and timeout; an unlisted one runs whole
    assert peer.select(root, ["test/fx/test_b.py", "fx/test_b_more.py"]) == [
        peer.Selected("fx/test_b.py", "not slow and not big", 300), peer.Selected("fx/test_b_more.py")]


@pytest.mark.parametrize(("text", "error"), [
    ("fx/test_b.py|300\n", "three fields"),
    ("fx/test_b.py||5s\n", "the timeout must be a positive number"),
    ("fx/test_b.py||0\n", "the timeout must be a positive number"),
    ("fx/test_gone.py||300\n", "test/fx/test_gone.py does not exist"),
    ("fx/test_b.py||300\nfx/test_b.py|x|300\n", "fx/test_b.py is listed twice"),
    ("# only a comment\n", "lists no test file"),
])
def test_a_bad_selection_line_is_named(tmp_path: Path, text: str, error: str) -> None:
    root = stored_folder(tmp_path, text)
    with pytest.raises(SeriesError, match=error) as info:
        peer.select(root, [])
    if "three fields" in error or "timeout" in error:
        assert f"{root / peer.SELECTION}:1:" in str(info.value)


# --------------------------------------------------------------------------- the pristine baseline

ENV = {"python": "3.11", "torch": "2.15.0", "pytest": "9.2.0", "pytest-timeout": "2.4.0", "expecttest": "0.3.0",
       "parameterized": "0.9.0", "numpy": "2.4.6"}


def test_baseline_key_changes_with_each_input_and_says_why(tmp_path: Path) -> None:
    root = stored_folder(tmp_path, "fx/test_b.py|not slow|300\n")
    sel = peer.select(root, [])[0]
    hashes = peer.tree_hashes(root / "test")
    key = peer.baseline_key(sel, hashes, ENV)
    entry = peer.baseline_entry(key, [{"fx/test_b.py::T::a": "passed"}], [1.0])
    assert peer.baseline_outcomes(entry, key) == ({"fx/test_b.py::T::a": "passed"}, "")
    assert peer.baseline_outcomes(None, key) == (None, "not in the baseline")

    def why(**change: object) -> str:
        return peer.baseline_outcomes(entry, {**key, **change})[1]
    (root / "test/fx/test_b.py").write_text("# changed\n")
    assert why(**peer.baseline_key(sel, peer.tree_hashes(root / "test"), ENV)) == "the test file changed"
    (root / "test/fx/test_b.py").write_text("# fx/test_b.py\n")
    (root / "test/fx/helper.py").write_text("# a helper changed\n")
    assert why(**peer.baseline_key(sel, peer.tree_hashes(root / "test"), ENV)) == (
        "another file under test/ (a helper it may import) changed")
    (root / "test/fx/helper.py").write_text("# fx/helper.py\n")
    assert peer.baseline_key(sel, peer.tree_hashes(root / "test"), ENV) == key  # back as it was: a hit again
    assert why(keyword="") == "its -k expression changed"
    assert why(timeout=60) == "its timeout changed"
    assert why(environment={**ENV, "torch": "2.16.0"}) == "the Python or test packages differ"
    assert why(environment={**ENV, "python": "3.12"}) == "the Python or test packages differ"


def test_baseline_entry_records_the_worst_outcome_and_flaky_tests() -> None:
    runs = [{"t::ok": "passed", "t::flaky": "passed", "t::broken": "failed", "t::crash": "passed"},
            {"t::ok": "passed", "t::flaky": "failed", "t::broken": "failed"}]
    entry = peer.baseline_entry({"k": 1}, runs, [3.2, 4.6])
    assert entry["outcomes"] == {"t::ok": "passed", "t::flaky": "failed", "t::broken": "failed", "t::crash": "error"}
    assert entry["flaky"] == {"t::flaky": "pristine runs gave passed, failed",
                              "t::crash": "pristine runs gave passed, missing"}
    assert entry["runs"] == 2 and entry["wall_s"] == [3, 5]


def test_baseline_file_round_trip_and_bad_files(tmp_path: Path) -> None:
    path = tmp_path / "ci" / "peer-baseline.json"
    assert peer.load_baseline(path) == {"files": {}}  # none yet: an empty baseline
    peer.write_baseline(path, {"files": {"b.py": {"outcomes": {}}, "a.py": {"outcomes": {}}}})
    data = peer.load_baseline(path)
    assert list(data["files"]) == ["a.py", "b.py"] and "refresh-baseline" in data["about"]
    assert [p.name for p in path.parent.iterdir()] == ["peer-baseline.json"]  # no temporary file left
    path.write_text("{not json")
    with pytest.raises(SeriesError, match="cannot read the peer baseline .*--refresh-baseline"):
        peer.load_baseline(path)
    path.write_text("[]")
    with pytest.raises(SeriesError, match="is not a peer baseline"):
        peer.load_baseline(path)


# --------------------------------------------------------------------------- the run: baseline, configurations


class FakeRuns:
    """Stands in for run_config: the outcomes each configuration gives, and the calls it got."""

    def __init__(self, outcomes: dict[str, dict[str, str]]) -> None:
        self.outcomes, self.calls = outcomes, []

    def __call__(self, config: str, python: Path, cwd: Path, files: list, work: Path, overlay: Path, sp: Path,
                 pytest_args: list[str], name: str) -> peer.Run:
        self.calls.append((name, [s.file for s in files]))
        mine = {t: o for t, o in self.outcomes[name].items() if t.split("::", 1)[0] in {s.file for s in files}}
        return peer.Run(config, mine, 0.0, {}, work / f"{name}.log", {s.file: 1.0 for s in files})


def run_with_baseline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, outcomes: dict[str, dict[str, str]],
                      refresh: bool = False, repeat: int = 1) -> tuple[int, FakeRuns, Path]:
    from scripts.series import Layout
    root = tmp_path / "stored"
    if not root.exists():  # made once: a later run sees what the test changed in it
        stored_folder(root, "dynamo/test_a.py||300\nfx/test_b.py||300\n")
    monkeypatch.setattr(peer, "load_series", lambda _: [])
    monkeypatch.setattr(peer, "series_hash_now", lambda sp, layout: "series")
    monkeypatch.setattr(peer, "environment_key", lambda python: ENV)
    monkeypatch.setattr(peer, "pristine_overlay", lambda layout, sp, series, dest: (dest, [], {}))
    monkeypatch.setattr(peer, "check_overlay", lambda dest, paths, record: None)
    fake = FakeRuns(outcomes)
    work = tmp_path / "work"
    work.mkdir(exist_ok=True)
    baseline = tmp_path / "peer-baseline.json"
    plan = peer.Plan(peer.select(root, []), list(peer.CONFIGS) if not refresh else ["pristine"], [], 2, baseline,
                     refresh, repeat)
    rc = peer.run_locked(Layout(tmp_path), tmp_path / "sp", Path("python"), root, plan, work, run=fake)
    return rc, fake, root


GOOD = {"dynamo/test_a.py::A::test_x": "passed", "dynamo/test_a.py::A::test_broken": "failed",
        "fx/test_b.py::B::test_y": "passed", "fx/test_b.py::B::test_flaky": "passed"}


def test_refresh_writes_the_baseline_then_ci_runs_no_pristine_and_catches_a_regression(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    flaky_run = {**GOOD, "fx/test_b.py::B::test_flaky": "failed"}
    rc, fake, root = run_with_baseline(tmp_path, monkeypatch, {"pristine-1": GOOD, "pristine-2": flaky_run},
                                       refresh=True, repeat=2)
    assert rc == 0 and sorted(n for n, _ in fake.calls) == ["pristine-1", "pristine-2"]
    data = peer.load_baseline(tmp_path / "peer-baseline.json")
    assert data["files"]["fx/test_b.py"]["flaky"] == {"fx/test_b.py::B::test_flaky": "pristine runs gave passed, failed"}
    assert "1 test(s) flaky on pristine" in capsys.readouterr().out

    # the series as pristine: no pristine run (the baseline), off and on side by side, no regression
    rc, fake, _ = run_with_baseline(tmp_path, monkeypatch, {"off": GOOD, "on": GOOD})
    out = capsys.readouterr().out
    assert rc == 0 and sorted(n for n, _ in fake.calls) == ["off", "on"], out
    assert "the baseline" in out and "for 2 of 2 file(s)" in out and "no regressions" in out
    # the flaky test failing with the series: listed with its reason, not a regression
    rc, _, _ = run_with_baseline(tmp_path, monkeypatch, {"off": flaky_run, "on": GOOD})
    out = capsys.readouterr().out
    assert rc == 0 and "fx/test_b.py::B::test_flaky  pristine runs gave passed, failed; here off=failed on=passed" in out
    # a planted regression (a test that passes on pristine fails with the flag on) fails the run
    rc, _, _ = run_with_baseline(tmp_path, monkeypatch, {"off": GOOD, "on": {**GOOD, "fx/test_b.py::B::test_y": "failed"}})
    out = capsys.readouterr().out
    assert rc == 1 and "REGRESSIONS: 1 test(s)" in out and "fx/test_b.py::B::test_y  off=passed on=failed" in out


def test_a_changed_test_file_reruns_pristine_for_the_files_it_may_reach(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    rc, _, root = run_with_baseline(tmp_path, monkeypatch, {"pristine-1": GOOD}, refresh=True)
    assert rc == 0
    (root / "test/fx/test_b.py").write_text("# a newer upstream version\n")
    capsys.readouterr()
    broken_now = {**GOOD, "fx/test_b.py::B::test_y": "failed"}
    rc, fake, _ = run_with_baseline(tmp_path, monkeypatch, {"pristine": broken_now, "off": broken_now,
                                                            "on": broken_now})
    out = capsys.readouterr().out
    # the changed file and every other (it may import the changed one): pristine reruns, no stale outcome used
    assert ("pristine", ["dynamo/test_a.py", "fx/test_b.py"]) in fake.calls, fake.calls
    assert "fx/test_b.py (the test file changed)" in out
    assert "dynamo/test_a.py (another file under test/ (a helper it may import) changed)" in out
    assert rc == 0, out  # it fails on pristine too now: not the series'
