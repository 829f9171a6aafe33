"""Interleaved rounds: how ``labkit.bench`` compares variants on a host that drifts.

A GPU host shared with other work drifts by tens of per cent between runs, and within a
run (clocks, a neighbour's jobs, the allocator's state). Timing variant A for a minute
and then variant B for a minute lets that drift decide the ranking. So every suite that
compares variants first *builds* all of them, then times them in **rounds**: each round
times every variant once (a short burst of samples, both timing methods), in an order
shuffled per round from a fixed seed. Drift then hits every variant alike, and each
round is a paired comparison.

A row keeps its rounds (``extra.rounds``: one value per round, in round order, per
method); its ``median_us`` / ``back_to_back_us`` are the medians over rounds.
:func:`verdict` turns two rows' rounds into the sentence a lesson may quote: "A is faster
than B" only when A wins at least 4 of 5 rounds (80 %, paired by round), otherwise
"level within the noise of this host", with both ranges.

Nothing here needs torch: the timer is passed in, so tests drive the bookkeeping with a
fake one.
"""

from __future__ import annotations

import math
import random
import statistics
from dataclasses import dataclass
from typing import Callable, Hashable, Mapping, Sequence

__all__ = ["DEFAULT_ROUNDS", "WIN_SHARE", "METHODS", "interleave", "summary", "Verdict",
           "verdict", "wins_needed", "format_us", "median_range"]

DEFAULT_ROUNDS = 5
WIN_SHARE = 0.8          # 4 of 5 rounds
METHODS = {"median_us": "synced", "back_to_back_us": "back to back",
           "wall_s": "whole run"}      # wall_s: the serve suite's time for the workload, s


def interleave(contenders: Mapping[Hashable, Callable[[], object]],
               time_one: Callable[[Callable[[], object]], Mapping[str, float]], *,
               rounds: int = DEFAULT_ROUNDS, seed: int = 0,
               log: Callable[[str], None] | None = None) -> dict[Hashable, dict[str, list]]:
    """Time every contender once per round, in an order shuffled per round.

    Args:
        contenders: key (e.g. ``(variant, batch_size)``) → the callable to time.
        time_one: times one callable and returns ``{method: value}`` (e.g.
            ``{"median_us": ..., "back_to_back_us": ..., "host_us": ...}``); every call
            must return the same methods.
        rounds: how many rounds (at least 1; a verdict wants at least 5).
        seed: the shuffle's seed, so a rerun times in the same orders.
        log: called with one line per round, if given.

    Returns:
        key → ``{method: [value of round 0, value of round 1, ...]}``.
    """
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
        raise ValueError(f"rounds must be a whole number >= 1, got {rounds!r}")
    if not contenders:
        raise ValueError("interleave needs at least one contender to time")
    rng = random.Random(seed)
    keys = list(contenders)
    out: dict[Hashable, dict[str, list]] = {k: {} for k in keys}
    for r in range(rounds):
        order = keys[:]
        rng.shuffle(order)
        for k in order:
            for method, value in time_one(contenders[k]).items():
                out[k].setdefault(method, []).append(float(value))
        if log is not None:
            log(f"  round {r + 1}/{rounds} done")
    for k, by_method in out.items():
        bad = {m: len(v) for m, v in by_method.items() if len(v) != rounds}
        if bad:
            raise ValueError(f"time_one returned different methods across rounds for {k!r}: "
                             f"values per method {bad}, expected {rounds} each")
    return out


def summary(values: Sequence[float]) -> dict[str, float]:
    """``{"median", "min", "max"}`` of one row's rounds."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def format_us(us: float | None) -> str:
    """``'7.41 ms'`` / ``'85.2 µs'`` / ``'—'``."""
    if us is None or (isinstance(us, float) and math.isnan(us)):
        return "—"
    if us >= 1000:
        return f"{us / 1000:.2f} ms"
    return f"{us:.1f} µs"


def _is_rate(method: str) -> bool:
    """``*_per_s`` methods (tokens/s) are rates: higher is faster."""
    return method.endswith("per_s")


def _fmt(value: float, method: str = "median_us") -> str:
    """A figure of ``method``: a count per second for ``*_per_s`` methods, seconds for
    other ``*_s`` methods, else :func:`format_us`."""
    if _is_rate(method):
        return f"{value:.0f}/s" if value >= 100 else f"{value:.3g}/s"
    return f"{value:.2f} s" if method.endswith("_s") else format_us(value)


def median_range(values: Sequence[float], method: str = "median_us") -> str:
    """One contender's rounds as a lesson prints them: ``'802.4 µs (781.0–853.2 µs)'``,
    the median over rounds and, in brackets, the min–max.

    Args:
        values: one value per round (an entry of :func:`interleave`'s result).
        method: what the values are, by the suffix of its name: ``*_us`` microseconds,
            ``*_per_s`` a rate (``'15057/s (14210/s–15310/s)'``), other ``*_s`` seconds.
    """
    if isinstance(values, (str, bytes)) or not hasattr(values, "__iter__"):
        raise TypeError(f"median_range: values must be one figure per round (a list), got "
                        f"{values!r:.40} ({type(values).__name__})")
    values = list(values)
    if not values:
        raise ValueError("median_range: no rounds given; pass one value per round, e.g. "
                         "interleave(...)[key]['median_us']")
    s = summary(values)
    return (f"{_fmt(s['median'], method)} ({_fmt(s['min'], method)}–"
            f"{_fmt(s['max'], method)})")


def _span(values: Sequence[float], method: str = "median_us") -> str:
    """``'351–510 µs'`` / ``'14.9–19.8 ms'``: the range of some rounds, one unit."""
    lo, hi = min(values), max(values)
    if method.endswith("_s"):
        return f"{lo:.2f}–{hi:.2f} s"
    if hi >= 1000:
        return f"{lo / 1000:.1f}–{hi / 1000:.1f} ms"
    return f"{lo:.0f}–{hi:.0f} µs"


@dataclass(frozen=True)
class Verdict:
    """The comparison of two rows over paired rounds, for one timing method.

    ``winner`` is the name of the faster row when it won at least ``WIN_SHARE`` of the
    rounds, else None (level within the noise). ``wins`` counts the rounds each side was
    faster in (ties count for neither).
    """

    a: str
    b: str
    method: str
    a_rounds: tuple[float, ...]
    b_rounds: tuple[float, ...]
    wins: tuple[int, int]
    winner: str | None
    label: str | None = None          # what the method measured, if not METHODS' name

    @property
    def ratio(self) -> float:
        """Median of ``a`` over median of ``b`` (below 1: ``a`` is quicker)."""
        return statistics.median(self.a_rounds) / statistics.median(self.b_rounds)

    def text(self) -> str:
        n = len(self.a_rounds)
        label = self.label or METHODS.get(self.method, self.method)
        ra, rb = summary(self.a_rounds), summary(self.b_rounds)
        m = self.method
        span = (f"{self.a} {_fmt(ra['median'], m)} ({_fmt(ra['min'], m)}–"
                f"{_fmt(ra['max'], m)}), {self.b} {_fmt(rb['median'], m)} "
                f"({_fmt(rb['min'], m)}–{_fmt(rb['max'], m)})")
        if self.winner is None:
            return (f"{label}: {self.a} and {self.b} are level within the noise of this host "
                    f"({self.a} faster in {self.wins[0]} of {n} rounds; {span})")
        loser = self.b if self.winner == self.a else self.a
        k = self.wins[0] if self.winner == self.a else self.wins[1]
        r = self.ratio if self.winner == self.a else 1 / self.ratio
        return (f"{label}: {self.winner} is faster than {loser} (in {k} of {n} rounds; "
                f"{r:.2f}× its time at the median; {span})")

    def short(self, labels: dict | None = None) -> str:
        """One short line for a lesson: who is faster in how many rounds (and the ratio of
        the medians), or level with both ranges; ``labels`` renames variants."""
        name = (labels or {}).get
        a, b = name(self.a, self.a), name(self.b, self.b)
        n = len(self.a_rounds)
        if self.winner is None:
            return (f"{a} ≈ {b}: level, {self.wins[0]}/{n} rounds to {a} "
                    f"({_span(self.a_rounds, self.method)} vs "
                    f"{_span(self.b_rounds, self.method)})")
        win, lose = (a, b) if self.winner == self.a else (b, a)
        k = self.wins[0] if self.winner == self.a else self.wins[1]
        r = self.ratio if self.winner == self.a else 1 / self.ratio
        return f"{win} faster than {lose}: {k}/{n} rounds, {r:.2f}× its time"

    __str__ = text


def wins_needed(rounds: int, share: float = WIN_SHARE) -> int:
    """Rounds a side must win to be called faster: ``ceil(share × rounds)`` (4 of 5)."""
    return math.ceil(share * rounds - 1e-9)


def verdict(a: str, a_rounds: Sequence[float], b: str, b_rounds: Sequence[float], *,
            method: str = "median_us", share: float = WIN_SHARE,
            label: str | None = None) -> Verdict:
    """Compare two rows round by round (round *i* of ``a`` against round *i* of ``b``).

    ``a`` is called faster only when it is quicker in at least ``ceil(share × rounds)``
    rounds (4 of 5 by default), and likewise ``b``; otherwise the two are level.

    Raises:
        ValueError: the two rows have different numbers of rounds (they were not timed
            in the same rounds), or none; or ``method`` is a rate (``*_per_s``: higher is
            faster, which this rule would read backwards).
    """
    if _is_rate(method):
        raise ValueError(f"verdict compares times (lower is faster), got the rate {method!r}: "
                         "pass a time per round instead (e.g. a step's median_us, a run's "
                         "wall_s)")
    if len(a_rounds) != len(b_rounds) or not a_rounds:
        raise ValueError(f"{a!r} has {len(a_rounds)} rounds and {b!r} {len(b_rounds)}: a "
                         "verdict pairs rows timed in the same rounds (same run, same "
                         "--rounds)")
    need = wins_needed(len(a_rounds), share)
    wins_a = sum(x < y for x, y in zip(a_rounds, b_rounds))
    wins_b = sum(y < x for x, y in zip(a_rounds, b_rounds))
    winner = a if wins_a >= need else b if wins_b >= need else None
    return Verdict(a, b, method, tuple(map(float, a_rounds)), tuple(map(float, b_rounds)),
                   (wins_a, wins_b), winner, label)
