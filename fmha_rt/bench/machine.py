"""The header every run records: when, on what GPU, with which software, and how it was measured.

Every probe here tolerates its source missing (no nvidia-smi, no git checkout): a header field it
cannot read is null, never an exception, since a benchmark must not fail for want of a clock reading.
"""

import datetime
import hashlib
import importlib.metadata
import os
import platform
import subprocess

_SMI_FIELDS = ("uuid", "clocks.sm", "clocks.mem", "clocks.max.sm", "driver_version")


def header(device_index, discovered, settings):
    """The run's header. `discovered` maps impl names to peers.Discovery; `settings` is a dict."""
    import torch

    props = torch.cuda.get_device_properties(device_index)
    smi = nvidia_smi_row(getattr(props, "uuid", None), device_index)
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "gpu": props.name,
        "sm_count": props.multi_processor_count,
        "memory_bytes": props.total_memory,
        "l2_bytes": getattr(props, "L2_cache_size", None),
        "clocks_mhz": {key: smi.get(field) for key, field in
                       (("sm", "clocks.sm"), ("mem", "clocks.mem"), ("max_sm", "clocks.max.sm"))},
        "driver": smi.get("driver_version"),
        "cuda": torch.version.cuda,
        "hip": getattr(torch.version, "hip", None),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": _distribution_version("triton"),
        "fmha_rt": fmha_rt_version(),
        "fmha_rt_commit": git_commit(),
        "fmha_rt_sources_sha256": sources_digest(),
        "impls": {name: found.fields() for name, found in discovered.items()},
        "settings": settings,
    }


def gpu_presence():
    """(whether a GPU is there, one line saying so): the driver library missing, present with no device, or
    the devices found. Asked of fmha_rt's own driver layer (the same probe its calls make)."""
    from fmha_rt.errors import FmhaError

    try:
        from fmha_rt.runtime import backend

        runtime = backend.runtime()
    except FmhaError as exc:
        return False, f"no GPU: {exc}"
    if not runtime.devices:
        return False, f"no GPU: the driver library {runtime.library} is present but reports no device"
    names = ", ".join(sorted({d.name for d in runtime.devices}))
    return True, f"GPU found: {len(runtime.devices)} device(s) ({names}) through {runtime.library}"


def nvidia_smi_row(uuid, index):
    """nvidia-smi's clocks and driver version for our GPU (matched by UUID where torch gives one,
    else by index), as a dict of the query fields; {} when nvidia-smi is absent or says nothing."""
    try:
        proc = subprocess.run(["nvidia-smi", f"--query-gpu={','.join(_SMI_FIELDS)}",
                               "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return {}
    return pick_smi_row(proc.stdout, uuid, index) if proc.returncode == 0 else {}


def pick_smi_row(csv_text, uuid, index):
    rows = [dict(zip(_SMI_FIELDS, (cell.strip() for cell in line.split(","))))
            for line in csv_text.splitlines() if line.strip()]
    rows = [{key: _number_or_text(value) for key, value in row.items()} for row in rows]
    wanted = str(uuid) if uuid is not None else None
    for row in rows:
        if wanted and str(row.get("uuid", "")).removeprefix("GPU-") == wanted.removeprefix("GPU-"):
            return row
    return rows[index] if index < len(rows) else {}


def _number_or_text(value):
    if value in ("", "[N/A]", "N/A", "[Not Supported]"):
        return None
    try:
        return int(value)
    except ValueError:
        return value


def _distribution_version(name):
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def fmha_rt_version():
    """The installed distribution's version, else the package's own (a source tree on sys.path)."""
    import fmha_rt

    return _distribution_version("fmha_rt") or getattr(fmha_rt, "__version__", None)


def sources_digest(root=None, package=None):
    """sha256 over what decides fmha_rt's behaviour: the package's Python and C sources, the C header,
    the kernel sources and the code-object manifest (which holds every object's own sha256). Unlike the
    git commit it needs no repository, so a copied tree still says exactly what was measured."""
    import fmha_rt

    package = package or os.path.dirname(os.path.abspath(fmha_rt.__file__))
    root = root or os.path.dirname(package)
    paths = []
    for folder, suffixes in ((package, (".py", ".c")), (os.path.join(root, "include"), (".h",)),
                             (os.path.join(root, "kernels"), (".py",))):
        for dirpath, dirnames, filenames in os.walk(folder):
            dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
            paths += [os.path.join(dirpath, f) for f in sorted(filenames) if f.endswith(suffixes)]
    for candidate in (os.path.join(package, "hsa", "manifest.json"), os.path.join(root, "hsa", "manifest.json")):
        if os.path.isfile(candidate):
            paths.append(candidate)
            break
    digest = hashlib.sha256()
    for path in paths:
        with open(path, "rb") as f:
            data = f.read()
        digest.update(f"{os.path.relpath(path, root)}\0{len(data)}\0".encode())
        digest.update(data)
    return digest.hexdigest()


def git_commit():
    """The commit of the fmha_rt checkout being measured, with "+dirty" when files differ from it."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        commit = subprocess.run(["git", "-C", root, "rev-parse", "--short=12", "HEAD"], capture_output=True,
                                text=True, timeout=10)
        dirty = subprocess.run(["git", "--no-optional-locks", "-C", root, "status", "--porcelain",
                                "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if commit.returncode != 0:
        return None
    return commit.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
