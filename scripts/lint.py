"""Lint the torch/ and test/ files of the patch series as PyTorch lints them.

Usage: python3 -m scripts.lint [--venv .venv | --workspace]   (from the repository root)

Runs, with the upstream settings vendored in ci/lint/ (see ci/lint/README.md):
ruff check, ruff format --check, usort (import order), flake8 (B950 and the
plugin codes ruff lacks) on every .py file the series touches, and mypy on the
modules the series adds. The files are taken twice: as the series leaves them
(the venv's patched torch and the test files of the patches, or build/workspace)
and as the base has them (the pristine copies `install` keeps, or the workspace's
`base` tag). A finding fails the run only if the base file does not have it too:
the tools pinned here are newer than upstream's, and findings in untouched
upstream code are upstream's. Findings are compared by file, code and the text
of the line, so moved lines do not count as new.
"""

import argparse
import collections
import concurrent.futures
import json
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from scripts import series

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "ci" / "lint"
# Config files copied to the root of each linted tree, under the name the tools look for.
CONFIG_FILES = {"pyproject.toml": "pyproject.toml", ".flake8": ".flake8", "mypy.ini": "mypy.ini"}

Finding = tuple[str, str, str]  # (path, tool:code, stripped line text or message)
Reader = Callable[[str], bytes | None]


def series_py_files(patches: list[series.Patch]) -> tuple[list[str], list[str]]:
    """(every .py file the series leaves under torch/, test/ or benchmarks/, the ones it creates)."""
    paths, created = series.final_paths(patches)
    files = [p for p in paths if p.endswith(".py") and p.startswith(("torch/", "test/", "benchmarks/"))]
    return files, [p for p in files if p in created]


# Left behind by editors, merges and `git am --reject`: never part of a reviewable PR.
STRAY_FILE = re.compile(r"(\.(bak|orig|rej|swp|pyc)|~)$")


def stray_files(patches: list[series.Patch]) -> list[str]:
    """The files the series leaves in the tree that are editor or merge leftovers, as findings."""
    paths, _ = series.final_paths(patches)
    return [f"{p}: an editor or merge leftover in the series; remove it in the workspace and export"
            for p in paths if STRAY_FILE.search(p)]


def write_tree(dest: Path, files: list[str], read: Reader) -> list[str]:
    """Write the files that exist in this version under dest with the lint configs; return them."""
    dest.mkdir(parents=True)
    for name, target in CONFIG_FILES.items():
        shutil.copyfile(CONFIG / name, dest / target)
    present = []
    for f in files:
        data = read(f)
        if data is None:
            continue
        (dest / f).parent.mkdir(parents=True, exist_ok=True)
        (dest / f).write_bytes(data)
        present.append(f)
    return present


def tool(venv: Path, name: str) -> str:
    exe = venv / "bin" / name
    if not exe.exists():
        raise series.SeriesError(f"{exe} is missing; install the pinned requirements: "
                                 f"python3 -m scripts.series setup")
    return str(exe)


def run(cmd: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)


def line_text(tree: Path, path: str, row: int) -> str:
    try:
        return (tree / path).read_text().splitlines()[row - 1].strip()
    except (OSError, IndexError):
        return ""


def diff_removed_lines(diff: str, strip_prefix: str = "") -> list[Finding]:
    """The lines a formatter would change, from its unified diff: (path, "", old line)."""
    out = []
    path = None
    for line in diff.splitlines():
        if line.startswith("--- "):
            path = line[4:].split("\t")[0].strip()
            for prefix in ("a/", strip_prefix):
                if prefix and path.startswith(prefix):
                    path = path[len(prefix):]
        elif line.startswith("-") and not line.startswith("---") and path:
            out.append((path, "", line[1:].strip()))
    return out


def lint_tree(tree: Path, files: list[str], new_modules: list[str], venv: Path) -> tuple[list[Finding], list[str]]:
    """All findings of all tools in one tree, and the human-readable lines for them."""
    findings: list[Finding] = []
    shown: list[str] = []
    proc = run([tool(venv, "ruff"), "check", "--no-cache", "--output-format", "json", "--exit-zero", *files], tree)
    for item in json.loads(proc.stdout or "[]"):
        path = str(Path(item["filename"]).resolve().relative_to(tree.resolve()))
        row = item["location"]["row"]
        findings.append((path, f"ruff:{item['code']}", line_text(tree, path, row)))
        shown.append(f"{path}:{row}: ruff {item['code']} {item['message']}")
    proc = run([tool(venv, "ruff"), "format", "--no-cache", "--diff", *files], tree)
    for path, _, text in diff_removed_lines(proc.stdout):
        findings.append((path, "ruff-format", text))
        shown.append(f"{path}: ruff format would change: {text}")
    proc = run([tool(venv, "usort"), "diff", *files], tree)
    for path, _, text in diff_removed_lines(proc.stdout):
        findings.append((path, "usort", text))
        shown.append(f"{path}: usort would move: {text}")
    proc = run([tool(venv, "flake8"), *files], tree)
    for line in proc.stdout.splitlines():
        m = re.match(r"^(.+?):(\d+):\d+: (\S+) (.*)$", line)
        if m:
            findings.append((m[1], f"flake8:{m[3]}", line_text(tree, m[1], int(m[2]))))
            shown.append(f"{m[1]}:{m[2]}: flake8 {m[3]} {m[4]}")
    modules = [f for f in new_modules if f.startswith("torch/")]
    if modules:
        proc = run([tool(venv, "mypy"), "--config-file", "mypy.ini", "--no-incremental", *modules], tree)
        errors = 0
        for line in proc.stdout.splitlines():
            m = re.match(r"^(.+?):(\d+): error: (.*?)(?:  \[([\w-]+)\])?$", line)
            if m:
                errors += 1
                findings.append((m[1], f"mypy:{m[4]}", m[3]))
                shown.append(line)
        if proc.returncode != 0 and not errors:
            # mypy could not check the modules at all (e.g. a config or module-path error)
            findings.append(("", "mypy", proc.stdout + proc.stderr))
            shown.append(f"mypy failed: {(proc.stdout + proc.stderr).strip()}")
    return findings, shown


def new_findings(base: list[Finding], findings: list[Finding], shown: list[str]) -> list[str]:
    """The shown lines of the findings the base files do not have as often (a multiset difference)."""
    known = collections.Counter(base)
    new = []
    for finding, text in zip(findings, shown):
        if known[finding] > 0:
            known[finding] -= 1
        else:
            new.append(text)
    return new


def readers_from_venv(venv: Path, patches: list[series.Patch], tmp: Path) -> tuple[Reader, Reader]:
    sp = series.site_packages(venv)
    state = series.install_state(sp, patches, series.Layout(ROOT).base()["torch_version"])
    if state.state != "current":
        raise series.SeriesError(f"the torch in {venv} is {state.state} ({state.detail}); "
                                 "run `python3 -m scripts.series install` first")
    tests = tmp / "tests"
    series.extract_tests(patches, tests)
    for patch in patches:  # benchmark files (pr_time_benchmarks) are new files, like the tests
        if patch.paths("benchmarks/"):
            subprocess.run(["git", "apply", "--include=benchmarks/*", str(patch.path.resolve())], cwd=tests,
                           check=True, capture_output=True, env=series.isolated_env())
    pristine = sp / series.STAMP_DIR / "pristine"

    def patched(path: str) -> bytes | None:
        f = sp / path if path.startswith("torch/") else tests / path
        return f.read_bytes() if f.exists() else None

    def base(path: str) -> bytes | None:
        # Files the series modifies have a pristine copy; the others are new.
        f = pristine / path
        return f.read_bytes() if f.exists() else None

    return base, patched


def readers_from_workspace(ws: Path) -> tuple[Reader, Reader]:
    if not (ws / ".git").exists():
        raise series.SeriesError(f"no workspace at {ws}; create it with `python3 -m scripts.series workspace`")

    def patched(path: str) -> bytes | None:
        f = ws / path
        return f.read_bytes() if f.exists() else None

    def base(path: str) -> bytes | None:
        proc = subprocess.run(["git", "show", f"base:{path}"], cwd=ws, capture_output=True)
        return proc.stdout if proc.returncode == 0 else None

    return base, patched


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python3 -m scripts.lint", description=__doc__.split("\n\n")[0])
    ap.add_argument("--venv", type=Path, default=ROOT / ".venv",
                    help="venv with the lint tools and the series installed (default: .venv)")
    ap.add_argument("--workspace", action="store_true",
                    help="lint build/workspace's working tree against its `base` tag instead of the venv's torch")
    args = ap.parse_args(argv)
    try:
        patches = series.load_series(ROOT / "patches")
        files, created = series_py_files(patches)
        with tempfile.TemporaryDirectory(prefix="rfc0051-lint-") as tmp_name:
            tmp = Path(tmp_name)
            if args.workspace:
                base, patched = readers_from_workspace(ROOT / "build" / "workspace")
            else:
                base, patched = readers_from_venv(args.venv, patches, tmp)
            base_files = write_tree(tmp / "base", files, base)
            patched_files = write_tree(tmp / "patched", files, patched)
            with concurrent.futures.ThreadPoolExecutor(2) as pool:
                base_run = pool.submit(lint_tree, tmp / "base", base_files, [], args.venv)
                patched_run = pool.submit(lint_tree, tmp / "patched", patched_files, created, args.venv)
                base_findings, _ = base_run.result()
                findings, shown = patched_run.result()
    except series.SeriesError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    new = stray_files(patches) + new_findings(base_findings, findings, shown)
    print(f"lint: {len(patched_files)} files of the series (ruff, ruff format, usort, flake8; "
          f"mypy on {len([f for f in created if f.startswith('torch/')])} new modules): "
          f"{len(findings)} findings, {len(findings) - len(new)} also in the base files, {len(new)} new")
    for text in new:
        print(f"  {text}")
    return 1 if new else 0


if __name__ == "__main__":
    sys.exit(main())
