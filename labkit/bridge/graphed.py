"""``make_graphed_callables`` built from :class:`~labkit.bridge.runner.GraphRunner`, with
``torch.cuda.make_graphed_callables``'s contract, and the module wrapper it returns."""

from __future__ import annotations

import torch

from labkit.backend import check_graph_options, ensure
from labkit.bridge.runner import GraphRunner, _check_arg_tuple, _refuse_kwargs
from labkit.core.validate import check_int

__all__ = ["GraphedModule", "make_graphed_callables"]


def _check_callables(callables, sample_args) -> tuple[tuple, tuple, bool]:
    """``(callables, sample_args, single)`` for :func:`make_graphed_callables`, checked:
    one callable with a tuple of its arguments, or a tuple of callables with a tuple of
    argument tuples of the same length (torch's convention)."""
    if isinstance(callables, list):
        raise TypeError("make_graphed_callables: pass several callables as a tuple, not a "
                        "list (torch's convention): tuple(callables), with sample_args a "
                        "tuple of argument tuples, one per callable.")
    single = not isinstance(callables, tuple)
    if single:
        callables = (callables,)
        sample_args = (_check_arg_tuple(sample_args, "sample_args"),)
    else:
        if not callables:
            raise ValueError("make_graphed_callables: callables is an empty tuple; pass one "
                             "callable, or a tuple of them")
        sample_args = _check_arg_tuple(sample_args, "sample_args",
                                       " (with several callables: a tuple of such tuples)")
        if len(callables) != len(sample_args):
            raise ValueError(f"make_graphed_callables: {len(callables)} callables but "
                             f"{len(sample_args)} entries in sample_args; give one tuple of "
                             f"sample arguments per callable, in the same order.")
        sample_args = tuple(_check_arg_tuple(a, f"sample_args[{i}]")
                            for i, a in enumerate(sample_args))
    for i, c in enumerate(callables):
        if not callable(c):
            raise TypeError(f"make_graphed_callables: callables[{i}] is a "
                            f"{type(c).__name__}, not a module or function")
    return callables, sample_args, single


class GraphedModule(torch.nn.Module):
    """A module whose calls replay its graphs while it is in the mode it was captured in
    (training or eval), and run eagerly otherwise, like torch's graphed modules.

    ``.module`` is the original (its parameters are this module's parameters, so an
    optimizer can be built from either); ``.runner`` holds the graphs.
    """

    def __init__(self, module: torch.nn.Module, runner: GraphRunner):
        super().__init__()
        self.module = module
        self.runner = runner
        self._captured_training = module.training

    def forward(self, *args, **kwargs):
        if kwargs:
            _refuse_kwargs(self.runner.name, kwargs)
        if self.module.training == self._captured_training:
            return self.runner(*args)
        return self.module(*args)


def make_graphed_callables(callables, sample_args, *, B=None, pool=None,
                           num_warmup_iters: int = 3, **runner_kw):
    """Graph the forward and backward of each callable, from scratch.

    The same contract as ``torch.cuda.make_graphed_callables``: ``callables`` is one
    module/function or a tuple of them, ``sample_args`` the matching tuple of argument
    tuples; the result is a graphed callable (or a tuple of them) that must be called
    with arguments of the same shapes and dtypes. All graphs share one pool; every
    callable is warmed up first (:meth:`GraphRunner.warmup`), then forwards are captured
    in the order given and backwards in reverse order, which is the order a model that
    calls them in sequence replays them in.

    ``runner_kw`` is passed to each :class:`GraphRunner` (``generators``,
    ``clone_wgrads``...). Modules come back wrapped in :class:`GraphedModule`; functions
    (no parameters) as their runner.

    .. warning::
        A sample that does not require grad gets no dgrad in the backward graph. torch's
        own function then leaves a live input's ``.grad`` at ``None`` without a word
        (its docs ask for matching ``requires_grad``); labkit's refuses such a call,
        because an upstream layer or pipeline stage would silently never train. Give
        the sample ``requires_grad=True`` wherever the real input may require grad.
        ``sample_args`` is a tuple of arguments (``(x,)``): a bare tensor is refused,
        since ``tuple(x)`` would split it along its first dimension.
    """
    B = ensure(B)
    callables, sample_args, single = _check_callables(callables, sample_args)
    check_int("num_warmup_iters", num_warmup_iters, minimum=0)
    check_graph_options(B, pool, None, where="make_graphed_callables")
    pool = pool if pool is not None else B.graph_pool_handle()
    runners = []
    for c, args in zip(callables, sample_args):
        module = c if isinstance(c, torch.nn.Module) else torch.nn.Module()
        if isinstance(c, torch.nn.Module) and (c._forward_hooks or c._forward_pre_hooks
                                                or c._backward_hooks):
            raise ValueError(f"{type(c).__name__} has module hooks: a graph would run them "
                             "once, at capture, not at every call. Remove them first.")
        runners.append(GraphRunner(module, B, pool=pool, func=c, num_warmup=num_warmup_iters,
                                   **runner_kw))
    for r, args in zip(runners, sample_args):   # every warm-up before the pool's first capture
        r.warmup(tuple(args))
    for r, args in zip(runners, sample_args):
        r.create_fwd_graph(tuple(args))
    for r in reversed(runners):
        if r.grad_enabled:
            r.create_bwd_graph()
    out = tuple(GraphedModule(c, r) if isinstance(c, torch.nn.Module) else r
                for c, r in zip(callables, runners))
    return out[0] if single else out
