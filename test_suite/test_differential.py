"""Differential test: the call_hierarchy patches never change what torch.compile compiles (issue 12).

Three builds of the pinned torch (``patches/base.json``) compile the same corpus
(``test_suite/differential_probe.py``: tiny Qwen2 inference and training, graph breaks default and
nested with a polymorphic call site, a custom ``autograd.Function`` and in-place ops trained through
AOTAutograd, ``torch.cond`` and activation checkpointing, trained ``cond``, ``map`` and ``scan``
bodies, strict export), each in its own process:

* (a) ``fixes``: the flag-free fixes only, the longest prefix of ``patches/.patches`` whose patches do
  not mention ``call_hierarchy`` in their diffs, installed into ``build/venv-fixes`` by
  ``python3 -m scripts.series setup --venv build/venv-fixes --through NNNN``;
* (b) ``off``: the whole series (``.venv``), ``torch._dynamo.config.record_call_hierarchy = False``;
* (c) ``on``: the whole series, the flag on.

Dynamo graph code, AOTAutograd forward/backward/inference graph code, node meta other than the
call_hierarchy keys, FX graph cache keys, the transformed bytecode and guard tree of every cache
entry (resume functions included), the generated resume functions and the counts of graphs,
cache entries and recompiles must be equal: (a) = (b) = (c).  Otherwise the test fails naming the
program, the artifact and a short unified diff.
"""

from __future__ import annotations

import concurrent.futures
import difflib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from scripts import series as S

REPO_ROOT = Path(__file__).resolve().parent.parent
FIXES_VENV = REPO_ROOT / "build" / "venv-fixes"
OUT_DIR = REPO_ROOT / "build" / "differential"
DIFF_LINES = 40  # per differing artifact in the failure message
FULL_REPORTS = 25  # differing artifacts shown with their diff; the rest by name


def mentions_call_hierarchy(patch: S.Patch) -> bool:
    """Whether the patch's diff (its torch/ code, tests and docs) mentions call_hierarchy.  The
    commit message is not read: a fix may say what found it; its code and tests may not."""
    text = patch.path.read_text()
    return "call_hierarchy" in text[text.find("\ndiff --git "):]


def fixes_prefix(series: list[S.Patch]) -> list[S.Patch]:
    """The longest prefix of the series whose patches do not mention call_hierarchy."""
    prefix = []
    for patch in series:
        if mentions_call_hierarchy(patch):
            break
        prefix.append(patch)
    return prefix


def test_series_is_fixes_then_call_hierarchy() -> None:
    """Structural: the flag-free fixes come first, and every later patch is a call_hierarchy patch."""
    series = S.load_series(REPO_ROOT / "patches")
    fixes = fixes_prefix(series)
    assert fixes, f"the series does not start with a flag-free fix: {series[0].name} mentions call_hierarchy"
    late = [p.name for p in series[len(fixes):] if not mentions_call_hierarchy(p)]
    assert not late, ("flag-free patches after the first call_hierarchy patch "
                      f"({series[len(fixes)].name}); move them to the bottom of the series: {', '.join(late)}")


def run(cmd: list[str], what: str) -> None:
    proc = subprocess.run(cmd, check=False, cwd=REPO_ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        raise AssertionError(f"{what} failed (exit {proc.returncode}): {' '.join(cmd)}\n"
                             f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")


def probe(python: Path, flag: str) -> dict[str, dict[str, str]]:
    out = OUT_DIR / f"{flag}.json"
    out.unlink(missing_ok=True)
    env_cmd = [str(python), "-m", "test_suite.differential_probe", "--flag", flag, "--out", str(out)]
    run(env_cmd, f"the differential probe with --flag {flag}")
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def builds() -> dict[str, dict[str, dict[str, str]]]:
    series = S.load_series(REPO_ROOT / "patches")
    fixes = fixes_prefix(series)
    if not fixes:
        pytest.fail("no flag-free fix at the bottom of the series (see test_series_is_fixes_then_call_hierarchy)")
    # setup is idempotent: it reuses build/venv-fixes when its requirements and series prefix are current.
    run([sys.executable, "-m", "scripts.series", "setup", "--venv", str(FIXES_VENV),
         "--through", fixes[-1].name], "setup of the fixes-only venv")
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    venv = REPO_ROOT / ".venv" / "bin" / "python"
    jobs = {"fixes": (FIXES_VENV / "bin" / "python", "absent"), "off": (venv, "off"), "on": (venv, "on")}
    # Each process spends much of its time in single-threaded Python (tracing): side by side they
    # take about 40% less wall time than one after the other, even on 2 cores.
    with concurrent.futures.ThreadPoolExecutor(max_workers=len(jobs)) as pool:
        futures = {name: pool.submit(probe, python, flag) for name, (python, flag) in jobs.items()}
        return {name: f.result() for name, f in futures.items()}


def differences(left_name: str, left: dict[str, dict[str, str]], right_name: str,
                right: dict[str, dict[str, str]]) -> list[str]:
    """One report per (program, artifact) that differs, with a short unified diff."""
    reports = []
    for program in sorted(set(left) | set(right)):
        if program not in left or program not in right:
            reports.append(f"{program}: only in {left_name if program in left else right_name}")
            continue
        a, b = left[program], right[program]
        for artifact in sorted(set(a) | set(b)):
            if artifact not in a or artifact not in b:
                reports.append(f"{program} / {artifact}: only in {left_name if artifact in a else right_name}")
            elif a[artifact] != b[artifact]:
                diff = list(difflib.unified_diff(a[artifact].splitlines(), b[artifact].splitlines(),
                                                 left_name, right_name, n=1, lineterm=""))
                more = f"\n    ... ({len(diff) - DIFF_LINES} more diff lines)" if len(diff) > DIFF_LINES else ""
                reports.append(f"{program} / {artifact}:\n    " + "\n    ".join(diff[:DIFF_LINES]) + more)
    return reports


@pytest.mark.parametrize(("left", "right"), [("fixes", "off"), ("off", "on")],
                         ids=["fixes-only_vs_flag-off", "flag-off_vs_flag-on"])
def test_compiles_the_same(builds: dict[str, dict[str, dict[str, str]]], left: str, right: str) -> None:
    reports = differences(left, builds[left], right, builds[right])
    shown = reports[:FULL_REPORTS] + [r.split("\n", 1)[0] + " (diff not shown)" for r in reports[FULL_REPORTS:]]
    if reports:
        pytest.fail(f"{left} and {right} compile differently in {len(reports)} artifact(s) "
                    f"(all outputs in {OUT_DIR.relative_to(REPO_ROOT)}/):\n" + "\n".join(shown), pytrace=False)


def test_normalization_keeps_identities() -> None:
    """Process-global counters and addresses are renumbered, but which name is which is kept."""
    from test_suite.differential_probe import Normalizer

    def norm(text: str) -> str:
        return Normalizer([])(text)

    uuid = "b3f8c315_b17a_439c_8020_c71c25d912ae"
    assert (norm(f"__compiled_fn_12_{uuid} at 0x7f00aa; __resume_at_30_13 id 140185255909456")
            == norm(f"__compiled_fn_3_{uuid.replace('b', 'c')} at 0x7f00bb; __resume_at_30_4 id 139812446083632"))
    assert norm("__compiled_fn_1 __compiled_fn_1") != norm("__compiled_fn_1 __compiled_fn_2")
    assert norm("G['_140185255909456_c0'] 140185255909456") != norm("G['_140185255909456_c0'] 140185255909999")
    assert norm("seq_nr 12") != norm("seq_nr 13")  # small integers are values, not ids


def test_differences_name_program_artifact_and_diff() -> None:
    left = {"p": {"dynamo graph 0: code": "a\nb\n", "counts": "graphs: 3"}}
    right = {"p": {"dynamo graph 0: code": "a\nb\n", "counts": "graphs: 4", "dynamo graph 3: code": "x"},
             "q": {}}
    reports = differences("off", left, "on", right)
    assert reports[0] == "p / counts:\n    --- off\n    +++ on\n    @@ -1 +1 @@\n    -graphs: 3\n    +graphs: 4"
    assert reports[1:] == ["p / dynamo graph 3: code: only in on", "q: only in on"]
    assert differences("off", left, "on", left) == []


def test_cache_entry_without_code_is_recorded(monkeypatch: pytest.MonkeyPatch) -> None:
    """A cache entry whose code is None (a frame Dynamo runs as it is for those guards, as a trained
    T5 recompiled at a second sequence length has) is an artifact too, not a crash of the probe."""
    import types

    from test_suite import differential_probe as probe

    def listed() -> None:
        pass

    entry = types.SimpleNamespace(code=None, guard_manager="TREE_GUARD_MANAGER")
    monkeypatch.setattr(probe, "_debug_get_cache_entry_list", lambda code: [entry])
    rec = probe.Recorder()
    rec.codes.append(listed.__code__)
    rec.record_cache_entries()
    label = f"{listed.__code__.co_qualname}@{listed.__code__.co_firstlineno}"
    assert rec.artifacts[f"cache entry {label} #0: bytecode"] == "(no code: the frame runs as it is)"
    assert rec.artifacts[f"cache entry {label} #0: guards"] == "TREE_GUARD_MANAGER"

