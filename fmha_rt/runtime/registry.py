"""Finding the shipped code objects: the hsa/ folder, its manifest, and each kernel's checked image.

Search order: $FMHA_RT_ASM_DIR, then the package's own data (an installed wheel), then the checkout's
hsa/ next to the package (an editable install). The first folder holding manifest.json wins.
A kernel's file must stay inside that folder, match the manifest's sha256, and declare (in the binary's
own parameter table) exactly the layout the manifest gives; anything else is refused.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pathlib
import threading
import zlib

from . import codeobj
from ..errors import FmhaRuntimeError, FmhaValueError
from .packing import ArgPacker, Slot

MANIFEST_FORMAT = 1
# Triton appends these pointer parameters after a kernel's own. Global scratch is passed where a
# kernel's plan provides it (the v3 family's TMA descriptors; traits global_scratch, bytes a program, and
# global_scratch_align), NULL elsewhere; the build refuses kernels that need profile scratch.
GLOBAL_SCRATCH = "global_scratch"
SCRATCH_POINTERS = (GLOBAL_SCRATCH, "profile_scratch")
# The alignment a kernel may assume is carried by its parameter names, so that the build (which promises
# it to the compiler) and the executor (which checks it before every launch) read one rule: a pointer
# is 16-byte aligned unless its name starts with UNALIGNED_POINTER_PREFIX (then it is only aligned to
# its element), and an integer named ALIGNED_STRIDE_PREFIX* is a multiple of 8 elements (no other
# integer carries a promise: strides of arrays that may have any layout are named pitch_*).
UNALIGNED_POINTER_PREFIX = "Unaligned"
ALIGNED_STRIDE_PREFIX = "stride_"
PACKAGE_DIR = pathlib.Path(__file__).resolve().parent.parent  # fmha_rt/, which holds hsa/ once installed


@dataclasses.dataclass(frozen=True)
class KernelEntry:
    key: str  # unique name of the variant: the kernel map's key
    family: str
    arch: str
    symbol: str  # entry point inside the code object
    file: str  # path relative to the hsa folder
    sha256: str
    compressed: bool
    threads: int
    shared: int  # dynamic shared memory bytes the launch must request
    params: tuple[Slot, ...]
    param_bytes: int
    traits: dict

    @property
    def packer(self) -> ArgPacker:
        return _packer(self)


_packers: dict[tuple[str, str], ArgPacker] = {}


def _packer(entry: KernelEntry) -> ArgPacker:
    packer = _packers.get((entry.arch, entry.key))
    if packer is None:
        packer = _packers.setdefault((entry.arch, entry.key), ArgPacker(list(entry.params), entry.param_bytes))
    return packer


def search_paths() -> list[pathlib.Path]:
    paths = []
    if os.environ.get("FMHA_RT_ASM_DIR"):
        paths.append(pathlib.Path(os.environ["FMHA_RT_ASM_DIR"]))
    paths += [PACKAGE_DIR / "hsa", PACKAGE_DIR.parent / "hsa"]
    return paths


MAX_IMAGE_BYTES = 64 << 20  # far above any kernel; a larger inflated image is refused, not allocated


def _confined(root: pathlib.Path, name: str) -> pathlib.Path:
    """The file `name` inside `root`, refusing absolute paths and anything that escapes `root`."""
    if (not isinstance(name, str) or not name or "\0" in name or name.startswith(("/", "\\"))
            or ".." in pathlib.PurePosixPath(name).parts):
        raise FmhaValueError(f"manifest file name {name!r} must be a relative path inside {root}")
    try:
        path = (root / name).resolve()
    except (OSError, RuntimeError) as exc:  # symlink loops
        raise FmhaValueError(f"manifest file name {name!r} cannot be resolved: {exc}") from None
    if root.resolve() not in path.parents:
        raise FmhaValueError(f"manifest file name {name!r} resolves outside {root}")
    return path


def _inflate(stored: bytes, name: str) -> bytes:
    """gunzip with a size limit, so a corrupt or hostile file is refused rather than exhausting memory."""
    inflater = zlib.decompressobj(wbits=16 + zlib.MAX_WBITS)
    try:
        data = inflater.decompress(stored, MAX_IMAGE_BYTES + 1)
    except zlib.error as exc:
        raise FmhaValueError(f"{name}: not a valid gzip stream ({exc})") from None
    if len(data) > MAX_IMAGE_BYTES:
        raise FmhaValueError(f"{name}: inflates to more than {MAX_IMAGE_BYTES} bytes")
    if not inflater.eof:
        raise FmhaValueError(f"{name}: the gzip stream is truncated")
    return data


def _int(value, what: str, lo: int, hi: int) -> int:
    """A JSON integer within [lo, hi]: floats, bools and strings are refused."""
    if type(value) is not int or not lo <= value <= hi:
        raise FmhaValueError(f"{what} must be an integer in [{lo}, {hi}], got {value!r}")
    return value


def _str(value, what: str) -> str:
    if not isinstance(value, str) or not value:
        raise FmhaValueError(f"{what} must be a non-empty string, got {value!r}")
    return value


def parse_manifest(data: dict, root: pathlib.Path) -> dict[tuple[str, str], KernelEntry]:
    """Validate a manifest document and index its kernels by (arch, key)."""
    if not isinstance(data, dict) or data.get("format") != MANIFEST_FORMAT or not isinstance(data.get("kernels"), list):
        raise FmhaValueError(f"{root}/manifest.json is not a format-{MANIFEST_FORMAT} fmha_rt manifest")
    entries = {}
    for i, k in enumerate(data["kernels"]):
        where = f"{root}/manifest.json: kernel #{i}"
        if not isinstance(k, dict) or not isinstance(k.get("params"), list) or not isinstance(k.get("traits", {}), dict):
            raise FmhaValueError(f"{where} is malformed (expected an object with a params list)")
        try:
            param_bytes = _int(k["param_bytes"], f"{where} param_bytes", 1, 4096)
            params = tuple(Slot(_str(p["name"], f"{where} parameter name"), _str(p["type"], f"{where} parameter type"),
                                _int(p["offset"], f"{where} parameter offset", 0, param_bytes),
                                _int(p["size"], f"{where} parameter size", 1, 8)) for p in k["params"])
            entry = KernelEntry(
                key=_str(k["key"], f"{where} key"), family=_str(k["family"], f"{where} family"),
                arch=_str(k["arch"], f"{where} arch"), symbol=_str(k["symbol"], f"{where} symbol"),
                file=k["file"], sha256=_str(k["sha256"], f"{where} sha256"), compressed=k.get("compressed") is True,
                threads=_int(k["threads"], f"{where} threads", 1, 1024),
                shared=_int(k["shared"], f"{where} shared", 0, 1 << 20), params=params, param_bytes=param_bytes,
                traits=dict(k.get("traits", {})),
            )
        except (KeyError, TypeError) as exc:
            raise FmhaValueError(f"{where} is malformed ({exc!r})") from None
        _confined(root, entry.file)
        if (entry.arch, entry.key) in entries:
            raise FmhaValueError(f"{root}/manifest.json: kernel {entry.key} appears twice for {entry.arch}")
        entries[(entry.arch, entry.key)] = entry
    return entries


class Registry:
    """One hsa folder: its manifest, and images loaded and checked on demand (cached)."""

    def __init__(self, root: pathlib.Path):
        self.root = root
        try:
            document = json.loads((root / "manifest.json").read_text())
        except (OSError, ValueError, RecursionError) as exc:
            raise FmhaValueError(f"cannot read {root}/manifest.json: {exc}") from None
        self.triton_version = document.get("triton") if isinstance(document, dict) else None
        self.entries = parse_manifest(document, root)
        self._images: dict[tuple[str, str], bytes] = {}
        self._lock = threading.Lock()

    def archs(self) -> list[str]:
        return sorted({arch for arch, _ in self.entries})

    def kernels_for(self, arch: str) -> list[KernelEntry]:
        return [e for (a, _), e in self.entries.items() if a == arch]

    def entry(self, arch: str, key: str) -> KernelEntry:
        try:
            return self.entries[(arch, key)]
        except KeyError:
            have = ", ".join(self.archs()) or "none"
            raise FmhaRuntimeError(f"no code object '{key}' for {arch} in {self.root} (archs there: {have})") from None

    def image(self, entry: KernelEntry) -> bytes:
        """The code object's bytes, checked against the manifest's sha256 and parameter layout."""
        cached = self._images.get((entry.arch, entry.key))
        if cached is not None:
            return cached
        path = _confined(self.root, entry.file)
        try:
            stored = path.read_bytes()
        except OSError as exc:
            raise FmhaRuntimeError(f"cannot read code object {path}: {exc}") from None
        digest = hashlib.sha256(stored).hexdigest()
        if digest != entry.sha256:
            raise FmhaValueError(f"{path}: sha256 {digest} differs from the manifest's {entry.sha256}: refusing it")
        data = _inflate(stored, str(path)) if entry.compressed else stored
        check_layout(entry, data, str(path))
        with self._lock:
            self._images[(entry.arch, entry.key)] = data
        return data


def check_layout(entry: KernelEntry, data: bytes, name: str) -> None:
    """Refuse a code object whose own parameter table disagrees with the manifest's packed layout."""
    obj = codeobj.read_code_object(data, name=name)
    # sm_90a code (wgmma) runs on sm_90 devices and is filed under sm_90.
    if obj.arch not in (entry.arch, entry.arch + "a"):
        raise FmhaValueError(f"{name}: built for {obj.arch}, but the manifest files it under {entry.arch}")
    info = obj.kernels.get(entry.symbol)
    if info is None:
        raise FmhaValueError(f"{name}: no kernel symbol {entry.symbol!r} (has {sorted(obj.kernels)})")
    problems = codeobj.compare_layout(info, [(p.offset, p.size) for p in entry.params])
    # CUDA declares the parameter bank the launch buffer must fill; an AMD kernarg segment also holds
    # the arguments the HIP runtime appends itself, so only the explicit parameters are compared there.
    if obj.vendor == "cuda" and info.param_bytes is not None and info.param_bytes != entry.param_bytes:
        problems.append(f"parameter bytes {info.param_bytes} in the binary, {entry.param_bytes} in the manifest")
    if problems:
        raise FmhaValueError(f"{name}: kernel {entry.key} layout disagrees with the manifest: " + "; ".join(problems))


_registry: Registry | None = None
_registry_lock = threading.Lock()


def registry() -> Registry:
    global _registry
    if _registry is None:
        with _registry_lock:
            if _registry is None:
                paths = search_paths()
                for path in paths:
                    if (path / "manifest.json").is_file():
                        _registry = Registry(path)
                        break
                else:
                    raise FmhaRuntimeError("no code objects found: searched " + ", ".join(map(str, paths)) +
                                           " (set FMHA_RT_ASM_DIR to a folder holding manifest.json)")
    return _registry


def reset() -> None:
    """Forget the cached registry (tests change FMHA_RT_ASM_DIR)."""
    global _registry
    with _registry_lock:
        _registry = None
        _packers.clear()
