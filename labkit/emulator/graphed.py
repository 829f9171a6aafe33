"""``make_graphed_callables`` on the emulator: PyTorch's own algorithm, run on the CPU.

``torch.cuda.make_graphed_callables`` is plain Python over the public graph API (warm up
on a side stream, capture every forward then every backward in reverse order into one
shared pool, join each pair with an ``autograd.Function``). Rather than re-type it, the
emulator runs *that very function* with ``torch.cuda`` pointing at the emulator, so its
checks (no module hooks, tensors only), its capture order and its replay logic are the
installed PyTorch's, on every version. Lesson 04 rebuilds the same idea by hand.

Its refusal of autocast's cast cache (``torch.is_autocast_enabled() and
torch.is_autocast_cache_enabled()``) holds too: under ``torch.autocast(B.device.type)`` it
raises unless ``cache_enabled=False``, as on a GPU.
"""

from __future__ import annotations

import types

import torch
import torch.cuda.graphs as _torch_graphs

from labkit.emulator.device import DEVICE_TYPE
from labkit.emulator.graph import CUDAGraph, graph, graph_pool_handle, is_current_stream_capturing
from labkit.emulator.streams import Stream, current_stream, stream, synchronize


class _TorchWithEmulatedCuda:
    """``torch``, except that ``.cuda`` is the emulator."""

    def __init__(self, cuda_ns):
        self.cuda = cuda_ns

    @staticmethod
    def is_autocast_enabled(device_type: str | None = None) -> bool:
        """``torch.is_autocast_enabled()`` without an argument asks about CUDA, which on the
        emulator is the emulated device: torch's refusal of the autocast cache holds."""
        if device_type is None or device_type == "cuda":
            device_type = DEVICE_TYPE
        return torch.is_autocast_enabled(device_type)

    def __getattr__(self, name):
        return getattr(torch, name)


def _build():
    cuda_ns = types.SimpleNamespace(
        CUDAGraph=CUDAGraph, graph=graph, graph_pool_handle=graph_pool_handle,
        Stream=Stream, stream=stream, current_stream=current_stream, synchronize=synchronize,
        is_current_stream_capturing=is_current_stream_capturing, _POOL_HANDLE=tuple,
    )
    original = _torch_graphs.make_graphed_callables
    globs = dict(original.__globals__)
    globs.update(torch=_TorchWithEmulatedCuda(cuda_ns), graph_pool_handle=graph_pool_handle,
                 CUDAGraph=CUDAGraph, graph=graph)
    fn = types.FunctionType(original.__code__, globs, original.__name__,
                            original.__defaults__, original.__closure__)
    fn.__kwdefaults__ = original.__kwdefaults__
    fn.__doc__ = original.__doc__
    return fn


_impl = None


def make_graphed_callables(callables, sample_args, num_warmup_iters: int = 3,
                           allow_unused_input: bool = False, pool=None):
    """Graph the forward and backward of each callable (``torch.cuda``'s, on the emulator).

    Same arguments, same rules and the same result as
    ``torch.cuda.make_graphed_callables``: modules must have no hooks when passed, only
    parameters may require grad, sample args must be tensors, and a graphed callable must
    be called with arguments of the same shapes, dtypes and order as ``sample_args``.
    """
    global _impl
    if _impl is None:
        _impl = _build()
    return _impl(callables, sample_args, num_warmup_iters=num_warmup_iters,
                 allow_unused_input=allow_unused_input, pool=pool)
