"""The correctness gate: before a point is timed, every implementation's output is compared with an fp32
reference computed on the same inputs, and an implementation that fails is not timed at that point.

The reference is torch in float32 with TF32 off, on the inputs' device, one chunk of (batch, head) pairs at
a time so that the [Sq, Sk] scores of a 16k-token sequence fit in memory. Masks align bottom-right (query i
sees keys j <= i + Sk - Sq), as every implementation benchmarked does; every benchmarked point has Sq == Sk.

Per compared tensor (the forward's out; the backward's dq, dk, dv):

    rel_err  ||err|| / ||ref|| over the whole tensor                     passes at <= REL_ERR_LIMIT
    row_err  the worst row's ||err_row|| / max(||ref_row||, rms row norm) passes at <= ROW_ERR_LIMIT

A row is one token of one head (D values). The floor on a row's denominator keeps a row whose reference is
exactly zero (dq of the first query under a causal mask) from dividing by zero; it is judged against the
tensor's typical row instead. A non-finite element fails the check, and outputs that the implementation is
handed (fmha_rt's out, dq, dk, dv) are filled with NaN before the checked call, so an element it never
writes fails too. For bf16 and fp16 inputs the limits are 2e-2 overall and 1e-1 for the worst row: bf16
keeps 8 bits of mantissa (a relative rounding error of 2^-9 per element), and flash-style kernels add the
error of a 16-bit P and dS on top.

A deterministic backward (bwd_det) is also called twice on the same inputs: the two results must agree bit
for bit.
"""

import contextlib
import math

REL_ERR_LIMIT = 2e-2
ROW_ERR_LIMIT = 1e-1
# Bytes of fp32 scores one chunk of (batch, head) pairs may hold; the backward keeps about four such arrays.
CHUNK_SCORE_BYTES = 512 * 1024**2
POISONED_OUTPUTS = ("out", "dq", "dk", "dv")


@contextlib.contextmanager
def _tf32_off(torch):
    matmul, cudnn = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = matmul, cudnn


def reference(case):
    """{"out": ...} for a forward point, {"dq", "dk", "dv": ...} for a backward one: float32 tensors in the
    layout of case.q / case.k / case.v, computed from the case's own inputs."""
    import torch

    point = case.point
    with torch.no_grad(), _tf32_off(torch):
        if not point.varlen:
            return _dense_reference(case.q, case.k, case.v, case.dout, point.causal)
        found = {}
        bounds = case.cu_seqlens.tolist()
        for start, end in zip(bounds[:-1], bounds[1:]):
            dout = None if case.dout is None else case.dout[None, start:end]
            part = _dense_reference(case.q[None, start:end], case.k[None, start:end], case.v[None, start:end],
                                    dout, point.causal)
            for name, tensor in part.items():
                found.setdefault(name, []).append(tensor[0])
        return {name: torch.cat(parts) for name, parts in found.items()}


def _dense_reference(q, k, v, dout, causal):
    """The reference of one dense problem, [B, S, H, D] tensors, chunked over (batch, head) pairs."""
    import torch

    batch, sq, hq, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    group = hq // hk
    scale = 1.0 / math.sqrt(d)
    # [B*Hq, S, D] float32, one slice per (batch, query head); k and v repeated per query head
    qs = q.float().permute(0, 2, 1, 3).reshape(batch * hq, sq, d)
    ks = k.float().repeat_interleave(group, dim=2).permute(0, 2, 1, 3).reshape(batch * hq, sk, d)
    vs = v.float().repeat_interleave(group, dim=2).permute(0, 2, 1, 3).reshape(batch * hq, sk, v.shape[-1])
    dos = None if dout is None else dout.float().permute(0, 2, 1, 3).reshape(batch * hq, sq, dout.shape[-1])
    hidden = None
    if causal:
        rows, cols = torch.arange(sq, device=q.device)[:, None], torch.arange(sk, device=q.device)[None, :]
        hidden = cols > rows + (sk - sq)
    results = {}
    per_pair = sq * sk * 4
    step = max(1, CHUNK_SCORE_BYTES // per_pair)
    for start in range(0, batch * hq, step):
        part = slice(start, start + step)
        scores = torch.matmul(qs[part], ks[part].transpose(1, 2)) * scale
        if hidden is not None:
            scores.masked_fill_(hidden, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        del scores
        out = torch.matmul(probs, vs[part])
        if dos is None:
            results.setdefault("out", []).append(out)
            continue
        dv = torch.matmul(probs.transpose(1, 2), dos[part])
        dprobs = torch.matmul(dos[part], vs[part].transpose(1, 2))
        row_dot = (dos[part] * out).sum(-1, keepdim=True)
        dscores = probs.mul_(dprobs.sub_(row_dot))
        del dprobs
        results.setdefault("dq", []).append(torch.matmul(dscores, ks[part]) * scale)
        results.setdefault("dk", []).append(torch.matmul(dscores.transpose(1, 2), qs[part]) * scale)
        results.setdefault("dv", []).append(dv)
    return {name: _to_flash_layout(torch.cat(parts), batch, hq, group if name in ("dk", "dv") else 1)
            for name, parts in results.items()}


def _to_flash_layout(stacked, batch, hq, group):
    """[B*Hq, S, D] -> [B, S, Hq / group, D], summing each group of query heads (dk, dv of a GQA key head)."""
    seq, d = stacked.shape[1:]
    grouped = stacked.reshape(batch, hq // group, group, seq, d).sum(2)
    return grouped.permute(0, 2, 1, 3).contiguous()


def tensor_errors(result, expected):
    """{"rel_err", "row_err", "finite"} of one output against its reference (both [..., D])."""
    import torch

    got = result.float()
    finite = bool(torch.isfinite(got).all())
    if not finite:
        return {"rel_err": math.inf, "row_err": math.inf, "finite": False}
    err = got - expected
    ref_norm = float(torch.linalg.vector_norm(expected))
    rel_err = float(torch.linalg.vector_norm(err)) / ref_norm if ref_norm else float(torch.linalg.vector_norm(err))
    d = expected.shape[-1]
    err_rows = torch.linalg.vector_norm(err.reshape(-1, d), dim=-1)
    ref_rows = torch.linalg.vector_norm(expected.reshape(-1, d), dim=-1)
    floor = ref_norm / math.sqrt(ref_rows.numel()) or 1.0
    row_err = float((err_rows / ref_rows.clamp(min=floor)).max())
    return {"rel_err": rel_err, "row_err": row_err, "finite": True}


def judge(results, expected):
    """The check of one implementation's outputs {name: tensor} against the reference {name: tensor}: per
    tensor its errors, and "passed" with, where it failed, "reason"."""
    check = {"rel_err_limit": REL_ERR_LIMIT, "row_err_limit": ROW_ERR_LIMIT, "tensors": {}}
    problems = []
    for name, want in expected.items():
        got = results.get(name)
        if got is None or tuple(got.shape) != tuple(want.shape):
            shape = None if got is None else tuple(got.shape)
            problems.append(f"{name}: shape {shape}, expected {tuple(want.shape)}")
            continue
        errors = tensor_errors(got, want)
        check["tensors"][name] = {"rel_err": errors["rel_err"], "row_err": errors["row_err"]}
        if not errors["finite"]:
            problems.append(f"{name}: non-finite elements")
        elif errors["rel_err"] > REL_ERR_LIMIT:
            problems.append(f"{name}: rel_err {errors['rel_err']:.3g} > {REL_ERR_LIMIT:g}")
        elif errors["row_err"] > ROW_ERR_LIMIT:
            problems.append(f"{name}: row_err {errors['row_err']:.3g} > {ROW_ERR_LIMIT:g}")
    check["passed"] = not problems
    if problems:
        check["reason"] = "; ".join(problems)
    return check


def bitwise_equal(first, second):
    """Whether two {name: tensor} results agree bit for bit (compared as raw bytes)."""
    import torch

    return first.keys() == second.keys() and all(
        torch.equal(first[n].contiguous().view(torch.uint8), second[n].contiguous().view(torch.uint8))
        for n in first)


def poison_given_outputs(call):
    """Fill with NaN the output buffers a call was bound with (functools.partial keywords out, dq, dk, dv), so
    that an element the implementation does not write shows in the check."""
    keywords = getattr(call, "keywords", None) or {}
    for name in POISONED_OUTPUTS:
        buffer = keywords.get(name)
        if buffer is not None:
            buffer.fill_(float("nan"))
