"""The whole-step wrappers: warm up eagerly, capture once, replay from then on."""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch

from labkit import backend
from labkit.capture import capturing, cleanup_on_failure, on_side_stream
from labkit.core.validate import check_int

from .optimizer import require_optimizer_state
from .step import phase

__all__ = ["FullCudaGraphWrapper", "OptimizerCudaGraphWrapper"]


class FullCudaGraphWrapper:
    """Run ``step_fn()`` eagerly ``warmup_steps`` times, capture it at the next call, and
    replay it from then on (Megatron's ``FullCudaGraphWrapper.__call__``).

    Args:
        step_fn: takes no arguments and reads its inputs from static buffers (see
            :class:`~labkit.full_step.StaticBatchLoader`): that makes it capturable.
        B: the backend (``labkit.backend.get(...)``).
        warmup_steps: eager calls before the capture (lazy init, optimizer state).
        pool: the memory pool to capture into; share one with the optimizer graph
            (``B.graph_pool_handle()``, Megatron's ``use_single_mempool``).
        stream: warm-up steps and the capture run on it (default: a new side stream);
            replays run on the caller's stream.
        generators: custom ``torch.Generator``\\ s the step draws from, registered with
            the graph (CUDA graphs register the default generator themselves).
        capture_error_mode: ``"global"``, ``"thread_local"`` (Megatron's choice: only
            this thread's unsafe calls break the capture) or ``"relaxed"``.
        name: a label for messages and plots.

    .. warning::
        From the capture on, each call returns the graph's static output: the *same*
        tensors every time, overwritten by each replay. ``clone()`` what you keep.
    """

    def __init__(self, step_fn: Callable[[], Any], B, warmup_steps: int = 2, pool=None,
                 stream=None, generators: Iterable[torch.Generator] = (),
                 capture_error_mode: str = "thread_local", name: str = "step"):
        warmup_steps = check_int("warmup_steps", warmup_steps, 0,
                                 fix="the number of eager steps before the capture")
        B = backend.ensure(B, "FullCudaGraphWrapper(step_fn, B)")
        if capture_error_mode not in ("global", "thread_local", "relaxed"):
            raise ValueError(f"capture_error_mode must be 'global', 'thread_local' or "
                             f"'relaxed', got {capture_error_mode!r}")
        self.step_fn = step_fn
        self.B = B
        self.warmup_steps = warmup_steps
        self.pool = pool
        self.stream = stream if stream is not None else B.Stream()
        self.generators = list(generators)
        self.capture_error_mode = capture_error_mode
        self.name = name
        self.graph = None
        self.result = None
        self.curr_iteration = 0
        self.captured_at: int | None = None
        self.calls = {"eager": 0, "capture": 0, "replay": 0}

    def _on_stream(self, fn):
        with on_side_stream(self.B, self.stream):
            return fn()

    def capture(self) -> None:
        """Capture ``step_fn`` into a new graph (records; computes nothing).

        A capture that raises leaves no graph and a usable process (default stream
        current, random ops allowed again); the error propagates unchanged.
        """
        B = self.B
        g = B.CUDAGraph()
        for gen in self.generators:
            g.register_generator_state(gen)
        B.synchronize()                 # the barrier before: nothing in flight is captured
        self.result = None              # a capture that raises leaves no result
        with cleanup_on_failure(B), capturing(B, g, pool=self.pool, stream=self.stream,
                                              capture_error_mode=self.capture_error_mode):
            self.result = self.step_fn()
        B.synchronize()                 # the barrier after: the capture has fully ended
        self.graph = g
        if self.pool is None:
            self.pool = g.pool()
        self.captured_at = self.curr_iteration
        self.calls["capture"] += 1

    def __call__(self):
        what = phase(self.curr_iteration, self.warmup_steps, self.graph is not None)
        if what == "eager":
            self.result = self._on_stream(self.step_fn)
            self.calls["eager"] += 1
        else:
            if what == "capture":
                self.capture()      # records the step, computes nothing...
            self.graph.replay()     # ...so this iteration replays too
            self.calls["replay"] += 1
        self.curr_iteration += 1
        return self.result

    def reset(self) -> None:
        """Drop the graph; the next call captures again (e.g. after the shapes change)."""
        if self.graph is not None:
            self.graph.reset()
        self.graph, self.result, self.captured_at = None, None, None
        self.curr_iteration = self.warmup_steps


class OptimizerCudaGraphWrapper(FullCudaGraphWrapper):
    """``optimizer.step()`` as a second graph, captured at the same step as the
    forward-backward graph and in the same pool (Megatron's ``OptimizerCudaGraphWrapper``).

    The optimizer must be capturable (see :func:`make_capturable_optimizer`), and its
    state must exist when it is captured (:func:`require_optimizer_state` refuses the
    capture otherwise). Replay it right after the forward-backward graph, the order in
    which the two were captured: graphs that share a pool are only safe when replayed in
    capture order.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, B, warmup_steps: int = 2, pool=None,
                 stream=None, **kw):
        self.optimizer = optimizer
        super().__init__(optimizer.step, B, warmup_steps, pool=pool, stream=stream,
                         name="optimizer", **kw)

    def capture(self) -> None:
        # state created inside the capture would be reset by every replay: refuse first
        require_optimizer_state(self.optimizer, self.warmup_steps)
        super().capture()
