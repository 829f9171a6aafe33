"""Checkers for lesson 06 (decode bucketing the SGLang way).

Four exercises, each checked against :mod:`labkit.decode`:

* ``sglang_buckets(max_bs) -> list[int]``: SGLang's default capture list,
  ``[1, 2, 4, 8, 12] + range(16, 257, 8) + range(272, 512, 16) + range(512, max_bs + 1, 32)``
  clipped to ``max_bs``, with ``max_bs`` itself always in, sorted, no duplicates.
  Reference: :func:`labkit.decode.default_buckets`.
* ``pad_to_bucket(raw_bs, buckets) -> int``: the smallest bucket ``>= raw_bs``, found with
  the ``bisect`` module; a batch larger than the largest bucket raises a ``ValueError``
  (:class:`~labkit.decode.BatchTooLargeError`) whose message names the batch size and the
  largest bucket. Reference: :func:`labkit.decode.pad_to_bucket`.
* ``fill_slot(slot, src, raw_rows, padded_rows)``: load one static buffer
  (a :class:`~labkit.decode.GraphSlot`) in place: ``src`` into rows ``0..raw_rows``, the
  padding tail ``raw_rows..padded_rows`` by the slot's policy (``head_only``: leave it,
  ``zero_tail``: zeros, ``sentinel``: ``slot.fill_value``), rows past the bucket left
  alone. Reference: :meth:`labkit.decode.StaticBuffers.fill_from` on a one-buffer registry.
* ``fixed_config() -> dict`` (a diagnosis exercise): the server of
  :func:`budget_scenario` ran out of graph memory at capture; the learner picks buckets and
  the pool layout so that every batch of its trace has a graph, the graphs fit the budget
  and the padding waste stays under the limit (all three judged by
  :func:`labkit.decode.explore_buckets`).

Every requirement the exercise text states is probed, and what it leaves free is
randomized (bucket lists, batch sizes, fill values, dtypes). The first ❌ names the mistake
actually made and where to look; the next hints (``labkit.checks.hint()``) go further, and
the last one is the answer.
"""

from __future__ import annotations

import bisect
import math
import re

import torch

from labkit.checks import (
    NOT_DONE,
    CheckResult,
    LearnerTimeout,
    call_learner,
    check,
    describe_exception,
    fail,
    passed,
)
from labkit.core.validate import is_int
from labkit.decode import (
    GraphSlot,
    Pad,
    StaticBuffers,
    default_buckets,
    explore_buckets,
    make_buckets,
)
from labkit.decode import pad_to_bucket as _pad_to_bucket

__all__ = ["check_sglang_buckets", "check_pad_to_bucket", "check_fill_slot",
           "check_fixed_config", "budget_scenario"]


def _as_int_list(actual) -> tuple[list[int] | None, str | None]:
    """``actual`` as a list of Python ints, or a reason why it is not one."""
    if actual is None:
        return None, "got None (did you forget `return`?)"
    if isinstance(actual, (set, frozenset)):
        return None, ("got a set: a set has no order, and pad_to_bucket bisects this list. "
                      "Return a sorted list")
    if isinstance(actual, torch.Tensor):
        actual = actual.tolist()
    if isinstance(actual, (str, bytes)) or not hasattr(actual, "__iter__"):
        return None, f"expected a list of ints, got {type(actual).__name__}"
    out = list(actual)
    bad = [x for x in out if not is_int(x)]
    if bad:
        return None, f"expected a list of ints, found {bad[0]!r} ({type(bad[0]).__name__})"
    return [int(x) for x in out], None


def _short(xs: list[int], n: int = 12) -> str:
    return str(xs) if len(xs) <= n else f"[{', '.join(map(str, xs[:n]))}, ...] ({len(xs)} values)"


# ---- exercise 1: sglang_buckets -----------------------------------------------------------

# Trials 1-5 are the cases where the usual mistakes show; the rest are random.
_MAX_BS_CASES = {1: 30, 2: 16, 3: 600, 4: 13, 5: 256}

_SGLANG_HINTS = [
    "Section 2 of the lesson prints the formula and default_buckets for several max_bs: "
    "compare your list with default_buckets(max_bs) for the max_bs in the message.",
    "Build the formula's list, keep only the sizes <= max_bs, add max_bs, then remove "
    "repeats and sort: sorted({...} | {max_bs}).",
    "sizes = [1, 2, 4, 8, 12] + list(range(16, 257, 8)) + list(range(272, 512, 16)) + "
    "list(range(512, max_bs + 1, 32)); return sorted({b for b in sizes if b <= max_bs} | "
    "{max_bs})",
]


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
            return (f"{head}. max_bs={max_bs} itself is missing: a batch of {max_bs} "
                    "requests (which the server admits) would have no graph")
        if len(got) != len(set(got)):
            dup = sorted({x for x in got if got.count(x) > 1})
            return (f"{head}. {dup} appear twice: max_bs may already be in the formula's "
                    "list, so adding it can repeat it")
        if got != sorted(got):
            return f"{head}. The list is not in ascending order: pad_to_bucket bisects it"
        if missing:
            return (f"{head}. Missing {missing[:6]}: check where each range of the formula "
                    "starts and stops (range's stop is exclusive)")
        return (f"{head}. Unexpected sizes {extra[:6]}: every size comes from the formula, "
                "plus max_bs")

    return check(
        fn, default_buckets, make_inputs, trials=trials, name="sglang_buckets",
        compare=compare, more_hints=_SGLANG_HINTS,
    )


# ---- exercise 2: pad_to_bucket --------------------------------------------------------------

_BUCKET_CASES = {1: ("sglang", 16), 2: ("sglang", 30), 3: ("pow2", 12), 4: ("sglang", 600)}

_PAD_HINTS = [
    "Section 2 explains which bucket a batch replays and why bisect_left, not bisect_right.",
    "i = bisect.bisect_left(buckets, raw_bs) is the index of the first bucket >= raw_bs; "
    "when i == len(buckets) no bucket holds the batch.",
    "i = bisect.bisect_left(buckets, raw_bs); if i == len(buckets): raise "
    "BatchTooLargeError(f'batch of {raw_bs} requests > the largest bucket {buckets[-1]}'); "
    "return buckets[i]",
]


class _ProbedBuckets(list):
    """The bucket list handed to the learner: counts element reads and full scans, so the
    checker can tell a bisect (a few reads) from a scan of the whole list."""

    def __init__(self, values):
        super().__init__(values)
        self.reads = 0
        self.scans = 0

    def __getitem__(self, i):
        self.reads += 1
        return super().__getitem__(i)

    def __iter__(self):
        self.scans += 1
        return super().__iter__()


class _BisectSpy:
    """Counts calls of the ``bisect`` functions while the learner's code runs: the module's
    attributes and any name in the learner's globals bound to one of them
    (``from bisect import bisect_left``)."""

    _NAMES = ("bisect_left", "bisect_right", "bisect", "insort", "insort_left",
              "insort_right")

    def __init__(self, fn):
        self.calls: list[str] = []
        self._fn = fn
        self._saved: list[tuple[dict | object, str, object]] = []

    def _wrap(self, name, real):
        def spy(*args, **kwargs):
            self.calls.append(name)
            return real(*args, **kwargs)
        return spy

    def __enter__(self):
        reals = {getattr(bisect, n): n for n in self._NAMES if hasattr(bisect, n)}
        for real, name in reals.items():
            self._saved.append((bisect, name, real))
            setattr(bisect, name, self._wrap(name, real))
        g = getattr(self._fn, "__globals__", None)
        if isinstance(g, dict):
            for key, value in list(g.items()):
                if callable(value) and any(value is r for r in reals):
                    self._saved.append((g, key, value))
                    g[key] = self._wrap(reals[value], value)
        return self

    def __exit__(self, *exc):
        for owner, name, real in reversed(self._saved):
            if isinstance(owner, dict):
                owner[name] = real
            else:
                setattr(owner, name, real)
        return False


class _AnswerKeySpy:
    """Counts calls of labkit's own ``pad_to_bucket`` (the answer key) while the learner's
    code runs: as ``labkit.decode.pad_to_bucket``, through its defining module, or as a
    name in the learner's globals (``from labkit.decode import pad_to_bucket``)."""

    def __init__(self, fn):
        self.calls = 0
        self._fn = fn
        self._saved: list[tuple[object, str, object]] = []

    def __enter__(self):
        import sys

        import labkit.decode as decode

        real = decode.pad_to_bucket

        def spy(*args, **kwargs):
            self.calls += 1
            return real(*args, **kwargs)

        owners = [decode, sys.modules.get(real.__module__)]
        for owner in owners:
            if owner is not None and getattr(owner, "pad_to_bucket", None) is real:
                self._saved.append((owner, "pad_to_bucket", real))
                setattr(owner, "pad_to_bucket", spy)
        g = getattr(self._fn, "__globals__", None)
        if isinstance(g, dict):
            for key, value in list(g.items()):
                if value is real:
                    self._saved.append((g, key, value))
                    g[key] = spy
        return self

    def __exit__(self, *exc):
        for owner, name, real in reversed(self._saved):
            if isinstance(owner, dict):
                owner[name] = real
            else:
                setattr(owner, name, real)
        return False


def _pad_inputs(trial: int, gen: torch.Generator) -> tuple[list[int], list[int]]:
    """(buckets, batch sizes to ask about) for one trial."""
    if trial in _BUCKET_CASES:
        scheme, max_bs = _BUCKET_CASES[trial]
        buckets = make_buckets(max_bs, scheme)
    else:  # a random custom list, sizes up to 300
        n = int(torch.randint(1, 20, (), generator=gen))
        buckets = sorted(set((torch.randperm(300, generator=gen)[:n] + 1).tolist()))
    top = buckets[-1]
    if top <= 64:
        raws = list(range(1, top + 1))
    else:  # every bucket, each side of it, and random sizes in between
        raws = sorted({1, top} | {x for b in buckets for x in (b - 1, b, b + 1) if 1 <= x <= top}
                      | set((torch.randint(1, top + 1, (16,), generator=gen)).tolist()))
    extra = int(torch.randint(2, 1000, (), generator=gen))
    return buckets, raws + [top + 1, top + extra]  # the last two are oversize


def _mentions(text: str, number: int) -> bool:
    return re.search(rf"(?<!\d){number}(?!\d)", text) is not None


def check_pad_to_bucket(fn, *, trials: int = 6, time_limit: float = 10.0,
                        quiet: bool = False) -> CheckResult:
    """``fn(raw_bs, buckets)``: the smallest bucket >= raw_bs, by ``bisect``; oversize
    batches raise a ``ValueError`` whose message names the batch size and the largest bucket.

    Each trial asks about every size up to the largest bucket (for long lists: every
    bucket, both neighbours of each and random sizes) and two oversize sizes. The list the
    learner gets counts its element reads, and the ``bisect`` functions are watched, so a
    scan of the list (``min(b for b in buckets if ...)``, a ``for`` loop) is told apart
    from a bisect. The list must come back unchanged, and labkit's own
    ``labkit.decode.pad_to_bucket`` (the answer key) may not be called.
    """
    name = "pad_to_bucket"
    if not callable(fn):
        return fail(name, f"expected a function, got {type(fn).__name__}", quiet=quiet)
    if fn is _pad_to_bucket:
        return fail(name, "this is labkit.decode.pad_to_bucket itself, labkit's own answer: "
                    "the exercise asks you to write the search yourself, with the bisect "
                    "module", more_hints=_PAD_HINTS, quiet=quiet)

    def failed(trial, message, kind="mismatch", **details):
        return fail(name, f"trial {trial} of {trials}: {message}", more_hints=_PAD_HINTS,
                    kind=kind, quiet=quiet, trials=trial - 1, failed_trial=trial,
                    details=details)

    for trial in range(1, trials + 1):
        gen = torch.Generator().manual_seed(trial)
        buckets, raws = _pad_inputs(trial, gen)
        top = buckets[-1]
        shown = _short(buckets, 8)
        results = {}          # raw -> ("value", v) | ("raised", exc)
        no_bisect = []        # in-range sizes answered without bisect (scan / many reads)
        for raw in raws:
            probe = _ProbedBuckets(buckets)
            try:
                with _BisectSpy(fn) as spy, _AnswerKeySpy(fn) as key:
                    value = call_learner(fn, raw, probe, time_limit=time_limit)
                results[raw] = ("value", value)
            except NotImplementedError:
                return fail(name, NOT_DONE, kind="not_implemented", quiet=quiet)
            except LearnerTimeout as exc:
                return failed(trial, f"pad_to_bucket({raw}, {shown}): {exc}", kind="timeout")
            except Exception as exc:  # noqa: BLE001 - judged below
                results[raw] = ("raised", exc)
            if key.calls:
                return failed(trial, f"pad_to_bucket({raw}, {shown}) called "
                                     "labkit.decode.pad_to_bucket, labkit's own answer: the "
                                     "exercise asks you to write the search yourself, with "
                                     "the bisect module (what labkit's function does inside is "
                                     "what you are practising)")
            if list.__eq__(probe, buckets) is not True:
                return failed(trial, f"pad_to_bucket({raw}, {shown}) changed the list to "
                                     f"{_short(list(probe), 8)}: the bucket list belongs to "
                                     "the runner, read it only (no sort, append or insort)")
            if raw <= top and not spy.calls:
                bound = math.ceil(math.log2(len(buckets) + 1)) + 3
                if probe.scans or probe.reads > bound:
                    no_bisect.append((raw, probe.scans, probe.reads))

        in_range = [r for r in raws if r <= top]
        oversize = [r for r in raws if r > top]

        # 1. sizes that fit a bucket: the pattern of wrong answers over the whole trial
        raised = [r for r in in_range if results[r][0] == "raised"]
        wrong = []
        for raw in in_range:
            kind, v = results[raw]
            e = _pad_to_bucket(raw, buckets)
            if kind == "value" and not is_int(v):
                hint = " (did you forget `return`?)" if v is None else ""
                return failed(trial, f"pad_to_bucket({raw}, {shown}) returned {v!r}, expected "
                                     f"the int {e}{hint}")
            if kind == "value" and v != e:
                wrong.append((raw, int(v), e))
        if _is_bisect_right(wrong, raised, buckets):
            raw = wrong[0][0] if wrong else top
            got = wrong[0][1] if wrong else describe_exception(results[top][1]).split("\n")[0]
            none = " (and the largest bucket's own size finds none)" if top in raised else ""
            return failed(trial, f"pad_to_bucket({raw}, {shown}) gave {got}, expected {raw}: a "
                                 f"batch of {raw} fits the bucket {raw} exactly, yet every size "
                                 f"equal to a bucket goes one bucket further{none}. That is what "
                                 "bisect_right does; section 2 says which bisect gives the first "
                                 "bucket >= raw_bs")
        if raised:
            raw = raised[0]
            return failed(trial, f"pad_to_bucket({raw}, {shown}) raised "
                                 f"{describe_exception(results[raw][1])}\n   but {raw} fits the "
                                 f"bucket {_pad_to_bucket(raw, buckets)}: only a batch larger "
                                 f"than the largest bucket ({top}) has no graph")
        if wrong:
            return failed(trial, _classify_wrong_buckets(wrong, buckets, shown),
                          expected={r: e for r, _, e in wrong},
                          actual={r: v for r, v, _ in wrong})

        # 3. oversize batches: a ValueError that says so
        for raw in oversize:
            kind, v = results[raw]
            call = f"pad_to_bucket({raw}, {shown})"
            if kind == "value":
                return failed(trial, f"{call} returned {v!r}, but {raw} is larger than the "
                                     f"largest bucket ({top}): no graph can run it. Raise "
                                     "BatchTooLargeError instead; returning a bucket would "
                                     "silently drop requests")
            text = str(v)
            if isinstance(v, ValueError) and "empty sequence" in text:
                return failed(trial, f"{call} raised {type(v).__name__}: {text}\n   That "
                                     "error comes from min()/max() over an empty generator, "
                                     "not from a check of yours: its message does not tell "
                                     "the caller that the batch is too large. And the "
                                     "exercise asks for bisect: the list is sorted, so a "
                                     "binary search finds the bucket without scanning it")
            if not isinstance(v, ValueError):
                what = ("an index one past the end of the list (buckets[i] with "
                        "i == len(buckets))" if isinstance(v, IndexError) else
                        "an error of the wrong type")
                return failed(trial, f"{call} raised {describe_exception(v)}\n   That is "
                                     f"{what}. A batch larger than the largest bucket must "
                                     "raise BatchTooLargeError (a ValueError) that says so")
            if not (_mentions(text, raw) and _mentions(text, top)):
                return failed(trial, f"{call} raised {type(v).__name__}({text!r}).\n   The "
                                     f"type is right, but the message must name the batch size "
                                     f"({raw}) and the largest bucket ({top}): the person who "
                                     "reads it has to know what to change")

        # 4. bisect, as the text asks
        if no_bisect:
            raw, scans, reads = no_bisect[-1]
            how = ("walked the whole list (a for loop, a generator in min()/next(), "
                   "sorted() or list())" if scans else
                   f"read the list entry by entry ({reads} reads of a list of {len(buckets)})")
            return failed(trial, f"the answers are right, but pad_to_bucket({raw}, {shown}) "
                                 f"{how} instead of using the bisect module. The list is "
                                 "sorted: a binary search needs about "
                                 f"{math.ceil(math.log2(len(buckets) + 1))} reads, and this "
                                 "runs before every replay")
    return passed(name, f"passed {trials} random trials", quiet=quiet, trials=trials)


def _is_bisect_right(wrong, raised, buckets) -> bool:
    """Every size equal to a bucket (below the largest) went one bucket further, nothing
    else is wrong, and the largest bucket's own size found nothing or was still wrong: the
    signature of ``bisect_right`` (or of ``>`` where ``>=`` belongs)."""
    top = buckets[-1]
    if set(raised) - {top} or (not wrong and top not in raised):
        return False
    nxt = {b: buckets[i + 1] for i, b in enumerate(buckets[:-1])}
    below = {r: v for r, v, _ in wrong if r != top}
    return set(below) == set(buckets[:-1]) and all(v == nxt[r] for r, v in below.items())


def _classify_wrong_buckets(wrong, buckets, shown) -> str:
    """One message for the pattern of wrong answers in a trial: (raw, got, expected)."""
    top = buckets[-1]
    raw, v, e = wrong[0]
    call = f"pad_to_bucket({raw}, {shown})"
    if all(v == bisect.bisect_left(buckets, r) for r, v, _ in wrong):
        return (f"{call} returned {v}, expected {e}: {v} is the position of the bucket in the "
                "list (what bisect returns), not the bucket itself")
    too_small = [w for w in wrong if w[1] < w[0]]
    if too_small:
        raw, v, e = too_small[0]
        return (f"pad_to_bucket({raw}, {shown}) returned {v}, smaller than the batch: a "
                f"bucket of {v} cannot hold {raw} requests (expected {e}, the smallest bucket "
                f">= {raw}). Look at which index you take after the search")
    not_buckets = [w for w in wrong if w[1] not in buckets]
    if not_buckets:
        raw, v, e = not_buckets[0]
        return (f"pad_to_bucket({raw}, {shown}) returned {v}, which is not one of the "
                f"buckets: only those have a graph (expected {e})")
    if all(v == top for _, v, _ in wrong) and len(wrong) > 1:
        return (f"{call} returned {v}, the largest bucket, expected {e}: every batch got the "
                f"largest bucket ({len(wrong)} sizes wrong). The bucket to return is the "
                "smallest one that holds the batch; look at which entry your code picks")
    return (f"{call} returned {v}, expected {e}: the smallest bucket >= {raw} is {e}, so "
            f"{v - raw} padding rows where {e - raw} would do ({len(wrong)} sizes wrong in "
            "this trial)")


# ---- exercise 3: fill_slot -------------------------------------------------------------------

_POLICY_CASES = {1: Pad.ZERO_TAIL, 2: Pad.SENTINEL, 3: Pad.HEAD_ONLY, 4: Pad.ZERO_TAIL,
                 5: Pad.SENTINEL, 6: Pad.ZERO_TAIL}
_SLOT_NAMES = {Pad.HEAD_ONLY: "input_ids", Pad.ZERO_TAIL: "positions",
               Pad.SENTINEL: "seq_lens"}
# sentinel values per trial: never 0 (a zeroed tail must show) and not always 1
_SENTINELS = {2: 3, 5: 1}

_FILL_HINTS = [
    "Section 3 lists the three policies and what each does to the padding tail; the "
    "message above names the rows that differ.",
    "Work on slot.tensor in place, along slot.row_dim: rows 0..raw_rows are the head, "
    "rows raw_rows..padded_rows the tail (slot.tensor.narrow(slot.row_dim, lo, hi - lo) "
    "is a view of rows lo..hi); the rows after padded_rows are not yours.",
    "head.copy_(src); then by slot.pad: Pad.ZERO_TAIL → tail.zero_(), Pad.SENTINEL → "
    "tail.fill_(slot.fill_value), Pad.HEAD_ONLY → nothing",
]


def _fill_reference(slot: GraphSlot, src: torch.Tensor, raw_rows: int, padded_rows: int):
    """labkit's own fill_from, on a registry that holds just this buffer."""
    reg = StaticBuffers(max_bs=1, device=slot.tensor.device)
    reg.slots = {}
    reg.register(slot.name, slot.tensor, slot.pad, per_token=False, fill_value=slot.fill_value,
                 row_dim=slot.row_dim)
    batch = type("OneBuffer", (), {slot.name: src})()
    reg.fill_from(batch, raw_rows, padded_rows)


# trial -> row_dim of the buffer: trial 6 is mrope_positions, shape (3, n), rows along dim 1
_ROW_DIM_CASES = {6: 1}


def _fill_case(gen: torch.Generator, device) -> tuple[GraphSlot, torch.Tensor, int, int]:
    """``(slot, src, raw_rows, padded_rows)`` for the trial ``gen`` was seeded with.

    Trials 1-5 are 1-D buffers of the three policies (trial 4: no tail at all); trial 6 is
    ``mrope_positions`` (shape ``(3, n)``, ``row_dim=1``); later trials draw the policy,
    the rank and ``row_dim``. Every buffer starts full of stale values (never 0 or the
    sentinel). ``fill_value`` is random for every policy (trials 1 and 3: a zero_tail and
    a head_only slot that carry a nonzero one): only ``Pad.SENTINEL`` uses it.
    """
    device = torch.device(device)
    trial = gen.initial_seed()
    pad = _POLICY_CASES.get(trial) or list(Pad)[int(torch.randint(0, 3, (), generator=gen))]
    n = int(torch.randint(8, 17, (), generator=gen))
    if trial == 4:   # a batch that fills its bucket exactly: no tail at all
        raw = padded = int(torch.randint(1, n, (), generator=gen))
    else:
        raw = int(torch.randint(1, n - 2, (), generator=gen))
        padded = int(torch.randint(raw + 1, n, (), generator=gen))  # rows past it stay
    dtype = (torch.int32, torch.int64)[int(torch.randint(0, 2, (), generator=gen))]
    if trial in _ROW_DIM_CASES:
        row_dim, shape = _ROW_DIM_CASES[trial], (3, n)
    elif trial > max(_ROW_DIM_CASES) and bool(torch.randint(0, 2, (), generator=gen)):
        row_dim = int(torch.randint(0, 2, (), generator=gen))
        shape = (n, 3) if row_dim == 0 else (3, n)
    else:
        row_dim, shape = 0, (n,)
    stale = torch.randint(50, 100, shape, generator=gen).to(dtype)
    src_shape = list(shape)
    src_shape[row_dim] = raw
    src = torch.randint(2, 40, src_shape, generator=gen).to(device)   # int64, as a batch has
    if pad is Pad.SENTINEL:
        fill = _SENTINELS.get(trial) or int(torch.randint(2, 10, (), generator=gen))
    elif trial in (1, 3):
        fill = int(torch.randint(2, 10, (), generator=gen))
    else:
        fill = int(torch.randint(0, 10, (), generator=gen))
    name = "mrope_positions" if row_dim == 1 and pad is Pad.ZERO_TAIL else _SLOT_NAMES[pad]
    slot = GraphSlot(name, stale.clone().to(device), pad, per_token=False, fill_value=fill,
                     row_dim=row_dim)
    return slot, src, raw, padded


def check_fill_slot(fn, *, device=None, trials: int = 8) -> CheckResult:
    """``fn(slot, src, raw_rows, padded_rows)`` must load ``slot.tensor`` in place.

    The buffer starts full of stale values from an "earlier batch" (never 0 or the
    sentinel), so a tail that is not cleared, a sentinel written as 0 and rows past the
    bucket that were touched all show. The sentinel's value changes from trial to trial
    (it is ``slot.fill_value``, which in SGLang depends on the attention backend), and so
    does the buffer's dtype (int32 or int64; ``src`` is always int64, as a batch has it).
    Slots of the other policies carry a random ``fill_value`` too (they must ignore it),
    and some buffers hold their rows along dim 1 (``slot.row_dim``, as SGLang's
    ``mrope_positions`` of shape ``(3, n)``). See :func:`_fill_case`.
    """
    if device is None:
        from labkit import backend

        device = backend.get("auto").device
    device = torch.device(device)
    last: dict = {}

    def make_inputs(gen: torch.Generator):
        slot, src, raw, padded = _fill_case(gen, device)
        last.update(pad=slot.pad, raw=raw, padded=padded, stale=slot.tensor.detach().cpu().clone(),
                    n=slot.tensor.shape[slot.row_dim], fill=slot.fill_value, name=slot.name,
                    row_dim=slot.row_dim, shape=tuple(slot.tensor.shape))
        return slot, src, raw, padded

    def run(f):
        def call(slot, src, raw, padded):
            buf = slot.tensor
            try:
                f(slot, src, raw, padded)
            except (NotImplementedError, LearnerTimeout):
                raise
            except Exception as exc:
                if slot.row_dim == 0:
                    raise
                return {"raised": exc}           # named with the slot's row_dim below
            return {"buffer": buf.detach().cpu().clone(), "rebound": slot.tensor is not buf}
        call.__name__ = getattr(f, "__name__", "fill_slot")
        return call

    def compare(expected, actual) -> str | None:
        pad, raw, padded, n = last["pad"], last["raw"], last["padded"], last["n"]
        rd, stale = last["row_dim"], last["stale"]
        what = (f"{last['name']} ({pad.value}, fill_value={last['fill']}), {n} rows, "
                f"raw_rows={raw}, padded_rows={padded}")
        if rd:
            what += f", shape {last['shape']}, row_dim={rd}"
        along = (f" This slot's rows are along dim {rd} (slot.row_dim={rd}, shape "
                 f"{last['shape']}, as SGLang's mrope_positions holds three position ids per "
                 f"token): its head is slot.tensor[:, :raw_rows] and src has shape "
                 f"(3, raw_rows). Slice along slot.row_dim, not along dim 0"
                 if rd else "")
        if "raised" in actual:
            return (f"{what}: your code raised {describe_exception(actual['raised'])}\n  "
                    + along)
        e, a = expected["buffer"], actual["buffer"]

        def part(t, lo, hi):
            return t.narrow(rd, lo, hi - lo)

        if torch.equal(a, e) and not actual["rebound"]:
            return None
        if actual["rebound"]:
            return (f"{what}: the buffer the graph reads was not written. A graph recorded "
                    "the address of slot.tensor; assigning slot.tensor = ... changes nothing "
                    "it reads. Write into it in place")
        if torch.equal(a, stale) and raw == padded:
            return (f"{what}: your function wrote nothing. This batch fills its bucket "
                    "exactly, so there is no padding tail, but the head still holds the real "
                    "requests: copy src into rows 0..raw_rows every time. Does a condition "
                    "on the tail (padded_rows > raw_rows, an early return) skip the head "
                    "copy too?")
        if torch.equal(a, stale):
            return (f"{what}: not one row of slot.tensor changed: the buffer the graph reads "
                    "was not written. Writing into a copy (slot.tensor.clone(), a new "
                    "tensor) or rebinding a local name changes nothing the graph reads. "
                    "Write into slot.tensor in place")
        if not torch.equal(part(a, 0, raw), part(e, 0, raw)):
            return (f"{what}: rows 0..{raw} should be the batch {part(e, 0, raw).tolist()}, "
                    f"got {part(a, 0, raw).tolist()}: the head holds the real requests, "
                    f"src.{along}")
        if not torch.equal(part(a, padded, n), part(e, padded, n)):
            return (f"{what}: rows {padded}..{n} changed from {part(e, padded, n).tolist()} "
                    f"to {part(a, padded, n).tolist()}. Rows past padded_rows belong to larger "
                    f"buckets and are not read by this replay: touch only up to padded_rows."
                    f"{along}")
        tail_a, tail_e = part(a, raw, padded), part(e, raw, padded)
        msg = (f"{what}: the padding tail (rows {raw}..{padded}) is {tail_a.tolist()}, "
               f"expected {tail_e.tolist()}.")
        rows = range(raw, padded)
        bad = [r for r in rows if not torch.equal(part(a, r, r + 1), part(e, r, r + 1))]
        stale_rows = [r for r in bad if torch.equal(part(a, r, r + 1), part(stale, r, r + 1))]
        if pad is not Pad.HEAD_ONLY and stale_rows and len(stale_rows) < padded - raw and \
                stale_rows == bad:
            return (msg + f" Rows {stale_rows} kept their stale values while the rest of the "
                    "tail is right: the tail is every row from raw_rows up to (not including) "
                    "padded_rows; check the bounds of your slice" + along)
        values = set(tail_a.reshape(-1).tolist())
        fill = last["fill"]
        if pad is Pad.ZERO_TAIL:
            if torch.equal(tail_a, part(stale, raw, padded)):
                return (msg + " zero_tail leaves no stale value: these are indices that padded "
                        "rows gather and scatter through, and a stale one points into a live "
                        "request's KV cache or past the end of a table (an illegal memory "
                        "access on a GPU). Section 3 says which row they must point at"
                        + along)
            if values == {fill} and fill != 0:
                return (msg + f" zero_tail means zeros: the tail holds {fill}, this slot's "
                        "fill_value, but fill_value is the sentinel of Pad.SENTINEL slots "
                        "only (every slot carries one; the policy decides whether it is "
                        "used). A zero_tail index must point at row 0, the dummy slot")
            return (msg + " zero_tail means zeros: index 0 is the dummy slot, the only place "
                    "padded rows may write" + along)
        if pad is Pad.SENTINEL:
            if values == {0}:
                return (msg + " A sentinel of 0 masks every key: the padded row's softmax "
                        "becomes NaN. The value to write is the slot's own sentinel")
            if len(values) == 1 and fill not in values:
                return (msg + f" The tail holds {values.pop()} but this slot's sentinel is "
                        f"{fill}: take the value from slot.fill_value, not a constant (SGLang "
                        "asks the attention backend for it: usually 1, not always)")
            return msg + " The sentinel policy fills every tail row with the slot's sentinel" \
                + along
        return (msg + " head_only leaves the tail as it is: any stale token id is valid and "
                "padded rows' outputs are thrown away, so clearing it costs a launch for "
                "nothing (and for a token id, no value is 'safer' than another)" + along)

    return check(
        run(fn), run(_fill_reference), make_inputs, trials=trials, name="fill_slot",
        compare=compare, more_hints=_FILL_HINTS,
    )


# ---- exercise 4 (diagnosis): fixed_config under a memory budget ---------------------------------

#: the broken server of exercise 4: one graph per batch size, a memory pool per graph
BROKEN_CONFIG = {"buckets": "every", "shared_pool": False}


def budget_scenario() -> dict:
    """The server of exercise 4: its decode trace, ``max_bs``, graph-memory budget and the
    padding-waste limit.

    The trace is 450 decode steps of a day's traffic (mostly 18..28 requests, peaks of
    52..64, a few near-idle steps of 1..4), fixed by a seed so that every learner and the
    checker see the same numbers. Memory is :func:`labkit.decode.explore_buckets`'s model
    with its default bytes per row.
    """
    gen = torch.Generator().manual_seed(6)
    parts = [torch.randint(18, 29, (300,), generator=gen),
             torch.randint(52, 65, (120,), generator=gen),
             torch.randint(1, 5, (30,), generator=gen)]
    trace = torch.cat(parts)[torch.randperm(450, generator=gen)].tolist()
    return {"batch_sizes": trace, "max_bs": 64, "budget_bytes": int(5.5 * 2**20),
            "max_waste": 0.08}


_BUDGET_HINTS = [
    "Run explore_buckets(max_bs, batch_sizes, scheme) for the broken config and for the "
    "named schemes, and read both memory columns: which one of the two faults costs more?",
    "Look at where the trace's batch sizes fall (a histogram, or sorted(set(batch_sizes))): "
    "buckets are cheap where no batch lands and padding is expensive where many do. A few "
    "buckets just at or above the busy sizes, plus max_bs for the peaks, and one shared pool.",
    "For example {'buckets': [4, 20, 24, 28, 56, 64], 'shared_pool': True}: 6 graphs, "
    "about 5.1 MiB, 5.4% padding.",
]


def check_fixed_config(fn, *, quiet: bool = False, time_limit: float = 10.0) -> CheckResult:
    """``fn()`` returns ``{"buckets": [...], "shared_pool": bool}`` for
    :func:`budget_scenario`'s server. It passes when, judged by
    :func:`labkit.decode.explore_buckets` on the scenario's trace:

    * the buckets are a sorted list of distinct ints in ``1..max_bs``;
    * no batch of the trace is larger than the largest bucket;
    * the graphs' memory (the shared-pool or the pool-per-graph figure, as chosen) fits
      the budget;
    * the padding waste is at most ``max_waste``.

    Any configuration that meets all four passes: there is no single answer.
    """
    name = "fixed_config"
    sc = budget_scenario()
    trace, max_bs, budget, max_waste = (sc["batch_sizes"], sc["max_bs"], sc["budget_bytes"],
                                        sc["max_waste"])

    def failed(message):
        return fail(name, message, more_hints=_BUDGET_HINTS, quiet=quiet)

    if not callable(fn):
        return failed(f"expected a function, got {type(fn).__name__}")
    try:
        cfg = call_learner(fn, time_limit=time_limit)
    except NotImplementedError:
        return fail(name, NOT_DONE, kind="not_implemented", quiet=quiet)
    except LearnerTimeout as exc:
        return fail(name, str(exc), kind="timeout", quiet=quiet)
    except Exception as exc:  # noqa: BLE001
        return fail(name, f"your code raised {describe_exception(exc)}", kind="exception",
                    more_hints=_BUDGET_HINTS, quiet=quiet)
    if not isinstance(cfg, dict) or set(cfg) != {"buckets", "shared_pool"}:
        got = sorted(cfg) if isinstance(cfg, dict) else type(cfg).__name__
        return failed(f"return a dict with exactly the keys 'buckets' and 'shared_pool', "
                      f"got {got}")
    shared = cfg["shared_pool"]
    if not isinstance(shared, bool):
        return failed(f"'shared_pool' must be True or False, got {shared!r}")
    raw = cfg["buckets"]
    if isinstance(raw, str):
        if raw not in ("sglang", "every", "pow2", "disable_padding"):
            return failed(f"'buckets' is {raw!r}: give a list of sizes, or one of 'sglang', "
                          "'every', 'pow2'")
        buckets = make_buckets(max_bs, raw)
    else:
        got, why = _as_int_list(raw)
        if why:
            return failed(f"'buckets': {why}")
        if not got:
            return failed("'buckets' is empty: no batch would have a graph")
        if got != sorted(set(got)):
            return failed(f"'buckets' {_short(got)} must be sorted ascending without repeats "
                          "(pad_to_bucket bisects it)")
        if got[0] < 1 or got[-1] > max_bs:
            bad = got[0] if got[0] < 1 else got[-1]
            return failed(f"bucket {bad} is outside 1..max_bs={max_bs}: the static buffers are "
                          f"sized by max_bs, so the largest graph is {max_bs} rows")
        buckets = got
    rep = explore_buckets(max_bs, trace, buckets)
    mem = rep.memory_bytes if shared else rep.memory_bytes_separate_pools
    mib = mem / 2**20
    where = (f"buckets {_short(buckets)}, {'one shared pool' if shared else 'a pool per graph'}: "
             f"{rep.num_graphs} graphs, {mib:.2f} MiB, padding waste "
             f"{100 * rep.padding_waste:.1f}%, {rep.oversize_batches} oversize steps")
    if rep.oversize_batches:
        big = sorted({b for b in trace if b > buckets[-1]})
        return failed(f"{where}.\n   {rep.oversize_batches} steps of the trace have more "
                      f"requests than your largest bucket ({buckets[-1]}; e.g. {big[:4]}): they "
                      "would raise or run eagerly. The peaks need a graph too")
    if mem > budget:
        if not shared and rep.memory_bytes <= budget:
            return failed(f"{where}, over the {budget / 2**20:.1f} MiB budget.\n   With a pool "
                          "per graph every graph keeps its own activation memory; the same "
                          f"graphs in one pool, captured largest first, need "
                          f"{rep.memory_bytes / 2**20:.2f} MiB. Which pool layout does the "
                          "lesson's runner use?")
        if shared:
            return failed(f"{where}, over the {budget / 2**20:.1f} MiB budget.\n   In one shared "
                          "pool the largest graph's activations are paid once, but every graph "
                          f"keeps its output and a fixed overhead alive: {rep.num_graphs} graphs "
                          "are too many (or too large) for this budget. Which of them does the "
                          "trace actually need?")
        return failed(f"{where}, over the {budget / 2**20:.1f} MiB budget.\n   Two things cost "
                      "memory here: a pool per graph keeps every graph's activations, and "
                      f"{rep.num_graphs} graphs each keep an output and a fixed overhead. "
                      "Compare the two memory columns of explore_buckets, then count your graphs")
    if rep.padding_waste > max_waste:
        return failed(f"{where}.\n   Within budget, but {100 * rep.padding_waste:.1f}% of the "
                      f"computed rows are padding (the limit is {100 * max_waste:.0f}%): some "
                      "busy batch sizes are padded a long way up. Look at where the trace's "
                      "batch sizes fall and put buckets there")
    return passed(name, f"{where}: within {budget / 2**20:.1f} MiB and "
                        f"{100 * max_waste:.0f}% waste", quiet=quiet)
