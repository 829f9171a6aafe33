"""Exercise 1: ``reduce_overhead(fn, static, B)``, CUDA graph trees' life cycle by hand.

The learner's factory returns a callable that runs ``fn`` eagerly on call 1 (the warm-up),
records a graph on call 2 on static copies of the non-static inputs (static inputs used as
given) and replays it, and on later calls copies the non-static inputs into their buffers
and replays; a static input at a new address records again. The checker runs it on the
emulator with a backend whose ``CUDAGraph`` counts captures and replays, hands it an
``fn`` that counts its eager runs and keeps what it returned inside the capture, and
probes every rule: one eager run (call 1), one capture and one replay (call 2), one replay
and no run of ``fn`` later, the graph's own outputs returned, no argument of the caller
written (now or later), a non-static input copied again when the caller passes the same
tensor refilled in place (torch copies every non-static input before each replay, whatever
its address), re-recording on a new address only (not on a new object at the same address,
not on new values), for every static position, each new recording reading its static input
where it is.
"""

from __future__ import annotations

import contextlib
import types

import torch

from labkit import backend
from labkit.checks import (
    attempt,
    call_learner,
    compare_outputs,
    describe_exception,
    extra_probe,
    fail,
    reject,
    run_check,
)
from labkit.checks.host_reads import HostReads
from labkit.compiled import ReduceOverhead
from labkit.core.errors import capture_cause

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
    """The emulated backend, with a CUDAGraph that counts its captures and replays."""
    B = backend.get("emulated")
    counter = {"captures": 0, "replays": 0}

    class CountingGraph(B.CUDAGraph):
        def capture_begin(self, *a, **k):
            counter["captures"] += 1
            return super().capture_begin(*a, **k)

        def replay(self, *a, **k):
            counter["replays"] += 1
            return super().replay(*a, **k)

    return types.SimpleNamespace(**{**vars(B), "CUDAGraph": CountingGraph}), counter


def _probe(f, B, counter):
    """``f`` as the learner gets it: counts eager runs, keeps what a captured run returned."""
    counter.update(eager=0, captured=0, capture_out=None)

    def fn(*args):
        out = f(*args)
        if B.is_current_stream_capturing() or (       # on a GPU: captured with torch.cuda
                torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()):
            counter["captured"] += 1
            counter["capture_out"] = out
        else:
            counter["eager"] += 1
        return out
    return fn


def _functions(gen):
    """A random fn, its arity and label, from a small family (one or two outputs)."""
    pick = int(torch.randint(0, 3, (), generator=gen))
    if pick == 0:
        return (lambda w, x: torch.relu(x @ w)), 2, "relu(x @ w)"
    if pick == 1:
        return (lambda a, b, c: (a * b + c, (a - c).sum(0))), 3, "(a * b + c, (a - c).sum(0))"
    return (lambda a, b, c, d: a + b * 2 - c * d), 4, "a + b * 2 - c * d"


def _args(gen, arity, device):
    """Random inputs for an fn of ``_functions``, on ``device`` (a graph records device
    work only): square ones, so ``x @ w`` fits."""
    n = int(torch.randint(2, 6, (), generator=gen))
    return [torch.randn(n, n, generator=gen, device=device) for _ in range(arity)]


def _same(a, b) -> bool:
    return compare_outputs(a, b, atol=1e-5) is None


def _leaves(out):
    return list(out) if isinstance(out, (tuple, list)) else [out]


def _kind(out) -> str:
    if isinstance(out, (tuple, list)):
        return f"a {type(out).__name__} of {len(out)}"
    return "one Tensor" if isinstance(out, torch.Tensor) else type(out).__name__


def _static_sets(gen, arity):
    """Which positions are static, per trial: none, all, one, a random subset. The last two
    always hold a static position followed by a non-static one, as the lesson's own example
    does (``f(w, x)``, ``static=(0,)``): code that pairs buffers and arguments by order, or
    takes the non-static inputs to come first, is caught there."""
    def draw(lo, hi):
        return int(torch.randint(lo, hi, (), generator=gen))
    one = (draw(0, arity - 1),) if arity > 1 else (0,)
    subset = {i for i in range(arity) if bool(torch.rand((), generator=gen) < 0.5)}
    if arity > 1 and not _mixed(subset, arity):
        i = draw(0, arity - 1)                  # a static position, a non-static one after it
        subset = (subset | {i}) - {draw(i + 1, arity)}
    return [(), tuple(range(arity)), one, tuple(sorted(subset))]


def _mixed(static, arity) -> bool:
    """Whether a static position comes before a non-static one."""
    return any(i in static and j not in static for i in range(arity) for j in range(i + 1, arity))


@contextlib.contextmanager
def _watch_answer_used():
    """Refuse a use of labkit.compiled.ReduceOverhead, the lesson's own answer, when it
    happens (it ends the check, whatever the trials would have found)."""
    init, call = ReduceOverhead.__init__, ReduceOverhead.__call__

    def refused(*a, **k):
        reject("your code calls labkit.compiled.ReduceOverhead, the lesson's own answer. "
               "Write the life cycle yourself; labkit.capture.capture (warm-up and capture "
               "in one call) is allowed", hints=HINTS)

    ReduceOverhead.__init__, ReduceOverhead.__call__ = refused, refused
    try:
        yield
    finally:
        ReduceOverhead.__init__, ReduceOverhead.__call__ = init, call


def check_reduce_overhead(fn, *, trials: int = 4, seed: int = 0):
    """Run the learner's ``reduce_overhead(fn, static, B)`` through the rules of lesson 08 §1."""
    if not callable(fn):
        return fail(NAME, f"expected your function reduce_overhead, got {type(fn).__name__}")

    def body() -> str:
        with _watch_answer_used():
            gen = torch.Generator().manual_seed(seed)
            for trial in range(trials):
                _one_trial(fn, trial, gen)
        return (f"warm-up, record, copy-and-replay and re-record all right in {trials} "
                f"random trials (any static positions, one or two outputs)")

    return run_check(NAME, body, more_hints=HINTS)


def _raised(where: str):
    def reason(e: BaseException) -> str:
        cause = capture_cause(e)
        tip = ("\n   Exercise 1 runs on labkit's CPU emulator: capture with the backend B "
               "you are given (capture(..., B=B), B.CUDAGraph, B.graph), not torch.cuda"
               if any(t in str(cause) for t in _TORCH_CUDA) else "")
        return f"{where}: your code raised {describe_exception(cause)}{tip}"
    return reason


def _one_trial(fn, trial: int, gen: torch.Generator) -> None:
    f, arity, label = _functions(gen)
    static = _static_sets(gen, arity)[trial % 4]
    where = f"trial {trial + 1} (fn = {label}, static={static})"
    # an error recovers the emulator: a capture may be left half-open
    msg = attempt(_Trial(fn, f, arity, label, static, gen, trial).run,
                  B=backend.get("emulated"), hints=HINTS, reason=_raised(where))
    if msg:
        misread = _misread_static(fn, f, arity, static, gen)
        reject(f"{where}: {misread or msg}", hints=HINTS)


def _treated_static(learner, f, arity, static, gen):
    """The positions at which a new tensor alone makes the learner's code record again,
    probed one position at a time on a fresh ``reduce_overhead(f, static, B)`` after its
    warm-up and recording; None when the probe itself fails."""
    B, counter = _counting_backend()

    def probe():
        call = call_learner(learner, _probe(f, B, counter), static, B)
        args = _args(gen, arity, B.device)
        for _ in range(2):
            call_learner(call, *args)
        seen = []
        for p in range(arity):
            args[p] = torch.randn(args[p].shape, generator=gen, device=B.device)
            was = counter["captures"]
            call_learner(call, *args)
            if counter["captures"] > was:
                seen.append(p)
        return tuple(seen)

    return extra_probe(probe, B=B)     # a probe: the trial's own message stands


def _misread_static(learner, f, arity, static, gen) -> str | None:
    """When the learner's code takes other positions for the static ones than ``static``
    names, in a way that has a name (counted from 1, or the last ones), say so; else None
    (the trial's own message stands). Where the same positions also come from comparing
    ``static[0]`` alone (``static=(0, 1)`` read from 1 leaves position 0), both readings
    are named: the probe cannot tell them apart."""
    if not static:
        return None
    seen = _treated_static(learner, f, arity, static, gen)
    if seen is None or set(seen) == set(static):
        return None
    shifted = [{s + d for s in static if 0 <= s + d < arity} for d in (-1, 1)]
    last = set(range(arity - len(static), arity))
    one_off = any(seen_set == set(seen) and seen_set for seen_set in shifted)
    at_end = set(seen) == last
    if not (one_off or at_end):
        return None                 # static[0] alone, say, is named by the trial's message
    first_only = len(static) > 1 and set(seen) == {static[0]}
    head = (f"your code records again when a new tensor arrives at position(s) "
            f"{list(seen)}, and only there: it takes those for the static inputs, but "
            f"static={static}. ")
    zero = ("Positions in static count from 0, as args[i] and enumerate(args) do (torch's "
            "static_input_idxs too): compare args[i] for i in static, no + 1 or - 1")
    anywhere = ("The positions in static can be anywhere in args, not only the last ones "
                "(the lesson's f(w, x) has static=(0,)): compare data_ptr() at exactly the "
                "positions in static, and copy every other argument into its buffer")
    first = ("A new tensor at any position in static records again, not only at the first "
             "one: compare data_ptr() for every position in static, not static[0] alone")
    causes = [text for found, text in ((first_only, first), (at_end, anywhere),
                                       (one_off, zero)) if found]
    if len(causes) > 1:             # the same positions, more than one way to get there
        return head + "Two readings of static give these positions. " + " ".join(
            f"({k}) {text}." for k, text in enumerate(causes, 1))
    return head + causes[0]


def _times(k: int) -> str:
    return {1: "once", 2: "twice"}.get(k, f"{k} times")


_NOT_ON_B = ("call {n} captured fn, but not on the backend B that reduce_overhead(fn, static, "
             "B) was given: pass it on, labkit.capture.capture(fn, *buffers, B=B, warmup=0) "
             "(or use B.CUDAGraph and B.graph)")
_TORCH_CUDA = ("Tried to instantiate dummy base class", "Torch not compiled with CUDA",
               "Found no NVIDIA driver", "No CUDA GPUs are available")

_GLOBAL_STATE = (" (this is a new function from a new reduce_overhead(...) call: if your "
                 "counter or graph lives outside reduce_overhead, e.g. in a global, it "
                 "carries over from the last one. Keep the state inside, one per function)")


class _Trial:
    """One trial: a fresh ``reduce_overhead(fn, static, B)`` called through its life."""

    def __init__(self, learner, f, arity, label, static, gen, trial):
        self.learner, self.f, self.arity, self.label = learner, f, arity, label
        self.static, self.gen, self.trial = static, gen, trial
        self.copied = [i for i in range(arity) if i not in static]
        self.kept = []          # (call, position, tensor, its value) of the caller's inputs
        self.n = 0              # calls made so far
        self.read = None        # (call, where) of the learner's first host read

    def fresh(self, args):
        """args with new values at the copied (non-static) positions."""
        return [a if i in self.static else self.randn(a.shape) for i, a in enumerate(args)]

    def randn(self, shape):
        """New random values on the device the trial's inputs live on."""
        return torch.randn(shape, generator=self.gen, device=self.device)

    def step(self, args):
        """Call the learner once: its number, what it returned, what fn gives, what it did
        (captures, replays, eager runs of fn) and which input of the caller it wrote, if any."""
        self.n += 1
        n, c = self.n, self.counter
        was = dict(c)
        before = [a.clone() for a in args]
        self.values = before
        with HostReads() as reads:
            got = call_learner(self.call, *args)
        if reads.found and self.read is None:
            self.read = (n, reads.message())
        did = {k: c[k] - was[k] for k in ("captures", "replays", "eager", "captured")}
        want = self.f(*before)
        wrote = None
        for i, (a, b) in enumerate(zip(args, before)):
            if not torch.equal(a, b):
                wrote = (f"call {n} wrote into its argument {i}, the caller's tensor"
                         + (": a static input is read where it is, never written"
                            if i in self.static else
                            " (arg.copy_(buf) copies the wrong way?): copy each argument "
                            "INTO its buffer, buf.copy_(arg)"))
                break
        for m, i, t, value in self.kept if wrote is None else ():
            if not torch.equal(t, value):
                wrote = (f"call {n} overwrote the tensor the caller passed as input {i} on "
                         f"call {m}: your graph reads the caller's own tensor there (you "
                         f"kept the argument, not a copy), so copy_ writes into it. Make "
                         f"each non-static buffer a copy, a.detach().clone(): torch copies "
                         f"those inputs into memory of its own")
                break
        self.kept += [(n, i, a, a.clone()) for i, a in enumerate(args) if i not in self.static]
        return n, got, want, did, wrote

    def run(self):
        B, self.counter = _counting_backend()
        self.device = B.device
        fn = _probe(self.f, B, self.counter)
        self.call = call_learner(self.learner, fn, self.static, B)
        if not callable(self.call):
            return (f"reduce_overhead returned {type(self.call).__name__}, expected a "
                    f"function to call with the inputs (define call(*args) inside and "
                    f"return it)")
        args = _args(self.gen, self.arity, self.device)
        for n in range(1, 5):
            if n > 1:
                args = self.fresh(args)
            n, got, want, did, wrote = self.step(args)
            msg = self.judge_call(n, got, want, did, wrote)
            if msg:
                return msg
        msg = self.refilled(args) if self.copied else None
        if msg:
            return msg
        msg = self.static_rules(args) if self.static else None
        return msg or self.host_read()     # last: a more precise mistake is named first

    def host_read(self):
        """The learner's first host read, as a verdict: on a GPU it is a device→host sync
        on every call, the very wait reduce-overhead exists to remove."""
        if self.read is None:
            return None
        n, where = self.read
        return (f"call {n} read a tensor's value on the host ({where}): on a GPU that is a "
                f"device→host sync on every call, the wait a replay exists to remove. Copy "
                f"every non-static input into its buffer on every call, without looking at "
                f"its values, as torch's trees do (CUDAGraphNode.run copies them all)")

    def refill(self, args):
        """The same tensors as the last call, new values written into the non-static ones in
        place (a caller that refills its input tensor, or a new tensor at the address of a
        freed one); what the trial remembers of the caller's tensors follows."""
        with torch.no_grad():           # new values, no draw from the trial's generator
            for i in self.copied:
                args[i].mul_(-1).add_(0.25)
        self.kept = [(m, i, t, t.clone() if any(t is args[j] for j in self.copied) else v)
                     for m, i, t, v in self.kept]
        return args

    def refilled(self, args):
        """A call with the tensors of the call before, refilled in place: copied again."""
        stale_before = self.n
        n, got, want, did, wrote = self.step(self.refill(args))
        msg = self.judge_call(n, got, want, did, wrote)
        if msg and "stale result" in msg:
            return (f"call {n} passed the same tensors as call {stale_before} at the non-static "
                    f"position(s) {self.copied}, their values changed in place, and the replay "
                    f"did not see the new values. Copy every non-static argument into its "
                    f"buffer on every call, whatever its address: a caller may refill the "
                    f"tensor it passed before, and the allocator hands a freed tensor's "
                    f"address to the next one (torch's CUDAGraphNode.run copies every "
                    f"non-static input before each replay, without comparing addresses)")
        return msg

    def judge_call(self, n, got, want, did, wrote):
        caps, reps, eager = did["captures"], did["replays"], did["eager"]
        if n == 1:
            extra = _GLOBAL_STATE if self.trial else ""
            if caps:
                return ("call 1 captured a graph. The first call is the warm-up: run fn "
                        "eagerly and return its result; record on call 2 (§1)" + extra)
            if reps:
                return ("call 1 replayed a graph, but nothing is recorded at call 1: the "
                        "first call is the warm-up, run fn eagerly and return its result"
                        + extra)
        elif n == 2:
            if not caps and did["captured"]:
                return _NOT_ON_B.format(n=n)
            if not caps:
                ran = (f" (it ran fn eagerly {_times(eager)}: only call 1 is the warm-up)"
                       if eager else " (B.CUDAGraph was never captured into)")
                return (f"call 2 captured no graph{ran}. Call 2 records: capture fn on the "
                        f"buffers, then replay")
            if eager:
                return (f"call 2 ran fn eagerly {_times(eager)} besides capturing it. Call 1 "
                        f"was the warm-up, so no further one: capture(fn, *buffers, B=B, "
                        f"warmup=0) (its default, warmup=3, runs fn three more times), and "
                        f"return the graph's outputs, not an eager result")
        else:
            if caps:
                static = (f" (static={self.static}: no input can call for a new recording "
                          f"here)" if not self.static else
                          " (if your buffers hold copies of the static inputs, their "
                          "addresses never match the caller's: use static inputs as given)")
                return (f"call {n} captured a new graph although every static input is the "
                        f"same tensor at the same address. Record once; later calls copy "
                        f"the non-static inputs and replay; compare data_ptr() only at the "
                        f"positions in static{static}")
            if eager:
                return (f"call {n} ran fn eagerly. After the recording, every call copies "
                        f"the non-static inputs into their buffers and replays the graph")
        return self.judge_result(n, got, want, did, wrote)

    def judge_result(self, n, got, want, did, wrote):
        """What every call must get right: one replay (from call 2), no input written, the
        right values in fn's structure, and (from call 2) the graph's own outputs."""
        reps = did["replays"]
        if n > 1 and reps != 1:
            if not reps:
                why = (": capturing records the kernels without running them, so the "
                       "graph's outputs hold no result until graph.replay()" if n == 2 else "")
                return f"call {n} did not replay the graph{why}. Replay it, then return its outputs"
            return (f"call {n} replayed the graph {_times(reps)}. Replay once per call: each "
                    f"replay runs every kernel again")
        if wrote:
            return wrote
        if got is None:
            return f"call {n} returned None: return fn's result (call 1) or the graph's outputs"
        if _kind(want) != _kind(got) and not (isinstance(want, tuple) and isinstance(got, list)
                                              and len(want) == len(got)):
            return (f"call {n} returned {_kind(got)}, but fn = {self.label} returns "
                    f"{_kind(want)}: return fn's result (call 1) or the graph's outputs as "
                    f"fn returned them")
        if not _same(want, got):
            paired = self.paired_by_order(got) if n > 2 else None
            if paired:
                return f"call {n} returned a wrong result: {paired}"
            if n > 2 and self.copied:
                return (f"call {n} returned a stale result: the replay did not see this "
                        f"call's values of input(s) {self.copied}. Before each replay, copy_ "
                        f"every non-static input into its buffer")
            if n == 2:
                return (f"call 2 (the recording) returned a wrong result for fn = "
                        f"{self.label}: the graph reads its buffers, so they must hold this "
                        f"call's values: copies of the non-static inputs (a.detach().clone()), "
                        f"the static ones as given")
            return f"call {n} returned a wrong result for fn = {self.label}"
        if n > 1 and any(a is not b for a, b in zip(_leaves(self.counter["capture_out"]),
                                                    _leaves(got))):
            return (f"call {n} returned the right values in new tensors, not the graph's "
                    f"outputs (the tensors fn returned inside the capture). Return those, "
                    f"the same tensors every call, as torch does (no clone: the caller "
                    f"clones what it keeps, §5)")
        return None

    def paired_by_order(self, got):
        """Whether ``got`` is what a replay gives when the buffers of the non-static inputs
        (in order) received the first arguments, ``zip(buffers, args)`` over every argument
        (right only while the non-static inputs come first); why, or None."""
        values = list(self.values)
        wrong = [(i, j) for j, i in enumerate(self.copied) if i != j]
        if not wrong:
            return None
        for j, i in enumerate(self.copied):
            values[i] = self.values[j]
        if not _same(self.f(*values), got):
            return None
        i, j = wrong[0]
        return (f"the replay read input {j}'s values where input {i} belongs: your copies "
                f"pair the buffers with the wrong arguments. With static={self.static} the "
                f"non-static inputs are {self.copied}: a zip of their buffers against every "
                f"argument, zip(buffers, args), hands buffer {self.copied.index(i)} (input "
                f"{i}'s) argument {j}. Copy each non-static argument into the buffer of its own "
                f"position: for i, a in enumerate(args), skip i in static, buffers[i].copy_(a)")

    def static_rules(self, args):
        """Static inputs: a new object at the same address, an in-place change, a new tensor."""
        # the same memory in new tensor objects (detach(): same storage, same data_ptr())
        args = [a.detach() if i in self.static else a for i, a in enumerate(self.fresh(args))]
        n, got, want, did, wrote = self.step(args)
        if did["captures"]:
            return (f"call {n}: static input(s) {self.static} arrived as new tensor objects at "
                    f"the same addresses (x.detach(): the same memory) and your code recorded "
                    f"again. torch's check_invariants compares addresses: compare data_ptr(), "
                    f"not the tensor objects")
        msg = self.judge_call(n, got, want, did, wrote)
        if msg:
            return msg
        # a static input changed in place is read by the replay, not copied away
        i = self.static[0]
        with torch.no_grad():
            args[i].mul_(2)
        n, got, want, did, wrote = self.step(args)
        if did["captures"]:
            return (f"static input {i} changed in place (same tensor, same address) and your "
                    f"code recorded again. A static input is re-recorded only when its "
                    f"address changes: compare data_ptr(), not values")
        if wrote is None and did["replays"] == 1 and not did["eager"] and not _same(want, got):
            return (f"static input {i} changed in place, but the replay computed on its old "
                    f"value: a static input is used where it is, never copied into a buffer "
                    f"of your own (torch never copies parameters)")
        msg = self.judge_call(n, got, want, did, wrote)
        if msg:
            return msg
        # each static position in turn: a new tensor records again, then that graph replays
        for i in self.static:
            args = self.fresh(args)
            args[i] = self.randn(args[i].shape)
            n, got, want, did, wrote = self.step(args)
            if not did["captures"] and did["captured"]:
                return _NOT_ON_B.format(n=n)
            if not did["captures"]:
                if did["eager"]:
                    return (f"static input {i} arrived as another tensor (a new address) and "
                            f"your code ran fn eagerly instead of recording. fn is warmed up "
                            f"already (call 1): torch records the new graph at once")
                hint = " (it computed on the old tensor)" if not _same(want, got) else ""
                return (f"static input {i} arrived as another tensor (a new address) and your "
                        f"code replayed the old graph{hint}. torch's check_invariants fails "
                        f"there and the manager records again: do the same, for every "
                        f"position in static")
            if did["eager"]:
                return (f"static input {i} arrived as another tensor: your code recorded, but "
                        f"also ran fn eagerly {_times(did['eager'])}. fn is warmed up already: "
                        f"capture with warmup=0")
            if (did["replays"] == 1 and wrote is None and got is not None
                    and _kind(got) == _kind(want) and not _same(want, got)):
                return (f"the recording for a new static input {i} returned a wrong result: "
                        f"its buffers must hold this call's values, copies of the non-static "
                        f"inputs made now (a.detach().clone()), static inputs as given")
            msg = self.judge_result(n, got, want, did, wrote)
            if msg:
                return f"after re-recording for a new static input {i}: {msg}"
            args = self.fresh(args)
            with torch.no_grad():
                args[i].mul_(2)     # the new static input, changed in place: read where it is
            n, got, want, did, wrote = self.step(args)
            if did["captures"]:
                return (f"after re-recording for a new static input {i}, the next call with "
                        f"the same static tensors recorded yet again: replay the new graph")
            if (wrote is None and did["replays"] == 1 and not did["eager"] and got is not None
                    and _kind(got) == _kind(want) and not _same(want, got)):
                return (f"after your code re-recorded for a new static input {i}, that tensor "
                        f"changed in place, and the replay computed on its old value: the new "
                        f"recording, like the first, uses every static input as given (never "
                        f"a copy), so that the graph reads it where it is")
            msg = self.judge_call(n, got, want, did, wrote)
            if msg:
                return f"after re-recording for a new static input {i}: {msg}"
        return None
