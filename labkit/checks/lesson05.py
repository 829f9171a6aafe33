"""Checkers for lesson 05 (1F1B ordered capture), against :mod:`labkit.pipeline`.

* ``one_f_one_b(P, M) -> list[list[tuple[str, int]]]``: each stage's 1F1B order, as
  ``("F", m)`` / ``("B", m)`` pairs.
* ``create_in_order(entries) -> None``: create the graph of every record entry
  (``(runner, "fwd", arg_metas)`` → ``runner.create_fwd_graph(arg_metas)``,
  ``(runner, "bwd")`` → ``runner.create_bwd_graph()``) so that graphs sharing one pool are
  safe; checked by training a small two-stage pipeline and comparing with eager.
"""

from __future__ import annotations

import torch

from labkit.checks import FAIL, PASS, CheckResult, check, describe_exception
from labkit.pipeline import schedule as S

__all__ = ["check_one_f_one_b", "check_create_in_order"]


def _fmt(order) -> str:
    try:
        return " ".join(f"{k}{m}" for k, m in order)
    except (TypeError, ValueError):
        return repr(order)


def check_one_f_one_b(fn, *, trials: int = 6) -> CheckResult:
    """``fn(P, M)`` must return the 1F1B order of every stage (see
    :func:`labkit.pipeline.schedule.one_f_one_b`). Trials include more microbatches than
    stages, fewer, and a single stage."""
    cases = [(4, 8), (3, 2), (1, 3), (2, 5), (5, 5), (4, 1)]

    def make_inputs(gen: torch.Generator):
        i = (gen.initial_seed() - 1) % len(cases)
        return cases[i]

    def learner(P, M):
        out = fn(P, M)
        if out is None:
            return None
        return [[tuple(op) for op in stage] for stage in out]

    def compare(expected, actual):
        if actual is None:
            return "expected a list of per-stage orders, got None (did you forget `return`?)"
        P, M = len(expected), sum(k == "F" for k, _ in expected[0])
        if len(actual) != P:
            return f"for P={P}, M={M} expected {P} stage orders, got {len(actual)}"
        for s, (e, a) in enumerate(zip(expected, actual)):
            if e == a:
                continue
            w = S.num_warmup_microbatches(P, M, s)
            head = f"for P={P}, M={M}, stage {s}: expected {_fmt(e)}, got {_fmt(a)}"
            if a == S.gpipe(P, M)[s] and a != e:
                return head + (". That is GPipe (all forwards, then all backwards): it holds "
                               "all M microbatches' activations at once")
            a_w = next((i for i, (k, _) in enumerate(a) if k == "B"), len(a))
            if a_w != w:
                return head + (f". Stage {s} should run min(P - s - 1, M) = {w} warmup "
                               f"forwards before its first backward, not {a_w}")
            if sorted(a) != sorted(e):
                return head + ". Every microbatch needs exactly one F and one B per stage"
            return head + (". After the warmup, alternate F (the next microbatch) and B (the "
                           "oldest in flight); then finish the remaining backwards")
        return None

    return check(learner, S.one_f_one_b, make_inputs, trials=trials, name="one_f_one_b",
                 compare=compare,
                 hint="w = min(P - s - 1, M); F0..F(w-1); then M - w pairs (F(w+i), B(i)); "
                      "then B(M-w)..B(M-1)")


def _pipeline_run(B, create, *, graphs: bool, steps: int = 2, P: int = 2, M: int = 2):
    from labkit.pipeline.models import make_blocks
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
    trained through the graphs ends equal to eager training."""
    if B is None:
        from labkit import backend
        B = backend.get("auto")
    name = "create_in_order"

    def fail(msg, hint, kind="mismatch"):
        text = f"{FAIL} {name}: {msg}\n   hint: {hint}"
        if not quiet:
            print(text)
        return CheckResult(name, False, text, kind=kind)

    created: list[str] = []

    def wrapped(entries):
        recorded = [f"{e[1]} {e[0].name}" for e in entries]
        for e in entries:                     # watch the order the learner creates in
            r = e[0]
            if not hasattr(r, "_orig_fwd"):
                r._orig_fwd, r._orig_bwd = r.create_fwd_graph, r.create_bwd_graph

                def f(args, r=r):
                    created.append(f"fwd {r.name}")
                    return r._orig_fwd(args)

                def b(r=r):
                    created.append(f"bwd {r.name}")
                    return r._orig_bwd()

                r.create_fwd_graph, r.create_bwd_graph = f, b
        wrapped.recorded = recorded
        return fn(entries)

    try:
        got, calls = _pipeline_run(B, wrapped, graphs=True)
    except NotImplementedError:
        text = f"{FAIL} {name}: not done yet: fill in the cell marked YOUR CODE HERE"
        if not quiet:
            print(text)
        return CheckResult(name, False, text, kind="not_implemented")
    except Exception as exc:  # noqa: BLE001 - reported to the learner
        missing = ("forward graph" in str(exc) or "no forward graph" in str(exc))
        return fail(f"training through your graphs raised {describe_exception(exc)}",
                    "every entry needs its graph: 'fwd' entries runner.create_fwd_graph("
                    "entry[2]), 'bwd' entries runner.create_bwd_graph()"
                    + (" (a backward graph can only be created after its forward)"
                       if missing else ""), kind="exception")
    recorded = getattr(wrapped, "recorded", [])
    if sorted(created) != sorted(recorded):
        return fail(f"you created {len(created)} graphs, the record has {len(recorded)} "
                    "entries", "create exactly one graph per entry")
    if created != recorded:
        i = next(k for k, (a, b) in enumerate(zip(created, recorded)) if a != b)
        return fail(f"graph {i + 1} you created is '{created[i]}', but in step 1 "
                    f"'{recorded[i]}' ran at that point. Graphs sharing a pool reuse each "
                    "other's freed blocks in creation order, so any other order lets a "
                    "replay overwrite activations a later backward still needs",
                    "loop over the entries as they come: do not group, sort or reverse them")
    ref, _ = _pipeline_run(B, None, graphs=False)
    worst = max((a - b).abs().max().item() for a, b in zip(got, ref))
    if worst > 1e-4:
        return fail(f"the parameters differ from eager training by up to {worst:.3g}",
                    "create each entry's graph in record order, nothing else")
    text = f"{PASS} {name}: {len(created)} graphs created in recorded order; the pipeline " \
           "trains exactly like eager"
    if not quiet:
        print(text)
    return CheckResult(name, True, text, trials=1)
