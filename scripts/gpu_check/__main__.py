"""Build `.gpu/`, the kit that runs the series' GPU checks on a lent device machine.

    python3 -m scripts.gpu_check     (from the repository root, after `python3 -m scripts.series workspace`)

The device machine's only torch is an older CUDA build, and one call carries at most 64 MiB, so the kit
holds torch==<patches/base.json's version> and the Triton it requires (cp312 wheels, stripped of what a
CUDA training step never loads) as one xz archive split into 61 MiB parts (`.gpu/parts/pNN`), and
`.gpu/run/`: the series' `torch/` diff, its test files, `device.sh`, `profile_cuda.py`, the nvshmem host
library of this torch (its symbols are newer than the machine's) and the expecttest wheel. docs/gpu-check.md
says how to send it.
"""

from __future__ import annotations

import hashlib
import json
import lzma
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from scripts.series.git import Layout, SeriesError, pip_env

PART_BYTES = 61 * 2**20
# Files of the wheels a CUDA training step never loads (ROCm's codegen, Triton's profiler libraries, the
# Blackwell ptxas, protoc): about 0.3 GB the parts need not carry.
DROPPED = re.compile(r"^(triton/backends/amd/lib/libtriton_amd_codegen\.so|triton/backends/nvidia/lib/cupti.*"
                     r"|triton/backends/nvidia/bin/ptxas-blackwell|torch/bin/protoc.*|.*\.a)$")
TESTS = ("test/dynamo/test_call_hierarchy.py", "test/functorch/test_rng_functionalization_meta.py")
HERE = Path(__file__).resolve().parent


def download(spec: str, dest: Path) -> Path:
    """The cp312 x86-64 wheel of `spec`, fetched into `dest` unless it is there."""
    name = spec.split("==")[0]
    found = sorted(dest.glob(f"{name}-{spec.split('==')[1]}-*.whl"))
    if found:
        return found[0]
    platforms = [f"--platform=manylinux_2_{n}_x86_64" for n in (17, 27, 28)] + ["--platform=manylinux2014_x86_64"]
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                    "--python-version=3.12", "--implementation=cp", *platforms, "-d", str(dest), spec],
                   check=True, env=pip_env())
    found = sorted(dest.glob(f"{name}-*.whl"))
    if not found:
        raise SeriesError(f"pip download {spec} left no wheel in {dest}")
    return found[0]


def triton_requirement(torch_wheel: Path) -> str:
    """`triton==X.Y.0` for torch's `Requires-Dist: triton~=X.Y.0`."""
    with zipfile.ZipFile(torch_wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        m = re.search(r"^Requires-Dist: triton[~=]=([\d.]+)", z.read(meta).decode(), re.M)
    if m is None:
        raise SeriesError(f"{torch_wheel.name} names no triton version")
    return f"triton=={m[1]}"


def build(layout: Layout) -> Path:
    base = layout.base()
    ws = layout.workspace
    if not (ws / ".git").exists():
        raise SeriesError(f"no workspace at {ws}; create it with `python3 -m scripts.series workspace`")
    nvshmem = next(layout.venv.glob("lib/python*/site-packages/nvidia/nvshmem/lib/libnvshmem_host.so.3"), None)
    if nvshmem is None:
        raise SeriesError(f"no nvshmem host library in {layout.venv}; run `python3 -m scripts.series setup`")
    kit = layout.root / ".gpu"
    wheels = layout.root / "build" / "gpu-wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    torch_wheel = download(f"torch=={base['torch_version']}", wheels)
    triton_wheel = download(triton_requirement(torch_wheel), wheels)
    expecttest = download(next(line.strip() for line in (layout.root / "requirements.txt").read_text().splitlines()
                               if line.startswith("expecttest==")), wheels)
    shutil.rmtree(kit, ignore_errors=True)
    (kit / "parts").mkdir(parents=True)
    (kit / "run").mkdir()
    (kit / "whl").mkdir()
    shutil.copy(expecttest, kit / "whl")
    with tempfile.TemporaryDirectory() as tmp:
        site = Path(tmp)
        for wheel in (torch_wheel, triton_wheel):
            with zipfile.ZipFile(wheel) as z:
                z.extractall(site, [n for n in z.namelist() if not DROPPED.match(n)])
        for f in site.rglob("*"):  # zipfile drops the permission bits
            if f.is_file() and (f.suffix in (".so", "") or ".so." in f.name or f.parent.name == "bin"):
                f.chmod(0o755)
        archive = site / "site.tar.xz"
        tops = sorted(p.name for p in site.iterdir() if p != archive)
        with archive.open("wb") as out:
            tar = subprocess.Popen(["tar", "-cf", "-", "-C", str(site), *tops], stdout=subprocess.PIPE)
            subprocess.run(["xz", "-6", "-T0"], stdin=tar.stdout, stdout=out, check=True)
            if tar.wait() != 0:
                raise SeriesError("tar of the extracted wheels failed")
        digest = hashlib.sha256()
        with archive.open("rb") as f:
            for i, chunk in enumerate(iter(lambda: f.read(PART_BYTES), b"")):
                (kit / "parts" / f"p{i:02d}").write_bytes(chunk)
                digest.update(chunk)
        (kit / "parts.sha256").write_text(f"{digest.hexdigest()}  site.tar.xz\n")
    diff = subprocess.run(["git", "-C", str(ws), "diff", "base", "series", "--", "torch/"],
                          check=True, capture_output=True, text=True).stdout
    (kit / "run" / "series-torch.diff").write_text(diff)
    for test in TESTS:
        text = subprocess.run(["git", "-C", str(ws), "show", f"series:{test}"],
                              check=True, capture_output=True, text=True).stdout
        (kit / "run" / Path(test).name).write_text(text)
    (kit / "run" / "libnvshmem_host.so.3.xz").write_bytes(lzma.compress(nvshmem.read_bytes(), preset=6))
    for name in ("device.sh", "profile_cuda.py"):
        shutil.copy(HERE / name, kit / "run" / name)
    parts = sorted((kit / "parts").iterdir())
    (kit / "calls.json").write_text(json.dumps(
        {"upload": [p.name for p in parts[:-1]], "last": parts[-1].name, "torch": torch_wheel.name,
         "triton": triton_wheel.name}, indent=1) + "\n")
    return kit


def main() -> int:
    try:
        kit = build(Layout(Path.cwd()))
    except (SeriesError, subprocess.CalledProcessError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    parts = json.loads((kit / "calls.json").read_text())
    print(f"kit ready in {kit}: {len(parts['upload'])} upload calls, then the check (docs/gpu-check.md)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
