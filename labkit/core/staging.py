"""Which host memory a copy between host and device really reads or writes, on a GPU.

``copy_kernel_cuda`` (ATen's ``native/cuda/Copy.cu``) hands ``cudaMemcpyAsync`` one
contiguous run of bytes. A copy it cannot do that way (``copy_requires_temporaries``:
anything but a same-dtype copy that ``TensorIterator`` sees as one contiguous run, so a
non-contiguous view, a broadcast, a dtype conversion) goes through contiguous temporaries,
and a temporary on the host side is ordinary *pageable* memory. During a capture the
pinned-memory check then refuses that inner copy, although the user's tensor is pinned:
``pinned[:, :2].to(B.device, non_blocking=True)`` fails the way a pageable copy does.

:func:`host_side_is_staged` answers, for one copy, whether the memory ``cudaMemcpy``
touches on the host is a temporary rather than the user's tensor. Both the emulator's
recorder and :func:`labkit.guards.lint_capture` ask it, through
:func:`labkit.core.rules.host_copy_rule`'s ``staged``. It follows the
temporaries branch of ``copy_kernel_cuda``: with ``non_blocking=True`` a dtype
conversion happens on the device, so a contiguous pinned source still reaches the copy
itself; a blocking copy converts on the host, in a new tensor.
"""

from __future__ import annotations

import torch

__all__ = ["host_side_is_staged", "to_copy_strides"]


def _broadcast_strides(src: torch.Tensor, shape) -> list[int] | None:
    """``src.expand(shape).stride()``, without touching the tensor (None: not broadcastable)."""
    ss, st = list(src.shape), list(src.stride())
    if len(ss) > len(shape):
        return None
    pad = len(shape) - len(ss)
    out = []
    for i, n in enumerate(shape):
        j = i - pad
        if j < 0:
            out.append(0)
        elif ss[j] == n:
            out.append(st[j])
        elif ss[j] == 1:
            out.append(0)
        else:
            return None
    return out


def _contiguous(shape, strides) -> bool:
    """``Tensor.is_contiguous()`` for this shape and these strides (size-1 dims ignored)."""
    expected = 1
    for n, s in zip(reversed(list(shape)), reversed(list(strides))):
        if n == 1:
            continue
        if s != expected:
            return False
        expected *= n
    return True


def _one_run(shape, dst_strides, src_strides) -> bool:
    """``TensorIterator::is_contiguous()`` after reordering and coalescing: both sides have
    the same strides, and those strides cover one dense block."""
    dims = [(d, n) for d, n in enumerate(shape) if n != 1]
    if any(dst_strides[d] != src_strides[d] for d, _ in dims):
        return False
    expected = 1
    for d, n in sorted(dims, key=lambda dn: dst_strides[dn[0]]):
        if dst_strides[d] != expected:
            return False
        expected *= n
    return True


def host_side_is_staged(way: str, dst_shape, dst_strides, dst_dtype, src: torch.Tensor,
                        non_blocking: bool, host: torch.Tensor) -> bool:
    """True if ``copy_kernel_cuda`` copies through a host temporary instead of ``host``.

    Args:
        way: ``"host-to-device"`` or ``"device-to-host"``.
        dst_shape, dst_strides, dst_dtype: the destination's layout.
        src: the source tensor (its shape, strides and dtype are read).
        non_blocking: the copy's flag (it decides where a dtype conversion happens).
        host: the host-side tensor (``src`` or the destination).
    """
    shape = list(dst_shape)
    if not shape or all(n == 1 for n in shape) or any(n == 0 for n in shape):
        return False                               # one element (or none): one run
    src_strides = _broadcast_strides(src, shape)
    if src_strides is None:
        return False                               # copy_ itself will refuse the shapes
    same_dtype = src.dtype == dst_dtype
    if same_dtype and _one_run(shape, list(dst_strides), src_strides):
        return False                               # one cudaMemcpyAsync, no temporaries
    if way == "host-to-device":
        # src_contig = src[.to(dst dtype) if blocking].expand_as(dst).contiguous()
        keeps = _contiguous(shape, src_strides) and (non_blocking or same_dtype)
    else:
        # dst_contig = dst if dst.is_contiguous() [and same dtype, if blocking] else a
        # new host tensor
        keeps = _contiguous(host.shape, host.stride()) and (non_blocking or same_dtype)
    return not keeps


def to_copy_strides(src: torch.Tensor, memory_format) -> list[int]:
    """The strides ``aten::_to_copy`` gives its new tensor: ``src``'s own when preserving
    the format of a non-overlapping, dense ``src``, else those of a fresh tensor."""
    if memory_format in (None, torch.preserve_format):
        if _dense(src):
            return list(src.stride())
        memory_format = torch.contiguous_format
    return list(torch.empty(src.shape, device="meta", memory_format=memory_format).stride())


def _dense(t: torch.Tensor) -> bool:
    dims = [(n, s) for n, s in zip(t.shape, t.stride()) if n != 1]
    expected = 1
    for n, s in sorted(dims, key=lambda ns: ns[1]):
        if s != expected:
            return False
        expected *= n
    return True
