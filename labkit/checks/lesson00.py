"""Checkers for lesson 00 (start here)."""

from __future__ import annotations

import torch

from labkit.checks import CheckResult, check

__all__ = ["check_scale_and_shift"]


def _scale_and_shift(x: torch.Tensor, a: float, b: float) -> torch.Tensor:
    return a * x + b


def check_scale_and_shift(fn, *, device: torch.device | str | None = None,
                          trials: int = 3) -> CheckResult:
    """``fn(x, a, b)`` must return ``a * x + b`` as a tensor of x's shape, dtype, device.

    ``device`` defaults to the device of ``labkit.backend.get("auto")``.
    """
    if device is None:
        from labkit import backend

        device = backend.get("auto").device
    device = torch.device(device)

    def make_inputs(gen: torch.Generator):
        rows = int(torch.randint(1, 6, (), generator=gen))
        cols = int(torch.randint(1, 9, (), generator=gen))
        x = torch.randn(rows, cols, generator=gen).to(device)
        a = round(float(torch.empty(()).uniform_(-3, 3, generator=gen)), 3)
        b = round(float(torch.empty(()).uniform_(-3, 3, generator=gen)), 3)
        return x, a, b

    return check(
        fn, _scale_and_shift, make_inputs,
        trials=trials, name="scale_and_shift",
        hint="one tensor expression does it: multiply x by a, then add b (no loops, "
             "no new tensors: the result stays on x's device)",
    )
