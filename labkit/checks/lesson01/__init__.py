"""Checkers for lesson 01 (launch-bound timeline), one module per exercise, each checked
against :mod:`labkit.timeline`:

* :mod:`.simulate_launch_bound`: ``check_simulate_launch_bound``;
* :mod:`.chrome_trace_events`: ``check_chrome_trace_events``.

:mod:`._common` holds what both share.
"""

from labkit.checks.lesson01.chrome_trace_events import (  # noqa: F401 - _trace_problem: tests
    _trace_problem,
    check_chrome_trace_events,
)
from labkit.checks.lesson01.simulate_launch_bound import LESSON_GAP_US, check_simulate_launch_bound

__all__ = ["check_simulate_launch_bound", "check_chrome_trace_events", "LESSON_GAP_US"]
