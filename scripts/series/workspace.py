"""`workspace` (import the series into build/workspace: base commit + one commit per patch) and
`export` (regenerate patches/ and patches/integrity.json from it, byte-stable, with no author or date:
whoever committed in the workspace, the files are the same and name no one)."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from .apply import run_am
from .git import (
    BOT, Layout, SeriesError, commit_all, configured_identity, extract_wheel_sources, find_wheel, git, init_repo,
    isolated_env, operation_in_progress,
)
from .patches import (
    INTEGRITY, identity_problems, load_series, message_problems, series_names, strip_identity, verify_postimages,
    write_integrity,
)

FORMAT_PATCH_FLAGS = [
    "--zero-commit", "--no-signature", "--full-index", "--no-stat", "--no-numbered",
    "--no-renames", "--no-thread", "--no-cover-letter", "--no-color", "--encode-email-headers",
]


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
                    force: bool = False, accept_patches: bool = False) -> Path:
    """Import the series into build/workspace. The patch files must match patches/integrity.json, unless
    accept_patches: then they are imported as they are (each must still apply and give the blobs its
    `index` lines promise), and the next `export` records them."""
    ws, base = layout.workspace, layout.base()
    series = load_series(layout.patches, verify=not accept_patches)
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
        # the patch commits are the user's (their git identity, else the neutral BOT); never exported
        name, email = configured_identity(ws) or (BOT["name"], BOT["email"])
        run_am(ws, series, dict(isolated_env(), GIT_COMMITTER_NAME=name, GIT_COMMITTER_EMAIL=email), len(series),
               (name, email))
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
    paths = [Path(line) for line in proc.stdout.splitlines() if line.strip()]
    for path in paths:  # no author, no date: the files name no one and do not change with who committed when
        path.write_bytes(strip_identity(path.read_bytes()))
    return paths


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
        refused = [f"{p.name}: {problem}" for p in fresh for problem in identity_problems(p.read_bytes())]
        if refused:
            raise SeriesError("refusing to export: the series would carry personal data or a placeholder identity:"
                              "\n  - " + "\n  - ".join(refused) + "\nNothing was changed. The patch files name no "
                              "one (`apply` makes each commit its applier's): take the address or name out of the "
                              f"commit message or the code in {ws} (`git rebase -i base`, reword or edit), then "
                              "export again.")
        commented = [f"{p.name}: {problem}" for p in fresh for problem in message_problems(p.read_bytes())]
        if commented:
            raise SeriesError("refusing to export: a commit message carries git's comment lines (a conflict "
                              "resolved with `git commit --no-edit` keeps `# Conflicts:`):\n  - "
                              + "\n  - ".join(commented) + "\nNothing was changed. Strip them in " + str(ws)
                              + " (`git rebase base --exec 'git commit -q --amend --no-edit --cleanup=strip'`), "
                              "then export again.")
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
    if write_integrity(pdir, names):
        print(f"recorded the digests and blob ids of the series in {pdir / INTEGRITY}")
    git(ws, "config", "series.exported", git(ws, "rev-parse", "HEAD").stdout.strip())
    print(f"exported {len(names)} patch(es) to {pdir}: {changed} written, {len(names) - changed} unchanged, "
          f"{len(stale)} removed")
    return names


