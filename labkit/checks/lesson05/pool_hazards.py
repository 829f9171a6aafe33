"""Lesson 05, exercise ``pool_hazards``: its checker.

``pool_hazards(created, replayed) -> list[tuple[str, str]]`` (a diagnosis exercise):
which backward graphs may read activations that another graph overwrote, given the
order the graphs were created in one shared pool and the order they replay in.
"""

from __future__ import annotations

import random

from labkit.checks import CheckResult, attempt, describe_exception, fail, reject, run_check

__all__ = ["check_pool_hazards", "reference_pool_hazards"]


def _runner_of(entry: str) -> str:
    return entry.split(" ", 1)[1]


def reference_pool_hazards(created, replayed) -> list[tuple[str, str]]:
    """The pairs ``(bwd entry, culprit entry)``: the backward graph of runner R, and a graph
    X of another runner that replays between R's forward and R's backward although it was
    not created between them, so that it may have been given R's activations' memory
    (created after R's backward: R's activations were back in the pool) or R's forward may
    have been given X's scratch memory (X created before R's forward)."""
    pos_c = {e: i for i, e in enumerate(created)}
    pos_r = {e: i for i, e in enumerate(replayed)}
    out = []
    for e in replayed:
        if not e.startswith("fwd "):
            continue
        r = _runner_of(e)
        f, b = e, f"bwd {r}"
        if b not in pos_r:
            continue
        for x in replayed[pos_r[f] + 1:pos_r[b]]:
            if not pos_c[f] < pos_c[x] < pos_c[b]:
                out.append((b, x))
    return out


_PH_HINTS = [
    "R's activations are written by 'fwd R' and read by 'bwd R'. Which replays run in "
    "between? Those are the only graphs that could overwrite them in time to matter.",
    "While R's activations were held (from creating 'fwd R' to creating 'bwd R') the pool "
    "could not hand them to anyone. A graph created inside that window is safe; one created "
    "before or after it is not.",
    "For each runner R: for each x replayed strictly between 'fwd R' and 'bwd R', report "
    "('bwd R', x) unless created.index('fwd R') < created.index(x) < created.index('bwd R').",
]


def _random_orders(rng: random.Random, n_runners: int):
    """A replay order in which each runner's fwd comes before its bwd, and a creation order
    that is the replay order with a few entries moved (or regrouped)."""
    names = [f"layer{i // 2}#{i % 2}" if n_runners > 2 else f"layer{i}#0"
             for i in range(n_runners)]
    replayed, open_ = [], []
    todo = list(names)
    while todo or open_:
        if todo and (not open_ or rng.random() < 0.55):
            r = todo.pop(0)
            replayed.append(f"fwd {r}")
            open_.append(r)
        else:
            r = open_.pop(0 if rng.random() < 0.5 else -1)
            replayed.append(f"bwd {r}")
    how = rng.choice(("grouped", "torch", "shuffle", "same"))
    fwds = [e for e in replayed if e.startswith("fwd")]
    if how == "grouped":
        created = [x for f in fwds for x in (f, f"bwd {_runner_of(f)}")]
    elif how == "torch":
        created = fwds + [f"bwd {_runner_of(f)}" for f in reversed(fwds)]
    elif how == "shuffle":
        created = list(replayed)
        for _ in range(2):
            i = rng.randrange(len(created))
            e = created.pop(i)
            created.insert(rng.randrange(len(created) + 1), e)
        for r in names:                              # keep each fwd before its bwd
            i, j = created.index(f"fwd {r}"), created.index(f"bwd {r}")
            if i > j:
                created[i], created[j] = created[j], created[i]
    else:
        created = list(replayed)
    return created, replayed


def _hazard_cases(trials: int):
    grouped_c = ["fwd layer0#0", "bwd layer0#0", "fwd layer1#0", "bwd layer1#0"]
    replay = ["fwd layer0#0", "fwd layer1#0", "bwd layer1#0", "bwd layer0#0"]
    before_c = ["fwd layer1#0", "fwd layer0#0", "bwd layer0#0", "bwd layer1#0"]
    cases = [(list(replay), list(replay)),      # created as replayed: no hazard
             (grouped_c, replay),               # created after bwd: hazard
             (before_c, replay)]                # created before fwd: hazard too
    rng = random.Random(11)
    while len(cases) < trials:
        cases.append(_random_orders(rng, rng.randint(2, 5)))
    return cases[:trials]


def _no(msg: str) -> None:
    reject(msg, hints=_PH_HINTS)


def _one_case(fn, t: int, created: list, replayed: list, time_limit: float) -> None:
    """Case ``t`` (0-based): the learner's pairs for these two orders, judged."""
    case = f"created {created}, replayed {replayed}"
    got = attempt(fn, (list(created), list(replayed)), time_limit=time_limit,
                  label=f"case {t + 1}", label_errors=False, hints=_PH_HINTS,
                  reason=lambda exc, case=case, t=t: f"case {t + 1} ({case}): your "
                  f"code raised {describe_exception(exc)}")
    if got is None:
        _no("returned None (did you forget `return`?); return a list of "
            "(bwd entry, culprit entry) pairs, empty when nothing is at risk")
    try:
        pairs = [tuple(p) for p in got]
    except TypeError:
        _no(f"returned a {type(got).__name__}; expected a list of pairs")
    if any(len(p) != 2 or not all(isinstance(x, str) for x in p) for p in pairs):
        bad = next(p for p in pairs if len(p) != 2 or not all(isinstance(x, str)
                                                               for x in p))
        _no(f"case {t + 1}: {bad!r} is not a pair of entry strings; each pair "
            "is (the backward graph at risk, the graph that may overwrite its "
            "activations), e.g. ('bwd layer0#0', 'fwd layer1#0')")
    entries = set(created) | set(replayed)
    runners = {_runner_of(e) for e in entries}
    if pairs and all(x not in entries for p in pairs for x in p) and \
            all(x in runners for p in pairs for x in p):
        _no(f"case {t + 1}: your pairs hold runner names ({pairs[0]!r}), not "
            "entries: each item is one of the entry strings of the two lists, "
            "like ('bwd layer0#0', 'fwd layer1#0'). A runner has two graphs, "
            "and they are different culprits (its forward and its backward "
            "replay at different times and were created at different times)")
    if any(not b.startswith("bwd ") for b, _ in pairs):
        b = next(b for b, _ in pairs if not b.startswith("bwd "))
        _no(f"case {t + 1}: the first item of a pair is the backward graph at "
            f"risk ('bwd R'), got {b!r}")
    if len(pairs) != len(set(pairs)):
        _no(f"case {t + 1}: some pairs appear twice in {pairs}; report each "
            "once")
    want = set(reference_pool_hazards(created, replayed))
    have = set(pairs)
    if have == want:
        return
    extra, missing = sorted(have - want), sorted(want - have)
    if extra:
        b, x = extra[0]
        r = _runner_of(b)
        i_f, i_b = replayed.index(f"fwd {r}"), replayed.index(b)
        if x not in replayed[i_f + 1:i_b]:
            _no(f"case {t + 1} ({case}): you report {(b, x)}, but {x!r} does "
                f"not replay between 'fwd {r}' and {b!r}, so it cannot "
                "overwrite what that backward is about to read")
        _no(f"case {t + 1} ({case}): you report {(b, x)}, but {x!r} was "
            f"created after 'fwd {r}' and before {b!r}: while it was captured, "
            f"{r}'s activations were still held, so the pool could not give "
            "it their memory")
    b, x = missing[0]
    r = _runner_of(b)
    when = ("after" if created.index(x) > created.index(b) else "before")
    _no(f"case {t + 1} ({case}): you missed {(b, x)}: {x!r} replays between "
        f"'fwd {r}' and {b!r} and was created {when} "
        + (f"{b!r}, when {r}'s activations were back in the pool"
           if when == "after" else
           f"'fwd {r}': the scratch memory it freed could become {r}'s "
           "activations"))


def check_pool_hazards(fn, *, trials: int = 10, quiet: bool = False,
                       time_limit: float = 10.0) -> CheckResult:
    """``fn(created, replayed)`` must return every ``(bwd entry, culprit entry)`` pair of
    :func:`reference_pool_hazards` (any order, each pair once).

    Args:
        fn: the learner's ``pool_hazards``.
        trials: how many order pairs to try (the first three are fixed cases).
        quiet: return the :class:`CheckResult` without printing it.
        time_limit: seconds one call of ``fn`` may take.
    """
    name = "pool_hazards"
    if not callable(fn):
        return fail(name, f"expected a function, got {type(fn).__name__}", quiet=quiet)

    def body() -> str:
        for t, (created, replayed) in enumerate(_hazard_cases(trials)):
            _one_case(fn, t, created, replayed, time_limit)
        return (f"passed {trials} cases (same order, created after the backward, created "
                "before the forward, random orders)")

    return run_check(name, body, quiet=quiet, trials=trials)
