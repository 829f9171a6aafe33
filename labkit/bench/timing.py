"""How ``labkit.bench`` times things: CUDA events, warm-up first, the median of many runs.

Why each choice:

* **CUDA events, not ``time.perf_counter``.** A GPU runs asynchronously: the host returns
  from a launch long before the kernel ends. Events are written into the stream and
  timestamped by the GPU, so ``start.elapsed_time(end)`` is the time the *GPU* saw. For a
  launch-bound step that time includes the gaps where the GPU waited for the host, which
  is exactly what graphs remove.
* **synchronize before every run.** Otherwise eager launches would queue up behind the
  previous run's kernels and hide their own cost.
* **warm-up first.** The first calls allocate memory, initialise cuBLAS, autotune, compile
  (``torch.compile``) or capture; none of that is the steady state we compare.
* **the median**, not the mean or the minimum: robust to the odd slow run (a context
  switch, a clock change) without rewarding a lucky one.
* **``inner`` calls per sample** for very short functions, so the events' own cost
  (a few µs) does not dominate; the sample is divided by ``inner``.

``gpu_busy_us`` answers a different question: how long the GPU actually computed during
one call, the sum of the durations of every kernel (and memcpy/memset) that
``torch.profiler`` saw. ``median_us - gpu_busy_us`` is then the time the GPU sat idle,
mostly waiting for launches.

On the emulated backend the same functions work with the host clock (``B.Event`` records
``perf_counter``) and ``gpu_busy_us`` returns ``None``: there is no GPU to profile. That
is only for tests of the benchmark code itself; no emulated number is a GPU result.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
from typing import Any, Callable

import torch

__all__ = ["measure_us", "gpu_busy_us", "device_name", "GPU_EVENT_CATEGORIES"]

GPU_EVENT_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


def measure_us(fn: Callable[[], Any], B, warmup: int = 5, repeats: int = 30,
               inner: int = 1) -> float:
    """Median time of one ``fn()`` call in µs, by ``B.Event`` timing.

    Each of ``repeats`` samples: synchronize, record a start event, call ``fn`` ``inner``
    times, record an end event, wait for it; the sample is the elapsed time / ``inner``.
    """
    if repeats < 1 or inner < 1:
        raise ValueError("repeats and inner must be >= 1")
    for _ in range(warmup):
        fn()
    B.synchronize()
    samples = []
    for _ in range(repeats):
        B.synchronize()
        start, end = B.Event(enable_timing=True), B.Event(enable_timing=True)
        start.record()
        for _ in range(inner):
            fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / inner)   # ms -> µs
    return statistics.median(samples)


def gpu_busy_us(fn: Callable[[], Any], B, warmup: int = 2) -> float | None:
    """Sum of the GPU time of every kernel, memcpy and memset of one ``fn()`` call, in µs,
    from a ``torch.profiler`` trace. ``None`` on a backend without a GPU.

    Kernels launched by a graph replay are reported one by one by the profiler (CUPTI),
    so this works for graph rows too. Kernels run one after another on one stream here,
    so the sum is also the time the GPU was busy.
    """
    if getattr(B, "name", None) != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    for _ in range(warmup):
        fn()
    B.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            fn()
            B.synchronize()
        prof.export_chrome_trace(path)
        with open(path) as f:
            trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    total = sum(float(e.get("dur", 0.0)) for e in events
                if e.get("ph") == "X" and e.get("cat") in GPU_EVENT_CATEGORIES)
    return total


def device_name(B) -> str:
    """The GPU's name, or a label saying the numbers come from the CPU emulator."""
    if getattr(B, "name", None) == "cuda":
        return torch.cuda.get_device_name(B.device)
    return "CPU (emulated CUDA graphs)"
