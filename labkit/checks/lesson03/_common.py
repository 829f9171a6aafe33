"""Helpers shared by lesson 03's checkers: one failed trial as an exception
(:class:`_Failure`), the learner's error with its line, the trial loop that turns what
goes wrong into one report, and a random int.
"""

from __future__ import annotations

import linecache
import os
import traceback
from typing import Callable

import torch

from labkit.backend import recover as _recover
from labkit.checks import NOT_DONE, LearnerTimeout, _generator, fail, passed
from labkit.core.errors import exception_chain, in_library
from labkit.core.validate import check_int


class _Failure(Exception):
    """One trial failed: ``message`` names the mistake, ``more_hints`` go further."""

    def __init__(self, message: str, more_hints: list[str] | None = None):
        super().__init__(message)
        self.message = message
        self.more_hints = list(more_hints or [])


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


def _run(name: str, trials: int, one_trial: Callable[[int, torch.Generator], None], *,
         quiet: bool, explain: Callable[[BaseException], _Failure] | None = None,
         B=None):
    """Run ``one_trial(trial, gen)`` for each trial; turn what goes wrong into one report."""
    check_int("trials", trials, 1, fix="a checker passes only after at least one trial")
    for trial in range(1, trials + 1):
        gen = _generator(1000 * trial + 3)
        torch.manual_seed(trial)
        try:
            one_trial(trial, gen)
        except NotImplementedError as exc:
            if str(exc):      # torch's own (an op a device lacks), not the blank's stub
                return fail(name, f"trial {trial} of {trials}: your code raised "
                            f"{_learner_error(exc)}", kind="exception", quiet=quiet,
                            trials=trial - 1, failed_trial=trial)
            return fail(name, NOT_DONE, kind="not_implemented", quiet=quiet,
                        trials=trial - 1, failed_trial=trial)
        except _Failure as f:
            return fail(name, f"trial {trial} of {trials}: {f.message}",
                        more_hints=f.more_hints, quiet=quiet, trials=trial - 1,
                        failed_trial=trial)
        except LearnerTimeout as exc:
            if B is not None:
                _recover(B)
            return fail(name, f"trial {trial} of {trials}: {exc}", kind="timeout",
                        quiet=quiet, trials=trial - 1, failed_trial=trial)
        except Exception as exc:  # the learner's code raised
            if B is not None:
                _recover(B)
            f = explain(exc) if explain is not None else None
            if f is None:
                f = _Failure(f"your code raised {_learner_error(exc)}")
            return fail(name, f"trial {trial} of {trials}: {f.message}",
                        more_hints=f.more_hints, kind="exception", quiet=quiet,
                        trials=trial - 1, failed_trial=trial, details={"exception": exc})
    plural = "trial" if trials == 1 else "trials"
    return passed(name, f"passed {trials} random {plural}", quiet=quiet, trials=trials)


def _rand_int(gen, lo, hi) -> int:
    return int(torch.randint(lo, hi + 1, (), generator=gen))
