#!/usr/bin/env bash
# The full test suite: bootstrap .venv (Python 3.11: the torch pinned by patches/base.json + test deps) and
# the patched torch, then run the lint and docs checks of the series, the harness tests (test_suite/) and
# the upstream test files the series adds or changes (in one pytest session) and the
# peer suite (`peer-tests`: PyTorch's tests of the touched modules, the series vs pristine torch), on
# Python 3.11 only: the oldest Python the pinned torch supports (no older Python is tested any more); the
# workflow's upstream-tests matrix (ci/workflows/ci.yml) runs the upstream tests on 3.11, 3.12 and 3.13.
# Each stage's time and exit status are printed in a table at the end.
set -uo pipefail
cd "$(dirname "$0")/.."
# .venv holds the registry's CUDA build of torch (about 5.4 GB with its nvidia-* wheels); setup refuses to
# create it with less than 7 GB free: say what is free.
df -h . | awk 'NR == 2 {print "free disk: " $4 " of " $2}'
stages=()
record() {  # record NAME SECONDS EXIT-STATUS: one row of the stage table
    stages+=("$(printf '%-34s %6d s   exit %d' "$1" "$2" "$3")")
}
stage() {  # stage NAME COMMAND...: run COMMAND in the foreground, record its time and exit status
    local name=$1 t0=$SECONDS rc
    shift
    "$@"
    rc=$?
    record "$name" $((SECONDS - t0)) "$rc"
    return "$rc"
}
print_stages() {
    echo "===== stages (wall time; the peer suite ran beside the foreground stages) ====="
    printf '%s\n' "${stages[@]}"
    echo "total                              $(printf '%6d' "$SECONDS") s"
}
trap print_stages EXIT
stage "setup" python3 -m scripts.series setup || exit $?
status=0
# The peer suite: PyTorch's own tests of the modules the series touches (../shared/upstream-tests,
# selection.txt), the series with the flag forced on, compared test by test with pristine torch: the checked-in
# baseline ci/peer-baseline.json, or a pristine run (beside it, --jobs 2) for each file whose baseline key (its
# hash, its selection line, the other stored files, the venv's test packages) differs. It runs in the background
# beside the stages below (they share the 2 cores); its log is printed when it ends. The flag-off configuration
# (`peer-tests` with no --configs runs pristine, off and on) is not run here: off and on each take about 40
# minutes of one core on a slow 2-core machine, and both beside test_suite/ do not fit in CI's hour; with the
# flag off the series' code is inert (test_differential.py compiles the same artifacts as the fixes-only torch
# in every run), and the flag-off peer run is done by hand for each series (docs/peer-suite.md). Where no stored test files are found the command exits 3 and the suite is reported as skipped, loudly,
# without failing the run.
mkdir -p build/ci
rm -f build/ci/peer-tests.rc  # a status left by an earlier run must not stand for this one
peer_log=build/ci/peer-tests.log
peer_t0=$SECONDS
(
    python3 -m scripts.series peer-tests --configs pristine,on --jobs 2 >"$peer_log" 2>&1
    echo $? >build/ci/peer-tests.rc
) &
peer_pid=$!
echo "peer suite: running in the background (log $peer_log)"
stage "lint" python3 -m scripts.lint || status=1
stage "docs check" python3 -m scripts.docs_check || status=1
stage "test_suite (pytest)" .venv/bin/python -m pytest test_suite "$@" || status=1
# The upstream tests in one pytest session, as PyTorch's CI runs them (run_test.py); the workflow's matrix also runs
# them file by file (`python test/...py`). Running both here would run every test twice on the same 2 cores.
stage "upstream tests (pytest)" python3 -m scripts.series upstream-tests --pytest || status=1
# Every prefix of the series merges on its own, PR by PR (`check-prefixes --quick`): patches 1..k apply exactly to
# pristine torch, lint clean, import with torch.fx's public API marked @compatibility, and pass the tests patch k adds
# or changes. The full form (every test file and the related peer files at every prefix) is run by hand.
stage "check-prefixes --quick" python3 -m scripts.series check-prefixes --quick || status=1
wait "$peer_pid"
record "peer suite (background)" $((SECONDS - peer_t0)) "$(cat build/ci/peer-tests.rc 2>/dev/null || echo 1)"
echo "===== peer suite log ($peer_log) ====="
cat "$peer_log"
rc=$(cat build/ci/peer-tests.rc 2>/dev/null || echo 1)
if [ "$rc" -eq 3 ]; then
    echo "!!!!! PEER SUITE SKIPPED: no stored upstream test files (../shared/upstream-tests) on this machine; see the error above !!!!!"
elif [ "$rc" -ne 0 ]; then
    status=1
fi
exit $status
