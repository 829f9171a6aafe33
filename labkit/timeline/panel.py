"""The live panel: sliders for launch cost, kernel time and kernel count over a picture."""

from __future__ import annotations

import base64
import math

from labkit.core.validate import check_int
from labkit.timeline.model import Timeline, _check_us, gpu_idle_fraction
from labkit.timeline.plots import plot_timelines
from labkit.timeline.presets import GPUPreset, get_preset
from labkit.timeline.simulate import simulate_pair
from labkit.widgets import ImagePanel, column, mimebundle, new_figure, widgets_wanted

__all__ = ["TimelinePanel", "timeline_panel"]

_PANEL_LAUNCH_US = (0.1, 100.0)   # the sliders' ranges (log sliders: 10**-1 .. 10**2, 10**3)
_PANEL_KERNEL_US = (0.1, 1000.0)
_PANEL_KERNELS = (1, 100)


def _check_panel_settings(launch_us, kernel_us, n_kernels) -> tuple[float, float, int]:
    """The panel's start values, within its sliders' ranges (a slider would clamp silently)."""
    for name, v, (lo, hi) in (("launch_us", launch_us, _PANEL_LAUNCH_US),
                              ("kernel_us", kernel_us, _PANEL_KERNEL_US)):
        v = _check_us(name, v, positive=True)
        if not lo <= v <= hi:
            raise ValueError(f"{name} must be within the slider's range {lo}..{hi} µs, got {v}")
    n = check_int("n_kernels", n_kernels, *_PANEL_KERNELS,
                  fix="the slider's range; for a longer chain use simulate_pair(...) "
                      "and plot_timelines")
    return float(launch_us), float(kernel_us), n


def _kept(slider, current: float) -> float:
    """``current`` when a log slider shows it snapped to its step grid, else the slider's value.

    .. warning::
        The browser snaps a FloatLogSlider's value to ``min + k * step`` decades and sends
        it back (2.0 µs becomes 10**0.30 = 1.995 µs): taken as a move, the panel would
        redraw with the snapped value and its label would disagree with the lesson's.
    """
    if abs(math.log10(slider.value) - math.log10(current)) <= slider.step / 2 + 1e-12:
        return current
    return slider.value


class TimelinePanel(ImagePanel):
    """Sliders for launch cost, kernel time and number of kernels over a live picture.

    In Jupyter with ipywidgets it shows the sliders and redraws the simulated eager and
    graphed timelines on each change. Everywhere else (nbconvert HTML, GitHub, a terminal,
    ipywidgets missing, ``LABKIT_WIDGETS=0``) it falls back to a plain PNG of the initial
    settings: the display bundle carries both, and a frontend that cannot render widgets
    picks the image. ``figure()`` draws the current settings as a matplotlib Figure (of its
    own, not through pyplot), ``png()`` as PNG bytes. Redraws run one at a time, a burst of
    slider moves ending on one drawing of the latest values: with ipykernel 7 two sliders'
    moves can arrive on two threads at once (issue 19, see :mod:`labkit.widgets`).

    .. warning::
        Start values must lie within the sliders' ranges (launch 0.1–100 µs, kernel
        0.1–1000 µs, 1–100 kernels); outside them ValueError is raised, because a slider
        would clamp the value silently and the picture would not show what was asked.
    """

    _SETTINGS = ("launch_us", "kernel_us", "n_kernels")

    def __init__(self, launch_us: float = 10.0, kernel_us: float = 2.0, n_kernels: int = 12,
                 preset: str | GPUPreset | None = None, widgets: bool | None = None):
        self.launch_us, self.kernel_us, self.n_kernels = _check_panel_settings(
            launch_us, kernel_us, n_kernels)
        self.preset = get_preset(preset) if preset is not None else None
        self.widget = self._build() if widgets_wanted(widgets) else None

    def timelines(self) -> tuple[Timeline, Timeline]:
        return simulate_pair(self.n_kernels, self.launch_us, self.kernel_us, preset=self.preset)

    def figure(self):
        """Eager over graphed on one time axis (``plot_timelines``), 900 px wide."""
        return plot_timelines(self.timelines(), width=9, figure=new_figure)

    def text(self) -> str:
        eager, graphed = self.timelines()
        e, g = eager.makespan_us, graphed.makespan_us
        return (f"eager step {e:.1f} µs (GPU idle {gpu_idle_fraction(eager):.0%}) · "
                f"graphed step {g:.1f} µs (GPU idle {gpu_idle_fraction(graphed):.0%}) · "
                f"speedup {e / max(g, 1e-9):.1f}×")

    def _build(self):
        try:
            import ipywidgets as w
        except ImportError:
            return None
        style = {"description_width": "120px"}
        layout = w.Layout(width="460px")
        self._launch = w.FloatLogSlider(value=self.launch_us, base=10, min=-1, max=2, step=0.05,
                                        description="launch cost µs", style=style, layout=layout)
        self._kernel = w.FloatLogSlider(value=self.kernel_us, base=10, min=-1, max=3, step=0.05,
                                        description="kernel time µs", style=style, layout=layout)
        self._n = w.IntSlider(value=self.n_kernels, min=1, max=100, description="kernels",
                              style=style, layout=layout)
        self._live([self._launch, self._kernel, self._n])
        # flex "0 0 auto": beside the long label a shrinkable VBox clipped the sliders' readouts
        sliders = w.VBox([self._launch, self._kernel, self._n], layout=w.Layout(flex="0 0 auto"))
        return column([w.HBox([sliders, self._label]), self._image])

    def _control_values(self):
        return (_kept(self._launch, self.launch_us), _kept(self._kernel, self.kernel_us),
                self._n.value)

    def _label_html(self) -> str:
        return self.text()

    def _repr_mimebundle_(self, include=None, exclude=None):
        png = base64.b64encode(self.png()).decode("ascii")
        bundle = {"text/plain": f"TimelinePanel: {self.text()}", "image/png": png}
        return mimebundle(bundle, self.widget)


def timeline_panel(launch_us: float = 10.0, kernel_us: float = 2.0, n_kernels: int = 12,
                   preset: str | GPUPreset | None = None,
                   widgets: bool | None = None) -> TimelinePanel:
    """A :class:`TimelinePanel`: display it (last expression of a cell) to use it."""
    return TimelinePanel(launch_us, kernel_us, n_kernels, preset, widgets)
