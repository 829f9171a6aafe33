"""What lesson 09's checkers share."""

from __future__ import annotations

import contextlib

import torch

from labkit.checks.host_reads import HostReads  # noqa: F401  (lesson 09's checkers use it)


@contextlib.contextmanager
def one_thread(device="cpu"):
    """One intra-op thread while a checker runs on the CPU (on host tensors, or on the
    emulated device, whose data lives in host memory; labkit's only other device is
    CUDA): its tensors are tiny, and two threads make each op several times slower (more
    so on a busy machine)."""
    if torch.device(device).type == "cuda":
        yield
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


_BOILERPLATE = ("Search for `cuda", "CUDA kernel errors might be asynchronously",
                "For debugging consider passing CUDA_LAUNCH_BLOCKING",
                "Compile with `TORCH_USE_CUDA_DSA`")


def short_description(exc: BaseException) -> str:
    """:func:`labkit.checks.describe_exception` of the error a failed capture started
    with, without CUDA's boilerplate lines (where to search, how to debug)."""
    from labkit.checks import describe_exception
    from labkit.core.errors import capture_cause

    text = describe_exception(capture_cause(exc))
    return "\n".join(ln for ln in text.split("\n")
                     if ln.strip() and not ln.startswith(_BOILERPLATE))
