"""Error chains and whose code raised: what every error message in labkit builds on."""

from __future__ import annotations

import os

import torch

__all__ = ["capture_cause", "exception_chain", "in_library", "TORCH_DIR"]

#: where torch is installed: a frame under it is torch's code, not the user's
TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__))
_LABKIT_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def exception_chain(exc: BaseException, limit: int = 8) -> list[BaseException]:
    """``exc`` and the exceptions it was raised while handling, root cause first.

    Follows ``__cause__`` (``raise ... from e``), else ``__context__`` unless the raise
    suppressed it (``raise ... from None``). A failed capture raises twice (the error, then
    the capture's ``__exit__``), so the root cause is ``exception_chain(e)[0]``.
    """
    out, seen = [], set()
    while exc is not None and id(exc) not in seen and len(out) < limit:
        seen.add(id(exc))
        out.append(exc)
        exc = exc.__cause__ or (None if exc.__suppress_context__ else exc.__context__)
    return out[::-1]


_FOLLOW_ON = ("previous error during capture", "StreamCaptureInvalidated")


def capture_cause(exc: BaseException) -> BaseException:
    """The error a failed capture started with, not the follow-on one its ``__exit__``
    raises ("operation failed due to a previous error during capture"); ``exc`` itself
    when it is not such a follow-on."""
    seen = set()
    while id(exc) not in seen and any(t in str(exc) for t in _FOLLOW_ON):
        seen.add(id(exc))
        nxt = exc.__cause__ or exc.__context__
        if nxt is None:
            break
        exc = nxt
    return exc


def in_library(filename: str) -> bool:
    """Whether a traceback frame's file is labkit's or torch's own code (a notebook cell,
    ``<ipython-input-...>``, and the learner's own files are not)."""
    if filename.startswith("<"):
        return False
    path = os.path.abspath(filename)
    return path.startswith(_LABKIT_DIR + os.sep) or path.startswith(TORCH_DIR + os.sep)
