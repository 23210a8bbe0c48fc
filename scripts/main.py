"""Main job: bootstrap .venv with the patched torch, then run scripts.profile_hierarchy.

Usage: python3 scripts/main.py [arguments for scripts.profile_hierarchy]

It runs from any directory: ``--model module:factory`` is imported from the caller's current
directory (and the caller's ``PYTHONPATH``), a relative ``--out`` is relative to it, and the
default output directory is ``<repository>/build/profile_hierarchy``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from scripts import series


def child_command(cwd: Path, environ: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    """The command line and environment that run the profiler in ``.venv`` from ``cwd``.

    ``-P`` keeps the current directory off the front of ``sys.path``, so that a ``scripts``
    package of the caller's cannot shadow this repository's; ``PYTHONPATH`` puts the
    repository first, then the caller's directory (their ``module:factory``), then theirs.
    """
    python = ROOT / ".venv" / "bin" / "python"
    paths = [str(ROOT), str(cwd), *filter(None, environ.get("PYTHONPATH", "").split(os.pathsep))]
    env = dict(environ, PYTHONPATH=os.pathsep.join(paths))
    return [str(python), "-P", "-m", "scripts.profile_hierarchy"], env


def main() -> int:
    try:
        print(series.setup(series.Layout(ROOT)), flush=True)
    except series.SeriesError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:  # Ctrl-C while .venv is set up: no traceback
        print("error: interrupted (Ctrl-C)", file=sys.stderr)
        return 130
    argv, env = child_command(Path.cwd(), dict(os.environ))
    os.execve(argv[0], [*argv, *sys.argv[1:]], env)


if __name__ == "__main__":
    sys.exit(main())
