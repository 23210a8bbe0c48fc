"""`radar`: does the series still apply to another torch release wheel?"""

from __future__ import annotations

import re
import tempfile
from pathlib import Path

from .apply import failed_paths
from .git import commit_all, extract_wheel_sources, git, init_repo, isolated_env
from .patches import Patch


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


