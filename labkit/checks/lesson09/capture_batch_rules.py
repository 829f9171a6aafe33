"""Lesson 09, exercise 4 (``capture_batch``): what one capture batch must be, judged.

:func:`judge_batch` runs :data:`BATCH_JUDGES` in order on the learner's batch for one
bucket (form, token count, dummy slot, request layout, cache locations, ids); the first
reason wins. :mod:`.capture_batch` runs the checker around it.
"""

from __future__ import annotations

import torch

from labkit.checks import Reason, describe_exception

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
