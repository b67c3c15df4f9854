"""The SASS of an sm_90 code object: its loops (found by their back edges) with their instruction mix,
and the registers and stack each kernel uses; what NOTES.md cites before a kernel change is timed.

    python bench/sass_loops.py hsa/sm_90/portable/fmha_bwd_fused_bf16_d128_nobias_nodrop.cubin.gz [...] [--json OUT]
    python bench/sass_loops.py --schedule CUBIN     # also each loop's issue order (see `schedule`)

Disassembles with the cuobjdump that the pinned Triton wheel bundles, so no CUDA toolkit is needed.
bench/stall_profile.py finds loops in ncu's SASS source page with the same back-edge rule.
"""
import argparse
import collections
import gzip
import json
import pathlib
import re
import subprocess
import sys
import tempfile

# Loops shorter than this are copy or setup loops, not a kernel's main loop.
MIN_LOOP = 40
# The opcodes a loop's mix reports: tensor-core work, exponentials, global loads (async and plain), shared
# loads, and the local-memory traffic of register spills.
MIX_OPCODES = ("HGMMA", "MUFU", "LDGSTS", "LDG", "LDS", "LDL", "STL")
_INSTRUCTION = re.compile(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_BRANCH = re.compile(r"\bBRA\b.*?0x([0-9a-f]+)")
_FUNCTION = re.compile(r"\s*Function\s*:\s*(\S+)")
_RESOURCES = re.compile(r"Function (\S+):\s*(.*)")


def mnemonic(text: str) -> str:
    """HGMMA.64x128x16.F32.BF16 for '@P0 HGMMA.64x128x16.F32.BF16 R24, ...': without the predicate."""
    tokens = text.split()
    if not tokens:
        return "?"
    return tokens[1] if tokens[0].startswith("@") and len(tokens) > 1 else tokens[0]


def opcode(text: str) -> str:
    """HGMMA for '@P0 HGMMA.64x128x16.F32.BF16 R24, ...': the mnemonic without predicate or modifiers."""
    return mnemonic(text).split(".")[0]


def find_loops(addresses, texts, min_loop: int = MIN_LOOP):
    """(first, last) row of each loop: a branch back to an earlier instruction closes a loop of the rows
    from its target to itself; loops under min_loop instructions are left out."""
    index = {a: i for i, a in enumerate(addresses)}
    loops = []
    for end, text in enumerate(texts):
        jump = _BRANCH.search(text)
        if jump:
            target = int(jump[1], 16)
            if target <= addresses[end] and target in index and end - index[target] + 1 >= min_loop:
                loops.append((index[target], end))
    return loops


def mix(texts) -> dict:
    counts = collections.Counter(opcode(t) for t in texts)
    return {op: counts[op] for op in MIX_OPCODES}


def _schedule_kind(text: str) -> str | None:
    """What one instruction is in a loop's schedule: a tensor-core product (by shape), an exponential, a
    wait or a barrier; None for everything else."""
    full = mnemonic(text)
    op = full.split(".")[0]
    if op == "HGMMA":
        return ".".join(full.split(".")[:2])  # HGMMA.64x128x16: the product's shape
    if op == "WARPGROUP" and ".DEPBAR" in full:
        return "wait:tensor"
    return {"MUFU": "MUFU", "DEPBAR": "wait:copies", "BAR": "barrier"}.get(op)


def schedule(texts) -> list:
    """A loop's products, exponentials, waits and barriers in issue order, as runs [(kind, count)] (other
    instructions left out). What runs beside what: exponentials between a product's HGMMAs and its
    wait:tensor execute while it is in flight; exponentials right after a wait:tensor and before the
    next HGMMA run with the tensor cores idle, unless a product issued before the wait is still running."""
    runs = []
    for text in texts:
        kind = _schedule_kind(text)
        if kind is None:
            continue
        if runs and runs[-1][0] == kind:
            runs[-1][1] += 1
        else:
            runs.append([kind, 1])
    return [tuple(run) for run in runs]


def schedule_text(runs, width: int = 110) -> list:
    """Lines of at most `width` characters: 'barrier · HGMMA.64x64x16 x8 · wait:tensor · MUFU x32 · ...'."""
    tokens = [kind if count == 1 else f"{kind} x{count}" for kind, count in runs]
    lines, line = [], ""
    for token in tokens:
        if line and len(line) + 3 + len(token) > width:
            lines.append(line)
            line = ""
        line = f"{line} · {token}" if line else token
    return lines + ([line] if line else [])


def _cuobjdump() -> pathlib.Path:
    import triton

    tool = pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not tool.is_file():
        raise SystemExit(f"no cuobjdump in this Triton install ({tool}); it ships with the Linux x86-64 wheels")
    return tool


def cuobjdump(flag: str, data: bytes) -> str:
    """cuobjdump's output for `flag` (-sass, -res-usage) on a cubin's bytes."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(data)
        f.flush()
        done = subprocess.run([str(_cuobjdump()), flag, f.name], capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"cuobjdump {flag} failed: {done.stderr.strip()}")
    return done.stdout


def read_code_object(path: str) -> bytes:
    data = pathlib.Path(path).read_bytes()
    return gzip.decompress(data) if path.endswith(".gz") else data


def kernels(sass_text: str):
    """{kernel name: [(address, instruction text)]} of cuobjdump -sass output."""
    found, current = {}, None
    for line in sass_text.splitlines():
        name = _FUNCTION.match(line)
        if name:
            current = found.setdefault(name[1], [])
            continue
        ins = _INSTRUCTION.match(line)
        if ins and current is not None:
            current.append((int(ins[1], 16), ins[2]))
    return found


def resources(text: str) -> dict:
    """{kernel name: {"REG": 168, "STACK": 56, ...}} of cuobjdump -res-usage output."""
    found = {}
    lines = text.splitlines()
    for i, line in enumerate(lines):
        head = _RESOURCES.search(line)
        if head:
            usage = head[2] if "REG:" in head[2] else (lines[i + 1] if i + 1 < len(lines) else "")
            found[head[1]] = {k: int(v) for k, v in re.findall(r"(\w+):(\d+)", usage)}
    return found


def summarize_sass(sass_text: str, usage: dict, min_loop: int = MIN_LOOP) -> list:
    report = []
    for name, rows in kernels(sass_text).items():
        addresses, texts = [a for a, _ in rows], [t for _, t in rows]
        whole = mix(texts)
        report.append({
            "kernel": name, "instructions": len(rows), "LDL": whole["LDL"], "STL": whole["STL"],
            "registers": usage.get(name, {}).get("REG"), "stack_bytes": usage.get(name, {}).get("STACK"),
            "loops": [{"first": f"{addresses[a]:#x}", "last": f"{addresses[b]:#x}", "instructions": b - a + 1,
                       "mix": mix(texts[a:b + 1]), "schedule": schedule(texts[a:b + 1])}
                      for a, b in find_loops(addresses, texts, min_loop)],
        })
    return report


def summarize(path: str, min_loop: int = MIN_LOOP) -> list:
    data = read_code_object(path)
    return summarize_sass(cuobjdump("-sass", data), resources(cuobjdump("-res-usage", data)), min_loop)


def print_report(path: str, report: list, show_schedule: bool = False) -> None:
    print(path)
    for k in report:
        print(f"  {k['kernel']}: {k['instructions']} instructions, {k['registers']} registers, "
              f"{k['stack_bytes']} bytes of stack, LDL {k['LDL']} STL {k['STL']}")
        for loop in k["loops"]:
            mix_text = " ".join(f"{op} {n}" for op, n in loop["mix"].items())
            print(f"    loop {loop['first']}-{loop['last']}: {loop['instructions']} instructions; {mix_text}")
            if show_schedule:
                for line in schedule_text(loop["schedule"]):
                    print(f"      {line}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("code_objects", nargs="+", metavar="CUBIN", help="sm_90 code objects (.cubin or .cubin.gz)")
    parser.add_argument("--min-loop", type=int, default=MIN_LOOP, help=f"shortest loop shown (default {MIN_LOOP})")
    parser.add_argument("--schedule", action="store_true",
                        help="also print each loop's issue order: products, exponentials, waits and barriers (see schedule())")
    parser.add_argument("--json", help="also write the summaries here")
    args = parser.parse_args(argv)
    reports = {}
    for path in args.code_objects:
        reports[path] = summarize(path, args.min_loop)
        print_report(path, reports[path], args.schedule)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(reports, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
