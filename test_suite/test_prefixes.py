"""Tests of `check-prefixes` (scripts/series/prefixes.py): synthetic three-patch series over a tiny fake torch
(importable, with torch.fx's `@compatibility` registry) in which patch 2 of 3 breaks the tree and patch 3
repairs it, so that only a check of every prefix can see it; plus the pure parts (which tests a patch changes,
the peer-file mapping) and the one-line errors for bad input."""

from __future__ import annotations

import contextlib
import io
import json
from collections.abc import Callable
from pathlib import Path

import pytest

from scripts import series as S
from scripts.series import prefixes
from test_suite.conftest import FAKE_COMMIT, git, install_wheel, make_wheel, numbered

VENV = S.REPO_ROOT / ".venv"

COMPAT = '''_BACK_COMPAT_OBJECTS: dict = {}
_MARKED_WITH_COMPATIBILITY: dict = {}


def compatibility(is_backward_compatible):
    def mark(fn):
        _MARKED_WITH_COMPATIBILITY.setdefault(fn)
        if is_backward_compatible:
            _BACK_COMPAT_OBJECTS.setdefault(fn)
        return fn

    return mark
'''

NODE = ("from torch.fx._compatibility import compatibility\n\n\n"
        "@compatibility(is_backward_compatible=True)\nclass Node:\n    pass\n\n\n" + numbered("node"))

FAKE_TORCH = {
    "torch/__init__.py": "__version__ = '2.13.0'\n",
    "torch/fx/__init__.py": "from torch.fx import node\nfrom torch.fx.node import Node\n",
    "torch/fx/_compatibility.py": COMPAT,
    "torch/fx/node.py": NODE,
    "torch/fx/traceback.py": numbered("tb"),
    "torch/_dynamo/__init__.py": "from torch._dynamo import config\n",
    "torch/_dynamo/config.py": numbered("option"),
}

TEST_FILE = '''import unittest

import torch._dynamo.config as config


class FakeTests(unittest.TestCase):
    def test_flag(self):
        self.assertFalse(config.record_call_hierarchy)


if __name__ == "__main__":
    unittest.main()
'''


def edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text, (old, path)
    path.write_text(text.replace(old, new, 1))


@pytest.fixture
def fake(tmp_path: Path) -> tuple[S.Layout, Path]:
    """A repository root with an empty series over the fake torch wheel, and a venv holding that torch whose
    bin/ runs .venv's Python and lint tools."""
    wheel = make_wheel(tmp_path / "torch-2.13.0+cpu-cp311-cp311-linux_x86_64.whl", "2.13.0+cpu", FAKE_TORCH)
    root = tmp_path / "repo"
    (root / "patches").mkdir(parents=True)
    (root / "patches" / "base.json").write_text(json.dumps(
        {"torch_version": "2.13.0", "commit": FAKE_COMMIT, "python": "3.11"}) + "\n")
    (root / "patches" / ".patches").write_text("")
    (root / "build" / "wheels").mkdir(parents=True)
    (root / "build" / "wheels" / wheel.name).write_bytes(wheel.read_bytes())
    venv = tmp_path / "venv"
    install_wheel(wheel, venv)
    (venv / "bin").mkdir()
    (venv / "bin" / "python").write_text(f'#!/bin/sh\nexec "{VENV / "bin" / "python"}" "$@"\n')
    (venv / "bin" / "python").chmod(0o755)
    for exe in ("ruff", "usort", "flake8", "mypy"):
        (venv / "bin" / exe).symlink_to(VENV / "bin" / exe)
    return S.Layout(root), venv


Step = Callable[[Path], None]


def make_series(layout: S.Layout, steps: list[tuple[str, Step]]) -> None:
    """One commit per step in a workspace synthesized from the fake wheel, exported as the series."""
    ws = S.build_workspace(layout)
    for subject, step in steps:
        step(ws)
        git(ws, "add", "-A")
        git(ws, "commit", "-qm", subject)
    S.export(layout)


def add_flag(ws: Path) -> None:
    edit(ws / "torch/_dynamo/config.py", "option_20 = 20\n", "option_20 = 20\nrecord_call_hierarchy = False\n")
    (ws / "test/dynamo").mkdir(parents=True, exist_ok=True)
    (ws / "test/dynamo/test_fake_prefix.py").write_text(TEST_FILE)


def add_public_fn(decorated: bool) -> Step:
    def step(ws: Path) -> None:
        deco = "@compatibility(is_backward_compatible=False)\n" if decorated else ""
        edit(ws / "torch/fx/node.py", "node_0 = 0\n", f"node_0 = 0\n\n\n{deco}def format_hierarchy(node):\n"
             "    return str(node)\n\n\n")
    return step


def mark_public_fn(ws: Path) -> None:
    edit(ws / "torch/fx/node.py", "\ndef format_hierarchy", "\n@compatibility(is_backward_compatible=False)\n"
         "def format_hierarchy")


def touch(rel: str, line: str) -> Step:
    def step(ws: Path) -> None:
        edit(ws / rel, "_30 = 30\n", f"_30 = 30\n{line}")
    return step


def check(layout: S.Layout, venv: Path, *args: str) -> tuple[int, str]:
    argv = ["--repo-root", str(layout.root), "check-prefixes", "--venv", str(venv), *args]
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = S.main(argv)
    return rc, out.getvalue() + err.getvalue()


def snapshot(sp: Path) -> dict[str, tuple[bytes, int]]:
    return {str(p.relative_to(sp)): (p.read_bytes(), p.stat().st_ino) for p in sorted(sp.rglob("*")) if p.is_file()}


def test_a_good_series_passes_every_prefix_and_leaves_the_venv_alone(fake: tuple[S.Layout, Path]) -> None:
    layout, venv = fake
    make_series(layout, [("[dynamo] add the flag", add_flag), ("[fx] add format_hierarchy", add_public_fn(True)),
                         ("[fx] touch traceback", touch("torch/fx/traceback.py", "tb_extra = 1\n"))])
    sp = S.site_packages(venv)
    before = snapshot(sp)
    rc, out = check(layout, venv, "--quick")
    assert rc == 0, out
    assert out.count(": ok;") == 3 and "all 3 prefix(es) pass" in out
    assert "test_fake_prefix.py" in out  # (d) ran the test file patch 1 adds
    assert snapshot(sp) == before  # hard links only: the venv's bytes and inodes are untouched


def test_quick_records_passing_prefixes_and_checks_again_only_what_changed(fake: tuple[S.Layout, Path]) -> None:
    layout, venv = fake
    make_series(layout, [("[dynamo] add the flag", add_flag), ("[fx] add format_hierarchy", add_public_fn(True)),
                         ("[fx] touch traceback", touch("torch/fx/traceback.py", "tb_extra = 1\n"))])
    rc, out = check(layout, venv, "--quick")
    assert rc == 0 and out.count(": ok;") == 3, out
    record = layout.root / "ci" / "prefix-results.json"
    assert len(json.loads(record.read_text())["passed"]) == 3
    # the same inputs: every prefix is applied, none checked again (no test runs)
    rc, out = check(layout, venv, "--quick")
    assert rc == 0 and out.count("recorded as passing") == 3 and "test_fake_prefix.py" not in out, out
    rc, out = check(layout, venv, "--quick", "--ignore-record")
    assert rc == 0 and out.count(": ok;") == 3 and "recorded as passing" not in out, out
    # a planted regression in patch 3 (a public torch.fx name without @compatibility): 1 and 2 stay recorded,
    # 3 is checked again and fails, and leaves the record
    ws = layout.workspace
    edit(ws / "torch/fx/node.py", "node_1 = 1\n", "node_1 = 1\n\n\ndef planted(node):\n    return node\n\n\n")
    git(ws, "add", "-A")
    git(ws, "commit", "-q", "--amend", "--no-edit")
    S.export(layout)
    rc, out = check(layout, venv, "--quick")
    assert rc == 1 and out.count("recorded as passing") == 2, out
    assert "first failing prefix is 3" in out and "torch.fx.node.planted" in out
    assert len(json.loads(record.read_text())["passed"]) == 2
    # what the check reads besides the patches is in the key: another tool version checks every prefix again
    series = S.load_series(layout.patches)
    env = {"python": "3.11", "ruff": "1"}
    keys = prefixes.prefix_keys(layout, series, env)
    assert len(set(keys)) == 3
    assert prefixes.prefix_keys(layout, series, env) == keys
    assert all(a != b for a, b in zip(keys, prefixes.prefix_keys(layout, series, {**env, "ruff": "2"})))
    (layout.root / "requirements.txt").write_text("ruff==2\n")
    assert all(a != b for a, b in zip(keys, prefixes.prefix_keys(layout, series, env)))


def test_public_fx_name_without_compatibility_in_patch_2_fails_prefix_2(fake: tuple[S.Layout, Path]) -> None:
    layout, venv = fake
    make_series(layout, [("[dynamo] add the flag", add_flag), ("[fx] add format_hierarchy", add_public_fn(False)),
                         ("[fx] mark it", mark_public_fn)])
    rc, out = check(layout, venv, "--quick")
    assert rc == 1, out
    assert "first failing prefix is 2 (0002-" in out
    assert "without @compatibility" in out and "torch.fx.node.format_hierarchy" in out
    rc, out = check(layout, venv, "--quick", "--through", "0001")  # the prefix before it is fine
    assert rc == 0, out
    rc, out = check(layout, venv, "--quick", "--keep-going")  # prefix 3 (the repair) is checked too, and passes
    assert rc == 1 and "first failing prefix is 2 (0002-" in out and "also failing" not in out, out
    assert "prefix 3/3 (0003-fx-mark-it.patch): ok" in out


def test_a_broken_import_in_patch_2_fails_prefix_2(fake: tuple[S.Layout, Path]) -> None:
    layout, venv = fake
    make_series(layout, [("[dynamo] add the flag", add_flag),
                         ("[dynamo] import a module that comes later", touch(
                             "torch/_dynamo/config.py", "from torch._dynamo import later  # noqa: F401\n")),
                         ("[dynamo] add it", lambda ws: (ws / "torch/_dynamo/later.py").write_text("X = 1\n"))])
    rc, out = check(layout, venv, "--quick")
    assert rc == 1, out
    assert "first failing prefix is 2 (0002-" in out and "(c) import torch._dynamo" in out
    assert "cannot import name 'later'" in out


def test_a_lint_finding_in_patch_2_fails_prefix_2(fake: tuple[S.Layout, Path]) -> None:
    layout, venv = fake
    make_series(layout, [("[dynamo] add the flag", add_flag),
                         ("[fx] unformatted", touch("torch/fx/traceback.py", "tb_x = {'a':1}\n")),
                         ("[fx] formatted", lambda ws: edit(ws / "torch/fx/traceback.py", "{'a':1}", '{"a": 1}'))])
    rc, out = check(layout, venv, "--quick")
    assert rc == 1, out
    assert "first failing prefix is 2 (0002-" in out and "(b) lint: torch/fx/traceback.py" in out


def test_a_test_that_passes_only_with_patch_3_fails_prefix_2(fake: tuple[S.Layout, Path]) -> None:
    layout, venv = fake

    def test_needing_3(ws: Path) -> None:
        edit(ws / "test/dynamo/test_fake_prefix.py", "\n\nif __name__", "\n    def test_extra(self):\n"
             "        self.assertEqual(config.extra, 1)\n\n\nif __name__")
    make_series(layout, [("[dynamo] add the flag", add_flag), ("[dynamo] test extra", test_needing_3),
                         ("[dynamo] add extra", touch("torch/_dynamo/config.py", "extra = 1\n"))])
    rc, out = check(layout, venv, "--quick")
    assert rc == 1, out
    assert "first failing prefix is 2 (0002-" in out
    assert "(d) upstream test file test/dynamo/test_fake_prefix.py fails" in out
    assert "FakeTests::test_extra" in out and "(1 selected)" in out  # --quick ran only the test patch 2 adds


def test_a_patch_that_does_not_apply_to_its_prefix_fails(fake: tuple[S.Layout, Path]) -> None:
    """Patch 3 made on top of patch 2 but ordered before it: the whole series may still apply as a unit in
    another order, the prefix 1..2 does not."""
    layout, venv = fake
    make_series(layout, [("[dynamo] add the flag", add_flag),
                         ("[fx] a", touch("torch/fx/traceback.py", "tb_a = 1\n")),
                         ("[fx] b", lambda ws: edit(ws / "torch/fx/traceback.py", "tb_a = 1\n", "tb_a = 2\n"))])
    names = S.series_names(layout.patches)
    names[1], names[2] = names[2], names[1]
    (layout.patches / ".patches").write_text("".join(n + "\n" for n in names))
    S.write_integrity(layout.patches, names)
    rc, out = check(layout, venv, "--quick")
    assert rc == 1, out
    assert "first failing prefix is 2 (0003-" in out and "(a) does not apply to prefix 1" in out
    assert "torch/fx/traceback.py is not the pre-image" in out


def test_full_form_compares_the_related_peer_files_with_pristine(fake: tuple[S.Layout, Path], tmp_path: Path) -> None:
    layout, venv = fake
    stored = tmp_path / "stored"
    (stored / "test/fx").mkdir(parents=True)
    (stored / "test/fx/test_fx_traceback.py").write_text(
        "import torch.fx.traceback as tb\n\n\ndef test_tb():\n    assert tb.tb_3 == 3\n")
    (stored / "test/higher_order_ops").mkdir(parents=True)
    (stored / "test/higher_order_ops/test_unrelated.py").write_text("def test_never_run():\n    raise AssertionError\n")
    make_series(layout, [("[dynamo] add the flag", add_flag),
                         ("[fx] break tb_3", lambda ws: edit(ws / "torch/fx/traceback.py", "tb_3 = 3\n", "tb_3 = 4\n")),
                         ("[fx] repair tb_3", lambda ws: edit(ws / "torch/fx/traceback.py", "tb_3 = 4\n", "tb_3 = 3\n"))])
    rc, out = check(layout, venv, "--tests-from", str(stored))
    assert rc == 1, out
    assert "first failing prefix is 2 (0002-" in out
    assert "(e) peer test fx/test_fx_traceback.py::test_tb passes on pristine torch but is failed at prefix 2" in out
    assert "test_unrelated" not in out  # not mapped from torch/fx/traceback.py


@pytest.mark.parametrize("args, message", [
    (["--through", "0009"], "--through 0009: no such patch in the series"),
    (["--through", "0001"], "lists no patches: there is no prefix to check"),
])
def test_bad_input_is_one_line(fake: tuple[S.Layout, Path], args: list[str], message: str) -> None:
    layout, venv = fake
    if "0009" in args:
        make_series(layout, [("[dynamo] add the flag", add_flag)])
    rc, out = check(layout, venv, "--quick", *args)
    assert rc == 2 and out.startswith("error: ") and message in out and out.count("\n") == 1, out


def test_a_missing_base_is_one_line(fake: tuple[S.Layout, Path]) -> None:
    layout, venv = fake
    (layout.patches / "base.json").unlink()
    rc, out = check(layout, venv, "--quick")
    assert rc == 2 and out.startswith("error: cannot read") and "base.json" in out and out.count("\n") == 1, out


# --------------------------------------------------------------------------- the pure parts

PRE = '''"""Doc."""
import os


def helper():
    return 1


class T:
    def setUp(self):
        pass

    def test_a(self):
        return helper()

    def test_b(self):
        return 2
'''


@pytest.mark.parametrize("post, expected", [
    (PRE.replace("return 2", "return 3"), [("T", "test_b")]),
    (PRE.replace('"""Doc."""\nimport os', '"""Doc, longer."""\nimport os\nimport sys') + "\n\nNEW = 1\n", []),
    (PRE + "\n    @staticmethod\n    def test_c():\n        return new_helper()\n\n\ndef new_helper():\n    return 4\n",
     [("T", "test_c")]),
    (PRE.replace("return 1", "return 5"), None),  # a helper that test_a shares
    (PRE.replace("        pass", "        self.x = 1"), None),  # a test class's setUp
    (PRE.replace("import os\n", "import os\nos.environ['X'] = '1'\n"), None),  # a module-level statement
])
def test_changed_tests(post: str, expected: list[tuple[str, ...]] | None) -> None:
    assert prefixes.changed_tests(PRE, post) == expected


def test_changed_tests_of_a_new_file_is_the_whole_file() -> None:
    assert prefixes.changed_tests(None, PRE) is None
    assert prefixes.keyword_expr([("T", "test_b"), ("test_f",)]) == "(T and test_b) or test_f"


def test_peer_files_mapping() -> None:
    stored = ["dynamo/test_aot_autograd.py", "dynamo/test_fx_annotate.py", "functorch/test_aot_joint_with_descriptors.py",
              "fx/test_fx_traceback.py", "fx/test_fx_traceback_tls.py", "higher_order_ops/test_invoke_subgraph.py"]
    assert prefixes.peer_files(["torch/fx/traceback.py"], stored) == [
        "dynamo/test_fx_annotate.py", "fx/test_fx_traceback.py", "fx/test_fx_traceback_tls.py"]
    assert prefixes.peer_files(["torch/_functorch/_aot_autograd/utils.py"], stored) == [
        "dynamo/test_aot_autograd.py", "functorch/test_aot_joint_with_descriptors.py"]
    assert prefixes.peer_files(["torch/_higher_order_ops/scan.py"], stored) == ["higher_order_ops/test_invoke_subgraph.py"]
    assert prefixes.peer_files(["torch/_export/serde/serialize.py"], stored) == []


def test_module_names() -> None:
    assert prefixes.module_name("torch/fx/proxy.py") == "torch.fx.proxy"
    assert prefixes.module_name("torch/_dynamo/__init__.py") == "torch._dynamo"
    assert prefixes.module_name("docs/source/x.md") is None


def test_cli_lists_the_command() -> None:
    from scripts.series.cli import parser
    assert "check-prefixes" in parser().format_help()
