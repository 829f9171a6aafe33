"""``CUDAGraph``, ``graph``, ``graph_pool_handle`` and ``is_current_stream_capturing``.

The same API and the same rules as ``torch.cuda``'s, checked in the same places with the
same messages (read off torch 2.11 on an H200), so code written against the backend
namespace behaves alike on both.
"""

from __future__ import annotations

import torch

import labkit.emulator.allocator as _allocator
import labkit.emulator.pool as _pool
import labkit.emulator.streams as _streams
from labkit.emulator.recorder import Capture, StuckGeneratorMode, run_steps
from labkit.emulator.state import (
    CAPTURE_INVALIDATED,
    CAPTURE_UNJOINED,
    active_capture,
    capture_error,
    refuse_device_sync,
)
from labkit.emulator.streams import Stream, current_stream, default_stream, synchronize

__all__ = ["CUDAGraph", "graph", "graph_pool_handle", "is_current_stream_capturing"]


_stuck_mode: StuckGeneratorMode | None = None


def _stuck_generator(stuck: bool) -> None:
    """Enter or leave the GPU's "generator left in capture mode" state (see recover())."""
    global _stuck_mode
    if stuck and _stuck_mode is None:
        _stuck_mode = StuckGeneratorMode()
        _stuck_mode.__enter__()
    elif not stuck and _stuck_mode is not None:
        mode, _stuck_mode = _stuck_mode, None
        try:
            mode.__exit__(None, None, None)
        except Exception:        # not on top of the mode stack: leave it be, harmlessly
            pass


def graph_pool_handle() -> tuple[int, int]:
    """An opaque token naming a new graph memory pool, to share between captures.

    Graphs captured with the same ``pool`` share memory: a block one of them frees can
    be reused by a later capture. That saves memory only if the graphs are replayed in
    the order they were captured (see lesson 05).
    """
    return _pool.new_handle()


def is_current_stream_capturing() -> bool:
    """True while a capture is underway on the current stream, False otherwise."""
    cap = active_capture()
    return cap is not None and cap.records_now()


class CUDAGraph:
    """A recorded sequence of ATen ops that ``replay()`` runs again on the same memory.

    Emulates ``torch.cuda.CUDAGraph`` on a CPU. What it reproduces: capture records and
    does not compute; replay re-runs every recorded op in place on the same storage,
    reading inputs by address; outputs are static and overwritten by each replay; Python
    runs once, at capture; CPU syncs and data-dependent shapes are refused; RNG advances
    per replay (custom generators must be registered); allocations come from a private
    pool that graphs may share, with the same reuse hazards as on a GPU.

    Only device work is recorded: host work during capture runs at once, a 0-dim host
    tensor is read once and baked in, and a pinned ``non_blocking`` copy re-reads its host
    buffer on every replay; work on a stream outside the capture runs at once, and a
    stream forked into it must be joined back before ``capture_end``.

    ``capture_error_mode`` decides, as on a GPU, whose ``cudaMalloc`` is refused while the
    capture runs: an allocation on a stream outside the capture that no cached block can
    hold is refused from the capturing thread under ``"global"`` and ``"thread_local"``,
    and from other threads under ``"global"`` (:mod:`~labkit.emulator.allocator`, which
    approximates the caching allocator's per-stream cache). A device-wide
    ``synchronize()`` from another thread is refused in every mode.

    What it cannot show: overlap (on a CPU the "kernels" run when replay is called, on
    the calling thread) and GPU timing: ``python -m
    labkit.bench.emulator_cost`` measures what a replay costs on the CPU, which is no
    GPU's figure. Other threads' kernels are never recorded (a capture watches its own
    thread), as on a GPU.

    .. warning::
        As on a GPU, a graph keeps writing to the memory it captured. Keep static inputs
        and outputs alive, fill inputs with ``copy_`` (never rebind), and ``clone()`` an
        output you want to keep past the next replay.
    """

    def __init__(self, keep_graph: bool = False):
        self.keep_graph = keep_graph      # as torch's: the graph stays describable after capture
        self._steps: list = []
        self._ops: list[str] = []
        self._dependencies: list[tuple[int, ...]] = []
        self._pool: _pool.MemPool | None = None
        self._capture: Capture | None = None
        self._has_graph = False
        self._generators: list[torch.Generator] = []

    # ---- capture ----------------------------------------------------------------------
    def capture_begin(self, pool=None, capture_error_mode: str = "global", **kwargs) -> None:
        """Begin capturing on the current stream (prefer the ``graph`` context manager).

        ``capture_error_mode`` is checked as torch checks it, first; it decides whose
        allocations outside the capture are refused (see the class docstring).
        """
        check_capture_error_mode(capture_error_mode)     # first, as torch's binding does
        if self._has_graph or self._capture is not None:
            raise RuntimeError("This CUDAGraph instance already owns a captured graph. "
                               "To capture a new graph, create a new instance.")
        handle = (_pool.check_handle(pool, "CUDAGraph.capture_begin") if pool is not None
                  else None)
        s = current_stream()
        if s == default_stream():
            raise RuntimeError("CUDA graphs must be captured on a non-default stream. "
                               "(However, after capture, it's ok to replay them on the "
                               "default stream.)")
        handle = handle if handle is not None else _pool.new_handle()
        mp = _pool.pool_for(handle)
        cap = Capture(self, mp, s, capture_error_mode)
        cap.start()
        mp.use_count += 1
        self._pool, self._capture = mp, cap

    def capture_end(self) -> None:
        """End the capture begun by ``capture_begin``."""
        cap = self._capture
        if cap is None:
            raise RuntimeError("capture_end() called without a capture in progress")
        cap.stop()
        self._capture = None
        unjoined = cap.unjoined() if cap.invalid is None else []
        if unjoined:
            _pool.release_pool(self._pool)
            self._pool = None
            _stuck_generator(True)
            raise capture_error(CAPTURE_UNJOINED, "cudaErrorStreamCaptureUnjoined",
                                f"{len(unjoined)} stream(s) joined this capture (wait_stream "
                                "on the capturing stream) and issued work that the capturing "
                                "stream never waited for: end each fork with "
                                "capturing_stream.wait_stream(side_stream).")
        if cap.invalid is not None:
            _pool.release_pool(self._pool)
            self._pool = None
            _stuck_generator(True)
            raise capture_error(CAPTURE_INVALIDATED, "cudaErrorStreamCaptureInvalidated",
                                f"an earlier op in this capture ({cap.invalid}) was refused;"
                                " the graph was not created.")
        self._steps, self._ops = cap.steps, cap.ops
        if self.keep_graph:
            self._dependencies = [tuple(p) for p in cap.parents]
        self._has_graph = True
        _stuck_generator(False)

    def register_generator_state(self, state) -> None:
        """Let ops in this graph draw from ``state`` (a ``torch.Generator``).

        The default generator is always registered. A custom generator used during
        capture without this raises, as PyTorch does on a GPU. On replay, registered
        generators advance, so random ops give new numbers on every replay.
        """
        if not isinstance(state, torch.Generator):
            raise TypeError(f"register_generator_state takes a torch.Generator (the one your "
                            f"random ops pass as generator=), got {type(state).__name__}")
        self._generators.append(state)

    # ---- replay -----------------------------------------------------------------------
    def replay(self) -> None:
        """Run every recorded op again, in order, on the captured memory."""
        if not self._has_graph:
            raise RuntimeError("Called CUDAGraph::replay without a preceding successful "
                               "capture.")
        outer = active_capture()
        if outer is not None:       # replay inside another capture: record it as one step
            if outer.graph is self:
                raise RuntimeError("a graph cannot replay itself during its own capture")
            if not outer.records_now():
                run_steps(self._steps)
                return
            outer._node()
            outer.steps.append(self.replay)
            outer.ops.append(f"<graph replay: {len(self._steps)} ops>")
            return
        run_steps(self._steps)

    def reset(self) -> None:
        """Drop the captured graph and its hold on the pool; the instance can capture again."""
        if self._capture is not None:
            self._capture.stop()
            self._capture = None
        if self._has_graph and self._pool is not None:
            _pool.release_pool(self._pool)
        self._steps, self._ops, self._has_graph, self._pool = [], [], False, None
        self._dependencies = []

    def pool(self) -> tuple[int, int]:
        """The handle of the pool this graph allocated from, to share with later captures."""
        if self._pool is None:
            raise RuntimeError("Called CUDAGraph::pool() without a preceding successful "
                               "capture.")
        return self._pool.handle

    def enable_debug_mode(self) -> None:
        pass

    def debug_dump(self, debug_path: str) -> None:
        with open(debug_path, "w") as f:
            f.write("\n".join(self._ops) + "\n")

    # ---- labkit extras: what was recorded -----------------------------------------------
    def recorded_ops(self) -> list[str]:
        """The ATen ops this graph replays, in order (on a GPU: its kernels)."""
        return list(self._ops)

    def recorded_dependencies(self) -> list[tuple[int, ...]]:
        """For each recorded op, the ops it waits for (indices into :meth:`recorded_ops`):
        program order on one stream, ``wait_stream`` / events across streams. What a GPU
        keeps as the edges of its ``cudaGraph_t``, so, as there, only a graph made with
        ``keep_graph=True`` has them after capture.

        Raises:
            RuntimeError: the graph was made without ``keep_graph=True``, or holds no
                captured graph.
        """
        if not self.keep_graph:
            raise RuntimeError("this graph was made without keep_graph=True: as on a GPU, "
                               "where capture_end drops the cudaGraph_t, its dependencies "
                               "are not kept. Create it with B.CUDAGraph(keep_graph=True) "
                               "before capturing")
        if not self._has_graph:
            raise RuntimeError("this graph holds no captured graph (it was never captured, "
                               "its capture failed, or it was reset): capture into it first")
        return list(self._dependencies)

    def __len__(self) -> int:
        return len(self._steps)

    def __repr__(self) -> str:
        state = f"{len(self._steps)} ops" if self._has_graph else "empty"
        return f"<emulated CUDAGraph: {state}>"

    def __del__(self):
        try:
            if self._has_graph and self._pool is not None:
                _pool.release_pool(self._pool)
        except Exception:
            pass


CAPTURE_ERROR_MODES = ("global", "thread_local", "relaxed")


def check_capture_error_mode(mode) -> None:
    """torch.cuda's check and message (a RuntimeError), plus a TypeError for a non-string."""
    if not isinstance(mode, str):
        raise TypeError(f"capture_error_mode must be one of the strings "
                        f"{', '.join(map(repr, CAPTURE_ERROR_MODES))}, got "
                        f"{type(mode).__name__} {mode!r:.40}")
    if mode not in CAPTURE_ERROR_MODES:
        raise RuntimeError(f"Unknown capture error mode. Expected `global`, "
                           f"`thread_local`, or `relaxed`, got {mode}")


class graph:
    """Context manager that captures the work inside it into ``cuda_graph``.

    Mirrors ``torch.cuda.graph`` line for line: synchronize, empty the caching allocator's
    cache (:func:`labkit.emulator.allocator.empty_cache`), switch to the capture stream
    (``stream`` or a process-wide default side stream), ``capture_begin(pool)``; on exit
    ``capture_end()`` and then switch back. As in PyTorch, if ``capture_begin`` raises (an
    unknown ``capture_error_mode``) or ``capture_end`` raises (after a refused op), the
    stream switch is not undone: ``labkit.backend.recover(B)`` undoes it.
    """

    default_capture_stream: Stream | None = None

    def __init__(self, cuda_graph: CUDAGraph, pool=None, stream: Stream | None = None,
                 capture_error_mode: str = "global", enable_annotations: bool = False,
                 check_input_liveness: bool = False):
        # enable_annotations / check_input_liveness: accepted for parity with newer torch
        # (debugging aids for profiler annotations and use-after-free); no-ops here.
        # The graph, pool and stream are checked here, before the stream switch. The mode
        # is checked where torch checks it, in capture_begin, after the switch: an unknown
        # mode leaves the capture stream current, as on a GPU.
        if not isinstance(cuda_graph, CUDAGraph):
            raise TypeError(f"graph(cuda_graph, ...) needs a B.CUDAGraph() to capture into, "
                            f"got {type(cuda_graph).__name__}. Write: g = B.CUDAGraph(); "
                            f"with B.graph(g): ...")
        if pool is not None:
            _pool.check_handle(pool, "graph(pool=...)")
        _streams.check_stream(stream, "graph(stream=...)", allow_none=True)
        if stream is None and self.__class__.default_capture_stream is None:
            self.__class__.default_capture_stream = Stream()
        self.pool = () if pool is None else (pool,)
        self.capture_stream = stream if stream is not None else \
            self.__class__.default_capture_stream
        self.stream_ctx = _streams.stream(self.capture_stream)
        self.cuda_graph = cuda_graph
        self.capture_error_mode = capture_error_mode

    def __enter__(self):
        if active_capture() is not None:   # torch's graph() fails in its synchronize() too
            refuse_device_sync("synchronize(), which graph(...) calls as it begins, while a "
                               "capture is already underway on this thread (captures do not "
                               "nest: end one, then begin the next)")
        synchronize()
        _allocator.empty_cache()          # torch.cuda.graph calls torch.cuda.empty_cache()
        self.stream_ctx.__enter__()
        self.cuda_graph.capture_begin(*self.pool, capture_error_mode=self.capture_error_mode)

    def __exit__(self, *args):
        self.cuda_graph.capture_end()
        self.stream_ctx.__exit__(*args)
