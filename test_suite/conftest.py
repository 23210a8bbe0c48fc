"""Fixtures for the harness tests: a fake torch wheel, a fake repository layout with a small
series made through the real workspace/export path, fake venvs and fake PyTorch checkouts."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import subprocess
import tempfile
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from scripts import series as S

FAKE_COMMIT = "1234567890abcdef1234567890abcdef12345678"


def numbered(name: str, n: int = 40) -> str:
    return "".join(f"{name}_{i} = {i}\n" for i in range(n))


BASE_FILES = {
    "torch/__init__.py": "__version__ = '2.13.0'\n" + numbered("init"),
    "torch/_dynamo/config.py": numbered("option"),
    "torch/fx/node.py": numbered("node"),
    "torch/lib/libtorch_fake.so": "\0\x7fELF binary",
}


def make_wheel(path: Path, version: str, files: dict[str, str]) -> Path:
    """A minimal torch wheel: the files plus a dist-info with METADATA and a sha256 RECORD."""
    dist = f"torch-{version}.dist-info"
    members = dict(files)
    members[f"{dist}/METADATA"] = f"Metadata-Version: 2.1\nName: torch\nVersion: {version}\n"
    record = []
    for name, text in members.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
        record.append(f"{name},sha256={digest},{len(text.encode())}")
    members[f"{dist}/RECORD"] = "\n".join(record + [f"{dist}/RECORD,,"]) + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(path, "w") as z:
        for name, text in members.items():
            z.writestr(name, text)
    return path


def git(cwd: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout


def tree_hashes(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and ".git" not in p.parts}


@pytest.fixture(scope="session", autouse=True)
def inductor_cache() -> Iterator[None]:
    """Inductor's cache for this run only (the compiles here and in their subprocesses), deleted at the
    end: the default /tmp/torchinductor_<user> grows by hundreds of MB a run, and CI's disk is small."""
    if "TORCHINDUCTOR_CACHE_DIR" in os.environ:
        yield
        return
    with tempfile.TemporaryDirectory(prefix="inductor-cache-") as folder:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = folder
        try:
            yield
        finally:
            del os.environ["TORCHINDUCTOR_CACHE_DIR"]


@pytest.fixture(autouse=True)
def isolated_git(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GIT_CONFIG_GLOBAL", "/dev/null")
    monkeypatch.setenv("GIT_CONFIG_NOSYSTEM", "1")
    for role in ("AUTHOR", "COMMITTER"):
        monkeypatch.setenv(f"GIT_{role}_NAME", "Test Dev")
        monkeypatch.setenv(f"GIT_{role}_EMAIL", "dev@example.invalid")


@pytest.fixture
def base_wheel(tmp_path: Path) -> Path:
    return make_wheel(tmp_path / "wheels" / "torch-2.13.0+cpu-cp311-cp311-linux_x86_64.whl", "2.13.0+cpu", BASE_FILES)


@pytest.fixture
def layout(tmp_path: Path, base_wheel: Path) -> S.Layout:
    """An empty-series repository root whose build/wheels holds the fake pinned wheel."""
    root = tmp_path / "repo"
    (root / "patches").mkdir(parents=True)
    (root / "patches" / "base.json").write_text(json.dumps(
        {"torch_version": "2.13.0", "commit": FAKE_COMMIT, "python": "3.11"}) + "\n")
    (root / "patches" / ".patches").write_text("")
    (root / "build" / "wheels").mkdir(parents=True)
    (root / "build" / "wheels" / base_wheel.name).write_bytes(base_wheel.read_bytes())
    return S.Layout(root)


def edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text, (old, path)
    path.write_text(text.replace(old, new, 1))


UPSTREAM_TEST = """import unittest

class T(unittest.TestCase):
    def test_patched(self):
        import torch._dynamo.config as c
        self.assertEqual(c.record_call_hierarchy, False)

if __name__ == "__main__":
    unittest.main()
"""


@pytest.fixture
def series_layout(layout: S.Layout) -> S.Layout:
    """A three-patch series made with `workspace`, commits and `export`:
    0001 touches torch/_dynamo/config.py, 0002 torch/fx/node.py plus a new upstream test file,
    0003 torch/__init__.py plus a new module torch/fx/call_hierarchy.py."""
    ws = S.build_workspace(layout)
    edit(ws / "torch/_dynamo/config.py", "option_20 = 20\n", "option_20 = 20\nrecord_call_hierarchy = False\n")
    edit(ws / "torch/_dynamo/config.py", "option_35 = 35\n", "option_35 = 35  # second hunk\n")
    git(ws, "commit", "-qam", "[dynamo] add record_call_hierarchy config")
    edit(ws / "torch/fx/node.py", "node_10 = 10\n", "node_10 = 10  # call_hierarchy\n")
    (ws / "test/dynamo").mkdir(parents=True)
    (ws / "test/dynamo/test_fake_hierarchy.py").write_text(UPSTREAM_TEST)
    git(ws, "add", "-A")
    git(ws, "commit", "-qm", "[fx] mark node meta")
    edit(ws / "torch/__init__.py", "init_30 = 30\n", "init_30 = 31\n")
    (ws / "torch/fx/call_hierarchy.py").write_text("HIERARCHY = []\n")
    git(ws, "add", "-A")
    git(ws, "commit", "-qm", "Add torch.fx.call_hierarchy")
    S.export(layout)
    return layout


def install_wheel(wheel: Path, dest: Path) -> Path:
    sp = dest / "lib" / "python3.11" / "site-packages"
    sp.mkdir(parents=True)
    with zipfile.ZipFile(wheel) as z:
        z.extractall(sp)
    return sp


@pytest.fixture
def site_packages(tmp_path: Path, base_wheel: Path) -> Path:
    return install_wheel(base_wheel, tmp_path / "venv")


@pytest.fixture
def make_checkout(tmp_path: Path) -> Callable[..., Path]:
    """A git checkout holding the fake torch files (optionally edited) in one commit."""
    def make(name: str = "pytorch", files: dict[str, str] | None = None) -> Path:
        repo = tmp_path / name
        repo.mkdir()
        for rel, text in (files or BASE_FILES).items():
            (repo / rel).parent.mkdir(parents=True, exist_ok=True)
            (repo / rel).write_text(text)
        git(repo, "init", "-q", "-b", "main")
        git(repo, "add", "-A")
        git(repo, "commit", "-qm", "upstream")
        return repo
    return make
