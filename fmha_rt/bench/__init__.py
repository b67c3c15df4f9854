"""The benchmark suite: fmha_rt against the attention implementations found on the machine.

    grid     the points swept (B*S = 16k tokens, Hq*D = 2048) and the command line's filters
    flops    the FLOP convention behind every TFLOP/s figure
    peers    one adapter per implementation, in the table PEERS
    timing   CUDA-event timing, input rotation past L2, host overhead, cold start, memory
    sweep    points x implementations -> result rows, one failure never stopping the rest
    machine  the header a run records (GPU, clocks, versions)
    report   the JSON record and the Markdown and PNG views of it
    cli      `python -m fmha_rt bench`

Nothing here imports torch or matplotlib until a measurement or a plot needs it.
"""
