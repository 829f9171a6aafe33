"""Lesson 05 checkers: the reference passes; real learner mistakes are rejected with a
message that names the mistake (issue 10 §1, issue 11: string ops, malformed schedules)."""

from __future__ import annotations

import pytest

from labkit.checks.lesson05 import (
    check_create_in_order,
    check_one_f_one_b,
    check_pool_hazards,
    reference_pool_hazards,
)
from labkit.pipeline import schedule as S
from labkit.pipeline.record import create_in_order, reorder

# ---- one_f_one_b ---------------------------------------------------------------------------


def ofob(*, warm=lambda P, M, s: min(P - s - 1, M), backward_first=False,
         cooldown_newest_first=False, cooldown=True, one_based=False, as_str=False,
         steady_newest=False, as_lists=False):
    """The reference schedule with one learner mistake switched on."""

    def fn(P, M):
        orders = []
        for s in range(P):
            w = warm(P, M, s)
            order = [("F", m) for m in range(w)]
            for i in range(max(M - w, 0)):
                # steady_newest: the backward of the microbatch just run, not the oldest
                pair = [("F", w + i), ("B", w + i if steady_newest else i)]
                order += pair[::-1] if backward_first else pair
            tail = [("B", m) for m in (range(w) if steady_newest
                                       else range(max(M - w, 0), M))]
            if cooldown_newest_first:
                tail = tail[::-1]
            if cooldown:
                order += tail
            if one_based:
                order = [(k, m + 1) for k, m in order]
            if as_str:
                order = [f"{k}{m}" for k, m in order]
            if as_lists:
                order = [[k, m] for k, m in order]
            orders.append(order)
        return orders

    return fn


def _ofob_iterators(P, M):
    """A tester's correct answer: iterators over forwards and backwards."""
    res = []
    for s in range(P):
        warm = min(P - s - 1, M)
        fwd, bwd, order = iter(range(M)), iter(range(M)), []
        order += [("F", next(fwd)) for _ in range(warm)]
        for _ in range(M - warm):
            order += [("F", next(fwd)), ("B", next(bwd))]
        order += [("B", m) for m in bwd]
        res.append(order)
    return res


def _ofob_warmup_m_minus_1(P, M):
    """Warm-up min(P - s - 1, M - 1): the same orders (with M forwards in warm-up, the
    last one moves into the steady phase and is still followed by B0)."""
    res = []
    for s in range(P):
        warm = min(P - s - 1, M - 1)
        order = [("F", m) for m in range(warm)]
        for k in range(M - warm):
            order += [("F", warm + k), ("B", k)]
        order += [("B", m) for m in range(M - warm, M)]
        res.append(order)
    return res


def test_one_f_one_b_accepts_the_reference(capsys):
    assert check_one_f_one_b(S.one_f_one_b)
    assert check_one_f_one_b(ofob())
    assert check_one_f_one_b(_ofob_iterators, quiet=True)
    assert check_one_f_one_b(_ofob_warmup_m_minus_1, quiet=True)
    np = pytest.importorskip("numpy")                   # numpy ints are ints too
    assert check_one_f_one_b(lambda P, M: [[(k, np.int64(m)) for k, m in o]
                                           for o in ofob()(P, M)])
    assert capsys.readouterr().out.count("✅ one_f_one_b") == 3


@pytest.mark.parametrize("fn, words", [
    (S.gpipe, "That is GPipe"),
    (ofob(warm=lambda P, M, s: min(P - s, M)), "It runs 5 forwards before its first backward"),
    (ofob(warm=lambda P, M, s: P - s - 1), "there is no microbatch 1 when M=1"),
    (ofob(warm=lambda P, M, s: min(s, M)), "It runs 1 forwards before its first backward"),
    (ofob(backward_first=True), "Your warm-up is right (3 forwards), but then B0 comes"),
    (ofob(cooldown_newest_first=True), "The backwards are out of order in the cooldown"),
    (ofob(cooldown=False), "Microbatch 5 has 1 forward(s) and 0 backward(s)"),
    (ofob(one_based=True), "there is no microbatch 8 when M=8"),
    (ofob(as_str=True), "is the string 'F0'"),
    (ofob(as_lists=True), "is the list ['F', 0]; ops are tuples"),
    (ofob(steady_newest=True), "out of order in the steady phase: op 4 is B3"),
    (lambda P, M: ofob()(P, M)[0], "returned one flat list"),
    (lambda P, M: {s: o for s, o in enumerate(ofob()(P, M))}, "returned a dict"),
    (lambda P, M: [[("F", m), ("B", m)] for m in range(M)] * 0 or None, "did you forget"),
    (lambda P, M: [[("F", 0, 1)]] * P, "expected a pair like ('F', 0)"),
    (lambda P, M: [[("f", m) for m in range(M)]] * P, "has kind 'f'"),
])
def test_one_f_one_b_rejects_learner_mistakes(fn, words):
    res = check_one_f_one_b(fn, quiet=True)
    assert not res
    assert words in res.message, res.message
    assert "Traceback" not in res.message


def test_one_f_one_b_right_warmup_wrong_cooldown_is_told_the_cooldown():
    """The bug of issue 10: a correct warm-up was reported as wrong."""

    def wrong_cooldown(P, M):
        orders = S.one_f_one_b(P, M)
        for o in orders:                  # swap the last two backwards where there are two
            if len(o) >= 2 and o[-1][0] == o[-2][0] == "B":
                o[-1], o[-2] = o[-2], o[-1]
        return orders

    res = check_one_f_one_b(wrong_cooldown, quiet=True)
    assert not res and "out of order in the cooldown" in res.message, res.message
    assert "warm" not in res.message.lower()

    def steady_then_extra_forward(P, M):
        orders = S.one_f_one_b(P, M)
        o = orders[0]
        if P > 1 and M > P:                # last forward pushed into the cooldown
            i = o.index(("F", M - 1))
            f = o.pop(i)
            o.insert(i + 1, f)
        return orders

    res = check_one_f_one_b(steady_then_extra_forward, quiet=True)
    assert not res and "steady phase goes wrong" in res.message, res.message
    assert "expected F7 there" in res.message


def test_one_f_one_b_steady_phase_error_is_not_placed_in_the_cooldown():
    res = check_one_f_one_b(ofob(steady_newest=True), quiet=True)
    assert "in the cooldown" not in res.message and "steady phase" in res.message
    assert "oldest microbatch still in flight then is 0" in res.message


def test_one_f_one_b_string_ops_do_not_print_identical_orders():
    res = check_one_f_one_b(ofob(as_str=True), quiet=True)
    assert "ops are tuples (kind, microbatch) like ('F', 0)" in res.message
    assert "expected F0" not in res.message


def test_one_f_one_b_malformed_never_crashes():
    for bad in (lambda P, M: 42, lambda P, M: [None] * P, lambda P, M: [[1, 2]] * P,
                lambda P, M: [[("F", "0")]] * P, lambda P, M: [[("F", True)]] * P):
        res = check_one_f_one_b(bad, quiet=True)
        assert not res and res.kind == "mismatch", res.message


def test_one_f_one_b_not_done():
    def blank(P, M):
        raise NotImplementedError()

    res = check_one_f_one_b(blank, quiet=True)
    assert not res and res.kind == "not_implemented"


# ---- create_in_order ------------------------------------------------------------------------


def _create_unpacking(entries):
    """A tester's correct answer: star-unpacking each entry."""
    for runner, what, *rest in entries:
        if what == "bwd":
            runner.create_bwd_graph()
        else:
            runner.create_fwd_graph(*rest)


def test_create_in_order_accepts_the_reference(B, one_thread):
    assert check_create_in_order(create_in_order, B=B, quiet=True)
    assert check_create_in_order(_create_unpacking, B=B, quiet=True)


def _fwd_then_bwd_sorted(entries):
    create_in_order(sorted(entries, key=lambda e: e[1] != "fwd"))


def _skip_backwards(entries):
    for e in entries:
        if e[1] == "fwd":
            e[0].create_fwd_graph(e[2])


def _whole_entry_as_args(entries):
    for e in entries:
        if e[1] == "fwd":
            e[0].create_fwd_graph(e)
        else:
            e[0].create_bwd_graph()


def _fresh_pools(B):
    def create(entries):           # "a pool per runner, to be safe"
        for e in entries:
            if e[1] == "fwd":
                e[0].pool = B.graph_pool_handle()
        create_in_order(entries)
    return create


def test_create_in_order_rejects_a_pool_per_runner(B, one_thread):
    res = check_create_in_order(_fresh_pools(B), B=B, quiet=True)
    assert not res
    assert "a pool of their own" in res.message and "the one shared pool" in res.message


def _twice(entries):
    create_in_order(entries)
    create_in_order(entries[:1])


@pytest.mark.parametrize("fn, words", [
    (lambda e: create_in_order(reorder(e, "grouped")), "in step 1"),
    (lambda e: create_in_order(reorder(e, "torch")), "in step 1"),
    (lambda e: create_in_order(list(reversed(e))), "raised"),
    (_fwd_then_bwd_sorted, "in step 1"),
    (_skip_backwards, "every runner needs both"),
    (_whole_entry_as_args, "entry[2] is the argument metadata"),
    (_twice, "created twice"),
])
def test_create_in_order_rejects_learner_mistakes(B, one_thread, fn, words):
    res = check_create_in_order(fn, B=B, quiet=True)
    assert not res and words in res.message, res.message
    # the process is usable afterwards: a capture and a random op work
    assert check_create_in_order(create_in_order, B=B, quiet=True)


# ---- pool_hazards (diagnosis) ------------------------------------------------------------------


def _runner(e):
    return e.split(" ", 1)[1]


def ph(*, only_after=False, only_before=False, swap_lists=False, unbounded=False,
       any_out_of_order=False, culprits_only=False, victim_name=False, inclusive=False):
    def fn(created, replayed):
        if swap_lists:
            created, replayed = replayed, created
        if any_out_of_order:
            out = []
            for i, a in enumerate(replayed):
                for b in replayed[i + 1:]:
                    if created.index(a) > created.index(b) and a.startswith("bwd"):
                        out.append((a, b))
            return out
        out = []
        for e in replayed:
            if not e.startswith("fwd"):
                continue
            r = _runner(e)
            b = f"bwd {r}"
            i, j = replayed.index(e), replayed.index(b)
            between = replayed[i + 1:] if unbounded else replayed[i + 1:j]
            cf, cb = created.index(e), created.index(b)
            for x in between:
                if x == b:
                    continue
                cx = created.index(x)
                if only_after:
                    bad = cx > cb
                elif only_before:
                    bad = cx < cf
                elif inclusive:
                    bad = not cf <= cx <= cb
                else:
                    bad = not cf < cx < cb
                if bad:
                    out.append((r if victim_name else b, x))
        if culprits_only:
            return [x for _, x in out]
        return out

    return fn


def _hazards_by_index(created, replayed):
    """A tester's correct answer: creation positions looked up with list.index."""
    res = []
    for i, f in enumerate(replayed):
        if f.split()[0] != "fwd":
            continue
        b = "bwd " + f.split(" ", 1)[1]
        j = replayed.index(b)
        lo, hi = created.index(f), created.index(b)
        res += [(b, x) for x in replayed[i + 1:j] if not lo < created.index(x) < hi]
    return res


def test_pool_hazards_accepts_the_reference(capsys):
    assert check_pool_hazards(_hazards_by_index, quiet=True)
    assert check_pool_hazards(reference_pool_hazards)
    assert check_pool_hazards(ph())
    assert check_pool_hazards(lambda c, r: set(reference_pool_hazards(c, r)))
    assert capsys.readouterr().out.count("✅ pool_hazards") == 3


@pytest.mark.parametrize("fn, words", [
    (ph(only_after=True), "you missed ('bwd layer0#0', 'fwd layer1#0')"),
    (ph(only_before=True), "was created after"),
    (ph(swap_lists=True), "you missed"),
    (ph(unbounded=True), "does not replay between"),
    (ph(any_out_of_order=True), "does not replay between"),
    (ph(culprits_only=True), "is not a pair of entry strings"),
    (ph(victim_name=True), "the first item of a pair is the backward graph"),
    (lambda c, r: [(_runner(b), _runner(x)) for b, x in reference_pool_hazards(c, r)],
     "runner names"),
    (lambda c, r: reference_pool_hazards(c, r) * 2, "appear twice"),
    (lambda c, r: None, "did you forget `return`"),
])
def test_pool_hazards_rejects_learner_mistakes(fn, words):
    res = check_pool_hazards(fn, quiet=True)
    assert not res and words in res.message, res.message
    if words != "appear twice":
        assert "appear twice" not in res.message


def test_pool_hazards_matches_what_training_shows():
    """The rule's verdict agrees with lesson 05's runs: the recorded order has no hazard;
    "grouped" (wrong in the notebook for PP=1 and PP=2) has some."""
    rec = ["fwd layer0#0", "fwd layer1#0", "bwd layer1#0", "bwd layer0#0"]
    assert reference_pool_hazards(rec, rec) == []
    grouped = ["fwd layer0#0", "bwd layer0#0", "fwd layer1#0", "bwd layer1#0"]
    assert ("bwd layer0#0", "fwd layer1#0") in reference_pool_hazards(grouped, rec)


def test_endless_loops_get_a_verdict():
    def forever(*args):
        while True:
            pass

    res = check_one_f_one_b(forever, quiet=True, time_limit=0.3)
    assert not res and res.kind == "timeout" and "did not finish" in res.message
    res = check_pool_hazards(forever, quiet=True, time_limit=0.3)
    assert not res and res.kind == "timeout"


def test_hints_come_one_at_a_time(capsys):
    import labkit.checks as lc

    res = check_one_f_one_b(S.gpipe, quiet=True)
    assert "w = min(P - s - 1, M)" not in res.message      # not the answer first
    capsys.readouterr()
    assert lc.hint() is None
    first = capsys.readouterr().out
    lc.hint()
    second = capsys.readouterr().out
    assert first.startswith("hint 1 of 3") and second.startswith("hint 2 of 3")
    assert "w = min(P - s - 1, M)" in second
