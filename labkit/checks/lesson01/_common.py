"""Helpers shared by lesson 01's checkers: a random duration."""

from __future__ import annotations

import torch


def _uniform(gen: torch.Generator, lo: float, hi: float) -> float:
    """A duration in µs drawn from ``[lo, hi)``, rounded to 0.01 µs."""
    return round(float(torch.empty(()).uniform_(lo, hi, generator=gen)), 2)
