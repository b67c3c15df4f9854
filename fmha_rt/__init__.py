"""fmha_rt: fused multi-head attention forward and backward from ahead-of-time compiled kernels."""
__version__ = "0.1.0"
