"""Build the series' docs pages with Sphinx -W, and check this repository's own pages.

Usage: python3 -m scripts.docs_check [--venv .venv] [--keep DIR]   (from the repository root)

Takes the docs/source/ files the patches add, puts them in a small Sphinx project (ci/docs:
conf.py with MyST and autodoc, an index whose toctree mirrors upstream's torch.compiler.md),
and builds HTML with the venv's Python, whose torch has the series installed, so
`automodule:: torch.fx.call_hierarchy` documents the patched module. Any warning fails.

README.md and the docs/*.md pages it links are checked against the repository: every relative
link resolves (file and heading), every docs/ page is linked from README.md, every path under
scripts/, test_suite/, ci/ or patches/ they name exists, and every `python3 -m scripts.series`
subcommand they show is one the workbench has.
"""

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from scripts import series

ROOT = Path(__file__).resolve().parent.parent
PROJECT = ROOT / "ci" / "docs"


def extract_docs(patches: list[series.Patch], dest: Path) -> list[str]:
    """Apply the docs/ parts of the patches to an empty tree; return the docs/source files."""
    series.init_repo(dest)
    for patch in patches:
        if not patch.paths("docs/"):
            continue
        proc = series.git(dest, "apply", "--include=docs/*", str(patch.path.resolve()), check=False,
                          env=series.isolated_env())
        if proc.returncode != 0:
            raise series.SeriesError(f"cannot extract the docs files of {patch.name} from the patches alone "
                                     f"(it changes an existing upstream page?): {proc.stderr.strip()}")
    return sorted(str(p.relative_to(dest)) for p in (dest / "docs" / "source").rglob("*") if p.is_file())


# Paths in backticks that must exist (outputs under build/ are not checked).
_REPO_PATH = re.compile(r"`((?:scripts|test_suite|ci|patches)/[\w./-]*\w)")
_LINK = re.compile(r"\]\(([^)\s]+)\)")
_SERIES_COMMAND = re.compile(r"python3 -m scripts\.series ([a-z][\w-]*)")


def heading_anchors(text: str) -> set[str]:
    """The anchors of a Markdown page's headings, as GitHub makes them."""
    anchors = set()
    for line in text.splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            anchors.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return anchors


def check_repository_pages(root: Path, commands: set[str]) -> list[str]:
    """What is wrong in README.md and the docs/*.md pages (see the module docstring)."""
    problems = []
    readme = root / "README.md"
    pages = [readme, *sorted((root / "docs").glob("*.md"))]
    linked: set[Path] = set()
    for page in pages:
        text = page.read_text()
        name = page.relative_to(root)
        for target in _LINK.findall(text):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            resolved = (page.parent / path).resolve() if path else page
            if not resolved.exists():
                problems.append(f"{name}: link to {target}: no such file")
                continue
            linked.add(resolved)
            if anchor and resolved.suffix == ".md" and anchor not in heading_anchors(resolved.read_text()):
                problems.append(f"{name}: link to {target}: no such heading")
        for path in _REPO_PATH.findall(text):
            if not any((root / path).parent.glob((root / path).name)):
                problems.append(f"{name}: names {path}, which does not exist")
        for command in _SERIES_COMMAND.findall(text):
            if command not in commands:
                problems.append(f"{name}: shows `python3 -m scripts.series {command}`, which is no subcommand")
    for page in pages[1:]:
        if page.resolve() not in linked:
            problems.append(f"{page.relative_to(root)} is not linked from README.md")
    return problems


def series_commands() -> set[str]:
    """The subcommands of `python3 -m scripts.series`."""
    from scripts.series import cli

    actions = [a for a in cli.parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return {name for action in actions for name in action.choices}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python3 -m scripts.docs_check", description=__doc__.split("\n\n")[0])
    ap.add_argument("--venv", type=Path, default=ROOT / ".venv", help="venv with Sphinx and the series installed")
    ap.add_argument("--keep", type=Path, default=None, help="build here and keep the HTML (default: a temp dir)")
    args = ap.parse_args(argv)
    python = args.venv / "bin" / "python"
    try:
        patches = series.load_series(ROOT / "patches")
        sp = series.site_packages(args.venv)
        state = series.install_state(sp, patches, series.Layout(ROOT).base()["torch_version"])
        if state.state != "current":
            raise series.SeriesError(f"the torch in {args.venv} is {state.state} ({state.detail}); "
                                     "run `python3 -m scripts.series install` first")
        with tempfile.TemporaryDirectory(prefix="rfc0051-docs-") as tmp_name:
            out = args.keep or Path(tmp_name)
            tree = Path(tmp_name) / "tree"
            pages = extract_docs(patches, tree)
            if not pages:
                raise series.SeriesError("the series adds no docs/source pages")
            src = tree / "docs" / "source"
            for name in ("conf.py", "index.md"):
                shutil.copyfile(PROJECT / name, src / name)
            proc = subprocess.run([str(python), "-m", "sphinx", "-W", "--keep-going", "-q", "-E", "-b", "html",
                                   "-d", str(out / "doctrees"), str(src), str(out / "html")],
                                  capture_output=True, text=True)
    except series.SeriesError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"docs check: {', '.join(pages)} with Sphinx -W: {'ok' if proc.returncode == 0 else 'FAILED'}")
    if proc.returncode != 0:
        print((proc.stdout + proc.stderr).strip())
    problems = check_repository_pages(ROOT, series_commands())
    print(f"docs check: README.md and docs/*.md against the repository: {'ok' if not problems else 'FAILED'}")
    for problem in problems:
        print(f"  {problem}")
    return proc.returncode or int(bool(problems))


if __name__ == "__main__":
    sys.exit(main())
