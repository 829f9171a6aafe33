"""Lesson 07, exercise ``make_step``: its checker.

``make_step(model, opt, found_inf, static_batch)`` returns the step a whole-step graph
captures; ``opt`` is torch's fused AdamW holding ``found_inf`` as ``opt.found_inf``
(:func:`labkit.full_step.make_capturable_optimizer`), so a step whose flag is 1.0 leaves
the weights alone. Checked by capturing the step on labkit's emulator and replaying good
steps and two bad ones, one whose loss is NaN and one whose loss is +inf (in a random
order, a good step between and after), watching the flag, the weights and the loss. The
optimizer given must be the one that steps, and ``opt.found_inf`` must stay the flag given.
"""

from __future__ import annotations

import torch

from labkit import full_step as FS
from labkit.checks import (
    CheckResult,
    Exercise,
    Reason,
    attempt,
    compare_outputs,
    describe_exception,
    extra_probe,
    recovering,
)
from labkit.checks.budget import one_thread
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


def _loss_text(loss) -> str:
    """A loss as the messages name it: nan, inf, -inf or its value."""
    v = float(loss)
    return "nan" if v != v else f"{v:g}"


def _spoil(model, kind: str, targets: torch.Tensor):
    """Make the next step's loss ``kind`` ("nan" or "inf") by setting one weight of the
    head; returns (parameter, index, old value) to put it back.

    * "nan": ``head.weight[0, 0] = inf``: logit 0 is +inf or -inf by the sign of a
      normalized feature, and a +inf logit makes its row's log-softmax inf - inf = NaN.
    * "inf": ``head.bias[t] = -inf`` for a target token ``t`` of the step: that token's
      log-probability is -inf, its cross-entropy +inf, the other rows stay finite (and so
      do the gradients: only a flag on the loss itself can catch this step).

    (A cross-entropy cannot be -inf; exercise 3's checker covers a -inf loss.)"""
    if kind == "nan":
        p, idx, v = model.head.weight, (0, 0), float("inf")
    else:
        p, idx, v = model.head.bias, (int(targets.flatten()[0]),), float("-inf")
    with torch.no_grad():
        keep = p[idx].item()
        p[idx] = v
    return p, idx, keep


def _run_guarded(make_step, bad: list[tuple[int, str]], n_steps: int, seed: int) -> dict:
    """Build a tiny LM and torch's fused AdamW reading ``flag`` on the emulator's device,
    capture the step that ``make_step`` returns (after one eager warm-up step) and replay
    ``n_steps`` steps; before each replay ``k`` of ``bad`` (pairs ``(k, kind)``) a weight is
    set so that the step's loss is ``kind`` ("nan" or "inf", see :func:`_spoil`), and
    restored after it. Returns the flag and whether the weights moved, per replay, the
    losses and weights, whether ``opt.found_inf`` is still the flag given, and whether the
    optimizer given ever stepped."""
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
    with recovering(E), E.graph(g, stream=s):
        static_loss = step()
    held = getattr(opt, "found_inf", None)
    replaced = "deleted" if held is None else (
        None if held is flag else "another tensor")
    stepped = any(len(st) for st in opt.state.values())     # fused AdamW: state at 1st step
    kinds = dict(bad)
    flags, moved, losses, params = [], [], [], list(model.parameters())
    for k in range(n_steps):
        for buf, mb in zip(static, batches[k + 1]):
            for b, t in zip(buf, mb):
                b.copy_(t)
        if k in kinds:
            p, idx, keep = _spoil(model, kinds[k], static[0][1])
        before = [q.detach().clone() for q in params]
        g.replay()
        if k in kinds:
            with torch.no_grad():
                p[idx] = keep
            i = next(j for j, q in enumerate(params) if q is p)
            before[i][idx] = keep                    # for the comparison
        moved.append(any(not torch.equal(q, r) for q, r in zip(params, before)))
        flags.append(flag.item())                  # 0.0 or 1.0, read after the replay
        losses.append(static_loss.detach().clone() if isinstance(static_loss, torch.Tensor)
                      else static_loss)
    return {"flags": flags, "moved": moved, "losses": losses,
            "weights": [q.detach().clone() for q in params],
            "replaced": replaced, "stepped": stepped}


def _make_inputs(gen: torch.Generator):
    """One trial: ``(bad, n_steps, seed)`` for :func:`_run_guarded`."""
    # two bad steps, one with a NaN loss and one with a +inf loss in a random order,
    # a good step between them and after them: a test of the loss that misses either
    # kind (torch.isnan, torch.isinf) fails every trial
    n = int(torch.randint(5, 7, (), generator=gen))
    first = int(torch.randint(1, n - 3, (), generator=gen))
    second = int(torch.randint(first + 2, n - 1, (), generator=gen))
    kinds = ("nan", "inf") if int(torch.randint(0, 2, (), generator=gen)) else ("inf", "nan")
    bad = [(first, kinds[0]), (second, kinds[1])]
    return bad, n, int(torch.randint(0, 100, (), generator=gen))


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
_MS_TEST = ["Which losses does your test of the loss catch: NaN, inf, -inf? A bad step can "
            "have any of them, and each must skip the step.",
            "found_inf.logical_or_(~torch.isfinite(loss)): torch.isfinite is False for inf, "
            "-inf and NaN alike (torch.isnan misses inf, torch.isinf misses NaN)"]
_MS_REPLACED = ["Two read the flag: the optimizer (through opt.found_inf, the tensor it holds "
                "at capture) and the host (found_inf, after each replay). After your step(), "
                "are they still one tensor?",
                "Leave opt.found_inf alone (it already holds found_inf) and update found_inf "
                "in place: found_inf.zero_() at the start of step(), then "
                "found_inf.logical_or_(~torch.isfinite(loss)) before opt.step()"]
_MS_OPT = ["make_step is given its optimizer: `opt`, torch's fused, capturable AdamW that "
           "holds found_inf (opt.found_inf) and skips a step on the device when it is 1.0. "
           "Which optimizer does your step() run?",
           "Build no optimizer in make_step: call opt.step(), the `opt` passed in, after "
           "setting found_inf"]
_MS_GENERAL = _MS_ONCE


def _float_flag_error(exc: BaseException) -> bool:
    """torch's error for a bitwise op (``|=``, ``|``) on a float tensor, such as found_inf."""
    return isinstance(exc, (NotImplementedError, RuntimeError, TypeError)) and \
        "bitwise_or" in str(exc) and "Float" in str(exc)


EXERCISE = Exercise(
    "make_step",
    hint="compare what runs at capture time (once) with what the graph replays "
         "(lesson section 4: capture records the step and runs its Python once)",
    more_hints=tuple(_MS_GENERAL),
)


def _raised(exc: BaseException) -> str | None:
    """An error out of the learner's step, named by its first cause (None: the stub)."""
    root = exception_chain(exc)[0]
    if isinstance(exc, NotImplementedError) and not _float_flag_error(exc):
        return None                                 # the exercise's stub
    if _float_flag_error(root):
        return Reason(
            f"your code raised {describe_exception(root)}\n   found_inf is a float32 "
            "tensor here (0.0 or 1.0), the flag torch's fused AdamW reads, and a "
            "float tensor has no bitwise or: `found_inf |= ...` (in your "
            "update_found_inf of exercise 3?) fails on it. Update it with "
            "found_inf.logical_or_(...), which writes 1.0 or 0.0 into a float flag",
            _MS_FLOAT)
    text = str(root)
    if "capturable is False" in text:
        return Reason(
            f"your code raised {describe_exception(root)}\n   step() runs an "
            "optimizer built without capturable=True, which keeps its step count "
            "on the host, so torch refuses to capture its step. Use the optimizer "
            "make_step is given: `opt`, torch's fused AdamW built capturable (its "
            "state on the device), which also reads found_inf and skips a bad "
            "step. Call opt.step()", _MS_OPT)
    if "Expected grad_scale and found_inf to be None" in text:
        return Reason(
            f"your code raised {describe_exception(root)}\n   step() runs an "
            "AdamW that is not the fused one, with a found_inf: only torch's "
            "fused AdamW reads found_inf (the foreach and for-loop updates refuse "
            "it, as here). The `opt` make_step is given is that fused AdamW, "
            "already holding found_inf as opt.found_inf: call opt.step()", _MS_OPT)
    host = isinstance(root, RuntimeError) and any(
        w in text for w in ("capture", "captur", "sync", "Boolean value"))
    return Reason(
        f"your code raised {describe_exception(root)}"
        + ("\n   The step runs inside a capture: nothing there may read a tensor's "
           "value on the host (an `if` on a tensor, .item(), bool(), print)."
           if host else ""),
        _MS_HOST if host else _MS_GENERAL)


def _observe(make_step):
    """The trial: :func:`_run_guarded` on ``make_step``; an error in it rejects the
    trial, named by :func:`_raised`."""
    def run(bad, n, seed):
        with one_thread():
            out = attempt(_run_guarded, (make_step, bad, n, seed), explain=_raised)
        return dict(out, bad=bad, seed=seed, make_step=make_step)
    return run


def _flag_alone(make_step, kind: str, seed: int) -> float | None:
    """The learner's flag after one bad step of ``kind`` alone (replay 1 of 3), or None if
    that run fails: tells which kind of bad loss the learner's test misses."""
    with one_thread():
        return extra_probe(lambda: _run_guarded(make_step, [(1, kind)], 3, seed)["flags"][1])


def _steps(expected) -> str:
    """The bad steps of a trial, as the messages name them."""
    lossof = {k: _loss_text(expected["losses"][k]) for k, _ in expected["bad"]}
    return ("(the bad steps are "
            + " and ".join(f"replay {k} (loss {lossof[k]})" for k, _ in expected["bad"])
            + f" of {len(expected['flags'])})")


def _opt_keeps_the_flag(expected, actual) -> Reason | None:
    if not actual["replaced"]:
        return None
    now = ("step() deletes opt.found_inf" if actual["replaced"] == "deleted" else
           "step() puts a new tensor into opt.found_inf (opt.found_inf = ...)")
    return Reason(
        f"{now} instead of updating the flag it was given: at capture the "
        "optimizer reads whatever tensor opt.found_inf holds then, and the host "
        "reads found_inf, the tensor given to make_step, after each replay; "
        f"flags per replay in that one: {actual['flags']} {_steps(expected)}. Leave "
        "opt.found_inf alone (it already holds found_inf) and update found_inf in place "
        "(found_inf.logical_or_(...))", _MS_REPLACED)


def _opt_steps(expected, actual) -> Reason | None:
    if actual["stepped"]:
        return None
    if any(actual["moved"]):
        return Reason(
            "the weights moved, but the `opt` given to make_step never stepped "
            "(its state is still empty): step() runs another optimizer. Only the "
            "`opt` passed in skips a bad step on the device: it is torch's fused, "
            "capturable AdamW and holds found_inf as opt.found_inf (an AdamW you "
            "build reads no flag unless it is fused and holds found_inf: the `opt` "
            "given is that one). Call opt.step(), on the opt given", _MS_OPT)
    return Reason(
        "the `opt` given to make_step never stepped and the weights never moved: "
        "step() must call opt.step(), the optimizer passed in, after setting "
        "found_inf", _MS_OPT)


def _flag_is_0_or_1(expected, actual) -> Reason | None:
    odd = [(i, v) for i, v in enumerate(actual["flags"]) if v not in (0.0, 1.0)]
    if not odd:
        return None
    i, v = odd[0]
    return Reason(
        f"after replay {i} found_inf holds {v:g} {_steps(expected)}: torch's fused AdamW "
        "skips a step only when the flag is exactly 1.0 (and then takes the flag "
        "off its step count), so the flag must be 0.0 or 1.0. Set it with "
        "found_inf.logical_or_(...), which writes 1.0, not with a sum or a count",
        _MS_VALUE)


def _flag_kept_to_the_end(expected, actual) -> Reason | None:
    for k, _ in expected["bad"]:
        if not actual["flags"][k] and not actual["moved"][k]:
            return Reason(
                f"the optimizer did skip the bad step of replay {k} {_steps(expected)}, but "
                "when its replay ends found_inf is 0.0 again: you clear the flag after "
                "opt.step(), so the host, which reads the flag after the replay "
                "(lesson section 6.2), never sees a bad step. The flag must hold the "
                "step's verdict until the next step starts: clear it at the start of "
                "step(), not at the end", _MS_WHEN)
    return None


def _bad_steps_flagged(expected, actual) -> Reason | None:
    bad, af, steps = expected["bad"], actual["flags"], _steps(expected)
    for k, kind in bad:
        if af[k]:
            continue
        loss = _loss_text(expected["losses"][k])
        head = (f"the bad step was not flagged {steps}: replay {k}'s loss was "
                f"{loss}, yet after that replay found_inf is 0.0 and the weights moved")
        other = "inf" if kind == "nan" else "nan"
        caught = next((j for j, kd in bad if kd == other and j < k and af[j]), None)
        if caught is not None or _flag_alone(actual["make_step"], other,
                                             actual["seed"]) == 1.0:
            seen = (f"replay {caught}, whose loss was {other}," if caught is not None
                    else f"a step whose loss is {other}")
            return Reason(
                f"{head}, while {seen} is flagged: your test of the loss misses {loss} ("
                + ("torch.isinf, or a comparison, is False for NaN"
                   if kind == "nan" else "torch.isnan, or loss != loss, is False for "
                   "inf") + "). ~torch.isfinite(loss) is True for NaN, inf and -inf "
                "alike", _MS_TEST)
        return Reason(
            f"{head}, so the verdict never reached opt.step(). Is the flag set after "
            "the loss is known, is nothing clearing it between the verdict and "
            f"opt.step(), does your test catch a loss of {loss}, and is it the very "
            "tensor the optimizer holds (opt.found_inf)?", _MS_ORDER)
    return None


def _bad_steps_skipped(expected, actual) -> Reason | None:
    for k, _ in expected["bad"]:
        if actual["moved"][k]:
            return Reason(
                f"the bad step of replay {k} changed the weights {_steps(expected)} "
                "although found_inf was set: the flag must be set before opt.step() reads "
                "it", _MS_ORDER)
    return None


def _later_steps_clean(expected, actual) -> Reason | None:
    bad, af, ef = expected["bad"], actual["flags"], expected["flags"]
    badset = {k for k, _ in bad}
    after = [i for i in range(bad[0][0] + 1, len(ef)) if i not in badset]
    if not any(af[i] for i in after):
        return None
    if not any(actual["moved"][i] for i in after):
        return Reason(
            f"after the first bad step, found_inf stays 1.0 and the weights never move "
            f"again {_steps(expected)}; flags per replay: {af}. Something that must happen "
            "at the start of every step happens only once. Which lines of make_step run "
            "at every replay, and which ran only once, before the capture?", _MS_ONCE)
    return Reason(
        f"found_inf is 1.0 again on a step after a bad one, whose data is "
        f"finite {_steps(expected)}; flags per replay: {af}, expected {ef}. Something of "
        "the bad step leaks into later ones: backward accumulates into .grad, so "
        "are the gradients zeroed in place at every step?", _MS_GRADS)


def _flags_and_weights(expected, actual) -> Reason | None:
    ef, af, em, am = expected["flags"], actual["flags"], expected["moved"], actual["moved"]
    if af != ef or am != em:
        return Reason(f"flags per replay {af} (expected {ef}), weights moved {am} "
                      f"(expected {em})", _MS_ONCE)
    problem = compare_outputs(expected["weights"], actual["weights"], rtol=1e-4, atol=1e-5)
    if problem:
        return Reason(
            "flags and skips are right, but the weights end up different from the "
            f"reference: {problem}; are the gradients zeroed in place at every step "
            "(backward accumulates into .grad)?", _MS_GRADS)
    return None


def _the_loss(expected, actual) -> Reason | None:
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
            "forward_backward gives inside step(), the graph's static loss", _MS_RETURN)
    return None


#: in order, the first reason wins
JUDGES = (_opt_keeps_the_flag, _opt_steps, _flag_is_0_or_1, _flag_kept_to_the_end,
          _bad_steps_flagged, _bad_steps_skipped, _later_steps_clean, _flags_and_weights,
          _the_loss)


def check_make_step(fn, *, trials: int = 2) -> CheckResult:
    """``fn(model, opt, found_inf, static_batch)`` returns a whole-step function whose
    capture skips a step with a non-finite loss (``opt`` is torch's fused AdamW with
    ``opt.found_inf = found_inf``, a float32 0.0/1.0 flag, from
    ``make_capturable_optimizer(..., found_inf=found_inf)``) and trains normally on the
    steps after it. When a replay ends,
    ``found_inf`` must hold that step's verdict: the host reads it after the replay (the
    exercise text says so), so clearing it at the end of the step is rejected; a test of
    the loss that misses NaN or +inf, an ``opt.found_inf`` replaced by another tensor and
    a step of another optimizer than ``opt`` are named as such. ``step()``
    must return the loss (the graph's static loss), and each failure's first hint is about
    the mistake seen."""
    return EXERCISE.check(_observe(fn), _observe(_reference_make_step), _make_inputs,
                          trials=trials, judges=JUDGES)
