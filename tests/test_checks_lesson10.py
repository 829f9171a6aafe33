"""Lesson 10's checker: each real learner mistake is rejected with a message that names it
(every rule broken, when several are), the reference and the exact optimum pass, and the
optimum is checked against brute force on random small servers."""

import itertools

import numpy as np
import pytest
import torch

from labkit.checks.lesson10 import (
    SLACK,
    Scenario,
    best_buckets,
    check_choose_buckets,
    judge,
    lesson_scenario,
    make_scenario,
    score,
    trials,
)
from labkit.checks.lesson10.buckets import MIB, reference_choose_buckets


def run(fn):
    return check_choose_buckets(fn, quiet=True)


def optimum(t, m, g, b):
    return best_buckets(Scenario(t, m, g, b))


def test_reference_and_optimum_pass():
    r = run(reference_choose_buckets)
    assert r, r.message
    assert "5 servers" in r.message and "the lesson's server" in r.message
    assert run(optimum)


def test_a_tuple_and_numpy_ints_pass():
    assert run(lambda *a: tuple(reference_choose_buckets(*a)))
    assert run(lambda *a: [np.int64(b) for b in reference_choose_buckets(*a)])


@pytest.mark.parametrize("fn, words", [
    # the powers of two fit the budget but pad the busy sizes a long way up
    (lambda t, m, g, b: [1, 2, 4, 8, 16, 32, 64][:[1, 2, 4, 8, 16, 32, 64].index(m) + 1]
     if m in (32, 64) else [1, 2, 4, 8, 16, 32, m],
     ["wasteful", "padding waste 25.1%", "best achievable 5.6%", "batches of 46"]),
    (lambda t, m, g, b: [m], ["wasteful", "[64]", "55.9%"]),
    (lambda t, m, g, b: sorted(reference_choose_buckets(t, m, g, b), reverse=True),
     ["not sorted ascending", "64 comes before"]),
    (lambda t, m, g, b: reference_choose_buckets(t, m, g, b) + [m], ["repeated bucket(s) [64]"]),
    (lambda t, m, g, b: reference_choose_buckets(t, m, g, b)[:-1], ["max_bs=64 is missing",
                                                                    "batches of 53..64"]),
    (lambda t, m, g, b: reference_choose_buckets(t, m, g, b)[:-1] + [m + 1],
     ["outside 1..max_bs=64", "max_bs=64 is missing"]),
    (lambda t, m, g, b: [0] + reference_choose_buckets(t, m, g, b), ["[0] outside 1..max_bs"]),
    (lambda t, m, g, b: list(range(1, m + 1)), ["over budget", "> 42 MiB"]),
    (lambda t, m, g, b: sorted(t), ["over budget"]),
    (lambda t, m, g, b: set(reference_choose_buckets(t, m, g, b)), ["got a set"]),
    (lambda t, m, g, b: None, ["got None", "return"]),
    (lambda t, m, g, b: {s: s for s in reference_choose_buckets(t, m, g, b)}, ["got a dict"]),
    (lambda t, m, g, b: [float(x) for x in reference_choose_buckets(t, m, g, b)],
     ["expected a list of ints", "float"]),
    (lambda t, m, g, b: "1,2,4,64", ["expected a list of ints, got str"]),
    (lambda t, m, g, b: [], ["empty"]),
    (lambda t, m, g, b: torch.tensor(reference_choose_buckets(t, m, g, b))[:-1],
     ["max_bs=64 is missing"]),
])
def test_mistakes_are_named(fn, words):
    r = run(fn)
    assert not r
    for w in words:
        assert w in r.message, (w, r.message)


def test_two_rules_broken_at_once_are_both_named():
    # every size, largest first: not sorted and over budget
    r = run(lambda t, m, g, b: list(range(m, 0, -1)))
    assert not r
    assert "not sorted ascending" in r.message and "over budget" in r.message
    # repeated and missing max_bs
    r = run(lambda t, m, g, b: [1, 1, 8])
    assert "repeated bucket(s) [1]" in r.message and "max_bs=64 is missing" in r.message


def _greedy(t, m, g, b, *, start_spent, cumulative=True):
    """The reference's greedy with one slip in its budget arithmetic."""
    import bisect
    buckets, spent = [m], start_spent

    def padded(bl):
        return sum(n * (bl[bisect.bisect_left(bl, s)] - s) for s, n in t.items())
    while True:
        now, best = padded(buckets), None
        for x in range(1, m):
            if x in buckets or (spent if cumulative else 0) + g[x] > b:
                continue
            saved = now - padded(sorted(buckets + [x]))
            if saved > 0 and (best is None or saved / g[x] > best[0]):
                best = (saved / g[x], x)
        if best is None:
            return buckets
        buckets = sorted(buckets + [best[1]])
        spent += g[best[1]]


def test_budget_slips_are_caught():
    # each bucket checked against the whole budget, not what is left of it
    r = run(lambda t, m, g, b: _greedy(t, m, g, b, start_spent=g[m], cumulative=False))
    assert not r and "over budget" in r.message
    # max_bs's own memory left out of the sum: over budget by about one graph
    r = run(lambda t, m, g, b: _greedy(t, m, g, b, start_spent=0))
    assert not r and "over budget" in r.message, r.message


def test_learner_errors_and_stub():
    def boom(t, m, g, b):
        return t[10_000]
    r = run(boom)
    assert not r and "your code raised" in r.message and "KeyError" in r.message

    def stub(t, m, g, b):
        raise NotImplementedError()
    r = run(stub)
    assert not r and r.kind == "not_implemented"
    r = run("buckets")
    assert not r and "expected a function, got str" in r.message


def test_trials_are_fixed_and_feasible():
    labels = [lab for lab, _ in trials()]
    assert labels == ["the lesson's server", "random server 1", "random server 2",
                      "random server 3", "a tight budget"]
    for _, sc in trials():
        best = best_buckets(sc)
        assert sc.max_bs in best and score(sc, best).memory_bytes <= sc.budget_bytes
    tight = trials()[-1][1]
    assert len(best_buckets(tight)) <= 2


@pytest.mark.parametrize("seed", range(20))
def test_reference_within_slack_of_the_optimum_on_random_servers(seed):
    sc = make_scenario(seed)
    ref, best = reference_choose_buckets(*sc.args()), best_buckets(sc)
    s_ref, s_best = score(sc, ref), score(sc, best)
    assert s_best.memory_bytes <= sc.budget_bytes and s_ref.memory_bytes <= sc.budget_bytes
    assert s_best.computed_rows <= s_ref.computed_rows
    assert s_ref.waste <= s_best.waste + SLACK
    assert judge(sc, ref)[0] and judge(sc, best)[0]


@pytest.mark.parametrize("seed", range(12))
def test_optimum_matches_brute_force_on_small_servers(seed):
    gen = torch.Generator().manual_seed(seed)
    m = int(torch.randint(4, 10, (1,), generator=gen))
    traffic = {s: int(n) for s, n in zip(range(1, m + 1),
                                          torch.randint(0, 20, (m,), generator=gen)) if n}
    graph_bytes = {b: int(1 + b % 3 + b // 2) * MIB for b in range(1, m + 1)}
    budget = graph_bytes[m] + int(torch.randint(0, 12, (1,), generator=gen)) * MIB
    sc = Scenario(traffic, m, graph_bytes, budget)
    best = score(sc, best_buckets(sc)).computed_rows
    brute = min(score(sc, sorted(set(c) | {m})).computed_rows
                for k in range(m) for c in itertools.combinations(range(1, m), k)
                if score(sc, sorted(set(c) | {m})).memory_bytes <= budget)
    assert best == brute


def test_best_buckets_refuses_a_budget_below_max_bs():
    sc = lesson_scenario()
    bad = Scenario(sc.traffic, sc.max_bs, sc.graph_bytes, sc.graph_bytes[sc.max_bs] - MIB)
    with pytest.raises(ValueError, match="cannot hold the bucket max_bs=64"):
        best_buckets(bad)
    odd = Scenario(sc.traffic, sc.max_bs, {**sc.graph_bytes, 3: MIB + 1}, sc.budget_bytes)
    with pytest.raises(ValueError, match="not a whole number"):
        best_buckets(odd)
