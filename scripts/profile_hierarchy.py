"""Profile a model by its call hierarchy: ``python -m scripts.profile_hierarchy --help``."""

import sys

if __name__ == "__main__":
    try:  # importing torch takes seconds: a Ctrl-C then is no error of the profiler's either
        from scripts.hierarchy_profiler.cli import main
    except KeyboardInterrupt:
        print("error: interrupted (Ctrl-C); nothing was written", file=sys.stderr)
        raise SystemExit(130) from None
    raise SystemExit(main())
