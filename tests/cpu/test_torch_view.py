"""torch tensors are read from their attributes, not through DLPack: the view must describe exactly
what DLPack would (pointer, shape, strides, dtype, span), for every layout the API accepts."""
import pytest

torch = pytest.importorskip("torch")

from fmha_rt.arrays import Arg, TorchView, is_plain_torch_tensor  # noqa: E402
from fmha_rt.runtime.dlpack import import_array  # noqa: E402


def tensors():
    base = torch.randn(3, 40, 6, 64, dtype=torch.float16)
    yield "contiguous", base
    yield "slice", base[:, 5:30, 1:4]
    yield "permuted", base.permute(0, 2, 1, 3)
    yield "step", base[::2, ::3]
    yield "expanded", torch.randn(1, 40, 1, 64, dtype=torch.bfloat16).expand(3, 40, 6, 64)
    yield "fp32", torch.randn(5, 7, dtype=torch.float32)
    yield "int32", torch.arange(9, dtype=torch.int32)
    yield "requires_grad", torch.randn(2, 8, 2, 16, dtype=torch.float16, requires_grad=True)
    yield "empty", torch.empty(0, 4, 2, 8, dtype=torch.float16)


@pytest.mark.parametrize("name,t", list(tensors()), ids=[n for n, _ in tensors()])
def test_view_matches_dlpack(name, t):
    fast = TorchView(t)
    slow = import_array(t.detach(), name="x")
    for field in ("data_ptr", "shape", "strides", "dtype", "itemsize", "device_type", "device_id", "span_start",
                  "nbytes_span"):
        assert getattr(fast, field) == getattr(slow, field), field
    assert fast.read_only is False


def test_only_plain_strided_tensors_take_the_fast_path():
    assert is_plain_torch_tensor(torch.zeros(2))
    assert not is_plain_torch_tensor(torch.zeros(2, dtype=torch.complex64).conj())
    assert not is_plain_torch_tensor(torch.zeros(2, 2).to_sparse())
    assert not is_plain_torch_tensor(torch.zeros(2).numpy())


def test_arg_from_torch_has_pointer_and_span():
    t = torch.randn(4, 8, dtype=torch.float16)[1:3]
    arg = Arg("x", t, 0)
    assert arg.pointer.address == t.data_ptr()
    assert arg.span() == (t.data_ptr(), t.data_ptr() + 2 * 8 * 2)
