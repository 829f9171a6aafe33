"""Helpers shared by lesson 03's checkers: the learner's error with its line, the trial
loop (:func:`labkit.checks.run_trials`, seeded as lesson 03 seeds it), and a random int.
"""

from __future__ import annotations

import linecache
import os
import traceback
from typing import Callable

import torch

from labkit.checks import (
    Reason,
    _generator,  # noqa: F401 - tests seed trials with it
    run_trials,
)
from labkit.core.errors import exception_chain, in_library
from labkit.core.validate import check_int


def _learner_error(exc: BaseException) -> str:
    """The root cause of ``exc`` (a failed capture raises twice), with the learner's line.

    ``TypeError: message`` and ``at line N of your cell: code``: the first line of the
    deepest error in the chain, at the deepest frame outside labkit and torch.
    """
    root = exception_chain(exc)[0]
    first = str(root).splitlines()[0] if str(root) else ""
    text = f"{type(root).__name__}: {first}" if first else type(root).__name__
    pick = None
    for tb_exc in (root, exc):
        for fr in traceback.extract_tb(tb_exc.__traceback__):
            if not in_library(fr.filename):
                pick = fr
        if pick is not None:
            break
    if pick is None:
        return text
    cell = pick.filename.startswith(("<ipython-input", "<cell")) \
        or "ipykernel_" in pick.filename
    where = "your cell" if cell else os.path.basename(pick.filename)
    loc = f"line {pick.lineno} of {where}"
    if pick.name != "<module>":
        loc += f" (in {pick.name})"
    line = (pick.line or linecache.getline(pick.filename, pick.lineno)).strip()
    return f"{text}\n   at {loc}: {line}" if line else f"{text}\n   at {loc}"


def _stub(exc: BaseException) -> bool:
    """The blank's stub raises a bare ``NotImplementedError``; torch's own (an op a device
    lacks) has a message, and is reported as an error."""
    return not str(exc)


def _explained(explain: Callable[[BaseException], Reason | None] | None):
    """The report of an error out of a trial: ``explain(exc)`` (a mistake the exercise
    names, with its hints) or the error with the learner's line."""
    def reason(exc: BaseException) -> Reason:
        named = explain(exc) if explain is not None and \
            not isinstance(exc, NotImplementedError) else None
        return named or Reason(f"your code raised {_learner_error(exc)}")
    return reason


def _run(name: str, trials: int, one_trial: Callable[[int, torch.Generator], None], *,
         quiet: bool, explain: Callable[[BaseException], Reason | None] | None = None,
         B=None):
    """:func:`labkit.checks.run_trials` as lesson 03's checkers run it: trial ``t``'s
    generator seeded with ``1000 * t + 3``, a bare ``NotImplementedError`` the stub."""
    check_int("trials", trials, 1, fix="a checker passes only after at least one trial")
    return run_trials(name, trials, one_trial, seed=lambda trial: 1000 * trial + 3, B=B,
                      quiet=quiet, reason=_explained(explain), stub=_stub)


def _rand_int(gen, lo, hi) -> int:
    return int(torch.randint(lo, hi + 1, (), generator=gen))
