"""Gradients at fixed addresses, and torch's AdamW built so that a graph can capture its step."""

from __future__ import annotations

from typing import Iterable

import torch

from labkit import backend

__all__ = ["ensure_grads", "make_capturable_optimizer", "check_found_inf",
           "require_optimizer_state"]


def ensure_grads(params: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """Give every parameter a zeroed ``.grad`` now, outside any capture; return the grads.

    Backward accumulates into an existing ``.grad`` in place, so from then on the grads
    keep their addresses and a captured backward writes into them on every replay.

    .. warning::
        Zero them in place before each step (``torch._foreach_zero_(grads)``, or
        ``opt.zero_grad(set_to_none=False)``), never set them to ``None``: the next
        backward would allocate new ones that no graph reads. (PyTorch's whole-network
        example does the opposite, ``zero_grad(set_to_none=True)`` before capture, so that
        backward allocates ``.grad`` from the graph's pool: that works as long as nothing
        resets them afterwards.)
    """
    grads = []
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        grads.append(p.grad)
    return grads


def check_found_inf(found_inf, device: torch.device, where: str) -> torch.Tensor:
    """Return ``found_inf`` if it is the flag torch's fused AdamW reads, else raise.

    That flag is GradScaler's ``found_inf``: a float32 scalar on the parameters' device,
    1.0 to skip the step, 0.0 to take it. The fused kernel reads it as a ``float``, and
    ``torch.optim.adam._fused_adam`` subtracts it from every step count afterwards: a
    bool flag fails inside the kernel, and ``_fused_adam`` would copy a flag on the host
    to the device inside every step, a copy a capture refuses.

    Args:
        found_inf: the flag to check.
        device: the device of the parameters (``B.device``).
        where: the call, for the message (``"make_capturable_optimizer"``).

    Raises:
        TypeError: not a float32 tensor.
        ValueError: not 0-dim, or on another device.
    """
    make = f"torch.zeros((), device={str(device)!r})"
    what = ("the flag torch's fused AdamW reads: 1.0 skips the step, 0.0 takes it, as "
            "GradScaler's found_inf")
    if not isinstance(found_inf, torch.Tensor) or found_inf.dtype != torch.float32:
        got = (f"a {found_inf.dtype} tensor" if isinstance(found_inf, torch.Tensor)
               else f"a {type(found_inf).__name__}")
        raise TypeError(f"{where}: found_inf must be a float32 tensor ({what}), got {got}: "
                        f"make it with {make}")
    if found_inf.dim() != 0 or found_inf.device != device:
        raise ValueError(f"{where}: found_inf must be a 0-dim tensor on {device} ({what}), "
                         f"got shape {tuple(found_inf.shape)} on {found_inf.device}: make it "
                         f"with {make}")
    return found_inf


def make_capturable_optimizer(params, B, lr: float | torch.Tensor = 1e-3,
                              betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                              weight_decay: float = 1e-2,
                              found_inf: torch.Tensor | None = None,
                              **kw) -> torch.optim.AdamW:
    """torch's ``AdamW`` with its whole state on the device, so a graph can capture its step.

    ``capturable=True`` keeps the step count on the device and computes the bias
    corrections from it with tensor ops; without it the count lives on the host and a
    captured step would bake it in (torch refuses that capture on a GPU).

    * ``found_inf=None``: ``AdamW(capturable=True, foreach=True)``, the multi-tensor
      update (``torch.optim.adam._multi_tensor_adam``).
    * ``found_inf=flag``: ``AdamW(capturable=True, fused=True)`` with ``opt.found_inf =
      flag``, the attribute ``GradScaler.step`` sets on optimizers that declare
      ``_step_supports_amp_scaling`` (torch's fused ones do). ``AdamW.step`` hands it to
      ``torch.optim.adam._fused_adam``, whose kernel leaves parameters and moments alone
      when the flag is 1.0 and which then subtracts the flag from every step count: the
      skip is decided on the device, at every replay, with no host read. (The foreach
      update has no such input: ``GradScaler`` skips its step on the host, in
      ``GradScaler._maybe_opt_step``, with ``found_inf.item()``, which no capture allows.)

    Args:
        params: the parameters to train.
        B: the backend (``labkit.backend.get(...)``); None means ``get("auto")``.
        lr, betas, eps, weight_decay: as for ``torch.optim.AdamW``. A float ``lr`` is
            baked into a graph at capture; for an LR schedule give a 0-dim tensor on
            ``B.device`` and update it in place (``lr.fill_(new)``).
        found_inf: the flag that skips a step (see above): a float32 0-dim tensor on
            ``B.device``, ``torch.zeros((), device=B.device)``, set to exactly 1.0 for a
            step to skip (``flag.logical_or_(bad)`` writes 1.0 or 0.0; a count such as
            2.0 would update the weights and take 2 off the step count) and back to 0.0
            before the next one. :class:`~labkit.full_step.FullStepTrainer` does both.
        **kw: passed on to ``torch.optim.AdamW``.

    .. warning::
        Keep ``torch.amp.GradScaler`` away from this optimizer: ``GradScaler.step`` sets
        ``opt.found_inf`` to its own flag before the step and deletes the attribute after
        it, so the flag given here would be gone.
    """
    B = backend.ensure(B, "make_capturable_optimizer(params, B)")
    if found_inf is None:
        return torch.optim.AdamW(params, lr=lr, betas=betas, eps=eps,
                                 weight_decay=weight_decay, capturable=True, foreach=True, **kw)
    check_found_inf(found_inf, B.device, "make_capturable_optimizer")
    opt = torch.optim.AdamW(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                            capturable=True, fused=True, **kw)
    opt.found_inf = found_inf
    return opt


def require_optimizer_state(optimizer: torch.optim.Optimizer, warmup_steps: int) -> None:
    """Raise unless the state of ``optimizer`` exists for every parameter with a gradient.

    An optimizer creates its state (AdamW: step count and moments) in its first ``step()``.
    Inside a capture those ``zeros`` are recorded too, and every replay would reset the
    state (silently wrong training): torch does not refuse that, so labkit does, before
    capturing. Optimizers without state (plain SGD) pass.

    Args:
        optimizer: the optimizer about to be captured.
        warmup_steps: the eager steps that were to create the state, for the message.
    """
    stateful = any("capturable" in g or g.get("momentum", 0) for g in optimizer.param_groups)
    if not stateful:
        return
    with_grad = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
    missing = sum(1 for p in with_grad if not optimizer.state.get(p))
    if not missing:
        return
    fix = ("Use warmup_steps >= 1, or run one eager optimizer step first." if warmup_steps == 0
           else f"The {warmup_steps} eager warm-up step(s) did not create it: give every "
                "parameter a .grad before them (FS.ensure_grads).")
    raise ValueError(
        f"warmup_steps={warmup_steps}, and the state of {type(optimizer).__name__} does not "
        f"exist yet for {missing} of its {len(with_grad)} parameters with a gradient: the "
        "first step would create it inside the capture, and every replay would reset it to "
        f"zeros (silently wrong training). {fix}")
