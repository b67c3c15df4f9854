"""Where a kernel's warps wait: Nsight Compute's stall samples per loop and per opcode.

Two steps. `run` does one forward or backward of fmha_rt, FlexAttention or cuDNN (through SDPA) between
cudaProfilerStart/Stop (after warm-up calls, so compiles and first-call work stay outside), for ncu to
sample:

    ncu --clock-control none --profile-from-start off --kernel-name regex:'fmha_bwd_fused|triton_tem' \
        --section WarpStateStats --section SourceCounters -o REPORT \
        python bench/stall_profile.py run --impl fmha_rt|flex|cudnn [--pass fwd|bwd] [--seqlen 4096] \
        [--kv-heads 16] [--hdim 128] [--causal]
    ncu -i REPORT.ncu-rep --page source --csv --print-source sass | gzip > SOURCE.csv.gz

`summarize` reads that SASS source page: the stall samples of each loop (found by its back edge, the rule
of bench/sass_loops.py), with its instruction mix, of each opcode, and of the hottest instructions (row,
text: what a wait sits on, such as the first use of a load's register), each with its main stall reasons:

    python bench/stall_profile.py summarize SOURCE.csv.gz [--json OUT]

Shapes as the benchmark's: bf16, B*S = 16k tokens, 16 query heads, [B, S, H, D] tensors.
"""
import argparse
import collections
import csv
import gzip
import json
import sys

import sass_loops  # bench/sass_loops.py: the loop rule and the opcode names

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"


def run(impl: str, seqlen: int, kv_heads: int, pass_: str = "bwd", dim: int = 128, causal: bool = False):
    import torch

    batch, heads = 16384 // seqlen, 16
    gen = torch.Generator(device="cuda").manual_seed(0)

    def tensor(h):
        return torch.randn(batch, seqlen, h, dim, device="cuda", dtype=torch.bfloat16, generator=gen)

    q, k, v, dout = tensor(heads), tensor(kv_heads), tensor(kv_heads), tensor(heads)
    if impl == "fmha_rt":
        import fmha_rt

        out, lse = fmha_rt.mha_fwd(q, k, v, causal=causal)

        def once():
            if pass_ == "fwd":
                return fmha_rt.mha_fwd(q, k, v, causal=causal)
            return fmha_rt.mha_bwd(dout, q, k, v, out, lse, causal=causal)
    else:
        qt, kt, vt = (t.transpose(1, 2).requires_grad_(pass_ == "bwd") for t in (q, k, v))
        if impl == "flex":
            from torch.nn.attention.flex_attention import create_block_mask, flex_attention

            mask = create_block_mask(lambda b, h, i, j: i >= j, None, None, seqlen, seqlen) if causal else None
            flex = torch.compile(flex_attention, dynamic=False)

            def attend():
                return flex(qt, kt, vt, block_mask=mask, enable_gqa=kv_heads != heads)
        else:  # cuDNN through SDPA
            from torch.nn.attention import SDPBackend, sdpa_kernel

            def attend():
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal,
                                                                            enable_gqa=kv_heads != heads)
        out = attend()

        def once():
            if pass_ == "fwd":
                with torch.no_grad():
                    return attend()
            return torch.autograd.grad(out, (qt, kt, vt), dout.transpose(1, 2), retain_graph=True)
    for _ in range(3):
        once()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    once()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


def _number(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def read_source_page(path: str):
    """(column names, rows) of ncu's SASS source page as CSV, plain or gzipped."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", errors="replace") as f:
        rows = list(csv.reader(f))
    header_at = next(i for i, r in enumerate(rows) if "Source" in (c.strip() for c in r))
    head = [c.strip() for c in rows[header_at]]
    return head, [r for r in rows[header_at + 1:] if len(r) == len(head)]


def summarize(path: str, min_loop: int = sass_loops.MIN_LOOP, hot: int = 16) -> dict:
    head, rows = read_source_page(path)
    src, samples, executed = head.index("Source"), head.index(SAMPLES), head.index(EXECUTED)
    reasons = [i for i, h in enumerate(head) if h.startswith("stall_") and "Not Issued" not in h]
    total = sum(_number(r[samples]) for r in rows) or 1.0

    def reason_shares(selection):
        counts = collections.Counter()
        for r in selection:
            for i in reasons:
                counts[head[i][len("stall_"):]] += _number(r[i])
        whole = sum(counts.values()) or 1.0
        return {name: round(100 * n / whole, 1) for name, n in counts.most_common(6) if n}

    def share(selection):
        return round(100 * sum(_number(r[samples]) for r in selection) / total, 2)

    loops = []
    for first, last in sass_loops.find_loops([int(r[0], 16) for r in rows], [r[src] for r in rows], min_loop):
        body = rows[first:last + 1]
        loops.append({"rows": [first, last], "instructions": len(body), "samples_pct": share(body),
                      "executed": sum(_number(x[executed]) for x in body),
                      "mix": {op: n for op, n in sass_loops.mix(x[src] for x in body).items() if n},
                      "stalls_pct": reason_shares(body)})
    by_opcode = collections.defaultdict(list)
    for r in rows:
        by_opcode[sass_loops.opcode(r[src])].append(r)
    opcodes = sorted(by_opcode.items(), key=lambda kv: -sum(_number(r[samples]) for r in kv[1]))
    hottest = sorted(range(len(rows)), key=lambda i: -_number(rows[i][samples]))[:hot]
    return {"samples": total, "instructions": len(rows), "executed": sum(_number(r[executed]) for r in rows),
            "stalls_pct": reason_shares(rows), "loops": loops,
            "opcodes": [{"opcode": op, "count": len(sel), "samples_pct": share(sel), "stalls_pct": reason_shares(sel)}
                        for op, sel in opcodes[:16]],
            "hot": [{"row": i, "source": rows[i][src].strip(), "samples_pct": share([rows[i]]),
                     "stalls_pct": reason_shares([rows[i]])} for i in hottest]}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="one forward or backward between cudaProfilerStart/Stop")
    r.add_argument("--impl", choices=("fmha_rt", "flex", "cudnn"), default="fmha_rt")
    r.add_argument("--pass", dest="pass_", choices=("fwd", "bwd"), default="bwd")
    r.add_argument("--seqlen", type=int, default=4096)
    r.add_argument("--kv-heads", type=int, default=16)
    r.add_argument("--hdim", type=int, default=128)
    r.add_argument("--causal", action="store_true")
    s = sub.add_parser("summarize", help="stall samples per loop and opcode of a SASS source page")
    s.add_argument("source")
    s.add_argument("--json", help="also write the summary here")
    args = parser.parse_args(argv)
    if args.command == "run":
        run(args.impl, args.seqlen, args.kv_heads, args.pass_, args.hdim, args.causal)
        return
    report = summarize(args.source)
    print(f"{report['instructions']} instructions, {report['samples']:.0f} samples, stalls {report['stalls_pct']}")
    for loop in report["loops"]:
        print(f"loop rows {loop['rows'][0]}-{loop['rows'][1]}: {loop['instructions']} instructions {loop['mix']}, "
              f"{loop['samples_pct']}% of samples, stalls {loop['stalls_pct']}")
    for op in report["opcodes"]:
        print(f"  {op['opcode']:10s} x{op['count']:<4d} {op['samples_pct']:5.1f}%  {op['stalls_pct']}")
    print("hottest instructions:")
    for ins in report["hot"]:
        print(f"  row {ins['row']:5d} {ins['samples_pct']:5.1f}%  {ins['source'][:60]:60s} {ins['stalls_pct']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
