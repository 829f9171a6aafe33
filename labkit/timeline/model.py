"""Timelines: busy spans on a CPU lane and a GPU lane, and what they say about a step.

Times are in microseconds (µs) everywhere, as in Chrome traces.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable

import torch

from labkit.core.timing import busy_us

__all__ = ["CPU", "GPU", "OPS", "Span", "Timeline", "gpu_busy_us", "gpu_idle_us",
           "gpu_idle_fraction", "summarize"]

# Lane names. A simulated timeline has CPU and GPU; a measured one may add OPS, the
# top-level ATen ops that contain each launch call (the Python -> ATen part of the path).
CPU = "CPU"
GPU = "GPU"
OPS = "CPU ops"
_LANE_ORDER = (OPS, CPU, GPU)


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


def gpu_busy_us(tl: Timeline, lane: str = GPU) -> float:
    """Time at least one span of ``lane`` runs (overlapping kernels count once).

    :func:`labkit.core.timing.busy_us` of the lane's spans; the profiler-based
    counterpart for a callable is :func:`labkit.core.timing.profile_gpu_busy_us`.
    """
    _check_timeline("tl", tl)
    return busy_us((s.start_us, s.end_us) for s in tl.lane(lane))


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
