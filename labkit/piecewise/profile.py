"""Where a piecewise step's host time goes: the parts of one ``runner.replay(batch)``.

A piecewise step is host-bound when its Python costs more than the GPU work it queues:
each piece is a graph replay (one launch, plus the Python around it), but the attention
between two pieces runs eagerly, op by op, every op a launch from Python. This module
times the parts of one step on the host, without syncing inside it, so the parts add up
to what the host spends queueing the step (the GPU may still be running it).
"""

from __future__ import annotations

import contextlib
import statistics
import time

__all__ = ["PARTS", "host_breakdown"]

PARTS = ("plan attention", "pieces (replays)", "attention (eager)", "rest")


@contextlib.contextmanager
def _timed(obj, name: str, spent: list):
    """Replace ``obj.name`` by a wrapper adding its host time to ``spent[0]``."""
    own = vars(obj).get(name)          # an attribute of the instance itself, if any
    original = getattr(obj, name)

    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            spent[0] += time.perf_counter() - t0

    setattr(obj, name, wrapper)
    try:
        yield
    finally:
        if own is None:
            delattr(obj, name)
        else:
            setattr(obj, name, own)


def host_breakdown(runner, batch, repeats: int = 20) -> dict[str, float]:
    """Mean host time, in µs, of each part of ``runner.replay(batch)`` (:data:`PARTS`)
    and of the whole step (``"total"``).

    runner   a captured :class:`~labkit.piecewise.PiecewiseGraphRunner`
    batch    a batch it can run (its tokens fit a bucket)
    repeats  steps timed; the device is synchronized between them, never inside one

    .. warning::
        Each part is timed by a wrapper around it, which adds about a microsecond per
        call to what it measures: compare breakdowns taken the same way, not a part
        against an unwrapped step.
    """
    from labkit.core.validate import check_int

    from .runner import EagerAttention, GraphedPiece
    check_int("host_breakdown: repeats", repeats, 1, fix="the number of steps to time")
    if not getattr(runner, "captured", False) or not hasattr(runner, "split"):
        raise TypeError("host_breakdown: runner must be a captured PiecewiseGraphRunner, got "
                        f"{type(runner).__name__}")
    if not runner.can_run(batch):
        raise ValueError(f"host_breakdown: the batch has {batch.num_tokens} tokens, above the "
                         f"largest bucket ({runner.max_num_tokens}): time a batch that fits")
    mods = list(runner.split.split_gm.children())
    pieces = [m for m in mods if isinstance(m, GraphedPiece)]
    attns = [m for m in mods if isinstance(m, EagerAttention)]
    B = runner.B
    samples: dict[str, list[float]] = {p: [] for p in PARTS + ("total",)}
    plan, rep, att = [0.0], [0.0], [0.0]
    with contextlib.ExitStack() as patched:
        patched.enter_context(_timed(runner.attn, "init_forward_metadata", plan))
        for mods, spent in ((pieces, rep), (attns, att)):
            for m in mods:
                patched.enter_context(_timed(m, "forward", spent))
        runner.replay(batch)                           # warm: allocator, caches
        for _ in range(repeats):
            B.synchronize()
            plan[0] = rep[0] = att[0] = 0.0
            t0 = time.perf_counter()
            runner.replay(batch)
            total = time.perf_counter() - t0
            parts = (plan[0], rep[0], att[0])
            for name, v in zip(PARTS, parts + (total - sum(parts),)):
                samples[name].append(v)
            samples["total"].append(total)
        B.synchronize()
    # Means, not medians: the parts of a step then add up to its total.
    return {k: round(1e6 * statistics.fmean(v), 1) for k, v in samples.items()}


def stored_breakdowns(path=None) -> dict | None:
    """The H200 breakdowns ``tools/piecewise_host_profile.py`` stored, before and after
    the runner's host work was cut (``labkit/bench/data/piecewise_host.json``, a copy of
    ``docs/benchmarks/piecewise_host.json``): ``{"runs": {"before": ..., "after": ...}}``,
    each with ``workloads`` mapping a workload to its :func:`host_breakdown` plus
    ``gpu_busy`` and ``kernels``. None when none is stored."""
    import json
    from pathlib import Path

    p = Path(path) if path is not None else (
        Path(__file__).parents[1] / "bench" / "data" / "piecewise_host.json")
    return json.loads(p.read_text()) if p.exists() else None


def plot_breakdowns(runs: dict, ax=None):
    """Stacked bars: the host time of each part of a step, per workload, one bar per run
    (``stored_breakdowns()["runs"]``), and each step's GPU busy time as a tick."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(9, 4.2))
    names = list(runs)
    workloads = list(runs[names[0]]["workloads"])
    colors = ("#9ecae1", "#3182bd", "#fd8d3c", "#bdbdbd")
    y, labels = 0, []
    for w in workloads:
        for name in names:
            parts = runs[name]["workloads"][w]
            left = 0.0
            for part, color in zip(PARTS, colors):
                ax.barh(y, parts[part], left=left, color=color,
                        label=part if not labels else None)
                left += parts[part]
            busy = parts.get("gpu_busy")
            if busy:
                ax.plot([busy, busy], [y - 0.4, y + 0.4], color="black", lw=2,
                        label="GPU busy" if not labels else None)
            labels.append(f"{w} · {name}")
            y += 1
        y += 0.5
    ticks = [i + 0.5 * (i // len(names)) for i in range(len(labels))]
    ax.set_yticks(ticks, labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("host µs per step (means)")
    ax.legend(fontsize=8, loc="lower right")
    return ax
