"""Pipeline schedules: the 1F1B order of each stage, a timeline, and a chart (lesson 05).

With pipeline parallelism (PP) a model is cut into ``P`` stages, one per GPU, and a batch
into ``M`` microbatches. Stage ``s`` can run the forward of microbatch ``m`` (``F m``)
once stage ``s-1`` has, and its backward (``B m``) once stage ``s+1`` has. *1F1B*
(one-forward-one-backward, Megatron's ``forward_backward_pipelining_without_interleaving``
in ``megatron/core/pipeline_parallel/schedules.py``) orders each stage's work in three
phases:

* **warmup**: ``min(P - s - 1, M)`` forwards, to fill the pipe downstream;
* **steady**: alternate one forward and one backward, ``M - warmup`` times;
* **cooldown**: the ``warmup`` backwards still owed.

So stage ``s`` never holds more than ``min(P - s, M)`` microbatches' activations at once
(GPipe's all-forward-then-all-backward holds ``M``). For CUDA graphs the consequence is
that one layer is *in flight* for several microbatches at the same time: its forward
replays for microbatch 1 before its backward for microbatch 0 has run, so one pair of
static buffers cannot serve them all (see :mod:`labkit.pipeline.runner`).

``simulate`` turns per-stage orders into a timeline (who runs what when, with bubbles),
``execution_order`` flattens it into the one sequence a single process can execute
(respecting every dependency), and ``plot_schedule`` draws it.
"""

from __future__ import annotations

from dataclasses import dataclass

from labkit.core.validate import check_int

__all__ = ["num_warmup_microbatches", "one_f_one_b", "gpipe", "max_in_flight", "Event",
           "simulate", "execution_order", "plot_schedule", "describe"]


# ---- argument checks ------------------------------------------------------------------------

def _check_PM(P, M) -> None:
    """``P`` stages and ``M`` microbatches: ints, at least one of each."""
    check_int("P (the number of pipeline stages)", P, minimum=1)
    check_int("M (the number of microbatches)", M, minimum=1)


def _check_order(order, where: str = "order") -> None:
    """A stage's order: a list of ``("F", m)`` / ``("B", m)``, each backward after its
    forward, each op once."""
    if isinstance(order, (str, bytes)) or not isinstance(order, (list, tuple)):
        raise TypeError(f"{where} must be a list of ('F', m) / ('B', m) pairs, as "
                        f"one_f_one_b(P, M)[stage] gives, got {type(order).__name__}")
    seen = set()
    for i, op in enumerate(order):
        if (not isinstance(op, (tuple, list)) or len(op) != 2 or op[0] not in ("F", "B")
                or isinstance(op[1], bool) or not isinstance(op[1], int) or op[1] < 0):
            raise ValueError(f"{where}[{i}] is {op!r}: each op must be ('F', m) or ('B', m) "
                             f"with m a microbatch index >= 0 (upper-case 'F'/'B')")
        kind, m = op
        if (kind, m) in seen:
            raise ValueError(f"{where}[{i}]: {kind}{m} appears twice")
        if kind == "B" and ("F", m) not in seen:
            raise ValueError(f"{where}[{i}]: B{m} comes before F{m}; a microbatch's backward "
                             f"can only run after its forward")
        seen.add((kind, m))


def _check_orders(orders) -> None:
    if isinstance(orders, (str, bytes)) or not isinstance(orders, (list, tuple)) or not orders:
        raise TypeError("orders must be a non-empty list with one order per stage, as "
                        f"one_f_one_b(P, M) returns, got {orders!r:.60}")
    for s, order in enumerate(orders):
        _check_order(order, f"orders[{s}]")


def num_warmup_microbatches(P: int, M: int, stage: int) -> int:
    """Forwards stage ``stage`` runs before its first backward: ``min(P - stage - 1, M)``."""
    _check_PM(P, M)
    check_int("stage", stage, minimum=0, maximum=P - 1, fix=f"there are P={P} stages")
    return min(P - stage - 1, M)


def one_f_one_b(P: int, M: int) -> list[list[tuple[str, int]]]:
    """The 1F1B order of every stage: ``orders[s]`` is a list of ``("F", m)``/``("B", m)``.

    Example, ``P=2, M=3``::

        stage 0: F0 F1 B0 F2 B1 B2      (1 warmup forward, 2 steady pairs, 1 cooldown)
        stage 1: F0 B0 F1 B1 F2 B2      (last stage: no warmup)
    """
    _check_PM(P, M)
    orders = []
    for s in range(P):
        w = num_warmup_microbatches(P, M, s)
        order = [("F", m) for m in range(w)]
        for i in range(M - w):
            order += [("F", w + i), ("B", i)]
        order += [("B", m) for m in range(M - w, M)]
        orders.append(order)
    return orders


def gpipe(P: int, M: int) -> list[list[tuple[str, int]]]:
    """All forwards, then all backwards (GPipe), for comparison with 1F1B."""
    _check_PM(P, M)
    return [[("F", m) for m in range(M)] + [("B", m) for m in range(M)] for _ in range(P)]


def max_in_flight(order: list[tuple[str, int]]) -> int:
    """Most microbatches whose forward ran and backward did not, at any point of ``order``.

    That is how many sets of activations the stage holds at once, and how many graph
    runners per layer a stage needs when each in-flight microbatch needs its own.
    """
    _check_order(order)
    live = peak = 0
    for kind, _ in order:
        live += 1 if kind == "F" else -1
        peak = max(peak, live)
    return peak


@dataclass(frozen=True)
class Event:
    """One unit of work on the timeline."""

    stage: int
    kind: str          # "F" or "B"
    microbatch: int
    start: float
    end: float


def simulate(orders: list[list[tuple[str, int]]], t_fwd: float = 1.0,
             t_bwd: float = 2.0) -> list[Event]:
    """When each op of each stage runs, if a forward takes ``t_fwd`` and a backward
    ``t_bwd`` and communication is free.

    Each stage runs its ops in its order; an op also waits for its dependency (``F m``
    on stage ``s-1``'s ``F m``; ``B m`` on stage ``s+1``'s ``B m``, or on this stage's
    own ``F m`` at the last stage). Raises ``ValueError`` when the orders deadlock.
    """
    _check_orders(orders)
    for name, t in (("t_fwd", t_fwd), ("t_bwd", t_bwd)):
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not t > 0:
            raise ValueError(f"{name} must be a positive number of time units, got {t!r}")
    P = len(orders)
    done: dict[tuple[int, str, int], float] = {}
    pos = [0] * P
    free = [0.0] * P
    events: list[Event] = []
    total = sum(len(o) for o in orders)
    while len(events) < total:
        progressed = False
        for s in range(P):
            while pos[s] < len(orders[s]):
                kind, m = orders[s][pos[s]]
                if kind == "F":
                    dep = (s - 1, "F", m) if s > 0 else None
                else:
                    dep = (s + 1, "B", m) if s < P - 1 else (s, "F", m)
                if dep is not None and dep not in done:
                    break
                if kind == "B" and (s, "F", m) not in done:
                    break
                start = max(free[s], done[dep] if dep is not None else 0.0)
                end = start + (t_fwd if kind == "F" else t_bwd)
                done[(s, kind, m)] = end
                free[s] = end
                events.append(Event(s, kind, m, start, end))
                pos[s] += 1
                progressed = True
        if not progressed:
            stuck = {s: orders[s][pos[s]] for s in range(P) if pos[s] < len(orders[s])}
            raise ValueError(f"the stage orders deadlock: each stage waits on another "
                             f"(next ops: {stuck})")
    return events


def execution_order(events: list[Event]) -> list[tuple[int, str, int]]:
    """``(stage, kind, microbatch)`` by start time: one sequence a single process can run
    with every dependency satisfied (ties broken by stage)."""
    return [(e.stage, e.kind, e.microbatch)
            for e in sorted(events, key=lambda e: (e.start, e.stage))]


def describe(orders: list[list[tuple[str, int]]]) -> str:
    """The orders as text, one stage per line: ``stage 0: F0 F1 B0 ...``."""
    _check_orders(orders)
    return "\n".join(f"stage {s}: " + " ".join(f"{k}{m}" for k, m in o)
                     for s, o in enumerate(orders))


def plot_schedule(events: list[Event], ax=None, title: str | None = None):
    """A Gantt chart: one row per stage, forwards light, backwards dark, labelled by
    microbatch; idle time (the pipeline bubble) stays white."""
    import matplotlib.pyplot as plt

    events = list(events)
    if not events or not all(isinstance(e, Event) for e in events):
        raise ValueError("plot_schedule needs the non-empty list of events that "
                         "simulate(orders) returns")
    if ax is None:
        P = 1 + max(e.stage for e in events)
        _, ax = plt.subplots(figsize=(10, 0.6 * P + 1.2))
    cmap = plt.get_cmap("tab10")
    for e in events:
        color = cmap(e.microbatch % 10)
        ax.barh(e.stage, e.end - e.start, left=e.start, height=0.8, color=color,
                alpha=0.45 if e.kind == "F" else 0.95, edgecolor="black", linewidth=0.6)
        ax.text((e.start + e.end) / 2, e.stage, f"{e.kind}{e.microbatch}", ha="center",
                va="center", fontsize=8, color="black" if e.kind == "F" else "white")
    stages = sorted({e.stage for e in events})
    ax.set_yticks(stages)
    ax.set_yticklabels([f"stage {s}" for s in stages])
    ax.invert_yaxis()
    ax.set_xlabel("time (forward = 1 unit)")
    span = max(e.end for e in events)
    busy = sum(e.end - e.start for e in events)
    bubble = 1 - busy / (span * len(stages))
    ax.set_title(title or f"schedule: bubble {bubble:.0%} of stage time")
    return ax
