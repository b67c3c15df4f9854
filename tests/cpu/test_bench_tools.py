"""The scripts in bench/ that study kernels rather than time them: the SASS loop report
(bench/sass_loops.py), the stall-profile summary (bench/stall_profile.py) and the A/B runner
(bench/ab.py, its bookkeeping through a stand-in benchmark)."""

import gzip
import importlib
import json
import os
import pathlib
import sys
import types

import pytest

from fmha_rt.bench import report

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
HSA = REPO_ROOT / "hsa"


@pytest.fixture
def bench_script(monkeypatch):
    """Imports a script of bench/ as a module, as `python bench/NAME.py` would find its neighbours."""
    monkeypatch.syspath_prepend(str(REPO_ROOT / "bench"))

    def load(name):
        sys.modules.pop(name, None)
        return importlib.import_module(name)

    return load


# ---- SASS loops (bench/sass_loops.py) ----------------------------------------------------------------

FAKE_SASS = """
\tcode for sm_90a
\t\tFunction : toy_kernel
        /*0000*/                   LDC R1, c[0x0][0x28] ;
        /*0010*/                   STL [R1+0x4], R2 ;
""" + "".join(f"        /*{0x20 + 16 * i:04x}*/                   HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], R24 ;\n"
              for i in range(2)) + "".join(
    f"        /*{0x40 + 16 * i:04x}*/                   MUFU.EX2 R5, R5 ;\n" for i in range(40)) + """
        /*02c0*/                   LDL R7, [R1+0x4] ;
        /*02d0*/               @P0 BRA 0x20 ;
        /*02e0*/                   LDGSTS.E.BYPASS.128 [R2], desc[UR6][R4.64] ;
        /*02f0*/               @P1 BRA 0x2e0 ;
        /*0300*/                   EXIT ;
"""
FAKE_USAGE = """
Resource usage:
 Common:
  GLOBAL:11
 Function toy_kernel:
  REG:168 STACK:56 SHARED:1024 LOCAL:0
"""


def test_sass_loops_finds_loops_by_back_edges_and_counts_their_mix(bench_script):
    """A made-up disassembly: a 44-instruction loop (2 HGMMA, 40 MUFU, a spill reload, its branch), then
    a 2-instruction copy loop, too short to count."""
    sass_loops = bench_script("sass_loops")
    (kernel,) = sass_loops.summarize_sass(FAKE_SASS, sass_loops.resources(FAKE_USAGE))
    assert kernel["kernel"] == "toy_kernel" and kernel["instructions"] == 49
    assert (kernel["registers"], kernel["stack_bytes"], kernel["LDL"], kernel["STL"]) == (168, 56, 1, 1)
    (loop,) = kernel["loops"]
    assert (loop["first"], loop["last"], loop["instructions"]) == ("0x20", "0x2d0", 44)
    assert loop["mix"] == {"HGMMA": 2, "MUFU": 40, "LDGSTS": 0, "LDG": 0, "LDS": 0, "LDL": 1, "STL": 0}
    assert sass_loops.opcode("@!P2 LDGSTS.E.BYPASS.128 [R2], desc[UR6][R4.64]") == "LDGSTS"


def test_schedule_keeps_products_exponentials_and_waits_in_issue_order(bench_script):
    """The schedule view: HGMMA runs by shape, MUFU runs, the two kinds of wait and barriers, in order;
    everything else (arithmetic, loads, spills) left out, so runs on either side of it merge."""
    sass_loops = bench_script("sass_loops")
    texts = ["DEPBAR.LE SB0, 0x4", "BAR.SYNC.DEFER_BLOCKING 0x0", "WARPGROUP.ARRIVE"]
    texts += ["HGMMA.64x64x16.F32.BF16 R152, gdesc[UR16], R152", "IADD3 R1, R2, R3, RZ"] * 2
    texts += ["WARPGROUP.DEPBAR.LE gsb0, 0x0", "FFMA R5, R5, R6, R7", "MUFU.EX2 R5, R5",
              "HGMMA.64x64x16.F32.BF16 R88, gdesc[UR20], RZ, !UPT", "MUFU.EX2 R6, R6", "LDL R7, [R1+0x4]",
              "@P0 MUFU.EX2 R8, R8", "WARPGROUP.DEPBAR.LE gsb0, 0x0", "HGMMA.64x128x16.F32.BF16 R24, R88, gdesc[UR4]"]
    runs = sass_loops.schedule(texts)
    assert runs == [("wait:copies", 1), ("barrier", 1), ("HGMMA.64x64x16", 2), ("wait:tensor", 1), ("MUFU", 1),
                    ("HGMMA.64x64x16", 1), ("MUFU", 2), ("wait:tensor", 1), ("HGMMA.64x128x16", 1)]
    assert sass_loops.schedule_text(runs, width=60) == [
        "wait:copies · barrier · HGMMA.64x64x16 x2 · wait:tensor", "MUFU · HGMMA.64x64x16 · MUFU x2 · wait:tensor",
        "HGMMA.64x128x16"]


def test_sass_loops_reads_a_shipped_code_object(bench_script):
    """The cuobjdump that the pinned Triton bundles disassembles a committed sm_90 forward: one kernel
    whose main loops do tensor-core work and exponentials without spilling."""
    sass_loops = bench_script("sass_loops")
    (kernel,) = sass_loops.summarize(str(HSA / "sm_90" / "portable" / "fmha_fwd_bf16_d128_nobias_nodrop.cubin.gz"))
    assert kernel["kernel"] == "fmha_fwd" and kernel["registers"] > 0
    assert kernel["loops"] and all(loop["mix"]["HGMMA"] > 0 and loop["mix"]["MUFU"] > 0 for loop in kernel["loops"])
    assert all(loop["mix"]["LDL"] == 0 and loop["mix"]["STL"] == 0 for loop in kernel["loops"])
    assert all(sum(n for kind, n in loop["schedule"] if kind.startswith("HGMMA")) == loop["mix"]["HGMMA"]
               for loop in kernel["loops"])
    assert kernel["instructions"] > sum(loop["instructions"] for loop in kernel["loops"])


def _innermost_product_loops(kernel) -> list:
    """The loops with tensor-core products that hold no other such loop: the consumers' steps."""
    products = [(int(loop["first"], 16), int(loop["last"], 16), loop) for loop in kernel["loops"] if loop["mix"]["HGMMA"]]
    return [loop for first, last, loop in products
            if not any(first <= a and b <= last and (a, b) != (first, last) for a, b, _ in products)]


@pytest.mark.parametrize("tile,stack_bytes", [("d128", 0), ("d64", 16)])
def test_the_shipped_v3_backward_adds_dq_by_bulk_tma_reductions(bench_script, tile, stack_bytes):
    """The v3 dK/dV kernels add each step's dQ tile into the accumulator with one bulk TMA reduction a
    consumer warpgroup, not element-wise fp32 atomics (NOTES.md, v3.2); their steps read Lse2 and Delta from
    shared memory, where TMA put them with dO, with no global load (v3.25); and they keep everything in
    registers but for the 64 tile's 16 bytes of stack, outside its loops: its 128-row step holds S and dP as
    128 x 64 (NOTES.md, v3.22)."""
    sass_loops = bench_script("sass_loops")
    path = HSA / "sm_90" / "v3" / f"fmha_bwd_dkdv_v3_bf16_{tile}.cubin.gz"
    (kernel,) = sass_loops.summarize(str(path))
    assert kernel["stack_bytes"] == stack_bytes and (stack_bytes or kernel["LDL"] == kernel["STL"] == 0)
    steps = _innermost_product_loops(kernel)
    assert len(steps) >= 2 and all(loop["mix"]["LDG"] == loop["mix"]["LDL"] == loop["mix"]["STL"] == 0 for loop in steps)
    (listing,) = sass_loops.kernels(sass_loops.cuobjdump("-sass", gzip.decompress(path.read_bytes()))).values()
    texts = [text for _, text in listing]
    assert sum("UTMAREDG" in t and ".ADD" in t for t in texts) == 2  # one in each consumer's step loop
    assert not [t for t in texts if "ATOMG.E.ADD" in t or "RED.E.ADD" in t]


def test_the_shipped_192_128_backward_tile_of_two_consumers_of_keys_keeps_its_steps_in_registers(bench_script):
    """The atomic (192, 128) tile (v3.32): each consumer's step reloads at most one spilled value and stores
    none, with 40 bytes of stack at most, no global load, and dQ's three 32-column pieces a consumer added by
    bulk TMA reductions (six in the kernel), no element-wise atomics (NOTES.md, v3.32)."""
    sass_loops = bench_script("sass_loops")
    path = HSA / "sm_90" / "v3" / "fmha_bwd_dkdv_v3_bf16_d192v128.cubin.gz"
    (kernel,) = sass_loops.summarize(str(path))
    assert kernel["stack_bytes"] <= 40
    # the consumers' steps (the back-edge rule also finds spans that run into the partitions' shared tail)
    steps = [loop for loop in _innermost_product_loops(kernel) if loop["mix"]["MUFU"] and loop["instructions"] < 1000]
    assert len(steps) == 2 and all(loop["mix"]["LDG"] == loop["mix"]["STL"] == 0 and loop["mix"]["LDL"] <= 1
                                   for loop in steps)
    (listing,) = sass_loops.kernels(sass_loops.cuobjdump("-sass", gzip.decompress(path.read_bytes()))).values()
    texts = [text for _, text in listing]
    assert sum("UTMAREDG" in t and ".ADD" in t for t in texts) == 6
    assert not [t for t in texts if "ATOMG.E.ADD" in t or "RED.E.ADD" in t]


@pytest.mark.parametrize("tile", ["d256", "d256v128"])
def test_the_shipped_wide_backward_steps_read_their_row_statistics_from_shared_memory(bench_script, tile):
    """The wide dK/dV program's consumers (the atomic form's 256 tiles) read each step's Lse2 (consumer 0) and
    Delta (consumer 1) from shared memory, where TMA put them with the step's query tiles, with no global load
    in any step loop and no stack (NOTES.md, v3.26)."""
    sass_loops = bench_script("sass_loops")
    (kernel,) = sass_loops.summarize(str(HSA / "sm_90" / "v3" / f"fmha_bwd_dkdv_v3_bf16_{tile}.cubin.gz"))
    assert kernel["stack_bytes"] == 0 and kernel["LDL"] == kernel["STL"] == 0
    steps = _innermost_product_loops(kernel)
    assert len(steps) >= 2 and all(loop["mix"]["LDG"] == 0 for loop in steps)
    assert sum(loop["mix"]["LDS"] for loop in steps) >= 2  # the statistics' reads


def _forward_loops(sass_loops, tile) -> list:
    """The SASS of the shipped bf16 v3 forward's loops that run a key block's exponentials (32 or more
    MUFU.EX2), each as its instruction texts."""
    path = HSA / "sm_90" / "v3" / f"fmha_fwd_v3_bf16_{tile}.cubin.gz"
    (listing,) = sass_loops.kernels(sass_loops.cuobjdump("-sass", gzip.decompress(path.read_bytes()))).values()
    addresses, texts = [a for a, _ in listing], [t for _, t in listing]
    bodies = (texts[first:last + 1] for first, last in sass_loops.find_loops(addresses, texts))
    return [body for body in bodies if sum("MUFU.EX2" in t for t in body) >= 32]


@pytest.mark.parametrize("tile", ["d128", "d256", "d192v128"])
def test_the_shipped_v3_forward_has_a_key_loop_without_the_mask(bench_script, tile):
    """The v3 forward runs its mask-free key blocks in a loop of their own (NOTES.md, v3.8): each
    consumer has a step loop whose products and exponentials come without the mask's compares and
    selects, beside the masked loop that has them. With one loop and a run-time mask, every step issued
    the selects (941 instructions a step at D=128 against 520)."""
    sass_loops = bench_script("sass_loops")
    # a step loop: a block's exponentials and both products (8 to 10 HGMMA each), not a nest of loops
    steps = [body for body in _forward_loops(sass_loops, tile) if 16 <= sum("HGMMA" in t for t in body) <= 20]
    selects = [sum(sass_loops.opcode(t) == "FSEL" for t in body) for body in steps]
    assert len(steps) >= 2
    assert min(selects) <= 2  # the rescale's guard of rows without a visible key; no per-element select
    assert max(selects) >= 64  # the masked loop selects every element of its block


@pytest.mark.parametrize("tile", ["d64", "d128", "d256", "d256v128", "d192v128"])
def test_the_shipped_v3_forward_issues_a_steps_two_products_together(bench_script, tile):
    """The ping-pong (NOTES.md, v3.9): in a consumer's turn its mask-free step issues S_{t+1} = Q K^T and
    O += P_t V_t back to back, with no exponential between them, and hands the turn over (an mbarrier
    arrive) after them; the exponentials of block t+1 come after. In the schedule before, a step read
    HGMMA x8 (S_{t+1}), the softmax's exponentials, then HGMMA x8 (P_t V_t)."""
    sass_loops = bench_script("sass_loops")
    steps = [body for body in _forward_loops(sass_loops, tile)
             if 8 <= sum("HGMMA" in t for t in body) <= 20 and sum(sass_loops.opcode(t) == "FSEL" for t in body) <= 2]
    assert steps
    for body in steps:
        products = [i for i, t in enumerate(body) if "HGMMA" in t]
        between = body[products[0]:products[-1]]
        assert not any("MUFU.EX2" in t for t in between)
        handover = next(i for i, t in enumerate(body) if i > products[-1] and "SYNCS.ARRIVE" in t)
        assert any("MUFU.EX2" in t for t in body[handover:])

# ---- stall profile (bench/stall_profile.py) ---------------------------------------------------------


def test_stall_profile_finds_loops_by_back_edges_and_sums_their_samples(bench_script, tmp_path):
    """A made-up SASS source page: a preamble, a 41-instruction loop closed by a backward branch, an
    exit. The loop's share, mix and stall reasons are sums over its rows only."""
    lines = [("IMAD R1, R2, R3, RZ", 10, 2, 8)]
    lines += [("HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], R24", 30, 20, 10)]
    lines += [("MUFU.EX2 R5, R5", 5, 1, 4)] * 38
    lines += [("@!PT LDS RZ, [RZ]", 15, 15, 0), ("@P0 BRA 0x10", 0, 0, 0), ("EXIT", 0, 0, 0)]
    rows = ["Address,Source,Warp Stall Sampling (All Samples),Instructions Executed,stall_barrier,stall_mio,"
            "stall_mio (Not Issued)"]
    for i, (text, samples, barrier, mio) in enumerate(lines):
        rows.append(f'{0x0 + 16 * i:x},"{text}",{samples},{1000 + i},{barrier},{mio},{mio}')
    path = tmp_path / "source.csv"
    path.write_text("\n".join(rows) + "\n")
    summary = bench_script("stall_profile").summarize(str(path))
    total = 10 + 30 + 38 * 5 + 15
    assert summary["samples"] == total and summary["instructions"] == len(lines)
    (loop,) = summary["loops"]
    assert loop["rows"] == [1, 41] and loop["instructions"] == 41
    assert loop["mix"] == {"HGMMA": 1, "MUFU": 38, "LDS": 1}
    assert loop["samples_pct"] == round(100 * (total - 10) / total, 2)
    barrier, mio = 20 + 38 + 15, 10 + 38 * 4
    assert loop["stalls_pct"] == {"mio": round(100 * mio / (barrier + mio), 1),
                                  "barrier": round(100 * barrier / (barrier + mio), 1)}
    assert summary["opcodes"][0]["opcode"] == "MUFU" and summary["opcodes"][0]["count"] == 38
    # the hottest rows first, each with its own share and reasons: the HGMMA (30), then the LDS (15)
    assert [h["row"] for h in summary["hot"][:2]] == [1, 40]
    assert summary["hot"][0]["source"].startswith("HGMMA") and summary["hot"][0]["samples_pct"] == round(3000 / total, 2)
    assert summary["hot"][1]["stalls_pct"] == {"barrier": 100.0}


# ---- A/B runner (bench/ab.py) -----------------------------------------------------------------------


def _fake_hsa(root, kernels):
    """A code-object folder: {key: bytes} as sm_90/portable/KEY.cubin.gz with its manifest."""
    entries = []
    for key, data in kernels.items():
        rel = f"sm_90/portable/{key}.cubin.gz"
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
        entries.append({"arch": "sm_90", "family": "portable", "key": key, "file": rel})
    (root / "manifest.json").write_text(json.dumps({"format": 1, "triton": "3.6.0", "kernels": entries}))
    return root


def test_ab_lays_a_partial_build_over_a_copy_of_the_code_objects(bench_script, tmp_path):
    ab = bench_script("ab")
    checkout = _fake_hsa(tmp_path / "hsa", {"fmha_fwd_a": b"old fwd", "fmha_bwd_b": b"old bwd"})
    partial = _fake_hsa(tmp_path / "build", {"fmha_bwd_b": b"new bwd"})
    variant = ab.resolve_variant(f"flat={partial}", tmp_path / "work", checkout_hsa=checkout)
    assert variant.kind == "partial build" and variant.kernels == ["sm_90/fmha_bwd_b"]
    laid = pathlib.Path(variant.env["FMHA_RT_ASM_DIR"])
    assert (laid / "sm_90/portable/fmha_bwd_b.cubin.gz").read_bytes() == b"new bwd"
    assert (laid / "sm_90/portable/fmha_fwd_a.cubin.gz").read_bytes() == b"old fwd"
    assert sorted(e["key"] for e in json.loads((laid / "manifest.json").read_text())["kernels"]) == [
        "fmha_bwd_b", "fmha_fwd_a"]
    assert (checkout / "sm_90/portable/fmha_bwd_b.cubin.gz").read_bytes() == b"old bwd", "the checkout is untouched"
    same = ab.resolve_variant(f"base={checkout}", tmp_path / "work", checkout_hsa=checkout)
    assert same.kind == "checkout" and same.env == {}


def _checkout(root, c_source, shim=None):
    (root / "fmha_rt").mkdir(parents=True)
    (root / "include").mkdir()
    (root / "fmha_rt" / "__init__.py").write_text("")
    (root / "fmha_rt" / "shim.c").write_text(c_source)
    (root / "include" / "fmha_rt.h").write_text("int fmha_version(void);\n")
    if shim is not None:
        (root / "fmha_rt" / "_shim.abi3.so").write_bytes(shim)
    _fake_hsa(root / "hsa", {"fmha_fwd_a": b"x"})
    return root


def test_ab_runs_another_checkout_with_its_own_shim_or_this_ones_for_the_same_c_sources(bench_script, tmp_path,
                                                                                         monkeypatch):
    ab = bench_script("ab")
    built = _checkout(tmp_path / "built", "int x;\n", shim=b"its shim")
    monkeypatch.delenv("PYTHONPATH", raising=False)
    variant = ab.resolve_variant(f"prev={built}", tmp_path / "work")
    assert variant.kind == "package" and variant.cwd == built.resolve()
    assert variant.env == {"PYTHONPATH": str(built.resolve()), "FMHA_RT_ASM_DIR": str(built.resolve() / "hsa")}
    # the caller's path stays behind the package's (where cffi may be installed)
    monkeypatch.setenv("PYTHONPATH", "/site/of/cffi")
    variant = ab.resolve_variant(f"again={built}", tmp_path / "work")
    assert variant.env["PYTHONPATH"] == os.pathsep.join([str(built.resolve()), "/site/of/cffi"])

    this = _checkout(tmp_path / "this", "int x;\n", shim=b"this shim")
    bare = _checkout(tmp_path / "bare", "int x;\n")
    package = ab.with_this_shim("prev", "bare", bare, tmp_path / "work", checkout=this)
    assert (package / "fmha_rt" / "_shim.abi3.so").read_bytes() == b"this shim"
    assert (package / "fmha_rt" / "shim.c").read_text() == "int x;\n" and not list((bare / "fmha_rt").glob("*.so"))
    changed = _checkout(tmp_path / "changed", "int y;\n")
    with pytest.raises(ab.AbError, match="C sources differ"):
        ab.with_this_shim("prev", "changed", changed, tmp_path / "work2", checkout=this)


@pytest.mark.parametrize("spec,message", [("base", "NAME=PATH"), ("=hsa", "NAME=PATH"), ("a-b=hsa", "NAME=PATH"),
                                          ("x=/nonexistent/place", "neither hsa/")])
def test_ab_refuses_a_variant_it_cannot_place(bench_script, tmp_path, spec, message):
    ab = bench_script("ab")
    with pytest.raises(ab.AbError, match=message):
        ab.resolve_variant(spec, tmp_path)


@pytest.mark.parametrize("args,message", [(["--impl", "flex"], "--impl is set by this tool"),
                                          (["--out=x"], "--out is set by this tool"),
                                          (["--hdim", "99"], "refuses the arguments")])
def test_ab_refuses_benchmark_flags_before_running_anything(bench_script, args, message):
    ab = bench_script("ab")
    with pytest.raises(ab.AbError, match=message):
        ab.check_bench_args(args)


def _bench_doc(tflops_by_point, date):
    rows = []
    for (seqlen, causal), tflops in tflops_by_point.items():
        point = {"kind": "dense", "pass": "bwd", "dtype": "bf16", "B": 16384 // seqlen, "Hq": 16, "Hk": 2,
                 "Sq": seqlen, "Sk": seqlen, "D": 128, "causal": causal}
        rows.append({"impl": "fmha_rt", **point, "tflops": tflops} if tflops else
                    {"impl": "fmha_rt", **point, "error": "FmhaDriverError: out of memory"})
    header = {"date": date, "gpu": "NVIDIA H200", "driver": "580", "torch": "2.11", "triton": "3.6.0"}
    return {**report.new_document(header), "rows": rows}


def test_ab_alternates_the_order_and_records_each_run_with_the_median_ratio(bench_script, tmp_path):
    """Two variants, three rounds through a stand-in benchmark: runs go A B, B A, A B, each variant with
    its own environment, and the record keeps every run's TFLOP/s and the median ratio per point."""
    ab = bench_script("ab")
    variants = [ab.Variant("base", "checkout", "hsa", {}, REPO_ROOT, []),
                ab.Variant("flat", "partial build", "out/flat", {"FMHA_RT_ASM_DIR": "/laid/hsa"}, REPO_ROOT,
                           ["sm_90/fmha_bwd_fused_bf16_d128_nobias_nodrop"])]
    speeds = {"base": iter([400.0, 402.0, 398.0]), "flat": iter([410.0, 409.0, 412.0])}
    calls = []

    def runner(cmd, env, cwd):
        name = "flat" if env.get("FMHA_RT_ASM_DIR") == "/laid/hsa" else "base"
        calls.append(name)
        assert cmd[1:4] == ["-m", "fmha_rt", "bench"] and cmd[-5:-1] == ["--impl", "fmha_rt", "--no-extras", "--out"]
        assert cmd[4:6] == ["--seqlen", "16k"] and cwd == str(REPO_ROOT)
        fast = next(speeds[name])
        report.save(_bench_doc({(16384, False): fast, (4096, True): None}, "2026-12-04T10:00:00+00:00"),
                    os.path.join(cmd[-1], "results.json"))
        return types.SimpleNamespace(returncode=0)

    docs = ab.run_rounds(variants, 3, ["--seqlen", "16k"], tmp_path, runner=runner, log=open(os.devnull, "w"))
    assert calls == ["base", "flat", "flat", "base", "base", "flat"]
    points = ab.compare(docs, ["base", "flat"])
    by_seqlen = {p["point"]["Sq"]: p for p in points}
    assert by_seqlen[16384]["tflops"] == {"base": [400.0, 402.0, 398.0], "flat": [410.0, 409.0, 412.0]}
    assert by_seqlen[16384]["median_ratio"] == {"flat": round(410.0 / 400.0, 4)}
    assert by_seqlen[4096]["errors"] == {"base": "FmhaDriverError: out of memory",
                                        "flat": "FmhaDriverError: out of memory"}
    record = ab.make_record(docs, variants, points, ["--variant", "base=hsa", "--record", "/some/where/x.json"], "t")
    assert record["format"] == ab.FORMAT and record["gpu"] == "NVIDIA H200" and record["rounds"] == 3
    assert record["command"][-2:] == ["--record", "x.json"], "the record names no private path"
    assert record["variants"][1]["kernels"] == ["sm_90/fmha_bwd_fused_bf16_d128_nobias_nodrop"]
    text = ab.table(points, ["base", "flat"])
    assert "400.0 | 410.0 (1.025x)" in text and "out of memory" in text


def test_ab_stops_at_a_failed_run(bench_script, tmp_path):
    ab = bench_script("ab")
    variants = [ab.Variant("base", "checkout", "hsa", {}, REPO_ROOT, []),
                ab.Variant("new", "checkout", "hsa", {}, REPO_ROOT, [])]
    with pytest.raises(ab.AbError, match="benchmark of base .round 1. exited with status 1"):
        ab.run_rounds(variants, 2, [], tmp_path, runner=lambda cmd, env, cwd: types.SimpleNamespace(returncode=1),
                      log=open(os.devnull, "w"))
