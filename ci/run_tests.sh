#!/usr/bin/env bash
# The full test suite: bootstrap .venv (Python 3.11: the torch pinned by patches/base.json + test deps) and
# the patched torch, then run the lint and docs checks of the series, the harness tests (test_suite/) and
# the upstream test files the series adds or changes (each file run by itself, then all under pytest) and the
# peer suite (`peer-tests`: PyTorch's tests of the touched modules, pristine vs the series), on
# Python 3.11 only: the oldest Python the pinned torch supports (no older Python is tested any more); the
# workflow's upstream-tests matrix (ci/workflows/ci.yml) runs the upstream tests on 3.11, 3.12 and 3.13.
set -uo pipefail
cd "$(dirname "$0")/.."
# .venv holds the registry's CUDA build of torch (about 5.4 GB with its nvidia-* wheels); setup refuses to
# create it with less than 7 GB free: say what is free.
df -h . | awk 'NR == 2 {print "free disk: " $4 " of " $2}'
python3 -m scripts.series setup || exit $?
status=0
python3 -m scripts.lint || status=1
python3 -m scripts.docs_check || status=1
.venv/bin/python -m pytest test_suite "$@" || status=1
python3 -m scripts.series upstream-tests || status=1
python3 -m scripts.series upstream-tests --pytest || status=1
# Every prefix of the series merges on its own, PR by PR (`check-prefixes --quick`): patches 1..k apply exactly to
# pristine torch, lint clean, import with torch.fx's public API marked @compatibility, and pass the tests patch k adds
# or changes. The full form (every test file and the related peer files at every prefix) is run by hand.
python3 -m scripts.series check-prefixes --quick || status=1
# The peer suite: PyTorch's own tests of the modules the series touches, pristine torch vs the series (flag off,
# flag on), test by test. Its test files are not in the repository (../shared/upstream-tests); where none are
# found the command exits 3 and the suite is reported as skipped, loudly, without failing the run.
python3 -m scripts.series peer-tests
rc=$?
if [ "$rc" -eq 3 ]; then
    echo "!!!!! PEER SUITE SKIPPED: no stored upstream test files (../shared/upstream-tests) on this machine; see the error above !!!!!"
elif [ "$rc" -ne 0 ]; then
    status=1
fi
exit $status
