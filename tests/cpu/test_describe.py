"""The shim's describer (fmha_rt/csrc/describe.c) on torch tensors, which keys the plan cache: one C call
reads every tensor of a call through torch's DLPack C exchange API. Equal words must mean equal
signatures (shape, strides, dtype, device), whatever the data; anything it cannot describe exactly
(another type, a negated view, a sparse tensor, a rank above its limit) is refused, leaving no Python
error set, so the caller describes the call from attributes instead. The addresses go to the call's
value array, and the per-call values after them are zeroed. (Arrays with a CUDA Array Interface:
test_array_interface.py.)"""
import struct

import numpy as np
import pytest

from fmha_rt import arrays
from fmha_rt.runtime import kernel_launch
from fmha_rt.replay import plan_cache
from fmha_rt.runtime.backend import ffi, lib

torch = pytest.importorskip("torch")

if not hasattr(torch.Tensor, "__dlpack_c_exchange_api__"):
    pytest.skip("this torch has no DLPack C exchange API (the attribute path keys its tensors)",
                allow_module_level=True)


@pytest.fixture
def describer():
    return arrays.make_describer(kernel_launch.REPLAY_OPS, (torch.Tensor, torch.nn.Parameter))


def describe(d, *objects, capacity=None):
    """(words, addresses) of `objects`, or None when refused."""
    capacity = len(objects) if capacity is None else capacity
    addresses = ffi.new("uint64_t[]", [0xDEAD] * capacity)  # poisoned: every slot must be written
    described = d(tuple(objects), int(ffi.cast("uintptr_t", addresses)), capacity, 0)
    if described is None:
        return None
    return list(struct.unpack(f"<{len(described) // 8}q", described)), ffi.unpack(addresses, capacity)


def test_words_hold_dtype_rank_device_shape_and_strides_and_addresses_the_data(describer):
    x = torch.randn(3, 5, 2, 8, dtype=torch.float16)[:, 1:4]  # a view: strides of the base
    (words, addresses) = describe(describer, x, None)
    header, device, *rest = words[:-1]
    assert header & 0xFF == 1 and header >> 8 & 0xFF == 4, "kind 1, rank 4"
    assert (header >> 16 & 0xFF, header >> 24 & 0xFF, header >> 32 & 0xFFFF) == (2, 16, 1), "kDLFloat, 16 bits, 1 lane"
    assert header >> 48 == 1 and device == 0, "kDLCPU, ordinal 0"
    assert rest == [*x.shape, *x.stride()]
    assert words[-1] == 0, "None is one zero word"
    assert addresses == [x.data_ptr(), 0]


def test_equal_signatures_give_equal_words_and_every_difference_differs(describer):
    base = torch.randn(2, 16, 4, 8, dtype=torch.float16)
    same = torch.randn(2, 16, 4, 8, dtype=torch.float16)
    assert describe(describer, base)[0] == describe(describer, same)[0]
    assert describe(describer, torch.nn.Parameter(same))[0] == describe(describer, base)[0], "a Parameter keys as a Tensor"
    variants = {
        "dtype": base.to(torch.bfloat16),
        "shape": torch.randn(2, 8, 4, 8, dtype=torch.float16),
        "rank": base.reshape(2, 16, 32),
        "strides": torch.randn(2, 16, 4, 16, dtype=torch.float16)[..., :8],
        "transposed": base.transpose(1, 2),
        "float32": base.float(),
    }
    seen = {tuple(describe(describer, base)[0])}
    for name, t in variants.items():
        words = tuple(describe(describer, t)[0])
        assert words not in seen, name
        seen.add(words)
    assert describe(describer, base, None)[0] != describe(describer, None, base)[0], "positions are described"


@pytest.mark.parametrize("case", ["negated view", "sparse", "numpy", "int", "rank 9", "too many"])
def test_what_it_cannot_describe_exactly_is_refused_without_an_error_left(describer, case):
    x = torch.randn(4, 4)
    objects = {
        "negated view": (x, torch._neg_view(x)),
        "sparse": (x.to_sparse(),),
        "numpy": (np.zeros(3),),
        "int": (3,),
        "rank 9": (torch.zeros((1,) * 9),),
    }.get(case)
    if case == "too many":
        assert describe(describer, x, x, x, capacity=2) is None, "more arrays than value slots"
        many = (x,) * (lib.FMHA_DESCRIBE_MAX_ARRAYS + 1)
        assert describe(describer, *many, capacity=len(many)) is None, "more arrays than the describer takes"
        assert describe(describer, *many[1:]) is not None
        return
    assert describe(describer, *objects) is None
    assert torch.ones(2).sum().item() == 2.0, "no Python error is left set"


def test_the_values_after_the_addresses_are_zeroed(describer):
    x = torch.randn(2, 4, dtype=torch.float16)
    assert describe(describer, x, None, capacity=5)[1] == [x.data_ptr(), 0, 0, 0, 0]


def test_describe_refuses_bad_arguments_with_an_error():
    describe = arrays.make_describer(kernel_launch.REPLAY_OPS, (torch.Tensor,))
    with pytest.raises(TypeError, match="4 arguments"):
        describe((None,), 0, 1)
    with pytest.raises(ValueError, match="NULL"):
        describe((None,), 0, 1, 0)
    with pytest.raises(OverflowError):
        describe((None,), 8, 1, -1)


def _signatures(objects: dict, values):
    return arrays.signatures(tuple(objects.values()), tuple(objects), 0, values, int(ffi.cast("uintptr_t", values)))


def test_signatures_key_a_negated_view_apart_from_its_plain_tensor():
    """The general path takes over where the describer refuses; the two keys never meet."""
    x = torch.randn(2, 4, 1, 8, dtype=torch.float16)
    values = plan_cache.value_array(2)
    plain, _ = _signatures({"q": x, "k": None}, values)
    assert type(plain) is bytes and list(values) == [x.data_ptr(), 0, 0, 0, 0]
    negated, _ = _signatures({"q": torch._neg_view(x), "k": None}, values)
    assert type(negated) is tuple and negated[1] is None and list(values) == [x.data_ptr(), 0, 0, 0, 0]


def test_a_type_without_the_exchange_api_is_refused_and_the_rest_still_described():
    d = ffi.new("fmha_describer *")
    namespace = {}
    assert lib.fmha_describer_init(d, kernel_launch.REPLAY_OPS, id(np.ndarray), 0, 0, 2, id(namespace)) == lib.FMHA_OK
    assert d.types[0] == id(np.ndarray) and d.export_fn == 0 and d.is_neg == 0
    assert describe(namespace["describe"], np.zeros(3)) is None
    assert describe(namespace["describe"], None, capacity=3) == ([0], [0, 0, 0])
    assert lib.fmha_describer_init(d, ffi.NULL, 0, 0, 0, 2, id(namespace)) == lib.FMHA_ERR_BAD_ARGUMENT


def test_without_the_exchange_api_tensors_are_keyed_from_attributes(monkeypatch):
    """A torch without `__dlpack_c_exchange_api__` (the describer refuses its tensors): the attribute
    path keys the same tensors, one description per array, with the same addresses and zeros after them."""
    x = torch.randn(2, 4, 1, 8, dtype=torch.float16)
    fast_values, slow_values = plan_cache.value_array(2), plan_cache.value_array(2)
    slow_values[4] = 0xDEAD  # stale: the per-call values are zeroed
    fast, _ = _signatures({"q": x, "k": None}, fast_values)
    monkeypatch.setattr(torch.Tensor, "__dlpack_c_exchange_api__", None)
    monkeypatch.setattr(arrays, "DESCRIBER", (None, None, None))  # made again, from the torch without it
    slow, imported = _signatures({"q": x, "k": None}, slow_values)
    assert arrays.DESCRIBER[0] is kernel_launch.REPLAY_OPS
    assert slow == ((x.shape, x.stride(), x.dtype, x.device), None) and imported == {}
    assert list(slow_values) == list(fast_values) == [x.data_ptr(), 0, 0, 0, 0] and slow != fast
