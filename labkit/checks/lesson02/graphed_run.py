"""Lesson 02, exercise ``graphed_run``: its checker.

``graphed_run(fn, static_input, batches) -> list[Tensor]``: the template of section 4.
Warm ``fn(static_input)`` up 3 times on a side stream, capture ``fn(static_input)`` once,
then for each batch ``copy_`` it into the static input, ``replay()``, and keep a *clone*
of the static output. Checked against eager ``[fn(b) for b in batches]``, and also for
*how*: ``fn`` counts its calls (eager before capture, during capture, eager after), the
stream and the input of each warm-up call (``static_input``), the two ``wait_stream``
calls around the warm-up (logged on ``B.Stream`` while the learner's code runs), and
every result must be a tensor of its own (none of them the static output, which the
next replay overwrites).
"""

from __future__ import annotations

import torch

from labkit.backend import ensure as _backend
from labkit.checks import DEFAULT_TIME_LIMIT, CheckResult, Exercise
from labkit.checks.lesson02._common import (
    WARMUP_ITERS,
    _call,
    _make_fn_inputs,
    _recording_replays,
    _recording_waits,
    _run_problem,
)

__all__ = ["check_graphed_run"]


EXERCISE = Exercise(
    "graphed_run",
    hint="the exercise's three steps are sections 2 (warm-up), 3 (capture) and 4-5 "
         "(replay, keep results) of the lesson",
    more_hints=(
        "warm-up: s = B.Stream(); s.wait_stream(B.current_stream()); then "
        f"`with B.stream(s):` call fn(static_input) {WARMUP_ITERS} times; then "
        "B.current_stream().wait_stream(s)",
        "capture once, before the loop: g = B.CUDAGraph(); `with B.graph(g): static_out = "
        "fn(static_input)`",
        "per batch: static_input.copy_(batch); g.replay(); results.append(static_out.clone())",
    ),
)


def _reference(fn, static_input, batches):
    with torch.no_grad():
        return {"outputs": [fn.compute(x) for x in batches]}


def _the_graphed_loop(expected, actual) -> str | None:
    return _run_problem(actual["fn"], actual["outputs"], actual["n"], expected["outputs"],
                        warmups=WARMUP_ITERS, static_input_ptr=actual["ptr"],
                        batches=actual["batches"])


def check_graphed_run(graphed_run, *, B=None, trials: int = 3,
                      time_limit: float | None = DEFAULT_TIME_LIMIT) -> CheckResult:
    """``graphed_run(fn, static_input, batches)`` must return clones of fn(batch), via one graph.

    Probed: one capture, no eager call after it, exactly :data:`WARMUP_ITERS` warm-up runs,
    each on a side stream, every result a tensor of its own with the eager values.
    """
    B = _backend(B)

    def make_inputs(gen: torch.Generator):
        fn, batches = _make_fn_inputs(B, gen)
        rows, cols = batches[0].shape
        return fn, torch.zeros(rows, cols, device=B.device), batches

    def learner(fn, static_input, batches):
        fed = [b.clone() for b in batches]
        with _recording_waits(B, fn), _recording_replays(B, fn):
            out = _call(B, graphed_run, fn, static_input, batches)
        return {"outputs": out, "fn": fn, "n": len(batches), "ptr": static_input.data_ptr(),
                "batches": fed}

    return EXERCISE.check(learner, _reference, make_inputs, trials=trials,
                          judges=(_the_graphed_loop,), time_limit=time_limit)
