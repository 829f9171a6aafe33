"""Checkers for lesson 05 (1F1B ordered capture), against :mod:`labkit.pipeline`.

* ``one_f_one_b(P, M) -> list[list[tuple[str, int]]]``: each stage's 1F1B order, as
  ``("F", m)`` / ``("B", m)`` pairs.
* ``create_in_order(entries) -> None``: create the graph of every record entry
  (``(runner, "fwd", arg_metas)`` → ``runner.create_fwd_graph(arg_metas)``,
  ``(runner, "bwd")`` → ``runner.create_bwd_graph()``) so that graphs sharing one pool are
  safe; checked by training a small two-stage pipeline and comparing with eager.
* ``pool_hazards(created, replayed) -> list[tuple[str, str]]`` (a diagnosis exercise):
  which backward graphs may read activations that another graph overwrote, given the
  order the graphs were created in one shared pool and the order they replay in.

A failure names the mistake it saw and where to look; ``labkit.checks.hint()`` then gives
further hints, one at a time.
"""

from __future__ import annotations

import numbers
import random

import torch

from labkit.backend import recover as _recover
from labkit.checks import NOT_DONE, CheckResult, LearnerTimeout, call_learner, describe_exception
from labkit.checks import verdict as _result
from labkit.pipeline import schedule as S

__all__ = ["check_one_f_one_b", "check_create_in_order", "check_pool_hazards"]

# ---- one_f_one_b ---------------------------------------------------------------------------------

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
        return _result(name, False, f"expected a function, got {type(fn).__name__}",
                       quiet=quiet)
    cases = [(4, 8), (3, 2), (1, 3), (2, 5), (5, 5), (4, 1)]
    rng = random.Random(5)
    while len(cases) < trials:
        cases.append((rng.randint(1, 6), rng.randint(1, 10)))
    for t, (P, M) in enumerate(cases[:trials]):
        try:
            out = call_learner(fn, P, M, time_limit=time_limit)
        except NotImplementedError:
            return _result(name, False, NOT_DONE,
                           kind="not_implemented", quiet=quiet)
        except LearnerTimeout as exc:
            return _result(name, False, f"for P={P}, M={M}: {exc}", kind="timeout",
                           more_hints=_1F1B_HINTS, quiet=quiet)
        except Exception as exc:  # noqa: BLE001 - reported to the learner
            return _result(name, False, f"for P={P}, M={M}: your code raised "
                           f"{describe_exception(exc)}", kind="exception",
                           more_hints=_1F1B_HINTS, quiet=quiet)
        orders, bad = _validate_orders(out, P, M)
        if bad:
            return _result(name, False, f"for P={P}, M={M}: {bad}", more_hints=_1F1B_HINTS,
                           quiet=quiet)
        for s, (e, a) in enumerate(zip(S.one_f_one_b(P, M), orders)):
            reason = _diagnose_stage(P, M, s, e, a)
            if reason:
                return _result(name, False, reason, more_hints=_1F1B_HINTS, quiet=quiet)
    return _result(name, True, f"passed {trials} schedules (M > P, M < P, one stage, one "
                   "microbatch, random)", trials=trials, quiet=quiet)


# ---- create_in_order -----------------------------------------------------------------------------

_CIO_HINTS = [
    "Graphs that share one pool must be created in the order they will replay. Which list "
    "already holds that order?",
    "Loop over `entries` as given; for a 'fwd' entry call entry[0].create_fwd_graph(entry[2]), "
    "for a 'bwd' entry entry[0].create_bwd_graph().",
]


def _pipeline_run(B, create, *, graphs: bool, steps: int = 2, P: int = 2, M: int = 2):
    from labkit.core.models import make_blocks
    from labkit.pipeline.record import GlobalRecord
    from labkit.pipeline.runner import graph_layers
    from labkit.pipeline.step import split_stages, train_step

    layers = make_blocks(2 * P, seed=0, hidden=16, heads=2, ffn=32, device=B.device)
    record = GlobalRecord()
    calls = graph_layers(layers, B, record, reuse=False, num_warmup=1) if graphs \
        else list(layers)
    stages = split_stages(calls, P)
    g = torch.Generator().manual_seed(3)
    opt = torch.optim.SGD(layers.parameters(), lr=0.1)
    for _ in range(steps):
        batch = [(torch.randn(2, 4, 16, generator=g).to(B.device),
                  torch.randn(2, 4, 16, generator=g).to(B.device)) for _ in range(M)]
        opt.zero_grad()
        xs, ts = zip(*batch)
        train_step(stages, xs, ts, record=record if graphs else None, B=B,
                   create_graphs={"create": create} if graphs else None)
        opt.step()
    return [p.detach().clone() for p in layers.parameters()], calls


def check_create_in_order(fn, *, B=None, quiet: bool = False) -> CheckResult:
    """``fn(entries)`` must create every entry's graph so that a two-stage 1F1B pipeline
    trained through the graphs ends equal to eager training.

    Args:
        fn: the learner's ``create_in_order``.
        B: the backend (default ``backend.get("auto")``).
        quiet: return the :class:`CheckResult` without printing it.

    .. warning::
        A wrong order can still train correctly by luck of the allocator; the check
        therefore compares the creation order with the record first, then the result.
    """
    from labkit import backend

    B = backend.ensure(B)
    name = "create_in_order"
    if not callable(fn):
        return _result(name, False, f"expected a function, got {type(fn).__name__}",
                       quiet=quiet)

    def fail(msg, kind="mismatch"):
        return _result(name, False, msg, kind=kind, more_hints=_CIO_HINTS, quiet=quiet)

    created: list[str] = []
    watched: set[int] = set()
    own_pool: list[str] = []      # graphs created in a pool other than the shared one

    def wrapped(entries):
        recorded = [f"{e[1]} {e[0].name}" for e in entries]
        shared = entries[0][0].pool if entries else None    # set by create_cudagraphs
        for e in entries:                     # watch the order the learner creates in
            r = e[0]
            if id(r) not in watched:
                watched.add(id(r))
                fwd, bwd = r.create_fwd_graph, r.create_bwd_graph

                def f(args, r=r, fwd=fwd):
                    created.append(f"fwd {r.name}")
                    if r.pool is None or r.pool != shared:
                        own_pool.append(f"fwd {r.name}")
                    return fwd(args)

                def b(r=r, bwd=bwd):
                    created.append(f"bwd {r.name}")
                    if r.pool is None or r.pool != shared:
                        own_pool.append(f"bwd {r.name}")
                    return bwd()

                r.create_fwd_graph, r.create_bwd_graph = f, b
        wrapped.recorded = recorded
        return call_learner(fn, entries)

    try:
        got, calls = _pipeline_run(B, wrapped, graphs=True)
    except NotImplementedError:
        return _result(name, False, NOT_DONE,
                       kind="not_implemented", quiet=quiet)
    except LearnerTimeout as exc:
        _recover(B)
        return fail(str(exc), kind="timeout")
    except Exception as exc:  # noqa: BLE001 - reported to the learner
        _recover(B)
        text = str(exc)
        recorded = getattr(wrapped, "recorded", [])
        if "already exists" in text:
            why = ("a graph was created twice: each entry stands for one graph; create "
                   "each exactly once")
        elif ("forward graph" in text or "create the forward graph first" in text
              or "has not been created" in text or "no backward graph" in text):
            why = ("a backward graph can only be created after its runner's forward graph, "
                   "and every runner needs both before the pipeline can replay")
        elif isinstance(exc, (TypeError, AttributeError, IndexError)):
            why = ("an entry is a tuple: entry[0] is the runner, entry[1] 'fwd' or 'bwd', "
                   "and a 'fwd' entry's entry[2] is the argument metadata to pass to "
                   "create_fwd_graph")
        else:
            why = "see the line above"
        return fail(f"training through your graphs raised {describe_exception(exc)}\n"
                    f"   what to look at: {why}"
                    + (f" (you created {len(created)} of {len(recorded)} graphs)"
                       if recorded else ""), kind="exception")
    recorded = getattr(wrapped, "recorded", [])
    if sorted(created) != sorted(recorded):
        missing = sorted(set(recorded) - set(created))
        return fail(f"you created {len(created)} graphs; the record has {len(recorded)} "
                    f"entries" + (f" (not created: {missing[:3]}"
                                  f"{' ...' if len(missing) > 3 else ''})" if missing else "")
                    + ". Create exactly one graph per entry")
    if own_pool:
        runners = sorted({e.split(" ", 1)[1] for e in own_pool})
        return fail(f"you gave {len(runners)} runners a pool of their own (runner.pool was "
                    f"changed before their graphs were created: {own_pool[:3]}"
                    f"{' ...' if len(own_pool) > 3 else ''}). The exercise creates every graph "
                    "in the one shared pool that runner.pool already holds. A pool per graph "
                    "is safe in any order, but each graph then keeps its own memory (lesson "
                    "05 §4 measures it): sharing is the point, and the creation order is "
                    "what makes it safe. Leave runner.pool as it is")
    if created != recorded:
        i = next(k for k, (a, b) in enumerate(zip(created, recorded)) if a != b)
        return fail(f"graph {i + 1} you created is '{created[i]}', but in step 1 "
                    f"'{recorded[i]}' ran at that point. Graphs sharing a pool reuse each "
                    "other's freed blocks in creation order, so any other order lets a "
                    "replay overwrite activations a later backward still needs: do not "
                    "group, sort or reverse the entries")
    ref, _ = _pipeline_run(B, None, graphs=False)
    worst = max((a - b).abs().max().item() for a, b in zip(got, ref))
    if worst > 1e-4:
        return fail(f"the parameters differ from eager training by up to {worst:.3g}, "
                    "although the creation order is right: look at what else your loop does")
    return _result(name, True, f"{len(created)} graphs created in recorded order; the "
                   "pipeline trains exactly like eager", trials=1, quiet=quiet)


# ---- pool_hazards (diagnosis) -----------------------------------------------------------------

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
        return _result(name, False, f"expected a function, got {type(fn).__name__}",
                       quiet=quiet)

    def failed(msg, kind="mismatch"):
        return _result(name, False, msg, kind=kind, more_hints=_PH_HINTS, quiet=quiet)

    for t, (created, replayed) in enumerate(_hazard_cases(trials)):
        case = f"created {created}, replayed {replayed}"
        try:
            got = call_learner(fn, list(created), list(replayed), time_limit=time_limit)
        except NotImplementedError:
            return _result(name, False, NOT_DONE,
                           kind="not_implemented", quiet=quiet)
        except LearnerTimeout as exc:
            return failed(f"case {t + 1}: {exc}", kind="timeout")
        except Exception as exc:  # noqa: BLE001 - reported to the learner
            return failed(f"case {t + 1} ({case}): your code raised "
                          f"{describe_exception(exc)}", kind="exception")
        if got is None:
            return failed("returned None (did you forget `return`?); return a list of "
                          "(bwd entry, culprit entry) pairs, empty when nothing is at risk")
        try:
            pairs = [tuple(p) for p in got]
        except TypeError:
            return failed(f"returned a {type(got).__name__}; expected a list of pairs")
        if any(len(p) != 2 or not all(isinstance(x, str) for x in p) for p in pairs):
            bad = next(p for p in pairs if len(p) != 2 or not all(isinstance(x, str)
                                                                   for x in p))
            return failed(f"case {t + 1}: {bad!r} is not a pair of entry strings; each pair "
                          "is (the backward graph at risk, the graph that may overwrite its "
                          "activations), e.g. ('bwd layer0#0', 'fwd layer1#0')")
        entries = set(created) | set(replayed)
        runners = {_runner_of(e) for e in entries}
        if pairs and all(x not in entries for p in pairs for x in p) and \
                all(x in runners for p in pairs for x in p):
            return failed(f"case {t + 1}: your pairs hold runner names ({pairs[0]!r}), not "
                          "entries: each item is one of the entry strings of the two lists, "
                          "like ('bwd layer0#0', 'fwd layer1#0'). A runner has two graphs, "
                          "and they are different culprits (its forward and its backward "
                          "replay at different times and were created at different times)")
        if any(not b.startswith("bwd ") for b, _ in pairs):
            b = next(b for b, _ in pairs if not b.startswith("bwd "))
            return failed(f"case {t + 1}: the first item of a pair is the backward graph at "
                          f"risk ('bwd R'), got {b!r}")
        if len(pairs) != len(set(pairs)):
            return failed(f"case {t + 1}: some pairs appear twice in {pairs}; report each "
                          "once")
        want = set(reference_pool_hazards(created, replayed))
        have = set(pairs)
        if have == want:
            continue
        extra, missing = sorted(have - want), sorted(want - have)
        if extra:
            b, x = extra[0]
            r = _runner_of(b)
            i_f, i_b = replayed.index(f"fwd {r}"), replayed.index(b)
            if x not in replayed[i_f + 1:i_b]:
                return failed(f"case {t + 1} ({case}): you report {(b, x)}, but {x!r} does "
                              f"not replay between 'fwd {r}' and {b!r}, so it cannot "
                              "overwrite what that backward is about to read")
            return failed(f"case {t + 1} ({case}): you report {(b, x)}, but {x!r} was "
                          f"created after 'fwd {r}' and before {b!r}: while it was captured, "
                          f"{r}'s activations were still held, so the pool could not give "
                          "it their memory")
        b, x = missing[0]
        r = _runner_of(b)
        when = ("after" if created.index(x) > created.index(b) else "before")
        return failed(f"case {t + 1} ({case}): you missed {(b, x)}: {x!r} replays between "
                      f"'fwd {r}' and {b!r} and was created {when} "
                      + (f"{b!r}, when {r}'s activations were back in the pool"
                         if when == "after" else
                         f"'fwd {r}': the scratch memory it freed could become {r}'s "
                         "activations"))
    return _result(name, True, f"passed {trials} cases (same order, created after the "
                   "backward, created before the forward, random orders)", trials=trials,
                   quiet=quiet)
