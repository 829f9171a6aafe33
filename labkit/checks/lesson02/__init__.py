"""Checkers for lesson 02 (raw capture and replay), one module per exercise, each run on
the backend of ``labkit.backend.get("auto")`` (or ``B=``):

* :mod:`.graphed_run`: ``check_graphed_run``, the template (warm-up, capture, replay);
* :mod:`.capture_chain`: ``check_capture_chain``, two graphs in one pool;
* :mod:`.serve`: ``check_serve``, the diagnosis of a broken serving loop.

:mod:`._common` holds what they share: ``fn`` that counts its calls, the recorders of
``wait_stream`` and ``replay``, and the diagnosis of a graphed loop (``graphed_run`` and
``serve`` are checked alike). An error raised inside a capture is reported at the
learner's line with its first cause: a failed capture raises a second, follow-on error
when the ``with B.graph(...)`` block ends, which names no line of the learner's code.
"""

from labkit.checks.lesson02._common import WARMUP_ITERS
from labkit.checks.lesson02.capture_chain import check_capture_chain
from labkit.checks.lesson02.graphed_run import check_graphed_run
from labkit.checks.lesson02.serve import check_serve

__all__ = ["check_graphed_run", "check_capture_chain", "check_serve", "WARMUP_ITERS"]
