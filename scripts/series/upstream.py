"""`upstream-tests`: run the upstream test files that the series adds or changes."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from .git import SeriesError, git, init_repo, isolated_env
from .patches import Patch, final_paths


def upstream_test_files(series: list[Patch]) -> list[str]:
    return [p for p in final_paths(series)[0]
            if p.startswith("test/") and re.fullmatch(r"test_\w+\.py", Path(p).name)]


def extract_tests(series: list[Patch], dest: Path) -> None:
    init_repo(dest)
    for patch in series:
        if not patch.paths("test/"):
            continue
        proc = git(dest, "apply", "--include=test/*", str(patch.path.resolve()), check=False, env=isolated_env())
        if proc.returncode != 0:
            raise SeriesError(f"cannot extract the test files of {patch.name} from the patches alone (it changes an "
                              f"existing upstream test?): {proc.stderr.strip()}\nrun with --tests-from CHECKOUT, a tree "
                              "with the series applied (build/workspace made from a PyTorch checkout, or the checkout)")


def upstream_test_env() -> dict[str, str]:
    """Environment for the upstream test files: ours, without `CI`.

    torch's `common_utils.run_tests` treats any non-empty `CI` (GitHub Actions and most CI systems
    set `CI=true`) as PyTorch's own CI and then writes JUnit XML through `xmlrunner`
    (unittest-xml-reporting), which is not a dependency of torch. The series' tests must pass with
    only torch and expecttest, so they run as a developer runs them.
    """
    return {k: v for k, v in os.environ.items() if k != "CI"}


def pytest_config_args(test_dir: Path) -> list[str]:
    """The pytest arguments that configure a run of the test files under `test_dir` (the `test/` folder of a
    PyTorch checkout, or of a folder laid out like one): none where the checkout has its own `pytest.ini`
    (PyTorch's, at its root); else no configuration file at all, with `test_dir` as pytest's rootdir.

    Otherwise pytest takes the first configuration file above the folder: one inside this repository
    (build/workspace, a copy under build/) ran with the workbench's `pytest.ini`, whose rootdir made
    the test ids `build.workspace.test.dynamo.test_x...`, which name no test file."""
    if (test_dir.parent / "pytest.ini").is_file():
        return []
    return ["-c", os.devnull, f"--rootdir={test_dir}"]


def run_upstream_tests(series: list[Patch], python: Path, tests_from: Path | None, extra: list[str],
                       pytest: bool = False) -> int:
    """Run each upstream test file the series adds or changes as a developer does (`python test_x.py`), or,
    with `pytest`, all of them in one pytest session as PyTorch's CI does (`run_test.py` uses pytest):
    test discovery, module names (`__main__` vs the file's) and expecttest's frames differ between the two."""
    files = upstream_test_files(series)
    if not files:
        print("the series adds or changes no upstream test files; nothing to run")
        return 0
    python = Path(os.path.abspath(python))  # not resolve(): a venv's python is a symlink
    if not python.exists():
        raise SeriesError(f"{python} does not exist; run `python3 -m scripts.series setup` (or pass --python)")
    with tempfile.TemporaryDirectory() as tmp:
        root = tests_from.resolve() if tests_from else Path(tmp)
        if tests_from is None:
            extract_tests(series, root)
            if os.environ.get("EXPECTTEST_ACCEPT"):
                print("note: EXPECTTEST_ACCEPT is set but the tests run from a temporary copy; to keep regenerated "
                      "expected values use --tests-from build/workspace, then commit and export", file=sys.stderr)
        missing = [f for f in files if not (root / f).is_file()]
        if missing:
            raise SeriesError(f"{root} lacks {', '.join(missing)}; is the series applied there?")
        cwd = root / "test"
        probe = subprocess.run([str(python), "-c", "import torch; print(torch.__file__, torch.__version__)"],
                               cwd=cwd, capture_output=True, text=True)
        if probe.returncode != 0:
            raise SeriesError(f"{python} cannot import torch: {probe.stderr.strip()[-500:]}")
        print(f"torch for the upstream tests: {probe.stdout.strip()}")
        failed = []
        if pytest:
            print(f"=== pytest {' '.join(files)}", flush=True)
            rc = subprocess.run([str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", *pytest_config_args(cwd),
                                 *(str(Path(f).relative_to("test")) for f in files), *extra], cwd=cwd,
                                env=upstream_test_env()).returncode
            print(f"upstream tests under pytest: {len(files)} file(s), " + ("passed" if rc == 0 else f"exit {rc}"))
            return 1 if rc else 0
        for f in files:
            print(f"=== {f}", flush=True)
            rc = subprocess.run([str(python), str(Path(f).relative_to("test")), *extra], cwd=cwd,
                                env=upstream_test_env()).returncode
            if rc != 0:
                failed.append(f"{f} (exit {rc})")
    print(f"upstream tests: {len(files) - len(failed)} passed, {len(failed)} failed" + (
        ": " + ", ".join(failed) if failed else ""))
    return 1 if failed else 0


