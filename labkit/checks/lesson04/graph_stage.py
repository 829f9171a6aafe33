"""Lesson 04, exercise ``graph_stage``: its checker.
"""

from __future__ import annotations

import random

import torch
from torch import nn

from labkit.backend import ensure as _backend
from labkit.checks import (
    DEFAULT_TIME_LIMIT,
    CheckResult,
    Exercise,
    attempt,
    describe_exception,
    fail,
    reject,
    run_check,
)
from labkit.checks.lesson04._common import _all_close, _close

__all__ = ["check_graph_stage"]


_GS_HINTS = [
    "Look at how the broken version makes the samples of blocks 1, 2, ...: under "
    "torch.no_grad() nothing it computes requires grad, so those graphs are captured "
    "without a dgrad for their input. Which of those inputs require grad when the stage "
    "really runs?",
    "Each block after the first is fed the previous block's output, which requires grad "
    "(the block has trainable parameters). Block 0 is fed the stage input: its sample must "
    "require grad exactly when `sample` does.",
    "Keep the no_grad walk for the shapes, and give block i > 0 the sample "
    "h.detach().clone().requires_grad_(); leave the caller's `sample` itself unchanged.",
]


class _StageBlock(nn.Module):
    def __init__(self, d_in: int, d_out: int, gen: torch.Generator):
        super().__init__()
        self.lin = nn.Linear(d_in, d_out)
        with torch.no_grad():
            for p in self.lin.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) / d_in ** 0.5)

    def forward(self, x):
        return torch.tanh(self.lin(x))


def _stage_config(rng: random.Random, trial: int) -> dict:
    """Trial 0: a first stage (its input needs no grad), three or four blocks; trial 1: a
    later stage (its input requires grad); then random. Widths change from block to block,
    so one shape for every sample is wrong."""
    n = rng.choice((3, 4)) if trial < 2 else rng.randint(2, 4)
    needs = {0: False, 1: True}.get(trial, rng.random() < 0.5)
    widths = [rng.choice((3, 4, 5, 6)) for _ in range(n + 1)]
    return {"n": n, "needs": needs, "widths": widths, "batch": rng.choice((2, 3))}


def _stage_grads(call, blocks, x, target):
    for b in blocks:
        b.zero_grad(set_to_none=True)
    h = x
    for c in call:
        h = c(h)
    ((h - target) ** 2).sum().backward()
    return [p.grad for b in blocks for p in b.parameters()], x.grad


EXERCISE = Exercise("graph_stage")


def _look(exc: BaseException) -> str:
    """The learner's error, with what to look at."""
    look = ("the samples you pass: one tuple (x,) per block, each shaped like that "
            "block's input (block i's input is block i-1's output)")
    if "during capture" in str(exc) or "legacy stream" in str(exc):
        look = ("a capture that failed on the GPU. An eager forward of these blocks "
                "whose outputs are still alive keeps its autograd graph, and that "
                "graph's AccumulateGrad nodes belong to the default stream: the "
                "backward capture then cannot run (torch warns about an AccumulateGrad "
                "stream mismatch). Find shapes under torch.no_grad(), or drop those "
                "outputs (del) before capturing (lesson 04 §2)")
    return f"your code raised {describe_exception(exc)}\n   what to look at: {look}"


def _the_tuple(where: str, got, sample, kept, cfg: dict) -> tuple:
    """The graphed blocks, as make_graphed_callables returns them, ``sample`` untouched."""
    def no(text: str) -> None:
        reject(f"{where}: {text}", hints=_GS_HINTS)

    if got is None:
        no("returned None (did you forget `return`?)")
    if sample.requires_grad != cfg["needs"] or not torch.equal(sample.detach(), kept):
        no(f"you changed the caller's `sample` (requires_grad {cfg['needs']} -> "
           f"{sample.requires_grad}, or its values): requires_grad_() works in place. Make "
           "a new tensor for the samples you need instead")
    if isinstance(got, list):
        graphed = sum(getattr(c, "runner", None) is not None for c in got)
        no(f"returned a list of {len(got)} ({graphed} of them graphed blocks); the exercise "
           "returns make_graphed_callables' tuple: call it ONCE, with the tuple of blocks "
           "and a tuple of samples (one per block), so that the blocks are captured "
           "together, into one memory pool, and return the tuple it gives")
    call = got if isinstance(got, tuple) else (got,)
    if len(call) != cfg["n"]:
        no(f"returned {len(call)} graphed callable(s) for {cfg['n']} blocks: return "
           "make_graphed_callables' tuple, one per block")
    if any(getattr(c, "runner", None) is None for c in call):
        no(f"returned {[type(c).__name__ for c in call]}: expected the graphed blocks that "
           "bridge.make_graphed_callables returns")
    return call


def _samples_need_grad(where: str, call: tuple, cfg: dict) -> None:
    """Each block's sample requires grad exactly when its live input does."""
    for i, r in enumerate(c.runner for c in call):
        s = r.static_args[0] if r.static_args else None
        live_needs = cfg["needs"] if i == 0 else True
        if not isinstance(s, torch.Tensor):
            continue
        if live_needs and not s.requires_grad:
            feed = ("the stage input, which requires grad here" if i == 0 else
                    f"block {i - 1}'s output, which requires grad (block {i - 1} has "
                    "trainable parameters)")
            reject(f"{where}: block {i} was captured from a sample that does not require "
                   f"grad, but at run time it is fed {feed}. Its backward graph has no dgrad "
                   "for that input, so everything upstream of it would get no gradient "
                   "(labkit refuses the call; torch would leave .grad None in silence). "
                   "Look at how the sample of each block is made", hints=_GS_HINTS)
        if not live_needs and s.requires_grad:
            reject(f"{where}: block 0 was captured from a sample that requires grad, but "
                   "this stage's input needs no grad: its backward graph computes a dgrad "
                   "nobody uses (wasted work at every step). Block 0's sample must require "
                   "grad exactly when `sample` does", hints=_GS_HINTS)


def _trains_like_eager(where: str, B, call: tuple, blocks: list, cfg: dict,
                       gen: torch.Generator) -> None:
    """One training step through the graphed blocks gives eager autograd's gradients."""
    w = cfg["widths"]
    x = torch.randn(cfg["batch"], w[0], generator=gen).to(B.device)
    target = torch.randn(cfg["batch"], w[-1], generator=gen).to(B.device)
    gg, gx = attempt(_stage_grads, (call, blocks, x.clone().requires_grad_(cfg["needs"]),
                                    target), B=B, not_done=False, label=where,
                     hints=_GS_HINTS, reason=lambda exc: "training through your graphed "
                     f"blocks raised {describe_exception(exc)}")
    eg, ex = _stage_grads(blocks, blocks, x.clone().requires_grad_(cfg["needs"]), target)
    if not (_all_close(gg, eg) and _close(gx, ex)):
        reject(f"{where}: gradients through your graphed blocks differ from eager autograd: "
               "check that each block's sample has that block's input shape and that you "
               "graph the blocks in order", hints=_GS_HINTS)


def _one_trial(fn, B, trial: int, trials: int) -> None:
    """Trial ``trial`` (0-based): a random stage graphed by ``fn``, then judged."""
    rng = random.Random(4400 + trial)
    gen = torch.Generator().manual_seed(4400 + trial)
    cfg = _stage_config(rng, trial)
    w = cfg["widths"]
    blocks = [_StageBlock(w[i], w[i + 1], gen).to(B.device) for i in range(cfg["n"])]
    sample = torch.randn(cfg["batch"], w[0], generator=gen).to(B.device)
    sample.requires_grad_(cfg["needs"])
    kept = sample.detach().clone()
    where = (f"trial {trial + 1} of {trials} ({cfg['n']} blocks, widths {w}, stage input "
             + ("requires grad" if cfg["needs"] else "needs no grad (a first stage)")
             + ")")
    got = attempt(fn, (blocks, sample), time_limit=DEFAULT_TIME_LIMIT, B=B, label=where,
                  hints=_GS_HINTS, reason=_look)
    call = _the_tuple(where, got, sample, kept, cfg)
    _samples_need_grad(where, call, cfg)
    _trains_like_eager(where, B, call, blocks, cfg, gen)


def check_graph_stage(fn, *, B=None, trials: int = 4, quiet: bool = False) -> CheckResult:
    """``fn(blocks, sample)`` must graph a pipeline stage: ``blocks`` (a list of modules run
    one after the other) with ``bridge.make_graphed_callables``, from ``sample`` (a tensor
    shaped like the stage input; it requires grad when the stage is not the first one).
    It returns the tuple of graphed blocks, and training through it must match eager.

    Trials randomize the number of blocks, their widths, the batch and whether the stage
    input requires grad (trial 1: it does not, as in a first stage; trial 2: it does).

    Args:
        fn: the learner's fixed ``graph_stage``.
        B: the backend (default: ``backend.get("auto")``); recovered after a capture that
            raised.
        trials: how many stages to try.
        quiet: return the :class:`CheckResult` without printing it.

    .. warning::
        A capture that raises leaves the capture stream current; the checker calls
        ``labkit.backend.recover(B)`` so the next cell starts clean.
    """
    B = _backend(B)
    if not callable(fn):
        return fail(EXERCISE.name, f"expected a function, got {type(fn).__name__}",
                    quiet=quiet)

    def body() -> str:
        for trial in range(trials):
            _one_trial(fn, B, trial, trials)
        return (f"passed {trials} random stages (first and later stages, 2-4 blocks of "
                "changing widths): every input that requires grad gets its gradient, and "
                "training matches eager")

    return run_check(EXERCISE.name, body, quiet=quiet, trials=trials)
