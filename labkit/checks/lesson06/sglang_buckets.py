"""Lesson 06, exercise ``sglang_buckets``: its checker.

``sglang_buckets(max_bs) -> list[int]``: SGLang's default capture list,
``[1, 2, 4, 8, 12] + range(16, 257, 8) + range(272, 512, 16) + range(512, max_bs + 1, 32)``
clipped to ``max_bs``, with ``max_bs`` itself always in, sorted, no duplicates.
Reference: :func:`labkit.decode.default_buckets`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from labkit.checks import CheckResult, Exercise
from labkit.checks.lesson06._common import _as_int_list, _short
from labkit.decode import default_buckets

__all__ = ["check_sglang_buckets"]


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


EXERCISE = Exercise("sglang_buckets", more_hints=tuple(_SGLANG_HINTS))


class _Case(NamedTuple):
    """A trial's max_bs and the right list (what the reference returns)."""

    max_bs: int
    buckets: list


def _reference(max_bs: int) -> _Case:
    return _Case(max_bs, default_buckets(max_bs))


def _make_inputs(gen: torch.Generator):
    trial = gen.initial_seed()
    return (_MAX_BS_CASES.get(trial) or int(torch.randint(1, 1100, (), generator=gen)),)


def _a_list(expected: _Case, actual) -> str | None:
    _, why = _as_int_list(actual)
    return f"sglang_buckets({expected.max_bs}): {why}" if why else None


def _the_buckets(expected: _Case, actual) -> str | None:
    """The list, and when wrong, which rule of the formula it breaks."""
    max_bs, want = expected
    got, _ = _as_int_list(actual)
    if got == want:
        return None
    head = f"sglang_buckets({max_bs}) returned {_short(got)}, expected {_short(want)}"
    too_big = sorted(x for x in set(got) if x > max_bs)
    missing = sorted(set(want) - set(got))
    extra = sorted(set(got) - set(want))
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


def check_sglang_buckets(fn, *, trials: int = 7) -> CheckResult:
    """``fn(max_bs)`` must return :func:`labkit.decode.default_buckets` ``(max_bs)``."""
    return EXERCISE.check(fn, _reference, _make_inputs, trials=trials,
                          judges=(_a_list, _the_buckets))
