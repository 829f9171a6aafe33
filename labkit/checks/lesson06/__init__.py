"""Checkers for lesson 06 (decode bucketing the SGLang way), one module per exercise, each
checked against :mod:`labkit.decode`:

* :mod:`.sglang_buckets`: ``check_sglang_buckets``, SGLang's default capture list;
* :mod:`.pad_to_bucket`: ``check_pad_to_bucket``, which bucket a batch replays;
* :mod:`.fill_slot`: ``check_fill_slot``, one static buffer and its padding policy;
* :mod:`.fixed_config`: ``check_fixed_config`` (with ``budget_scenario`` and
  ``BROKEN_CONFIG``), the diagnosis of graphs that do not fit their memory budget.

:mod:`._common` reads a learner's bucket list. Every requirement the exercise text states
is probed, and what it leaves free is randomized (bucket lists, batch sizes, fill values,
dtypes, row dims). The first ❌ names the mistake actually made and where to look; the
next hints (``labkit.checks.hint()``) go further, and the last one is the answer.
"""

from labkit.checks.lesson06.fill_slot import check_fill_slot
from labkit.checks.lesson06.fixed_config import BROKEN_CONFIG, budget_scenario, check_fixed_config
from labkit.checks.lesson06.pad_to_bucket import check_pad_to_bucket
from labkit.checks.lesson06.sglang_buckets import check_sglang_buckets

__all__ = ["check_sglang_buckets", "check_pad_to_bucket", "check_fill_slot",
           "check_fixed_config", "budget_scenario", "BROKEN_CONFIG"]
