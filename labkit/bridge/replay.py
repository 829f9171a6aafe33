"""The bridge itself: an ``autograd.Function`` whose forward replays a runner's forward
graph and whose backward replays its backward graph (Megatron's ``_CudagraphReplayNode``).

Its two halves are plain functions, :func:`replay_forward` and :func:`replay_backward`, so
that lesson 04's exercises can swap them (``GraphRunner(forward_impl=, backward_impl=)``).
"""

from __future__ import annotations

import enum
from typing import Sequence

import torch

__all__ = ["GraphStatus", "GraphOrderError", "replay_forward", "replay_backward", "ReplayNode"]


class GraphStatus(enum.Enum):
    """What a runner may do next (Megatron's ``_GraphStatus``)."""

    FWD_READY = 0   # set after a backward replay (and initially)
    BWD_READY = 1   # set after a forward replay that autograd will differentiate


class GraphOrderError(RuntimeError):
    """A runner's forward or backward graph was called when the other one was due."""


def _order_error(runner, wanted: str) -> GraphOrderError:
    if wanted == "fwd":
        return GraphOrderError(
            f"{runner.name}: tried to replay the forward graph while its backward graph is "
            "due (status BWD_READY). A second forward replay would overwrite the static "
            "buffers the pending backward still needs: run backward first, or give each "
            "in-flight microbatch its own runner (lesson 05). (A forward that will never "
            "be differentiated belongs under torch.no_grad().)")
    return GraphOrderError(
        f"{runner.name}: tried to replay the backward graph while its forward graph is due "
        "(status FWD_READY): this backward has already run (backward twice through one "
        "forward?) or the forward was never replayed.")


def replay_forward(runner, inputs: Sequence[torch.Tensor]) -> tuple:
    """The forward half of the bridge (Megatron's ``_CudagraphReplayNode.forward``).

    ``inputs`` are the live tensors matching ``runner.input_surface`` (user inputs, then
    the connected parameters). Copy each into its static buffer unless it already lives
    there, replay, and return new tensor objects on the static output buffers.
    """
    if runner.status is not GraphStatus.FWD_READY:
        raise _order_error(runner, "fwd")
    for user, static in zip(inputs, runner.input_surface):
        if user.data_ptr() != static.data_ptr():
            static.copy_(user)
            runner.copies["fwd"] += 1
    runner.fwd_graph.replay()
    runner.replays["fwd"] += 1
    return tuple(o.detach() for o in runner.output_surface)


def replay_backward(runner, grads: Sequence[torch.Tensor | None]) -> tuple:
    """The backward half of the bridge (Megatron's ``_CudagraphReplayNode.backward``).

    ``grads`` are the output-gradients autograd hands in, one per output. Copy them into
    ``runner.static_grad_outputs`` (skipping outputs without a buffer and buffers that
    already are the gradient), replay the backward graph, flip the status back to
    FWD_READY, restore ``grad_added_to_main_grad``, and return one gradient per tensor of
    ``runner.input_surface``: the dgrads as they are, the wgrads cloned.
    """
    if runner.status is not GraphStatus.BWD_READY:
        raise _order_error(runner, "bwd")
    for g, static in zip(grads, runner.static_grad_outputs):
        if static is None:
            continue
        if g is None:
            static.zero_()
        elif g.data_ptr() != static.data_ptr():
            static.copy_(g)
            runner.copies["bwd"] += 1
    runner.bwd_graph.replay()
    runner.replays["bwd"] += 1
    runner.status = GraphStatus.FWD_READY
    if runner.restore_grad_added:
        for p, added in runner.groundtruth_grad_added_to_main_grad.items():
            p.grad_added_to_main_grad = added
    n = runner.num_dgrads
    dgrads = runner.static_grad_inputs[:n]
    if runner.clone_wgrads:
        # the next replay overwrites these buffers: return copies the caller owns
        wgrads = tuple(w.clone() if w is not None else None
                       for w in runner.static_grad_inputs[n:])
    else:   # what torch.cuda.make_graphed_callables returns: fresh tensors on the buffers
        wgrads = tuple(w.detach() if w is not None else None
                       for w in runner.static_grad_inputs[n:])
    return (*dgrads, *wgrads)


class ReplayNode(torch.autograd.Function):
    """The ``autograd.Function`` that joins the two graphs (``_CudagraphReplayNode``).

    Its inputs are the user tensors *and* the connected parameters, so autograd routes
    the wgrads it returns to the parameters' ``AccumulateGrad`` nodes (``.grad``, hooks,
    ``main_grad``) exactly as eager backward would.
    """

    @staticmethod
    def forward(ctx, runner, *inputs):
        ctx.runner = runner
        outs = runner.forward_impl(runner, inputs)
        flags = runner.output_requires_grad
        if not all(flags):
            ctx.mark_non_differentiable(*[o for o, rg in zip(outs, flags) if not rg])
        return outs

    @staticmethod
    def backward(ctx, *grads):
        grads_in = ctx.runner.backward_impl(ctx.runner, grads)
        return (None, *grads_in)
