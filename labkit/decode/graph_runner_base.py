"""The graph runner's base, shared by every runner of the course: the pluggable graph
backend, the capture loop and the eager fallback. Lesson 06's
:class:`~labkit.decode.runner.DecodeGraphRunner`, lesson 09's
:class:`~labkit.piecewise.runner.PiecewiseGraphRunner` and
:class:`~labkit.speculative.runner.DraftGraphRunner` are built on it.

Layered as SGLang's runner is (``BaseCudaGraphRunner``, ``DecodeCudaGraphRunner`` and the
pluggable ``FullCudaGraphBackend``, sgl-project/sglang at f438a118):

:class:`GraphBackend`
    what every graph backend shares: one pool and one capture stream per capture
    session, the warm-ups on that stream, the graphs and their outputs, the cleanup.
:class:`FullGraphBackend`
    the pluggable graph backend: ``capture_one(key, fn)`` (two warmups on the capture
    stream, then capture into the shared pool) and ``replay(key)``. One full graph per
    shape: the only backend decode needs (prefill uses lesson 09's piecewise one).
:class:`BaseGraphRunner`
    phase-agnostic: walks the buckets **largest first** so every graph can reuse the
    blocks the larger ones freed in the one shared pool, times each capture and measures
    the pool after it. A phase runner adds :meth:`~BaseGraphRunner.capture_prepare`.
:class:`EagerRunner`
    any batch without a graph: the reference, and every runner's fallback.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Callable

import torch

from labkit.backend import ensure as ensure_backend
from labkit.capture import capturing
from labkit.core.validate import check_int

from .attention import TorchNativeAttnBackend, make_attn_backend
from .batch import ForwardBatch, check_batch, check_model
from .capture_utils import clean_up_after_failure, frozen_gc, progress_bar
from .validation import WARMUP_WHY, check_same_caches

__all__ = ["GraphBackend", "FullGraphBackend", "BaseGraphRunner", "EagerRunner"]

logger = logging.getLogger("labkit.decode")


CAPTURE_ERROR_MODES = ("global", "thread_local", "relaxed")

class GraphBackend:
    """A graph backend's shared part: the pool, the capture stream, the warm-ups, the
    graphs and their outputs. A backend adds ``capture_one(key, forward_fn,
    post_warmup_hook=None)`` and the way it replays."""

    def __init__(self, B, num_warmups: int = 2, capture_error_mode: str = "global"):
        self.B = ensure_backend(B, f"{type(self).__name__}(B)")
        self.num_warmups = check_int("num_warmups", num_warmups, 1, fix=WARMUP_WHY)
        if capture_error_mode not in CAPTURE_ERROR_MODES:
            raise ValueError(f"capture_error_mode must be one of "
                             f"{', '.join(map(repr, CAPTURE_ERROR_MODES))}, got "
                             f"{capture_error_mode!r}")
        self.capture_error_mode = capture_error_mode  # B.graph's: whose unsafe calls fail
        self.graphs: dict = {}
        self.outputs: dict = {}
        self.pool = None
        self.stream = None

    @contextlib.contextmanager
    def capture_session(self):
        """A capture of every bucket: one new pool shared by all their graphs, one stream."""
        self.pool = self.B.graph_pool_handle()  # ONE pool shared by every bucket's graph
        self.stream = self.B.Stream()           # capture happens off the default stream
        yield self

    def warm_up(self, forward_fn: Callable[[], torch.Tensor],
                post_warmup_hook: Callable[[], None] | None = None) -> None:
        """Run ``forward_fn`` ``num_warmups`` times on the capture stream, each followed by
        ``post_warmup_hook`` (SGLang's ``on_after_cuda_graph_warmup``: undo what a warm-up
        left behind that the capture must not see).

        .. warning::
            Lazy initialisation, allocator growth and library autotuning happen now: during
            capture they would be illegal (a host sync, a ``cudaMalloc`` outside the pool).
        """
        B = self.B
        for _ in range(self.num_warmups):
            B.synchronize()
            with B.stream(self.stream):
                forward_fn()
            if post_warmup_hook is not None:
                post_warmup_hook()
        B.synchronize()

    def cleanup(self) -> None:
        """Reset and drop every graph (a new capture starts from nothing)."""
        for g in self.graphs.values():
            try:
                g.reset()
            except Exception:  # a graph whose capture failed may not reset: drop it anyway
                pass
        self.graphs.clear()
        self.outputs.clear()


class FullGraphBackend(GraphBackend):
    """One full CUDA graph per shape key, all in one memory pool, one capture stream."""

    def capture_one(self, key, forward_fn: Callable[[], torch.Tensor],
                    post_warmup_hook: Callable[[], None] | None = None) -> torch.Tensor:
        """Warm ``forward_fn`` up (:meth:`warm_up`), then capture it into the shared pool as
        the graph of ``key``; returns its output, the tensor every replay rewrites."""
        B = self.B
        self.warm_up(forward_fn, post_warmup_hook)
        g = B.CUDAGraph()
        with capturing(B, g, pool=self.pool, stream=self.stream,
                       capture_error_mode=self.capture_error_mode):
            out = forward_fn()
        B.synchronize()
        self.graphs[key] = g
        self.outputs[key] = out
        return out

    def replay(self, key) -> torch.Tensor:
        """Replay the graph of ``key``; returns its static output (rewritten by each replay)."""
        g = self.graphs.get(key)
        if g is None:
            raise KeyError(f"no graph captured for {key!r}; captured: {sorted(self.graphs)} "
                           "(a runner pads a batch to its bucket first: runner.replay(batch))")
        g.replay()
        return self.outputs[key]


class BaseGraphRunner:
    """Phase-agnostic: buckets, the largest-first capture loop, timing and pool memory.

    A phase runner implements :meth:`capture_prepare` (bs → a zero-argument function
    that runs the forward on the static buffers for a bucket of ``bs``).
    """

    def __init__(self, B, buckets: list[int], backend: GraphBackend | None = None,
                 progress: bool = True):
        self.B = B
        self.buckets = list(buckets)
        if not self.buckets or self.buckets != sorted(set(self.buckets)):
            raise ValueError(f"buckets must be a non-empty ascending list of distinct batch "
                             f"sizes, got {self.buckets}")
        self.backend = backend or FullGraphBackend(B)
        self.progress = progress
        self.capture_log: list[dict] = []

    @property
    def max_bucket(self) -> int:
        return self.buckets[-1]

    @property
    def captured(self) -> bool:
        return bool(self.backend.graphs)

    def capture_prepare(self, bs: int) -> Callable[[], torch.Tensor]:
        raise NotImplementedError

    def capture(self) -> list[dict]:
        """Capture every bucket, largest first, into one pool. Returns the capture log:
        one dict per bucket with ``bs``, ``seconds`` (warmups + capture),
        ``pool_reserved_bytes`` / ``pool_allocated_bytes`` (the pool after this graph) and
        the ``*_delta_bytes`` this graph added. Reserved memory barely grows after the
        first (largest) graph: the smaller ones reuse its freed blocks; allocated memory
        grows by each graph's live output."""
        if self.captured:
            self.backend.cleanup()
        self.capture_log = []
        t_all = time.perf_counter()
        with clean_up_after_failure(self), frozen_gc(), torch.no_grad(), \
                self.backend.capture_session():
            before = self._pool_bytes()
            bar = progress_bar(list(reversed(self.buckets)), self.progress,
                                 desc=f"Capturing {len(self.buckets)} graphs", unit="graph")
            for bs in bar:
                t0 = time.perf_counter()
                fn = self.capture_prepare(bs)
                self.backend.capture_one(bs, fn)
                secs = time.perf_counter() - t0
                now = self._pool_bytes()
                self.capture_log.append({
                    "bs": bs, "seconds": secs,
                    "pool_reserved_bytes": now[0], "pool_allocated_bytes": now[1],
                    "reserved_delta_bytes": now[0] - before[0],
                    "allocated_delta_bytes": now[1] - before[1]})
                before = now
                if hasattr(bar, "set_postfix"):
                    bar.set_postfix(bs=bs, pool_MiB=f"{now[0] / 2**20:.1f}")
                logger.debug("captured bs=%d in %.1f ms, pool reserved %.2f MiB", bs,
                             1e3 * secs, now[0] / 2**20)
        r = self.capture_report()
        logger.info("captured %d graphs (bs %d..%d) in %.2f s (%.2f s total), "
                    "pool reserved %.2f MiB", r["graphs"], self.buckets[0], self.buckets[-1],
                    r["capture_seconds"], time.perf_counter() - t_all,
                    r["pool_reserved_bytes"] / 2**20)
        return self.capture_log

    def capture_report(self) -> dict:
        """Totals over the capture log (for the notebook's table)."""
        log = self.capture_log
        return {
            "graphs": len(log),
            "capture_seconds": sum(r["seconds"] for r in log),
            "pool_reserved_bytes": log[-1]["pool_reserved_bytes"] if log else 0,
            "pool_allocated_bytes": log[-1]["pool_allocated_bytes"] if log else 0,
            "sum_reserved_deltas_bytes": sum(r["reserved_delta_bytes"] for r in log),
            "per_bucket": sorted(log, key=lambda r: r["bs"]),
        }

    def _pool_bytes(self) -> tuple[int, int]:
        try:
            st = self.B.pool_stats(self.backend.pool)
        except Exception:  # a backend without pool accounting: report 0, don't fail
            return (0, 0)
        return int(st.get("reserved_bytes", 0)), int(st.get("allocated_bytes", 0))


class EagerRunner:
    """Run any batch without a graph: the reference, and the fallback."""

    def __init__(self, model, attn_backend: TorchNativeAttnBackend | str | None = None):
        check_model(model, "EagerRunner")
        self.model = model
        if attn_backend is None or isinstance(attn_backend, str):
            attn_backend = make_attn_backend(attn_backend or "torch_native", model)
        elif not hasattr(attn_backend, "init_forward_metadata"):
            raise TypeError("EagerRunner: attn_backend must be a name ('torch_native', "
                            "'triton', 'auto') or an attention backend object, got "
                            f"{type(attn_backend).__name__}")
        self.attn = attn_backend

    @torch.no_grad()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Run ``batch`` eagerly (any mode) and return its logits, (num_tokens, vocab).
        The batch is checked first (:func:`~labkit.decode.batch.check_batch`)."""
        check_batch(batch, self.model, "EagerRunner.forward")
        check_same_caches(self.attn, self.model, "EagerRunner.forward")
        if batch.num_tokens == 0:  # IDLE: nothing to run
            return torch.empty(0, self.model.args.vocab_size, device=self.model.device)
        batch.attn_backend = self.attn
        self.attn.init_forward_metadata(batch)
        return self.model(batch.input_ids, batch.positions, batch)
