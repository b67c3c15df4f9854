#!/usr/bin/env bash
# README's two commands as a new user runs them: a fresh clone of this checkout's commit, a fresh
# virtualenv (no system site-packages; pip's download cache is used), then
#   1. python -m pip install -e '.[torch]' && python -m fmha_rt quickstart
#   2. ./tools/test.sh
# and their outputs checked: on a machine without a GPU the quickstart must check the code objects,
# end with its one line saying what needs the GPU and exit 2, with no traceback; on a GPU it must pass
# (exit 0). test.sh must pass with no test file skipped for a missing package (it fails otherwise).
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export PIP_DISABLE_PIP_VERSION_CHECK=1

git clone -q "$repo" "$work/clone"
python3 -m venv "$work/venv"
# shellcheck disable=SC1091
source "$work/venv/bin/activate"
cd "$work/clone"

fail() { echo "newcomer check: $*" >&2; exit 1; }

set +e
python -m pip install -q -e '.[torch]' && python -m fmha_rt quickstart >"$work/quickstart.out" 2>&1
status=$?
set -e
./tools/quickstart_verdict.sh "$work/quickstart.out" "$status" || fail "the install or the quickstart did not pass (above)"

./tools/test.sh
echo "newcomer check: both commands work from a fresh clone in a fresh virtualenv"
