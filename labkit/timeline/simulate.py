"""Simulated timelines: a chain of kernels from a launch cost and kernel times."""

from __future__ import annotations

import math
from typing import Iterable, Sequence

import torch

from labkit.core.validate import check_int
from labkit.timeline.model import CPU, GPU, Span, Timeline, _check_us
from labkit.timeline.presets import GPUPreset, add_chain_cost, get_preset, roofline_kernel_us

__all__ = ["simulate", "simulate_pair", "simulate_serving", "sweep_simulated", "crossover"]

def simulate(n_kernels: int, launch_us: float, kernel_us: float | Sequence[float], *,
             graphed: bool = False, graph_launch_us: float | None = None,
             gap_us: float | None = None, preset: str | GPUPreset | None = None,
             label: str | None = None) -> Timeline:
    """The two-lane picture of a chain of kernels, from three numbers.

    Eager: the CPU issues launches back to back; kernel *i* starts once its launch has
    returned and kernel *i-1* has finished (one stream runs kernels in order)::

        start[i] = max(launch_end[i], end[i-1] + gap_us)

    Graphed: one ``cudaGraphLaunch``, then the recorded kernels back to back, ``gap_us``
    apart; the CPU is free as soon as that launch returns.

    Args:
        n_kernels: kernels in the chain.
        launch_us: CPU cost of one eager launch
            (``measure_launch_cost(B)["cpu_us_per_launch"]`` on this machine).
        kernel_us: one duration for every kernel, or a list of one per kernel.
        graphed: draw the graph replay instead of the eager chain.
        graph_launch_us: cost of the one graph launch (default: ``launch_us``).
        gap_us: device gap between kernels (default: the preset's ``kernel_gap_us``,
            else 0.1). The same gap in both modes makes a GPU-bound chain take as long
            graphed as eager: a graph removes launch cost, not kernel time.
        preset: the GPU whose kernel times these are, for the label only; kernel times
            from :func:`roofline_kernel_us` make the name true.
        label: the plot's title (default: mode and kernel count).

    .. warning::
        The model leaves out the launch queue's depth limit (a CPU far ahead eventually
        blocks), the gaps between queued eager kernels and launch latency on the device.
        Its timelines say ``simulated`` in every plot and trace so they are never read as
        measurements.
    """
    n_kernels = check_int("n_kernels", n_kernels, 0)
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


def simulate_serving(n_steps: int, host_us: float, gpu_us: float, *, overlap: bool,
                     label: str | None = None) -> Timeline:
    """The host and the GPU over ``n_steps`` decode steps of a serving loop.

    Each step the host prepares the step (``host_us``: build the batch, stage it, launch
    the replay) and the GPU runs it (``gpu_us``). Synced: the host then waits for the
    step's tokens, so the two take turns and a step costs ``host_us + gpu_us``.
    Overlapped: the host queues step *i*, only then waits for step *i-1*'s tokens, and
    prepares step *i+1* while the GPU runs step *i*; a step costs ``max(host_us,
    gpu_us)``::

        gpu_start[i]  = max(host_end[i], gpu_end[i-1])
        host_start[i] = max(host_end[i-1], gpu_end[i-2])   # overlapped
        host_start[i] = gpu_end[i-1]                        # synced
    """
    n_steps = check_int("n_steps", n_steps, 1)
    host_us = _check_us("host_us", host_us, positive=True)
    gpu_us = _check_us("gpu_us", gpu_us, positive=True)
    if not isinstance(overlap, bool):
        raise TypeError(f"overlap must be True or False, got {overlap!r}")
    if label is not None and not isinstance(label, str):
        raise TypeError(f"label must be a str, got {type(label).__name__}")
    spans: list[Span] = []
    host_end, gpu_end = [], []
    for i in range(n_steps):
        if overlap:
            start = max(host_end[-1] if host_end else 0.0, gpu_end[-2] if i >= 2 else 0.0)
        else:
            start = gpu_end[-1] if gpu_end else 0.0
        host_end.append(start + host_us)
        spans.append(Span(CPU, f"prepare step {i}", start, host_us))
        g = max(host_end[-1], gpu_end[-1] if gpu_end else 0.0)
        gpu_end.append(g + gpu_us)
        spans.append(Span(GPU, f"step {i}", g, gpu_us))
    mode = "overlapped" if overlap else "synced"
    return Timeline(spans, source="simulated",
                    label=label or f"{mode}: {n_steps} decode steps",
                    meta={"mode": mode, "steps": n_steps, "host_us": host_us,
                          "gpu_us": gpu_us, "cpu_label": "host work per step"})


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


def _check_numels(numels) -> list[int]:
    if isinstance(numels, (str, bytes)) or not isinstance(numels, Iterable):
        raise TypeError(f"numels must be a list of ints (elements per kernel), got {numels!r}")
    out = list(numels)
    if not out:
        raise ValueError("numels is empty: pass at least one size, e.g. [256, 4096, 65536]")
    return [check_int("each entry of numels", n, 1) for n in out]


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


def sweep_simulated(numels: Sequence[int], launch_us: float, preset: str | GPUPreset = "H200",
                    n_kernels: int = 100, dtype: torch.dtype = torch.float32,
                    graph_launch_us: float | None = None) -> list[dict]:
    """The same sweep from :func:`simulate`, with roofline kernel times of ``preset``."""
    numels = _check_numels(numels)
    launch_us = _check_us("launch_us", launch_us)
    check_int("n_kernels", n_kernels, 1)
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
