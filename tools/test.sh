#!/usr/bin/env bash
# The test command of README: installs the pinned test and lint tools and the project, then runs the
# lint and the CPU tests. Every CPU test file must run: a test file skipped because a package is
# missing fails the run (FMHA_RT_TESTS_NEED_ALL_PACKAGES, tests/cpu/conftest.py).
#
# The project is installed with --no-build-isolation after jax: the XLA FFI handler of fmha_rt.jax is
# compiled against the installed jaxlib's header (fmha_rt/shim_build.py), which an isolated build
# environment would not have. Extra pytest arguments are passed on (e.g. tools/test.sh -x -k jax).
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1
pip_install() { python3 -m pip install -q -c tools/test-constraints.txt "$@"; }

pip_install "setuptools>=64" wheel "cffi>=1.15" pycparser jax jaxlib   # what the build itself needs
pip_install --no-build-isolation -e '.[test]'
python3 -m fmha_rt info || true   # what this machine has (the tests need no GPU)
python3 -m ruff check .
FMHA_RT_TESTS_NEED_ALL_PACKAGES=1 python3 -m pytest -q -p no:cacheprovider tests/cpu "$@"
