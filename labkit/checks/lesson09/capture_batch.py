"""Exercise 4 (diagnosis): ``capture_batch(model, num_tokens)``, the batch a token bucket
is warmed up and captured with.

The symptom: after ``runner.capture()``, a request prefilled before the capture generates
other tokens than it would have without the capture, and nothing raised. The cause: the
warm-ups and the capture run attention eagerly, and attention *stores* the batch's keys
and values; the broken capture batch (``make_extend_batch(model, [1], ...)``) sits in slot
1, a live request's slot, so capturing overwrites that request's cache. The fix
(:func:`labkit.piecewise.runner.capture_batch`) writes only into the dummy slot 0, which no
request owns, and splits the tokens into requests of at most ``max_seq_len``.

The checker first reads the learner's batch for many sizes (one token, below, at and
above ``max_seq_len``, exact multiples of it): a ForwardBatch in EXTEND mode with exactly
``num_tokens`` tokens, every request in slot 0, none longer than ``max_seq_len`` nor
empty, ``seq_lens``/``extend_lens``/``positions`` consistent, every ``out_cache_loc`` one
of slot 0's locations. Then it plugs the function into a ``PiecewiseGraphRunner``
subclass (``make_capture_batch``), prefills every live slot, captures buckets that include
one larger than ``max_seq_len`` and one that is an exact multiple of it, and checks that
the live slots' K/V are byte-identical after the capture and that the pieces then compute
what eager does.
"""

from __future__ import annotations

import numbers

import torch

from labkit import backend
from labkit.checks import (
    NOT_DONE,
    LearnerTimeout,
    call_learner,
    compare_outputs,
    describe_exception,
    fail,
    passed,
)
from labkit.checks.lesson09._common import one_thread, short_description

__all__ = ["check_capture_batch", "reference_capture_batch", "broken_capture_batch",
           "show_symptom"]

NAME = "capture_batch"
HINTS = [
    "Which cache does attention write during runner.capture()? The warm-ups and the capture "
    "run the whole forward, attention included, on the capture batch. Which slot may it "
    "write then, whatever requests are running?",
    "Build the ForwardBatch yourself (make_extend_batch refuses slot 0): lens = max_seq_len-"
    "sized requests plus the remainder, positions = torch.cat of torch.arange(n) per "
    "request, out_cache_loc = model.req_to_token[DUMMY_SLOT].index_select(0, positions), "
    "req_pool_indices all DUMMY_SLOT, seq_lens = extend_lens = seq_lens_cpu = lens.",
]
_WHY = ("The warm-ups and the capture run attention eagerly, and attention stores the "
        "batch's keys and values in its slot's cache: whatever request owns that slot loses "
        "its K/V. Put the capture batch in slot 0 (DUMMY_SLOT), which no request owns")


def broken_capture_batch(model, num_tokens):
    """The capture batch as first written: ``num_tokens`` tokens, one request in slot 1."""
    from labkit.decode import make_extend_batch

    return make_extend_batch(model, [1], [[0] * num_tokens])


def reference_capture_batch(model, num_tokens):
    """The answer (labkit.piecewise.runner.capture_batch)."""
    from labkit.decode.batch import ForwardBatch, ForwardMode
    from labkit.decode.model import DUMMY_SLOT

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


def _runner_class(make_batch):
    from labkit.piecewise import PiecewiseGraphRunner

    class Runner(PiecewiseGraphRunner):
        def make_capture_batch(self, num_tokens):
            return call_learner(make_batch, self.model, num_tokens)

    return Runner


# ---- reading one batch -------------------------------------------------------------------

def _slots_word(model) -> str:
    return f"slots 1..{model.num_slots - 1} belong to requests"


def _explain_raise(e, model, n) -> str:
    """What the learner's code raising for ``n`` tokens most likely means."""
    L = model.args.max_seq_len
    text = describe_exception(e)
    s = str(e)
    if "reserved dummy slot" in s:
        return (f"{text}\n   make_extend_batch (and make_decode_batch) refuse slot 0: they keep "
                f"every request out of the dummy slot, whose cache padded rows write. The "
                f"capture batch is the one batch that belongs there: build the ForwardBatch "
                f"yourself, ForwardBatch(forward_mode=ForwardMode.EXTEND, ...)")
    if n > L and ("out of range" in s or "outside" in s or "out of bounds" in s):
        return (f"{text}\n   num_tokens={n} is more than max_seq_len={L}: one request holds at "
                f"most {L} tokens (slot 0 has {L} cache locations, the rotary table {L} rows). "
                f"Split the tokens into requests of at most max_seq_len, all in slot 0, each "
                f"with its own positions 0..len-1")
    return text


def judge_batch(model, n, batch) -> str | None:
    """Why ``batch`` is not a capture batch of ``n`` tokens for ``model``, or None."""
    from labkit.decode.batch import ForwardBatch, ForwardMode
    from labkit.decode.model import DUMMY_SLOT

    L = model.args.max_seq_len
    if batch is None:
        return "returned None (did you forget `return`?)"
    if not isinstance(batch, ForwardBatch):
        return f"returned a {type(batch).__name__}; expected a ForwardBatch"
    if batch.forward_mode is not ForwardMode.EXTEND:
        mode = getattr(batch.forward_mode, "name", repr(batch.forward_mode))
        return (f"forward_mode is ForwardMode.{mode}; the capture batch is a prefill, "
                f"ForwardMode.EXTEND: a piecewise bucket serves prefill and mixed batches")
    for name in ("input_ids", "positions", "out_cache_loc", "req_pool_indices", "seq_lens"):
        t = getattr(batch, name)
        if not isinstance(t, torch.Tensor):
            return f"batch.{name} is a {type(t).__name__}; expected a tensor"
        if t.dtype not in (torch.int64, torch.int32) or t.dim() != 1:
            return (f"batch.{name} is a {t.dtype} tensor of shape {tuple(t.shape)}; expected a "
                    f"flat integer tensor (torch.int64; seq_lens torch.int32)")
        if t.device != model.device:
            return f"batch.{name} is on {t.device}; the model is on {model.device}"
    over = (f" (num_tokens={n} is more than max_seq_len={L}: slot 0 has {L} cache "
            f"locations, so the tokens go to several requests of at most {L}, all in "
            f"slot 0)" if n > L else "")
    if batch.input_ids.numel() != n:
        return (f"the batch holds {batch.input_ids.numel()} tokens (input_ids), but the "
                f"bucket is {n}: the pieces are captured at the bucket's token count, so the "
                f"capture batch has exactly num_tokens tokens{over}")
    for name in ("positions", "out_cache_loc"):
        if getattr(batch, name).numel() != n:
            return (f"batch.{name} has {getattr(batch, name).numel()} entries; expected one "
                    f"per token, {n}{over}")
    slots = batch.req_pool_indices.tolist()
    live = sorted({s for s in slots if s != DUMMY_SLOT})
    if live:
        which = (f"slot {live[0]}" if len(live) == 1
                 else f"slots {', '.join(map(str, live))}")
        return (f"req_pool_indices holds {which}: {_slots_word(model)}, and a live request's "
                f"slot is not the capture's to write. {_WHY}")
    ext = batch.extend_lens
    if not isinstance(ext, (list, tuple)) or not all(
            isinstance(x, numbers.Integral) and not isinstance(x, bool) for x in ext):
        return (f"extend_lens is {ext!r:.60}; an EXTEND batch needs extend_lens, a list of "
                f"ints on the host (new tokens per request)")
    bs = len(slots)
    if len(ext) != bs or sum(ext) != n:
        return (f"extend_lens {list(ext)} does not match the batch: {bs} request(s) "
                f"(req_pool_indices) and {n} tokens; one entry per request, summing to "
                f"num_tokens")
    if any(x == 0 for x in ext):
        exact = (f" (num_tokens={n} is a multiple of max_seq_len={L}: there is no partial "
                 f"request then)" if n % L == 0 else "")
        return (f"extend_lens {list(ext)} holds a request of 0 tokens{exact}: every request "
                f"feeds at least one token")
    if max(ext) > L:
        return (f"a request of {max(ext)} tokens (extend_lens {list(ext)}), more than "
                f"max_seq_len={L}: a request holds at most max_seq_len tokens (slot 0 has "
                f"{L} cache locations, the rotary table {L} rows). Split the tokens into "
                f"requests of at most max_seq_len, all in slot 0")
    seq = batch.seq_lens.tolist()
    cpu = list(batch.seq_lens_cpu) if hasattr(batch.seq_lens_cpu, "__len__") else None
    if cpu != seq:
        return (f"seq_lens_cpu {cpu} and seq_lens {seq} disagree: seq_lens_cpu is the host "
                f"copy of the same lengths")
    if len(seq) != bs or any(s < x or s > L for s, x in zip(seq, ext)):
        return (f"seq_lens {seq} do not fit extend_lens {list(ext)}: a request's length "
                f"counts its new tokens (and any prefix before them), at most "
                f"max_seq_len={L}; a fresh request's seq_len is its extend_len")
    pos = batch.positions.tolist()
    start = 0
    for r, (x, s) in enumerate(zip(ext, seq)):
        mine, want = pos[start:start + x], list(range(s - x, s))
        if mine != want:
            restart = (" (the positions run on from the request before: each request has its "
                       "own positions, from 0)" if r and mine and mine[0] == start else "")
            return (f"the positions of request {r} are {_span(mine)}, but a request of "
                    f"{x} new token{'s' if x != 1 else ''} and length {s} has positions "
                    f"{_span(want)}{restart}")
        start += x
    own = set(model.req_to_token[DUMMY_SLOT].tolist())
    locs = batch.out_cache_loc.tolist()
    bad = [loc for loc in locs if loc not in own]
    if bad:
        rows = (model.req_to_token == bad[0]).nonzero()
        whose = f" (slot {int(rows[0, 0])}'s)" if rows.numel() else ""
        return (f"out_cache_loc holds location {bad[0]}{whose}, which is not one of slot 0's: "
                f"attention stores each token's K/V at its out_cache_loc, so every location "
                f"must be the dummy slot's, model.req_to_token[DUMMY_SLOT][position]")
    ids = batch.input_ids
    if bool(((ids < 0) | (ids >= model.args.vocab_size)).any()):
        return (f"input_ids holds ids outside the vocabulary 0..{model.args.vocab_size - 1}: "
                f"any id in range works (zeros, as SGLang's capture does)")
    return None


def _span(xs) -> str:
    if not xs:
        return "[] (none)"
    if xs == list(range(xs[0], xs[0] + len(xs))):
        return f"{xs[0]}..{xs[-1]}"
    return str(xs[:8])[:-1] + (", ...]" if len(xs) > 8 else "]")


# ---- running it --------------------------------------------------------------------------

def _model(B, L, seed):
    from labkit.decode import build_model
    from labkit.decode.model import ModelArgs

    args = ModelArgs.from_name("tiny", max_seq_len=L)
    return build_model(args, max_requests=3, device=B.device, dtype=torch.float32, seed=seed)


def _prefill(model, gen):
    """Prefill every live slot; return {slot: (next token, position)}."""
    from labkit.decode import EagerRunner, make_extend_batch

    L = model.args.max_seq_len
    slots = list(range(1, model.num_slots))
    lens = [int(torch.randint(2, L - 2, (), generator=gen)) for _ in slots]
    prompts = [torch.randint(0, model.args.vocab_size, (n,), generator=gen).tolist()
               for n in lens]
    logits = EagerRunner(model).forward(make_extend_batch(model, slots, prompts))
    last = torch.tensor(lens).cumsum(0) - 1
    toks = logits[last.to(logits.device)].argmax(-1).tolist()
    return {s: (t, n) for s, t, n in zip(slots, toks, lens)}


def _kv(model):
    return [layer.attention.kv_cache.kv.clone() for layer in model.layers]


def _changed_kv(model, before, live) -> str | None:
    """Which live slot's K/V the capture changed, by slot, layer and positions."""
    for slot in live:
        locs = model.req_to_token[slot]
        for li, (layer, old) in enumerate(zip(model.layers, before)):
            now = layer.attention.kv_cache.kv
            diff = (now[locs] != old[locs]).flatten(1).any(1).nonzero().flatten().tolist()
            if diff:
                return (f"after runner.capture(), the K/V of slot {slot} (a live request, "
                        f"prefilled before the capture) changed in layer {li}, positions "
                        f"{_span(diff)}. {_WHY}")
    return None


def _trial(fn, B, gen, seed, L, buckets):
    """Capture with the learner's batches and check the live slots and the output."""
    from labkit.decode import EagerRunner, make_decode_batch

    model, twin = _model(B, L, seed), _model(B, L, seed)
    state = _prefill(model, torch.Generator().manual_seed(seed))
    _prefill(twin, torch.Generator().manual_seed(seed))
    live = sorted(state)
    before = _kv(model)
    runner = _runner_class(fn)(model, B, max_num_tokens=buckets[-1], buckets=buckets,
                               progress=False)
    runner.capture()
    msg = _changed_kv(model, before, live)
    if msg:
        return msg
    toks = [state[s][0] for s in live]
    pos = [state[s][1] for s in live]
    got = runner.forward(make_decode_batch(model, live, toks, pos))
    want = EagerRunner(twin).forward(make_decode_batch(twin, live, toks, pos))
    diff = compare_outputs(want, got, rtol=1e-4, atol=1e-4)
    if diff:
        return (f"after runner.capture(), a decode step of the live requests through the "
                f"pieces differs from the same step run eagerly on a model that was never "
                f"captured: {diff}")
    return None


def check_capture_batch(fn, *, B=None, trials: int = 2, seed: int = 0):
    """Check the learner's ``capture_batch(model, num_tokens)`` (module docstring).
    ``B``: the backend (default ``backend.get("auto")``)."""
    if not callable(fn):
        return fail(NAME, f"expected your function capture_batch, got {type(fn).__name__}")
    B = backend.get("auto") if B is None else backend.ensure(B, "check_capture_batch(B=...)")
    with one_thread(B.device):
        return _check(fn, B, trials, seed)


def _check(fn, B, trials, seed):
    gen = torch.Generator().manual_seed(seed)
    for t in range(trials):
        L = int(torch.randint(10, 17, (), generator=gen))
        small = int(torch.randint(1, L, (), generator=gen))
        above = L + int(torch.randint(1, L, (), generator=gen))        # two requests
        buckets = sorted({small, above, 2 * L} if t % 2 == 0 else {1, L, 2 * L + small})
        # up to max_seq_len first (largest first), then above it: the slot before the split
        sizes = sorted(set(buckets) | {1, L - 1, L, L + 1, 2 * L, 3 * L - 1},
                       key=lambda n: (n > L, -n if n <= L else n))
        where = f"trial {t + 1} (max_seq_len={L}, buckets {buckets})"
        try:
            model = _model(B, L, seed + t)
            for n in sizes:
                try:
                    batch = call_learner(fn, model, n)
                except (NotImplementedError, LearnerTimeout):
                    raise
                except Exception as e:
                    return fail(NAME, f"{where}: capture_batch(model, {n}) raised "
                                      f"{_explain_raise(e, model, n)}",
                                kind="exception", more_hints=HINTS)
                msg = judge_batch(model, n, batch)
                if msg:
                    return fail(NAME, f"{where}: capture_batch(model, {n}): {msg}",
                                more_hints=HINTS)
            msg = _trial(fn, B, gen, seed + t, L, buckets)
        except NotImplementedError:
            return fail(NAME, NOT_DONE, kind="not_implemented")
        except LearnerTimeout as e:
            return fail(NAME, str(e), kind="timeout")
        except Exception as e:
            backend.recover(B)
            return fail(NAME, f"{where}: capturing with your batches raised "
                              f"{short_description(e)}",
                        kind="exception", more_hints=HINTS)
        if msg:
            return fail(NAME, f"{where}: {msg}", more_hints=HINTS)
    return passed(NAME, "every capture batch in the dummy slot, no request longer than "
                        "max_seq_len, exactly num_tokens tokens; the live requests' K/V "
                        f"untouched by runner.capture() and the pieces equal to eager after "
                        f"it ({trials} models, buckets above max_seq_len included)")


# ---- the symptom, for the notebook -------------------------------------------------------

def show_symptom(make_batch, *, B=None, steps: int = 8, buckets=(8, 16, 32)):
    """Print slot 1's next ``steps`` greedy tokens without a capture, then on a twin model
    captured with ``make_batch`` as its capture batch (lesson 09's tiny model, one request
    prefilled before the capture). Returns ``(tokens_without, tokens_after)``."""
    B = backend.get("auto") if B is None else backend.ensure(B, "show_symptom(B=...)")
    with one_thread(B.device):
        try:
            return _symptom(make_batch, B, steps, buckets)
        except NotImplementedError:
            print(f"{getattr(make_batch, '__name__', 'capture_batch')}: {NOT_DONE}")
            return None


def _symptom(make_batch, B, steps, buckets):
    from labkit.decode import EagerRunner, build_model, make_decode_batch, make_extend_batch

    prompt = [5, 17, 42, 8, 99, 23, 61, 4, 77, 30, 12]

    def prefill(model):
        logits = EagerRunner(model).forward(make_extend_batch(model, [1], [prompt]))
        return int(logits[-1].argmax())

    def decode(model, tok, forward):
        out, pos = [], len(prompt)
        for _ in range(steps):
            out.append(tok)
            logits = forward(make_decode_batch(model, [1], [tok], [pos]))
            tok, pos = int(logits[-1].argmax()), pos + 1
        return out

    def fresh():
        return build_model("tiny", max_requests=2, device=B.device, dtype=torch.float32)

    model = fresh()
    without = decode(model, prefill(model), EagerRunner(model).forward)
    model = fresh()
    tok = prefill(model)
    runner = _runner_class(make_batch)(model, B, max_num_tokens=max(buckets),
                                       buckets=list(buckets), progress=False)
    runner.capture()                                 # after the prefill, before decoding
    after = decode(model, tok, runner.forward)
    same = sum(a == b for a, b in zip(without, after))
    print(f"slot 1, no capture:                 {without}")
    print(f"slot 1, a capture after its prefill: {after}")
    print("the same tokens" if without == after else
          f"{steps - same} of {steps} tokens differ, and nothing raised")
    return without, after
