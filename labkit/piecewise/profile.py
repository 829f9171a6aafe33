"""Where a piecewise step's host time goes: the parts of one ``runner.replay(batch)``.

A piecewise step is host-bound when its Python costs more than the GPU work it queues:
each piece is a graph replay (one launch, plus the Python around it), but the attention
between two pieces runs eagerly, op by op, every op a launch from Python. This module
times the parts of one step on the host, without syncing inside it, so the parts add up
to what the host spends queueing the step (the GPU may still be running it).
"""

from __future__ import annotations

import statistics
import time
from contextlib import contextmanager

import torch

__all__ = ["PARTS", "host_breakdown"]

PARTS = ("plan attention", "pieces (replays)", "attention (eager)", "rest")


@contextmanager
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
    from .runner import EagerAttention, GraphedPiece

    from labkit.core.validate import check_int
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
    with _timed(runner.attn, "init_forward_metadata", plan):
        patches = [_timed(m, "forward", rep) for m in pieces]
        patches += [_timed(m, "forward", att) for m in attns]
        for p in patches:
            p.__enter__()
        try:
            runner.replay(batch)                       # warm: allocator, caches
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
        finally:
            for p in reversed(patches):
                p.__exit__(None, None, None)
    # Means, not medians: the parts of a step then add up to its total.
    return {k: round(1e6 * statistics.fmean(v), 1) for k, v in samples.items()}
