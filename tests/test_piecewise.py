"""labkit.piecewise: the split at attention, piecewise graphs per token bucket, the dispatcher.

Runner tests take the ``B`` fixture: the emulator everywhere, the GPU too where one is
present (``pytest -m cuda``). Captures are the slow part, so each backend's runners are
built once per module.
"""

from __future__ import annotations

import random
import warnings

import pytest
import torch
from helpers import assert_usable

from labkit.decode import (
    DecodeGraphRunner,
    EagerRunner,
    build_model,
    make_decode_batch,
    make_extend_batch,
)
from labkit.piecewise import (
    Dispatcher,
    GraphMode,
    PiecewiseGraphRunner,
    make_mixed_batch,
    split_at_attention,
    token_buckets,
    vllm_token_buckets,
)

BUCKETS = [8, 16, 32, 64]
_CACHE: dict = {}


def _model(B, seed=0):
    return build_model("tiny", max_requests=8, device=B.device, dtype=torch.float32, seed=seed)


def _runners(B):
    """(model, piecewise runner, full decode runner), captured once per backend."""
    if B.name not in _CACHE:
        m = _model(B)
        pw = PiecewiseGraphRunner(m, B, max_num_tokens=64, buckets=BUCKETS, progress=False)
        pw.capture()
        full = DecodeGraphRunner(m, B, max_bs=4, progress=False)
        full.capture()
        _CACHE[B.name] = (m, pw, full)
    return _CACHE[B.name]


def _prompts(rng, lens, vocab):
    return [[rng.randrange(vocab) for _ in range(n)] for n in lens]


# ---- buckets (pure) ----------------------------------------------------------------------

@pytest.mark.parametrize("max_num_tokens", [1, 3, 8, 100, 255, 256, 300, 512])
def test_vllm_token_buckets(max_num_tokens):
    b = vllm_token_buckets(max_num_tokens)
    full = [1, 2, 4] + list(range(8, 256, 8)) + list(range(256, max_num_tokens + 1, 16))
    assert b == sorted({x for x in full if x <= max_num_tokens} | {max_num_tokens})


def test_token_buckets_schemes_and_errors():
    assert token_buckets(64, "pow2") == [1, 2, 4, 8, 16, 32, 64]
    assert token_buckets(64, [64, 8, 8, 16]) == [8, 16, 64]
    with pytest.raises(ValueError, match="unknown token bucket scheme 'sglang'"):
        token_buckets(64, "sglang")
    with pytest.raises(ValueError, match=r"buckets\[1\].*max_num_tokens=64"):
        token_buckets(64, [8, 65])
    with pytest.raises(ValueError, match="empty"):
        token_buckets(64, [])
    with pytest.raises(TypeError, match="max_num_tokens"):
        token_buckets(2.5)


# ---- the split ---------------------------------------------------------------------------

def test_split_at_attention_cuts_every_layer(E):
    m = _model(E)
    split = split_at_attention(m)
    kinds = [it.is_splitting_graph for it in split.items]
    # piece, attention, piece, attention, piece: one attention call per layer
    assert kinds == [False, True] * m.args.n_layer + [False]
    assert [it.graph_id for it in split.items] == list(range(len(kinds)))
    assert len(split.describe().splitlines()) == len(kinds)
    batch = make_extend_batch(m, [1, 2], [[1, 2, 3], [4, 5]])
    ref = EagerRunner(m).forward(batch)
    batch.attn_backend.init_forward_metadata(batch)
    with torch.no_grad():
        out = split.split_gm(batch.input_ids, batch.positions, batch)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)


def test_split_refuses_other_models():
    with pytest.raises(TypeError, match="labkit.decode Transformer"):
        split_at_attention(torch.nn.Linear(2, 2))


# ---- piecewise == eager ------------------------------------------------------------------

def test_pieces_match_eager_for_every_bucket(B):
    m, pw, _ = _runners(B)
    rng = random.Random(1)
    eager = EagerRunner(m)
    # every bucket exactly, one token above each smaller bucket, and random mixes
    totals = BUCKETS + [b + 1 for b in BUCKETS[:-1]] + [rng.randrange(1, 65) for _ in range(3)]
    for total in totals:
        n_req = rng.randrange(1, min(total, 8) + 1)
        cuts = sorted(rng.sample(range(1, total), n_req - 1)) if n_req > 1 else []
        lens = [b - a for a, b in zip([0] + cuts, cuts + [total])]
        slots = rng.sample(range(1, 9), n_req)
        prompts = _prompts(rng, lens, m.args.vocab_size)
        ref = eager.forward(make_extend_batch(m, slots, prompts))
        out = pw.forward(make_extend_batch(m, slots, prompts))
        assert pw.last_replay == (total, min(b for b in BUCKETS if b >= total))
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
        assert out.argmax(-1).tolist() == ref.argmax(-1).tolist()


def test_pieces_write_only_the_real_tokens_kv(B):
    """A piecewise prefill leaves the KV cache exactly as an eager one: the padded rows
    reach neither attention nor the cache."""
    _, pw, _ = _runners(B)
    m = pw.model
    twin = _model(B)   # same seed, same weights
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6]]
    pw.forward(make_extend_batch(m, [5, 6], prompts))          # 8 tokens: bucket 8, no pad
    pw.forward(make_extend_batch(m, [7], [[2, 7, 1]]))          # 3 tokens padded to 8
    EagerRunner(twin).forward(make_extend_batch(twin, [5, 6], prompts))
    EagerRunner(twin).forward(make_extend_batch(twin, [7], [[2, 7, 1]]))
    for slot, n in ((5, 5), (6, 3), (7, 3)):
        locs = m.req_to_token[slot, :n]
        for la, lb in zip(m.layers, twin.layers):
            torch.testing.assert_close(la.attention.kv_cache.kv[locs],
                                       lb.attention.kv_cache.kv[locs], rtol=1e-4, atol=1e-4)


def test_mixed_batch_matches_eager(B):
    m, pw, _ = _runners(B)
    prompts = {1: [5, 6, 7, 8], 2: [9, 10]}
    EagerRunner(m).forward(make_extend_batch(m, list(prompts), list(prompts.values())))
    mixed = make_mixed_batch(m, {3: [1, 2, 3, 4, 5, 6]}, {1: (11, 4), 2: (12, 2)})
    assert mixed.extend_lens == [6, 1, 1] and mixed.num_tokens == 8
    ref = EagerRunner(m).forward(mixed)
    mixed = make_mixed_batch(m, {3: [1, 2, 3, 4, 5, 6]}, {1: (11, 4), 2: (12, 2)})
    torch.testing.assert_close(pw.forward(mixed), ref, rtol=1e-4, atol=1e-4)


def test_one_graph_per_piece_per_bucket(B):
    m, pw, _ = _runners(B)
    assert pw.num_pieces == m.args.n_layer + 1
    assert sorted(pw.backend.graphs) == sorted((b, i) for b in BUCKETS
                                               for i in range(0, 2 * m.args.n_layer + 1, 2))
    assert [r["bs"] for r in pw.capture_log] == BUCKETS[::-1]   # largest first
    rep = pw.capture_report()
    assert rep["graphs"] == len(BUCKETS) * pw.num_pieces and rep["buckets"] == len(BUCKETS)


# ---- above the largest bucket ------------------------------------------------------------

def test_fallback_is_warned_once_counted_and_correct(B):
    m, pw, _ = _runners(B)
    before = pw.stats["eager_fallback"]
    pw._warned_fallback = False
    batch = make_extend_batch(m, [1, 2], [[1] * 40, [2] * 30])       # 70 tokens > 64
    ref = EagerRunner(m).forward(make_extend_batch(m, [1, 2], [[1] * 40, [2] * 30]))
    with pytest.warns(UserWarning, match="70 tokens is above the largest captured bucket"):
        out = pw.forward(batch)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pw.forward(make_extend_batch(m, [1, 2], [[1] * 40, [2] * 30]))
    assert pw.stats["eager_fallback"] == before + 2
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    with pytest.raises(ValueError, match="70 tokens.*largest captured bucket holds 64"):
        pw.replay(make_extend_batch(m, [1, 2], [[1] * 40, [2] * 30]))


def test_fallback_error_raises(E):
    m = _model(E)
    pw = PiecewiseGraphRunner(m, E, max_num_tokens=8, buckets=[8], fallback="error",
                              progress=False)
    pw.capture()
    with pytest.raises(ValueError, match="9 tokens"):
        pw.forward(make_extend_batch(m, [1], [[1] * 9]))


# ---- the dispatcher ----------------------------------------------------------------------

def test_dispatcher_modes(B):
    m, pw, full = _runners(B)
    d = Dispatcher(m, full=full, piecewise=pw)
    eager = EagerRunner(m)
    prefill = make_extend_batch(m, [1, 2, 3, 4, 5, 6], [[1, 2]] * 6)
    assert d.dispatch(prefill) is GraphMode.PIECEWISE
    d.forward(prefill)
    cases = [
        (make_decode_batch(m, [1, 2], [3, 4], [2, 2]), GraphMode.FULL),
        # 6 requests: above the full graphs' largest bucket (4), inside a token bucket
        (make_decode_batch(m, [1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 6], [2] * 6),
         GraphMode.PIECEWISE),
        (make_mixed_batch(m, {7: [1, 2, 3]}, {1: (5, 2)}), GraphMode.PIECEWISE),
        (make_extend_batch(m, [7, 8], [[1] * 40, [2] * 30]), GraphMode.NONE),
    ]
    for batch, mode in cases:
        assert d.dispatch(batch) is mode
    with pytest.warns(UserWarning,
                      match=r"no graph fits this EXTEND batch \(2 requests, 70 tokens\)"):
        for batch, mode in cases:
            fresh = batch  # every batch is run once by the dispatcher, once eagerly
            out = d.forward(fresh)
            assert d.last_mode is mode
            torch.testing.assert_close(out, eager.forward(batch), rtol=1e-4, atol=1e-4)
    assert d.stats == {"none": 1, "piecewise": 3, "full": 1}


def test_dispatcher_without_full_graphs_runs_decode_piecewise(E):
    m, pw, _ = _runners(E)
    d = Dispatcher(m, piecewise=pw)
    assert d.dispatch(make_decode_batch(m, [1], [3], [2])) is GraphMode.PIECEWISE


def test_dispatcher_refuses_bad_runners(E):
    m, pw, full = _runners(E)
    other = _model(E)
    with pytest.raises(TypeError, match="full must be a DecodeGraphRunner"):
        Dispatcher(m, full=pw)
    with pytest.raises(ValueError, match="another model"):
        Dispatcher(other, piecewise=pw)
    fresh = PiecewiseGraphRunner(other, E, max_num_tokens=8, buckets=[8], progress=False)
    with pytest.raises(RuntimeError, match="capture"):
        Dispatcher(other, piecewise=fresh)


# ---- bad input, failed capture -----------------------------------------------------------

def test_bad_options_are_named(E):
    m = _model(E)
    with pytest.raises(ValueError, match="fallback must be one of 'eager', 'error', got 'skip'"):
        PiecewiseGraphRunner(m, E, fallback="skip")
    with pytest.raises(ValueError, match="max_num_tokens"):
        PiecewiseGraphRunner(m, E, max_num_tokens=0)
    with pytest.raises(TypeError, match="progress must be True or False"):
        PiecewiseGraphRunner(m, E, progress="yes")
    pw = PiecewiseGraphRunner(m, E, max_num_tokens=8, buckets=[8], progress=False)
    with pytest.raises(RuntimeError, match="call runner.capture"):
        pw.forward(make_extend_batch(m, [1], [[1, 2]]))
    pw.capture()
    with pytest.raises(TypeError, match="expected a ForwardBatch"):
        pw.forward("tokens")


def test_mixed_batch_bad_input(E):
    m = _model(E)
    with pytest.raises(ValueError, match=r"slot\(s\) \[1\] are in both"):
        make_mixed_batch(m, {1: [1, 2]}, {1: (3, 2)})
    with pytest.raises(TypeError, match=r"decode\[2\] must be \(token, position\)"):
        make_mixed_batch(m, {1: [1, 2]}, {2: 3})
    with pytest.raises(TypeError, match="prefill must be a dict"):
        make_mixed_batch(m, [[1, 2]], {})


def test_setup_caches_after_capture_is_refused(E):
    m = _model(E)
    pw = PiecewiseGraphRunner(m, E, max_num_tokens=8, buckets=[8], progress=False)
    pw.capture()
    m.setup_caches(8)
    with pytest.raises(RuntimeError, match="setup_caches"):
        pw.forward(make_extend_batch(m, [1], [[1, 2]]))


def test_failed_capture_leaves_a_usable_process(B):
    m = _model(B)
    pw = PiecewiseGraphRunner(m, B, max_num_tokens=16, buckets=[8, 16], progress=False)
    piece = pw.split.split_gm.submod_2
    good = piece.submod

    class Syncs(torch.nn.Module):
        def forward(self, *args):
            out = good(*args)
            float(out[0].sum())      # a device -> host read: refused while capturing
            return out

    piece.submod = Syncs()
    with pytest.raises(Exception):
        pw.capture()
    assert not pw.captured and not pw.backend.graphs
    assert_usable(B)
    piece.submod = good
    pw.capture()
    assert pw.captured


# ---- an op that depends on the requests must be a splitting op -----------------------------

def short_conv(x, batch):
    """Mix each token with the one before it in the same request (a causal short
    convolution, as in Mamba-style layers): it reads the requests' lengths."""
    out = x.clone()
    start = 0
    for n in batch.extend_lens:
        out[start + 1:start + n] += 0.5 * x[start:start + n - 1]
        start += n
    return out


torch.fx.wrap("short_conv")


def _conv_model(B):
    from labkit.decode.model import TransformerBlock

    class ConvBlock(TransformerBlock):
        def forward(self, x, freqs_cis, batch):
            return super().forward(short_conv(x, batch), freqs_cis, batch)

    m = _model(B)
    for layer in m.layers:
        layer.__class__ = ConvBlock
    return m


def test_a_piece_that_reads_the_batch_is_refused(E):
    with pytest.raises(ValueError, match=r"piece submod_0 reads the batch \(short_conv\(\.\.\.\)\)"
                                         r".*splitting_ops=\(attend, that_op\)"):
        PiecewiseGraphRunner(_conv_model(E), E, max_num_tokens=8, buckets=[8], progress=False)


def test_extra_splitting_ops_run_eagerly_and_match(E):
    from labkit.decode.model import attend

    m = _conv_model(E)
    pw = PiecewiseGraphRunner(m, E, max_num_tokens=16, buckets=[8, 16], progress=False,
                              splitting_ops=(attend, short_conv))
    assert [line.split()[1] for line in pw.split.describe().splitlines()][:3] == [
        "piece", "short_conv", "piece"]
    pw.capture()
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8]]
    ref = EagerRunner(m).forward(make_extend_batch(m, [1, 2], prompts))
    torch.testing.assert_close(pw.forward(make_extend_batch(m, [1, 2], prompts)), ref,
                               rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="must be functions and include"):
        PiecewiseGraphRunner(m, E, splitting_ops=(short_conv,))
