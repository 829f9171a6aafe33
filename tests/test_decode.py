"""labkit.decode: buckets, padding policies, the decode graph runner, the serving loop.

Every runner test takes the ``B`` fixture (tests/conftest.py): it runs on the emulator
everywhere and again on a GPU where one is present (``pytest -m cuda``). The model is tiny
(2 layers, dim 64, 16 request slots) so the whole file runs in seconds on a CPU.
"""

from __future__ import annotations

import re
import warnings

import pytest
import torch
from helpers import DecodeModels, prefill_slots

from labkit import backend
from labkit.decode import (
    BatchTooLargeError,
    DecodeGraphRunner,
    ForwardMode,
    Pad,
    StaticBuffers,
    build_model,
    default_buckets,
    demo_stale_tail,
    explore_buckets,
    make_buckets,
    make_decode_batch,
    make_extend_batch,
    pad_to_bucket,
    pow2_buckets,
    serve,
    synthetic_workload,
)

MAX_BS = 16

# ---- buckets (pure) --------------------------------------------------------------------


@pytest.mark.parametrize("max_bs", [1, 2, 3, 12, 13, 16, 100, 256, 300, 511, 512, 600, 1024])
def test_default_buckets_properties(max_bs):
    b = default_buckets(max_bs)
    assert b == sorted(set(b)), "sorted, no duplicates"
    assert b[-1] == max_bs and all(1 <= x <= max_bs for x in b)
    full = ([1, 2, 4, 8, 12] + list(range(16, 257, 8)) + list(range(272, 512, 16))
            + list(range(512, max_bs + 1, 32)))
    assert set(b) == {x for x in full if x <= max_bs} | {max_bs}


def test_default_buckets_known_values():
    assert default_buckets(16) == [1, 2, 4, 8, 12, 16]
    assert default_buckets(20) == [1, 2, 4, 8, 12, 16, 20]
    assert default_buckets(30) == [1, 2, 4, 8, 12, 16, 24, 30]
    assert default_buckets(600)[-5:] == [496, 512, 544, 576, 600]
    assert len(default_buckets(512)) == 5 + 31 + 15 + 1
    assert default_buckets(16, disable_padding=True) == list(range(1, 17))
    assert pow2_buckets(16) == [1, 2, 4, 8, 16] and pow2_buckets(12) == [1, 2, 4, 8, 12]
    assert make_buckets(16, [8, 2, 2, 4]) == [2, 4, 8]


@pytest.mark.parametrize("scheme", ["sglang", "every", "pow2"])
def test_pad_to_bucket_is_smallest_bucket_that_fits(scheme):
    buckets = make_buckets(300, scheme)
    for raw in range(1, 301):
        assert pad_to_bucket(raw, buckets) == min(b for b in buckets if b >= raw)
    with pytest.raises(BatchTooLargeError, match="larger than the largest captured graph"):
        pad_to_bucket(301, buckets)
    with pytest.raises(ValueError):
        pad_to_bucket(0, buckets)


def test_explore_buckets():
    workload = [1, 3, 5, 9, 16, 17]
    r = explore_buckets(16, workload, "sglang", activation_bytes_per_row=100,
                        output_bytes_per_row=10, graph_overhead_bytes=0)
    assert r.num_graphs == 6 and r.oversize_batches == 1
    assert (r.real_rows, r.padded_rows) == (34, 1 + 4 + 8 + 12 + 16)
    assert r.padding_waste == pytest.approx(7 / 41)
    assert r.memory_bytes == 1600 + 10 * sum(r.buckets)
    assert r.memory_bytes_separate_pools == 100 * sum(r.buckets) + 10 * sum(r.buckets)
    every = explore_buckets(16, workload, "every")
    assert every.num_graphs == 16 and every.padding_waste == 0
    assert every.memory_bytes < every.memory_bytes_separate_pools
    assert set(r.as_row()) >= {"scheme", "graphs", "padding_waste_%", "memory_MiB"}


# ---- static buffers and their padding policies -------------------------------------------


def _fake_batch(bs, k, base):
    n = bs * k
    return type("FB", (), dict(
        input_ids=torch.arange(n) + base, positions=torch.arange(n) + base + 1,
        out_cache_loc=torch.arange(n) + base + 2, req_pool_indices=torch.arange(bs) + base + 3,
        seq_lens=(torch.arange(bs) + base + 4).int()))()


@pytest.mark.parametrize("k", [1, 3])
def test_padding_policy_per_buffer(k, monkeypatch):
    buf = StaticBuffers(max_bs=8, num_tokens_per_bs=k)
    assert buf.policies() == {"input_ids": "head_only", "req_pool_indices": "zero_tail",
                              "seq_lens": "sentinel", "out_cache_loc": "zero_tail",
                              "positions": "zero_tail"}
    for s in buf.slots.values():
        s.tensor.fill_(99)  # stale values from an earlier batch
    calls = []
    real = torch._foreach_copy_
    monkeypatch.setattr(torch, "_foreach_copy_", lambda d, s: (calls.append(len(d)), real(d, s)))
    fb = _fake_batch(5, k, base=10)
    buf.fill_from(fb, raw_bs=5, padded_bs=6)
    assert calls == [5], "all heads copied by one _foreach_copy_"
    for name, slot in buf.slots.items():
        lo, hi = slot.rows(5, k), slot.rows(6, k)
        t = slot.tensor
        assert torch.equal(t[:lo], getattr(fb, name).to(t.dtype)), name
        tail = {"input_ids": 99, "seq_lens": 1}.get(name, 0)
        assert (t[lo:hi] == tail).all(), f"{name}: tail should be {tail}"
        assert (t[hi:] == 99).all(), f"{name}: rows past the bucket are not touched"
    # an override leaves a tail stale (the demo of what goes wrong)
    buf.fill_from(_fake_batch(2, k, base=0), 2, 4, override={"positions": "head_only"})
    assert (buf.positions[2 * k:4 * k] == torch.arange(2 * k, 4 * k) + 11).all()


# ---- the model and the runner ----------------------------------------------------------

DECODE = DecodeModels(MAX_BS, seed=0, prompt_lens=(2, 20))
_model, _runner = DECODE.model, DECODE.runner


def _prefill(m, seed=0):
    """Prefill all 16 slots with random prompts; return each slot's (token, position)."""
    return prefill_slots(m, MAX_BS, seed, (2, 20))


def _decode_batch(m, state, slots, mode=ForwardMode.DECODE, k=1):
    toks = [[state[s][0]] * k if k > 1 else state[s][0] for s in slots]
    return make_decode_batch(m, slots, toks, [state[s][1] for s in slots], mode=mode)


def _random_slots(bs, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randperm(MAX_BS, generator=g)[:bs] + 1).tolist()


@pytest.mark.parametrize("scheme", ["sglang", "every"])
def test_graph_logits_equal_eager_for_every_batch_size(B, scheme):
    m, state = _model(B)
    r = _runner(B, buckets=scheme)
    assert r.buckets == make_buckets(MAX_BS, scheme)
    for bs in range(1, MAX_BS + 1):
        batch = _decode_batch(m, state, _random_slots(bs, seed=bs))
        assert r.can_run(batch)
        eager = r.eager_forward(batch).clone()
        graphed = r.forward(batch)
        assert graphed.shape == (bs, m.args.vocab_size), "sliced to the real rows"
        torch.testing.assert_close(graphed, eager, rtol=1e-5, atol=1e-5)
    assert r.stats["graph"] >= MAX_BS


def test_capture_log_largest_first_one_pool(B):
    r = _runner(B, buckets="sglang")
    log = r.capture_log
    assert [e["bs"] for e in log] == sorted(r.buckets, reverse=True), "largest first"
    assert len(r.backend.graphs) == len(r.buckets)
    rep = r.capture_report()
    assert rep["graphs"] == len(r.buckets) and rep["capture_seconds"] > 0
    assert rep["pool_reserved_bytes"] > 0
    # the first (largest) graph reserves the pool; the smaller ones mostly reuse it
    assert log[0]["reserved_delta_bytes"] >= max(e["reserved_delta_bytes"] for e in log[1:])
    pools = {tuple(g.pool()) for g in r.backend.graphs.values()}
    assert pools == {tuple(r.backend.pool)}, "every bucket's graph lives in the one shared pool"


def test_can_run_by_mode_and_size(B):
    m, state = _model(B)
    r = _runner(B, max_bs=8)
    assert r.buckets == [1, 2, 4, 8]
    assert r.can_run(_decode_batch(m, state, [1, 2, 3]))
    assert not r.can_run(_decode_batch(m, state, list(range(1, 10))))  # 9 > 8
    assert not r.can_run(make_extend_batch(m, [1], [[1, 2, 3]]))      # prefill: never
    verify = _decode_batch(m, state, [1, 2], mode=ForwardMode.TARGET_VERIFY, k=2)
    assert not r.can_run(verify), "a decode runner does not replay verify batches"


def test_oversize_batch_error_or_logged_eager_fallback(B):
    m, state = _model(B)
    batch = _decode_batch(m, state, list(range(1, 13)))  # 12 > 8
    strict = _runner(B, max_bs=8)
    with pytest.raises(BatchTooLargeError, match="fallback='eager'"):
        strict.forward(batch)
    lenient = _runner(B, max_bs=8, fallback="eager")
    with pytest.warns(RuntimeWarning, match="running it eagerly"):
        out = lenient.forward(batch).clone()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once only; later fallbacks are logged
        lenient.forward(batch)
    assert lenient.stats["eager_fallback"] == 2
    torch.testing.assert_close(out, lenient.eager_forward(batch))


def test_fast_path_copies_only_ids_and_positions(B):
    """A batch planned ahead (SGLang's plan stream) replays with only input_ids and
    positions copied: in spec decoding they are what arrives after planning."""
    m, state = _model(B)
    r = _runner(B, buckets="sglang")
    slots = _random_slots(5, seed=1)
    batch = _decode_batch(m, state, slots)
    real_ids = batch.input_ids.clone()
    batch.input_ids = torch.zeros_like(real_ids)  # tokens not known yet at plan time
    assert r.plan(batch) == 8 and not batch.needs_forward_metadata_init()
    before = dict(r.stats)
    batch.input_ids = real_ids                     # ... now they are
    out = r.replay(batch).clone()
    assert r.stats["fast_path"] == before["fast_path"] + 1
    torch.testing.assert_close(out, r.eager_forward(batch), rtol=1e-5, atol=1e-5)
    other = _decode_batch(m, state, slots)         # a new batch: full fill, no fast path
    r.replay(other)
    assert r.stats["fast_path"] == before["fast_path"] + 1


def test_target_verify_equals_sequential_decode(B):
    """Verifying k tokens per request in one graph = k single-token decode steps."""
    m, state = _model(B)
    k = 3
    r = _runner(B, max_bs=8, num_tokens_per_bs=k)
    assert r.capture_forward_mode is ForwardMode.TARGET_VERIFY
    slots = [3, 5, 6, 9, 11]
    # k greedy decode steps, eagerly, one token each
    toks = {s: [state[s][0]] for s in slots}
    step_logits = []
    for j in range(k):
        b = make_decode_batch(m, slots, [toks[s][j] for s in slots],
                              [state[s][1] + j for s in slots])
        lg = r.eager_forward(b).clone()
        step_logits.append(lg)
        for s, t in zip(slots, lg.argmax(-1).tolist()):
            toks[s].append(t)
    verify = make_decode_batch(m, slots, [toks[s][:k] for s in slots],
                               [state[s][1] for s in slots], mode=ForwardMode.TARGET_VERIFY)
    assert r.can_run(verify)
    out = r.forward(verify).view(len(slots), k, -1)
    for j in range(k):
        torch.testing.assert_close(out[:, j], step_logits[j], rtol=1e-4, atol=1e-4)
    assert r.stats["graph"] >= 1


def test_stale_tail_gives_index_error(B):
    """With the tail NOT zeroed, a stale out-of-range index in the padded rows is read by
    the graph: IndexError on the CPU. (On a GPU this is a device-side assert / illegal
    memory access that kills the context, so the cuda variant is not run here; see
    test_stale_tail_cuda_subprocess.)"""
    if B.name == "cuda":
        pytest.skip("fatal to the CUDA context: covered by test_stale_tail_cuda_subprocess")
    m, state = _model(B)
    r = _runner(B, buckets="sglang")
    batch = _decode_batch(m, state, [1, 2, 3])  # padded to 4: one tail row
    for name in ("positions", "out_cache_loc", "req_pool_indices"):
        with pytest.raises(IndexError):
            demo_stale_tail(r, batch, name)
    with pytest.raises(ValueError, match="no padding tail"):
        demo_stale_tail(r, _decode_batch(m, state, [1, 2, 3, 4]))
    # with the policy in force the same buffers are cleaned and the replay is fine
    torch.testing.assert_close(r.forward(batch), r.eager_forward(batch), rtol=1e-5, atol=1e-5)


def test_stale_in_range_loc_silently_corrupts_a_live_request(B):
    """The quieter failure: a stale out_cache_loc that is still in range makes a padded
    row overwrite a live request's key. Zeroing the tail sends it to the dummy slot."""
    m, state = _model(B)
    r = _runner(B, buckets="sglang")
    kc = m.layers[0].attention.kv_cache.k_cache
    four = _decode_batch(m, state, [1, 2, 3, 4])
    r.forward(four)
    loc = int(four.out_cache_loc[3])  # request 4's newest key; it now sits out a step
    saved = kc[loc].clone()
    three = _decode_batch(m, state, [1, 2, 3])
    r.replay(three)                                  # zero tail: request 4 untouched
    assert torch.equal(kc[loc], saved)
    r.forward(four)                                  # reload the 4-row batch's locations
    r.replay(three, padding_override={"out_cache_loc": Pad.HEAD_ONLY})
    assert not torch.equal(kc[loc], saved), "the padded row wrote into request 4's cache"
    r.forward(four)                                  # repair


def test_serving_eager_and_graphed_tokens_identical(B):
    m, _ = _model(B)
    wl = synthetic_workload(24, arrival_rate=2.0, prompt_len=(2, 12), output_len=(2, 16),
                            vocab_size=m.args.vocab_size, max_seq_len=m.args.max_seq_len,
                            seed=3)
    eager = serve(m, wl)
    graphed = serve(m, wl, runner=_runner(B, buckets="sglang"))
    assert graphed.tokens == eager.tokens
    assert [len(t) for t in eager.tokens.values()] == [r.max_new_tokens for r in wl]
    assert graphed.decode_batch_size == eager.decode_batch_size
    assert len(set(eager.decode_batch_size)) > 4, "continuous batching varies the batch size"
    assert max(eager.decode_batch_size) <= MAX_BS
    s = graphed.summary()
    assert s["generated_tokens"] == sum(r.max_new_tokens for r in wl) and s["tokens_per_s"] > 0
    assert graphed.runner_stats["graph"] == len(graphed.decode_latency_s)
    # a runner smaller than the running set falls back to eager for big steps, same tokens
    small = _runner(B, max_bs=4, fallback="eager")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        mixed = serve(m, wl, runner=small)
    assert mixed.tokens == eager.tokens
    assert mixed.runner_stats["eager_fallback"] > 0 and mixed.runner_stats["graph"] > 0


def test_overlapped_serving_generates_the_same_tokens(B):
    """serve(overlap=True): tokens stay on the device, the host reads each step's tokens one
    step late, and every request still gets exactly the tokens of the synced loop."""
    m, _ = _model(B)
    wl = synthetic_workload(24, arrival_rate=2.0, prompt_len=(2, 12), output_len=(2, 16),
                            vocab_size=m.args.vocab_size, max_seq_len=m.args.max_seq_len,
                            seed=5)
    runner = _runner(B, buckets="sglang")
    synced = serve(m, wl, runner=runner)
    overlapped = serve(m, wl, runner=runner, overlap=True)
    assert overlapped.tokens == synced.tokens
    assert [len(t) for t in overlapped.tokens.values()] == [r.max_new_tokens for r in wl]
    assert overlapped.decode_batch_size == synced.decode_batch_size
    assert overlapped.runner_stats["graph"] == len(overlapped.decode_latency_s)
    assert overlapped.runner_stats["fast_path"] == 0 and overlapped.runner_stats["eager"] == len(
        overlapped.prefill_latency_s), "decode steps replay staged graphs, prefills run eagerly"


def test_staged_replay_equals_a_replayed_batch(B):
    m, state = _model(B)
    r = _runner(B)
    slots = [3, 1, 7]
    toks, pos = [state[s][0] for s in slots], [state[s][1] for s in slots]
    want = r.forward(make_decode_batch(m, slots, toks, pos)).clone()
    assert r.stage(slots, pos, toks) == 4                  # bucket 4: one padding row
    assert torch.equal(r.replay_staged(), want)
    # the padded tail follows each buffer's policy, written in the same one copy
    assert r.buffers.req_pool_indices[3].item() == 0 and r.buffers.positions[3].item() == 0
    assert r.buffers.seq_lens[3].item() == r.buffers.slots["seq_lens"].fill_value
    # tokens from a per-slot table on the device: gathered into input_ids there
    table = torch.zeros(m.num_slots, dtype=torch.int64, device=m.device)
    table[slots] = torch.tensor(toks, device=m.device)
    r.stage(slots, pos, table)
    assert torch.equal(r.replay_staged(), want)
    assert r.buffers.input_ids[:3].tolist() == toks


@pytest.mark.parametrize("args, kind, words", [
    (([0, 1], [3, 3], [1, 2]), ValueError, "dummy slot"),
    (([1, 1], [3, 3], [1, 2]), ValueError, "appear more than once"),
    (([1, 2], [3, 999], [1, 2]), ValueError, "position 999 is outside"),
    (([1, 2], [3], [1, 2]), ValueError, "2 slots but 1 positions"),
    (([1, 2], [3, 4], [1]), ValueError, "2 slots but 1 tokens"),
    (([1, 2], [3, 4], [1, 10**6]), ValueError, "token id 1000000"),
    (([], [], []), ValueError, "0 requests"),
    ((list(range(1, 18)), [0] * 17, [1] * 17), ValueError, "17 requests"),
    (([1, 2.5], [3, 4], [1, 2]), TypeError, "slots[1]"),
    (([True, 2], [3, 4], [1, 2]), TypeError, "slots[0]"),
    (([[1, 2], [3]], [3, 4], [1, 2]), TypeError, "slots[0]"),
    (([1, 2], [3, 4], [1, 2**70]), ValueError, "not a 64-bit integer"),
    ((torch.tensor([1, 2]), [3, 4], [1, 2]), TypeError, "slots is a tensor; pass host ints"),
])
def test_stage_refuses_bad_host_values(E, args, kind, words):
    r = _runner(E)
    with pytest.raises(kind, match=re.escape(words)):
        r.stage(*args)


def test_stage_refuses_a_bad_token_table_and_replay_before_stage(E):
    m, _ = _model(E)
    r = DecodeGraphRunner(m, E, max_bs=4, progress=False)
    with pytest.raises(RuntimeError, match="no graphs captured"):
        r.stage([1], [2], [3])
    r.capture()
    with pytest.raises(RuntimeError, match="nothing staged"):
        r.replay_staged()
    for bad in (torch.zeros(3, dtype=torch.int64), torch.zeros(m.num_slots)):
        with pytest.raises(ValueError, match=r"token table must be an int64 tensor.*tolist"):
            r.stage([1], [2], bad)


def test_a_staged_step_never_replays_after_the_buffers_changed(E):
    """replay(batch) or a stage() that raised leave nothing to replay_staged(): it would
    replay whatever the buffers hold now under the old step's bucket."""
    m, state = _model(E)
    r = _runner(E)
    r.stage([1, 2, 3], [state[s][1] for s in (1, 2, 3)], [state[s][0] for s in (1, 2, 3)])
    r.replay_staged()
    r.replay_staged()                                   # the same staged step, again: fine
    assert r.stats["staged"] >= 2
    slots = list(range(1, 9))
    r.replay(make_decode_batch(m, slots, [state[s][0] for s in slots],
                               [state[s][1] for s in slots]))
    with pytest.raises(RuntimeError, match="nothing staged"):
        r.replay_staged()
    r.stage([1], [state[1][1]], [state[1][0]])
    with pytest.raises(ValueError):
        r.stage([0], [1], [1])                          # refused: the dummy slot
    with pytest.raises(RuntimeError, match="nothing staged"):
        r.replay_staged()


def test_one_bucket_entry_per_bucket_over_the_static_buffers(E):
    """The runner's per-bucket record: the padded batch its graph reads, made once, views of
    the first ``bs`` rows of the static buffers."""
    r = _runner(E)
    assert list(r.entries) == r.buckets
    for bs, entry in r.entries.items():
        assert entry.bs == bs and entry.batch.batch_size == bs
        assert entry.batch.input_ids.data_ptr() == r.buffers.input_ids.data_ptr()
        assert entry.batch.seq_lens.data_ptr() == r.buffers.seq_lens.data_ptr()


def test_the_loaded_step_records_what_the_buffers_hold(E):
    """One record of the step in the static buffers: set by plan / replay / stage, gone when
    a capture or a new stage() rewrites them."""
    m, state = _model(E)
    r = _runner(E)
    slots = [2, 4, 6]
    batch = make_decode_batch(m, slots, [state[s][0] for s in slots],
                              [state[s][1] for s in slots])
    assert r.plan(batch) == 4
    step = r.loaded
    assert (step.batch, step.raw_bs, step.bs, step.raw_num_tokens, step.staged) == (
        batch, 3, 4, 3, False)
    r.replay(batch)
    assert r.loaded is step and r.last_replay == (3, 4), "the fast path replays the plan"
    r.stage(slots, [state[s][1] for s in slots], [state[s][0] for s in slots])
    assert r.loaded.staged and (r.loaded.raw_bs, r.loaded.bs) == (3, 4)
    with pytest.raises(ValueError):
        r.stage([0], [1], [1])                          # refused: nothing left loaded
    assert r.loaded is None


class _Event:
    log: list = []
    made = 0

    def __init__(self, *a, **k):
        self.id = _Event.made
        _Event.made += 1

    def record(self):
        _Event.log.append(("record", self.id))

    def synchronize(self):
        _Event.log.append(("wait", self.id))


def test_staging_never_rewrites_a_pinned_buffer_before_its_copy_ran():
    """Two host mirrors in turn; before a mirror is written again, the event recorded
    behind its last copy is waited for (the copy reads the host buffer when the stream
    gets there, not when it is queued)."""
    class FakeB:
        Event = _Event

    _Event.log, _Event.made = [], 0
    buf = StaticBuffers(max_bs=4)
    vals = lambda n, p: {"req_pool_indices": [1] * n, "positions": [p] * n,  # noqa: E731
                         "out_cache_loc": [p] * n, "seq_lens": [p + 1] * n}
    for step in range(4):
        buf.stage(vals(2, step), 2, 4, FakeB)
        assert buf.positions[:2].tolist() == [step, step] and buf.positions[2:].tolist() == [0, 0]
    assert _Event.log == [("record", 0), ("record", 1), ("wait", 0), ("record", 2),
                          ("wait", 1), ("record", 3)]
    assert buf.seq_lens[2:].tolist() == [buf.slots["seq_lens"].fill_value] * 2
    buf.input_ids[:2] = torch.tensor([7, 8])
    buf.stage(vals(2, 0), 2, 2, FakeB)                     # no input_ids: left as they are
    assert buf.input_ids[:2].tolist() == [7, 8]
    with pytest.raises(ValueError, match="give values for"):
        buf.stage({"positions": [1]}, 1, 1, FakeB)


def test_workload_is_seeded_and_fits():
    a = synthetic_workload(20, seed=7, max_seq_len=30, prompt_len=(4, 24), output_len=(4, 40))
    b = synthetic_workload(20, seed=7, max_seq_len=30, prompt_len=(4, 24), output_len=(4, 40))
    assert [(r.arrival_step, r.prompt, r.max_new_tokens) for r in a] == \
           [(r.arrival_step, r.prompt, r.max_new_tokens) for r in b]
    assert all(len(r.prompt) + r.max_new_tokens - 1 <= 30 for r in a)
    assert [r.arrival_step for r in a] == sorted(r.arrival_step for r in a)


# ---- GPU only -----------------------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_fp16_cuda_graph_matches_eager():
    B = backend.get("cuda")
    m = build_model("tiny", max_requests=MAX_BS, device=B.device)  # fp16 on CUDA
    assert m.output.weight.dtype == torch.float16
    state = _prefill(m)
    r = DecodeGraphRunner(m, B, max_bs=MAX_BS, progress=False)
    r.capture()
    for bs in range(1, MAX_BS + 1):
        batch = _decode_batch(m, state, _random_slots(bs, seed=bs))
        torch.testing.assert_close(r.forward(batch), r.eager_forward(batch),
                                   rtol=2e-2, atol=2e-2)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_stale_tail_cuda_subprocess():
    """On a GPU the stale-tail replay faults the device, so it runs in a child process."""
    import os
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (root, os.environ.get("PYTHONPATH")) if p)}
    code = (
        "import torch\n"
        "from labkit import backend\n"
        "from labkit.decode import *\n"
        "B = backend.get('cuda')\n"
        "m = build_model('tiny', max_requests=16, device=B.device)\n"
        "r = DecodeGraphRunner(m, B, max_bs=16, progress=False); r.capture()\n"
        "b = make_decode_batch(m, [1, 2, 3], [5, 6, 7], [0, 0, 0])\n"
        "demo_stale_tail(r, b, 'positions'); torch.cuda.synchronize()\n"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=300, env=env, cwd=root)
    assert p.returncode != 0
    assert any(s in p.stderr for s in ("device-side assert", "illegal memory access",
                                       "out of bounds", "CUDA error")), p.stderr[-2000:]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_compile_small_buckets_cuda():
    B = backend.get("cuda")
    m = build_model("tiny", max_requests=MAX_BS, device=B.device)
    state = _prefill(m)
    r = DecodeGraphRunner(m, B, max_bs=8, compile_bs=4, progress=False)
    r.capture()
    for bs in (1, 3, 4, 7):
        batch = _decode_batch(m, state, _random_slots(bs, seed=bs))
        torch.testing.assert_close(r.forward(batch), r.eager_forward(batch),
                                   rtol=2e-2, atol=2e-2)


# ---- attention backends ---------------------------------------------------------------------


def test_attention_backend_by_name():
    from labkit.decode.attention import TorchNativeAttnBackend, make_attn_backend
    m = build_model("tiny", max_requests=2)
    assert type(make_attn_backend("torch_native", m)) is TorchNativeAttnBackend
    with pytest.raises(ValueError, match="unknown attention backend 'flash'"):
        make_attn_backend("flash", m)
    if m.device.type == "cpu":
        assert make_attn_backend("auto", m).name == "torch_native", "auto: what can run here"
        with pytest.raises(RuntimeError, match="attention='torch_native'"):
            make_attn_backend("triton", m)
        E = backend.get("emulated")             # the runner needs its model on B.device
        on_e = build_model("tiny", max_requests=2, device=E.device)
        with pytest.raises(RuntimeError, match="attention='torch_native'"):
            DecodeGraphRunner(on_e, E, max_bs=2, attention="triton")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("config", ["tiny", "small"])   # GQA 4:2 (d=16) and 8:4 (d=32)
def test_triton_decode_attention_cuda(config):
    """The Triton kernel agrees with gather + SDPA; graphed equals eager with it, for every
    batch size; a serving run gives the same tokens eagerly and graphed."""
    from labkit.decode.triton_attention import triton_available
    if not triton_available("cuda"):
        pytest.skip("no triton")
    B = backend.get("cuda")
    m = build_model(config, max_requests=MAX_BS, device=B.device)
    state = _prefill(m)
    r = DecodeGraphRunner(m, B, max_bs=MAX_BS, progress=False, attention="triton")
    r.capture()
    native = DecodeGraphRunner(m, B, max_bs=MAX_BS, progress=False).eager
    assert r.attn.name == "triton" and r.eager.attn.name == "triton"
    for bs in range(1, MAX_BS + 1):
        batch = _decode_batch(m, state, _random_slots(bs, seed=bs))
        eager = r.eager_forward(batch).clone()
        # fp16, and a padded bucket may pick other GEMM kernels / key splits than the raw
        # batch: equal up to rounding (the fp32 tests above check exact agreement)
        torch.testing.assert_close(r.forward(batch), eager, rtol=2e-2, atol=2e-2,
                                   msg=lambda m, bs=bs: f"graphed vs eager, bs={bs}: {m}")
        torch.testing.assert_close(eager, native.forward(batch), rtol=2e-2, atol=2e-2,
                                   msg=lambda m, bs=bs: f"triton vs torch_native, bs={bs}: {m}")


def test_num_kv_splits():
    from labkit.decode.triton_attention import num_kv_splits
    got = [num_kv_splits(bs, 8, 4096) for bs in (1, 8, 16, 32, 64)]
    assert got == [16, 4, 2, 1, 1], "split small batches of long requests"
    assert [num_kv_splits(bs, 8, 256) for bs in (1, 8, 64)] == [1, 1, 1], \
        "a few hundred keys: one program per (request, head), no merge kernel"
    assert num_kv_splits(1, 4, 64) == 1


# ---- the hot path stays lean ----------------------------------------------------------------


def test_rotary_in_place_matches_the_reference_formula():
    from labkit.decode.model import apply_rotary_emb, precompute_freqs_cis, rotary_emb_
    g = torch.Generator().manual_seed(0)
    fc = precompute_freqs_cis(32, 16).index_select(0, torch.randint(0, 32, (5,), generator=g))
    for dtype in (torch.float32, torch.float16):
        x = torch.randn(5, 6, 16, generator=g).to(dtype)
        ref = apply_rotary_emb(x, fc)
        wide = torch.zeros(5, 9, 16, dtype=dtype)  # rotate a strided view, as the model does
        wide[:, :6] = x
        out = rotary_emb_(wide[:, :6], fc)
        torch.testing.assert_close(out, ref, rtol=1e-3 if dtype == torch.float16 else 1e-6,
                                   atol=1e-3 if dtype == torch.float16 else 1e-6)
        assert (wide[:, 6:] == 0).all(), "only the rotated heads are written"


def test_kv_pool_stores_and_gathers_keys_and_values_together():
    m = build_model("tiny", max_requests=2, dtype=torch.float32)
    kvc = m.layers[0].attention.kv_cache
    assert kvc.k_cache.shape == kvc.v_cache.shape == (3 * m.args.max_seq_len, 2, 16)
    k, v = torch.randn(2, 2, 16), torch.randn(2, 2, 16)
    kvc.store(torch.tensor([5, 70]), k, v)              # no fused tensor: stacked first
    assert torch.equal(kvc.k_cache[[5, 70]], k) and torch.equal(kvc.v_cache[[5, 70]], v)


def test_emulated_graph_scatters_kv_once_per_layer_and_builds_the_bias_once(B):
    """A decode graph of the 2-layer tiny model: one KV scatter per layer, the attention bias
    built once per step. (How many ops in all depends on how the torch version decomposes
    RMSNorm and friends: ``python -m labkit.bench capture`` reports it, as
    ``kernels_per_graph``.)"""
    if B.name == "cuda":
        pytest.skip("counts the emulator's recorded ops")
    r = _runner(B, buckets="sglang")
    for bs, g in r.backend.graphs.items():
        ops = g.recorded_ops()
        assert sum("index_put_" in o for o in ops) == r.model.args.n_layer
        assert sum("where" in o for o in ops) == 1, "the attention bias is built once"
