"""The decode graph runner: capture one graph per bucket, replay the right one, pad, slice.

:class:`DecodeGraphRunner` is lesson 06's decode phase on the shared base
(:mod:`labkit.decode.graph_runner_base`: the pluggable :class:`FullGraphBackend`, the
largest-first capture loop of :class:`BaseGraphRunner`, the :class:`EagerRunner` fallback),
as SGLang's ``DecodeCudaGraphRunner`` sits on its ``BaseCudaGraphRunner``: static buffers
with padding policies, the attention metadata split (out of graph / in graph), the fast
path, slicing outputs back to the real batch, and ``forward(batch)``, graph when
:meth:`~DecodeGraphRunner.can_run`, eager otherwise.

Its state is two records. One :class:`BucketEntry` per bucket (vLLM's ``CUDAGraphEntry``
in ``vllm/compilation/cuda_graph.py``: a key and what its graph reads), made once; and the
one :class:`LoadedStep`, what the static buffers hold now (SGLang's ``raw_bs``,
``raw_num_token`` and ``bs``, stored by ``CudaGraphRunner.replay_prepare``). Every way in
(:meth:`~DecodeGraphRunner.plan`, :meth:`~DecodeGraphRunner.replay`,
:meth:`~DecodeGraphRunner.forward`, :meth:`~DecodeGraphRunner.stage`) fills the buffers, then
ends in the same preparation, which builds the metadata and records the step; every replay
launches a recorded step. The fast path (SGLang's ``replay(..., skip_attn_backend_init=True)``)
replays the step a planned batch left, copying only the two fields that arrive late.

Typical use (any backend)::

    B = backend.get("auto")
    model = build_model("tiny", max_requests=16, device=B.device)
    runner = DecodeGraphRunner(model, B, max_bs=16)
    runner.capture()
    logits = runner.forward(batch)     # graph for DECODE batches that fit, else eager
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from labkit.backend import ensure as ensure_backend

from .attention import make_attn_backend
from .batch import ForwardBatch, ForwardMode, check_batch, check_model
from .buckets import pad_to_bucket
from .buffers import Pad, StaticBuffers
from .capture_utils import quiet_autotune, warn_fallback_once
from .graph_runner_base import BaseGraphRunner, EagerRunner, FullGraphBackend
from .options import DecodeRunnerOptions
from .validation import check_device, check_padding_override, check_same_caches, check_staged

# FullGraphBackend, BaseGraphRunner, EagerRunner and warn_fallback_once live in
# graph_runner_base / capture_utils; importing them from here still works.
__all__ = ["DecodeGraphRunner", "DecodeRunnerOptions", "BucketEntry", "LoadedStep",
           "FullGraphBackend", "BaseGraphRunner", "EagerRunner", "warn_fallback_once"]


@dataclass(frozen=True, eq=False)
class BucketEntry:
    """One bucket of a :class:`DecodeGraphRunner`, made once (vLLM's ``CUDAGraphEntry``,
    keyed by batch size).

    bs      the bucket: the batch size its graph was captured for
    batch   the padded batch that graph was captured with and replays: views of the first
            ``bs`` rows of the static buffers (``seq_lens_cpu`` rewritten per step)

    Its graph and output are the pluggable backend's, ``runner.backend.graphs[bs]`` and
    ``runner.backend.outputs[bs]`` (SGLang's ``graphs[bs]`` / ``output_buffers[bs]``).
    """

    bs: int
    batch: ForwardBatch


@dataclass(frozen=True, eq=False)
class LoadedStep:
    """What the static buffers of a :class:`DecodeGraphRunner` hold now, ready to replay.

    entry           the bucket it replays (:class:`BucketEntry`)
    raw_bs          its real requests (the rows after them are padding)
    raw_num_tokens  its real tokens, ``raw_bs * num_tokens_per_bs``: the output rows kept
    batch           the batch loaded (:meth:`~DecodeGraphRunner.plan`, ``replay``); None for
                    a step staged from host values (:meth:`~DecodeGraphRunner.stage`)
    """

    entry: BucketEntry
    raw_bs: int
    raw_num_tokens: int
    batch: ForwardBatch | None

    @property
    def bs(self) -> int:
        return self.entry.bs

    @property
    def staged(self) -> bool:
        return self.batch is None


def _option(name: str) -> property:
    """A runner attribute that reads its checked option ``name``, read-only: the runner's
    graphs and buffers were made for it."""
    return property(lambda self: getattr(self.options, name),
                    doc=f"``options.{name}`` (read-only)")


class DecodeGraphRunner(BaseGraphRunner):
    """Decode (or target-verify) graphs for every bucket up to ``max_bs``.

    model      a :class:`~labkit.decode.model.Transformer` with caches set up
    B          the backend namespace (``labkit.backend.get(...)``)
    options    a :class:`~labkit.decode.options.DecodeRunnerOptions`, or its fields as
               keywords (``max_bs=8, fallback="eager"``; a keyword replaces the field of
               ``options``): max_bs, buckets, disable_padding, num_tokens_per_bs,
               forward_mode, fallback, padding_override, num_warmups, compile_bs, progress,
               attention, compile_mode. All are checked at once, against ``model``.

    State: :attr:`entries` (one :class:`BucketEntry` per bucket), :attr:`loaded` (the
    :class:`LoadedStep` in the buffers, or None), :attr:`last_replay` (``(raw_bs, bucket)``
    of the last replay) and :attr:`stats` (counts by path: ``graph``, ``fast_path``,
    ``staged``, ``eager``, ``eager_fallback``).
    """

    def __init__(self, model, B, *, options: DecodeRunnerOptions | None = None, **kw):
        check_model(model, "DecodeGraphRunner")
        B = ensure_backend(B, "DecodeGraphRunner(model, B)")
        check_device(model, B)
        opts = DecodeRunnerOptions.from_call(options, kw).checked(model)
        super().__init__(B, opts.buckets, self.make_graph_backend(B, opts.num_warmups),
                         opts.progress)
        self.options = opts
        self.model = model
        self.attn = make_attn_backend(opts.attention, model)
        self.attn.init_cuda_graph_state(opts.max_bs, opts.max_bs * opts.num_tokens_per_bs)
        self.buffers = StaticBuffers(opts.max_bs, opts.num_tokens_per_bs, device=model.device)
        check_padding_override(opts.padding_override, self.buffers.slots, "DecodeGraphRunner")
        self.eager = EagerRunner(model, make_attn_backend(self.attn.name, model))
        self.entries = {bs: BucketEntry(bs, self._static_batch(bs)) for bs in self.buckets}
        self.loaded: LoadedStep | None = None
        self.last_replay: tuple[int, int] | None = None
        self.stats = {"graph": 0, "fast_path": 0, "staged": 0, "eager": 0, "eager_fallback": 0}
        self._warned_fallback = False
        self._compiled = None                   # the torch.compile'd model, made on first use
        # The request→token table on the host (it never changes after setup_caches): where
        # each staged token's K/V goes is looked up here, with no device work.
        self._req_to_token_host = model.req_to_token.cpu().numpy()

    max_bs = _option("max_bs")
    num_tokens_per_bs = _option("num_tokens_per_bs")
    capture_forward_mode = _option("forward_mode")
    fallback = _option("fallback")
    padding_override = _option("padding_override")
    compile_bs = _option("compile_bs")
    compile_mode = _option("compile_mode")

    # ---- capture -----------------------------------------------------------------------
    def make_graph_backend(self, B, num_warmups: int) -> FullGraphBackend:
        """The graph backend this runner captures with: a hook for subclasses
        (:class:`labkit.tp.TPDecodeGraphRunner` returns one that checks, after each
        capture, that every rank captured the same collectives)."""
        return FullGraphBackend(B, num_warmups)

    def _static_batch(self, bs: int) -> ForwardBatch:
        """A ForwardBatch whose tensors are views of the static buffers (first ``bs`` rows)."""
        v = self.buffers.view(bs)
        return ForwardBatch(self.capture_forward_mode, v["input_ids"], v["positions"],
                            v["out_cache_loc"], v["req_pool_indices"], v["seq_lens"], [],
                            attn_backend=self.attn)

    def _reset_buffers(self) -> None:
        """Dummy inputs for capture: every row points at the dummy slot, seq_len = sentinel.
        The warmups really run, and this is what keeps them out of live requests' cache."""
        for slot in self.buffers.slots.values():
            slot.tensor.fill_(slot.fill_value if slot.pad is Pad.SENTINEL else 0)
        self.loaded = None                      # whatever was planned or staged is gone

    def capture_prepare(self, bs: int) -> Callable[[], torch.Tensor]:
        self._reset_buffers()
        fb = self.entries[bs].batch
        fb.seq_lens_cpu = [self.buffers.slots["seq_lens"].fill_value] * bs
        self.attn.init_forward_metadata_out_graph(fb, in_capture=True)
        model_fn = self.model
        if self.compile_bs and bs <= self.compile_bs:
            compiled = self._compiled_model()

            def model_fn(*args):
                with quiet_autotune():  # no autotune tables printed while it compiles
                    return compiled(*args)

        def run_once() -> torch.Tensor:
            self.attn.init_forward_metadata_in_graph(fb)  # recorded into the graph
            return model_fn(fb.input_ids, fb.positions, fb)

        return run_once

    def _compiled_model(self):
        """The model through torch.compile, one variant per bucket shape (dynamic=False, as
        SGLang does), with dynamo's recompile limit raised so none silently falls back to
        eager."""
        if self._compiled is None:
            import torch._dynamo
            cfg = torch._dynamo.config
            name = "recompile_limit" if hasattr(cfg, "recompile_limit") else "cache_size_limit"
            n = sum(b <= self.compile_bs for b in self.buckets)
            setattr(cfg, name, max(getattr(cfg, name), n + 8))
            self._compiled = torch.compile(self.model, mode=self.compile_mode, dynamic=False)
        return self._compiled

    # ---- checks ------------------------------------------------------------------------
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

    def check_replayable(self, batch, fn: str, padding_override: dict | None = None, *,
                         need_graphs: bool = True) -> None:
        """What ``fn`` (a replay of ``batch``) needs, checked before anything reaches a
        static buffer: the graphs captured (unless ``need_graphs=False``: :meth:`plan`), the
        batch's layout and values, the KV cache still the model's, ``padding_override``, and
        the mode and tokens per request captured in a bucket that fits."""
        if need_graphs:
            self._check_captured(fn)
        self._check_batch(batch, fn, padding_override)
        if batch.batch_size > self.max_bucket:
            pad_to_bucket(batch.batch_size, self.buckets)  # raises BatchTooLargeError
        k = self.num_tokens_per_bs
        if batch.num_tokens_per_bs != k or batch.forward_mode is not self.capture_forward_mode:
            raise ValueError(f"runner captured {self.capture_forward_mode.name} with {k} "
                             f"token(s)/request; batch is {batch.forward_mode.name} with "
                             f"{batch.num_tokens_per_bs}: use runner.forward(batch), which "
                             "runs other batches eagerly")

    def _check_captured(self, fn: str) -> None:
        if not self.captured:
            raise RuntimeError(f"{fn}: no graphs captured yet: call runner.capture() first")

    def _check_batch(self, batch, fn: str, padding_override: dict | None = None) -> None:
        """Layout (types, dtypes, devices, shapes) and values (ids, positions, slots,
        lengths, cache locations) before anything reaches a static buffer."""
        check_batch(batch, self.model, fn)
        check_same_caches(self.attn, self.model, fn)
        if padding_override:
            check_padding_override(padding_override, self.buffers.slots, fn)

    # ---- the one preparation, the one launch --------------------------------------------
    def _prepare(self, entry: BucketEntry, raw_bs: int, seq_lens_cpu: list[int],
                 batch: ForwardBatch | None) -> LoadedStep:
        """What every way in ends with, once the buffers hold a step (SGLang's
        ``replay_prepare`` after its copies): the padded lengths on the host, the attention
        metadata built out of graph, and the record of what the buffers now hold."""
        fill = self.buffers.slots["seq_lens"].fill_value
        entry.batch.seq_lens_cpu = list(seq_lens_cpu) + [fill] * (entry.bs - raw_bs)
        self.attn.init_forward_metadata_out_graph(entry.batch)
        self.loaded = LoadedStep(entry, raw_bs, raw_bs * self.num_tokens_per_bs, batch)
        return self.loaded

    def _load(self, batch: ForwardBatch, padding_override: dict | None) -> LoadedStep:
        """Pad ``batch`` to its bucket, fill the static buffers by policy (``padding_override``
        over the runner's), then :meth:`_prepare`. Only :meth:`plan` marks the batch."""
        raw_bs = batch.batch_size
        entry = self.entries[pad_to_bucket(raw_bs, self.buckets)]
        self.loaded = None                       # the buffers are about to change
        override = {**self.padding_override, **(padding_override or {})}
        self.buffers.fill_from(batch, raw_bs, entry.bs, override=override or None)
        return self._prepare(entry, raw_bs, batch.seq_lens_cpu, batch)

    def _prepared(self, batch: ForwardBatch, padding_override: dict | None) -> LoadedStep:
        """The step that replays ``batch``. Fast path: the buffers hold the step
        :meth:`plan` loaded from this very batch, unchanged since
        (``needs_forward_metadata_init()`` is False), so only ``input_ids`` and
        ``positions`` are copied again (in spec decoding, the fields that arrive after
        planning). Otherwise :meth:`_load`."""
        step = self.loaded
        if (not padding_override and step is not None and step.batch is batch
                and step.raw_bs == batch.batch_size
                and not batch.needs_forward_metadata_init()):
            n = step.raw_num_tokens
            self.buffers.input_ids[:n].copy_(batch.input_ids)
            self.buffers.positions[:n].copy_(batch.positions)
            self.stats["fast_path"] += 1
            return step
        return self._load(batch, padding_override)

    def _launch(self, step: LoadedStep) -> torch.Tensor:
        """Replay ``step``'s bucket; the output rows of its real tokens."""
        self.last_replay = (step.raw_bs, step.bs)
        out = self.backend.replay(step.bs)
        self.stats["graph"] += 1
        return out[:step.raw_num_tokens]                # drop the padded rows

    # ---- the ways in -------------------------------------------------------------------
    def plan(self, batch: ForwardBatch, padding_override: dict | None = None) -> int:
        """Load a batch into the static buffers and prepare its metadata out of graph.

        SGLang runs this ahead of time on a plan stream; a batch planned here later
        replays through the fast path (only input_ids / positions copied again). Returns
        the bucket size. A batch changed after planning (its slots, lengths or cache
        locations) is detected and planned again at replay, never replayed stale.
        """
        self.check_replayable(batch, "plan", padding_override, need_graphs=False)
        step = self._load(batch, padding_override)
        batch.mark_forward_metadata_ready()  # SGLang's mark, right next to the planning
        return step.bs

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
        self.check_replayable(batch, "replay", padding_override)
        return self._replay(batch, padding_override)

    @torch.no_grad()
    def _replay(self, batch: ForwardBatch, padding_override: dict | None) -> torch.Tensor:
        """replay() after its checks (SGLang's ``CudaGraphRunner.replay``)."""
        return self._launch(self._prepared(batch, padding_override))

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

        A new step starts here: what the buffers held is forgotten first, so a refused
        ``stage()`` leaves nothing for :meth:`replay_staged` (nor the fast path) to replay.
        """
        fn = "stage"
        self.loaded = None
        self._check_captured(fn)
        check_same_caches(self.attn, self.model, fn)
        if self.capture_forward_mode is not ForwardMode.DECODE:
            raise ValueError(f"{fn}: this runner captured {self.capture_forward_mode.name}; "
                             "stage() loads DECODE steps (one token per request)")
        slots, positions = check_staged(self, slots, positions, tokens, fn)
        raw = len(slots)
        entry = self.entries[pad_to_bucket(raw, self.buckets)]
        seq_lens = positions + 1
        values = {"req_pool_indices": slots, "positions": positions,
                  "out_cache_loc": self._req_to_token_host[slots, positions],
                  "seq_lens": seq_lens}
        if not isinstance(tokens, torch.Tensor):
            values["input_ids"] = tokens
        self.buffers.stage(values, raw, entry.bs, self.B)
        if isinstance(tokens, torch.Tensor):   # after the copy, on the same stream
            torch.index_select(tokens, 0, self.buffers.req_pool_indices[:raw],
                               out=self.buffers.input_ids[:raw])
        return self._prepare(entry, raw, seq_lens.tolist(), None).bs

    @torch.no_grad()
    def replay_staged(self) -> torch.Tensor:
        """Replay the step :meth:`stage` loaded; the logits of its real rows (a view of
        the graph's static output, overwritten by the next replay of that bucket)."""
        step = self.loaded
        if step is None or not step.staged:
            raise RuntimeError("replay_staged: nothing staged: call runner.stage(slots, "
                               "positions, tokens) first (replay(batch) loads a batch itself)")
        out = self._launch(step)
        self.stats["staged"] += 1
        return out

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
