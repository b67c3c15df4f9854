"""Kernel parameter layouts read straight from GPU code objects: NVIDIA cubins and AMD HSA code objects.

The runtime packs kernel arguments itself, so its layout must agree byte for byte with the compiler's.
Both vendors record that layout inside the ELF file: a cubin in the EIATTR records of `.nv.info.<kernel>`,
an HSA code object in the msgpack NT_AMDGPU_METADATA note. One ELF reader serves both. Every file is
treated as hostile: anything out of bounds or inconsistent raises FmhaValueError naming the file and the
problem, never an IndexError or struct.error.
"""
from __future__ import annotations

import re
import struct
from collections import namedtuple
from dataclasses import dataclass
from itertools import zip_longest
from typing import NoReturn

from ..errors import FmhaTypeError, FmhaValueError

EM_CUDA, EM_AMDGPU = 190, 224


@dataclass(frozen=True)
class Param:
    ordinal: int
    offset: int
    size: int
    name: str | None = None  # HIP metadata only
    kind: str | None = None  # HIP .value_kind (global_buffer, by_value, hidden_*); None on CUDA


@dataclass(frozen=True)
class KernelInfo:
    name: str  # what cuModuleGetFunction / hipModuleGetFunction take
    params: list[Param]  # in ordinal order
    param_bytes: int | None  # CUDA parameter bank size, HIP kernarg segment size
    shared_bytes: int | None  # static shared memory (CUDA .nv.shared.<kernel>, HIP group segment)
    wavefront_size: int | None  # None on CUDA
    registers: int | None = None  # CUDA EIATTR_REGCOUNT, HIP .vgpr_count
    max_threads: int | None = None  # CUDA required/maximum block size, HIP .max_flat_workgroup_size


@dataclass(frozen=True)
class CodeObject:
    vendor: str  # 'cuda' or 'hip'
    arch: str  # 'sm_90', 'sm_90a', 'gfx942', ...
    kernels: dict[str, KernelInfo]
    features: tuple[str, ...] = ()  # HIP target features such as 'sramecc+', 'xnack-'


def read_code_object(data: bytes, *, name: str = "<bytes>") -> CodeObject:
    """Vendor, arch and every kernel's parameter layout of a cubin or an HSA code object."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise FmhaTypeError(f"{name}: a code object must be bytes, got {type(data).__name__}")
    elf = _Elf(bytes(data), name)
    if elf.machine == EM_CUDA:
        return CodeObject("cuda", _cuda_arch(elf), _cubin_kernels(elf))
    if elf.machine == EM_AMDGPU:
        return _read_hsaco(elf)
    elf.fail(f"e_machine {elf.machine} is neither CUDA ({EM_CUDA}) nor AMDGPU ({EM_AMDGPU})")


def compare_layout(kernel: KernelInfo, expected) -> list[str]:
    """Every disagreement between the binary's parameters and `expected`, a list of (offset, size) in
    ordinal order; empty when they agree. HIP's hidden_* arguments are appended and filled in by the
    runtime, never packed by us, so they are left out of the comparison."""
    actual = [p for p in kernel.params if not (p.kind or "").startswith("hidden_")]
    expected = [tuple(slot) for slot in expected]
    problems = []
    if len(actual) != len(expected):
        problems.append(f"{len(actual)} parameters in the binary, {len(expected)} expected")
    for index, (have, want) in enumerate(zip_longest(actual, expected)):
        if have is not None and (have.offset, have.size) == want:
            continue
        label = f" ({have.name})" if have is not None and have.name else ""
        have_text = "none" if have is None else f"offset {have.offset} size {have.size}"
        want_text = "none" if want is None else f"offset {want[0]} size {want[1]}"
        problems.append(f"parameter {index}{label}: {have_text} in the binary, {want_text} expected")
    return problems


# ---------------------------------------------------------------------------------------------- ELF
_EHDR = struct.Struct("<16sHHIQQQIHHHHHH")
_SHDR = struct.Struct("<IIQQQQIIQQ")
_PHDR = struct.Struct("<IIQQQQQQ")
_SYM = struct.Struct("<IBBHQQ")
_NOTE = struct.Struct("<III")
SHT_SYMTAB, SHT_NOTE, SHT_NOBITS, PT_NOTE = 2, 7, 8, 4
# size is kept apart from data: NOBITS sections (.nv.shared.*) have a size and no bytes.
_Section = namedtuple("_Section", "name type size data link")


class _Elf:
    """Header and sections of an ELF64 little-endian file, with every read bounds-checked."""

    def __init__(self, data: bytes, name: str):
        self.data, self.name = data, name
        (ident, _, self.machine, _, _, phoff, shoff, self.flags, ehsize, phentsize, phnum, shentsize, shnum,
         shstrndx) = self.unpack(_EHDR, 0, "the ELF header")
        if ident[:4] != b"\x7fELF":
            self.fail("not an ELF file (bad magic)")
        if ident[4:6] != b"\x02\x01" or ehsize != _EHDR.size:
            self.fail("not a 64-bit little-endian ELF file")
        self.abi_version = ident[8]
        self.phdrs = self._table(_PHDR, phoff, phentsize, phnum, "program header")
        headers = self._table(_SHDR, shoff, shentsize, shnum, "section header")
        self.sections = []
        if headers:
            if shstrndx >= len(headers):
                self.fail(f"section name table index {shstrndx} is not below the section count {len(headers)}")
            names = self.slice(headers[shstrndx][4], headers[shstrndx][5], "the section name table")
            for index, (name_at, type_, _, _, offset, size, link, *_) in enumerate(headers):
                data = b"" if type_ == SHT_NOBITS else self.slice(offset, size, f"section {index}")
                self.sections.append(_Section(self.string(names, name_at, f"section {index}'s name"),
                                              type_, size, data, link))

    def fail(self, problem: str) -> NoReturn:
        raise FmhaValueError(f"{self.name}: {problem}")

    def unpack(self, layout: struct.Struct, offset: int, what: str, buf: bytes | None = None) -> tuple:
        return layout.unpack(self.slice(offset, layout.size, what, buf))

    def slice(self, offset: int, size: int, what: str, buf: bytes | None = None) -> bytes:
        buf = self.data if buf is None else buf
        if offset + size > len(buf):
            self.fail(f"{what} (bytes {offset}..{offset + size}) runs past the end ({len(buf)} bytes)")
        return buf[offset:offset + size]

    def string(self, table: bytes, index: int, what: str) -> str:
        end = table.find(b"\0", index)
        if end < 0:
            self.fail(f"{what} (string table index {index}) is outside its string table or unterminated")
        try:
            return table[index:end].decode()
        except UnicodeDecodeError:
            self.fail(f"{what} is not UTF-8")

    def section(self, index: int, what: str) -> _Section:
        if index >= len(self.sections):
            self.fail(f"{what} names section {index}, but there are {len(self.sections)}")
        return self.sections[index]

    def notes(self):
        """(owner, type, descriptor) of every note: from the note sections, or from the PT_NOTE segments
        when the section table has been stripped."""
        blobs = [s.data for s in self.sections if s.type == SHT_NOTE]
        if not self.sections:
            blobs = [self.slice(p[2], p[5], "a PT_NOTE segment") for p in self.phdrs if p[0] == PT_NOTE]
        for blob in blobs:
            pos = 0
            while pos < len(blob):
                namesz, descsz, type_ = self.unpack(_NOTE, pos, "a note header", blob)
                desc_at = pos + _NOTE.size + ((namesz + 3) & ~3)  # name and descriptor are padded to 4 bytes
                owner = self.slice(pos + _NOTE.size, namesz, "a note's owner", blob)
                yield owner.rstrip(b"\0"), type_, self.slice(desc_at, descsz, "a note's descriptor", blob)
                pos = desc_at + ((descsz + 3) & ~3)

    def _table(self, layout: struct.Struct, offset: int, entsize: int, count: int, what: str) -> list[tuple]:
        if count and entsize != layout.size:
            self.fail(f"{what} entries are {entsize} bytes, expected {layout.size}")
        self.slice(offset, count * layout.size, f"the {what} table")
        return [layout.unpack_from(self.data, offset + i * layout.size) for i in range(count)]


# -------------------------------------------------------------------------------------- NVIDIA cubin
_STT_FUNC = 2
_STO_CUDA_ENTRY = 0x10  # st_other bit of kernel entry points; device functions lack it
_EIFMT_SVAL = 4  # the other formats (1 none, 2 byte, 3 half) fit their value into the 4-byte record head
_EIATTR_HEAD = struct.Struct("<BBH")  # format, attribute, then a 16-bit value or the SVAL payload size
_EIATTR_PARAM_CBANK, _EIATTR_KPARAM_INFO, _EIATTR_KPARAM_INFO_V2 = 0x0A, 0x17, 0x45
_EIATTR_MAX_THREADS, _EIATTR_REQNTID, _EIATTR_REGCOUNT = 0x05, 0x10, 0x2F
# KPARAM_INFO: index, ordinal, offset, then a word whose bits 18..31 hold the size in bytes (the low bits
# hold pointee alignment, address space and bank). KPARAM_INFO_V2, which ptxas writes for parameter
# banks over 4 KiB, keeps the size in the low 16 bits of that word instead.
_KPARAM = struct.Struct("<IHHI")
_PARAM_CBANK = struct.Struct("<IHH")  # constant-bank symbol, start offset in the bank, size
_THREE_DIMS, _REGCOUNT = struct.Struct("<III"), struct.Struct("<II")  # block size x, y, z; symbol, registers


def _cuda_arch(elf: _Elf) -> str:
    # ELF ABI 7 (CUDA 12) keeps the SM in the low byte and marks sm_XXa with 0x800; ABI 8 (CUDA 13)
    # moves the SM to bits 8..15 and the 'a' mark to 0x8.
    if elf.abi_version >= 8:
        sm, accelerated = (elf.flags >> 8) & 0xFF, elf.flags & 0x8
    else:
        sm, accelerated = elf.flags & 0xFF, elf.flags & 0x800
    if sm < 10:
        elf.fail(f"cubin e_flags 0x{elf.flags:x} name no SM architecture")
    return f"sm_{sm}{'a' if accelerated else ''}"


def _sval_records(elf: _Elf, section: _Section):
    """(attribute, payload) of each EIFMT_SVAL record of an .nv.info section; the other formats are skipped."""
    data, pos = section.data, 0
    while pos < len(data):
        fmt, attribute, value = elf.unpack(_EIATTR_HEAD, pos, f"a record of {section.name}", data)
        pos += _EIATTR_HEAD.size
        if fmt == _EIFMT_SVAL:
            yield attribute, elf.slice(pos, value, f"record 0x{attribute:x} of {section.name}", data)
            pos += value
        elif fmt not in (1, 2, 3):
            elf.fail(f"{section.name}: record format {fmt} at byte {pos - 4} is not one of 1..4")


def _fields(elf: _Elf, layout: struct.Struct, payload: bytes, what: str) -> tuple:
    if len(payload) != layout.size:
        elf.fail(f"{what} record holds {len(payload)} bytes, expected {layout.size}")
    return layout.unpack(payload)


def _cubin_kernels(elf: _Elf) -> dict[str, KernelInfo]:
    by_name = {s.name: s for s in elf.sections}
    symtab = next((s for s in elf.sections if s.type == SHT_SYMTAB), None) or elf.fail("cubin has no symbol table")
    if len(symtab.data) % _SYM.size:
        elf.fail(f"symbol table size {len(symtab.data)} is not a multiple of {_SYM.size}")
    names = elf.section(symtab.link, "the symbol table").data
    registers = {}
    if ".nv.info" in by_name:
        for attribute, payload in _sval_records(elf, by_name[".nv.info"]):
            if attribute == _EIATTR_REGCOUNT:
                symbol, count = _fields(elf, _REGCOUNT, payload, ".nv.info register count")
                registers[symbol] = count
    kernels = {}
    for index, (name_at, info, other, shndx, _, _) in enumerate(_SYM.iter_unpack(symtab.data)):
        if info & 0xF != _STT_FUNC or not other & _STO_CUDA_ENTRY:
            continue
        name = elf.string(names, name_at, f"symbol {index}'s name")
        if elf.section(shndx, f"kernel {name}").name != ".text." + name:
            elf.fail(f"kernel {name} is not in section .text.{name}")
        if name in kernels:
            elf.fail(f"kernel {name} is defined twice")
        attrs = by_name.get(".nv.info." + name) or elf.fail(f"kernel {name} has no .nv.info.{name} section")
        shared = by_name.get(".nv.shared." + name)
        kernels[name] = _cubin_kernel(elf, name, attrs, shared.size if shared else 0, registers.get(index))
    return kernels


def _cubin_kernel(elf: _Elf, name: str, attrs: _Section, shared: int, registers: int | None) -> KernelInfo:
    params, param_bytes, max_threads = [], None, None
    for attribute, payload in _sval_records(elf, attrs):
        if attribute in (_EIATTR_KPARAM_INFO, _EIATTR_KPARAM_INFO_V2):
            _, ordinal, offset, word = _fields(elf, _KPARAM, payload, f"{attrs.name} parameter")
            size = word >> 18 if attribute == _EIATTR_KPARAM_INFO else word & 0xFFFF
            params.append(Param(ordinal, offset, size))
        elif attribute == _EIATTR_PARAM_CBANK:
            _, _, param_bytes = _fields(elf, _PARAM_CBANK, payload, f"{attrs.name} parameter bank")
        elif attribute in (_EIATTR_MAX_THREADS, _EIATTR_REQNTID):
            x, y, z = _fields(elf, _THREE_DIMS, payload, f"{attrs.name} block size")
            max_threads = x * y * z
    return KernelInfo(name, _checked_params(elf, name, params, param_bytes), param_bytes, shared, None,
                      registers, max_threads)


def _checked_params(elf: _Elf, kernel: str, params: list[Param], total: int | None) -> list[Param]:
    """Parameters in ordinal order, refused unless ordinals run 0..n-1 and the slots are non-empty,
    disjoint and inside the declared total."""
    params = sorted(params, key=lambda p: p.ordinal)
    if [p.ordinal for p in params] != list(range(len(params))):
        elf.fail(f"kernel {kernel}: parameter ordinals are not 0..{len(params) - 1} each once")
    end = 0
    for p in sorted(params, key=lambda p: p.offset):
        if p.size <= 0 or p.offset < end:
            elf.fail(f"kernel {kernel}: parameter {p.ordinal} (offset {p.offset}, size {p.size}) is empty "
                     "or overlaps another")
        end = p.offset + p.size
    if total is not None and end > total:
        elf.fail(f"kernel {kernel}: parameters end at byte {end}, past the declared {total} bytes")
    return params


# ----------------------------------------------------------------------------- AMD HSA code object
_NT_AMDGPU_METADATA = 32
_TARGET = re.compile(r"amdgcn-amd-amdhsa--(gfx[0-9a-z-]+)((?::[a-z0-9_]+[+-])*)")
_REQUIRED = object()


def _read_hsaco(elf: _Elf) -> CodeObject:
    notes = [desc for owner, type_, desc in elf.notes() if owner == b"AMDGPU" and type_ == _NT_AMDGPU_METADATA]
    if len(notes) != 1:
        elf.fail(f"expected one NT_AMDGPU_METADATA note, found {len(notes)} (code object v2 is not supported)")
    meta = _map(elf, decode_msgpack(notes[0], name=f"{elf.name}: AMDGPU metadata"), "AMDGPU metadata")
    target = _get(elf, meta, "amdhsa.target", str, "AMDGPU metadata")
    match = _TARGET.fullmatch(target) or elf.fail(
        f"amdhsa.target {target!r} is not amdgcn-amd-amdhsa--gfx<N>[:feature(+|-)...]")
    kernels = {}
    for index, kernel in enumerate(_get(elf, meta, "amdhsa.kernels", list, "AMDGPU metadata")):
        name = _get(elf, _map(elf, kernel, f"amdhsa.kernels[{index}]"), ".name", str, f"amdhsa.kernels[{index}]")
        if name in kernels:
            elf.fail(f"kernel {name} is described twice")
        where = f"kernel {name}"
        params = [_hip_param(elf, ordinal, arg, f"{where} argument {ordinal}")
                  for ordinal, arg in enumerate(_get(elf, kernel, ".args", list, where, default=[]))]
        total = _get(elf, kernel, ".kernarg_segment_size", int, where)
        kernels[name] = KernelInfo(
            name, _checked_params(elf, name, params, total), total,
            shared_bytes=_get(elf, kernel, ".group_segment_fixed_size", int, where, default=None),
            wavefront_size=_get(elf, kernel, ".wavefront_size", int, where, default=None),
            registers=_get(elf, kernel, ".vgpr_count", int, where, default=None),
            max_threads=_get(elf, kernel, ".max_flat_workgroup_size", int, where, default=None))
    features = tuple(f for f in match.group(2).split(":") if f)
    return CodeObject("hip", match.group(1), kernels, features)


def _hip_param(elf: _Elf, ordinal: int, arg, where: str) -> Param:
    arg = _map(elf, arg, where)
    return Param(ordinal, _get(elf, arg, ".offset", int, where), _get(elf, arg, ".size", int, where),
                 name=_get(elf, arg, ".name", str, where, default=None),
                 kind=_get(elf, arg, ".value_kind", str, where))


def _map(elf: _Elf, value, where: str) -> dict:
    if not isinstance(value, dict):
        elf.fail(f"{where} is not a map")
    return value


def _get(elf: _Elf, mapping: dict, key: str, kind: type, where: str, default=_REQUIRED):
    """mapping[key], refused unless it is a `kind` (a non-negative int for int; bools are not ints)."""
    if key not in mapping:
        if default is _REQUIRED:
            elf.fail(f"{where} has no {key}")
        return default
    value = mapping[key]
    if not isinstance(value, kind) or (kind is int and (isinstance(value, bool) or value < 0)):
        elf.fail(f"{where}: {key} is {value!r:.60}, expected a{' non-negative' if kind is int else ''} "
                 f"{kind.__name__}")
    return value


# --------------------------------------------------------------------------------------- msgpack
MSGPACK_MAX_DEPTH = 32  # AMDGPU metadata nests four levels deep
_MSGPACK_CONSTANTS = {0xC0: None, 0xC2: False, 0xC3: True}
_MSGPACK_NUMBERS = {0xCA: ">f", 0xCB: ">d", 0xCC: ">B", 0xCD: ">H", 0xCE: ">I", 0xCF: ">Q",
                    0xD0: ">b", 0xD1: ">h", 0xD2: ">i", 0xD3: ">q"}
_MSGPACK_SIZED = {0xC4: ("bin", ">B"), 0xC5: ("bin", ">H"), 0xC6: ("bin", ">I"),
                  0xD9: ("str", ">B"), 0xDA: ("str", ">H"), 0xDB: ("str", ">I"),
                  0xDC: ("array", ">H"), 0xDD: ("array", ">I"), 0xDE: ("map", ">H"), 0xDF: ("map", ">I")}


def decode_msgpack(data: bytes, *, name: str = "msgpack") -> object:
    """One msgpack value occupying all of `data`: maps, arrays, str, bin, ints, floats, bools and nil, the
    subset AMDGPU metadata uses. Extension types, truncation, trailing bytes, invalid UTF-8, duplicate or
    unhashable map keys and nesting deeper than MSGPACK_MAX_DEPTH raise FmhaValueError."""
    decoder = _MsgpackDecoder(bytes(data), name)
    value = decoder.value(0)
    if decoder.pos != len(decoder.data):
        decoder.fail(f"{len(decoder.data) - decoder.pos} trailing bytes after the value")
    return value


class _MsgpackDecoder:
    def __init__(self, data: bytes, name: str):
        self.data, self.pos, self.name = data, 0, name

    def fail(self, problem: str) -> NoReturn:
        raise FmhaValueError(f"{self.name}: {problem} (msgpack byte {self.pos})")

    def take(self, n: int) -> bytes:
        if n > len(self.data) - self.pos:
            self.fail(f"truncated: {n} bytes needed, {len(self.data) - self.pos} left")
        self.pos += n
        return self.data[self.pos - n:self.pos]

    def number(self, fmt: str):
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def value(self, depth: int):
        if depth > MSGPACK_MAX_DEPTH:
            self.fail(f"nested deeper than {MSGPACK_MAX_DEPTH} levels")
        byte = self.take(1)[0]
        if byte <= 0x7F or byte >= 0xE0:
            return byte if byte <= 0x7F else byte - 0x100
        if byte in _MSGPACK_CONSTANTS:
            return _MSGPACK_CONSTANTS[byte]
        if byte in _MSGPACK_NUMBERS:
            return self.number(_MSGPACK_NUMBERS[byte])
        if byte <= 0x8F:
            kind, count = "map", byte & 0x0F
        elif byte <= 0x9F:
            kind, count = "array", byte & 0x0F
        elif byte <= 0xBF:
            kind, count = "str", byte & 0x1F
        elif byte in _MSGPACK_SIZED:
            kind, fmt = _MSGPACK_SIZED[byte]
            count = self.number(fmt)
        else:
            self.fail(f"type byte 0x{byte:02x} (extension or reserved) is not part of code object metadata")
        if kind == "bin":
            return self.take(count)
        if kind == "str":
            try:
                return self.take(count).decode()
            except UnicodeDecodeError:
                self.fail("string is not UTF-8")
        # Every element takes at least one byte, so a count beyond the bytes left is a lie: refuse it
        # before building anything of that size.
        if count > len(self.data) - self.pos:
            self.fail(f"{kind} of {count} elements cannot fit in the {len(self.data) - self.pos} bytes left")
        if kind == "array":
            return [self.value(depth + 1) for _ in range(count)]
        result = {}
        for _ in range(count):
            key = self.value(depth + 1)
            if not isinstance(key, (str, int, float, type(None))):
                self.fail(f"map key of type {type(key).__name__}")
            if key in result:
                self.fail(f"duplicate map key {key!r:.60}")
            result[key] = self.value(depth + 1)
        return result
