"""The PNG plots of a benchmark record: TFLOP/s against sequence length per (pass, dtype), and fmha_rt's
TFLOP/s over each peer's. Like the Markdown, they are drawn from the JSON document alone."""

import os

from matplotlib.backends.backend_agg import FigureCanvasAgg  # an ImportError here: report writes Markdown only
from matplotlib.figure import Figure
from matplotlib.ticker import MultipleLocator

from . import peers, versus
from .report import SUBJECT, groups, impl_order, peer_summaries, points


def plot_name(stem, pass_name, dtype):
    return f"{stem}_{pass_name}_{dtype}.png"


def write_plots(doc, out_dir, stem):
    """One PNG per (pass, dtype): TFLOP/s against sequence length, one line per implementation, a
    subplot per head dim (and one for GQA) and causal setting. Varlen rows have no sequence axis and
    appear in the tables only. Returns the file names written."""
    names = []
    for (pass_name, dtype), group in groups(doc["rows"]):
        measured = [row for row in group if row["kind"] in ("dense", "gqa") and row.get("tflops")]
        if not measured:
            continue
        panels = sorted({(row["kind"], row["D"]) for row in measured}, key=lambda p: (p[0] == "gqa", p[1]))
        causals = sorted({row["causal"] for row in measured})
        impls = impl_order({row["impl"] for row in measured})
        fig = Figure(figsize=(5.2 * len(causals), 3.3 * len(panels) + 0.8), layout="constrained")
        FigureCanvasAgg(fig)
        axes = fig.subplots(len(panels), len(causals), squeeze=False)
        for (kind, head_dim), axes_row in zip(panels, axes):
            for causal, ax in zip(causals, axes_row):
                cell = [r for r in measured if (r["kind"], r["D"], r["causal"]) == (kind, head_dim, causal)]
                _plot_panel(ax, cell, impls, kind, head_dim, causal)
        handles, labels = axes[0][0].get_legend_handles_labels()
        fig.legend(handles, labels, loc="outside lower center", ncols=min(len(impls), 4))
        fixture = " (synthetic fixture, not a measurement)" if doc["header"].get("fixture") else ""
        fig.suptitle(f"{pass_name} {dtype}, {doc['header'].get('gpu')}{fixture}")
        name = plot_name(stem, pass_name, dtype)
        fig.savefig(os.path.join(out_dir, name), dpi=100)
        names.append(name)
    return names + _write_versus_plot(doc, out_dir, stem)


def versus_plot_name(stem):
    return f"{stem}_versus.png"


def _write_versus_plot(doc, out_dir, stem):
    """One PNG of fmha_rt's speed over each peer's (median of per-round ratios), a bar per (point, peer), a panel
    per (pass, dtype), the line at 1 where they are equal; [] where no peer shares a point with fmha_rt."""
    found = peer_summaries(doc["rows"])
    if not found:
        return []
    panels = list(dict.fromkeys((s.pass_name, s.dtype) for s in found))
    peer_names = list(dict.fromkeys(s.peer for s in found))
    bars = len(peer_names) * max(len(s.items) for s in found)
    fig = Figure(figsize=(max(6.0, 0.2 * bars + 2), 3.6 * len(panels) + 0.8), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(panels), 1, squeeze=False)[:, 0]
    width = 0.8 / len(peer_names)
    for (pass_name, dtype), ax in zip(panels, axes):
        by_peer = {s.peer: {_bar_key(c.ours): c for c in s.items}
                   for s in found if (s.pass_name, s.dtype) == (pass_name, dtype)}
        ours = points([c.ours for cells in by_peer.values() for c in cells.values()])
        firsts = [next(iter(by_impl.values())) for by_impl in ours.values()]
        shapes = [_bar_key(row) for row in firsts]
        for i, peer in enumerate(peer_names):
            cells = by_peer.get(peer, {})
            ratios = [cells[k].ratio if k in cells else float("nan") for k in shapes]
            ax.bar([x + (i - (len(peer_names) - 1) / 2) * width for x in range(len(shapes))], ratios, width,
                   color=_colour(peer), label=peer)
        ax.axhline(1.0, color="black", linewidth=1)
        ax.set_xticks(range(len(shapes)), [short_point(r) for r in firsts], rotation=60, ha="right", fontsize=8)
        ax.set_ylabel(f"{SUBJECT} / peer")
        ax.set_title(f"{pass_name}, {dtype}")
        ax.set_ylim(bottom=0)
        ax.yaxis.set_major_locator(MultipleLocator(0.25))
        ax.grid(axis="y", alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncols=len(peer_names))
    fixture = " (synthetic fixture, not a measurement)" if doc["header"].get("fixture") else ""
    fig.suptitle(f"{SUBJECT} TFLOP/s over each peer's, {doc['header'].get('gpu')}{fixture}")
    name = versus_plot_name(stem)
    fig.savefig(os.path.join(out_dir, name), dpi=100)
    return [name]


def _bar_key(row):
    return (row.get("run"),) + versus.shape_key(row)


def short_point(row):
    """A point as an axis label: 'D128 16k causal', 'GQA 16/2 D128 4k', 'varlen D64'."""
    if row.get("seqlens"):
        return f"varlen D{row['D']}" + (" causal" if row["causal"] else "")
    seqlen = f"{row['Sq'] // 1024}k" if row["Sq"] >= 1024 else str(row["Sq"])
    group = f"GQA {row['Hq']}/{row['Hk']} " if row["Hq"] != row["Hk"] else ""
    return f"{group}D{row['D']} {seqlen}" + (" causal" if row["causal"] else "")


def _plot_panel(ax, rows, impls, kind, head_dim, causal):
    seqlens = sorted({row["Sq"] for row in rows})
    # Every implementation is drawn in every panel, even without points, so the shared legend (taken
    # from the first panel) lists them all.
    for impl in impls:
        line = sorted((row["Sq"], row["tflops"]) for row in rows if row["impl"] == impl)
        ax.plot([s for s, _ in line], [t for _, t in line], marker="o", label=impl, color=_colour(impl),
                linewidth=2.5 if impl == SUBJECT else 1.5)
    ax.set_xscale("log", base=2)
    ax.set_xticks(seqlens, [f"{s // 1024}k" if s >= 1024 else str(s) for s in seqlens])
    ax.minorticks_off()
    group = f", GQA {rows[0]['Hq'] // rows[0]['Hk']}:1" if kind == "gqa" and rows else ""
    ax.set_title(f"D={head_dim}{group}, {'causal' if causal else 'non-causal'}")
    ax.set_xlabel("sequence length")
    ax.set_ylabel("TFLOP/s")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)


def _colour(impl):
    """The same colour for an implementation in every plot of every run."""
    index = peers.PEER_NAMES.index(impl) if impl in peers.PEER_NAMES else len(peers.PEER_NAMES)
    return f"C{index % 10}"
