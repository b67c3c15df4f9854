"""Finding hsa/ (env var, installed package data, editable checkout) and refusing bad manifests and
code objects: paths outside the folder, hash mismatches, wrong archs, layouts that disagree."""
import copy
import gzip
import hashlib
import json
import pathlib
import shutil
import subprocess
import sys

import pytest

from fmha_rt.runtime import registry as reg_mod
from fmha_rt.errors import FmhaRuntimeError, FmhaValueError

REPO = pathlib.Path(__file__).resolve().parents[2]
COMMITTED = REPO / "hsa"


@pytest.fixture(autouse=True)
def fresh_registry(monkeypatch):
    monkeypatch.delenv("FMHA_RT_ASM_DIR", raising=False)
    reg_mod.reset()
    yield
    reg_mod.reset()


def selftest_copy(tmp_path, mutate=None):
    """A private hsa folder with the committed self-test kernels; `mutate(manifest, root)` edits it."""
    manifest = json.loads((COMMITTED / "manifest.json").read_text())
    manifest["kernels"] = [k for k in manifest["kernels"] if k["family"] == "selftest"]
    root = tmp_path / "hsa"
    for k in manifest["kernels"]:
        (root / k["file"]).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(COMMITTED / k["file"], root / k["file"])
    if mutate:
        mutate(manifest, root)
    (root / "manifest.json").write_text(json.dumps(manifest))
    return root


def first(manifest, arch="sm_90", key="selftest_axpy_f32"):
    return next(k for k in manifest["kernels"] if k["arch"] == arch and k["key"] == key)


def test_every_committed_code_object_passes_its_checks():
    from fmha_rt.runtime.abi_check import check_all

    reg = reg_mod.Registry(COMMITTED)
    per_arch, problems = check_all(reg)
    assert problems == []
    assert set(per_arch) == {"sm_90", "gfx942", "gfx950"}


def test_editable_checkout_finds_the_repository_hsa():
    assert reg_mod.registry().root == COMMITTED


def test_env_var_comes_first(tmp_path, monkeypatch):
    root = selftest_copy(tmp_path)
    monkeypatch.setenv("FMHA_RT_ASM_DIR", str(root))
    reg = reg_mod.registry()
    assert reg.root == root
    entry = reg.entry("sm_90", "selftest_axpy_f32")
    assert reg.image(entry)[:4] == b"\x7fELF"


def test_nothing_found_lists_the_paths_searched(tmp_path, monkeypatch):
    monkeypatch.setenv("FMHA_RT_ASM_DIR", str(tmp_path / "nowhere"))
    monkeypatch.setattr(reg_mod, "PACKAGE_DIR", tmp_path / "pkg")
    with pytest.raises(FmhaRuntimeError) as info:
        reg_mod.registry()
    assert str(tmp_path / "nowhere") in str(info.value) and str(tmp_path / "pkg" / "hsa") in str(info.value)


def test_unknown_arch_lists_the_archs_available(tmp_path):
    reg = reg_mod.Registry(selftest_copy(tmp_path))
    with pytest.raises(FmhaRuntimeError, match="archs there: gfx942, gfx950, sm_90"):
        reg.entry("gfx1100", "selftest_axpy_f32")


@pytest.mark.parametrize("name", ["/etc/passwd", "../outside.cubin.gz", "sm_90/../../x", "", "\\\\host\\share"])
def test_file_names_must_stay_inside_hsa(tmp_path, name):
    def mutate(m, root):
        first(m)["file"] = name
    with pytest.raises(FmhaValueError, match="manifest file name"):
        reg_mod.Registry(selftest_copy(tmp_path, mutate))


def test_symlink_escaping_hsa_is_refused(tmp_path):
    outside = tmp_path / "outside.cubin.gz"
    outside.write_bytes(b"x")

    def mutate(m, root):
        (root / "sm_90" / "link.gz").symlink_to(outside)
        first(m)["file"] = "sm_90/link.gz"
    with pytest.raises(FmhaValueError, match="resolves outside"):
        reg_mod.Registry(selftest_copy(tmp_path, mutate))


def test_sha256_mismatch_is_refused(tmp_path):
    def mutate(m, root):
        path = root / first(m)["file"]
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))
    reg = reg_mod.Registry(selftest_copy(tmp_path, mutate))
    with pytest.raises(FmhaValueError, match="sha256 .* differs from the manifest"):
        reg.image(reg.entry("sm_90", "selftest_axpy_f32"))


def rewrite(root, entry, data):
    stored = gzip.compress(data, mtime=0)
    (root / entry["file"]).write_bytes(stored)
    entry["sha256"] = hashlib.sha256(stored).hexdigest()


def test_code_object_of_another_arch_is_refused(tmp_path):
    def mutate(m, root):
        amd = first(m, arch="gfx942")
        rewrite(root, first(m), gzip.decompress((root / amd["file"]).read_bytes()))
    reg = reg_mod.Registry(selftest_copy(tmp_path, mutate))
    with pytest.raises(FmhaValueError, match="built for gfx942"):
        reg.image(reg.entry("sm_90", "selftest_axpy_f32"))


@pytest.mark.parametrize("arch", ["sm_90", "gfx942"])
def test_layout_disagreeing_with_the_binary_is_refused(tmp_path, arch):
    def mutate(m, root):
        params = first(m, arch=arch)["params"]
        params[3]["offset"] += 4  # alpha moved: the binary says otherwise
        params[4]["offset"] += 4
    reg = reg_mod.Registry(selftest_copy(tmp_path, mutate))
    with pytest.raises(FmhaValueError, match="layout disagrees with the manifest"):
        reg.image(reg.entry(arch, "selftest_axpy_f32"))


@pytest.mark.parametrize("cut", [0, 16, 64, 1000])
def test_truncated_code_object_is_refused(tmp_path, cut):
    def mutate(m, root):
        entry = first(m)
        rewrite(root, entry, gzip.decompress((root / entry["file"]).read_bytes())[:cut])
    reg = reg_mod.Registry(selftest_copy(tmp_path, mutate))
    with pytest.raises(FmhaValueError):
        reg.image(reg.entry("sm_90", "selftest_axpy_f32"))


@pytest.mark.parametrize("field,value", [("threads", 10**6), ("shared", 2**40), ("param_bytes", 2**31),
                                         ("threads", "many"), ("params", None)])
def test_hostile_sizes_and_types_are_refused(tmp_path, field, value):
    def mutate(m, root):
        first(m)[field] = value
    with pytest.raises(FmhaValueError):
        reg_mod.Registry(selftest_copy(tmp_path, mutate))


def test_duplicate_and_foreign_manifests_are_refused(tmp_path):
    def dup(m, root):
        m["kernels"].append(copy.deepcopy(first(m)))
    with pytest.raises(FmhaValueError, match="appears twice"):
        reg_mod.Registry(selftest_copy(tmp_path, dup))
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "manifest.json").write_text(json.dumps({"format": 99, "kernels": []}))
    with pytest.raises(FmhaValueError, match="not a format-1"):
        reg_mod.Registry(tmp_path / "other")


def test_installed_wheel_carries_its_code_objects(tmp_path):
    """A real, non-editable `pip install` into a fresh virtual environment: the installed package
    finds its own copy of hsa/ from any working directory."""
    venv = tmp_path / "venv"
    # The venv borrows this interpreter's pip and setuptools (system site packages): nothing is downloaded.
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)], check=True)
    py = venv / "bin" / "python"
    build = tmp_path / "src"
    shutil.copytree(REPO, build, ignore=shutil.ignore_patterns(".git", "*.so", "build", "*.egg-info", "__pycache__"))
    subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-build-isolation", "--no-deps", str(build)],
                   check=True, cwd=tmp_path)
    probe = ("import fmha_rt, fmha_rt.runtime.registry as r; reg = r.registry(); "
             "print(reg.root); print(len(reg.entries)); print(fmha_rt.__file__)")
    done = subprocess.run([str(py), "-c", probe], check=True, capture_output=True, text=True, cwd=tmp_path,
                          env={"PATH": "/usr/bin:/bin"})
    root, count, package = done.stdout.split()
    assert pathlib.Path(root) == pathlib.Path(package).parent / "hsa"
    assert str(venv) in root
    assert int(count) == len(json.loads((COMMITTED / "manifest.json").read_text())["kernels"])
