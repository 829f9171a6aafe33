"""labkit.tp — lesson 10: collectives inside a CUDA graph (tensor-parallel decode).

Lesson 06's decode model split over N ranks the way Megatron-LM, vLLM and SGLang split
it (column-parallel QKV and MLP-up, row-parallel attention output and MLP-down, one
all-reduce after each of the two), on ``torch.distributed`` itself, and captured per
decode bucket by lesson 06's runner with the all-reduces inside the graphs. One module
per idea:

    comm     TPGroup, all_reduce (functional collectives), record_collectives,
             check_same_collectives, CollectiveMismatchError
    layers   ColumnParallelLinear, RowParallelLinear, shard_rows / shard_cols / shard_parts
    model    build_tp_model (this rank's share of build_model's weights), TPTransformer
    runner   TPDecodeGraphRunner (DecodeGraphRunner + the checks every rank must pass)
    launch   launch(fn, world_size, backend): N processes, one rank each
    demos    compare_with_one_rank and the broken captures the lesson shows

On a CPU the emulator records the functional collectives in capture and replays them
over gloo (:mod:`labkit.emulator.collectives`); on GPUs the same code runs over NCCL.

    from labkit.tp import launch
    from labkit.tp.demos import compare_with_one_rank
    r0, r1 = launch(compare_with_one_rank, world_size=2, backend="gloo")
    assert r0["tokens_equal"] and all(r0["allclose"].values())
"""

from .comm import (
    CollectiveMismatchError,
    TPGroup,
    all_reduce,
    check_same_collectives,
    check_same_values,
    record_collectives,
)
from .launch import LaunchError, launch
from .layers import ColumnParallelLinear, RowParallelLinear, shard_cols, shard_parts, shard_rows
from .model import TPTransformer, build_tp_model, check_tp_args
from .runner import CollectiveGraphBackend, TPDecodeGraphRunner

__all__ = [
    "CollectiveMismatchError", "TPGroup", "all_reduce", "check_same_collectives",
    "check_same_values", "record_collectives", "LaunchError", "launch",
    "ColumnParallelLinear", "RowParallelLinear", "shard_cols", "shard_parts", "shard_rows",
    "TPTransformer", "build_tp_model", "check_tp_args", "CollectiveGraphBackend",
    "TPDecodeGraphRunner",
]
