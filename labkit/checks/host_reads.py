"""Host reads in the learner's own code: the device→host syncs a graph cannot hold and a
replay loop must not pay every call. Shared by the checkers of lessons 08 and 09; the
rules themselves are :mod:`labkit.core.rules`'."""

from __future__ import annotations

import contextlib
import linecache
import os
import sys

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from labkit.core import rules
from labkit.core.errors import TORCH_DIR, in_library

__all__ = ["HostReads"]

_ATEN_SHOWN = {
    "_local_scalar_dense": ".item(), int(t), float(t) or an `if` on a tensor",
    "is_nonzero": "bool(t) or an `if` on a tensor",
    "equal": "torch.equal",
}
_READ_KINDS = ("cpu_sync", "tensor_branch", "dynamic_shape")
# Python-level calls that never reach ATen on a CPU; the others (.item(), bool(t)) are
# seen at the ATen op they lower to. torch.tensor(data) builds from host data: no read.
_FUNCTION_READS = ("tolist", "numpy", "__array__", "cpu", "__repr__", "__str__")


def _tensor_method(frame) -> bool:
    """Whether ``frame`` runs a tensor subclass's own version of a ``torch.Tensor`` method
    (the emulated device's ``tolist``, ``__repr__``, ...). It stands where torch's C
    method stands on a GPU: the call was made by whoever called the method."""
    return (hasattr(torch.Tensor, frame.f_code.co_name)
            and isinstance(frame.f_locals.get("self"), torch.Tensor))


def _learner_frame(frame):
    """The frame that issued a torch call, when it is the learner's own code: the first
    frame outside torch, tensor subclasses' methods and :class:`HostReads`' own modes,
    unless that is labkit's (a graph's replay, the checker)."""
    while frame is not None:
        name = frame.f_code.co_filename
        if not in_library(name):
            return frame
        if name != __file__ and not os.path.abspath(name).startswith(TORCH_DIR + os.sep) \
                and not _tensor_method(frame):
            return None              # labkit's own code
        frame = frame.f_back
    return None


class HostReads:
    """While active, notes every host read (``.item()``, ``bool(t)``, ``torch.equal``,
    ``.tolist()``, ``nonzero()``, ...) that the learner's own code makes, as
    ``(what, where)``: a device→host sync on a GPU. Reads made inside labkit (a graph's
    replay) or by the checker are not the learner's and are not noted. ``data_ptr()``,
    shapes and Python numbers are no reads. The rules are :mod:`labkit.core.rules`'."""

    def __init__(self):
        self.found: list[tuple[str, str]] = []

    def _note(self, what: str) -> None:
        from labkit.checks import _is_notebook_frame

        frame = _learner_frame(sys._getframe(2))
        if frame is None or any(w == what for w, _ in self.found):
            return
        name = frame.f_code.co_filename
        line = linecache.getline(name, frame.f_lineno).strip()
        where = "your cell" if _is_notebook_frame(name) else os.path.basename(name)
        loc = f"line {frame.f_lineno} of {where}"
        self.found.append((what, f"{loc}: `{line}`" if line else loc))

    def __enter__(self):
        reads = self

        class _Functions(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                name = getattr(func, "__name__", "")
                if name in _FUNCTION_READS and rules.function_rule(name, args, kwargs):
                    reads._note(rules.FUNCTION_RULES[name].shown)
                return func(*args, **kwargs)

        class _Aten(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                name = func.overloadpacket.__name__
                rule = rules.aten_rule(name, args, kwargs)
                if rule is not None and rule.kind in _READ_KINDS:
                    reads._note(_ATEN_SHOWN.get(name, rule.shown))
                return func(*args, **kwargs)

        self._stack = contextlib.ExitStack()
        self._stack.enter_context(_Functions())
        self._stack.enter_context(_Aten())
        return self

    def __exit__(self, *exc):
        return self._stack.__exit__(*exc)

    def message(self) -> str | None:
        """``what, at line N of your cell: the line`` of the first read, or None."""
        if not self.found:
            return None
        what, where = self.found[0]
        return f"{what}, at {where}"
