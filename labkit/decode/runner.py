"""The decode graph runner: capture one graph per bucket, replay the right one, pad, slice.

Three layers, as in SGLang's runner (``BaseCudaGraphRunner``, ``DecodeCudaGraphRunner`` and
the pluggable ``FullCudaGraphBackend``, sgl-project/sglang at f438a118):

:class:`FullGraphBackend`
    the pluggable graph backend: ``capture_one(key, fn)`` (two warmups on the capture
    stream, then capture into the shared pool) and ``replay(key)``. One full graph per
    shape — the only backend decode needs (prefill would need a piecewise one).
:class:`BaseGraphRunner`
    phase-agnostic: walks the buckets **largest first** so every graph can reuse the
    blocks the larger ones freed in the one shared pool, times each capture and measures
    the pool after it, and picks a bucket with ``bisect_left``.
:class:`DecodeGraphRunner`
    the decode phase: static buffers with padding policies, the attention metadata split
    (out of graph / in graph), the fast path, slicing outputs back to the real batch, and
    ``forward(batch)`` — graph when :meth:`can_run`, eager otherwise.

Typical use (any backend)::

    B = backend.get("auto")
    model = build_model("tiny", max_requests=16, device=B.device)
    runner = DecodeGraphRunner(model, B, max_bs=16)
    runner.capture()
    logits = runner.forward(batch)     # graph for DECODE batches that fit, else eager
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Callable, Iterable

import torch

from labkit.backend import ensure as ensure_backend
from labkit.capture import own_cublas_workspace
from labkit.core.validate import check_int

from .attention import TorchNativeAttnBackend, make_attn_backend
from .batch import ForwardBatch, ForwardMode, _check_model, check_batch
from .buckets import make_buckets, pad_to_bucket
from .buffers import Pad, StaticBuffers
from .capture_utils import (
    _clean_up_after_failure,
    _freeze_gc,
    _progress,
    _quiet_autotune,
    warn_fallback_once,
)
from .validation import (
    _WARMUP_WHY,
    _check_device,
    _check_options,
    _check_same_caches,
    _check_staged,
)

__all__ = ["FullGraphBackend", "BaseGraphRunner", "DecodeGraphRunner", "EagerRunner",
           "warn_fallback_once"]

logger = logging.getLogger("labkit.decode")

_CAPTURE_ERROR_MODES = ("global", "thread_local", "relaxed")


class FullGraphBackend:
    """One full CUDA graph per shape key, all in one memory pool, one capture stream."""

    def __init__(self, B, num_warmups: int = 2, capture_error_mode: str = "global"):
        self.B = ensure_backend(B, "FullGraphBackend(B)")
        self.num_warmups = check_int("num_warmups", num_warmups, 1, fix=_WARMUP_WHY)
        if capture_error_mode not in _CAPTURE_ERROR_MODES:
            raise ValueError(f"capture_error_mode must be one of "
                             f"{', '.join(map(repr, _CAPTURE_ERROR_MODES))}, got "
                             f"{capture_error_mode!r}")
        self.capture_error_mode = capture_error_mode  # B.graph's: whose unsafe calls fail
        self.graphs: dict = {}
        self.outputs: dict = {}
        self.pool = None
        self.stream = None

    @contextlib.contextmanager
    def capture_session(self):
        self.pool = self.B.graph_pool_handle()  # ONE pool shared by every bucket's graph
        self.stream = self.B.Stream()           # capture happens off the default stream
        yield self

    def capture_one(self, key, forward_fn: Callable[[], torch.Tensor],
                    post_warmup_hook: Callable[[], None] | None = None) -> torch.Tensor:
        B = self.B
        for _ in range(self.num_warmups):
            # Warm up on the capture stream: lazy init, allocator growth and library
            # autotuning happen now, not during capture (where they would be illegal).
            B.synchronize()
            with B.stream(self.stream):
                forward_fn()
            if post_warmup_hook is not None:
                post_warmup_hook()
        B.synchronize()
        g = B.CUDAGraph()
        with own_cublas_workspace(B, g, self.pool), B.graph(
                g, pool=self.pool, stream=self.stream,
                capture_error_mode=self.capture_error_mode):
            out = forward_fn()
        B.synchronize()
        self.graphs[key] = g
        self.outputs[key] = out
        return out

    def replay(self, key) -> torch.Tensor:
        g = self.graphs.get(key)
        if g is None:
            raise KeyError(f"no graph captured for {key!r}; captured: {sorted(self.graphs)} "
                           "(a runner pads a batch to its bucket first: runner.replay(batch))")
        g.replay()
        return self.outputs[key]

    def cleanup(self) -> None:
        for g in self.graphs.values():
            try:
                g.reset()
            except Exception:  # a graph whose capture failed may not reset: drop it anyway
                pass
        self.graphs.clear()
        self.outputs.clear()


class BaseGraphRunner:
    """Phase-agnostic: buckets, the largest-first capture loop, timing and pool memory.

    A phase runner implements :meth:`capture_prepare` (bs → a zero-argument function
    that runs the forward on the static buffers for a bucket of ``bs``).
    """

    def __init__(self, B, buckets: list[int], backend: FullGraphBackend | None = None,
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
        with _clean_up_after_failure(self), _freeze_gc(), torch.no_grad(), \
                self.backend.capture_session():
            before = self._pool_bytes()
            bar = _progress(list(reversed(self.buckets)), self.progress,
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
        _check_model(model, "EagerRunner")
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
        _check_same_caches(self.attn, self.model, "EagerRunner.forward")
        if batch.num_tokens == 0:  # IDLE: nothing to run
            return torch.empty(0, self.model.args.vocab_size, device=self.model.device)
        batch.attn_backend = self.attn
        self.attn.init_forward_metadata(batch)
        return self.model(batch.input_ids, batch.positions, batch)


class DecodeGraphRunner(BaseGraphRunner):
    """Decode (or target-verify) graphs for every bucket up to ``max_bs``.

    model              a :class:`~labkit.decode.model.Transformer` with caches set up
    B                  the backend namespace (``labkit.backend.get(...)``)
    max_bs             largest batch to capture (default: every slot the model has)
    buckets            "sglang" (default), "every", "pow2" or a list of sizes
    disable_padding    shorthand for buckets="every": one graph per batch size
    num_tokens_per_bs  1 for decode; k for TARGET_VERIFY (k draft tokens per request)
    fallback           "error" (default): a DECODE batch larger than the largest bucket
                       raises BatchTooLargeError; "eager": run it eagerly, with a warning
                       the first time and a count in ``stats``
    padding_override   e.g. {"positions": "head_only"}: change a buffer's policy (demos)
    compile_bs         buckets <= this run through torch.compile before capture (GPU)
    compile_mode       "max-autotune-no-cudagraphs" (SGLang's; tunes GEMMs, minutes) or
                       "default" (fusion only, seconds)
    attention          "torch_native" (default), "triton" (CUDA: decode attention
                       through the page table, no gather) or "auto"; see
                       :func:`~labkit.decode.attention.make_attn_backend`
    """

    def __init__(self, model, B, max_bs: int | None = None,
                 buckets: str | Iterable[int] | None = "sglang", disable_padding: bool = False,
                 num_tokens_per_bs: int = 1, forward_mode: ForwardMode | None = None,
                 fallback: str = "error", padding_override: dict | None = None,
                 num_warmups: int = 2, compile_bs: int = 0, progress: bool = True,
                 attention: str = "torch_native",
                 compile_mode: str = "max-autotune-no-cudagraphs"):
        _check_model(model, "DecodeGraphRunner")
        B = ensure_backend(B, "DecodeGraphRunner(model, B)")
        _check_device(model, B)
        max_bs = model.num_slots - 1 if max_bs is None else max_bs
        buckets = _check_options(
            model, max_bs=max_bs, buckets=buckets, disable_padding=disable_padding,
            num_tokens_per_bs=num_tokens_per_bs, forward_mode=forward_mode, fallback=fallback,
            num_warmups=num_warmups, compile_bs=compile_bs, progress=progress,
            compile_mode=compile_mode)
        max_bs, num_tokens_per_bs = int(max_bs), int(num_tokens_per_bs)  # numpy ints too
        scheme = "every" if disable_padding else (buckets if buckets is not None else "sglang")
        bucket_list = make_buckets(max_bs, scheme)
        if bucket_list[-1] > max_bs:
            raise ValueError(f"bucket {bucket_list[-1]} exceeds max_bs={max_bs}")
        super().__init__(B, bucket_list, self.make_graph_backend(B, num_warmups), progress)
        self.model = model
        self.max_bs = max_bs
        self.num_tokens_per_bs = num_tokens_per_bs
        self.capture_forward_mode = forward_mode or (
            ForwardMode.DECODE if num_tokens_per_bs == 1 else ForwardMode.TARGET_VERIFY)
        self.fallback = fallback
        if padding_override is not None and not isinstance(padding_override, dict):
            raise TypeError("DecodeGraphRunner: padding_override must be a dict "
                            f"{{buffer: policy}}, got {type(padding_override).__name__}")
        self.padding_override = dict(padding_override or {})
        self.compile_bs = compile_bs
        self.compile_mode = compile_mode
        self.attn = make_attn_backend(attention, model)
        self.attn.init_cuda_graph_state(max_bs, max_bs * num_tokens_per_bs)
        self.buffers = StaticBuffers(max_bs, num_tokens_per_bs, device=model.device)
        self._check_padding_override(self.padding_override, "DecodeGraphRunner")
        self.eager = EagerRunner(model, make_attn_backend(self.attn.name, model))
        self.stats = {"graph": 0, "fast_path": 0, "staged": 0, "eager": 0, "eager_fallback": 0}
        self._warned_fallback = False
        self._loaded: tuple | None = None  # (batch, raw_bs, padded_bs) now in the buffers
        self._compiled = None
        self._bucket_batches: dict[int, ForwardBatch] = {}    # see _bucket_batch
        self._staged: tuple[int, int] | None = None  # (raw_bs, bucket) loaded by stage()
        # The request→token table on the host (it never changes after setup_caches): where
        # each staged token's K/V goes is looked up here, with no device work.
        self._req_to_token_host = model.req_to_token.cpu().numpy()
        self.last_replay: tuple[int, int] | None = None  # (raw_bs, bucket) of the last replay

    # ---- capture -----------------------------------------------------------------------
    def make_graph_backend(self, B, num_warmups: int) -> FullGraphBackend:
        """The graph backend this runner captures with: a hook for subclasses
        (:class:`labkit.tp.TPDecodeGraphRunner` returns one that checks, after each
        capture, that every rank captured the same collectives)."""
        return FullGraphBackend(B, num_warmups)

    def _buffer_batch(self, bs: int, seq_lens_cpu: list[int]) -> ForwardBatch:
        """A ForwardBatch whose tensors are views of the static buffers (first ``bs`` rows)."""
        v = self.buffers.view(bs)
        return ForwardBatch(self.capture_forward_mode, v["input_ids"], v["positions"],
                            v["out_cache_loc"], v["req_pool_indices"], v["seq_lens"],
                            seq_lens_cpu, attn_backend=self.attn)

    def _reset_buffers(self) -> None:
        """Dummy inputs for capture: every row points at the dummy slot, seq_len = sentinel.
        The warmups really run, and this is what keeps them out of live requests' cache."""
        for slot in self.buffers.slots.values():
            slot.tensor.fill_(slot.fill_value if slot.pad is Pad.SENTINEL else 0)
        self._loaded = self._staged = None  # whatever was planned or staged is gone

    def capture_prepare(self, bs: int) -> Callable[[], torch.Tensor]:
        self._reset_buffers()
        fill = self.buffers.slots["seq_lens"].fill_value
        fb = self._buffer_batch(bs, [fill] * bs)
        self.attn.init_forward_metadata_out_graph(fb, in_capture=True)
        model_fn = self.model
        if self.compile_bs and bs <= self.compile_bs:
            if self._compiled is None:
                # One compiled variant per bucket shape (dynamic=False, as SGLang does):
                # make sure dynamo's recompile limit does not silently fall back to eager.
                import torch._dynamo
                cfg = torch._dynamo.config
                name = "recompile_limit" if hasattr(cfg, "recompile_limit") else "cache_size_limit"
                n = sum(b <= self.compile_bs for b in self.buckets)
                setattr(cfg, name, max(getattr(cfg, name), n + 8))
                self._compiled = torch.compile(self.model, mode=self.compile_mode,
                                               dynamic=False)
            compiled = self._compiled

            def model_fn(*args):
                with _quiet_autotune():  # no autotune tables printed while it compiles
                    return compiled(*args)

        def run_once() -> torch.Tensor:
            self.attn.init_forward_metadata_in_graph(fb)  # recorded into the graph
            return model_fn(fb.input_ids, fb.positions, fb)

        return run_once

    # ---- replay ------------------------------------------------------------------------
    def can_run(self, batch: ForwardBatch) -> bool:
        """Graph or eager? The forward mode must be graphable and the one captured, the
        tokens per request must match, and the batch must fit the largest bucket."""
        if not isinstance(batch, ForwardBatch):
            raise TypeError(f"can_run: expected a ForwardBatch, got {type(batch).__name__}")
        return (self.captured
                and batch.forward_mode is self.capture_forward_mode
                and batch.forward_mode.is_cuda_graph()
                and batch.num_tokens_per_bs == self.num_tokens_per_bs
                and 1 <= batch.batch_size <= self.max_bucket)

    def plan(self, batch: ForwardBatch, padding_override: dict | None = None) -> int:
        """Load a batch into the static buffers and prepare its metadata out of graph.

        SGLang runs this ahead of time on a plan stream; a batch planned here later
        replays through the fast path (only input_ids / positions copied again). Returns
        the bucket size. A batch changed after planning (its slots, lengths or cache
        locations) is detected and planned again at replay, never replayed stale.
        """
        self._check_batch(batch, "plan", padding_override)
        self._check_graphable(batch)
        bs = self._load(batch, padding_override)
        batch.mark_forward_metadata_ready()  # SGLang's mark, right next to the planning
        return bs

    def _load(self, batch: ForwardBatch, padding_override: dict | None) -> int:
        """Pad to the bucket, fill the static buffers and prepare the metadata out of graph
        (SGLang's ``replay_prepare``); returns the bucket. Only :meth:`plan` marks the batch."""
        raw_bs = batch.batch_size
        bs = pad_to_bucket(raw_bs, self.buckets)
        override = {**self.padding_override, **(padding_override or {})}
        self.buffers.fill_from(batch, raw_bs, bs, override=override or None)
        fb = self._bucket_batch(bs)
        fill = self.buffers.slots["seq_lens"].fill_value
        fb.seq_lens_cpu = list(batch.seq_lens_cpu) + [fill] * (bs - raw_bs)
        self.attn.init_forward_metadata_out_graph(fb)
        self._loaded = (batch, raw_bs, bs)
        self._staged = None                    # the buffers no longer hold a staged step
        return bs

    def _bucket_batch(self, bs: int) -> ForwardBatch:
        """The padded batch of bucket ``bs``: views of the static buffers, made once."""
        if bs not in self._bucket_batches:
            self._bucket_batches[bs] = self._buffer_batch(bs, [])
        return self._bucket_batches[bs]

    def _is_planned(self, batch: ForwardBatch) -> bool:
        """``batch`` is the one :meth:`plan` loaded, unchanged since."""
        loaded = self._loaded
        return (loaded is not None and loaded[0] is batch and loaded[1] == batch.batch_size
                and not batch.needs_forward_metadata_init())

    def replay(self, batch: ForwardBatch, padding_override: dict | None = None) -> torch.Tensor:
        """Replay the bucket's graph for ``batch``; return logits for the real tokens only.

        Fast path: the batch was planned (:meth:`plan`), is the one the buffers hold and
        has not changed since (``needs_forward_metadata_init()`` is False), so only
        ``input_ids`` and ``positions`` heads are copied (in spec decoding, the two fields
        that arrive after planning). Otherwise: pad to the bucket, fill the buffers by
        policy, rebuild metadata out of graph.

        The returned tensor is a *view* of the graph's static output: the next replay of
        the same bucket overwrites it. Use it (or ``.clone()`` it) before replaying again.
        """
        self._check_captured("replay")
        self._check_batch(batch, "replay", padding_override)
        self._check_graphable(batch)
        return self._replay(batch, padding_override)

    # ---- checks (small helpers, so replay reads like SGLang's) ---------------------------
    def _check_captured(self, fn: str) -> None:
        if not self.captured:
            raise RuntimeError(f"{fn}: no graphs captured yet: call runner.capture() first")

    def _check_batch(self, batch, fn: str, padding_override: dict | None = None) -> None:
        """Layout (types, dtypes, devices, shapes) and values (ids, positions, slots,
        lengths, cache locations) before anything reaches a static buffer."""
        check_batch(batch, self.model, fn)
        _check_same_caches(self.attn, self.model, fn)
        if padding_override:
            self._check_padding_override(padding_override, fn)

    def _check_graphable(self, batch: ForwardBatch) -> None:
        """The mode and tokens per request this runner captured, and a bucket that fits."""
        if batch.batch_size > self.max_bucket:
            pad_to_bucket(batch.batch_size, self.buckets)  # raises BatchTooLargeError
        k = self.num_tokens_per_bs
        if batch.num_tokens_per_bs != k or batch.forward_mode is not self.capture_forward_mode:
            raise ValueError(f"runner captured {self.capture_forward_mode.name} with {k} "
                             f"token(s)/request; batch is {batch.forward_mode.name} with "
                             f"{batch.num_tokens_per_bs}: use runner.forward(batch), which "
                             "runs other batches eagerly")

    def _check_padding_override(self, override, fn: str) -> None:
        if not isinstance(override, dict):
            raise TypeError(f"{fn}: padding_override must be a dict {{buffer: policy}}, got "
                            f"{type(override).__name__}")
        names, pads = list(self.buffers.slots), [p.value for p in Pad]
        for name, pad in override.items():
            if name not in self.buffers.slots:
                raise ValueError(f"{fn}: padding_override names buffer {name!r}; the buffers "
                                 f"are {', '.join(names)}")
            if pad not in pads and not isinstance(pad, Pad):
                raise ValueError(f"{fn}: padding_override[{name!r}] = {pad!r}; choose one of "
                                 f"{', '.join(pads)}")

    @torch.no_grad()
    def _replay(self, batch: ForwardBatch, padding_override: dict | None) -> torch.Tensor:
        """replay() after its checks (SGLang's ``CudaGraphRunner.replay``)."""
        raw_num_token = batch.batch_size * self.num_tokens_per_bs
        if self._is_planned(batch) and not padding_override:
            # Planned ahead: only the two fields that arrive after planning.
            self.buffers.input_ids[:raw_num_token].copy_(batch.input_ids)
            self.buffers.positions[:raw_num_token].copy_(batch.positions)
            bs = self._loaded[2]
            self.stats["fast_path"] += 1
        else:
            bs = self._load(batch, padding_override)
        self.last_replay = (batch.batch_size, bs)
        out = self.backend.replay(bs)
        self.stats["graph"] += 1
        return out[:raw_num_token]                      # drop the padded rows

    # ---- the staged path (the overlapped serving loop) -----------------------------------
    @torch.no_grad()
    def stage(self, slots: list[int], positions: list[int],
              tokens: list[int] | torch.Tensor) -> int:
        """Load one DECODE step from host values with ONE host→device copy; returns the
        bucket. :meth:`replay_staged` then replays it.

        ``slots`` and ``positions``: one int per request (the position of the token fed
        now). ``tokens``: the token ids as ints, or a device tensor holding every slot's
        next token (``tokens[slot]``), gathered into ``input_ids`` on the device: the
        tokens of the last step then never come to the host. Slots, positions, cache
        locations and lengths go into a pinned host buffer and reach the graph's static
        buffers in one non-blocking copy (:meth:`StaticBuffers.stage`); the page table is
        then built out of graph, as in :meth:`replay`. The host waits at most for the copy
        of two steps back (its pinned buffer is about to be rewritten).
        """
        fn = "stage"
        self._staged = None                    # whatever happens next, the old step is gone
        self._check_captured(fn)
        _check_same_caches(self.attn, self.model, fn)
        if self.capture_forward_mode is not ForwardMode.DECODE:
            raise ValueError(f"{fn}: this runner captured {self.capture_forward_mode.name}; "
                             "stage() loads DECODE steps (one token per request)")
        slots, positions = _check_staged(self, slots, positions, tokens, fn)
        raw = len(slots)
        bs = pad_to_bucket(raw, self.buckets)
        locs = self._req_to_token_host[slots, positions]
        seq_lens = positions + 1
        values = {"req_pool_indices": slots, "positions": positions, "out_cache_loc": locs,
                  "seq_lens": seq_lens}
        if not isinstance(tokens, torch.Tensor):
            values["input_ids"] = tokens
        self.buffers.stage(values, raw, bs, self.B)
        if isinstance(tokens, torch.Tensor):   # after the copy, on the same stream
            torch.index_select(tokens, 0, self.buffers.req_pool_indices[:raw],
                               out=self.buffers.input_ids[:raw])
        fb = self._bucket_batch(bs)
        fb.seq_lens_cpu = (seq_lens.tolist()
                           + [self.buffers.slots["seq_lens"].fill_value] * (bs - raw))
        self.attn.init_forward_metadata_out_graph(fb)
        self._loaded = None                    # the buffers no longer hold a planned batch
        self._staged = (raw, bs)
        return bs

    @torch.no_grad()
    def replay_staged(self) -> torch.Tensor:
        """Replay the step :meth:`stage` loaded; the logits of its real rows (a view of
        the graph's static output, overwritten by the next replay of that bucket)."""
        if self._staged is None:
            raise RuntimeError("replay_staged: nothing staged: call runner.stage(slots, "
                               "positions, tokens) first (replay(batch) loads a batch itself)")
        raw, bs = self._staged
        self.last_replay = (raw, bs)
        out = self.backend.replay(bs)
        self.stats["graph"] += 1
        self.stats["staged"] += 1
        return out[:raw]

    def eager_forward(self, batch: ForwardBatch) -> torch.Tensor:
        self.stats["eager"] += 1
        return self.eager.forward(batch)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """The dispatch (SGLang's model_runner): replay when :meth:`can_run`, else eager.

        Prefill (EXTEND) always runs eagerly. A graphable batch that is too large raises
        :class:`BatchTooLargeError` unless ``fallback="eager"``, which runs it eagerly and
        warns the first time (and logs every time at INFO) — never silently.
        """
        if not isinstance(batch, ForwardBatch):
            raise TypeError(f"forward: expected a ForwardBatch, got {type(batch).__name__}")
        if batch.forward_mode is self.capture_forward_mode:
            self._check_captured("forward")  # a forgotten capture() would silently run eagerly
        if self.can_run(batch):                 # mode, tokens per request, size: graphable
            self._check_batch(batch, "forward")  # and its contents are sound
            return self._replay(batch, None)
        if (self.captured and batch.forward_mode is self.capture_forward_mode
                and batch.batch_size > self.max_bucket):
            if self.fallback == "error":
                pad_to_bucket(batch.batch_size, self.buckets)  # raises BatchTooLargeError
            warn_fallback_once(self, f"batch of {batch.batch_size} requests > largest "
                                     f"captured graph ({self.max_bucket}); running it eagerly "
                                     "(warned once; see runner.stats['eager_fallback'])")
            self.stats["eager_fallback"] += 1
        return self.eager_forward(batch)
