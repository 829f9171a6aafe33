"""Checkers for lesson 10 (graphs at scale), one module per exercise:

* :mod:`.choose_buckets`: ``check_choose_buckets``, the diagnosis exercise: choose the
  buckets of a server from its traffic, per-bucket memory and budget;
* :mod:`.buckets`: the problem itself: scenarios (:func:`lesson_scenario`,
  :func:`make_scenario`), the score (memory, padding waste) and the exact optimum
  (:func:`best_buckets`).

The first ❌ names every rule the answer breaks and where to look; the next hints
(``labkit.checks.hint()``) go further, and the last one is the answer.
"""

from labkit.checks.lesson10.buckets import (
    Scenario,
    best_buckets,
    lesson_scenario,
    make_scenario,
    score,
)
from labkit.checks.lesson10.choose_buckets import SLACK, check_choose_buckets, judge, trials

__all__ = ["check_choose_buckets", "judge", "trials", "SLACK", "Scenario", "best_buckets",
           "lesson_scenario", "make_scenario", "score"]
