"""labkit.speculative: the draft graph runner, greedy acceptance, the speculative loop.

The claim under test: speculative decoding generates exactly the tokens of plain greedy
decoding with the target, whatever the draft (a copy, a truncated copy, a noisy one, one
that is always wrong), the number of draft tokens and the batch size; eagerly and with
graphs. Runner tests take the ``B`` fixture (emulator everywhere, GPU with ``-m cuda``);
the models are lesson 06's "tiny" config in float32, so the file runs in seconds.
"""

from __future__ import annotations

import math
import re
import statistics
import sys

import pytest
import torch
from helpers import assert_usable

from labkit.decode import (
    DecodeGraphRunner,
    EagerRunner,
    ModelArgs,
    build_model,
    make_decode_batch,
    make_extend_batch,
)
from labkit.speculative import (
    DraftGraphRunner,
    damp_blocks,
    format_table,
    graph_savings,
    greedy_accept,
    greedy_generate,
    make_draft,
    measure,
    speculative_generate,
)

MAX_BS = 4
N_NEW = 14
BUCKETS = [1, 2, 4]          # a batch of 3 replays bucket 4: one padded row
PROMPT_LENS = (3, 9, 5, 12)
DRAFTS = ("copy", "1 block", "noisy", "wrong")


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """Tiny tensors: one intra-op thread is faster (tests/conftest.py)."""


class _Models:
    """A target per backend, its drafts, its plain greedy tokens and captured runners,
    each built once for the module (captures are the slow part)."""

    def __init__(self):
        self.cache = {}

    def _get(self, key, make):
        if key not in self.cache:
            self.cache[key] = make()
        return self.cache[key]

    def target(self, B):
        return self._get(("target", B.name), lambda: build_model(
            "tiny", max_requests=MAX_BS, device=B.device, dtype=torch.float32))

    def prompts(self, bs=MAX_BS):
        g = torch.Generator().manual_seed(1)
        return [torch.randint(0, 128, (n,), generator=g).tolist() for n in PROMPT_LENS][:bs]

    def greedy(self, B, bs=MAX_BS):
        def run():
            res = greedy_generate(self.target(B), self.prompts(bs), N_NEW)
            return [res.tokens[i] for i in range(bs)]
        return self._get(("greedy", B.name, bs), run)

    def draft(self, B, kind):
        def make():
            t = self.target(B)
            if kind == "copy":
                return make_draft(t)
            if kind == "1 block":
                return make_draft(t, n_layer=1)
            if kind == "noisy":
                return make_draft(t, n_layer=1, noise=0.3, seed=3)
            d = make_draft(t)              # "wrong": logits shifted by one token id, so the
            with torch.no_grad():          # draft's argmax is always the target's + 1
                d.output.weight.copy_(torch.roll(d.output.weight, 1, dims=0))
            return d
        return self._get(("draft", B.name, kind), make)

    def draft_runner(self, B, kind, k):
        def make():
            r = DraftGraphRunner(self.draft(B, kind), B, k, max_bs=MAX_BS, buckets=BUCKETS)
            r.capture()
            return r
        return self._get(("draft_runner", B.name, kind, k), make)

    def verify_runner(self, B, k):
        def make():
            r = DecodeGraphRunner(self.target(B), B, max_bs=MAX_BS, buckets=BUCKETS,
                                  num_tokens_per_bs=k + 1, progress=False)
            r.capture()
            return r
        return self._get(("verify_runner", B.name, k), make)


M = _Models()


# ---- greedy acceptance (pure) ----------------------------------------------------------------


def test_greedy_accept_keeps_the_agreeing_prefix_and_the_bonus():
    V = 10                    # k = 3 draft tokens per request
    target_choice = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8], [9, 0, 1, 2]])  # (bs, k + 1)
    logits = torch.nn.functional.one_hot(target_choice, V).float().reshape(-1, V)
    drafts = torch.tensor([[1, 2, 3],     # all agree: 3 accepted, bonus 4
                           [5, 0, 7],     # agree, disagree, (agree too late): 1
                           [8, 0, 1]])    # first disagrees: 0, the target's 9 instead
    accepted, t = greedy_accept(drafts, logits)
    assert accepted.tolist() == [3, 1, 0]
    assert torch.equal(t, target_choice)
    new = [t[i, :n + 1].tolist() for i, n in enumerate(accepted.tolist())]
    assert new == [[1, 2, 3, 4], [5, 6], [9]], "accepted drafts, then the target's own token"


# ---- the draft runner ------------------------------------------------------------------------


def _prefill(model, prompts):
    slots = list(range(1, len(prompts) + 1))
    EagerRunner(model).forward(make_extend_batch(model, slots, prompts))
    return slots


def test_draft_loop_is_k_greedy_decode_steps_of_the_draft(B):
    """One call = k greedy decode steps of the draft, each fed its own previous token; the
    captured graph (one per bucket, all k steps in it) gives the same tokens as the loop
    run eagerly, padded bucket included."""
    k = 3
    draft = M.draft(B, "noisy")
    prompts = M.prompts(3)
    slots = _prefill(draft, prompts)
    pos = [len(p) for p in prompts]
    prev, new = [p[-2] for p in prompts], [p[-1] for p in prompts]
    pos = [p - 1 for p in pos]      # the prompts' last token is the "newest" one: refeed it
    runner = M.draft_runner(B, "noisy", k)
    before = dict(runner.stats)
    graphed = runner.forward(slots, pos, prev, new).clone()
    assert runner.last_replay == (3, 4) and runner.stats["graph"] == before["graph"] + 1
    eager = DraftGraphRunner(draft, B, k, max_bs=MAX_BS)
    assert not eager.captured and eager.forward(slots, pos, prev, new).tolist() == graphed.tolist()
    assert eager.stats == {"graph": 0, "eager": 1}
    # the reference: k plain greedy decode steps of the draft, one batch each
    toks, want = list(new), []
    for j in range(k):
        logits = EagerRunner(draft).forward(
            make_decode_batch(draft, slots, toks, [p + j for p in pos]))
        toks = logits.argmax(-1).tolist()
        want.append(toks)
    assert graphed.T.tolist() == want


def test_one_graph_per_bucket_holds_every_draft_step(B):
    if B.name == "cuda":
        pytest.skip("counts the emulator's recorded ops")
    k = 3
    runner = M.draft_runner(B, "1 block", k)
    assert sorted(runner.backend.graphs) == BUCKETS
    for g in runner.backend.graphs.values():
        scatters = sum("index_put_" in op for op in g.recorded_ops())
        assert scatters == k * runner.model.args.n_layer, "k forwards' KV writes in one graph"


# ---- the speculative loop ---------------------------------------------------------------------


@pytest.mark.parametrize("bs", [1, 4])
@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("kind", DRAFTS)
def test_speculative_equals_plain_greedy(E, kind, k, bs):
    target = M.target(E)
    res = speculative_generate(target, M.draft(E, kind), M.prompts(bs), N_NEW, num_steps=k)
    assert res.tokens == M.greedy(E, bs), "exactly the target's greedy tokens"
    assert [len(t) for t in res.tokens] == [N_NEW] * bs
    assert res.decode_tokens == (N_NEW - 1) * bs
    assert len(res.accepted) == len(res.batch_size) == len(res.draft_s) == res.rounds
    assert all(0 <= n <= k for row in res.accepted for n in row)
    if kind == "copy":                       # the draft predicts what the target does
        assert res.acceptance_rate == 1.0
        assert res.rounds == math.ceil((N_NEW - 1) / (k + 1))
    elif kind == "wrong":                    # nothing accepted: one token per round
        assert res.acceptance_rate == 0.0 and res.rounds == N_NEW - 1
    else:
        assert 0.0 < res.acceptance_rate < 1.0
    assert res.draft_stats == {"graph": 0, "eager": res.rounds} and res.verify_stats is None


@pytest.mark.parametrize("kind", ["1 block", "noisy", "wrong"])
def test_graphed_equals_eager(B, kind):
    """Draft graphs + verify graphs: the same tokens and the same acceptance, round by
    round, as the eager loop; every round replays one draft graph and one verify graph."""
    k = 3
    target, draft = M.target(B), M.draft(B, kind)
    eager = speculative_generate(target, draft, M.prompts(), N_NEW, num_steps=k, B=B)
    graphed = speculative_generate(target, draft, M.prompts(), N_NEW,
                                   draft_runner=M.draft_runner(B, kind, k),
                                   verify_runner=M.verify_runner(B, k))
    assert graphed.tokens == eager.tokens == M.greedy(B)
    assert graphed.accepted == eager.accepted and graphed.batch_size == eager.batch_size
    assert graphed.draft_stats == {"graph": graphed.rounds, "eager": 0}
    assert graphed.verify_stats["graph"] == graphed.rounds
    assert graphed.verify_stats["eager"] == 0
    s = graphed.summary()
    assert s["rounds"] == graphed.rounds and s["decode_tokens_per_s"] > 0
    assert s["round_ms"] >= s["draft_ms"] > 0 and s["verify_ms"] > 0


def test_requests_finish_at_different_rounds_and_the_batch_shrinks(E):
    res = speculative_generate(M.target(E), M.draft(E, "noisy"), M.prompts(), N_NEW,
                               draft_runner=M.draft_runner(E, "noisy", 3),
                               verify_runner=M.verify_runner(E, 3))
    assert res.batch_size[0] == MAX_BS and res.batch_size == sorted(res.batch_size, reverse=True)
    assert len(set(res.batch_size)) > 1, "continuous batching: finished requests leave"
    assert res.tokens == M.greedy(E)


# ---- measurement -----------------------------------------------------------------------------


def test_measure_rows_on_the_emulator(E):
    rows = measure(E, "tiny", batch_size=2, num_steps=2, max_new_tokens=8, prompt_len=4,
                   noises=(0.0, 1.0), rounds=1)
    assert [(r["method"], r["mode"]) for r in rows] == (
        [("greedy", "eager"), ("greedy", "graphed")]
        + [("speculative", "eager"), ("speculative", "graphed")] * 2)
    assert all(r["same_tokens"] for r in rows), "every way gives plain greedy's tokens"
    spec = [r for r in rows if r["method"] == "speculative"]
    assert spec[0]["acceptance_%"] == spec[1]["acceptance_%"] > spec[2]["acceptance_%"], \
        "more noise, fewer accepted (measured, the same eager and graphed)"
    for r in spec:
        assert r["tokens_per_s"] > 0 and r["draft_ms"] > 0 and r["verify_ms"] > 0
        assert 1.0 <= r["tokens_per_round"] <= 3.0
    assert {r["mode"]: r["vs_greedy"] for r in rows[:2]} == {"eager": 1.0, "graphed": 1.0}
    saved = graph_savings(rows)
    assert [r["part"] for r in saved] == ["round"] + ["round", "draft", "verify", "accept",
                                                      "host"] * 2
    table = format_table(rows, ["method", "mode", "acceptance_%", "tokens_per_s"])
    assert table.splitlines()[0] == "| method | mode | acceptance_% | tokens_per_s |"
    assert len(table.splitlines()) == 2 + len(rows) and "| greedy | eager | - |" in table


def test_measure_times_every_way_in_interleaved_rounds(E, monkeypatch):
    """Every way is warmed up once, then decoded once per round in a shuffled order; a row
    keeps one value per round, its figures are the medians, and verdicts() pairs each
    speculative row with plain greedy of its mode round by round."""
    M = sys.modules["labkit.speculative.measure"]
    orders = []
    real = M.interleave

    def spy(ways, time_one, **kw):
        def note(run):
            orders.append(run)
            return time_one(run)
        return real(ways, note, **kw)
    monkeypatch.setattr(M, "interleave", spy)
    rows = measure(E, "tiny", batch_size=2, num_steps=2, max_new_tokens=6, prompt_len=4,
                   noises=(0.0,), rounds=3)
    assert len(orders) == 3 * len(rows), "each way once per round"
    first_round = orders[:len(rows)]
    assert len(set(map(id, first_round))) == len(rows)
    for r in rows:
        per = r["rounds"]
        assert len(per["token_us"]) == len(per["tokens_per_s"]) == 3
        assert r["tokens_per_s"] == statistics.median(per["tokens_per_s"])
        for us, rate in zip(per["token_us"], per["tokens_per_s"]):
            assert us == pytest.approx(1e6 / rate)
    judged = M.verdicts(rows)
    assert [(r["method"], r["mode"]) for r, _ in judged] == [("speculative", "eager"),
                                                             ("speculative", "graphed")]
    for r, v in judged:
        plain = next(p for p in rows if p["method"] == "greedy" and p["mode"] == r["mode"])
        assert v.a_rounds == tuple(r["rounds"]["token_us"])
        assert v.b_rounds == tuple(plain["rounds"]["token_us"])
        assert v.wins[0] + v.wins[1] <= 3 and ("faster" in v.text() or "level" in v.text())


def test_cli_prints_both_tables(capsys):
    from labkit.speculative.__main__ import main
    rows = main(["--backend", "emulated", "--batch-size", "1", "--num-steps", "2",
                 "--max-new-tokens", "6", "--noises", "0", "--rounds", "1",
                 "--tail-scale", "0.5"])
    out = capsys.readouterr().out
    assert len(rows) == 4 and "what the graphs save per round" in out
    assert "| 1 | 0.5 | speculative | graphed |" in out and "emulated backend" in out
    with pytest.raises(SystemExit) as e:
        main(["--draft-layers", "3"])
    assert e.value.code == 2
    assert "the tiny target has 2 blocks" in capsys.readouterr().err


# ---- the draft model -------------------------------------------------------------------------


def test_make_draft_copies_truncates_and_perturbs(E):
    target = M.target(E)
    exact = make_draft(target)
    assert exact is not target and len(exact.layers) == len(target.layers)
    for (name, p), q in zip(target.named_parameters(), exact.parameters()):
        assert torch.equal(p, q) and p.data_ptr() != q.data_ptr(), name
    assert exact.num_slots == target.num_slots
    assert exact.layers[0].attention.kv_cache.kv.data_ptr() != \
        target.layers[0].attention.kv_cache.kv.data_ptr(), "a KV cache of its own"
    one = make_draft(target, n_layer=1)
    assert len(one.layers) == 1 and torch.equal(one.output.weight, target.output.weight)
    a, b = make_draft(target, noise=0.1, seed=5), make_draft(target, noise=0.1, seed=5)
    assert torch.equal(a.output.weight, b.output.weight), "seeded"
    w, wn = target.output.weight, a.output.weight
    rel = ((wn - w).pow(2).mean().sqrt() / w.pow(2).mean().sqrt()).item()
    assert 0.08 < rel < 0.12, "noise of the relative scale asked for"
    damped = make_draft(target)
    damp_blocks(damped, 1, 0.0)
    assert torch.count_nonzero(damped.layers[1].attention.wo.weight) == 0
    assert torch.count_nonzero(damped.layers[1].feed_forward.w2.weight) == 0
    assert torch.equal(damped.layers[0].attention.wo.weight, target.layers[0].attention.wo.weight)


# ---- misuse: errors that say what was given, what was expected, what to do ---------------------


def _other_vocab(E):
    args = ModelArgs.from_name("tiny", vocab_size=64)
    return build_model(args, max_requests=MAX_BS, device=E.device, dtype=torch.float32)


def _small_verify_runner(E):
    r = DecodeGraphRunner(M.target(E), E, max_bs=2, num_tokens_per_bs=4, progress=False)
    r.capture()
    return r


def _few_slots_draft(E):
    return build_model("tiny", max_requests=2, device=E.device, dtype=torch.float32)


@pytest.mark.parametrize("call, kind, words", [
    (lambda E: DraftGraphRunner(M.draft(E, "copy"), E, 0), ValueError,
     "num_steps must be in 1..62, got 0: the draft tokens per request"),
    (lambda E: speculative_generate(M.target(E), M.draft(E, "copy"), M.prompts(), 4,
                                    num_steps=0), ValueError,
     "num_steps must be >= 1, got 0"),
    (lambda E: speculative_generate(M.target(E), M.draft(E, "copy"), M.prompts(), 4),
     ValueError, "give num_steps"),
    (lambda E: speculative_generate(M.target(E), _other_vocab(E), M.prompts(), 4, num_steps=2),
     ValueError, "the draft's vocabulary has 64 tokens but the target's has 128"),
    (lambda E: speculative_generate(M.target(E), M.target(E), M.prompts(), 4, num_steps=2),
     ValueError, "draft is the target itself"),
    (lambda E: speculative_generate(
        M.target(E), M.draft(E, "copy"), M.prompts(), 4,
        draft_runner=DraftGraphRunner(M.draft(E, "copy"), E, 2, max_bs=2)),
     ValueError, "4 prompts but the draft runner holds at most 2 requests (max_bs): build it "
                 "with max_bs=4"),
    (lambda E: speculative_generate(M.target(E), M.draft(E, "copy"), M.prompts(), 4,
                                    draft_runner=M.draft_runner(E, "1 block", 3)),
     ValueError, "draft_runner was built for another draft model"),
    (lambda E: speculative_generate(M.target(E), M.draft(E, "copy"), M.prompts(), 4,
                                    num_steps=2, verify_runner=M.verify_runner(E, 3)),
     ValueError, "verify_runner captured 4 token(s) per request (TARGET_VERIFY); verifying 2 "
                 "draft tokens feeds 3 (the newest token and the drafts): build it with "
                 "num_tokens_per_bs=3"),
    (lambda E: speculative_generate(
        M.target(E), M.draft(E, "copy"), M.prompts(), 4, num_steps=3,
        verify_runner=_small_verify_runner(E)),
     ValueError, "4 prompts but the verify runner's largest graph holds 2: capture it with "
                 "max_bs=4"),
    (lambda E: speculative_generate(
        M.target(E), M.draft(E, "copy"), M.prompts(), 4, num_steps=3,
        verify_runner=DecodeGraphRunner(M.target(E), E, max_bs=4, num_tokens_per_bs=4)),
     RuntimeError, "verify_runner has no graphs yet: call verify_runner.capture() first"),
    (lambda E: speculative_generate(
        M.target(E), M.draft(E, "copy"), M.prompts(), 4, num_steps=3,
        verify_runner=DecodeGraphRunner(M.draft(E, "copy"), E, max_bs=4, num_tokens_per_bs=4)),
     ValueError, "verify_runner was built for another model"),
    (lambda E: speculative_generate(M.target(E), _few_slots_draft(E), M.prompts(), 4,
                                    num_steps=2),
     ValueError, "the draft has 2 request slots, the target 4; a request uses the same slot in "
                 "both, so build the draft with max_requests=4"),
    (lambda E: speculative_generate(M.target(E), M.draft(E, "copy"), [[1] * 60], 4,
                                    num_steps=2), ValueError,
     "prompts[0] has 60 tokens; with max_new_tokens=4 and 2 tokens verified past the last one "
     "it needs 65 positions, more than max_seq_len=64"),
    (lambda E: speculative_generate(M.target(E), M.draft(E, "copy"), [[1, 200]], 4,
                                    num_steps=2), ValueError, "token id 200, outside"),
    (lambda E: speculative_generate(M.target(E), M.draft(E, "copy"), [[1]] * 5, 4,
                                    num_steps=2), ValueError, "5 prompts; the model has request "
                                                              "slots for 1..4"),
    (lambda E: M.draft_runner(E, "1 block", 3).forward([1, 2, 3, 4, 1], [5] * 5, [1] * 5,
                                                       [1] * 5),
     ValueError, "5 requests, but this runner's static buffers hold 1..4 (max_bs)"),
    (lambda E: M.draft_runner(E, "1 block", 3).forward(torch.tensor([1]), [5], [1], [1]),
     TypeError, "slots is a tensor; pass host ints"),
    (lambda E: M.draft_runner(E, "1 block", 3).forward([1], [62], [1], [1]), ValueError,
     "positions[0] = 62: the draft reads position 61 and writes up to 64"),
    (lambda E: M.draft_runner(E, "1 block", 3).forward([0], [5], [1], [1]), ValueError,
     "reserved dummy slot"),
    (lambda E: make_draft(M.target(E), n_layer=3), ValueError,
     "n_layer must be in 1..2, got 3: the draft keeps the first n_layer"),
    (lambda E: make_draft(M.target(E), noise=-1.0), ValueError, "noise must be a finite number"),
])
def test_bad_arguments_say_what_and_how_to_fix(E, call, kind, words):
    with pytest.raises(kind, match=re.escape(words)):
        call(E)


def test_failed_capture_leaves_a_usable_process(B):
    """A capture that raises (a host read inside the draft loop) leaves no half-captured
    runner and a usable process; the runner still drafts eagerly, and captures again."""
    draft = M.draft(B, "1 block")
    runner = DraftGraphRunner(draft, B, 3, max_bs=2)
    real = runner.attn_next.init_forward_metadata_in_graph

    def host_read(batch):
        real(batch)
        if B.is_current_stream_capturing():
            batch.seq_lens.sum().item()          # illegal in capture
    runner.attn_next.init_forward_metadata_in_graph = host_read
    with pytest.raises(RuntimeError):
        runner.capture()
    assert not runner.captured and runner.backend.graphs == {} and runner.capture_log == []
    assert_usable(B)
    runner.attn_next.init_forward_metadata_in_graph = real
    target = M.target(B)
    eager = speculative_generate(target, draft, M.prompts(2), N_NEW, draft_runner=runner)
    assert eager.tokens == M.greedy(B, 2) and eager.draft_stats["graph"] == 0
    runner.capture()
    graphed = speculative_generate(target, draft, M.prompts(2), N_NEW, draft_runner=runner)
    assert graphed.tokens == eager.tokens and graphed.draft_stats["eager"] == 0


# ---- GPU only -------------------------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_measure_small_on_cuda():
    """The lead's H200 command in miniature: the "small" target, graphs on a GPU."""
    from labkit import backend
    rows = measure(backend.get("cuda"), "small", batch_size=2, num_steps=3, max_new_tokens=16,
                   noises=(0.0,), tail_scale=0.3, rounds=1)
    assert all(r["same_tokens"] for r in rows)
    assert [r["mode"] for r in rows] == ["eager", "graphed"] * 2
