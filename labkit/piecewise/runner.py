"""Piecewise CUDA graphs: every piece between two attention calls captured per token count.

A prefill or mixed batch has a different attention shape per request, so no full graph
holds it; everything *between* the attention calls (norms, projections, MLPs) depends on
the token count alone. vLLM's ``PIECEWISE`` mode and SGLang's piecewise CUDA graphs for
prefill capture exactly that: the model is cut at the attention op
(:func:`~labkit.piecewise.split.split_at_attention`), each piece is captured once per
token-count bucket into one shared pool (largest bucket first), and at run time the batch
is padded to its bucket, the pieces replay, and attention runs eagerly on the real tokens
between them.

:class:`PiecewiseBackend`
    the pluggable graph backend, beside lesson 06's
    :class:`~labkit.decode.runner.FullGraphBackend` (both on lesson 06's
    :class:`~labkit.decode.graph_runner_base.GraphBackend`): ``capture_one(bucket, forward_fn)``
    warms the whole forward up, then runs it once more with every piece captured as it is
    reached. vLLM's ``CUDAGraphWrapper`` around each piece's ``PiecewiseBackend``.
:class:`PiecewiseGraphRunner`
    static ``input_ids``/``positions`` buffers, padding to a token bucket, the capture loop
    (lesson 06's :class:`~labkit.decode.runner.BaseGraphRunner`) and ``forward(batch)``:
    pieces replayed when the tokens fit a bucket, eager (warned once, counted) above it.

Typical use (any backend)::

    B = backend.get("auto")
    model = build_model("tiny", max_requests=16, device=B.device)
    runner = PiecewiseGraphRunner(model, B, max_num_tokens=128)
    runner.capture()
    logits = runner.forward(make_extend_batch(model, [1, 2], [prompt_a, prompt_b]))
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterable

import torch
import torch.nn as nn

from labkit.backend import ensure as ensure_backend
from labkit.capture import capturing
from labkit.core.validate import check_int
from labkit.decode.attention import make_attn_backend
from labkit.decode.batch import ForwardBatch, ForwardMode, check_batch, check_model
from labkit.decode.buckets import pad_to_bucket
from labkit.decode.capture_utils import warn_fallback_once
from labkit.decode.graph_runner_base import BaseGraphRunner, EagerRunner, GraphBackend
from labkit.decode.model import DUMMY_SLOT, attend
from labkit.decode.validation import check_device, check_fallback, check_same_caches

from .buckets import token_buckets
from .split import SplitModel, split_at_attention

__all__ = ["PiecewiseBackend", "PiecewiseGraphRunner", "GraphedPiece", "EagerAttention",
           "capture_batch"]


class PiecewiseBackend(GraphBackend):
    """Piecewise graphs: one graph per (token bucket, piece), all in one pool.

    The :class:`~labkit.decode.graph_runner_base.GraphBackend` of lesson 06's
    :class:`~labkit.decode.runner.FullGraphBackend`, with a graph per piece instead of one
    per bucket. The pieces themselves (:class:`GraphedPiece`) read ``mode``
    and ``bucket`` from here, as vLLM's wrappers read the forward context: ``"eager"``
    runs them as they are, ``"capture"`` captures each one as it is reached, ``"replay"``
    replays the graph of ``bucket``.
    """

    def __init__(self, B, num_warmups: int = 2):
        super().__init__(B, num_warmups)
        self.inputs: dict = {}       # (bucket, piece index) -> the arguments it was captured with
        self.attn_outputs: dict = {}  # (bucket, attention index) -> where it writes its output
        self.mode = "eager"
        self.bucket: int | None = None

    @contextlib.contextmanager
    def running(self, mode: str, bucket: int | None):
        self.mode, self.bucket = mode, bucket
        try:
            yield
        finally:
            self.mode, self.bucket = "eager", None

    def capture_one(self, bucket: int, forward_fn: Callable[[], torch.Tensor],
                    post_warmup_hook: Callable[[], None] | None = None) -> torch.Tensor:
        """Warm the whole forward up, pieces and attention alike (:meth:`warm_up`), then
        run it once in ``"capture"`` mode: each piece captures its graph as it is reached."""
        self.warm_up(forward_fn, post_warmup_hook)
        with self.B.stream(self.stream), self.running("capture", bucket):
            out = forward_fn()
        self.B.synchronize()
        return out

    def capture_piece(self, index: int, submod: nn.Module, args: tuple):
        g = self.B.CUDAGraph()
        self.B.synchronize()
        with capturing(self.B, g, pool=self.pool, stream=self.stream,
                       capture_error_mode=self.capture_error_mode):
            out = submod(*args)
        key = (self.bucket, index)
        self.graphs[key], self.inputs[key], self.outputs[key] = g, args, out
        return out

    def replay_piece(self, index: int, args: tuple):
        key = (self.bucket, index)
        for new, static in zip(args, self.inputs[key]):
            if not isinstance(new, torch.Tensor):
                if new != static:
                    raise RuntimeError(f"piece {index}, bucket {self.bucket}: argument {new!r} "
                                       f"differs from the {static!r} it was captured with")
            elif new.data_ptr() != static.data_ptr():
                # An attention output: a new tensor every step. The graph reads the tensor
                # it was captured with, so the real rows are copied there (the padded rows
                # keep stale values: every op outside attention works row by row).
                static[: new.size(0)].copy_(new)
        self.graphs[key].replay()
        return self.outputs[key]

    def cleanup(self) -> None:
        super().cleanup()
        self.inputs.clear()
        self.attn_outputs.clear()
        self.mode, self.bucket = "eager", None


class GraphedPiece(nn.Module):
    """A piece of the split model: run, captured or replayed as its backend says."""

    def __init__(self, index: int, submod: nn.Module, backend: PiecewiseBackend):
        super().__init__()
        self.index = index
        self.submod = submod
        self.backend = backend

    def forward(self, *args):
        backend = self.backend
        if backend.mode == "capture":
            return backend.capture_piece(self.index, self.submod, args)
        if backend.mode == "replay":
            return backend.replay_piece(self.index, args)
        return self.submod(*args)


class EagerAttention(nn.Module):
    """An attention call between two pieces: always eager, on the batch's real tokens.

    The pieces run on the padded token count; the tensors they hand to attention (the
    queries and the new keys and values) are cut back to ``batch.num_tokens`` rows, so no
    padded row is attended with or written into the KV cache.

    The output of the capture run is the tensor the next piece was captured reading. At
    replay, attention writes its real rows straight into it (``batch.attn_out``), so the
    next piece replays without a copy: vLLM's attention op takes its output buffer
    (``unified_attention_with_output``) for the same reason.
    """

    def __init__(self, index: int, submod: nn.Module, backend: PiecewiseBackend):
        super().__init__()
        self.index = index
        self.submod = submod
        self.backend = backend

    def forward(self, *args):
        batch = args[-1]
        n = batch.num_tokens
        args = tuple(a[:n] if isinstance(a, torch.Tensor) else a for a in args)
        backend = self.backend
        key = (backend.bucket, self.index)
        out = backend.attn_outputs.get(key) if backend.mode == "replay" else None
        if out is None:
            y = self.submod(*args)
            if backend.mode == "capture" and isinstance(y, torch.Tensor):
                backend.attn_outputs[key] = y
            return y
        batch.attn_out = out[:n]
        try:
            y = self.submod(*args)
        finally:
            batch.attn_out = None
        if y.data_ptr() != out.data_ptr():   # an op that takes no output buffer: copy
            out[:n].copy_(y)
        return out


def capture_batch(model, num_tokens: int) -> ForwardBatch:
    """A prefill batch of ``num_tokens`` tokens in the dummy slot, to capture a bucket with.

    .. warning::
        The warm-ups before a capture run attention eagerly, and attention *stores* the
        batch's keys and values. So the capture batch writes only into the dummy slot
        (slot 0, which no request owns, as SGLang's padded rows do): a capture in slot 1
        would overwrite a live request's cache. The tokens are split into requests of at
        most ``max_seq_len`` each, all in slot 0."""
    check_model(model, "capture_batch")
    num_tokens = check_int("capture_batch: num_tokens", num_tokens, 1,
                           fix="the token count of the bucket to capture")
    L = model.args.max_seq_len
    lens = [L] * (num_tokens // L) + ([num_tokens % L] if num_tokens % L else [])
    dev = model.device
    pos = torch.cat([torch.arange(n, device=dev) for n in lens])
    return ForwardBatch(
        forward_mode=ForwardMode.EXTEND,
        input_ids=torch.zeros(num_tokens, dtype=torch.int64, device=dev),
        positions=pos,
        out_cache_loc=model.req_to_token[DUMMY_SLOT].index_select(0, pos),
        req_pool_indices=torch.full((len(lens),), DUMMY_SLOT, dtype=torch.int64, device=dev),
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=dev),
        seq_lens_cpu=lens,
        extend_lens=lens,
    )


class PiecewiseGraphRunner(BaseGraphRunner):
    """Piecewise graphs for every token bucket up to ``max_num_tokens``.

    model           a :class:`~labkit.decode.model.Transformer` with caches set up
    B               the backend namespace (``labkit.backend.get(...)``)
    max_num_tokens  the largest token count captured (default 256)
    buckets         "vllm" (default: vLLM's capture sizes), "pow2", "every" or a list
    fallback        "eager" (default): a batch above the largest bucket runs eagerly, with
                    a warning the first time and a count in ``stats``; "error": raise
    num_warmups     eager runs of the whole forward before each bucket's capture
    splitting_ops   the ops run eagerly between the pieces (default: attention alone);
                    see :func:`~labkit.piecewise.split.split_at_attention`
    attention       the attention run between the pieces: "torch_native" (default: stock
                    torch ops, about ten launches per layer), "triton" (one kernel per
                    layer, :func:`~labkit.decode.triton_extend.extend_attention`; CUDA) or
                    "auto" (triton where it can run)

    .. warning::
        Every op outside attention must work token by token (norms, linears, rotary
        embeddings, the MLP): the padded rows of a bucket are never cleared, and a piece
        that mixed tokens would mix them in. Attention, the one op that mixes tokens, runs
        eagerly on the real tokens only.
    """

    def __init__(self, model, B, max_num_tokens: int = 256,
                 buckets: str | Iterable[int] = "vllm", fallback: str = "eager",
                 num_warmups: int = 2, progress: bool = True, splitting_ops=(attend,),
                 attention: str = "torch_native"):
        check_model(model, "PiecewiseGraphRunner")
        B = ensure_backend(B, "PiecewiseGraphRunner(model, B)")
        check_device(model, B)
        check_fallback(fallback, default="eager")
        if not isinstance(progress, bool):
            raise TypeError(f"progress must be True or False, got {progress!r}")
        super().__init__(B, token_buckets(max_num_tokens, buckets),
                         PiecewiseBackend(B, num_warmups), progress)
        self.model = model
        self.max_num_tokens = self.buckets[-1]
        self.fallback = fallback
        self.attn = make_attn_backend(attention, model)
        self.eager = EagerRunner(model, make_attn_backend(self.attn.name, model))
        self.split: SplitModel = split_at_attention(model, splitting_ops)
        for item in self.split.items:
            wrapped = (EagerAttention(item.graph_id, item.graph, self.backend)
                       if item.is_splitting_graph
                       else GraphedPiece(item.graph_id, item.graph, self.backend))
            setattr(self.split.split_gm, item.submod_name, wrapped)
        dev = model.device
        self.input_ids = torch.zeros(self.max_num_tokens, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(self.max_num_tokens, dtype=torch.int64, device=dev)
        self.stats = {"piecewise": 0, "eager_fallback": 0}
        self._warned_fallback = False
        self.last_replay: tuple[int, int] | None = None  # (num_tokens, bucket)

    @property
    def num_pieces(self) -> int:
        return len(self.split.pieces)

    def capture_report(self) -> dict:
        """Lesson 06's totals, with ``graphs`` counting every piece's graph (buckets ×
        pieces) and ``buckets`` the buckets captured."""
        return {**super().capture_report(), "graphs": len(self.backend.graphs),
                "buckets": len(self.capture_log)}

    # ---- capture -----------------------------------------------------------------------
    def capture(self) -> list[dict]:
        """Capture every bucket (lesson 06's loop), then clear the dummy slot's keys.

        .. warning::
            The capture run hands attention the pieces' outputs before any replay has
            filled them (garbage on a GPU, NaN on the emulator), and attention stores
            those keys into the dummy slot. Attention multiplies a masked key too (a 0
            weight times NaN is NaN), and a decode graph gathers masked columns that
            point at the dummy slot: left there, they would poison other runners' rows.
        """
        log = super().capture()
        locs = self.model.req_to_token[DUMMY_SLOT]
        for layer in self.model.layers:
            layer.attention.kv_cache.kv.index_fill_(0, locs, 0)
        return log

    def make_capture_batch(self, num_tokens: int) -> ForwardBatch:
        """The batch a bucket is warmed up and captured with (:func:`capture_batch`)."""
        return capture_batch(self.model, num_tokens)

    def capture_prepare(self, bucket: int) -> Callable[[], torch.Tensor]:
        batch = self.make_capture_batch(bucket)
        self.input_ids[:bucket].copy_(batch.input_ids)
        self.positions[:bucket].copy_(batch.positions)
        return lambda: self._run_split(batch, bucket)

    def _run_split(self, batch: ForwardBatch, bucket: int) -> torch.Tensor:
        batch.attn_backend = self.attn
        self.attn.init_forward_metadata(batch)
        return self.split.split_gm(self.input_ids[:bucket], self.positions[:bucket], batch)

    # ---- run ---------------------------------------------------------------------------
    def can_run(self, batch: ForwardBatch) -> bool:
        """Pieces (True) or eager (False): captured, and the batch's tokens fit a bucket."""
        if not isinstance(batch, ForwardBatch):
            raise TypeError(f"PiecewiseGraphRunner.can_run: expected a ForwardBatch "
                            f"(make_extend_batch / make_mixed_batch), got {type(batch).__name__}")
        return self.captured and 0 < batch.num_tokens <= self.max_num_tokens

    @torch.no_grad()
    def replay(self, batch: ForwardBatch) -> torch.Tensor:
        """Run ``batch`` through the pieces of its token bucket → logits (num_tokens, vocab)."""
        self._check(batch, "PiecewiseGraphRunner.replay")
        if not self.can_run(batch):
            raise ValueError(f"PiecewiseGraphRunner.replay: the batch has {batch.num_tokens} "
                             f"tokens, and the largest captured bucket holds "
                             f"{self.max_num_tokens}: call forward(batch), which runs it "
                             "eagerly, or capture larger buckets")
        return self._replay(batch)

    def _replay(self, batch: ForwardBatch) -> torch.Tensor:
        n = batch.num_tokens
        bucket = pad_to_bucket(n, self.buckets)
        self.input_ids[:n].copy_(batch.input_ids)
        self.positions[:n].copy_(batch.positions)
        with self.backend.running("replay", bucket):
            logits = self._run_split(batch, bucket)
        self.stats["piecewise"] += 1
        self.last_replay = (n, bucket)
        return logits[:n]

    @torch.no_grad()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Pieces when the batch fits a bucket, else eager (or an error: ``fallback``)."""
        self._check(batch, "PiecewiseGraphRunner.forward")
        if self.can_run(batch):
            return self._replay(batch)
        if self.fallback == "error" or not self.captured:
            self.replay(batch)   # raises, saying why
        self.stats["eager_fallback"] += 1
        warn_fallback_once(self, f"PiecewiseGraphRunner: a batch of {batch.num_tokens} tokens "
                                 f"is above the largest captured bucket ({self.max_num_tokens}); "
                                 "it runs eagerly (counted in runner.stats['eager_fallback']; "
                                 "this warning is shown once)", UserWarning)
        return self.eager.forward(batch)

    def eager_forward(self, batch: ForwardBatch) -> torch.Tensor:
        return self.eager.forward(batch)

    def _check(self, batch, fn: str) -> None:
        if not self.captured:
            raise RuntimeError(f"{fn}: nothing captured yet: call runner.capture() first")
        check_batch(batch, self.model, fn)
        check_same_caches(self.attn, self.model, fn)
