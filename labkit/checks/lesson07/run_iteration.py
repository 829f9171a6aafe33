"""Lesson 07, exercise ``run_iteration``: its checker.

``run_iteration(it, warmup_steps, ops)``: the capture-at-warmup-step logic of a
whole-step wrapper: eager while ``it < warmup_steps``, capture once at the first
iteration after that *and replay in the same iteration*, replay from then on. Checked
by the sequence of calls it makes over a run of iterations and the losses it returns
(tensors, as a real wrapper's: a clone of the static loss is fine, a float is not).
"""

from __future__ import annotations

import torch

from labkit import full_step as FS
from labkit.checks import CheckResult, Exercise

__all__ = ["check_run_iteration"]


class _Ops:
    """A stand-in for a whole-step wrapper's three actions, logging each call.

    Losses are tensors, as a real wrapper's are: ``eager()`` returns a new scalar tensor
    per call; ``replay()`` returns the graph's static loss, the SAME tensor every time,
    holding the value of the latest replay (so ``.clone()``, ``.detach()`` or
    ``.item()`` on it behave as on a real loss)."""

    def __init__(self):
        self.captured = False
        self.log: list[str] = []
        self._eager = 0
        self._static = torch.zeros(())
        self._replays = 0

    def eager(self):
        self.log.append("eager")
        self._eager += 1
        return torch.tensor(float(self._eager))

    def capture(self):
        self.log.append("capture")
        self.captured = True

    def replay(self):
        if not self.captured:
            raise RuntimeError("Called CUDAGraph::replay without a preceding successful "
                               "capture.")
        self.log.append("replay")
        self._replays += 1
        self._static.fill_(100.0 + self._replays)
        return self._static


def _loss_seen(x):
    """What a returned loss holds now (the static loss is overwritten by later replays)."""
    return x.detach().clone() if isinstance(x, torch.Tensor) else x


def _show_loss(x) -> str:
    if isinstance(x, torch.Tensor):
        return f"a tensor holding {x.item():g}"
    return repr(x)


def _reference_run_iteration(it, warmup_steps, ops):
    what = FS.phase(it, warmup_steps, ops.captured)
    if what == "eager":
        return ops.eager()
    if what == "capture":
        ops.capture()
    return ops.replay()


def _per_iteration(log_steps):
    return [" + ".join(s) if s else "(nothing)" for s in log_steps]


EXERCISE = Exercise(
    "run_iteration",
    hint="compare with section 4 (capture at the warm-up step)",
    more_hints=("Three cases, in this order: a warm-up iteration; the first iteration "
                "after warm-up (no graph yet); every later one. Which ops.* call(s) "
                "does each make, and which loss does it return?",
                "it < warmup_steps → return ops.eager(); otherwise capture first if "
                "not ops.captured, then return ops.replay() (capture computes nothing)"),
)


def _make_inputs(gen: torch.Generator):
    trial = gen.initial_seed()
    warmup = 0 if trial == 2 else int(torch.randint(1, 4, (), generator=gen))
    n = warmup + int(torch.randint(2, 5, (), generator=gen))
    return warmup, n


def _observe(step):
    """The trial: ``step`` run over ``n_iters`` iterations on a fresh :class:`_Ops`; what
    it called at each, and the losses it returned."""
    def run(warmup_steps, n_iters):
        ops = _Ops()
        steps, results = [], []
        for it in range(n_iters):
            start = len(ops.log)
            results.append(_loss_seen(step(it, warmup_steps, ops)))
            steps.append(ops.log[start:])
        return {"calls": _per_iteration(steps), "returns": results, "warmup": warmup_steps}
    return run


def _why_calls(e: str, a: str, it: int, w: int) -> str:
    """What a wrong iteration ``it`` (expected ``e``, did ``a``) means."""
    if e == "capture + replay" and a == "capture":
        return (" Capture records the step and computes nothing: replay right after "
                "capturing, or this iteration's batch is never trained on.")
    if e == "capture + replay" and a == "capture + eager":
        return (" Replay the graph you just captured (ops.replay()), as every later "
                "iteration does: it trains this iteration's batch, and this first "
                "replay is where a broken capture shows.")
    if "capture" in a and "capture" not in e and it > w:
        return " Capture once: after that ops.captured is True, and you only replay."
    if "capture" in a and it < w:
        return (f" Too early: iterations 0..{w - 1} are the eager warm-up steps; "
                f"capture at iteration {w}.")
    if e.startswith("eager") and a != e:
        return f" Iterations below warmup_steps ({w}) run eagerly."
    if "capture" in e and "capture" not in a:
        return f" At iteration {w} the graph does not exist yet: capture it."
    return ""


def _the_calls(expected, actual) -> str | None:
    """The ops.* calls of every iteration, and no iteration missing."""
    w = expected["warmup"]
    for it, (e, a) in enumerate(zip(expected["calls"], actual["calls"])):
        if e != a:
            return (f"warmup_steps={w}, iteration {it}: expected {e!r}, your code did {a!r}."
                    + _why_calls(e, a, it, w))
    if len(expected["calls"]) != len(actual["calls"]):
        return "your code stopped early"
    return None


def _the_losses(expected, actual) -> str | None:
    """Every iteration returns the loss tensor ops gave (not its value on the host)."""
    w = expected["warmup"]
    for it, (e, a) in enumerate(zip(expected["returns"], actual["returns"])):
        if isinstance(a, torch.Tensor) and a.shape == e.shape and torch.equal(a, e):
            continue
        if isinstance(a, float) and a == e.item():
            return (f"warmup_steps={w}, iteration {it}: returned the float {a!r}, the "
                    f"loss's value read on the host (.item()?). Return the loss tensor "
                    f"itself: .item() makes the host wait for the GPU to finish the step, "
                    f"at every iteration, which is the very sync a whole-step graph is "
                    f"there to avoid (read it only when you log)")
        hint = " (did you forget `return`?)" if a is None else ""
        return (f"warmup_steps={w}, iteration {it}: returned {_show_loss(a)}, expected "
                f"{_show_loss(e)}: return the loss that ops.eager() / ops.replay() gives"
                f"{hint}")
    return None


JUDGES = (_the_calls, _the_losses)


def check_run_iteration(fn, *, trials: int = 4) -> CheckResult:
    """``fn(it, warmup_steps, ops)`` must, at iteration ``it``: call and return
    ``ops.eager()`` while ``it < warmup_steps``; otherwise call ``ops.capture()`` if
    ``ops.captured`` is False, then call and return ``ops.replay()``."""
    return EXERCISE.check(_observe(fn), _observe(_reference_run_iteration), _make_inputs,
                          trials=trials, judges=JUDGES)
