"""Lesson 01, exercise ``simulate_launch_bound``: its checker.

``simulate_launch_bound(n, launch_us, kernel_us) -> float``: the GPU's idle time in µs
for an eager chain of ``n`` kernels (no gap between kernels: ``gap_us=0``, where the
lesson's ``T.simulate`` adds a default 0.1 µs), from the first launch to the last
kernel's end. Reference: ``gpu_idle_us(simulate(n, launch_us, kernel_us, gap_us=0))``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from numbers import Real
from typing import NamedTuple

import torch

from labkit import timeline as T
from labkit.checks import DEFAULT_TIME_LIMIT, CheckResult, Exercise
from labkit.checks.lesson01._common import _uniform

__all__ = ["check_simulate_launch_bound", "LESSON_GAP_US"]


LESSON_GAP_US = 0.1  # T.simulate's default gap between two kernels (the exercise has none)


def _idle_reference(n: int, launch_us: float, kernel_us: float) -> float:
    return T.gpu_idle_us(T.simulate(n, launch_us, kernel_us, gap_us=0.0))


EXERCISE = Exercise(
    "simulate_launch_bound",
    hint="work the failing case by hand on section 2's two-lane picture, in both regimes "
         "(kernel_us < launch_us and kernel_us > launch_us)",
    more_hints=(
        "kernel i starts when BOTH are done: launch i (it ends at (i+1)*launch_us) and "
        "kernel i-1",
        "loop over the kernels keeping the end of the previous one; idle = end of the "
        "last kernel - n*kernel_us (the window starts at 0, the first launch)",
    ),
)


class _Case(NamedTuple):
    """A trial's chain and its right answer (what the reference returns)."""

    n: int
    L: float  # launch_us
    K: float  # kernel_us
    idle: float

    @property
    def regime(self) -> str:
        return "launch-bound" if self.K < self.L else "GPU-bound"


def _reference(n: int, launch_us: float, kernel_us: float) -> _Case:
    return _Case(n, launch_us, kernel_us, _idle_reference(n, launch_us, kernel_us))


def _close(a: float, b: float, abs_tol: float = 1e-6) -> bool:
    return math.isclose(a, b, rel_tol=1e-6, abs_tol=abs_tol)


def _no_queue(c: _Case) -> float:
    return c.n * c.L + c.K - c.n * c.K  # kernel i starts at the end of launch i, always


_QUEUE = (" Your kernels start as soon as their launch ends, even while the previous kernel "
          "still runs: the GPU runs one kernel of a stream at a time, so a kernel also waits "
          "for the previous one to finish.")

#: (the wrong answer's test, what it means), first match wins: a wrong idle time is
#: compared with what each mistake the lesson has seen returns
_MISTAKES: tuple[tuple[Callable[[_Case, float], bool], str], ...] = (
    (lambda c, got: c.n > 1 and _close(got, T.gpu_idle_us(
        T.simulate(c.n, c.L, c.K, gap_us=LESSON_GAP_US))),
     f" That is the idle time with T.simulate's default {LESSON_GAP_US} µs gap between "
     "kernels (section 2's table uses it); the exercise has no gap."),
    (lambda c, got: c.regime == "GPU-bound" and _close(got, _no_queue(c)) and got < 0,
     _QUEUE + " (A negative idle time is the sign: kernels overlapping each other.)"),
    (lambda c, got: c.regime == "GPU-bound" and _close(got, _no_queue(c)), _QUEUE),
    (lambda c, got: got < 0,
     " Idle time cannot be negative: when kernels outlast launches the queue fills up and "
     "the GPU waits only for the very first launch."),
    (lambda c, got: c.regime == "GPU-bound" and math.isclose(got, 0.0, abs_tol=1e-9),
     " Even GPU-bound, the GPU waits for the first launch before kernel 0 can start."),
    (lambda c, got: c.regime == "launch-bound" and _close(got, c.idle - c.L),
     " That is exactly one launch time too little: the GPU also idles while the FIRST "
     "launch runs. Kernel i can start only when launch i has ENDED, at (i+1)*launch_us, "
     "not when it starts (i*launch_us); so kernel 0 starts at launch_us, and the window "
     "starts at 0."),
    (lambda c, got: got != c.idle and float(round(c.idle)) == got,
     " That is the right idle time rounded to a whole number: return the float itself "
     "(no round(), int() or //)."),
    (lambda c, got: c.idle > 0 and _close(got, c.idle / (c.idle + c.n * c.K), abs_tol=1e-9),
     " That is the idle FRACTION of the window; the exercise asks for the idle time in µs."),
    (lambda c, got: _close(got, c.idle - c.K),
     " You are off by one kernel time: the window runs from the first launch to the END of "
     "the last kernel, which starts only after the last launch."),
    (lambda c, got: _close(got, c.n * c.L),
     " That is the CPU's total launch time; subtract the time kernels keep the GPU busy."),
)


def _as_number(actual):
    if isinstance(actual, torch.Tensor) and actual.numel() == 1:
        return actual.item()
    return actual


def _a_number(c: _Case, actual) -> str | None:
    actual = _as_number(actual)
    if not isinstance(actual, Real) or isinstance(actual, bool):
        hint = " (did you forget `return`?)" if actual is None else ""
        return f"expected a number of µs, got {type(actual).__name__}{hint}"
    return None


def _the_idle_time(c: _Case, actual) -> str | None:
    got = float(_as_number(actual))
    if _close(got, c.idle):
        return None
    why = next((text for wrong, text in _MISTAKES if wrong(c, got)), "")
    return (f"for n={c.n}, launch_us={c.L}, kernel_us={c.K} ({c.regime}) the GPU idles "
            f"{c.idle:g} µs, you returned {got:g}.{why}")


JUDGES = (_a_number, _the_idle_time)


def _make_inputs(gen: torch.Generator):
    trial = gen.initial_seed()
    n = 1 if trial == 3 else int(torch.randint(2, 40, (), generator=gen))
    launch_us = _uniform(gen, 2.0, 15.0)
    if trial % 2:  # launch-bound: kernels shorter than a launch
        kernel_us = round(launch_us * _uniform(gen, 0.05, 0.8), 2)
    else:          # GPU-bound: kernels longer than a launch
        kernel_us = round(launch_us * _uniform(gen, 1.3, 6.0), 2)
    if trial == 5:  # whole microseconds, as ints: the text does not promise floats
        launch_us, kernel_us = int(round(launch_us)) or 1, int(round(kernel_us)) + 1
    return n, launch_us, kernel_us


def check_simulate_launch_bound(fn, *, trials: int = 6,
                                time_limit: float | None = DEFAULT_TIME_LIMIT) -> CheckResult:
    """``fn(n, launch_us, kernel_us)`` must return the GPU idle time (µs) of an eager chain.

    Trials alternate between launch-bound (kernel shorter than a launch) and GPU-bound
    (kernel longer) chains, and include a single kernel, so a formula that holds in one
    regime only is caught.
    """
    return EXERCISE.check(fn, _reference, _make_inputs, trials=trials, judges=JUDGES,
                          time_limit=time_limit)
