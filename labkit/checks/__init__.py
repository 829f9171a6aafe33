"""Checkers for the exercises: run the learner's function against the reference.

Each lesson has a module ``labkit.checks.lessonNN`` with one ``check_<exercise>(fn)`` per
exercise; they are thin wrappers around :func:`check`::

    from labkit.checks.lesson00 import check_scale_and_shift
    check_scale_and_shift(scale_and_shift)
    # ✅ scale_and_shift: passed 3 random trials

:func:`check` builds fresh random inputs for every trial (seeded, so a failure can be
reproduced), calls the reference and the learner's function on separate copies, compares
the results and prints ONE line when all trials pass, or a short report of the first
failure: which trial, what differs (type, shape, dtype, device, values with the largest
absolute difference) and a hint. An exception raised by the learner's code is never shown
as a bare traceback: the report names the exception, its message and the learner's line.

It returns a :class:`CheckResult`, truthy when the check passed, for tests and scripts.

Hints come in steps. A failure report names what is wrong and where to look; it never
starts with the answer. A checker may attach ``more_hints`` (each more specific than the
last); :func:`hint` prints the next one for the most recent failed check. A ``compare``
function may return a :class:`Reason` instead of a plain string: its ``hints`` then replace
``more_hints`` for that failure, so that the first hint is about the mistake seen. After a
"not done yet" report, :func:`hint` names the exercise and gives its first hint; a printed
✅ forgets that exercise's failure (a quiet pass, in a test or script, forgets nothing).

Learner code runs under a time budget (:func:`call_learner`): an endless loop gets a
verdict ("did not finish within 10 s") instead of a cell that never returns.
"""

from __future__ import annotations

import linecache
import math
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from labkit.core.errors import in_library
from labkit.core.signature import fmt_shape

__all__ = [
    "DEFAULT_TIME_LIMIT",
    "CheckResult",
    "LearnerTimeout",
    "Reason",
    "call_learner",
    "check",
    "compare_outputs",
    "describe_exception",
    "short_description",
    "learner_raised",
    "fail",
    "hint",
    "passed",
    "verdict",
]

PASS = "✅"
FAIL = "❌"
NOT_DONE = "not done yet: fill in the cell marked YOUR CODE HERE"
DEFAULT_TIME_LIMIT = 10.0  # seconds a learner's function may run in one trial
_ALARM_REPEAT_S = 0.25     # after the budget, the timeout is raised again this often


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


# --- the time budget -----------------------------------------------------------------------


class _Deadline(BaseException):
    """Raised into the learner's code when its budget is spent. A ``BaseException``, like
    ``KeyboardInterrupt``, so that library ``except Exception`` blocks do not swallow it;
    :func:`call_learner` turns it into :class:`LearnerTimeout` for the checkers."""


class LearnerTimeout(Exception):
    """The learner's code did not finish within its time budget."""

    def __init__(self, seconds: float, fn_name: str = "your function"):
        self.seconds = seconds
        super().__init__(
            f"{fn_name} did not finish within {seconds:g} s: look for a loop that never ends "
            f"(a `while` whose condition never changes, or a loop over a list you keep "
            f"appending to)"
        )


def call_learner(fn: Callable, *args: Any, time_limit: float | None = DEFAULT_TIME_LIMIT,
                 **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)``, stopped with :class:`LearnerTimeout` after ``time_limit`` s.

    On the main thread (where a notebook cell runs) the budget is a ``SIGALRM`` timer; on
    other threads a trace function checks the clock. ``None`` or ``0`` means no limit.

    .. warning::
        A loop inside one long torch call is interrupted only when it returns to Python.
        If the budget runs out inside a capture, the capture is abandoned like any other
        failed capture: call :func:`labkit.backend.recover` afterwards (the checkers do).
    """
    name = getattr(fn, "__name__", "your function")
    if not time_limit:
        return fn(*args, **kwargs)
    if threading.current_thread() is threading.main_thread() and hasattr(signal, "setitimer"):
        active = [True]

        def _alarm(signum, frame):
            if active[0]:
                raise _Deadline

        old = signal.signal(signal.SIGALRM, _alarm)
        # the timer repeats: code that catches even a BaseException cannot keep an
        # endless loop alive for long
        signal.setitimer(signal.ITIMER_REAL, time_limit, _ALARM_REPEAT_S)
        try:
            return fn(*args, **kwargs)
        except _Deadline:
            raise LearnerTimeout(time_limit, name) from None
        finally:
            while True:         # an alarm landing in here must not skip the clean-up
                try:
                    active[0] = False
                    signal.setitimer(signal.ITIMER_REAL, 0)
                    signal.signal(signal.SIGALRM, old)
                    break
                except _Deadline:
                    continue
    deadline = time.monotonic() + time_limit

    def _trace(frame, event, arg):
        if time.monotonic() > deadline:
            raise _Deadline
        return _trace

    old_trace = sys.gettrace()
    sys.settrace(_trace)
    try:
        return fn(*args, **kwargs)
    except _Deadline:
        raise LearnerTimeout(time_limit, name) from None
    finally:
        sys.settrace(old_trace)


# --- comparing outputs -----------------------------------------------------------------


def _type_name(x: Any) -> str:
    if isinstance(x, torch.Tensor):
        return "a torch.Tensor"
    if x is None:
        return "None"
    return f"a {type(x).__name__}"


def _compare_tensors(expected: torch.Tensor, actual: torch.Tensor, where: str,
                     rtol: float, atol: float) -> str | None:
    if tuple(actual.shape) != tuple(expected.shape):
        return f"{where}shape: expected {fmt_shape(expected.shape)}, got {fmt_shape(actual.shape)}"
    if actual.dtype != expected.dtype:
        return f"{where}dtype: expected {expected.dtype}, got {actual.dtype}"
    if actual.device != expected.device:
        return f"{where}device: expected {expected.device}, got {actual.device}"
    e = expected.detach().cpu()
    a = actual.detach().cpu()
    if e.numel() == 0:
        return None
    if e.is_floating_point() or e.is_complex():
        close = torch.isclose(a, e, rtol=rtol, atol=atol, equal_nan=True)
    else:
        close = a == e
    if bool(close.all()):
        return None
    bad = ~close
    n_bad = int(bad.sum())
    if e.dtype == torch.bool:
        diff = (a != e).to(torch.float64)
    else:
        diff = (a.to(torch.float64) - e.to(torch.float64)).abs()
        diff = torch.where(torch.isnan(diff), torch.full_like(diff, math.inf), diff)
    diff = torch.where(bad, diff, torch.zeros_like(diff))
    flat = int(diff.reshape(-1).argmax())
    idx = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), e.shape)) if e.dim() else ()
    ev, av = e.reshape(-1)[flat].item(), a.reshape(-1)[flat].item()
    at = f" at index {idx}" if idx else ""
    return (
        f"{where}values differ: max abs diff {diff.reshape(-1)[flat].item():.4g}{at} "
        f"(expected {ev:.6g}, got {av:.6g}); {n_bad} of {e.numel()} elements differ"
    )


def compare_outputs(expected: Any, actual: Any, *, rtol: float = 1e-5, atol: float = 1e-6,
                    where: str = "") -> str | None:
    """``None`` when ``actual`` matches ``expected``, else one line saying what differs.

    Tensors are compared by shape, dtype, device, then values (``torch.isclose``); tuples,
    lists and dicts element by element; other values with ``==`` (floats with tolerance).
    """
    if isinstance(expected, torch.Tensor):
        if not isinstance(actual, torch.Tensor):
            hint = " (did you forget `return`?)" if actual is None else ""
            return f"{where}expected a torch.Tensor, got {_type_name(actual)}{hint}"
        return _compare_tensors(expected, actual, where, rtol, atol)
    if isinstance(expected, Mapping):
        if not isinstance(actual, Mapping):
            return f"{where}expected a dict, got {_type_name(actual)}"
        if set(expected) != set(actual):
            want, got = sorted(map(str, expected)), sorted(map(str, actual))
            return f"{where}keys: expected {want}, got {got}"
        for k in expected:
            msg = compare_outputs(expected[k], actual[k], rtol=rtol, atol=atol,
                                  where=f"{where}[{k!r}] ")
            if msg:
                return msg
        return None
    if isinstance(expected, Sequence) and not isinstance(expected, str):
        if not isinstance(actual, Sequence) or isinstance(actual, str):
            return f"{where}expected {_type_name(expected)}, got {_type_name(actual)}"
        if len(actual) != len(expected):
            return f"{where}length: expected {len(expected)}, got {len(actual)}"
        for i, (e, a) in enumerate(zip(expected, actual)):
            msg = compare_outputs(e, a, rtol=rtol, atol=atol, where=f"{where}[{i}] ")
            if msg:
                return msg
        return None
    if isinstance(expected, float) and isinstance(actual, (int, float)):
        if math.isclose(actual, expected, rel_tol=rtol, abs_tol=atol) or (
            math.isnan(expected) and math.isnan(actual)
        ):
            return None
        return f"{where}value: expected {expected!r}, got {actual!r}"
    if actual != expected:
        if type(actual) is not type(expected):
            return (f"{where}expected {_type_name(expected)} {expected!r}, "
                    f"got {_type_name(actual)} {actual!r}")
        return f"{where}value: expected {expected!r}, got {actual!r}"
    return None


# --- exceptions --------------------------------------------------------------------------


def _is_learner_frame(filename: str) -> bool:
    """Not labkit's own code (checkers, engines, the emulator) and not torch's."""
    return not in_library(filename)


def _is_notebook_frame(filename: str) -> bool:
    return filename.startswith(("<ipython-input", "<cell")) or "ipykernel_" in filename


def describe_exception(exc: BaseException) -> str:
    """``TypeError: message`` plus the learner's line that raised it, for a report."""
    text = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    frames = traceback.extract_tb(exc.__traceback__)
    # Prefer the deepest frame in a notebook cell; else the deepest frame outside
    # labkit.checks and torch.
    pick = None
    for fr in frames:
        if _is_notebook_frame(fr.filename):
            pick = fr
    if pick is None:
        for fr in frames:
            if _is_learner_frame(fr.filename):
                pick = fr
    if pick is None:
        return text
    line = (pick.line or linecache.getline(pick.filename, pick.lineno)).strip()
    where = "your cell" if _is_notebook_frame(pick.filename) else os.path.basename(pick.filename)
    loc = f"line {pick.lineno} of {where}"
    if pick.name != "<module>":
        loc += f" (in {pick.name})"
    return f"{text}\n   at {loc}: {line}" if line else f"{text}\n   at {loc}"


_CUDA_BOILERPLATE = ("Search for `cuda", "CUDA kernel errors might be asynchronously",
                     "For debugging consider passing CUDA_LAUNCH_BLOCKING",
                     "Compile with `TORCH_USE_CUDA_DSA`")


def short_description(exc: BaseException) -> str:
    """:func:`describe_exception` of the error a failed capture started with, without
    CUDA's boilerplate lines (where to search, how to debug)."""
    from labkit.core.errors import capture_cause

    text = describe_exception(capture_cause(exc))
    return "\n".join(ln for ln in text.split("\n")
                     if ln.strip() and not ln.startswith(_CUDA_BOILERPLATE))


# --- the checker ---------------------------------------------------------------------------


def _as_call(inputs: Any) -> tuple[tuple, dict]:
    if isinstance(inputs, dict):
        return (), dict(inputs)
    if isinstance(inputs, tuple):
        return inputs, {}
    return (inputs,), {}


def _generator(seed: int) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(seed)
    return g


def _report(result: CheckResult, quiet: bool) -> CheckResult:
    _remember(result, quiet)
    if not quiet:
        print(result.message)
    return result


def check(
    learner_fn: Callable,
    reference_fn: Callable,
    make_inputs: Callable[[torch.Generator], Any],
    *,
    trials: int = 3,
    name: str | None = None,
    hint: str | None = None,
    more_hints: Sequence[str] | None = None,
    compare: Callable[[Any, Any], str | None] | None = None,
    seed: int = 0,
    rtol: float = 1e-5,
    atol: float = 1e-6,
    quiet: bool = False,
    time_limit: float | None = DEFAULT_TIME_LIMIT,
) -> CheckResult:
    """Run ``learner_fn`` against ``reference_fn`` on ``trials`` fresh random inputs.

    ``make_inputs(gen)`` gets a ``torch.Generator`` seeded with ``seed + trial`` and returns
    the arguments: a tuple (positional), a dict (keyword) or a single value. It is called
    twice per trial with the same seed, so the reference and the learner get separate but
    identical inputs (an in-place change by one cannot leak into the other); the global
    torch RNG is seeded the same way before each call.

    ``compare(expected, actual)`` returns ``None`` when they match, else a one-line reason
    (default: :func:`compare_outputs` with ``rtol``/``atol``); a :class:`Reason` brings
    the hints for that mistake, used instead of ``more_hints``.

    ``hint`` is shown with a failure; ``more_hints`` are kept for :func:`hint`, one step
    at a time. Each call of ``learner_fn`` runs under ``time_limit`` seconds
    (:func:`call_learner`).

    Prints one line (pass) or a short report (fail) unless ``quiet``; returns a
    :class:`CheckResult`.
    """
    name = name or getattr(reference_fn, "__name__", "check")
    compare = compare or (lambda e, a: compare_outputs(e, a, rtol=rtol, atol=atol))
    hint_line = f"\n   hint: {hint}" if hint else ""
    hints = list(more_hints or [])

    if not callable(learner_fn):
        msg = f"{FAIL} {name}: expected a function, got {_type_name(learner_fn)}"
        return _report(CheckResult(name, False, msg + hint_line, kind="mismatch"), quiet)

    for trial in range(1, trials + 1):
        trial_seed = seed + trial
        try:
            args, kwargs = _as_call(make_inputs(_generator(trial_seed)))
            torch.manual_seed(trial_seed)
            expected = reference_fn(*args, **kwargs)
            l_args, l_kwargs = _as_call(make_inputs(_generator(trial_seed)))
        except Exception as exc:  # a bug in the checker, not in the learner's code
            msg = (f"{FAIL} {name}: the checker itself failed (not your fault): "
                   f"{type(exc).__name__}: {exc}")
            return _report(CheckResult(name, False, msg, trials=trial - 1, failed_trial=trial,
                                       kind="checker_error"), quiet)

        torch.manual_seed(trial_seed)
        try:
            actual = call_learner(learner_fn, *l_args, time_limit=time_limit, **l_kwargs)
        except NotImplementedError:
            msg = f"{FAIL} {name}: {NOT_DONE}"
            return _report(CheckResult(name, False, msg, trials=trial - 1, failed_trial=trial,
                                       kind="not_implemented", more_hints=hints), quiet)
        except LearnerTimeout as exc:
            msg = _with_hint_tail(f"{FAIL} {name}: trial {trial} of {trials}: {exc}", hints)
            return _report(CheckResult(name, False, msg, trials=trial - 1, failed_trial=trial,
                                       kind="timeout", more_hints=hints), quiet)
        except Exception as exc:
            desc = describe_exception(exc)
            msg = f"{FAIL} {name}: trial {trial} of {trials}: your code raised {desc}{hint_line}"
            return _report(CheckResult(name, False, _with_hint_tail(msg, hints),
                                       trials=trial - 1, failed_trial=trial, kind="exception",
                                       details={"exception": exc}, more_hints=hints), quiet)

        reason = compare(expected, actual)
        if reason:
            seen = list(getattr(reason, "hints", None) or hints)
            msg = f"{FAIL} {name}: trial {trial} of {trials}: {reason}{hint_line}"
            return _report(CheckResult(name, False, _with_hint_tail(msg, seen),
                                       trials=trial - 1, failed_trial=trial, kind="mismatch",
                                       details={"expected": expected, "actual": actual,
                                                "inputs": (l_args, l_kwargs)},
                                       more_hints=seen), quiet)

    plural = "trial" if trials == 1 else "trials"
    msg = f"{PASS} {name}: passed {trials} random {plural}"
    return _report(CheckResult(name, True, msg, trials=trials), quiet)
