"""Helpers shared by lesson 02's checkers: reporting an error raised in the learner's
capture, ``fn`` that counts its calls, the recorders of ``wait_stream`` and ``replay``
calls, and the diagnosis of a graphed loop (``graphed_run`` and ``serve`` are checked
alike).
"""

from __future__ import annotations

import contextlib
import traceback
import weakref
from typing import NamedTuple

import torch

from labkit.checks import Reason, _is_learner_frame, attempt, compare_outputs
from labkit.core.errors import capture_cause

WARMUP_ITERS = 3  # what the exercise text asks for


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


def _raised_in_capture(exc: BaseException) -> str:
    """What the learner's capture code raised: the error the capture started with."""
    root = capture_cause(exc)
    hint = ""
    if "captured tensor" in str(root) or "capturing" in str(root):
        hint = ("\n   Inside `with B.graph(g):` ops are recorded, not run: nothing there may "
                "read a tensor's values on the host (print, .item(), .tolist(), if on a "
                "tensor). Read the static output after g.replay().")
    return f"your code raised {_describe(root)}{hint}"


def _call(B, fn, *args):
    """``fn(*args)`` through :func:`labkit.checks.attempt`: an error rejects the trial with
    :func:`_raised_in_capture` (as a mismatch), and the capture is recovered after every
    call."""
    return attempt(fn, args, B=B, always_recover=True, reason=_raised_in_capture,
                   kind="mismatch")


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
def _patched_method(cls, name: str, make):
    """Replace ``cls.<name>`` by ``make(original)`` for the ``with`` block, then put back
    what was there (or delete it, when ``cls`` only inherited the method)."""
    had = name in vars(cls)
    original = vars(cls).get(name, getattr(cls, name))
    setattr(cls, name, make(original))
    try:
        yield
    finally:
        if had:
            setattr(cls, name, original)
        else:
            delattr(cls, name)


@contextlib.contextmanager
def _recording_waits(B, fn: _Counted):
    """Log every ``wait_stream`` call made on ``B.Stream`` objects into ``fn.log``.

    ``B.Stream`` is ``torch.cuda.Stream`` on a GPU (``wait_stream`` is a Python method
    there) and the emulator's ``Stream`` otherwise; ``B.current_stream()`` returns the
    same class, so both calls of section 2 go through the patched method.
    """
    def make(original):
        def wait_stream(self, other):
            fn.log.append(("wait", (self, other)))
            return original(self, other)
        return wait_stream

    with _patched_method(B.Stream, "wait_stream", make):
        yield


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
    def make(original):
        def replay(self, *args, **kwargs):
            if fn.captured_ref is not None and fn.dropped_at is None \
                    and fn.captured_ref() is None:
                fn.dropped_at = fn.replays
            held = fn.captured_ref() if fn.captured_ref is not None else None
            fn.replay_inputs.append(None if held is None else held.detach().clone())
            fn.replays += 1
            return original(self, *args, **kwargs)
        return replay

    with _patched_method(B.CUDAGraph, "replay", make):
        yield


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


class _Run(NamedTuple):
    """One graphed loop as the judges below see it (see :func:`_run_problem`)."""

    fn: _Counted
    out: object
    n: int
    expected: list
    warmups: int | None
    what: str
    static: str
    static_input_ptr: int | None
    section: int
    batches: list | None


def _the_capture(r: _Run) -> Reason | None:
    """One capture, on static_input, and no eager call after it."""
    what, fn = r.what, r.fn
    if fn.captured == 0:
        return Reason(f"{what} was never called during a capture, so nothing was graphed: "
                      f"record it once inside `with B.graph(g):` (section 3) and replay that "
                      f"graph", _H_CAPTURE)
    if fn.captured > 1:
        return Reason(f"{what} was captured {fn.captured} times for {r.n} batches: capture "
                      "ONE graph before the loop (section 3) and only replay it inside the "
                      "loop", _H_CAPTURE)
    if r.static_input_ptr is not None and fn.captured_on != r.static_input_ptr:
        if isinstance(r.out, (list, tuple)) and compare_outputs(
                r.expected, list(r.out), rtol=1e-4, atol=1e-5) is None:
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
        return Reason(f"{what} ran eagerly {fn.after} time(s) after the capture, for {r.n} "
                      "batches: after capture, a batch needs only copy_ + g.replay() "
                      "(section 4); the graph computes the result", _H_CAPTURE)
    return None


def _the_results(r: _Run) -> Reason | None:
    """A list of tensors, each a copy of its own (not the static output)."""
    out, n = r.out, r.n
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
    if len(out) == n and len(tensors) == n and r.fn.static_out is not None:
        ptr = r.fn.static_out.data_ptr()
        aliased = [i for i, t in enumerate(tensors) if t.data_ptr() == ptr]
        if aliased:
            which = "the last result" if aliased == [n - 1] else f"results {aliased}"
            return Reason(f"{which} IS the graph's static output ({r.static}), not a copy: "
                          "the next replay of this graph (or the next capture into its pool) "
                          "overwrites it in place (section 5). Clone every result, the last "
                          "one too", _H_CLONE)
    return None


def _same_values(tensors: list) -> bool:
    return len(tensors) > 1 and all(t.shape == tensors[0].shape and torch.equal(t, tensors[0])
                                    for t in tensors)


def _the_values(r: _Run) -> Reason | None:
    """The eager values, each batch's own; when not, which step of the loop is wrong."""
    msg = compare_outputs(r.expected, list(r.out), rtol=1e-4, atol=1e-5)
    if not msg:
        return None
    what, static, section, expected = r.what, r.static, r.section, r.expected
    tensors = [t for t in r.out if isinstance(t, torch.Tensor)]
    if r.fn.dropped_at is not None:
        # checked before the values: on a GPU, replays of a freed input read whatever
        # the allocator put in its memory since, so the values say nothing reliable
        return Reason(
            msg + f"; by replay {r.fn.dropped_at + 1} the tensor {what} was captured on "
            "(your static input) was gone: nothing of yours held it any more, so you gave "
            "its name another tensor (static_x = x?). The graph still reads the old "
            "tensor's memory, never the batch (on a GPU that memory is free and the next "
            "tensor allocated may land there). Keep the static input and copy_ each "
            "batch into it before g.replay() (section 4)", _H_COPY)
    if len(tensors) == len(r.out) and _same_values(tensors):
        if len(expected) == len(r.out) and tensors[-1].shape == expected[-1].shape and \
                torch.allclose(tensors[-1], expected[-1], rtol=1e-4, atol=1e-5):
            return Reason(
                f"every result equals the LAST batch's result: you kept references to "
                f"the static output ({static}) and cloned after the loop: every replay "
                f"overwrote them (section {section}). Clone right after each replay, "
                "inside the loop", _H_CLONE)
        return Reason(
            msg + f"; all {len(r.out)} results hold the same values, so every replay read "
            "the same input: the graph reads the static input's memory, and a batch "
            "gets there only by copy_ into it (section 4; rebinding the name changes "
            "nothing the graph sees)", _H_COPY)
    if len(tensors) == len(r.out) and _lagged(tensors, list(expected)):
        if _replays_saw_their_batch(r.fn, r.batches):
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


def _the_warmup(r: _Run) -> Reason | None:
    """The warm-up asked for: how many runs, on a side stream, both waits, on static_input."""
    if r.warmups is None:
        return None
    what, warmups, fn = r.what, r.warmups, r.fn
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
    ptr = r.static_input_ptr
    if ptr is not None and any(p != ptr for p in fn.warmup_ptrs):
        k = sum(p != ptr for p in fn.warmup_ptrs)
        return Reason(f"{k} of the {done} warm-up runs called {what} on a tensor that is "
                      f"not static_input (a batch?): the exercise asks you to warm up "
                      f"{what}(static_input), the very call you then capture (section 2)",
                      _H_WARMUP)
    return None


#: a graphed loop's judges, in order (the first reason wins)
RUN_JUDGES = (_the_capture, _the_results, _the_values, _the_warmup)


def _run_problem(fn: _Counted, out, n: int, expected, *, warmups: int | None,
                 what: str = "fn", static: str = "static_out",
                 static_input_ptr: int | None = None, section: int = 5,
                 batches: list | None = None) -> Reason | None:
    """What is wrong with a graphed loop's results and ``fn``'s call counts, or None.

    ``warmups``: the exact number of warm-up runs asked for; 0: at least one (any number);
    None: the warm-up is not checked. ``batches``: what was fed (to tell a clone taken
    before the replay from a copy_ made after it).
    """
    run = _Run(fn, out, n, expected, warmups, what, static, static_input_ptr, section,
               batches)
    return next((reason for judge in RUN_JUDGES if (reason := judge(run))), None)
