"""Lesson 02, exercise ``serve``: its checker.

``serve(model, requests) -> list[Tensor]`` (diagnosis): the fixed version of a broken
serving loop given in the notebook. Checked like ``graphed_run``; the warm-up must be
kept (on a side stream, with both ``wait_stream`` calls; any number of runs), and the
caller's requests must be unchanged after the call (a request used as the static input
is overwritten by every ``copy_``).
"""

from __future__ import annotations

import torch

from labkit.backend import ensure as _backend
from labkit.checks import DEFAULT_TIME_LIMIT, CheckResult, Exercise
from labkit.checks.lesson02._common import (
    _call,
    _make_fn_inputs,
    _recording_replays,
    _recording_waits,
    _run_problem,
)

__all__ = ["check_serve"]


EXERCISE = Exercise(
    "serve",
    hint="compare what broken_serve printed with sections 4 and 5 of the lesson",
    more_hints=(
        "one bug makes every output come from the same input: how does a new request "
        "reach the memory the graph reads? (section 4)",
        "one bug makes every output the same tensor: what does the next replay do to "
        "static_y? (section 5)",
    ),
)


def _reference(model, requests):
    with torch.no_grad():
        return {"outputs": [model.compute(x) for x in requests]}


def _requests_unchanged(expected, actual) -> str | None:
    """The caller's requests are the caller's: none used as the static input."""
    if not actual["changed"]:
        return None
    i = actual["changed"][0]
    where = (" Your static input IS a caller's request (static_x = requests[0]?), "
             "so each copy_ overwrote it" if actual["on_request"] else "")
    return (f"serve changed the caller's requests[{i}] in place (requests "
            f"{actual['changed']} differ after the call).{where}: allocate a static "
            "input of your own, as the broken version does (torch.zeros_like), and "
            "copy_ each request into it (section 4)")


def _the_graphed_loop(expected, actual) -> str | None:
    return _run_problem(actual["fn"], actual["outputs"], actual["n"], expected["outputs"],
                        warmups=0, what="model", static="static_y",
                        batches=actual["batches"])


JUDGES = (_requests_unchanged, _the_graphed_loop)


def check_serve(serve, *, B=None, trials: int = 3,
                time_limit: float | None = DEFAULT_TIME_LIMIT) -> CheckResult:
    """``serve(model, requests)`` must return clones of model(request), via one graph."""
    B = _backend(B)

    def make_inputs(gen: torch.Generator):
        return _make_fn_inputs(B, gen)

    def learner(model, requests):
        kept = [r.clone() for r in requests]
        ptrs = [r.data_ptr() for r in requests]
        with _recording_waits(B, model), _recording_replays(B, model):
            out = _call(B, serve, model, list(requests))
        changed = [i for i, (r, k) in enumerate(zip(requests, kept)) if not torch.equal(r, k)]
        return {"outputs": out, "fn": model, "n": len(requests), "changed": changed,
                "on_request": model.captured_on in ptrs, "batches": kept}

    return EXERCISE.check(learner, _reference, make_inputs, trials=trials, judges=JUDGES,
                          time_limit=time_limit)
