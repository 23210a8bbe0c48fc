"""`check-prefixes`: the series merges PR by PR. Every prefix 1..k of it, applied to the pristine base,
is a tree that upstream would accept as it stands.

Guarantees, for every k = 1..N (N: the series, or `--through PATCH`), in order, stopping at the first
prefix that fails (exit status 1; the message names k, the patch and what failed):
- (a) apply: patch k applies to the tree of prefix k-1 (the pristine base for k = 1: the wheel's versions
  of every torch/ file the series touches, from the backups `install` keeps, checked against RECORD; the
  files the series adds are absent) with `git apply`, exactly: each file's pre-image is the blob its
  `index` line names, and the result is the post-image blob it names (no offset, no fuzz, no 3-way).
- (b) lint: the .py files patch k touches, as prefix k has them, pass `scripts.lint`'s checks (ruff,
  ruff format, usort, flake8 with upstream's vendored settings; mypy on the new modules among them): only
  findings the base files lack fail, exactly as `python3 -m scripts.lint` judges the whole series.
- (c) import and torch.fx's public API: with prefix k's torch first on PYTHONPATH (a hard-link overlay of
  the venv's torch/ in which every file the series touches is unlinked and rewritten as prefix k has it,
  or removed; the venv is never written to), `import torch`, `torch._dynamo`, the torch modules
  test/test_fx.py imports and every torch module the prefix adds or changes; then upstream's
  `test_public_api_surface` check (see API_PROBE). A module that imports on pristine torch (or that the
  prefix adds) must import; a public torch.fx name without `@compatibility` that pristine torch lacks
  fails.
- (d) upstream tests: the upstream test files that exist at k (the ones patches 1..k add or change) pass,
  each in its own pytest process, run from a copy of prefix k's test/ folder (no torch/ beside it), with a
  fresh Inductor cache; a probe plugin checks that each process imported prefix k's torch.
- (e) peer files: the stored peer-suite files (../shared/upstream-tests, see peer.py) most related to what
  patch k touches (PEER_MAP) run on prefix k and on pristine torch; a test that passes on pristine must
  pass at k (peer.compare).

`--quick` (CI): (a), (b), (c) for every k, and (d) only for the test files patch k adds or changes: a file
patch k adds runs whole; of a file it changes, only the tests whose code patch k adds or changes run (one
`-k` selection), unless it changes code other tests share (a helper, a test class's setUp, a module-level
statement other than an import): then the whole file runs. No (e). The full form reruns every test file at
every prefix.

The record (`--quick` only): a prefix's result depends only on its inputs, so a passing prefix k is recorded in
ci/prefix-results.json under a key over everything its check reads: patches 1..k (names and bytes),
patches/base.json, requirements*.txt, the checker (scripts/lint.py, scripts/series/*.py, ci/lint/) and the
venv's Python and tool versions. A prefix whose key is recorded is applied (its tree is needed by the next) but
not linted, probed or tested again, and says so; any change to an input reruns it, and every later prefix (their
keys include it). Each `--quick` run rewrites the record with the prefixes that passed (`--ignore-record`: check
every prefix, and still rewrite it); commit it with the patches it records.

The venv is only read. Work files: build/prefixes/ (the tree of the last prefix checked is left in
build/prefixes/tree, its torch overlay in build/prefixes/overlay, logs in build/prefixes/logs).
"""

from __future__ import annotations

import ast
import concurrent.futures
import dataclasses
import difflib
import fcntl
import fnmatch
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from . import peer
from .git import REPO_ROOT, Layout, SeriesError, blob_id, git, init_repo, isolated_env
from .install import site_packages
from .patches import Patch, final_paths, load_series, prefix_length
from .upstream import pytest_config_args, upstream_test_env, upstream_test_files

# Patch k's torch/ paths -> the peer-suite files (globs under the stored test/ folder) most related to them.
# Every rule whose prefix a touched path starts with applies. Globs that match no stored file are ignored.
AOT = ("dynamo/test_aot_autograd.py", "functorch/test_aot_joint_with_descriptors.py")
PEER_MAP: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("torch/fx/traceback.py", ("fx/test_fx_traceback*.py", "dynamo/test_fx_annotate.py")),
    ("torch/fx/", ("dynamo/test_fx_annotate.py",)),  # node meta created through the fx proxy
    ("torch/_higher_order_ops/", ("higher_order_ops/test_*.py",)),
    ("torch/_functorch/_aot_autograd/", AOT),
    ("torch/_functorch/partitioners.py", AOT),
    ("torch/_functorch/autograd_function.py", ("dynamo/test_autograd_function.py",)),
    ("torch/_dynamo/variables/invoke_subgraph.py", ("higher_order_ops/test_invoke_subgraph.py",)),
    ("torch/_dynamo/graph_deduplication.py", ("higher_order_ops/test_invoke_subgraph.py",
                                               "dynamo/test_regional_inductor.py")),
    ("torch/_dynamo/", ("dynamo/test_fx_annotate.py",)),  # node meta recorded by Dynamo
    ("torch/_inductor/", ("dynamo/test_regional_inductor.py",)),
)

# What the public-API walk imports first: the torch.fx modules upstream's test/test_fx.py imports (pytorch/pytorch
# at 05f814fecfca; its torch.testing and profiler imports load no torch.fx module the walk would miss) and
# torch._dynamo; then every torch module the prefix has touched, so a public name a patch adds anywhere under
# torch/fx is reachable from torch.fx, as it is in upstream's test process. Names that pristine torch also
# reports (it loads the same modules) are upstream's, not the series'.
API_IMPORTS = (
    "torch.fx", "torch.fx._pytree", "torch.fx.node", "torch.fx.passes", "torch.fx.passes.shape_prop",
    "torch.fx.immutable_collections", "torch.fx.experimental.rewriter", "torch.fx.operator_schemas",
    "torch.fx._compatibility", "torch.fx._symbolic_trace", "torch.fx.proxy", "torch._dynamo",
)

API_PROBE = '''\
"""rfc0051 check-prefixes: import torch and the given modules, then torch.fx's public-API check.

The check is upstream's TestFXAPIBackwardCompatibility.test_public_api_surface, with its inner
check_symbols_have_bc_designation, in pytorch/pytorch test/test_fx.py (read at commit 05f814fecfca):
every public class or function reachable from torch.fx and torch.fx.passes (torch.fx.experimental
excepted) must be marked with @torch.fx._compatibility.compatibility. Usage: probe.py SPEC_JSON OUT_JSON.
"""
import importlib
import json
import sys
import traceback
import types


def error():
    return "".join(traceback.format_exception_only(*sys.exc_info()[:2])).strip()[-1500:]


def typename(obj):
    import torch
    if hasattr(torch, "typename"):
        return torch.typename(obj)
    return f"{getattr(obj, '__module__', '')}.{getattr(obj, '__qualname__', obj.__name__)}"


def public_api_without_compatibility():
    import torch
    import torch.fx
    from torch.fx._compatibility import _MARKED_WITH_COMPATIBILITY

    non_back_compat_objects = {}

    def check_symbols_have_bc_designation(m, seen):  # upstream's, verbatim in substance
        if not m.__name__.startswith("torch.fx"):
            return
        if m.__name__.startswith("torch.fx.experimental"):
            return
        seen.add(m.__name__)
        for k, v in m.__dict__.items():
            if hasattr(v, "__name__") and v.__name__ in seen:
                continue
            if v is m:
                continue
            if k.startswith("_"):
                continue
            if isinstance(v, types.ModuleType):
                check_symbols_have_bc_designation(v, seen)
            elif isinstance(v, (type, types.FunctionType)):
                if v not in _MARKED_WITH_COMPATIBILITY:
                    non_back_compat_objects.setdefault(v)

    check_symbols_have_bc_designation(torch.fx, set())
    if isinstance(getattr(torch.fx, "passes", None), types.ModuleType):
        check_symbols_have_bc_designation(torch.fx.passes, set())
    names = [typename(obj) for obj in non_back_compat_objects]
    names = [s for s in names if s.startswith("torch.fx") and not s.startswith("torch.fx.experimental")]
    return sorted(s for s in names if all(not atom.startswith("_") for atom in s.split(".")))


def main():
    spec = json.loads(sys.argv[1])
    out = {"torch": None, "torch_error": None, "imports": {}, "api": None, "api_error": None, "flag": None}
    try:
        import torch
        out["torch"] = torch.__file__
    except BaseException:
        out["torch_error"] = error()
    if out["torch"]:
        for mod in spec["modules"]:
            try:
                importlib.import_module(mod)
                out["imports"][mod] = None
            except BaseException:
                out["imports"][mod] = error()
        try:
            out["api"] = public_api_without_compatibility()
        except BaseException:
            out["api_error"] = error()
        config = sys.modules.get("torch._dynamo.config")
        out["flag"] = getattr(config, "record_call_hierarchy", None) if config else None
    with open(sys.argv[2], "w") as fh:
        json.dump(out, fh)


if __name__ == "__main__":
    main()
'''


# --------------------------------------------------------------------------- (a) the trees


def snapshot_series(patches_dir: Path, dest: Path) -> list[Patch]:
    """Copy the series (verified against integrity.json) to dest and load it from there: a restack that
    exports new patch files during the run cannot change what is checked."""
    load_series(patches_dir)  # refuses a damaged series with the usual message before anything is copied
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    for p in list(patches_dir.glob("*.patch")) + [patches_dir / ".patches", patches_dir / "integrity.json"]:
        if p.is_file():
            shutil.copyfile(p, dest / p.name)
    try:
        return load_series(dest)
    except SeriesError as exc:
        raise SeriesError(f"patches/ changed while it was copied (a restack exporting?); rerun: {exc}") from None


def module_name(rel: str) -> str | None:
    """torch/fx/proxy.py -> torch.fx.proxy; torch/_dynamo/__init__.py -> torch._dynamo; None for non-Python."""
    if not rel.endswith(".py"):
        return None
    parts = rel.removesuffix(".py").split("/")
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts) if all(p.isidentifier() for p in parts) else None


def apply_patch(tree: Path, patch: Patch) -> str | None:
    """Apply one patch to the tree exactly; None, or what went wrong."""
    for change in patch.changes:
        if change.old_path and change.old_blob:
            f = tree / change.old_path
            have = blob_id(f.read_bytes()) if f.is_file() else None
            if have != change.old_blob:
                return (f"{change.old_path} is not the pre-image the patch was made against (blob "
                        f"{change.old_blob[:12]}; the tree has {have[:12] if have else 'no such file'}"
                        + ("; the base has only torch/ files: does the patch change an existing upstream file "
                           "outside torch/?" if not change.old_path.startswith("torch/") and not have else "")
                        + ")")
        elif change.new_path and not change.old_path and (tree / change.new_path).exists():
            return f"{change.new_path} already exists, but the patch creates it"
    proc = git(tree, "apply", "--whitespace=nowarn", str(patch.path.resolve()), check=False, env=isolated_env())
    if proc.returncode != 0:
        return f"`git apply` failed: {(proc.stderr or proc.stdout).strip()[-1500:]}"
    for change in patch.changes:
        if change.new_path and change.new_blob:
            f = tree / change.new_path
            got = blob_id(f.read_bytes()) if f.is_file() else None
            if got != change.new_blob:
                return f"{change.new_path} is not the post-image the patch records ({change.new_blob[:12]})"
    return None


def tree_contents(tree: Path, paths: list[str]) -> dict[str, bytes]:
    return {rel: (tree / rel).read_bytes() for rel in paths if (tree / rel).is_file()}


def build_prefix_overlay(sp: Path, dest: Path, paths: list[str], contents: dict[str, bytes]) -> Path:
    """dest/torch: the venv's torch/ hard-linked, every path of `paths` unlinked and rewritten with
    `contents` (removed where contents lacks it): peer.build_overlay with prefix k's bytes."""
    record = {rel: hashlib.sha256(data).hexdigest() for rel, data in contents.items()}
    return peer.build_overlay(sp, dest, paths, record, contents)


# --------------------------------------------------------------------------- (b) lint


@dataclasses.dataclass
class Linter:
    """scripts.lint's machinery (vendored upstream configs, base-relative findings) for one prefix at a time."""

    venv: Path
    work: Path
    base: dict[str, bytes]  # every .py file the series touches, as the base has it (absent: new)
    base_findings: list = dataclasses.field(default_factory=list)

    def lint_base(self, files: list[str]) -> None:
        from scripts import lint
        tree = self.work / "lint" / "base"
        shutil.rmtree(tree, ignore_errors=True)
        present = lint.write_tree(tree, files, self.base.get)
        self.base_findings, _ = lint.lint_tree(tree, present, [], self.venv)

    def check(self, k: int, series: list[Patch], contents: dict[str, bytes]) -> list[str]:
        """New findings in the .py files patch k touches (prefix k against the base), and editor leftovers."""
        from scripts import lint
        prefix = series[:k]
        files, created = lint.series_py_files(prefix)
        mine = [f for f in files if f in series[k - 1].paths()]
        tree = self.work / "lint" / f"prefix-{k}"
        shutil.rmtree(tree, ignore_errors=True)
        present = lint.write_tree(tree, mine, contents.get)
        findings, shown = lint.lint_tree(tree, present, [f for f in present if f in created], self.venv)
        base = [f for f in self.base_findings if f[0] in present]
        shutil.rmtree(tree, ignore_errors=True)
        return lint.stray_files(prefix) + lint.new_findings(base, findings, shown)


# --------------------------------------------------------------------------- (c) import and the API check


def run_api_probe(python: Path, work: Path, overlay: Path, modules: list[str], tag: str) -> dict:
    probe = work / "probe" / "rfc0051_prefix_api.py"
    out = work / "results" / f"api-{tag}.json"
    out.unlink(missing_ok=True)
    env = upstream_test_env()
    env["PYTHONPATH"] = os.pathsep.join([str(overlay), *([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])])
    run_dir = work / "run"
    run_dir.mkdir(exist_ok=True)
    proc = subprocess.run([str(python), str(probe), json.dumps({"modules": modules}), str(out)], cwd=run_dir, env=env,
                          capture_output=True, text=True)
    if not out.is_file():
        return {"torch": None, "torch_error": f"the probe process died (exit {proc.returncode}): "
                f"{(proc.stderr or proc.stdout).strip()[-1500:]}", "imports": {}, "api": None, "api_error": None}
    return json.loads(out.read_text())


def judge_api(got: dict, pristine: dict, overlay: Path, required: set[str]) -> list[str]:
    """What is wrong at prefix k, given the probe's answers there and on pristine torch."""
    if got.get("torch_error"):
        return [f"import torch failed: {got['torch_error']}"]
    want = (overlay / "torch").resolve()
    if Path(got["torch"]).resolve().parent != want:
        return [f"the probe imported torch from {got['torch']}, not from the prefix's overlay {want}"]
    out = []
    for mod, err in got["imports"].items():
        if err and (mod in required or pristine["imports"].get(mod, "absent") is None):
            out.append(f"import {mod} failed: {err}")
    if got.get("api_error") and not pristine.get("api_error"):
        out.append(f"the torch.fx public-API check could not run: {got['api_error']}")
    new = sorted(set(got.get("api") or []) - set(pristine.get("api") or []))
    if new:
        out.append(f"public torch.fx API without @compatibility (upstream test_fx.py's test_public_api_surface "
                   f"fails): {', '.join(new)}; decorate with @torch.fx._compatibility.compatibility(...)")
    return out


# --------------------------------------------------------------------------- (d) and (e): pytest runs


def test_spans(tree: ast.Module) -> list[tuple[tuple[str, ...], int, int, bool]]:
    """Every def and class as (qualified name, first line with decorators, last line, is a test function)."""
    out: list[tuple[tuple[str, ...], int, int, bool]] = []

    def walk(body: list[ast.stmt], stack: tuple[str, ...], in_class_only: bool) -> None:
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                start = min([node.lineno] + [d.lineno for d in node.decorator_list])
                name = (*stack, node.name)
                is_test = (not isinstance(node, ast.ClassDef)) and in_class_only and node.name.startswith("test")
                out.append((name, start, node.end_lineno or node.lineno, is_test))
                walk(node.body, name, in_class_only and isinstance(node, ast.ClassDef))
    walk(tree.body, (), True)
    return out


def bound_names(node: ast.stmt) -> set[str]:
    """The module-level names a statement binds."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return {node.name}
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        return {(a.asname or a.name).split(".")[0] for a in node.names}
    targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
        node, (ast.AnnAssign, ast.AugAssign)) else []
    return {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}


def changed_tests(pre: str | None, post: str) -> list[tuple[str, ...]] | None:
    """The tests (qualified names) whose code changes from pre to post, or None when the whole file must run:
    a new file, or a change to code that tests may share (a helper or module-level name that both versions
    have, a test class's own code). New helpers, classes and module-level names, imports, the module's
    docstring, comments and blank lines are not shared: no test of pre can use what pre lacks."""
    if pre is None:
        return None
    try:
        trees = ast.parse(pre), ast.parse(post)
    except SyntaxError:
        return None
    spans = [test_spans(t) for t in trees]
    names = [{s[0] for s in side} for side in spans]
    module_names = [set().union(*(bound_names(n) for n in t.body)) for t in trees]
    tops = [[(min([n.lineno] + [d.lineno for d in getattr(n, "decorator_list", [])]), n.end_lineno or n.lineno, n)
             for n in t.body] for t in trees]
    lines = pre.splitlines(), post.splitlines()
    selected: set[tuple[str, ...]] = set()

    def classify(side: int, line: int) -> bool:
        """Select what the changed line belongs to; False when it is shared code."""
        text = lines[side][line - 1].strip() if line <= len(lines[side]) else ""
        top = next((n for a, b, n in tops[side] if a <= line <= b), None)
        if not text or text.startswith("#") or top is None or isinstance(top, (ast.Import, ast.ImportFrom)):
            return True
        if top is trees[side].body[0] and isinstance(top, ast.Expr) and isinstance(getattr(top, "value", None),
                                                                                   ast.Constant):
            return True  # the module docstring
        inner = [s for s in spans[side] if s[1] <= line <= s[2]]
        test = next((s for s in inner if s[3]), None)
        if test is not None:
            if test[0] in names[1]:
                selected.add(test[0])
            return True  # a deleted test changes nothing else
        if side == 0:
            return False
        if inner:
            return max(inner, key=lambda s: s[1])[0] not in names[0]  # a new helper or class
        bound = bound_names(top)
        return bool(bound) and not bound & module_names[0]  # a new module-level name

    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(None, lines[0], lines[1], autojunk=False).get_opcodes():
        if tag == "equal":
            continue
        if not all(classify(0, n) for n in range(i1 + 1, i2 + 1)) or not all(
                classify(1, n) for n in range(j1 + 1, j2 + 1)):
            return None
    return sorted(selected)


def keyword_expr(tests: list[tuple[str, ...]]) -> str:
    return " or ".join("(" + " and ".join(t) + ")" if len(t) > 1 else t[0] for t in tests)


@dataclasses.dataclass
class PytestRun:
    rc: int
    outcomes: dict[str, str]
    log: Path


class Runner:
    """One pytest process per test file, with a torch overlay first on PYTHONPATH, checked by peer's probe plugin."""

    def __init__(self, python: Path, work: Path) -> None:
        self.python, self.work = python, work

    def run(self, f: str, cwd: Path, overlay: Path, tag: str, peer_env: bool, extra: list[str]) -> PytestRun:
        stem = f"{tag}-{f.removesuffix('.py').replace('/', '.')}"
        xml, probe_out = self.work / "results" / f"{stem}.xml", self.work / "results" / f"{stem}.probe.json"
        log = self.work / "logs" / f"{stem}.log"
        for p in (xml, probe_out):
            p.unlink(missing_ok=True)
        with tempfile.TemporaryDirectory(prefix="prefixes-inductor-") as cache:
            if peer_env:  # the peer suite's environment: caches off, OMP_NUM_THREADS=1
                env = peer.config_env("pristine", self.work, overlay, Path(cache))
            else:  # as `upstream-tests` runs them (their cache tests need Inductor's caches on), a fresh cache
                env = upstream_test_env()
                env["PYTHONPATH"] = os.pathsep.join([str(overlay), str(self.work / "probe"),
                                                     *([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])])
                env["TORCHINDUCTOR_CACHE_DIR"] = cache
            env["RFC0051_PEER_PROBE_OUT"] = str(probe_out)
            cmd = [str(self.python), "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", peer.PROBE_PLUGIN,
                   *pytest_config_args(cwd), f"--junitxml={xml}", f, *extra]
            with open(log, "w") as fh:
                fh.write(f"=== cd {cwd} && PYTHONPATH={env['PYTHONPATH']} {' '.join(cmd)}\n")
                fh.flush()
                rc = subprocess.run(cmd, cwd=cwd, env=env, stdout=fh, stderr=subprocess.STDOUT).returncode
        if not probe_out.exists():  # it died before its session started (e.g. torch does not import)
            return PytestRun(rc or 1, {f"{f}::<session>": "error"}, log)
        probe = json.loads(probe_out.read_text())
        if Path(probe.get("torch", "")).resolve().parent != (overlay / "torch").resolve() or probe.get("flag") is True:
            raise SeriesError(f"the pytest process of {f} ({tag}) imported torch from {probe.get('torch')} with "
                              f"record_call_hierarchy={probe.get('flag')!r}; expected {overlay / 'torch'} with the flag "
                              "at its default")
        outcomes = peer.parse_junit(xml, [f]) if xml.exists() else {f"{f}::<session>": "error"}
        return PytestRun(rc, outcomes, log)


def peer_files(paths: list[str], stored: list[str]) -> list[str]:
    """The stored peer files PEER_MAP relates to these torch paths, in stored order."""
    globs = [g for rel in paths for prefix, gs in PEER_MAP if rel.startswith(prefix) for g in gs]
    return [f for f in stored if any(fnmatch.fnmatch(f, g) for g in globs)]


# --------------------------------------------------------------------------- the record of passing prefixes

RECORD = Path("ci") / "prefix-results.json"  # relative to the repository root
# The venv's packages a prefix's check runs (its lint tools, torch and the test runner), with the Python version.
RECORD_PACKAGES = ("torch", "pytest", "expecttest", "ruff", "usort", "flake8", "mypy", "numpy")


def checker_files() -> list[Path]:
    """The code and settings of the check itself: scripts/lint.py, scripts/series/*.py and ci/lint/."""
    lint_dir = REPO_ROOT / "ci" / "lint"
    return sorted([REPO_ROOT / "scripts" / "lint.py", *(REPO_ROOT / "scripts" / "series").glob("*.py"),
                   *(p for p in lint_dir.rglob("*") if p.is_file() and "__pycache__" not in p.parts)])


def prefix_keys(layout: Layout, series: list[Patch], env: dict[str, str]) -> list[str]:
    """keys[k-1]: the sha256 of everything prefix k's quick check reads (see the module docstring)."""
    h = hashlib.sha256(b"check-prefixes --quick\n")
    h.update(json.dumps(env, sort_keys=True).encode())
    for path in [layout.patches / "base.json", layout.root / "requirements.txt",
                 layout.root / "requirements-nodeps.txt", *checker_files()]:
        h.update(f"\n{path.name}\n".encode() + (path.read_bytes() if path.is_file() else b"<absent>"))
    keys = []
    for patch in series:
        h.update(f"\npatch {patch.name}\n".encode() + patch.path.read_bytes())
        keys.append(h.copy().hexdigest())
    return keys


def load_record(path: Path) -> dict[str, str]:
    """patch name -> key of the passing prefixes recorded in `path` ({} where there is none or it is unreadable:
    every prefix is then checked)."""
    try:
        data = json.loads(path.read_text())
        return {str(k): str(v) for k, v in data["passed"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}


def write_record(path: Path, passed: dict[str, str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {"about": "Prefixes of the series that passed `python3 -m scripts.series check-prefixes --quick`: patch "
                     "name -> the key of prefix 1..k's inputs (scripts/series/prefixes.py). A recorded key is not "
                     "checked again.", "passed": passed}
    with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=".prefix-results.", delete=False) as fh:
        json.dump(data, fh, indent=1)
        fh.write("\n")
    os.replace(fh.name, path)


# --------------------------------------------------------------------------- the command


def check_prefixes(layout: Layout, through: str | None = None, quick: bool = False, venv: Path | None = None,
                   tests_from: Path | None = None, keep_going: bool = False, ignore_record: bool = False) -> int:
    start = time.monotonic()
    layout.base()  # a missing or damaged base.json is refused first
    names_series = load_series(layout.patches)
    if not names_series:
        raise SeriesError(f"{layout.patches / '.patches'} lists no patches: there is no prefix to check")
    n = prefix_length(names_series, through)
    venv = venv or layout.venv
    python = Path(os.path.abspath(venv / "bin" / "python"))
    if not python.exists():
        raise SeriesError(f"{python} does not exist; run `python3 -m scripts.series setup`")
    sp = site_packages(venv)
    stored: list[str] = []
    peer_root: Path | None = None
    peer_skipped = ""
    if not quick:
        try:
            peer_root = (tests_from or peer.default_tests_from(layout.root)).resolve()
            stored = peer.select_files(peer_root, [])
        except peer.NoStoredTests as exc:
            peer_skipped = str(exc)
    work = layout.root / "build" / "prefixes"
    work.mkdir(parents=True, exist_ok=True)
    with open(work / ".lock", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            raise SeriesError(f"another check-prefixes run holds {work}; wait for it to finish") from None
        rc = run_locked(layout, sp, python, work, n, quick, peer_root, stored, keep_going, ignore_record)
    form = ("quick form: (a) apply, (b) lint, (c) import + torch.fx API, (d) the tests each patch adds or changes"
            if quick else "full form: (a)-(e)")
    print(f"check-prefixes ({form}): {time.monotonic() - start:.0f} s wall", flush=True)
    if rc == 0 and peer_skipped:
        print(f"!!!!! (e) PEER FILES SKIPPED: {peer_skipped} !!!!!")
        return 3
    return rc


def run_locked(layout: Layout, sp: Path, python: Path, work: Path, n: int, quick: bool, peer_root: Path | None,
               stored: list[str], keep_going: bool = False, ignore_record: bool = False) -> int:
    series = snapshot_series(layout.patches, work / "series")
    # --quick: the prefixes whose inputs are recorded as passing are applied, not checked again
    keys = prefix_keys(layout, series, peer.environment_key(python, RECORD_PACKAGES)) if quick else []
    recorded = {} if ignore_record or not quick else load_record(layout.root / RECORD)
    matching = [k for k in range(1, len(keys) + 1) if recorded.get(series[k - 1].name) == keys[k - 1]]
    known = [k for k in matching if k <= n]
    passed = {series[k - 1].name: keys[k - 1] for k in matching}  # a --through run keeps the later ones
    for sub in ("results", "logs", "probe"):
        shutil.rmtree(work / sub, ignore_errors=True)
        (work / sub).mkdir(parents=True)
    (work / "probe" / "rfc0051_prefix_api.py").write_text(API_PROBE)
    (work / "probe" / f"{peer.PROBE_PLUGIN}.py").write_text(peer.PROBE)
    print(f"check-prefixes: prefixes 1..{n} of {len(series)} patch(es) on the pristine torch "
          f"{layout.base()['torch_version']} of {sp.parent.parent.parent}" + (" (--quick)" if quick else ""), flush=True)

    # the pristine base: the wheel's version of every torch/ file the series (or the venv's stamp) touches
    pristine, paths, _ = peer.pristine_overlay(layout, sp, series, work / "pristine")
    tree = work / "tree"
    shutil.rmtree(tree, ignore_errors=True)
    init_repo(tree)
    base = tree_contents(pristine, paths)
    for rel, data in base.items():
        (tree / rel).parent.mkdir(parents=True, exist_ok=True)
        (tree / rel).write_bytes(data)
    from scripts import lint
    linter = Linter(python.parent.parent, work, {rel: data for rel, data in base.items() if rel.endswith(".py")})
    all_modules = [m for rel in paths if (m := module_name(rel))]
    api_modules = list(dict.fromkeys([*API_IMPORTS, *all_modules]))
    pristine_api: dict = {}
    if len(known) < n:  # some prefix is checked: the base's lint findings and pristine's API to compare with
        with concurrent.futures.ThreadPoolExecutor(2) as pool:  # lint's tools and the probe are subprocesses
            base_lint = pool.submit(linter.lint_base, lint.series_py_files(series[:n])[0])
            pristine_api = run_api_probe(python, work, pristine, api_modules, "pristine")
            base_lint.result()
        if pristine_api.get("torch_error"):
            raise SeriesError(f"pristine torch ({pristine}) does not import: {pristine_api['torch_error']}")
    runner = Runner(python, work)
    pristine_peer: dict[str, dict[str, str]] = {}
    overlay = work / "overlay"
    tests_dir = work / "tests"
    failures: list[tuple[int, Patch, list[str]]] = []
    for k in range(1, n + 1):
        t0 = time.monotonic()
        patch = series[k - 1]
        label = f"prefix {k}/{len(series)} ({patch.name})"
        before = {rel: (tree / rel).read_text(errors="replace") if (tree / rel).is_file() else None
                  for rel in patch.paths("test/")}
        if (err := apply_patch(tree, patch)) is not None:  # no later prefix can be built
            return report([*failures, (k, patch, [f"(a) does not apply to prefix {k - 1}: {err}"])])
        if k in known:
            print(f"  {label}: ok; recorded as passing in {RECORD} (key {keys[k - 1][:12]}: same patches 1..{k}, "
                  "checker and tools); applied, not checked again", flush=True)
            continue
        contents = tree_contents(tree, paths)
        build_prefix_overlay(sp, overlay, paths, contents)
        problems: list[str] = []
        notes: list[str] = []
        lap = Lap()
        # (b) and (c), side by side (2 cores: lint's tools and the import probe are subprocesses)
        py_contents = tree_contents(tree, [p for p in final_paths(series[:k])[0] if p.endswith(".py")])
        mods = [m for rel in paths if rel in contents and (m := module_name(rel))]
        required = {m for rel in final_paths(series[:k])[0] if rel in contents and (m := module_name(rel))}
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            linted = pool.submit(linter.check, k, series, py_contents)
            got = run_api_probe(python, work, overlay, list(dict.fromkeys([*API_IMPORTS, *mods])), f"prefix-{k}")
            problems += [f"(b) lint: {t}" for t in linted.result()]
        api_problems = judge_api(got, pristine_api, overlay, required)
        problems += [f"(c) {t}" for t in api_problems]
        notes.append(f"lint {len([p for p in patch.paths() if p.endswith('.py') and p in py_contents])} file(s), "
                     f"import + torch.fx API {'ok' if not api_problems else 'FAILED'}" + lap())
        if got.get("torch_error"):  # nothing else can run at this prefix
            print(f"  {label}: FAILED; " + "; ".join(notes), flush=True)
            failures.append((k, patch, problems))
            if keep_going:
                continue
            return report(failures)
        # (d)
        shutil.rmtree(tests_dir, ignore_errors=True)
        if (tree / "test").is_dir():
            shutil.copytree(tree / "test", tests_dir / "test")
        existing = upstream_test_files(series[:k])
        files = [f for f in existing if f in patch.paths()] if quick else existing
        ran = []
        for f in files:
            extra: list[str] = []
            if quick:
                sel = changed_tests(before.get(f), (tree / f).read_text(errors="replace"))
                if sel is not None:
                    extra = ["-k", keyword_expr(sel)] if sel else ["--collect-only"]
            rel = str(Path(f).relative_to("test"))
            r = runner.run(rel, tests_dir / "test", overlay, f"prefix-{k}", False, extra)
            if r.rc == 5 and extra and extra[0] == "-k":  # nothing selected (e.g. generated names): run it all
                r = runner.run(rel, tests_dir / "test", overlay, f"prefix-{k}", False, [])
            ran.append(f"{rel}" + (" (collect only)" if extra == ["--collect-only"] else
                                   f" ({len(r.outcomes)} selected)" if extra else ""))
            if r.rc != 0:
                bad = [t for t, o in r.outcomes.items() if o in ("failed", "error")]
                problems.append(f"(d) upstream test file {f} fails at prefix {k} (pytest exit {r.rc}): "
                                + (", ".join(bad[:10]) + (f" and {len(bad) - 10} more" if len(bad) > 10 else "")
                                   if bad else "see the log") + f"; log {r.log}")
        notes.append(f"tests: {', '.join(ran) or 'none'}" + lap())
        # (e)
        if not quick and peer_root is not None:
            mine = peer_files(patch.paths("torch/"), stored)
            for f in mine:
                if f not in pristine_peer:
                    pristine_peer[f] = runner.run(f, peer_root / "test", pristine, "pristine", True, []).outcomes
                got_peer = runner.run(f, peer_root / "test", overlay, f"prefix-{k}", True, []).outcomes
                verdict = peer.compare({"pristine": pristine_peer[f], f"prefix {k}": got_peer})
                for tid, seen in verdict.regressions.items():
                    problems.append(f"(e) peer test {tid} passes on pristine torch but is {seen[f'prefix {k}']} at "
                                    f"prefix {k}")
            notes.append(f"peer: {', '.join(mine) or 'none mapped'}" + lap())
        print(f"  {label}: {'ok' if not problems else 'FAILED'}; " + "; ".join(notes)
              + f"; {time.monotonic() - t0:.0f} s in all", flush=True)
        if quick:
            if problems:
                passed.pop(patch.name, None)
            else:
                passed[patch.name] = keys[k - 1]
            write_record(layout.root / RECORD, passed)
        if problems:
            failures.append((k, patch, problems))
            if not keep_going:
                return report(failures)
    if failures:
        return report(failures)
    print(f"all {n} prefix(es) pass" + (f" (of {len(series)})" if n < len(series) else ""))
    return 0


class Lap:
    """` (N s)`: the seconds since the last call."""

    def __init__(self) -> None:
        self.t = time.monotonic()

    def __call__(self) -> str:
        t, self.t = self.t, time.monotonic()
        return f" ({self.t - t:.0f} s)"


CHECKS = {"(a)": "(a) apply", "(b)": "(b) lint", "(c)": "(c) import / torch.fx public API",
          "(d)": "(d) upstream tests", "(e)": "(e) peer files"}


def report(failures: list[tuple[int, Patch, list[str]]]) -> int:
    """Print every problem of the failing prefixes, then one line naming the first and the checks that failed
    there; exit status 1."""
    for k, patch, problems in failures:
        print(f"prefix {k} ({patch.name}) FAILS:", file=sys.stderr)
        for p in problems:
            print(f"  {p}", file=sys.stderr)
    k, patch, problems = failures[0]
    also = f" (also failing: prefixes {', '.join(str(f[0]) for f in failures[1:])})" if failures[1:] else ""
    failed = list(dict.fromkeys(CHECKS.get(p[:3], p[:3]) for p in problems))
    first = problems[0].replace("\n", " ")
    print(f"error: the first failing prefix is {k} ({patch.name}): {', '.join(failed)} failed; first: "
          f"{first[:300]}{'...' if len(first) > 300 else ''} (its tree: build/prefixes/tree, its torch: "
          f"build/prefixes/overlay){also}", file=sys.stderr)
    return 1
