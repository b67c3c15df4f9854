"""The shim's describer of torch tensors (fmha_rt/describe.c), which keys the plan cache: one C call
reads every tensor of a call through torch's DLPack C exchange API. Equal words must mean equal
signatures (shape, strides, dtype, device), whatever the data; anything it cannot describe exactly
(another type, a negated view, a sparse tensor, a rank above its limit) is refused, leaving no Python
error set, so the caller describes the call from attributes instead."""
import numpy as np
import pytest

from fmha_rt import arrays, plan_cache
from fmha_rt.backend import ffi, lib

torch = pytest.importorskip("torch")

if not hasattr(torch.Tensor, "__dlpack_c_exchange_api__"):
    pytest.skip("this torch has no DLPack C exchange API (the attribute path keys its tensors)",
                allow_module_level=True)


@pytest.fixture
def describer():
    d = ffi.new("fmha_describer *")
    assert lib.fmha_describer_init(d, id(torch.Tensor), id(torch.nn.Parameter)) == lib.FMHA_OK
    return d


def describe(d, *objects):
    """(words, addresses) of `objects`, or None when refused."""
    words = ffi.new("int64_t[]", lib.FMHA_DESCRIBE_WORDS_PER_ARRAY * len(objects))
    addresses = ffi.new("uint64_t[]", [0xDEAD] * len(objects))  # poisoned: every slot must be written
    objects = tuple(objects)  # alive across the call: the shim gets its address, not a reference
    n = lib.fmha_describe(d, id(objects), words, len(words), addresses, len(objects))
    return (ffi.unpack(words, n), ffi.unpack(addresses, len(objects))) if n else None


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
        words = ffi.new("int64_t[]", lib.FMHA_DESCRIBE_WORDS_PER_ARRAY)
        addresses = ffi.new("uint64_t[]", 2)
        two, three = (x, x), (x, x, x)
        assert lib.fmha_describe(describer, id(two), words, len(words), addresses, 2) == 0
        assert lib.fmha_describe(describer, id(three), ffi.new("int64_t[]", 64), 64, addresses, 2) == 0
        return
    assert describe(describer, *objects) is None
    assert torch.ones(2).sum().item() == 2.0, "no Python error is left set"


def test_signatures_key_a_negated_view_apart_from_its_plain_tensor():
    """The general path takes over where the describer refuses; the two keys never meet."""
    x = torch.randn(2, 4, 1, 8, dtype=torch.float16)
    values = plan_cache.value_array(2)
    plain, _ = arrays.signatures({"q": x, "k": None}, 0, values)
    assert type(plain[0]) is bytes and list(values)[:2] == [x.data_ptr(), 0]
    negated, _ = arrays.signatures({"q": torch._neg_view(x), "k": None}, 0, values)
    assert type(negated[0]) is not bytes and negated != plain and negated[1] is None


def test_init_refuses_a_type_without_the_exchange_api():
    d = ffi.new("fmha_describer *")
    assert lib.fmha_describer_init(d, id(np.ndarray), 0) == lib.FMHA_ERR_NO_SYMBOL
    words, addresses = ffi.new("int64_t[]", 64), ffi.new("uint64_t[]", 1)
    objects = (np.zeros(2),)
    assert lib.fmha_describe(d, id(objects), words, 64, addresses, 1) == 0


def test_without_the_exchange_api_tensors_are_keyed_from_attributes(monkeypatch):
    """A torch without `__dlpack_c_exchange_api__` (the describer is None): the attribute path keys the
    same tensors, one description per array, with the same addresses."""
    x = torch.randn(2, 4, 1, 8, dtype=torch.float16)
    fast_values, slow_values = plan_cache.value_array(2), plan_cache.value_array(2)
    fast, _ = arrays.signatures({"q": x, "k": None}, 0, fast_values)
    monkeypatch.setattr(arrays, "_DESCRIBER", [None])
    slow, imported = arrays.signatures({"q": x, "k": None}, 0, slow_values)
    assert slow == ((x.shape, x.stride(), x.dtype, x.device), None) and imported == {}
    assert list(slow_values) == list(fast_values) and slow != fast
