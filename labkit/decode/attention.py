"""Attention backends by name (SGLang's ``--attention-backend``).

``torch_native`` (:mod:`~labkit.decode.torch_attention`) builds the attention metadata and
runs SDPA in stock torch ops, on every backend; ``triton``
(:mod:`~labkit.decode.triton_attention`) reads the keys through the page table in one
kernel, on CUDA. Both share the split into metadata prepared out of graph and in graph.
"""

from __future__ import annotations

from .torch_attention import DecodeMetadata, TorchNativeAttnBackend

__all__ = ["DecodeMetadata", "TorchNativeAttnBackend", "ATTENTION_BACKENDS", "check_attention_name",
           "make_attn_backend"]


ATTENTION_BACKENDS = ("torch_native", "triton", "auto")


def check_attention_name(name) -> str:
    """``name`` is one of :data:`ATTENTION_BACKENDS`, or a ValueError listing them."""
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}: choose one of "
                         f"{', '.join(ATTENTION_BACKENDS)}")
    return name


def make_attn_backend(name: str, model) -> TorchNativeAttnBackend:
    """A fresh attention backend by name (SGLang's ``--attention-backend``).

    ``"torch_native"`` (default everywhere: stock torch ops, runs on the emulator too),
    ``"triton"`` (:mod:`labkit.decode.triton_attention`: decode attention reads keys
    through the page table, no gather; CUDA only) or ``"auto"`` (triton where it can run,
    else torch_native)."""
    check_attention_name(name)
    if name != "torch_native":
        from .triton_attention import TritonAttnBackend, triton_available  # imports triton
        if name == "triton" or triton_available(model.device):
            return TritonAttnBackend(model)   # raises a clear error where it cannot run
    return TorchNativeAttnBackend(model)
