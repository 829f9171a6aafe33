"""Pictures of timelines and sweeps (matplotlib, imported when a plot is drawn)."""

from __future__ import annotations

from typing import Iterable, Sequence

from labkit.timeline.model import CPU, GPU, OPS, Timeline, _check_timeline, _check_us, summarize
from labkit.timeline.simulate import _check_rows, _check_tolerance, crossover

__all__ = ["plot_timeline", "plot_timelines", "plot_sweep"]

_COLORS = {CPU: "#4C72B0", GPU: "#55A868", OPS: "#8172B2"}
_IDLE = "#C44E52"


def plot_timeline(tl: Timeline, ax=None, shade_idle: bool = True, xlim: float | None = None,
                  title: str | None = None):
    """Draw ``tl`` as a Gantt chart: one row per lane, idle GPU time shaded red.

    The title always carries the timeline's tag ("simulated (H200)", "measured (...)").
    ``xlim`` fixes the x axis (µs) so several timelines can be compared by length.
    Returns the matplotlib Axes.
    """
    from matplotlib.patches import Patch

    _check_timeline("tl", tl)
    if xlim is not None:
        _check_us("xlim", xlim, positive=True)
    if ax is None:
        import matplotlib.pyplot as plt

        _, ax = plt.subplots(figsize=(10, 0.6 + 0.55 * max(2, len(tl.lanes))))
    lanes = tl.lanes or [CPU, GPU]
    t0 = tl.start_us
    ys = {lane: len(lanes) - 1 - i for i, lane in enumerate(lanes)}
    for lane in lanes:
        bars = [(s.start_us - t0, s.dur_us) for s in tl.lane(lane)]
        ax.broken_barh(bars, (ys[lane] - 0.35, 0.7), facecolors=_COLORS.get(lane, "#937860"),
                       edgecolors="white", linewidth=0.4)
    kernels = tl.lane(GPU)
    if shade_idle and kernels:
        gaps, cur = [], t0
        for s in sorted(kernels, key=lambda s: s.start_us):
            if s.start_us > cur:
                gaps.append((cur - t0, s.start_us - cur))
            cur = max(cur, s.end_us)
        ax.broken_barh(gaps, (ys[GPU] - 0.35, 0.7), facecolors=_IDLE, alpha=0.25, hatch="//",
                       edgecolors=_IDLE, linewidth=0)
    ax.set_yticks([ys[lane] for lane in lanes], lanes)
    ax.set_ylim(-0.6, len(lanes) - 0.4)
    ax.set_xlim(0, xlim if xlim is not None else max(tl.makespan_us, 1e-9) * 1.02)
    ax.set_xlabel("time (µs)")
    s = summarize(tl)
    head = title if title is not None else tl.label
    steps = tl.meta.get("steps")
    span = (f"{steps} steps {s['step_us']:.1f} µs ({s['step_us'] / steps:.1f} per step)"
            if steps else f"step {s['step_us']:.1f} µs")
    ax.set_title(f"{head}  [{tl.tag}]   {span}, "
                 f"GPU idle {100 * s['gpu_idle_fraction']:.0f}%", fontsize=10, loc="left")
    ax.legend(handles=[Patch(color=_COLORS.get(lane, "#937860"),
                             label=tl.meta.get("cpu_label", "launch calls") if lane == CPU else
                             "kernels" if lane == GPU else "ATen ops") for lane in lanes]
              + ([Patch(facecolor=_IDLE, alpha=0.25, hatch="//", label="GPU idle")]
                 if shade_idle and kernels else []),
              loc="center left", bbox_to_anchor=(1.005, 0.5), fontsize=8, frameon=False)
    return ax


def plot_timelines(timelines: Sequence[Timeline], share_x: bool = True, titles=None, *,
                   width: float = 10, figure=None):
    """Several timelines stacked, on one x scale by default so lengths compare directly.

    ``width`` is the figure's width in inches; ``figure`` is the function that makes the
    Figure from ``figsize`` (default pyplot's; a panel passes
    :func:`labkit.widgets.new_figure`, which keeps pyplot out). Returns the matplotlib Figure.
    """
    timelines = _check_timeline_list(timelines, titles)
    if figure is None:
        import matplotlib.pyplot as plt

        figure = plt.figure
    heights = [0.6 + 0.55 * max(2, len(t.lanes)) for t in timelines]
    fig = figure(figsize=(width, sum(heights) + 0.4))
    axes = fig.subplots(len(timelines), 1, gridspec_kw={"height_ratios": heights},
                        squeeze=False)
    xlim = max(t.makespan_us for t in timelines) * 1.02 if share_x else None
    for i, (tl, ax) in enumerate(zip(timelines, axes[:, 0])):
        plot_timeline(tl, ax=ax, xlim=xlim, title=None if titles is None else titles[i])
    fig.tight_layout()
    return fig


def _check_timeline_list(timelines, titles) -> list:
    if isinstance(timelines, Timeline):
        raise TypeError("plot_timelines takes a list of timelines: pass [tl], "
                        "or use plot_timeline(tl) for one")
    if isinstance(timelines, (str, bytes)) or not isinstance(timelines, Iterable):
        raise TypeError(f"timelines must be a list of Timeline, got {type(timelines).__name__}")
    timelines = list(timelines)
    if not timelines:
        raise ValueError("plot_timelines got no timelines; pass at least one, e.g. "
                         "list(simulate_pair(...))")
    for i, tl in enumerate(timelines):
        _check_timeline(f"timelines[{i}]", tl)
    if titles is not None:
        if isinstance(titles, str) or len(titles) != len(timelines):
            raise ValueError(f"titles must be a list of one title per timeline "
                             f"({len(timelines)}), got {titles!r}")
    return timelines


def plot_sweep(rows: Sequence[dict], ax=None, tolerance: float = 0.10, title: str | None = None):
    """Time per step, eager vs graphed, against elements per kernel (log-log).

    The dotted line marks :func:`crossover`: right of it, kernels hide the launches and a
    graph buys less than ``tolerance``. Returns the Axes.
    """
    import matplotlib.pyplot as plt

    rows = _check_rows(rows, "plot_sweep")
    if not rows:
        raise ValueError("plot_sweep got no rows; pass what sweep_measured or "
                         "sweep_simulated returned")
    tolerance = _check_tolerance(tolerance)
    if ax is None:
        _, ax = plt.subplots(figsize=(8, 4.2))
    rows = sorted(rows, key=lambda r: r["numel"])
    x = [r["numel"] for r in rows]
    ax.loglog(x, [r["eager_us"] for r in rows], "o-", color=_COLORS[CPU], label="eager")
    ax.loglog(x, [r["graph_us"] for r in rows], "s-", color=_COLORS[GPU], label="one graph replay")
    c = crossover(rows, tolerance)
    if c is not None:
        ax.axvline(c, color="gray", ls=":", label=f"within {tolerance:.0%} from {c:,} elements")
    src = rows[0]["source"] if rows else ""
    dev = rows[0].get("device", "") if rows else ""
    n = rows[0].get("n_kernels", "") if rows else ""
    ax.set_xlabel("elements per kernel")
    ax.set_ylabel(f"time per step of {n} kernels (µs)")
    ax.set_title(title or f"Where launch cost stops mattering  [{src} ({dev})]", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    return ax
