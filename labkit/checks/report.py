"""The reports of the checkers: :class:`CheckResult`, the one-line pass or fail, and the
hints in steps (:func:`hint`). Re-exported by :mod:`labkit.checks`.

:func:`fail`, :func:`passed`, :func:`learner_raised` and :func:`verdict` build a report by
hand; the checkers get theirs from :func:`labkit.checks.check` and
:func:`labkit.checks.run_check`, which use them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from labkit.checks.budget import LearnerTimeout
from labkit.checks.outputs import describe_exception

__all__ = ["PASS", "FAIL", "NOT_DONE", "CheckResult", "Reason", "hint", "fail", "passed",
           "learner_raised", "verdict"]

PASS = "✅"
FAIL = "❌"
NOT_DONE = "not done yet: fill in the cell marked YOUR CODE HERE"


@dataclass
class CheckResult:
    """What a check found. ``bool(result)`` is ``result.passed``."""

    name: str
    passed: bool
    message: str
    trials: int = 0  # trials that passed
    failed_trial: int | None = None  # 1-based
    kind: str = "ok"  # ok | mismatch | exception | not_implemented | checker_error | timeout
    details: dict = field(default_factory=dict)
    more_hints: list[str] = field(default_factory=list)  # next hints, most general first

    def __bool__(self) -> bool:
        return self.passed

    def __str__(self) -> str:
        return self.message

    def _ipython_display_(self) -> None:
        # check() already printed the message; as a cell's last value, show nothing more.
        pass


# --- hints in steps ----------------------------------------------------------------------

_last_failure: dict[str, Any] = {"result": None, "shown": 0, "passed": None}


def _remember(result: CheckResult, quiet: bool = True) -> None:
    """Keep a failed (or not done) result for :func:`hint`; a printed pass of the same
    exercise forgets it (its hints would be stale)."""
    if not result.passed:
        _last_failure.update(result=result, shown=0, passed=None)
    elif not quiet and _last_failure["result"] is not None \
            and _last_failure["result"].name == result.name:
        _last_failure.update(result=None, shown=0, passed=result.name)


def hint() -> None:
    """Print the next hint for the most recent failed check.

    Each call goes one step further; when the checker has nothing more to say, it says so.
    After a "not done yet" report it names the exercise and gives its first hint. It
    returns None, so that a notebook cell shows the hint once (not again as its value).
    """
    result = _last_failure["result"]
    if result is None and _last_failure["passed"]:
        text = (f"No failed check: {_last_failure['passed']} passed since its last failure, "
                f"so its hints are no longer needed.")
    elif result is None:
        text = "No failed check yet: run a checker first."
    elif result.kind == "not_implemented":
        todo = f"{result.name} is not done yet: fill in the cell marked YOUR CODE HERE"
        i = _last_failure["shown"]
        if not result.more_hints:
            text = f"{todo} first, then run its checker again."
        elif i >= len(result.more_hints):
            text = (f"No more hints for {result.name}: fill in the cell marked YOUR CODE "
                    f"HERE, then run its checker again.")
        else:
            _last_failure["shown"] = i + 1
            text = (f"{todo}, then run its checker again. "
                    f"hint {i + 1} of {len(result.more_hints)} for {result.name}: "
                    f"{result.more_hints[i]}")
    elif not result.more_hints:
        text = (f"No further hint for this failure of {result.name}: its message says what "
                "to change and where to look.")
    elif _last_failure["shown"] >= len(result.more_hints):
        text = (f"No more hints for {result.name}: "
                "compare your code with the lesson section it names.")
    else:
        i = _last_failure["shown"]
        _last_failure["shown"] = i + 1
        text = f"hint {i + 1} of {len(result.more_hints)} for {result.name}: {result.more_hints[i]}"
    print(text)


class Reason(str):
    """What a ``compare`` function found wrong, with the hints that belong to THAT mistake.

    A plain string works too; a ``Reason``'s ``hints`` replace the checker's general
    ``more_hints`` for this failure (most general first, never the answer first).
    """

    hints: list[str]

    def __new__(cls, text: str, hints: Sequence[str] = ()):
        self = super().__new__(cls, text)
        self.hints = list(hints)
        return self


def _with_hint_tail(message: str, more_hints: list[str] | None) -> str:
    if more_hints:
        message += "\n   (stuck? `labkit.checks.hint()` gives a further hint)"
    return message


def fail(name: str, message: str, *, more_hints: list[str] | None = None,
         kind: str = "mismatch", quiet: bool = False, **fields: Any) -> CheckResult:
    """Build, remember and print a failed :class:`CheckResult`: ``❌ name: message``.

    An untouched blank (``kind="not_implemented"``) gets no hint tail in its message
    (nothing was tried yet); its ``more_hints`` are kept for :func:`hint`, which names
    the exercise that is not done and gives the first one.
    """
    hints = list(more_hints or [])
    tail = hints if kind != "not_implemented" else None
    text = _with_hint_tail(f"{FAIL} {name}: {message}", tail)
    return _report(CheckResult(name, False, text, kind=kind, more_hints=hints, **fields), quiet)


def learner_raised(name: str, exc: BaseException, raised: str, *,
                   describe: Callable[[BaseException], str] | None = None,
                   more_hints: list[str] | None = None, B=None,
                   quiet: bool = False) -> CheckResult:
    """The :func:`fail` for an exception out of the learner's code.

    Args:
        name: the check's name.
        exc: what the learner's code raised. A ``NotImplementedError`` is the exercise's
            stub (``kind="not_implemented"``), a :class:`LearnerTimeout` says how long it
            ran (``kind="timeout"``); anything else is ``kind="exception"``.
        raised: the start of that last message, e.g. ``f"{where}: your code raised"``;
            ``describe(exc)`` (default :func:`describe_exception`) follows it.
        B: a backend to :func:`labkit.backend.recover` first (a capture left half-open).
    """
    if B is not None and not isinstance(exc, NotImplementedError):
        from labkit import backend
        backend.recover(B)
    if isinstance(exc, NotImplementedError):
        return fail(name, NOT_DONE, kind="not_implemented", more_hints=more_hints,
                    quiet=quiet)
    if isinstance(exc, LearnerTimeout):
        return fail(name, str(exc), kind="timeout", quiet=quiet)
    return fail(name, f"{raised} {(describe or describe_exception)(exc)}", kind="exception",
                more_hints=more_hints, quiet=quiet)


def verdict(name: str, ok: bool, message: str, **fields: Any) -> CheckResult:
    """:func:`passed` when ``ok``, else :func:`fail` (``more_hints``, ``kind`` go to it)."""
    if ok:
        fields.pop("more_hints", None)
        fields.pop("kind", None)
        return passed(name, message, **fields)
    return fail(name, message, **fields)


def passed(name: str, message: str, *, quiet: bool = False, **fields: Any) -> CheckResult:
    """Build and print a passed :class:`CheckResult`: ``✅ name: message``."""
    return _report(CheckResult(name, True, f"{PASS} {name}: {message}", **fields), quiet)


def _report(result: CheckResult, quiet: bool) -> CheckResult:
    _remember(result, quiet)
    if not quiet:
        print(result.message)
    return result
