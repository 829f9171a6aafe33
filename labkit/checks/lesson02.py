"""Checkers for lesson 02 (raw capture and replay).

Two exercises, each run on the backend of ``labkit.backend.get("auto")`` (or ``B=``):

* ``graphed_run(fn, static_input, batches) -> list[Tensor]``: the §1.2 template. Warm up
  on a side stream, capture ``fn(static_input)`` once, then for each batch ``copy_`` it
  into the static input, ``replay()``, and keep a *clone* of the static output. Checked
  against eager ``[fn(b) for b in batches]``, and also for *how*: ``fn`` must have been
  captured exactly once and must not run once per batch, and the results must not all be
  the same tensor (the static output, overwritten by every replay).
* ``capture_chain(f1, f2, static_input) -> (g1, g2, static_mid, static_out)``: two graphs
  in ONE shared pool, ``g1`` computing ``static_mid = f1(static_input)`` and ``g2``
  computing ``static_out = f2(static_mid)``. Checked by replaying ``g1`` then ``g2`` on
  fresh data, and by ``g1.pool() == g2.pool()``.
"""

from __future__ import annotations

import torch

from labkit.backend import recover as _recover
from labkit.checks import CheckResult, check, compare_outputs

__all__ = ["check_graphed_run", "check_capture_chain"]


def _backend(B):
    if B is not None:
        return B
    from labkit import backend

    return backend.get("auto")


# ---- exercise 1: graphed_run ------------------------------------------------------------

class _Counted:
    """``fn`` that counts its eager calls and its calls during a capture."""

    def __init__(self, B, weight: torch.Tensor, bias: torch.Tensor):
        self.B, self.weight, self.bias = B, weight, bias
        self.eager = 0
        self.captured = 0
        self.__name__ = "fn"

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.B.is_current_stream_capturing():
            self.captured += 1
        else:
            self.eager += 1
        return torch.tanh(x @ self.weight + self.bias) * 2.0


def check_graphed_run(graphed_run, *, B=None, trials: int = 3) -> CheckResult:
    """``graphed_run(fn, static_input, batches)`` must return clones of fn(batch), via one graph."""
    B = _backend(B)

    def make_inputs(gen: torch.Generator):
        rows = int(torch.randint(2, 6, (), generator=gen))
        cols = int(torch.randint(3, 9, (), generator=gen))
        n = int(torch.randint(8, 13, (), generator=gen))
        w = (torch.randn(cols, cols, generator=gen) / cols ** 0.5).to(B.device)
        b = torch.randn(cols, generator=gen).to(B.device)
        batches = [torch.randn(rows, cols, generator=gen).to(B.device) for _ in range(n)]
        # cuBLAS initialises lazily on its first matmul, which must not happen during a
        # capture: make sure that is over, so only the learner's own steps are tested
        torch.mm(batches[0], w)
        B.synchronize()
        return _Counted(B, w, b), torch.zeros(rows, cols, device=B.device), batches

    def reference(fn, static_input, batches):
        with torch.no_grad():
            out = [torch.tanh(x @ fn.weight + fn.bias) * 2.0 for x in batches]
        return {"outputs": out}

    def learner(fn, static_input, batches):
        try:
            out = graphed_run(fn, static_input, batches)
        finally:
            _recover(B)
        return {"outputs": out, "fn": fn, "n": len(batches)}

    def compare(expected, actual) -> str | None:
        out, fn, n = actual["outputs"], actual["fn"], actual["n"]
        if fn.captured == 0:
            return ("fn was never called during a capture: record it once inside "
                    "`with B.graph(g):` and then call g.replay() for each batch")
        if fn.captured > 1:
            return (f"fn was captured {fn.captured} times: capture ONE graph before the "
                    "loop and replay it for every batch")
        if fn.eager >= n:
            return (f"fn ran eagerly {fn.eager} times for {n} batches: after capture, only "
                    "copy_ + g.replay() should run per batch (warm up a few times, not once "
                    "per batch)")
        if isinstance(out, (list, tuple)) and len(out) > 1 and all(
                isinstance(t, torch.Tensor) for t in out):
            ptrs = {t.data_ptr() for t in out}
            if len(ptrs) == 1:
                return (f"all {len(out)} results are the same tensor, the graph's static "
                        "output, which every replay overwrites in place: append "
                        "static_out.clone()")
        msg = compare_outputs(expected["outputs"], out, rtol=1e-4, atol=1e-5)
        if msg:
            return msg + ("  (results from the first batches wrong? copy_ each batch into "
                          "static_input BEFORE g.replay(), and never rebind it)")
        return None

    return check(
        learner, reference, make_inputs, trials=trials, name="graphed_run", compare=compare,
        hint="warm up on a side stream (s = B.Stream(); s.wait_stream(B.current_stream()); "
             "with B.stream(s): ...), capture once with `with B.graph(g): static_out = "
             "fn(static_input)`, then per batch: static_input.copy_(batch); g.replay(); "
             "keep static_out.clone()",
    )


# ---- exercise 2: capture_chain ------------------------------------------------------------

def _f1(x: torch.Tensor) -> torch.Tensor:
    return x * 2.0 + 1.0


def _f2(x: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x) * 3.0 - x


def check_capture_chain(capture_chain, *, B=None, trials: int = 3) -> CheckResult:
    """``capture_chain(f1, f2, static_input)``: ``(g1, g2, static_mid, static_out)``, one pool."""
    B = _backend(B)

    def make_inputs(gen: torch.Generator):
        n = int(torch.randint(3, 40, (), generator=gen))
        fresh = [torch.randn(n, generator=gen).to(B.device) for _ in range(3)]
        return torch.zeros(n, device=B.device), fresh

    def reference(static_input, fresh):
        return {"mid": [_f1(x) for x in fresh], "out": [_f2(_f1(x)) for x in fresh],
                "same_pool": True}

    def learner(static_input, fresh):
        try:
            result = capture_chain(_f1, _f2, static_input)
        finally:
            _recover(B)
        if not isinstance(result, (tuple, list)) or len(result) != 4:
            got = type(result).__name__ + (f" of {len(result)}" if isinstance(
                result, (tuple, list)) else "")
            return {"bad": f"expected a tuple (g1, g2, static_mid, static_out), got {got}"}
        g1, g2, mid, out = result
        mids, outs = [], []
        for x in fresh:
            static_input.copy_(x)
            g1.replay()
            g2.replay()
            mids.append(mid.clone())
            outs.append(out.clone())
        try:
            same = tuple(g1.pool()) == tuple(g2.pool())
        except Exception as exc:  # a graph that was never captured
            return {"bad": f"g1.pool() / g2.pool() failed: {exc}"}
        return {"mid": mids, "out": outs, "same_pool": same}

    def compare(expected, actual) -> str | None:
        if "bad" in actual:
            return actual["bad"]
        msg = compare_outputs(expected["mid"], actual["mid"], rtol=1e-5, atol=1e-6,
                              where="static_mid ")
        if msg:
            return msg + " (g1 must record static_mid = f1(static_input))"
        msg = compare_outputs(expected["out"], actual["out"], rtol=1e-5, atol=1e-6,
                              where="static_out ")
        if msg:
            return msg + " (g2 must record static_out = f2(static_mid), reading g1's output)"
        if not actual["same_pool"]:
            return ("the results are right, but g1 and g2 use different memory pools: pass "
                    "pool=g1.pool() (or one B.graph_pool_handle() to both) when capturing g2")
        return None

    return check(
        learner, reference, make_inputs, trials=trials, name="capture_chain", compare=compare,
        hint="pool = B.graph_pool_handle(); capture g1 with `with B.graph(g1, pool=pool):`, "
             "then g2 with the same pool, its input being g1's static output",
    )
