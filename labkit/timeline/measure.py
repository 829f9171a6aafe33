"""Measured launch cost: a chain of tiny adds, eager and as one graph replay."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from labkit import backend
from labkit.capture import capturing, cleanup_on_failure, side_stream_warmup
from labkit.core.rounds import DEFAULT_ROUNDS, interleave, verdict
from labkit.core.timing import device_name, time_call
from labkit.core.validate import check_int
from labkit.timeline.model import _check_dtype
from labkit.timeline.simulate import _check_numels

__all__ = ["chain", "ChainSteps", "chain_steps", "measure_launch_cost", "sweep_measured"]

def chain(x: torch.Tensor, n_ops: int = 100) -> torch.Tensor:
    """``n_ops`` dependent tiny adds: the smallest program whose speed is all launch cost.

    Each ``x + 1`` is one kernel launch on a GPU; the result of one feeds the next, as the
    ops of a layer do.
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"chain(x, n_ops) needs a tensor x, got {type(x).__name__}; "
                        "e.g. torch.zeros(256, device=B.device)")
    check_int("n_ops", n_ops, 0)
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

    Warm up on a side stream, then capture into a fresh graph (``B.graph`` captures on a
    side stream of its own).

    Args:
        B: the backend (``None``: ``labkit.backend.get("auto")``).
        n_ops: adds in the chain (kernels on a GPU).
        numel: elements of ``x``.
        dtype: of ``x``.
        warmup: eager runs on the side stream before the capture.

    .. warning::
        Capture records the ops, it does not run them: ``out`` holds the result only after
        the first replay. The warm-up keeps lazy initialisation (allocator, library
        handles) out of the capture, where it would be recorded or refused.
    """
    B = _check_chain_args(B, n_ops=n_ops, numel=numel, dtype=dtype, warmup=warmup)
    x = torch.zeros(numel, device=B.device, dtype=dtype)
    side_stream_warmup(chain, x, n_ops, B=B, iters=warmup)
    g = B.CUDAGraph()
    with cleanup_on_failure(B), capturing(B, g):
        out = chain(x, n_ops)
    B.synchronize()
    return ChainSteps(eager=lambda: chain(x, n_ops), graphed=g.replay, graph=g, x=x, out=out,
                      n_ops=n_ops)


def _check_chain_args(B, *, n_ops, numel, dtype, warmup, repeats=1, rounds=1):
    """The backend (``B`` or ``get("auto")``), after the arguments every measurement of a
    chain shares are checked, before any capture."""
    B = backend.ensure(B)
    check_int("n_ops", n_ops, 1)
    check_int("numel", numel, 1)
    check_int("warmup", warmup, 0)
    check_int("repeats", repeats, 1)
    check_int("rounds", rounds, 1)
    _check_dtype(dtype)
    return B


def measure_launch_cost(B, n_ops: int = 100, numel: int = 256, repeats: int = 20,
                        warmup: int = 3, dtype: torch.dtype = torch.float32,
                        rounds: int = DEFAULT_ROUNDS, seed: int = 0) -> dict:
    """Per-kernel cost of a chain of ``n_ops`` tiny adds, eager vs one graph replay.

    The two are timed in interleaved rounds (:func:`labkit.core.rounds.interleave`): each
    round times both, in a shuffled order, by :func:`labkit.core.timing.time_call` (the
    median of ``repeats`` samples). A figure is the median over rounds.

    Args:
        B: the backend (``None``: ``labkit.backend.get("auto")``).
        n_ops, numel, dtype, warmup: the chain, as for :func:`chain_steps`.
        repeats: timed samples of each, per round.
        rounds: interleaved rounds (a ``verdict`` wants at least 5).
        seed: the seed of the rounds' shuffled orders.

    Returns:
        A dict: ``eager_step_us`` / ``graph_step_us`` (one step), ``eager_us_per_kernel`` /
        ``graph_us_per_kernel`` (a step / ``n_ops``), their ratio ``speedup``,
        ``cpu_us_per_launch`` (issuing one eager op: the ``launch_us`` that a
        :func:`simulate` of this machine wants), ``cpu_us_per_replay`` (issuing one
        ``g.replay()``), ``rounds`` (``{"eager_step_us": [...], "graph_step_us": [...]}``,
        one value per round), ``verdict`` (a :class:`labkit.core.rounds.Verdict`: is the
        replay faster in at least 4 of 5 rounds?), ``timer``, ``device`` and the
        arguments.

    .. warning::
        On the emulator the step times are CPU wall times: the eager number is the real
        dispatch cost of a torch op on this CPU, but the graph number is the emulator's
        replay, which runs on the CPU too. It shows the mechanism (one call replays N
        ops), not what a GPU gains; the ``note`` key says so.
    """
    B = _check_chain_args(B, n_ops=n_ops, numel=numel, dtype=dtype, warmup=warmup,
                          repeats=repeats, rounds=rounds)
    steps = chain_steps(B, n_ops=n_ops, numel=numel, dtype=dtype, warmup=warmup)
    for _ in range(warmup):
        steps.eager()
        steps.graphed()
    timed = interleave({"eager": steps.eager, "graph": steps.graphed},
                       lambda fn: time_call(fn, B, warmup=0, repeats=repeats)._asdict(),
                       rounds=rounds, seed=seed)
    B.synchronize()
    eager_step, eager_cpu, graph_step, graph_cpu = (
        statistics.median(timed[name][method])
        for name in ("eager", "graph") for method in ("device_us", "host_us"))
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
        "device": device_name(B),
        "n_ops": n_ops, "numel": numel, "repeats": repeats, "dtype": str(dtype),
        "eager_step_us": eager_step,
        "graph_step_us": graph_step,
        "eager_us_per_kernel": eager_step / n_ops,
        "graph_us_per_kernel": graph_step / n_ops,
        "speedup": eager_step / graph_step if graph_step > 0 else math.inf,
        "cpu_us_per_launch": eager_cpu / n_ops,
        "cpu_us_per_replay": graph_cpu,
        "rounds": {"eager_step_us": timed["eager"]["device_us"],
                   "graph_step_us": timed["graph"]["device_us"]},
        "verdict": verdict("graph", timed["graph"]["device_us"],
                           "eager", timed["eager"]["device_us"]),
    }
    if B.name != "cuda":
        result["note"] = ("emulated: eager = real per-op dispatch cost on this CPU; graph = the "
                          "emulator's CPU replay, not a GPU's. Real GPU timing needs a GPU.")
    return result


def sweep_measured(B, numels: Sequence[int], n_ops: int = 50, repeats: int = 10,
                   dtype: torch.dtype = torch.float32, rounds: int = 1) -> list[dict]:
    """:func:`measure_launch_cost` at each size in ``numels``: one row per size, each the
    median over ``rounds`` interleaved rounds (one by default: a sweep draws where the two
    curves meet, it ranks nothing).

    .. warning::
        Meaningful on a GPU only. On the emulator both curves are CPU compute once tensors
        grow; :func:`sweep_simulated` draws the GPU picture there.
    """
    numels = _check_numels(numels)
    B = _check_chain_args(B, n_ops=n_ops, numel=1, dtype=dtype, warmup=0, repeats=repeats,
                          rounds=rounds)
    rows = []
    for numel in numels:
        m = measure_launch_cost(B, n_ops=n_ops, numel=int(numel), repeats=repeats, dtype=dtype,
                                rounds=rounds)
        rows.append({"numel": int(numel), "eager_us": m["eager_step_us"],
                     "graph_us": m["graph_step_us"], "n_kernels": n_ops,
                     "source": "measured", "device": m["device"],
                     "launch_us": m["cpu_us_per_launch"]})
    return rows
