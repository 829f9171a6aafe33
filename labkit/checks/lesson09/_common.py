"""What lesson 09's checkers share."""

from __future__ import annotations

import contextlib

import torch

from labkit.checks import short_description  # noqa: F401  (lesson 09's checkers use it)
from labkit.checks.host_reads import HostReads  # noqa: F401  (likewise)


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


