"""Column- and row-parallel linears, and how a 1-rank weight is cut for them.

Megatron-LM's tensor parallelism (``ColumnParallelLinear`` / ``RowParallelLinear`` in
``megatron.core.tensor_parallel.layers``; vLLM's and SGLang's layers of the same names):

* a **column-parallel** linear ``Y = X Aᵀ`` splits ``A``'s output rows over ranks: rank
  ``r`` computes its slice of ``Y``, no communication (``gather_output=False``);
* a **row-parallel** linear splits ``A``'s input columns: rank ``r`` multiplies its slice
  of ``X`` (the column-parallel output it already holds) and gets a *partial* ``Y``; one
  all-reduce sums the partials (``reduce_results=True``).

A transformer block pairs them twice: QKV column-parallel (whole heads per rank), the
attention output row-parallel, then MLP-up column-parallel and MLP-down row-parallel, so
a block costs two all-reduces. The fused projections are cut part by part: ``wqkv`` holds
``[q; k; v]`` and each rank takes its heads of each (vLLM's ``QKVParallelLinear``), and
``w13`` holds ``[w1; w3]`` and each rank takes its rows of each
(``MergedColumnParallelLinear``).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .comm import TPGroup, all_reduce

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "shard_rows", "shard_cols",
           "shard_parts"]


def shard_rows(w: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """Rank ``rank``'s block of output rows of ``w`` (out, in)."""
    n = w.size(0) // world_size
    return w[rank * n:(rank + 1) * n]


def shard_cols(w: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """Rank ``rank``'s block of input columns of ``w`` (out, in)."""
    n = w.size(1) // world_size
    return w[:, rank * n:(rank + 1) * n]


def shard_parts(w: torch.Tensor, sizes: list[int], rank: int, world_size: int) -> torch.Tensor:
    """A fused weight ``[A; B; ...]`` (row blocks of ``sizes``) cut part by part: rank
    ``r``'s rows of each part, stacked in the same order."""
    parts = torch.split(w, sizes, dim=0)
    return torch.cat([shard_rows(p, rank, world_size) for p in parts], dim=0)


class ColumnParallelLinear(nn.Module):
    """``y_r = x @ A_rᵀ``: this rank's slice of the output, no communication."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.weight = nn.Parameter(weight.detach().clone(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class RowParallelLinear(nn.Module):
    """``y = Σ_r x_r @ A_rᵀ``: a partial product on each rank, then one all-reduce.

    .. warning::
        The all-reduce is a collective: every rank must run this layer, in the same
        order, with the same shapes, in eager mode and in every captured graph alike.
    """

    def __init__(self, weight: torch.Tensor, group: TPGroup):
        super().__init__()
        self.weight = nn.Parameter(weight.detach().clone(), requires_grad=False)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return all_reduce(F.linear(x, self.weight), self.group)
