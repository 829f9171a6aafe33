"""Comparing a learner's outputs with the reference's, and describing an exception raised
by the learner's code (its line, not a bare traceback). Re-exported by :mod:`labkit.checks`.
"""

from __future__ import annotations

import linecache
import math
import os
import traceback
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from labkit.core.errors import in_library
from labkit.core.signature import fmt_shape

__all__ = ["compare_outputs", "describe_exception", "short_description"]


def _type_name(x: Any) -> str:
    if isinstance(x, torch.Tensor):
        return "a torch.Tensor"
    if x is None:
        return "None"
    return f"a {type(x).__name__}"


def _compare_tensors(expected: torch.Tensor, actual: torch.Tensor, where: str,
                     rtol: float, atol: float) -> str | None:
    if tuple(actual.shape) != tuple(expected.shape):
        return f"{where}shape: expected {fmt_shape(expected.shape)}, got {fmt_shape(actual.shape)}"
    if actual.dtype != expected.dtype:
        return f"{where}dtype: expected {expected.dtype}, got {actual.dtype}"
    if actual.device != expected.device:
        return f"{where}device: expected {expected.device}, got {actual.device}"
    e = expected.detach().cpu()
    a = actual.detach().cpu()
    if e.numel() == 0:
        return None
    if e.is_floating_point() or e.is_complex():
        close = torch.isclose(a, e, rtol=rtol, atol=atol, equal_nan=True)
    else:
        close = a == e
    if bool(close.all()):
        return None
    bad = ~close
    n_bad = int(bad.sum())
    if e.dtype == torch.bool:
        diff = (a != e).to(torch.float64)
    else:
        diff = (a.to(torch.float64) - e.to(torch.float64)).abs()
        diff = torch.where(torch.isnan(diff), torch.full_like(diff, math.inf), diff)
    diff = torch.where(bad, diff, torch.zeros_like(diff))
    flat = int(diff.reshape(-1).argmax())
    idx = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), e.shape)) if e.dim() else ()
    ev, av = e.reshape(-1)[flat].item(), a.reshape(-1)[flat].item()
    at = f" at index {idx}" if idx else ""
    return (
        f"{where}values differ: max abs diff {diff.reshape(-1)[flat].item():.4g}{at} "
        f"(expected {ev:.6g}, got {av:.6g}); {n_bad} of {e.numel()} elements differ"
    )


def compare_outputs(expected: Any, actual: Any, *, rtol: float = 1e-5, atol: float = 1e-6,
                    where: str = "") -> str | None:
    """``None`` when ``actual`` matches ``expected``, else one line saying what differs.

    Tensors are compared by shape, dtype, device, then values (``torch.isclose``); tuples,
    lists and dicts element by element; other values with ``==`` (floats with tolerance).
    """
    if isinstance(expected, torch.Tensor):
        if not isinstance(actual, torch.Tensor):
            hint = " (did you forget `return`?)" if actual is None else ""
            return f"{where}expected a torch.Tensor, got {_type_name(actual)}{hint}"
        return _compare_tensors(expected, actual, where, rtol, atol)
    if isinstance(expected, Mapping):
        if not isinstance(actual, Mapping):
            return f"{where}expected a dict, got {_type_name(actual)}"
        if set(expected) != set(actual):
            want, got = sorted(map(str, expected)), sorted(map(str, actual))
            return f"{where}keys: expected {want}, got {got}"
        for k in expected:
            msg = compare_outputs(expected[k], actual[k], rtol=rtol, atol=atol,
                                  where=f"{where}[{k!r}] ")
            if msg:
                return msg
        return None
    if isinstance(expected, Sequence) and not isinstance(expected, str):
        if not isinstance(actual, Sequence) or isinstance(actual, str):
            return f"{where}expected {_type_name(expected)}, got {_type_name(actual)}"
        if len(actual) != len(expected):
            return f"{where}length: expected {len(expected)}, got {len(actual)}"
        for i, (e, a) in enumerate(zip(expected, actual)):
            msg = compare_outputs(e, a, rtol=rtol, atol=atol, where=f"{where}[{i}] ")
            if msg:
                return msg
        return None
    if isinstance(expected, float) and isinstance(actual, (int, float)):
        if math.isclose(actual, expected, rel_tol=rtol, abs_tol=atol) or (
            math.isnan(expected) and math.isnan(actual)
        ):
            return None
        return f"{where}value: expected {expected!r}, got {actual!r}"
    if actual != expected:
        if type(actual) is not type(expected):
            return (f"{where}expected {_type_name(expected)} {expected!r}, "
                    f"got {_type_name(actual)} {actual!r}")
        return f"{where}value: expected {expected!r}, got {actual!r}"
    return None


def _is_learner_frame(filename: str) -> bool:
    """Not labkit's own code (checkers, engines, the emulator) and not torch's."""
    return not in_library(filename)


def _is_notebook_frame(filename: str) -> bool:
    return filename.startswith(("<ipython-input", "<cell")) or "ipykernel_" in filename


def describe_exception(exc: BaseException) -> str:
    """``TypeError: message`` plus the learner's line that raised it, for a report."""
    text = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    frames = traceback.extract_tb(exc.__traceback__)
    # Prefer the deepest frame in a notebook cell; else the deepest frame outside
    # labkit.checks and torch.
    pick = None
    for fr in frames:
        if _is_notebook_frame(fr.filename):
            pick = fr
    if pick is None:
        for fr in frames:
            if _is_learner_frame(fr.filename):
                pick = fr
    if pick is None:
        return text
    line = (pick.line or linecache.getline(pick.filename, pick.lineno)).strip()
    where = "your cell" if _is_notebook_frame(pick.filename) else os.path.basename(pick.filename)
    loc = f"line {pick.lineno} of {where}"
    if pick.name != "<module>":
        loc += f" (in {pick.name})"
    return f"{text}\n   at {loc}: {line}" if line else f"{text}\n   at {loc}"


_CUDA_BOILERPLATE = ("Search for `cuda", "CUDA kernel errors might be asynchronously",
                     "For debugging consider passing CUDA_LAUNCH_BLOCKING",
                     "Compile with `TORCH_USE_CUDA_DSA`")


def short_description(exc: BaseException) -> str:
    """:func:`describe_exception` of the error a failed capture started with, without
    CUDA's boilerplate lines (where to search, how to debug)."""
    from labkit.core.errors import capture_cause

    text = describe_exception(capture_cause(exc))
    return "\n".join(ln for ln in text.split("\n")
                     if ln.strip() and not ln.startswith(_CUDA_BOILERPLATE))
