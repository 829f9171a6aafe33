"""Pictures for lesson 06: the serving comparison, the capture report, the bucket explorer.

Nothing here computes anything the engine does not already compute: every function takes
what :func:`~labkit.decode.serving.serve`, :meth:`DecodeGraphRunner.capture_report
<labkit.decode.runner.BaseGraphRunner.capture_report>` or
:func:`~labkit.decode.buckets.explore_buckets` returned and draws it.

    from labkit.decode import plots
    plots.plot_serving({"eager": eager, "graphed": graphed}, note="emulator timings")
    plots.plot_capture_report(runner.capture_report())
    plots.bucket_panel(graphed.decode_batch_size, max_bs=16)   # display it (last line)

:func:`bucket_panel` is a live panel (a ``max_bs`` slider and a bucket-scheme dropdown)
when ipywidgets can render, and a plain picture plus a table everywhere else (nbconvert
HTML, GitHub, a terminal, ipywidgets missing, ``LABKIT_WIDGETS=0``), the same fallback
as :func:`labkit.timeline.timeline_panel`.
"""

from __future__ import annotations

import base64
import html
from collections import Counter
from typing import Iterable, Mapping, Sequence

import numpy as np

from labkit.widgets import ImagePanel, column, mimebundle, new_figure, widgets_wanted

from .buckets import (
    DECODE_SCHEMES,
    BatchTooLargeError,
    BucketReport,
    explore_buckets,
    make_buckets,
    pad_to_bucket,
)

__all__ = ["plot_serving", "plot_capture_report", "plot_buckets", "BucketPanel",
           "bucket_panel"]

_COLORS = {"eager": "#C44E52", "graphed": "#4C72B0", "sglang": "#4C72B0",
           "every": "#55A868", "pow2": "#DD8452"}


def _color(name: str, i: int) -> str:
    return _COLORS.get(name, f"C{i}")


# --------------------------------------------------------------------------- serving

def _plain_log_labels(axis) -> None:
    """Label a log axis with plain numbers (0.6, 1, 2, 3), not 6×10⁻¹, 10⁰, 2×10⁰.

    Which ticks get a label stays matplotlib's choice for a log axis (minor ticks too when
    it spans about a decade); only the way the numbers are written changes.
    """
    from matplotlib.ticker import Formatter, LogFormatter

    class Plain(Formatter):
        def __init__(self, minor: bool):
            self.choice = LogFormatter(labelOnlyBase=False,
                                       minor_thresholds=(2, 0.4) if minor else (1, 0.4))

        def set_axis(self, ax):
            super().set_axis(ax)
            self.choice.set_axis(ax)

        def set_locs(self, locs):
            self.choice.set_locs(locs)

        def __call__(self, x, pos=None):
            return f"{x:g}" if self.choice(x, pos) else ""

    axis.set_major_formatter(Plain(minor=False))
    axis.set_minor_formatter(Plain(minor=True))


def plot_serving(results: Mapping[str, object], note: str = "", axes=None):
    """Per-step decode latency (left) and decode tokens/s (right) of several
    :class:`~labkit.decode.serving.ServeResult` runs, e.g. ``{"eager": e, "graphed": g}``.

    The left panel also draws the decode batch size of every step (grey, right axis): the
    batch size changes from step to step, which is why the runner needs buckets. ``note``
    goes into the title (say where the timings come from). The figure is 9 inches wide
    (900 px at :data:`labkit.widgets.FIGURE_DPI`): it fits a notebook's column without
    being scaled down, so its 9-point legend stays readable; the latency axis is a log
    axis labelled with plain numbers (ms).
    """
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    if axes is None:
        fig, axes = plt.subplots(1, 2, figsize=(9, 4.4),
                                 gridspec_kw={"width_ratios": [2.3, 1]})
    else:
        fig = axes[0].figure
    ax, bx = axes
    names = list(results)
    first = results[names[0]]
    twin = ax.twinx()
    twin.fill_between(range(len(first.decode_batch_size)), first.decode_batch_size,
                      step="mid", color="0.85", zorder=0, label="batch size")
    twin.set_ylabel("requests in the step", color="0.45")
    twin.tick_params(axis="y", colors="0.45")
    twin.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_zorder(twin.get_zorder() + 1)
    ax.patch.set_visible(False)
    all_ms = []
    for i, name in enumerate(names):
        r = results[name]
        ms = np.array(r.decode_latency_s) * 1e3
        all_ms.append(ms)
        ax.plot(ms, lw=1.2, color=_color(name, i),
                label=f"{name} (p50 {np.median(r.decode_latency_s) * 1e3:.2f} ms, "
                      f"max {ms.max():.2f} ms)" if len(ms) else name)
    ax.set_yscale("log")
    _plain_log_labels(ax.yaxis)
    ms = np.concatenate(all_ms) if all_ms else np.array([])
    ms = ms[ms > 0]
    if len(ms):
        # every step in view, the slowest included (a one-off spike is the story on a GPU),
        # with room above it; the legend sits outside the curves
        ax.set_ylim(ms.min() / 1.5, ms.max() * 1.8)
    ax.set_xlabel("decode step")
    ax.set_ylabel("step latency (ms, log)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=9, loc="upper left", bbox_to_anchor=(0, -0.17), ncol=1,
              frameon=False, borderaxespad=0)
    ax.set_title("per-step decode latency", fontsize=10)

    tps = [results[n].decode_tokens_per_s for n in names]
    bars = bx.bar(names, tps, color=[_color(n, i) for i, n in enumerate(names)])
    for b, v in zip(bars, tps):
        bx.annotate(f"{v:,.0f}", (b.get_x() + b.get_width() / 2, v), ha="center",
                    va="bottom", fontsize=9)
    bx.set_ylabel("decode tokens / s")
    bx.set_title("decode throughput", fontsize=10)
    bx.margins(y=0.15)
    if note:
        fig.suptitle(note, fontsize=10)
    fig.tight_layout(w_pad=2)
    return fig


# --------------------------------------------------------------------------- capture

def plot_capture_report(report: dict, ax=None):
    """Capture time per bucket (bars, in capture order: largest first) and the shared
    pool's reserved memory after each graph (line, right axis)."""
    import matplotlib.pyplot as plt

    log = sorted(report["per_bucket"], key=lambda r: -r["bs"])  # capture order
    if ax is None:
        _, ax = plt.subplots(figsize=(8, 3.2))
    labels = [str(r["bs"]) for r in log]
    ax.bar(labels, [1e3 * r["seconds"] for r in log], color="#4C72B0")
    ax.set_xlabel("bucket (capture order: largest first)")
    ax.set_ylabel("warmups + capture (ms)")
    twin = ax.twinx()
    twin.plot(labels, [r["pool_reserved_bytes"] / 2**20 for r in log], "o-", color="#C44E52")
    twin.set_ylabel("pool reserved (MiB)", color="#C44E52")
    twin.set_ylim(bottom=0)
    ax.set_title(f"{report['graphs']} graphs in {report['capture_seconds']:.2f} s, one pool "
                 f"({report['pool_reserved_bytes'] / 2**20:.1f} MiB reserved)", fontsize=10)
    return ax


# --------------------------------------------------------------------------- buckets

def _padded(raw: int, buckets: Sequence[int]) -> int | None:
    try:
        return pad_to_bucket(raw, buckets)
    except BatchTooLargeError:
        return None


def plot_buckets(max_bs: int, workload: Iterable[int] = (), schemes=DECODE_SCHEMES, ax=None,
                 show_max: int | None = None):
    """Which bucket every raw batch size replays (a staircase per scheme), over the
    histogram of the batch sizes a workload produced. Sizes above the largest bucket
    have no graph (no staircase there): error or eager fallback. Given ``ax``, pyplot is
    not touched (a panel's redraw may run on another thread)."""
    if ax is None:
        import matplotlib.pyplot as plt

        _, ax = plt.subplots(figsize=(8, 3.6))
    counts = Counter(int(b) for b in workload)
    top = max([max_bs, show_max or 0] + list(counts))
    if counts:
        hist = ax.twinx()
        xs = sorted(counts)
        hist.bar(xs, [counts[x] for x in xs], color="0.85", width=0.8, zorder=0)
        hist.set_ylabel("steps with this batch size", color="0.45")
        hist.tick_params(axis="y", colors="0.45")
        ax.set_zorder(hist.get_zorder() + 1)
        ax.patch.set_visible(False)
    raw = np.arange(1, top + 1)
    for i, s in enumerate([schemes] if isinstance(schemes, str) else schemes):
        buckets = make_buckets(max_bs, s)
        y = [_padded(int(r), buckets) for r in raw]
        y = np.array([np.nan if v is None else v for v in y], dtype=float)
        name = s if isinstance(s, str) else "custom"
        # earlier schemes drawn wider, so a later one lying on top leaves them visible
        ax.step(raw, y, where="mid", color=_color(name, i), lw=max(1.2, 3.2 - 0.9 * i),
                label=f"{name}: {len(buckets)} graphs")
    ax.plot(raw, raw, ":", color="0.5", lw=1, label="no padding")
    if top > max_bs:
        ax.axvspan(max_bs + 0.5, top + 0.5, color="#C44E52", alpha=0.08,
                   label="> max_bs: no graph")
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlim(0.5, top + 0.5)
    ax.set_xlabel("raw batch size")
    ax.set_ylabel("bucket replayed")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")
    return ax



class BucketPanel(ImagePanel):
    """A ``max_bs`` slider and a bucket-scheme dropdown over a workload's batch sizes.

    Shows, for the chosen settings, what :func:`~labkit.decode.buckets.explore_buckets`
    computes: the number of graphs, the padding waste, the batches too large for any
    graph, and the (modelled) pool memory, shared vs one pool per graph; plus the
    staircase picture of :func:`plot_buckets`. In Jupyter with ipywidgets it redraws on
    every change; everywhere else (nbconvert HTML, GitHub, a terminal, ipywidgets
    missing, ``LABKIT_WIDGETS=0``) the display falls back to a picture and a table of
    the initial settings: the display bundle carries both, and a frontend that cannot
    render widgets picks the picture.

    Redraws run one at a time on a figure of their own (no pyplot), a burst of changes
    ending on one drawing of the controls' latest values: with ipykernel 7 the changes of
    two controls can arrive on two threads at once (issue 19, see :mod:`labkit.widgets`).
    """

    _SETTINGS = ("max_bs", "scheme")

    def __init__(self, workload: Iterable[int], max_bs: int = 16, scheme: str = "sglang",
                 slider_max: int | None = None, widgets: bool | None = None, **explore_kwargs):
        self.workload = [int(b) for b in workload]
        self.max_bs = int(max_bs)
        self.scheme = scheme
        self.explore_kwargs = explore_kwargs
        self.slider_max = slider_max or max(64, self.max_bs, max(self.workload, default=1))
        self.widget = self._build() if widgets_wanted(widgets) else None

    def report(self, scheme: str | None = None) -> BucketReport:
        return explore_buckets(self.max_bs, self.workload, scheme or self.scheme,
                               **self.explore_kwargs)

    def rows(self) -> list[dict]:
        """One :meth:`BucketReport.as_row` per scheme, for the current ``max_bs``."""
        return [self.report(s).as_row() for s in DECODE_SCHEMES]

    def text(self) -> str:
        r = self.report()
        return (f"max_bs {self.max_bs}, {r.scheme}: {r.num_graphs} graphs · padding waste "
                f"{100 * r.padding_waste:.1f}% · {r.oversize_batches} of "
                f"{len(self.workload)} steps too large for a graph · pool ≈ "
                f"{r.memory_bytes / 2**20:.2f} MiB shared "
                f"({r.memory_bytes_separate_pools / 2**20:.2f} MiB with a pool per graph)")

    def table_html(self) -> str:
        rows = self.rows()
        head = "".join(f"<th>{html.escape(str(k))}</th>" for k in rows[0])
        body = "".join(
            "<tr" + (' style="font-weight:bold"' if r["scheme"] == self.scheme else "") + ">"
            + "".join(f"<td>{html.escape(str(v))}</td>" for v in r.values()) + "</tr>"
            for r in rows)
        return (f"<p>{html.escape(self.text())}</p>"
                f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>")

    def figure(self):
        """The current settings' picture, on a Figure of its own (not through pyplot)."""
        fig = new_figure((8, 3.4))
        ax = fig.subplots()
        plot_buckets(self.max_bs, self.workload, schemes=self.scheme, ax=ax)
        ax.set_title(self.text().split(" · pool")[0], fontsize=9)
        fig.tight_layout()
        return fig

    def _build(self):
        try:
            import ipywidgets as w
        except ImportError:
            return None
        style = {"description_width": "80px"}
        self._slider = w.IntSlider(value=self.max_bs, min=1, max=self.slider_max,
                                   description="max_bs", style=style,
                                   layout=w.Layout(width="420px"))
        self._dropdown = w.Dropdown(options=list(DECODE_SCHEMES), value=self.scheme,
                                    description="buckets", style=style)
        self._live([self._slider, self._dropdown])
        return column([w.HBox([self._slider, self._dropdown]), self._label, self._image])

    def _control_values(self):
        return self._slider.value, self._dropdown.value

    def _label_html(self) -> str:
        return self.table_html()

    def _repr_mimebundle_(self, include=None, exclude=None):
        png = base64.b64encode(self.png()).decode("ascii")
        # The static views: a frontend without widgets picks text/html (table + picture)
        # or image/png; the widget view, when present, wins where widgets render.
        page = f'{self.table_html()}<img src="data:image/png;base64,{png}"/>'
        bundle = {"text/plain": f"BucketPanel: {self.text()}", "image/png": png,
                  "text/html": page}
        return mimebundle(bundle, self.widget)


def bucket_panel(workload: Iterable[int], max_bs: int = 16, scheme: str = "sglang",
                 slider_max: int | None = None, widgets: bool | None = None,
                 **explore_kwargs) -> BucketPanel:
    """A :class:`BucketPanel`: display it (last expression of a cell) to use it."""
    return BucketPanel(workload, max_bs, scheme, slider_max, widgets, **explore_kwargs)
