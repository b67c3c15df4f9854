"""The benchmark suite: fmha_rt against the attention implementations found on the machine.

    grid     the points swept (B*S = 16k tokens, Hq*D = 2048) and the command line's filters
    flops    the FLOP convention behind every TFLOP/s figure
    peers    one adapter per implementation, in the table PEERS
    timing   CUDA-event timing, input rotation past L2, host overhead, cold start, memory
    correctness  the gate before timing: every output against an fp32 reference on the same inputs
    sweep    points x implementations -> result rows in equal turns, one failure never stopping the rest
    versus   fmha_rt over each peer and over the best peer: medians of per-round ratios, within one run
    overhead host cost per call on the path a user takes
    clocks   SM clock and power per turn, from NVML
    machine  the header a run records (GPU, clocks, versions)
    report   the JSON record and the Markdown and PNG views of it
    cli      `python -m fmha_rt bench`

Nothing here imports torch or matplotlib until a measurement or a plot needs it.
"""
