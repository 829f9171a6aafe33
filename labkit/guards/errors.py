"""Showing errors: first lines of an error chain, and where in the learner's code it happened."""

from __future__ import annotations

import inspect
import os
import sysconfig
import traceback
import warnings

from labkit.backend import ensure as _ensure
from labkit.backend import recover as _recover
from labkit.core.errors import TORCH_DIR
from labkit.core.errors import exception_chain as _chain
from labkit.core.validate import check_int

__all__ = ["error_lines", "error_text", "expect_error"]

_EMULATOR_TAG = "[labkit emulator]"


def _check_exception(exc, where: str) -> None:
    if not isinstance(exc, BaseException):
        raise TypeError(f"{where} takes the exception object (except ... as e: {where}(e); "
                        f"with pytest.raises(...) as err: {where}(err.value)), got "
                        f"{type(exc).__name__}")


def error_lines(exc: BaseException, lines: int = 1, emulator_notes: bool = False) -> list[str]:
    """The first ``lines`` lines of each error in ``exc``'s chain, root cause first.

    CUDA errors are long (a link to the CUDA docs, a note on asynchronous reporting);
    their first line says what happened, and it is the same on a GPU and on the emulator.
    The emulator adds a ``[labkit emulator] ...`` line explaining why; it is left out
    unless ``emulator_notes`` (it does not exist on a GPU).
    """
    _check_exception(exc, "error_lines")
    out = []
    for e in _chain(exc):
        text = [ln.rstrip() for ln in str(e).splitlines() if ln.strip()]
        if not emulator_notes:
            text = [ln for ln in text if not ln.startswith(_EMULATOR_TAG)]
        out.append("\n".join(text[:lines]) if text else type(e).__name__)
    return out


def error_text(exc: BaseException) -> str:
    """The whole text of every error in ``exc``'s chain, root cause first, one string.

    A failed capture raises twice: the refused operation, then ``capture_end`` reporting
    the invalidated capture. ``SYNC_MSG in error_text(e)`` asks whether the refusal is
    anywhere in that chain, whichever error the ``except`` clause caught."""
    _check_exception(exc, "error_text")
    return "\n".join(str(e) for e in _chain(exc, limit=16))


class expect_error:
    """Context manager for demonstrations: the block must raise; print the error briefly.

    ::

        with expect_error(B):
            with B.graph(B.CUDAGraph()):
                x.sum().item()
        # error: CUDA error: operation not permitted when stream is capturing
        #  then: CUDA error: operation failed due to a previous error during capture

    Prints the first line of every error in the chain (root cause first, then what it
    caused, e.g. ``capture_end`` reporting the invalidated capture), without the
    emulator's extra line, so the output is the same on a GPU and on the CPU. Afterwards
    it restores the default stream: a failed ``B.graph`` leaves its capture stream
    current. If nothing is raised it prints ``no error`` and says so in ``.raised``.
    The exception is kept in ``.exception`` for inspection; ``KeyboardInterrupt`` and
    other non-``Exception`` errors propagate. Warnings raised inside the block (on a GPU,
    a capture cut short by an error may warn that the graph is empty) are kept in
    ``.warnings`` and not printed, so a demonstration prints the same on every backend.
    """

    def __init__(self, B=None, lines: int = 1, emulator_notes: bool = False):
        self.B = _ensure(B, "expect_error(B)")
        check_int("lines (first lines shown of each error)", lines, 1)
        self.lines = lines
        self.emulator_notes = emulator_notes
        self.exception: BaseException | None = None
        self.messages: list[str] = []
        self.warnings: list = []
        self._catch = None

    @property
    def raised(self) -> bool:
        return self.exception is not None

    def __enter__(self) -> "expect_error":
        self._catch = warnings.catch_warnings(record=True)
        self.warnings = self._catch.__enter__()
        warnings.simplefilter("always")
        return self

    def __exit__(self, typ, exc, tb) -> bool:
        if self._catch is not None:
            self._catch.__exit__(None, None, None)
            self._catch = None
        try:
            _recover(self.B)
        except Exception:
            pass
        if exc is None:
            print("no error")
            return False
        if not isinstance(exc, Exception):
            return False
        self.exception = exc
        self.messages = error_lines(exc, self.lines, self.emulator_notes)
        for i, m in enumerate(self.messages):
            prefix = "error: " if i == 0 else " then: "
            print(prefix + m.replace("\n", "\n" + " " * len(prefix)))
        return True


# ---- where the user's code is -----------------------------------------------------------

_LABKIT_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_INTERNAL_LABKIT = tuple(os.path.join(_LABKIT_DIR, p) for p in
                         ("guards", "capture.py", "backend.py", "emulator", "core"))
_STDLIB = tuple({os.path.abspath(p) for p in (sysconfig.get_paths().get("stdlib"),
                                              sysconfig.get_paths().get("platstdlib")) if p})


def is_internal(filename: str) -> bool:
    if filename.startswith("<frozen") or filename.startswith("<string"):
        return True
    if filename.startswith("<"):
        return False
    path = os.path.abspath(filename)
    if path.startswith(TORCH_DIR) or path.startswith(_INTERNAL_LABKIT):
        return True
    return any(path.startswith(s + os.sep) for s in _STDLIB) and "site-packages" not in path


def user_frame() -> traceback.FrameSummary | None:
    """The innermost frame of the stack that is not torch, labkit's machinery or stdlib."""
    for fr in reversed(traceback.extract_stack()):
        if not is_internal(fr.filename):
            return fr
    return None


def def_frame(fn) -> traceback.FrameSummary | None:
    try:
        target = inspect.unwrap(fn)
        if not inspect.isfunction(target) and not inspect.ismethod(target):
            target = type(fn).forward if hasattr(type(fn), "forward") else type(fn).__call__
        _, lineno = inspect.getsourcelines(target)
        filename = inspect.getsourcefile(target) or inspect.getfile(target)
        return traceback.FrameSummary(filename, lineno, getattr(target, "__name__", ""))
    except (TypeError, OSError):
        return None

