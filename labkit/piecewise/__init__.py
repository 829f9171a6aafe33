"""labkit.piecewise — lesson 09: piecewise CUDA graphs for prefill and mixed batches.

    split     split_at_attention, split_graph, split_labels  (vLLM's split_graph, on torch.fx)
    buckets   vllm_token_buckets, token_buckets             (token-count buckets)
    runner    PiecewiseBackend, PiecewiseGraphRunner        (pieces per bucket, eager attention)
    dispatch  GraphMode, Dispatcher, make_mixed_batch       (vLLM's FULL / PIECEWISE / NONE)
"""

from .buckets import token_buckets, vllm_token_buckets
from .dispatch import Dispatcher, GraphMode, make_mixed_batch
from .runner import (
    EagerAttention,
    GraphedPiece,
    PiecewiseBackend,
    PiecewiseGraphRunner,
    capture_batch,
)
from .split import SplitItem, SplitModel, split_at_attention, split_graph, split_labels

__all__ = ["Dispatcher", "GraphMode", "make_mixed_batch",
           "token_buckets", "vllm_token_buckets",
           "EagerAttention", "GraphedPiece", "capture_batch", "PiecewiseBackend",
           "PiecewiseGraphRunner",
           "SplitItem", "SplitModel", "split_at_attention", "split_graph", "split_labels"]
