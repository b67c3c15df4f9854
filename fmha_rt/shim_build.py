"""cffi build of the C shim (API mode). Run by setuptools through `cffi_modules` in pyproject.toml.

The cdef is the block between the CDEF markers of include/fmha_rt.h, so the header stays the one
declaration of the shim's ABI.

The XLA FFI handler (xla_ffi.c, for fmha_rt.jax) is compiled in when XLA's C FFI header is found:
in $FMHA_RT_XLA_FFI_INCLUDE (a folder holding xla/ffi/api/c_api.h; the build fails if it does not),
else in the include/ folder of the jaxlib installed in the build environment (found without
importing it). Without either the shim is built without the handler, and fmha_rt.jax says so. The
handler must be built against the jaxlib it runs with (XLA checks the FFI API version at
registration), which is why jaxlib is not a build requirement: build with
`pip install --no-build-isolation` in the environment that has jax, or point the variable at it.
"""
import importlib.util
import os
import pathlib
import sys

import cffi

ROOT = pathlib.Path(__file__).resolve().parent.parent
HEADER = ROOT / "include" / "fmha_rt.h"
SOURCE = pathlib.Path(__file__).resolve().parent / "csrc" / "shim.c"
XLA_FFI_SOURCE = SOURCE.with_name("xla_ffi.c")
REPLAY_SOURCE = SOURCE.with_name("replay.c")
PROGRAM_SOURCE = SOURCE.with_name("program.c")
DESCRIBE_SOURCE = SOURCE.with_name("describe.c")
WORKSPACES_SOURCE = SOURCE.with_name("workspaces.c")
EVENTS_SOURCE = SOURCE.with_name("events.c")
LAUNCH_GRAPHS_SOURCE = SOURCE.with_name("launch_graphs.c")
XLA_FFI_HEADER = pathlib.Path("xla", "ffi", "api", "c_api.h")
# The handler asks XLA for the call's device; headers older than that query are not used.
XLA_FFI_REQUIRED = "XLA_FFI_DeviceOrdinal_Get"


def header_cdef(text: str, block: str = "CDEF") -> str:
    begin, end = f"/* {block} BEGIN */", f"/* {block} END */"
    if begin not in text or end not in text:
        raise RuntimeError(f"{HEADER} lacks the {begin} ... {end} block")
    return text.split(begin, 1)[1].split(end, 1)[0]


def xla_ffi_include_dir():
    """(folder holding xla/ffi/api/c_api.h, or None; a line for the build log)."""
    explicit = os.environ.get("FMHA_RT_XLA_FFI_INCLUDE")
    if explicit:
        folder = pathlib.Path(explicit)
        if not (folder / XLA_FFI_HEADER).is_file():
            raise RuntimeError(f"FMHA_RT_XLA_FFI_INCLUDE={explicit} holds no {XLA_FFI_HEADER}")
        return folder, f"XLA FFI handler: built against {folder / XLA_FFI_HEADER} (FMHA_RT_XLA_FFI_INCLUDE)"
    spec = importlib.util.find_spec("jaxlib")
    if spec is None or not spec.submodule_search_locations:
        return None, "XLA FFI handler: not built (no jaxlib in the build environment; fmha_rt.jax will say so)"
    folder = pathlib.Path(next(iter(spec.submodule_search_locations))) / "include"
    header = folder / XLA_FFI_HEADER
    if not header.is_file():
        return None, f"XLA FFI handler: not built ({header} does not exist)"
    if XLA_FFI_REQUIRED not in header.read_text(errors="replace"):
        return None, f"XLA FFI handler: not built ({header} predates {XLA_FFI_REQUIRED}; upgrade jax)"
    return folder, f"XLA FFI handler: built against {header}"


def make_builder() -> cffi.FFI:
    text = HEADER.read_text()
    xla_include, note = xla_ffi_include_dir()
    print(f"fmha_rt: {note}", file=sys.stderr)
    builder = cffi.FFI()
    builder.cdef(header_cdef(text))
    include_dirs = [str(HEADER.parent)]
    sources = [os.path.relpath(s) for s in (REPLAY_SOURCE, PROGRAM_SOURCE, WORKSPACES_SOURCE, EVENTS_SOURCE, LAUNCH_GRAPHS_SOURCE,
                                                  DESCRIBE_SOURCE)]
    if xla_include is not None:
        builder.cdef(header_cdef(text, "CDEF XLA_FFI"))
        include_dirs.append(str(xla_include))
        sources.append(os.path.relpath(XLA_FFI_SOURCE))
    builder.set_source(
        "fmha_rt._shim",
        SOURCE.read_text(),
        sources=sources,
        include_dirs=include_dirs,
        libraries=["dl", "pthread"],
        extra_compile_args=["-O2", "-std=gnu11", "-Wall", "-Wextra", "-Wno-unused-parameter"],
    )
    return builder


ffibuilder = make_builder()

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
