"""Capture and replay on either backend: warm up on a side stream, capture, replay.

:func:`side_stream_warmup` and :func:`capture` do the first two steps; :class:`StaticGraph`
does all three and refuses a call the graph was not captured for; :func:`recorded_kernels`
and :func:`format_pool_stats` show what a graph recorded and what its pool holds.

.. warning::
    A graph keeps writing to the memory it captured. Keep static inputs and outputs
    alive, fill inputs with ``copy_`` (never rebind), and ``clone()`` an output you want
    to keep past the next replay: ``StaticGraph.__call__`` returns the static outputs
    themselves, the same tensors every time.

.. warning::
    Python runs once, at capture: Python scalars are baked into the recorded kernels,
    Python side effects happen once, and control flow keeps the branch it took during
    capture. :mod:`labkit.guards` catches these before they cost a wrong answer.
"""

from __future__ import annotations

import contextlib
import gc
import re
import warnings
from typing import Any, Callable, NamedTuple

import torch
from torch.utils._pytree import keystr, tree_flatten_with_path, tree_map

from labkit import backend
from labkit.backend import check_graph_options, ensure
from labkit.core.signature import (
    GraphArgumentError,
    describe_tree,
    get_mismatch_errors,
    leaf_pairs,
    metadata_tree,
)
from labkit.core.validate import check_int

__all__ = [
    "on_side_stream", "side_stream_warmup", "capture", "cleanup_on_failure", "Captured",
    "fresh_cublas_workspaces", "own_cublas_workspace", "paused_gc", "capturing",
    "StaticGraph",
    "recorded_kernels",
    "short_kernel_name", "format_pool_stats",
    "check_callable", "same_memory", "static_copy",
]


def check_backend(B, where: str = "B") -> None:
    """``B`` must be the namespace :func:`labkit.backend.get` returns (not its name)."""
    ensure(B, where)


# ---- steps 1 and 2 ---------------------------------------------------------------------

@contextlib.contextmanager
def on_side_stream(B, stream=None):
    """Run the body on a side stream (``stream``, else a fresh one), ordered both ways.

    The side stream first waits for the current one (it sees earlier work), and the
    current stream waits for it at the end (later work sees its results). This is where
    warm-up belongs: lazy initialisation and autotuning then never touch the capture.
    """
    check_backend(B, "on_side_stream(B)")
    s = stream if stream is not None else B.Stream()
    s.wait_stream(B.current_stream())
    with B.stream(s):
        yield s
    B.current_stream().wait_stream(s)


def side_stream_warmup(fn: Callable, *args, B=None, iters: int = 3, **kwargs) -> Any:
    """Run ``fn(*args, **kwargs)`` ``iters`` times on a fresh side stream; return the last result.

    The warm-up, written out::

        s = B.Stream()
        s.wait_stream(B.current_stream())      # the side stream sees earlier work
        with B.stream(s):
            for _ in range(iters):
                out = fn(*args)
        B.current_stream().wait_stream(s)      # later work sees the warm-up's results

    (:func:`on_side_stream` is those stream lines as a context manager.)

    Why: the first calls initialise lazily and autotune (cuBLAS, cuDNN, Triton); none of
    that may happen during capture. Running on a side stream keeps autograd's stream state
    off the default (legacy) stream. It does not pre-size the graph's memory: capture
    allocates from the graph's own fresh pool.

    .. warning::
        Warm-up runs ``fn`` for real: in-place updates (a running mean, an optimizer
        step, a counter) happen ``iters`` times. Back up such state first if it matters.
    """
    B = ensure(B)
    check_callable(fn, "side_stream_warmup(fn, ...)")
    check_int("iters", iters, 0)
    out = None
    with on_side_stream(B):
        for _ in range(iters):
            out = fn(*args, **kwargs)
    return out


def fresh_cublas_workspaces(B) -> None:
    """Drop cuBLAS's cached workspaces so that the capture that follows allocates its own.

    cuBLAS keeps one workspace per (handle, stream), allocated by torch's caching allocator
    the first time a matmul runs there. A warm-up on the capture stream caches one from the
    *general* pool, and the graph then records that block, which it does not own.
    ``torch.compile(mode="reduce-overhead")`` frees every cached workspace around its own
    warm-ups and recordings (``clear_cublas_manager`` in ``torch/_inductor/cudagraph_trees.py``);
    a graph that still writes into the freed block corrupts whatever is allocated there next.
    Cleared first, the workspace is allocated during capture, from the graph's pool, and
    lives as long as the graph. A no-op on the emulated backend.

    .. warning::
        The clear is process-wide, like torch's: any other graph that recorded a cached
        workspace is exposed to it exactly as it is to ``torch.compile``.
    """
    if getattr(B, "name", None) == "cuda":
        clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
        if clear is not None:
            clear()


_POOLS_WITH_WORKSPACE: set = set()   # pools whose graphs already own a cuBLAS workspace


def _pool_key(pool):
    return tuple(pool) if isinstance(pool, (list, tuple)) else pool


@contextlib.contextmanager
def own_cublas_workspace(B, g, pool=None):
    """Wrap a capture into ``pool`` so that its graph uses a cuBLAS workspace of its pool.

    Before the first capture into a pool (``pool=None``: a new private one) the cached
    workspaces are dropped (:func:`fresh_cublas_workspaces`), so the capture allocates one
    from the pool; later captures into the same pool, on the same stream, reuse it. It is
    not dropped again for them: that would free a block the pool's earlier graphs still
    write to, and a later capture into the pool could put a tensor there.

    .. warning::
        The first capture into a *new* pool drops the workspace an older pool's graphs
        use; the block goes back to that older pool (which lives as long as its graphs),
        not to the device. Capturing into the older pool again after that can place a
        tensor in the block those graphs still write to: finish one pool's captures before
        starting another's, as labkit's runners do.

    .. warning::
        Warm everything up before a pool's first capture. The workspace is cached per
        (cuBLAS handle, stream), and each thread has its own handle: autograd runs a
        backward on its device thread. A warm-up backward after the first capture caches
        that thread's workspace from the general pool, the pool's later captures record
        it, and the next drop frees it from under them.
    """
    if getattr(B, "name", None) == "cuda" and (
            pool is None or _pool_key(pool) not in _POOLS_WITH_WORKSPACE):
        fresh_cublas_workspaces(B)
    yield
    if getattr(B, "name", None) == "cuda":
        _POOLS_WITH_WORKSPACE.add(_pool_key(g.pool()))


class Captured(NamedTuple):
    """What :func:`capture` returns: the graph and ``fn``'s result, now static outputs."""

    graph: Any
    output: Any


def capture(fn: Callable, *args, B=None, pool=None, stream=None, warmup: int = 3,
            capture_error_mode: str = "global", **kwargs) -> Captured:
    """Warm up ``fn(*args, **kwargs)`` on a side stream, then capture it into a new graph.

    ``args`` must already be the *static inputs*: tensors that stay alive and that you
    will ``copy_`` new data into. Returns ``Captured(graph, output)``; ``output`` is what
    ``fn`` returned during capture, which now holds no result yet (on a GPU: garbage; on
    the emulator: NaN) until the first ``graph.replay()``.

    ``pool`` shares the memory pool of earlier captures (a handle from
    ``B.graph_pool_handle()`` or ``other_graph.pool()``); ``None`` gives the graph a
    private pool. ``stream`` is the capture stream (``None``: torch's default side
    stream). If capture fails, the current stream is restored before the error propagates
    (``B.graph`` alone leaves its capture stream current when ``capture_end`` raises).
    """
    B = ensure(B)
    check_callable(fn, "capture(fn, ...)")
    check_int("warmup", warmup, 0)
    check_graph_options(B, pool, stream, capture_error_mode, "capture")
    if warmup:
        side_stream_warmup(fn, *args, B=B, iters=warmup, **kwargs)
    g = B.CUDAGraph()
    with cleanup_on_failure(B), capturing(B, g, pool=pool, stream=stream,
                                          capture_error_mode=capture_error_mode):
        out = fn(*args, **kwargs)
    return Captured(g, out)


@contextlib.contextmanager
def paused_gc():
    """Pause Python's cyclic garbage collector for the body (a capture), then restore it.

    A graph that only a dead reference cycle still holds (a runner from an earlier cell,
    an exercise's trial) is freed when the collector next runs. If that happens in the
    middle of a capture, its destructor resets the graph, a CUDA call that is not permitted
    while a stream captures: the capture under way is invalidated ("operation failed due
    to a previous error during capture"), though nothing in it was wrong.

    .. warning::
        ``torch.cuda.graph`` used to run ``gc.collect()`` before every capture; it no
        longer does unless ``torch.compiler.config.force_cudagraph_gc`` is set (the
        collection is slow when many graphs are captured in a row), so a collection can
        now fall inside a capture. Every labkit capture runs inside this.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


@contextlib.contextmanager
def capturing(B, g, *, pool=None, stream=None, capture_error_mode: str = "global"):
    """``B.graph(g, ...)`` as every labkit capture runs it: with the collector paused
    (:func:`paused_gc`) and a cuBLAS workspace of the graph's own pool
    (:func:`own_cublas_workspace`). The arguments are ``B.graph``'s."""
    with paused_gc(), own_cublas_workspace(B, g, pool), B.graph(
            g, pool=pool, stream=stream, capture_error_mode=capture_error_mode):
        yield


@contextlib.contextmanager
def cleanup_on_failure(B):
    """Leave a usable process if the body (a capture) raises, then re-raise.

    A failed capture leaves its capture stream current (``B.graph`` raises from
    ``capture_end`` before it switches back) and the default generator in capture mode,
    so the next random op outside a capture fails (see :func:`labkit.backend.recover`).
    This puts both back and makes the stream that was current before the body current
    again. Every labkit function that captures runs its capture inside it.
    """
    previous = B.current_stream()
    try:
        yield
    except BaseException as exc:
        try:
            backend.recover(B)
            B.set_stream(previous)
        except Exception as again:     # e.g. a sticky device error: keep the first error
            if hasattr(exc, "add_note"):
                exc.add_note(f"[labkit] cleaning up after this failed capture also failed "
                             f"({type(again).__name__}: {again}); restart the kernel.")
        raise


# ---- argument checks shared by the capture helpers ----------------------------------------

def check_callable(fn, where: str) -> None:
    """``fn`` can be called, or a TypeError saying ``where`` got what, and to pass the
    callable itself."""
    if not callable(fn):
        raise TypeError(f"{where}: fn must be a function or module to capture, got "
                        f"{type(fn).__name__} {fn!r:.60}. Pass the callable itself, "
                        "not its result (fn, not fn(x)).")


# ---- the runner ------------------------------------------------------------------------

def same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """``a`` is ``b``'s memory seen the same way (address, strides, shape, dtype, device):
    a graph that reads ``b`` reads ``a`` too."""
    return a is b or (a.data_ptr() == b.data_ptr() and a.stride() == b.stride()
                      and a.shape == b.shape and a.dtype == b.dtype and a.device == b.device)


_describe = describe_tree


def static_copy(x):
    """A fresh static buffer holding ``x``'s value (tensors), or ``x`` itself (anything else)."""
    if isinstance(x, torch.Tensor):
        return x.detach().clone()
    return x


class StaticGraph:
    """A captured function with its own static inputs and outputs: capture once, call many times.

    ::

        sg = StaticGraph(mlp, B=B).capture(torch.randn(8, 16, device=B.device))
        y = sg(x)               # copy_ x into the static input, replay, return the output
        kept = y.clone()        # y is overwritten by the next call: clone what you keep

    ``capture(*sample_args)`` allocates one static input per tensor argument (a copy of
    the sample), warms ``fn`` up on a side stream, and captures ``fn(*static_inputs)``
    into a new graph (private pool unless ``pool`` is given), with autograd off: this
    is the inference template (lesson 04 graphs the backward pass). Non-tensor arguments
    are passed through and *baked in*: the graph recorded their effect once.

    ``sg(*args)`` checks the arguments against what was captured, copies each tensor into
    its static input (skipped when you pass the static input itself), replays, and
    returns the static outputs. It refuses, with one message listing every mismatch:

    * a tensor of another shape, dtype or device (``copy_`` would broadcast or convert
      silently and the graph would compute on the wrong data): capture one graph per
      shape (lesson 06 buckets and pads);
    * a different Python value (it was baked in at capture);
    * a different number of arguments;
    * a call or ``replay()`` before ``capture``, and a second ``capture``.

    .. warning::
        The returned tensors are the graph's static outputs: the *same* tensors on every
        call, overwritten in place by the next replay (of this graph, and of any graph
        sharing its pool that reuses the memory). ``clone()`` what you keep.
    """

    def __init__(self, fn: Callable, *, B=None, pool=None, stream=None, warmup: int = 3,
                 name: str | None = None):
        check_callable(fn, type(self).__name__)
        check_int("warmup", warmup, 0)
        self.fn = fn
        self.B = ensure(B)
        check_graph_options(self.B, pool, stream, where=type(self).__name__)
        self.pool_handle = pool
        self.stream = stream
        self.warmup = warmup
        self.name = name or getattr(fn, "__name__", None) or type(fn).__name__
        self.graph = None
        self.static_inputs: tuple = ()
        self.static_outputs: Any = None
        self.arg_metadata: tuple = ()
        self.replays = 0        # how many times the graph ran
        self.copies = 0         # how many input tensors were copied in

    # ---- capture -------------------------------------------------------------------
    @property
    def captured(self) -> bool:
        return self.graph is not None

    def capture(self, *sample_args, **sample_kwargs) -> "StaticGraph":
        """Allocate static inputs like ``sample_args``, warm up, capture; return ``self``."""
        self._refuse_kwargs(sample_kwargs, "capture")
        if self.captured:
            raise RuntimeError(
                f"{self._label()} is already captured. A graph is recorded once; for other "
                f"shapes or values create another StaticGraph (or call reset() first).")
        self._check_devices(sample_args, "args")
        static = tree_map(static_copy, tuple(sample_args))    # nested lists/dicts too
        self.static_outputs = self._record(static, {})
        self.static_inputs = static
        self.arg_metadata = tuple(metadata_tree(a) for a in static)
        return self

    def _record(self, args: tuple, kwargs: dict):
        """Warm up and capture ``fn(*args, **kwargs)`` with autograd off; keep the graph."""
        with torch.no_grad():
            g, out = capture(self.fn, *args, B=self.B, pool=self.pool_handle,
                             stream=self.stream, warmup=self.warmup, **kwargs)
        self.graph = g
        return out

    def _check_devices(self, args, where: str) -> None:
        want = torch.device(self.B.device)
        for path, a in tree_flatten_with_path(args)[0]:
            if isinstance(a, torch.Tensor) and a.device.type != want.type:
                raise ValueError(
                    f"{self._label()}: {where}{keystr(path)} is on {a.device}, but this "
                    f"backend ({self.B.name}) captures on {want}. Move it first: "
                    f"x.to(B.device).")

    def reset(self) -> None:
        """Forget the graph and its static buffers, so ``capture`` may run again."""
        if self.graph is not None:
            self.graph.reset()
        self.graph, self.static_inputs, self.static_outputs = None, (), None
        self.arg_metadata = ()

    # ---- replay --------------------------------------------------------------------
    def replay(self) -> None:
        """Replay the graph on whatever the static inputs hold now (no copies, no checks)."""
        self._require_captured("replay()")
        self.graph.replay()
        self.replays += 1

    def __call__(self, *args, **kwargs):
        """Check ``args``, ``copy_`` them into the static inputs, replay, return the outputs."""
        self._refuse_kwargs(kwargs, "call")
        self._require_captured("calling it")
        errors = get_mismatch_errors(self.arg_metadata, args)
        if errors:
            raise GraphArgumentError(self._label(), errors)
        with torch.no_grad():
            for static, a in leaf_pairs(self.static_inputs, args):
                if isinstance(a, torch.Tensor) and not same_memory(a, static):
                    static.copy_(a)
                    self.copies += 1
        self.replay()
        return self.static_outputs

    def _refuse_kwargs(self, kwargs: dict, what: str) -> None:
        if kwargs:
            raise TypeError(
                f"{self._label()}: StaticGraph takes positional arguments only, got keyword "
                f"argument(s) {', '.join(kwargs)} in {what}. Pass them positionally, in the "
                f"order fn takes them, or use labkit.guards.GuardedGraph, which accepts "
                f"keyword arguments.")

    def _require_captured(self, what: str) -> None:
        if not self.captured:
            raise RuntimeError(
                f"{self._label()} has not been captured yet, so there is nothing to replay "
                f"({what}). Call .capture(*sample_args) first: it warms the function up on "
                f"a side stream, allocates the static inputs and records the graph.")

    # ---- looking inside ------------------------------------------------------------
    def recorded_kernels(self, short: bool = True) -> list[str]:
        """What the graph recorded; see :func:`recorded_kernels` (on a GPU this replays once)."""
        self._require_captured("recorded_kernels()")
        return recorded_kernels(self.graph, self.B, short=short)

    def pool(self):
        """The handle of this graph's memory pool (pass it as ``pool=`` to share it)."""
        self._require_captured("pool()")
        return self.graph.pool()

    def pool_stats(self) -> dict:
        """``B.pool_stats`` of this graph's pool: bytes reserved, allocated, peak."""
        return self.B.pool_stats(self.pool())

    def _label(self) -> str:
        return f"StaticGraph({self.name})"

    def __repr__(self) -> str:
        if not self.captured:
            return f"<{self._label()}: not captured>"
        sig = ", ".join(describe_tree(m) for m in self.arg_metadata)
        return f"<{self._label()}: captured for ({sig}); {self.replays} replays>"


# ---- looking inside a graph -------------------------------------------------------------

_TEMPLATE = re.compile(r"<[^<>]*>")


def short_kernel_name(name: str) -> str:
    """A readable name for a CUDA kernel: ``vectorized_elementwise_kernel[CUDAFunctor_add]``.

    Kernel names from the profiler are demangled C++ signatures, hundreds of characters
    long. This keeps the function name and, for element-wise kernels, the functor that
    says which operation it is. ATen op names (the emulator's) pass through unchanged.
    """
    if not isinstance(name, str):
        raise TypeError(f"short_kernel_name takes a kernel name (str), got "
                        f"{type(name).__name__}")
    if name.startswith("aten.") or name.startswith("<"):
        return name
    s = name.strip()
    if s.startswith("void "):
        s = s[5:]
    functor = re.search(r"(\w*(?:Functor|functor|_kernel_cuda|Op)\w*)", s)
    head = s.split("(")[0]
    while True:                      # drop template arguments, innermost first
        stripped = _TEMPLATE.sub("", head)
        if stripped == head:
            break
        head = stripped
    head = head.split("::")[-1].strip() or s[:60]
    if functor and functor.group(1) not in head:
        head = f"{head}[{functor.group(1).split('::')[-1]}]"
    return head if len(head) <= 80 else head[:77] + "..."


def recorded_kernels(g, B=None, *, short: bool = True) -> list[str]:
    """The kernels a captured graph runs, in order: what capture recorded.

    * emulated backend: ``g.recorded_ops()``, the ATen ops the emulator recorded (one per
      kernel a GPU would launch, e.g. ``aten.addmm.default``), without replaying;
    * cuda backend: the GPU kernels (and memcpy/memset) of **one replay**, read from
      ``torch.profiler``; ``short`` shortens the C++ names (:func:`short_kernel_name`).

    .. warning::
        On a GPU this *replays the graph once* to observe it: the static outputs are
        overwritten and registered generators advance, as with any replay. Names differ
        between the backends (ATen ops vs. CUDA kernels, and one op may launch several
        kernels), so compare counts and shapes of the lists, not the strings.
    """
    B = ensure(B)
    if isinstance(g, StaticGraph):
        g = g.graph if g.captured else g._require_captured("recorded_kernels()")
    if not isinstance(g, B.CUDAGraph):
        raise TypeError(f"recorded_kernels needs a {B.name} CUDAGraph (or a StaticGraph), "
                        f"got {type(g).__name__}")
    if getattr(B, "is_emulated", B.name == "emulated"):
        if not g._has_graph:
            raise RuntimeError("recorded_kernels: this graph has not been captured (or its "
                               "capture failed), so it recorded nothing. Capture it first.")
        return list(g.recorded_ops())
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    B.synchronize()
    with warnings.catch_warnings():
        # torch.profiler may warn about its own event bookkeeping: keep it out of lessons
        warnings.filterwarnings("ignore", message=".*Profiler clears events.*")
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            g.replay()
            B.synchronize()
    device_events = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    device_events.sort(key=lambda e: e.time_range.start)
    names = [e.name for e in device_events]
    return [short_kernel_name(n) for n in names] if short else names


def format_pool_stats(stats: dict, label: str = "pool") -> str:
    """One line for ``B.pool_stats(handle)``: reserved, allocated and peak, in KiB/MiB.

    *Reserved* is what the pool took from the device (whole segments: 2 MiB for small
    blocks, 20 MiB or more for large ones); *allocated* is what live tensors use now;
    freed blocks stay reserved by the pool so a later capture into the same pool can reuse
    them. On a GPU torch keeps no per-pool peak, so the peak there is device-wide.
    """
    if not isinstance(stats, dict):
        raise TypeError(f"format_pool_stats needs the dict B.pool_stats(handle) returns, got "
                        f"{type(stats).__name__}")

    def size(n: int) -> str:
        return f"{n / 2**20:.2f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"

    peak = size(stats.get("peak_bytes", 0))
    if stats.get("peak_is_device_wide"):
        peak += " (device-wide)"
    return (f"{label}: reserved {size(stats.get('reserved_bytes', 0))}, "
            f"allocated {size(stats.get('allocated_bytes', 0))}, peak {peak}")
