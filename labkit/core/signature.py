"""Argument metadata and mismatch errors: what a graph was captured for, and what a call differs in.

After Megatron-LM's ``ArgMetadata`` and ``get_mismatch_errors``
(``megatron/core/transformer/cuda_graphs.py``): record each argument at capture, and before
a replay report every difference in one message.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterable, NamedTuple

import torch
from torch.utils._pytree import keystr, tree_flatten_with_path, tree_leaves, tree_map

__all__ = [
    "ArgMetadata", "metadata_tree", "Mismatch", "mismatches", "get_mismatch_errors",
    "GraphArgumentError", "leaf_pairs", "describe_tree", "signature_lines", "values_equal",
    "fmt_shape", "short_repr", "type_name",
]


def fmt_shape(shape) -> str:
    """``(4, 8)``: a shape as a tuple of ints, the same for a ``torch.Size`` and a tuple."""
    return str(tuple(int(s) for s in shape))


def short_repr(v: Any) -> str:
    """``repr(v)``, cut to 40 characters for an error message."""
    text = repr(v)
    return text if len(text) <= 40 else text[:37] + "..."


def _data_ptr(t: torch.Tensor) -> int | None:
    try:
        return t.data_ptr()
    except (RuntimeError, NotImplementedError):    # sparse or storage-less tensors
        return None


@dataclass(frozen=True, eq=False)
class ArgMetadata:
    """What a graph remembers about one argument at capture.

    Args:
        type: ``torch.Tensor`` for a tensor, else the argument's type.
        shape, dtype, device: a tensor's (the graph was recorded for exactly these).
        data_ptr: a tensor's address (the graph reads that memory on every replay).
        requires_grad: a tensor's flag (a runner rebuilding static buffers needs it).
        value: a non-tensor's value: capture ran Python once with it and baked it in.
    """

    type: type
    shape: tuple | None = None
    dtype: torch.dtype | None = None
    device: torch.device | None = None
    data_ptr: int | None = None
    value: Any = None
    requires_grad: bool = False

    @classmethod
    def of(cls, x: Any) -> "ArgMetadata":
        """The metadata of ``x`` (``x`` itself if it already is metadata)."""
        if isinstance(x, ArgMetadata):
            return x
        if isinstance(x, torch.Tensor):
            return cls(torch.Tensor, tuple(x.shape), x.dtype, x.device, _data_ptr(x),
                       requires_grad=bool(x.requires_grad))
        return cls(type(x), value=x)

    @property
    def is_tensor(self) -> bool:
        return self.type is torch.Tensor

    def zeros(self) -> torch.Tensor:
        """A zero tensor with this metadata: a fresh static buffer."""
        if not self.is_tensor:
            raise TypeError(f"zeros() needs the metadata of a tensor, this is of a "
                            f"{self.type.__name__} ({short_repr(self.value)})")
        return torch.zeros(self.shape, dtype=self.dtype, device=self.device,
                           requires_grad=self.requires_grad)

    def describe(self) -> str:
        """``Tensor(8, 16) float32`` or ``float 0.5`` (no device or address: portable)."""
        if self.is_tensor:
            dims = ", ".join(str(s) for s in self.shape)
            return f"Tensor({dims}) {str(self.dtype).replace('torch.', '')}"
        return f"{self.type.__name__} {short_repr(self.value)}"


def _is_none(x: Any) -> bool:
    return x is None


def metadata_tree(obj: Any) -> Any:
    """``obj`` with every leaf replaced by its :class:`ArgMetadata` (containers kept).

    Containers are what ``torch.utils._pytree`` knows (lists, tuples, named tuples,
    dicts); ``None`` is a leaf, so a captured ``None`` is remembered as a value.
    """
    return tree_map(ArgMetadata.of, obj, is_leaf=_is_none)


def leaf_pairs(static: Any, received: Any) -> list[tuple[Any, Any]]:
    """(static leaf, received leaf) pairs of two trees of the same structure.

    .. warning::
        Call it only after :func:`mismatches` found nothing: leaves are paired in order.
    """
    return list(zip(tree_leaves(static, is_leaf=_is_none),
                    tree_leaves(received, is_leaf=_is_none)))


def describe_tree(tree: Any) -> str:
    """``[Tensor(3) float32, float 2.0]``: a metadata tree in one line."""
    if isinstance(tree, (list, tuple)):
        return "[" + ", ".join(describe_tree(m) for m in tree) + "]"
    if isinstance(tree, dict):
        return "{" + ", ".join(f"{k!r}: {describe_tree(m)}" for k, m in tree.items()) + "}"
    return ArgMetadata.of(tree).describe()


def signature_lines(arg_metadata: Iterable, kwarg_metadata: dict | None = None) -> list[str]:
    """``args[0]: Tensor(8, 16) float32``: one line per captured leaf, args then kwargs."""
    lines = []
    for prefix, tree in (("args", tuple(arg_metadata)), ("kwargs", dict(kwarg_metadata or {}))):
        for path, meta in tree_flatten_with_path(tree, is_leaf=_is_none)[0]:
            lines.append(f"{prefix}{keystr(path)}: {ArgMetadata.of(meta).describe()}")
    return lines


def values_equal(a: Any, b: Any) -> bool:
    """``a == b`` for baked-in values, with NaN equal to NaN and no exception escaping."""
    if a is b:
        return True
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    try:
        return bool(a == b)
    except Exception:
        return False


class Mismatch(NamedTuple):
    """One difference between a call and the capture.

    ``field`` is one of ``"count"``, ``"structure"``, ``"missing"``, ``"unexpected"``,
    ``"type"``, ``"shape"``, ``"dtype"``, ``"device"``, ``"address"``, ``"value"``;
    ``captured`` and ``received`` are that field's two values (type names for ``"type"``).
    """

    where: str
    field: str
    captured: Any
    received: Any

    def __str__(self) -> str:
        w, c, r = self.where, self.captured, self.received
        if self.field == "count":
            return f"Count mismatch: received {r} positional args, captured {c}"
        if self.field == "structure":
            return f"Structure mismatch at {w}: received {r} items, captured {c}"
        if self.field == "missing":
            return f"Missing {w}: it was passed at capture"
        if self.field == "unexpected":
            return f"Unexpected {w}: it was not passed at capture"
        if self.field == "type":
            return f"Type mismatch at {w}: received {r}, captured {c}"
        if self.field == "shape":
            return f"Tensor mismatch at {w}: received shape {fmt_shape(r)}, captured {fmt_shape(c)}"
        if self.field in ("dtype", "device"):
            return f"Tensor mismatch at {w}: received {self.field} {r}, captured {c}"
        if self.field == "address":
            return (f"Address mismatch at {w}: received a tensor at another address than the "
                    f"captured static input, which is the only memory the graph reads")
        return f"Value mismatch at {w}: received {short_repr(r)}, captured {short_repr(c)}"


def type_name(x: Any) -> str:
    """The type an error names for ``x``: ``Tensor`` for a tensor or a tensor's metadata,
    else the class name (of the value a metadata leaf recorded)."""
    if isinstance(x, torch.Tensor):
        return "Tensor"
    if isinstance(x, ArgMetadata):
        return "Tensor" if x.is_tensor else x.type.__name__
    return type(x).__name__


def _compare(meta: Any, val: Any, where: str, out: list[Mismatch], check_address: bool) -> None:
    """Append every way ``val`` differs from the captured ``meta`` tree.

    A diff of two trees that names where they part: ``torch.utils._pytree`` flattens one
    tree at a time, so this one walk stays.
    """
    if isinstance(meta, (list, tuple)):
        if not isinstance(val, (list, tuple)):
            out.append(Mismatch(where, "type", type(meta).__name__, type_name(val)))
            return
        if len(val) != len(meta):
            out.append(Mismatch(where, "structure", len(meta), len(val)))
        for i, (m, v) in enumerate(zip(meta, val)):
            _compare(m, v, f"{where}[{i}]", out, check_address)
        return
    if isinstance(meta, dict):
        if not isinstance(val, dict):
            out.append(Mismatch(where, "type", "dict", type_name(val)))
            return
        for k in meta:
            if k not in val:
                out.append(Mismatch(f"{where}[{k!r}]", "missing", meta[k], None))
            else:
                _compare(meta[k], val[k], f"{where}[{k!r}]", out, check_address)
        for k in val:
            if k not in meta:
                out.append(Mismatch(f"{where}[{k!r}]", "unexpected", None, val[k]))
        return
    meta = ArgMetadata.of(meta)
    if meta.is_tensor != isinstance(val, torch.Tensor) or (
            not meta.is_tensor and type(val) is not meta.type):
        out.append(Mismatch(where, "type", type_name(meta), type_name(val)))
        return
    if meta.is_tensor:
        if tuple(val.shape) != meta.shape:
            out.append(Mismatch(where, "shape", meta.shape, tuple(val.shape)))
        if val.dtype != meta.dtype:
            out.append(Mismatch(where, "dtype", meta.dtype, val.dtype))
        if val.device != meta.device:
            out.append(Mismatch(where, "device", meta.device, val.device))
        if check_address and val.data_ptr() != meta.data_ptr:
            out.append(Mismatch(where, "address", meta.data_ptr, val.data_ptr()))
    elif not values_equal(val, meta.value):
        out.append(Mismatch(where, "value", meta.value, val))


def _check_arg_sequences(captured_args, args, captured_kwargs, kwargs) -> None:
    """Positional arguments come as sequences (a bare tensor would be iterated row by row)."""
    for name, seq in (("captured_args", captured_args), ("args", args)):
        if isinstance(seq, torch.Tensor) or not isinstance(seq, (tuple, list)):
            what = (f"a Tensor of shape {tuple(seq.shape)}" if isinstance(seq, torch.Tensor)
                    else type(seq).__name__)
            raise TypeError(f"get_mismatch_errors: {name} must be a tuple or list of "
                            f"arguments, got {what}; for one argument write (x,)")
    for name, d in (("captured_kwargs", captured_kwargs), ("kwargs", kwargs)):
        if d is not None and not isinstance(d, dict):
            raise TypeError(f"get_mismatch_errors: {name} must be a dict or None, got "
                            f"{type(d).__name__}")


def mismatches(captured_args: Iterable, args: Iterable, captured_kwargs: dict | None = None,
               kwargs: dict | None = None, *, check_address: bool = False) -> list[Mismatch]:
    """Every difference between a call's arguments and those captured, as data.

    Args:
        captured_args: what was captured, one entry per positional argument: metadata trees
            (:func:`metadata_tree`), :class:`ArgMetadata`, or the captured arguments themselves.
        args: the call's positional arguments (a tuple or list).
        captured_kwargs, kwargs: the same for keyword arguments (dicts, or None).
        check_address: a tensor not at the captured address is a mismatch too (for callers
            that must pass the static inputs themselves).

    Tensors are compared by shape, dtype and device (never by value: a replay reads new
    values), everything else by type and value. The count is compared first, then every
    position both calls have.
    """
    _check_arg_sequences(captured_args, args, captured_kwargs, kwargs)
    captured_args, args = list(captured_args), list(args)
    out: list[Mismatch] = []
    if len(args) != len(captured_args):
        out.append(Mismatch("args", "count", len(captured_args), len(args)))
    for i, (m, v) in enumerate(zip(captured_args, args)):
        _compare(m, v, f"args[{i}]", out, check_address)
    if captured_kwargs or kwargs:
        _compare(dict(captured_kwargs or {}), dict(kwargs or {}), "kwargs", out, check_address)
    return out


def get_mismatch_errors(captured_args: Iterable, args: Iterable,
                        captured_kwargs: dict | None = None, kwargs: dict | None = None,
                        *, check_address: bool = False) -> list[str]:
    """Every difference between a call's arguments and those captured, one line each.

    Lines look like ``Tensor mismatch at args[0]: received shape (4, 8), captured (8, 8)``;
    an empty list means the call may replay. Arguments as for :func:`mismatches`.
    Everything is checked before anything is reported, so one message lists all the
    problems at once, as Megatron's ``get_mismatch_errors`` does.
    """
    return [str(m) for m in mismatches(captured_args, args, captured_kwargs, kwargs,
                                       check_address=check_address)]


_HINTS = (
    ("shape", "shapes are fixed at capture: capture one graph per shape, or pad to a "
              "captured shape (bucket + pad, lesson 06)"),
    ("dtype", "convert before calling (x.to(dtype)): copy_ would convert silently"),
    ("device", "move the tensor first (x.to(B.device))"),
    ("Value", "Python values are baked in at capture: pass a tensor you copy_ into "
              "instead, or capture one graph per value"),
    ("Address", "copy_ into the static input (graph.static_inputs) instead of passing "
                "another tensor, or use inputs='copy'"),
    ("Count", "call with the same arguments as at capture"),
)


class GraphArgumentError(ValueError):
    """A call whose arguments do not match the capture; ``errors`` lists every mismatch.

    Args:
        label: who refuses, e.g. ``"GuardedGraph(block)"``.
        errors: the lines :func:`get_mismatch_errors` returned.
    """

    def __init__(self, label: str, errors: list[str]):
        self.label = label
        self.errors = list(errors)
        n = len(self.errors)
        lines = [f"{label} refuses these arguments ({n} mismatch{'es' if n != 1 else ''}; "
                 f"nothing was copied or replayed):"]
        lines += [f"  {e}" for e in self.errors]
        hints = [h for key, h in _HINTS if any(key in e for e in self.errors)]
        if hints:
            lines.append("How to fix: " + "; ".join(hints) + ".")
        super().__init__("\n".join(lines))
