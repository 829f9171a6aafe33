"""Lesson 07, exercise ``make_step``: its checker.

``make_step(model, opt, found_inf, static_batch)`` returns the step a whole-step graph
captures; ``opt`` is torch's fused AdamW holding ``found_inf`` as ``opt.found_inf``
(:func:`labkit.full_step.make_capturable_optimizer`), so a step whose flag is 1.0 leaves
the weights alone. Checked by capturing the step on labkit's emulator and replaying good
steps, a bad one and good ones again, watching the flag, the weights and the loss.
"""

from __future__ import annotations

import torch

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

__all__ = ["check_make_step"]


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
    """Build a tiny LM and torch's fused AdamW reading ``flag`` on the emulator's device,
    capture the step that ``make_step`` returns (after one eager warm-up step) and replay
    ``n_steps`` steps; before replay ``bad_at`` a weight is set to inf (every gradient goes
    non-finite), and restored after it. Returns the flag and whether the weights moved,
    per replay."""
    from labkit import backend

    E = backend.get("emulated")
    cfg = FS.LMConfig(vocab_size=32, d_model=16, n_layers=1, n_heads=2, seq_len=8,
                      micro_batch=2, num_microbatches=2)
    # everything on the emulator's device: a capture records device ops only
    model = FS.build_lm(cfg, E.device, seed=seed)
    flag = torch.zeros((), device=E.device)         # float32 0.0/1.0: what the fused step reads
    opt = FS.make_capturable_optimizer(list(model.parameters()), E, lr=1e-2, found_inf=flag)
    gen = torch.Generator().manual_seed(seed)
    batches = [FS.random_microbatches(cfg, gen, device=E.device) for _ in range(n_steps + 1)]
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
        flags.append(flag.item())                  # 0.0 or 1.0, read after the replay
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
             "very tensor the optimizer holds (opt.found_inf), before that.",
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
_MS_VALUE = ["The fused step compares the flag with exactly 1.0. What does your update write "
             "into it when several things are non-finite at once?",
             "found_inf.zero_() at the start of step(), then "
             "found_inf.logical_or_(~torch.isfinite(loss)): 1.0 however much went wrong"]
_MS_FLOAT = ["found_inf is float32 here (torch's fused AdamW reads that dtype), where "
             "exercise 3's was bool: update it with an in-place op that works on both.",
             "found_inf.logical_or_(~torch.isfinite(loss)) writes 1.0 or 0.0 into a float "
             "flag; |= (a bitwise or) exists for bool and integer tensors only"]
_MS_GENERAL = _MS_ONCE


def _float_flag_error(exc: BaseException) -> bool:
    """torch's error for a bitwise op (``|=``, ``|``) on a float tensor, such as found_inf."""
    return isinstance(exc, (NotImplementedError, RuntimeError, TypeError)) and \
        "bitwise_or" in str(exc) and "Float" in str(exc)


def check_make_step(fn, *, trials: int = 2) -> CheckResult:
    """``fn(model, opt, found_inf, static_batch)`` returns a whole-step function whose
    capture skips a step with a non-finite loss (``opt`` is torch's fused AdamW with
    ``opt.found_inf = found_inf``, a float32 0.0/1.0 flag, from
    ``make_capturable_optimizer(..., found_inf=found_inf)``) and trains normally on the
    steps after it. When a replay ends,
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
            except NotImplementedError as exc:
                if _float_flag_error(exc):          # torch's, not the exercise's stub
                    return {"raised": exc}
                raise
            except LearnerTimeout:
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
            if _float_flag_error(root):
                return Reason(
                    f"your code raised {describe_exception(root)}\n   found_inf is a float32 "
                    "tensor here (0.0 or 1.0), the flag torch's fused AdamW reads, and a "
                    "float tensor has no bitwise or: `found_inf |= ...` (in your "
                    "update_found_inf of exercise 3?) fails on it. Update it with "
                    "found_inf.logical_or_(...), which writes 1.0 or 0.0 into a float flag",
                    _MS_FLOAT)
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
        odd = [(i, v) for i, v in enumerate(af) if v not in (0.0, 1.0)]
        if odd:
            i, v = odd[0]
            return Reason(
                f"after replay {i} found_inf holds {v:g} {steps}: torch's fused AdamW "
                "skips a step only when the flag is exactly 1.0 (and then takes the flag "
                "off its step count), so the flag must be 0.0 or 1.0. Set it with "
                "found_inf.logical_or_(...), which writes 1.0, not with a sum or a count",
                _MS_VALUE)
        if not af[k] and not am[k]:
            return Reason(
                f"the optimizer did skip the bad step {steps}, but when its replay ends "
                "found_inf is 0.0 again: you clear the flag after opt.step(), so the "
                "host, which reads the flag after the replay (lesson section 6.2), never "
                "sees a bad step. The flag must hold the step's verdict until the next "
                "step starts: clear it at the start of step(), not at the end", _MS_WHEN)
        if not af[k]:
            return Reason(
                f"the bad step was not flagged {steps}: after its replay found_inf is "
                "0.0 and the weights moved, so the verdict never reached opt.step(). "
                "Is the flag set after the loss is known, is nothing clearing it between "
                "the verdict and opt.step(), and is it the very tensor the optimizer "
                "holds (opt.found_inf)?", _MS_ORDER)
        if am[k]:
            return Reason(
                f"the bad step changed the weights {steps} although found_inf was set: "
                "the flag must be set before opt.step() reads it", _MS_ORDER)
        if any(af[k + 1:]) and not any(am[k + 1:]):
            return Reason(
                f"after the bad step, found_inf stays 1.0 and the weights never move "
                f"again {steps}; flags per replay: {af}. Something that must happen at "
                "the start of every step happens only once. Which lines of make_step run "
                "at every replay, and which ran only once, before the capture?", _MS_ONCE)
        if any(af[k + 1:]):
            return Reason(
                f"found_inf is 1.0 again on a step after the bad one, whose data is "
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
        more_hints=_MS_GENERAL,
    )
