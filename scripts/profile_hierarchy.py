"""Profile a model by its call hierarchy: ``python -m scripts.profile_hierarchy --help``."""

from scripts.hierarchy_profiler.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
