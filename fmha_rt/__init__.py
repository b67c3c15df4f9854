"""fmha_rt: fused multi-head attention forward and backward from ahead-of-time compiled kernels.

    import fmha_rt
    out, lse = fmha_rt.mha_fwd(q, k, v, causal=True)              # q [B, S, H, D], any DLPack array
    dq, dk, dv = fmha_rt.mha_bwd(dout, q, k, v, out, lse, causal=True, deterministic=True)
"""
__version__ = "0.1.0"

from .api import (BwdLauncher, bwd_workspace_bytes, mha_bwd, mha_dropout_mask, mha_fwd, mha_varlen_bwd, mha_varlen_fwd,
                  release_workspaces, varlen_bwd_workspace_bytes)
from .call_keys import clear_plan_cache, plan_cache_info
from .errors import (DriverError, FmhaError, FmhaNotImplementedError, FmhaRuntimeError, FmhaTypeError,
                     FmhaValueError)
from .runtime.executor import last_launch_info
from .runtime.packing import Pointer

__all__ = ["mha_fwd", "mha_bwd", "mha_varlen_fwd", "mha_varlen_bwd", "mha_dropout_mask", "BwdLauncher",
           "bwd_workspace_bytes", "varlen_bwd_workspace_bytes", "last_launch_info", "clear_plan_cache", "plan_cache_info",
           "release_workspaces", "Pointer",
           "FmhaError", "FmhaValueError", "FmhaTypeError", "FmhaRuntimeError", "FmhaNotImplementedError", "DriverError"]
