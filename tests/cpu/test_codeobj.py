"""The code-object reader against real builds and against hostile input.

Real inputs: Triton kernels with mixed argument types compiled here for sm_90, gfx942 and gfx950, and
cubins assembled by the ptxas that ships with Triton (struct parameters, a parameter-less kernel, a device
function, a parameter bank over 4 KiB). Expected layouts come from the signatures (natural alignment,
Triton's two scratch pointers at the end) and, for cubins, from cuobjdump's own decoding.
Hostile inputs: every truncation, every single-bit flip of the structural bytes, random flips, random
bytes, and lying msgpack. Only FmhaValueError may come out; the case counts are printed at the end.
"""
import collections
import pathlib
import re
import struct
import subprocess

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fmha_rt.runtime.codeobj import CodeObject, KernelInfo, Param, compare_layout, decode_msgpack, read_code_object
from fmha_rt.errors import FmhaTypeError, FmhaValueError

triton = pytest.importorskip("triton")
tl = triton.language
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

NVIDIA_BIN = pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
CASES = collections.Counter()
FUZZ = settings(deadline=None, max_examples=300, suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture(scope="module", autouse=True)
def report_case_counts(request):
    yield
    line = "code object reader cases: " + ", ".join(f"{name} {count}" for name, count in sorted(CASES.items()))
    with request.config.pluginmanager.get_plugin("capturemanager").global_and_fixture_disabled():
        print("\n" + line)


# ----------------------------------------------------------------------------------- Triton builds
@triton.jit
def mixed_args(x_ptr, n, y_ptr, scale, BLOCK: tl.constexpr, big, out_ptr, m):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask)
    y = tl.load(y_ptr + offs, mask=mask).to(tl.float32)
    tl.store(out_ptr + offs, x * scale + y + big.to(tl.float32) + m, mask=mask)


@triton.jit
def scalars_first(a, b, SHIFT: tl.constexpr, c, d, out_ptr, e, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(out_ptr + offs, (a + b + c + d).to(tl.float32) * e + (offs >> SHIFT).to(tl.float32))


KERNELS = {
    "mixed_args": (mixed_args, {"x_ptr": "*fp32", "n": "i32", "y_ptr": "*fp16", "scale": "fp32",
                                "BLOCK": "constexpr", "big": "i64", "out_ptr": "*fp32", "m": "i32"},
                   {"BLOCK": 1024}),
    "scalars_first": (scalars_first, {"a": "i64", "b": "i32", "SHIFT": "constexpr", "c": "i32", "d": "i64",
                                      "out_ptr": "*fp32", "e": "fp32", "BLOCK": "constexpr"},
                      {"SHIFT": 2, "BLOCK": 256}),
}
TARGETS = {"sm_90": GPUTarget("cuda", 90, 32), "gfx942": GPUTarget("hip", "gfx942", 64),
           "gfx950": GPUTarget("hip", "gfx950", 64)}
SCALAR_BYTES = {"i32": 4, "i64": 8, "fp32": 4}
TRITON_SCRATCH_POINTERS = 2  # global_scratch and profile_scratch, appended after the kernel's own


def expected_slots(signature: dict) -> list[tuple[int, int, str]]:
    """(offset, size, HIP value kind) of each parameter: constexprs dropped, natural alignment."""
    kinds = [k for k in signature.values() if k != "constexpr"] + ["*scratch"] * TRITON_SCRATCH_POINTERS
    slots, end = [], 0
    for kind in kinds:
        size = 8 if kind.startswith("*") else SCALAR_BYTES[kind]
        offset = -(-end // size) * size
        slots.append((offset, size, "global_buffer" if kind.startswith("*") else "by_value"))
        end = offset + size
    return slots


@pytest.fixture(scope="module")
def built():
    """(kernel, arch) -> code object bytes, compiled once for the whole module."""
    objects = {}
    for key, (fn, signature, constexprs) in KERNELS.items():
        attrs = {(i,): [["tt.divisibility", 16]] for i, kind in enumerate(signature.values()) if kind[0] == "*"}
        for arch, target in TARGETS.items():
            compiled = triton.compile(ASTSource(fn, signature=signature, constexprs=constexprs, attrs=attrs),
                                      target=target, options={"num_warps": 4})
            assert compiled.metadata.name == key
            objects[key, arch] = compiled.asm["cubin" if arch.startswith("sm_") else "hsaco"]
    return objects


@pytest.mark.parametrize("arch", TARGETS)
@pytest.mark.parametrize("key", KERNELS)
def test_triton_layout_matches_signature(built, key, arch):
    obj = read_code_object(built[key, arch], name=f"{key}.{arch}")
    assert isinstance(obj, CodeObject)
    assert list(obj.kernels) == [key]
    info = obj.kernels[key]
    slots = expected_slots(KERNELS[key][1])
    assert [(p.ordinal, p.offset, p.size) for p in info.params] == [(i, o, s) for i, (o, s, _) in enumerate(slots)]
    assert info.param_bytes == slots[-1][0] + slots[-1][1]
    assert compare_layout(info, [(o, s) for o, s, _ in slots]) == []
    if arch == "sm_90":
        # Triton builds capability 9.0 as sm_90a (wgmma and TMA need the 'a' variant).
        assert (obj.vendor, obj.arch, obj.features) == ("cuda", "sm_90a", ())
        assert info.wavefront_size is None and info.max_threads == 4 * 32
        assert all(p.kind is None and p.name is None for p in info.params)
    else:
        assert (obj.vendor, obj.arch, obj.features) == ("hip", arch, ())
        assert info.wavefront_size == 64 and info.max_threads == 4 * 64
        assert [p.kind for p in info.params] == [kind for _, _, kind in slots]
        assert info.shared_bytes == 0  # Triton's buffers are dynamic LDS
    assert info.registers and info.registers > 0


def cuobjdump(data: bytes, tmp_path) -> str:
    tool = NVIDIA_BIN / "cuobjdump"
    if not tool.exists():
        pytest.skip("cuobjdump is not in this Triton wheel")
    path = tmp_path / "k.cubin"
    path.write_bytes(data)
    return subprocess.run([str(tool), "-elf", str(path)], check=True, capture_output=True, text=True).stdout


def test_cubins_agree_with_cuobjdump(built, ptxas_cubins, tmp_path):
    cubins = [built[key, "sm_90"] for key in KERNELS] + list(ptxas_cubins.values())
    for data in cubins:
        dump = cuobjdump(data, tmp_path)
        obj = read_code_object(data)
        assert obj.arch == "sm_" + re.search(r"sm=(\w+)", dump).group(1)
        for name, info in obj.kernels.items():
            section = dump.split(f"\n.nv.info.{name}\n")[1].split("\n\n")[0]
            params = sorted(tuple(int(v, 16) for v in m) for m in
                            re.findall(r"Ordinal : 0x(\w+)\s+Offset\s+: 0x(\w+)\s+Size\s+: 0x(\w+)", section))
            assert [(p.ordinal, p.offset, p.size) for p in info.params] == params
            bank = re.search(r"EIATTR_PARAM_CBANK\s+Format:\s+\w+\s+Value:\s+0x\w+ 0x(\w+)", section)
            # The bank record's second word: size in the high half, start offset in the low half.
            assert info.param_bytes == (int(bank.group(1), 16) >> 16 if bank else None)
            registers = re.search(rf"function: {re.escape(name)}\(0x\w+\)\s+register count: (\d+)", dump)
            assert info.registers == int(registers.group(1))


# ------------------------------------------------------------------------------ ptxas-built cubins
PTX_HEAD = ".version 8.1\n.target {target}\n.address_size 64\n"
PTX_STRUCT_PARAMS = """
.visible .func (.param .b32 r) plus_one(.param .b32 a)
{ .reg .b32 %r<3>; ld.param.b32 %r1, [a]; add.s32 %r2, %r1, 1; st.param.b32 [r], %r2; ret; }
.visible .entry with_struct(.param .u64 .ptr .global .align 8 p, .param .align 16 .b8 s[48], .param .u32 n)
{
  .reg .b32 %r<4>; .reg .b64 %rd<2>;
  ld.param.u64 %rd1, [p]; ld.param.u32 %r1, [n]; ld.param.u32 %r3, [s+44]; add.s32 %r1, %r1, %r3;
  { .param .b32 a0; .param .b32 r0; st.param.b32 [a0], %r1; call.uni (r0), plus_one, (a0);
    ld.param.b32 %r2, [r0]; }
  st.global.u32 [%rd1], %r2; ret;
}
.visible .entry no_params() { ret; }
"""
PTX_BIG_BANK = """
.visible .entry big_bank(.param .u64 .ptr .global .align 8 p, .param .align 4 .b8 s[20000], .param .u32 n)
{
  .reg .b32 %r<4>; .reg .b64 %rd<2>;
  ld.param.u64 %rd1, [p]; ld.param.u32 %r1, [n]; ld.param.u32 %r3, [s+19996]; add.s32 %r1, %r1, %r3;
  st.global.u32 [%rd1], %r1; ret;
}
"""


@pytest.fixture(scope="module")
def ptxas_cubins(tmp_path_factory):
    """Cubins from hand-written PTX: name -> bytes. 'relocatable' keeps plus_one as its own function."""
    tool = NVIDIA_BIN / "ptxas"
    if not tool.exists():
        pytest.skip("ptxas is not in this Triton wheel")
    folder = tmp_path_factory.mktemp("ptx")
    jobs = {"struct": ("sm_90", PTX_STRUCT_PARAMS, []), "relocatable": ("sm_90", PTX_STRUCT_PARAMS, ["-c"]),
            "big_bank": ("sm_90a", PTX_BIG_BANK, [])}
    cubins = {}
    for name, (target, body, flags) in jobs.items():
        source, out = folder / f"{name}.ptx", folder / f"{name}.cubin"
        source.write_text(PTX_HEAD.format(target=target) + body)
        subprocess.run([str(tool), f"-arch={target}", *flags, str(source), "-o", str(out)], check=True)
        cubins[name] = out.read_bytes()
    return cubins


@pytest.mark.parametrize("name", ["struct", "relocatable"])
def test_struct_parameter_and_entry_points(ptxas_cubins, name):
    obj = read_code_object(ptxas_cubins[name])
    assert obj.arch == "sm_90"
    # plus_one has its own .text/.nv.info sections in relocatable code but is not an entry point.
    assert sorted(obj.kernels) == ["no_params", "with_struct"]
    info = obj.kernels["with_struct"]
    assert [(p.offset, p.size) for p in info.params] == [(0, 8), (16, 48), (64, 4)]
    assert info.param_bytes == 68
    assert obj.kernels["no_params"].params == []


def test_parameter_bank_over_4k_uses_kparam_info_v2(ptxas_cubins):
    data = ptxas_cubins["big_bank"]
    assert b"\x04\x45\x0c\x00" in data and b"\x04\x17\x0c\x00" not in data  # only V2 records
    obj = read_code_object(data)
    assert obj.arch == "sm_90a"
    info = obj.kernels["big_bank"]
    assert [(p.offset, p.size) for p in info.params] == [(0, 8), (8, 20000), (20008, 4)]
    assert info.param_bytes == 20012


# -------------------------------------------------------------------------- HSA metadata, synthetic
def pack(value) -> bytes:
    """msgpack in its widest forms only, the opposite of what LLVM writes, so both paths get exercised."""
    if value is None or isinstance(value, bool):
        return {None: b"\xc0", False: b"\xc2", True: b"\xc3"}[value]
    if isinstance(value, int):
        return b"\xd3" + struct.pack(">q", value)
    if isinstance(value, str):
        return b"\xdb" + struct.pack(">I", len(value.encode())) + value.encode()
    if isinstance(value, list):
        return b"\xdd" + struct.pack(">I", len(value)) + b"".join(map(pack, value))
    return b"\xdf" + struct.pack(">I", len(value)) + b"".join(pack(k) + pack(v) for k, v in value.items())


def synthetic_hsaco(metadata: dict | None = None, *, note: bytes | None = None) -> bytes:
    """A minimal AMDGPU ELF holding just one NT_AMDGPU_METADATA note with `metadata` (or raw `note`)."""
    desc = pack(metadata) if note is None else note
    note_bytes = struct.pack("<III", 7, len(desc), 32) + b"AMDGPU\0\0" + desc + bytes(-len(desc) % 4)
    names = b"\0.note\0.shstrtab\0"
    names_at = 64 + len(note_bytes)
    shoff = (names_at + len(names) + 7) & ~7
    header = struct.pack("<16sHHIQQQIHHHHHH", b"\x7fELF\x02\x01\x01\x40\x03" + bytes(7), 3, 224, 1, 0, 0, shoff,
                         0x54C, 64, 56, 0, 64, 3, 2)
    body = header + note_bytes + names + bytes(shoff - names_at - len(names))
    shdr = struct.Struct("<IIQQQQIIQQ")
    return body + bytes(64) + shdr.pack(1, 7, 0, 0, 64, len(note_bytes), 0, 0, 4, 0) + \
        shdr.pack(7, 3, 0, 0, names_at, len(names), 0, 0, 1, 0)


def hip_metadata(**kernel_changes) -> dict:
    """hipcc-style metadata: two explicit arguments then hidden ones the HIP runtime fills in."""
    args = [{".name": "out", ".offset": 0, ".size": 8, ".value_kind": "global_buffer"},
            {".name": "n", ".offset": 8, ".size": 4, ".value_kind": "by_value"},
            {".offset": 16, ".size": 4, ".value_kind": "hidden_block_count_x"},
            {".offset": 24, ".size": 8, ".value_kind": "hidden_global_offset_x"}]
    kernel = {".name": "k", ".symbol": "k.kd", ".args": args, ".kernarg_segment_size": 280,
              ".group_segment_fixed_size": 512, ".private_segment_fixed_size": 0, ".wavefront_size": 64,
              ".max_flat_workgroup_size": 1024, ".vgpr_count": 32}
    kernel.update(kernel_changes)
    return {"amdhsa.version": [1, 2], "amdhsa.target": "amdgcn-amd-amdhsa--gfx942:sramecc+:xnack-",
            "amdhsa.kernels": [kernel]}


def refusal(data: bytes) -> str:
    with pytest.raises(FmhaValueError) as caught:
        read_code_object(data, name="bad.hsaco")
    assert str(caught.value).startswith("bad.hsaco: ")
    return str(caught.value)


def test_synthetic_hsaco_with_hidden_arguments():
    obj = read_code_object(synthetic_hsaco(hip_metadata()))
    assert (obj.vendor, obj.arch, obj.features) == ("hip", "gfx942", ("sramecc+", "xnack-"))
    info = obj.kernels["k"]
    assert (info.param_bytes, info.shared_bytes, info.wavefront_size, info.max_threads, info.registers) == \
        (280, 512, 64, 1024, 32)
    assert [(p.name, p.kind) for p in info.params[:2]] == [("out", "global_buffer"), ("n", "by_value")]
    assert compare_layout(info, [(0, 8), (8, 4)]) == []  # hidden arguments are not ours to pack
    meta = hip_metadata(**{".args": []})
    meta["amdhsa.target"] = "amdgcn-amd-amdhsa--gfx9-4-generic"
    assert read_code_object(synthetic_hsaco(meta)).arch == "gfx9-4-generic"


def _with_arg(index, **changes):
    args = hip_metadata()["amdhsa.kernels"][0][".args"]
    args[index] = {**args[index], **changes}
    return hip_metadata(**{".args": args})


def _top(**changes):
    return {**hip_metadata(), **changes}


def _without(key):
    meta = hip_metadata()
    del meta["amdhsa.kernels"][0][key]
    return meta


BAD_METADATA = [
    (hip_metadata(**{".kernarg_segment_size": 20}), "past the declared 20 bytes"),
    (_without(".kernarg_segment_size"), "kernel k has no .kernarg_segment_size"),
    (_without(".name"), "amdhsa.kernels[0] has no .name"),
    (_with_arg(1, **{".offset": 4}), "overlaps"),
    (_with_arg(1, **{".size": 0}), "is empty"),
    (_with_arg(1, **{".size": True}), "expected a non-negative int"),
    (_with_arg(0, **{".offset": -8}), "expected a non-negative int"),
    (_with_arg(1, **{".value_kind": 3}), "expected a str"),
    (hip_metadata(**{".args": {"a": 1}}), "expected a list"),
    (hip_metadata(**{".args": [7]}), "is not a map"),
    ({"amdhsa.target": "amdgcn-amd-amdhsa--gfx942", "amdhsa.kernels": [hip_metadata()["amdhsa.kernels"][0]] * 2},
     "described twice"),
    (_top(**{"amdhsa.target": "amdgcn-amd-amdhsa--sm_90"}), "is not amdgcn-amd-amdhsa--gfx"),
    (_top(**{"amdhsa.kernels": "k"}), "expected a list"),
    ({"amdhsa.kernels": []}, "has no amdhsa.target"),
    ([1, 2], "not a map"),
]


@pytest.mark.parametrize("metadata, message", BAD_METADATA)
def test_inconsistent_metadata_is_refused(metadata, message):
    assert message in refusal(synthetic_hsaco(metadata))


def test_section_less_hsaco_is_read_from_its_program_headers(built):
    data = bytearray(built["mixed_args", "gfx942"])
    struct.pack_into("<Q", data, 0x28, 0)  # e_shoff
    struct.pack_into("<HHH", data, 0x3A, 64, 0, 0)  # e_shentsize, e_shnum, e_shstrndx
    assert read_code_object(bytes(data)) == read_code_object(built["mixed_args", "gfx942"])


def test_not_a_code_object(built):
    data = built["mixed_args", "gfx942"]
    assert "bad magic" in refusal(b"\x7fELG" + data[4:])
    assert "64-bit little-endian" in refusal(data[:4] + b"\x01" + data[5:])
    assert "neither CUDA" in refusal(data[:18] + struct.pack("<H", 62) + data[20:])
    assert "the ELF header (bytes 0..64) runs past the end (0 bytes)" in refusal(b"")
    with pytest.raises(FmhaTypeError):
        read_code_object("not bytes")


def test_compare_layout_names_every_disagreement():
    info = KernelInfo("k", [Param(0, 0, 8, "q", "global_buffer"), Param(1, 8, 4, "n", "by_value"),
                            Param(2, 16, 4, None, "hidden_block_count_x")], 24, 0, 64)
    assert compare_layout(info, [(0, 8), (8, 4)]) == []
    assert compare_layout(info, [(0, 8), (8, 8)]) == \
        ["parameter 1 (n): offset 8 size 4 in the binary, offset 8 size 8 expected"]
    assert compare_layout(info, [(0, 8), (8, 4), (16, 8)]) == \
        ["2 parameters in the binary, 3 expected", "parameter 2: none in the binary, offset 16 size 8 expected"]
    assert compare_layout(info, [(0, 8)]) == \
        ["2 parameters in the binary, 1 expected", "parameter 1 (n): offset 8 size 4 in the binary, none expected"]


# --------------------------------------------------------------------------------------- msgpack
DECODED = [
    (b"\x00", 0), (b"\x7f", 127), (b"\xff", -1), (b"\xe0", -32), (b"\xcc\xff", 255), (b"\xcd\x01\x00", 256),
    (b"\xce\xff\xff\xff\xff", 2**32 - 1), (b"\xcf" + b"\xff" * 8, 2**64 - 1), (b"\xd0\x80", -128),
    (b"\xd1\x80\x00", -32768), (b"\xd2\x80\x00\x00\x00", -2**31), (b"\xd3\x80" + bytes(7), -2**63),
    (b"\xc0", None), (b"\xc2", False), (b"\xc3", True),
    (b"\xca" + struct.pack(">f", 1.5), 1.5), (b"\xcb" + struct.pack(">d", -0.25), -0.25),
    (b"\xa3abc", "abc"), (b"\xd9\x03abc", "abc"), (b"\xda\x00\x03abc", "abc"), (b"\xdb\x00\x00\x00\x02\xc3\xa9", "é"),
    (b"\xa0", ""), (b"\xc4\x02\x01\x02", b"\x01\x02"), (b"\xc5\x00\x01\x00", b"\x00"),
    (b"\xc6\x00\x00\x00\x00", b""), (b"\x92\x01\xa1x", [1, "x"]), (b"\xdc\x00\x01\xc0", [None]),
    (b"\xdd\x00\x00\x00\x00", []), (b"\x81\xa1k\xc3", {"k": True}), (b"\xde\x00\x01\x01\x90", {1: []}),
    (b"\xdf\x00\x00\x00\x01\xa1a\x81\xa1b\x91\x80", {"a": {"b": [{}]}}),
]


@pytest.mark.parametrize("data, value", DECODED)
def test_msgpack_decodes(data, value):
    decoded = decode_msgpack(data)
    assert decoded == value and type(decoded) is type(value)


HOSTILE_MSGPACK = [
    (b"", "truncated"), (b"\xcd\x01", "truncated"), (b"\xcb\x00", "truncated"), (b"\xa5abc", "truncated"),
    (b"\xdb\xff\xff\xff\xffab", "truncated: 4294967295 bytes needed"), (b"\xc6\xff\xff\xff\xff", "truncated"),
    (b"\xdd\xff\xff\xff\xff\x00", "array of 4294967295 elements cannot fit"),
    (b"\xdf\xff\xff\xff\xff\x00\x00", "map of 4294967295 elements cannot fit"),
    (b"\x91" * 100_000 + b"\x00", "nested deeper than 32"), (b"\x81\xa1k" * 1000 + b"\xc0", "nested deeper"),
    (b"\xc1", "reserved"), (b"\xc7\x01\x05x", "extension"), (b"\xd4\x01\x00", "extension"),
    (b"\x01\x02", "1 trailing bytes"), (b"\xa2\xff\xfe", "not UTF-8"), (b"\x82\xa1a\x01\xa1a\x02", "duplicate"),
    (b"\x81\x90\x01", "map key of type list"), (b"\x81\xc4\x01x\x01", "map key of type bytes"),
]


@pytest.mark.parametrize("data, message", HOSTILE_MSGPACK)
def test_msgpack_refuses(data, message):
    with pytest.raises(FmhaValueError, match=re.escape(message)) as caught:
        decode_msgpack(data, name="meta")
    assert str(caught.value).startswith("meta: ")


def test_msgpack_decodes_real_metadata_like_the_msgpack_package(built):
    msgpack = pytest.importorskip("msgpack")
    data = built["mixed_args", "gfx950"]
    start = data.index(b"AMDGPU\0\0") + 8
    (size,) = struct.unpack_from("<I", data, start - 16)
    note = data[start:start + size]
    assert decode_msgpack(note) == msgpack.unpackb(note, strict_map_key=False)


METADATA_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.floats(allow_nan=False) | st.text() |
    st.binary(),
    lambda children: st.lists(children, max_size=5) |
    st.dictionaries(st.text(max_size=8) | st.integers(-2**63, 2**63 - 1), children, max_size=5),
    max_leaves=30)


@FUZZ
@given(METADATA_VALUES)
def test_msgpack_round_trips_through_the_msgpack_package(value):
    msgpack = pytest.importorskip("msgpack")
    CASES["msgpack round trips"] += 1
    assert decode_msgpack(msgpack.packb(value, use_bin_type=True)) == value


@FUZZ
@given(st.recursive(st.none() | st.booleans() | st.integers(-2**63, 2**63 - 1) | st.text(),
                    lambda children: st.lists(children, max_size=5) |
                    st.dictionaries(st.text(max_size=8), children, max_size=5), max_leaves=30))
def test_msgpack_wide_forms_round_trip(value):
    CASES["msgpack round trips"] += 1
    assert decode_msgpack(pack(value)) == value


# ------------------------------------------------------------------------------------------- fuzz
def refused_or_well_formed(data: bytes, case: str) -> None:
    """The only acceptable outcomes: FmhaValueError, or a code object whose every field is sane."""
    CASES[case] += 1
    try:
        obj = read_code_object(data, name="fuzzed")
    except FmhaValueError:
        return
    assert obj.vendor in ("cuda", "hip") and isinstance(obj.arch, str)
    for name, info in obj.kernels.items():
        assert name == info.name
        assert [p.ordinal for p in info.params] == list(range(len(info.params)))
        assert all(p.offset >= 0 and p.size > 0 for p in info.params)
        assert info.param_bytes is None or info.param_bytes >= max((p.offset + p.size for p in info.params), default=0)


def structural_spans(data: bytes) -> list[tuple[int, int]]:
    """ELF header, section header table and the sections the reader interprets, found with plain struct."""
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shnum, shstrndx = struct.unpack_from("<HH", data, 0x3C)
    headers = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + 64 * i) for i in range(shnum)]
    names_at = headers[shstrndx][4]
    spans = [(0, 64), (shoff, 64 * shnum)]
    for header in headers:
        name = data[names_at + header[0]:data.index(b"\0", names_at + header[0])].decode()
        if name in (".symtab", ".strtab", ".shstrtab", ".note") or name.startswith(".nv.info"):
            spans.append((header[4], header[5]))
    return spans


FUZZED = [("mixed_args", "sm_90"), ("mixed_args", "gfx942"), ("scalars_first", "gfx950")]


@pytest.mark.parametrize("key", FUZZED)
def test_every_truncation_is_refused(built, key):
    data = built[key]
    for length in range(len(data)):
        CASES["truncations"] += 1
        with pytest.raises(FmhaValueError):
            read_code_object(data[:length])


@pytest.mark.parametrize("key", FUZZED[:2])
def test_every_single_bit_flip_of_the_structure(built, key):
    data = built[key]
    for start, size in structural_spans(data):
        for bit in range(start * 8, (start + size) * 8):
            flipped = bytearray(data)
            flipped[bit // 8] ^= 1 << (bit % 8)
            refused_or_well_formed(bytes(flipped), "single-bit flips")


@settings(FUZZ, max_examples=1000)
@given(key=st.sampled_from(FUZZED), flips=st.lists(st.integers(0, 2**40), min_size=1, max_size=16))
def test_random_bit_flips(built, key, flips):
    flipped = bytearray(built[key])
    for bit in flips:
        bit %= len(flipped) * 8
        flipped[bit // 8] ^= 1 << (bit % 8)
    refused_or_well_formed(bytes(flipped), "random bit flips")


@settings(FUZZ, max_examples=1000)
@given(key=st.sampled_from(FUZZED), at=st.integers(0, 2**32), patch=st.binary(min_size=1, max_size=64))
def test_random_overwrites(built, key, at, patch):
    data = built[key]
    at %= len(data)
    refused_or_well_formed(data[:at] + patch + data[at + len(patch):], "random overwrites")


@FUZZ
@given(head=st.sampled_from([b"", b"\x7fELF\x02\x01\x01", b"\x7fELF\x02\x01\x01\x40\x03"]),
       tail=st.binary(max_size=2048))
def test_random_bytes(head, tail):
    refused_or_well_formed(head + tail, "random bytes")


HOSTILE_PREFIXES = [b"\xdd\xff\xff\xff\xff", b"\xdf\xff\xff\xff\xff", b"\xdb\x7f\xff\xff\xff",
                    b"\xc6\xff\xff\xff\xff", b"\x91" * 64, b"\x81\xa1k" * 40, b"\x81\xaeamdhsa.kernels"]


@FUZZ
@given(prefix=st.sampled_from(HOSTILE_PREFIXES), tail=st.binary(max_size=256))
def test_hostile_metadata_notes(prefix, tail):
    CASES["hostile msgpack"] += 1
    try:
        decode_msgpack(prefix + tail)
    except FmhaValueError:
        pass
    refused_or_well_formed(synthetic_hsaco(note=prefix + tail), "hostile metadata notes")


def test_hostile_note_inside_a_real_code_object(built):
    """Overwrite the real note's msgpack in place, keeping every ELF size intact."""
    data = built["mixed_args", "gfx942"]
    start = data.index(b"AMDGPU\0\0") + 8
    (size,) = struct.unpack_from("<I", data, start - 16)
    for prefix in HOSTILE_PREFIXES:
        hostile = (prefix * (size // len(prefix) + 1))[:size]
        assert refusal(data[:start] + hostile + data[start + size:])
        CASES["hostile metadata notes"] += 1
