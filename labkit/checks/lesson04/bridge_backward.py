"""Lesson 04, exercise ``bridge_backward``: its checker.

``bridge_backward(runner, grads) -> tuple``: the backward half of the bridge: copy the
incoming grads into ``runner.static_grad_outputs`` (skipping ``None`` buffers), replay
``runner.bwd_graph``, set the status back to FWD_READY, restore
``grad_added_to_main_grad``, return the dgrads and the *cloned* wgrads (one per tensor
of ``runner.input_surface``).
"""

from __future__ import annotations

import contextlib
import random
import types

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from labkit import bridge
from labkit.backend import ensure as _backend
from labkit.checks import (
    DEFAULT_TIME_LIMIT,
    CheckResult,
    Exercise,
    attempt,
    describe_exception,
    extra_probe,
    fail,
    reject,
    run_check,
)
from labkit.checks.lesson04._common import _all_close, _close
from labkit.core.main_grad import attach_main_grad, zero_main_grad

__all__ = ["check_bridge_backward"]


class _BridgeProbe(nn.Module):
    """``kinds[i]`` says whether output ``i`` requires grad ("grad") or not ("nograd": it
    gets no grad buffer). Two inputs are mixed so that each gets a dgrad if it needs one."""

    def __init__(self, kinds):
        super().__init__()
        self.kinds = tuple(kinds)
        self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, *xs):
        h = xs[0] if len(xs) == 1 else xs[0] + 2 * xs[1]
        outs = []
        for i, kind in enumerate(self.kinds):
            if kind == "grad":
                outs.append(torch.tanh((self.a, self.b, self.c)[i](h)) * (i + 1))
            else:
                outs.append((self.a(h) > 0).to(h.dtype))
        return outs[0] if len(outs) == 1 else tuple(outs)


def _bridge_config(rng: random.Random, trial: int) -> dict:
    """Trial 0: two or three outputs, an output without grad (a None grad buffer) before
    one with grad, at random positions, so that grads[i] must go to buffer i. Trial 1: two
    outputs with grad, two inputs of which one needs no grad (a None dgrad). Later trials:
    1-3 outputs and 1-2 inputs, drawn at random."""
    if trial == 0:                           # a None buffer before a real one
        n = rng.choice((2, 3))
        kinds = [rng.choice(("grad", "nograd")) for _ in range(n)]
        last_grad = rng.randrange(1, n)
        kinds[last_grad] = "grad"
        kinds[rng.randrange(last_grad)] = "nograd"
        needs = [True]
    elif trial == 1:
        kinds, needs = ["grad", "grad"], [True, False]
        rng.shuffle(needs)
    else:
        n = rng.randint(1, 3)
        kinds = [rng.choice(("grad", "nograd")) for _ in range(n)]
        kinds[rng.randrange(n)] = "grad"
        needs = [rng.random() < 0.7 for _ in range(rng.randint(1, 2))]
    return {"kinds": kinds, "needs": needs}


def _describe_config(cfg) -> str:
    outs = ", ".join("with grad" if k == "grad" else "without grad (grad buffer None)"
                     for k in cfg["kinds"])
    ins = ", ".join("requires grad" if n else "no grad (dgrad None)" for n in cfg["needs"])
    return f"a module with outputs [{outs}] and inputs [{ins}]"


def _eager_grads(module, xs, grads, params, flags):
    """What autograd gives for this module: one entry per tensor of the input surface."""
    ex = tuple(x.detach().clone().requires_grad_(x.requires_grad) for x in xs)
    outs = module(*ex)
    outs = (outs,) if isinstance(outs, torch.Tensor) else tuple(outs)
    pairs = [(o, g) for o, g, rg in zip(outs, grads, flags) if rg]
    wants = [x for x in ex if x.requires_grad] + list(params)
    got = iter(torch.autograd.grad([o for o, _ in pairs], wants, [g for _, g in pairs],
                                   allow_unused=True))
    dgrads = [next(got) if x.requires_grad else None for x in ex]
    return dgrads + list(got)


_BB_HINTS = [
    "Step 1 in detail: for g, static in zip(grads, runner.static_grad_outputs): skip the "
    "pair when static is None, else static.copy_(g) unless g.data_ptr() == static.data_ptr().",
    "Steps 2-4: runner.bwd_graph.replay(); runner.status = GraphStatus.FWD_READY; then "
    "p.grad_added_to_main_grad = added for each item of "
    "runner.groundtruth_grad_added_to_main_grad.",
    "Step 5: n = runner.num_dgrads; return (*runner.static_grad_inputs[:n], *wgrads) with "
    "wgrads = each of runner.static_grad_inputs[n:] cloned (None stays None).",
]


def _bb_hints_for(msg: str) -> list[str]:
    """The three step hints, the one for the step the message is about first."""
    low = msg.lower()
    if "step 1" in low or "grads[i] belongs in" in low:
        first = 0
    elif any(w in low for w in ("step 5", "clone", "tuple", "gradients, expected",
                                "none stays none", "forget `return`")):
        first = 2
    elif any(w in low for w in ("step 3", "step 4", "fwd_ready")):
        first = 1
    else:
        first = 0
    return [_BB_HINTS[first]] + [h for i, h in enumerate(_BB_HINTS) if i != first]


def _shape_of(x) -> str:
    return f"shape {tuple(x.shape)}" if isinstance(x, torch.Tensor) else repr(x)


def _storage(t):
    return t.untyped_storage().data_ptr()


class _SelfCopies(TorchDispatchMode):
    """Counts ``copy_`` calls whose source already IS their destination (same address,
    same shape): a grad that is its static buffer, copied onto itself anyway."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ == "copy_" and len(args) > 1 and all(
                isinstance(a, torch.Tensor) for a in args[:2]):
            dst, src = args[0], args[1]
            if dst.data_ptr() == src.data_ptr() and dst.shape == src.shape:
                self.count += 1
        return func(*args, **(kwargs or {}))


def _train(B, backward_impl, seed: int, *, fused: bool = False, micro: int = 2,
           steps: int = 2, keep_wgrads: bool = False):
    """Train a block through a runner using ``backward_impl`` (None = eager).

    ``keep_wgrads``: a hook on every parameter keeps each microbatch's wgrad, and the
    update uses their sum at the end of the step (a deferred gradient reduction, as a
    bucketed all-reduce would), instead of ``.grad``."""
    from labkit.core.models import TransformerBlock

    torch.manual_seed(seed)
    block = TransformerBlock(hidden=16, heads=2, ffn=32, fused=fused).to(B.device)
    if fused:
        attach_main_grad(block)
    g = torch.Generator().manual_seed(seed)
    data = [(torch.randn(2, 4, 16, generator=g).to(B.device),
             torch.randn(2, 4, 16, generator=g).to(B.device)) for _ in range(micro * steps)]
    if backward_impl is None:
        call = block
    else:
        call = bridge.GraphRunner(block, B, num_warmup=1, backward_impl=backward_impl,
                                  name="block")
        call.create_fwd_graph((torch.zeros(2, 4, 16, device=B.device, requires_grad=True),))
        call.create_bwd_graph()
    kept = {p: [] for p in block.parameters()}
    if keep_wgrads:
        for p in block.parameters():
            p.register_hook(lambda grad, p=p: kept[p].append(grad) or grad)
    xgrads = []
    for s in range(steps):
        if fused:
            zero_main_grad(block)
        else:
            block.zero_grad(set_to_none=True)
        for p in kept:
            kept[p].clear()
        for m in range(micro):
            x, t = data[s * micro + m]
            x = x.clone().requires_grad_()
            (((call(x) - t) ** 2).mean() / micro).backward()
            xgrads.append(x.grad)
        with torch.no_grad():
            for p in block.parameters():
                if keep_wgrads:
                    grad = sum(kept[p])
                else:
                    grad = p.main_grad if fused else p.grad
                p -= 0.1 * grad
    return [p.detach().clone() for p in block.parameters()] + xgrads


def _max_diff(a, b) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b))


def _clone_story(B, fn) -> str:
    """Why an uncloned wgrad is wrong, measured here: a consumer that keeps the returned
    tensor past the next replay reads the next microbatch's wgrad; and when the returned
    tensor is a new object over the buffer's memory (``.detach()``, a view),
    ``AccumulateGrad`` steals it as ``.grad`` and plain ``.grad`` accumulation breaks
    too."""
    plain = extra_probe(lambda: _max_diff(_train(B, fn, 5), _train(B, None, 5)))
    kept = None if plain is None else extra_probe(
        lambda: _max_diff(_train(B, fn, 5, keep_wgrads=True),
                          _train(B, None, 5, keep_wgrads=True)))
    if kept is None:            # the story is optional
        return ""
    deferred = (f"with a hook that keeps each microbatch's wgrad for a deferred reduction "
                f"it differs by {kept:.2g}: the second microbatch's replay overwrote the "
                f"first one's wgrad before the reduction read it")
    if plain <= 1e-4:
        return (f"\n   Measured: training with gradients accumulated in .grad differs from "
                f"eager by {plain:.2g} (AccumulateGrad copies a gradient that the runner "
                f"still holds: that is why the end-to-end cell's .grad line can print "
                f"True), but {deferred}")
    return (f"\n   Measured: even training with gradients accumulated in .grad differs from "
            f"eager by {plain:.2g}: what you return is a new tensor object (a .detach() or "
            f"a view) over the static buffer's memory, which nothing else references, so "
            f"AccumulateGrad steals it as .grad instead of copying it; the next "
            f"microbatch's replay then overwrites .grad itself (lesson 04 §5 walks "
            f"through it). And {deferred}")


EXERCISE = Exercise("bridge_backward")


def _no(msg: str) -> None:
    """Reject with ``msg`` and the three step hints, the one it is about first."""
    reject(msg, hints=_bb_hints_for(msg))


def _why_raised(exc: BaseException) -> str:
    """The learner's error, with what to look at for the usual ones."""
    text = str(exc)
    why = "see the line above"
    if isinstance(exc, AttributeError) and "NoneType" in text:
        if "copy_" in text or "data_ptr" in text or "zero_" in text:
            why = ("runner.static_grad_outputs holds None for an output that does "
                   "not require grad (it has no grad buffer): step 1 says to skip "
                   "those")
        elif "clone" in text or "detach" in text:
            why = ("runner.static_grad_inputs holds None for an input that does not "
                   "require grad: None stays None (step 5)")
    elif "not supported" in text or "does not support item assignment" in text:
        why = ("runner.static_grad_outputs is a tuple of buffers the graph reads: "
               "copy_ into each buffer, do not replace it")
    return f"your code raised {describe_exception(exc)}\n   what to look at: {why}"


def _call(fn, r, grads, where: str, watch=None):
    """``fn(r, grads)`` through :func:`labkit.checks.attempt`, under ``watch``."""
    with watch if watch is not None else contextlib.nullcontext():
        return attempt(fn, (r, grads), time_limit=DEFAULT_TIME_LIMIT, label=where,
                       reason=_why_raised, hints=_bb_hints_for)


def _probe(B, trial: int, trials: int) -> types.SimpleNamespace:
    """Probe ``trial`` (0-based): a small graphed module, its outputs, the incoming grads
    and a previous microbatch's grads left in the buffers."""
    rng = random.Random(2000 + trial)
    cfg = _bridge_config(rng, trial)
    torch.manual_seed(100 + trial)
    module = _BridgeProbe(cfg["kinds"]).to(B.device)
    r = bridge.GraphRunner(module, B, num_warmup=1, name="probe")
    r.create_fwd_graph(tuple(torch.randn(3, 4, device=B.device).requires_grad_(n)
                             for n in cfg["needs"]))
    r.create_bwd_graph()
    xs = tuple(torch.randn(3, 4, device=B.device).requires_grad_(n) for n in cfg["needs"])
    outs = r(*xs)
    outs = (outs,) if isinstance(outs, torch.Tensor) else tuple(outs)
    flags = r.output_requires_grad
    grads = tuple(torch.randn_like(o) if rg else torch.zeros_like(o)   # as autograd does
                  for o, rg in zip(outs, flags))
    stale = tuple(torch.randn_like(o) if rg else torch.zeros_like(o)
                  for o, rg in zip(outs, flags))
    # the last trial hands over one grad that already IS its static buffer (the
    # gradient was written straight into it): step 1 says skip that copy
    in_buffer = None
    if trial == trials - 1:
        in_buffer = next(i for i, s in enumerate(r.static_grad_outputs) if s is not None)
        stale = stale[:in_buffer] + (grads[in_buffer],) + stale[in_buffer + 1:]
    for s, v in zip(r.static_grad_outputs, stale):     # a previous microbatch's grads
        if s is not None:
            s.copy_(v)
    if in_buffer is not None:
        grads = (grads[:in_buffer] + (r.static_grad_outputs[in_buffer],)
                 + grads[in_buffer + 1:])
    where = f"trial {trial + 1} of {trials}, {_describe_config(cfg)}"
    orig = tuple(r.static_grad_outputs)
    orig_mem = [None if s is None else _storage(s) for s in orig]
    return types.SimpleNamespace(cfg=cfg, module=module, r=r, xs=xs, outs=outs,
                                 flags=flags, grads=grads, stale=stale,
                                 in_buffer=in_buffer, where=where, orig=orig,
                                 orig_mem=orig_mem)


def _probe_returned(p: types.SimpleNamespace, result, self_copies) -> tuple:
    """What the learner returned: a tuple of one gradient per input, None kept None, the
    runner ready for its next forward, no copy of a buffer onto itself."""
    r, in_buffer, where = p.r, p.in_buffer, p.where
    n_in = len(r.input_surface)
    if result is None:
        _no(f"{where}: returned None (did you forget `return`?)")
    if isinstance(result, list):
        _no(f"{where}: returned a list of {len(result)} gradients; step 5 "
                      "returns a tuple. What you return is the result of the "
                      "autograd.Function's backward, one entry per input of its forward, "
                      "and autograd expects a tuple: wrap it in tuple(...) or build it "
                      "with (*dgrads, *wgrads)")
    try:
        result = tuple(result)
    except TypeError:
        _no(f"{where}: returned a {type(result).__name__}, expected a tuple of "
                      f"{n_in} gradients")
    if len(result) != n_in:
        _no(
            f"{where}: returned {len(result)} gradients, expected {n_in}: one per tensor "
            f"of runner.input_surface ({r.num_dgrads} input(s), then "
            f"{len(r.params_to_backprop)} connected parameters), the dgrads first")
    if self_copies.count:
        _no(f"{where}: grads[{in_buffer}] already is "
                      f"runner.static_grad_outputs[{in_buffer}] (same data_ptr(): the "
                      "gradient was written straight into the buffer, as a graphed layer "
                      "downstream can do), and your function still called copy_ on it. "
                      "Step 1 says skip a buffer whose data_ptr() equals the grad's: a "
                      "copy of a buffer onto itself is wasted work at every backward")
    nones = [i for i in range(min(len(result), n_in))
             if r.static_grad_inputs[i] is None and result[i] is not None]
    if nones:
        i = nones[0]
        what = (f"dgrad {i} (input {i}, which does not require grad)" if i < r.num_dgrads
                else f"wgrad {i - r.num_dgrads}")
        _no(f"{where}: {what} is a {type(result[i]).__name__} "
                      f"({_shape_of(result[i])}), but runner.static_grad_inputs[{i}] is "
                      "None: None stays None (step 5). None tells autograd that this "
                      "input gets no gradient; a tensor of zeros is a gradient it would "
                      "carry on with, in memory and work, for nothing")
    if r.status != bridge.GraphStatus.FWD_READY:
        _no(f"{where}: after your function the runner's status is still "
                      f"{r.status.name}, so its next forward would be refused "
                      "(GraphOrderError): it must be FWD_READY once the backward graph "
                      "has replayed. Look at step 3")
    return result


def _probe_values(p: types.SimpleNamespace, result: tuple) -> None:
    """The gradients are eager autograd's; when not, which step went wrong."""
    (module, r, xs, outs, flags, grads, stale, where, orig, orig_mem) = \
        (p.module, p.r, p.xs, p.outs, p.flags, p.grads, p.stale, p.where, p.orig, p.orig_mem)
    want = _eager_grads(module, xs, grads, r.params_to_backprop, flags)
    nd = r.num_dgrads
    moved = [i for i, (s, m) in enumerate(zip(orig, orig_mem))
             if s is not None and _storage(s) != m]
    swapped = [i for i, (s, t) in enumerate(zip(orig, r.static_grad_outputs))
               if s is not None and t is not s]
    if _all_close(result, want):
        pass
    elif moved:
        _no(f"{where}: after your function the grad buffers at positions "
                      f"{moved} of runner.static_grad_outputs point to other memory: "
                      "you rebound the buffer (`buf.data = "
                      "g`, `buf.set_(g)`) instead of copying into it. The backward graph "
                      "was recorded with the buffers' old addresses and still reads "
                      "them, so it replayed on the previous grads. Write into the "
                      "buffer's own memory: buf.copy_(g) (step 1)")
    elif swapped or len(r.static_grad_outputs) != len(orig):
        _no(f"{where}: runner.static_grad_outputs holds other tensors after "
                      "your function: you replaced the buffers (or the tuple) instead "
                      "of copying into them. The backward graph reads the buffers it "
                      "was recorded with: buf.copy_(g) into each of them (step 1)")
    elif _all_close(result, _eager_grads(module, xs, stale, r.params_to_backprop, flags)):
        now = [s for s in r.static_grad_outputs if s is not None]
        copied = all(_close(s, g) for s, g in zip(
            r.static_grad_outputs, grads) if s is not None)
        if copied and now:
            _no(f"{where}: the gradients are those of the previous grads in "
                          "runner.static_grad_outputs: you copied the new grads in "
                          "after replaying. The graph reads the buffers when it "
                          "replays: copy first (step 1), then replay (step 2)")
        _no(f"{where}: the gradients are those of the grads that were already "
                      "in runner.static_grad_outputs: the new grads never reached the "
                      "buffers the backward graph reads. copy_ the incoming grads into "
                      "those buffers before the replay (assigning to a name or to the "
                      "tuple changes nothing the graph sees). Look at step 1")
    else:
        held = tuple(s.detach().clone() if s is not None else torch.zeros_like(o)
                     for s, o in zip(r.static_grad_outputs, outs))
        routed = all(_close(h, g) for h, g, rg in zip(held, grads, flags) if rg)
        if not routed and _all_close(
                result, _eager_grads(module, xs, held, r.params_to_backprop, flags)):
            _no(f"{where}: the backward graph ran on values that are not the "
                          "incoming grads: grads[i] belongs in "
                          "runner.static_grad_outputs[i] (zip them in the same order; "
                          "skip only the None buffers)")
        bad_i = next(i for i, (a, b) in enumerate(zip(result, want))
                     if b is not None and not _close(a, b))
        what = (f"dgrad {bad_i} (input {bad_i})" if bad_i < nd else
                f"wgrad {bad_i - nd} (parameter {bad_i - nd} of runner.params_to_backprop)")
        if result[bad_i] is None:
            _no(f"{where}: {what} is None, eager autograd gives a gradient: "
                          "return runner.static_grad_inputs in full, dgrads then wgrads")
        _no(f"{where}: {what} differs from eager autograd's. Return the "
                      "entries of runner.static_grad_inputs in their order (dgrads "
                      "first, then wgrads), after the replay")


def _probe_clones(fn, B, p: types.SimpleNamespace, result: tuple) -> None:
    """The wgrads returned are clones, not the backward graph's static buffers."""
    r, where, nd, n_in = p.r, p.where, p.r.num_dgrads, len(p.r.input_surface)
    for i in range(nd, n_in):
        w, s = result[i], r.static_grad_inputs[i]
        if isinstance(w, torch.Tensor) and s is not None and _storage(w) == _storage(s):
            _no(
                f"{where}: the wgrads you return are the backward graph's static buffers "
                "(they share memory with runner.static_grad_inputs), and the next replay "
                "of this graph overwrites them. Step 5: clone each wgrad before "
                "returning it (dgrads may stay as they are)" + _clone_story(B, fn))


def _fused_block(fn, B) -> None:
    """A fused block: main_grad and grad_added_to_main_grad as the capture left them."""
    from labkit.core.models import TransformerBlock

    torch.manual_seed(0)
    block = TransformerBlock(hidden=16, heads=2, ffn=32, fused=True).to(B.device)
    attach_main_grad(block)
    r = bridge.GraphRunner(block, B, num_warmup=1, name="probe")
    r.create_fwd_graph((torch.randn(2, 4, 16, device=B.device, requires_grad=True),))
    r.create_bwd_graph()
    zero_main_grad(block)
    y = r(torch.randn(2, 4, 16, device=B.device, requires_grad=True))
    where = "a block with fused linears (main_grad)"
    _call(fn, r, (torch.randn_like(y),), where)
    truth = r.groundtruth_grad_added_to_main_grad
    now_false = [p for p, v in truth.items() if v and not p.grad_added_to_main_grad]
    now_true = [p for p, v in truth.items() if not v and p.grad_added_to_main_grad]
    if now_false:
        _no(f"{where}: grad_added_to_main_grad is False on {len(now_false)} "
                      "parameters after your function; the captured backward left it True "
                      "(the fused weights, whose wgrad it already added into main_grad). The "
                      "DDP hook will add their wgrads into main_grad a second time. Look at "
                      "step 4")
    if now_true:
        _no(f"{where}: grad_added_to_main_grad is True on {len(now_true)} "
                      f"parameters after your function, but the captured backward left it "
                      f"False on them (of {len(truth)}, only the {len(truth) - len(now_true)} "
                      "fused weights have it True): their wgrads are returned, not added, "
                      "and the DDP hook skips a parameter whose flag is True, so those "
                      "gradients are lost. Set each flag to its value in "
                      "runner.groundtruth_grad_added_to_main_grad, not to a constant "
                      "(step 4)")


def _end_to_end(fn, B) -> None:
    """Training through ``fn``, with and without main_grad, matches eager training."""
    for fused, what in ((False, "gradient accumulation in .grad"),
                        (True, "main_grad and fused linears")):
        got = attempt(_train, (B, fn, 3), {"fused": fused}, not_done=False,
                      hints=_bb_hints_for, reason=lambda exc, what=what: "training through "
                      f"your function ({what}) raised {describe_exception(exc)}")
        diff = _max_diff(got, _train(B, None, 3, fused=fused))
        if diff > 1e-4:
            _no(f"training a block through your function ({what}, 2 steps of 2 "
                f"microbatches) ends {diff:.3g} away from eager training, although "
                "one call matched: look for state your function keeps or changes "
                "between calls")


def check_bridge_backward(fn, *, B=None, quiet: bool = False, trials: int = 3) -> CheckResult:
    """``fn(runner, grads)`` must do what :func:`labkit.bridge.replay_backward` does.

    First ``trials`` probes on small graphed modules (random output arity, outputs without
    grad buffers, inputs without dgrads: their None must stay None; in the last probe one
    grad already is its static buffer, and a ``copy_`` onto itself is refused; a list
    instead of the tuple is refused), compared with eager autograd; then a fused block
    (``main_grad`` flags); then training through it, with and without ``main_grad``, and
    with a deferred reduction that keeps the returned wgrads.

    Args:
        fn: the learner's ``bridge_backward``.
        B: the backend (default ``backend.get("auto")``).
        quiet: return the :class:`CheckResult` without printing it.
        trials: how many small modules to probe before the fused block and training.

    .. warning::
        An uncloned wgrad trains correctly when gradients only accumulate in ``.grad``
        (``AccumulateGrad`` copies a gradient the runner still references); the checker
        still rejects it, and measures the case where it is wrong (a hook that keeps the
        wgrad past the next replay), so that its message and the notebook agree.
    """
    B = _backend(B)
    if not callable(fn):
        return fail(EXERCISE.name, f"expected a function, got {type(fn).__name__}",
                    quiet=quiet)

    def body() -> str:
        for trial in range(trials):       # 1. probes on small modules, against eager
            p = _probe(B, trial, trials)
            self_copies = _SelfCopies()
            result = _call(fn, p.r, p.grads, p.where, watch=self_copies)
            result = _probe_returned(p, result, self_copies)
            _probe_values(p, result)
            _probe_clones(fn, B, p, result)
        _fused_block(fn, B)               # 2. main_grad and grad_added_to_main_grad
        _end_to_end(fn, B)                # 3. gradient accumulation, with/without main_grad
        return (f"{trials} probes (outputs without grad buffers, inputs without dgrads, "
                "1-3 outputs) and a fused block match eager autograd; training through it "
                "matches eager")

    return run_check(EXERCISE.name, body, quiet=quiet, trials=trials + 3)
