"""serve(..., prefill=PiecewiseGraphRunner): admissions prefilled through piecewise graphs.

The tokens must be those of the plain loop (eager prefill, synced) whatever the loop:
synced or overlapped, piecewise prefill or not; in the overlapped loop a prefill's first
token stays on the device and is read back with the next step's.
"""

from __future__ import annotations

import pytest
import torch
from helpers import DecodeModels

from labkit import piecewise as P
from labkit.decode import EagerRunner, serve, synthetic_workload
from labkit.decode.serving import prefill_logits

DECODE = DecodeModels(max_bs=16)


@pytest.fixture
def setup(B):
    m, _ = DECODE.model(B)
    runner = DECODE.runner(B, buckets="sglang")
    pw = P.PiecewiseGraphRunner(m, B, max_num_tokens=32, buckets=[8, 16, 32], progress=False)
    pw.capture()
    yield m, runner, pw
    pw.backend.cleanup()


def _workload(m, seed=5, prompt_len=(2, 12)):
    # prompts of up to 12 tokens, up to 5 admitted at once: some prefills above the
    # largest bucket (32 tokens) run eagerly, the rest through the pieces
    return synthetic_workload(24, arrival_rate=3.0, prompt_len=prompt_len, output_len=(1, 16),
                              vocab_size=m.args.vocab_size, max_seq_len=m.args.max_seq_len,
                              seed=seed)


def test_piecewise_prefill_gives_the_plain_loops_tokens(setup):
    m, runner, pw = setup
    wl = _workload(m)
    plain = serve(m, wl)                                          # eager, synced
    before = dict(pw.stats)
    synced = serve(m, wl, runner=runner, prefill=pw)
    mid = dict(pw.stats)
    overlapped = serve(m, wl, runner=runner, overlap=True, prefill=pw)
    assert synced.tokens == plain.tokens
    assert overlapped.tokens == plain.tokens
    assert [len(t) for t in overlapped.tokens.values()] == [r.max_new_tokens for r in wl]
    assert overlapped.decode_batch_size == plain.decode_batch_size
    n_prefills = len(plain.prefill_latency_s)
    for a, b in ((before, mid), (mid, pw.stats)):
        ran = {k: b[k] - a[k] for k in b}
        assert ran["piecewise"] + ran["eager_fallback"] == n_prefills
        assert ran["piecewise"] > 0
    # the decode runner ran no prefill: every admission went through pw
    assert overlapped.runner_stats["eager"] == 0
    assert overlapped.runner_stats["graph"] == len(overlapped.decode_latency_s)


def test_overlapped_loop_reads_first_tokens_lazily(setup, monkeypatch):
    """No prefill in the overlapped loop reads a token on the host: .tolist() is called
    only by land(), after the next step is queued."""
    m, runner, pw = setup
    wl = _workload(m, seed=7)
    want = serve(m, wl).tokens
    import labkit.decode.serving as S
    calls = []
    real = S.prefill_overlapped

    def spy(*a, **k):
        out = real(*a, **k)
        calls.append(out[0][0].pending)      # still pending: nothing landed yet
        return out
    monkeypatch.setattr(S, "prefill_overlapped", spy)
    got = S.serve(m, wl, runner=runner, overlap=True, prefill=pw)
    assert got.tokens == want
    assert calls and all(p >= 1 for p in calls)


def test_prefill_logits_are_the_last_prompt_tokens(setup):
    m, _, pw = setup
    wl = _workload(m, seed=3)[:3]
    for i, r in enumerate(wl):
        r.slot = i + 1
    got = prefill_logits(pw, wl)
    eager = EagerRunner(m)
    from labkit.decode import make_extend_batch
    full = eager.forward(make_extend_batch(m, [r.slot for r in wl], [r.prompt for r in wl]))
    ends = torch.tensor([len(r.prompt) for r in wl]).cumsum(0) - 1
    assert got.shape == (3, m.args.vocab_size)
    assert torch.equal(got.argmax(-1).cpu(), full[ends.to(full.device)].argmax(-1).cpu())


def test_prefill_argument_is_checked(B):
    m, _ = DECODE.model(B)
    other, _ = DecodeModels(max_bs=8).model(B)
    wl = _workload(m)[:4]
    with pytest.raises(TypeError, match=r"prefill must be a captured PiecewiseGraphRunner .* "
                                        r"got EagerRunner"):
        serve(m, wl, prefill=EagerRunner(m))
    pw = P.PiecewiseGraphRunner(m, B, max_num_tokens=16, buckets=[16], progress=False)
    with pytest.raises(RuntimeError, match=r"prefill runner has no graphs yet: call "
                                           r"prefill.capture\(\) first"):
        serve(m, wl, prefill=pw)
    pw_other = P.PiecewiseGraphRunner(other, B, max_num_tokens=16, buckets=[16],
                                      progress=False)
    with pytest.raises(ValueError, match=r"prefill runner was built for another model"):
        serve(m, wl, prefill=pw_other)


def test_piecewise_capture_leaves_no_garbage_in_the_dummy_slot(setup):
    """The capture run stores keys computed from outputs no replay has filled (NaN on the
    emulator, garbage on a GPU) into the dummy slot; a decode graph gathers masked columns
    pointing there, and 0 x NaN is NaN. Found by the emulator: the decode runner captured
    before returned NaN rows after a piecewise capture."""
    m, runner, pw = setup
    for layer in m.layers:
        assert torch.isfinite(layer.attention.kv_cache.kv).all()
    wl = _workload(m, seed=11)
    assert serve(m, wl, runner=runner).tokens == serve(m, wl).tokens
