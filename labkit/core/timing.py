"""Timing for labkit: the one timer, the one profiler-trace reader, GPU-busy time.

Every function takes the backend ``B`` (``labkit.backend.get(...)``) as an argument; on the
CPU emulator ``B.Event`` notes the host clock and ``B.synchronize()`` does nothing, so the
same code runs there and times the CPU. Times are in microseconds (µs), as in Chrome traces.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Iterable, NamedTuple

import torch

from labkit.core.validate import check_int

__all__ = [
    "Timing", "time_call", "measure_us", "back_to_back_us",
    "read_chrome_trace", "complete_events", "record_chrome_trace", "GPU_EVENT_CATEGORIES",
    "busy_us", "events_busy_us", "profile_gpu_events", "profile_gpu_busy_us", "device_name",
]

# Kineto's categories for work that runs on the GPU: kernels, copies and fills.
GPU_EVENT_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


# --------------------------------------------------------------------------- the timer

class Timing(NamedTuple):
    """Median µs of one call: on the device's clock, and on the host to issue it."""

    device_us: float
    host_us: float


def _check_timed(fn, warmup, repeats, **counts) -> None:
    """A timer's arguments: a callable, warm-up >= 0, repeats and every count >= 1."""
    if not callable(fn):
        raise TypeError(f"fn must be a callable that runs one step, got {type(fn).__name__}; "
                        "pass the function, not its result")
    check_int("warmup", warmup, 0)
    check_int("repeats", repeats, 1)
    for name, n in counts.items():
        check_int(name, n, 1)


def time_call(fn: Callable[[], Any], B, *, warmup: int = 5, repeats: int = 30,
              inner: int = 1) -> Timing:
    """Median time of one ``fn()`` call, from ``B.Event`` pairs around each sample.

    Each of ``repeats`` samples synchronizes, records a start event, calls ``fn`` ``inner``
    times, records an end event and waits for it; a sample is the elapsed time divided by
    ``inner``. ``host_us`` is the ``perf_counter`` time of the same calls without waiting
    for the device: on a GPU, what issuing them costs the CPU.

    Args:
        fn: one step, called with no arguments.
        B: the backend; its ``Event`` and ``synchronize`` do the timing.
        warmup: untimed calls first (allocation, library start-up, compilation).
        repeats: samples; the median is robust to an odd slow one without rewarding a
            lucky one, as a minimum would.
        inner: calls per sample, so that the events' own cost does not dominate a very
            short ``fn``.

    .. warning::
        The device is synchronized before every sample. Otherwise eager launches queue up
        behind the previous sample's kernels and hide their own cost, which is what a
        CUDA graph removes.
    """
    _check_timed(fn, warmup, repeats, inner=inner)
    for _ in range(warmup):
        fn()
    B.synchronize()
    device, host = [], []
    for _ in range(repeats):
        B.synchronize()
        start, end = B.Event(enable_timing=True), B.Event(enable_timing=True)
        start.record()
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        t1 = time.perf_counter()
        end.record()
        end.synchronize()
        device.append(start.elapsed_time(end) * 1e3 / inner)   # ms -> µs
        host.append((t1 - t0) * 1e6 / inner)
    return Timing(statistics.median(device), statistics.median(host))


def measure_us(fn: Callable[[], Any], B, warmup: int = 5, repeats: int = 30,
               inner: int = 1) -> float:
    """:func:`time_call`'s ``device_us``: the median time of one ``fn()`` call in µs."""
    return time_call(fn, B, warmup=warmup, repeats=repeats, inner=inner).device_us


def back_to_back_us(fn: Callable[[], Any], B, *, calls: int = 100, warmup: int = 5,
                    repeats: int = 5) -> float:
    """Median time per call of ``calls`` back-to-back ``fn()`` calls, in µs.

    Each of ``repeats`` samples synchronizes once, records a start event, calls ``fn``
    ``calls`` times with no synchronization in between, records an end event and waits:
    a sample is the elapsed time divided by ``calls``. This is the steady state of a loop
    whose next input stays on the device (a serving loop that never reads its tokens
    back, a training loop): the host issues call N+1 while the device still runs call N,
    so host work hides behind device work wherever it is shorter.

    :func:`time_call` is the other method: it synchronizes before *every* call, so the
    host work of a call is paid in full before its device work can start (a loop that
    needs each step's result on the host). A benchmark reports both.
    """
    _check_timed(fn, warmup, repeats, calls=calls)
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        B.synchronize()
        start, end = B.Event(enable_timing=True), B.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / calls)   # ms -> µs
    return statistics.median(samples)


# --------------------------------------------------------------------------- traces

def read_chrome_trace(trace: dict | str | os.PathLike) -> dict:
    """A Chrome trace as a dict: ``trace`` itself, or the JSON file at that path.

    Raises:
        TypeError: ``trace`` is neither a dict nor a path.
        ValueError: no file there, or not a JSON object (e.g. a truncated export).
    """
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


def complete_events(trace: dict | str | os.PathLike) -> list[dict]:
    """The complete (``ph: "X"``) events of a trace, each with a numeric ``ts`` and ``dur``.

    Raises:
        ValueError: ``traceEvents`` is not a list, or a complete event lacks a number.
    """
    events = read_chrome_trace(trace).get("traceEvents", [])
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


def record_chrome_trace(fn: Callable[[], Any], B, *, warmup: int = 2,
                        path: str | os.PathLike | None = None) -> dict:
    """One ``fn()`` call recorded by ``torch.profiler`` (CPU and CUDA activity), as a dict.

    Args:
        fn: one step, called with no arguments.
        B: the ``"cuda"`` backend.
        warmup: unprofiled calls first.
        path: where to keep the Chrome-trace JSON (Perfetto opens it); a temporary file
            if None.

    .. warning::
        The profiler's schedule runs ``fn`` once as its own warm-up step before the
        recorded one: the first profiled step carries CUPTI's start-up cost, which is not
        the step's.
    """
    from torch.profiler import ProfilerActivity, profile, schedule

    check_int("warmup", warmup, 0)
    for _ in range(warmup):
        fn()
    B.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(path) if path is not None else Path(tmp) / "trace.json"
        with warnings.catch_warnings():
            # the schedule's single cycle is the whole recording, so torch.profiler's note
            # that a cycle clears its events loses nothing; keep it out of a lesson
            warnings.filterwarnings("ignore", message=".*Profiler clears events.*")
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
                         schedule=schedule(wait=0, warmup=1, active=1, repeat=1),
                         on_trace_ready=lambda p: p.export_chrome_trace(str(out))) as prof:
                for _ in range(2):
                    fn()
                    B.synchronize()
                    prof.step()
        if not out.exists():
            raise RuntimeError(f"torch.profiler wrote no trace to {out}")
        return read_chrome_trace(out)


# --------------------------------------------------------------------------- GPU-busy time

def busy_us(intervals: Iterable[tuple[float, float]]) -> float:
    """Time covered by at least one ``(start, end)`` interval: overlaps count once.

    This is what "the GPU was busy" means in labkit: kernels of several streams that run
    at the same time are one busy stretch, not two.
    """
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


def profile_gpu_events(fn: Callable[[], Any], B, warmup: int = 2) -> list[dict] | None:
    """The GPU events (kernels, copies, fills) of one ``fn()`` call from
    :func:`record_chrome_trace`, each a Chrome-trace dict; None without a GPU.
    ``len(...)`` is how many kernels the call ran (a graph replay's nodes one by one)."""
    if getattr(B, "name", None) != "cuda":
        return None
    return [e for e in complete_events(record_chrome_trace(fn, B, warmup=warmup))
            if e.get("cat") in GPU_EVENT_CATEGORIES]


def events_busy_us(events: Iterable[dict]) -> float:
    """:func:`busy_us` of Chrome-trace events."""
    return busy_us((float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in events)


def profile_gpu_busy_us(fn: Callable[[], Any], B, warmup: int = 2) -> float | None:
    """How long the GPU computed during one ``fn()`` call, in µs; None without a GPU.

    The :func:`busy_us` of every kernel, memcpy and memset in :func:`record_chrome_trace`.
    CUPTI reports a graph replay's kernels one by one, so this works for replays too.
    ``measure_us(fn, B) - profile_gpu_busy_us(fn, B)`` is then the time the GPU sat idle,
    mostly waiting for launches.
    """
    events = profile_gpu_events(fn, B, warmup=warmup)
    return None if events is None else events_busy_us(events)


def device_name(B) -> str:
    """The GPU's name, or a label saying the numbers come from the CPU emulator."""
    if getattr(B, "name", None) == "cuda":
        return torch.cuda.get_device_name(B.device)
    return "CPU (emulated CUDA graphs)"
