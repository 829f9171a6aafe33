"""A CPU stand-in for ``torch.cuda``'s graph API, with the same observable behaviour.

``labkit.backend.get("emulated")`` returns these objects under ``torch.cuda``'s names, so
the same code runs without a GPU. Tensors live on a device of the emulator's own, ``emu:0``,
distinct from the host (:mod:`~labkit.emulator.device`), so mixing host and device
tensors, copying between them and reading host scalars follow a GPU's rules. Capture
records the device's ATen ops instead of computing them, runs host work at once
(:mod:`~labkit.emulator.recorder`) and refuses what CUDA refuses (the rules in
:mod:`labkit.core.rules`, and pinned copies that a GPU stages through pageable memory:
:mod:`~labkit.core.staging`); capture allocates from pools carved the way CUDA's
caching allocator carves them (:mod:`~labkit.emulator.pool`), and an allocation outside
the capture that would need ``cudaMalloc`` is refused as ``capture_error_mode`` says
(:mod:`~labkit.emulator.allocator`); streams decide what capture records and whether
every fork is joined back (:mod:`~labkit.emulator.streams`); autocast casts as CUDA's
does (:mod:`~labkit.emulator.autocast`); ``torch.distributed``'s functional collectives are
recorded in capture and run again, over the process group, on every replay
(:mod:`~labkit.emulator.collectives`). ``tests/test_backend_behaviour.py`` runs each
behaviour on both backends.

.. warning::
    No GPU timing and no overlap: replay runs the recorded ops on the calling thread, and
    streams order nothing. Lessons that need those measure on a GPU, or show a clearly
    labelled simulation. A Python device has no pinned allocator and no device generator:
    write ``t.pin_memory()`` and ``B.Generator()`` (see :mod:`~labkit.emulator.device`).
    Autocast does not cache its casts, and the allocator model does not follow frees
    outside graph pools (see those modules).
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
