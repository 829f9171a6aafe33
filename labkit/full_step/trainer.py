"""The whole-step trainer (two graphs: forward+backward, then the optimizer) and its eager
reference."""

from __future__ import annotations

from typing import Callable, Iterable, Sequence

import torch
from torch import nn

from labkit import backend
from labkit.core.models import LMConfig, lm_loss
from labkit.core.validate import check_int

from .loader import StaticBatchLoader
from .optimizer import (
    check_found_inf,
    ensure_grads,
    make_capturable_optimizer,
    require_optimizer_state,
)
from .step import forward_backward, nonfinite_flag
from .wrapper import FullCudaGraphWrapper, OptimizerCudaGraphWrapper

__all__ = ["FullStepTrainer", "EagerTrainer"]


class FullStepTrainer:
    """A training step as two graphs: forward+backward of all microbatches, then AdamW.

    ::

        trainer = FullStepTrainer(model, lm_loss, make_capturable_optimizer(...), B,
                                  num_microbatches=4, warmup_steps=2)
        for batch in data:                 # batch: a list of 4 microbatches
            loss = trainer.step(batch)     # eager, eager, capture+replay, replay, ...

    Each step: ``loader.load(batch)`` copies the data into the static buffers, then the
    forward-backward wrapper (zero grads in place, forward and backward of every
    microbatch, optionally the ``found_inf`` check) and the optimizer wrapper run: eagerly
    during warm-up, as replays after. Both graphs share one pool and one capture stream.

    Args:
        model, loss_fn: ``loss_fn(model, microbatch)`` returns a scalar loss.
        optimizer: a capturable optimizer (:func:`make_capturable_optimizer`).
        B: the backend (``labkit.backend.get(...)``).
        num_microbatches: microbatches per step, fixed by the capture.
        warmup_steps: eager steps before the capture.
        check_finite: keep ``trainer.found_inf`` up to date inside the graph: 1.0 when a
            gradient of this step is inf or NaN, else 0.0 (a float32 scalar on the device,
            GradScaler's ``found_inf``). Read it after the step.
        found_inf: the flag tensor to use (implies ``check_finite``). Left out, it is the
            optimizer's ``found_inf`` if it has one: an optimizer from
            ``make_capturable_optimizer(..., found_inf=flag)`` holds its flag there and
            skips a step when it is 1.0, so a step with a non-finite gradient leaves the
            weights untouched (:meth:`skip_nonfinite` builds both). Given, it must be
            that same tensor.
        generators: custom generators the step draws from.

    Misuse is refused before anything is captured: a non-capturable optimizer, an
    optimizer whose state would be created inside the capture (``warmup_steps=0``), a
    ``found_inf`` other than the optimizer's,
    microbatches of the wrong count, structure or shape, token ids outside the model's
    vocabulary (checked on every step for tokens on the CPU; for tokens on the GPU on the
    eager and capturing steps only, since the check costs a sync). A capture that fails
    anyway leaves no graph and a usable process.

    .. warning::
        Each graph gets its own cuBLAS workspace from its pool
        (:func:`labkit.capture.own_cublas_workspace`). A graph that recorded the workspace
        cuBLAS had cached for the warm-up stream writes into freed memory once something
        frees the cached workspaces, as ``torch.compile(mode="reduce-overhead")`` does
        around its own recordings (cudagraph trees' ``clear_cublas_manager``): an illegal
        memory access that poisons the CUDA context.
    """

    def __init__(self, model: nn.Module, loss_fn: Callable, optimizer: torch.optim.Optimizer,
                 B, num_microbatches: int, warmup_steps: int = 2, check_finite: bool = False,
                 found_inf: torch.Tensor | None = None,
                 generators: Iterable[torch.Generator] = ()):
        num_microbatches = check_int("num_microbatches", num_microbatches, 1,
                                     fix="every step has at least one microbatch")
        warmup_steps = check_int("warmup_steps", warmup_steps, 0,
                                 fix="the number of eager steps before the capture")
        B = backend.ensure(B, "FullStepTrainer(..., B, ...)")
        _check_capturable(optimizer, B)
        found_inf = _the_flag(optimizer, found_inf, B)
        self.model, self.loss_fn, self.optimizer, self.B = model, loss_fn, optimizer, B
        self.vocab_size = _vocab_size(model)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.grads = ensure_grads(self.params)
        if warmup_steps == 0:       # with the grads in place: the params that need state
            require_optimizer_state(optimizer, warmup_steps)
        self.check_finite = check_finite or found_inf is not None
        self.found_inf = (found_inf if found_inf is not None
                          else torch.zeros((), device=B.device))
        self.stream = B.Stream()                    # one capture stream for both graphs
        self.pool = B.graph_pool_handle()           # one pool for both graphs
        self.loader = StaticBatchLoader(B, num_microbatches, stream=B.Stream())
        self.fwd_bwd = FullCudaGraphWrapper(self._forward_backward, B, warmup_steps,
                                            pool=self.pool, stream=self.stream,
                                            generators=generators, name="forward_backward")
        self.opt_step = OptimizerCudaGraphWrapper(optimizer, B, warmup_steps, pool=self.pool,
                                                  stream=self.stream)

    @classmethod
    def skip_nonfinite(cls, model, loss_fn, B, num_microbatches, warmup_steps=2, **adam_kw):
        """A trainer whose AdamW skips, on the device, every step with an inf/NaN gradient:
        torch's fused AdamW reading the trainer's ``found_inf``
        (``make_capturable_optimizer(..., found_inf=flag)``); ``adam_kw`` go to it."""
        B = backend.ensure(B, "FullStepTrainer.skip_nonfinite(model, loss_fn, B, ...)")
        flag = torch.zeros((), device=B.device)
        params = [p for p in model.parameters() if p.requires_grad]
        opt = make_capturable_optimizer(params, B, found_inf=flag, **adam_kw)
        return cls(model, loss_fn, opt, B, num_microbatches, warmup_steps)

    def _forward_backward(self) -> torch.Tensor:
        torch._foreach_zero_(self.grads)            # in place: same addresses every step
        loss = forward_backward(self.model, self.loss_fn, self.loader.buffers)
        if self.check_finite:
            self.found_inf.zero_()                  # every replay: this step's verdict only
            nonfinite_flag(self.found_inf, self.grads)
        return loss

    @property
    def iteration(self) -> int:
        return self.fwd_bwd.curr_iteration

    @property
    def captured(self) -> bool:
        return self.fwd_bwd.graph is not None

    @property
    def graphs(self) -> list:
        return [g for g in (self.fwd_bwd.graph, self.opt_step.graph) if g is not None]

    def _check_batch(self, microbatches) -> None:
        n = self.loader.num_microbatches
        if not isinstance(microbatches, (list, tuple)):
            raise TypeError(f"step() expects a list of {n} microbatches, got a "
                            f"{type(microbatches).__name__}")
        if len(microbatches) != n:
            raise ValueError(f"step() got {len(microbatches)} microbatches, the trainer was "
                             f"built with num_microbatches={n} (the captured schedule has a "
                             "fixed count): pass exactly that many")
        if self.loss_fn is not lm_loss:
            return
        for i, mb in enumerate(microbatches):
            if not isinstance(mb, (tuple, list)) or len(mb) != 2:
                what = (f"a {type(mb).__name__} of {len(mb)}" if isinstance(mb, (tuple, list))
                        else f"a {type(mb).__name__}")
                raise ValueError(f"microbatch {i} is {what}; lm_loss needs a pair "
                                 "(tokens, targets) for every microbatch")
            tokens, targets = mb
            if tokens.shape != targets.shape:
                raise ValueError(f"microbatch {i}: targets {tuple(targets.shape)} for tokens "
                                 f"{tuple(tokens.shape)}: every token needs its target")
            if self.vocab_size is None:
                continue
            check_values = tokens.device.type == "cpu" or not self.captured
            if not check_values:
                continue
            for name, t in (("tokens", tokens), ("targets", targets)):
                if t.numel() == 0:
                    continue
                lo, hi = (int(v) for v in torch.aminmax(t))
                if lo < 0 or hi >= self.vocab_size:
                    bad = lo if lo < 0 else hi
                    raise ValueError(
                        f"microbatch {i}: {name} hold the id {bad}, outside the model's "
                        f"vocabulary [0, {self.vocab_size}). A bad id would index past the "
                        "embedding (on a GPU: a device-side assert that ends the process). "
                        "Fix the data or build the model with a larger vocab_size.")

    def step(self, microbatches: Sequence) -> torch.Tensor:
        """One training step on ``microbatches``; returns the step's mean loss."""
        self._check_batch(microbatches)
        self.loader.load(microbatches)
        loss = self.fwd_bwd()
        self.opt_step()
        return loss


def _check_capturable(optimizer, B) -> None:
    """Refuse, before any capture, an optimizer whose ``step()`` cannot be captured."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got "
                        f"{type(optimizer).__name__}")
    name = type(optimizer).__name__
    flags = [g.get("capturable") for g in optimizer.param_groups]
    if all(f is None for f in flags):
        return                      # an optimizer without the flag: its own business
    if not all(flags):
        raise ValueError(
            f"{name} has capturable=False: its step count lives on the host and its bias "
            "corrections are Python floats, which a graph would bake in (torch refuses "
            f"such a step in capture). Build it with {name}(..., capturable=True), or use "
            "FS.make_capturable_optimizer(params, B).")


def _the_flag(optimizer, found_inf, B) -> torch.Tensor | None:
    """The one ``found_inf`` both graphs use: the trainer's and the optimizer's, if any."""
    held = getattr(optimizer, "found_inf", None)
    if found_inf is None:
        found_inf = held
    elif held is not None and held is not found_inf:
        raise ValueError(
            f"found_inf is not the flag the optimizer reads: {type(optimizer).__name__} "
            "holds optimizer.found_inf, another tensor, so a step the trainer flags would "
            "not be skipped. Pass found_inf=optimizer.found_inf, or leave found_inf out "
            "(the trainer then uses the optimizer's).")
    if found_inf is not None:
        check_found_inf(found_inf, B.device, "FullStepTrainer")
    return found_inf


def _vocab_size(model: nn.Module) -> int | None:
    cfg = getattr(model, "cfg", None)
    if isinstance(cfg, LMConfig):
        return cfg.vocab_size
    for m in model.modules():
        if isinstance(m, nn.Embedding):
            return m.num_embeddings
    return None


class EagerTrainer:
    """The reference: the same step without graphs (``zero_grad``, forward and backward of
    every microbatch, ``optimizer.step()``), with ``torch.optim.AdamW`` by default."""

    def __init__(self, model: nn.Module, loss_fn: Callable,
                 optimizer: torch.optim.Optimizer | None = None, **adam_kw):
        self.model, self.loss_fn = model, loss_fn
        self.optimizer = optimizer or torch.optim.AdamW(model.parameters(), **adam_kw)

    def step(self, microbatches: Sequence) -> torch.Tensor:
        self.optimizer.zero_grad(set_to_none=False)
        loss = forward_backward(self.model, self.loss_fn, microbatches)
        self.optimizer.step()
        return loss
