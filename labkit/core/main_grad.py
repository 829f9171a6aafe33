"""Megatron-style ``main_grad``: a gradient buffer beside each parameter, and a linear
layer whose backward adds its weight gradient into it (gradient-accumulation fusion).

:func:`attach_main_grad` plays Megatron DDP's part (a hook moves each ``.grad`` into
``main_grad``); :class:`FusedLinear` plays the layer's (``gradient_accumulation_fusion``:
the wgrad goes straight into ``main_grad`` and ``grad_added_to_main_grad`` tells the hook
to skip it). Lesson 04 graphs such layers; see :mod:`labkit.bridge` for what a replay
must restore.
"""

from __future__ import annotations

import torch

__all__ = ["attach_main_grad", "zero_main_grad", "FusedLinear", "check_module"]


def check_module(module, where: str) -> None:
    """``module`` must be a ``torch.nn.Module`` (a generator of parameters is the usual slip)."""
    if not isinstance(module, torch.nn.Module):
        what = ("a generator (model.parameters()?)" if hasattr(module, "__next__")
                else type(module).__name__)
        raise TypeError(f"{where}: module must be a torch.nn.Module, got {what}; pass the "
                        f"model itself")


def attach_main_grad(module: torch.nn.Module, dtype=torch.float32) -> None:
    """Give every trainable parameter a ``main_grad`` buffer, like Megatron's DDP.

    A hook on each parameter's ``AccumulateGrad`` adds ``param.grad`` into ``main_grad``
    and clears ``.grad``, unless the layer's backward already added it itself
    (``grad_added_to_main_grad``: gradient-accumulation fusion, see :class:`FusedLinear`).
    Call :func:`zero_main_grad` at the start of each step.

    Args:
        module: the model; parameters that already have ``main_grad`` are left alone.
        dtype: a floating dtype for the buffers.
    """
    check_module(module, "attach_main_grad")
    if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise TypeError(f"attach_main_grad: dtype must be a floating torch.dtype such as "
                        f"torch.float32, got {dtype!r}")
    for p in module.parameters():
        if not p.requires_grad or hasattr(p, "main_grad"):
            continue
        p.main_grad = torch.zeros_like(p, dtype=dtype)
        p.grad_added_to_main_grad = False

        def hook(param):
            if param.grad is not None and not param.grad_added_to_main_grad:
                param.main_grad.add_(param.grad)
            param.grad = None

        p.register_post_accumulate_grad_hook(hook)


def zero_main_grad(module: torch.nn.Module) -> None:
    """Zero every ``main_grad`` and clear ``grad_added_to_main_grad`` (a new step)."""
    check_module(module, "zero_main_grad")
    for p in module.parameters():
        if hasattr(p, "main_grad"):
            p.main_grad.zero_()
            p.grad_added_to_main_grad = False


class _LinearGradAccumulation(torch.autograd.Function):
    """``y = x W^T + b`` whose backward adds ``dW`` into ``W.main_grad`` itself.

    Megatron's ``LinearWithGradAccumulationAndAsyncCommunication`` with
    ``gradient_accumulation_fusion``: the wgrad GEMM accumulates into ``main_grad`` and
    the layer sets ``grad_added_to_main_grad`` so that the DDP hook skips it.

    .. warning::
        Megatron then returns an uninitialised dummy wgrad; this toy returns the real one,
        so that a forgotten flag shows up as a *doubled* gradient on every backend.
    """

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        return torch.nn.functional.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, gy):
        x, weight = ctx.saved_tensors
        gx = gy @ weight
        gw = gy.reshape(-1, gy.shape[-1]).t() @ x.reshape(-1, x.shape[-1])
        gb = gy.reshape(-1, gy.shape[-1]).sum(0)
        if hasattr(weight, "main_grad"):
            weight.main_grad.add_(gw)
            weight.grad_added_to_main_grad = True
        return gx, gw, gb


class FusedLinear(torch.nn.Linear):
    """``nn.Linear`` with gradient-accumulation fusion into ``weight.main_grad``."""

    def forward(self, x):
        return _LinearGradAccumulation.apply(x, self.weight, self.bias)
