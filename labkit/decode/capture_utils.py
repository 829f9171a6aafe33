"""What a graph runner's capture loop needs around it: a progress bar, the garbage collector
frozen during capture (SGLang's ``freeze_gc``), a failed capture cleaned up, torch.compile's
autotune reports kept quiet, and a fallback warned about once. Used by
:mod:`labkit.decode.graph_runner_base` (every graph runner's capture loop), lesson 06's
:mod:`labkit.decode.runner` and lesson 09's :mod:`labkit.piecewise`."""

from __future__ import annotations

import contextlib
import gc
import logging
import warnings

from labkit.capture import cleanup_on_failure

__all__ = ["progress_bar", "frozen_gc", "clean_up_after_failure", "quiet_autotune",
           "warn_fallback_once"]

logger = logging.getLogger("labkit.decode")


def progress_bar(iterable, enabled: bool, **kw):
    """``iterable`` wrapped in a tqdm bar (``kw``: its options) when ``enabled``, else as is."""
    if not enabled:
        return iterable
    from tqdm.auto import tqdm
    return tqdm(iterable, **kw)


@contextlib.contextmanager
def frozen_gc():
    """Collect once, then keep the garbage collector out of the capture loop (SGLang's
    freeze_gc): a collection mid-capture could free tensors the graph still records."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


@contextlib.contextmanager
def clean_up_after_failure(runner):
    """A capture that raises leaves no half-captured ``runner`` (a
    :class:`~labkit.decode.runner.BaseGraphRunner`) and a usable process: the
    graphs captured so far are dropped (``captured`` is False again, so nothing replays a
    bucket that has no graph) and :func:`labkit.backend.recover` puts the default stream
    back and takes the generator out of capture mode (:func:`labkit.capture.cleanup_on_failure`).
    The error itself propagates."""
    try:
        with cleanup_on_failure(runner.B):
            yield
    except BaseException:
        runner.backend.cleanup()
        runner.capture_log = []
        raise


@contextlib.contextmanager
def quiet_autotune():
    """Keep torch.compile's max-autotune reports out of the output (lesson 06 prints
    capture results next to them). Inductor writes ``AUTOTUNE mm(...)`` tables and
    ``Autotune Choices Stats`` straight to stderr while it compiles; these two config
    switches turn exactly those prints off (the tuning itself is unchanged), and its
    TypedStorage deprecation warning is silenced while compiling. Keys this torch does
    not have are skipped."""
    import torch._inductor.config as inductor_config
    quiet = {k: v for k, v in (("autotune_num_choices_displayed", 0),
                               ("max_autotune_report_choices_stats", False))
             if hasattr(inductor_config, k)}
    with inductor_config.patch(quiet), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="TypedStorage is deprecated")
        yield


def warn_fallback_once(owner, message: str, category: type[Warning] = RuntimeWarning) -> None:
    """A batch ran eagerly for want of a graph: warn the first time for ``owner`` (its
    ``_warned_fallback`` flag), log every time at INFO. Never silent, never a flood."""
    if not owner._warned_fallback:
        owner._warned_fallback = True
        warnings.warn(message, category, stacklevel=3)
    logger.info(message)
