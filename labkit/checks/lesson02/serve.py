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
from labkit.checks import DEFAULT_TIME_LIMIT, CheckResult, check
from labkit.checks.lesson02._common import (
    _call,
    _make_fn_inputs,
    _recording_replays,
    _recording_waits,
    _Reported,
    _run_problem,
)

__all__ = ["check_serve"]


def check_serve(serve, *, B=None, trials: int = 3,
                time_limit: float | None = DEFAULT_TIME_LIMIT) -> CheckResult:
    """``serve(model, requests)`` must return clones of model(request), via one graph."""
    B = _backend(B)

    def make_inputs(gen: torch.Generator):
        return _make_fn_inputs(B, gen)

    def reference(model, requests):
        with torch.no_grad():
            return {"outputs": [model.compute(x) for x in requests]}

    def learner(model, requests):
        kept = [r.clone() for r in requests]
        ptrs = [r.data_ptr() for r in requests]
        try:
            with _recording_waits(B, model), _recording_replays(B, model):
                out = _call(B, serve, model, list(requests))
        except _Reported as rep:
            return {"bad": str(rep)}
        changed = [i for i, (r, k) in enumerate(zip(requests, kept)) if not torch.equal(r, k)]
        return {"outputs": out, "fn": model, "n": len(requests), "changed": changed,
                "on_request": model.captured_on in ptrs, "batches": kept}

    def compare(expected, actual) -> str | None:
        if "bad" in actual:
            return actual["bad"]
        if actual["changed"]:
            i = actual["changed"][0]
            where = (" Your static input IS a caller's request (static_x = requests[0]?), "
                     "so each copy_ overwrote it" if actual["on_request"] else "")
            return (f"serve changed the caller's requests[{i}] in place (requests "
                    f"{actual['changed']} differ after the call).{where}: allocate a static "
                    "input of your own, as the broken version does (torch.zeros_like), and "
                    "copy_ each request into it (section 4)")
        return _run_problem(actual["fn"], actual["outputs"], actual["n"], expected["outputs"],
                            warmups=0, what="model", static="static_y",
                            batches=actual["batches"])

    return check(
        learner, reference, make_inputs, trials=trials, name="serve", compare=compare,
        time_limit=time_limit,
        hint="compare what broken_serve printed with sections 4 and 5 of the lesson",
        more_hints=[
            "one bug makes every output come from the same input: how does a new request "
            "reach the memory the graph reads? (section 4)",
            "one bug makes every output the same tensor: what does the next replay do to "
            "static_y? (section 5)",
        ],
    )
