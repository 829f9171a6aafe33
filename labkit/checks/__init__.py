"""Checkers for the exercises: this module owns the whole loop, the exercise modules declare.

Each lesson has a module ``labkit.checks.lessonNN`` with one ``check_<exercise>(fn)`` per
exercise::

    from labkit.checks.lesson00 import check_scale_and_shift
    check_scale_and_shift(scale_and_shift)
    # ✅ scale_and_shift: passed 3 random trials

An exercise module declares what is its own, as :mod:`labkit.core.rules` declares the
rules of capture in one table:

* an :class:`Exercise`: its name and its hints;
* its trials: ``make_inputs(gen)`` and the reference (or, for an exercise that builds and
  probes an object step by step, a ``body`` that returns the pass message);
* its judges: small predicates ``judge(expected, actual)`` that return a reason (a
  string, or a :class:`Reason` with the hints for that mistake) or None.

This module does the rest, the same way for every exercise:

* :func:`attempt` calls the learner's code: under a time budget (:func:`call_learner`:
  an endless loop gets "did not finish within 10 s" instead of a cell that never
  returns), the untouched stub (``NotImplementedError``) reported as :data:`NOT_DONE`,
  a timeout or an exception reported with the learner's line (never a bare traceback),
  a half-open capture recovered (:func:`labkit.backend.recover`). Nothing below
  ``labkit.checks`` wraps the learner's code in a ``try``: a failure travels as
  :class:`Rejected` (also what :func:`reject` raises for a judge's reason);
* :func:`check` runs the trials: fresh random inputs for every trial (seeded, so a
  failure can be reproduced), the reference and the learner on separate copies, the
  judges in order; :func:`run_check` runs a ``body`` once;
* the report: ONE line when all trials pass, or a short report of the first failure
  (which trial, what differs: type, shape, dtype, device, values with the largest
  absolute difference, and a hint). Both return a :class:`CheckResult`, truthy when the
  check passed, for tests and scripts.

Hints come in steps. A failure report names what is wrong and where to look; it never
starts with the answer. A checker may attach ``more_hints`` (each more specific than the
last); :func:`hint` prints the next one for the most recent failed check. A judge may
return a :class:`Reason` instead of a plain string: its ``hints`` then replace
``more_hints`` for that failure, so that the first hint is about the mistake seen. After a
"not done yet" report, :func:`hint` names the exercise and gives its first hint; a printed
✅ forgets that exercise's failure (a quiet pass, in a test or script, forgets nothing).

:func:`fail`, :func:`passed`, :func:`learner_raised` and :func:`verdict` are the older
hand-written form of the same reports, used by the checkers not yet declared this way
(issue #31 moves them one lesson at a time).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from labkit.checks.budget import DEFAULT_TIME_LIMIT, LearnerTimeout, call_learner
from labkit.checks.outputs import (  # noqa: F401 - re-exported, private ones: host_reads, lesson02
    _is_learner_frame,
    _is_notebook_frame,
    _type_name,
    compare_outputs,
    describe_exception,
    short_description,
)
from labkit.checks.report import (  # noqa: F401 - re-exported
    FAIL,
    NOT_DONE,
    PASS,
    CheckResult,
    Reason,
    _report,
    _with_hint_tail,
    fail,
    hint,
    learner_raised,
    passed,
    verdict,
)
from labkit.core.errors import capture_cause

__all__ = [
    "DEFAULT_TIME_LIMIT",
    "NOT_DONE",
    "CheckResult",
    "Exercise",
    "LearnerTimeout",
    "Reason",
    "Rejected",
    "attempt",
    "call_learner",
    "check",
    "compare_outputs",
    "describe_exception",
    "extra_probe",
    "short_description",
    "learner_raised",
    "outcome",
    "fail",
    "hint",
    "passed",
    "recovering",
    "reject",
    "run_check",
    "run_trials",
    "shown",
    "verdict",
]

# --- calling the learner's code ----------------------------------------------------------


class Rejected(Exception):
    """Ends a check with a failure: raised by :func:`reject` (a judge's reason) and by
    :func:`attempt` (the learner's code raised, timed out or is the untouched stub).

    Only this module catches it (:func:`check`, :func:`run_check`), so that no checker
    below ``labkit.checks`` needs a ``try`` around the learner's code.

    Args:
        reason: the report's text after ``name:`` (and, in :func:`check`, the trial).
        kind: ``mismatch``, ``exception``, ``timeout`` or ``not_implemented``
            (:attr:`CheckResult.kind`).
        hints: the hints for THIS failure (replace the exercise's ``more_hints``).
        details: kept in :attr:`CheckResult.details` by :func:`check` (``exception`` for
            a raise); :func:`run_check` reports the ``fields`` of :func:`reject` instead.
    """

    def __init__(self, reason: str, *, kind: str = "mismatch",
                 hints: Sequence[str] | None = None, details: dict | None = None):
        super().__init__(reason)
        self.reason, self.kind, self.details = reason, kind, dict(details or {})
        self.hints = list(hints) if hints is not None else (getattr(reason, "hints", None)
                                                            or None)
        self.fields: dict = {}  # CheckResult fields a reject() sets for run_check


def reject(reason: str, *, hints: Sequence[str] | None = None, kind: str = "mismatch",
           **fields: Any) -> None:
    """Fail the running check with ``reason`` (a judge's finding, or a :class:`Reason`);
    ``hints=[]`` gives none (``None``: the exercise's); ``fields`` (``trials``,
    ``failed_trial``, ``details``) go to :func:`run_check`'s :class:`CheckResult`."""
    rejected = Rejected(reason, hints=hints, kind=kind)
    rejected.fields = fields
    raise rejected


def _raised(exc: BaseException) -> str:
    return f"your code raised {describe_exception(exc)}"


def _rejected(text: str, kind: str, hints, exc: BaseException | None) -> Rejected:
    """The :class:`Rejected` of an :func:`attempt`: ``hints`` a list, or a function of
    the report's text."""
    if callable(hints):
        hints = hints(text)
    return Rejected(text, kind=kind, hints=hints,
                    details={"exception": exc} if exc is not None else None)


def _labelled(at: str, reason: str) -> str:
    """``at + reason``, a :class:`Reason`'s hints kept."""
    if not at:
        return reason
    return Reason(at + reason, reason.hints) if isinstance(reason, Reason) else at + reason


def _any_stub(exc: BaseException) -> bool:
    return True


def attempt(fn: Callable, args: Sequence = (), kwargs: dict | None = None, *,
            time_limit: float | None = None, B=None, always_recover: bool = False,
            on_error: Callable[[], Any] | None = None,
            explain: Callable[[BaseException], str | None] | None = None,
            reason: Callable[[BaseException], str] = _raised, kind: str = "exception",
            not_done: bool = True, stub: Callable[[BaseException], bool] = _any_stub,
            passthrough: tuple[type[BaseException], ...] = (), label: str = "",
            label_errors: bool = True,
            hints: Sequence[str] | Callable[[str], list[str]] | None = None) -> Any:
    """``fn(*args, **kwargs)``: the learner's code, called the one way checkers call it.

    Whatever goes wrong ends the check as a :class:`Rejected`, in this order: a
    :class:`LearnerTimeout` (``time_limit``, :func:`call_learner`) says how long it ran;
    an exception ``explain(exc)`` names is that mistake (``kind="mismatch"``); the
    untouched stub (a ``NotImplementedError``, also when a failed capture wraps it) is
    ``NOT_DONE``; any other ``Exception`` is ``reason(exc)`` (default: "your code raised"
    and :func:`describe_exception`) with ``kind``.

    Args:
        B: a backend to :func:`labkit.backend.recover` after a failure (a capture left
            half-open), or after every call with ``always_recover``.
        on_error: called after a failure (also a ``BaseException``), before ``B`` is
            recovered: e.g. ending a capture the checker began.
        not_done: False when ``fn`` is not the exercise's own function (a stub raised
            there is an ordinary error).
        stub: which ``NotImplementedError`` is the exercise's stub (default: any; lesson
            03: one without a message, torch's own has one).
        passthrough: exceptions that go on as they are, to an :func:`attempt` further out
            (a :class:`Rejected` always does).
        label: where in the check this call is (``"trial 2 of 5"``): it starts the
            reason of a timeout or an error (``label: reason``), not ``NOT_DONE``;
            with ``label_errors=False`` a timeout's only (``reason`` names the place).
        hints: the hints of a timeout or an error here (default: the exercise's), or a
            function of the report's text that returns them.

    .. warning::
        A ``BaseException`` (``KeyboardInterrupt``, an outer time budget running out)
        passes through, after ``on_error`` and the recovery: only the outermost budget
        turns into a timeout.
    """
    failed = True
    try:
        value = call_learner(fn, *args, time_limit=time_limit, **(kwargs or {}))
        failed = False
        return value
    except Rejected:
        failed = False              # the attempt that raised it has cleaned up
        raise
    except passthrough:
        raise
    except Exception as exc:
        root = capture_cause(exc)
        at = f"{label}: " if label else ""
        if isinstance(root, LearnerTimeout):
            raise _rejected(f"{at}{root}", "timeout", hints, None) from None
        at = at if label_errors else ""
        named = explain(exc) if explain is not None else None
        if named:
            raise _rejected(_labelled(at, named), "mismatch", hints, exc) from None
        if not_done and isinstance(root, NotImplementedError) and stub(root):
            raise Rejected(NOT_DONE, kind="not_implemented") from None
        raise _rejected(_labelled(at, reason(exc)), kind, hints, exc) from None
    finally:
        if failed and on_error is not None:
            on_error()
        if B is not None and (failed or always_recover):
            from labkit import backend
            backend.recover(B)


def outcome(fn: Callable, args: Sequence = (), *, time_limit: float | None = None,
            label: str = "", hints: Sequence[str] | None = None,
            **fields: Any) -> tuple[str, Any]:
    """The learner's answer where raising is one of the answers (an oversize batch must
    raise): ``("value", v)`` or ``("raised", exc)``, for the judges to weigh.

    The stub (``NOT_DONE``) and a timeout (``label: ...``, with ``hints`` and ``fields``)
    still end the check, as in :func:`attempt`.
    """
    try:
        return "value", attempt(fn, args, time_limit=time_limit, label=label, hints=hints,
                                kind="raised", reason=lambda exc: "")   # judged by the caller
    except Rejected as r:
        if r.kind == "raised":
            return "raised", r.details["exception"]
        if r.kind == "timeout":
            r.fields.update(fields)
        raise


def extra_probe(fn: Callable, args: Sequence = (), *, B=None, default: Any = None) -> Any:
    """``fn(*args)``, a probe of the learner's object that decides nothing by itself: when
    it raises, ``default`` (and ``B`` recovered), as if the probe had found nothing; a
    :class:`LearnerTimeout` or a :class:`Rejected` (a judge's, a stub's) still ends the
    check.

    .. warning::
        Only for a probe whose finding is extra (the probes before it decide); a probe
        that can reject goes through :func:`attempt`.
    """
    try:
        return fn(*args)
    except (LearnerTimeout, Rejected):
        raise
    except Exception:  # noqa: BLE001 - extra: the probes that decide have run
        if B is not None:
            from labkit import backend
            backend.recover(B)
        return default


@contextlib.contextmanager
def recovering(B):
    """A block of the learner's code that :func:`attempt` (further out) reports: when it
    raises anything, ``B`` is recovered (:func:`labkit.backend.recover`) first.

    For a capture the checker opens around the learner's code (``with recovering(E),
    E.graph(g):``): the graph's own exit runs first, then the recovery, then the error
    goes on to the ``attempt`` that names it.
    """
    try:
        yield
    except BaseException:
        from labkit import backend
        backend.recover(B)
        raise


# --- the two loops: one run, or trials against a reference ----------------------------


def run_check(name: str, body: Callable[[], str], *, more_hints: Sequence[str] | None = None,
              quiet: bool = False, trials: int = 0) -> CheckResult:
    """Run a checker's ``body()``: it returns the pass message, or ends in a :class:`Rejected`.

    The shape of the checkers that build, run and probe the learner's object step by step
    (lessons 03-09): ``body`` calls the learner's code through :func:`attempt` and its
    judges through :func:`reject`. A failure carries its own hints (:func:`reject`'s,
    :func:`attempt`'s) or, without, ``more_hints``; a timeout without hints of its own
    carries none (it names the loop). A pass records ``trials`` (those the body ran).
    """
    try:
        message = body()
    except Rejected as r:
        hints = r.hints if r.hints is not None else (
            [] if r.kind == "timeout" else list(more_hints or []))
        return fail(name, r.reason, kind=r.kind, more_hints=hints, quiet=quiet, **r.fields)
    return passed(name, message, quiet=quiet, trials=trials)


def run_trials(name: str, trials: int, one_trial: Callable[[int, torch.Generator], None], *,
               seed: Callable[[int], int] = lambda trial: trial, B=None,
               more_hints: Sequence[str] = (), quiet: bool = False,
               reason: Callable[[BaseException], str] = _raised,
               stub: Callable[[BaseException], bool] = _any_stub) -> CheckResult:
    """Run ``one_trial(trial, gen)`` for each trial, through one :func:`attempt`.

    The shape of the checkers that probe the learner's object step by step, trial by
    trial (lesson 03): each trial gets ``gen`` seeded with ``seed(trial)`` and the global
    torch RNG seeded with ``trial``; it returns nothing when it sees nothing wrong,
    :func:`reject` s with a reason, or calls the learner through :func:`attempt`.
    Anything else it raises is ``reason(exc)``, ``B`` recovered. The report names the
    trial (``trial 2 of 3: ...``); a stub's is :data:`NOT_DONE`.
    """
    for trial in range(1, trials + 1):
        gen = _generator(seed(trial))
        torch.manual_seed(trial)
        try:
            attempt(one_trial, (trial, gen), B=B, reason=reason, stub=stub)
        except Rejected as r:
            fields = dict(trials=trial - 1, failed_trial=trial, quiet=quiet)
            if r.kind == "not_implemented":
                return fail(name, NOT_DONE, kind=r.kind, more_hints=list(more_hints),
                            **fields)
            hints = [] if r.kind == "timeout" else (r.hints or list(more_hints))
            details = r.details if r.kind == "exception" else {}
            return fail(name, f"trial {trial} of {trials}: {r.reason}", kind=r.kind,
                        more_hints=hints, details=details, **fields)
    plural = "trial" if trials == 1 else "trials"
    return passed(name, f"passed {trials} random {plural}", quiet=quiet, trials=trials)


def shown(body: Callable[[], Any], *, name: str, label: str) -> Any:
    """For a notebook helper that shows something rather than checks it: ``body()``'s
    value, or None after one ``❌`` line when it is rejected (``❌ name: not done yet...``
    for the stub, ``❌ label: reason`` otherwise). Nothing is kept for :func:`hint`."""
    try:
        return body()
    except Rejected as r:
        print(f"{FAIL} {name if r.kind == 'not_implemented' else label}: {r.reason}")
        return None


@dataclass(frozen=True)
class Exercise:
    """An exercise as its checker declares it, once, at the top of its module.

    Args:
        name: what every report of it starts with (``❌ name: ...``).
        hint: the line under a failed trial (:meth:`check` only).
        more_hints: what :func:`hint` gives, one step at a time, most general first.
    """

    name: str
    hint: str | None = None
    more_hints: tuple[str, ...] = ()

    def check(self, learner_fn: Callable, reference_fn: Callable,
              make_inputs: Callable[[torch.Generator], Any], **options: Any) -> CheckResult:
        """:func:`check` with this exercise's name and hints."""
        return check(learner_fn, reference_fn, make_inputs, name=self.name, hint=self.hint,
                     more_hints=self.more_hints, **options)

    def run(self, body: Callable[[], str], *, quiet: bool = False) -> CheckResult:
        """:func:`run_check` with this exercise's name and hints."""
        return run_check(self.name, body, more_hints=self.more_hints, quiet=quiet)


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


def first_reason(judges: Sequence[Callable[[Any, Any], str | None]], expected: Any,
                 actual: Any) -> str | None:
    """The first judge's reason that is not None: judges run in order, most basic first."""
    for judge in judges:
        reason = judge(expected, actual)
        if reason:
            return reason
    return None


def _trial_failure(name: str, r: Rejected, trial: int, trials: int, hint_line: str,
                   hints: list[str]) -> CheckResult:
    """The report of trial ``trial``'s :class:`Rejected`."""
    fields = dict(trials=trial - 1, failed_trial=trial, kind=r.kind, details=r.details)
    if r.kind == "not_implemented":
        return CheckResult(name, False, f"{FAIL} {name}: {NOT_DONE}", more_hints=hints, **fields)
    seen = list(r.hints or hints)
    tail = "" if r.kind == "timeout" else hint_line
    msg = f"{FAIL} {name}: trial {trial} of {trials}: {r.reason}{tail}"
    return CheckResult(name, False, _with_hint_tail(msg, seen), more_hints=seen, **fields)


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
    judges: Sequence[Callable[[Any, Any], str | None]] = (),
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

    ``judges``: predicates ``judge(expected, actual)`` returning ``None`` when they see
    nothing wrong, else a one-line reason (a :class:`Reason` brings the hints for that
    mistake, used instead of ``more_hints``); the first reason wins. ``compare`` is one
    judge; without either, :func:`compare_outputs` with ``rtol``/``atol``. The learner's
    side may end a trial itself with :func:`reject` or :func:`attempt`.

    ``hint`` is shown with a failure; ``more_hints`` are kept for :func:`hint`, one step
    at a time. Each call of ``learner_fn`` runs under ``time_limit`` seconds
    (:func:`call_learner`).

    Prints one line (pass) or a short report (fail) unless ``quiet``; returns a
    :class:`CheckResult`.
    """
    name = name or getattr(reference_fn, "__name__", "check")
    judges = (compare,) if compare else tuple(judges) or (
        lambda e, a: compare_outputs(e, a, rtol=rtol, atol=atol),)
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
        details = {"expected": expected, "actual": None, "inputs": (l_args, l_kwargs)}
        try:
            actual = attempt(learner_fn, l_args, l_kwargs, time_limit=time_limit)
        except Rejected as r:
            if r.kind == "mismatch":  # a reject() on the learner's side
                r.details = details
            return _report(_trial_failure(name, r, trial, trials, hint_line, hints), quiet)
        reason = first_reason(judges, expected, actual)
        if reason:
            r = Rejected(reason, details=dict(details, actual=actual))
            return _report(_trial_failure(name, r, trial, trials, hint_line, hints), quiet)

    plural = "trial" if trials == 1 else "trials"
    msg = f"{PASS} {name}: passed {trials} random {plural}"
    return _report(CheckResult(name, True, msg, trials=trials), quiet)
