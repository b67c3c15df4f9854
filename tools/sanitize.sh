#!/usr/bin/env bash
# Runs tools/sanitize_sweep.py (every kernel family once, small shapes, results checked against the
# float64 reference) under compute-sanitizer's memcheck, racecheck and initcheck, and prints one line per
# tool with its error count. Exits non-zero when any tool reports an error or the sweep itself fails.
#
#   tools/sanitize.sh                 # all three tools
#   tools/sanitize.sh memcheck        # some of them
#
# COMPUTE_SANITIZER names the binary (default: compute-sanitizer on PATH, else under CUDA_HOME or
# /usr/local/cuda); SANITIZE_LOG_DIR keeps the full logs (default: a new temporary folder);
# SANITIZE_TIMEOUT bounds each tool's run in seconds (default 1800).
set -uo pipefail
cd "$(dirname "$0")/.."

sanitizer=${COMPUTE_SANITIZER:-}
if [ -z "$sanitizer" ]; then
    for candidate in "$(command -v compute-sanitizer || true)" "${CUDA_HOME:-/usr/local/cuda}/bin/compute-sanitizer" \
                     /usr/local/cuda/bin/compute-sanitizer; do
        if [ -n "$candidate" ] && [ -x "$candidate" ]; then sanitizer=$candidate; break; fi
    done
fi
if [ -z "$sanitizer" ]; then
    echo "compute-sanitizer not found: install the CUDA toolkit or set COMPUTE_SANITIZER" >&2
    exit 2
fi

tools=("$@")
[ ${#tools[@]} -gt 0 ] || tools=(memcheck racecheck initcheck)
logs=${SANITIZE_LOG_DIR:-$(mktemp -d)}
mkdir -p "$logs"
# One driver allocation per tensor: an access past a tensor's end then leaves its allocation, which
# memcheck sees, instead of landing inside a larger cached block.
export PYTORCH_NO_CUDA_MEMORY_CACHING=1

failed=0
for tool in "${tools[@]}"; do
    log="$logs/$tool.log"
    started=$(date +%s)
    timeout "${SANITIZE_TIMEOUT:-1800}" "$sanitizer" --tool "$tool" --error-exitcode 1 \
        python3 tools/sanitize_sweep.py >"$log" 2>&1
    status=$?
    errors=$(grep -Eo 'ERROR SUMMARY: [0-9]+' "$log" | tail -n 1 | grep -Eo '[0-9]+$')
    hazards=$(grep -Eo 'RACECHECK SUMMARY: .*' "$log" | tail -n 1)
    # racecheck prints no ERROR SUMMARY: its count is the "(N errors, M warnings)" of its own summary
    [ -z "$errors" ] && [ -n "$hazards" ] && errors=$(grep -Eo '\([0-9]+ errors' <<<"$hazards" | grep -Eo '[0-9]+')
    sweep=$(grep -E '^sweep: ' "$log" | tail -n 1)
    [ "$status" -eq 124 ] && sweep="timed out after ${SANITIZE_TIMEOUT:-1800} s"
    printf '%-9s errors: %-4s exit: %-3s %4ss  %s%s  (log: %s)\n' "$tool" "${errors:-?}" "$status" \
        "$(( $(date +%s) - started ))" "${sweep:-the sweep did not finish}" "${hazards:+; $hazards}" "$log"
    if [ "$status" -ne 0 ] || [ "${errors:-1}" != 0 ]; then failed=1; fi
done
exit "$failed"
