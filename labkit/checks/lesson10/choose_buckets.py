"""Lesson 10, exercise ``choose_buckets``: its checker.

``choose_buckets(traffic, max_bs, graph_bytes, budget_bytes) -> list[int]`` (a diagnosis
exercise): given a server's traffic histogram ``{batch size: decode steps}``, the graph
memory each bucket would cost and the budget for all graphs, return the buckets to
capture. The pass criterion, on every trial (the lesson's server and seeded random ones):

1. a list (or tuple) of ints, sorted ascending, no repeats, each in ``1..max_bs``;
2. ``max_bs`` is in it: the server admits up to ``max_bs`` requests, and a batch larger
   than the largest bucket has no graph (it raises, or runs eagerly);
3. the buckets' ``graph_bytes`` add up to at most ``budget_bytes``;
4. its padding waste (padded rows / computed rows over the traffic) is at most the best
   achievable within the budget plus :data:`SLACK` (one percentage point). The best is
   computed exactly (:func:`~labkit.checks.lesson10.buckets.best_buckets`, dynamic
   programming); the slack lets a good heuristic pass (the reference's greedy "most padded
   rows saved per byte" is within 0.8 points of the best on every scenario the tests draw).

Every rule broken is named, not only the first.
"""

from __future__ import annotations

import bisect

from labkit.checks import (
    CheckResult,
    Exercise,
    attempt,
    describe_exception,
    reject,
)
from labkit.checks.lesson06._common import _as_int_list, _short
from labkit.checks.lesson10.buckets import (
    MIB,
    Scenario,
    best_buckets,
    lesson_scenario,
    make_scenario,
    score,
)

__all__ = ["check_choose_buckets", "trials", "SLACK", "judge"]

NAME = "choose_buckets"
#: how much more padding waste than the best achievable still passes (a share: 1 point)
SLACK = 0.01

_HINTS = [
    "Three numbers decide it: the memory of your list (the sum of graph_bytes over your "
    "buckets) against budget_bytes, max_bs in the list, and the padded rows: a step of s "
    "requests replays the smallest bucket >= s (bisect_left) and computes bucket - s rows "
    "for nothing. Score a candidate list with those three before returning it.",
    "A greedy that works: start from [max_bs] (it must be there) and, while some bucket "
    "still fits the budget and saves padded rows, add the one that saves the most padded "
    "rows per byte of graph_bytes.",
    "For example:\n"
    "    buckets, spent = [max_bs], graph_bytes[max_bs]\n"
    "    def padded(bl): return sum(n * (bl[bisect.bisect_left(bl, s)] - s)"
    " for s, n in traffic.items())\n"
    "    while True: pick b not in buckets with spent + graph_bytes[b] <= budget_bytes that "
    "maximizes (padded(buckets) - padded(sorted(buckets + [b]))) / graph_bytes[b]; stop when "
    "none saves anything; else add it.",
]

EXERCISE = Exercise(NAME, more_hints=tuple(_HINTS))


def trials() -> list[tuple[str, Scenario]]:
    """The scenarios every learner's function is run on: the lesson's server, three seeded
    random ones, and a tight budget where only ``max_bs`` and one more bucket fit."""
    out = [("the lesson's server", lesson_scenario())]
    out += [(f"random server {k}", make_scenario(k)) for k in (1, 2, 3)]
    sc = make_scenario(4, max_bs=32)
    gb = sc.graph_bytes
    tight = Scenario(sc.traffic, sc.max_bs, gb, gb[sc.max_bs] + gb[sc.max_bs // 2])
    out.append(("a tight budget", tight))
    return out


def _where(label: str, sc: Scenario) -> str:
    steps = sum(sc.traffic.values())
    return (f"{label} (max_bs {sc.max_bs}, budget {sc.budget_bytes / MIB:.0f} MiB, "
            f"{steps} decode steps)")


def _structure(raw, max_bs: int) -> tuple[list[int] | None, list[str]]:
    """The list as ints and what is wrong with its form (type, order, repeats, range)."""
    if isinstance(raw, dict):
        return None, ["the return value: got a dict: return the bucket sizes themselves, a "
                      "sorted list of ints"]
    got, why = _as_int_list(raw)
    if why:
        return None, [f"the return value: {why}"]
    if not got:
        return None, ["the list is empty: no batch would have a graph (max_bs at least)"]
    problems = []
    if got != sorted(got):
        i = next(k for k in range(1, len(got)) if got[k] < got[k - 1])
        problems.append(f"not sorted ascending: {got[i - 1]} comes before {got[i]} "
                        "(the runner bisects this list, and bisect on an unsorted list picks "
                        "a wrong bucket without an error)")
    dups = sorted({b for b in got if got.count(b) > 1})
    if dups:
        problems.append(f"repeated bucket(s) {dups}: each would be captured twice, paying "
                        "its memory twice")
    bad = [b for b in got if not 1 <= b <= max_bs]
    if bad:
        problems.append(f"bucket(s) {bad} outside 1..max_bs={max_bs}: the static buffers have "
                        f"max_bs rows, so no graph can be larger (and none smaller than 1)")
    return got, problems


def judge(sc: Scenario, raw) -> tuple[bool, str]:
    """Judge one returned value on one scenario: ``(passed, what is wrong / the score)``."""
    got, problems = _structure(raw, sc.max_bs)
    if got is None:
        return False, problems[0]
    buckets = sorted({b for b in got if 1 <= b <= sc.max_bs})
    mem = sum(sc.graph_bytes[b] for b in got if 1 <= b <= sc.max_bs)
    if sc.max_bs not in buckets:
        top = buckets[-1] if buckets else 0
        orphan = sum(n for s, n in sc.traffic.items() if s > top)
        problems.append(f"max_bs={sc.max_bs} is missing: batches of {top + 1}..{sc.max_bs} "
                        f"requests have no bucket that fits ({orphan} decode steps of this "
                        "traffic; and the server admits up to max_bs requests, so any step "
                        "may need it)")
    if mem > sc.budget_bytes:
        costly = sorted(set(got) & set(sc.graph_bytes), key=lambda b: -sc.graph_bytes[b])[:3]
        big = ", ".join(f"{b}: {sc.graph_bytes[b] / MIB:.0f}" for b in costly)
        problems.append(f"over budget: {mem / MIB:.0f} MiB of graphs (the sum of graph_bytes "
                        f"over your buckets) > {sc.budget_bytes / MIB:.0f} MiB "
                        f"(largest: {big} MiB)")
    if problems:
        return False, "; ".join(problems)
    mine, best = score(sc, buckets), score(sc, best_buckets(sc))
    text = (f"{_short(buckets)}: {mine.memory_bytes / MIB:.0f} of {sc.budget_bytes / MIB:.0f} "
            f"MiB, padding waste {100 * mine.waste:.1f}% (best achievable "
            f"{100 * best.waste:.1f}%)")
    if mine.waste > best.waste + SLACK:
        worst = max(sc.traffic, key=lambda s: sc.traffic[s] *
                    (buckets[bisect.bisect_left(buckets, s)] - s))
        pad = buckets[bisect.bisect_left(buckets, worst)] - worst
        return False, (f"wasteful: {text}, more than {100 * SLACK:.0f} point above the best "
                       f"within the budget. The most padded rows come from batches of "
                       f"{worst} ({sc.traffic[worst]} steps, {pad} padded rows each): spend "
                       "the budget where the traffic is")
    return True, text


def _answer(fn, label: str, sc: Scenario, time_limit: float):
    """``fn``'s answer on ``sc``, under ``time_limit``; an error names the trial (a
    timeout says how long it ran, the stub is :data:`~labkit.checks.NOT_DONE`)."""
    where = _where(label, sc)
    return attempt(fn, sc.args(), time_limit=time_limit,
                   reason=lambda exc: f"{where}: your code raised {describe_exception(exc)}")


def check_choose_buckets(fn, *, quiet: bool = False, time_limit: float = 10.0) -> CheckResult:
    """Run ``fn(traffic, max_bs, graph_bytes, budget_bytes)`` on every scenario of
    :func:`trials` and judge each answer by the module's criterion (see its docstring).
    Passes when every trial passes."""

    def body() -> str:
        if not callable(fn):
            reject(f"expected a function, got {type(fn).__name__}")
        texts = []
        for label, sc in trials():
            ok, text = judge(sc, _answer(fn, label, sc, time_limit))
            if not ok:
                reject(f"{_where(label, sc)}: {text}")
            texts.append(text)
        return (f"{len(texts)} servers, each within its budget and within "
                f"{100 * SLACK:.0f} point of the least padding; the lesson's server: "
                f"{texts[0]}")

    return EXERCISE.run(body, quiet=quiet)
