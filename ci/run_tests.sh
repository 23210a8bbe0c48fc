#!/usr/bin/env bash
# The full test suite: bootstrap .venv (pinned torch + test deps) and the patched torch, then run
# the harness tests (test_suite/) and the upstream test files the series adds or changes.
set -uo pipefail
cd "$(dirname "$0")/.."
python3 -m scripts.series setup || exit $?
status=0
.venv/bin/python -m pytest test_suite "$@" || status=1
python3 -m scripts.series upstream-tests || status=1
exit $status
