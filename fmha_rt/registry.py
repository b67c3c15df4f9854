"""Finding the shipped code objects: the hsa/ folder, its manifest, and each kernel's checked image.

Search order: $FMHA_RT_ASM_DIR, then the package's own data (an installed wheel), then the checkout's
hsa/ next to the package (an editable install). The first folder holding manifest.json wins.
A kernel's file must stay inside that folder, match the manifest's sha256, and declare (in the binary's
own parameter table) exactly the layout the manifest gives; anything else is refused.
"""
from __future__ import annotations

import dataclasses
import gzip
import hashlib
import json
import os
import pathlib
import threading

from . import codeobj
from .errors import FmhaRuntimeError, FmhaValueError
from .packing import ArgPacker, Slot

MANIFEST_FORMAT = 1
# Triton appends these pointer parameters after a kernel's own; the build refuses kernels that need
# the scratch memory behind them, so the runtime always passes NULL.
SCRATCH_POINTERS = ("global_scratch", "profile_scratch")
PACKAGE_DIR = pathlib.Path(__file__).resolve().parent


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


def _confined(root: pathlib.Path, name: str) -> pathlib.Path:
    """The file `name` inside `root`, refusing absolute paths and anything that escapes `root`."""
    if not isinstance(name, str) or not name or name.startswith(("/", "\\")) or ".." in pathlib.PurePosixPath(name).parts:
        raise FmhaValueError(f"manifest file name {name!r} must be a relative path inside {root}")
    path = (root / name).resolve()
    if root.resolve() not in path.parents:
        raise FmhaValueError(f"manifest file name {name!r} resolves outside {root}")
    return path


def parse_manifest(data: dict, root: pathlib.Path) -> dict[tuple[str, str], KernelEntry]:
    """Validate a manifest document and index its kernels by (arch, key)."""
    if not isinstance(data, dict) or data.get("format") != MANIFEST_FORMAT or not isinstance(data.get("kernels"), list):
        raise FmhaValueError(f"{root}/manifest.json is not a format-{MANIFEST_FORMAT} fmha_rt manifest")
    entries = {}
    for i, k in enumerate(data["kernels"]):
        try:
            params = tuple(Slot(p["name"], p["type"], int(p["offset"]), int(p["size"])) for p in k["params"])
            entry = KernelEntry(
                key=str(k["key"]), family=str(k["family"]), arch=str(k["arch"]), symbol=str(k["symbol"]),
                file=k["file"], sha256=str(k["sha256"]), compressed=bool(k.get("compressed", False)),
                threads=int(k["threads"]), shared=int(k["shared"]), params=params,
                param_bytes=int(k["param_bytes"]), traits=dict(k.get("traits", {})),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise FmhaValueError(f"{root}/manifest.json: kernel #{i} is malformed ({exc!r})") from None
        _confined(root, entry.file)
        if not 0 < entry.threads <= 1024 or not 0 <= entry.shared <= 1 << 20 or not 0 < entry.param_bytes <= 4096:
            raise FmhaValueError(f"{root}/manifest.json: kernel {entry.key} has out-of-range launch sizes")
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
        except (OSError, ValueError) as exc:
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
        data = gzip.decompress(stored) if entry.compressed else stored
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
