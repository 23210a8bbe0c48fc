"""The docs check's part that holds README.md and docs/*.md to the repository (scripts/docs_check.py)."""

from __future__ import annotations

from pathlib import Path

from scripts import docs_check

ROOT = Path(__file__).resolve().parent.parent


def test_the_repository_pages_are_true_to_the_code() -> None:
    assert docs_check.check_repository_pages(ROOT, docs_check.series_commands()) == []


def test_readme_reaches_every_moved_section() -> None:
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 200
    for page in sorted((ROOT / "docs").glob("*.md")):
        assert f"](docs/{page.name})" in readme, page.name


def test_each_kind_of_problem_is_reported(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "real.py").write_text("")
    (tmp_path / "README.md").write_text(
        "# Title\n\nSee [a](docs/a.md#no-such-heading), [b](docs/missing.md), [web](https://pytorch.org).\n"
        "Run `scripts/real.py`, not `scripts/gone.py`; `python3 -m scripts.series install`, "
        "`python3 -m scripts.series frobnicate`.\n")
    (tmp_path / "docs" / "a.md").write_text("# A page\n\n## Some heading\n\nBack to [README](../README.md#title).\n")
    (tmp_path / "docs" / "orphan.md").write_text("# Orphan\n")
    problems = docs_check.check_repository_pages(tmp_path, {"install"})
    assert problems == [
        "README.md: link to docs/a.md#no-such-heading: no such heading",
        "README.md: link to docs/missing.md: no such file",
        "README.md: names scripts/gone.py, which does not exist",
        "README.md: shows `python3 -m scripts.series frobnicate`, which is no subcommand",
        "docs/orphan.md is not linked from README.md",
    ]
    (tmp_path / "README.md").write_text("# Title\n\n[a](docs/a.md#some-heading), [o](docs/orphan.md)\n")
    assert docs_check.check_repository_pages(tmp_path, {"install"}) == []
