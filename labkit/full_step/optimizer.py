"""Gradients at fixed addresses and an optimizer whose whole state stays on the device."""

from __future__ import annotations

from typing import Callable, Iterable

import torch

from labkit import backend

__all__ = ["ensure_grads", "CapturableAdamW", "make_capturable_optimizer"]


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


def _capturing(device: torch.device) -> bool:
    """Is a graph (real or emulated) being captured on the current stream of ``device``?"""
    return backend.get("cuda" if device.type == "cuda" else "emulated") \
        .is_current_stream_capturing()


class CapturableAdamW(torch.optim.Optimizer):
    """AdamW whose entire state (step count included) lives in tensors: graph-capturable.

    The update is ``torch.optim.AdamW``'s::

        step += 1
        p *= 1 - lr * weight_decay
        m = beta1 * m + (1 - beta1) * g
        v = beta2 * v + (1 - beta2) * g²
        p -= lr / (1 - beta1**step) * m / (sqrt(v) / sqrt(1 - beta2**step) + eps)

    with ``beta**step`` computed from the ``step`` tensor on the device, as torch's
    ``AdamW(capturable=True)`` does (which refuses CPU tensors, hence this class for the
    emulator).

    Args:
        params, lr, betas, eps, weight_decay: as for ``torch.optim.AdamW``. Floats are
            baked into a graph at capture; for an LR schedule give ``lr`` as a 0-dim tensor
            on the device and update it in place (``lr.fill_(new)``).
        skip_if: an optional bool scalar tensor (e.g. a trainer's ``found_inf``). When it
            is true at replay time, the step leaves parameters, moments and the step count
            unchanged, decided on the device with ``torch.where`` (GradScaler's "skip the
            step on inf/NaN").

    .. warning::
        The state must exist before capture: created inside a capture, every replay would
        reset it to zeros. The first ``step()`` creates it, so run one eagerly (a warm-up
        step) or call :meth:`init_state`; a step that would create it during a capture
        raises.
    """

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2,
                 skip_if: torch.Tensor | None = None):
        if lr < 0 or eps < 0 or not (0 <= betas[0] < 1 and 0 <= betas[1] < 1):
            raise ValueError(f"invalid AdamW hyper-parameters lr={lr} betas={betas} eps={eps}")
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.skip_if = skip_if

    @torch.no_grad()
    def init_state(self) -> None:
        """Create the state of every parameter now (zeros; step count 0)."""
        for group in self.param_groups:
            for p in group["params"]:
                st = self.state[p]
                if not st:
                    if _capturing(p.device):
                        raise RuntimeError(
                            "CapturableAdamW: the optimizer state does not exist yet and a "
                            "graph is being captured. State created during capture would be "
                            "re-initialised by every replay. Run at least one eager step "
                            "(warmup_steps >= 1) or call opt.init_state() before capturing.")
                    st["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
                    st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)

    @torch.no_grad()
    def step(self, closure: Callable | None = None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.init_state()
        skip = self.skip_if
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            grads = [p.grad for p in params]
            states = [self.state[p] for p in params]
            m = [s["exp_avg"] for s in states]
            v = [s["exp_avg_sq"] for s in states]
            steps = [s["step"] for s in states]
            lr, (beta1, beta2) = group["lr"], group["betas"]
            eps, wd = group["eps"], group["weight_decay"]
            if skip is not None:            # keep the old values to restore on skip
                old = [[t.clone() for t in ts] for ts in (params, m, v)]
            torch._foreach_add_(steps, 1.0)
            if wd != 0:
                torch._foreach_mul_(params, 1.0 - lr * wd)
            torch._foreach_lerp_(m, grads, 1.0 - beta1)
            torch._foreach_mul_(v, beta2)
            torch._foreach_addcmul_(v, grads, grads, value=1.0 - beta2)
            # Bias corrections from the step *tensor*: no host read, so capturable.
            bc1 = [1.0 - torch.pow(beta1, s) for s in steps]
            bc2_sqrt = [torch.sqrt(1.0 - torch.pow(beta2, s)) for s in steps]
            denom = torch._foreach_sqrt(v)
            torch._foreach_div_(denom, bc2_sqrt)
            torch._foreach_add_(denom, eps)
            step_size = [lr / b for b in bc1]                  # lr / (1 - beta1**step)
            update = torch._foreach_div(m, denom)
            torch._foreach_mul_(update, step_size)
            torch._foreach_sub_(params, update)
            if skip is not None:
                for new_list, old_list in zip((params, m, v), old):
                    for new, prev in zip(new_list, old_list):
                        new.copy_(torch.where(skip, prev, new))
                torch._foreach_sub_(steps, [skip.to(s.dtype) for s in steps])
        return loss


def make_capturable_optimizer(params, B, lr: float = 1e-3,
                              betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                              weight_decay: float = 1e-2, impl: str = "auto", **kw):
    """An AdamW that can be captured: torch's ``AdamW(capturable=True, foreach=True)`` on a
    GPU, :class:`CapturableAdamW` on the emulator.

    Args:
        params: the parameters to train.
        B: the backend (``labkit.backend.get(...)``); None means ``get("auto")``.
        lr, betas, eps, weight_decay: as for ``torch.optim.AdamW``.
        impl: ``"auto"`` (the above), ``"torch"`` (GPU only) or ``"labkit"`` (both; needed
            for ``skip_if``, which torch's foreach AdamW does not take).
        **kw: passed on to the optimizer.
    """
    B = backend.ensure(B, "make_capturable_optimizer(params, B)")
    if impl == "auto":
        impl = "torch" if B.name == "cuda" else "labkit"
    if impl == "torch":
        if B.name != "cuda":
            raise ValueError("torch's AdamW(capturable=True) runs on CUDA devices only; "
                             "use impl='labkit' (CapturableAdamW) on the emulator")
        return torch.optim.AdamW(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                 capturable=True, foreach=True, **kw)
    if impl == "labkit":
        return CapturableAdamW(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                               **kw)
    raise ValueError(f"impl must be 'auto', 'torch' or 'labkit', got {impl!r}")
