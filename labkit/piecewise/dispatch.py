"""Which graph runs a batch: FULL, PIECEWISE or none (vLLM's ``CudagraphDispatcher``).

vLLM's ``FULL_AND_PIECEWISE`` mode keeps two sets of graphs: full graphs for uniform
decode batches (every request feeds the same number of tokens, so attention's shape is
fixed by the batch size too) and piecewise graphs for everything else. Its
``CudagraphDispatcher.dispatch`` (``vllm/v1/cudagraph_dispatcher.py``) looks a batch up
in that order: a FULL key for it, then a PIECEWISE key, else ``NONE`` (eager). Here:

* ``FULL``       a DECODE batch that lesson 06's :class:`~labkit.decode.DecodeGraphRunner`
                 can replay (its requests fit a bucket);
* ``PIECEWISE``  any other batch whose tokens fit a token bucket of the
                 :class:`~labkit.piecewise.PiecewiseGraphRunner`: prefill and mixed
                 prefill + decode batches, and decode batches above the full graphs;
* ``NONE``       the rest, eagerly: warned the first time, counted in ``stats``.
"""

from __future__ import annotations

import enum
from typing import Mapping, Sequence

import torch

from labkit.core.validate import check_int
from labkit.decode.batch import ForwardBatch, ForwardMode, check_model, make_extend_batch
from labkit.decode.capture_utils import warn_fallback_once
from labkit.decode.graph_runner_base import EagerRunner
from labkit.decode.runner import DecodeGraphRunner

from .runner import PiecewiseGraphRunner

__all__ = ["GraphMode", "Dispatcher", "make_mixed_batch"]


class GraphMode(enum.Enum):
    NONE = "none"
    PIECEWISE = "piecewise"
    FULL = "full"


def make_mixed_batch(model, prefill: Mapping[int, Sequence[int]],
                     decode: Mapping[int, tuple[int, int]]) -> ForwardBatch:
    """One batch with new prompts *and* running requests (chunked prefill's mixed batch).

    prefill   {slot: prompt tokens} for requests starting now
    decode    {slot: (token, position)} for running requests, one new token each

    A decode request is an extend of one token after ``position`` tokens already in its
    cache, so the batch is an EXTEND batch (:func:`~labkit.decode.make_extend_batch`):
    prompts first, then the decode tokens.
    """
    for name, m in (("prefill", prefill), ("decode", decode)):
        if not isinstance(m, Mapping):
            raise TypeError(f"make_mixed_batch: {name} must be a dict keyed by slot, got "
                            f"{type(m).__name__}")
    both = sorted(set(prefill) & set(decode))
    if both:
        raise ValueError(f"make_mixed_batch: slot(s) {both} are in both prefill and decode: "
                         "a request either starts or runs in one step")
    for slot, p in prefill.items():
        if isinstance(p, (str, bytes, torch.Tensor)) or not hasattr(p, "__iter__"):
            raise TypeError(f"make_mixed_batch: prefill[{slot}] must be a list of token ids "
                            f"(ints), got {p!r:.40} ({type(p).__name__})")
        for j, t in enumerate(p):
            check_int(f"make_mixed_batch: prefill[{slot}][{j}]", t, None,
                      fix="a prompt is a list of token ids")
    for slot, td in decode.items():
        if not (isinstance(td, (tuple, list)) and len(td) == 2):
            raise TypeError(f"make_mixed_batch: decode[{slot}] must be (token, position), "
                            f"got {td!r}")
        check_int(f"make_mixed_batch: decode[{slot}]'s token", td[0], None,
                  fix="decode maps a slot to (token, position)")
        check_int(f"make_mixed_batch: decode[{slot}]'s position", td[1], 0,
                  fix="the tokens already in the request's cache (its new token's position)")
    slots = list(prefill) + list(decode)
    prompts = [list(p) for p in prefill.values()] + [[t] for t, _ in decode.values()]
    prefix_lens = [0] * len(prefill) + [p for _, p in decode.values()]
    return make_extend_batch(model, slots, prompts, prefix_lens)


class Dispatcher:
    """Run each batch on the graphs that fit it: FULL, then PIECEWISE, else eager.

    model      the :class:`~labkit.decode.model.Transformer` both runners were built on
    full       a captured :class:`~labkit.decode.DecodeGraphRunner` (or None)
    piecewise  a captured :class:`~labkit.piecewise.PiecewiseGraphRunner` (or None)

    ``stats`` counts the batches each mode ran; ``last_mode`` is the last one's.
    """

    def __init__(self, model, full: DecodeGraphRunner | None = None,
                 piecewise: PiecewiseGraphRunner | None = None):
        check_model(model, "Dispatcher")
        for name, runner, cls in (("full", full, DecodeGraphRunner),
                                  ("piecewise", piecewise, PiecewiseGraphRunner)):
            if runner is None:
                continue
            if not isinstance(runner, cls):
                raise TypeError(f"Dispatcher: {name} must be a {cls.__name__} or None, got "
                                f"{type(runner).__name__}")
            if runner.model is not model:
                raise ValueError(f"Dispatcher: the {name} runner was built on another model; "
                                 "build every runner on the model the dispatcher runs")
            if not runner.captured:
                raise RuntimeError(f"Dispatcher: the {name} runner has no graphs yet: call its "
                                   "capture() first")
        if full is not None and full.capture_forward_mode is not ForwardMode.DECODE:
            raise ValueError(f"Dispatcher: full must hold DECODE graphs (one token per request: "
                             f"the batches FULL runs); this runner captured "
                             f"{full.capture_forward_mode.name} with {full.num_tokens_per_bs} "
                             "tokens per request, so no batch would ever run on it. Pass a "
                             "DecodeGraphRunner(model, B) (num_tokens_per_bs=1)")
        self.model = model
        self.full = full
        self.piecewise = piecewise
        self.eager = EagerRunner(model)
        self.stats = {m.value: 0 for m in GraphMode}
        self.last_mode: GraphMode | None = None
        self._warned_fallback = False

    def dispatch(self, batch: ForwardBatch) -> GraphMode:
        """The mode ``batch`` runs in (nothing runs)."""
        if not isinstance(batch, ForwardBatch):
            raise TypeError(f"Dispatcher: expected a ForwardBatch (make_decode_batch, "
                            f"make_extend_batch, make_mixed_batch), got {type(batch).__name__}")
        if (self.full is not None and batch.forward_mode is ForwardMode.DECODE
                and self.full.can_run(batch)):
            return GraphMode.FULL
        if self.piecewise is not None and self.piecewise.can_run(batch):
            return GraphMode.PIECEWISE
        return GraphMode.NONE

    @torch.no_grad()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        mode = self.dispatch(batch)
        if mode is GraphMode.FULL:
            logits = self.full.replay(batch)
        elif mode is GraphMode.PIECEWISE:
            logits = self.piecewise.replay(batch)
        else:
            warn_fallback_once(self, f"Dispatcher: no graph fits this "
                                     f"{batch.forward_mode.name} batch ({batch.batch_size} "
                                     f"requests, {batch.num_tokens} tokens); it runs eagerly "
                                     "(counted in dispatcher.stats['none']; this warning is "
                                     "shown once)", UserWarning)
            logits = self.eager.forward(batch)
        self.stats[mode.value] += 1
        self.last_mode = mode
        return logits
