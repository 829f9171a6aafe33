"""Lesson 06, exercise ``fixed_config``: its checker.

``fixed_config() -> dict`` (a diagnosis exercise): the server of
:func:`budget_scenario` ran out of graph memory at capture; the learner picks buckets and
the pool layout so that every batch of its trace has a graph, the graphs fit the budget
and the padding waste stays under the limit (all three judged by
:func:`labkit.decode.explore_buckets`).
"""

from __future__ import annotations

import torch

from labkit.checks import CheckResult, attempt, fail, reject, run_check
from labkit.checks.lesson06._common import _as_int_list, _short
from labkit.decode import explore_buckets, make_buckets

__all__ = ["check_fixed_config", "budget_scenario", "BROKEN_CONFIG"]


#: the broken server of exercise 4: one graph per batch size, a memory pool per graph
BROKEN_CONFIG = {"buckets": "every", "shared_pool": False}


def budget_scenario() -> dict:
    """The server of exercise 4: its decode trace, ``max_bs``, graph-memory budget and the
    padding-waste limit.

    The trace is 450 decode steps of a day's traffic (mostly 18..28 requests, peaks of
    52..64, a few near-idle steps of 1..4), fixed by a seed so that every learner and the
    checker see the same numbers. Memory is :func:`labkit.decode.explore_buckets`'s model
    with its default bytes per row.
    """
    gen = torch.Generator().manual_seed(6)
    parts = [torch.randint(18, 29, (300,), generator=gen),
             torch.randint(52, 65, (120,), generator=gen),
             torch.randint(1, 5, (30,), generator=gen)]
    trace = torch.cat(parts)[torch.randperm(450, generator=gen)].tolist()
    return {"batch_sizes": trace, "max_bs": 64, "budget_bytes": int(5.5 * 2**20),
            "max_waste": 0.08}


_BUDGET_HINTS = [
    "Run explore_buckets(max_bs, batch_sizes, scheme) for the broken config and for the "
    "named schemes, and read both memory columns: which one of the two faults costs more?",
    "Look at where the trace's batch sizes fall (a histogram, or sorted(set(batch_sizes))): "
    "buckets are cheap where no batch lands and padding is expensive where many do. A few "
    "buckets just at or above the busy sizes, plus max_bs for the peaks, and one shared pool.",
    "For example {'buckets': [4, 20, 24, 28, 56, 64], 'shared_pool': True}: 6 graphs, "
    "about 5.1 MiB, 5.4% padding.",
]


def _config(cfg, max_bs: int) -> tuple[list[int], bool]:
    """The learner's configuration: its buckets (a list, or a scheme's name) and its pool
    layout, each checked for what it must be."""
    if not isinstance(cfg, dict) or set(cfg) != {"buckets", "shared_pool"}:
        got = sorted(cfg) if isinstance(cfg, dict) else type(cfg).__name__
        reject(f"return a dict with exactly the keys 'buckets' and 'shared_pool', "
                      f"got {got}")
    shared = cfg["shared_pool"]
    if not isinstance(shared, bool):
        reject(f"'shared_pool' must be True or False, got {shared!r}")
    raw = cfg["buckets"]
    if isinstance(raw, str):
        if raw not in ("sglang", "every", "pow2", "disable_padding"):
            reject(f"'buckets' is {raw!r}: give a list of sizes, or one of 'sglang', "
                          "'every', 'pow2'")
        buckets = make_buckets(max_bs, raw)
    else:
        got, why = _as_int_list(raw)
        if why:
            reject(f"'buckets': {why}")
        if not got:
            reject("'buckets' is empty: no batch would have a graph")
        if got != sorted(set(got)):
            reject(f"'buckets' {_short(got)} must be sorted ascending without repeats "
                          "(pad_to_bucket bisects it)")
        if got[0] < 1 or got[-1] > max_bs:
            bad = got[0] if got[0] < 1 else got[-1]
            reject(f"bucket {bad} is outside 1..max_bs={max_bs}: the static buffers are "
                          f"sized by max_bs, so the largest graph is {max_bs} rows")
        buckets = got
    return buckets, shared


def _judged(buckets: list[int], shared: bool, sc: dict) -> str:
    """The configuration on the scenario's trace: no oversize step, within the memory
    budget and the padding limit. Returns the pass message."""
    trace, max_bs, budget, max_waste = (sc["batch_sizes"], sc["max_bs"], sc["budget_bytes"],
                                        sc["max_waste"])
    rep = explore_buckets(max_bs, trace, buckets)
    mem = rep.memory_bytes if shared else rep.memory_bytes_separate_pools
    mib = mem / 2**20
    where = (f"buckets {_short(buckets)}, {'one shared pool' if shared else 'a pool per graph'}: "
             f"{rep.num_graphs} graphs, {mib:.2f} MiB, padding waste "
             f"{100 * rep.padding_waste:.1f}%, {rep.oversize_batches} oversize steps")
    if rep.oversize_batches:
        big = sorted({b for b in trace if b > buckets[-1]})
        reject(f"{where}.\n   {rep.oversize_batches} steps of the trace have more "
                      f"requests than your largest bucket ({buckets[-1]}; e.g. {big[:4]}): they "
                      "would raise or run eagerly. The peaks need a graph too")
    if mem > budget:
        if not shared and rep.memory_bytes <= budget:
            reject(f"{where}, over the {budget / 2**20:.1f} MiB budget.\n   With a pool "
                          "per graph every graph keeps its own activation memory; the same "
                          f"graphs in one pool, captured largest first, need "
                          f"{rep.memory_bytes / 2**20:.2f} MiB. Which pool layout does the "
                          "lesson's runner use?")
        if shared:
            reject(f"{where}, over the {budget / 2**20:.1f} MiB budget.\n   In one shared "
                          "pool the largest graph's activations are paid once, but every graph "
                          f"keeps its output and a fixed overhead alive: {rep.num_graphs} graphs "
                          "are too many (or too large) for this budget. Which of them does the "
                          "trace actually need?")
        reject(f"{where}, over the {budget / 2**20:.1f} MiB budget.\n   Two things cost "
                      "memory here: a pool per graph keeps every graph's activations, and "
                      f"{rep.num_graphs} graphs each keep an output and a fixed overhead. "
                      "Compare the two memory columns of explore_buckets, then count your graphs")
    if rep.padding_waste > max_waste:
        reject(f"{where}.\n   Within budget, but {100 * rep.padding_waste:.1f}% of the "
                      f"computed rows are padding (the limit is {100 * max_waste:.0f}%): some "
                      "busy batch sizes are padded a long way up. Look at where the trace's "
                      "batch sizes fall and put buckets there")
    return f"{where}: within {budget / 2**20:.1f} MiB and {100 * max_waste:.0f}% waste"


def check_fixed_config(fn, *, quiet: bool = False, time_limit: float = 10.0) -> CheckResult:
    """``fn()`` returns ``{"buckets": [...], "shared_pool": bool}`` for
    :func:`budget_scenario`'s server. It passes when, judged by
    :func:`labkit.decode.explore_buckets` on the scenario's trace:

    * the buckets are a sorted list of distinct ints in ``1..max_bs``;
    * no batch of the trace is larger than the largest bucket;
    * the graphs' memory (the shared-pool or the pool-per-graph figure, as chosen) fits
      the budget;
    * the padding waste is at most ``max_waste``.

    Any configuration that meets all four passes: there is no single answer.
    """
    name = "fixed_config"
    if not callable(fn):
        return fail(name, f"expected a function, got {type(fn).__name__}",
                    more_hints=_BUDGET_HINTS, quiet=quiet)

    def body() -> str:
        sc = budget_scenario()
        cfg = attempt(fn, time_limit=time_limit)
        buckets, shared = _config(cfg, sc["max_bs"])
        return _judged(buckets, shared, sc)

    return run_check(name, body, more_hints=_BUDGET_HINTS, quiet=quiet)
