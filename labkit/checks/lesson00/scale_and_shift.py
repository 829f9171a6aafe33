"""Lesson 00, exercise ``scale_and_shift``: its checker.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch.overrides import TorchFunctionMode

from labkit.checks import CheckResult, Exercise, compare_outputs

__all__ = ["check_scale_and_shift"]


def _scale_and_shift(x: torch.Tensor, a: float, b: float) -> torch.Tensor:
    return a * x + b


# element-by-element access: what "no Python loop over elements, no .tolist()" forbids
_ELEMENTWISE = {
    "__getitem__": "indexes x element by element (x[i])",
    "unbind": "loops over x (a for loop over a tensor unbinds it)",
    "tolist": "calls .tolist()",
    "item": "calls .item()",
    "numpy": "goes through NumPy (.numpy())",
}


class _ElementAccess(TorchFunctionMode):
    """Records the element-by-element accesses made while it is active."""

    def __init__(self):
        super().__init__()
        self.seen: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        what = _ELEMENTWISE.get(getattr(func, "__name__", ""))
        if what and what not in self.seen:
            self.seen.append(what)
        return func(*args, **(kwargs or {}))


# (a wrong formula, what it means): tried on the trial's inputs when values differ, so the
# message names the mistake made instead of only the largest difference
_MISTAKES = (
    (lambda x, a, b: a * x - b, "b is subtracted: the task adds it (a * x + b)"),
    (lambda x, a, b: b * x + a, "a and b are swapped: x is multiplied by b and a is added"),
    (lambda x, a, b: a * x, "b is never added"),
    (lambda x, a, b: x + b, "x is never multiplied by a"),
    (lambda x, a, b: x * a * b, "b multiplies x instead of being added"),
    (lambda x, a, b: a * (x + b), "b is multiplied by a too: a * (x + b) is not a * x + b"),
    (lambda x, a, b: x + a * b, "a multiplies b instead of x"),
)


EXERCISE = Exercise(
    "scale_and_shift",
    hint="the first line says what differs; check your function against each thing the "
         "task states (the formula, one tensor expression, x's shape, dtype and device)",
    more_hints=("the result is x scaled by a (multiply), then shifted by b (add)",
                "return a * x + b"),
)


class _Seen(NamedTuple):
    """One trial of the learner's function: what it returned, on which inputs, and the
    element-by-element accesses it made."""

    out: object
    inputs: tuple
    elementwise: list


def _loops(expected, seen: _Seen) -> str | None:
    """Element-by-element access is rejected first, whatever the values."""
    if not seen.elementwise:
        return None
    reason = compare_outputs(expected, seen.out, rtol=1e-5, atol=1e-6)
    loop = (f"your function {' and '.join(seen.elementwise)}: the task asks for "
            f"one tensor expression of x, a and b, with no Python loop over elements")
    return f"{reason}; {loop}" if reason and reason.startswith("expected") else loop


def _form(expected, seen: _Seen) -> str | None:
    """Type, shape, dtype, device (not the values), with what changes a dtype or device."""
    reason = compare_outputs(expected, seen.out, rtol=1e-5, atol=1e-6)
    if reason is None or reason.startswith("values differ"):
        return None
    if reason.startswith("dtype"):
        reason += (" (Python floats a and b keep x's dtype; a torch.tensor(...) or "
                   ".float()/.double() changes it)")
    elif reason.startswith("device"):
        reason += " (keep the result where x is: no .cpu() or new tensors elsewhere)"
    return reason


def _values(expected, seen: _Seen) -> str | None:
    """The values, with the wrong formula of :data:`_MISTAKES` they match, if any."""
    reason = compare_outputs(expected, seen.out, rtol=1e-5, atol=1e-6)
    if reason is None:
        return None
    x, a, b = seen.inputs
    for wrong, what in _MISTAKES:
        if torch.allclose(seen.out, wrong(x, a, b), rtol=1e-5, atol=1e-6):
            return f"{reason}; with a={a}, b={b} your result is what happens when {what}"
    return reason


JUDGES = (_loops, _form, _values)


def _make_inputs(device: torch.device):
    def make_inputs(gen: torch.Generator):
        rows = int(torch.randint(1, 6, (), generator=gen))
        cols = int(torch.randint(2, 9, (), generator=gen))
        dtype = (torch.float32, torch.float64)[int(torch.randint(0, 2, (), generator=gen))]
        x = torch.randn(rows, cols, generator=gen, dtype=dtype).to(device)

        def coefficient():
            # away from 0 and ±1, so that a * x and x, or b and 0, cannot be confused
            sign = 1.0 if float(torch.rand((), generator=gen)) < 0.5 else -1.0
            return sign * round(float(torch.empty(()).uniform_(1.25, 3.0, generator=gen)), 3)

        a, b = coefficient(), coefficient()
        while abs(a - b) < 0.25:
            b = coefficient()
        return x, a, b
    return make_inputs


def check_scale_and_shift(fn, *, device: torch.device | str | None = None,
                          trials: int = 3) -> CheckResult:
    """``fn(x, a, b)`` must return ``a * x + b`` as a tensor of x's shape, dtype, device.

    Probes what the exercise states: the value on random shapes and random ``a``, ``b``
    (never 0 or 1, so a missing term shows); x's dtype (float32 or float64) and device
    kept; one tensor expression (element-by-element access through ``x[i]``, iteration,
    ``.tolist()``, ``.item()`` or ``.numpy()`` is rejected).

    ``device`` defaults to the device of ``labkit.backend.get("auto")``.
    """
    if device is None:
        from labkit import backend

        device = backend.get("auto").device

    def learner(x, a, b):
        inputs = (x.clone(), a, b)
        mode = _ElementAccess()
        with mode:
            out = fn(x, a, b)
        return _Seen(out, inputs, mode.seen)

    return EXERCISE.check(learner, _scale_and_shift, _make_inputs(torch.device(device)),
                          trials=trials, judges=JUDGES)
