"""The speculative decoding loop: draft k tokens, verify them in one step, accept greedily.

One round, for every unfinished request at once:

1. **draft**: the draft model proposes k tokens
   (:class:`~labkit.speculative.runner.DraftGraphRunner`: one graph holding all k steps,
   or the same loop eagerly);
2. **verify**: the target runs ONE forward over ``[newest token, d1, ..., dk]``, k + 1
   tokens per request, in ``ForwardMode.TARGET_VERIFY`` (lesson 06's
   ``DecodeGraphRunner(target, B, num_tokens_per_bs=k + 1)``, or eagerly). k + 1 is what
   SGLang verifies with ``topk = 1`` (sgl-project/sglang;
   ``eagle_worker.py`` at 00559eac): ``ServerArgs._handle_speculative_decoding`` sets
   ``speculative_num_draft_tokens = speculative_num_steps + 1``, ``EAGLEWorker.verify``
   sets ``num_tokens_per_req = speculative_num_steps + 1``, and the target's
   ``DecodeCudaGraphRunner`` captures TARGET_VERIFY with
   ``num_tokens_per_bs = speculative_num_draft_tokens``;
3. **accept** on the device (:func:`greedy_accept`): ``t = argmax`` of the target's logits at
   each of the k + 1 positions; the longest prefix where ``d[j] == t[j - 1]`` is accepted,
   and the target's own next token after it comes free (the bonus). Since accepted draft
   tokens *equal* the target's argmax there, the round's new tokens are simply
   ``t[:n + 1]``: exactly what greedy decoding with the target alone would have produced.
   ONE device→host copy per round brings ``n`` and ``t`` back.

The K/V the target wrote for rejected tokens stays in its cache, beyond the request's
length: masked out (positions past ``seq_len``) and overwritten by the next round before
anything reads it. The same holds for the draft's cache.

.. warning::
    "Exactly greedy" holds up to ties: the verify step computes the target's logits for
    k + 1 tokens in one batch, plain decoding one token at a time, and in floating point
    the two can round differently. Two logits equal to the last bit can then pick
    different argmaxes. In fp32 on these toy models that does not happen in the tests;
    in fp16 on a GPU it can, rarely, and :func:`~labkit.speculative.measure.measure`
    reports whether the tokens matched instead of assuming it.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Sequence

import torch

from labkit import backend
from labkit.core.validate import check_int, is_int
from labkit.decode import (
    DecodeGraphRunner,
    EagerRunner,
    ForwardMode,
    Request,
    ServeResult,
    greedy,
    make_decode_batch,
    make_extend_batch,
    serve,
)
from labkit.decode.buffers import pinned_zeros

from .draft import check_pair
from .runner import DraftGraphRunner

__all__ = ["greedy_accept", "SpecResult", "speculative_generate", "greedy_generate"]


def greedy_accept(draft_tokens: torch.Tensor,
                  target_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy acceptance on the device, no host reads.

    Args:
        draft_tokens: (bs, k) the draft's proposals d1..dk.
        target_logits: (bs * (k + 1), V) the target's logits for
            ``[newest, d1, ..., dk]`` of each request, in that order.

    Returns:
        ``accepted`` (bs,) int64, how many draft tokens each request keeps (0..k), and
        ``target_tokens`` (bs, k + 1), the target's argmax after each prefix. Request
        i's new tokens are ``target_tokens[i, :accepted[i] + 1]``.

    Raises:
        TypeError, ValueError: inputs of another kind, shape or device than these (checked
            on their metadata: no host read).
    """
    _check_accept_inputs(draft_tokens, target_logits)
    bs, k = draft_tokens.shape
    t = greedy(target_logits.view(bs, k + 1, -1))
    agree = (draft_tokens == t[:, :k]).long()
    return agree.cumprod(1).sum(1), t


def _check_accept_inputs(draft_tokens, target_logits) -> None:
    """greedy_accept's inputs: kinds, shapes, dtypes and devices (metadata only)."""
    fn = "greedy_accept"
    for name, t in (("draft_tokens", draft_tokens), ("target_logits", target_logits)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{fn}: {name} must be a tensor on the device, got "
                            f"{type(t).__name__}")
    if draft_tokens.dim() != 2:
        raise ValueError(f"{fn}: draft_tokens must be (bs, k), one row of k draft tokens per "
                         f"request, got shape {tuple(draft_tokens.shape)}: for one request "
                         "pass draft_tokens.view(1, -1)")
    if draft_tokens.is_floating_point() or draft_tokens.is_complex() or \
            draft_tokens.dtype is torch.bool:
        raise TypeError(f"{fn}: draft_tokens must hold token ids (an integer tensor, the "
                        f"draft's argmax), got {draft_tokens.dtype}")
    bs, k = draft_tokens.shape
    rows = bs * (k + 1)
    if target_logits.dim() != 2 or target_logits.shape[0] != rows:
        raise ValueError(
            f"{fn}: target_logits has shape {tuple(target_logits.shape)}; for bs={bs} requests "
            f"of k={k} draft tokens it must be ({rows}, vocab): bs * (k + 1) rows, the logits "
            "of [newest, d1, ..., dk] of each request in that order. Pass the verify step's "
            "logits whole (the newest token's row included)")
    if not target_logits.is_floating_point():
        raise TypeError(f"{fn}: target_logits must be the target's logits (floating point), "
                        f"got {target_logits.dtype}")
    if draft_tokens.device != target_logits.device:
        raise ValueError(f"{fn}: draft_tokens is on {draft_tokens.device}, target_logits on "
                         f"{target_logits.device}: both come from the device (keep them there: "
                         "acceptance runs without a host read)")


@dataclass
class SpecResult:
    """Tokens and per-round measurements of one :func:`speculative_generate` run.

    The ``*_s`` lists hold, per round, the time of each part on the device's clock
    (``B.Event`` pairs: on the emulator, the host clock): from the end of the previous
    part to the end of this one, so the parts of a round add up to its device-side span
    and host work that overlaps device work is counted once. ``host_s`` is the host's
    bookkeeping after the read-back.
    """

    tokens: list[list[int]]              # per request: max_new_tokens ids (prefill's first)
    num_steps: int
    accepted: list[list[int]] = field(default_factory=list)   # per round, per request in it
    batch_size: list[int] = field(default_factory=list)       # requests in each round
    round_s: list[float] = field(default_factory=list)        # wall time of each round
    draft_s: list[float] = field(default_factory=list)
    verify_s: list[float] = field(default_factory=list)
    accept_s: list[float] = field(default_factory=list)
    host_s: list[float] = field(default_factory=list)
    prefill_s: float = 0.0
    draft_stats: dict | None = None      # the draft runner's counters during this run
    verify_stats: dict | None = None     # the verify runner's counters (None: eager)

    @property
    def rounds(self) -> int:
        return len(self.accepted)

    @property
    def decode_tokens(self) -> int:
        """Tokens the rounds added (the prefill's first token of each request excluded)."""
        return sum(len(t) for t in self.tokens) - len(self.tokens)

    @property
    def acceptance_rate(self) -> float:
        """Accepted draft tokens / proposed draft tokens, over every request and round."""
        proposed = self.num_steps * sum(self.batch_size)
        return sum(map(sum, self.accepted)) / proposed if proposed else 0.0

    @property
    def tokens_per_round(self) -> float:
        """Mean new tokens per request per round (1 + accepted), before the last round's
        tokens are cut to the budget."""
        n = sum(self.batch_size)
        return (n + sum(map(sum, self.accepted))) / n if n else 0.0

    @property
    def decode_s(self) -> float:
        return sum(self.round_s)

    @property
    def decode_tokens_per_s(self) -> float:
        return self.decode_tokens / self.decode_s if self.decode_s else 0.0

    def summary(self) -> dict:
        """Totals and per-round means (ms), for a table row."""
        per = {name: 1e3 * statistics.fmean(v) if v else 0.0
               for name, v in (("round_ms", self.round_s), ("draft_ms", self.draft_s),
                               ("verify_ms", self.verify_s), ("accept_ms", self.accept_s),
                               ("host_ms", self.host_s))}
        return {"rounds": self.rounds, "decode_tokens": self.decode_tokens,
                "acceptance_rate": self.acceptance_rate,
                "tokens_per_round": self.tokens_per_round,
                "decode_tokens_per_s": self.decode_tokens_per_s, **per}


def _check_prompts(model, prompts, max_new_tokens, extra: int, fn: str) -> list[list[int]]:
    """Prompts as lists of ints that fit the model together with their new tokens."""
    if isinstance(prompts, (str, bytes, torch.Tensor)) or not hasattr(prompts, "__len__"):
        raise TypeError(f"{fn}: prompts must be a list of token-id lists, got "
                        f"{type(prompts).__name__}")
    out = []
    for i, p in enumerate(prompts):
        if isinstance(p, (str, bytes)) or not hasattr(p, "__len__") or not all(map(is_int, p)):
            raise TypeError(f"{fn}: prompts[{i}] must be a list of token ids (ints), got "
                            f"{p!r:.60}")
        out.append([int(t) for t in p])
    slots = model.num_slots - 1
    if not 1 <= len(out) <= slots:
        raise ValueError(f"{fn}: {len(out)} prompts; the model has request slots for 1..{slots} "
                         "(build_model(max_requests=...))")
    vocab, width = model.args.vocab_size, model.args.max_seq_len
    for i, p in enumerate(out):
        if not p:
            raise ValueError(f"{fn}: prompts[{i}] is empty: a request starts with >= 1 token")
        bad = [t for t in p if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"{fn}: prompts[{i}] holds token id {bad[0]}, outside the "
                             f"vocabulary 0..{vocab - 1}")
        need = len(p) + max_new_tokens - 1 + extra
        if need > width:
            raise ValueError(f"{fn}: prompts[{i}] has {len(p)} tokens; with "
                             f"max_new_tokens={max_new_tokens}"
                             + (f" and {extra} tokens verified past the last one" if extra else "")
                             + f" it needs {need} positions, more than max_seq_len={width}: "
                             "shorten the prompt, ask for fewer tokens"
                             + (" or lower num_steps" if extra else ""))
    return out


def greedy_generate(model, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                    runner=None) -> ServeResult:
    """Plain greedy decoding of a batch (the reference): lesson 06's :func:`serve` with
    every request arriving at once. ``runner``: a captured ``DecodeGraphRunner`` or None
    (eager). ``result.tokens[i]`` are request i's ``max_new_tokens`` tokens."""
    fn = "greedy_generate"
    check_int(f"{fn}: max_new_tokens", max_new_tokens, 1)
    prompts = _check_prompts(model, prompts, max_new_tokens, 0, fn)
    wl = [Request(i, 0, p, max_new_tokens) for i, p in enumerate(prompts)]
    return serve(model, wl, runner=runner, max_running=len(wl))


def _resolve(target, draft, num_steps, draft_runner, verify_runner, B):
    """The backend and both runners, checked against the models and each other."""
    fn = "speculative_generate"
    if draft_runner is not None:
        if not isinstance(draft_runner, DraftGraphRunner):
            raise TypeError(f"{fn}: draft_runner must be a DraftGraphRunner (or None), got "
                            f"{type(draft_runner).__name__}")
        if draft_runner.model is not draft:
            raise ValueError(f"{fn}: draft_runner was built for another draft model: pass "
                             "DraftGraphRunner(draft, ...) of this draft")
        if num_steps is not None and num_steps != draft_runner.num_steps:
            raise ValueError(f"{fn}: num_steps={num_steps} but draft_runner proposes "
                             f"{draft_runner.num_steps} tokens per round: leave num_steps out "
                             "or build the runner with the same num_steps")
        num_steps = draft_runner.num_steps
    elif num_steps is None:
        raise ValueError(f"{fn}: give num_steps (draft tokens per round, >= 1) or a "
                         "draft_runner, which carries it")
    k = check_int(f"{fn}: num_steps", num_steps, 1,
                  fix="the draft proposes at least one token per round")
    if B is None:
        B = (draft_runner.B if draft_runner is not None
             else getattr(verify_runner, "B", None)
             or backend.get("cuda" if target.device.type == "cuda" else "emulated"))
    B = backend.ensure(B, f"{fn}(B=...)")
    if verify_runner is not None:
        if not isinstance(verify_runner, DecodeGraphRunner):
            raise TypeError(f"{fn}: verify_runner must be a DecodeGraphRunner (or None), got "
                            f"{type(verify_runner).__name__}")
        if verify_runner.model is not target:
            raise ValueError(f"{fn}: verify_runner was built for another model: pass "
                             "DecodeGraphRunner(target, B, num_tokens_per_bs=num_steps + 1)")
        if (verify_runner.capture_forward_mode is not ForwardMode.TARGET_VERIFY
                or verify_runner.num_tokens_per_bs != k + 1):
            raise ValueError(f"{fn}: verify_runner captured {verify_runner.num_tokens_per_bs} "
                             f"token(s) per request ({verify_runner.capture_forward_mode.name});"
                             f" verifying {k} draft tokens feeds {k + 1} (the newest token and "
                             f"the drafts): build it with num_tokens_per_bs={k + 1}")
        if not verify_runner.captured:
            raise RuntimeError(f"{fn}: verify_runner has no graphs yet: call "
                               "verify_runner.capture() first (or pass None to verify eagerly)")
    if draft_runner is None:
        # Not captured: the same draft loop, run eagerly (sized for the whole batch).
        draft_runner = DraftGraphRunner(draft, B, k, max_bs=draft.num_slots - 1)
    return B, k, draft_runner, verify_runner


@torch.no_grad()
def speculative_generate(target, draft, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                         num_steps: int | None = None, *,
                         draft_runner: DraftGraphRunner | None = None,
                         verify_runner: DecodeGraphRunner | None = None,
                         B=None) -> SpecResult:
    """Generate ``max_new_tokens`` tokens per prompt by greedy speculative decoding.

    Args:
        target: the model whose greedy tokens come out (a ``build_model`` model).
        draft: the model that proposes (e.g. :func:`~labkit.speculative.draft.make_draft`).
        prompts: one list of token ids per request (they take slots 1..len(prompts)).
        max_new_tokens: tokens per request, the prefill's first one included (as in
            lesson 06's ``serve``).
        num_steps: k, draft tokens per round (taken from ``draft_runner`` if given).
        draft_runner: a :class:`DraftGraphRunner` of ``draft``: its graphs when captured,
            its eager loop otherwise; None: an uncaptured one (eager).
        verify_runner: a captured ``DecodeGraphRunner(target, B, num_tokens_per_bs=k + 1)``;
            None: verify eagerly.
        B: the backend (default: the runners', else the models' device's).

    Returns:
        :class:`SpecResult`; ``result.tokens`` equals plain greedy decoding's tokens
        (:func:`greedy_generate`), up to exact floating-point ties.

    .. warning::
        Both models' KV caches are written at slots ``1..len(prompts)``: whatever another
        loop kept there is overwritten.
    """
    fn = "speculative_generate"
    check_pair(target, draft, fn)
    check_int(f"{fn}: max_new_tokens", max_new_tokens, 1)
    B, k, draft_runner, verify_runner = _resolve(target, draft, num_steps, draft_runner,
                                                 verify_runner, B)
    prompts = _check_prompts(target, prompts, max_new_tokens, k, fn)
    if len(prompts) > draft_runner.max_bs:
        raise ValueError(f"{fn}: {len(prompts)} prompts but the draft runner holds at most "
                         f"{draft_runner.max_bs} requests (max_bs): build it with "
                         f"max_bs={len(prompts)}")
    if verify_runner is not None and len(prompts) > verify_runner.max_bucket:
        raise ValueError(f"{fn}: {len(prompts)} prompts but the verify runner's largest graph "
                         f"holds {verify_runner.max_bucket}: capture it with "
                         f"max_bs={len(prompts)}")
    verify = verify_runner.forward if verify_runner is not None else EagerRunner(target).forward
    n = len(prompts)
    slots = list(range(1, n + 1))
    dev = target.device
    res = SpecResult(tokens=[[] for _ in prompts], num_steps=k)
    draft_stats0 = dict(draft_runner.stats)
    verify_stats0 = dict(verify_runner.stats) if verify_runner is not None else None

    # Prefill both models (eager: variable length), the target's first token per request.
    B.synchronize()
    t0 = time.perf_counter()
    logits = EagerRunner(target).forward(make_extend_batch(target, slots, prompts))
    last_rows = torch.tensor([len(p) for p in prompts], device=dev).cumsum(0) - 1
    first = greedy(logits.index_select(0, last_rows)).tolist()
    EagerRunner(draft).forward(make_extend_batch(draft, slots, prompts))
    B.synchronize()
    res.prefill_s = time.perf_counter() - t0

    # Per request: its tokens, the position of its newest token, the token before it.
    for i, t in enumerate(first):
        res.tokens[i].append(t)
    pos = [len(p) for p in prompts]
    prev = [p[-1] for p in prompts]
    readback = pinned_zeros((n, k + 2), torch.int64, dev)
    events = [B.Event(enable_timing=True) for _ in range(4)]

    live = [i for i in range(n) if len(res.tokens[i]) < max_new_tokens]
    while live:
        b = len(live)
        r_slots = [slots[i] for i in live]
        r_pos = [pos[i] for i in live]
        r_new = [res.tokens[i][-1] for i in live]
        t_round = time.perf_counter()
        events[0].record()
        drafts = draft_runner.forward(r_slots, r_pos, [prev[i] for i in live], r_new)
        events[1].record()
        batch = make_decode_batch(target, r_slots, [[t] * (k + 1) for t in r_new], r_pos,
                                  mode=ForwardMode.TARGET_VERIFY)
        batch.input_ids = torch.cat([batch.input_ids.view(b, k + 1)[:, :1], drafts],
                                    dim=1).reshape(-1)
        # The drafts are argmax indices over the draft's vocabulary, which check_pair made
        # the target's: in range by construction, so no device→host check (a sync) here.
        batch.mark_values_checked()
        logits = verify(batch)
        events[2].record()
        accepted, target_tokens = greedy_accept(drafts, logits)
        host = readback[:b]                         # contiguous rows of a pinned buffer
        host.copy_(torch.cat([accepted.unsqueeze(1), target_tokens], dim=1), non_blocking=True)
        events[3].record()
        events[3].synchronize()                     # the round's one wait for the device
        t_host = time.perf_counter()
        rows = host.tolist()
        res.accepted.append([r[0] for r in rows])
        for i, r in zip(live, rows):
            new = r[1:r[0] + 2][:max_new_tokens - len(res.tokens[i])]
            prev[i] = res.tokens[i][-1] if len(new) == 1 else new[-2]
            res.tokens[i].extend(new)
            pos[i] += len(new)
        live = [i for i in live if len(res.tokens[i]) < max_new_tokens]
        done = time.perf_counter()
        res.batch_size.append(b)
        res.round_s.append(done - t_round)
        res.draft_s.append(events[0].elapsed_time(events[1]) / 1e3)
        res.verify_s.append(events[1].elapsed_time(events[2]) / 1e3)
        res.accept_s.append(events[2].elapsed_time(events[3]) / 1e3)
        res.host_s.append(done - t_host)
    res.draft_stats = {key: v - draft_stats0.get(key, 0) for key, v in draft_runner.stats.items()}
    if verify_runner is not None:
        res.verify_stats = {key: v - verify_stats0.get(key, 0)
                            for key, v in verify_runner.stats.items()}
    return res
