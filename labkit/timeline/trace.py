"""Chrome traces: measured timelines from ``torch.profiler``, and any timeline written out.

The Trace Event Format (what chrome://tracing and https://ui.perfetto.dev read) holds
``ts`` and ``dur`` in microseconds, as :class:`~labkit.timeline.Span` does.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, Callable, Iterable

from labkit import backend
from labkit.core.timing import (
    GPU_EVENT_CATEGORIES,
    complete_events,
    device_name,
    record_chrome_trace,
)
from labkit.core.validate import check_int
from labkit.timeline.model import _LANE_ORDER, CPU, GPU, OPS, Span, Timeline, _check_timeline

__all__ = ["timeline_from_chrome_trace", "profile_timeline", "chrome_trace_events",
           "to_chrome_trace"]

# Kineto's categories and names of the CPU-side launch calls.
_LAUNCH_CATS = ("cuda_runtime", "cuda_driver")
_LAUNCH_PREFIXES = ("cudaLaunch", "cuLaunch", "cudaGraphLaunch", "cuGraphLaunch",
                    "cudaMemcpyAsync", "cudaMemsetAsync", "cuMemcpy", "cuMemset")


def timeline_from_chrome_trace(trace: dict | str | os.PathLike, label: str = "",
                               device: str | None = None, ops_lane: bool = True) -> Timeline:
    """A measured :class:`Timeline` from a ``torch.profiler`` Chrome trace.

    Kineto writes CPU and GPU events on one clock in µs, so the lanes line up as they
    happened. Times are shifted so the first span starts at 0.

    Args:
        trace: the trace dict, or the path ``prof.export_chrome_trace`` wrote.
        label: the timeline's title.
        device: the GPU's name, for the tag.
        ops_lane: add the ``CPU ops`` lane, the outermost ATen ops (``cat`` cpu_op), which
            show the rest of each op's CPU cost around its launch call.

    The ``CPU`` lane holds launch calls (``cat`` cuda_runtime/cuda_driver, names like
    ``cudaLaunchKernel``, ``cudaGraphLaunch``; synchronisation calls are left out), the
    ``GPU`` lane kernels, memcpys and memsets.

    Raises:
        ValueError: the trace has no GPU work (recorded without ``ProfilerActivity.CUDA``).
    """
    events = complete_events(trace)
    spans: list[Span] = []
    ops: list[dict] = []
    for e in events:
        cat, name = e.get("cat", ""), e.get("name", "")
        ts, dur = float(e["ts"]), float(e["dur"])
        if cat in _LAUNCH_CATS and name.startswith(_LAUNCH_PREFIXES):
            spans.append(Span(CPU, name, ts, dur))
        elif cat in GPU_EVENT_CATEGORIES:
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

    Args:
        fn: one step, e.g. an eager chain or ``g.replay``.
        B: the ``"cuda"`` backend.
        label: the timeline's title.
        warmup: unprofiled calls first (the profiler then runs one more as its own
            warm-up step: the first profiled step carries CUPTI's start-up cost).
        ops_lane: as for :func:`timeline_from_chrome_trace`.
        trace_path: keep the raw Chrome trace there (Perfetto opens it).

    Raises:
        RuntimeError: ``B`` is not the cuda backend: there is no device trace to record;
            :func:`simulate` draws the picture on a CPU.

    .. warning::
        The profiler adds CPU time of its own to each op, so a profiled eager chain looks
        more launch-bound than it runs: take numbers from :func:`measure_launch_cost`,
        pictures from here.
    """
    B = backend.ensure(B)
    if B.name != "cuda":
        raise RuntimeError(
            "profile_timeline needs a CUDA GPU (backend 'cuda'); this backend is "
            f"{B.name!r}, which has no device trace to record. On a CPU use "
            "timeline.simulate(n_kernels, launch_us, kernel_us), with launch_us from "
            "measure_launch_cost(B)['cpu_us_per_launch'] and kernel_us from roofline_kernel_us().")
    if not callable(fn):
        raise TypeError(f"fn must be a callable that runs one step (e.g. steps.eager or "
                        f"g.replay), got {type(fn).__name__}; pass the function, not its result")
    check_int("warmup", warmup, 0)
    if trace_path is not None:
        _check_folder_of(trace_path, "trace_path")
    trace = record_chrome_trace(fn, B, warmup=warmup, path=trace_path)
    return timeline_from_chrome_trace(trace, label=label, device=device_name(B),
                                      ops_lane=ops_lane)


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


def chrome_trace_events(spans: Iterable[Span]) -> list[dict]:
    """Spans as Chrome-trace "complete" events (``ph: "X"``), one (pid, tid) per lane.

    Each lane gets its own pid, so Perfetto draws it as its own track, CPU lanes above
    the GPU.
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
