#!/usr/bin/env bash
# Rebuild hsa/ (code objects + manifest.json) from kernels/ with the pinned Triton.
#   ./build_hsaco.sh                  full rebuild of every family for sm_90, gfx942, gfx950
#   ./build_hsaco.sh --family selftest --arch sm_90   rebuild a part, merged into hsa/
#   ./build_hsaco.sh --check          rebuild into a temporary folder; fail if any committed byte differs
set -euo pipefail
cd "$(dirname "$0")"
PYTHON=${PYTHON:-python3}
if ! "$PYTHON" -c 'import triton, sys; sys.exit(triton.__version__ != "3.6.0")' 2>/dev/null; then
  echo "build_hsaco.sh needs triton==3.6.0: pip install triton==3.6.0" >&2
  exit 2
fi
exec "$PYTHON" -m kernels.build "$@"
