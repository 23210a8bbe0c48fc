"""`install`, `install --revert` and `status`: the series in the torch/ files of a venv's torch.

Guarantees:
- The new files are built and verified aside (from the wheel's pristine files, never by first
  reverting what is installed); nothing in site-packages changes unless all of them are ready.
- The switch is journaled (site-packages/.rfc0051-series.journal/): SIGINT and SIGTERM wait until it
  is done, an error in it rolls it back, and a switch cut off harder (SIGKILL, power loss) is rolled
  back by the next `install` or `install --revert`; `status` says `interrupted` until then. So torch
  holds the old series or the new one, never a mixture that goes unreported.
- A file is "edited by hand" only if it matches neither the wheel's RECORD, nor the installed stamp,
  nor a post-image of the series. Such edits are never discarded silently: the command refuses, or
  with --force saves them under site-packages/.rfc0051-series-backups/<time>/ and says so.
"""

from __future__ import annotations

import base64
import contextlib
import csv
import dataclasses
import hashlib
import json
import os
import shutil
import signal
import tempfile
import threading
import time
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path

from .git import SeriesError, blob_id, commit_all, git, init_repo, isolated_env, sha256_or_none
from .patches import Patch, describe_patches, post_images, prefix_length, series_hash, verify_postimages

STAMP_DIR = ".rfc0051-series"  # inside site-packages: stamp.json + pristine/ backups of the wheel's files
JOURNAL_DIR = ".rfc0051-series.journal"  # during a switch: journal.json, new/ and old/ file contents
BACKUP_DIR = ".rfc0051-series-backups"  # hand edits saved before --force replaces them

WheelSource = Callable[[], Path]


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


def check_torch_version(sp: Path, pinned: str) -> Path:
    version, dist_info = installed_torch(sp)
    if version.split("+", 1)[0] != pinned:
        raise SeriesError(f"the torch installed in {sp} is {version}, but the series is pinned to torch {pinned}; "
                          f"install the pinned release: PIP_CONSTRAINT=/dev/null pip install torch=={pinned}")
    return dist_info


def torch_paths(series: list[Patch]) -> list[str]:
    return list(dict.fromkeys(p for patch in series for p in patch.paths("torch/")))


def reinstall_hint(sp: Path, pinned: str) -> str:
    venv = sp.parent.parent.parent
    pip = f"{venv}/bin/python -m pip" if (venv / "bin" / "python").exists() else "pip"
    # PIP_CONSTRAINT=/dev/null: as every pip the workbench runs (git.pip_env), past a configured constraints file
    return f"PIP_CONSTRAINT=/dev/null {pip} install --force-reinstall --no-deps torch=={pinned}"


def read_stamp(sp: Path) -> dict | None:
    path = sp / STAMP_DIR / "stamp.json"
    if not path.exists():
        return None
    try:
        stamp = json.loads(path.read_text())
        assert isinstance(stamp, dict) and isinstance(stamp.get("files"), dict) and "series_hash" in stamp
    except (OSError, ValueError, AssertionError):
        raise SeriesError(f"{path} is damaged, so what is installed is unknown; reinstall torch "
                          f"({reinstall_hint(sp, '<pinned version>')}) and delete {path.parent}") from None
    return stamp


def read_journal(sp: Path) -> dict | None:
    path = sp / JOURNAL_DIR / "journal.json"
    if not path.exists():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        raise SeriesError(f"{path} is damaged: an install into {sp} was cut off while it started; check the files "
                          f"it names by hand, or reinstall torch, then delete {path.parent}") from None


# --------------------------------------------------------------------------- what each file is


def classify(sp: Path, paths: list[str], record: dict[str, str], stamp: dict | None,
             series: list[Patch]) -> dict[str, str]:
    """Per path: `installed` (as the stamp records), `pristine` (the wheel's, or absent if the wheel
    has no such file), `series` (a post-image of the series), or `edited` (by hand: none of those)."""
    posts = post_images(series, "torch/")
    stamped = stamp["files"] if stamp else {}
    out = {}
    for rel in paths:
        target = sp / rel
        cur = sha256_or_none(target)
        if rel in stamped and cur == stamped[rel]["patched"]:
            out[rel] = "installed"
        elif cur == pristine_hash(rel, record, stamp):
            out[rel] = "pristine"
        elif cur is not None and blob_id(target.read_bytes()) in posts.get(rel, set()):
            out[rel] = "series"
        else:
            out[rel] = "edited"
    return out


def pristine_hash(rel: str, record: dict[str, str], stamp: dict | None) -> str | None:
    """sha256 of the wheel's file (None: the wheel has none; the series creates it)."""
    if rel in record:
        return record[rel]
    if stamp and rel in stamp["files"]:
        return stamp["files"][rel]["pristine"]
    return None


def pristine_bytes(sp: Path, rel: str, want: str, pinned: str, wheel: WheelSource | None) -> bytes:
    """The wheel's version of rel: from the backup, the file itself, or the wheel; checked by hash."""
    for candidate in (sp / STAMP_DIR / "pristine" / rel, sp / rel):
        if candidate.is_file() and hashlib.sha256(data := candidate.read_bytes()).hexdigest() == want:
            return data
    if wheel is not None:
        with zipfile.ZipFile(wheel()) as z:
            if rel in z.NameToInfo and hashlib.sha256(data := z.read(rel)).hexdigest() == want:
                return data
    raise SeriesError(f"no copy of the wheel's {rel} (sha256 {want[:12]}) is left in {sp} or the wheel; restore "
                      f"torch's files with `{reinstall_hint(sp, pinned)}`, then rerun")


def save_edits(sp: Path, paths: list[str]) -> Path:
    """Copy hand-edited files to site-packages/.rfc0051-series-backups/<UTC time>/ before they are replaced."""
    dest = sp / BACKUP_DIR / time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    n = 1
    while dest.exists():
        dest, n = dest.with_name(f"{dest.name.split('.')[0]}.{n}"), n + 1
    for rel in paths:
        if (sp / rel).is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(sp / rel, dest / rel)
    return dest


# --------------------------------------------------------------------------- state


@dataclasses.dataclass
class InstallState:
    state: str  # pristine | current | stale | modified | interrupted
    detail: str
    stamp: dict | None
    edited: list[str] = dataclasses.field(default_factory=list)


def install_state(sp: Path, series: list[Patch], pinned: str, through: str | None = None,
                  follow_stamp: bool = False) -> InstallState:
    """State of the venv's torch against the prefix of the series ending with `through` (default: the
    whole series; with follow_stamp, the prefix the installed stamp was made for, as `status` reports)."""
    record = record_hashes(check_torch_version(sp, pinned))
    stamp = read_stamp(sp)
    if (journal := read_journal(sp)) is not None:
        files = {rel: h for rel, h in journal["files"].items() if rel.startswith("torch/")}
        done = sum(1 for rel, h in files.items() if sha256_or_none(sp / rel) == h["new"])
        return InstallState(
            "interrupted", f"{journal['action']} of {journal['to']} was cut off after switching {done} of "
            f"{len(files)} torch file(s) (before: {journal['from']}); the next `install` or `install --revert` "
            f"first puts every file back as it was before", stamp)
    if through is None and follow_stamp and stamp and stamp.get("through") in [p.name for p in series]:
        through = stamp["through"]
    want = series[: prefix_length(series, through)]
    paths = list(dict.fromkeys([*(stamp["files"] if stamp else []), *torch_paths(want)]))
    kinds = classify(sp, paths, record, stamp, series)
    edited = [rel for rel, k in kinds.items() if k == "edited"]
    if edited:
        return InstallState("modified", "edited by hand (matching neither the wheel's RECORD, nor the installed "
                            "series, nor the series' patches): " + ", ".join(edited) + f"; `install --force` or "
                            f"`install --revert --force` saves them to {sp / BACKUP_DIR}/<time>/ before replacing "
                            "them", stamp, edited)
    if stamp and all(kinds[rel] == "pristine" for rel in stamp["files"]) and stamp["files"]:
        stamp = None  # torch was reinstalled since: the stamp describes nothing that is there
    if stamp:
        changed = [rel for rel in stamp["files"] if kinds[rel] != "installed"]
        installed = describe_patches(stamp["patches"], series)
        if changed:
            return InstallState("modified", f"{installed} were installed, but since then {', '.join(changed)} went "
                                "back to the wheel's version or another version of the series (torch reinstalled "
                                "in part?); `install` puts the series in place again", stamp)
        if stamp["series_hash"] == series_hash(want):
            how = (f" (installed with --through {stamp['through']})"
                   if stamp.get("through") and len(want) < len(series) else "")
            return InstallState("current", f"{installed}: series {stamp['series_hash'][:12]} is installed{how}", stamp)
        return InstallState("stale", f"{installed} installed as series {stamp['series_hash'][:12]}; wanted "
                            f"{describe_patches([p.name for p in want], series)}, series {series_hash(want)[:12]}; `install"
                            + (f" --through {through}" if len(want) < len(series) else "") + "` replaces it",
                            stamp)
    carried = [rel for rel in torch_paths(want) if kinds[rel] != "pristine"]
    if carried:
        return InstallState("modified", "no install is recorded, but these files carry changes of the series: "
                            + ", ".join(carried) + "; `install` puts the series in place properly", None)
    if not want:
        return InstallState("current", "the series is empty; torch is pristine", None)
    return InstallState("pristine", "torch is as the wheel installed it; `install` installs the series", None)


# --------------------------------------------------------------------------- the journaled switch


@contextlib.contextmanager
def deferred_signals() -> Iterator[None]:
    """Hold SIGINT/SIGTERM until the block is done (Ctrl-C then lands after the switch, not in it).

    Python handlers that only record the signal, then the original handlers and the signals again:
    blocking them with pthread_sigmask would hold them only in this thread, and a process-directed
    signal is delivered to any thread that does not block it (torch's worker threads), whose C-level
    handler then raises KeyboardInterrupt in the main thread inside the block."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[int] = []
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    for sig in previous:
        signal.signal(sig, lambda signum, frame: received.append(signum))
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
        for sig in dict.fromkeys(received):
            signal.raise_signal(sig)


def write_atomic(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".rfc0051-tmp")
    with open(tmp, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def roll_back(sp: Path) -> str:
    """Put every file of an interrupted switch back as it was before it; idempotent."""
    jdir = sp / JOURNAL_DIR
    journal = read_journal(sp)
    if journal is None:
        shutil.rmtree(jdir, ignore_errors=True)  # staging of a switch that never started
        return ""
    unknown = []
    for rel, h in journal["files"].items():
        target = sp / rel
        cur = sha256_or_none(target)
        if cur == h["old"]:
            continue
        if cur != h["new"]:
            unknown.append(rel)
            continue
        if h["old"] is None:
            target.unlink()
        else:
            write_atomic(target, (jdir / "old" / rel).read_bytes())
    stamp_file = sp / STAMP_DIR / "stamp.json"
    if journal["old_stamp"] is None:
        stamp_file.unlink(missing_ok=True)
    else:
        write_atomic(stamp_file, journal["old_stamp"].encode())
    for d in sorted(journal.get("created_dirs", []), key=len, reverse=True):
        with contextlib.suppress(OSError):
            (sp / d).rmdir()
    if unknown:
        raise SeriesError(f"an interrupted {journal['action']} in {sp} cannot be rolled back: {', '.join(unknown)} "
                          f"changed after it; the old contents are in {jdir / 'old'}; check them, then delete {jdir}")
    (jdir / "journal.json").unlink()
    shutil.rmtree(jdir)
    return f"rolled back an interrupted {journal['action']} of {journal['to']}: torch is as before it ({journal['from']})"


def switch(sp: Path, targets: dict[str, bytes | None], new_stamp: dict | None, action: str, before: str,
           after: str) -> None:
    """Make each sp/rel hold targets[rel] (None: absent) and the stamp new_stamp, all or nothing."""
    jdir = sp / JOURNAL_DIR
    shutil.rmtree(jdir, ignore_errors=True)
    files: dict[str, dict[str, str | None]] = {}
    created: list[str] = []
    for rel, data in targets.items():
        target = sp / rel
        old = sha256_or_none(target)
        new = hashlib.sha256(data).hexdigest() if data is not None else None
        if old == new:
            continue
        if old is not None:
            (jdir / "old" / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(target, jdir / "old" / rel)
        if data is not None:
            (jdir / "new" / rel).parent.mkdir(parents=True, exist_ok=True)
            (jdir / "new" / rel).write_bytes(data)
            parent = Path(rel).parent
            while not (sp / parent).exists():
                created.append(str(parent))
                parent = parent.parent
        files[rel] = {"old": old, "new": new}
    stamp_file = sp / STAMP_DIR / "stamp.json"
    journal = {"action": action, "from": before, "to": after, "files": files, "created_dirs": sorted(set(created)),
               "old_stamp": stamp_file.read_text() if stamp_file.exists() else None}
    write_atomic(jdir / "journal.json", json.dumps(journal, indent=1).encode())  # from here: roll back if cut
    with deferred_signals():
        try:
            for rel, h in files.items():
                target = sp / rel
                if h["new"] is None:
                    target.unlink()
                else:
                    target.parent.mkdir(parents=True, exist_ok=True)
                    os.replace(jdir / "new" / rel, target)
            if new_stamp is None:
                stamp_file.unlink(missing_ok=True)
            else:
                write_atomic(stamp_file, (json.dumps(new_stamp, indent=1, sort_keys=True) + "\n").encode())
            (jdir / "journal.json").unlink()  # the switch is done
        except BaseException:
            roll_back(sp)
            raise
    shutil.rmtree(jdir, ignore_errors=True)


# --------------------------------------------------------------------------- install / revert


def refuse_edits(sp: Path, edited: list[str], what: str, pinned: str) -> SeriesError:
    return SeriesError(f"refusing to {what}: {', '.join(edited)} in {sp} edited by hand (matching neither the "
                       "wheel's RECORD, nor the installed series, nor the series' patches); nothing was changed.\n"
                       f"Keep them elsewhere first, or pass --force to save them to {sp / BACKUP_DIR}/<time>/ and go "
                       f"on; or restore the wheel's files: {reinstall_hint(sp, pinned)}")


def build_files(sp: Path, want: list[Patch], pristine: dict[str, bytes | None]) -> dict[str, bytes | None]:
    """The torch/ files of `want` applied to the wheel's files, built and verified in a scratch repo."""
    paths = torch_paths(want)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        init_repo(work)
        for rel in paths:
            if pristine[rel] is not None:
                (work / rel).parent.mkdir(parents=True, exist_ok=True)
                (work / rel).write_bytes(pristine[rel])
        commit_all(work, "the wheel's torch files")
        commits = []
        for patch in want:
            if patch.paths("torch/"):
                proc = git(work, "apply", "--index", "--include=torch/*", str(patch.path.resolve()),
                           check=False, env=isolated_env())
                if proc.returncode != 0:
                    raise SeriesError(f"patch {patch.name} does not apply to the wheel's torch files; nothing was "
                                      f"changed in {sp}:\n{proc.stderr.strip()}\nfix the patch in the workspace and "
                                      "export it")
            commits.append(commit_all(work, patch.subject))
        verify_postimages(work, commits, want, prefix="torch/")
        return {rel: (work / rel).read_bytes() if (work / rel).is_file() else None for rel in paths}


def install(sp: Path, series: list[Patch], pinned: str, through: str | None = None, force: bool = False,
            wheel: WheelSource | None = None) -> str:
    """Install the series, or its prefix ending with the patch `through`, into site-packages sp."""
    record = record_hashes(check_torch_version(sp, pinned))
    notes = [msg] if (msg := roll_back(sp)) else []
    st = install_state(sp, series, pinned, through)
    if st.state == "current":
        return "\n".join([*notes, f"already installed: {st.detail}"])
    want = series[: prefix_length(series, through)]
    stamp = read_stamp(sp)
    paths = list(dict.fromkeys([*(stamp["files"] if stamp else []), *torch_paths(want)]))
    kinds = classify(sp, paths, record, stamp, series)
    edited = [rel for rel, k in kinds.items() if k == "edited"]
    if edited and not force:
        raise refuse_edits(sp, edited, "install", pinned)
    hashes = {rel: pristine_hash(rel, record, stamp) for rel in paths}
    pristine = {rel: None if h is None else pristine_bytes(sp, rel, h, pinned, wheel) for rel, h in hashes.items()}
    built = build_files(sp, want, pristine)
    targets = {rel: built[rel] if rel in built else pristine[rel] for rel in paths}
    for rel, data in pristine.items():  # backups of the wheel's files for --revert, switched with the rest
        if rel in built and data is not None:
            targets[f"{STAMP_DIR}/pristine/{rel}"] = data
    created = sorted({str(p) for rel in built for p in Path(rel).parents
                      if str(p) != "." and not (sp / p).exists()} | set(stamp.get("created_dirs", []) if stamp else []))
    new_stamp = {"series_hash": series_hash(want), "patches": [p.name for p in want],
                 "through": want[-1].name if want and len(want) < len(series) else None,
                 "torch": installed_torch(sp)[0], "created_dirs": created,
                 "files": {rel: {"pristine": hashes[rel],
                                 "patched": hashlib.sha256(d).hexdigest() if (d := built[rel]) is not None else None}
                           for rel in built}}
    if edited:
        notes.append(f"saved your edits to {', '.join(edited)} in {save_edits(sp, edited)}")
    before = describe_patches(stamp["patches"], series) if stamp else "the wheel's files"
    after = describe_patches(new_stamp["patches"], series)
    switch(sp, targets, new_stamp, "install", before, after)
    unrecorded = [p for p in built if hashes[p] is not None and p not in record]
    note = f" (not in the wheel RECORD: {', '.join(unrecorded)})" if unrecorded else ""
    return "\n".join([*notes, f"installed series {new_stamp['series_hash'][:12]}: {after}, {len(built)} file(s) "
                              f"under torch/ in {sp}{note}"])


def revert(sp: Path, pinned: str, series: list[Patch] | None = None, force: bool = False,
           wheel: WheelSource | None = None) -> str:
    """Restore the wheel's version of every file an install changed (and, given the series, of the
    files it touches), byte-identical to the wheel's RECORD."""
    record = record_hashes(check_torch_version(sp, pinned))
    notes = [msg] if (msg := roll_back(sp)) else []
    stamp = read_stamp(sp)
    paths = list(dict.fromkeys([*(stamp["files"] if stamp else []), *torch_paths(series or [])]))
    kinds = classify(sp, paths, record, stamp, series or [])
    if all(k == "pristine" for k in kinds.values()):
        shutil.rmtree(sp / STAMP_DIR, ignore_errors=True)
        return "\n".join([*notes, "no series installed; the torch files the series touches are as the wheel "
                                  "installed them"])
    edited = [rel for rel, k in kinds.items() if k == "edited"]
    if edited and not force:
        raise refuse_edits(sp, edited, "revert", pinned)
    hashes = {rel: pristine_hash(rel, record, stamp) for rel in paths}
    targets = {rel: None if h is None else pristine_bytes(sp, rel, h, pinned, wheel) for rel, h in hashes.items()}
    if edited:
        notes.append(f"saved your edits to {', '.join(edited)} in {save_edits(sp, edited)}")
    before = f"series {stamp['series_hash'][:12]}" if stamp else "torch files carrying changes"
    switch(sp, targets, None, "revert", before, "the wheel's files")
    for d in sorted(stamp.get("created_dirs", []) if stamp else [], key=len, reverse=True):
        if (sp / d).is_dir() and not any(p for p in (sp / d).iterdir() if p.name != "__pycache__"):
            shutil.rmtree(sp / d)
    shutil.rmtree(sp / STAMP_DIR, ignore_errors=True)
    bad = [rel for rel in paths if rel in record and sha256_or_none(sp / rel) != record[rel]]
    if bad:
        raise SeriesError(f"after revert these files still differ from the wheel RECORD: {', '.join(bad)}; "
                          f"{reinstall_hint(sp, pinned)}")
    what = f"series {stamp['series_hash'][:12]}" if stamp else "the series' changes"
    return "\n".join([*notes, f"reverted {what}; torch files are pristine again"])
