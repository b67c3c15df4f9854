"""`python -m fmha_rt check`'s source checks: the tree as committed passes, and a mismatch planted in a
temporary copy (never in the tree) is caught and named: a Python call into the shim with a wrong
argument count or to an undeclared function, an XLA-handler call with a wrong count, a launch-program
constant that differs between Python and C, and a manifest parameter that is not what the plan packs."""
import dataclasses
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

from fmha_rt.runtime import registry as registry_module
from fmha_rt.plan.abi import SIGNATURES
from fmha_rt.runtime.registry import SCRATCH_POINTERS, registry
from fmha_rt.source_check import check_sources, planned_slots

ROOT = pathlib.Path(__file__).resolve().parents[2]


def kernels():
    registry_module.reset()
    return list(registry().entries.values())


def source_copy(tmp_path) -> pathlib.Path:
    """The package (with its built shim) and include/ copied under tmp_path."""
    shutil.copytree(ROOT / "fmha_rt", tmp_path / "fmha_rt", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(ROOT / "include", tmp_path / "include")
    return tmp_path


def plant(path: pathlib.Path, old: str, new: str):
    text = path.read_text()
    assert text.count(old) == 1, f"{old!r} is not once in {path}"
    path.write_text(text.replace(old, new))


def test_the_committed_tree_passes():
    entries = kernels()
    planned = sum(e.family in ("portable", "v3") for e in entries)
    lines, ok = check_sources(ROOT, entries, SIGNATURES, SCRATCH_POINTERS)
    assert ok and len(lines) == 1 and lines[0].startswith("source ABI checks: all pass ("), lines
    assert f", 7 launch-program constants, {planned} planned kernel signatures against the manifest)" in lines[0]
    assert planned > 600


def test_every_planted_source_mismatch_is_named(tmp_path):
    root = source_copy(tmp_path)
    plant(root / "fmha_rt" / "runtime" / "backend.py", "lib.fmha_device_get_info(ordinal, info)",
          "lib.fmha_device_get_info(ordinal, info, 0)")
    plant(root / "fmha_rt" / "runtime" / "backend.py", "return ffi.string(lib.fmha_last_error())",
          "return ffi.string(lib.fmha_last_errors())")
    plant(root / "fmha_rt" / "csrc" / "xla_ffi.c", "p->label, fmha_last_error());", "p->label, fmha_last_error(0));")
    plant(root / "fmha_rt" / "csrc" / "program.h", "#define PROGRAM_FORMAT 3", "#define PROGRAM_FORMAT 4")
    lines, ok = check_sources(root, kernels(), SIGNATURES, SCRATCH_POINTERS)
    assert not ok and lines[0].startswith("source ABI checks: 4 FAIL ("), lines
    assert sorted(lines[1:]) == sorted([
        "  FAIL fmha_rt/runtime/backend.py:54: fmha_last_errors is not declared in include/fmha_rt.h",
        "  FAIL fmha_rt/runtime/backend.py:82: fmha_device_get_info with 3 argument(s); include/fmha_rt.h declares 2",
        "  FAIL fmha_rt/csrc/xla_ffi.c:151: fmha_last_error with 1 argument(s); include/fmha_rt.h declares 0",
        "  FAIL launch program: fmha_rt/replay/program.py FORMAT = 0x3 but fmha_rt/csrc/program.h PROGRAM_FORMAT = 0x4",
    ])


def test_a_header_prototype_changed_under_its_callers_is_caught(tmp_path):
    root = source_copy(tmp_path)
    plant(root / "include" / "fmha_rt.h", "int fmha_device_get_info(int ordinal, fmha_device_info *info);",
          "int fmha_device_get_info(int ordinal, int flags, fmha_device_info *info);")
    lines, ok = check_sources(root, kernels(), SIGNATURES, SCRATCH_POINTERS)
    assert not ok and lines[1:] == [
        "  FAIL fmha_rt/runtime/backend.py:82: fmha_device_get_info with 2 argument(s); include/fmha_rt.h declares 3"]


def test_a_manifest_parameter_that_the_plan_does_not_pack_is_caught():
    entries = kernels()
    portable = next(e for e in entries if e.family == "portable" and e.symbol == "fmha_fwd")
    v3 = next(e for e in entries if e.family == "v3" and e.symbol == "fmha_bwd_dkdv")
    slots = list(portable.params)
    i = next(n for n, s in enumerate(slots) if s.type == "i32")  # same size: the binary's layout still agrees
    slots[i] = dataclasses.replace(slots[i], type="f32")
    swapped = list(v3.params)
    swapped[0], swapped[1] = swapped[1], swapped[0]
    planted = [dataclasses.replace(portable, params=tuple(slots)), dataclasses.replace(v3, params=tuple(swapped)),
               dataclasses.replace(portable, symbol="fmha_fwd_renamed")]
    lines, ok = check_sources(ROOT, planted, SIGNATURES, SCRATCH_POINTERS)
    name = slots[i].name
    assert not ok and lines[1:] == [
        f"  FAIL {portable.arch}/{portable.key}: parameter {i} is ('{name}', 'f32') in the manifest, the plan packs "
        f"('{name}', 'i32')",
        f"  FAIL {v3.arch}/{v3.key}: parameter 0 is ('{swapped[0].name}', 'ptr') in the manifest, the plan packs "
        f"('{swapped[1].name}', 'ptr')",
        f"  FAIL {portable.arch}/{portable.key}: function fmha_fwd_renamed has no planned signature",
    ]
    assert [(s.name, s.type) for s in portable.params if s.name not in SCRATCH_POINTERS] == planned_slots(SIGNATURES["fmha_fwd"])


@pytest.mark.parametrize("planted", [False, True])
def test_the_command_exits_1_naming_a_planted_mismatch(tmp_path, planted):
    root = source_copy(tmp_path)
    if planted:
        plant(root / "fmha_rt" / "replay" / "program.py", "MAX_LAUNCHES = 16", "MAX_LAUNCHES = 17")
    env = dict(os.environ, PYTHONPATH=str(root), FMHA_RT_ASM_DIR=str(ROOT / "hsa"))
    done = subprocess.run([sys.executable, "-m", "fmha_rt", "check"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)
    assert "Traceback" not in done.stderr, done.stderr
    if planted:
        assert done.returncode == 1 and done.stdout.splitlines()[-1] == (
            "  FAIL launch program: fmha_rt/replay/program.py MAX_LAUNCHES = 0x11"
            " but fmha_rt/csrc/program.h MAX_LAUNCHES = 0x10")
    else:
        assert done.returncode == 0 and "source ABI checks: all pass" in done.stdout, done.stdout
