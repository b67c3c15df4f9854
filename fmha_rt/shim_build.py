"""cffi build of the C shim (API mode). Run by setuptools through `cffi_modules` in pyproject.toml.

The cdef is the block between the CDEF markers of include/fmha_rt.h, so the header stays the one
declaration of the shim's ABI.
"""
import pathlib

import cffi

ROOT = pathlib.Path(__file__).resolve().parent.parent
HEADER = ROOT / "include" / "fmha_rt.h"
SOURCE = pathlib.Path(__file__).resolve().parent / "shim.c"


def header_cdef(text: str) -> str:
    begin, end = "/* CDEF BEGIN */", "/* CDEF END */"
    if begin not in text or end not in text:
        raise RuntimeError(f"{HEADER} lacks the {begin} ... {end} block")
    return text.split(begin, 1)[1].split(end, 1)[0]


ffibuilder = cffi.FFI()
ffibuilder.cdef(header_cdef(HEADER.read_text()))
ffibuilder.set_source(
    "fmha_rt._shim",
    SOURCE.read_text(),
    include_dirs=[str(HEADER.parent)],
    libraries=["dl", "pthread"],
    extra_compile_args=["-O2", "-std=gnu11", "-Wall", "-Wextra", "-Wno-unused-parameter"],
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
