"""Build the series' docs pages and the docstrings they autodoc with Sphinx -W.

Usage: python3 -m scripts.docs_check [--venv .venv] [--keep DIR]   (from the repository root)

Takes the docs/source/ files the patches add, puts them in a small Sphinx project (ci/docs:
conf.py with MyST and autodoc, an index whose toctree mirrors upstream's torch.compiler.md),
and builds HTML with the venv's Python, whose torch has the series installed, so
`automodule:: torch.fx.call_hierarchy` documents the patched module. Any warning fails.
"""

import argparse
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
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
