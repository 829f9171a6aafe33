"""Helpers shared by lesson 06's checkers: a learner's bucket list as ints, and a long list
shortened for a message.
"""

from __future__ import annotations

import torch

from labkit.core.validate import is_int


def _as_int_list(actual) -> tuple[list[int] | None, str | None]:
    """``actual`` as a list of Python ints, or a reason why it is not one."""
    if actual is None:
        return None, "got None (did you forget `return`?)"
    if isinstance(actual, (set, frozenset)):
        return None, ("got a set: a set has no order, and pad_to_bucket bisects this list. "
                      "Return a sorted list")
    if isinstance(actual, torch.Tensor):
        actual = actual.tolist()
    if isinstance(actual, (str, bytes)) or not hasattr(actual, "__iter__"):
        return None, f"expected a list of ints, got {type(actual).__name__}"
    out = list(actual)
    bad = [x for x in out if not is_int(x)]
    if bad:
        return None, f"expected a list of ints, found {bad[0]!r} ({type(bad[0]).__name__})"
    return [int(x) for x in out], None


def _short(xs: list[int], n: int = 12) -> str:
    return str(xs) if len(xs) <= n else f"[{', '.join(map(str, xs[:n]))}, ...] ({len(xs)} values)"
