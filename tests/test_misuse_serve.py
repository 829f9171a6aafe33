"""The overlapped serving loop's parts under misuse (issue 29 §3): ``TokenReadback``,
``decode_step_overlapped`` and the static buffers it stages into. Each wrong
input is refused before any work is queued, naming what was given, what was expected and
what to do; a step too large for its read-back buffer no longer loses tokens. ``serve``'s
own arguments are covered in tests/test_misuse_decode.py. ``land`` is left as it is (lesson
06 prints its source); its ``inflight`` is checked by ``decode_step_overlapped``.
"""

from __future__ import annotations

import re

import pytest
import torch
from helpers import DecodeModels

from labkit.decode import Request, StaticBuffers, make_decode_batch, serve, synthetic_workload
from labkit.decode.serving import TokenReadback, decode_step_overlapped, land

pytestmark = pytest.mark.usefixtures("one_thread")
DECODE = DecodeModels(4, seed=3, prompt_lens=(3, 10))


def _raises(err, words, call):
    with pytest.raises(err, match=re.escape(words)):
        call()


def _running(state, slots):
    """Admitted requests in ``slots``, each with the prefill's token as its output."""
    return [Request(s, 0, [1] * p, 8, output=[t], slot=s) for s, (t, p) in
            ((s, state[s]) for s in slots)]


# ---- TokenReadback ---------------------------------------------------------------------------


@pytest.mark.parametrize("max_bs, err, words", [
    (0, ValueError, "TokenReadback: max_bs must be >= 1, got 0: the most requests one step "
                    "reads back"),
    ("4", TypeError, "TokenReadback: max_bs must be an int >= 1, got '4' (str)"),
])
def test_token_readback_size(E, max_bs, err, words):
    """Before: TokenReadback(0) built two empty buffers; '4' failed inside torch.zeros."""
    _raises(err, words, lambda: TokenReadback(max_bs, E.device))


def test_token_readback_next_larger_than_its_buffers(E):
    """Before: next(5) of a 2-token buffer returned 2 entries, and land() zipped 5 requests with
    2 tokens: 3 tokens lost, silently."""
    rb = TokenReadback(2, E.device)
    _raises(ValueError, "TokenReadback.next: n must be in 1..2, got 5: the buffers hold 2 tokens "
                        "(max_bs): build TokenReadback(max_bs=5, ...) for steps of 5 requests",
            lambda: rb.next(5))
    assert rb.next(2).shape == (2,)


# ---- decode_step_overlapped ------------------------------------------------------------------


def _step_args(B, slots=(1, 2)):
    m, state = DECODE.model(B)
    r = DECODE.runner(B)
    table = torch.zeros(m.num_slots, dtype=torch.int64, device=m.device)
    return r, _running(state, list(slots)), table, TokenReadback(4, m.device)


@pytest.mark.parametrize("change, err, words", [
    (lambda a: {**a, "runner": object()}, TypeError,
     "decode_step_overlapped: runner must be a captured DecodeGraphRunner (the step is staged "
     "into its static buffers), got object"),
    (lambda a: {**a, "running": []}, ValueError,
     "decode_step_overlapped: running must be a non-empty list of Request, got []: skip the step "
     "when nothing runs"),
    (lambda a: {**a, "running": [{"slot": 1}]}, TypeError,
     "running[0] must be a Request holding a slot (an admitted request), got {'slot': 1}"),
    (lambda a: {**a, "running": [Request(0, 0, [1, 2], 4, output=[3])]}, TypeError,
     "running[0] must be a Request holding a slot"),
    (lambda a: {**a, "readback": [0, 0]}, TypeError,
     "readback must be a TokenReadback(max_bs, device), got list"),
    (lambda a: {**a, "readback": TokenReadback(1, a["next_tokens"].device)}, ValueError,
     "decode_step_overlapped: 2 requests run, but readback holds 1 tokens per step: build "
     "TokenReadback(max_bs=2, ...) (serve sizes it by max_running)"),
    (lambda a: {**a, "inflight": (1, 2)}, TypeError,
     "inflight must be None (the first step) or what the previous call returned, got (1, 2)"),
])
def test_overlapped_step_refused_before_any_work(E, change, err, words):
    """Before: AttributeError on a non-runner, a wait on nothing for an empty list, and a
    too-small read-back buffer failed after the step had replayed and written the token
    table (torch's "output with shape [1] doesn't match the broadcast shape [2]")."""
    r, running, table, rb = _step_args(E)
    args = change({"runner": r, "running": running, "next_tokens": table, "readback": rb,
                   "inflight": None})
    replays, before = dict(r.stats), table.clone()
    _raises(err, words, lambda: decode_step_overlapped(**args))
    assert r.stats == replays and torch.equal(table, before), "nothing was queued"
    assert all(q.pending == 0 for q in running)


def test_overlapped_steps_by_hand_give_serve_tokens(B):
    """The parts used as serve uses them, after refusals: the same tokens as the eager loop."""
    m, state = DECODE.model(B)
    r, running, table, rb = _step_args(B, slots=(1, 2, 3))
    for q in running:
        table[q.slot] = q.output[-1]
    with pytest.raises(ValueError):
        decode_step_overlapped(r, running, table, TokenReadback(1, m.device), None)
    inflight = None
    for _ in range(3):
        inflight = decode_step_overlapped(r, running, table, rb, inflight)
    land(inflight)
    eager = _running(state, [1, 2, 3])
    from labkit.decode import EagerRunner
    for _ in range(3):
        batch = make_decode_batch(m, [q.slot for q in eager], [q.output[-1] for q in eager],
                                  [q.seq_len - 1 for q in eager])
        for q, t in zip(eager, EagerRunner(m).forward(batch).argmax(-1).tolist()):
            q.output.append(t)
    assert [q.output for q in running] == [q.output for q in eager]


def test_serve_overlap_still_matches_eager(E):
    m, _ = DECODE.model(E)
    wl = synthetic_workload(4, vocab_size=m.args.vocab_size, max_seq_len=m.args.max_seq_len,
                            seed=2)
    assert serve(m, wl, runner=DECODE.runner(E), overlap=True).tokens == serve(m, wl).tokens


# ---- the static buffers a step is staged into -------------------------------------------------


@pytest.mark.parametrize("args, err, words", [
    ((0,), ValueError, "StaticBuffers: max_bs must be >= 1, got 0: the largest batch (requests) "
                       "a graph replays"),
    ((4, 0), ValueError, "StaticBuffers: num_tokens_per_bs must be >= 1, got 0: the tokens each "
                         "request feeds per step"),
    ((2.0,), TypeError, "StaticBuffers: max_bs must be an int >= 1, got 2.0 (float)"),
])
def test_static_buffers_sizes(E, args, err, words):
    """Before: StaticBuffers(0) and (4, 0) built empty buffers without a word; 2.0 failed in
    torch.zeros."""
    _raises(err, words, lambda: StaticBuffers(*args, device=E.device))


_VALUES = {"req_pool_indices": [1, 2], "positions": [5, 6], "out_cache_loc": [1, 2],
           "seq_lens": [6, 7]}


@pytest.mark.parametrize("call, words", [
    (lambda sb, b, B: sb.fill_from(b, 2, 1),
     "fill_from: raw_bs must be in 0..1, got 2: the batch's requests, padded up to padded_bs=1"),
    (lambda sb, b, B: sb.fill_from(b, 2, 8),
     "fill_from: padded_bs=8 needs 8 rows of input_ids, which holds 4 (max_bs=4): replay a "
     "bucket the buffers hold"),
    (lambda sb, b, B: sb.fill_from(b, 0, 0), "fill_from: padded_bs must be >= 1, got 0"),
    (lambda sb, b, B: sb.stage(_VALUES, 2, 1, B), "stage: raw_bs must be in 0..1, got 2"),
    (lambda sb, b, B: sb.stage(_VALUES, 2, 9, B), "stage: padded_bs=9 needs 9 rows of input_ids"),
])
def test_static_buffers_rows(E, call, words):
    """Before: fill_from raised torch's narrow() errors; stage(raw 2, padded 1) and (padded 9
    of 4) returned without a word, staging rows the replayed bucket never reads."""
    m, state = DECODE.model(E)
    sb = StaticBuffers(4, device=m.device)
    b = make_decode_batch(m, [1, 2], [state[1][0], state[2][0]], [state[1][1], state[2][1]])
    _raises(ValueError, words, lambda: call(sb, b, E))
