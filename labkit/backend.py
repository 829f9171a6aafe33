"""One namespace for CUDA-graph code, on a GPU or on a CPU.

Every lesson, exercise and test is written once against the object that :func:`get`
returns::

    from labkit import backend
    B = backend.get("auto")          # "cuda" when a GPU is there, else "emulated"
    x = torch.zeros(8, device=B.device)
    s = B.Stream()
    with B.stream(s):
        ...
    g = B.CUDAGraph()
    with B.graph(g):
        y = x * 2

The contract (tests outside this repo rely on it; do not rename):

    B.name                      "cuda" | "emulated"
    B.device                    torch.device to put tensors on
    B.CUDAGraph                 capture_begin/capture_end, replay, reset, pool,
                                register_generator_state
    B.graph                     graph(g, pool=None, stream=None, capture_error_mode="global")
    B.graph_pool_handle()
    B.make_graphed_callables(callables, sample_args, ...)
    B.Stream, B.stream(s), B.current_stream(), B.synchronize(), B.is_current_stream_capturing()

For ``"cuda"`` each attribute *is* torch.cuda's own object, so nothing in labkit stands
between a learner and PyTorch on a GPU. For ``"emulated"`` each attribute comes from
:mod:`labkit.emulator`, which reproduces what CUDA graphs do wherever a CPU can show it.

Extras beyond the contract (both backends): ``B.Generator()`` (a generator for random ops
on ``B.device``, also as ``B.Generator(device=B.device)``; a host one on the emulator,
where ``torch.Generator(device=B.device)`` cannot work: see
:func:`labkit.emulator.rng.generator`), ``B.Event`` (timing events),
``B.default_stream()``, ``B.set_stream(s)``, ``B.pool_stats(pool)``,
``B.is_emulated``.
"""

from __future__ import annotations

import functools
import os
import types

import torch

__all__ = ["get", "resolve", "ensure", "recover", "check_graph_options", "NAMES"]

NAMES = ("auto", "cuda", "emulated")

_CONTRACT = (
    "CUDAGraph", "graph", "graph_pool_handle", "make_graphed_callables", "Stream",
    "stream", "current_stream", "synchronize", "is_current_stream_capturing",
)

_cache: dict[str, types.SimpleNamespace] = {}


def _cuda_pool_stats(pool=None) -> dict:
    """Bytes reserved and allocated in one graph pool (or all memory if pool is None)."""
    reserved = allocated = 0
    for seg in torch.cuda.memory_snapshot():
        if pool is not None and tuple(seg.get("segment_pool_id", (0, 0))) != tuple(pool):
            continue
        reserved += seg["total_size"]
        allocated += seg["allocated_size"]
    stats = torch.cuda.memory_stats()
    return {
        "reserved_bytes": reserved,
        "allocated_bytes": allocated,
        # torch keeps no per-pool peak; report the device-wide one and say so.
        "peak_bytes": stats.get("allocated_bytes.all.peak", 0),
        "peak_is_device_wide": True,
    }


def _make_cuda() -> types.SimpleNamespace:
    c = torch.cuda
    device = torch.device("cuda", c.current_device())
    return types.SimpleNamespace(
        name="cuda",
        is_emulated=False,
        device=device,
        Generator=functools.partial(torch.Generator, device=device),
        CUDAGraph=c.CUDAGraph,
        graph=c.graph,
        graph_pool_handle=c.graph_pool_handle,
        make_graphed_callables=c.make_graphed_callables,
        Stream=c.Stream,
        Event=c.Event,
        stream=c.stream,
        set_stream=c.set_stream,
        current_stream=c.current_stream,
        default_stream=c.default_stream,
        synchronize=c.synchronize,
        is_current_stream_capturing=c.is_current_stream_capturing,
        pool_stats=_cuda_pool_stats,
    )


def _make_emulated() -> types.SimpleNamespace:
    from labkit import emulator as e
    from labkit.emulator.device import install
    from labkit.emulator.recorder import refuse_uncapturable_optimizers
    from labkit.emulator.rng import generator

    refuse_uncapturable_optimizers()
    return types.SimpleNamespace(
        name="emulated",
        is_emulated=True,
        device=install(),
        # the emulator's kernels run on host data, so they draw from a host generator
        Generator=generator,
        CUDAGraph=e.CUDAGraph,
        graph=e.graph,
        graph_pool_handle=e.graph_pool_handle,
        make_graphed_callables=e.make_graphed_callables,
        Stream=e.Stream,
        Event=e.Event,
        stream=e.stream,
        set_stream=e.set_stream,
        current_stream=e.current_stream,
        default_stream=e.default_stream,
        synchronize=e.synchronize,
        is_current_stream_capturing=e.is_current_stream_capturing,
        pool_stats=e.pool_stats,
    )


def resolve(name: str = "auto") -> str:
    """The backend name ``get(name)`` would give: "cuda" or "emulated".

    ``LABKIT_BACKEND`` in the environment overrides "auto" (e.g. to force the emulator
    on a GPU machine and compare the two).
    """
    if name not in NAMES:
        raise ValueError(f"unknown backend {name!r}: choose one of {', '.join(NAMES)}")
    if name == "auto":
        name = os.environ.get("LABKIT_BACKEND", "auto")
        if name not in NAMES:
            raise ValueError(f"LABKIT_BACKEND={name!r} is not one of {', '.join(NAMES)}")
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "emulated"
    return name


def get(name: str = "auto") -> types.SimpleNamespace:
    """Return the backend namespace: ``"cuda"``, ``"emulated"`` or ``"auto"``.

    ``"auto"`` picks ``"cuda"`` when ``torch.cuda.is_available()``, else ``"emulated"``.
    Asking for ``"cuda"`` on a machine without a GPU raises a RuntimeError that says so
    and what to use instead.
    """
    name = resolve(name)
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(
            "backend 'cuda' needs a CUDA GPU, and torch.cuda.is_available() is False here "
            f"(torch {torch.__version__}). Use backend.get('emulated') or backend.get('auto') "
            "to run the same code on the CPU emulator; `python -m labkit doctor` says more."
        )
    if name not in _cache:
        _cache[name] = _make_cuda() if name == "cuda" else _make_emulated()
    return _cache[name]


def ensure(B=None, where: str = "B") -> types.SimpleNamespace:
    """``B`` itself if it is a namespace :func:`get` returned; ``get("auto")`` if ``B`` is None.

    Every labkit function that takes a backend calls this, so a wrong one reads the same
    everywhere.

    Raises:
        TypeError: ``B`` is something else, e.g. the name ``"cuda"`` instead of
            ``get("cuda")``.
    """
    if B is None:
        return get("auto")
    if not all(hasattr(B, a) for a in ("CUDAGraph", "graph", "device", "name")):
        hint = f": write B = labkit.backend.get({B!r}) and pass B" if isinstance(B, str) else (
            ": pass B = labkit.backend.get('auto') (or get('emulated'))")
        raise TypeError(f"{where} must be the backend namespace that labkit.backend.get() "
                        f"returns, got {type(B).__name__} {B!r:.40}{hint}")
    return B


def check_graph_options(B, pool=None, stream=None, capture_error_mode: str = "global",
                        where: str = "capture") -> None:
    """Check what ``B.graph`` will be given, before any warm-up runs.

    Args:
        B: the backend namespace.
        pool: None, or a pool handle: the ``(id, 0)`` pair ``B.graph_pool_handle()`` and
            ``g.pool()`` return, the same on both backends.
        stream: None, or a stream made by ``B.Stream()``.
        capture_error_mode: ``"global"``, ``"thread_local"`` or ``"relaxed"``.
        where: the caller, named in the errors.

    Raises:
        TypeError: a pool that is not a handle, a stream of another kind, a mode that is
            not a string. RuntimeError: an unknown mode (torch.cuda's own check).

    .. warning::
        torch checks these in ``capture_begin``, after ``B.graph`` switched to the
        capture stream; a failed check there leaves that stream current. Checked here,
        a typo fails before anything ran.
    """
    from labkit.emulator.graph import check_capture_error_mode
    from labkit.emulator.pool import check_handle

    if pool is not None:
        check_handle(pool, f"{where}(pool=...)")
    if stream is not None and not isinstance(stream, B.Stream):
        raise TypeError(f"{where}(stream=...): expected a stream made by B.Stream() (or None "
                        f"for the default side stream), got {type(stream).__name__}")
    check_capture_error_mode(capture_error_mode)


def recover(B) -> None:
    """Put things back after a capture that raised, so the next cell starts clean.

    Two things outlive a failed capture, on a GPU and on the emulator alike:

    * the capture stream stays current (``graph.__exit__`` raises from ``capture_end``
      before it can switch back), so a later ``capture_begin`` would not notice it is
      "on the default stream";
    * the default generator stays in capture mode (its capture epilogue never ran), so
      the next random op *outside* a capture raises "Offset increment outside graph
      capture encountered unexpectedly". It leaves that mode at the next capture that
      ends well.

    ``recover`` makes the default stream current and runs one tiny capture that ends well.
    labkit's own capture helpers call it themselves when a capture fails.
    """
    import torch

    if not (hasattr(B, "CUDAGraph") and hasattr(B, "set_stream")):
        raise TypeError(f"recover takes the backend namespace that get() returns (B = "
                        f"labkit.backend.get('auto')), got {type(B).__name__} {B!r:.40}")

    B.set_stream(B.default_stream())
    s = B.Stream()
    s.wait_stream(B.current_stream())
    x = torch.zeros(1, device=B.device)
    with B.stream(s):
        x.add_(1)                       # warm up the op outside capture
    B.current_stream().wait_stream(s)
    g = B.CUDAGraph()
    with B.graph(g, stream=s):
        x.add_(1)
    del g
