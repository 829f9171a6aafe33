"""Pipeline-parallel CUDA graphs: 1F1B, the execution record, ordered capture (lesson 05).

One module per idea:

=================  ===========================================================
``schedule``       1F1B (and GPipe) orders per stage, a timeline, a Gantt chart
``record``         the global record of step 1 and graph creation in that order
``runner``         ``CudaGraphManager``: record vs replay, which runner serves a call
``step``           one pipeline training step in one process, in 1F1B order
``te_style``       per layer x microbatch graphs from ``B.make_graphed_callables``
``moe``            a toy MoE layer: router graphed, dispatch eager
``distributed``    the same pipeline across processes (gloo / NCCL)
``models``         re-exports the toy block of lessons 04 and 05 (:mod:`labkit.core.models`)
=================  ===========================================================

The graph pair itself (runner, bridge, status machine) is :mod:`labkit.bridge`.
"""

from labkit.pipeline.record import GlobalRecord, RecordNode, reorder
from labkit.pipeline.runner import CudaGraphManager, graph_layers
from labkit.pipeline.schedule import (
                                      execution_order,
                                      gpipe,
                                      max_in_flight,
                                      num_warmup_microbatches,
                                      one_f_one_b,
                                      plot_schedule,
                                      simulate,
)
from labkit.pipeline.step import Stage, split_stages, train_step

__all__ = [
    "GlobalRecord", "RecordNode", "reorder", "CudaGraphManager", "graph_layers",
    "one_f_one_b", "gpipe", "num_warmup_microbatches", "max_in_flight", "simulate",
    "execution_order", "plot_schedule", "Stage", "split_stages", "train_step",
]
