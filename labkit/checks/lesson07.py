"""Checkers for lesson 07 (whole-step capture and torch.compile).

Three exercises, each checked against :mod:`labkit.full_step`:

* ``fill_static_buffers(buffers, microbatches)``: copy every microbatch into its static
  buffers *in place*, with non-blocking copies, on the stream the caller made current.
  Checked by what a captured graph would see (the tensors that were in ``buffers``
  before the call must hold the new data afterwards) and by watching every ``copy_``
  the function makes (its ``non_blocking`` flag, the stream it runs on).
* ``run_iteration(it, warmup_steps, ops)``: the capture-at-warmup-step logic of a
  whole-step wrapper: eager while ``it < warmup_steps``, capture once at the first
  iteration after that *and replay in the same iteration*, replay from then on. Checked
  by the sequence of calls it makes over a run of iterations and the losses it returns
  (tensors, as a real wrapper's: a clone of the static loss is fine, a float is not).
* ``update_found_inf(found_inf, loss)``: set the flag when ``loss`` is inf, -inf or NaN,
  with tensor ops only, accumulating over the microbatches of a step. Checked by
  capturing it on labkit's emulator (a host read is refused there exactly as on a GPU)
  and replaying with finite and non-finite losses; a wrong answer is then probed with
  single values (NaN alone, inf alone, a bad loss followed by a good one) to name the
  mistake actually made.

Every check leaves a usable process, also after a learner's host read inside a capture
(:func:`labkit.backend.recover`).
"""

from __future__ import annotations

import os

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from labkit import full_step as FS
from labkit.checks import (
    CheckResult,
    LearnerTimeout,
    Reason,
    check,
    compare_outputs,
    describe_exception,
)
from labkit.core.errors import exception_chain

__all__ = ["check_fill_static_buffers", "check_run_iteration", "check_update_found_inf",
           "check_make_step"]


# ---- exercise 1: the static batch loader's fill -------------------------------------------

def _leaves(buffers) -> list[torch.Tensor]:
    out = []
    for mb in buffers:
        out.extend(mb if isinstance(mb, (tuple, list)) else [mb])
    return out


def _current_stream(device: torch.device):
    if device.type == "cuda":
        return torch.cuda.current_stream(device)
    from labkit import backend

    return backend.get("emulated").current_stream()


def _side_stream(device: torch.device):
    if device.type == "cuda":
        return torch.cuda.Stream(device)
    from labkit import backend

    return backend.get("emulated").Stream()


def _stream_ctx(s):
    if isinstance(s, torch.cuda.Stream):
        return torch.cuda.stream(s)
    from labkit import backend

    return backend.get("emulated").stream(s)


class _CopyLog(TorchDispatchMode):
    """Records every op that writes into one of ``targets`` (by storage): which op, its
    ``non_blocking`` flag (copies) and the stream current at that moment."""

    def __init__(self, targets, device):
        super().__init__()
        self.targets = {t.untyped_storage().data_ptr(): i for i, t in enumerate(targets)}
        self.device = device
        self.writes: list[tuple[int, str, bool | None, object]] = []

    def _note(self, t, op, nb):
        i = self.targets.get(t.untyped_storage().data_ptr()) if isinstance(t, torch.Tensor) \
            else None
        if i is not None:
            self.writes.append((i, op, nb, _current_stream(self.device)))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if name == "copy_":
            nb = kwargs.get("non_blocking", args[2] if len(args) > 2 else False)
            self._note(args[0], "copy_", bool(nb))
        elif name == "_foreach_copy_":
            nb = kwargs.get("non_blocking", args[2] if len(args) > 2 else False)
            for t in args[0]:
                self._note(t, "copy_", bool(nb))
        elif func._schema.is_mutable:
            for arg, t in zip(func._schema.arguments, args):
                if arg.is_write:
                    for x in (t if isinstance(t, (list, tuple)) else [t]):
                        self._note(x, name, None)
        return func(*args, **kwargs)


class _SyncWatch:
    """Notes every host synchronization made while active, instead of letting a CPU-only
    torch refuse ``torch.cuda.synchronize()`` with "Torch not compiled with CUDA enabled"
    (which a learner would read as a broken install, not as the rule). Patched: the
    ``synchronize`` of ``torch.cuda``, ``torch.accelerator`` and every labkit backend
    namespace, and of the Stream and Event classes of both backends."""

    def __init__(self):
        self.calls: list[str] = []
        self._undo: list[tuple[object, str, object]] = []

    def _patch(self, owner, attr: str, label: str, call_through: bool):
        orig = getattr(owner, attr, None)
        if orig is None:
            return

        def noted(*args, **kwargs):
            self.calls.append(label)
            if call_through:
                return orig(*args, **kwargs)
            return None

        self._undo.append((owner, attr, orig))
        setattr(owner, attr, noted)

    def __enter__(self):
        from labkit import backend

        on_gpu = torch.cuda.is_available()
        emulated = backend.get("emulated")
        self._patch(torch.cuda, "synchronize", "torch.cuda.synchronize()", on_gpu)
        self._patch(torch.cuda.Stream, "synchronize", "Stream.synchronize()", on_gpu)
        self._patch(torch.cuda.Event, "synchronize", "Event.synchronize()", on_gpu)
        if hasattr(torch, "accelerator"):
            self._patch(torch.accelerator, "synchronize", "torch.accelerator.synchronize()",
                        on_gpu)
        self._patch(emulated.Stream, "synchronize", "Stream.synchronize()", True)
        self._patch(emulated.Event, "synchronize", "Event.synchronize()", True)
        for ns in list(backend._cache.values()):
            self._patch(ns, "synchronize", "B.synchronize()", ns.name == "emulated" or on_gpu)
        return self

    def __exit__(self, *exc):
        for owner, attr, orig in reversed(self._undo):
            setattr(owner, attr, orig)
        self._undo.clear()
        return False


_NO_GPU_WORDS = ("Torch not compiled with CUDA", "Found no NVIDIA driver",
                 "No CUDA GPUs are available")


_FILL_HINTS = [
    "A graph holds the addresses of the buffer tensors: write INTO them, element-wise, "
    "with Tensor.copy_. Which tensor is the destination, which the source?",
    "Loop over microbatches and, inside, over the tensors of each one (tokens, targets); "
    "copy with non_blocking=True. Streams and waits are the loader's job, not yours.",
    "for bufs, mb in zip(buffers, microbatches):\n"
    "        for buf, new in zip(bufs, mb):\n"
    "            buf.copy_(new, non_blocking=True)",
]


def check_fill_static_buffers(fn, *, device: torch.device | str | None = None,
                              trials: int = 3) -> CheckResult:
    """``fn(buffers, microbatches)`` must copy ``microbatches[i]`` into ``buffers[i]`` in
    place, with ``copy_(..., non_blocking=True)``, on the stream current when it is called.

    ``buffers`` is a list with one ``(tokens, targets)`` tuple per microbatch; the
    microbatches have the same shapes and dtypes (their number and shapes are random per
    trial). The check keeps the buffer tensors that existed before the call (the ones a
    graph captured) and compares *their* contents with the microbatches. It calls ``fn``
    inside a side stream, as ``StaticBatchLoader.load`` does: streams are not ``fn``'s job.
    """
    if device is None:
        from labkit import backend

        device = backend.get("auto").device
    device = torch.device(device)

    def make_inputs(gen: torch.Generator):
        m = int(torch.randint(2, 5, (), generator=gen))
        b = int(torch.randint(1, 4, (), generator=gen))
        t = int(torch.randint(3, 9, (), generator=gen))
        mbs = []
        for _ in range(m):
            seq = torch.randint(0, 100, (b, t + 1), generator=gen)
            mbs.append((seq[:, :-1].contiguous().to(device), seq[:, 1:].contiguous().to(device)))
        buffers = [(torch.randint(100, 200, (b, t), generator=gen).to(device),
                    torch.randint(200, 300, (b, t), generator=gen).to(device))
                   for _ in range(m)]
        return buffers, mbs

    def observe(fill):
        def run(buffers, microbatches):
            captured = _leaves(buffers)                 # what a graph would hold on to
            ptrs = [t.data_ptr() for t in captured]
            sources = [t.clone() for t in _leaves(microbatches)]
            side = _side_stream(device)
            side.wait_stream(_current_stream(device))   # as the loader does: inputs are ready
            log = _CopyLog(captured, device)
            syncs = _SyncWatch()
            try:
                with _stream_ctx(side), syncs, log:
                    fill(buffers, microbatches)
            except (AssertionError, RuntimeError) as exc:
                if not any(w in str(exc) for w in _NO_GPU_WORDS):
                    raise
                return {"cuda_on_cpu": f"{type(exc).__name__}: {str(exc).splitlines()[0]}"}
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            now = _leaves(buffers)
            rebound = (len(now) != len(captured) or any(a is not b for a, b in zip(now, captured))
                       or [t.data_ptr() for t in captured] != ptrs)
            return {"syncs": syncs.calls,
                    "contents": [t.clone() for t in captured],
                    "rebound": rebound,
                    "sources_changed": any(not torch.equal(a, b)
                                           for a, b in zip(sources, _leaves(microbatches))),
                    "writes": [(i, op, nb, st == side) for i, op, nb, st in log.writes],
                    "width": len(buffers[0]) if buffers else 0}
        return run

    def where(k, width):
        i, j = divmod(k, width)
        return f"buffers[{i}][{j}] ({'tokens' if j == 0 else 'targets'} of microbatch {i})"

    def compare(expected, actual) -> str | None:
        if "cuda_on_cpu" in actual:
            return ("your fill called torch.cuda, which this machine cannot run ("
                    f"{actual['cuda_on_cpu']}); but the fill needs no torch.cuda call on a "
                    "GPU either: copy_ on the stream that is current, create no stream, "
                    "synchronize nothing. StaticBatchLoader.load makes the waits around "
                    "your call")
        if actual["syncs"]:
            return (f"your fill calls {actual['syncs'][0]}: the exercise says synchronize "
                    "nothing. A synchronize makes the host wait for work queued on the GPU, "
                    "which throws away what non_blocking=True bought; "
                    "StaticBatchLoader.load orders the copies with event waits between its "
                    "stream and the compute stream, so the host never waits")
        width = actual["width"] or 2
        if actual["rebound"]:
            return ("the buffers now hold different tensors than before the call: a graph "
                    "captured the OLD ones and keeps reading their addresses, which still "
                    "hold the old data. Don't assign to buffers[i] (or to an element of it): "
                    "write into the tensors that are there")
        exp, act = expected["contents"], actual["contents"]
        wrong = [k for k, (e, a) in enumerate(zip(exp, act)) if not torch.equal(e, a)]
        if wrong:
            if actual["sources_changed"]:
                return ("your function changed the microbatches and left the buffers as they "
                        "were: the copy goes the wrong way. In dst.copy_(src) the tensor "
                        "before the dot is the one written")
            written = {i for i, *_ in actual["writes"]}
            k = wrong[0]
            if len(wrong) == len(act) and not written:
                return ("no buffer was written: rebinding a loop variable (buf = new) "
                        "changes nothing the graph sees; write into the buffer tensor")
            for other, e in enumerate(exp):
                if other != k and torch.equal(act[k], e):
                    return (f"{where(k, width)} holds the data of {where(other, width)}: "
                            "each microbatch goes into its own buffers, in the same order")
            untouched = [w for w in wrong if w not in written]
            if untouched:
                missed = ", ".join(where(w, width) for w in untouched[:3])
                return (f"{missed} still hold the old data: fill every tensor of every "
                        f"microbatch (this trial has {len(act) // width} microbatches of "
                        f"{width} tensors)")
            return (f"{where(k, width)} does not hold the microbatch's data after your fill: "
                    + (compare_outputs(exp[k], act[k]) or "values differ"))
        copies = {i: (op, nb, on_side) for i, op, nb, on_side in actual["writes"]}
        for k in range(len(act)):
            op, nb, on_side = copies.get(k, (None, None, True))
            if op is None:
                continue
            if op != "copy_":
                return (f"{where(k, width)} was written by {op}, not by a copy: use "
                        "Tensor.copy_(src, non_blocking=True), the op StaticBatchLoader uses")
            if not nb:
                return (f"the copy into {where(k, width)} is blocking: the exercise asks for "
                        "non_blocking=True (from pinned host memory the copy then overlaps "
                        "other work instead of stalling the host). Note that buf[:] = new is "
                        "a blocking copy too")
            if not on_side:
                return (f"the copy into {where(k, width)} ran on another stream than the one "
                        "current when your function was called. Streams are not your job: "
                        "StaticBatchLoader calls you on its side stream, with the waits around "
                        "the call; copy on the current stream")
        return None

    return check(
        observe(fn), observe(FS.fill_static_buffers), make_inputs, trials=trials,
        name="fill_static_buffers", compare=compare,
        hint="compare with section 2 (static inputs): the graph reads the buffers' addresses",
        more_hints=_FILL_HINTS,
    )


# ---- exercise 2: capture at the warm-up step ------------------------------------------------

class _Ops:
    """A stand-in for a whole-step wrapper's three actions, logging each call.

    Losses are tensors, as a real wrapper's are: ``eager()`` returns a new scalar tensor
    per call; ``replay()`` returns the graph's static loss, the SAME tensor every time,
    holding the value of the latest replay (so ``.clone()``, ``.detach()`` or
    ``.item()`` on it behave as on a real loss)."""

    def __init__(self):
        self.captured = False
        self.log: list[str] = []
        self._eager = 0
        self._static = torch.zeros(())
        self._replays = 0

    def eager(self):
        self.log.append("eager")
        self._eager += 1
        return torch.tensor(float(self._eager))

    def capture(self):
        self.log.append("capture")
        self.captured = True

    def replay(self):
        if not self.captured:
            raise RuntimeError("Called CUDAGraph::replay without a preceding successful "
                               "capture.")
        self.log.append("replay")
        self._replays += 1
        self._static.fill_(100.0 + self._replays)
        return self._static


def _loss_seen(x):
    """What a returned loss holds now (the static loss is overwritten by later replays)."""
    return x.detach().clone() if isinstance(x, torch.Tensor) else x


def _show_loss(x) -> str:
    if isinstance(x, torch.Tensor):
        return f"a tensor holding {x.item():g}"
    return repr(x)


def _reference_run_iteration(it, warmup_steps, ops):
    what = FS.phase(it, warmup_steps, ops.captured)
    if what == "eager":
        return ops.eager()
    if what == "capture":
        ops.capture()
    return ops.replay()


def _per_iteration(log_steps):
    return [" + ".join(s) if s else "(nothing)" for s in log_steps]


def check_run_iteration(fn, *, trials: int = 4) -> CheckResult:
    """``fn(it, warmup_steps, ops)`` must, at iteration ``it``: call and return
    ``ops.eager()`` while ``it < warmup_steps``; otherwise call ``ops.capture()`` if
    ``ops.captured`` is False, then call and return ``ops.replay()``."""
    last: dict = {}

    def make_inputs(gen: torch.Generator):
        trial = gen.initial_seed()
        warmup = 0 if trial == 2 else int(torch.randint(1, 4, (), generator=gen))
        n = warmup + int(torch.randint(2, 5, (), generator=gen))
        last.update(warmup=warmup, n=n)
        return warmup, n

    def observe(step):
        def run(warmup_steps, n_iters):
            ops = _Ops()
            steps, results = [], []
            for it in range(n_iters):
                start = len(ops.log)
                results.append(_loss_seen(step(it, warmup_steps, ops)))
                steps.append(ops.log[start:])
            return {"calls": _per_iteration(steps), "returns": results}
        return run

    def compare(expected, actual) -> str | None:
        w = last["warmup"]
        for it, (e, a) in enumerate(zip(expected["calls"], actual["calls"])):
            if e == a:
                continue
            where = f"warmup_steps={w}, iteration {it}: expected {e!r}, your code did {a!r}."
            why = ""
            if e == "capture + replay" and a == "capture":
                why = (" Capture records the step and computes nothing: replay right after "
                       "capturing, or this iteration's batch is never trained on.")
            elif e == "capture + replay" and a == "capture + eager":
                why = (" Replay the graph you just captured (ops.replay()), as every later "
                       "iteration does: it trains this iteration's batch, and this first "
                       "replay is where a broken capture shows.")
            elif "capture" in a and "capture" not in e and it > w:
                why = " Capture once: after that ops.captured is True, and you only replay."
            elif "capture" in a and it < w:
                why = (f" Too early: iterations 0..{w - 1} are the eager warm-up steps; "
                       f"capture at iteration {w}.")
            elif e.startswith("eager") and a != e:
                why = f" Iterations below warmup_steps ({w}) run eagerly."
            elif "capture" in e and "capture" not in a:
                why = f" At iteration {w} the graph does not exist yet: capture it."
            return where + why
        if len(expected["calls"]) != len(actual["calls"]):
            return "your code stopped early"
        for it, (e, a) in enumerate(zip(expected["returns"], actual["returns"])):
            if isinstance(a, torch.Tensor) and a.shape == e.shape and torch.equal(a, e):
                continue
            if isinstance(a, float) and a == e.item():
                return (f"warmup_steps={w}, iteration {it}: returned the float {a!r}, the "
                        f"loss's value read on the host (.item()?). Return the loss tensor "
                        f"itself: .item() makes the host wait for the GPU to finish the step, "
                        f"at every iteration, which is the very sync a whole-step graph is "
                        f"there to avoid (read it only when you log)")
            hint = " (did you forget `return`?)" if a is None else ""
            return (f"warmup_steps={w}, iteration {it}: returned {_show_loss(a)}, expected "
                    f"{_show_loss(e)}: return the loss that ops.eager() / ops.replay() gives"
                    f"{hint}")
        return None

    return check(
        observe(fn), observe(_reference_run_iteration), make_inputs, trials=trials,
        name="run_iteration", compare=compare,
        hint="compare with section 4 (capture at the warm-up step)",
        more_hints=["Three cases, in this order: a warm-up iteration; the first iteration "
                    "after warm-up (no graph yet); every later one. Which ops.* call(s) "
                    "does each make, and which loss does it return?",
                    "it < warmup_steps → return ops.eager(); otherwise capture first if "
                    "not ops.captured, then return ops.replay() (capture computes nothing)"],
    )


# ---- exercise 3: a flag instead of a host-side NaN check ------------------------------------

_HIDDEN = (os.path.dirname(os.path.dirname(os.path.abspath(__file__))),   # labkit/
           os.path.dirname(os.path.abspath(torch.__file__)))


def _trim_traceback(exc: BaseException) -> BaseException:
    """Cut the traceback after the learner's last frame, so the report points at the
    learner's line, not at the emulator code that refused the op."""
    keep, tb = None, exc.__traceback__
    while tb is not None:
        if not os.path.abspath(tb.tb_frame.f_code.co_filename).startswith(_HIDDEN):
            keep = tb
        tb = tb.tb_next
    if keep is not None:
        keep.tb_next = None
    return exc


def _reference_update_found_inf(found_inf, loss):
    found_inf.logical_or_(~torch.isfinite(loss))


def _captured_flag(update, values_per_replay: list[list[float]]) -> list[bool]:
    """Capture ``flag.zero_(); update(flag, loss_k) for each k`` on the emulator, replay it
    once per entry of ``values_per_replay`` and return the flag after each replay.

    A capture that raises (a host read, a Python ``if`` on a tensor) is cleaned up with
    :func:`labkit.backend.recover` and re-raised with the learner's line on top."""
    from labkit import backend

    E = backend.get("emulated")
    m = len(values_per_replay[0])
    losses = [torch.zeros(()) for _ in range(m)]
    flag = torch.zeros((), dtype=torch.bool)
    g = E.CUDAGraph()
    E.set_stream(E.default_stream())
    with E.stream(E.Stream()):
        g.capture_begin()
        try:
            flag.zero_()
            for loss in losses:          # one call per microbatch, in the graph
                update(flag, loss)
        except BaseException as exc:     # the learner's own error, not capture_end's
            try:
                g.capture_end()
            except Exception:
                pass
            backend.recover(E)           # default stream back, RNG out of capture mode
            raise _trim_traceback(exc) from None
        g.capture_end()
    seen = []
    for vals in values_per_replay:
        for loss, v in zip(losses, vals):
            loss.fill_(v)
        g.replay()
        seen.append(bool(flag))
    return seen


def _diagnose_found_inf(update) -> str:
    """Probe single cases to name the mistake: NaN alone, +inf, -inf, finite, a bad
    microbatch followed by a good one."""
    nan, inf = float("nan"), float("inf")
    try:
        one = _captured_flag(update, [[1.0], [nan], [inf], [-inf], [2.0]])
        two = _captured_flag(update, [[nan, 1.0], [1.0, 1.0]])
    except BaseException:
        one, two = None, None
    if one is None:
        return "found_inf is wrong for some replays"
    finite, f_nan, f_inf, f_ninf, finite2 = one
    if not any(one) and not any(two):
        return ("found_inf never became True, even for a NaN/inf loss. Update it in place: "
                "`found_inf = ...` (or `found_inf | x`) makes a new tensor at capture, and "
                "the graph keeps writing the old one")
    if finite or finite2 or two[1]:
        return ("found_inf is True for an all-finite step: it must become True only when a "
                "loss is inf, -inf or NaN")
    if f_nan and not f_inf and not f_ninf:
        return ("losses of inf and -inf are not flagged: your test catches NaN only "
                "(torch.isnan, or loss != loss). An overflowed loss is inf, and it must skip "
                "the step too")
    if f_nan and f_inf != f_ninf:
        missed, caught = ("-inf", "inf") if f_inf else ("inf", "-inf")
        return (f"a loss of {missed} is not flagged: your test catches NaN and {caught} but "
                f"not {missed} (a comparison with one infinity, such as loss == "
                f"float('{caught}')?). A loss can overflow to either sign; "
                "torch.isfinite(loss) is False for inf, -inf and NaN alike")
    if (f_inf or f_ninf) and not f_nan:
        return ("a NaN loss is not flagged: your test catches inf only (torch.isinf, or a "
                "comparison: every comparison with NaN is False)")
    if f_inf != f_ninf:
        return ("inf and -inf are not treated alike: "
                + ("-inf" if f_inf else "inf") + " is not flagged (a one-sided comparison?)")
    if not two[0]:
        return ("found_inf missed a bad microbatch that was followed by a good one: your "
                "update overwrites the flag with the latest loss's verdict. Combine the "
                "flag with the new verdict instead, so that True stays True until the next "
                "step's zero_()")
    return "found_inf is wrong for some replays"


def check_update_found_inf(fn, *, trials: int = 3) -> CheckResult:
    """``fn(found_inf, loss)`` must set the bool scalar ``found_inf`` (in place) when
    ``loss`` is inf, -inf or NaN and leave it as it was otherwise, without reading any
    value on the host. Captured on labkit's emulator, once per microbatch, then replayed;
    the process stays usable after a learner's host read."""

    def make_inputs(gen: torch.Generator):
        m = int(torch.randint(2, 5, (), generator=gen))
        bad = [float("nan"), float("inf"), float("-inf")]
        replays = [(torch.rand(m, generator=gen) * 5).tolist() for _ in range(5)]
        k = int(torch.randint(0, 3, (), generator=gen))
        replays[1][int(torch.randint(0, m - 1, (), generator=gen))] = bad[k]   # not last
        replays[3][m - 1] = bad[(k + 1) % 3]                                  # last
        replays[4][0] = bad[(k + 2) % 3]
        return (replays,)

    def observe(update):
        def run(replays):
            return _captured_flag(update, replays)
        return run

    def compare(expected, actual) -> str | None:
        if expected == actual:
            return None
        return (f"{_diagnose_found_inf(fn)} (over 5 replays: expected {expected}, got "
                f"{actual})")

    return check(
        observe(fn), observe(_reference_update_found_inf), make_inputs, trials=trials,
        name="update_found_inf", compare=compare,
        hint="compare with section 6.2: no `if`, .item() or bool() on a tensor inside the "
             "captured step; in-place tensor ops only",
        more_hints=["Which values must set the flag? torch has one test that is False for "
                    "inf, -inf and NaN alike. And the flag must remember earlier microbatches.",
                    "A bool tensor has an in-place logical or: found_inf.logical_or_(...) "
                    "(or found_inf |= ...), of ~torch.isfinite(loss)"],
    )


# ---- exercise 4 (diagnosis): training stops after one bad step ------------------------------

def _reference_make_step(model, opt, found_inf, static_batch):
    grads = FS.ensure_grads(model.parameters())

    def step():
        torch._foreach_zero_(grads)
        found_inf.zero_()                          # every replay: the step starts clean
        loss = FS.forward_backward(model, FS.lm_loss, static_batch)
        found_inf.logical_or_(~torch.isfinite(loss))
        opt.step()
        return loss
    return step


def _run_guarded(make_step, bad_at: int, n_steps: int, seed: int) -> dict:
    """Build a tiny LM and a CapturableAdamW(skip_if=flag) on the emulator, capture the step
    that ``make_step`` returns (after one eager warm-up step) and replay ``n_steps`` steps;
    before replay ``bad_at`` a weight is set to inf (every gradient goes non-finite), and
    restored after it. Returns the flag and whether the weights moved, per replay."""
    from labkit import backend

    E = backend.get("emulated")
    cfg = FS.LMConfig(vocab_size=32, d_model=16, n_layers=1, n_heads=2, seq_len=8,
                      micro_batch=2, num_microbatches=2)
    model = FS.build_lm(cfg, seed=seed)
    flag = torch.zeros((), dtype=torch.bool)
    opt = FS.CapturableAdamW(list(model.parameters()), lr=1e-2, skip_if=flag)
    gen = torch.Generator().manual_seed(seed)
    batches = [FS.random_microbatches(cfg, gen) for _ in range(n_steps + 1)]
    static = [tuple(t.clone() for t in mb) for mb in batches[0]]
    step = make_step(model, opt, flag, static)
    if not callable(step):
        raise TypeError(f"make_step must return the step function, got "
                        f"{type(step).__name__}")
    E.set_stream(E.default_stream())
    s = E.Stream()
    with E.stream(s):
        step()                                      # the eager warm-up step
    g = E.CUDAGraph()
    try:
        with E.graph(g, stream=s):
            static_loss = step()
    except BaseException:
        backend.recover(E)
        raise
    flags, moved, losses, params = [], [], [], list(model.parameters())
    for k in range(n_steps):
        for buf, mb in zip(static, batches[k + 1]):
            for b, t in zip(buf, mb):
                b.copy_(t)
        if k == bad_at:
            with torch.no_grad():
                keep = model.head.weight[0, 0].item()
                model.head.weight[0, 0] = float("inf")
        before = [p.detach().clone() for p in params]
        g.replay()
        if k == bad_at:
            with torch.no_grad():
                model.head.weight[0, 0] = keep
                before[-2][0, 0] = keep                 # head.weight, for the comparison
        moved.append(any(not torch.equal(p, q) for p, q in zip(params, before)))
        flags.append(bool(flag))
        losses.append(static_loss.detach().clone() if isinstance(static_loss, torch.Tensor)
                      else static_loss)
    return {"flags": flags, "moved": moved, "losses": losses,
            "weights": [p.detach().clone() for p in params]}


# hints for make_step, one list per kind of mistake (most general first)
_MS_ONCE = ["Every tensor op inside step() is recorded and replayed; code in make_step "
            "outside step() ran once, before the capture. Which of the two does "
            "found_inf.zero_() belong to?",
            "Move found_inf.zero_() into step(), before the forward-backward: each replay "
            "then starts with a clean flag"]
_MS_WHEN = ["The host reads found_inf after the replay: what must it hold then, and what "
            "clears it before the host can read it?",
            "Clear the flag at the start of step() (found_inf.zero_() before the "
            "forward-backward), never after opt.step()"]
_MS_ORDER = ["opt.step() reads the flag when it runs: the verdict must be in found_inf, the "
             "very tensor the optimizer holds (skip_if), before that.",
             "In step(): zero the grads and the flag, forward-backward, update the flag in "
             "place from the loss, then opt.step()"]
_MS_GRADS = ["backward() adds into .grad: which gradients does the next step start from, "
             "if nothing clears them in place?",
             "torch._foreach_zero_(grads) at the start of step(), inside the graph"]
_MS_HOST = ["Inside a capture nothing may read a tensor's value on the host: decide with "
            "tensor ops (lesson section 6.2), not with an `if` on a tensor.",
            "found_inf.logical_or_(~torch.isfinite(loss)) sets the flag on the device"]
_MS_RETURN = ["What did the broken make_step's step() return, and who reads it after a "
              "replay?",
              "End step() with `return loss`: the graph's static loss"]
_MS_GENERAL = _MS_ONCE


def check_make_step(fn, *, trials: int = 2) -> CheckResult:
    """``fn(model, opt, found_inf, static_batch)`` returns a whole-step function whose
    capture skips a step with a non-finite loss (``opt`` is a ``CapturableAdamW`` with
    ``skip_if=found_inf``) and trains normally on the steps after it. When a replay ends,
    ``found_inf`` must hold that step's verdict: the host reads it after the replay (the
    exercise text says so), so clearing it at the end of the step is rejected. ``step()``
    must return the loss (the graph's static loss), and each failure's first hint is about
    the mistake seen."""

    def make_inputs(gen: torch.Generator):
        n = int(torch.randint(4, 6, (), generator=gen))
        bad = int(torch.randint(1, n - 2, (), generator=gen))
        return bad, n, int(torch.randint(0, 100, (), generator=gen))

    def observe(make_step):
        def run(bad_at, n, seed):
            threads = torch.get_num_threads()
            torch.set_num_threads(1)                # tiny tensors: one thread is faster
            try:
                out = _run_guarded(make_step, bad_at, n, seed)
            except (NotImplementedError, LearnerTimeout):
                raise
            except Exception as exc:                # named with its first cause below
                return {"raised": exc}
            finally:
                torch.set_num_threads(threads)
            out["bad_at"] = bad_at
            return out
        return run

    def compare(expected, actual) -> str | None:
        if "raised" in actual:
            root = exception_chain(actual["raised"])[0]
            host = isinstance(root, RuntimeError) and any(
                w in str(root) for w in ("capture", "captur", "sync", "Boolean value"))
            return Reason(
                f"your code raised {describe_exception(root)}"
                + ("\n   The step runs inside a capture: nothing there may read a tensor's "
                   "value on the host (an `if` on a tensor, .item(), bool(), print)."
                   if host else ""),
                _MS_HOST if host else _MS_GENERAL)
        k = expected["bad_at"]
        ef, af, em, am = expected["flags"], actual["flags"], expected["moved"], actual["moved"]
        steps = f"(the bad step is replay {k} of {len(ef)})"
        if not af[k] and not am[k]:
            return Reason(
                f"the optimizer did skip the bad step {steps}, but when its replay ends "
                "found_inf is False again: you clear the flag after opt.step(), so the "
                "host, which reads the flag after the replay (lesson section 6.2), never "
                "sees a bad step. The flag must hold the step's verdict until the next "
                "step starts: clear it at the start of step(), not at the end", _MS_WHEN)
        if not af[k]:
            return Reason(
                f"the bad step was not flagged {steps}: after its replay found_inf is "
                "False and the weights moved, so the verdict never reached opt.step(). "
                "Is the flag set after the loss is known, is nothing clearing it between "
                "the verdict and opt.step(), and is it the very tensor the optimizer "
                "holds (skip_if)?", _MS_ORDER)
        if am[k]:
            return Reason(
                f"the bad step changed the weights {steps} although found_inf was set: "
                "the flag must be set before opt.step() reads it", _MS_ORDER)
        if any(af[k + 1:]) and not any(am[k + 1:]):
            return Reason(
                f"after the bad step, found_inf stays True and the weights never move "
                f"again {steps}; flags per replay: {af}. Something that must happen at "
                "the start of every step happens only once. Which lines of make_step run "
                "at every replay, and which ran only once, before the capture?", _MS_ONCE)
        if any(af[k + 1:]):
            return Reason(
                f"found_inf is True again on a step after the bad one, whose data is "
                f"finite {steps}; flags per replay: {af}, expected {ef}. Something of the "
                "bad step leaks into later ones: backward accumulates into .grad, so "
                "are the gradients zeroed in place at every step?", _MS_GRADS)
        if af != ef or am != em:
            return Reason(f"flags per replay {af} (expected {ef}), weights moved {am} "
                          f"(expected {em})", _MS_ONCE)
        problem = compare_outputs(expected["weights"], actual["weights"], rtol=1e-4,
                                  atol=1e-5)
        if problem:
            return Reason(
                "flags and skips are right, but the weights end up different from the "
                f"reference: {problem}. Are the gradients zeroed in place at every step "
                "(backward accumulates into .grad)?", _MS_GRADS)
        el, al = expected["losses"], actual["losses"]
        if not all(isinstance(x, torch.Tensor) for x in al):
            got = next(x for x in al if not isinstance(x, torch.Tensor))
            return Reason(
                f"flags, skips and weights are right, but step() returned "
                f"{'None' if got is None else type(got).__name__}: the exercise's step "
                "returns the loss, the graph's static loss: after each replay the host "
                "reads it there (to log it, as it reads found_inf)", _MS_RETURN)
        wrong = [i for i, (e, a) in enumerate(zip(el, al))
                 if a.shape != e.shape or not torch.allclose(a, e, equal_nan=True)]
        if wrong:
            i = wrong[0]
            return Reason(
                f"step() returned a tensor, but after replay {i} it holds {al[i].tolist()} "
                f"where that step's loss is {el[i].tolist()}: return the loss that "
                "forward_backward gives inside step(), the graph's static loss",
                _MS_RETURN)
        return None

    return check(
        observe(fn), observe(_reference_make_step), make_inputs, trials=trials,
        name="make_step", compare=compare,
        hint="compare what runs at capture time (once) with what the graph replays "
             "(lesson section 4: capture records the step and runs its Python once)",
        more_hints=["Every tensor op inside step() is recorded and replayed; code in "
                    "make_step outside step() ran once, before the capture. Which of the two "
                    "does found_inf.zero_() belong to?",
                    "Move found_inf.zero_() into step(), before the forward-backward: each "
                    "replay then starts with a clean flag"],
    )
