"""Checkers for lesson 02 (raw capture and replay).

Three exercises, each run on the backend of ``labkit.backend.get("auto")`` (or ``B=``):

* ``graphed_run(fn, static_input, batches) -> list[Tensor]``: the template of section 4.
  Warm ``fn(static_input)`` up 3 times on a side stream, capture ``fn(static_input)`` once,
  then for each batch ``copy_`` it into the static input, ``replay()``, and keep a *clone*
  of the static output. Checked against eager ``[fn(b) for b in batches]``, and also for
  *how*: ``fn`` counts its calls (eager before capture, during capture, eager after), the
  stream and the input of each warm-up call (``static_input``), the two ``wait_stream``
  calls around the warm-up (logged on ``B.Stream`` while the learner's code runs), and
  every result must be a tensor of its own (none of them the static output, which the
  next replay overwrites).
* ``capture_chain(f1, f2, static_input) -> (g1, g2, static_mid, static_out)``: two graphs
  in ONE shared pool, ``g1`` computing ``static_mid = f1(static_input)`` and ``g2``
  computing ``static_out = f2(static_mid)``. Checked by replaying ``g1`` then ``g2`` on
  fresh data, then each graph alone (``g1`` must not touch ``static_out``; ``g2`` must read
  what is in ``static_mid``, not recompute it from ``static_input``), by
  ``g1.pool() == g2.pool()``, and that ``g1`` records f1 "and nothing else": no capture
  calls both f1 and f2 (``capture_begin`` and the two functions log their calls), and on
  the emulator ``g1`` holds no more ops than f1 captured alone.
* ``serve(model, requests) -> list[Tensor]`` (diagnosis): the fixed version of a broken
  serving loop given in the notebook. Checked like ``graphed_run``; the warm-up must be
  kept (on a side stream, with both ``wait_stream`` calls; any number of runs), and the
  caller's requests must be unchanged after the call (a request used as the static input
  is overwritten by every ``copy_``).

An error raised inside a capture is reported at the learner's line with its first cause:
a failed capture raises a second, follow-on error when the ``with B.graph(...)`` block
ends, which names no line of the learner's code.
"""

from __future__ import annotations

import contextlib
import traceback
import weakref
from collections import Counter

import torch

from labkit.backend import ensure as _backend
from labkit.backend import recover as _recover
from labkit.capture import capture, recorded_kernels
from labkit.checks import (
    DEFAULT_TIME_LIMIT,
    CheckResult,
    Reason,
    _is_learner_frame,
    check,
    compare_outputs,
)

__all__ = ["check_graphed_run", "check_capture_chain", "check_serve", "WARMUP_ITERS"]

WARMUP_ITERS = 3  # what the exercise text asks for



# ---- reporting an error raised in the learner's capture ---------------------------------

class _Reported(Exception):
    """A learner error already turned into a message (not re-described by check())."""


def _first_cause(exc: BaseException) -> BaseException:
    """The error a failed capture started with, not the follow-on one from its ``__exit__``."""
    seen = set()
    while id(exc) not in seen:
        seen.add(id(exc))
        nxt = exc.__cause__ or exc.__context__
        if nxt is None:
            break
        text = str(exc)
        if "previous error during capture" in text or "StreamCaptureInvalidated" in text:
            exc = nxt
            continue
        break
    return exc


def _describe(exc: BaseException) -> str:
    """``Type: first line`` and the deepest line of the learner's own code that raised it."""
    first = str(exc).strip().splitlines()
    # the emulator adds its explanation as the last line; CUDA's text starts with the error
    lines = [ln for ln in first if ln.startswith("[labkit emulator]")] or first[:1]
    text = f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__
    pick = None
    for fr in traceback.extract_tb(exc.__traceback__):
        if _is_learner_frame(fr.filename):
            pick = fr
    if pick is None:
        return text
    where = f"line {pick.lineno}" + (f" (in {pick.name})" if pick.name != "<module>" else "")
    code = (pick.line or "").strip()
    return f"{text}\n   at {where}: {code}" if code else f"{text}\n   at {where}"


def _call(B, fn, *args):
    """``fn(*args)``; an error comes back as :class:`_Reported`, with the capture recovered."""
    try:
        return fn(*args)
    except BaseException as exc:  # noqa: BLE001 - sorted out below
        _recover(B)
        root = _first_cause(exc)
        if isinstance(root, NotImplementedError) or type(root).__name__ == "LearnerTimeout":
            raise root from None
        if not isinstance(root, Exception):
            raise
        hint = ""
        if "captured tensor" in str(root) or "capturing" in str(root):
            hint = ("\n   Inside `with B.graph(g):` ops are recorded, not run: nothing there may "
                    "read a tensor's values on the host (print, .item(), .tolist(), if on a "
                    "tensor). Read the static output after g.replay().")
        raise _Reported(f"your code raised {_describe(root)}{hint}") from None
    finally:
        _recover(B)


# ---- exercise 1: graphed_run ------------------------------------------------------------

_ACTIVATIONS = {"tanh": torch.tanh, "sigmoid": torch.sigmoid, "sin": torch.sin}


class _Counted:
    """``fn`` that counts its calls: eager before capture, during capture, eager after.

    It also remembers the stream of every eager call before the capture (the warm-up)
    and the tensor it returned during capture (the static output).
    """

    def __init__(self, B, weight: torch.Tensor, bias: torch.Tensor, act: str):
        self.B, self.weight, self.bias, self.act = B, weight, bias, act
        self.warmup_streams: list[bool] = []  # True: that warm-up ran on the default stream
        self.warmup_ptrs: list[int | None] = []  # data_ptr of each warm-up's input
        # ("warm", stream) / ("capture", None) / ("wait", (waiter, waited_on)), in order
        self.log: list[tuple] = []
        self.captured = 0
        self.after = 0
        self.static_out: torch.Tensor | None = None
        self.captured_on: int | None = None  # data_ptr of the tensor fn was captured on
        # the tensor fn was captured on, weakly: a graph keeps no Python reference to it
        self.captured_ref: weakref.ref | None = None
        self.replays = 0
        self.dropped_at: int | None = None  # first replay at which that tensor was gone
        self.replay_inputs: list[torch.Tensor | None] = []  # what it held at each replay
        self.__name__ = "fn"

    def compute(self, x: torch.Tensor) -> torch.Tensor:
        return _ACTIVATIONS[self.act](x @ self.weight + self.bias) * 2.0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        B = self.B
        if B.is_current_stream_capturing():
            self.captured += 1
            self.log.append(("capture", None))
            self.captured_on = x.data_ptr() if isinstance(x, torch.Tensor) else None
            self.captured_ref = weakref.ref(x) if isinstance(x, torch.Tensor) else None
            out = self.compute(x)
            self.static_out = out
            return out
        if self.captured:
            self.after += 1
        else:
            current = B.current_stream()
            self.warmup_streams.append(current == B.default_stream())
            self.warmup_ptrs.append(x.data_ptr() if isinstance(x, torch.Tensor) else None)
            self.log.append(("warm", current))
        return self.compute(x)


@contextlib.contextmanager
def _recording_waits(B, fn: _Counted):
    """Log every ``wait_stream`` call made on ``B.Stream`` objects into ``fn.log``.

    ``B.Stream`` is ``torch.cuda.Stream`` on a GPU (``wait_stream`` is a Python method
    there) and the emulator's ``Stream`` otherwise; ``B.current_stream()`` returns the
    same class, so both calls of section 2 go through the patched method.
    """
    cls = B.Stream
    had = "wait_stream" in vars(cls)
    original = vars(cls).get("wait_stream", cls.wait_stream)

    def wait_stream(self, other):
        fn.log.append(("wait", (self, other)))
        return original(self, other)

    cls.wait_stream = wait_stream
    try:
        yield
    finally:
        if had:
            cls.wait_stream = original
        else:
            del cls.wait_stream


@contextlib.contextmanager
def _recording_replays(B, fn: _Counted):
    """Note in ``fn.dropped_at`` the first replay at which fn's captured input was gone,
    and in ``fn.replay_inputs`` what that input held when each replay was queued.

    A graph reads its input by address and holds no Python reference to it. If the
    learner rebinds the only name of the static input (``static_x = x``), the tensor is
    freed: the emulator's recorded ops still alias its memory (so replays keep reading
    the values it held), while a GPU's caching allocator hands the block to the next
    tensor of that size (so replays read whatever lands there). Whether the tensor object
    is still alive at each replay is the same on both backends, so that is what is probed.
    """
    cls = B.CUDAGraph
    had = "replay" in vars(cls)
    original = vars(cls).get("replay", cls.replay)

    def replay(self, *args, **kwargs):
        if fn.captured_ref is not None and fn.dropped_at is None \
                and fn.captured_ref() is None:
            fn.dropped_at = fn.replays
        held = fn.captured_ref() if fn.captured_ref is not None else None
        fn.replay_inputs.append(None if held is None else held.detach().clone())
        fn.replays += 1
        return original(self, *args, **kwargs)

    cls.replay = replay
    try:
        yield
    finally:
        if had:
            cls.replay = original
        else:
            del cls.replay


def _missing_waits(fn: _Counted) -> str | None:
    """Which of section 2's two ``wait_stream`` calls around the warm-up is missing, or None."""
    log = fn.log
    warm = [i for i, (kind, _) in enumerate(log) if kind == "warm"]
    if not warm:
        return None
    side = log[warm[0]][1]
    end = next((i for i, (kind, _) in enumerate(log) if kind == "capture"), len(log))
    before = any(kind == "wait" and a[0] == side and not a[1] == side
                 for kind, a in log[:warm[0]])
    after = any(kind == "wait" and a[1] == side and not a[0] == side
                for kind, a in log[warm[-1] + 1:end])
    if before and after:
        return None
    missing = []
    if not before:
        missing.append("`s.wait_stream(B.current_stream())` before the warm-up (without "
                       "it the side stream may start before the work queued so far, such "
                       "as filling the static input, is done)")
    if not after:
        missing.append("`B.current_stream().wait_stream(s)` after it, before the capture "
                       "(without it later work may overlap the warm-up)")
    return ("your warm-up runs on a side stream s, but without " + " and without ".join(missing)
            + ". On a GPU the streams run concurrently, and this is a race the CPU cannot "
            "show: section 2 puts both wait_stream calls around `with B.stream(s):` "
            "(labkit.capture.side_stream_warmup does it for you)")


def _make_fn_inputs(B, gen: torch.Generator):
    rows = int(torch.randint(2, 6, (), generator=gen))
    cols = int(torch.randint(3, 9, (), generator=gen))
    n = int(torch.randint(5, 10, (), generator=gen))
    act = list(_ACTIVATIONS)[int(torch.randint(0, len(_ACTIVATIONS), (), generator=gen))]
    w = (torch.randn(cols, cols, generator=gen) / cols ** 0.5).to(B.device)
    b = torch.randn(cols, generator=gen).to(B.device)
    batches = [torch.randn(rows, cols, generator=gen).to(B.device) for _ in range(n)]
    # cuBLAS initialises lazily on its first matmul, which must not happen during a
    # capture: make sure that is over, so only the learner's own steps are tested
    torch.mm(batches[0], w)
    B.synchronize()
    return _Counted(B, w, b, act), batches


# hints that belong to one mistake each (most general first, never the answer first)
_H_CAPTURE = [
    "A graph records only what runs inside `with B.graph(g):`, once, before the loop "
    "(section 3); inside the loop a batch needs no call of fn at all.",
    "g = B.CUDAGraph(); `with B.graph(g): static_out = fn(static_input)` before the loop; "
    "in the loop only copy_, g.replay() and a clone.",
]
_H_STATIC_IN = [
    "The graph reads the memory of the tensor it was captured on, at every replay "
    "(section 4). Which tensor do you capture on, and which one do you fill?",
    "Capture fn(static_input) itself, and write each batch into it: "
    "static_input.copy_(batch).",
]
_H_CLONE = [
    "What does the next replay do to the static output (section 5)? Every result you keep "
    "must survive the replays after it.",
    "Right after each replay, keep a copy: results.append(static_out.clone()).",
]
_H_ORDER = [
    "In which order do a batch's three steps run? The replay reads the static input when "
    "it runs and writes the static output; a copy_ after it, or a clone before it, belongs "
    "to another batch.",
    "Per batch, in this order: static_input.copy_(batch); g.replay(); "
    "results.append(static_out.clone()).",
]
_H_COPY = [
    "How does a new batch reach the memory the graph reads (section 4)? Rebinding a name "
    "changes nothing the graph sees.",
    "Keep the static input and fill it in place before each replay: "
    "static_input.copy_(batch).",
]
_H_WARMUP = [
    "Section 2: the warm-up runs fn(static_input) on a side stream s, and two wait_stream "
    "calls order s against the stream current before and after it.",
    "s = B.Stream(); s.wait_stream(B.current_stream()); then `with B.stream(s):` call "
    f"fn(static_input) {WARMUP_ITERS} times; then B.current_stream().wait_stream(s)",
]
_H_RETURN = ["Collect one result per batch in a list, in the order of the batches, and "
             "return that list."]


def _lagged(out: list, expected: list) -> bool:
    """Every result from the second on is the PREVIOUS batch's, the first one is not its
    own: a loop whose replay and clone are one batch apart."""
    if len(out) != len(expected) or len(out) < 2:
        return False
    if compare_outputs(expected[0], out[0], rtol=1e-4, atol=1e-5) is None:
        return False
    return all(compare_outputs(expected[i - 1], out[i], rtol=1e-4, atol=1e-5) is None
               for i in range(1, len(out)))


def _replays_saw_their_batch(fn: _Counted, batches: list | None) -> bool:
    """Replay k ran on batch k (the static input held it when the replay was queued)."""
    seen = fn.replay_inputs
    if batches is None or len(seen) != len(batches):
        return False
    return all(s is not None and s.shape == b.shape and torch.equal(s, b)
               for s, b in zip(seen, batches))


def _run_problem(fn: _Counted, out, n: int, expected, *, warmups: int | None,
                 what: str = "fn", static: str = "static_out",
                 static_input_ptr: int | None = None, section: int = 5,
                 batches: list | None = None) -> Reason | None:
    """What is wrong with a graphed loop's results and ``fn``'s call counts, or None.

    ``warmups``: the exact number of warm-up runs asked for; 0: at least one (any number);
    None: the warm-up is not checked. ``batches``: what was fed (to tell a clone taken
    before the replay from a copy_ made after it).
    """
    if fn.captured == 0:
        return Reason(f"{what} was never called during a capture, so nothing was graphed: "
                      f"record it once inside `with B.graph(g):` (section 3) and replay that "
                      f"graph", _H_CAPTURE)
    if fn.captured > 1:
        return Reason(f"{what} was captured {fn.captured} times for {n} batches: capture ONE "
                      "graph before the loop (section 3) and only replay it inside the loop",
                      _H_CAPTURE)
    if static_input_ptr is not None and fn.captured_on != static_input_ptr:
        if isinstance(out, (list, tuple)) and compare_outputs(
                expected, list(out), rtol=1e-4, atol=1e-5) is None:
            return Reason(f"your results are right, but {what} was captured on a tensor that "
                          "is not static_input (StaticGraph allocates static inputs of its "
                          "own): the exercise asks you to capture fn(static_input) yourself "
                          "and copy_ each batch into static_input (sections 3 and 4)",
                          _H_STATIC_IN)
        return Reason(f"{what} was captured on a tensor that is not static_input: the graph "
                      "reads the memory it was captured on, so what you copy into "
                      "static_input never reaches it (section 3 captures fn(static_input))",
                      _H_STATIC_IN)
    if fn.after:
        return Reason(f"{what} ran eagerly {fn.after} time(s) after the capture, for {n} "
                      "batches: after capture, a batch needs only copy_ + g.replay() "
                      "(section 4); the graph computes the result", _H_CAPTURE)
    if out is None:
        return Reason("got None (did you forget `return results`?)", _H_RETURN)
    if not isinstance(out, (list, tuple)):
        return Reason(f"expected a list of tensors, one per batch, got a {type(out).__name__}",
                      _H_RETURN)
    tensors = [t for t in out if isinstance(t, torch.Tensor)]
    if len(out) == n and len(tensors) == n and n > 1:
        if len({t.data_ptr() for t in tensors}) == 1:
            return Reason(f"all {n} results are the same tensor, the graph's static output, "
                          "which every replay overwrites in place (section 5): keep a copy "
                          "(.clone()) per batch", _H_CLONE)
    if len(out) == n and len(tensors) == n and fn.static_out is not None:
        ptr = fn.static_out.data_ptr()
        aliased = [i for i, t in enumerate(tensors) if t.data_ptr() == ptr]
        if aliased:
            which = "the last result" if aliased == [n - 1] else f"results {aliased}"
            return Reason(f"{which} IS the graph's static output ({static}), not a copy: the "
                          "next replay of this graph (or the next capture into its pool) "
                          "overwrites it in place (section 5). Clone every result, the last "
                          "one too", _H_CLONE)
    msg = compare_outputs(expected, list(out), rtol=1e-4, atol=1e-5)
    if msg:
        if fn.dropped_at is not None:
            # checked before the values: on a GPU, replays of a freed input read whatever
            # the allocator put in its memory since, so the values say nothing reliable
            return Reason(
                msg + f"; by replay {fn.dropped_at + 1} the tensor {what} was captured on "
                "(your static input) was gone: nothing of yours held it any more, so you gave "
                "its name another tensor (static_x = x?). The graph still reads the old "
                "tensor's memory, never the batch (on a GPU that memory is free and the next "
                "tensor allocated may land there). Keep the static input and copy_ each "
                "batch into it before g.replay() (section 4)", _H_COPY)
        if len(tensors) == len(out) > 1 and all(
                t.shape == tensors[0].shape and torch.equal(t, tensors[0]) for t in tensors):
            if len(expected) == len(out) and tensors[-1].shape == expected[-1].shape and \
                    torch.allclose(tensors[-1], expected[-1], rtol=1e-4, atol=1e-5):
                return Reason(
                    f"every result equals the LAST batch's result: you kept references to "
                    f"the static output ({static}) and cloned after the loop: every replay "
                    f"overwrote them (section {section}). Clone right after each replay, "
                    "inside the loop", _H_CLONE)
            return Reason(
                msg + f"; all {len(out)} results hold the same values, so every replay read "
                "the same input: the graph reads the static input's memory, and a batch "
                "gets there only by copy_ into it (section 4; rebinding the name changes "
                "nothing the graph sees)", _H_COPY)
        if len(tensors) == len(out) and _lagged(tensors, list(expected)):
            if _replays_saw_their_batch(fn, batches):
                return Reason(
                    f"result 0 is not batch 0's, and each later result is the PREVIOUS "
                    f"batch's: every replay ran on its own batch, but you clone {static} "
                    f"BEFORE g.replay(), so you keep what the previous replay left there "
                    f"(result 0: {static} before any replay, memory no replay had written "
                    f"yet). Take the clone after the replay (section {section})", _H_ORDER)
            return Reason(
                "result 0 is not batch 0's, and each later result is the PREVIOUS batch's: "
                "every replay ran on the batch copied in before it, one batch late. You "
                "copy_ a batch into the static input AFTER g.replay(): the replay reads the "
                "static input when it runs, so copy first, then replay (section 4)",
                _H_ORDER)
        return Reason(msg + ("  (a graph reads its input from the static input's memory: "
                             "each batch must be copy_-ed into it before g.replay(), "
                             "section 4)"), _H_COPY)
    if warmups is not None:
        done = len(fn.warmup_streams)
        if done == 0:
            if not warmups:
                return Reason(f"{what} never ran before the capture: you dropped the warm-up. "
                              "Keep it (the exercise says so): side_stream_warmup runs the "
                              "model on a side stream before capturing (section 2)", _H_WARMUP)
            return Reason(f"{what} never ran before the capture: no warm-up. The exercise asks "
                          f"for {warmups} warm-up runs on a side stream before capturing "
                          "(section 2)", _H_WARMUP)
        if warmups and done != warmups:
            return Reason(f"{what} ran eagerly {done} time(s) before the capture: the exercise "
                          f"asks for exactly {warmups} warm-up runs (section 2), not {done}",
                          _H_WARMUP)
        on_default = sum(fn.warmup_streams)
        if on_default:
            return Reason(f"{on_default} of the {done} warm-up runs ran on the default stream: "
                          "the exercise asks for a side stream (section 2 shows the two "
                          "wait_stream calls around `with B.stream(s):`)", _H_WARMUP)
        waits = _missing_waits(fn)
        if waits:
            return Reason(waits, _H_WARMUP)
        if static_input_ptr is not None and any(p != static_input_ptr for p in fn.warmup_ptrs):
            k = sum(p != static_input_ptr for p in fn.warmup_ptrs)
            return Reason(f"{k} of the {done} warm-up runs called {what} on a tensor that is "
                          f"not static_input (a batch?): the exercise asks you to warm up "
                          f"{what}(static_input), the very call you then capture (section 2)",
                          _H_WARMUP)
    return None


def check_graphed_run(graphed_run, *, B=None, trials: int = 3,
                      time_limit: float | None = DEFAULT_TIME_LIMIT) -> CheckResult:
    """``graphed_run(fn, static_input, batches)`` must return clones of fn(batch), via one graph.

    Probed: one capture, no eager call after it, exactly :data:`WARMUP_ITERS` warm-up runs,
    each on a side stream, every result a tensor of its own with the eager values.
    """
    B = _backend(B)

    def make_inputs(gen: torch.Generator):
        fn, batches = _make_fn_inputs(B, gen)
        rows, cols = batches[0].shape
        return fn, torch.zeros(rows, cols, device=B.device), batches

    def reference(fn, static_input, batches):
        with torch.no_grad():
            return {"outputs": [fn.compute(x) for x in batches]}

    def learner(fn, static_input, batches):
        fed = [b.clone() for b in batches]
        try:
            with _recording_waits(B, fn), _recording_replays(B, fn):
                out = _call(B, graphed_run, fn, static_input, batches)
        except _Reported as rep:
            return {"bad": str(rep)}
        return {"outputs": out, "fn": fn, "n": len(batches), "ptr": static_input.data_ptr(),
                "batches": fed}

    def compare(expected, actual) -> str | None:
        if "bad" in actual:
            return actual["bad"]
        return _run_problem(actual["fn"], actual["outputs"], actual["n"], expected["outputs"],
                            warmups=WARMUP_ITERS, static_input_ptr=actual["ptr"],
                            batches=actual["batches"])

    return check(
        learner, reference, make_inputs, trials=trials, name="graphed_run", compare=compare,
        time_limit=time_limit,
        hint="the exercise's three steps are sections 2 (warm-up), 3 (capture) and 4-5 "
             "(replay, keep results) of the lesson",
        more_hints=[
            "warm-up: s = B.Stream(); s.wait_stream(B.current_stream()); then "
            f"`with B.stream(s):` call fn(static_input) {WARMUP_ITERS} times; then "
            "B.current_stream().wait_stream(s)",
            "capture once, before the loop: g = B.CUDAGraph(); `with B.graph(g): static_out = "
            "fn(static_input)`",
            "per batch: static_input.copy_(batch); g.replay(); results.append(static_out.clone())",
        ],
    )


# ---- exercise 3 (diagnosis): serve ------------------------------------------------------

def check_serve(serve, *, B=None, trials: int = 3,
                time_limit: float | None = DEFAULT_TIME_LIMIT) -> CheckResult:
    """``serve(model, requests)`` must return clones of model(request), via one graph."""
    B = _backend(B)

    def make_inputs(gen: torch.Generator):
        return _make_fn_inputs(B, gen)

    def reference(model, requests):
        with torch.no_grad():
            return {"outputs": [model.compute(x) for x in requests]}

    def learner(model, requests):
        kept = [r.clone() for r in requests]
        ptrs = [r.data_ptr() for r in requests]
        try:
            with _recording_waits(B, model), _recording_replays(B, model):
                out = _call(B, serve, model, list(requests))
        except _Reported as rep:
            return {"bad": str(rep)}
        changed = [i for i, (r, k) in enumerate(zip(requests, kept)) if not torch.equal(r, k)]
        return {"outputs": out, "fn": model, "n": len(requests), "changed": changed,
                "on_request": model.captured_on in ptrs, "batches": kept}

    def compare(expected, actual) -> str | None:
        if "bad" in actual:
            return actual["bad"]
        if actual["changed"]:
            i = actual["changed"][0]
            where = (" Your static input IS a caller's request (static_x = requests[0]?), "
                     "so each copy_ overwrote it" if actual["on_request"] else "")
            return (f"serve changed the caller's requests[{i}] in place (requests "
                    f"{actual['changed']} differ after the call).{where}: allocate a static "
                    "input of your own, as the broken version does (torch.zeros_like), and "
                    "copy_ each request into it (section 4)")
        return _run_problem(actual["fn"], actual["outputs"], actual["n"], expected["outputs"],
                            warmups=0, what="model", static="static_y",
                            batches=actual["batches"])

    return check(
        learner, reference, make_inputs, trials=trials, name="serve", compare=compare,
        time_limit=time_limit,
        hint="compare what broken_serve printed with sections 4 and 5 of the lesson",
        more_hints=[
            "one bug makes every output come from the same input: how does a new request "
            "reach the memory the graph reads? (section 4)",
            "one bug makes every output the same tensor: what does the next replay do to "
            "static_y? (section 5)",
        ],
    )


# ---- exercise 2: capture_chain ------------------------------------------------------------

_F1 = {
    "2x+1": lambda x: x * 2.0 + 1.0,
    "x*x-0.5": lambda x: x * x - 0.5,
    "exp(-|x|)": lambda x: torch.exp(-x.abs()),
}
_F2 = {
    "3tanh(x)-x": lambda x: torch.tanh(x) * 3.0 - x,
    "sigmoid(x)+x": lambda x: torch.sigmoid(x) + x,
    "x/2-1": lambda x: x * 0.5 - 1.0,
}


def _logged(B, fn, name: str, calls: list):
    """``fn`` that logs ``(name, capturing?)`` into ``calls`` at every call."""
    def logged(*args, **kwargs):
        calls.append((name, B.is_current_stream_capturing()))
        return fn(*args, **kwargs)
    logged.__name__ = getattr(fn, "__name__", name)
    return logged


@contextlib.contextmanager
def _recording_captures(B, calls: list):
    """Log ``("begin", graph)`` into ``calls`` at every ``B.CUDAGraph.capture_begin``.

    ``B.graph(g)`` calls ``g.capture_begin`` on both backends (torch.cuda.graph and the
    emulator's graph mirror each other), so this marks where each capture starts.
    """
    cls = B.CUDAGraph
    had = "capture_begin" in vars(cls)
    original = vars(cls).get("capture_begin", cls.capture_begin)

    def capture_begin(self, *args, **kwargs):
        calls.append(("begin", self))
        return original(self, *args, **kwargs)

    cls.capture_begin = capture_begin
    try:
        yield
    finally:
        if had:
            cls.capture_begin = original
        else:
            del cls.capture_begin


def _pick(table: dict, gen: torch.Generator):
    key = list(table)[int(torch.randint(0, len(table), (), generator=gen))]
    fn = table[key]
    fn.__name__ = key
    return fn


def check_capture_chain(capture_chain, *, B=None, trials: int = 3,
                        time_limit: float | None = DEFAULT_TIME_LIMIT) -> CheckResult:
    """``capture_chain(f1, f2, static_input)``: ``(g1, g2, static_mid, static_out)``, one pool.

    Probed: two distinct graphs; replaying g1 then g2 gives f1(x) and f2(f1(x)); g1 alone
    writes static_mid and leaves static_out alone; g2 alone reads whatever static_mid
    holds; both graphs in one pool. f1, f2 and the sizes are drawn at random.
    """
    B = _backend(B)

    def make_inputs(gen: torch.Generator):
        n = int(torch.randint(3, 40, (), generator=gen))
        f1, f2 = _pick(_F1, gen), _pick(_F2, gen)
        fresh = [torch.randn(n, generator=gen).to(B.device) for _ in range(3)]
        probe = torch.randn(n, generator=gen).to(B.device)
        return f1, f2, torch.zeros(n, device=B.device), fresh, probe

    def reference(f1, f2, static_input, fresh, probe):
        return {"mid": [f1(x) for x in fresh], "out": [f2(f1(x)) for x in fresh]}

    def learner(f1, f2, static_input, fresh, probe):
        calls: list[tuple] = []     # ("begin", graph) / ("f1" or "f2", capturing?)
        try:
            with _recording_captures(B, calls):
                result = _call(B, capture_chain, _logged(B, f1, "f1", calls),
                               _logged(B, f2, "f2", calls), static_input)
        except _Reported as rep:
            return {"bad": str(rep)}
        if not isinstance(result, (tuple, list)) or len(result) != 4:
            got = type(result).__name__ + (f" of {len(result)}" if isinstance(
                result, (tuple, list)) else "")
            return {"bad": f"expected a tuple (g1, g2, static_mid, static_out), got {got}"}
        g1, g2, mid, out = result
        for name, g in (("g1", g1), ("g2", g2)):
            if not isinstance(g, B.CUDAGraph):
                return {"bad": f"{name} is a {type(g).__name__}, expected a B.CUDAGraph()"}
        for name, t in (("static_mid", mid), ("static_out", out)):
            if not isinstance(t, torch.Tensor):
                return {"bad": f"{name} is a {type(t).__name__}, expected the tensor the "
                               "graph writes"}
        if g1 is g2:
            return {"bad": "g1 and g2 are the same graph object: the exercise asks for two "
                           "graphs, g1 recording f1 only and g2 recording f2 only (two "
                           "captures, section 7)"}
        try:
            same = tuple(g1.pool()) == tuple(g2.pool())
        except Exception as exc:  # a graph that was never captured
            return {"bad": f"g1.pool() / g2.pool() failed ({exc}): was each graph captured?"}
        mids, outs = [], []
        try:
            for x in fresh:
                static_input.copy_(x)
                g1.replay()
                g2.replay()
                mids.append(mid.clone())
                outs.append(out.clone())
            # every fresh input gave the same static_mid: g1 reads no static_input
            mid_constant = len(mids) > 1 and all(torch.equal(m, mids[0]) for m in mids)
            # probe 1: g1 alone must write static_mid and must not compute static_out.
            # (It MAY scribble on static_out: in a shared pool g2's output can live in a
            # block g1 used for an intermediate; that is why shared pools replay in order.)
            static_input.copy_(probe)
            full = f2(f1(probe))
            was_full = bool(torch.allclose(out, full, rtol=1e-5, atol=1e-6))
            marker = torch.full_like(mid, 1234.5)
            mid.copy_(marker)
            g1.replay()
            g1_writes_mid = not torch.equal(mid, marker)
            g1_mid_ok = bool(torch.allclose(mid, f1(probe), rtol=1e-5, atol=1e-6))
            g1_touches_out = not was_full and bool(
                torch.allclose(out, full, rtol=1e-5, atol=1e-6))
            # probe 2: g2 alone must read what static_mid holds now
            planted = probe.flip(0) + 0.25
            mid.copy_(planted)
            g2.replay()
            g2_reads_mid = bool(torch.allclose(out, f2(planted), rtol=1e-5, atol=1e-6))
            g2_writes_mid = not torch.equal(mid, planted)
            g2_recomputes = bool(torch.allclose(out, full, rtol=1e-5, atol=1e-6))
            g2_reads_input = bool(torch.allclose(out, f2(probe), rtol=1e-5, atol=1e-6))
        except Exception as exc:
            return {"bad": f"replaying g1 / g2 failed: {type(exc).__name__}: {exc}"}
        # probe 3: g1 records f1 "and nothing else". (a) No capture called f1 and f2
        # both (every backend: f1 and f2 log their calls, B.CUDAGraph its capture_begin).
        # (b) On the emulator, g1 holds as many ops as f1 alone captured here (on a GPU
        # counting kernels needs the profiler, too slow for a checker).
        begins = [i for i, (kind, _) in enumerate(calls) if kind == "begin"] + [len(calls)]
        f1_with_f2 = any({"f1", "f2"} <= {kind for kind, capturing in calls[a + 1:b] if capturing}
                         for a, b in zip(begins, begins[1:]))
        g1_kernels = f1_kernels = []
        if B.is_emulated:
            try:
                g1_kernels = recorded_kernels(g1, B)
                g_f1, _ = capture(f1, torch.zeros_like(static_input), B=B)
                f1_kernels = recorded_kernels(g_f1, B)
                del g_f1
            except Exception:  # noqa: BLE001 - the probe is extra; the probes above decide
                _recover(B)
                g1_kernels = f1_kernels = []
        return {"mid": mids, "out": outs, "same_pool": same, "g1_mid_ok": g1_mid_ok,
                "g1_touches_out": g1_touches_out, "g2_reads_mid": g2_reads_mid,
                "g2_writes_mid": g2_writes_mid, "g1_kernels": g1_kernels,
                "f1_kernels": f1_kernels, "f1_with_f2": f1_with_f2,
                "mid_constant": mid_constant, "g1_writes_mid": g1_writes_mid,
                "g2_recomputes": g2_recomputes, "g2_reads_input": g2_reads_input}

    def compare(expected, actual) -> str | None:
        if "bad" in actual:
            return actual["bad"]
        msg = compare_outputs(expected["mid"], actual["mid"], rtol=1e-5, atol=1e-6,
                              where="static_mid ")
        if msg and compare_outputs(expected["out"], actual["mid"], rtol=1e-5, atol=1e-6) is None \
                and compare_outputs(expected["mid"], actual["out"], rtol=1e-5,
                                    atol=1e-6) is None:
            return ("static_mid and static_out: order swapped. What you return as static_mid "
                    "holds f2(f1(x)) and what you return as static_out holds f1(x): return "
                    "(g1, g2, static_mid, static_out) in this order")
        if msg and not actual["g1_writes_mid"]:
            return (msg + " after g1.replay(). Replaying g1 leaves what you return as "
                    "static_mid unchanged: it is not the tensor g1 writes (an eager result, "
                    "or a copy of g1's output). Return the very tensor f1 returned inside "
                    "g1's capture, not a copy of it")
        if msg and actual["mid_constant"]:
            return (msg + " after g1.replay(). g1 writes static_mid, but the same values "
                    "whatever static_input holds: g1 does not read static_input. Did you "
                    "capture f1 on a copy of it (static_input.clone(), a tensor of your own)? "
                    "The graph reads the tensor it was captured on: capture "
                    "f1(static_input) itself")
        if msg:
            return msg + (" after g1.replay(): g1 must record static_mid = f1(static_input), "
                          "and static_mid must be the tensor g1 wrote (not a copy of it)")
        if actual["g1_touches_out"]:
            return ("replaying g1 alone computed static_out = f2(f1(x)): g1 records f2 too. "
                    "Each graph records one function: g1 f1, g2 f2")
        if actual["g2_writes_mid"] and not actual["g2_reads_mid"]:
            return ("replaying g2 alone overwrote static_mid: your g2 records f1. Graph order "
                    "swapped? Return (g1, g2, static_mid, static_out), g1 the f1 graph")
        if not actual["g2_reads_mid"]:
            head = ("g2 does not read g1's output: with new values written into static_mid, "
                    "g2.replay() alone did not give f2(static_mid). ")
            if actual["g2_recomputes"]:
                why = ("It gave f2(f1(static_input)): your g2 recomputes f1 from "
                       "static_input. ")
            elif actual["g2_reads_input"]:
                why = ("It gave f2(static_input): your g2 records f2 of static_input, not of "
                       "static_mid. ")
            else:
                why = ("Your g2 reads another tensor, made before its capture (a copy of "
                       "static_mid?), which no replay of g1 updates. ")
            return head + why + "Capture g2 on static_mid itself, the tensor g1 writes"
        msg = compare_outputs(expected["out"], actual["out"], rtol=1e-5, atol=1e-6,
                              where="static_out ")
        if msg:
            return msg + (" after g1.replay(); g2.replay(): g2 must record "
                          "static_out = f2(static_mid)")
        if not actual["g1_mid_ok"]:
            return "replaying g1 alone did not write f1(static_input) into static_mid"
        if actual["f1_with_f2"]:
            return ("one capture called f1 and f2 both: g1 records f2 as well (into a tensor "
                    "you do not keep?). The exercise asks g1 to record static_mid = "
                    "f1(static_input), f1 and nothing else: f2 belongs in g2 only")
        extra = len(actual["g1_kernels"]) - len(actual["f1_kernels"])
        if actual["f1_kernels"] and extra > 0:
            more = sorted((Counter(actual["g1_kernels"]) - Counter(actual["f1_kernels"]))
                          .elements())
            named = ", ".join(more) if more else f"{extra} more"
            copy = any("copy" in k for k in more)
            why = ("a copy of f1's result into a tensor of your own? static_mid can be f1's "
                   "own output: no copy needed" if copy else
                   "an op f1 does not have, into a tensor you do not keep?")
            return (f"g1 recorded {len(actual['g1_kernels'])} kernels, but f1 alone is "
                    f"{len(actual['f1_kernels'])}: g1 records more than static_mid = "
                    f"f1(static_input) (extra: {named}; {why}). The exercise asks g1 to "
                    "record f1 and nothing else")
        if not actual["same_pool"]:
            return ("the results are right, but g1 and g2 use different memory pools: the "
                    "exercise asks for one shared pool: capture g2 with pool=g1.pool() or pass one "
                    "B.graph_pool_handle() to both (section 7)")
        return None

    return check(
        learner, reference, make_inputs, trials=trials, name="capture_chain", compare=compare,
        time_limit=time_limit,
        hint="section 7 of the lesson captures two graphs into one pool, the second reading "
             "the first's static output",
        more_hints=[
            "two graphs, two captures: g1 records static_mid = f1(static_input); g2 records "
            "static_out = f2(static_mid), on the very tensor g1 writes",
            "one pool for both: pool = B.graph_pool_handle(), then `with B.graph(g1, "
            "pool=pool):` and `with B.graph(g2, pool=pool):` (or pool=g1.pool() for g2)",
        ],
    )
