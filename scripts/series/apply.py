"""`apply`: put the series onto a PyTorch checkout with `git am --3way`, after verifying the series
and that the checkout is a PyTorch checkout at or near the base; every refusal happens before
`git am` and leaves the checkout as it was. The commits are the applier's: authored and committed as
their git identity in the checkout (or `--author`), dated when they are applied."""

from __future__ import annotations

import re
import subprocess
import tempfile
from pathlib import Path

from .git import (
    BOT, Layout, SeriesConflict, SeriesError, configured_identity, git, git_dir, isolated_env, operation_in_progress,
    parse_identity, user_env,
)
from .patches import PLACEHOLDER_RES, Patch, load_series, normalize_message, with_author

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


def run_am(repo: Path, series: list[Patch], env: dict[str, str], total: int,
           author: tuple[str, str] | None = None) -> None:
    """`git am --3way` the series onto repo, each commit authored by author (name, email; default: the
    workbench's neutral BOT) and dated now: the patch files carry no author or date (an older file's
    are replaced), so each is handed to `git am` as a mail from author."""
    name, email = author or (BOT["name"], BOT["email"])
    with tempfile.TemporaryDirectory(prefix="series-am-") as tmp:
        mails = []
        for i, patch in enumerate(series):
            mail = Path(tmp) / f"{i:04d}-{patch.name}"
            mail.write_bytes(with_author(patch.path.read_bytes(), name, email))
            mails.append(str(mail))
        proc = git(repo, "am", "--3way", "--keep-non-patch", *mails, check=False, env=env)
    if proc.returncode != 0:
        raise SeriesConflict(am_failure_report(repo, series, proc.stderr + proc.stdout, total))


def history_ids(repo: Path, rev_args: list[str]) -> tuple[set[str], set[tuple[str, str]]]:
    """patch-ids and (subject, message body) of the commits in rev_args."""
    log = git(repo, "-c", "diff.noprefix=false", "-c", "diff.mnemonicPrefix=false", "log", "-p", "--no-renames",
              "--no-merges", "--no-color", "--no-ext-diff", "--no-textconv", *rev_args).stdout
    pid = git(repo, "patch-id", "--stable", stdin=log).stdout
    ids = {line.split()[0] for line in pid.splitlines() if line.strip()}
    meta = git(repo, "log", "--no-merges", "--format=%s%x00%b%x01", *rev_args).stdout
    keys = {(s.strip(), normalize_message(b)) for s, b in (rec.split("\0", 1) for rec in meta.split("\x01")
                                                            if "\0" in rec)}
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
    present = [patch_id(p) in ids or (p.subject, p.message) in keys for p in series]
    k = present.index(False) if False in present else len(present)
    if any(present[k:]):
        found = ", ".join(p.name for p, yes in zip(series, present) if yes)
        raise SeriesError(f"{repo} already has some patches of the series but not as a leading run ({found}); "
                          "apply the missing ones by hand (`git apply --3way PATCH`, then `git commit`), or "
                          "reset the checkout to the base and run `apply` again")
    return k


def version_at_head(repo: Path) -> str | None:
    """The PyTorch version that HEAD's tree names (version.txt, or torch/version.py where tracked)."""
    for path, pattern in (("version.txt", r"^\s*(\d+\.\d+)"), ("torch/version.py", r"__version__\s*=\s*['\"](\d+\.\d+)")):
        proc = git(repo, "show", f"HEAD:{path}", check=False)
        if proc.returncode == 0 and (m := re.search(pattern, proc.stdout, re.M)):
            return m.group(1)
    return None


def check_target(repo: Path, series: list[Patch], upstream: str, torch_version: str) -> None:
    """Refuse a checkout that is not PyTorch at or near the base (before anything is changed)."""
    if git(repo, "rev-parse", "--verify", "--quiet", "HEAD^{commit}", check=False).returncode != 0:
        raise SeriesError(f"{repo} has no commits; it is not a PyTorch checkout. Clone PyTorch and check out the base: "
                          f"git clone https://github.com/pytorch/pytorch && git -C pytorch checkout {upstream}")
    tree = set(git(repo, "ls-tree", "-r", "--name-only", "HEAD").stdout.splitlines())
    created: set[str] = set()
    missing: list[str] = []
    for patch in series:
        for c in patch.changes:
            if c.old_path and c.old_path not in tree and c.old_path not in created and c.old_path not in missing:
                missing.append(c.old_path)
            if c.new_path:
                created.add(c.new_path)
    has_base = git(repo, "merge-base", "--is-ancestor", upstream, "HEAD", check=False).returncode == 0
    version = version_at_head(repo)
    near = has_base or (version is not None and version == ".".join(torch_version.split(".")[:2]))
    if missing or not near:
        why = []
        if missing:
            why.append(f"HEAD lacks {len(missing)} file(s) the series changes: {', '.join(missing[:8])}"
                       + (" ..." if len(missing) > 8 else ""))
        if not near:
            why.append(f"HEAD does not contain the base commit {upstream[:12]} and its version.txt names "
                       f"{version or 'no version'}, not {torch_version}")
        raise SeriesError(f"{repo} is not a PyTorch checkout at or near the base of the series (torch {torch_version}, "
                          f"commit {upstream[:12]}): " + "; ".join(why) + f". Nothing was changed. Check out the "
                          f"base first: git -C {repo} fetch origin {upstream} && git -C {repo} checkout -b rfc0051 {upstream}")


def applier(repo: Path, author: str | None) -> tuple[str, str]:
    """Whom the commits are from: --author, else the git identity configured in repo (one-line error)."""
    if author is not None:
        return parse_identity(author)
    found = configured_identity(repo)
    if found is None:
        raise SeriesError(f"no git identity in {repo} to write the commits as; set yours: git -C {repo} config "
                          f"user.name 'Your Name' && git -C {repo} config user.email you@your.domain (or pass "
                          "--author 'Your Name <you@your.domain>'). Nothing was changed.")
    return found


def apply_to_checkout(layout: Layout, checkout: Path, author: str | None = None) -> int:
    checkout = checkout.resolve()
    if author is not None:
        parse_identity(author)  # a malformed --author is refused before anything else
    if not checkout.is_dir() or git(checkout, "rev-parse", "--git-dir", check=False).returncode != 0:
        raise SeriesError(f"{checkout} is not a git checkout")
    repo = Path(git(checkout, "rev-parse", "--show-toplevel").stdout.strip())
    series = load_series(layout.patches)
    if (op := operation_in_progress(repo)):
        raise SeriesError(f"{repo}: {op}; finish it (`git am --continue`) or abort it (`git am --abort`) first")
    if not series:
        print("the series is empty; nothing to apply")
        return 0
    base = layout.base()
    upstream = base["commit"]
    check_target(repo, series, upstream, base["torch_version"])
    dirty = git(repo, "status", "--porcelain", "--untracked-files=no").stdout.strip()
    if dirty:
        raise SeriesError(f"{repo} has uncommitted changes to tracked files; commit or stash them first:\n  "
                          + dirty.replace("\n", "\n  "))
    done = applied_prefix(repo, series, upstream)
    if done == len(series):
        print(f"{repo} already has all {len(series)} patch(es) of the series; nothing to do")
        return 0
    name, email = applier(repo, author)
    if done:
        print(f"{repo} already has the first {done} patch(es); applying the remaining {len(series) - done}")
    if git(repo, "merge-base", "--is-ancestor", upstream, "HEAD", check=False).returncode != 0:
        print(f"note: HEAD of {repo} does not contain the base commit {upstream[:12]}; relying on 3-way merges")
    if any(rx.search(f"{name} <{email}>") for rx in PLACEHOLDER_RES):
        print(f"note: {name} <{email}> looks like a placeholder identity; a CLA check will refuse commits by it "
              f"(pass --author, or set user.name and user.email in {repo})")
    head = git(repo, "rev-parse", "HEAD").stdout.strip()
    run_am(repo, series[done:], user_env(repo, (name, email)), len(series), (name, email))
    print(f"applied {len(series) - done} patch(es) to {repo} on top of {head[:12]} as {name} <{email}> "
          f"(to undo: git -C {repo} reset --keep {head[:12]})")
    return 0
