"""fmha_rt.jax.flash_attention against jax.nn.dot_product_attention, under jit, on one GPU.

    python bench/jax_attention.py [--hdim 64 128] [--seqlen 1k 4k 16k] [--causal both|yes|no]
                                  [--impl fmha_rt cudnn xla] [--repeats 20] [--warmup-ms 200] [--out FILE]

Points follow the benchmark grid (fmha_rt.bench.grid): bf16, B * S = 16k tokens, H * D = 2048, MHA.
Passes: "fwd" (the attention alone) and "fwd_bwd" (jax.vjp of it and the gradients of q, k, v for a
fixed cotangent), each one jitted function. Implementations: fmha_rt (through its XLA FFI custom calls),
cudnn and xla (jax.nn.dot_product_attention's implementations; xla forms the [B, H, S, S] scores, so
it may run out of memory at 16k: the row then holds the error). TFLOP/s use fmha_rt.bench.flops: fwd =
4 B H S^2 D (halved when causal), fwd_bwd = fwd + 2.5 fwd.

Timing (fmha_rt.bench.timing's rules): inputs rotate among copies so that every call reads from HBM,
the first call (compile included) is timed alone, then at least --warmup-ms of synchronised calls, then
--repeats calls in groups of 10 queued back to back, each group timed from its first dispatch to
block_until_ready on its last result; the median per-call time of the groups is reported. Each row also
gives fmha_rt's relative error against cudnn on the same inputs (forward output; dq for fwd_bwd).
"""
import argparse
import dataclasses
import datetime
import importlib.metadata
import json
import os
import pathlib
import platform
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # the xla rows need what they need, no more

import jax
import jax.numpy as jnp
import numpy as np

from fmha_rt import reference
from fmha_rt.bench import flops, grid, machine, timing
from fmha_rt.bench.cli import parse_seqlen

HERE = pathlib.Path(__file__).resolve().parent
DEFAULT_OUT = HERE / "results" / "h200_jax_attention_bf16.json"
IMPLS = ("fmha_rt", "cudnn", "xla")
PASSES = ("fwd", "fwd_bwd")
GROUP = 10  # calls per timed group
DISTRIBUTIONS = ("jax", "jaxlib", "jax-cuda13-plugin", "jax-cuda13-pjrt", "jax-cuda12-plugin", "jax-cuda12-pjrt")


class JaxDevice:
    """fmha_rt.bench.timing's device protocol for jax: a call is waited for by blocking on its result."""

    def __init__(self):
        self.pending = None

    def track(self, fn, *args):
        def call():
            self.pending = fn(*args)
        return call

    def synchronize(self):
        if self.pending is not None:
            jax.block_until_ready(self.pending)
            self.pending = None

    def time_each(self, calls):
        """Per-call milliseconds of groups of GROUP calls queued back to back: a group pays one wait,
        so the samples are GPU time, not the wait for an idle stream."""
        samples = []
        for first in range(0, len(calls), GROUP):
            group = calls[first:first + GROUP]
            start = time.perf_counter()
            for call in group:
                call()
            self.synchronize()
            samples.append((time.perf_counter() - start) * 1e3 / len(group))
        return samples


def attention(impl, causal):
    if impl == "fmha_rt":
        from fmha_rt.jax import flash_attention

        return lambda q, k, v: flash_attention(q, k, v, causal=causal)
    return lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation=impl)


def compiled(impl, pass_name, causal):
    f = attention(impl, causal)
    if pass_name == "fwd":
        return jax.jit(f)

    def fwd_bwd(q, k, v, dout):
        out, vjp = jax.vjp(f, q, k, v)
        return (out, *vjp(dout))

    return jax.jit(fwd_bwd)


def make_inputs(point, copies, seed):
    shape = (point.batch, point.seqlen_q, point.heads_q, point.head_dim)
    keys = jax.random.split(jax.random.PRNGKey(seed), 4 * copies)
    draws = [jax.random.normal(key, shape, jnp.float32).astype(jnp.bfloat16) for key in keys]
    return [tuple(draws[4 * c:4 * c + 4]) for c in range(copies)]


def pass_flops(point, pass_name):
    fwd = point.flops()
    return fwd if pass_name == "fwd" else fwd + flops.pass_flops("bwd", point.batch, point.heads_q, point.seqlen_q,
                                                                point.seqlen_k, point.head_dim, point.causal)


def measure(impl, pass_name, point, copies, args):
    fn = compiled(impl, pass_name, point.causal)
    device = JaxDevice()
    calls = [device.track(fn, *(c[:3] if pass_name == "fwd" else c)) for c in copies]
    try:
        first = timing.first_call_ms(calls[0], device)
        timed = timing.time_calls(calls, device, warmup_ms=args.warmup_ms, repeats=args.repeats)
    except (RuntimeError, ValueError, NotImplementedError) as exc:  # out of memory; a shape an impl refuses
        return {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"}
    return {"first_call_ms": first, **timed.fields(), "tflops": flops.tflops(pass_flops(point, pass_name), timed.ms)}


def relative_error(pass_name, point, inputs):
    """fmha_rt against cudnn on one copy of the inputs: the output (fwd) or dq (fwd_bwd)."""
    try:
        ours = compiled("fmha_rt", pass_name, point.causal)(*(inputs[:3] if pass_name == "fwd" else inputs))
        theirs = compiled("cudnn", pass_name, point.causal)(*(inputs[:3] if pass_name == "fwd" else inputs))
    except (RuntimeError, ValueError, NotImplementedError) as exc:
        return f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    pick = (lambda r: r) if pass_name == "fwd" else (lambda r: r[1])
    return reference.rel_err(np.asarray(pick(ours), np.float32), np.asarray(pick(theirs), np.float32))


def header(args):
    device = jax.devices("gpu")[0]
    smi = machine.nvidia_smi_row(None, device.id)
    versions = {}
    for name in DISTRIBUTIONS:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "gpu": device.device_kind,
        "clocks_mhz": {key: smi.get(field) for key, field in
                       (("sm", "clocks.sm"), ("mem", "clocks.mem"), ("max_sm", "clocks.max.sm"))},
        "driver": smi.get("driver_version"),
        "python": platform.python_version(),
        "versions": versions,
        "fmha_rt": machine.fmha_rt_version(),
        "fmha_rt_commit": machine.git_commit(),
        "fmha_rt_sources_sha256": machine.sources_digest(),
        "settings": {"repeats": args.repeats, "warmup_ms": args.warmup_ms, "dtype": "bf16",
                     "tokens": grid.TOTAL_TOKENS, "model_width": grid.MODEL_WIDTH,
                     "timing": f"median over groups of {GROUP} back-to-back calls of wall clock per call"},
    }


def points(args):
    causals = {"both": (False, True), "yes": (True,), "no": (False,)}[args.causal]
    for d in args.hdim:
        for s in args.seqlen:
            for causal in causals:
                heads = grid.MODEL_WIDTH // d
                yield grid.Point(kind="dense", pass_name="fwd", dtype="bf16", batch=grid.TOTAL_TOKENS // s,
                                 heads_q=heads, heads_k=heads, seqlen_q=s, seqlen_k=s, head_dim=d, causal=causal)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hdim", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--seqlen", type=parse_seqlen, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--causal", choices=("both", "yes", "no"), default="both")
    parser.add_argument("--impl", nargs="+", choices=IMPLS, default=list(IMPLS))
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--warmup-ms", type=float, default=200.0)
    parser.add_argument("--out", type=pathlib.Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    result = {**header(args), "rows": []}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for seed, point in enumerate(points(args)):
        bytes_per_copy = timing.working_set_bytes(dataclasses.replace(point, pass_name="bwd"))
        copies = make_inputs(point, timing.copies_needed(bytes_per_copy), seed)
        for pass_name in PASSES:
            row = {key: value for key, value in point.fields().items() if key not in ("kind", "pass")}
            row["pass"] = pass_name
            if "fmha_rt" in args.impl and "cudnn" in args.impl:
                row["rel_err_fmha_rt_vs_cudnn"] = relative_error(pass_name, point, copies[0])
            for impl in args.impl:
                row[impl] = measure(impl, pass_name, point, copies, args)
            result["rows"].append(row)
            args.out.write_text(json.dumps(result, indent=1) + "\n")  # after every row: a cut run keeps its rows
            print(_line(row, args.impl), flush=True)
        del copies
    print(f"wrote {args.out}")


def _line(row, impls):
    cells = []
    for impl in impls:
        r = row[impl]
        cells.append(f"{impl} {r['tflops']:6.1f}" if "tflops" in r else f"{impl} error")
    err = row.get("rel_err_fmha_rt_vs_cudnn")
    err = f"  rel err vs cudnn {err:.1e}" if isinstance(err, float) else ""
    return (f"D={row['D']:<3} S={row['Sq']:<5} B={row['B']:<2} H={row['Hq']:<2} causal={row['causal']!s:<5} "
            f"{row['pass']:<7} TFLOP/s: " + "  ".join(cells) + err)


if __name__ == "__main__":
    main()
