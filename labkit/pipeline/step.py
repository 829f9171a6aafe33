"""One training step of a pipeline, run in one process in 1F1B order (lesson 05).

This is the shape of Megatron's ``forward_backward_pipelining_without_interleaving``
(``megatron/core/pipeline_parallel/schedules.py``) with the ranks folded into one
process: every stage's ops run in an order that respects the schedule and every
dependency (:func:`~labkit.pipeline.schedule.execution_order`), and "sending" an
activation or a gradient to the next stage is a ``detach().clone()``. A forward of
stage ``s`` takes the previous stage's output as a fresh leaf that requires grad; its
backward is ``torch.autograd.backward(output, grad_from_next_stage)`` and sends the
leaf's ``.grad`` upstream, exactly the calls each rank makes in the real thing
(:mod:`labkit.pipeline.distributed` runs the same ops across processes).

At the end of step 1 Megatron calls ``create_cudagraphs()``; so does :func:`train_step`
when given the record (``create_graphs=`` chooses the order and the pools, to show what
goes wrong otherwise).
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from labkit.pipeline.schedule import execution_order, gpipe, one_f_one_b, simulate

__all__ = ["Stage", "split_stages", "train_step", "mse_loss"]


def mse_loss(y: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((y - target) ** 2).mean()


class Stage:
    """A pipeline stage: layers (eager modules or graph managers) applied in sequence.

    ``set_current_microbatch(m)`` is passed on to layers that have it (the TE-style path
    picks ``graphs[m % n]`` from it, as Megatron's schedule does before each forward).
    """

    def __init__(self, layers: Sequence[Callable]):
        self.layers = list(layers)

    def set_current_microbatch(self, m: int) -> None:
        for layer in self.layers:
            if hasattr(layer, "set_current_microbatch"):
                layer.set_current_microbatch(m)

    def __call__(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def split_stages(layers: Sequence[Callable], P: int) -> list[Stage]:
    """``layers`` cut into ``P`` consecutive stages of (nearly) equal size."""
    n = len(layers)
    if not 1 <= P <= n:
        raise ValueError(f"cannot split {n} layers into {P} stages")
    bounds = [round(i * n / P) for i in range(P + 1)]
    return [Stage(layers[bounds[i]:bounds[i + 1]]) for i in range(P)]


def train_step(stages: Sequence[Stage], inputs: Sequence[torch.Tensor],
               targets: Sequence[torch.Tensor], *, loss_fn: Callable = mse_loss,
               schedule: str = "1f1b", record=None, B=None, create_graphs: dict | None = None,
               trace: list | None = None) -> list[float]:
    """Forward and backward of ``len(inputs)`` microbatches through ``stages``.

    Gradients accumulate into the parameters (``.grad`` or ``main_grad``); the loss of
    each microbatch is divided by the number of microbatches, as Megatron does. Returns
    the per-microbatch losses (floats, read after the step).

    With ``record`` (a :class:`~labkit.pipeline.record.GlobalRecord`) still recording,
    the graphs are created at the end (``record.create_cudagraphs(B, **create_graphs)``).
    ``trace``, if a list, receives ``(stage, kind, microbatch)`` as ops run.
    """
    P, M = len(stages), len(inputs)
    orders = one_f_one_b(P, M) if schedule == "1f1b" else gpipe(P, M)
    seq = execution_order(simulate(orders))
    ins: dict = {}
    outs: dict = {}
    grads: dict = {}
    losses: dict = {}
    for s, kind, m in seq:
        if trace is not None:
            trace.append((s, kind, m))
        if kind == "F":
            if s == 0:
                x = inputs[m]
            else:                                   # recv_forward
                x = outs[(s - 1, m)].detach().clone().requires_grad_()
            stages[s].set_current_microbatch(m)
            y = stages[s](x)
            if s == P - 1:
                loss = loss_fn(y, targets[m]) / M
                losses[m] = loss
                outs[(s, m)] = loss
            else:
                outs[(s, m)] = y
            ins[(s, m)] = x
        else:
            y = outs.pop((s, m))
            if s == P - 1:
                torch.autograd.backward(y)
            else:
                torch.autograd.backward(y, grads.pop((s, m)))
            x = ins.pop((s, m))
            if s > 0:                               # send_backward
                grads[(s - 1, m)] = x.grad.detach().clone()
    result = [losses[m].item() for m in range(M)]
    if record is not None and not record.created:
        # Let step 1's autograd graph die first. Its AccumulateGrad nodes were made on the
        # stream the eager step ran on (on a GPU, usually the legacy default stream); if
        # they were still alive, the captured backward would route parameter grads through
        # them and make the legacy stream wait on the capturing stream, which CUDA refuses
        # ("operation would make the legacy stream depend on a capturing blocking stream").
        losses.clear()
        outs.clear()
        ins.clear()
        x = y = loss = None  # noqa: F841
        record.create_cudagraphs(B, **(create_graphs or {}))
    return result
