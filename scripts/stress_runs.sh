#!/usr/bin/env bash
# Repeat the tests that compare two runs, every other repetition with another process keeping one
# core busy, and count the repetitions that failed: a test that fails one run in five passes a
# single try 80% of the time, but 20 tries in a row only 1.2% of the time (0.8^20).
#   scripts/stress_runs.sh [REPS] [pytest args...]   (default: 20 reps of tests/test_train.py)
# Needs the project's .venv (bash run test creates it). Not part of the test suite: its cost is
# REPS times that of the selection (docs/testing.md).
set -euo pipefail
cd "$(dirname "$0")/.."
reps="${1:-20}"
[ $# -gt 0 ] && shift
[ $# -gt 0 ] || set -- tests/test_train.py
case "$reps" in ''|*[!0-9]*) echo "stress_runs.sh: REPS must be a number, got '$reps'" >&2; exit 2 ;; esac
python=.venv/bin/python
[ -x "$python" ] || { echo "stress_runs.sh: no .venv here: run 'bash run test' once first" >&2; exit 2; }

load_pid=""
stop_load() {
    if [ -n "$load_pid" ]; then
        kill "$load_pid" 2>/dev/null || true
        wait "$load_pid" 2>/dev/null || true  # a killed process's status is not a failure here
    fi
    load_pid=""
}
trap stop_load EXIT

logs=$(mktemp -d -t tailrl-stress.XXXXXX)
echo "each repetition's output: $logs/REP.log"
failed=0
for ((i = 1; i <= reps; i++)); do
    if ((i % 2 == 0)); then
        "$python" -c "while True: pass" &
        load_pid=$!
        what="loaded"
    else
        what="quiet"
    fi
    start=$SECONDS
    if "$python" -m pytest -q -p no:cacheprovider "$@" > "$logs/$i.log" 2>&1; then
        echo "rep $i/$reps ($what): passed in $((SECONDS - start)) s"
    else
        failed=$((failed + 1))
        echo "rep $i/$reps ($what): FAILED in $((SECONDS - start)) s: $(grep -E '^FAILED' "$logs/$i.log" | tr '\n' ' ')"
    fi
    stop_load
done
echo "$((reps - failed)) passed, $failed failed"
[ "$failed" -eq 0 ]
