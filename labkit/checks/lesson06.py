"""Checkers for lesson 06 (decode bucketing the SGLang way).

Three exercises, each checked against :mod:`labkit.decode`:

* ``sglang_buckets(max_bs) -> list[int]``: SGLang's default capture list,
  ``[1, 2, 4, 8, 12] + range(16, 257, 8) + range(272, 512, 16) + range(512, max_bs + 1, 32)``
  clipped to ``max_bs``, with ``max_bs`` itself always in, sorted, no duplicates.
  Reference: :func:`labkit.decode.default_buckets`.
* ``pad_to_bucket(raw_bs, buckets) -> int``: the smallest bucket ``>= raw_bs``
  (``bisect_left``); a batch larger than the largest bucket raises
  :class:`~labkit.decode.BatchTooLargeError` (any ``ValueError`` is accepted). Reference:
  :func:`labkit.decode.pad_to_bucket`.
* ``fill_slot(slot, src, raw_rows, padded_rows)``: load one static buffer
  (a :class:`~labkit.decode.GraphSlot`) in place: ``src`` into rows ``0..raw_rows``, the
  padding tail ``raw_rows..padded_rows`` by the slot's policy (``head_only``: leave it,
  ``zero_tail``: zeros, ``sentinel``: ``slot.fill_value``), rows past the bucket left
  alone. Reference: :meth:`labkit.decode.StaticBuffers.fill_from` on a one-buffer registry.

Every checker prints one line on success and names the typical mistake otherwise
(``bisect_right``, a missing ``max_bs``, a tail that is not cleared, ...).
"""

from __future__ import annotations

from numbers import Integral

import torch

from labkit.checks import CheckResult, check, describe_exception
from labkit.decode import (
    GraphSlot,
    Pad,
    StaticBuffers,
    default_buckets,
    make_buckets,
)
from labkit.decode import pad_to_bucket as _pad_to_bucket

__all__ = ["check_sglang_buckets", "check_pad_to_bucket", "check_fill_slot"]


def _as_int_list(actual) -> tuple[list[int] | None, str | None]:
    """``actual`` as a list of Python ints, or a reason why it is not one."""
    if actual is None:
        return None, "got None (did you forget `return`?)"
    if isinstance(actual, torch.Tensor):
        actual = actual.tolist()
    if isinstance(actual, (str, bytes)) or not hasattr(actual, "__iter__"):
        return None, f"expected a list of ints, got {type(actual).__name__}"
    out = list(actual)
    bad = [x for x in out if not isinstance(x, Integral) or isinstance(x, bool)]
    if bad:
        return None, f"expected a list of ints, found {bad[0]!r} ({type(bad[0]).__name__})"
    return [int(x) for x in out], None


def _short(xs: list[int], n: int = 12) -> str:
    return str(xs) if len(xs) <= n else f"[{', '.join(map(str, xs[:n]))}, ...] ({len(xs)} values)"


# ---- exercise 1: sglang_buckets -----------------------------------------------------------

# Trials 1-5 are the cases where the usual mistakes show; the rest are random.
_MAX_BS_CASES = {1: 30, 2: 16, 3: 600, 4: 13, 5: 256}


def check_sglang_buckets(fn, *, trials: int = 7) -> CheckResult:
    """``fn(max_bs)`` must return :func:`labkit.decode.default_buckets` ``(max_bs)``."""
    last: dict = {}

    def make_inputs(gen: torch.Generator):
        trial = gen.initial_seed()
        max_bs = _MAX_BS_CASES.get(trial) or int(torch.randint(1, 1100, (), generator=gen))
        last["max_bs"] = max_bs
        return (max_bs,)

    def compare(expected: list[int], actual) -> str | None:
        max_bs = last["max_bs"]
        got, why = _as_int_list(actual)
        if why:
            return f"sglang_buckets({max_bs}): {why}"
        if got == expected:
            return None
        head = f"sglang_buckets({max_bs}) returned {_short(got)}, expected {_short(expected)}"
        too_big = sorted(x for x in set(got) if x > max_bs)
        missing = sorted(set(expected) - set(got))
        extra = sorted(set(got) - set(expected))
        if too_big:
            return (f"{head}. {too_big[:5]} exceed max_bs={max_bs}: clip the list to "
                    "sizes <= max_bs (no graph can be larger than the static buffers)")
        if missing == [max_bs]:
            return (f"{head}. max_bs={max_bs} itself is missing: add it, or a batch of "
                    f"{max_bs} requests (which the server admits) would have no graph")
        if len(got) != len(set(got)):
            dup = sorted({x for x in got if got.count(x) > 1})
            return (f"{head}. {dup} appear twice: make it a set before sorting (max_bs "
                    "may already be in the list)")
        if got != sorted(got):
            return f"{head}. Sort it ascending: pad_to_bucket bisects this list"
        if missing:
            return (f"{head}. Missing {missing[:6]}: check the range ends (range(16, 257, 8) "
                    "includes 256, range(272, 512, 16) stops before 512, range(512, max_bs + 1, "
                    "32) includes max_bs when it is on the grid)")
        return f"{head}. Unexpected sizes {extra[:6]}"

    return check(
        fn, default_buckets, make_inputs, trials=trials, name="sglang_buckets",
        compare=compare,
        hint="[1, 2, 4, 8, 12] + range(16, 257, 8) + range(272, 512, 16) + "
             "range(512, max_bs + 1, 32); keep sizes <= max_bs, add max_bs, sort, no duplicates",
    )


# ---- exercise 2: pad_to_bucket --------------------------------------------------------------

_BUCKET_CASES = {1: ("sglang", 16), 2: ("sglang", 30), 3: ("pow2", 12), 4: ("sglang", 300)}


def _outcome(fn, raw: int, buckets: list[int]):
    """What ``fn(raw, buckets)`` did: ("value", v) or ("raised", exception)."""
    try:
        return ("value", fn(raw, list(buckets)))
    except NotImplementedError:
        raise
    except Exception as exc:  # noqa: BLE001 - reported, not hidden
        return ("raised", exc)


def check_pad_to_bucket(fn, *, trials: int = 6) -> CheckResult:
    """``fn(raw_bs, buckets)``: the smallest bucket >= raw_bs; oversize batches raise.

    Each trial asks about every size from 1 to one past the largest bucket, so exact hits
    (where ``bisect_right`` goes one bucket too far) and the oversize case are always in.
    """
    last: dict = {}

    def make_inputs(gen: torch.Generator):
        trial = gen.initial_seed()
        if trial in _BUCKET_CASES:
            scheme, max_bs = _BUCKET_CASES[trial]
            buckets = make_buckets(max_bs, scheme)
        else:  # a random custom list
            n = int(torch.randint(1, 8, (), generator=gen))
            buckets = sorted(set((torch.randperm(40, generator=gen)[:n] + 1).tolist()))
        raws = list(range(1, buckets[-1] + 2))
        last.update(buckets=buckets, raws=raws)
        return raws, buckets

    def reference(raws, buckets):
        return [_outcome(_pad_to_bucket, r, buckets) for r in raws]

    def learner(raws, buckets):
        return [_outcome(fn, r, buckets) for r in raws]

    def compare(expected, actual) -> str | None:
        buckets = last["buckets"]
        for raw, (ek, ev), (ak, av) in zip(last["raws"], expected, actual):
            call = f"pad_to_bucket({raw}, {_short(buckets, 8)})"
            if ek == "raised":  # oversize: must raise a ValueError
                if ak == "raised" and isinstance(av, ValueError):
                    continue
                if ak == "raised":
                    return (f"{call} raised {describe_exception(av)}\n   A batch larger than "
                            "the largest bucket must raise BatchTooLargeError (a ValueError) "
                            "with a clear message, not fail on an index")
                return (f"{call} returned {av!r}, but {raw} > the largest bucket "
                        f"({buckets[-1]}): raise BatchTooLargeError instead. Returning a "
                        "smaller bucket would silently drop requests")
            if ak == "raised":
                why = ""
                if raw == buckets[-1]:
                    why = (f"\n   A batch of {raw} fits the largest bucket exactly: that is "
                           "bisect_right going one past it; use bisect_left")
                return f"{call} raised {describe_exception(av)}; expected {ev}{why}"
            if isinstance(av, bool) or not isinstance(av, Integral):
                hint = " (did you forget `return`?)" if av is None else ""
                return f"{call} returned {av!r}, expected the int {ev}{hint}"
            if av == ev:
                continue
            if av < raw:
                return (f"{call} returned {av}, smaller than the batch: the bucket must hold "
                        f"all {raw} requests (expected {ev})")
            if raw in buckets:
                return (f"{call} returned {av}, expected {ev}: a batch of {raw} fits the "
                        f"bucket {raw} exactly. That is bisect_right; use bisect_left "
                        "(the first bucket >= raw_bs)")
            return f"{call} returned {av}, expected {ev} (the smallest bucket >= {raw})"
        return None

    return check(
        learner, reference, make_inputs, trials=trials, name="pad_to_bucket", compare=compare,
        hint="i = bisect.bisect_left(buckets, raw_bs); if i == len(buckets): raise "
             "BatchTooLargeError(...); return buckets[i]",
    )


# ---- exercise 3: fill_slot -------------------------------------------------------------------

_POLICY_CASES = {1: Pad.ZERO_TAIL, 2: Pad.SENTINEL, 3: Pad.HEAD_ONLY, 4: Pad.ZERO_TAIL}
_SLOT_NAMES = {Pad.HEAD_ONLY: "input_ids", Pad.ZERO_TAIL: "positions",
               Pad.SENTINEL: "seq_lens"}


def _fill_reference(slot: GraphSlot, src: torch.Tensor, raw_rows: int, padded_rows: int):
    """labkit's own fill_from, on a registry that holds just this buffer."""
    reg = StaticBuffers(max_bs=1, device=slot.tensor.device)
    reg.slots = {}
    reg.register(slot.name, slot.tensor, slot.pad, per_token=False, fill_value=slot.fill_value)
    batch = type("OneBuffer", (), {slot.name: src})()
    reg.fill_from(batch, raw_rows, padded_rows)


def check_fill_slot(fn, *, device=None, trials: int = 6) -> CheckResult:
    """``fn(slot, src, raw_rows, padded_rows)`` must load ``slot.tensor`` in place.

    The buffer starts full of stale values from an "earlier batch" (never 0 or the
    sentinel), so a tail that is not cleared, a sentinel written as 0 and rows past the
    bucket that were touched all show.
    """
    if device is None:
        from labkit import backend

        device = backend.get("auto").device
    device = torch.device(device)
    last: dict = {}

    def make_inputs(gen: torch.Generator):
        trial = gen.initial_seed()
        pad = _POLICY_CASES.get(trial) or list(Pad)[int(torch.randint(0, 3, (), generator=gen))]
        n = int(torch.randint(8, 17, (), generator=gen))
        if trial == 4:   # a batch that fills its bucket exactly: no tail at all
            raw = padded = int(torch.randint(1, n, (), generator=gen))
        else:
            raw = int(torch.randint(1, n - 2, (), generator=gen))
            padded = int(torch.randint(raw + 1, n, (), generator=gen))  # rows past it stay
        dtype = torch.int32 if pad is Pad.SENTINEL else torch.int64
        stale = torch.randint(50, 100, (n,), generator=gen).to(dtype)
        src = torch.randint(2, 40, (raw,), generator=gen).to(device)  # int64, as a batch has
        fill = 1 if pad is Pad.SENTINEL else 0
        slot = GraphSlot(_SLOT_NAMES[pad], stale.clone().to(device), pad, per_token=False,
                         fill_value=fill)
        last.update(pad=pad, raw=raw, padded=padded, stale=stale, n=n, fill=fill,
                    name=slot.name)
        return slot, src, raw, padded

    def run(f):
        def call(slot, src, raw, padded):
            buf = slot.tensor
            f(slot, src, raw, padded)
            return {"buffer": buf.detach().cpu().clone(), "rebound": slot.tensor is not buf}
        return call

    def compare(expected, actual) -> str | None:
        e, a = expected["buffer"], actual["buffer"]
        pad, raw, padded, n = last["pad"], last["raw"], last["padded"], last["n"]
        stale = last["stale"]
        what = (f"{last['name']} ({pad.value}, fill_value={last['fill']}), {n} rows, "
                f"raw_rows={raw}, padded_rows={padded}")
        if torch.equal(a, e) and not actual["rebound"]:
            return None
        if actual["rebound"] or torch.equal(a, stale):
            return (f"{what}: the buffer the graph reads was not written. Write into "
                    "slot.tensor in place (slot.tensor[:raw_rows].copy_(src), ...): a graph "
                    "recorded its address; assigning slot.tensor = ... or a new tensor "
                    "changes nothing it reads")
        if not torch.equal(a[:raw], e[:raw]):
            return (f"{what}: rows 0..{raw} should be the batch {e[:raw].tolist()}, got "
                    f"{a[:raw].tolist()} (copy src into the head)")
        if not torch.equal(a[padded:], e[padded:]):
            return (f"{what}: rows {padded}..{n} changed from {e[padded:].tolist()} to "
                    f"{a[padded:].tolist()}. Rows past the bucket are not read by this "
                    "replay: leave them (touch only raw_rows..padded_rows)")
        tail_a, tail_e = a[raw:padded].tolist(), e[raw:padded].tolist()
        msg = f"{what}: the padding tail (rows {raw}..{padded}) is {tail_a}, expected {tail_e}."
        if pad is Pad.ZERO_TAIL:
            return (msg + " zero_tail: zero it. These are indices that padded rows gather "
                    "and scatter through: a stale one points into a live request's KV cache "
                    "or past the end of a table (illegal memory access on a GPU); 0 is the "
                    "dummy slot")
        if pad is Pad.SENTINEL:
            zero = all(v == 0 for v in tail_a)
            return (msg + " sentinel: fill it with slot.fill_value"
                    + (" (not 0: a length of 0 masks every key and the softmax of the "
                       "padded row becomes NaN)" if zero else
                       " so a padded row sees exactly one (dummy) key"))
        return (msg + " head_only: leave the tail as it is. Any stale token id is valid and "
                "padded rows' outputs are thrown away, so clearing it is a launch for nothing")

    return check(
        run(fn), run(_fill_reference), make_inputs, trials=trials, name="fill_slot",
        compare=compare,
        hint="slot.tensor[:raw_rows].copy_(src); then by slot.pad: ZERO_TAIL → "
             "slot.tensor[raw_rows:padded_rows].zero_(), SENTINEL → "
             ".fill_(slot.fill_value), HEAD_ONLY → nothing",
    )

