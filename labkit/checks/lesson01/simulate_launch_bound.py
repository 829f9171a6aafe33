"""Lesson 01, exercise ``simulate_launch_bound``: its checker.

``simulate_launch_bound(n, launch_us, kernel_us) -> float``: the GPU's idle time in µs
for an eager chain of ``n`` kernels (no gap between kernels: ``gap_us=0``, where the
lesson's ``T.simulate`` adds a default 0.1 µs), from the first launch to the last
kernel's end. Reference: ``gpu_idle_us(simulate(n, launch_us, kernel_us, gap_us=0))``.
"""

from __future__ import annotations

import math
from numbers import Real

import torch

from labkit import timeline as T
from labkit.checks import DEFAULT_TIME_LIMIT, CheckResult, check
from labkit.checks.lesson01._common import _uniform

__all__ = ["check_simulate_launch_bound", "LESSON_GAP_US"]


LESSON_GAP_US = 0.1  # T.simulate's default gap between two kernels (the exercise has none)


def _idle_reference(n: int, launch_us: float, kernel_us: float) -> float:
    return T.gpu_idle_us(T.simulate(n, launch_us, kernel_us, gap_us=0.0))


def check_simulate_launch_bound(fn, *, trials: int = 6,
                                time_limit: float | None = DEFAULT_TIME_LIMIT) -> CheckResult:
    """``fn(n, launch_us, kernel_us)`` must return the GPU idle time (µs) of an eager chain.

    Trials alternate between launch-bound (kernel shorter than a launch) and GPU-bound
    (kernel longer) chains, and include a single kernel, so a formula that holds in one
    regime only is caught.
    """
    last: dict = {}

    def make_inputs(gen: torch.Generator):
        trial = gen.initial_seed()
        n = 1 if trial == 3 else int(torch.randint(2, 40, (), generator=gen))
        launch_us = _uniform(gen, 2.0, 15.0)
        if trial % 2:  # launch-bound: kernels shorter than a launch
            kernel_us = round(launch_us * _uniform(gen, 0.05, 0.8), 2)
        else:          # GPU-bound: kernels longer than a launch
            kernel_us = round(launch_us * _uniform(gen, 1.3, 6.0), 2)
        if trial == 5:  # whole microseconds, as ints: the text does not promise floats
            launch_us, kernel_us = int(round(launch_us)) or 1, int(round(kernel_us)) + 1
        last.update(n=n, launch_us=launch_us, kernel_us=kernel_us)
        return n, launch_us, kernel_us

    def compare(expected: float, actual) -> str | None:
        n, L, K = last["n"], last["launch_us"], last["kernel_us"]
        case = f"n={n}, launch_us={L}, kernel_us={K}"
        regime = "launch-bound" if K < L else "GPU-bound"
        if isinstance(actual, torch.Tensor) and actual.numel() == 1:
            actual = actual.item()
        if not isinstance(actual, Real) or isinstance(actual, bool):
            hint = " (did you forget `return`?)" if actual is None else ""
            return f"expected a number of µs, got {type(actual).__name__}{hint}"
        actual = float(actual)
        if math.isclose(actual, expected, rel_tol=1e-6, abs_tol=1e-6):
            return None
        with_gap = T.gpu_idle_us(T.simulate(n, L, K, gap_us=LESSON_GAP_US))
        no_queue = n * L + K - n * K  # kernel i starts at the end of launch i, always
        why = ""
        if n > 1 and math.isclose(actual, with_gap, rel_tol=1e-6, abs_tol=1e-6):
            why = (f" That is the idle time with T.simulate's default {LESSON_GAP_US} µs gap "
                   "between kernels (section 2's table uses it); the exercise has no gap.")
        elif regime == "GPU-bound" and math.isclose(actual, no_queue, rel_tol=1e-6,
                                                    abs_tol=1e-6):
            why = (" Your kernels start as soon as their launch ends, even while the previous "
                   "kernel still runs: the GPU runs one kernel of a stream at a time, so a "
                   "kernel also waits for the previous one to finish.")
            if actual < 0:
                why += " (A negative idle time is the sign: kernels overlapping each other.)"
        elif actual < 0:
            why = (" Idle time cannot be negative: when kernels outlast launches the queue "
                   "fills up and the GPU waits only for the very first launch.")
        elif regime == "GPU-bound" and math.isclose(actual, 0.0, abs_tol=1e-9):
            why = " Even GPU-bound, the GPU waits for the first launch before kernel 0 can start."
        elif regime == "launch-bound" and math.isclose(actual, expected - L, rel_tol=1e-6,
                                                       abs_tol=1e-6):
            why = (" That is exactly one launch time too little: the GPU also idles while the "
                   "FIRST launch runs. Kernel i can start only when launch i has ENDED, at "
                   "(i+1)*launch_us, not when it starts (i*launch_us); so kernel 0 starts at "
                   "launch_us, and the window starts at 0.")
        elif actual != expected and float(round(expected)) == actual:
            why = (" That is the right idle time rounded to a whole number: return the float "
                   "itself (no round(), int() or //).")
        elif expected > 0 and math.isclose(actual, expected / (expected + n * K),
                                           rel_tol=1e-6, abs_tol=1e-9):
            why = (" That is the idle FRACTION of the window; the exercise asks for the idle "
                   "time in µs.")
        elif math.isclose(actual, expected - K, rel_tol=1e-6, abs_tol=1e-6):
            why = (" You are off by one kernel time: the window runs from the first launch "
                   "to the END of the last kernel, which starts only after the last launch.")
        elif math.isclose(actual, n * L, rel_tol=1e-6, abs_tol=1e-6):
            why = (" That is the CPU's total launch time; subtract the time kernels keep "
                   "the GPU busy.")
        return (f"for {case} ({regime}) the GPU idles {expected:g} µs, you returned "
                f"{actual:g}.{why}")

    return check(
        fn, _idle_reference, make_inputs, trials=trials, name="simulate_launch_bound",
        compare=compare, time_limit=time_limit,
        hint="work the failing case by hand on section 2's two-lane picture, in both regimes "
             "(kernel_us < launch_us and kernel_us > launch_us)",
        more_hints=[
            "kernel i starts when BOTH are done: launch i (it ends at (i+1)*launch_us) and "
            "kernel i-1",
            "loop over the kernels keeping the end of the previous one; idle = end of the "
            "last kernel - n*kernel_us (the window starts at 0, the first launch)",
        ],
    )
