"""Lesson 06's decode graph runner for a tensor-parallel model: collectives inside graphs.

:class:`TPDecodeGraphRunner` *is* :class:`labkit.decode.DecodeGraphRunner` (buckets,
static buffers, padding, the largest-first capture into one pool, replay, the eager
fallback), with two checks that a graph of collectives needs, run on every rank:

* before any capture (and before the warmups, which already run the collectives
  eagerly), every rank must capture the same bucket list: SGLang derives its list from
  ``--cuda-graph-max-bs``, and a rank that picked another one would capture different
  shapes (:func:`~labkit.tp.comm.check_same_values`);
* after each bucket's capture, every rank must have captured the same collectives in
  the same order (:func:`~labkit.tp.comm.check_same_collectives`), or the first replay
  hangs.

SGLang wraps its whole capture in ``graph_capture()`` (``parallel_state``), which enters
the custom all-reduce's and PyNccl's capture modes; vLLM does the same. Here the
collective is ``torch.distributed``'s own, which needs no such mode: ProcessGroupNCCL
records no work for its watchdog while the stream captures (pytorch/pytorch#102542).
"""

from __future__ import annotations

from labkit.decode.runner import DecodeGraphRunner, FullGraphBackend

from .comm import TPGroup, check_same_collectives, check_same_values, record_collectives
from .model import TPTransformer

__all__ = ["TPDecodeGraphRunner", "CollectiveGraphBackend"]


class CollectiveGraphBackend(FullGraphBackend):
    """:class:`~labkit.decode.runner.FullGraphBackend` that compares, after every capture,
    the collectives each rank captured (see :func:`~labkit.tp.comm.check_same_collectives`).
    ``signatures`` keeps this rank's: bucket → ``[(op, shape, dtype), ...]``."""

    def __init__(self, B, group: TPGroup, num_warmups: int = 2,
                 capture_error_mode: str = "global"):
        super().__init__(B, num_warmups, capture_error_mode)
        self.group = group
        self.signatures: dict = {}

    def capture_one(self, key, forward_fn, post_warmup_hook=None):
        with record_collectives() as captured:
            out = super().capture_one(key, forward_fn, post_warmup_hook)
        self.signatures[key] = list(captured)
        check_same_collectives(captured, self.group, f"the graph of bucket {key}")
        return out


class TPDecodeGraphRunner(DecodeGraphRunner):
    """Decode graphs of one rank's :class:`~labkit.tp.model.TPTransformer`, per bucket.

    Every rank builds one with the same options and calls :meth:`capture` and then
    replays the same buckets in the same order (the batch is the same on every rank:
    tensor parallelism splits the model, not the requests).

    Args:
        model: this rank's :func:`~labkit.tp.build_tp_model`.
        B: the backend namespace (``"cuda"`` with NCCL, ``"emulated"`` with gloo).
        capture_error_mode: ``B.graph``'s; ``"thread_local"`` when other threads of this
            process use the device while it captures (see the lesson).
        **kwargs: the options of :class:`~labkit.decode.DecodeGraphRunner`.
    """

    def __init__(self, model, B, capture_error_mode: str = "global", **kwargs):
        if not isinstance(model, TPTransformer):
            raise TypeError(f"TPDecodeGraphRunner: model must be this rank's "
                            f"labkit.tp.build_tp_model(...), got {type(model).__name__} (a "
                            "1-rank model runs in labkit.decode.DecodeGraphRunner)")
        self.group = model.tp_group
        self._capture_error_mode = capture_error_mode
        super().__init__(model, B, **kwargs)

    def make_graph_backend(self, B, num_warmups: int) -> CollectiveGraphBackend:
        return CollectiveGraphBackend(B, self.group, num_warmups, self._capture_error_mode)

    def capture(self) -> list[dict]:
        """Check that every rank captures the same buckets, then capture them all, each
        checked for the same collectives on every rank (see the module)."""
        check_same_values(list(self.buckets), self.group, "the bucket lists to capture",
                          "Every rank must capture the same buckets (the same max_bs and "
                          "bucket scheme): give every rank the same runner options")
        return super().capture()

    @property
    def signatures(self) -> dict:
        """Bucket → the collectives this rank captured into its graph."""
        return self.backend.signatures
