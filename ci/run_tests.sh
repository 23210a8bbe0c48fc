#!/usr/bin/env bash
# The full test suite: bootstrap .venv (pinned torch + test deps) and the patched torch, then run
# the lint and docs checks of the series, the harness tests (test_suite/) and the upstream test
# files the series adds or changes (each file run by itself, then all under pytest), on Python 3.11
# and on 3.10 (the oldest Python torch 2.13 supports; its venv takes one to five minutes to create, its
# upstream tests about 2).
set -uo pipefail
cd "$(dirname "$0")/.."
# The venvs take about 6.5 GB (.venv 1.5 GB; the 3.10 venv, a CUDA build, 4.7 GB): say what is free.
df -h . | awk 'NR == 2 {print "free disk: " $4 " of " $2}'
python3 -m scripts.series setup || exit $?
status=0
python3 -m scripts.lint || status=1
python3 -m scripts.docs_check || status=1
.venv/bin/python -m pytest test_suite "$@" || status=1
python3 -m scripts.series upstream-tests || status=1
python3 -m scripts.series upstream-tests --pytest || status=1
{ python3 -m scripts.series setup --python 3.10 && python3 -m scripts.series upstream-tests --python 3.10 \
  && python3 -m scripts.series upstream-tests --python 3.10 --pytest; } || status=1
exit $status
