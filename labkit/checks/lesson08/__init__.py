"""Checkers for lesson 08 (torch.compile and CUDA graph trees), one module per exercise.

    from labkit.checks.lesson08 import check_reduce_overhead, check_decoder
"""

from labkit.checks.lesson08.decoder import check_decoder
from labkit.checks.lesson08.reduce_overhead import check_reduce_overhead

__all__ = ["check_reduce_overhead", "check_decoder"]
