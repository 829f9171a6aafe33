"""The bucket-choice problem of lesson 10's exercise: its scenarios, its score, its optimum.

A server admits up to ``max_bs`` requests per decode step and captures one graph per
bucket. Its traffic is a histogram ``{batch size: decode steps}``; each bucket ``b`` costs
``graph_bytes[b]`` of graph memory (what that graph keeps in the pools, measured as in
lesson 10 §2), and all the buckets together must fit ``budget_bytes``. A step of ``s``
requests replays the smallest bucket ``>= s`` and computes its ``bucket - s`` padded rows
for nothing. The score of a bucket list:

* ``memory``: the sum of its buckets' ``graph_bytes``;
* ``padding waste``: padded rows / computed rows over the histogram (the share of the
  GPU's decode work thrown away), as :func:`labkit.decode.explore_buckets` counts it.

:func:`best_buckets` finds the list of least waste within the budget exactly, by dynamic
programming over (largest bucket so far, memory spent), memory counted in whole
``unit_bytes`` (every scenario's costs are whole MiB).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["Scenario", "make_scenario", "lesson_scenario", "score", "Score", "best_buckets",
           "reference_choose_buckets", "MIB"]

MIB = 2**20


@dataclass(frozen=True)
class Scenario:
    """One server: its traffic histogram, its per-bucket memory cost and its budget."""

    traffic: dict          # {batch size: decode steps}, sizes in 1..max_bs
    max_bs: int
    graph_bytes: dict      # {bucket size: bytes}, for every size 1..max_bs
    budget_bytes: int

    def args(self) -> tuple:
        """Fresh copies of the arguments the learner's function receives."""
        return dict(self.traffic), self.max_bs, dict(self.graph_bytes), self.budget_bytes


@dataclass(frozen=True)
class Score:
    memory_bytes: int
    real_rows: int
    computed_rows: int

    @property
    def padded_rows(self) -> int:
        return self.computed_rows - self.real_rows

    @property
    def waste(self) -> float:
        return self.padded_rows / self.computed_rows if self.computed_rows else 0.0


def score(sc: Scenario, buckets: list[int]) -> Score:
    """Memory and padding of a valid bucket list (sorted, distinct, ``max_bs`` in)."""
    real = computed = 0
    for s, n in sc.traffic.items():
        b = buckets[bisect.bisect_left(buckets, s)]
        real += s * n
        computed += b * n
    return Score(sum(sc.graph_bytes[b] for b in buckets), real, computed)


def best_buckets(sc: Scenario, unit_bytes: int = MIB) -> list[int]:
    """The bucket list of least padding waste within the budget (``max_bs`` always in).

    Dynamic programming: ``f[j][u]`` is the fewest computed rows for the batch sizes
    ``1..j`` when ``j`` is a bucket and the buckets up to ``j`` cost at most ``u`` units.

    Raises:
        ValueError: a cost that is not a whole number of ``unit_bytes``, or a budget that
            cannot hold even the bucket ``max_bs``.
    """
    m = sc.max_bs
    cost = [0] * (m + 1)
    for b in range(1, m + 1):
        c, r = divmod(int(sc.graph_bytes[b]), unit_bytes)
        if r:
            raise ValueError(f"graph_bytes[{b}] = {sc.graph_bytes[b]} is not a whole number "
                             f"of {unit_bytes} bytes")
        cost[b] = c
    cap = int(sc.budget_bytes) // unit_bytes
    if cost[m] > cap:
        raise ValueError(f"the budget ({sc.budget_bytes} bytes) cannot hold the bucket "
                         f"max_bs={m} alone ({sc.graph_bytes[m]} bytes)")
    counts = np.zeros(m + 1)
    for s, n in sc.traffic.items():
        counts[s] += n
    prefix = np.concatenate([[0.0], np.cumsum(counts[1:])])     # prefix[j] = steps of 1..j
    inf = np.inf
    f = np.full((m + 1, cap + 1), inf)
    f[0, :] = 0.0
    back = np.zeros((m + 1, cap + 1), dtype=np.int64)
    for j in range(1, m + 1):
        c = cost[j]
        if c > cap:
            continue
        best = np.full(cap + 1, inf)
        arg = np.zeros(cap + 1, dtype=np.int64)
        for i in range(j):
            rows = j * (prefix[j] - prefix[i])                   # sizes i+1..j replay j
            cand = np.full(cap + 1, inf)
            cand[c:] = f[i, :cap + 1 - c] + rows
            better = cand < best
            best[better], arg[better] = cand[better], i
        f[j], back[j] = best, arg
    out, j, u = [], m, cap
    while j > 0:
        out.append(j)
        i = int(back[j, u])
        u -= cost[j]
        j = i
    return sorted(out)


def reference_choose_buckets(traffic, max_bs, graph_bytes, budget_bytes) -> list[int]:
    """The reference solution: start from ``[max_bs]`` and keep adding the bucket that
    saves the most padded rows per byte, while one fits the budget and saves anything."""
    buckets, spent = [max_bs], graph_bytes[max_bs]

    def padded(bs_list):
        return sum(n * (bs_list[bisect.bisect_left(bs_list, s)] - s) for s, n in traffic.items())

    now = padded(buckets)
    while True:
        best = None
        for b in range(1, max_bs):
            if b in buckets or spent + graph_bytes[b] > budget_bytes:
                continue
            saved = now - padded(sorted(buckets + [b]))
            if saved > 0 and (best is None or saved / graph_bytes[b] > best[0]):
                best = (saved / graph_bytes[b], b)
        if best is None:
            return buckets
        buckets = sorted(buckets + [best[1]])
        spent += graph_bytes[best[1]]
        now = padded(buckets)


def _traffic(gen: torch.Generator, max_bs: int, steps: int) -> dict:
    """A day's decode steps: two or three busy clumps of batch sizes, and a thin floor."""
    traffic: dict = {}
    clumps = int(torch.randint(2, 4, (1,), generator=gen))
    for _ in range(clumps):
        center = int(torch.randint(1, max_bs + 1, (1,), generator=gen))
        width = max(1, max_bs // 16)
        n = steps // clumps
        offs = torch.randint(-width, width + 1, (n,), generator=gen).tolist()
        for o in offs:
            s = min(max_bs, max(1, center + o))
            traffic[s] = traffic.get(s, 0) + 1
    for s in torch.randint(1, max_bs + 1, (steps // 20,), generator=gen).tolist():
        traffic[s] = traffic.get(s, 0) + 1
    return dict(sorted(traffic.items()))


def make_scenario(seed: int, max_bs: int | None = None, steps: int = 600) -> Scenario:
    """A random server, reproducible from ``seed``: its ``max_bs`` (32, 48 or 64), traffic,
    per-bucket cost ``fixed + per_row * bs`` (whole MiB) and a budget of about six to ten
    average graphs."""
    gen = torch.Generator().manual_seed(10_000 + seed)
    if max_bs is None:
        max_bs = (32, 48, 64)[int(torch.randint(0, 3, (1,), generator=gen))]
    fixed = int(torch.randint(2, 6, (1,), generator=gen))           # MiB per graph
    per_16_rows = int(torch.randint(1, 4, (1,), generator=gen))     # MiB per 16 rows
    graph_bytes = {b: (fixed + (per_16_rows * b + 15) // 16) * MIB for b in range(1, max_bs + 1)}
    avg = sum(graph_bytes.values()) / max_bs
    graphs = int(torch.randint(5, 10, (1,), generator=gen))
    budget = int(graph_bytes[max_bs] + graphs * avg) // MIB * MIB
    return Scenario(_traffic(gen, max_bs, steps), max_bs, graph_bytes, budget)


def lesson_scenario() -> Scenario:
    """The server the exercise's text looks at (shown in the notebook)."""
    return make_scenario(0, max_bs=64)
