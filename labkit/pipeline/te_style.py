"""The Transformer Engine path: per layer × microbatch graphs from ``make_graphed_callables``.

Megatron's ``cuda_graph_impl="transformer_engine"`` (``TECudaGraphHelper``,
``megatron/core/transformer/cuda_graphs.py`` L1760) does not record anything. It finds
the graphable layers, builds sample arguments for every layer and microbatch, and hands
them all to TE's ``make_graphed_callables`` (L2389), which captures a forward and a
backward graph per (layer, microbatch) and bridges them with an ``autograd.Function``
(lesson 04's bridge, inside TE). The graphs land in ``layer.cuda_graphs``, one per
microbatch (L2395); before each forward the schedule calls ``set_current_microbatch``
(``schedules.py`` L455) and the layer replays ``cuda_graphs[microbatch % len]``
(``module.py`` L300-305).

Here ``B.make_graphed_callables`` (``torch.cuda``'s own on a GPU) plays TE's part. Two
details of torch's version shape the code:

* it replaces the ``forward`` of the modules it is given, so each (layer, slot) gets a
  thin :class:`_Slot` wrapper module (sharing the layer's parameters) to graph instead
  of the layer itself;
* one call captures its forwards in order and its backwards in *reverse* order in one
  pool, which is right for one microbatch passing through a stack of layers but not for
  1F1B's interleaving across microbatches. So each microbatch slot gets its own call,
  hence its own pool: graphs of different slots never share memory.

torch's graphed callables return their static wgrad buffers without a clone (pytorch
issue #181723, and lesson 04): with ``.grad`` set to ``None`` between steps, the first
microbatch's ``AccumulateGrad`` *steals* a buffer that a later replay overwrites. Keep
``.grad`` allocated instead (:func:`zero_grads_in_place`), so that every microbatch adds
into it and nothing is stolen.
"""

from __future__ import annotations

from typing import Sequence

import torch

__all__ = ["TEStyleLayer", "make_te_style_layers", "zero_grads_in_place"]


class _Slot(torch.nn.Module):
    """``layer`` seen as a separate module, so that graphing it leaves ``layer`` alone."""

    def __init__(self, layer: torch.nn.Module):
        super().__init__()
        self.layer = layer

    def forward(self, *args):
        return self.layer(*args)


class TEStyleLayer:
    """A layer that replays ``graphs[microbatch % len(graphs)]`` (Megatron's
    ``_te_cuda_graph_replay``)."""

    def __init__(self, layer: torch.nn.Module, graphs: Sequence):
        self.layer = layer
        self.cuda_graphs = list(graphs)
        self.current_microbatch = 0
        self.log: list[int] = []

    def set_current_microbatch(self, m: int) -> None:
        self.current_microbatch = m

    def __call__(self, *args):
        i = self.current_microbatch % len(self.cuda_graphs)
        self.log.append(i)
        return self.cuda_graphs[i](*args)


def make_te_style_layers(layers: Sequence[torch.nn.Module], sample_input: torch.Tensor, B,
                         num_slots: int, *, first_input_requires_grad: bool = False,
                         num_warmup_iters: int = 1) -> list[TEStyleLayer]:
    """Graph ``layers`` (a stage, applied in sequence) once per microbatch slot.

    ``sample_input`` fixes the input shape of the first layer; later layers get samples
    of the previous layer's output shape that require grad. ``num_slots`` must be at
    least the number of microbatches the stage holds in flight
    (:func:`~labkit.pipeline.schedule.max_in_flight`), or a slot's buffers would be
    overwritten before its backward ran.
    """
    layers = list(layers)
    with torch.no_grad():
        shapes = []
        x = sample_input
        for layer in layers:
            shapes.append(tuple(x.shape))
            x = layer(x)
    per_slot = []
    for _ in range(num_slots):
        slots = tuple(_Slot(layer) for layer in layers)
        samples = tuple(
            (torch.randn(shapes[i], device=sample_input.device, dtype=sample_input.dtype)
             .requires_grad_(i > 0 or first_input_requires_grad),)
            for i in range(len(layers)))
        per_slot.append(B.make_graphed_callables(slots, samples,
                                                 num_warmup_iters=num_warmup_iters))
    return [TEStyleLayer(layer, [per_slot[k][i] for k in range(num_slots)])
            for i, layer in enumerate(layers)]


def zero_grads_in_place(params) -> None:
    """Zero each ``.grad`` in place, allocating it first if it is ``None``: the workaround
    for torch's uncloned wgrads (``AccumulateGrad`` only steals into an empty ``.grad``)."""
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        else:
            p.grad.zero_()
