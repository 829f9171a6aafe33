"""Launch-bound timelines: measure the per-launch cost, draw CPU/GPU lanes, export traces.

This is the engine of lesson 01. It answers one question with numbers and pictures:
*when does the CPU's cost of launching a kernel, rather than the GPU's cost of running
it, set the speed of a program?*

Why launches cost anything
--------------------------
CUDA is asynchronous. ``y = x + 1`` on a GPU tensor does not add anything on the CPU: it
walks Python → the torch dispatcher → ATen's CUDA kernel wrapper → the CUDA driver's
``cudaLaunchKernel``, which queues the kernel on a stream and returns. That walk costs a
few µs of CPU time per op, *whatever the size of the tensor*. The GPU then runs the
kernel. Two regimes follow:

* **GPU-bound**: each kernel runs longer than a launch costs. The CPU races ahead, the
  stream's queue fills up, and the GPU runs kernels back to back. Launch cost is hidden.
* **launch-bound** (CPU-bound): each kernel is shorter than a launch. The GPU finishes a
  kernel and then waits for the CPU to hand it the next one; the gaps are wasted time.
  Decode steps of an LLM (batch ``B``, one token: dozens of tiny kernels per layer) and
  training layers made of many small element-wise/norm/bias kernels are the classic cases.

A CUDA graph records the kernel sequence once and relaunches all of it with one
``cudaGraphLaunch``: N launches become 1, and the GPU runs the recorded kernels back to
back. This module lets a learner see that, three ways:

1. :func:`measure_launch_cost` times a chain of N tiny ops eagerly and as one graph
   replay, against any backend from :mod:`labkit.backend`. On a GPU it uses CUDA events;
   on a CPU it times the real dispatch cost of each op with ``perf_counter`` and replays
   the graph through the emulator (which shows the mechanism, not a GPU's speed).
2. :func:`profile_timeline` (GPU only) records a real ``torch.profiler`` trace and turns
   its launch calls (``cudaLaunchKernel``, ``cudaGraphLaunch``) and kernels into a
   two-lane :class:`Timeline`. :func:`simulate` builds the same picture anywhere, from a
   launch cost (measured here) and kernel times (a roofline model of a named GPU in
   :data:`GPU_PRESETS`); such timelines say ``simulated (<preset>)`` on every plot.
3. :func:`sweep_measured` / :func:`sweep_simulated` vary the work per kernel and find the
   crossover where launch cost stops mattering.

Pictures come from :func:`plot_timeline`, :func:`plot_timelines`, :func:`plot_sweep` and
the live :func:`timeline_panel`; :func:`to_chrome_trace` writes any timeline as
Chrome-trace JSON that https://ui.perfetto.dev opens.

Times are in microseconds (µs) everywhere, as in Chrome traces.
"""

from __future__ import annotations

import base64
import json
import math
import os
import statistics
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import torch

from labkit.capture import cleanup_on_failure, side_stream_warmup
from labkit.widgets import column, figure_png, image_widget, mimebundle, set_image, widgets_wanted

__all__ = [
    "Span", "Timeline", "GPUPreset", "UnknownPresetError", "GPU_PRESETS", "REFERENCE_H200",
    "CPU", "GPU", "OPS",
    "simulate", "simulate_pair", "gpu_busy_us", "gpu_idle_us", "gpu_idle_fraction",
    "summarize", "roofline_kernel_us", "add_chain_cost", "get_preset", "preset_for",
    "chain", "chain_steps", "ChainSteps", "measure_launch_cost", "sweep_measured",
    "sweep_simulated", "crossover",
    "profile_timeline", "timeline_from_chrome_trace",
    "chrome_trace_events", "to_chrome_trace",
    "plot_timeline", "plot_timelines", "plot_sweep", "timeline_panel", "TimelinePanel",
]

# Lane names. A simulated timeline has CPU and GPU; a measured one may add OPS, the
# top-level ATen ops that *contain* each launch call (the Python → ATen part of the path).
CPU = "CPU"
GPU = "GPU"
OPS = "CPU ops"
_LANE_ORDER = (OPS, CPU, GPU)

# The lesson's reference measurement (lead's run, torch 2.11, one H200, 100 tiny adds).
REFERENCE_H200 = {
    "device": "NVIDIA H200", "torch": "2.11", "n_ops": 100,
    "eager_us_per_kernel": 10.5, "graph_us_per_kernel": 1.1, "speedup": 9.5,
}



# --------------------------------------------------------------------------- input checks
# Small named checks, so every public function says what was given, what was expected and
# what to do, instead of failing deep inside matplotlib or torch (or computing nonsense).


def _check_count(name: str, value, minimum: int = 0) -> int:
    """``value`` as an int >= ``minimum``; bools, floats and strings are refused."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int >= {minimum}, got {value!r} "
                        f"({type(value).__name__}); pass a whole number such as {max(minimum, 1)}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}; pass a count of "
                         f"at least {minimum}")
    return value


def _check_us(name: str, value, positive: bool = False) -> float:
    """``value`` as a finite float >= 0 (> 0 if ``positive``): a duration in µs."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number of µs, got {value!r} "
                        f"({type(value).__name__}); pass a float such as 2.0")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number of µs, got {value}; "
                         "pass a real duration such as 2.0")
    if value < 0 or (positive and value == 0):
        bound = "> 0" if positive else ">= 0"
        raise ValueError(f"{name} must be {bound} µs, got {value}; a duration cannot be "
                         f"{'zero or ' if positive else ''}negative")
    return value


def _check_timeline(name: str, tl) -> "Timeline":
    if not isinstance(tl, Timeline):
        raise TypeError(f"{name} must be a labkit.timeline.Timeline, got {type(tl).__name__}; "
                        "build one with simulate(...), profile_timeline(...) or "
                        "timeline_from_chrome_trace(...)")
    return tl


def _check_dtype(dtype) -> torch.dtype:
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype such as torch.float32, got {dtype!r} "
                        f"({type(dtype).__name__})")
    return dtype


def _check_backend(B, what: str):
    if not (hasattr(B, "name") and hasattr(B, "device") and hasattr(B, "CUDAGraph")):
        raise TypeError(f"{what} needs a labkit backend, got {type(B).__name__}; "
                        "pass B = labkit.backend.get() (or labkit.backend.get('emulated'))")
    return B


def _check_numels(numels) -> list[int]:
    if isinstance(numels, (str, bytes)) or not isinstance(numels, Iterable):
        raise TypeError(f"numels must be a list of ints (elements per kernel), got {numels!r}")
    out = list(numels)
    if not out:
        raise ValueError("numels is empty: pass at least one size, e.g. [256, 4096, 65536]")
    return [_check_count("each entry of numels", n, 1) for n in out]


def _check_folder_of(path, what: str) -> Path:
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"{what} must be a file path (str or Path), got {type(path).__name__}")
    path = Path(path)
    if not path.parent.is_dir():
        raise ValueError(f"{what} {str(path)!r} is in a folder that does not exist "
                         f"({str(path.parent)!r}); create it first or pick another path")
    if path.is_dir():
        raise ValueError(f"{what} {str(path)!r} is a folder; pass a file name such as "
                         f"{str(path / 'trace.json')!r}")
    return path


def _check_rows(rows, what: str) -> list[dict]:
    if isinstance(rows, (str, bytes, dict)) or not isinstance(rows, Iterable):
        raise TypeError(f"{what} takes the list of rows from sweep_measured/sweep_simulated, "
                        f"got {type(rows).__name__}")
    rows = list(rows)
    for i, r in enumerate(rows):
        missing = [k for k in ("numel", "eager_us", "graph_us")
                   if not isinstance(r, dict) or k not in r]
        if missing:
            raise ValueError(f"{what}: row {i} lacks {', '.join(missing)}; rows come from "
                             "sweep_measured or sweep_simulated")
    return rows


def _check_tolerance(tolerance) -> float:
    if isinstance(tolerance, bool) or not isinstance(tolerance, (int, float)):
        raise TypeError(f"tolerance must be a fraction such as 0.10, got {tolerance!r}")
    if not (math.isfinite(tolerance) and tolerance >= 0):
        raise ValueError(f"tolerance must be a finite fraction >= 0 such as 0.10, "
                         f"got {tolerance}")
    return float(tolerance)


class UnknownPresetError(KeyError, ValueError):
    """An unknown GPU preset name (a KeyError for old callers, a ValueError by kind)."""

    def __str__(self):
        return str(self.args[0]) if self.args else ""


# --------------------------------------------------------------------------- data model

@dataclass(frozen=True)
class Span:
    """One busy interval on one lane: a launch call on the CPU or a kernel on the GPU."""

    lane: str
    name: str
    start_us: float
    dur_us: float

    def __post_init__(self):
        for f in ("lane", "name"):
            if not isinstance(getattr(self, f), str):
                raise TypeError(f"Span.{f} must be a str, got {getattr(self, f)!r}; "
                                f"lanes are {CPU!r}, {GPU!r} or {OPS!r}")
        if isinstance(self.start_us, bool) or not isinstance(self.start_us, (int, float)) \
                or not math.isfinite(self.start_us):
            raise ValueError(f"Span.start_us must be a finite number of µs, got "
                             f"{self.start_us!r}")
        _check_us("Span.dur_us", self.dur_us)

    @property
    def end_us(self) -> float:
        return self.start_us + self.dur_us


@dataclass
class Timeline:
    """Spans on lanes, plus where they came from.

    ``source`` is ``"measured"`` (a profiler trace of this machine) or ``"simulated"``
    (:func:`simulate`); ``device`` names the GPU (a preset for a simulation, the real
    device for a measurement) and ends up in every plot title, so a simulated picture can
    never pass for a measured one.
    """

    spans: list[Span]
    source: str = "simulated"
    label: str = ""
    device: str | None = None
    meta: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.source not in ("measured", "simulated"):
            raise ValueError(f"source must be 'measured' or 'simulated', not {self.source!r}")
        if not isinstance(self.label, str):
            raise TypeError(f"label must be a str, got {type(self.label).__name__}")
        if self.device is not None and not isinstance(self.device, str):
            raise TypeError(f"device must be a str (the GPU's name) or None, got "
                            f"{type(self.device).__name__}")
        if not isinstance(self.meta, dict):
            raise TypeError(f"meta must be a dict, got {type(self.meta).__name__}")
        if isinstance(self.spans, (str, bytes)) or not isinstance(self.spans, Iterable):
            raise TypeError(f"spans must be a list of Span, got {type(self.spans).__name__}")
        self.spans = list(self.spans)
        bad = [x for x in self.spans if not isinstance(x, Span)]
        if bad:
            raise TypeError(f"spans must hold Span objects only, got {type(bad[0]).__name__} "
                            f"({bad[0]!r}); build each with Span(lane, name, start_us, dur_us)")
        self.spans = sorted(self.spans, key=lambda s: (s.start_us, s.lane))

    @property
    def tag(self) -> str:
        """``"simulated (H200)"``, ``"measured (NVIDIA H200)"``, or just the source."""
        return f"{self.source} ({self.device})" if self.device else self.source

    @property
    def lanes(self) -> list[str]:
        present = {s.lane for s in self.spans}
        ordered = [lane for lane in _LANE_ORDER if lane in present]
        return ordered + sorted(present - set(ordered))

    def lane(self, name: str) -> list[Span]:
        if not isinstance(name, str):
            raise TypeError(f"lane name must be a str such as {GPU!r}, got {name!r}")
        return [s for s in self.spans if s.lane == name]

    @property
    def start_us(self) -> float:
        return min((s.start_us for s in self.spans), default=0.0)

    @property
    def end_us(self) -> float:
        return max((s.end_us for s in self.spans), default=0.0)

    @property
    def makespan_us(self) -> float:
        """From the first launch to the last kernel's end: one step's wall time."""
        return self.end_us - self.start_us

    def shifted(self, to: float = 0.0) -> "Timeline":
        """The same timeline with its first span starting at ``to``."""
        if isinstance(to, bool) or not isinstance(to, (int, float)) or not math.isfinite(to):
            raise ValueError(f"shifted(to=...) takes a finite number of µs, got {to!r}")
        d = to - self.start_us
        spans = [Span(s.lane, s.name, s.start_us + d, s.dur_us) for s in self.spans]
        return Timeline(spans, self.source, self.label, self.device, dict(self.meta))


# --------------------------------------------------------------------------- GPU presets

@dataclass(frozen=True)
class GPUPreset:
    """What a roofline needs to know about a GPU.

    ``fp16_tflops`` is the dense tensor-core peak (what matmuls can reach), ``fp32_tflops``
    the CUDA-core peak (what element-wise fp32 kernels use), ``hbm_gbps`` the memory
    bandwidth; all from the vendor datasheets, without sparsity. ``kernel_floor_us`` and
    ``kernel_gap_us`` are *not* datasheet values: the shortest time any kernel takes (block
    scheduling, the tail of the launch on the device) and the device's gap between two
    consecutive kernels of one stream. They are rough, a tenth of a µs to a few µs; the
    H200 pair (0.9 + 0.1 µs) reproduces the lesson's reference measurement, 1.1 µs per
    kernel for a graphed chain of 100 tiny adds including the one graph launch.
    """

    name: str
    fp16_tflops: float
    fp32_tflops: float
    hbm_gbps: float
    kernel_floor_us: float
    kernel_gap_us: float = 0.1
    memory: str = ""

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name:
            raise TypeError(f"GPUPreset.name must be a non-empty str, got {self.name!r}")
        for f in ("fp16_tflops", "fp32_tflops", "hbm_gbps"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, (int, float)) \
                    or not (math.isfinite(v) and v > 0):
                raise ValueError(f"GPUPreset.{f} must be a finite number > 0 (a datasheet "
                                 f"peak), got {v!r}")
        _check_us("GPUPreset.kernel_floor_us", self.kernel_floor_us)
        _check_us("GPUPreset.kernel_gap_us", self.kernel_gap_us)

    def peak_flops(self, dtype: str = "fp32") -> float:
        if dtype in ("fp16", "bf16", "half", "float16", "bfloat16"):
            return self.fp16_tflops * 1e12
        if dtype in ("fp32", "float", "float32"):
            return self.fp32_tflops * 1e12
        raise ValueError(f"dtype must be one of 'fp16', 'bf16', 'half', 'float16', 'bfloat16', "
                         f"'fp32', 'float', 'float32', not {dtype!r}")


GPU_PRESETS: dict[str, GPUPreset] = {
    p.name: p for p in (
        GPUPreset("H200", fp16_tflops=989, fp32_tflops=67, hbm_gbps=4800,
                  kernel_floor_us=0.9, memory="141 GB HBM3e (SXM)"),
        GPUPreset("H100", fp16_tflops=989, fp32_tflops=67, hbm_gbps=3350,
                  kernel_floor_us=0.9, memory="80 GB HBM3 (SXM)"),
        GPUPreset("A100", fp16_tflops=312, fp32_tflops=19.5, hbm_gbps=2039,
                  kernel_floor_us=1.5, memory="80 GB HBM2e (SXM)"),
        GPUPreset("L4", fp16_tflops=121, fp32_tflops=30.3, hbm_gbps=300,
                  kernel_floor_us=2.0, memory="24 GB GDDR6"),
        GPUPreset("T4", fp16_tflops=65, fp32_tflops=8.1, hbm_gbps=320,
                  kernel_floor_us=2.5, memory="16 GB GDDR6"),
    )
}


def get_preset(preset: str | GPUPreset) -> GPUPreset:
    """A preset by name (case-insensitive), or the preset itself.

    An unknown name raises :class:`UnknownPresetError` (a ValueError, and a KeyError for
    callers written against older labkit) listing the names of :data:`GPU_PRESETS`.
    """
    if isinstance(preset, GPUPreset):
        return preset
    if not isinstance(preset, str):
        raise TypeError(f"preset must be a preset name or a GPUPreset, got "
                        f"{type(preset).__name__}; choose one of {', '.join(GPU_PRESETS)}")
    for name, p in GPU_PRESETS.items():
        if name.lower() == preset.lower():
            return p
    raise UnknownPresetError(f"no GPU preset {preset!r}; choose one of {', '.join(GPU_PRESETS)}")


def preset_for(device_name: str, default: str = "H200") -> GPUPreset:
    """The preset whose name appears in a device name ("NVIDIA A100-SXM4-80GB" → A100),
    else ``default``: a simulation next to a measurement should model the same GPU."""
    import re

    if not isinstance(device_name, str):
        raise TypeError(f"device_name must be a str such as 'NVIDIA H200', got {device_name!r}")
    get_preset(default)  # an unknown default fails here, naming the presets
    for name, p in GPU_PRESETS.items():
        if re.search(rf"(?<![A-Za-z0-9]){name}(?![0-9])", device_name, re.IGNORECASE):
            return p
    return get_preset(default)


def roofline_kernel_us(flops: float, bytes: float, preset: str | GPUPreset = "H200",
                       dtype: str = "fp32") -> float:
    """How long one kernel takes on ``preset``, by the roofline model, in µs.

    A kernel needs at least ``flops / peak`` to compute and ``bytes / bandwidth`` to move
    its data; whichever is longer bounds it, and no kernel is shorter than the preset's
    floor. Peaks are never reached in practice, so this is an optimistic estimate, which
    is the conservative choice here: it makes kernels look *shorter*, i.e. the launch
    cost look *worse*, only as much as the hardware allows.
    """
    p = get_preset(preset)
    flops, bytes = _check_amount("flops", flops), _check_amount("bytes", bytes)
    compute_us = flops / p.peak_flops(dtype) * 1e6
    memory_us = bytes / (p.hbm_gbps * 1e9) * 1e6
    return max(p.kernel_floor_us, compute_us, memory_us)


def add_chain_cost(numel: int, dtype: torch.dtype = torch.float32) -> tuple[float, float]:
    """(flops, bytes) of one ``y = y + 1`` kernel on ``numel`` elements: read y, write y'."""
    _check_count("numel", numel, 0)
    itemsize = torch.empty((), dtype=_check_dtype(dtype)).element_size()
    return float(numel), float(2 * numel * itemsize)


# --------------------------------------------------------------------------- simulation

def simulate(n_kernels: int, launch_us: float, kernel_us: float | Sequence[float], *,
             graphed: bool = False, graph_launch_us: float | None = None,
             gap_us: float | None = None, preset: str | GPUPreset | None = None,
             label: str | None = None) -> Timeline:
    """The two-lane picture of a chain of kernels, from three numbers.

    Eager: the CPU issues launches back to back, each costing ``launch_us``; kernel *i*
    can start once its launch has returned *and* kernel *i-1* has finished (one stream
    runs kernels in order), plus the device's small gap between two kernels::

        start[i] = max(launch_end[i], end[i-1] + gap_us)

    Graphed: one ``cudaGraphLaunch`` of ``graph_launch_us`` (default: one launch), then
    the device runs the recorded kernels back to back, ``gap_us`` apart. The CPU is free
    as soon as that launch returns. ``gap_us`` defaults to the preset's ``kernel_gap_us``,
    else 0.1 µs; with the same gap in both modes a GPU-bound chain takes exactly as long
    graphed as eager, which is the point: a graph removes launch cost, not kernel time.

    ``kernel_us`` is one duration for all kernels or one per kernel (a real layer mixes a
    long matmul with short element-wise kernels). ``preset`` only names the GPU whose
    kernel times these are, for the plot's label; pass kernel times from
    :func:`roofline_kernel_us` to make that name true. What the model leaves out: the
    launch queue's depth limit (~1000 entries: a far-ahead CPU eventually blocks), the
    small gaps between queued eager kernels, and launch latency on the device.
    """
    n_kernels = _check_count("n_kernels", n_kernels, 0)
    launch_us = _check_us("launch_us", launch_us)
    durations = _kernel_durations(kernel_us, n_kernels)
    p = get_preset(preset) if preset is not None else None
    gap_us = _check_us("gap_us", gap_us) if gap_us is not None else (
        p.kernel_gap_us if p is not None else 0.1)
    graph_launch_us = (_check_us("graph_launch_us", graph_launch_us)
                       if graph_launch_us is not None else launch_us)
    if label is not None and not isinstance(label, str):
        raise TypeError(f"label must be a str, got {type(label).__name__}")

    spans: list[Span] = []
    if graphed:
        spans.append(Span(CPU, "cudaGraphLaunch", 0.0, graph_launch_us))
        t = graph_launch_us
        for i, k in enumerate(durations):
            spans.append(Span(GPU, f"kernel {i}", t, k))
            t += k + gap_us
    else:
        prev_end = -math.inf
        for i, k in enumerate(durations):
            launch_end = (i + 1) * launch_us
            spans.append(Span(CPU, f"launch {i}", i * launch_us, launch_us))
            start = max(launch_end, prev_end + gap_us)
            spans.append(Span(GPU, f"kernel {i}", start, k))
            prev_end = start + k
    mode = "graphed" if graphed else "eager"
    return Timeline(
        spans, source="simulated", label=label or f"{mode}: {n_kernels} kernels",
        device=p.name if p is not None else None,
        meta={"mode": mode, "n_kernels": n_kernels, "launch_us": launch_us,
              "kernel_us": kernel_us if isinstance(kernel_us, (int, float)) else durations,
              "graph_launch_us": graph_launch_us if graphed else None,
              "gap_us": gap_us},
    )


def _check_amount(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {value!r} ({type(value).__name__})")
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"{name} must be a finite number >= 0, got {value}; "
                         "add_chain_cost(numel) gives both for the lesson's chain")
    return float(value)


def _kernel_durations(kernel_us, n_kernels: int) -> list[float]:
    """One duration per kernel from one number or a list of ``n_kernels`` numbers."""
    if isinstance(kernel_us, (int, float)) and not isinstance(kernel_us, bool):
        return [_check_us("kernel_us", kernel_us)] * n_kernels
    if isinstance(kernel_us, (str, bytes)) or not isinstance(kernel_us, Iterable):
        raise TypeError(f"kernel_us must be a number of µs or a list of them, got "
                        f"{kernel_us!r} ({type(kernel_us).__name__})")
    durations = [_check_us(f"kernel_us[{i}]", k) for i, k in enumerate(kernel_us)]
    if len(durations) != n_kernels:
        raise ValueError(f"kernel_us has {len(durations)} entries for {n_kernels} kernels; "
                         "pass one number for all kernels or exactly one per kernel")
    return durations


def simulate_pair(n_kernels: int, launch_us: float, kernel_us: float | Sequence[float],
                  **kw) -> tuple[Timeline, Timeline]:
    """(eager, graphed) timelines of the same chain: the before/after of one graph."""
    if "graphed" in kw:
        raise TypeError("simulate_pair makes both the eager and the graphed timeline; "
                        "drop graphed=..., or call simulate(..., graphed=True) for one")
    return (simulate(n_kernels, launch_us, kernel_us, graphed=False, **kw),
            simulate(n_kernels, launch_us, kernel_us, graphed=True, **kw))


def _union_length(intervals: Iterable[tuple[float, float]]) -> float:
    total, cur_s, cur_e = 0.0, None, None
    for s, e in sorted(intervals):
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        total += cur_e - cur_s
    return total


def gpu_busy_us(tl: Timeline, lane: str = GPU) -> float:
    """Time at least one kernel runs (overlapping kernels of several streams count once)."""
    _check_timeline("tl", tl)
    return _union_length((s.start_us, s.end_us) for s in tl.lane(lane))


def gpu_idle_us(tl: Timeline, lane: str = GPU) -> float:
    """GPU time wasted in the step: from the first launch to the last kernel's end,
    minus the time a kernel runs.

    The window starts at the first *launch*, not the first kernel: while the CPU pays for
    that launch the GPU has nothing to do either, and a graph pays it once instead of N
    times. Zero for a timeline without kernels.
    """
    _check_timeline("tl", tl)
    kernels = tl.lane(lane)
    if not kernels:
        return 0.0
    window = max(s.end_us for s in kernels) - tl.start_us
    return max(0.0, window - gpu_busy_us(tl, lane))


def gpu_idle_fraction(tl: Timeline, lane: str = GPU) -> float:
    """:func:`gpu_idle_us` as a fraction of the step's window (0 = always busy)."""
    _check_timeline("tl", tl)
    kernels = tl.lane(lane)
    if not kernels:
        return 0.0
    window = max(s.end_us for s in kernels) - tl.start_us
    return gpu_idle_us(tl, lane) / window if window > 0 else 0.0


def summarize(tl: Timeline) -> dict:
    """The numbers a timeline's picture shows, rounded for printing."""
    _check_timeline("tl", tl)
    launches = [s for s in tl.spans if s.lane == CPU]
    return {
        "tag": tl.tag,
        "label": tl.label,
        "launches": len(launches),
        "kernels": len(tl.lane(GPU)),
        "step_us": round(tl.makespan_us, 3),
        "gpu_busy_us": round(gpu_busy_us(tl), 3),
        "gpu_idle_us": round(gpu_idle_us(tl), 3),
        "gpu_idle_fraction": round(gpu_idle_fraction(tl), 4),
    }


# --------------------------------------------------------------------------- measurement

def chain(x: torch.Tensor, n_ops: int = 100) -> torch.Tensor:
    """``n_ops`` dependent tiny adds: the smallest program whose speed is all launch cost.

    Each ``x + 1`` is one kernel launch on a GPU; the result of one feeds the next, as the
    ops of a layer do.
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"chain(x, n_ops) needs a tensor x, got {type(x).__name__}; "
                        "e.g. torch.zeros(256, device=B.device)")
    _check_count("n_ops", n_ops, 0)
    for _ in range(n_ops):
        x = x + 1
    return x


@dataclass
class ChainSteps:
    """One chain, runnable two ways: ``eager()`` launches its ops one by one, ``graphed()``
    replays the captured graph. ``out`` is the graph's static output (``x + n_ops``)."""

    eager: Callable[[], torch.Tensor]
    graphed: Callable[[], None]
    graph: Any
    x: torch.Tensor
    out: torch.Tensor
    n_ops: int


def chain_steps(B, n_ops: int = 100, numel: int = 256, dtype: torch.dtype = torch.float32,
                warmup: int = 3) -> ChainSteps:
    """Build a :func:`chain` on ``B.device`` and capture it, with the lesson-02 template.

    Warm up on a side stream, so lazy initialisation (allocator, library handles) happens
    outside the capture and off the default stream; then capture into a fresh graph
    (``B.graph`` captures on a side stream of its own). Capture records the ops, it does
    not run them: ``out`` holds the result only after the first replay.
    """
    _check_chain_args(B, "chain_steps", n_ops=n_ops, numel=numel, dtype=dtype, warmup=warmup)
    x = torch.zeros(numel, device=B.device, dtype=dtype)
    side_stream_warmup(chain, x, n_ops, B=B, iters=warmup)
    g = B.CUDAGraph()
    with cleanup_on_failure(B), B.graph(g):
        out = chain(x, n_ops)
    B.synchronize()
    return ChainSteps(eager=lambda: chain(x, n_ops), graphed=g.replay, graph=g, x=x, out=out,
                      n_ops=n_ops)


def _check_chain_args(B, what: str, *, n_ops, numel, dtype, warmup, repeats=1) -> None:
    """The arguments every measurement of a chain shares, checked before any capture."""
    _check_backend(B, what)
    _check_count("n_ops", n_ops, 1)
    _check_count("numel", numel, 1)
    _check_count("warmup", warmup, 0)
    _check_count("repeats", repeats, 1)
    _check_dtype(dtype)


class _Timer:
    """Times a callable the way the backend allows.

    On CUDA: CUDA events around the call, measured on the GPU's clock, synchronized each
    repeat so every repeat starts with an empty queue (otherwise eager launches would hide
    behind the previous repeat's kernels). The CPU-side time of the same call (no sync) is
    taken with ``perf_counter``: that is the launch cost itself. On the emulator there is
    no device: both numbers are CPU wall time, and ``B.synchronize()`` is a no-op.
    """

    def __init__(self, B):
        self.B = B
        self.cuda = B.name == "cuda"

    def __call__(self, fn: Callable[[], Any], repeats: int) -> tuple[float, float]:
        """(median device µs, median CPU µs) of ``fn()`` over ``repeats`` runs."""
        dev, cpu = [], []
        for _ in range(repeats):
            self.B.synchronize()
            if self.cuda:
                start, end = self.B.Event(enable_timing=True), self.B.Event(enable_timing=True)
                start.record()
                t0 = time.perf_counter()
                fn()
                t1 = time.perf_counter()
                end.record()
                end.synchronize()
                dev.append(start.elapsed_time(end) * 1e3)  # ms → µs
            else:
                t0 = time.perf_counter()
                fn()
                t1 = time.perf_counter()
                self.B.synchronize()
                dev.append((time.perf_counter() - t0) * 1e6)
            cpu.append((t1 - t0) * 1e6)
        return statistics.median(dev), statistics.median(cpu)


def measure_launch_cost(B, n_ops: int = 100, numel: int = 256, repeats: int = 20,
                        warmup: int = 3, dtype: torch.dtype = torch.float32) -> dict:
    """Per-kernel cost of a chain of ``n_ops`` tiny adds, eager vs one graph replay.

    Returns a dict with
    ``eager_us_per_kernel`` / ``graph_us_per_kernel`` (step time ÷ n_ops), their ratio
    ``speedup``, the step times ``eager_step_us`` / ``graph_step_us``, and the CPU-side
    costs ``cpu_us_per_launch`` (issuing one eager op: the Python → ATen → driver path,
    the ``launch_us`` a :func:`simulate` of this machine wants) and ``cpu_us_per_replay``
    (issuing one ``g.replay()``). ``timer`` says how the step times were taken.

    On a GPU (``B.name == "cuda"``) step times are CUDA-event times on the device. On the
    emulator they are CPU wall times: the eager number is the real dispatch cost of a
    torch op on this CPU, but the graph number is the emulator's replay, which runs on the
    CPU too. It shows the mechanism (one call replays N ops), not what a GPU gains; the
    ``note`` key says so.
    """
    _check_chain_args(B, "measure_launch_cost", n_ops=n_ops, numel=numel, dtype=dtype,
                      warmup=warmup, repeats=repeats)
    steps = chain_steps(B, n_ops=n_ops, numel=numel, dtype=dtype, warmup=warmup)
    for _ in range(warmup):
        steps.eager()
        steps.graphed()
    timer = _Timer(B)
    eager_step, eager_cpu = timer(steps.eager, repeats)
    graph_step, graph_cpu = timer(steps.graphed, repeats)
    B.synchronize()
    # Replay must have computed what the eager chain computes: x + n_ops in fp32, but in
    # fp16/bf16 the sum stops growing once 1 is below its precision (2048 in fp16), so the
    # reference is the eager result in the same dtype, not the number n_ops.
    got = float(steps.out.reshape(-1)[0])
    expected = float(steps.eager().reshape(-1)[0])
    if abs(got - expected) > 1e-3 * max(1.0, abs(expected)):
        raise RuntimeError(f"graph replay produced {got}, eager gives {expected}: the capture "
                           "is broken")
    result = {
        "backend": B.name,
        "timer": "cuda events" if B.name == "cuda" else "perf_counter",
        "device": _device_name(B),
        "n_ops": n_ops, "numel": numel, "repeats": repeats, "dtype": str(dtype),
        "eager_step_us": eager_step,
        "graph_step_us": graph_step,
        "eager_us_per_kernel": eager_step / n_ops,
        "graph_us_per_kernel": graph_step / n_ops,
        "speedup": eager_step / graph_step if graph_step > 0 else math.inf,
        "cpu_us_per_launch": eager_cpu / n_ops,
        "cpu_us_per_replay": graph_cpu,
    }
    if B.name != "cuda":
        result["note"] = ("emulated: eager = real per-op dispatch cost on this CPU; graph = the "
                          "emulator's CPU replay, not a GPU's. Real GPU timing needs a GPU.")
    return result


def _device_name(B) -> str:
    if B.name == "cuda":
        return torch.cuda.get_device_name(B.device)
    return "CPU (emulated CUDA graphs)"


def sweep_measured(B, numels: Sequence[int], n_ops: int = 50, repeats: int = 10,
                   dtype: torch.dtype = torch.float32) -> list[dict]:
    """:func:`measure_launch_cost` at each tensor size: measured time per step vs work.

    Meaningful on a GPU. On the emulator both curves are CPU compute once tensors grow,
    so use :func:`sweep_simulated` there for the GPU picture.
    """
    numels = _check_numels(numels)
    _check_chain_args(B, "sweep_measured", n_ops=n_ops, numel=1, dtype=dtype, warmup=0,
                      repeats=repeats)
    rows = []
    for numel in numels:
        m = measure_launch_cost(B, n_ops=n_ops, numel=int(numel), repeats=repeats, dtype=dtype)
        rows.append({"numel": int(numel), "eager_us": m["eager_step_us"],
                     "graph_us": m["graph_step_us"], "n_kernels": n_ops,
                     "source": "measured", "device": m["device"],
                     "launch_us": m["cpu_us_per_launch"]})
    return rows


def sweep_simulated(numels: Sequence[int], launch_us: float, preset: str | GPUPreset = "H200",
                    n_kernels: int = 100, dtype: torch.dtype = torch.float32,
                    graph_launch_us: float | None = None) -> list[dict]:
    """The same sweep from :func:`simulate`, with roofline kernel times of ``preset``."""
    numels = _check_numels(numels)
    launch_us = _check_us("launch_us", launch_us)
    _check_count("n_kernels", n_kernels, 1)
    p = get_preset(preset)
    tdtype = "fp16" if dtype in (torch.float16, torch.bfloat16) else "fp32"
    rows = []
    for numel in numels:
        k = roofline_kernel_us(*add_chain_cost(int(numel), dtype), p, tdtype)
        eager, graphed = simulate_pair(n_kernels, launch_us, k, preset=p,
                                       graph_launch_us=graph_launch_us)
        rows.append({"numel": int(numel), "kernel_us": k, "eager_us": eager.makespan_us,
                     "graph_us": graphed.makespan_us, "n_kernels": n_kernels,
                     "source": "simulated", "device": p.name, "launch_us": launch_us})
    return rows


def crossover(rows: Sequence[dict], tolerance: float = 0.10) -> int | None:
    """Smallest ``numel`` from which eager is within ``tolerance`` of graphed, for good.

    Past this size the kernels are long enough to hide the launches, and a graph saves
    less than ``tolerance`` of a step. None if the sweep never gets there.
    """
    rows = sorted(_check_rows(rows, "crossover"), key=lambda r: r["numel"])
    tolerance = _check_tolerance(tolerance)
    found = None
    for r in rows:
        close = r["eager_us"] <= (1 + tolerance) * r["graph_us"]
        if close and found is None:
            found = r["numel"]
        elif not close:
            found = None
    return found


# --------------------------------------------------------------------------- profiling (GPU)

# Kineto's chrome-trace categories and names: CPU-side launch calls and GPU-side work.
_LAUNCH_CATS = ("cuda_runtime", "cuda_driver")
_LAUNCH_PREFIXES = ("cudaLaunch", "cuLaunch", "cudaGraphLaunch", "cuGraphLaunch",
                    "cudaMemcpyAsync", "cudaMemsetAsync", "cuMemcpy", "cuMemset")
_GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def _trace_events(trace: dict) -> list[dict]:
    """The complete (``ph: "X"``) events of a trace, each with numeric ``ts`` and ``dur``."""
    events = trace.get("traceEvents", [])
    if not isinstance(events, list):
        raise ValueError(f'"traceEvents" must be a list of events, got {type(events).__name__}; '
                         "pass the dict that prof.export_chrome_trace wrote")
    out = []
    for i, e in enumerate(events):
        if not (isinstance(e, dict) and e.get("ph") == "X" and "dur" in e):
            continue
        try:
            float(e["ts"]), float(e["dur"])
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"trace event {i} ({e.get('name', '?')!r}) has no numeric ts/dur: "
                             f"{e!r}; the file is not a complete Chrome trace") from None
        out.append(e)
    return out


def _load_trace(trace) -> dict:
    """The trace dict, read from a path if need be, with a clear error for a bad file."""
    if isinstance(trace, dict):
        return trace
    if not isinstance(trace, (str, os.PathLike)):
        raise TypeError(f"trace must be a Chrome-trace dict or a path to its JSON file, got "
                        f"{type(trace).__name__}")
    path = Path(trace)
    if not path.is_file():
        raise ValueError(f"no trace file at {str(path)!r}; pass the path that "
                         "profile_timeline(trace_path=...) or prof.export_chrome_trace wrote")
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{str(path)!r} is not Chrome-trace JSON ({e}); record it again "
                         "with prof.export_chrome_trace") from None
    if not isinstance(data, dict):
        raise ValueError(f"{str(path)!r} holds a JSON {type(data).__name__}, expected an "
                         'object with "traceEvents"')
    return data


def timeline_from_chrome_trace(trace: dict | str | os.PathLike, label: str = "",
                               device: str | None = None, ops_lane: bool = True) -> Timeline:
    """A measured :class:`Timeline` from a ``torch.profiler`` Chrome trace.

    ``trace`` is the JSON (dict) or a path to it, as written by
    ``prof.export_chrome_trace``. Kineto writes CPU and GPU events on one clock in µs,
    so the lanes line up as they happened:

    * ``CPU``: launch calls (``cat`` cuda_runtime/cuda_driver, names like
      ``cudaLaunchKernel``, ``cudaGraphLaunch``); synchronisation calls are left out;
    * ``GPU``: kernels, memcpys and memsets (``cat`` kernel/gpu_memcpy/gpu_memset);
    * ``CPU ops`` (if ``ops_lane``): the outermost ATen ops (``cat`` cpu_op), which show
      the rest of each op's CPU cost around its launch call.

    Times are shifted so the first span starts at 0.
    """
    trace = _load_trace(trace)
    events = _trace_events(trace)
    spans: list[Span] = []
    ops: list[dict] = []
    for e in events:
        cat, name = e.get("cat", ""), e.get("name", "")
        ts, dur = float(e["ts"]), float(e["dur"])
        if cat in _LAUNCH_CATS and name.startswith(_LAUNCH_PREFIXES):
            spans.append(Span(CPU, name, ts, dur))
        elif cat in _GPU_CATS:
            spans.append(Span(GPU, name, ts, dur))
        elif ops_lane and cat == "cpu_op" and not name.startswith("ProfilerStep"):
            ops.append(e)
    # Outermost ops only, per thread: aten::add contains aten::empty etc.
    ops.sort(key=lambda e: (e.get("tid"), float(e["ts"]), -float(e["dur"])))
    last_end: dict[Any, float] = {}
    for e in ops:
        ts, dur, tid = float(e["ts"]), float(e["dur"]), e.get("tid")
        if ts >= last_end.get(tid, -math.inf):
            spans.append(Span(OPS, e["name"], ts, dur))
            last_end[tid] = ts + dur
    if not any(s.lane == GPU for s in spans):
        raise ValueError("the trace has no GPU kernels: was it recorded with "
                         "ProfilerActivity.CUDA on a GPU?")
    tl = Timeline(spans, source="measured", label=label, device=device)
    return tl.shifted(0.0)


def profile_timeline(fn: Callable[[], Any], B, label: str = "", warmup: int = 2,
                     ops_lane: bool = True,
                     trace_path: str | os.PathLike | None = None) -> Timeline:
    """Record ``fn()`` with ``torch.profiler`` on a GPU and return its measured timeline.

    ``fn`` is one step: an eager chain, or ``g.replay``. It runs ``warmup`` times
    unprofiled, then once as the profiler's own warmup step (the first profiled step
    carries CUPTI start-up costs), then once recorded. ``trace_path`` keeps the raw
    Chrome trace (Perfetto opens it too). The profiler adds a few µs of its own to each
    op on the CPU, so a profiled eager chain looks somewhat *more* launch-bound than it
    runs; take numbers from :func:`measure_launch_cost`, pictures from here.

    Needs the ``"cuda"`` backend; on a CPU there is no device trace to record, so build the
    picture with :func:`simulate` instead.
    """
    if getattr(B, "name", None) != "cuda":
        raise RuntimeError(
            "profile_timeline needs a CUDA GPU (backend 'cuda'); this backend is "
            f"{getattr(B, 'name', B)!r}, which has no device trace to record. On a CPU use "
            "timeline.simulate(n_kernels, launch_us, kernel_us), with launch_us from "
            "measure_launch_cost(B)['cpu_us_per_launch'] and kernel_us from roofline_kernel_us().")
    if not callable(fn):
        raise TypeError(f"fn must be a callable that runs one step (e.g. steps.eager or "
                        f"g.replay), got {type(fn).__name__}; pass the function, not its result")
    _check_count("warmup", warmup, 0)
    if trace_path is not None:
        _check_folder_of(trace_path, "trace_path")
    from torch.profiler import ProfilerActivity, profile, schedule

    for _ in range(warmup):
        fn()
    B.synchronize()
    tmpdir = None
    if trace_path is None:
        tmpdir = tempfile.TemporaryDirectory()
        trace_path = Path(tmpdir.name) / "trace.json"
    trace_path = Path(trace_path)
    try:
        with warnings.catch_warnings():
            # torch.profiler warns once that a schedule's cycle clears its events (our one
            # cycle is the whole recording: nothing is lost); keep that out of a lesson
            warnings.filterwarnings("ignore", message=".*Profiler clears events.*")
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
                         schedule=schedule(wait=0, warmup=1, active=1, repeat=1),
                         on_trace_ready=lambda p: p.export_chrome_trace(str(trace_path))
                         ) as prof:
                for _ in range(2):
                    fn()
                    B.synchronize()
                    prof.step()
        if not trace_path.exists():
            raise RuntimeError(f"torch.profiler wrote no trace to {trace_path}")
        return timeline_from_chrome_trace(trace_path, label=label, device=_device_name(B),
                                          ops_lane=ops_lane)
    finally:
        if tmpdir is not None:
            tmpdir.cleanup()


# --------------------------------------------------------------------------- trace export

def chrome_trace_events(spans: Iterable[Span]) -> list[dict]:
    """Spans as Chrome-trace "complete" events (``ph: "X"``), one (pid, tid) per lane.

    The format (the Trace Event Format that chrome://tracing and Perfetto read) wants
    ``ts`` and ``dur`` in **microseconds**, which is what :class:`Span` holds. Each lane
    gets its own pid, so Perfetto draws it as its own track, CPU lanes above the GPU.
    """
    if isinstance(spans, Timeline):
        raise TypeError("chrome_trace_events takes spans: pass tl.spans (or use "
                        "to_chrome_trace(tl) for the whole trace)")
    if isinstance(spans, (str, bytes)) or not isinstance(spans, Iterable):
        raise TypeError(f"spans must be a list of Span, got {type(spans).__name__}")
    spans = list(spans)
    bad = [x for x in spans if not isinstance(x, Span)]
    if bad:
        raise TypeError(f"spans must hold Span objects only, got {type(bad[0]).__name__}")
    present = {s.lane for s in spans}
    lanes = [lane for lane in _LANE_ORDER if lane in present] + sorted(present - set(_LANE_ORDER))
    pid = {lane: i + 1 for i, lane in enumerate(lanes)}
    return [{"name": s.name, "cat": s.lane, "ph": "X", "pid": pid[s.lane], "tid": pid[s.lane],
             "ts": s.start_us, "dur": s.dur_us} for s in spans]


def to_chrome_trace(tl: Timeline, path: str | os.PathLike | None = None) -> dict:
    """``{"traceEvents": [...]}`` for ``tl``; written to ``path`` as JSON when given.

    Metadata events name each lane's process and thread (``ph: "M"``), so the tracks read
    "GPU — simulated (H200)" in Perfetto (https://ui.perfetto.dev → Open trace file).

    .. warning::
        ``path``'s folder must exist: it is checked *before* anything is written, so a
        mistyped folder raises ValueError naming it instead of failing halfway.
    """
    _check_timeline("tl", tl)
    if path is not None:
        path = _check_folder_of(path, "path")
    events = chrome_trace_events(tl.spans)
    meta = []
    for ev in {(e["cat"], e["pid"], e["tid"]) for e in events}:
        lane, pid, tid = ev
        meta.append({"name": "process_name", "ph": "M", "pid": pid, "tid": tid,
                     "args": {"name": f"{lane} — {tl.tag}"}})
        meta.append({"name": "process_sort_index", "ph": "M", "pid": pid, "tid": tid,
                     "args": {"sort_index": pid}})
        meta.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid,
                     "args": {"name": lane}})
    meta.sort(key=lambda e: (e["pid"], e["name"]))
    trace = {"traceEvents": meta + events, "displayTimeUnit": "ns",
             "otherData": {"label": tl.label, "source": tl.source, "device": tl.device or "",
                           "tool": "labkit.timeline"}}
    if path is not None:
        Path(path).write_text(json.dumps(trace))
    return trace


# --------------------------------------------------------------------------- plots

_COLORS = {CPU: "#4C72B0", GPU: "#55A868", OPS: "#8172B2"}
_IDLE = "#C44E52"


def plot_timeline(tl: Timeline, ax=None, shade_idle: bool = True, xlim: float | None = None,
                  title: str | None = None):
    """Draw ``tl`` as a Gantt chart: one row per lane, idle GPU time shaded red.

    The title always carries the timeline's tag ("simulated (H200)", "measured (...)").
    ``xlim`` fixes the x axis (µs) so several timelines can be compared by length.
    Returns the matplotlib Axes.
    """
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    _check_timeline("tl", tl)
    if xlim is not None:
        _check_us("xlim", xlim, positive=True)
    if ax is None:
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
    ax.set_title(f"{head}  [{tl.tag}]   step {s['step_us']:.1f} µs, "
                 f"GPU idle {100 * s['gpu_idle_fraction']:.0f}%", fontsize=10, loc="left")
    ax.legend(handles=[Patch(color=_COLORS.get(lane, "#937860"),
                             label="launch calls" if lane == CPU else
                             "kernels" if lane == GPU else "ATen ops") for lane in lanes]
              + ([Patch(facecolor=_IDLE, alpha=0.25, hatch="//", label="GPU idle")]
                 if shade_idle and kernels else []),
              loc="center left", bbox_to_anchor=(1.005, 0.5), fontsize=8, frameon=False)
    return ax


def plot_timelines(timelines: Sequence[Timeline], share_x: bool = True, titles=None):
    """Several timelines stacked, on one x scale by default so lengths compare directly.

    Returns the matplotlib Figure.
    """
    import matplotlib.pyplot as plt

    timelines = _check_timeline_list(timelines, titles)
    heights = [0.6 + 0.55 * max(2, len(t.lanes)) for t in timelines]
    fig, axes = plt.subplots(len(timelines), 1, figsize=(10, sum(heights) + 0.4),
                             gridspec_kw={"height_ratios": heights}, squeeze=False)
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


# --------------------------------------------------------------------------- live panel


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
    n = _check_count("n_kernels", n_kernels, _PANEL_KERNELS[0])
    if n > _PANEL_KERNELS[1]:
        raise ValueError(f"n_kernels must be within the slider's range 1..100, got {n}; "
                         "for longer chains use simulate_pair(...) and plot_timelines")
    return float(launch_us), float(kernel_us), n


class TimelinePanel:
    """Sliders for launch cost, kernel time and number of kernels over a live picture.

    In Jupyter with ipywidgets it shows the sliders and redraws the simulated eager and
    graphed timelines on each change. Everywhere else (nbconvert HTML, GitHub, a terminal,
    ipywidgets missing, ``LABKIT_WIDGETS=0``) it falls back to a plain PNG of the initial
    settings: the display bundle carries both, and a frontend that cannot render widgets
    picks the image. ``figure()`` draws the current settings as a matplotlib Figure.

    .. warning::
        Start values must lie within the sliders' ranges (launch 0.1–100 µs, kernel
        0.1–1000 µs, 1–100 kernels); outside them ValueError is raised, because a slider
        would clamp the value silently and the picture would not show what was asked.
    """

    def __init__(self, launch_us: float = 10.0, kernel_us: float = 2.0, n_kernels: int = 12,
                 preset: str | GPUPreset | None = None, widgets: bool | None = None):
        self.launch_us, self.kernel_us, self.n_kernels = _check_panel_settings(
            launch_us, kernel_us, n_kernels)
        self.preset = get_preset(preset) if preset is not None else None
        self.widget = self._build() if widgets_wanted(widgets) else None

    def timelines(self) -> tuple[Timeline, Timeline]:
        return simulate_pair(self.n_kernels, self.launch_us, self.kernel_us, preset=self.preset)

    def figure(self):
        eager, graphed = self.timelines()
        return plot_timelines([eager, graphed])

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
        self._image = image_widget(figure_png(self.figure()))
        self._label = w.HTML(self.text())
        for s in (self._launch, self._kernel, self._n):
            s.observe(self._redraw, names="value")
        return column([w.HBox([w.VBox([self._launch, self._kernel, self._n]), self._label]),
                       self._image])

    def _redraw(self, _change=None):
        self.launch_us, self.kernel_us = self._launch.value, self._kernel.value
        self.n_kernels = self._n.value
        set_image(self._image, figure_png(self.figure()))
        self._label.value = self.text()

    def _repr_mimebundle_(self, include=None, exclude=None):
        png = base64.b64encode(figure_png(self.figure())).decode("ascii")
        bundle = {"text/plain": f"TimelinePanel: {self.text()}", "image/png": png}
        return mimebundle(bundle, self.widget)


def timeline_panel(launch_us: float = 10.0, kernel_us: float = 2.0, n_kernels: int = 12,
                   preset: str | GPUPreset | None = None,
                   widgets: bool | None = None) -> TimelinePanel:
    """A :class:`TimelinePanel`: display it (last expression of a cell) to use it."""
    return TimelinePanel(launch_us, kernel_us, n_kernels, preset, widgets)
