"""labkit.decode under misuse: every wrong input is an error that names it, never a wrong
number, a poisoned runner or a traceback from the command line (issue 11).

Kinds (counted in the report): silent-wrong-number repros, state-left-broken repros,
batch constructors, runner options, runner calls (replay / plan / forward / order),
eager runner, serving loop + workload, model building, command line, capture failure,
autotune noise. Runner tests take ``B`` (emulated everywhere, cuda on a GPU).
"""

from __future__ import annotations

import subprocess
import sys
import warnings

import pytest
import torch
from helpers import DecodeModels

from labkit import backend
from labkit.decode import (
    DUMMY_SLOT,
    DecodeGraphRunner,
    EagerRunner,
    ForwardBatch,
    ForwardMode,
    Request,
    build_model,
    demo_stale_tail,
    make_attn_backend,
    make_decode_batch,
    make_extend_batch,
    serve,
    synthetic_workload,
)
from labkit.decode.__main__ import main as cli_main

MAX_BS = 8
DECODE = DecodeModels(MAX_BS, seed=1, prompt_lens=(3, 12))
_model, _runner = DECODE.model, DECODE.runner


def _batch(m, state, slots):
    return make_decode_batch(m, slots, [state[s][0] for s in slots], [state[s][1] for s in slots])


def _close(a, b):
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


# ---- wrong numbers, silently (the repros) -----------------------------------------------


def test_batch_reused_for_the_next_step_is_replanned(B):
    """forward(batch), then the batch updated in place for the next step (as a serving loop
    would): the runner must not keep the previous step's seq_lens / cache locations."""
    m, state = _model(B)
    r = _runner(B)
    slots = [2, 5, 7]
    batch = _batch(m, state, slots)
    r.forward(batch)
    step = [state[s][1] + 1 for s in slots]
    nxt = _batch(m, {s: (state[s][0], p) for s, p in zip(slots, step)}, slots)
    # the serving loop's in-place update: every field, tensors and host list
    batch.positions.add_(1)
    batch.seq_lens.add_(1)
    batch.out_cache_loc.copy_(nxt.out_cache_loc)
    batch.seq_lens_cpu[:] = nxt.seq_lens_cpu
    _close(r.forward(batch).clone(), r.eager_forward(nxt))


def test_planned_batch_changed_before_replay_is_replanned(B):
    """plan(batch), then its lengths change: the fast path is not taken for a stale plan."""
    m, state = _model(B)
    r = _runner(B)
    slots = [1, 3, 4, 6, 8]
    batch = _batch(m, state, slots)
    r.plan(batch)
    assert not batch.needs_forward_metadata_init()
    nxt = _batch(m, {s: (state[s][0], state[s][1] + 2) for s in slots}, slots)
    batch.positions.add_(2)
    batch.seq_lens = nxt.seq_lens                   # a new tensor, same values as eager's
    batch.out_cache_loc = nxt.out_cache_loc
    batch.seq_lens_cpu = list(nxt.seq_lens_cpu)
    assert batch.needs_forward_metadata_init(), "the plan record must see the change"
    before = r.stats["fast_path"]
    _close(r.replay(batch).clone(), r.eager_forward(nxt))
    assert r.stats["fast_path"] == before
    # only the host list changed: still stale
    r.plan(batch)
    batch.seq_lens_cpu[0] += 1
    assert batch.needs_forward_metadata_init()


def test_fast_path_still_taken_for_an_unchanged_planned_batch(B):
    m, state = _model(B)
    r = _runner(B)
    batch = _batch(m, state, [2, 4, 6])
    r.plan(batch)
    before = r.stats["fast_path"]
    _close(r.replay(batch).clone(), r.eager_forward(batch))
    assert r.stats["fast_path"] == before + 1


def test_forward_alone_never_marks_a_batch_planned(B):
    """Only plan() marks (SGLang's mark site); the forward path loads and replays."""
    m, state = _model(B)
    r = _runner(B)
    batch = _batch(m, state, [1, 2])
    r.forward(batch)
    assert batch.needs_forward_metadata_init()


@pytest.mark.parametrize("maker", ["decode", "extend"])
def test_dummy_slot_is_refused(maker):
    m, state = _model(backend.get("emulated"))
    with pytest.raises(ValueError,
                       match=r"slots\[1\] is 0, the reserved dummy slot.*Use slots 1\.\.8"):
        if maker == "decode":
            make_decode_batch(m, [3, DUMMY_SLOT], [1, 2], [5, 5])
        else:
            make_extend_batch(m, [3, DUMMY_SLOT], [[1, 2], [3]])


def test_dummy_slot_written_into_a_batch_is_refused_by_the_runner(B):
    m, state = _model(B)
    r = _runner(B)
    batch = _batch(m, state, [1, 2, 3])
    batch.req_pool_indices[1] = DUMMY_SLOT
    with pytest.raises(ValueError, match="reserved dummy slot"):
        r.forward(batch)


# ---- state left broken --------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [128, -1, 10_000])
def test_out_of_vocab_id_refused_by_make_decode_batch(bad):
    m, _ = _model(backend.get("emulated"))
    with pytest.raises(ValueError,
                       match=rf"token id {bad} in tokens is outside the vocabulary 0\.\.127"):
        make_decode_batch(m, [1, 2], [5, bad], [4, 4])


@pytest.mark.parametrize("call", ["forward", "replay", "plan"])
def test_bad_id_never_reaches_a_static_buffer_and_the_runner_stays_usable(B, call):
    """A bad id written into a batch is caught before the buffers; the next valid batch of
    the same bucket (whose padding rows would have held the bad id) runs and is right."""
    m, state = _model(B)
    r = _runner(B)
    six = _batch(m, state, [1, 2, 3, 4, 5, 6])
    six.input_ids[5] = m.args.vocab_size + 3
    ids_before = r.buffers.input_ids.clone()
    with pytest.raises(ValueError, match="outside the vocabulary"):
        getattr(r, call)(six)
    assert torch.equal(r.buffers.input_ids, ids_before), "nothing reached the static buffer"
    five = _batch(m, state, [1, 2, 3, 4, 5])        # same bucket (8), padded rows 5..7
    _close(r.forward(five).clone(), r.eager_forward(five))


def test_negative_id_refused_by_eager_runner_too():
    m, state = _model(backend.get("emulated"))
    batch = _batch(m, state, [1, 2])
    batch.input_ids[0] = -4
    with pytest.raises(ValueError, match="token id -4 in batch.input_ids"):
        EagerRunner(m).forward(batch)


# ---- batch constructors -------------------------------------------------------------------------


@pytest.mark.parametrize("args,match", [
    (([1, 2], [5], [3, 3]), r"lengths slots: 2, tokens: 1, start_positions: 2"),
    (([1, 2], [5, 6], [3]), r"lengths slots: 2, tokens: 2, start_positions: 1"),
    (([], [], []), r"no requests"),
    (([1, 9], [5, 6], [3, 3]), r"slots\[1\] = 9 is outside the model's request slots 1\.\.8"),
    (([1, -2], [5, 6], [3, 3]), r"slots\[1\] = -2 is outside"),
    (([3, 3], [5, 6], [3, 3]), r"slot\(s\) \[3\] appear more than once"),
    (([1, 2], [5, 6], [3, 64]), r"start_positions\[1\] = 64.*outside 0\.\.63"),
    (([1, 2], [5, 6], [-1, 3]), r"start_positions\[0\] = -1"),
    (([1, 2], [[5, 6], [7]], [3, 3]), r"same number \(>= 1\) of tokens, got \[1, 2\]"),
    (([1, 2], [[5, 6], [7, 8]], [3, 3]), r"DECODE batch feeds one token.*TARGET_VERIFY"),
])
def test_make_decode_batch_value_errors(args, match):
    m, _ = _model(backend.get("emulated"))
    with pytest.raises(ValueError, match=match):
        make_decode_batch(m, *args)


@pytest.mark.parametrize("args,kw,match", [
    (([1, 2.0], [5, 6], [3, 3]), {},
     r"slots\[1\] must be an int, got 2.0 \(float\): slots holds request slots"),
    (([1, 2], [5, "6"], [3, 3]), {}, r"tokens\[1\] must be a list of token ids"),
    (([1, 2], 5, [3, 3]), {}, r"tokens must be a list"),
    (("12", [5, 6], [3, 3]), {}, r"slots must be a list of request slots \(ints\), got str"),
    (([1, 2], [5, 6], [3, True]), {}, r"start_positions\[1\] must be an int"),
    (([1], [5], [3]), {"mode": "decode"},
     r"mode must be ForwardMode.DECODE or ForwardMode.TARGET_VERIFY"),
    (([1], [5], [3]), {"mode": ForwardMode.EXTEND}, r"make_extend_batch"),
])
def test_make_decode_batch_type_errors(args, kw, match):
    m, _ = _model(backend.get("emulated"))
    with pytest.raises((TypeError, ValueError), match=match):
        make_decode_batch(m, *args, **kw)


def test_make_decode_batch_needs_a_model():
    with pytest.raises(TypeError, match="labkit.decode Transformer with caches set up"):
        make_decode_batch(torch.nn.Linear(2, 2), [1], [5], [3])


@pytest.mark.parametrize("args,match", [
    (([1, 2], [[5, 6]]), r"lengths slots: 2, prompts: 1, prefix_lens: 2"),
    (([1, 2], [[5, 6], []]), r"prompts\[1\] is empty"),
    (([1], [[5, 200]]), r"token id 200 in prompts\[0\] is outside the vocabulary"),
    (([1], [[5] * 65]), r"positions 0\.\.64.*outside 0\.\.63"),
    (([1], [[5]], [-2]), r"prefix_lens\[0\] = -2"),
    (([], []), r"no requests"),
])
def test_make_extend_batch_errors(args, match):
    m, _ = _model(backend.get("emulated"))
    with pytest.raises(ValueError, match=match):
        make_extend_batch(m, *args)


# ---- runner options -----------------------------------------------------------------------------


@pytest.mark.parametrize("kw,err,match", [
    ({"max_bs": 0}, ValueError, r"max_bs must be in 1\.\.8, got 0"),
    ({"max_bs": -3}, ValueError, r"max_bs must be in 1\.\.8, got -3"),
    ({"max_bs": 9}, ValueError, r"max_bs must be in 1\.\.8, got 9: the model has 8 request slots"),
    ({"max_bs": "8"}, TypeError, r"max_bs must be an int in 1\.\.8, got '8' \(str\)"),
    ({"max_bs": 4.0}, TypeError, r"max_bs must be an int"),
    ({"buckets": "SGLang"}, ValueError,
     r"unknown bucket scheme 'SGLang': choose one of sglang, every, pow2"),
    ({"buckets": []}, ValueError, r"empty list"),
    ({"buckets": [1, 2, 16]}, ValueError, r"every bucket size must be in 1\.\.8, got 16"),
    ({"buckets": [0, 2]}, ValueError, r"every bucket size must be in 1\.\.8, got 0"),
    ({"buckets": 4}, TypeError, r"buckets must be a scheme name"),
    ({"fallback": "Eager"}, ValueError, r"fallback must be one of 'error', 'eager', got 'Eager'"),
    ({"attention": "flash"}, ValueError,
     r"unknown attention backend 'flash': choose one of torch_native, triton, auto"),
    ({"num_tokens_per_bs": 0}, ValueError, r"num_tokens_per_bs must be in 1\.\.64"),
    ({"forward_mode": ForwardMode.EXTEND}, ValueError, r"forward_mode must be ForwardMode.DECODE"),
    ({"forward_mode": ForwardMode.DECODE, "num_tokens_per_bs": 3}, ValueError,
     r"use TARGET_VERIFY"),
    ({"num_warmups": 0}, ValueError, r"num_warmups must be >= 1.*before capture"),
    ({"compile_bs": -1}, ValueError, r"compile_bs must be >= 0"),
    ({"disable_padding": "yes"}, TypeError, r"disable_padding must be True or False"),
    ({"padding_override": {"pos": "head_only"}}, ValueError,
     r"names buffer 'pos'; the buffers are input_ids"),
    ({"padding_override": {"positions": "zero"}}, ValueError, r"choose one of .*zero_tail"),
    ({"padding_override": ["positions"]}, TypeError, r"padding_override must be a dict"),
])
def test_runner_options(kw, err, match):
    m, _ = _model(backend.get("emulated"))
    with pytest.raises(err, match=match):
        DecodeGraphRunner(m, backend.get("emulated"), progress=False, **kw)


def test_runner_options_unknown_keyword_names_the_known_ones():
    m, _ = _model(backend.get("emulated"))
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'max_bss'; its options are "
                                        r"max_bs, buckets, disable_padding"):
        DecodeGraphRunner(m, backend.get("emulated"), max_bss=4)


def test_runner_options_as_one_dataclass():
    """options= and keywords build the same runner; a keyword replaces an option; the
    dataclass is checked as the keywords are, and the runner's options are read-only."""
    from labkit.decode import DecodeRunnerOptions
    E = backend.get("emulated")
    m, _ = _model(E)
    opts = DecodeRunnerOptions(max_bs=4, buckets="pow2", fallback="eager", progress=False)
    r = DecodeGraphRunner(m, E, options=opts)
    assert (r.max_bs, r.buckets, r.fallback) == (4, [1, 2, 4], "eager")
    assert DecodeGraphRunner(m, E, options=opts, max_bs=3).buckets == [1, 2, 3]
    with pytest.raises(ValueError, match=r"fallback must be one of 'error', 'eager', got 'x'"):
        DecodeGraphRunner(m, E, options=DecodeRunnerOptions(fallback="x"))
    with pytest.raises(TypeError, match=r"options must be a DecodeRunnerOptions, got dict"):
        DecodeGraphRunner(m, E, options={"max_bs": 4})
    with pytest.raises(AttributeError):
        r.max_bs = 8


def test_runner_takes_every_bucket_scheme_make_buckets_knows():
    """'sglang_spec' (SGLang's list under speculative decoding, a verify runner's) is a
    scheme like the others, not an 'unknown bucket scheme'."""
    from labkit.decode import make_buckets
    m, _ = _model(backend.get("emulated"))
    r = DecodeGraphRunner(m, backend.get("emulated"), buckets="sglang_spec", progress=False)
    assert r.buckets == make_buckets(MAX_BS, "sglang_spec")


def test_runner_needs_a_backend_and_a_model():
    m, _ = _model(backend.get("emulated"))
    with pytest.raises(TypeError, match=r"DecodeGraphRunner\(model, B\) must be the backend "
                                        r"namespace .* got str 'emulated'.*labkit\.backend\.get"):
        DecodeGraphRunner(m, "emulated")
    with pytest.raises(TypeError, match=r"with caches set up"):
        DecodeGraphRunner(object(), backend.get("emulated"))


def test_max_bs_none_means_every_slot():
    m, _ = _model(backend.get("emulated"))
    assert DecodeGraphRunner(m, backend.get("emulated"), progress=False).max_bs == MAX_BS


# ---- runner calls: replay / plan / forward, out of order, wrong batches -------------------------


def test_calls_before_capture():
    m, state = _model(backend.get("emulated"))
    r = DecodeGraphRunner(m, backend.get("emulated"), max_bs=4, progress=False)
    batch = _batch(m, state, [1, 2])
    for call in (r.replay, r.forward):
        with pytest.raises(RuntimeError,
                           match=r"no graphs captured yet: call runner.capture\(\) first"):
            call(batch)
    with pytest.raises(RuntimeError, match="capture"):
        demo_stale_tail(r, batch)
    prefill = make_extend_batch(m, [1], [[1, 2]])
    # prefill is eager by design, captured or not: not an error
    assert r.forward(prefill).shape == (2, m.args.vocab_size)


def _empty_batch(m):
    e = torch.empty(0, dtype=torch.int64, device=m.device)
    return ForwardBatch(ForwardMode.DECODE, e, e.clone(), e.clone(), e.clone(),
                        e.to(torch.int32), [])


@pytest.mark.parametrize("call", ["replay", "forward", "plan"])
def test_empty_batch(B, call):
    m, _ = _model(B)
    r = _runner(B)
    with pytest.raises(ValueError, match=r"the batch is empty \(0 requests\)"):
        getattr(r, call)(_empty_batch(m))


def test_wrong_object_for_a_batch(B):
    r = _runner(B)
    for call in (r.replay, r.forward, r.plan, r.can_run):
        with pytest.raises(TypeError, match=r"expected a ForwardBatch.*got dict"):
            call({"input_ids": [1]})


def test_wrong_dtype_device_shape(B):
    m, state = _model(B)
    r = _runner(B)
    b = _batch(m, state, [1, 2, 3])
    b.input_ids = b.input_ids.float()
    with pytest.raises(TypeError,
                       match=r"batch.input_ids has dtype torch.float32; expected an integer"):
        r.forward(b)
    b = _batch(m, state, [1, 2, 3])
    b.positions = torch.zeros(3, dtype=torch.int64, device="meta")
    with pytest.raises(ValueError, match=r"batch.positions is on meta but the model is on"):
        r.replay(b)
    b = _batch(m, state, [1, 2, 3])
    b.seq_lens = b.seq_lens[:2]
    with pytest.raises(ValueError, match=r"batch.seq_lens has 2 entries, expected 3"):
        r.forward(b)
    b = _batch(m, state, [1, 2, 3])
    b.seq_lens_cpu = b.seq_lens_cpu + [9]
    with pytest.raises(ValueError, match=r"batch.seq_lens_cpu has 4 entries, expected 3"):
        r.forward(b)
    b = _batch(m, state, [1, 2, 3])
    b.input_ids = b.input_ids.view(3, 1)
    with pytest.raises(ValueError, match=r"must be flat \(1-D\)"):
        r.forward(b)


def test_inconsistent_values(B):
    m, state = _model(B)
    r = _runner(B)
    b = _batch(m, state, [1, 2, 3])
    b.seq_lens.add_(1)                           # tensor updated, host list forgotten
    with pytest.raises(ValueError, match=r"batch.seq_lens .* and batch.seq_lens_cpu .* disagree"):
        r.forward(b)
    b = _batch(m, state, [1, 2, 3])
    b.positions.add_(1)                          # positions moved, lengths not
    with pytest.raises(ValueError, match=r"last position is .* but its seq_len is"):
        r.forward(b)
    b = _batch(m, state, [1, 2, 3])
    b.out_cache_loc[0] += 1                      # K/V would land in another position
    with pytest.raises(ValueError, match=r"out_cache_loc\[0\] = .* owns cache location"):
        r.forward(b)
    b = _batch(m, state, [1, 2, 3])
    b.positions[2] = 64
    with pytest.raises(ValueError, match=r"position 64 in batch.positions is outside 0\.\.63"):
        r.replay(b)


def test_replay_of_a_batch_the_graphs_cannot_take(B):
    m, state = _model(B)
    r = _runner(B)
    verify = make_decode_batch(m, [1, 2], [[1, 2], [3, 4]], [20, 20],
                               mode=ForwardMode.TARGET_VERIFY)
    with pytest.raises(ValueError, match=r"captured DECODE with 1 token.*use runner.forward"):
        r.replay(verify)
    with pytest.raises(ValueError, match="use runner.forward"):
        r.replay(make_extend_batch(m, [1], [[1, 2]]))
    small = _runner(B, max_bs=4)
    from labkit.decode import BatchTooLargeError
    with pytest.raises(BatchTooLargeError):
        small.replay(_batch(m, state, [1, 2, 3, 4, 5]))


def test_replay_padding_override_typos(B):
    m, state = _model(B)
    r = _runner(B)
    b = _batch(m, state, [1, 2, 3])
    with pytest.raises(ValueError, match=r"names buffer 'position'"):
        r.replay(b, padding_override={"position": "head_only"})
    with pytest.raises(ValueError,
                       match=r"padding_override\['positions'\] = 'head'; choose one of"):
        r.replay(b, padding_override={"positions": "head"})


def test_demo_stale_tail_misuse(B):
    m, state = _model(B)
    r = _runner(B)
    three = _batch(m, state, [1, 2, 3])
    with pytest.raises(ValueError, match=r"'seq_lens' is not an index buffer; choose one of"):
        demo_stale_tail(r, three, "seq_lens")
    with pytest.raises(TypeError, match=r"runner must be a DecodeGraphRunner"):
        demo_stale_tail(EagerRunner(m), three)
    with pytest.raises(TypeError, match=r"stale_value must be an int"):
        demo_stale_tail(r, three, "positions", stale_value="big")


# ---- eager runner, attention backends -----------------------------------------------------------


def test_eager_runner_misuse():
    m, _ = _model(backend.get("emulated"))
    with pytest.raises(TypeError, match=r"attn_backend must be a name"):
        EagerRunner(m, attn_backend=3)
    with pytest.raises(ValueError, match=r"unknown attention backend 'native'"):
        EagerRunner(m, attn_backend="native")
    with pytest.raises(TypeError, match=r"expected a ForwardBatch"):
        EagerRunner(m).forward([1, 2, 3])
    with pytest.raises(ValueError, match=r"unknown attention backend 'Triton'"):
        make_attn_backend("Triton", m)


# ---- serving loop and workload ------------------------------------------------------------------


@pytest.mark.parametrize("kw,err,match", [
    ({"num_requests": -1}, ValueError, r"num_requests must be >= 0, got -1"),
    ({"num_requests": 2.5}, TypeError, r"num_requests must be an int"),
    ({"arrival_rate": 0}, ValueError, r"arrival_rate must be a finite number > 0"),
    ({"arrival_rate": float("nan")}, ValueError, r"arrival_rate must be a finite number > 0"),
    ({"prompt_len": (5, 2)}, ValueError, r"prompt_len=\(5, 2\): need 1 <= min <= max"),
    ({"output_len": (0, 4)}, ValueError, r"output_len=\(0, 4\)"),
    ({"output_len": 8}, TypeError, r"output_len must be a \(min, max\) pair of ints"),
    ({"vocab_size": 0}, ValueError, r"vocab_size must be >= 1"),
    ({"max_seq_len": 10, "prompt_len": (12, 14)}, ValueError, r"does not fit max_seq_len=10"),
])
def test_synthetic_workload_misuse(kw, err, match):
    with pytest.raises(err, match=match):
        synthetic_workload(**kw)


def test_serve_misuse():
    B = backend.get("emulated")
    m, _ = _model(B)
    wl = synthetic_workload(3, vocab_size=m.args.vocab_size, max_seq_len=m.args.max_seq_len)
    other = build_model("tiny", max_requests=2)
    with pytest.raises(ValueError, match=r"runner was built for another model"):
        serve(other, wl, runner=EagerRunner(m))
    with pytest.raises(ValueError, match=r"max_running=9 > KV slots \(8\)"):
        serve(m, wl, max_running=9)
    with pytest.raises(ValueError, match=r"max_running must be >= 1, got 0"):
        serve(m, wl, max_running=0)
    with pytest.raises(ValueError, match=r"max_steps must be >= 1"):
        serve(m, wl, max_steps=0)
    with pytest.raises(ValueError, match=r"request id 0 appears twice"):
        serve(m, wl + [wl[0]])
    with pytest.raises(TypeError, match=r"workload\[1\] is a dict, not a Request"):
        serve(m, [wl[0], {"rid": 1}])
    with pytest.raises(TypeError, match=r"workload must be a list of Request"):
        serve(m, wl[0])
    with pytest.raises(ValueError, match=r"prompt has token id 500, outside the vocabulary"):
        serve(m, [Request(0, 0, [1, 500], 2)])
    with pytest.raises(ValueError, match=r"request 0's max_new_tokens must be >= 1, got 0: the "
                                         r"prefill already samples one token"):
        serve(m, [Request(0, 0, [1, 2], 0)])
    with pytest.raises(ValueError, match=r"needs 70 positions, more than max_seq_len=64"):
        serve(m, [Request(0, 0, [1] * 10, 61)])
    with pytest.raises(TypeError, match=r"runner must be a DecodeGraphRunner or EagerRunner"):
        serve(m, wl, runner="graphs")


def test_serve_overlap_misuse():
    B = backend.get("emulated")
    m, _ = _model(B)
    wl = synthetic_workload(3, vocab_size=m.args.vocab_size, max_seq_len=m.args.max_seq_len)
    with pytest.raises(TypeError, match=r"overlap must be True or False, got 'yes'"):
        serve(m, wl, overlap="yes")
    with pytest.raises(ValueError, match=r"overlap=True needs a captured DecodeGraphRunner .* "
                                         r"got runner=None"):
        serve(m, wl, overlap=True)
    with pytest.raises(ValueError, match=r"got EagerRunner"):
        serve(m, wl, runner=EagerRunner(m), overlap=True)
    strict = DecodeGraphRunner(m, B, max_bs=4, progress=False)      # fallback="error"
    strict.capture()
    with pytest.raises(ValueError, match=r"overlap=True runs every decode step as a graph") as e:
        serve(m, wl, runner=strict, overlap=True)
    assert "fallback" not in str(e.value), "advice that cannot work with overlap=True"
    small = DecodeGraphRunner(m, B, max_bs=4, progress=False, fallback="eager")
    small.capture()
    with pytest.raises(ValueError, match=r"up to 8 requests run at once and the largest graph "
                                         r"is 4: pass max_running=4 or capture with max_bs=8"):
        serve(m, wl, runner=small, overlap=True)
    assert serve(m, wl, runner=small, overlap=True, max_running=4).tokens == serve(m, wl).tokens


def test_serve_warns_when_max_steps_cuts_requests_short():
    m, _ = _model(backend.get("emulated"))
    wl = synthetic_workload(3, vocab_size=m.args.vocab_size, max_seq_len=m.args.max_seq_len)
    with pytest.warns(RuntimeWarning, match=r"stopped at max_steps=2 with 3 requests unfinished"):
        res = serve(m, wl, max_steps=2)
    assert all(len(t) < r.max_new_tokens for t, r in zip(res.tokens.values(), wl))


# ---- model building -----------------------------------------------------------------------------


@pytest.mark.parametrize("args,kw,err,match", [
    (("huge",), {}, ValueError, r"unknown model config 'huge': choose one of tiny, small"),
    ((3,), {}, TypeError, r"args must be a config name"),
    (("tiny",), {"max_requests": 0}, ValueError,
     r"max_requests must be >= 1, got 0: the number of live requests"),
    (("tiny",), {"dtype": torch.int32}, TypeError, r"dtype must be a floating torch dtype"),
    (("tiny",), {"dtype": "float16"}, TypeError, r"dtype must be a floating torch dtype"),
])
def test_build_model_misuse(args, kw, err, match):
    with pytest.raises(err, match=match):
        build_model(*args, **kw)


def test_model_args_misuse():
    from labkit.decode import ModelArgs
    with pytest.raises(ValueError, match=r"dim=60 is not a multiple of n_head=8"):
        ModelArgs(dim=60, n_head=8)
    with pytest.raises(ValueError, match=r"n_head=4 is not a multiple of n_local_heads=3"):
        ModelArgs(n_head=4, n_local_heads=3)
    with pytest.raises(ValueError, match=r"ModelArgs.vocab_size must be >= 1, got 0"):
        ModelArgs(vocab_size=0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_build_model_on_cuda_without_a_gpu():
    with pytest.raises(RuntimeError, match=r"no CUDA GPU is available here"):
        build_model("tiny", device="cuda")


# ---- command line -------------------------------------------------------------------------------


@pytest.mark.parametrize("argv,match", [
    (["--requests", "-1"], r"argument --requests: must be >= 1, got -1"),
    (["--requests", "0"], r"argument --requests: must be >= 1, got 0"),
    (["--requests", "many"], r"argument --requests: 'many' is not an integer"),
    (["--config", "huge"],
     r"argument --config: invalid choice: 'huge' \(choose from 'tiny', 'small'\)"),
    (["--rate", "0"], r"argument --rate: must be a number > 0"),
    (["--rate", "-2"], r"argument --rate: must be a number > 0"),
    (["--rate", "inf"], r"argument --rate: must be a number > 0"),
    (["--rate", "fast"], r"argument --rate: 'fast' is not a number"),
    (["--buckets", "1,x"], r"argument --buckets: '1,x': use sglang, every, pow2 or batch sizes"),
    (["--buckets", "1,0,4"], r"argument --buckets: '1,0,4'"),
    (["--buckets", "SGLang"], r"argument --buckets: 'SGLang'"),
    (["--buckets", "1,2,32", "--max-bs", "8"], r"argument --buckets: bucket 32 > --max-bs 8"),
    (["--max-bs", "-1"], r"argument --max-bs: must be >= 1, got -1"),
    (["--max-bs", "0"], r"argument --max-bs: must be >= 1, got 0"),
    (["--seed", "-1"], r"argument --seed: must be >= 0"),
    (["--dtype", "float8"], r"argument --dtype: invalid choice: 'float8'"),
    (["--backend", "gpu"], r"argument --backend: invalid choice: 'gpu'"),
    (["--json", "/no/such/folder/out.json"],
     r"argument --json: folder /no/such/folder does not exist"),
])
def test_cli_rejects_bad_options(argv, match, capsys):
    with pytest.raises(SystemExit) as e:
        cli_main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert __import__("re").search(match, err), err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_cli_cuda_backend_without_a_gpu(capsys):
    with pytest.raises(SystemExit) as e:
        cli_main(["--backend", "cuda"])
    assert e.value.code == 2
    assert "argument --backend: backend 'cuda' needs a CUDA GPU" in capsys.readouterr().err


@pytest.mark.parametrize("argv,match", [
    (["--requests", "-1"], "argument --requests: must be >= 1, got -1"),
    (["--buckets", "1,two"], "argument --buckets: '1,two'"),
])
def test_cli_subprocess_exits_2_without_traceback(argv, match):
    p = subprocess.run([sys.executable, "-m", "labkit.decode", *argv], capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 2 and "Traceback" not in p.stderr and match in p.stderr, p.stderr


# ---- capture failure leaves a usable process ----------------------------------------------------


def test_failed_capture_cleans_up(B):
    """A capture that raises (here: a host read inside the captured region) leaves no
    half-captured runner, the default stream current and random ops allowed."""
    m, state = _model(B)
    r = DecodeGraphRunner(m, B, max_bs=4, progress=False)
    real = r.attn.init_forward_metadata_in_graph

    def host_read(batch):
        real(batch)
        if B.is_current_stream_capturing():
            batch.seq_lens.sum().item()          # illegal in capture
    r.attn.init_forward_metadata_in_graph = host_read
    with pytest.raises(RuntimeError):
        r.capture()
    assert not r.captured and r.backend.graphs == {} and r.capture_log == []
    assert B.current_stream() == B.default_stream()
    torch.randn(4, device=B.device)               # the generator is out of capture mode
    r.attn.init_forward_metadata_in_graph = real
    r.capture()                                    # and the runner captures again
    batch = _batch(m, state, [1, 2, 3])
    _close(r.forward(batch).clone(), r.eager_forward(batch))


# ---- autotune noise -----------------------------------------------------------------------------


def test_quiet_autotune_turns_off_inductor_reports():
    import torch._inductor.config as cfg

    from labkit.decode.capture_utils import quiet_autotune
    before = cfg.autotune_num_choices_displayed
    with quiet_autotune():
        assert cfg.autotune_num_choices_displayed == 0
        if hasattr(cfg, "max_autotune_report_choices_stats"):
            assert cfg.max_autotune_report_choices_stats is False
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            pass
    assert cfg.autotune_num_choices_displayed == before


def test_triton_attention_has_no_autotuner():
    """Its kernels are plain @triton.jit (fixed BLOCK_N): nothing to print autotune logs."""
    from pathlib import Path

    import labkit.decode.triton_attention as ta
    src = Path(ta.__file__).read_text()
    assert "triton.autotune" not in src and "@triton.jit" in src


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_compiled_capture_prints_no_autotune_tables_cuda(capfd):
    B = backend.get("cuda")
    m = build_model("tiny", max_requests=4, device=B.device)
    r = DecodeGraphRunner(m, B, max_bs=4, compile_bs=2, progress=False)
    r.capture()
    out = capfd.readouterr()
    assert "AUTOTUNE" not in out.err and "Autotune Choices Stats" not in out.err, out.err[-2000:]
    assert "TypedStorage is deprecated" not in out.err


# ---- model / attention called directly, out of order --------------------------------------------


def test_model_called_without_an_attention_backend():
    m, state = _model(backend.get("emulated"))
    b = _batch(m, state, [1, 2])
    with pytest.raises(RuntimeError, match=r"batch has none: run batches through EagerRunner"):
        m(b.input_ids, b.positions, b)


def test_setup_caches_after_the_runner_was_built():
    B = backend.get("emulated")
    m = build_model("tiny", max_requests=4, device=B.device)
    r = DecodeGraphRunner(m, B, max_bs=4, progress=False)
    r.capture()
    eager = EagerRunner(m)
    m.setup_caches(4)                              # new KV pools: the graphs read the old ones
    b = make_decode_batch(m, [1, 2], [3, 4], [0, 0])
    for call in (r.forward, r.replay, eager.forward):
        with pytest.raises(RuntimeError, match=r"setup_caches\(\) ran after this runner was built"):
            call(b)


def test_attention_backend_misuse():
    from labkit.decode import TorchNativeAttnBackend
    m, state = _model(backend.get("emulated"))
    with pytest.raises(TypeError, match=r"needs a labkit.decode Transformer with caches"):
        TorchNativeAttnBackend(torch.nn.Linear(2, 2))
    a = TorchNativeAttnBackend(m)
    with pytest.raises(RuntimeError, match=r"before init_cuda_graph_state"):
        a.init_forward_metadata_out_graph(_batch(m, state, [1]))
    with pytest.raises(ValueError, match=r"max_num_tokens a multiple of it"):
        a.init_cuda_graph_state(4, 6)


@pytest.mark.parametrize("change,err,match", [
    ({"q": torch.zeros(2, 4, 16)[:, :, :8]}, ValueError, r"kv_pool heads 2 x dim 16 do not fit"),
    ({"q": torch.zeros(2, 16)}, ValueError, r"q must be \(bs, Hq, D\)"),
    ({"page_table": torch.zeros(3, 8, dtype=torch.int64)}, ValueError,
     r"page_table must be \(bs=2, W\)"),
    ({"seq_lens": torch.zeros(2)}, TypeError, r"integer tensors"),
    ({"kv_pool": torch.zeros(10, 2, 2, 16, dtype=torch.float16)}, TypeError,
     r"q is torch.float32 but kv_pool is torch.float16"),
    ({"num_splits": 3}, ValueError, r"num_splits \(3\) must be powers of two"),
    ({"block_n": 8}, ValueError, r"block_n must be a power of two >= 16"),
])
def test_decode_attention_arguments(change, err, match):
    from labkit.decode.triton_attention import decode_attention
    kw = dict(q=torch.zeros(2, 4, 16), kv_pool=torch.zeros(10, 2, 2, 16),
              page_table=torch.zeros(2, 8, dtype=torch.int64),
              seq_lens=torch.ones(2, dtype=torch.int32))
    kw.update(change)
    with pytest.raises(err, match=match):
        decode_attention(**kw)


def test_serve_with_a_runner_that_cannot_take_every_step():
    B = backend.get("emulated")
    m, _ = _model(B)
    wl = synthetic_workload(3, vocab_size=m.args.vocab_size, max_seq_len=m.args.max_seq_len)
    with pytest.raises(RuntimeError, match=r"runner has no graphs yet: call runner.capture\(\)"):
        serve(m, wl, runner=DecodeGraphRunner(m, B, max_bs=4, progress=False))
    small = _runner(B, max_bs=4)
    with pytest.raises(ValueError, match=r"up to 8 requests run at once but the runner's largest "
                                         r"graph is 4 and fallback='error'"):
        serve(m, wl, runner=small)
    assert serve(m, wl, runner=small, max_running=4).tokens == serve(m, wl).tokens


def test_buckets_from_a_generator_are_read_once():
    m, _ = _model(backend.get("emulated"))
    r = DecodeGraphRunner(m, backend.get("emulated"), max_bs=8, buckets=(b for b in (1, 2, 8)),
                          progress=False)
    assert r.buckets == [1, 2, 8]


def test_graph_backend_and_base_runner_misuse(B):
    from labkit.decode import BaseGraphRunner, FullGraphBackend
    with pytest.raises(ValueError, match=r"num_warmups must be >= 1, got 0"):
        FullGraphBackend(B, num_warmups=0)
    with pytest.raises(ValueError,
                       match=r"non-empty ascending list of distinct batch sizes, got \[4, 2\]"):
        BaseGraphRunner(B, [4, 2])
    with pytest.raises(ValueError, match=r"got \[\]"):
        BaseGraphRunner(B, [])
    r = _runner(B)
    with pytest.raises(KeyError, match=r"no graph captured for 3; captured: \[1, 2, 4, 8\]"):
        r.backend.replay(3)


def test_tensors_and_numpy_ints_are_accepted_where_lists_of_ints_are():
    import numpy as np
    m, _ = _model(backend.get("emulated"))
    ref = make_decode_batch(m, [1, 2], [5, 6], [3, 3])
    for b in (make_decode_batch(m, torch.tensor([1, 2]), torch.tensor([5, 6]), [3, 3]),
              make_decode_batch(m, np.array([1, 2]), np.array([5, 6]), np.array([3, 3]))):
        assert torch.equal(b.input_ids, ref.input_ids) and b.seq_lens_cpu == ref.seq_lens_cpu
    r = DecodeGraphRunner(m, backend.get("emulated"), max_bs=np.int64(2), progress=False)
    assert r.max_bs == 2 and r.buckets == [1, 2]
