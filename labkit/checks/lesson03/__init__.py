"""Checkers for lesson 03 (constraint pitfalls), one module per exercise, each run on the
backend of ``labkit.backend.get("auto")`` (or ``B=``):

* :mod:`.capturable_clip`: ``check_capturable_clip``, a Python branch made capturable;
* :mod:`.arg_mismatches`: ``check_arg_mismatches``, Megatron's argument check as data;
* :mod:`.build_server`: ``check_build_server``, the diagnosis of a broken server.

:mod:`._common` holds what they share: the learner's error with its line and the trial
loop (:func:`labkit.checks.run_trials`; a trial rejects with :func:`labkit.checks.reject`
and calls the learner through :func:`labkit.checks.attempt`). Every checker leaves a
usable process after a learner's failed capture (:func:`labkit.backend.recover`), gives
learner code a time budget (:func:`labkit.checks.call_learner`), and keeps further hints
for :func:`labkit.checks.hint`.
"""

from labkit.checks.lesson03.arg_mismatches import FIELDS, check_arg_mismatches
from labkit.checks.lesson03.build_server import SERVER_SHAPE, check_build_server
from labkit.checks.lesson03.capturable_clip import check_capturable_clip

__all__ = ["check_capturable_clip", "check_arg_mismatches", "check_build_server", "FIELDS",
           "SERVER_SHAPE"]
