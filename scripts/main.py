"""Main job: bootstrap .venv with the patched torch, then run scripts.profile_hierarchy.

Usage: python3 scripts/main.py [arguments for scripts.profile_hierarchy]
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from scripts import series


def main() -> int:
    try:
        print(series.setup(series.Layout(ROOT)), flush=True)
    except series.SeriesError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    python = ROOT / ".venv" / "bin" / "python"
    os.chdir(ROOT)
    os.execv(python, [str(python), "-m", "scripts.profile_hierarchy", *sys.argv[1:]])


if __name__ == "__main__":
    sys.exit(main())
