#!/usr/bin/env bash
# One round of kernel work on a GPU machine, in one command: build the shim, run the GPU tests on this
# checkout's code objects, time builds against each other (bench/ab.py), then the benchmark grid of
# issue 30 with the peers (FA4 among them) and the host overhead on the user's path. Results go under $OUT (default out/gpu_round); a summary prints last.
#
#   bench/gpu_round.sh [NAME=PATH NAME=PATH ...]     two or more variants: the A/B runs, the first is the base
#
# Environment:
#   WHEELS=DIR   install the wheels in DIR first (machines without a package index: cffi, pycparser)
#   AB_FLAGS     the A/B's benchmark flags (default: backward, bf16, D=128, 4k and 16k, causal and not, GQA too);
#                several sets separated by ';' run one after the other, each with its own record (ab1.json, ...)
#   AB_ROUNDS    rounds of the A/B (default 2)
#   GRID=0       skip the grid; TESTS=0 skip the GPU tests; OVERHEAD=0 skip the host-overhead run
#   HDIMS        the grid's head dims (default "64 128 192 256"); a grid split in two runs (HDIMS="64 128", then
#                HDIMS=256 OUT=other) merges with `python -m fmha_rt bench --report A/grid/results.json
#                B/grid/results.json --out merged`, every ratio still within its own run
#   GRID_ROUNDS  rounds of the grid (default 5, a multiple of its 5 implementations)
#   GRID_REPEATS timed calls a turn (default 10: the whole grid in about 6 minutes on an H100/H200)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out/gpu_round}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if [ -n "${WHEELS:-}" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/fmha_rt_site "$WHEELS"/*.whl
  export PYTHONPATH=/tmp/fmha_rt_site${PYTHONPATH:+:$PYTHONPATH}
fi
python3 -m pip install -q --no-build-isolation --no-deps --no-index -e . > "$OUT/install.log" 2>&1 \
  || { tail -20 "$OUT/install.log"; exit 1; }
summary=()
if [ "${TESTS:-1}" != 0 ]; then
  python3 -m pytest -q -rs tests/gpu > "$OUT/gpu_tests.log" 2>&1 || true
  summary+=("GPU tests: $(tail -1 "$OUT/gpu_tests.log")")
fi
if [ $# -ge 2 ]; then
  variants=()
  for v in "$@"; do variants+=(--variant "$v"); done
  IFS=';' read -ra flag_sets <<< "${AB_FLAGS:---dtype bf16 --hdim 128 --seqlen 4k 16k --causal both --pass bwd --gqa 1 --varlen 0 --repeats 10}"
  n=0
  for flags in "${flag_sets[@]}"; do
    n=$((n + 1))
    # shellcheck disable=SC2086
    python3 bench/ab.py "${variants[@]}" --rounds "${AB_ROUNDS:-2}" --record "$OUT/ab$n.json" -- $flags \
      > "$OUT/ab$n.md" 2> "$OUT/ab$n.log" || { tail -20 "$OUT/ab$n.log"; exit 1; }
  done
fi
if [ "${GRID:-1}" != 0 ]; then
  # shellcheck disable=SC2086
  python3 -m fmha_rt bench --dtype bf16 --hdim ${HDIMS:-64 128 192 256} --seqlen 1k 4k 16k --causal both \
    --pass fwd bwd bwd_det --gqa 1 --varlen 0 --impl fmha_rt fa4 sdpa_cudnn sdpa_flash flex --no-extras \
    --repeats "${GRID_REPEATS:-10}" --rounds "${GRID_ROUNDS:-5}" --out "$OUT/grid" \
    > "$OUT/grid.log" 2>&1 || { tail -20 "$OUT/grid.log"; exit 1; }
  sed -n '/^## fmha_rt over the best peer/,/^## Machine/p' "$OUT/grid/results.md" | sed '$d' > "$OUT/grid_headline.md"
  # the report's comparison with each peer: its summary printed, the whole section (point by point) kept
  sed -n '/^## fmha_rt against each peer/,/^## Plots/p' "$OUT/grid/results.md" | sed '$d' > "$OUT/grid_vs_peers.md"
  summary+=("$(cat "$OUT/grid_headline.md")")
fi
if [ "${OVERHEAD:-1}" != 0 ]; then
  python3 -m fmha_rt bench --overhead-only --impl fmha_rt fa4 sdpa_cudnn sdpa_flash --rounds 5 --out "$OUT/overhead" \
    > "$OUT/overhead.log" 2>&1 || { tail -20 "$OUT/overhead.log"; exit 1; }
  summary+=("$(sed -n '/^## Host overhead/,/^## /p' "$OUT/overhead/results.md" | sed '$d')")
fi
for line in "${summary[@]}"; do echo "$line"; done
for f in "$OUT"/ab*.md; do [ -f "$f" ] && cat "$f"; done
exit 0
