"""DLPack on the GPU: device buffers allocated through the shim go to torch, CuPy and JAX without a copy,
and arrays from each come back in with the right pointer, shape and strides."""
import numpy as np
import pytest

from fmha_rt.runtime import backend
from fmha_rt.arrays import Arg
from fmha_rt.runtime.buffers import DeviceBuffer
from gpu_presence import require

NO_JAX_GPU = "a GPU is present but this JAX has no GPU platform"


def filled_buffer(n=4096):
    """A float32 device buffer holding 0, 1, 2, ... (written through the shim)."""
    buf = DeviceBuffer(0, (n,), "float32")
    backend.copy_to_device(0, buf.ptr, np.arange(n, dtype=np.float32))
    return buf


def test_device_buffer_to_torch_without_copy():
    torch = require("torch")
    buf = filled_buffer()
    t = torch.from_dlpack(buf)
    assert t.device.type == "cuda" and t.data_ptr() == buf.ptr and t.dtype == torch.float32
    assert torch.equal(t.cpu(), torch.arange(4096, dtype=torch.float32))
    t.mul_(2)  # a write through torch is visible through the shim
    back = np.empty(4096, np.float32)
    backend.copy_to_host(0, back, buf.ptr)
    assert np.array_equal(back, 2 * np.arange(4096, dtype=np.float32))


def test_device_buffer_to_cupy_without_copy():
    cupy = require("cupy")
    buf = filled_buffer()
    c = cupy.from_dlpack(buf)
    assert c.data.ptr == buf.ptr
    assert np.array_equal(cupy.asnumpy(c), np.arange(4096, dtype=np.float32))


def test_device_buffer_to_jax():
    jax = require("jax")
    assert any(d.platform == "gpu" for d in jax.devices()), NO_JAX_GPU
    buf = filled_buffer()
    backend.synchronize(0)
    j = jax.dlpack.from_dlpack(buf)
    assert np.array_equal(np.asarray(j), np.arange(4096, dtype=np.float32))


@pytest.mark.parametrize("framework", ["torch", "cupy", "jax"])
def test_framework_arrays_import_with_pointer_shape_and_strides(framework):
    mod = require(framework)
    host = np.arange(2 * 3 * 8, dtype=np.float32).reshape(2, 3, 8)
    if framework == "torch":
        arr = mod.from_numpy(host).cuda()[:, 1:]  # a strided view with a byte offset
        ptr, strides = arr.data_ptr(), tuple(arr.stride())
    elif framework == "cupy":
        arr = mod.asarray(host)[:, 1:]
        ptr, strides = arr.data.ptr, tuple(s // 4 for s in arr.strides)
    else:
        assert any(d.platform == "gpu" for d in mod.devices()), NO_JAX_GPU
        arr = mod.device_put(host[:, 1:], mod.devices("gpu")[0])
        ptr, strides = arr.unsafe_buffer_pointer(), (16, 8, 1)
    arg = Arg("x", arr, 0)
    assert arg.view.device_type == "cuda" and arg.device == 0
    assert tuple(arg.shape) == (2, 2, 8) and tuple(arg.strides) == strides and arg.pointer.address == ptr
