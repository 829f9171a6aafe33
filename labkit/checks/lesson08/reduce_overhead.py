"""Exercise 1: ``reduce_overhead(fn, static, B)``, CUDA graph trees' life cycle by hand.

The learner's factory returns a callable that runs ``fn`` eagerly on call 1 (the warm-up),
records a graph on call 2 on static copies of the non-static inputs (static inputs used as
given) and replays it, and on later calls copies the non-static inputs into their buffers
and replays; a static input at a new address records again. The checker runs it on the
emulator with a backend whose ``CUDAGraph`` counts captures, and probes every rule.
"""

from __future__ import annotations

import contextlib
import types

import torch

from labkit import backend
from labkit.checks import NOT_DONE, LearnerTimeout, call_learner, describe_exception, fail, passed
from labkit.compiled import ReduceOverhead

NAME = "reduce_overhead"
HINTS = [
    "Keep a call counter and three pieces of state: the graph, the list of buffers it reads "
    "(static inputs as given, copies of the others) and its outputs.",
    "Call 1: return fn(*args). Call 2 (or a static input whose data_ptr() changed): build "
    "the buffers, capture fn(*buffers) with labkit.capture.capture(fn, *buffers, B=B, "
    "warmup=0), then replay. Later calls: buf.copy_(arg) for each non-static input, then "
    "replay. Return the captured outputs, the same tensors every time.",
]


def _counting_backend():
    """The emulated backend, with a CUDAGraph that counts its captures."""
    B = backend.get("emulated")
    counter = {"captures": 0}

    class CountingGraph(B.CUDAGraph):
        def capture_begin(self, *a, **k):
            counter["captures"] += 1
            return super().capture_begin(*a, **k)

    return types.SimpleNamespace(**{**vars(B), "CUDAGraph": CountingGraph}), counter


def _functions(gen):
    """A random fn and its arity, from a small family (one or two outputs)."""
    pick = int(torch.randint(0, 3, (), generator=gen))
    if pick == 0:
        return (lambda w, x: torch.relu(x @ w)), 2, "relu(x @ w)"
    if pick == 1:
        return (lambda a, b, c: (a * b + c, (a - c).sum(0))), 3, "(a * b + c, (a - c).sum(0))"
    return (lambda a, b, c, d: a + b * 2 - c * d), 4, "a + b * 2 - c * d"


def _args(gen, arity, fn_label, B):
    rows, cols = (int(torch.randint(2, 6, (), generator=gen)) for _ in range(2))
    if fn_label.startswith("relu"):
        return [torch.randn(cols, cols, generator=gen), torch.randn(rows, cols, generator=gen)]
    return [torch.randn(rows, cols, generator=gen) for _ in range(arity)]


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and a.shape == b.shape
                and torch.allclose(a, b, atol=1e-5))
    if isinstance(a, (tuple, list)):
        return isinstance(b, (tuple, list)) and len(a) == len(b) and all(map(_same, a, b))
    return False


def _leaves(out):
    return list(out) if isinstance(out, (tuple, list)) else [out]


def _static_sets(gen, arity):
    """Which positions are static, per trial: none, all, one at random, a random subset."""
    subset = [i for i in range(arity) if bool(torch.rand((), generator=gen) < 0.5)]
    return [(), tuple(range(arity)), (int(torch.randint(0, arity, (), generator=gen)),),
            tuple(subset)]


@contextlib.contextmanager
def _watch_answer_used():
    """Notice a call of labkit.compiled.ReduceOverhead, the lesson's own answer."""
    used, init = [], ReduceOverhead.__init__

    def spy(self, *a, **k):
        used.append(True)
        init(self, *a, **k)

    ReduceOverhead.__init__ = spy
    try:
        yield used
    finally:
        ReduceOverhead.__init__ = init


def check_reduce_overhead(fn, *, trials: int = 4, seed: int = 0):
    """Run the learner's ``reduce_overhead(fn, static, B)`` through the rules of lesson 08 §1."""
    if not callable(fn):
        return fail(NAME, f"expected your function reduce_overhead, got {type(fn).__name__}")
    with _watch_answer_used() as used:
        verdict = _run_trials(fn, trials, seed)     # (message, kind), or None: all passed
    if used:
        return fail(NAME, "your code calls labkit.compiled.ReduceOverhead, the lesson's own "
                          "answer. Write the life cycle yourself; labkit.capture.capture (warm-"
                          "up and capture in one call) is allowed", more_hints=HINTS)
    if verdict:
        message, kind = verdict
        return fail(NAME, message, kind=kind, more_hints=HINTS)
    return passed(NAME, f"warm-up, record, copy-and-replay and re-record all right in {trials} "
                        f"random trials (any static positions, one or two outputs)")


def _run_trials(fn, trials, seed):
    gen = torch.Generator().manual_seed(seed)
    for trial in range(trials):
        f, arity, label = _functions(gen)
        static = _static_sets(gen, arity)[trial % 4]
        where = f"trial {trial + 1} (fn = {label}, static={static})"
        try:
            msg = _one_trial(fn, f, arity, label, static, gen)
        except NotImplementedError:
            return NOT_DONE, "not_implemented"
        except LearnerTimeout as e:
            return str(e), "timeout"
        except Exception as e:      # the learner's code raised
            backend.recover(backend.get("emulated"))    # e.g. a capture left half-open
            return f"{where}: your code raised {describe_exception(e)}", "exception"
        if msg:
            return f"{where}: {msg}", "mismatch"
    return None


def _one_trial(learner, f, arity, label, static, gen):
    B, counter = _counting_backend()
    call = call_learner(learner, f, static, B)
    if not callable(call):
        return (f"reduce_overhead returned {type(call).__name__}, expected a function to call "
                f"with the inputs (define call(*args) inside and return it)")
    args = _args(gen, arity, label, B)
    outs = []
    for n in range(1, 5):
        new = [a if i in static else torch.randn(a.shape, generator=gen)
               for i, a in enumerate(args)]
        if n > 1:
            args = new
        before = counter["captures"]
        got = call_learner(call, *args)
        want = f(*args)
        captured = counter["captures"] - before
        if n == 1 and captured:
            return ("call 1 captured a graph. The first call is the warm-up: run fn eagerly "
                    "and return its result; record on call 2 (§1)")
        if n == 2 and not captured:
            return ("call 2 captured no graph (B.CUDAGraph was never captured into). Call 2 "
                    "records: capture fn on the buffers, then replay")
        if n > 2 and captured:
            return (f"call {n} captured a new graph although every static input is the same "
                    f"tensor at the same address. Record once; later calls copy the "
                    f"non-static inputs and replay (if your buffers hold copies of the static "
                    f"inputs, their addresses never match the caller's: use static inputs as "
                    f"given)")
        if got is None:
            return f"call {n} returned None: return fn's result (call 1) or the graph's outputs"
        if not _same(want, got):
            copied = [i for i in range(arity) if i not in static]
            if n > 2 and copied:
                return (f"call {n} returned a stale result: the replay did not see this call's "
                        f"values of input(s) {copied}. Before each replay, copy_ every "
                        f"non-static input into its buffer")
            return f"call {n} returned a wrong result for fn = {label}"
        outs.append(got)
    # the outputs of calls 2.. are the graph's static outputs, the same tensors
    if any(a is not b for a, b in zip(_leaves(outs[1]), _leaves(outs[2]))):
        return ("calls 2 and 3 returned different tensor objects. Return the graph's static "
                "outputs, as torch does (no clone: the caller clones what it keeps, §5)")
    # a static input changed in place is read by the replay, not copied away
    if static:
        i = static[0]
        with torch.no_grad():
            args[i].mul_(2)
        before = counter["captures"]
        got = call_learner(call, *args)
        if counter["captures"] != before:
            return (f"static input {i} changed in place (same tensor, same address) and your "
                    f"code recorded again. A static input is re-recorded only when its "
                    f"address changes: compare data_ptr(), not values")
        if not _same(f(*args), got):
            return (f"static input {i} changed in place, but the replay computed on its old "
                    f"value: a static input is used where it is, never copied into a buffer "
                    f"of your own (torch never copies parameters)")
        # the same static position, a new tensor: record again, then replay that one
        args = list(args)
        args[i] = torch.randn(args[i].shape, generator=gen)
        before = counter["captures"]
        got = call_learner(call, *args)
        if counter["captures"] == before:
            hint = (" (it computed on the old tensor)" if not _same(f(*args), got) else "")
            return (f"static input {i} arrived as another tensor (a new address) and your code "
                    f"replayed the old graph{hint}. torch's check_invariants fails there and "
                    f"the manager records again: do the same")
        if not _same(f(*args), got):
            return f"after re-recording for a new static input {i}, the result is wrong"
        before = counter["captures"]
        got = call_learner(call, *args)
        if counter["captures"] != before:
            return ("after re-recording for a new static tensor, the next call with the same "
                    "tensors recorded yet again: replay the new graph")
        if not _same(f(*args), got):
            return "the replay after a re-recording returned a wrong result"
    return None
