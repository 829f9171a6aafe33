"""Lesson 05, exercise ``create_in_order``: its checker.

``create_in_order(entries) -> None``: create the graph of every record entry
(``(runner, "fwd", arg_metas)`` → ``runner.create_fwd_graph(arg_metas)``,
``(runner, "bwd")`` → ``runner.create_bwd_graph()``) so that graphs sharing one pool are
safe; checked by training a small two-stage pipeline and comparing with eager.
"""

from __future__ import annotations

import torch

from labkit.checks import (
    CheckResult,
    attempt,
    call_learner,
    describe_exception,
    fail,
    reject,
    run_check,
)

__all__ = ["check_create_in_order"]


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


def _why_raised(exc: BaseException, created: list, recorded: list) -> str:
    """The learner's error in training through its graphs, with what to look at."""
    text = str(exc)
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
    return (f"training through your graphs raised {describe_exception(exc)}\n"
            f"   what to look at: {why}"
            + (f" (you created {len(created)} of {len(recorded)} graphs)"
               if recorded else ""))


def _judged(B, got, created: list, recorded: list, own_pool: list) -> str:
    """The graphs created, one per entry, in the shared pool, in recorded order; the
    training equal to eager's. Returns the pass message."""
    def no(msg: str) -> None:
        reject(msg, hints=_CIO_HINTS)

    if sorted(created) != sorted(recorded):
        missing = sorted(set(recorded) - set(created))
        no(f"you created {len(created)} graphs; the record has {len(recorded)} "
                    f"entries" + (f" (not created: {missing[:3]}"
                                  f"{' ...' if len(missing) > 3 else ''})" if missing else "")
                    + ". Create exactly one graph per entry")
    if own_pool:
        runners = sorted({e.split(" ", 1)[1] for e in own_pool})
        no(f"you gave {len(runners)} runners a pool of their own (runner.pool was "
                    f"changed before their graphs were created: {own_pool[:3]}"
                    f"{' ...' if len(own_pool) > 3 else ''}). The exercise creates every graph "
                    "in the one shared pool that runner.pool already holds. A pool per graph "
                    "is safe in any order, but each graph then keeps its own memory (lesson "
                    "05 §4 measures it): sharing is the point, and the creation order is "
                    "what makes it safe. Leave runner.pool as it is")
    if created != recorded:
        i = next(k for k, (a, b) in enumerate(zip(created, recorded)) if a != b)
        no(f"graph {i + 1} you created is '{created[i]}', but in step 1 "
                    f"'{recorded[i]}' ran at that point. Graphs sharing a pool reuse each "
                    "other's freed blocks in creation order, so any other order lets a "
                    "replay overwrite activations a later backward still needs: do not "
                    "group, sort or reverse the entries")
    ref, _ = _pipeline_run(B, None, graphs=False)
    worst = max((a - b).abs().max().item() for a, b in zip(got, ref))
    if worst > 1e-4:
        no(f"the parameters differ from eager training by up to {worst:.3g}, "
                    "although the creation order is right: look at what else your loop does")
    return (f"{len(created)} graphs created in recorded order; the pipeline trains "
            "exactly like eager")


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
        return fail(name, f"expected a function, got {type(fn).__name__}", quiet=quiet)

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

    def body() -> str:
        got, calls = attempt(_pipeline_run, (B, wrapped), {"graphs": True}, B=B,
                             hints=_CIO_HINTS,
                             reason=lambda exc: _why_raised(exc, created,
                                                            getattr(wrapped, "recorded", [])))
        return _judged(B, got, created, getattr(wrapped, "recorded", []), own_pool)

    return run_check(name, body, quiet=quiet, trials=1)
