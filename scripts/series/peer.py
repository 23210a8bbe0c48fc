"""`peer-tests`: PyTorch's own test files for the modules the series touches, run on pristine torch and
with the series (flag off, flag on), compared test by test.

Guarantees:
- The same test files run under three configurations, one pytest process per file (as PyTorch's
  run_test.py does: some tests depend on process-global counters that other files advance), from the
  `test/` folder of the tree they come from: `pristine` (torch 2.15.0 without the series), `off` (the
  series installed, `torch._dynamo.config.record_call_hierarchy` at its default, off) and `on` (the
  series with the flag forced on for the whole process and its subprocesses by a `sitecustomize.py`
  on PYTHONPATH). Environment: OMP_NUM_THREADS=1, CI unset, Inductor's FX-graph and AOTAutograd caches
  off, a fresh TORCHINDUCTOR_CACHE_DIR per configuration (deleted afterwards).
- Pristine torch is a hard-link overlay of the venv's `torch/` (build/peer/pristine/torch): every file
  the series changes is unlinked there and rewritten with the wheel's version (from the backups
  `install` keeps in site-packages/.rfc0051-series/pristine/, checked against the wheel's RECORD), every
  file it adds is removed. The venv is never written to: a link is always removed before its path is
  written. The overlay is checked against RECORD before and after its run.
- Each configuration is checked inside every pytest process (a plugin that records `torch.__file__`
  and the flag as the session starts): torch from the overlay for `pristine` (and no
  `record_call_hierarchy` flag), from the venv for `off`/`on`, the flag False/True. A probe with the same
  environment fails the run before the tests start if that would not hold. Any mismatch is an error.
- The verdict is per test id (pytest's JUnit XML): a test that passes on pristine and does not pass (fails,
  errors, is skipped or is missing) with the series, flag off or on, is a regression; exit status 1 if
  there is any. Tests that fail on pristine are reported as such only (the stored files come from
  various upstream commits). If the venv's series changed during the run, the result is refused (rerun).
- What runs: the stored folder's `selection.txt` (`file | -k expression | per-test timeout s`, one file a line),
  else every test_*.py under test/; files named on the command line take their selection line's `-k` and
  timeout. The timeout is pytest-timeout's `--timeout`: a hung test fails, the file goes on.
- Pristine from a checked-in baseline (`ci/peer-baseline.json`, written by `--refresh-baseline`): pristine
  outcomes depend only on the torch wheel, the test files and the test environment, so a file's recorded
  pristine outcomes are used instead of a pristine run when its key matches: the sha256 of the file, its
  selection line, every other file under test/ (helpers it may import), and the interpreter and test
  packages of the venv (Python minor version; torch, pytest, pytest-timeout, expecttest, parameterized,
  numpy). Any difference reruns pristine for that file and says why. `--refresh-baseline` runs pristine
  `--repeat` times (2 by default); a test whose outcome differs between the repeats is recorded as flaky
  on pristine with the outcomes seen, counted as failing on pristine (never a regression), and listed.
- Configurations run side by side (`--jobs`, default 2: one pytest process per configuration at a time).
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from .git import Layout, SeriesError, find_wheel, git
from .install import (
    check_torch_version, install_state, pristine_bytes, read_stamp, record_hashes, site_packages, torch_paths,
)
from .patches import Patch, load_series
from .upstream import pytest_config_args, upstream_test_env

CONFIGS = ("pristine", "off", "on")
OUTCOMES = ("passed", "failed", "error", "skipped")
SEVERITY = {"passed": 0, "skipped": 1, "failed": 2, "error": 3}
FLAG = "record_call_hierarchy"
PROBE_PLUGIN = "rfc0051_peer_probe"
SELECTION = "selection.txt"
BASELINE = Path("ci") / "peer-baseline.json"  # relative to the repository root
# The packages of the venv whose versions are part of a baseline key (with the Python minor version).
KEY_PACKAGES = ("torch", "pytest", "pytest-timeout", "expecttest", "parameterized", "numpy")

# Put on PYTHONPATH for the `on` configuration: forces the flag on as soon as torch._dynamo.config is
# executed, in this process and every Python subprocess that inherits PYTHONPATH.
SITECUSTOMIZE = '''\
"""rfc0051 peer-tests: force torch._dynamo.config.record_call_hierarchy = True in every process."""
import importlib.abc
import sys

_TARGET = "torch._dynamo.config"


class _ForceCallHierarchy(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name != _TARGET:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
                exec_module = spec.loader.exec_module

                def exec_and_force(module, _exec=exec_module):
                    _exec(module)
                    setattr(module, "record_call_hierarchy", True)

                spec.loader.exec_module = exec_and_force
                return spec
        return None


sys.meta_path.insert(0, _ForceCallHierarchy())
'''

# A pytest plugin (-p rfc0051_peer_probe): records, as the session starts, which torch the test process
# imports and the flag's value, into the JSON file named by RFC0051_PEER_PROBE_OUT.
PROBE = '''\
"""rfc0051 peer-tests: record the torch a test process imports and the flag's value."""
import json
import os


def probe():
    import torch
    import torch._dynamo.config as config
    return {"torch": torch.__file__, "version": torch.__version__,
            "flag": getattr(config, "record_call_hierarchy", None), "pid": os.getpid()}


def pytest_configure(config):
    out = os.environ.get("RFC0051_PEER_PROBE_OUT")
    if out:
        with open(out, "w") as fh:
            json.dump(probe(), fh)


if __name__ == "__main__":
    print(json.dumps(probe()))
'''


# --------------------------------------------------------------------------- JUnit XML and the verdict


def module_name(test_file: str) -> str:
    """`dynamo/test_x.py` -> `dynamo.test_x` (how pytest's JUnit XML names the file in `classname`)."""
    return test_file.removesuffix(".py").replace("/", ".")


def test_id(classname: str, name: str, files: Iterable[str]) -> str:
    """`file::Class::test` for a JUnit testcase, `files` relative to test/ (pytest's classname may carry a
    leading `test.` when its rootdir is the checkout's root); a collection error is `file::<collection>`."""
    mods = sorted(((module_name(f), f) for f in files), key=lambda m: -len(m[0]))
    for cand, test in ((classname, name), (classname.removeprefix("test."), name), (name, ""),
                       (name.removeprefix("test."), "")):
        for mod, f in mods:
            if cand == mod or cand.startswith(mod + "."):
                rest = cand[len(mod) + 1:].split(".") if cand != mod else []
                return "::".join([f, *rest, test or "<collection>"])
    return "::".join(p for p in (classname, name) if p)


def parse_junit(path: Path, files: Iterable[str]) -> dict[str, str]:
    """Outcome per test id (passed/failed/error/skipped) from pytest's --junitxml file; a test reported
    twice (e.g. a teardown error after a pass) takes its worse outcome."""
    files = list(files)
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError) as exc:
        raise SeriesError(f"cannot read the JUnit XML {path}: {exc}") from exc
    out: dict[str, str] = {}
    for case in root.iter("testcase"):
        tags = {child.tag for child in case}
        outcome = ("error" if "error" in tags else "failed" if "failure" in tags
                   else "skipped" if "skipped" in tags else "passed")
        tid = test_id(case.get("classname", ""), case.get("name", ""), files)
        if tid not in out or SEVERITY[outcome] > SEVERITY[out[tid]]:
            out[tid] = outcome
    return out


def file_outcomes(xml: Path, f: str, config: str) -> dict[str, str]:
    """:func:`parse_junit` of the JUnit XML of the pytest process of test file `f`: an error if a test id
    names no test of `f` (pytest named the tests from another rootdir), as they would count for no file."""
    outcomes = parse_junit(xml, [f])
    stray = [tid for tid in outcomes if not tid.startswith(f"{f}::")]
    if stray:
        raise SeriesError(f"configuration {config}: pytest named a test of {f} {stray[0]!r}, which is not under "
                          f"{f}: was it run with another rootdir (a pytest.ini above the test folder)?")
    return outcomes


@dataclasses.dataclass
class Verdict:
    regressions: dict[str, dict[str, str]]  # test id -> {config: outcome ("missing" if not run)}
    fails_on_pristine: dict[str, dict[str, str]]  # test id -> {config: outcome}, pristine included


def compare(results: dict[str, dict[str, str]]) -> Verdict:
    """Regressions: passed on pristine, anything but passed (missing included) in another configuration.
    Tests that fail or error on pristine are listed apart; tests skipped on pristine are ignored."""
    pristine = results.get("pristine", {})
    others = [c for c in results if c != "pristine"]
    regressions: dict[str, dict[str, str]] = {}
    fails: dict[str, dict[str, str]] = {}
    for tid, outcome in sorted(pristine.items()):
        seen = {c: results[c].get(tid, "missing") for c in others}
        if outcome == "passed" and any(v != "passed" for v in seen.values()):
            regressions[tid] = seen
        elif outcome in ("failed", "error"):
            fails[tid] = {"pristine": outcome, **seen}
    return Verdict(regressions, fails)


def counts(outcomes: dict[str, str], test_file: str) -> tuple[int, int, int]:
    """(passed, failed or errored, skipped) of the tests of one file."""
    mine = [o for tid, o in outcomes.items() if tid.split("::", 1)[0] == test_file]
    return (mine.count("passed"), mine.count("failed") + mine.count("error"), mine.count("skipped"))


def table(results: dict[str, dict[str, str]], files: list[str]) -> str:
    configs = list(results)
    width = max([len(f) for f in files] + [4])
    lines = [f"{'file':<{width}}  " + "  ".join(f"{c + ' p/f/s':>14}" for c in configs)]
    for f in files:
        lines.append(f"{f:<{width}}  " + "  ".join(f"{'/'.join(map(str, counts(results[c], f))):>14}"
                                                   for c in configs))
    totals = ["/".join(str(sum(counts(results[c], f)[i] for f in files)) for i in range(3)) for c in configs]
    lines.append(f"{'total':<{width}}  " + "  ".join(f"{t:>14}" for t in totals))
    return "\n".join(lines)


# --------------------------------------------------------------------------- the pristine overlay


def series_paths(sp: Path, series: list[Patch]) -> list[str]:
    """Every torch/ file the series (or what the venv's stamp records) changes or adds."""
    stamp = read_stamp(sp)
    return list(dict.fromkeys([*torch_paths(series), *(stamp["files"] if stamp else [])]))


def build_overlay(sp: Path, dest: Path, paths: list[str], record: dict[str, str],
                  pristine: dict[str, bytes]) -> Path:
    """dest/torch: hard links to sp/torch, except `paths`: the wheel's bytes (`pristine`) written to a fresh
    inode where the wheel has the file, removed where it has not (`record` lacks it). Returns dest."""
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    proc = subprocess.run(["cp", "-al", str(sp / "torch"), str(dest / "torch")], capture_output=True, text=True)
    if proc.returncode != 0:
        raise SeriesError(f"cannot hard-link {sp / 'torch'} into {dest} (`cp -al`: {proc.stderr.strip()}); the "
                          "overlay must be on the venv's file system")
    for rel in paths:
        target = dest / rel
        if target.is_file() or target.is_symlink():
            target.unlink()  # break the hard link first: never write through it into the venv
        cache = target.parent / "__pycache__"
        for pyc in cache.glob(f"{target.stem}.*.pyc") if cache.is_dir() else []:
            pyc.unlink()
        if rel in record:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(pristine[rel])
    check_overlay(dest, paths, record)
    return dest


def check_overlay(dest: Path, paths: list[str], record: dict[str, str]) -> None:
    bad = []
    for rel in paths:
        target = dest / rel
        if rel not in record:
            if target.exists():
                bad.append(f"{rel} exists (the series adds it)")
        elif not target.is_file() or hashlib.sha256(target.read_bytes()).hexdigest() != record[rel]:
            bad.append(f"{rel} is not the wheel's")
    if bad:
        raise SeriesError(f"the pristine overlay {dest} is not pristine: {'; '.join(bad)}")


def pristine_overlay(layout: Layout, sp: Path, series: list[Patch], dest: Path) -> tuple[Path, list[str], dict]:
    pinned = layout.base()["torch_version"]
    record = record_hashes(check_torch_version(sp, pinned))
    paths = series_paths(sp, series)
    pristine = {rel: pristine_bytes(sp, rel, record[rel], pinned, lambda: find_wheel(pinned, layout.wheels))
                for rel in paths if rel in record}
    return build_overlay(sp, dest, paths, record, pristine), paths, record


# --------------------------------------------------------------------------- where the tests come from


class NoStoredTests(SeriesError):
    """No folder of stored upstream test files was found (ci/run_tests.sh reports the suite as skipped)."""

    exit_code = 3


def default_tests_from(root: Path) -> Path:
    """../shared/upstream-tests beside the repository, or beside its `origin` if that is a local path."""
    tried = [root.parent / "shared" / "upstream-tests"]
    proc = git(root, "remote", "get-url", "origin", check=False)
    url = proc.stdout.strip() if proc.returncode == 0 else ""
    url = url.removeprefix("file://")
    if url and "://" not in url and not (":" in url.split("/", 1)[0]):
        origin = Path(url) if os.path.isabs(url) else (root / url)
        tried.append(origin.resolve().parent / "shared" / "upstream-tests")
    for cand in tried:
        if (cand / "test").is_dir():
            return cand
    raise NoStoredTests("no stored upstream test files: looked for " + " and ".join(f"{c}/test" for c in tried)
                      + "; pass --tests-from DIR (a PyTorch checkout, or a folder laid out like one)")


@dataclasses.dataclass(frozen=True)
class Selected:
    """One test file to run (relative to test/) with its selection line's `-k` expression and timeout."""

    file: str
    keyword: str = ""
    timeout: int | None = None

    def pytest_args(self) -> list[str]:
        return (["-k", self.keyword] if self.keyword else []) + ([f"--timeout={self.timeout}"] if self.timeout else [])


def read_selection(tests_from: Path) -> dict[str, Selected] | None:
    """tests_from/selection.txt (`file under test/ | -k expression | per-test timeout s`; `#` comments), or None
    where there is none. A malformed line or a listed file that does not exist is an error naming the line."""
    path = tests_from / SELECTION
    if not path.is_file():
        return None
    out: dict[str, Selected] = {}
    for n, raw in enumerate(path.read_text().splitlines(), 1):
        line = "" if raw.lstrip().startswith("#") else raw.strip()
        if not line:
            continue
        parts = [p.strip() for p in line.split("|")]
        where = f"{path}:{n}: {raw.strip()!r}"
        if len(parts) != 3 or not parts[0]:
            raise SeriesError(f"{where}: expected `file | -k expression | timeout s` (three fields)")
        f, keyword, timeout = parts[0].removeprefix("test/"), parts[1], parts[2]
        if timeout and not (timeout.isdigit() and int(timeout) > 0):
            raise SeriesError(f"{where}: the timeout must be a positive number of seconds or empty")
        if not (tests_from / "test" / f).is_file():
            raise SeriesError(f"{where}: {tests_from / 'test' / f} does not exist")
        if f in out:
            raise SeriesError(f"{where}: {f} is listed twice")
        out[f] = Selected(f, keyword, int(timeout) if timeout else None)
    if not out:
        raise SeriesError(f"{path} lists no test file")
    return out


def select(tests_from: Path, files: list[str]) -> list[Selected]:
    """The test files to run, relative to tests_from/test. Given none: those selection.txt lists, else every
    test_*.py under test/ of a stored folder (a PyTorch checkout, holding torch/, must name its files). A
    named file takes its selection line's -k expression and timeout."""
    test_dir = tests_from / "test"
    if not test_dir.is_dir():
        raise SeriesError(f"{test_dir} does not exist; --tests-from takes a folder laid out like a PyTorch checkout")
    selection = read_selection(tests_from) or {}
    if not files:
        if selection:
            return list(selection.values())
        if (tests_from / "torch").is_dir():
            raise SeriesError(f"{tests_from} is a PyTorch checkout: name the test files to run, e.g. "
                              "test/dynamo/test_regional_inductor.py")
        found = sorted(str(p.relative_to(test_dir)) for p in test_dir.rglob("test_*.py"))
        if not found:
            raise SeriesError(f"no test_*.py files under {test_dir}")
        return [Selected(f) for f in found]
    out = []
    for f in files:
        rel = f.removeprefix("test/")
        if not (test_dir / rel).is_file():
            raise SeriesError(f"{test_dir / rel} does not exist")
        out.append(selection.get(rel, Selected(rel)))
    return list(dict.fromkeys(out))


def select_files(tests_from: Path, files: list[str]) -> list[str]:
    """The paths (relative to tests_from/test) of `select`."""
    return [s.file for s in select(tests_from, files)]


# --------------------------------------------------------------------------- the checked-in pristine baseline


def environment_key(python: Path, packages: tuple[str, ...] = KEY_PACKAGES) -> dict[str, str]:
    """The Python minor version and the versions of `packages` in the venv of `python`."""
    code = ("import json, sys, importlib.metadata as m\n"
            "def v(n):\n"
            "    try:\n        return m.version(n)\n"
            "    except m.PackageNotFoundError:\n        return None\n"
            f"print(json.dumps({{'python': '%d.%d' % sys.version_info[:2], **{{n: v(n) for n in {packages!r}}}}}))")
    proc = subprocess.run([str(python), "-c", code], capture_output=True, text=True, env=upstream_test_env())
    if proc.returncode != 0:
        raise SeriesError(f"{python} cannot report its package versions: {proc.stderr.strip()[-400:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def tree_hashes(test_dir: Path) -> dict[str, str]:
    """sha256 of every file under test_dir (no __pycache__), by path relative to it."""
    return {str(p.relative_to(test_dir)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(test_dir.rglob("*")) if p.is_file() and "__pycache__" not in p.parts}


def baseline_key(sel: Selected, hashes: dict[str, str], env: dict[str, str]) -> dict[str, object]:
    """What a file's pristine outcomes depend on: the file, its selection line, every other file under test/
    (the helpers it may import) and the test environment."""
    others = hashlib.sha256("".join(f"{p} {h}\n" for p, h in sorted(hashes.items()) if p != sel.file).encode())
    return {"sha256": hashes.get(sel.file), "keyword": sel.keyword, "timeout": sel.timeout,
            "others_sha256": others.hexdigest(), "environment": env}


WHY = {"sha256": "the test file changed", "keyword": "its -k expression changed", "timeout": "its timeout changed",
       "others_sha256": "another file under test/ (a helper it may import) changed",
       "environment": "the Python or test packages differ"}


def load_baseline(path: Path) -> dict:
    """The baseline file (an empty one where there is none); a file that is not a baseline is an error."""
    if not path.exists():
        return {"files": {}}
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise SeriesError(f"cannot read the peer baseline {path}: {exc}; refresh it with "
                          "`python3 -m scripts.series peer-tests --refresh-baseline`") from exc
    if not isinstance(data, dict) or not isinstance(data.get("files"), dict):
        raise SeriesError(f"{path} is not a peer baseline (no `files` object); refresh it with "
                          "`python3 -m scripts.series peer-tests --refresh-baseline`")
    return data


def baseline_outcomes(entry: dict | None, key: dict[str, object]) -> tuple[dict[str, str] | None, str]:
    """(the recorded pristine outcomes, "") where the entry's key is `key`, else (None, why not)."""
    if entry is None:
        return None, "not in the baseline"
    diff = [WHY[k] for k in key if entry.get("key", {}).get(k) != key[k]]
    if diff:
        return None, "; ".join(diff)
    return dict(entry["outcomes"]), ""


def baseline_entry(key: dict[str, object], runs: list[dict[str, str]], walls: list[float]) -> dict:
    """A file's baseline entry from `runs` (its pristine outcomes, one dict per repeat): each test's worst
    outcome, and the tests whose outcome differs between repeats as flaky (with the outcomes seen)."""
    ids = sorted(set().union(*runs))
    outcomes: dict[str, str] = {}
    flaky: dict[str, str] = {}
    for tid in ids:
        seen = [r.get(tid, "missing") for r in runs]
        present = [o for o in seen if o != "missing"]
        outcomes[tid] = "error" if "missing" in seen else max(present, key=SEVERITY.__getitem__)
        if len(set(seen)) > 1:
            flaky[tid] = "pristine runs gave " + ", ".join(seen)
    return {"key": key, "runs": len(runs), "wall_s": [round(w) for w in walls], "outcomes": outcomes,
            "flaky": flaky}


def write_baseline(path: Path, data: dict) -> None:
    """Write atomically (a temporary file renamed over it): an interrupted refresh keeps the old baseline."""
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {"about": "Pristine outcomes of the peer suite, per test id, written by `python3 -m scripts.series "
                     "peer-tests --refresh-baseline`; a file's entry is used only while its key matches.",
            "files": dict(sorted(data["files"].items()))}
    with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=".peer-baseline.", delete=False) as fh:
        json.dump(data, fh, indent=1, sort_keys=True)
        fh.write("\n")
    os.replace(fh.name, path)


# --------------------------------------------------------------------------- running a configuration


@dataclasses.dataclass
class Run:
    config: str
    outcomes: dict[str, str]
    wall_s: float
    rcs: dict[str, int]  # pytest's exit status per file
    log: Path
    file_wall_s: dict[str, float] = dataclasses.field(default_factory=dict)  # the pytest process's, per file


def config_env(config: str, work: Path, overlay: Path, cache_dir: Path) -> dict[str, str]:
    env = upstream_test_env()  # without CI
    path = [str(work / "probe")]
    if config == "pristine":
        path.insert(0, str(overlay))
    elif config == "on":
        path.insert(0, str(work / "force_on"))
    if env.get("PYTHONPATH"):
        path.append(env["PYTHONPATH"])
    env.update(PYTHONPATH=os.pathsep.join(path), OMP_NUM_THREADS="1", TORCHINDUCTOR_FX_GRAPH_CACHE="0",
               TORCHINDUCTOR_AUTOGRAD_CACHE="0", TORCHINDUCTOR_CACHE_DIR=str(cache_dir))
    return env


def check_probe(config: str, probe: dict, sp: Path, overlay: Path, where: str) -> None:
    torch_dir = Path(probe.get("torch", "")).resolve().parent
    want_dir = (overlay if config == "pristine" else sp).resolve() / "torch"
    want_flag = {"pristine": None, "off": False, "on": True}[config]
    if torch_dir != want_dir or probe.get("flag") != want_flag:
        raise SeriesError(f"configuration {config}: {where} imported torch from {torch_dir} with {FLAG}="
                          f"{probe.get('flag')!r}; expected {want_dir} with "
                          f"{'no such flag' if want_flag is None else want_flag}")


def run_config(config: str, python: Path, cwd: Path, files: list[Selected], work: Path, overlay: Path, sp: Path,
               pytest_args: list[str], name: str | None = None) -> Run:
    """One pytest process per test file, as PyTorch's run_test.py runs them (tests of one file depend on
    process-global counters that another file's tests advance), all with this configuration's environment.
    `name` (default: the configuration) names the results folder and log: a repeat of a configuration."""
    name = name or config
    out = work / "results" / name
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    log = work / f"{name}.log"
    outcomes: dict[str, str] = {}
    rcs: dict[str, int] = {}
    walls: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix=f"peer-{name}-inductor-") as cache:
        env = config_env(config, work, overlay, Path(cache))
        pre = subprocess.run([str(python), "-m", PROBE_PLUGIN], cwd=cwd, env=env, capture_output=True, text=True)
        if pre.returncode != 0:
            raise SeriesError(f"configuration {config}: the probe cannot import torch: {pre.stderr.strip()[-800:]}")
        check_probe(config, json.loads(pre.stdout.strip().splitlines()[-1]), sp, overlay, "a probe process")
        print(f"=== {name}: {len(files)} file(s), one pytest each, log {log}", flush=True)
        start = time.monotonic()
        with open(log, "w") as fh:
            for sel in files:
                f = sel.file
                stem = f.removesuffix(".py").replace("/", ".")
                xml, probe_out = out / f"{stem}.xml", out / f"{stem}.probe.json"
                env["RFC0051_PEER_PROBE_OUT"] = str(probe_out)
                cmd = [str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", PROBE_PLUGIN,
                       *pytest_config_args(cwd), f"--junitxml={xml}", f, *sel.pytest_args(), *pytest_args]
                fh.write(f"=== {' '.join(cmd)}\n")
                fh.flush()
                began = time.monotonic()
                rcs[f] = subprocess.run(cmd, cwd=cwd, env=env, stdout=fh, stderr=subprocess.STDOUT).returncode
                if not probe_out.exists():
                    raise SeriesError(f"configuration {config}: the pytest process of {f} recorded no probe (exit "
                                      f"{rcs[f]}); see {log}")
                check_probe(config, json.loads(probe_out.read_text()), sp, overlay, f"the pytest process of {f}")
                if xml.exists():
                    outcomes.update(file_outcomes(xml, f, config))
                else:  # pytest died (a crash): its tests are missing, and the file is marked
                    outcomes[f"{f}::<session>"] = "error"
                walls[f] = time.monotonic() - began
                print(f"    {name}: {f} {walls[f]:.0f} s (pytest exit {rcs[f]})", flush=True)
        wall = time.monotonic() - start
    print(f"    {name}: {sum(o == 'passed' for o in outcomes.values())} passed of {len(outcomes)} in {wall:.0f} s",
          flush=True)
    return Run(config, outcomes, wall, rcs, log, walls)


def series_hash_now(sp: Path, layout: Layout) -> str:
    st = install_state(sp, load_series(layout.patches), layout.base()["torch_version"], None)
    if st.state != "current":
        raise SeriesError(f"the series is not installed in {sp} ({st.state}: {st.detail}); run "
                          "`python3 -m scripts.series install`, then rerun")
    stamp = read_stamp(sp)
    return str(stamp["series_hash"]) if stamp else ""


def run_peer_tests(layout: Layout, tests_from: Path | None, files: list[str], configs: list[str],
                   pytest_args: list[str], venv: Path | None = None, jobs: int = 2, baseline: Path | None = None,
                   refresh: bool = False, repeat: int = 2, use_baseline: bool = True) -> int:
    """Run the peer suite (see the module docstring). `baseline` (default ci/peer-baseline.json; a missing file
    is an empty baseline) stands in for pristine runs where its keys match, unless `pytest_args` narrow the
    run, or `use_baseline` is False; `refresh` runs only pristine, `repeat` times, and writes the baseline of
    the selected files."""
    bad = [c for c in configs if c not in CONFIGS]
    if bad or not configs:
        raise SeriesError(f"--configs takes a comma-separated subset of {','.join(CONFIGS)}, not {','.join(bad)}")
    if jobs < 1 or repeat < 1:
        raise SeriesError(f"--jobs and --repeat take a positive number (got --jobs {jobs}, --repeat {repeat})")
    configs = ["pristine"] if refresh else [c for c in CONFIGS if c in configs]
    root = (tests_from or default_tests_from(layout.root)).resolve()
    if not root.is_dir():
        raise SeriesError(f"{root} does not exist (--tests-from)")
    selected = select(root, files)
    venv = venv or layout.venv
    python = Path(os.path.abspath(venv / "bin" / "python"))
    if not python.exists():
        raise SeriesError(f"{python} does not exist; run `python3 -m scripts.series setup`")
    sp = site_packages(venv)
    work = layout.root / "build" / "peer"
    work.mkdir(parents=True, exist_ok=True)
    with open(work / ".lock", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            raise SeriesError(f"another peer-tests run holds {work}; wait for it to finish") from None
        plan = Plan(selected, configs, pytest_args, jobs, baseline or layout.root / BASELINE, refresh, repeat,
                    use_baseline)
        return run_locked(layout, sp, python, root, plan, work)


@dataclasses.dataclass
class Plan:
    files: list[Selected]
    configs: list[str]
    pytest_args: list[str]
    jobs: int
    baseline: Path
    refresh: bool
    repeat: int
    use_baseline: bool = True


def run_locked(layout: Layout, sp: Path, python: Path, root: Path, plan: Plan, work: Path,
               run: Callable[..., Run] = run_config) -> int:
    series = load_series(layout.patches)
    files = [s.file for s in plan.files]
    (work / "probe").mkdir(exist_ok=True)
    (work / "probe" / f"{PROBE_PLUGIN}.py").write_text(PROBE)
    (work / "force_on").mkdir(exist_ok=True)
    (work / "force_on" / "sitecustomize.py").write_text(SITECUSTOMIZE)
    before = series_hash_now(sp, layout) if set(plan.configs) - {"pristine"} else ""
    overlay = work / "pristine"
    paths: list[str] = []
    record: dict = {}
    # Pristine: the baseline's outcomes for each file whose key matches, a pristine run for the others.
    recorded: dict[str, str] = {}
    flaky: dict[str, str] = {}
    pristine_files = list(plan.files) if "pristine" in plan.configs else []
    baseline = load_baseline(plan.baseline)
    keys: dict[str, dict[str, object]] = {}
    if pristine_files:
        env, hashes = environment_key(python), tree_hashes(root / "test")
        keys = {s.file: baseline_key(s, hashes, env) for s in plan.files}
    if pristine_files and not plan.refresh:
        if plan.pytest_args or not plan.use_baseline:
            print(f"pristine: run (the baseline {plan.baseline} is not used "
                  f"{'with extra pytest arguments' if plan.pytest_args else 'with --no-baseline'})")
        else:
            stale: dict[str, str] = {}
            for s in plan.files:
                got, why = baseline_outcomes(baseline["files"].get(s.file), keys[s.file])
                if got is None:
                    stale[s.file] = why
                    continue
                recorded.update(got)
                flaky.update(baseline["files"][s.file].get("flaky", {}))
            pristine_files = [s for s in plan.files if s.file in stale]
            print(f"pristine: the baseline {plan.baseline} for {len(plan.files) - len(stale)} of {len(plan.files)} "
                  "file(s)" + ("; run for " + ", ".join(f"{f} ({why})" for f, why in stale.items()) if stale else ""))
    if pristine_files:
        overlay, paths, record = pristine_overlay(layout, sp, series, overlay)
    # (run name, configuration, files): the repeats of a refresh, or each configuration once
    runs_todo = ([(f"pristine-{i}", "pristine", pristine_files) for i in range(1, plan.repeat + 1)] if plan.refresh
                 else [(c, c, pristine_files if c == "pristine" else plan.files) for c in plan.configs
                       if c != "pristine" or pristine_files])
    print(f"peer tests: {len(files)} file(s) from {root}/test, configurations {', '.join(plan.configs)}, "
          f"{min(plan.jobs, len(runs_todo))} at a time")
    with ThreadPoolExecutor(max(1, min(plan.jobs, len(runs_todo)))) as pool:
        futures = {name: pool.submit(run, config, python, root / "test", todo, work, overlay, sp, plan.pytest_args,
                                     name) for name, config, todo in runs_todo}
        done = {name: fut.result() for name, fut in futures.items()}
    if pristine_files:
        check_overlay(overlay, paths, record)  # an install during the run must not have reached it
    if before and series_hash_now(sp, layout) != before:
        raise SeriesError(f"the series installed in {sp} changed during the run (an `install`); rerun")
    if plan.refresh:
        for s in plan.files:
            mine = [{t: o for t, o in done[n].outcomes.items() if t.split("::", 1)[0] == s.file} for n, _, _ in runs_todo]
            walls = [done[n].file_wall_s.get(s.file, 0.0) for n, _, _ in runs_todo]
            baseline["files"][s.file] = baseline_entry(keys[s.file], mine, walls)
        write_baseline(plan.baseline, baseline)
        entries = [baseline["files"][f] for f in files]
        n_flaky = sum(len(e["flaky"]) for e in entries)
        print("\n" + table({n: done[n].outcomes for n, _, _ in runs_todo}, files))
        print(f"\nwrote {plan.baseline}: {len(files)} file(s), {plan.repeat} pristine run(s) each, "
              f"{n_flaky} test(s) flaky on pristine" + "".join(
                  f"\n  {t}  {r}" for e in entries for t, r in e["flaky"].items()))
        return 0
    results: dict[str, dict[str, str]] = {}
    if "pristine" in plan.configs:
        results["pristine"] = {**recorded, **(done["pristine"].outcomes if "pristine" in done else {})}
    results.update({c: done[c].outcomes for c in plan.configs if c != "pristine"})
    print("\n" + table(results, files))
    print("wall time: " + ", ".join(f"{c} {r.wall_s:.0f} s" for c, r in done.items()))
    if "pristine" not in results:
        print("no pristine configuration: nothing to compare against")
        return 0
    verdict = compare(results)
    if verdict.fails_on_pristine:
        print(f"\nfails on pristine (not the series'): {len(verdict.fails_on_pristine)} test(s); ids in "
              f"{work / 'fails_on_pristine.txt'}")
        (work / "fails_on_pristine.txt").write_text("".join(
            f"{tid}  " + " ".join(f"{c}={o}" for c, o in seen.items()) + "\n"
            for tid, seen in verdict.fails_on_pristine.items()))
    if flaky:
        print(f"flaky on pristine (repeated pristine runs differ; counted as failing on pristine): {len(flaky)}")
        for tid, why in sorted(flaky.items()):
            print(f"  {tid}  {why}; here " + " ".join(f"{c}={results[c].get(tid, 'missing')}" for c in results
                                                      if c != "pristine"))
    if len(results) == 1:
        return 0
    if verdict.regressions:
        print(f"\nREGRESSIONS: {len(verdict.regressions)} test(s) pass on pristine torch but not with the series:")
        for tid, seen in verdict.regressions.items():
            print(f"  {tid}  " + " ".join(f"{c}={o}" for c, o in seen.items()))
        return 1
    print(f"\nno regressions: every test that passes on pristine passes in {', '.join(c for c in results if c != 'pristine')}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit("use `python3 -m scripts.series peer-tests`")
