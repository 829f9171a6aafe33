"""The step a whole-step graph captures, and the pieces that keep it free of host reads."""

from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch import nn

__all__ = ["forward_backward", "nonfinite_flag", "phase"]


def forward_backward(model: nn.Module, loss_fn: Callable, microbatches: Sequence) -> torch.Tensor:
    """The forward and backward of every microbatch, in order; returns the mean loss.

    The function a whole-step graph captures (Megatron's ``forward_backward_func`` with no
    pipeline). Each microbatch's loss is scaled by ``1/len(microbatches)`` before
    ``backward``, so the accumulated grads are those of the step's mean loss.

    Args:
        model: the module ``loss_fn`` runs.
        loss_fn: ``loss_fn(model, microbatch)`` returns a scalar loss.
        microbatches: the step's microbatches (at least one).

    .. warning::
        The returned loss is detached; in a graph it is the static output that every
        replay overwrites.
    """
    n = len(microbatches)
    if n == 0:
        raise ValueError("forward_backward got 0 microbatches: a step needs at least one")
    total = None
    for mb in microbatches:
        loss = loss_fn(model, mb) / n
        loss.backward()
        total = loss.detach() if total is None else total + loss.detach()
    return total


def nonfinite_flag(found_inf: torch.Tensor, values: torch.Tensor | Sequence[torch.Tensor]) -> None:
    """Set ``found_inf`` to 1.0 if any value is inf or NaN, in place, with no host read:
    graph-safe. A flag that is already 1.0 stays 1.0.

    Args:
        found_inf: a float32 scalar tensor, 0.0 or 1.0 (``torch.zeros((), device=...)``):
            GradScaler's ``found_inf``, the flag torch's fused AdamW reads to skip a step
            (:func:`~labkit.full_step.make_capturable_optimizer`).
        values: a tensor or a list of tensors (e.g. every gradient of the step).

    .. warning::
        Read ``found_inf`` after the replay (one sync, where you choose). Branching on it
        inside the captured step (``if found_inf: ...``) is a host read, refused in capture.
    """
    if not isinstance(found_inf, torch.Tensor) or found_inf.dtype != torch.float32:
        raise TypeError(f"found_inf must be a float32 tensor (0.0 or 1.0, the flag torch's "
                        f"fused AdamW reads), got "
                        f"{getattr(found_inf, 'dtype', type(found_inf).__name__)}: make it "
                        "with torch.zeros((), device=...)")
    if isinstance(values, torch.Tensor):
        values = [values]
    norms = torch._foreach_norm(list(values))       # inf/NaN anywhere -> inf/NaN norm
    bad = ~torch.isfinite(torch.stack(norms).sum())
    found_inf.logical_or_(bad)                      # into a float tensor: exactly 1.0 or 0.0


def phase(iteration: int, warmup_steps: int, captured: bool) -> str:
    """What a whole-step wrapper does at ``iteration``: ``"eager"``, ``"capture"``
    (then replay, in the same iteration) or ``"replay"``."""
    if iteration < warmup_steps:
        return "eager"
    return "replay" if captured else "capture"
