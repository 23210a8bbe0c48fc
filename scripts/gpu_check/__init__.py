"""The GPU check of the series (issues 35 and 36) on a lent device machine: see docs/gpu-check.md."""
