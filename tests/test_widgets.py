"""labkit.widgets and the two live panels under concurrent redraws (issue 19).

With ipykernel 7 and JupyterLab 4.6 a panel's controls can deliver changes on two threads at
once (the main thread and a subshell's). These tests drive the panels from several threads
and check that no two pictures are drawn at the same time, that a burst ends on a picture of
the latest values, and that nothing goes through pyplot's global state.
"""

from __future__ import annotations

import hashlib
import threading
import time

import matplotlib
import pytest

matplotlib.use("Agg")

from labkit import widgets as W  # noqa: E402


def _sha(png: bytes) -> str:
    return hashlib.sha256(bytes(png)).hexdigest()


# --------------------------------------------------------------------------- Redraw

def test_redraw_runs_one_draw_at_a_time_and_ends_on_the_latest_value():
    value = {"v": 0}
    inside, most, drawn = [0], [0], []
    guard = threading.Lock()

    def draw():
        with guard:
            inside[0] += 1
            most[0] = max(most[0], inside[0])
        v = value["v"]
        time.sleep(0.01)
        drawn.append(v)
        with guard:
            inside[0] -= 1

    redraw = W.Redraw(draw)
    start = threading.Barrier(4)

    def burst(k):
        start.wait()
        for i in range(20):
            value["v"] = (k, i)
            redraw()

    threads = [threading.Thread(target=burst, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert most[0] == 1, "two draws ran at the same time"
    assert drawn[-1] == value["v"], "the burst did not end on a drawing of the latest value"
    assert len(drawn) < 80, f"a burst of 80 changes was not coalesced ({len(drawn)} draws)"


def test_redraw_draws_again_after_a_failed_draw():
    calls = []

    def draw():
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("boom")

    redraw = W.Redraw(draw)
    with pytest.raises(RuntimeError, match="boom"):
        redraw()
    redraw()
    assert len(calls) == 2


def test_redraw_and_draw_png_reject_what_is_not_a_function():
    with pytest.raises(TypeError, match="Redraw takes the function that redraws, got int"):
        W.Redraw(3)
    with pytest.raises(TypeError, match="draw_png takes a function that returns a Figure"):
        W.draw_png(W.new_figure((2, 1)))


# --------------------------------------------------------------------------- figures

def test_new_figure_stays_out_of_pyplot_and_renders():
    import matplotlib.pyplot as plt

    before = plt.get_fignums()
    fig = W.new_figure((4, 2))
    fig.subplots().plot([1, 2, 3])
    assert plt.get_fignums() == before, "new_figure registered a pyplot figure"
    png = W.figure_png(fig)
    assert W.png_size(png) == (4 * W.FIGURE_DPI, 2 * W.FIGURE_DPI)
    assert plt.get_fignums() == before


def test_figure_png_still_closes_a_pyplot_figure():
    import matplotlib.pyplot as plt

    fig = plt.figure(figsize=(2, 1))
    W.figure_png(fig)
    assert fig.number not in plt.get_fignums()


@pytest.mark.parametrize("figsize", [(10, 3), (0, 3), (4, 0)])
def test_new_figure_keeps_to_the_notebook_width(figsize):
    with pytest.raises(ValueError, match=r"0 < width <= 9\.0 \(the notebook's width\)"):
        W.new_figure(figsize)


# --------------------------------------------------------------------------- the panels

def _hammer(changes) -> None:
    """Run each list of changes on a thread of its own, all starting together."""
    start = threading.Barrier(len(changes))

    def run(items):
        start.wait()
        for setter in items:
            setter()

    threads = [threading.Thread(target=run, args=(c,)) for c in changes]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def _count_drawings(monkeypatch):
    """Spans (start, end) of every picture rendered through labkit.widgets.figure_png."""
    spans, real = [], W.figure_png

    def timed(fig):
        t0 = time.perf_counter()
        try:
            return real(fig)
        finally:
            spans.append((t0, time.perf_counter()))
    monkeypatch.setattr(W, "figure_png", timed)
    return spans


def _overlaps(spans) -> int:
    spans = sorted(spans)
    return sum(1 for i, a in enumerate(spans) for b in spans[i + 1:] if b[0] < a[1])


def test_bucket_panel_under_changes_from_two_threads(monkeypatch):
    pytest.importorskip("ipywidgets")
    import matplotlib.pyplot as plt

    from labkit.decode import plots

    panel = plots.bucket_panel([1, 2, 3, 5, 8, 13, 16] * 3, max_bs=16, widgets=True)
    spans = _count_drawings(monkeypatch)
    figs = plt.get_fignums()
    slider, dropdown = panel._slider, panel._dropdown
    _hammer([
        [lambda v=v: setattr(slider, "value", v) for v in (15, 12, 9, 14, 11)],
        [lambda v=v: setattr(dropdown, "value", v) for v in ("pow2", "every", "pow2")],
    ])
    assert (panel.max_bs, panel.scheme) == (11, "pow2")
    fresh = plots.BucketPanel(panel.workload, max_bs=11, scheme="pow2", widgets=False)
    assert _sha(panel._image.value) == _sha(fresh.png())
    assert panel._label.value == fresh.table_html()
    assert _overlaps(spans) == 0, "two pictures were drawn at the same time"
    assert plt.get_fignums() == figs, "a redraw left a pyplot figure open"


def test_timeline_panel_under_changes_from_two_threads(monkeypatch):
    pytest.importorskip("ipywidgets")
    from labkit import timeline as T

    panel = T.timeline_panel(launch_us=10.0, kernel_us=2.0, n_kernels=12, widgets=True)
    spans = _count_drawings(monkeypatch)
    _hammer([
        [lambda v=v: setattr(panel._n, "value", v) for v in (20, 8, 30, 6)],
        [lambda v=v: setattr(panel._kernel, "value", v) for v in (5.0, 50.0, 3.0)],
        [lambda v=v: setattr(panel._launch, "value", v) for v in (20.0, 4.0)],
    ])
    assert panel.n_kernels == 6 and panel.kernel_us == pytest.approx(3.0, rel=1e-6)
    assert panel.launch_us == pytest.approx(4.0, rel=1e-6)
    fresh = T.TimelinePanel(panel.launch_us, panel.kernel_us, panel.n_kernels, widgets=False)
    assert _sha(panel._image.value) == _sha(fresh.png())
    assert panel._label.value == fresh.text()
    assert _overlaps(spans) == 0, "two pictures were drawn at the same time"


def test_panel_pictures_fit_the_notebook():
    from labkit import timeline as T
    from labkit.decode import plots

    for panel in (T.timeline_panel(widgets=False),
                  plots.bucket_panel([1, 2, 3], max_bs=8, widgets=False)):
        assert W.png_size(panel.png())[0] <= 900


def test_serving_figure_fits_the_notebook_and_labels_its_log_axis_plainly():
    from types import SimpleNamespace

    from labkit.decode import plots

    def run(ms, tps):
        return SimpleNamespace(decode_batch_size=[1, 2, 4, 4, 2], decode_tokens_per_s=tps,
                               decode_latency_s=[m / 1e3 for m in ms])

    fig = plots.plot_serving({"eager": run([2.4, 2.6, 2.5, 2.7, 2.3], 4500.0),
                              "graphed": run([0.7, 0.8, 0.9, 0.75, 0.6], 15000.0)},
                             note="test")
    assert fig.get_size_inches()[0] * W.FIGURE_DPI <= 900
    fig.canvas.draw()
    ax = fig.axes[0]
    labels = [t.get_text() for t in ax.yaxis.get_ticklabels(which="both") if t.get_text()]
    assert labels and all("10^" not in s and "×" not in s and "e" not in s for s in labels), labels
    assert {"1", "2"} <= set(labels), labels
    legend = ax.get_legend()
    assert min(t.get_fontsize() for t in legend.get_texts()) >= 9
    import matplotlib.pyplot as plt
    plt.close(fig)
