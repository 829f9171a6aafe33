"""Checkers for lesson 07 (whole-step capture and torch.compile), one module per exercise,
each checked against :mod:`labkit.full_step`:

* :mod:`.fill_static_buffers`: ``check_fill_static_buffers``, the static batch loader's
  copy into the captured buffers;
* :mod:`.run_iteration`: ``check_run_iteration``, eager, capture and replay by iteration;
* :mod:`.update_found_inf`: ``check_update_found_inf``, a NaN/inf flag kept on the device;
* :mod:`.make_step`: ``check_make_step``, the diagnosis of a step that stops training
  after one bad loss.

Every check leaves a usable process, also after a learner's host read inside a capture
(:func:`labkit.backend.recover`).
"""

from labkit.checks.lesson07.fill_static_buffers import check_fill_static_buffers
from labkit.checks.lesson07.make_step import check_make_step
from labkit.checks.lesson07.run_iteration import check_run_iteration
from labkit.checks.lesson07.update_found_inf import check_update_found_inf

__all__ = ["check_fill_static_buffers", "check_run_iteration", "check_update_found_inf",
           "check_make_step"]
