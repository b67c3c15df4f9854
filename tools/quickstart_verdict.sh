#!/usr/bin/env bash
# Judges one run of `python -m fmha_rt quickstart`: quickstart_verdict.sh OUTPUT_FILE EXIT_STATUS.
# It must print no traceback and pass the code-object checks; then on a machine without a GPU it must
# exit 2 with its last line saying what needs the GPU, and on a GPU exit 0 with no FAIL line.
set -euo pipefail
output=$1 status=$2
fail() { echo "quickstart: $*" >&2; exit 1; }
cat "$output"
grep -q "Traceback" "$output" && fail "it printed a traceback"
grep -q "^ABI checks: all pass" "$output" || fail "it did not pass the code-object checks"
case "$status" in
    0) grep -q "FAIL" "$output" && fail "it exited 0 with a FAIL line" ;;
    2) tail -n 1 "$output" | grep -q "^GPU: .* needs a GPU, and " \
           || fail "it exited 2 without its one line saying what needs the GPU" ;;
    *) fail "it failed (exit $status)" ;;
esac
exit 0
