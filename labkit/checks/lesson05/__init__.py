"""Checkers for lesson 05 (1F1B ordered capture), one module per exercise, each checked
against :mod:`labkit.pipeline`:

* :mod:`.one_f_one_b`: ``check_one_f_one_b``, each stage's 1F1B order;
* :mod:`.create_in_order`: ``check_create_in_order``, graphs created so that one shared
  pool is safe;
* :mod:`.pool_hazards`: ``check_pool_hazards`` (and ``reference_pool_hazards``), the
  diagnosis of a creation order.

A failure names the mistake it saw and where to look; ``labkit.checks.hint()`` then gives
further hints, one at a time.
"""

from labkit.checks.lesson05.create_in_order import check_create_in_order
from labkit.checks.lesson05.one_f_one_b import check_one_f_one_b
from labkit.checks.lesson05.pool_hazards import check_pool_hazards, reference_pool_hazards

__all__ = ["check_one_f_one_b", "check_create_in_order", "check_pool_hazards",
           "reference_pool_hazards"]
