"""The draft runner: ONE graph per batch-size bucket holding all k draft steps.

SGLang's ``EAGLEDraftCudaGraphRunner`` (sgl-project/sglang,
``python/sglang/srt/speculative/eagle_draft_cuda_graph_runner.py`` at 00023be5, and
``eagle_worker.py`` at 00559eac) captures, per bucket, a single full graph around
``EAGLEWorker.draft_forward``: the whole multi-step draft loop (forward, top-k, the next
step's inputs, ``forward_batch.positions.add_(1)``), each step with its own attention backend
(``draft_attn_backend.attn_backends[i]``), the metadata of every step prepared out of
graph before the replay (``init_forward_metadata_replay_cuda_graph``). Its static inputs
are sized by ``max_num_token = max_bs * topk`` tokens, and ``out_cache_loc`` by
``max_num_token * speculative_num_steps``: every step's cache location is allocated
before the replay. With ``topk = 1`` (greedy) the loop is a chain, which is what
:class:`DraftGraphRunner` captures::

    step 0      feed [token at p-1, token at p]  -> argmax of the second = draft token 1
    step j      feed draft token j at p+j        -> argmax = draft token j+1   (0 < j < k)

Positions, sequence lengths, cache locations and the next input are computed **on the
device**, inside the graph; the host reads nothing back. (Here a cache location is looked
up in ``req_to_token`` inside the graph, since every slot owns its positions' locations in
lesson 06's layout; SGLang's allocator hands them out before the replay instead.)

The first step feeds two tokens because the draft may lack the K/V of the token before
the newest one: when the target accepted all k draft tokens, the k-th was never fed to the
draft. SGLang fills the draft's cache with a separate draft-extend pass after verify
(``EAGLEWorker.forward_draft_extend_after_decode``), and its ``draft_forward`` runs
``speculative_num_steps - 1`` forwards ("we get 1 token from draft prefill and (#spec
steps - 1) tokens here"). Feeding that token again inside the draft graph does the same
job: k draft tokens cost k draft forwards here too. Rewriting a K/V the draft already has
changes it at most by rounding, and only the draft reads it: it can change what the draft
proposes, never which tokens come out.

Typical use (any backend)::

    runner = DraftGraphRunner(draft, B, num_steps=4, max_bs=8)
    runner.capture()                         # optional: without it, forward runs eagerly
    drafts = runner.forward(slots, positions, prev_tokens, tokens)   # (bs, 4), on device

.. warning::
    ``forward`` returns a view of the graph's static output: the next call overwrites it.
    Use it (or ``.clone()`` it) first.
"""

from __future__ import annotations

from typing import Callable, Iterable, Sequence

import numpy as np
import torch

from labkit.backend import ensure as ensure_backend
from labkit.core.validate import check_int
from labkit.decode import (
    BaseGraphRunner,
    ForwardBatch,
    ForwardMode,
    FullGraphBackend,
    Pad,
    StaticBuffers,
    TorchNativeAttnBackend,
    make_buckets,
    pad_to_bucket,
)
from labkit.decode.batch import check_model, check_slots, check_tokens

__all__ = ["DraftGraphRunner"]


class DraftGraphRunner(BaseGraphRunner):
    """Draft graphs for every bucket up to ``max_bs``, each running ``num_steps`` steps.

    draft       a :func:`~labkit.decode.build_model` model (e.g. from
                :func:`~labkit.speculative.draft.make_draft`)
    B           the backend namespace (``labkit.backend.get(...)``)
    num_steps   k, the draft tokens proposed per request per round (SGLang's
                ``speculative_num_steps``), >= 1
    max_bs      the largest batch (default: every request slot of the draft); the static
                buffers are sized by it
    buckets     a scheme of :func:`~labkit.decode.make_buckets` ("sglang_spec", SGLang's
                list under speculative decoding, by default) or a list of sizes
    num_warmups warm-up runs before each capture

    Without :meth:`capture` (or for a batch the graphs do not hold) :meth:`forward` runs
    the very same loop eagerly: SGLang's draft runs ``draft_forward`` itself then.
    """

    def __init__(self, draft, B, num_steps: int, max_bs: int | None = None,
                 buckets: str | Iterable[int] = "sglang_spec", num_warmups: int = 2,
                 progress: bool = False):
        check_model(draft, "DraftGraphRunner(draft)")
        B = ensure_backend(B, "DraftGraphRunner(draft, B)")
        if draft.device.type != torch.device(B.device).type:
            raise ValueError(f"DraftGraphRunner: the draft is on {draft.device} but backend "
                             f"{B.name!r} runs on {B.device}: build it with device=B.device")
        width = draft.args.max_seq_len
        k = check_int("DraftGraphRunner: num_steps", num_steps, 1, width - 2,
                      fix="the draft tokens per request per round (step j writes position "
                      "p + j, which must fit max_seq_len)")
        slots = draft.num_slots - 1
        max_bs = slots if max_bs is None else check_int(
            "DraftGraphRunner: max_bs", max_bs, 1, slots,
            fix=f"the draft has {slots} request slots (build_model(max_requests=...))")
        if not isinstance(progress, bool):
            raise TypeError(f"DraftGraphRunner: progress must be True or False, got {progress!r}")
        super().__init__(B, make_buckets(max_bs, buckets), FullGraphBackend(B, num_warmups),
                         progress)
        self.model, self.num_steps, self.max_bs = draft, k, max_bs
        dev = draft.device
        # Step 0's inputs, two tokens per request, filled from the host in one copy.
        self.buffers = StaticBuffers(max_bs, num_tokens_per_bs=2, device=dev)
        # Steps 1..k-1: written inside the graph, never by the host.
        self.step = {name: torch.zeros(max_bs, dtype=torch.int64, device=dev)
                     for name in ("input_ids", "positions", "out_cache_loc", "seq_lens")}
        self.out_tokens = torch.zeros((max_bs, k), dtype=torch.int64, device=dev)
        # One attention backend per token layout, as SGLang keeps one per step: their
        # metadata tensors are separate static buffers the graph reads.
        self.attn_first = TorchNativeAttnBackend(draft)
        self.attn_first.init_cuda_graph_state(max_bs, 2 * max_bs)
        self.attn_next = TorchNativeAttnBackend(draft)
        self.attn_next.init_cuda_graph_state(max_bs, max_bs)
        self._table = draft.req_to_token.reshape(-1)
        self._req_to_token_host = draft.req_to_token.cpu().numpy()
        self._batches: dict[int, tuple[ForwardBatch, ForwardBatch]] = {}
        self.stats = {"graph": 0, "eager": 0}
        self.last_replay: tuple[int, int] | None = None

    # ---- the loop (captured, or run as it is) -----------------------------------------
    def _step_batches(self, bs: int) -> tuple[ForwardBatch, ForwardBatch]:
        """Step 0's and step j's batches for ``bs`` rows: views of the static buffers."""
        if bs not in self._batches:
            v = self.buffers.view(bs)
            first = ForwardBatch(ForwardMode.TARGET_VERIFY, v["input_ids"], v["positions"],
                                 v["out_cache_loc"], v["req_pool_indices"], v["seq_lens"],
                                 [], attn_backend=self.attn_first)
            s = {n: t[:bs] for n, t in self.step.items()}
            nxt = ForwardBatch(ForwardMode.DECODE, s["input_ids"], s["positions"],
                               s["out_cache_loc"], v["req_pool_indices"], s["seq_lens"], [],
                               attn_backend=self.attn_next)
            self._batches[bs] = (first, nxt)
        return self._batches[bs]

    def _draft_loop(self, bs: int) -> torch.Tensor:
        """All k draft steps for the first ``bs`` rows; returns draft tokens (bs, k).
        Static shapes only, no host reads: this is what a graph records."""
        first, nxt = self._step_batches(bs)
        model, width = self.model, self.model.args.max_seq_len
        out = self.out_tokens[:bs]
        self.attn_first.init_forward_metadata_in_graph(first)
        logits = model(first.input_ids, first.positions, first)
        tok = logits.view(bs, 2, -1)[:, 1].argmax(-1)     # the guess after the newest token
        out[:, 0].copy_(tok)
        newest = first.positions.view(bs, 2)[:, 1]
        for j in range(1, self.num_steps):
            nxt.input_ids.copy_(tok)
            torch.add(newest, j, out=nxt.positions)
            torch.add(nxt.positions, 1, out=nxt.seq_lens)
            torch.index_select(self._table, 0, nxt.req_pool_indices * width + nxt.positions,
                               out=nxt.out_cache_loc)
            self.attn_next.init_forward_metadata_in_graph(nxt)
            tok = model(nxt.input_ids, nxt.positions, nxt).argmax(-1)
            out[:, j].copy_(tok)
        return out

    def _plan(self, bs: int, final_lens: Sequence[int]) -> None:
        """Out of graph: both backends' page tables, wide enough for the last step."""
        first, nxt = self._step_batches(bs)
        first.seq_lens_cpu = nxt.seq_lens_cpu = list(final_lens)
        self.attn_first.init_forward_metadata_out_graph(first)
        self.attn_next.init_forward_metadata_out_graph(nxt)

    # ---- capture -----------------------------------------------------------------------
    def capture_prepare(self, bs: int) -> Callable[[], torch.Tensor]:
        # Dummy inputs: every row in the dummy slot at positions 0.., so the warm-ups
        # (which really run) write only where padded rows always write.
        for slot in self.buffers.slots.values():
            slot.tensor.fill_(slot.fill_value if slot.pad is Pad.SENTINEL else 0)
        fill = self.buffers.slots["seq_lens"].fill_value
        self._plan(bs, [fill + self.num_steps] * bs)
        return lambda: self._draft_loop(bs)

    # ---- replay ------------------------------------------------------------------------
    def can_run(self, bs: int) -> bool:
        """Replay a graph (True) or run the loop eagerly (False) for ``bs`` requests."""
        check_int("DraftGraphRunner.can_run: bs", bs, 0, fix="the number of requests")
        return self.captured and 1 <= bs <= self.max_bucket

    @torch.no_grad()
    def forward(self, slots: Sequence[int], positions: Sequence[int],
                prev_tokens: Sequence[int], tokens: Sequence[int]) -> torch.Tensor:
        """Propose ``num_steps`` tokens for each request; returns (bs, num_steps) int64.

        ``tokens[i]`` is request i's newest token, at ``positions[i]`` (not in the draft's
        KV cache yet); ``prev_tokens[i]`` the one before it, at ``positions[i] - 1``.
        ``slots[i]`` is the request's KV slot. All host ints: they reach the static
        buffers in one copy. Graph when captured and the batch fits, else eager.
        """
        bs, values, final = self._stage_values(slots, positions, prev_tokens, tokens)
        graphed = self.can_run(bs)
        padded = pad_to_bucket(bs, self.buckets) if graphed else bs
        self.buffers.stage(values, bs, padded, self.B)
        fill = self.buffers.slots["seq_lens"].fill_value
        self._plan(padded, final + [fill + self.num_steps] * (padded - bs))
        self.last_replay = (bs, padded)
        if graphed:
            self.stats["graph"] += 1
            return self.backend.replay(padded)[:bs]
        self.stats["eager"] += 1
        return self._draft_loop(bs)

    def _stage_values(self, slots, positions, prev_tokens, tokens):
        """Checked host values for :meth:`StaticBuffers.stage` and each row's final length."""
        fn = "DraftGraphRunner.forward"
        m, k = self.model, self.num_steps
        num_rows, width = self._req_to_token_host.shape
        lists = {}
        for name, values in (("slots", slots), ("positions", positions),
                             ("prev_tokens", prev_tokens), ("tokens", tokens)):
            if isinstance(values, torch.Tensor):
                raise TypeError(f"{fn}: {name} is a tensor; pass host ints ({name}.tolist()): "
                                "reading a device tensor back would be a sync")
            if isinstance(values, (str, bytes)) or not hasattr(values, "__len__"):
                raise TypeError(f"{fn}: {name} must be a list of ints, got "
                                f"{type(values).__name__}")
            lists[name] = [check_int(f"{fn}: {name}[{i}]", v, None) for i, v in enumerate(values)]
        bs = len(lists["slots"])
        lens = {n: len(v) for n, v in lists.items()}
        if len(set(lens.values())) != 1:
            raise ValueError(f"{fn}: one entry per request in each list, got lengths {lens}")
        if not 1 <= bs <= self.max_bs:
            raise ValueError(f"{fn}: {bs} requests, but this runner's static buffers hold "
                             f"1..{self.max_bs} (max_bs): build it with max_bs >= {bs} or "
                             "draft for fewer requests at a time")
        check_slots(lists["slots"], num_rows, fn)
        check_tokens(lists["prev_tokens"] + lists["tokens"], m.args.vocab_size, fn,
                      "prev_tokens/tokens")
        for i, p in enumerate(lists["positions"]):
            if not 1 <= p <= width - k:
                raise ValueError(f"{fn}: positions[{i}] = {p}: the draft reads position "
                                 f"{p - 1} and writes up to {p + k - 1}, which must lie in "
                                 f"0..{width - 1} (max_seq_len = {width}, num_steps = {k})")
        s = np.asarray(lists["slots"], dtype=np.int64)
        p = np.asarray(lists["positions"], dtype=np.int64)
        pos = np.stack([p - 1, p], axis=1).reshape(-1)
        values = {
            "input_ids": np.stack([lists["prev_tokens"], lists["tokens"]], 1).reshape(-1),
            "positions": pos,
            "out_cache_loc": self._req_to_token_host[np.repeat(s, 2), pos],
            "req_pool_indices": s,
            "seq_lens": p + 1,
        }
        return bs, values, (p + k).tolist()
