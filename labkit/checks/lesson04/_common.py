"""Helpers shared by lesson 04's checkers: gradients compared with eager autograd's
(``None`` only against ``None``).
"""

from __future__ import annotations

import torch


def _close(a, b) -> bool:
    if a is None or b is None:
        return a is None and b is None
    if not isinstance(a, torch.Tensor) or a.shape != b.shape:
        return False
    return bool(torch.allclose(a.detach().cpu().float(), b.detach().cpu().float(),
                               rtol=1e-4, atol=1e-5))


def _all_close(xs, ys) -> bool:
    return all(_close(x, y) for x, y in zip(xs, ys) if y is not None)
