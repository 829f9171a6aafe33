"""A CPU stand-in for ``torch.cuda``'s graph API, with the same observable behaviour.

``labkit.backend.get("emulated")`` returns these objects under ``torch.cuda``'s names, so
the same code runs without a GPU. Capture records ATen ops instead of computing them
(:mod:`~labkit.emulator.recorder`) and refuses what CUDA refuses (the rules in
:mod:`labkit.core.rules`); capture allocates from pools carved the way CUDA's caching
allocator carves them (:mod:`~labkit.emulator.pool`); streams decide only what capture
allows (:mod:`~labkit.emulator.streams`). ``tests/test_backend_behaviour.py`` runs each
behaviour on both backends.

.. warning::
    There is no host/device split (replay runs the recorded ops on the calling thread, so
    nothing overlaps) and no GPU timing: lessons that need those measure on a GPU, or
    show a clearly labelled simulation.
"""

from labkit.emulator.graph import CUDAGraph, graph, graph_pool_handle, is_current_stream_capturing
from labkit.emulator.graphed import make_graphed_callables
from labkit.emulator.pool import pool_stats
from labkit.emulator.streams import (
                                     Event,
                                     Stream,
                                     current_stream,
                                     default_stream,
                                     set_stream,
                                     stream,
                                     synchronize,
)

__all__ = [
    "CUDAGraph", "graph", "graph_pool_handle", "make_graphed_callables", "Stream", "Event",
    "stream", "set_stream", "current_stream", "default_stream", "synchronize",
    "is_current_stream_capturing",
    "pool_stats",
]
