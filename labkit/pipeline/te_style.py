"""The Transformer Engine path: per layer × microbatch graphs from ``make_graphed_callables``.

Megatron's ``cuda_graph_impl="transformer_engine"`` (``TECudaGraphHelper``,
``megatron/core/transformer/cuda_graphs.py``) does not record anything. It finds
the graphable layers, builds sample arguments for every layer and microbatch, and hands
them all to TE's ``make_graphed_callables``, which captures a forward and a
backward graph per (layer, microbatch) and bridges them with an ``autograd.Function``
(lesson 04's bridge, inside TE). The graphs land in ``layer.cuda_graphs``, one per
microbatch; before each forward the schedule calls ``set_current_microbatch``
(``schedules.py``) and the layer replays ``cuda_graphs[microbatch % len]``
(``module.py``).

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

import weakref
from typing import Sequence

import torch

from labkit.backend import ensure
from labkit.capture import cleanup_on_failure
from labkit.core.validate import check_int

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
    ``_te_cuda_graph_replay``).

    It also keeps the rule that makes this correct: a slot's forward may replay again
    only after the backward of its previous forward ran (else the new forward overwrites
    the activations that backward still reads, and the gradients come out wrong without
    an error). A forward into a busy slot raises instead; so does an input that requires
    grad when the slot's sample did not (torch's graphed callables would leave its
    ``.grad`` at ``None``).
    """

    def __init__(self, layer: torch.nn.Module, graphs: Sequence,
                 input_requires_grad: bool | None = None):
        self.layer = layer
        self.cuda_graphs = list(graphs)
        if not self.cuda_graphs:
            raise ValueError("TEStyleLayer needs at least one graphed callable (one per slot)")
        self.input_requires_grad = input_requires_grad
        self.current_microbatch = 0
        self.log: list[int] = []
        self._busy: dict[int, int] = {}          # slot -> microbatch whose backward is due

    def set_current_microbatch(self, m: int) -> None:
        check_int("microbatch", m, minimum=0)
        self.current_microbatch = m

    def __call__(self, *args):
        i = self.current_microbatch % len(self.cuda_graphs)
        grad = torch.is_grad_enabled()
        if grad:
            self._check_slot_free(i)
            self._check_input_grad(args)
        self.log.append(i)
        out = self.cuda_graphs[i](*args)
        if grad:
            self._mark_busy(i, out)
        return out

    def _check_slot_free(self, i: int) -> None:
        if i in self._busy:
            n = len(self.cuda_graphs)
            raise RuntimeError(
                f"TE-style {type(self.layer).__name__}: microbatch {self.current_microbatch} "
                f"needs graph slot {i} (= {self.current_microbatch} % {n}), but that slot's "
                f"backward for microbatch {self._busy[i]} has not run yet: replaying it now "
                f"would overwrite the activations that backward reads (gradients silently "
                f"wrong). Build the layers with num_slots >= max_in_flight(order) "
                f"microbatches (now {n}); a forward that will not be differentiated belongs "
                f"under torch.no_grad().")

    def _check_input_grad(self, args) -> None:
        if self.input_requires_grad is False and args and isinstance(args[0], torch.Tensor) \
                and args[0].requires_grad:
            raise RuntimeError(
                f"TE-style {type(self.layer).__name__}: its input requires grad, but the "
                f"graphs were captured from a sample that did not, so torch's graphed "
                f"callable returns no gradient for it and the stages upstream would never "
                f"train. Pass first_input_requires_grad=True to make_te_style_layers for "
                f"every stage but the first.")

    def _mark_busy(self, i: int, out) -> None:
        outs = out if isinstance(out, (tuple, list)) else (out,)
        node = next((o.grad_fn for o in outs if isinstance(o, torch.Tensor)
                     and o.grad_fn is not None), None)
        if node is None:
            return
        m = self.current_microbatch
        self._busy[i] = m

        def free(*_):                 # its backward ran, or its autograd graph was freed
            if self._busy.get(i) == m:
                del self._busy[i]

        node.register_hook(free)
        weakref.finalize(node, free)


def make_te_style_layers(layers: Sequence[torch.nn.Module], sample_input: torch.Tensor, B,
                         num_slots: int, *, first_input_requires_grad: bool = False,
                         num_warmup_iters: int = 1) -> list[TEStyleLayer]:
    """Graph ``layers`` (a stage, applied in sequence) once per microbatch slot.

    ``sample_input`` fixes the input shape of the first layer; later layers get samples
    of the previous layer's output shape that require grad. ``num_slots`` must be at
    least the number of microbatches the stage holds in flight
    (:func:`~labkit.pipeline.schedule.max_in_flight`), or a slot's buffers would be
    overwritten before its backward ran.

    .. warning::
        With too few slots a slot's forward replays for a new microbatch before the old
        one's backward read its buffers, and the gradients come out wrong without an
        error. So :func:`~labkit.pipeline.step.train_step` refuses a schedule that holds
        more microbatches in flight than there are slots, before anything runs, and a
        :class:`TEStyleLayer` refuses a forward into a slot whose backward is still due.
    """
    B = ensure(B)
    layers = _check_te_args(layers, sample_input, B, num_slots, num_warmup_iters)
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
        with cleanup_on_failure(B):
            per_slot.append(B.make_graphed_callables(slots, samples,
                                                     num_warmup_iters=num_warmup_iters))
    return [TEStyleLayer(layer, [per_slot[k][i] for k in range(num_slots)],
                         input_requires_grad=i > 0 or first_input_requires_grad)
            for i, layer in enumerate(layers)]


def _check_te_args(layers, sample_input, B, num_slots, num_warmup_iters) -> list:
    if isinstance(layers, torch.nn.Module) and not isinstance(
            layers, (torch.nn.ModuleList, torch.nn.Sequential)):
        raise TypeError(f"layers must be a list of modules (a stage), got one "
                        f"{type(layers).__name__}: write [layer]")
    layers = list(layers)
    if not layers:
        raise ValueError("make_te_style_layers: layers is empty; give the stage's modules")
    for i, layer in enumerate(layers):
        if not isinstance(layer, torch.nn.Module):
            raise TypeError(f"layers[{i}] is a {type(layer).__name__}; TE-style graphs need "
                            f"torch.nn.Module layers (their parameters get the wgrads)")
    if not isinstance(sample_input, torch.Tensor):
        raise TypeError(f"sample_input must be a tensor of the stage's input shape, got "
                        f"{type(sample_input).__name__}")
    if sample_input.device.type != B.device.type:
        raise ValueError(f"sample_input is on {sample_input.device}, but the {B.name} backend "
                         f"captures on {B.device}: move it first (x.to(B.device))")
    check_int("num_slots (graph slots per layer, >= microbatches in flight)", num_slots,
              minimum=1)
    check_int("num_warmup_iters", num_warmup_iters, minimum=0)
    return layers


def zero_grads_in_place(params) -> None:
    """Zero each ``.grad`` in place, allocating it first if it is ``None``: the workaround
    for torch's uncloned wgrads (``AccumulateGrad`` only steals into an empty ``.grad``)."""
    if isinstance(params, (torch.nn.Module, torch.Tensor)):
        raise TypeError(f"zero_grads_in_place takes an iterable of parameters, got a "
                        f"{type(params).__name__}: pass model.parameters()")
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        else:
            p.grad.zero_()
