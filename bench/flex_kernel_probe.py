"""Time FlexAttention's backward kernel with and without its dQ programs, on the GPU.

FlexAttention's backward is one Triton kernel whose grid holds, per (batch, kv head), first one program
per key block computing dK and dV, then one per query block computing dQ. Launching the same compiled
kernel on a grid cut after the key-block programs times its dK/dV work alone; the same source with
its program ids shifted past the key blocks, on a grid of the dQ programs' size, times its dQ work
alone. bench/tune_tiles.py times fmha_rt's passes the same way, so the two can be compared pass by
pass instead of only as whole backwards.

    python bench/flex_kernel_probe.py [--dim 128] [--seqlen 4096 16384] [--causal 0 1] [--repeats 20]
                                      [--out FILE] [--asm DIR]

Shapes and layout as the benchmark's: bf16, B*S = 16k tokens, H*D = 2048, [B, S, H, D] tensors
passed as [B, H, S, D] views, gradients by torch.autograd.grad. The kernel is
caught as torch.compile's generated code launches it (its arguments and launch configuration), then
launched again through Triton on two grids; CUDA events, median of --repeats. --asm DIR writes each
kernel's cubin and TTGIR with its registers and spills, for reading the disassembly.
"""
import argparse
import importlib.util
import json
import pathlib
import sys
import tempfile

import torch
from torch._inductor.runtime import triton_heuristics
from torch._inductor.runtime.cache_dir_utils import cache_dir
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from fmha_rt.bench import machine  # noqa: E402


# The probe runs the compiled backward again with retain_graph, which donated buffers forbid.
torch._functorch.config.donated_buffer = False


def catch_backward_kernel(run_backward):
    """(autotuner, launch args) of the Flex backward kernel that run_backward() launches."""
    caught = []
    original = triton_heuristics.CachingAutotuner.run

    def run(self, *args, stream, **kwargs):
        if self.fn.__name__.startswith("triton_tem") and "DELTA" in self.fn.src and "bwd_dkdv" in self.fn.src:
            caught.append((self, args))  # holding the args keeps their memory alive for the replays
        return original(self, *args, stream=stream, **kwargs)

    triton_heuristics.CachingAutotuner.run = run
    try:
        run_backward()
    finally:
        triton_heuristics.CachingAutotuner.run = original
    if len(caught) != 1:
        raise RuntimeError(f"expected one Flex backward kernel launch, caught {len(caught)}")
    return caught[0]


PID_LINE = "pid = tl.program_id(0).to(INDEX_DTYPE)"
# The reloaded kernel modules, one folder for the run (removed at exit).
_MODULES = tempfile.TemporaryDirectory(prefix="flex_probe_")


def fresh_kernel(fn, pid_offset=0):
    """A fresh JITFunction of `fn`, loaded again from the module inductor wrote for it (the one the
    autotuner holds is stripped for pickling once compiled). Kernel names repeat across compiled
    graphs, so the module is the one holding this kernel's own source; the graph's wrapper module,
    which holds it as a string for async_compile, is not it. pid_offset > 0 shifts the program ids,
    so that a grid of the dQ programs' size runs the dQ programs alone."""
    for path in pathlib.Path(cache_dir()).rglob("*.py"):
        text = path.read_text(errors="replace")
        if fn.src in text and "async_compile.triton(" not in text:
            if pid_offset:
                if text.count(PID_LINE) != 1:
                    raise RuntimeError(f"{path}: the program id line is not where the probe expects it")
                text = text.replace(PID_LINE, f"{PID_LINE} + {pid_offset}")
            shifted = pathlib.Path(_MODULES.name) / f"flex_probe_{path.stem}_{pid_offset}.py"
            shifted.write_text(text)
            spec = importlib.util.spec_from_file_location(shifted.stem, shifted)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            return getattr(module, fn.__name__).fn
    raise FileNotFoundError(f"no generated module defines {fn.__name__}")


def constexpr(src: str, name: str) -> int:
    for line in src.splitlines():
        stripped = line.replace(" ", "")
        if stripped.startswith(f"{name}:tl.constexpr="):
            return int(stripped.split("=", 1)[1])
    raise KeyError(name)


def median_ms(launch, repeats):
    for _ in range(3):
        launch()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        launch()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def probe(d, s, causal, repeats, asm_dir):
    h, b = 2048 // d, 16384 // s
    torch.manual_seed(0)
    # [B, S, H, D] tensors seen as [B, H, S, D], as the benchmark gives them to FlexAttention.
    q, k, v, do = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2) for _ in range(4))
    q, k, v = (t.requires_grad_(True) for t in (q, k, v))
    mask = create_block_mask(lambda b_, h_, qi, ki: qi >= ki, None, None, s, s) if causal else None
    out = torch.compile(flex_attention, dynamic=False)(q, k, v, block_mask=mask)

    def backward():
        return torch.autograd.grad(out, (q, k, v), do, retain_graph=True)

    backward()  # compiles the backward
    torch.cuda.synchronize()
    tuner, args = catch_backward_kernel(backward)
    cfg = tuner.launchers[0].config  # its one configuration, compiled (configs is dropped then)
    args, grid = tuner._interpret_args_grid(args, cfg)
    src = tuner.fn.src
    kernel = fresh_kernel(tuner.fn)
    kv_blocks = -(-s // constexpr(src, "BLOCK_N1"))
    if grid[0] != kv_blocks + (-(-s // constexpr(src, "BLOCK_M2"))):
        raise RuntimeError(f"unexpected Flex backward grid {grid} for {kv_blocks} key blocks")
    options = {**cfg.kwargs, "num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
    compiled = kernel[grid](*args, **options)
    whole = median_ms(lambda: kernel[grid](*args, **options), repeats)
    dkdv = median_ms(lambda: kernel[(kv_blocks, grid[1], grid[2])](*args, **options), repeats)
    dq_kernel = fresh_kernel(tuner.fn, pid_offset=kv_blocks)
    dq = median_ms(lambda: dq_kernel[(grid[0] - kv_blocks, grid[1], grid[2])](*args, **options), repeats)
    flex_bwd = median_ms(backward, repeats)
    fwd_flops = 4 * b * h * s * s * d * (0.5 if causal else 1.0)
    row = {
        "head_dim": d, "seqlen": s, "batch": b, "heads": h, "causal": bool(causal), "grid": list(grid),
        "tile": {n: constexpr(src, n) for n in ("BLOCK_M1", "BLOCK_N1", "BLOCK_M2", "BLOCK_N2")},
        "num_warps": cfg.num_warps, "num_stages": cfg.num_stages,
        "registers": compiled.n_regs, "spills": compiled.n_spills,
        "ms": {"flex_backward": flex_bwd, "kernel_whole_grid": whole, "kernel_dkdv_programs": dkdv,
               "kernel_dq_programs": dq},
        # In the units bench/tune_tiles.py reports its passes in (the backward as a whole is 2.5 forwards,
        # dK/dV 1.6, dQ 0.9), and as the block products each really executes (4 of them for dK/dV, 3 for dQ).
        "tflops": {"backward": 2.5 * fwd_flops / flex_bwd / 1e9, "dkdv_pass_units": 1.6 * fwd_flops / dkdv / 1e9,
                   "dkdv_executed": 2.0 * fwd_flops / dkdv / 1e9, "dq_pass_units": 0.9 * fwd_flops / dq / 1e9,
                   "dq_executed": 1.5 * fwd_flops / dq / 1e9},
    }
    if asm_dir is not None:
        asm_dir.mkdir(parents=True, exist_ok=True)
        stem = f"flex_bwd_d{d}_s{s}_c{int(causal)}"
        (asm_dir / f"{stem}.cubin").write_bytes(compiled.asm["cubin"])
        (asm_dir / f"{stem}.ttgir").write_text(compiled.asm["ttgir"])
        (asm_dir / f"{stem}.py").write_text(src)
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--seqlen", nargs="+", type=int, default=[4096, 16384])
    parser.add_argument("--causal", nargs="+", type=int, default=[0, 1], choices=[0, 1])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", type=pathlib.Path)
    parser.add_argument("--asm", type=pathlib.Path)
    args = parser.parse_args()
    rows = []
    for s in args.seqlen:
        for causal in args.causal:
            row = probe(args.dim, s, causal, args.repeats, args.asm)
            rows.append(row)
            t = row["tflops"]
            print(f"D={args.dim} S={s} causal={causal} tile {row['tile']} w{row['num_warps']} s{row['num_stages']} "
                  f"regs {row['registers']} spills {row['spills']}: backward {t['backward']:.1f}, dK/dV programs "
                  f"{t['dkdv_pass_units']:.1f} (pass units; {t['dkdv_executed']:.1f} executed), dQ programs "
                  f"{t['dq_pass_units']:.1f} ({t['dq_executed']:.1f} executed) TFLOP/s", flush=True)
    if args.out is not None:
        record = {**machine.header(0, {}, {"repeats": args.repeats}), "command": " ".join(sys.argv), "rows": rows}
        args.out.write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
