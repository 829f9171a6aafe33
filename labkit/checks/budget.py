"""The time budget of the learner's code: :func:`call_learner` stops an endless loop.

Re-exported by :mod:`labkit.checks`, whose checkers run every learner call under it.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["DEFAULT_TIME_LIMIT", "LearnerTimeout", "call_learner", "one_thread"]

DEFAULT_TIME_LIMIT = 10.0  # seconds a learner's function may run in one trial
_ALARM_REPEAT_S = 0.25     # after the budget, the timeout is raised again this often


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


@contextlib.contextmanager
def one_thread(device="cpu"):
    """One intra-op thread while a checker runs on the CPU (on host tensors, or on the
    emulated device, whose data lives in host memory; labkit's only other device is
    CUDA): its tensors are tiny, and two threads make each op several times slower (more
    so on a busy machine)."""
    if torch.device(device).type == "cuda":
        yield
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
