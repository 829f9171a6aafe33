"""Argument checks that every engine shares, so a wrong value reads the same everywhere."""

from __future__ import annotations

import numbers

__all__ = ["is_int", "check_int", "int_at_least"]


def is_int(value) -> bool:
    """True for a whole number (Python or NumPy int, a 0-d integer tensor is not one); False
    for ``bool``, which Python counts as an int but no count or size means."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_int(name: str, value, minimum: int | None = 0, maximum: int | None = None, *,
              fix: str = "") -> int:
    """``value`` as a Python int in ``minimum..maximum``, or an error that names it.

    Args:
        name: how the caller knows the value, e.g. ``"n_ops"`` or ``"M (microbatches)"``.
        value: what was given.
        minimum, maximum: the inclusive bounds (``None``: unbounded on that side).
        fix: what to do, appended to the message after a colon.

    Raises:
        TypeError: ``value`` is not a whole number (a float, a string, a bool, ...):
            ``"n_ops must be an int >= 1, got 2.5 (float)"``.
        ValueError: ``value`` is out of range: ``"n_ops must be >= 1, got 0"``.
    """
    if minimum is not None and maximum is not None:
        wanted = f"in {minimum}..{maximum}"
    elif minimum is not None:
        wanted = f">= {minimum}"
    elif maximum is not None:
        wanted = f"<= {maximum}"
    else:
        wanted = ""
    tail = f": {fix}" if fix else ""
    if not is_int(value):
        raise TypeError(f"{name} must be an int{' ' + wanted if wanted else ''}, got "
                        f"{value!r:.60} ({type(value).__name__}){tail}")
    if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        raise ValueError(f"{name} must be {wanted}, got {value}{tail}")
    return int(value)


def int_at_least(lo: int):
    """An ``argparse`` type: an int >= ``lo``, or the error argparse prints with usage."""
    import argparse

    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if v < lo:
            raise argparse.ArgumentTypeError(f"must be >= {lo}, got {v}")
        return v
    parse.__name__ = f"integer >= {lo}"
    return parse
