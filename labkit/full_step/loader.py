"""Static inputs: per-microbatch buffers at fixed addresses, refilled with ``copy_``."""

from __future__ import annotations

import os
from typing import Sequence

import torch
from torch.utils._pytree import tree_flatten, tree_map

from labkit import backend
from labkit.core.validate import check_int

__all__ = ["fill_static_buffers", "StaticBatchLoader", "foreach_load"]


def foreach_load() -> bool:
    """Whether :class:`StaticBatchLoader` copies a step with one ``torch._foreach_copy_``
    (a speed trick, :func:`_foreach_fill`). ``LABKIT_FOREACH_LOAD=0`` turns it off, so that
    ``python -m labkit.bench train`` can time the step with and without it."""
    value = os.environ.get("LABKIT_FOREACH_LOAD", "1").strip()
    if value not in ("0", "1"):
        raise ValueError(f"LABKIT_FOREACH_LOAD={value!r}: set it to 1 (one multi-tensor copy "
                         "per step, the default) or 0 (one copy_ per tensor)")
    return value == "1"


def fill_static_buffers(buffers: Sequence, microbatches: Sequence,
                        non_blocking: bool = True) -> None:
    """Copy each microbatch into its buffers, in place: ``buffers[i]`` ← ``microbatches[i]``.

    Args:
        buffers: one structure of tensors per microbatch (a tensor, a tuple, a dict...),
            the static inputs a graph reads.
        microbatches: the new data, the same structures with the same shapes and dtypes.
        non_blocking: passed to ``copy_`` (from pinned host memory the copy then
            overlaps other work).

    Raises:
        ValueError: a different count, structure, shape or dtype; the message says which.

    .. warning::
        Copy, never rebind. A graph reads the addresses it captured: after
        ``buffers[i] = microbatches[i]`` it would go on reading the old data.
    """
    if len(buffers) != len(microbatches):
        raise ValueError(f"{len(microbatches)} microbatches for {len(buffers)} static buffer "
                         "sets: the number of microbatches is part of the captured schedule")
    for i, (buf, mb) in enumerate(zip(buffers, microbatches)):
        dst, dst_spec = tree_flatten(buf)
        src, src_spec = tree_flatten(mb)
        if dst_spec != src_spec:
            raise ValueError(f"microbatch {i} has structure {src_spec}, the buffers {dst_spec}")
        for j, (d, s) in enumerate(zip(dst, src)):
            if d.shape != s.shape or d.dtype != s.dtype:
                raise ValueError(
                    f"microbatch {i}, tensor {j}: got {tuple(s.shape)} {s.dtype}, the static "
                    f"buffer is {tuple(d.shape)} {d.dtype}. A captured step has fixed shapes: "
                    "pad to the captured shape, or capture another graph for this one.")
            d.copy_(s, non_blocking=non_blocking)


def _foreach_fill(buffers: Sequence, microbatches: Sequence) -> None:
    """:func:`fill_static_buffers` as one ``torch._foreach_copy_``: one launch per step
    instead of one per tensor. Anything that does not match goes to the checked copy, and
    so does data on another device than the buffers (host memory, say): one launch needs
    one device on both sides, and torch's ``_foreach_copy_`` itself falls back to one
    ``copy_`` per tensor there."""
    dsts, dst_spec = tree_flatten(list(buffers))
    srcs, src_spec = tree_flatten(list(microbatches))
    if dst_spec != src_spec or not all(
            isinstance(s, torch.Tensor) and s.shape == d.shape and s.dtype == d.dtype
            and s.device == d.device for d, s in zip(dsts, srcs)):
        fill_static_buffers(buffers, microbatches)      # says what does not match
        return
    torch._foreach_copy_(dsts, srcs, non_blocking=True)


def _empty_like(microbatch, device):
    def alloc(t):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"a microbatch must hold tensors only, got {type(t).__name__}")
        return torch.empty(t.shape, dtype=t.dtype, device=device)
    return tree_map(alloc, microbatch)


class StaticBatchLoader:
    """Per-microbatch input buffers at fixed addresses, filled by ``copy_`` on a side stream
    (Megatron's ``StaticBufferLoader``).

    ``load(microbatches)`` allocates the buffers on its first call (one set per microbatch,
    with its structure, shapes and dtypes, on ``B.device``) and copies the data into them
    on every call. ``buffers`` is what the step function reads, eager or captured. The copy
    is :func:`fill_static_buffers`, or the same as one multi-tensor copy when ``foreach``
    is set (:func:`foreach_load`).

    Args:
        B: the backend (``labkit.backend.get(...)``).
        num_microbatches: how many microbatches every ``load`` gets.
        stream: the side stream for the copies (default: a new one).

    .. warning::
        Two waits make the side stream safe: it first waits for the current stream (the
        previous replay may still read the buffers), and the current stream then waits
        for it (the next replay must see the new data). On the emulator streams order
        nothing and the copies simply happen.
    """

    def __init__(self, B, num_microbatches: int, stream=None):
        self.num_microbatches = check_int("num_microbatches", num_microbatches, 1,
                                          fix="every step has at least one microbatch")
        self.B = B = backend.ensure(B, "StaticBatchLoader(B, num_microbatches)")
        self.stream = stream if stream is not None else B.Stream()
        self.foreach = foreach_load()
        self.buffers: list = []
        self.loads = 0

    def load(self, microbatches: Sequence) -> list:
        """Copy ``microbatches`` (``num_microbatches`` structures of tensors) into the
        static buffers and return the buffers."""
        microbatches = list(microbatches)
        if len(microbatches) != self.num_microbatches:
            raise ValueError(f"expected {self.num_microbatches} microbatches, got "
                             f"{len(microbatches)}: the captured schedule has a fixed count")
        B = self.B
        self.stream.wait_stream(B.current_stream())     # the previous replay may still read
        with B.stream(self.stream):
            if not self.buffers:
                self.buffers = [_empty_like(mb, B.device) for mb in microbatches]
            if self.foreach:
                _foreach_fill(self.buffers, microbatches)
            else:
                fill_static_buffers(self.buffers, microbatches)
        B.current_stream().wait_stream(self.stream)     # the next replay must see the data
        self.loads += 1
        return self.buffers
