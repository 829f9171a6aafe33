"""Training through CUDA graphs: a forward and a backward graph per layer, joined to
autograd (lesson 04).

A graph replays kernels and autograd knows nothing about it. A :class:`GraphRunner`
captures a layer's forward and, with ``torch.autograd.grad`` on the forward graph's
outputs, its backward; a :class:`ReplayNode` (an ``autograd.Function``) replays the
forward graph when the layer is called and the backward graph when autograd reaches it.
:func:`make_graphed_callables` puts runners together with the contract of
``torch.cuda.make_graphed_callables``.

After Megatron-LM's ``local`` implementation (``megatron/core/transformer/cuda_graphs.py``):

=============  ================================================================================
module         contents (Megatron)
=============  ================================================================================
``runner``     :class:`GraphRunner` (``_CudaGraphRunner``), :func:`get_connected_params`,
               :func:`capture_stream`, :func:`mismatch_errors` (``get_mismatch_errors``)
``replay``     :class:`ReplayNode` (``_CudagraphReplayNode``) and its halves
               :func:`replay_forward`, :func:`replay_backward`; :class:`GraphStatus`
               (``_GraphStatus``), :class:`GraphOrderError`
``graphed``    :func:`make_graphed_callables`, :class:`GraphedModule`
=============  ================================================================================

Also here under their lesson 04 names: :class:`ArgMeta` and :class:`GraphArgMismatch`
(:mod:`labkit.core.signature`), :func:`attach_main_grad`, :func:`zero_main_grad` and
:class:`FusedLinear` (:mod:`labkit.core.main_grad`).

.. warning::
    A runner's forward graph may replay again only after its backward did: the second
    forward would overwrite the static buffers the first one's backward reads. Calling
    out of turn raises :class:`GraphOrderError`. With pipeline parallelism, give each
    microbatch in flight its own runner (:mod:`labkit.pipeline`).
"""

from labkit.bridge.graphed import GraphedModule, make_graphed_callables
from labkit.bridge.replay import (
    GraphOrderError,
    GraphStatus,
    ReplayNode,
    replay_backward,
    replay_forward,
)
from labkit.bridge.runner import GraphRunner, capture_stream, get_connected_params, mismatch_errors
from labkit.core.main_grad import FusedLinear, attach_main_grad, zero_main_grad
from labkit.core.signature import ArgMetadata as ArgMeta
from labkit.core.signature import GraphArgumentError as GraphArgMismatch

__all__ = [
    "GraphStatus", "GraphOrderError", "GraphArgMismatch", "ArgMeta", "mismatch_errors",
    "get_connected_params", "GraphRunner", "ReplayNode", "replay_forward", "replay_backward",
    "GraphedModule", "make_graphed_callables", "attach_main_grad", "zero_main_grad",
    "FusedLinear", "capture_stream",
]
