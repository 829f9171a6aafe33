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

from labkit.backend import ensure
from labkit.core.validate import check_int
from labkit.pipeline.schedule import (
    execution_order,
    gpipe,
    max_in_flight,
    one_f_one_b,
    simulate,
)

__all__ = ["Stage", "split_stages", "train_step", "mse_loss", "SCHEDULES"]

#: The schedules :func:`train_step` runs. Exact, lower-case names: any other string (a
#: different case included) is refused, so that a typo can never run another schedule.
SCHEDULES = {"1f1b": one_f_one_b, "gpipe": gpipe}


def mse_loss(y: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((y - target) ** 2).mean()


class Stage:
    """A pipeline stage: layers (eager modules or graph managers) applied in sequence.

    ``set_current_microbatch(m)`` is passed on to layers that have it (the TE-style path
    picks ``graphs[m % n]`` from it, as Megatron's schedule does before each forward).
    """

    def __init__(self, layers: Sequence[Callable]):
        if isinstance(layers, torch.nn.Module) and not isinstance(
                layers, (torch.nn.ModuleList, torch.nn.Sequential)):
            raise TypeError(f"Stage takes a list of layers, got one {type(layers).__name__}: "
                            f"write Stage([layer])")
        self.layers = list(layers)
        for i, layer in enumerate(self.layers):
            if not callable(layer):
                raise TypeError(f"Stage: layers[{i}] is a {type(layer).__name__}, not a "
                                f"module or function")

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
    layers = list(layers)
    n = len(layers)
    check_int("P (the number of stages)", P, minimum=1)
    if not 1 <= P <= n:
        raise ValueError(f"cannot split {n} layers into {P} stages: each stage needs at "
                         f"least one layer, so P must be in 1..{n}")
    bounds = [round(i * n / P) for i in range(P + 1)]
    return [Stage(layers[bounds[i]:bounds[i + 1]]) for i in range(P)]


# ---- argument checks -------------------------------------------------------------------------

def _schedule_orders(schedule, P: int, M: int) -> list:
    """The per-stage orders of ``schedule``, one of :data:`SCHEDULES` exactly."""
    if not isinstance(schedule, str) or schedule not in SCHEDULES:
        known = ", ".join(repr(k) for k in SCHEDULES)
        near = [k for k in SCHEDULES if isinstance(schedule, str)
                and k == schedule.strip().lower()]
        hint = f" Did you mean {near[0]!r}? Names are lower case." if near else ""
        raise ValueError(f"unknown schedule {schedule!r}: choose one of {known}.{hint}")
    return SCHEDULES[schedule](P, M)


def _check_step_args(stages, inputs, targets, record, B, create_graphs, trace) -> tuple:
    """``(stages, inputs, targets)`` as lists once every argument of :func:`train_step`
    makes sense."""
    for name, seq in (("stages", stages), ("inputs", inputs), ("targets", targets)):
        if isinstance(seq, torch.Tensor):
            raise TypeError(f"train_step: {name} must be a list (one entry per "
                            f"{'stage' if name == 'stages' else 'microbatch'}), got one Tensor "
                            f"of shape {tuple(seq.shape)}; for one microbatch write [x]")
    stages, inputs, targets = list(stages), list(inputs), list(targets)
    if not stages:
        raise ValueError("train_step needs at least one stage (split_stages(layers, P))")
    for i, st in enumerate(stages):
        if not callable(st):
            raise TypeError(f"stages[{i}] is a {type(st).__name__}; stages are Stage objects "
                            f"(split_stages(layers, P))")
    if not inputs:
        raise ValueError("train_step needs at least one microbatch: inputs is empty")
    if len(targets) != len(inputs):
        raise ValueError(f"train_step: {len(inputs)} input microbatches but {len(targets)} "
                         f"targets; give one target per microbatch, in the same order")
    for name, seq in (("inputs", inputs), ("targets", targets)):
        for m, t in enumerate(seq):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"train_step: {name}[{m}] is a {type(t).__name__}, not a "
                                f"tensor (one tensor per microbatch)")
    if record is not None:
        from labkit.pipeline.record import GlobalRecord

        if not isinstance(record, GlobalRecord):
            raise TypeError(f"record must be a GlobalRecord, got {type(record).__name__}")
        if B is not None:
            ensure(B)
        if not record.created and B is None:
            raise ValueError("train_step(record=...) creates the graphs at the end of this "
                             "step and needs the backend: pass B=B")
    if create_graphs is not None and not isinstance(create_graphs, dict):
        raise TypeError("create_graphs is a dict of keyword arguments for "
                        "record.create_cudagraphs (order=, pool=, create=), got "
                        f"{type(create_graphs).__name__}")
    if trace is not None and not isinstance(trace, list):
        raise TypeError(f"trace must be a list to append to, got {type(trace).__name__}")
    return stages, inputs, targets


def _check_te_slots(stages, orders) -> None:
    """A TE-style layer (``cuda_graphs``, one per slot) needs a slot per microbatch that a
    stage holds in flight, or a slot's forward buffers are overwritten before its
    backward read them (gradients silently off)."""
    for s, (stage, order) in enumerate(zip(stages, orders)):
        need = max_in_flight(order)
        for layer in getattr(stage, "layers", ()):
            slots = getattr(layer, "cuda_graphs", None)
            if slots is not None and len(slots) < need:
                raise ValueError(
                    f"stage {s} holds up to {need} microbatches in flight under this "
                    f"schedule, but its TE-style layers have num_slots={len(slots)}: "
                    f"graph slot m % {len(slots)} would be replayed for a new microbatch "
                    f"before its backward ran, and the gradients would be wrong. Build them "
                    f"with num_slots >= max_in_flight(order) = {need} "
                    f"(make_te_style_layers(..., num_slots={need})).")


def _check_recorded_step(stages, P: int, M: int, schedule: str) -> None:
    """Graphs created from a recorded step replay in the order that step ran (they share a
    pool), and with ``reuse=False`` there is one runner per microbatch of that step: a
    step of another shape would replay them out of order, and the results would be wrong
    without an error."""
    records = {}
    for stage in stages:
        for layer in getattr(stage, "layers", ()):
            rec = getattr(layer, "record", None)
            if getattr(rec, "step_signature", None) is not None and rec.created:
                per_mb = records.setdefault(id(rec), [rec, False])
                per_mb[1] |= getattr(layer, "reuse", True) is False
    for rec, per_microbatch in records.values():
        P0, M0, schedule0 = rec.step_signature
        if (P, schedule) != (P0, schedule0) or (per_microbatch and M != M0):
            raise ValueError(
                f"these graphs were recorded from a step of P={P0} stages, M={M0} "
                f"microbatches, schedule {schedule0!r}; this step has P={P}, M={M}, "
                f"schedule {schedule!r}. Graphs that share a pool must replay in the order "
                f"they were recorded (with one runner per microbatch in flight), so every "
                f"step must have the recorded shape. For another shape, record again with a "
                f"new GlobalRecord.")


def _check_input_grad(x: torch.Tensor, s: int, m: int) -> None:
    """A stage's input must get a gradient, or the stages before it never train."""
    if x.grad is None:
        raise RuntimeError(
            f"stage {s} computed no gradient for its input of microbatch {m}, so stages "
            f"0..{s - 1} would never train: a layer of stage {s} cut the autograd graph "
            f"(a detach(), a torch.no_grad() region, or a graphed callable captured from a "
            f"sample that did not require grad).")


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
    stages, inputs, targets = _check_step_args(stages, inputs, targets, record, B,
                                               create_graphs, trace)
    P, M = len(stages), len(inputs)
    orders = _schedule_orders(schedule, P, M)
    _check_te_slots(stages, orders)
    _check_recorded_step(stages, P, M, schedule)
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
                _check_input_grad(x, s, m)
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
        record.step_signature = (P, M, schedule)
    return result
