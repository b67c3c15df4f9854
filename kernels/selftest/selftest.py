"""Self-test kernels: tiny, exact, and covering every argument kind the packer knows (pointers, i32,
i64, f32), so that loading, packing and launching can be checked bit for bit on any GPU."""
import triton
import triton.language as tl


@triton.jit
def strided_copy(src, dst, n, src_stride, dst_stride, BLOCK: tl.constexpr):
    """dst[i * dst_stride] = src[i * src_stride] for i < n; strides are i64 element strides."""
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    keep = i < n
    tl.store(dst + i * dst_stride, tl.load(src + i * src_stride, mask=keep), mask=keep)


@triton.jit
def axpy(x, y, out, alpha, n, BLOCK: tl.constexpr):
    """out = alpha * x + y over n float32 elements."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    keep = i < n
    tl.store(out + i, alpha * tl.load(x + i, mask=keep) + tl.load(y + i, mask=keep), mask=keep)


BLOCK = 1024
NUM_WARPS = 4


def variants(arch: str) -> list[dict]:
    """What the build compiles for each arch (the same for all three)."""
    common = {"module": "kernels.selftest.selftest", "constexprs": {"BLOCK": BLOCK}, "num_warps": NUM_WARPS,
              "num_stages": 1, "family": "selftest"}
    return [
        dict(common, key="selftest_strided_copy_f32", function="strided_copy",
             signature={"src": "*fp32", "dst": "*fp32", "n": "i64", "src_stride": "i64", "dst_stride": "i64",
                        "BLOCK": "constexpr"},
             traits={"dtype": "fp32", "block": BLOCK}),
        dict(common, key="selftest_axpy_f32", function="axpy",
             signature={"x": "*fp32", "y": "*fp32", "out": "*fp32", "alpha": "fp32", "n": "i32",
                        "BLOCK": "constexpr"},
             traits={"dtype": "fp32", "block": BLOCK}),
    ]
