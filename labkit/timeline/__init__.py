"""Launch-bound timelines: measure the per-launch cost, draw CPU/GPU lanes, export traces.

The engine of lesson 01, in three parts:

* :mod:`~labkit.timeline.measure`: :func:`measure_launch_cost` times a chain of tiny ops
  eagerly and as one graph replay, against any backend from :mod:`labkit.backend`;
* :mod:`~labkit.timeline.trace`: :func:`profile_timeline` (GPU only) turns a
  ``torch.profiler`` trace into a measured :class:`Timeline`; :func:`to_chrome_trace`
  writes any timeline for https://ui.perfetto.dev;
* :mod:`~labkit.timeline.simulate`: :func:`simulate` builds the same picture anywhere from
  a launch cost and kernel times (a roofline of a GPU in :data:`GPU_PRESETS`).

:mod:`~labkit.timeline.plots` and :mod:`~labkit.timeline.panel` draw them;
:mod:`~labkit.timeline.model` holds :class:`Span`, :class:`Timeline` and their figures.
Times are in microseconds (µs) everywhere, as in Chrome traces.

.. warning::
    A simulated timeline says ``simulated (<preset>)`` in every plot title and trace: it
    is a model of a GPU, never a measurement, and must not be read as one.
"""

from labkit.timeline.measure import (
                                     ChainSteps,
                                     chain,
                                     chain_steps,
                                     measure_launch_cost,
                                     sweep_measured,
)
from labkit.timeline.model import (
                                   CPU,
                                   GPU,
                                   OPS,
                                   Span,
                                   Timeline,
                                   gpu_busy_us,
                                   gpu_idle_fraction,
                                   gpu_idle_us,
                                   summarize,
)
from labkit.timeline.panel import TimelinePanel, timeline_panel
from labkit.timeline.plots import plot_sweep, plot_timeline, plot_timelines
from labkit.timeline.presets import (
                                     GPU_PRESETS,
                                     REFERENCE_H200,
                                     GPUPreset,
                                     UnknownPresetError,
                                     add_chain_cost,
                                     get_preset,
                                     preset_for,
                                     roofline_kernel_us,
)
from labkit.timeline.simulate import (
                                      crossover,
                                      simulate,
                                      simulate_pair,
                                      simulate_serving,
                                      sweep_simulated,
)
from labkit.timeline.trace import (
                                   chrome_trace_events,
                                   profile_timeline,
                                   timeline_from_chrome_trace,
                                   to_chrome_trace,
)

__all__ = [
    "Span", "Timeline", "GPUPreset", "UnknownPresetError", "GPU_PRESETS", "REFERENCE_H200",
    "CPU", "GPU", "OPS",
    "simulate", "simulate_pair", "simulate_serving", "gpu_busy_us", "gpu_idle_us",
    "gpu_idle_fraction",
    "summarize", "roofline_kernel_us", "add_chain_cost", "get_preset", "preset_for",
    "chain", "chain_steps", "ChainSteps", "measure_launch_cost", "sweep_measured",
    "sweep_simulated", "crossover",
    "profile_timeline", "timeline_from_chrome_trace",
    "chrome_trace_events", "to_chrome_trace",
    "plot_timeline", "plot_timelines", "plot_sweep", "timeline_panel", "TimelinePanel",
]
