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
    describe_exception,
    fail,
    reject,
    run_check,
    shown,
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
_LAYOUT_HINTS = [
    "Every request of the capture batch is a fresh prefill in slot 0: request i feeds "
    "lens[i] new tokens at positions 0..lens[i]-1, so seq_lens, seq_lens_cpu and "
    "extend_lens all equal lens (none above max_seq_len, none 0, summing to num_tokens).",
    "lens = [L] * (num_tokens // L) + ([num_tokens % L] if num_tokens % L else []); "
    "positions = torch.cat([torch.arange(n, device=dev) for n in lens]); seq_lens = "
    "torch.tensor(lens, dtype=torch.int32, device=dev); seq_lens_cpu = extend_lens = lens.",
]
_BATCH_HINTS = [
    "The slot is right (slot 0, which no request owns); what the report names is in how the "
    "batch is built. help(ForwardBatch) lists the fields: one entry per token in input_ids, "
    "positions and out_cache_loc, one per request in req_pool_indices and seq_lens, each "
    "with the dtype the text gives.",
    HINTS[1],
]
_LOC_HINTS = [
    "Attention stores each token's K/V at its out_cache_loc, a location in the KV pool, and "
    "reads a request's keys back through model.req_to_token[slot, position]. The location "
    "of a token is looked up in that table, in slot 0's row, at the token's position.",
    HINTS[1],
]
_WHY = ("The warm-ups and the capture run attention eagerly, and attention stores the "
        "batch's keys and values in its slot's cache: whatever request owns that slot loses "
        "its K/V. Put the capture batch in slot 0 (DUMMY_SLOT), which no request owns")


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


# ---- reading one batch -------------------------------------------------------------------

def _slots_word(model) -> str:
    return f"slots 1..{model.num_slots - 1} belong to requests"


def _explain_raise(e, model, n):
    """What the learner's code raising for ``n`` tokens most likely means: ``(text,
    hints)``."""
    L = model.args.max_seq_len
    text = describe_exception(e)
    s = str(e)
    if "reserved dummy slot" in s:
        return (f"{text}\n   make_extend_batch (and make_decode_batch) refuse slot 0: they "
                f"keep every request out of the dummy slot, whose cache padded rows write. The "
                f"capture batch is the one batch that belongs there: build the ForwardBatch "
                f"yourself, ForwardBatch(forward_mode=ForwardMode.EXTEND, ...)", _BATCH_HINTS)
    if n > L and ("out of range" in s or "outside" in s or "out of bounds" in s):
        lens = _split_lens(e, n, L)
        if lens is not None:
            return (f"{text}\n   num_tokens={n} is more than max_seq_len={L}, and your code "
                    f"split it into requests of {lens} tokens, all at most {L}: right. But the "
                    f"positions run on from one request to the next (torch.arange(num_tokens) "
                    f"reaches {n - 1}), and slot 0's row of req_to_token has {L} entries (the "
                    f"rotary table {L} rows): every request is a fresh prefill, so its "
                    f"positions start again at 0, torch.cat([torch.arange(m) for m in lens])",
                    _LAYOUT_HINTS)
        return (f"{text}\n   num_tokens={n} is more than max_seq_len={L}: one request holds at "
                f"most {L} tokens (slot 0 has {L} cache locations, the rotary table {L} rows). "
                f"Split the tokens into requests of at most max_seq_len, all in slot 0, each "
                f"with its own positions 0..len-1 (they start again at 0 for every request)",
                _LAYOUT_HINTS)
    return text, _BATCH_HINTS


def _split_lens(e, n, L) -> list | None:
    """The request lengths the learner's code had worked out when it raised (a list of
    ints, each 1..L, summing to ``n``, in a local variable of its own frames), or None:
    then the tokens were split and what ran past max_seq_len is a position."""
    from labkit.core.errors import in_library

    tb = e.__traceback__
    while tb is not None:
        frame = tb.tb_frame
        if not in_library(frame.f_code.co_filename):
            for v in frame.f_locals.values():
                if (isinstance(v, (list, tuple)) and len(v) > 1
                        and all(type(x) is int and 1 <= x <= L for x in v) and sum(v) == n):
                    return list(v)
        tb = tb.tb_next
    return None


_DTYPES = {   # field: (dtype, what it holds)
    "input_ids": (torch.int64, "token ids"),
    "positions": (torch.int64, "each token's position"),
    "out_cache_loc": (torch.int64, "each token's location in the KV pool"),
    "req_pool_indices": (torch.int64, "each request's slot"),
    "seq_lens": (torch.int32, "each request's length"),
}


def _host_ints(name, value) -> str | None:
    """Why ``value`` (``seq_lens_cpu`` or ``extend_lens``) is not a list of Python ints."""
    what = {"extend_lens": "new tokens per request", "seq_lens_cpu": "the host copy of "
            "seq_lens"}[name]
    if isinstance(value, torch.Tensor):
        return (f"{name} is a tensor ({value.dtype}, on {value.device}); it is host data: a "
                f"list of Python ints ({what}), such as the lens list itself, not "
                f"torch.tensor(lens)")
    if not isinstance(value, list):
        return (f"{name} is {value!r:.60} ({type(value).__name__}); the batch needs a list "
                f"of Python ints ({what}), e.g. {name}=lens")
    bad = next((x for x in value if type(x) is not int), None)
    if bad is not None:
        return (f"{name} holds {bad!r} ({type(bad).__name__}); it is a list of Python ints "
                f"({what}): int(x) for each, or build it from Python ints")
    return None


def _batch_form(model, n: int, batch) -> str | None:
    """A ForwardBatch in EXTEND mode, its tensors flat, of the right dtypes, on the
    model's device."""
    from labkit.decode.batch import ForwardBatch, ForwardMode

    if batch is None:
        return "returned None (did you forget `return`?)"
    if not isinstance(batch, ForwardBatch):
        return f"returned a {type(batch).__name__}; expected a ForwardBatch"
    if batch.forward_mode is not ForwardMode.EXTEND:
        mode = getattr(batch.forward_mode, "name", repr(batch.forward_mode))
        return (f"forward_mode is ForwardMode.{mode}; the capture batch is a prefill, "
                f"ForwardMode.EXTEND: a piecewise bucket serves prefill and mixed batches")
    for name, (dtype, what) in _DTYPES.items():
        t = getattr(batch, name)
        if not isinstance(t, torch.Tensor):
            return (f"batch.{name} is a {type(t).__name__}; expected a tensor ({what}, "
                    f"{dtype}, on model.device)")
        if t.dim() != 1:
            per = "request" if name in ("req_pool_indices", "seq_lens") else "token"
            return (f"batch.{name} has shape {tuple(t.shape)}; expected a flat tensor, one "
                    f"entry per {per}")
        if t.dtype != dtype:
            make = ("build it with torch.tensor(lens, dtype=torch.int32, device=dev)"
                    if name == "seq_lens" else "build it with dtype=torch.int64, or keep the "
                    "int64 that torch.arange and an index_select of req_to_token give")
            return (f"batch.{name} is {t.dtype}; the text asks for {dtype} ({what}): "
                    f"{make}")
        if t.device != model.device:
            return f"batch.{name} is on {t.device}; the model is on {model.device}"
    return None


def _token_count(model, n: int, batch) -> str | None:
    """Exactly ``n`` tokens, one position and one cache location each."""
    L = model.args.max_seq_len
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
    return None


def _dummy_slot(model, n: int, batch) -> str | None:
    """Every request in slot 0, the dummy slot."""
    from labkit.decode.model import DUMMY_SLOT

    slots = batch.req_pool_indices.tolist()
    rows = model.num_slots
    neg = [s for s in slots if s < 0]
    if neg:
        s, row = neg[0], rows + neg[0]
        if row < 0:
            return (f"req_pool_indices holds {s}, outside req_to_token's rows 0..{rows - 1}: "
                    f"every request of the capture batch is in slot 0 (DUMMY_SLOT)")
        whose = ("a live request's slot" if row != DUMMY_SLOT else "the dummy slot, by a "
                 "detour: write DUMMY_SLOT (0) itself")
        return Reason(f"req_pool_indices holds {s}: a negative index counts from the end of "
                      f"req_to_token, so {s} is row {row}, slot {row}, {whose} "
                      f"({_slots_word(model)}). {_WHY}", HINTS)
    high = [s for s in slots if s >= rows]
    if high:
        return Reason(f"req_pool_indices holds {high[0]}, but req_to_token has rows "
                      f"0..{rows - 1} only (slot 0, the dummy slot, then one per request): "
                      f"every request of the capture batch is in slot 0 (DUMMY_SLOT)", HINTS)
    live = sorted({s for s in slots if s != DUMMY_SLOT})
    if live:
        which = (f"slot {live[0]}" if len(live) == 1
                 else f"slots {', '.join(map(str, live))}")
        return Reason(f"req_pool_indices holds {which}: {_slots_word(model)}, and a live "
                      f"request's slot is not the capture's to write. {_WHY}", HINTS)
    return None


def _request_layout(model, n: int, batch) -> str | None:
    """Requests of 1..max_seq_len tokens, fresh prefills from position 0."""
    L = model.args.max_seq_len
    slots = batch.req_pool_indices.tolist()
    ext = batch.extend_lens
    if ext is None:
        return Reason("extend_lens is None; an EXTEND batch needs extend_lens, a list of "
                      "Python ints (new tokens per request)", _LAYOUT_HINTS)
    for name, value in (("extend_lens", ext), ("seq_lens_cpu", batch.seq_lens_cpu)):
        msg = _host_ints(name, value)
        if msg:
            return Reason(msg, _LAYOUT_HINTS)
    bs = len(slots)
    if len(ext) != bs or sum(ext) != n:
        return Reason(f"extend_lens {list(ext)} does not match the batch: {bs} request(s) "
                      f"(req_pool_indices) and {n} tokens; one entry per request, summing to "
                      f"num_tokens", _LAYOUT_HINTS)
    if any(x == 0 for x in ext):
        exact = (f" (num_tokens={n} is a multiple of max_seq_len={L}: there is no partial "
                 f"request then)" if n % L == 0 else "")
        return Reason(f"extend_lens {list(ext)} holds a request of 0 tokens{exact}: every "
                      f"request feeds at least one token", _LAYOUT_HINTS)
    if min(ext) < 0 or max(ext) > L:
        big = max(ext)
        return Reason(f"a request of {big} tokens (extend_lens {list(ext)}), more than "
                      f"max_seq_len={L}: a request holds at most max_seq_len tokens (slot 0 "
                      f"has {L} cache locations, the rotary table {L} rows). Split the tokens "
                      f"into requests of at most max_seq_len, all in slot 0", _LAYOUT_HINTS)
    seq = batch.seq_lens.tolist()
    cpu = list(batch.seq_lens_cpu)
    if cpu != seq:
        return Reason(f"seq_lens_cpu {cpu} and seq_lens {seq} disagree: seq_lens_cpu is the "
                      f"host copy of the same lengths", _LAYOUT_HINTS)
    for i, (s, x) in enumerate(zip(seq, ext)):
        if s != x:
            return Reason(f"seq_lens[{i}] is {s}, but a request of {x} new "
                          f"token{'s' if x != 1 else ''} starting at position 0 has length "
                          f"{x}: every capture request is a fresh prefill from position 0, so "
                          f"seq_lens == extend_lens (seq_lens {seq}, extend_lens {list(ext)})",
                          _LAYOUT_HINTS)
    pos = batch.positions.tolist()
    start = 0
    for r, x in enumerate(ext):
        mine, want = pos[start:start + x], list(range(x))
        if mine != want:
            restart = (" (the positions run on from the request before: each request has its "
                       "own positions, from 0)" if r and mine and mine[0] == start else "")
            return Reason(f"the positions of request {r} are {_span(mine)}, but every capture "
                          f"request starts at position 0: a request of {x} new "
                          f"token{'s' if x != 1 else ''} has positions {_span(want)}{restart}",
                          _LAYOUT_HINTS)
        start += x
    return None


def _cache_locations(model, n: int, batch) -> str | None:
    """Each token's cache location is slot 0's, from req_to_token."""
    from labkit.decode.model import DUMMY_SLOT

    pos = batch.positions.tolist()
    table = model.req_to_token
    locs = batch.out_cache_loc.tolist()
    own = table[DUMMY_SLOT].index_select(
        0, batch.positions.to(table.device)).tolist()
    for j, (loc, want, p) in enumerate(zip(locs, own, pos)):
        if loc == want:
            continue
        same = (" (your locations equal the positions: that holds for an identity table "
                "only; a server's req_to_token maps each (slot, position) to any location in "
                "the pool, so look it up)" if locs == pos else "")
        size = table.numel()
        if not -size <= loc < size:
            return Reason(f"out_cache_loc[{j}] is {loc}, which is no location of the KV pool "
                          f"(0..{size - 1}): position {p} of slot 0 is location "
                          f"req_to_token[0, {p}] = {want}", _LOC_HINTS)
        at = (table == loc % size).nonzero()
        s_, c = int(at[0, 0]), int(at[0, 1])
        if loc < 0:
            live = ", a live request" + chr(39) + "s" if s_ != DUMMY_SLOT else ""
            return Reason(
                f"out_cache_loc[{j}] is {loc}: labkit's attention stores every token's K/V, "
                f"there is no 'skip' location (vLLM's dummy runs pass -1 to a kernel that "
                f"skips it), and a negative index counts from the end of the pool: location "
                f"{loc % size}, req_to_token[{s_}, {c}]{live}. Position {p} of slot 0 is "
                f"location req_to_token[0, {p}] = {want}", _LOC_HINTS)
        if s_ != DUMMY_SLOT:
            return Reason(
                f"out_cache_loc[{j}] is location {loc}, slot {s_}'s (req_to_token[{s_}, {c}]), "
                f"a live request's: attention stores each token's K/V at its out_cache_loc, "
                f"so the capture would overwrite that request's cache. Position {p} of slot 0 "
                f"is location req_to_token[0, {p}] = {want}: out_cache_loc = "
                f"model.req_to_token[DUMMY_SLOT].index_select(0, positions){same}", _LOC_HINTS)
        return Reason(
            f"location {loc} for position {p} of slot 0 (out_cache_loc[{j}]) is not "
            f"req_to_token[0, {p}] = {want}: attention stores each token's K/V at its "
            f"out_cache_loc and reads a request's keys back through req_to_token, so "
            f"out_cache_loc[i] = model.req_to_token[DUMMY_SLOT, positions[i]]{same}", _LOC_HINTS)
    return None


def _token_ids(model, n: int, batch) -> str | None:
    """Token ids in the vocabulary."""
    ids = batch.input_ids
    if bool(((ids < 0) | (ids >= model.args.vocab_size)).any()):
        return (f"input_ids holds ids outside the vocabulary 0..{model.args.vocab_size - 1}: "
                f"any id in range works (zeros, as SGLang's capture does)")
    return None


#: a capture batch's judges, in order (the first reason wins)
BATCH_JUDGES = (_batch_form, _token_count, _dummy_slot, _request_layout, _cache_locations,
                _token_ids)


def judge_batch(model, n, batch) -> str | None:
    """Why ``batch`` is not a capture batch of ``n`` tokens for ``model``, or None. A
    :class:`~labkit.checks.Reason` where the mistake has hints of its own."""
    return next((why for judge in BATCH_JUDGES if (why := judge(model, n, batch))), None)


def _hints_for(batch):
    """The hints for a mistake judge_batch gave no hints of its own: about the slot only
    when the batch's slot is wrong."""
    from labkit.decode.model import DUMMY_SLOT

    slots = getattr(batch, "req_pool_indices", None)
    if isinstance(slots, torch.Tensor) and bool((slots != DUMMY_SLOT).any()):
        return HINTS
    return _BATCH_HINTS


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
