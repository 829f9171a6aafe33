"""Lesson 03, exercise ``build_server``: its checker.

``build_server(B)`` (diagnosis): the learner fixes a broken server that captures
``softmax(logits / temperature)`` once and replays it per batch. The checker gives
``build_server`` a backend that counts captures and replays, then calls the returned
``serve(batches, temperatures)``: exactly one graph captured in ``build_server``, none
in ``serve``, one replay per batch, no softmax run eagerly in ``serve`` (results come from
the graph), results that are separate tensors equal to eager. A wrong answer is told
which pitfall it still has: results that share memory or were cloned after the loop
(section 6), logits the graph never saw (section 1), a temperature stuck at its capture
value (section 7), results one batch behind, a tensor the graph reads that was given up
before a replay (a name given a new tensor: told by the tensor being gone, since a GPU
reuses its freed memory and the emulator keeps reading it, so the values differ).
"""

from __future__ import annotations

import math
import types
import weakref
from typing import NamedTuple

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from labkit.backend import ensure as _backend
from labkit.checks import Reason, attempt, compare_outputs, fail, reject
from labkit.checks.lesson03._common import _learner_error, _rand_int, _run

__all__ = ["check_build_server", "SERVER_SHAPE"]


SERVER_SHAPE = (4, 16)


def _counting_backend(B):
    """A copy of the backend namespace whose graphs count their captures and replays.

    At each replay it also notes (``stats["dropped"]``) every tensor the captures read
    that is gone by then (see :class:`_CaptureReads`).
    """
    stats = {"captures": 0, "replays": 0, "replaying": False, "reads": {}, "dropped": None}

    class CountingGraph(B.CUDAGraph):
        def capture_begin(self, *args, **kwargs):
            stats["captures"] += 1
            return super().capture_begin(*args, **kwargs)

        def replay(self):
            if stats["dropped"] is None:
                gone = [shape for ref, shape, _ in stats["reads"].values() if ref() is None]
                if gone:
                    stats["dropped"] = (stats["replays"], gone)
            stats["replays"] += 1
            stats["replaying"] = True     # the emulator replays ATen ops: not eager ones
            try:
                return super().replay()
            finally:
                stats["replaying"] = False

    counted = types.SimpleNamespace(**vars(B))
    counted.CUDAGraph = CountingGraph
    return counted, stats


_METADATA = {"__get__", "size", "dim", "stride", "numel", "data_ptr", "element_size",
             "is_contiguous", "storage_offset", "untyped_storage", "__len__", "nelement"}


def _version(t: torch.Tensor) -> int | None:
    """``t``'s version counter (bumped by every in-place write), None if it has none."""
    try:
        return t._version
    except RuntimeError:        # inference tensors have no version counter
        return None


def _never_written(stats: dict) -> list[tuple]:
    """Shapes of the one-element tensors the captures read that nothing wrote since."""
    out = []
    for ref, shape, version in stats["reads"].values():
        t = ref()
        if t is not None and t.numel() == 1 and version is not None \
                and _version(t) == version:
            out.append(shape)
    return out


def _shape_str(shape: tuple) -> str:
    return "(" + ", ".join(map(str, shape)) + ("," if len(shape) == 1 else "") + ")"


class _CaptureReads(TorchFunctionMode):
    """Notes, weakly, every tensor made before a capture that the capture reads.

    A graph reads its inputs by address and keeps no Python reference to them. If the
    learner gives the only name of one a new tensor (``t = torch.tensor(temperature)``),
    the captured one is freed: the emulator's recorded ops still alias its memory (so
    replays keep reading the value it held at capture), while a GPU's caching allocator
    hands the block to the next tensor allocated (so replays read whatever lands there).
    Whether the tensor object is still alive at a replay is the same on both backends.
    Active around ``build_server``; records only while the current stream captures.
    """

    def __init__(self, B, stats: dict):
        super().__init__()
        self.B, self.reads = B, stats["reads"]
        self.made: dict[int, weakref.ref] = {}   # tensors the captures created

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        capturing = getattr(func, "__name__", "") not in _METADATA and \
            self.B.is_current_stream_capturing()
        if capturing:
            for t in tree_flatten((args, kwargs))[0]:
                if isinstance(t, torch.Tensor) and id(t) not in self.reads:
                    made = self.made.get(id(t))
                    if made is None or made() is not t:
                        self.reads[id(t)] = (weakref.ref(t), tuple(t.shape), _version(t))
        out = func(*args, **kwargs)
        if capturing:
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor) and id(t) not in self.reads:
                    self.made[id(t)] = weakref.ref(t)
        return out


_SOFTMAX_OPS = ("softmax", "_softmax", "_safe_softmax", "log_softmax", "_log_softmax", "exp",
                "exp_")


class _EagerSoftmaxCounter(TorchDispatchMode):
    """Counts softmax (and exp) ATen ops run eagerly: not captured, not replayed."""

    def __init__(self, B, stats: dict):
        super().__init__()
        self.B, self.stats, self.count = B, stats, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.__name__.split(".")[0] in _SOFTMAX_OPS and not self.stats["replaying"] \
                and not self.B.is_current_stream_capturing():
            self.count += 1
        return func(*args, **(kwargs or {}))


def _implied_temperature(probs: torch.Tensor, logits: torch.Tensor) -> float | None:
    """The t with probs == softmax(logits / t), if probs is one (least squares on logs)."""
    if bool((probs <= 0).any()):
        return None
    lp = probs.log()
    lp = lp - lp.mean(dim=-1, keepdim=True)
    lg = logits - logits.mean(dim=-1, keepdim=True)
    denom = float((lp * lp).sum())
    if denom < 1e-12:
        return math.inf          # uniform: no logits seen at all
    return float((lg * lp).sum()) / denom


def _build_raised(exc: BaseException) -> Reason:
    return Reason(f"build_server raised {_learner_error(exc)}",
                  ["The line named above raised while building the server. An "
                   "error inside the capture is a pitfall of section 3 (a host read: "
                   ".item(), print, an `if` on a tensor)."])


class _Served(NamedTuple):
    """One trial's serving, as the judges below see it."""

    batches: list
    temps: list
    results: object
    stats: dict
    new_captures: int   # captures made by serve
    replays: int        # replays made by serve
    eager: int          # softmax/exp ops serve ran eagerly


def _built(build_server, B, time_limit: float) -> tuple:
    """``build_server(counted B)``: its serve and the counts of what it did."""
    counted, stats = _counting_backend(B)
    with _CaptureReads(B, stats):
        serve = attempt(build_server, (counted,), time_limit=time_limit, B=B,
                        not_done=False, passthrough=(NotImplementedError,),
                        kind="mismatch", reason=_build_raised)
    if not callable(serve):
        reject(Reason(f"build_server must return the function serve; it returned "
                       f"{type(serve).__name__}",
                       ["build_server builds the server once and returns the inner "
                        "function serve itself, not the result of calling it."]))
    if stats["captures"] == 0:
        reject(Reason("build_server captured no graph: capture the softmax once there, "
                       "with the B it is given (capture(..., B=B))",
                       ["The checker counts captures made with the B that build_server "
                        "is given: a capture with another backend, or none, counts "
                        "nothing."]))
    built = stats["captures"]
    if built > 1:
        reject(Reason(
            f"build_server captured {built} graphs: the exercise asks for ONE graph, "
            f"captured once. Every graph you capture keeps its memory pool reserved for "
            f"as long as it lives, and serve replays only one of them: drop the others.",
            ["Which capture does serve replay? Keep that one; delete the others (a "
             "leftover first attempt?)."]))
    return serve, stats


def _served(serve, stats: dict, gen: torch.Generator, B, time_limit: float) -> _Served:
    """``serve`` on 3 to 6 random batches and temperatures, its ops counted."""
    built = stats["captures"]
    n = _rand_int(gen, 3, 6)
    batches = [(torch.randn(SERVER_SHAPE, generator=gen) * 3).to(B.device)
               for _ in range(n)]
    temps = [round(0.4 + 2.0 * float(torch.rand((), generator=gen)), 2) for _ in range(n)]
    while len(set(temps)) < n:
        temps = [t + 0.01 * i for i, t in enumerate(temps)]
    before = stats["replays"]
    eager = _EagerSoftmaxCounter(B, stats)
    with eager:
        results = attempt(serve, ([b.clone() for b in batches], list(temps)),
                          time_limit=time_limit, B=B, not_done=False,
                          passthrough=(NotImplementedError,), kind="mismatch",
                          reason=lambda exc: Reason(f"serve raised {_learner_error(exc)}"))
    return _Served(batches, temps, results, stats, stats["captures"] - built,
                   stats["replays"] - before, eager.count)


def _one_graph_per_batch(s: _Served) -> None:
    n, new_captures, replays = len(s.batches), s.new_captures, s.replays
    if new_captures:
        reject(Reason(
            f"serve captured {new_captures} new graph{'s' if new_captures > 1 else ''} "
            f"for {n} batches: capture once, in build_server; serve only fills the static "
            f"inputs and replays (a capture per call costs more than running eagerly).",
            ["What changes from batch to batch must live in static tensors that serve "
             "fills in place (section 7)."]))
    if replays != n:
        reject(Reason(
            f"serve replayed the graph {replays} times for {n} batches: compute every "
            f"batch by one replay of the captured graph (not eagerly).",
            ["Per batch: fill the static inputs in place, replay once, read the static "
             "output."]))
    if s.eager:
        reject(Reason(
            f"serve ran {s.eager} softmax/exp op(s) eagerly, outside the graph, for "
            f"{n} batches: replaying the graph beside an eager computation does not "
            f"count. Every result must come from the graph: read (and clone) its static "
            f"output after each replay.",
            ["The replay computes softmax(logits / t); what does serve still compute "
             "itself? Drop it and keep what the graph wrote."]))


def _one_result_per_batch(s: _Served) -> None:
    n, results = len(s.batches), s.results
    if not isinstance(results, (list, tuple)) or len(results) != n:
        got = (f"{len(results)} items" if isinstance(results, (list, tuple))
               else type(results).__name__)
        reject(Reason(f"serve must return a list of {n} results (one per batch); "
                       f"got {got}",
                       ["Append one result per batch to a list, in the order of the "
                        "batches, and return the list."]))
    for i, r in enumerate(results):
        if not isinstance(r, torch.Tensor) or tuple(r.shape) != SERVER_SHAPE:
            reject(Reason(f"result {i} is not a tensor of shape {SERVER_SHAPE}: "
                           f"{type(r).__name__}"
                           f"{tuple(r.shape) if isinstance(r, torch.Tensor) else ''}",
                           ["Each result is a copy of the graph's static output, "
                            "the softmax of one batch."]))
    ptrs = [r.data_ptr() for r in results]
    if len(set(ptrs)) < n:
        i = next(i for i in range(n) if ptrs.index(ptrs[i]) != i)
        j = ptrs.index(ptrs[i])
        reject(Reason(
            f"results {j} and {i} are the same memory: the graph's static output, which "
            f"every replay overwrites, so all your results show the last batch "
            f"(section 6).",
            ["Keep a copy of the static output after each replay: .clone()."]))


def _input_kept(s: _Served, wrong: list) -> None:
    """A tensor the graph reads was freed (checked before the values: on a GPU, replays
    of a freed input read whatever the allocator put in its memory since)."""
    stats = s.stats
    if stats["dropped"] is not None:
        # checked before the values: on a GPU, replays of a freed input read whatever
        # the allocator put in its memory since, so the values say nothing reliable
        at, shapes = stats["dropped"]
        shape = shapes[0]
        if shape == SERVER_SHAPE:
            what, example = " (your static logits?)", "static_logits = logits"
            fix = "copy_ each batch into it (section 1)"
        elif math.prod(shape) == 1:
            what, example = " (your temperature?)", "t = torch.tensor(temperature)"
            fix = "fill_ it with each temperature (section 7)"
        else:
            what, example = "", "x = new_tensor"
            fix = "fill it in place before each replay (sections 1 and 7)"
        reject(Reason(
            f"result {wrong[0]} is not softmax(logits / t). By replay {at + 1}, a tensor "
            f"of shape {_shape_str(shape)}{what} that the graph reads was gone: nothing "
            f"in your code held it any more. Giving a name a new tensor ({example}) "
            f"does not change what the graph reads: it still reads the old tensor's "
            f"memory (on a GPU that memory is free, and the next tensor allocated may "
            f"land there). Keep the captured tensor and {fix}.",
            ["The graph was captured on the tensors that existed then; it reads them by "
             "address at every replay. Write new values into them in place."]))


def _values(s: _Served, expected: list, wrong: list) -> None:
    """Which pitfall the wrong values show."""
    n, results, batches, temps, stats = (len(s.batches), s.results, s.batches, s.temps,
                                         s.stats)
    implied = [_implied_temperature(results[i].detach().float().cpu(),
                                    batches[i].cpu()) for i in range(n)]
    uniform = torch.full(SERVER_SHAPE, 1.0 / SERVER_SHAPE[1])
    if n > 1 and all(torch.allclose(r.float(), expected[-1], rtol=1e-4, atol=1e-6)
                     for r in results):
        reject(Reason(
            "every result equals the LAST batch's softmax: you kept references to the "
            "static output and cloned after the loop: every replay overwrote them "
            "(section 6).",
            ["Clone the static output right after each replay, inside the loop."]))
    if all(torch.allclose(results[i].float().cpu(), uniform, atol=1e-5) for i in wrong) \
            or all(torch.allclose(results[i].float(), results[0].float()) for i in wrong):
        reject(Reason(
            "your results do not depend on the batches: the graph keeps reading the "
            "logits it was captured with. Assigning a new tensor to a name does not "
            "change the memory the graph reads (section 1).",
            ["Fill the static input in place: static_logits.copy_(logits)."]))
    if any(i > 0 for i in wrong) and all(
            i == 0 or torch.allclose(results[i].float(), expected[i - 1], rtol=1e-4,
                                     atol=1e-6) for i in wrong):
        reject(Reason(
            "each result is the previous batch's: serve replays before it fills the "
            "static inputs. Fill first, then replay, then read.",
            ["The replay reads the static inputs when it runs: what is in them at "
             "that moment is what it computes."]))
    finite = [t for t in implied if t is not None and math.isfinite(t)]
    if len(finite) == n and max(finite) - min(finite) < 1e-3 and _never_written(stats):
        reject(Reason(
            f"every result is softmax(logits / {finite[0]:.3g}): the temperature is the "
            f"one the graph was captured with, whatever serve is given. The graph divides "
            f"by a tensor of shape {_shape_str(_never_written(stats)[0])} that nothing "
            f"wrote after the capture: giving a name a new tensor does not change what "
            f"the graph reads (section 7).",
            ["Fill the captured temperature tensor in place before each replay: "
             "t.fill_(temperature)."]))
    if len(finite) == n and max(finite) - min(finite) < 1e-3:
        reject(Reason(
            f"every result is softmax(logits / {finite[0]:.3g}): the temperature is the "
            f"one the graph was captured with, whatever serve is given. A Python number "
            f"read inside the captured function is baked in at capture (section 7).",
            ["Keep the temperature in a static tensor the captured function divides by, "
             "and fill_ it before each replay (or divide the logits before copying them "
             "in)."]))
    i = wrong[0]
    diff = compare_outputs(expected[i], results[i].float(), rtol=1e-4, atol=1e-6)
    reject(Reason(f"result {i} (temperature {temps[i]}) is not softmax(logits / t): "
                   f"{diff}. Compare your serve with the broken one step by step: which "
                   f"pitfalls of sections 1, 6 and 7 does it still have?",
                   ["Section 1: a new batch reaches the graph only by copy_ into its "
                    "static input. Section 6: the next replay overwrites the static "
                    "output. Section 7: a Python number is baked in at capture.",
                    "Print, for one batch, what the graph read (the static logits and "
                    "temperature just before the replay) and compare with the batch."]))




def check_build_server(build_server, *, B=None, trials: int = 2, quiet: bool = False,
                       time_limit: float = 20.0):
    """Check the fixed ``build_server(B)``: its ``serve(batches, temperatures)`` must
    replay ONE graph, captured in ``build_server``, once per batch, and return
    ``softmax(logits / t)`` for every batch as separate tensors.

    Args:
        build_server: the learner's function of a backend.
        B: the backend (default ``labkit.backend.get("auto")``); the learner's function
            gets a copy whose graphs count their captures and replays.
        trials: each builds a server and serves 3 to 6 random batches.
        quiet: do not print.
        time_limit: seconds ``build_server`` and ``serve`` may each run.
    """
    B = _backend(B)
    name = "build_server"
    if not callable(build_server):
        return fail(name, f"expected a function, got {type(build_server).__name__}",
                    quiet=quiet)

    def one_trial(trial, gen):
        serve, stats = _built(build_server, B, time_limit)
        served = _served(serve, stats, gen, B, time_limit)
        _one_graph_per_batch(served)
        _one_result_per_batch(served)
        expected = [torch.softmax(b / t, dim=-1) for b, t in zip(served.batches, served.temps)]
        wrong = [i for i, r in enumerate(served.results)
                 if not torch.allclose(r.float(), expected[i], rtol=1e-4, atol=1e-6)]
        if wrong:
            _input_kept(served, wrong)
            _values(served, expected, wrong)

    return _run(name, trials, one_trial, quiet=quiet, B=B)
