"""Checkers for lesson 00 (start here), one module per exercise.

* :mod:`.scale_and_shift`: ``check_scale_and_shift``.

    from labkit.checks.lesson00 import check_scale_and_shift
"""

from labkit.checks.lesson00.scale_and_shift import check_scale_and_shift

__all__ = ["check_scale_and_shift"]
