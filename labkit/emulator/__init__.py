"""A CPU stand-in for CUDA graphs with the same observable behaviour.

``labkit.backend.get("emulated")`` returns this module's objects under the names of
``torch.cuda``'s, so lessons and tests run unchanged on a machine without a GPU. It is
built on a ``TorchDispatchMode`` that records every ATen op during capture (see
``recorder``), a pool allocator that carves memory the way CUDA's caching allocator does
(see ``pool``), and streams that exist only to decide what capture allows (``streams``).

What it reproduces (each rule has a test in ``tests/test_backend_behaviour.py`` that also
runs on a real GPU):

* capture records and does not compute: outputs hold poison (NaN) until the first replay,
  and in-place updates made during capture are applied only by replay;
* replay reads inputs by address (``copy_`` into the static input is seen, rebinding a
  Python name is not) and writes outputs in place (same ``data_ptr``, overwritten);
* Python runs once, at capture: scalars are baked in, side effects happen once;
* forbidden during capture, with CUDA's messages: ``.item()``, ``.tolist()``, printing,
  ``if tensor:``, ``nonzero`` and other data-dependent shapes, ``synchronize()``; capture on
  the default stream; capturing twice into one graph; replaying an empty graph;
* RNG: the default generator advances on every replay; custom generators must be
  registered with ``register_generator_state``;
* memory pools: private per graph or shared, blocks freed by user code reused by later
  captures in the same pool, so out-of-order replay corrupts results as on a GPU;
  ``pool_stats`` reports bytes reserved, allocated and the peak per pool;
* autograd: ``torch.autograd.grad`` inside capture; ``make_graphed_callables`` is
  PyTorch's own implementation running on the emulator.

What it cannot show: the host/device split (there is no second processor: replay runs
the recorded ops on the calling thread, so nothing overlaps) and real GPU timing (launch
costs, kernel times, the speedup a GPU gets). Lessons that need those measure them on a
GPU, or show a clearly labelled simulation.
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
