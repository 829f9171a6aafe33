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
above ``max_seq_len``, exact multiples of it), as the text states it: a ForwardBatch in
EXTEND mode with exactly ``num_tokens`` tokens; ``input_ids``, ``positions``,
``out_cache_loc``, ``req_pool_indices`` flat int64 tensors and ``seq_lens`` int32, all on
``model.device``; ``seq_lens_cpu`` and ``extend_lens`` lists of Python ints; every request
in slot 0 (a negative slot counts from the end: -1 is the last, live, slot), none longer
than ``max_seq_len`` nor empty; every request a fresh prefill starting at position 0
(positions ``0..n-1``, ``seq_lens == extend_lens == seq_lens_cpu``); and
``out_cache_loc[i] == model.req_to_token[0, positions[i]]``. Its models' ``req_to_token``
is a random permutation of the pool's locations, as a real server hands them out (location
0 stays slot 0's first, where a decode graph's padded rows write), so a location taken to
equal the position, or read from another slot's row, is caught. Then it plugs the
function into a ``PiecewiseGraphRunner`` subclass (``make_capture_batch``), prefills
every live slot, captures buckets that include one larger than ``max_seq_len`` and one
that is an exact multiple of it, and checks that the live slots' K/V are byte-identical
after the capture and that the pieces then compute what eager does.

Devices cannot be told apart on a CPU: a tensor built without ``device=`` passes the
device check on the emulator; the same check on a GPU (``pytest -m cuda``,
``B=backend.get("cuda")``) catches it.
"""

from __future__ import annotations

import torch

from labkit import backend
from labkit.checks import (
    DEFAULT_TIME_LIMIT,
    Reason,
    attempt,
    call_learner,
    compare_outputs,
    fail,
    reject,
    run_check,
    shown,
)
from labkit.checks.lesson09._common import one_thread, short_description
from labkit.checks.lesson09.capture_batch_rules import (
    _BATCH_HINTS,
    _WHY,
    HINTS,
    _explain_raise,
    _hints_for,
    _span,
    judge_batch,
)

__all__ = ["check_capture_batch", "reference_capture_batch", "broken_capture_batch",
           "show_symptom"]

NAME = "capture_batch"
def broken_capture_batch(model, num_tokens):
    """The capture batch as first written: ``num_tokens`` tokens, one request in slot 1."""
    from labkit.decode import make_extend_batch

    return make_extend_batch(model, [1], [[0] * num_tokens])


def reference_capture_batch(model, num_tokens):
    """The answer: :func:`labkit.piecewise.runner.capture_batch`."""
    from labkit.piecewise.runner import capture_batch

    return capture_batch(model, num_tokens)


def _runner_class(make_batch):
    from labkit.piecewise import PiecewiseGraphRunner

    class Runner(PiecewiseGraphRunner):
        def make_capture_batch(self, num_tokens):
            return call_learner(make_batch, self.model, num_tokens)

    return Runner


# ---- running it --------------------------------------------------------------------------

def _model(B, L, seed):
    from labkit.decode import build_model
    from labkit.decode.model import ModelArgs

    args = ModelArgs.from_name("tiny", max_seq_len=L)
    model = build_model(args, max_requests=3, device=B.device, dtype=torch.float32, seed=seed)
    permute_table(model, seed)
    return model


def permute_table(model, seed: int) -> None:
    """Give ``model.req_to_token`` a random permutation of the pool's locations, as a real
    server hands pages out (build_model's table is the identity): each (slot, position)
    then has its own location anywhere in the pool. labkit's decode and piecewise code go
    through the table everywhere; location 0 stays at ``req_to_token[0, 0]``, because a
    decode graph's padded rows write their throw-away K/V at location 0."""
    table = model.req_to_token
    g = torch.Generator().manual_seed(10_007 + seed)
    rest = 1 + torch.randperm(table.numel() - 1, generator=g)
    perm = torch.cat([torch.zeros(1, dtype=torch.int64), rest])
    table.copy_(perm.view_as(table).to(table.device))


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
                return Reason(f"after runner.capture(), the K/V of slot {slot} (a live "
                              f"request, prefilled before the capture) changed in layer {li}, "
                              f"positions {_span(diff)}. {_WHY}", HINTS)
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
    def body() -> str:
        gen = torch.Generator().manual_seed(seed)
        for t in range(trials):
            _one_trial(fn, B, gen, seed, t)
        return ("every capture batch in the dummy slot, no request longer than max_seq_len, "
                "exactly num_tokens tokens; the live requests' K/V untouched by "
                "runner.capture() and the pieces equal to eager after it "
                f"({trials} models, buckets above max_seq_len included)")

    return run_check(NAME, body, more_hints=_BATCH_HINTS)


def _batches(fn, B, model, sizes: list, where: str) -> None:
    """``fn(model, n)`` for every size, each judged by :func:`judge_batch` (``B``
    recovered after a timeout or an error)."""
    for n in sizes:
        def raised(e, n=n) -> Reason:
            text, hints = _explain_raise(e, model, n)
            return Reason(f"{where}: capture_batch(model, {n}) raised {text}", hints)

        batch = attempt(fn, (model, n), time_limit=DEFAULT_TIME_LIMIT, B=B,
                        not_done=False, passthrough=(NotImplementedError,), reason=raised)
        msg = judge_batch(model, n, batch)
        if msg:
            reject(f"{where}: capture_batch(model, {n}): {msg}",
                   hints=getattr(msg, "hints", None) or _hints_for(batch))


def _one_trial(fn, B, gen: torch.Generator, seed: int, t: int) -> None:
    """Trial ``t``: a model of random max_seq_len and buckets; the learner's batches for
    sizes up to and above it, then a capture with them (:func:`_trial`)."""
    L = int(torch.randint(10, 17, (), generator=gen))
    small = int(torch.randint(1, L, (), generator=gen))
    above = L + int(torch.randint(1, L, (), generator=gen))        # two requests
    buckets = sorted({small, above, 2 * L} if t % 2 == 0 else {1, L, 2 * L + small})
    # up to max_seq_len first (largest first), then above it: the slot before the split
    sizes = sorted(set(buckets) | {1, L - 1, L, L + 1, 2 * L, 3 * L - 1},
                   key=lambda n: (n > L, -n if n <= L else n))
    where = f"trial {t + 1} (max_seq_len={L}, buckets {buckets})"

    def capturing() -> str | None:
        _batches(fn, B, _model(B, L, seed + t), sizes, where)
        return _trial(fn, B, gen, seed + t, L, buckets)

    msg = attempt(capturing, B=B, reason=lambda e: f"{where}: capturing with your batches "
                  f"raised {short_description(e)}")
    if msg:
        reject(f"{where}: {msg}", hints=getattr(msg, "hints", None) or _BATCH_HINTS)


# ---- the symptom, for the notebook -------------------------------------------------------

def show_symptom(make_batch, *, B=None, steps: int = 8, buckets=(8, 16, 32)):
    """Print slot 1's next ``steps`` greedy tokens without a capture, then on a twin model
    captured with ``make_batch`` as its capture batch (lesson 09's tiny model, one request
    prefilled before the capture). Returns ``(tokens_without, tokens_after)``, or None when
    ``make_batch`` (or the capture it is used in) raised: then one ❌ line says what raised
    and what to do, as a checker would."""
    B = backend.get("auto") if B is None else backend.ensure(B, "show_symptom(B=...)")
    name = getattr(make_batch, "__name__", "capture_batch")

    def raised(e: BaseException) -> str:
        who = ("your function" if _raised_in_learner_code(e) else
               "the capture with your function's batch")
        return (f"{who} raised {short_description(e)}\n   No tokens to compare: run "
                f"check_capture_batch({name}), which says what is wrong with the batch")

    with one_thread(B.device):
        return shown(lambda: attempt(_symptom, (make_batch, B, steps, buckets), B=B,
                                     reason=raised),
                     name=name, label=f"show_symptom({name})")


def _raised_in_learner_code(e) -> bool:
    """Whether the error a failed capture started with was raised in the learner's own
    code (a frame outside labkit and torch), not by the capture of its batch."""
    from labkit.core.errors import capture_cause, in_library

    tb = capture_cause(e).__traceback__
    while tb is not None:
        if not in_library(tb.tb_frame.f_code.co_filename):
            return True
        tb = tb.tb_next
    return False


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
    labels = ("slot 1, no capture:", "slot 1, a capture after its prefill:")
    width = max(map(len, labels)) + 1
    print(f"{labels[0]:<{width}}{without}")
    print(f"{labels[1]:<{width}}{after}")
    print("the same tokens" if without == after else
          f"{steps - same} of {steps} tokens differ, and nothing raised")
    return without, after
