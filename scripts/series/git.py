"""Errors, the repository layout, git helpers and torch wheels (no series knowledge here)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent.parent
# The identity of commits that no person wrote: the synthesized base of `workspace` and the scratch
# repositories of `install`, `radar`, `upstream-tests`, and the workspace's patch commits where the user
# has no git identity. Never exported: `export` writes no author (patches.strip_identity).
BOT = {"name": "RFC-0051 workbench", "email": "workbench@localhost"}
FIXED_DATE = "2000-01-01T00:00:00+0000"
BINARY_SUFFIXES = {".so", ".a", ".dylib", ".dll", ".lib", ".pyd", ".pt", ".ptl", ".whl", ".pkl"}
SKIP_PREFIXES = ("torch/include/", "torch/lib/", "torch/share/", "torch/bin/")


class SeriesError(Exception):
    """A problem the user must fix; the message names it. Nothing was changed unless it says so."""

    exit_code = 2


class SeriesConflict(SeriesError):
    """A patch did not apply; the target was left in a recoverable `git am` state."""

    exit_code = 1


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


IDENTITY_RE = re.compile(r"^\s*([^<>\n]*[^<>\s][^<>\n]*?)\s*<([^<>\s@]+@[^<>\s@]+)>\s*$")


def parse_identity(value: str) -> tuple[str, str]:
    """(name, email) of `Name <email@host>`; SeriesError on anything else (for `apply --author`)."""
    m = IDENTITY_RE.match(value)
    if not m:
        raise SeriesError(f"--author {value!r} is not `Name <email@host>`; give it as --author 'Your Name "
                          "<you@your.domain>' (the name you sign your commits with). Nothing was changed.")
    return m.group(1), m.group(2)


def configured_identity(repo: Path, role: str = "author") -> tuple[str, str] | None:
    """The identity git would give a commit made in repo, as (name, email), only where the user set one:
    GIT_AUTHOR_NAME/GIT_AUTHOR_EMAIL (committer: GIT_COMMITTER_*), else `author.*` (`committer.*`), else
    `user.name`/`user.email` from repo's git config (local, global, system). None when either is unset:
    git's guess from the host name is no identity to put on a contribution."""
    env = dict(os.environ, LC_ALL="C", GIT_TERMINAL_PROMPT="0")
    found = []
    for key in ("name", "email"):
        value = os.environ.get(f"GIT_{role.upper()}_{key.upper()}", "").strip()
        for section in (role, "user"):
            if not value:
                value = git(repo, "config", "--get", f"{section}.{key}", check=False, env=env).stdout.strip()
        found.append(value)
    return (found[0], found[1]) if all(found) else None


def user_env(repo: Path, author: tuple[str, str]) -> dict[str, str]:
    """The user's own git environment for `git am` in repo: the commits' dates are now (a GIT_*_DATE of
    the caller's is dropped); the committer is the user's configured one, else the author."""
    env = dict(os.environ, LC_ALL="C", GIT_TERMINAL_PROMPT="0")
    for var in ("GIT_AUTHOR_DATE", "GIT_COMMITTER_DATE"):
        env.pop(var, None)
    name, email = configured_identity(repo, "committer") or author
    env.update(GIT_COMMITTER_NAME=name, GIT_COMMITTER_EMAIL=email)
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


def sha256_or_none(path: Path) -> str | None:
    """sha256 of a file, None when it does not exist."""
    return sha256_file(path) if path.is_file() else None


def blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


# --------------------------------------------------------------------------- wheels


def pip_env() -> dict[str, str]:
    """Environment for every pip the workbench runs (setup's installs, `pip_install_one_at_a_time`,
    `find_wheel`'s `pip download`): ours with PIP_CONSTRAINT=/dev/null.

    A machine's pip configuration may name a global constraints file (this one's, in /etc/xdg/pip,
    caps torch below the pinned base), and pip would then refuse the very release the series is pinned
    to. PIP_CONSTRAINT set in the environment takes the place of the configured file, so an empty one
    lifts it for these calls only; the workbench's own pin (torch==<patches/base.json's torch_version>)
    is still passed with `-c`, and the configuration itself is left alone.
    """
    return dict(os.environ, PIP_CONSTRAINT=os.devnull)


def find_wheel(version: str, wheels_dir: Path) -> Path:
    """A torch wheel of this version: from build/wheels, else fetched there with `pip download`
    (under `pip_env()`: PIP_CONSTRAINT=/dev/null, so a configured constraints file cannot refuse it)."""
    def cached() -> list[Path]:
        return sorted(p for p in wheels_dir.glob(f"torch-{version}*.whl")
                      if re.match(rf"torch-{re.escape(version)}(\+[^-]+)?-", p.name))
    if not (found := cached()):
        wheels_dir.mkdir(parents=True, exist_ok=True)
        print(f"fetching the torch=={version} wheel with pip download into {wheels_dir} ...", flush=True)
        proc = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                               f"torch=={version}", "-d", str(wheels_dir)], capture_output=True, text=True,
                              env=pip_env())
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
