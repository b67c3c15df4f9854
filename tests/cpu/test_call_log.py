"""FMHA_RT_LOG_CONFIG's line per API call (fmha_rt/call_log.py) on the CPU stand-in (fake_gpu.py): each
field's value for a forward, a GQA backward with a window, a varlen forward, dropout by value and by
device array, the dropout mask and a plan-cache hit; nothing at all when the variable is unset. The
kernels a line names are the ones the stand-in driver saw launched."""
import logging

import numpy as np

import fmha_rt
from fmha_rt.plan.problem import AttentionProblem

from fake_gpu import FakeGpuArray
from log_lines import logged_calls

B, S, H, D = 2, 64, 4, 64


def attention_arrays(hq=H, hk=H, sk=S, device=0):
    q, k, v = (FakeGpuArray(shape, device=device) for shape in ((B, S, hq, D), (B, sk, hk, D), (B, sk, hk, D)))
    return q, k, v, FakeGpuArray((B, S, hq, D), device=device), FakeGpuArray((B, hq, S), "float32", device=device)


def one_call(caplog, driver, call) -> tuple[dict, list]:
    """The one line `call` logs, and the kernels the driver saw it launch."""
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="fmha_rt"):
        call()
    (line,) = logged_calls(caplog.records)
    return line, [key for key, *_ in driver.take()]


def test_a_forward_logs_its_arrays_and_options(rt, driver, caplog, log_config):
    q, k, v, out, lse = attention_arrays(device=1)
    line, launched = one_call(caplog, driver, lambda: fmha_rt.mha_fwd(
        q, k, v, out=out, lse=lse, softmax_scale=0.25, mask_type=2, window=(32, -1)))
    assert line == {
        "function": "mha_fwd", "family": "portable", "kernels": ",".join(launched), "device": "1", "arch": "sm_90",
        "q": "fp16[2,64,4,64]:[16384,256,64,1]", "k": "fp16[2,64,4,64]:[16384,256,64,1]",
        "v": "fp16[2,64,4,64]:[16384,256,64,1]", "out": "fp16[2,64,4,64]:[16384,256,64,1]",
        "lse": "fp32[2,4,64]:[256,64,1]", "softmax_scale": "0.25", "window": "(32,0)",
        "causal_alignment": "bottom_right", "mask_type": "2", "dropout_p": "0.0", "seed": "none", "offset": "none",
        "bias_shape": "none", "alibi_shape": "none", "deterministic": "False", "workspace_bytes": "0",
        "dq_splits": "none"}
    assert launched == ["fmha_fwd_fp16_d64_nobias_nodrop"]


def test_a_gqa_backward_with_a_window_logs_its_workspace_and_dq_splits(rt, driver, caplog, log_config):
    q, k, v, out, lse = attention_arrays(hq=8, hk=2, sk=96)
    dout, dq, dk, dv = FakeGpuArray(q.shape), FakeGpuArray(q.shape), FakeGpuArray(k.shape), FakeGpuArray(v.shape)
    # a view with a padded head stride: strides are logged as the kernels get them
    k_view = FakeGpuArray((B, 96, 2, D), base=FakeGpuArray((B, 96, 2, 2 * D)).base, strides=(96 * 256, 256, 128, 1))
    line, launched = one_call(caplog, driver, lambda: fmha_rt.mha_bwd(
        dout, q, k_view, v, out, lse, dq=dq, dk=dk, dv=dv, window=(16, 8), deterministic=True))
    problem = AttentionProblem(batch=B, seqlen_q=S, seqlen_k=96, heads_q=8, heads_k=2, head_dim_qk=D, head_dim_v=D,
                               dtype="fp16", window_left=16, window_right=8, deterministic=True)
    launcher = fmha_rt.BwdLauncher(problem, "sm_90")
    assert launcher.workspace_size > 0
    assert (line["function"], line["family"], line["kernels"]) == ("mha_bwd", "portable", ",".join(launched))
    assert len(launched) >= 2
    assert line["workspace_bytes"] == str(launcher.workspace_size)
    assert line["dq_splits"] == str(launcher.dq_acc_splits)
    assert line["q"] == line["dout"] == line["dq"] == "fp16[2,64,8,64]:[32768,512,64,1]"
    assert line["k"] == "fp16[2,96,2,64]:[24576,256,128,1]" and line["dk"] == "fp16[2,96,2,64]:[12288,128,64,1]"
    assert line["lse"] == "fp32[2,8,64]:[512,64,1]"
    assert (line["window"], line["mask_type"], line["causal_alignment"]) == ("(16,8)", "3", "top_left")
    assert line["deterministic"] == "True" and line["softmax_scale"] == repr(1 / 8)


def test_a_varlen_forward_logs_its_sequence_offsets(rt, driver, caplog, log_config):
    q, k, v = FakeGpuArray((100, 4, 64)), FakeGpuArray((90, 2, 64)), FakeGpuArray((90, 2, 64))
    cu_q, cu_k = np.array([0, 60, 100], np.int32), np.array([0, 30, 90], np.int32)
    line, launched = one_call(caplog, driver, lambda: fmha_rt.mha_varlen_fwd(q, k, v, cu_q, cu_k, 60, 60,
                                                                             causal=True))
    assert (line["function"], line["kernels"]) == ("mha_varlen_fwd", ",".join(launched))
    assert line["q"] == "fp16[100,4,64]:[256,64,1]" and line["k"] == "fp16[90,2,64]:[128,64,1]"
    assert line["cu_seqlens_q"] == line["cu_seqlens_k"] == "int32[3]:[1]"
    assert line["lse"] == "fp32[4,100]:[100,1]"
    assert (line["window"], line["mask_type"], line["causal_alignment"]) == ("(-1,0)", "1", "top_left")


def test_dropout_logs_its_seed_by_value_or_device(rt, driver, caplog, log_config):
    q, k, v, out, lse = attention_arrays()
    line, _ = one_call(caplog, driver, lambda: fmha_rt.mha_fwd(q, k, v, out=out, lse=lse, dropout_p=0.25,
                                                               seed=-1234, offset=7))
    assert (line["dropout_p"], line["seed"], line["offset"]) == ("0.25", "-1234", "7")
    seed = FakeGpuArray((2,), "int64")
    line, _ = one_call(caplog, driver, lambda: fmha_rt.mha_fwd(q, k, v, out=out, lse=lse, dropout_p=0.5, seed=seed))
    assert (line["dropout_p"], line["seed"], line["offset"]) == ("0.5", "device", "device")
    mask = FakeGpuArray((B, H, S, S), "uint8")
    line, launched = one_call(caplog, driver, lambda: fmha_rt.mha_dropout_mask(q, k, dropout_p=0.5, seed=9, offset=3,
                                                                               out=mask))
    assert (line["function"], line["kernels"], line["mask"]) == ("mha_dropout_mask", ",".join(launched),
                                                                 "uint8[2,4,64,64]:[16384,4096,64,1]")
    assert (line["seed"], line["offset"]) == ("9", "3")


def test_a_plan_cache_hit_logs_what_the_recording_call_logged_with_its_own_seed(rt, driver, caplog, log_config):
    q, k, v, out, lse = attention_arrays(hq=8, hk=2)
    lines = []
    for seed in (5, 5, 6):  # a miss, a miss that records, a hit
        lines.append(one_call(caplog, driver, lambda: fmha_rt.mha_fwd(
            q, k, v, out=out, lse=lse, causal=True, dropout_p=0.125, seed=seed, offset=11)))
    assert fmha_rt.plan_cache_info()["hits"] == 1
    assert lines[0] == lines[1]
    (hit, launched), (recorded, _) = lines[2], lines[1]
    assert hit == {**recorded, "seed": "6"} and hit["kernels"] == ",".join(launched)


def test_nothing_is_logged_when_the_variable_is_unset(rt, driver, caplog):
    q, k, v, out, lse = attention_arrays()
    dout, dq, dk, dv = (FakeGpuArray(q.shape) for _ in range(4))
    with caplog.at_level(logging.DEBUG, logger="fmha_rt"):
        for _ in range(3):  # planned, recorded, replayed
            fmha_rt.mha_fwd(q, k, v, out=out, lse=lse, causal=True)
            fmha_rt.mha_bwd(dout, q, k, v, out, lse, dq=dq, dk=dk, dv=dv, causal=True)
    assert fmha_rt.plan_cache_info()["hits"] == 2 and driver.take()
    assert caplog.records == []

