"""Stand-ins shared by the benchmark harness's CPU tests: a tiny point, a device that times nothing, and a
reader of the report's Markdown tables."""

from fmha_rt.bench import grid


def tiny_point(pass_name="fwd", causal=False, kind="dense", seqlens=None):
    if seqlens:
        return grid.Point(kind, pass_name, "fp16", len(seqlens), 2, 2, max(seqlens), max(seqlens), 16, causal,
                          seqlens=tuple(seqlens))
    return grid.Point(kind, pass_name, "fp16", 2, 4, 2, 32, 32, 16, causal)


class StandInDevice:
    """CudaDevice's interface on the CPU; per-call times are invented (nothing here is timed)."""

    name = "cpu"

    def __init__(self, times=None, healthy=True, clock_readings=None):
        self.times = list(times or [])
        self.is_healthy = healthy
        self.clock_readings = list(clock_readings or [])  # what successive clock_reading calls return

    def clock_reading(self, start, end):
        assert start <= end
        return self.clock_readings.pop(0) if self.clock_readings else {}

    def synchronize(self):
        pass

    def l2_bytes(self):
        return 1 << 16

    def time_each(self, calls):
        for call in calls:
            call()
        return self.times[:len(calls)] if self.times else [1.0] * len(calls)

    def peak_extra_bytes(self, call):
        call()
        return 0

    def release_cached(self):
        pass

    def healthy(self):
        return self.is_healthy


def table_after(markdown, heading):
    """(headings, body) of the table two lines below the line `heading`."""
    lines = markdown.splitlines()
    return _read_table(lines[lines.index(heading) + 2:])


def first_table_after(markdown, heading):
    """(headings, body) of the first table after the first line starting with `heading`, whatever stands
    between."""
    lines = markdown.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(heading))
    return _read_table(lines[next(i for i in range(start, len(lines)) if lines[i].startswith("|")):])


def _read_table(lines):
    table = []
    for line in lines:
        if not line.startswith("|"):
            break
        table.append([cell.strip() for cell in line.strip("|").split(" | ")])
    return table[0], table[2:]
