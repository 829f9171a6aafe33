"""Checkers for lesson 07 (whole-step capture and torch.compile).

Three exercises, each checked against :mod:`labkit.full_step`:

* ``fill_static_buffers(buffers, microbatches)``: copy every microbatch into its static
  buffers *in place*. Checked by what a captured graph would see: the tensors that were
  in ``buffers`` before the call must hold the new data afterwards.
* ``run_iteration(it, warmup_steps, ops)``: the capture-at-warmup-step logic of a
  whole-step wrapper: eager while ``it < warmup_steps``, capture once at the first
  iteration after that *and replay in the same iteration*, replay from then on. Checked
  by the sequence of calls it makes over a run of iterations.
* ``update_found_inf(found_inf, loss)``: set the flag when ``loss`` is inf or NaN, with
  tensor ops only. Checked by capturing it on labkit's emulator (a host read is refused
  there exactly as on a GPU) and replaying with finite and non-finite losses.
"""

from __future__ import annotations

import os

import torch

from labkit import full_step as FS
from labkit.checks import CheckResult, check, compare_outputs

__all__ = ["check_fill_static_buffers", "check_run_iteration", "check_update_found_inf"]


# ---- exercise 1: the static batch loader's fill -------------------------------------------

def _leaves(buffers) -> list[torch.Tensor]:
    out = []
    for mb in buffers:
        out.extend(mb if isinstance(mb, (tuple, list)) else [mb])
    return out


def check_fill_static_buffers(fn, *, device: torch.device | str | None = None,
                              trials: int = 3) -> CheckResult:
    """``fn(buffers, microbatches)`` must copy ``microbatches[i]`` into ``buffers[i]`` in place.

    ``buffers`` is a list with one ``(tokens, targets)`` tuple per microbatch; the
    microbatches have the same shapes and dtypes. The check keeps the buffer tensors
    that existed before the call (the ones a graph captured) and compares *their*
    contents with the microbatches.
    """
    if device is None:
        from labkit import backend

        device = backend.get("auto").device
    device = torch.device(device)
    last: dict = {}

    def make_inputs(gen: torch.Generator):
        m = int(torch.randint(1, 5, (), generator=gen))
        b = int(torch.randint(1, 4, (), generator=gen))
        t = int(torch.randint(3, 9, (), generator=gen))
        mbs = []
        for _ in range(m):
            seq = torch.randint(0, 100, (b, t + 1), generator=gen)
            mbs.append((seq[:, :-1].contiguous().to(device), seq[:, 1:].contiguous().to(device)))
        buffers = [(torch.zeros(b, t, dtype=torch.int64, device=device),
                    torch.full((b, t), -1, dtype=torch.int64, device=device)) for _ in range(m)]
        return buffers, mbs

    def observe(fill):
        def run(buffers, microbatches):
            captured = _leaves(buffers)                 # what a graph would hold on to
            ptrs = [t.data_ptr() for t in captured]
            fill(buffers, microbatches)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            now = _leaves(buffers)
            last["rebound"] = (len(now) != len(captured)
                               or any(a is not b for a, b in zip(now, captured))
                               or [t.data_ptr() for t in captured] != ptrs)
            return [t.clone() for t in captured]
        return run

    def compare(expected, actual) -> str | None:
        problem = compare_outputs(expected, actual)
        if problem is None and not last.get("rebound"):
            return None
        if last.get("rebound"):
            return ("the buffers now hold different tensors than before the call: a graph "
                    "captured the OLD ones and keeps reading their addresses, which still "
                    "hold the old data. Don't assign (buffers[i] = ...); copy into them: "
                    "buf.copy_(new, non_blocking=True)")
        return ("the buffer tensors do not hold the microbatches after your fill: "
                f"{problem}")

    return check(
        observe(fn), observe(FS.fill_static_buffers), make_inputs, trials=trials,
        name="fill_static_buffers", compare=compare,
        hint="for each microbatch i and each tensor j: buffers[i][j].copy_(microbatches[i][j], "
             "non_blocking=True)",
    )


# ---- exercise 2: capture at the warm-up step ------------------------------------------------

class _Ops:
    """A stand-in for a whole-step wrapper's three actions, logging each call."""

    def __init__(self):
        self.captured = False
        self.log: list[str] = []
        self._eager = 0

    def eager(self):
        self.log.append("eager")
        self._eager += 1
        return f"eager loss #{self._eager}"

    def capture(self):
        self.log.append("capture")
        self.captured = True

    def replay(self):
        if not self.captured:
            raise RuntimeError("Called CUDAGraph::replay without a preceding successful "
                               "capture.")
        self.log.append("replay")
        return "static loss"


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
                results.append(step(it, warmup_steps, ops))
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
            if e != a:
                hint = " (did you forget `return`?)" if a is None else ""
                return (f"warmup_steps={w}, iteration {it}: returned {a!r}, expected {e!r}: "
                        f"return the loss that ops.eager() / ops.replay() gives{hint}")
        return None

    return check(
        observe(fn), observe(_reference_run_iteration), make_inputs, trials=trials,
        name="run_iteration", compare=compare,
        hint="three cases: it < warmup_steps → eager; not yet captured → capture, then replay; "
             "else replay",
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


def check_update_found_inf(fn, *, trials: int = 3) -> CheckResult:
    """``fn(found_inf, loss)`` must set the bool scalar ``found_inf`` (in place) when
    ``loss`` is inf or NaN and leave it as it was otherwise, without reading any value
    on the host. Captured on labkit's emulator, once per microbatch, then replayed."""
    from labkit import backend

    E = backend.get("emulated")

    def make_inputs(gen: torch.Generator):
        m = int(torch.randint(2, 5, (), generator=gen))
        replays = []
        for r in range(4):
            vals = torch.rand(m, generator=gen) * 5
            if r == 1:      # a bad microbatch that is not the last one...
                vals[int(torch.randint(0, m - 1, (), generator=gen))] = float("nan")
            elif r == 3:    # ...and one that is
                vals[m - 1] = float("inf")
            replays.append(vals)
        return m, replays

    def observe(update):
        def run(m, replays):
            losses = [torch.zeros(()) for _ in range(m)]
            flag = torch.zeros((), dtype=torch.bool)
            g = E.CUDAGraph()
            s = E.Stream()
            with E.stream(s):
                g.capture_begin()
                try:
                    flag.zero_()
                    for loss in losses:          # one call per microbatch, in the graph
                        update(flag, loss)
                except BaseException as exc:
                    try:
                        g.capture_end()
                    except Exception:
                        pass
                    E.set_stream(E.default_stream())
                    raise _trim_traceback(exc)   # the learner's own error and line
                g.capture_end()
            seen = []
            for vals in replays:
                for loss, v in zip(losses, vals):
                    loss.fill_(v)
                g.replay()
                seen.append(bool(flag))
            return seen
        return run

    def compare(expected, actual) -> str | None:
        if expected == actual:
            return None
        if not any(actual):
            return ("found_inf never became True, even for a NaN/inf loss. Update it in place "
                    "(found_inf.logical_or_(...) or copy_): `found_inf = ...` makes a new "
                    "tensor at capture, and the graph keeps writing the old one")
        if all(actual):
            return ("found_inf is True for an all-finite step: it must be True only when a "
                    "loss is inf or NaN (torch.isfinite)")
        return ("found_inf missed a bad microbatch that was not the last one: accumulate over "
                "microbatches (logical_or_), don't overwrite the flag with the latest loss "
                f"(expected {expected}, got {actual} over 4 replays)")

    return check(
        observe(fn), observe(_reference_update_found_inf), make_inputs, trials=trials,
        name="update_found_inf", compare=compare,
        hint="no `if`, .item() or bool() on a tensor inside the step: one in-place tensor op, "
             "e.g. found_inf.logical_or_(~torch.isfinite(loss))",
    )
