"""Lesson 05, exercise ``one_f_one_b``: its checker.

``one_f_one_b(P, M) -> list[list[tuple[str, int]]]``: each stage's 1F1B order, as
``("F", m)`` / ``("B", m)`` pairs.
"""

from __future__ import annotations

import numbers
import random

from labkit.checks import CheckResult, attempt, fail, reject, run_check
from labkit.pipeline import schedule as S

__all__ = ["check_one_f_one_b"]


_1F1B_HINTS = [
    "Build each stage's order in three parts: the warm-up forwards, the steady pairs, the "
    "cooldown backwards. Check each part on P=2, M=3 against the example in the exercise.",
    "Warm-up: w = min(P - s - 1, M) forwards F0..F(w-1). Steady: M - w pairs, each the "
    "forward of the next microbatch then the backward of the oldest one in flight.",
    "Steady pair i is (F(w + i), B(i)); the cooldown is B(M - w) .. B(M - 1).",
]


def _show(order, upto=None) -> str:
    ops = [f"{k}{m}" for k, m in order]
    if upto is not None and upto < len(ops):
        ops = ops[:upto + 1] + (["..."] if upto + 1 < len(ops) else [])
    return " ".join(ops)


def _validate_orders(out, P: int, M: int):
    """(orders as lists of (kind, m), None) or (None, what is malformed)."""
    if out is None:
        return None, "returned None (did you forget `return`?)"
    if isinstance(out, (str, bytes, dict)) or not hasattr(out, "__len__"):
        return None, (f"returned a {type(out).__name__}; expected a list of {P} stage orders "
                      "(one list of ops per stage)")
    out = list(out)
    if out and isinstance(out[0], (tuple, str)) and P != len(out):
        return None, (f"returned one flat list of {len(out)} ops; expected a list of {P} "
                      "stage orders, one list per stage (a list of lists)")
    if len(out) != P:
        return None, f"returned {len(out)} stage orders, expected {P} (one per stage)"
    orders = []
    for s, stage in enumerate(out):
        if isinstance(stage, (str, bytes)) or not hasattr(stage, "__iter__"):
            return None, (f"stage {s}'s order is a {type(stage).__name__}; expected a list of "
                          "ops like ('F', 0)")
        ops = []
        for i, op in enumerate(stage):
            if isinstance(op, str):
                return None, (f"stage {s}, op {i} is the string {op!r}; ops are tuples "
                              f"(kind, microbatch) like ('F', 0), so that the microbatch is "
                              "a number")
            if isinstance(op, list) and len(op) == 2:
                return None, (f"stage {s}, op {i} is the list {op!r}; ops are tuples, like "
                              f"{tuple(op)!r}, as the exercise asks: in Python "
                              f"{op!r} == {tuple(op)!r} is False, so code that looks an op "
                              "up in a schedule (op in order, order.index(op)) would not "
                              "find it. Write (kind, m), not [kind, m]")
            if not isinstance(op, tuple) or len(op) != 2:
                return None, (f"stage {s}, op {i} is {op!r}; expected a pair like ('F', 0) "
                              "or ('B', 0)")
            kind, m = op
            if kind not in ("F", "B"):
                return None, (f"stage {s}, op {i} has kind {kind!r}; the kind is the string "
                              "'F' (forward) or 'B' (backward)")
            if isinstance(m, bool) or not isinstance(m, numbers.Integral):
                return None, (f"stage {s}, op {i} has microbatch {m!r} (a "
                              f"{type(m).__name__}); microbatches are ints 0..M-1")
            if not 0 <= m < M:
                return None, (f"stage {s}, op {i} is ({kind!r}, {m}): there is no microbatch "
                              f"{m} when M={M} (they are 0..{M - 1})"
                              + ("; with fewer microbatches than stages the warm-up is "
                                 "capped at M" if M < P and m >= M else ""))
            ops.append((kind, int(m)))
        orders.append(ops)
    return orders, None


def _diagnose_stage(P, M, s, e, a) -> str | None:
    if a == e:
        return None
    head = f"for P={P}, M={M}, stage {s}: your order is {_show(a)}. "
    if a == S.gpipe(P, M)[s]:
        return head + ("That is GPipe (all forwards, then all backwards): it holds all M "
                       "microbatches' activations at once. 1F1B starts backwards as soon as "
                       "the pipe is full")
    for m in range(M):
        nf, nb = a.count(("F", m)), a.count(("B", m))
        if nf != 1 or nb != 1:
            return head + (f"Microbatch {m} has {nf} forward(s) and {nb} backward(s); every "
                           "microbatch needs exactly one of each per stage"
                           + (" (the cooldown runs the backwards still owed)"
                              if nb == 0 else ""))
        if a.index(("B", m)) < a.index(("F", m)):
            return head + f"B{m} comes before F{m}: a backward needs its forward first"
    fs, bs = [m for k, m in a if k == "F"], [m for k, m in a if k == "B"]
    if fs != sorted(fs):
        return head + "The forwards are out of order: they run microbatches 0, 1, 2, ..."
    if bs != sorted(bs):
        b_pos = [i for i, (k, _) in enumerate(a) if k == "B"]
        j = next(j for j in range(len(bs)) if bs[j] != j)     # the first one out of place
        last_f = max((i for i, (k, _) in enumerate(a) if k == "F"), default=-1)
        phase = "cooldown" if b_pos[j] > last_f else "steady phase"
        return head + (f"The backwards are out of order in the {phase}: op {b_pos[j]} is "
                       f"B{bs[j]}, but the oldest microbatch still in flight then is {j}. Each "
                       "backward is that of the oldest microbatch still in flight, so they "
                       "run 0, 1, 2, ...")
    w = S.num_warmup_microbatches(P, M, s)
    nf = next(i for i, (k, _) in enumerate(a) if k == "B")      # forwards before the 1st B
    want = min(w + 1, M)
    if nf != want:
        if nf == w:
            return head + (f"Your warm-up is right ({w} forwards), but then B0 comes "
                           "straight away: each steady step is a forward (the next "
                           "microbatch) and then a backward, so one more forward runs before "
                           f"B0 ({want} in all)")
        return head + (f"It runs {nf} forwards before its first backward. Stage {s} warms up "
                       f"with w = min(P - s - 1, M) = {w} forwards, then the steady phase "
                       f"opens with one more forward, so B0 comes after {want} forwards")
    i = next(i for i, (x, y) in enumerate(zip(a, e)) if x != y)
    last_f = max(j for j, (k, _) in enumerate(e) if k == "F")
    kind_e, m_e = e[i]
    where = f"op {i} ({_show(a, i)})"
    if i <= last_f:
        return head + (f"The warm-up is right; at {where} the steady phase goes wrong: "
                       f"expected {kind_e}{m_e} there. In the steady phase forwards and "
                       "backwards alternate, one forward then one backward (of the oldest "
                       "microbatch in flight)")
    return head + (f"The warm-up and the steady phase are right; at {where} the cooldown "
                   f"goes wrong: expected {kind_e}{m_e} there. Once every forward has run, "
                   "only the backwards still owed remain, oldest first")


def check_one_f_one_b(fn, *, trials: int = 8, quiet: bool = False,
                      time_limit: float = 10.0) -> CheckResult:
    """``fn(P, M)`` must return the 1F1B order of every stage (see
    :func:`labkit.pipeline.schedule.one_f_one_b`). Trials include more microbatches than
    stages, fewer, a single stage and a single microbatch, then random sizes.

    Args:
        fn: the learner's ``one_f_one_b``.
        trials: how many ``(P, M)`` cases to try.
        quiet: return the :class:`CheckResult` without printing it.
        time_limit: seconds one call of ``fn`` may take.

    .. warning::
        The forwards before a stage's first backward are its warm-up *plus* the steady
        phase's opening forward (``min(P - s, M)`` in all), not the warm-up alone.
    """
    name = "one_f_one_b"
    if not callable(fn):
        return fail(name, f"expected a function, got {type(fn).__name__}", quiet=quiet)
    cases = [(4, 8), (3, 2), (1, 3), (2, 5), (5, 5), (4, 1)]
    rng = random.Random(5)
    while len(cases) < trials:
        cases.append((rng.randint(1, 6), rng.randint(1, 10)))

    def body() -> str:
        for P, M in cases[:trials]:
            where = f"for P={P}, M={M}"
            out = attempt(fn, (P, M), time_limit=time_limit, label=where, hints=_1F1B_HINTS)
            orders, bad = _validate_orders(out, P, M)
            if bad:
                reject(f"{where}: {bad}", hints=_1F1B_HINTS)
            for s, (e, a) in enumerate(zip(S.one_f_one_b(P, M), orders)):
                reason = _diagnose_stage(P, M, s, e, a)
                if reason:
                    reject(reason, hints=_1F1B_HINTS)
        return (f"passed {trials} schedules (M > P, M < P, one stage, one microbatch, "
                "random)")

    return run_check(name, body, quiet=quiet, trials=trials)
