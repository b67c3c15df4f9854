"""The backward's launches, pass by pass, for whichever family picks the kernels: each builder takes the
variant key (and tile) a family chose and returns one Launch. A family's plan_bwd composes them in its
strategy's order: dQ first (which also writes Delta and Lse2), then dK/dV, for the deterministic
strategy; the pre-pass (Delta), dK/dV adding into the fp32 dQ accumulator, then its conversion, for the
atomic one; the pre-pass, the persistent dK/dV pass adding dQ in key-block order, then the conversion, for the
ordered one; the pre-pass and the fused grid for the fused one; the fused grid alone for the single one;
then the bias gradient where the problem has one.

The operands are a forward's plus dout, dq, dk, dv, optional dbias, and in their regions one address
per region of the backward's workspace (layout.backward_workspace, by its name: delta, lse2, dq_acc, dq_order, ds):
the caller carves them out of one workspace buffer and zeroes the regions marked zero_init.
"""
import math
import os

from fmha_rt.errors import FmhaValueError

from .abi import DQ_ATOMIC, DQ_ORDERED, DQ_SINGLE, ROWS_TILE, ordered
from .args import Args, Launch, cdiv, launch_grid
from .layout import contiguous_strides


# A debug setting for the ORDERED strategy: how many of its dK/dV programs may run at once (the portable
# pass's persistent programs; the v3 pass's programs a launch, its items going in waves of this many). The
# bits must be the same for every value.
BWD_PROGRAMS_ENV = "FMHA_RT_BWD_PROGRAMS"


def forced_programs():
    """FMHA_RT_BWD_PROGRAMS as a positive integer, None where it is unset. Read at every plan: the plan
    cache does not key on it (clear it after a change)."""
    forced = os.environ.get(BWD_PROGRAMS_ENV, "")
    if not forced:
        return None
    if not (forced.isascii() and forced.isdigit() and int(forced) > 0):
        raise FmhaValueError(f"{BWD_PROGRAMS_ENV}={forced!r}: expected a positive integer number of programs")
    return int(forced)


class BackwardArgs:
    """The argument groups a backward's launches share, built once from the call's operands and its
    workspace layout."""

    def __init__(self, problem, operands, workspace):
        self.problem = p = problem
        self.workspace = workspace
        self.args = a = Args(problem, operands)
        n, r = a.need, operands.region
        self.varlen, self.shape, self.mask = a.varlen(), a.shape(), a.mask()
        self.rows = {arg: a.rows(operand, arg) for operand, arg in ((n.q, "q"), (n.k, "k"), (n.v, "v"), (n.out, "o"),
                                                                     (n.dout, "do"), (n.dq, "dq"), (n.dk, "dk"),
                                                                     (n.dv, "dv"))}
        if workspace.dq_strategy == DQ_SINGLE:  # its programs compute Delta and Lse2 and keep them: no workspace
            self.delta = {"Delta": None, "Lse2": None, "stride_delta_b": 0, "stride_delta_h": 0}
        else:
            strides = contiguous_strides(workspace.region("delta").shape)
            # lse2 has delta's shape, so one pair of strides serves both
            self.delta = {"Delta": r("delta"), "Lse2": r("lse2"),
                          "stride_delta_b": 0 if p.varlen else strides[0], "stride_delta_h": strides[-2]}
        self.lse = dict(a.lse_like(n.lse, "lse"), Lse=n.lse.pointer)
        self.attention = {"Q": n.q.pointer, "K": n.k.pointer, "V": n.v.pointer, "dO": n.dout.pointer,
                          **self.lse, **self.delta, **a.score_terms(), **a.dropout(), **self.varlen, **self.shape,
                          **self.mask, **self.rows["q"], **self.rows["k"], **self.rows["v"], **self.rows["do"],
                          "softmax_scale": p.softmax_scale, "scale_log2": p.softmax_scale * math.log2(math.e)}
        self.dq_acc = {"DqAcc": None, "stride_dqacc_b": 0, "stride_dqacc_s": 0, "stride_dqacc_h": 0}
        if workspace.dq_strategy in (DQ_ATOMIC, DQ_ORDERED):
            self.dq_acc = {"DqAcc": r("dq_acc"), **self.region_strides("dq_acc", "dqacc")}
        self.ds = {"dS": None, "stride_ds_b": 0, "stride_ds_h": 0, "stride_ds_s": 0, "write_dbias": 0}
        if p.bias_grad:
            st = contiguous_strides(workspace.region("ds").shape)
            self.ds = {"dS": r("ds"), "stride_ds_b": st[0], "stride_ds_h": st[1], "stride_ds_s": st[2],
                       "write_dbias": 1}
        self.outputs = {**self.ds, **self.rows["dk"], **self.rows["dv"], "dK": n.dk.pointer, "dV": n.dv.pointer}

    def region_strides(self, region, name) -> dict:
        """stride_<name>_b/s/h of a workspace region laid out as rows of heads, [B, S, H, d] or [total, H, d]."""
        st = contiguous_strides(self.workspace.region(region).shape)
        b, s, h = (0, st[0], st[1]) if self.problem.varlen else st[:3]
        return {f"stride_{name}_b": b, f"stride_{name}_s": s, f"stride_{name}_h": h}

    def rows_pass(self):
        """What the row passes (preprocess, dq_convert) share: the query rows' offsets and shape."""
        v = self.varlen
        return {"CuSeqlensQ": v["CuSeqlensQ"], "SeqstartQ": v["SeqstartQ"], "seqlen_q": self.problem.seqlen_q,
                "is_varlen": v["is_varlen"], "has_seqstart": v["has_seqstart"]}

    def rows_grid(self):
        return launch_grid(cdiv(self.problem.seqlen_q, ROWS_TILE.block_m), self.problem)


def preprocess(b: BackwardArgs, key) -> Launch:
    """Delta = rowsum(dO * O) and Lse2 of every query row, into the workspace."""
    args = {"Out": b.args.need.out.pointer, "dO": b.args.need.dout.pointer, **b.rows_pass(), **b.rows["o"],
            **b.rows["do"], **b.lse, **b.delta, "head_dim_v_div8": b.shape["head_dim_v_div8"]}
    return Launch(key, b.rows_grid(), ordered(key, "fmha_bwd_preprocess", args))


def dq(b: BackwardArgs, key, tile) -> Launch:
    """dQ by query blocks of `tile`, writing the Delta and Lse2 that dK/dV reads."""
    args = {**b.attention, **b.rows["o"], **b.rows["dq"], "Out": b.args.need.out.pointer, "dQ": b.args.need.dq.pointer}
    return Launch(key, launch_grid(cdiv(b.problem.seqlen_q, tile.block_m), b.problem), ordered(key, "fmha_bwd_dq", args))


def dkdv(b: BackwardArgs, key, block_n, extra=None) -> Launch:
    """dK and dV by key blocks of `block_n` (and dQ into the accumulator under the atomic strategy);
    `extra` the arguments a family's kernel takes beyond the signature (the v3 kernel's global scratch)."""
    args = ordered(key, "fmha_bwd_dkdv", {**b.attention, **b.dq_acc, **b.outputs})
    grid = launch_grid(cdiv(b.problem.seqlen_k, block_n), b.problem)
    return Launch(key, (grid[0], b.problem.heads_k, grid[2]), {**args, **(extra or {})})


def dkdv_heads(b: BackwardArgs, key, block_n, extra=None) -> Launch:
    """GQA's dK and dV by query head (fmha_bwd_dkdv's ONE_HEAD): a program per (`block_n` keys, query head, batch
    entry), adding dQ into its accumulator and dK and dV into theirs, the workspace regions dk_acc and dv_acc
    (zeroed; dkdv_convert makes the outputs); `extra` as for dkdv."""
    region = b.args.operands.region
    accumulators = {"dK": region("dk_acc"), "dV": region("dv_acc"), **b.region_strides("dk_acc", "dk"),
                    **b.region_strides("dv_acc", "dv")}
    args = ordered(key, "fmha_bwd_dkdv", {**b.attention, **b.dq_acc, **b.outputs, **accumulators})
    return Launch(key, launch_grid(cdiv(b.problem.seqlen_k, block_n), b.problem), {**args, **(extra or {})})


def dkdv_convert(b: BackwardArgs, key, name) -> Launch:
    """The fp32 accumulator of dK or dV (`name`: 'dk' or 'dv', region '<name>_acc', already scaled) into its
    output, by the dQ conversion's kernel run over the key rows and key heads."""
    p, v = b.problem, b.varlen
    acc = b.region_strides(f"{name}_acc", "dqacc")
    out = {f"stride_dq_{axis}": b.rows[name][f"stride_{name}_{axis}"] for axis in "bsh"}
    dims = b.shape["head_dim_qk_div8" if name == "dk" else "head_dim_v_div8"]
    args = {"DqAcc": b.args.operands.region(f"{name}_acc"), **acc, **out, "dQ": b.outputs["dK" if name == "dk" else "dV"],
            "CuSeqlensQ": v["CuSeqlensK"], "SeqstartQ": v["SeqstartK"], "seqlen_q": p.seqlen_k,
            "is_varlen": v["is_varlen"], "has_seqstart": v["has_seqstart"], "head_dim_qk_div8": dims, "softmax_scale": 1.0}
    grid = (cdiv(p.seqlen_k, ROWS_TILE.block_m), p.heads_k, launch_grid(1, p)[2])
    return Launch(key, grid, ordered(key, "fmha_bwd_dq_convert", args))


def dkdv_ordered(b: BackwardArgs, key, programs, extra=None) -> Launch:
    """dK and dV by `programs` programs taking (key block, key head, batch entry) items in turn (by ticket:
    the portable pass is persistent, the v3 one has a program per item), dQ added into the accumulator in
    key-block order (the zeroed order region dq_order); `extra` as for dkdv."""
    args = {**b.attention, **b.dq_acc, **b.outputs, "DqOrder": b.args.operands.region("dq_order"),
            "batch": b.problem.batch}
    return Launch(key, (programs, 1, 1), {**ordered(key, "fmha_bwd_dkdv_ordered", args), **(extra or {})})


def fused(b: BackwardArgs, key, kv_tile, q_tile) -> Launch:
    """The fused grid: dK/dV programs by key blocks of kv_tile, then dQ programs by query blocks of q_tile."""
    p = b.problem
    args = {**b.attention, **b.outputs, **b.rows["dq"], **b.rows["o"], "Out": b.args.need.out.pointer,
            "dQ": b.args.need.dq.pointer}
    blocks = cdiv(p.seqlen_k, kv_tile.block_n) + cdiv(p.seqlen_q, q_tile.block_m) * p.kv_group_size
    grid = launch_grid(blocks, p)
    return Launch(key, (grid[0], p.heads_k, grid[2]), ordered(key, "fmha_bwd_fused", args))


def dq_convert(b: BackwardArgs, key) -> Launch:
    """The fp32 dQ accumulator, scaled, into dQ."""
    args = {**b.dq_acc, **b.rows["dq"], **b.rows_pass(), "dQ": b.args.need.dq.pointer,
            "head_dim_qk_div8": b.shape["head_dim_qk_div8"], "softmax_scale": b.problem.softmax_scale}
    return Launch(key, b.rows_grid(), ordered(key, "fmha_bwd_dq_convert", args))


def dbias(b: BackwardArgs, key, block_m) -> Launch:
    """dS reduced over the bias's broadcast dims into dbias, `block_m` query rows a program."""
    p = b.problem
    dbias_operand = b.args.need.dbias
    strides_b, strides_h, strides_s, _ = b.args.given_strides(dbias_operand, 4)
    batch_bcast, head_bcast = p.bias_shape[0] == "1", p.bias_shape[1] == "1"
    args = {"dS": b.ds["dS"], "stride_ds_b": b.ds["stride_ds_b"], "stride_ds_h": b.ds["stride_ds_h"],
            "stride_ds_s": b.ds["stride_ds_s"], "dBias": dbias_operand.pointer,
            **b.args.checked_strides({"stride_dbias_b": strides_b if not batch_bcast else 0,
                                      "stride_dbias_h": strides_h if not head_bcast else 0,
                                      "stride_dbias_s": strides_s}, "dbias"),
            "seqlen_q": p.seqlen_q, "seqlen_k": p.seqlen_k, "reduce_batch": p.batch if batch_bcast else 1,
            "reduce_heads": p.heads_q if head_bcast else 1}
    grid = (cdiv(p.seqlen_q, block_m), 1 if head_bcast else p.heads_q, 1 if batch_bcast else p.batch)
    return Launch(key, grid, ordered(key, "fmha_bwd_dbias", args))
