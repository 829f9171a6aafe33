"""Lesson 06, exercise ``pad_to_bucket``: its checker.

``pad_to_bucket(raw_bs, buckets) -> int``: the smallest bucket ``>= raw_bs``, found with
the ``bisect`` module; a batch larger than the largest bucket raises a ``ValueError``
(:class:`~labkit.decode.BatchTooLargeError`) whose message names the batch size and the
largest bucket. Reference: :func:`labkit.decode.pad_to_bucket`.
"""

from __future__ import annotations

import bisect
import math
import re
from collections.abc import Callable
from typing import NamedTuple

import torch

from labkit.checks import CheckResult, describe_exception, fail, outcome, reject, run_check
from labkit.checks.lesson06._common import _short
from labkit.core.validate import is_int
from labkit.decode import make_buckets
from labkit.decode import pad_to_bucket as _pad_to_bucket

__all__ = ["check_pad_to_bucket"]


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


class _Spy:
    """What both spies share: ``_saved`` holds ``(owner, name, real)`` for every name they
    rebound (``owner`` a module or a globals dict); leaving the ``with`` puts them back."""

    def __init__(self, fn):
        self._fn = fn
        self._saved: list[tuple[dict | object, str, object]] = []

    def __exit__(self, *exc):
        for owner, name, real in reversed(self._saved):
            if isinstance(owner, dict):
                owner[name] = real
            else:
                setattr(owner, name, real)
        return False


class _BisectSpy(_Spy):
    """Counts calls of the ``bisect`` functions while the learner's code runs: the module's
    attributes and any name in the learner's globals bound to one of them
    (``from bisect import bisect_left``)."""

    _NAMES = ("bisect_left", "bisect_right", "bisect", "insort", "insort_left",
              "insort_right")

    def __init__(self, fn):
        super().__init__(fn)
        self.calls: list[str] = []

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


class _AnswerKeySpy(_Spy):
    """Counts calls of labkit's own ``pad_to_bucket`` (the answer key) while the learner's
    code runs: as ``labkit.decode.pad_to_bucket``, through its defining module, or as a
    name in the learner's globals (``from labkit.decode import pad_to_bucket``)."""

    def __init__(self, fn):
        super().__init__(fn)
        self.calls = 0

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


class _Trial(NamedTuple):
    """One trial: its lists, the learner's answer per size, and the sizes answered
    without bisect. ``no(message, **details)`` rejects it, naming the trial."""

    no: Callable[..., None]
    buckets: list[int]
    raws: list[int]
    shown: str
    results: dict          # raw -> ("value", v) | ("raised", exc)
    no_bisect: list        # in-range sizes answered without bisect (scan / many reads)


def _answers(fn, trial: int, trials: int, time_limit: float) -> _Trial:
    """Ask ``fn`` about every size of trial ``trial``, watching bisect, the answer key
    and the list's reads; reject a call of the answer key or a changed list."""
    def no(message: str, **details) -> None:
        reject(f"trial {trial} of {trials}: {message}", hints=_PAD_HINTS,
               trials=trial - 1, failed_trial=trial, details=details)

    gen = torch.Generator().manual_seed(trial)
    buckets, raws = _pad_inputs(trial, gen)
    top, shown = buckets[-1], _short(buckets, 8)
    results, no_bisect = {}, []
    for raw in raws:
        probe = _ProbedBuckets(buckets)
        with _BisectSpy(fn) as spy, _AnswerKeySpy(fn) as key:
            results[raw] = outcome(fn, (raw, probe), time_limit=time_limit,
                                   label=f"trial {trial} of {trials}: pad_to_bucket({raw}, "
                                         f"{shown})", hints=_PAD_HINTS,
                                   trials=trial - 1, failed_trial=trial, details={})
        if key.calls:
            no(f"pad_to_bucket({raw}, {shown}) called labkit.decode.pad_to_bucket, labkit's "
               "own answer: the exercise asks you to write the search yourself, with the "
               "bisect module (what labkit's function does inside is what you are "
               "practising)")
        if list.__eq__(probe, buckets) is not True:
            no(f"pad_to_bucket({raw}, {shown}) changed the list to "
               f"{_short(list(probe), 8)}: the bucket list belongs to the runner, read it "
               "only (no sort, append or insort)")
        if raw <= top and not spy.calls:
            bound = math.ceil(math.log2(len(buckets) + 1)) + 3
            if probe.scans or probe.reads > bound:
                no_bisect.append((raw, probe.scans, probe.reads))
    return _Trial(no, buckets, raws, shown, results, no_bisect)


def _in_range(t: _Trial) -> None:
    """Sizes that fit a bucket: the pattern of wrong answers over the whole trial."""
    no, buckets, shown, results = t.no, t.buckets, t.shown, t.results
    top = buckets[-1]
    in_range = [r for r in t.raws if r <= top]
    raised = [r for r in in_range if results[r][0] == "raised"]
    wrong = []
    for raw in in_range:
        kind, v = results[raw]
        e = _pad_to_bucket(raw, buckets)
        if kind == "value" and not is_int(v):
            hint = " (did you forget `return`?)" if v is None else ""
            no(f"pad_to_bucket({raw}, {shown}) returned {v!r}, expected the int {e}{hint}")
        if kind == "value" and v != e:
            wrong.append((raw, int(v), e))
    if _is_bisect_right(wrong, raised, buckets):
        raw = wrong[0][0] if wrong else top
        got = wrong[0][1] if wrong else describe_exception(results[top][1]).split("\n")[0]
        none = " (and the largest bucket's own size finds none)" if top in raised else ""
        no(f"pad_to_bucket({raw}, {shown}) gave {got}, expected {raw}: a batch of {raw} fits "
           f"the bucket {raw} exactly, yet every size equal to a bucket goes one bucket "
           f"further{none}. That is what bisect_right does; section 2 says which bisect "
           "gives the first bucket >= raw_bs")
    if raised:
        raw = raised[0]
        no(f"pad_to_bucket({raw}, {shown}) raised {describe_exception(results[raw][1])}\n"
           f"   but {raw} fits the bucket {_pad_to_bucket(raw, buckets)}: only a batch larger "
           f"than the largest bucket ({top}) has no graph")
    if wrong:
        no(_classify_wrong_buckets(wrong, buckets, shown),
           expected={r: e for r, _, e in wrong}, actual={r: v for r, v, _ in wrong})


def _oversize(t: _Trial) -> None:
    """Oversize batches: a ValueError that names the batch size and the largest bucket."""
    no, top = t.no, t.buckets[-1]
    for raw in [r for r in t.raws if r > top]:
        kind, v = t.results[raw]
        call = f"pad_to_bucket({raw}, {t.shown})"
        if kind == "value":
            no(f"{call} returned {v!r}, but {raw} is larger than the largest bucket ({top}): "
               "no graph can run it. Raise BatchTooLargeError instead; returning a bucket "
               "would silently drop requests")
        text = str(v)
        if isinstance(v, ValueError) and "empty sequence" in text:
            no(f"{call} raised {type(v).__name__}: {text}\n   That error comes from "
               "min()/max() over an empty generator, not from a check of yours: its message "
               "does not tell the caller that the batch is too large. And the exercise asks "
               "for bisect: the list is sorted, so a binary search finds the bucket without "
               "scanning it")
        if not isinstance(v, ValueError):
            what = ("an index one past the end of the list (buckets[i] with "
                    "i == len(buckets))" if isinstance(v, IndexError) else
                    "an error of the wrong type")
            no(f"{call} raised {describe_exception(v)}\n   That is {what}. A batch larger "
               "than the largest bucket must raise BatchTooLargeError (a ValueError) that "
               "says so")
        if not (_mentions(text, raw) and _mentions(text, top)):
            no(f"{call} raised {type(v).__name__}({text!r}).\n   The type is right, but the "
               f"message must name the batch size ({raw}) and the largest bucket ({top}): "
               "the person who reads it has to know what to change")


def _bisected(t: _Trial) -> None:
    """Bisect, as the text asks: no scan, a few reads."""
    if not t.no_bisect:
        return
    raw, scans, reads = t.no_bisect[-1]
    how = ("walked the whole list (a for loop, a generator in min()/next(), sorted() or "
           "list())" if scans else
           f"read the list entry by entry ({reads} reads of a list of {len(t.buckets)})")
    t.no(f"the answers are right, but pad_to_bucket({raw}, {t.shown}) {how} instead of using "
         "the bisect module. The list is sorted: a binary search needs about "
         f"{math.ceil(math.log2(len(t.buckets) + 1))} reads, and this runs before every "
         "replay")


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

    def body() -> str:
        for trial in range(1, trials + 1):
            t = _answers(fn, trial, trials, time_limit)
            _in_range(t)
            _oversize(t)
            _bisected(t)
        return f"passed {trials} random trials"

    return run_check(name, body, quiet=quiet, trials=trials)


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
