"""Device memory allocated through the shim, exported by DLPack so any framework can take it."""
from __future__ import annotations

import math

from . import backend
from .dlpack import DLPackExporter, contiguous_strides

ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4, "int32": 4, "int64": 8, "uint8": 1}


class DeviceBuffer(DLPackExporter):
    """A stream-ordered allocation on one device: freed on that stream when the last reference (ours or
    a DLPack consumer's) goes away. `torch.from_dlpack`, `cupy.from_dlpack` and `jax.dlpack.from_dlpack`
    take it without a copy."""

    def __init__(self, device: int, shape, dtype: str, stream: int = 0, pitch: int | None = None):
        """`pitch`: elements per row of the last dim when rows are padded (None: C-contiguous)."""
        self.shape, self.dtype, self.strides = tuple(int(s) for s in shape), dtype, None
        stored = self.shape
        if pitch is not None and self.shape and pitch != self.shape[-1]:
            stored = self.shape[:-1] + (int(pitch),)
            self.strides = contiguous_strides(stored)
        self.nbytes = math.prod(stored) * ITEMSIZE[dtype]
        self.device_ordinal, self.stream = device, stream
        kind = backend.runtime().backend
        self.device = (kind if kind == "cuda" else "rocm", device)
        self.ptr = backend.mem_alloc(device, self.nbytes, stream)

    @property
    def device_ptr(self) -> int:
        return self.ptr

    def zero(self) -> None:
        backend.memset(self.device_ordinal, self.ptr, 0, self.nbytes, self.stream)

    def __del__(self):
        ptr, self.ptr = getattr(self, "ptr", 0), 0
        if ptr:
            try:
                backend.mem_free(self.device_ordinal, ptr, self.stream)
            except Exception:  # interpreter shutdown: the driver may already be gone
                pass
