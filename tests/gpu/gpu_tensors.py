"""Tensor helpers shared by the GPU tests: seeded generators that print their seed, fresh random inputs,
NaN-poisoned outputs (given, or blocks left in torch's caching allocator for what the torch adapter
allocates), float64 copies, raw-bit comparison and a float64 attention computed on the GPU."""
import itertools
import math
import zlib

from gpu_presence import require

torch = require("torch")

# Integer views of each float dtype, for comparing raw bits (torch.equal compares values: -0.0 == 0.0).
BITS = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32,
        torch.float64: torch.int64}


def seed_of(name):
    """A fixed seed for a name (the same in every process, unlike hash())."""
    return zlib.crc32(name.encode()) % 1_000_000


def generator(seed):
    """A CUDA generator seeded with `seed`, which is printed (pytest shows it with a failure)."""
    print(f"seed {seed}")
    return torch.Generator(device="cuda").manual_seed(seed)


def rand(shape, dtype, gen, scale=1.0):
    """Standard-normal values drawn in float32 on the GPU from `gen`, then cast to `dtype`."""
    return (torch.randn(shape, generator=gen, device="cuda", dtype=torch.float32) * scale).to(dtype)


def nan_like(shape, dtype):
    """An output buffer filled with NaN, so that any element a kernel leaves unwritten shows."""
    return torch.full(shape, float("nan"), device="cuda", dtype=dtype)


def f64(t):
    """A float64 NumPy copy of a tensor (on any device), for the float64 reference."""
    return t.detach().to("cpu", torch.float64).numpy()


def differing_bits(got, want):
    """Elements of the tensors `got` whose raw bits differ from `want`'s, as a device scalar (no host sync);
    a NaN left in an output differs from any written value."""
    total = torch.zeros((), dtype=torch.int64, device="cuda")
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape and g.dtype == w.dtype, (g.shape, g.dtype, w.shape, w.dtype)
        total += (g.view(BITS[g.dtype]) != w.view(BITS[w.dtype])).sum()
    return total


def attention_f64(q, k, v, *, causal=False, rows=None, dout=None):
    """The float64 attention of batched q [B, Sq, Hq, D], k, v [B, Sk, Hk, D] (GQA by repeated key heads,
    causal top-left), computed on the GPU: (out, lse), or (out, lse, dq, dk, dv) with `dout`. rows: a 1-D
    tensor of query rows to compute alone (the others are not formed; no gradients then)."""
    group = q.shape[2] // k.shape[2]
    qd = (q if rows is None else q[:, rows]).double()
    kd, vd = k.double(), v.double()
    if dout is not None:
        qd, kd, vd = (t.requires_grad_() for t in (qd, kd, vd))
    scores = torch.einsum("bqhd,bkhd->bhqk", qd, kd.repeat_interleave(group, 2)) / math.sqrt(q.shape[-1])
    if causal:
        query_rows = torch.arange(q.shape[1], device="cuda") if rows is None else rows
        hidden = torch.arange(k.shape[1], device="cuda")[None, :] > query_rows[:, None]
        scores = scores.masked_fill(hidden[None, None], float("-inf"))
    out = torch.einsum("bhqk,bkhd->bqhd", torch.softmax(scores, -1), vd.repeat_interleave(group, 2))
    lse = torch.logsumexp(scores, -1)
    if dout is None:
        return out.detach(), lse.detach()
    out.backward(dout.double())
    return out.detach(), lse.detach(), qd.grad, kd.grad, vd.grad


def varlen_inputs(lens_q, lens_k, heads_q, heads_k, head_dim, seed, dtype=torch.bfloat16, head_dim_v=None):
    """cu_seqlens_q, cu_seqlens_k (int32 on the GPU) and fresh packed q, k, v, dout for those lengths (values
    head_dim_v wide where given)."""
    cu_q, cu_k = (torch.tensor([0, *itertools.accumulate(lens)], device="cuda", dtype=torch.int32)
                  for lens in (lens_q, lens_k))
    gen = generator(seed)
    tq, tk = sum(lens_q), sum(lens_k)
    dv = head_dim_v or head_dim
    q, k, v = rand((tq, heads_q, head_dim), dtype, gen), rand((tk, heads_k, head_dim), dtype, gen), \
        rand((tk, heads_k, dv), dtype, gen)
    return cu_q, cu_k, q, k, v, rand((tq, heads_q, dv), dtype, gen)


def poison_allocator(*specs):
    """Leave NaN-filled blocks of these (shape, dtype) sizes in torch's caching allocator, which hands
    a freed block of the requested size back first: the adapter's next allocations of these sizes
    start as NaN. Best effort (other allocations may take a block), which the reference check backs."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    blocks = [torch.full(shape, float("nan"), device="cuda", dtype=dtype) for shape, dtype in specs]
    del blocks


def poison_for(q, k, v, lse_shape):
    """poison_allocator for what fmha_rt.torch allocates in a step on q, k, v: out, lse, dq, dk, dv."""
    out_shape = (*q.shape[:-1], v.shape[-1])
    poison_allocator((out_shape, q.dtype), (lse_shape, torch.float32), (q.shape, q.dtype), (k.shape, k.dtype),
                     (v.shape, v.dtype))
