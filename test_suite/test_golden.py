"""The golden-file helper never rewrites a file unless EXPECTTEST_ACCEPT is set."""

from __future__ import annotations

from pathlib import Path

import pytest

from test_suite.golden import assert_golden


def test_difference_fails_and_keeps_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("EXPECTTEST_ACCEPT", raising=False)
    golden = tmp_path / "g.txt"
    golden.write_text("a\nb\n")
    with pytest.raises(pytest.fail.Exception, match=r"(?s)g\.txt differs.*-b\n\+c"):
        assert_golden(golden, "a\nc\n")
    assert golden.read_text() == "a\nb\n"
    assert_golden(golden, "a\nb\n")


def test_missing_file_fails(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("EXPECTTEST_ACCEPT", raising=False)
    with pytest.raises(AssertionError, match="EXPECTTEST_ACCEPT=1 to create it"):
        assert_golden(tmp_path / "missing.txt", "x")
    assert not (tmp_path / "missing.txt").exists()


def test_accept_rewrites(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EXPECTTEST_ACCEPT", "1")
    golden = tmp_path / "sub" / "g.txt"
    assert_golden(golden, "new\n")
    assert golden.read_text() == "new\n"
