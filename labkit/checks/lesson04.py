"""Checkers for lesson 04 (the fwd/bwd bridge), against :mod:`labkit.bridge`.

* ``connected_params(outputs, module) -> tuple``: the parameters ``outputs`` depend on,
  found by walking the autograd graph to its ``AccumulateGrad`` leaves, in
  ``module.parameters()`` order.
* ``bridge_backward(runner, grads) -> tuple``: the backward half of the bridge: copy the
  incoming grads into ``runner.static_grad_outputs`` (skipping ``None`` buffers), replay
  ``runner.bwd_graph``, set the status back to FWD_READY, restore
  ``grad_added_to_main_grad``, return the dgrads and the *cloned* wgrads (one per tensor
  of ``runner.input_surface``).

Every trial randomizes what the exercise leaves free (how many outputs, which of them
require grad, how many inputs and which of them require grad, which parameters are
frozen, unused or used only under ``no_grad``) and plants the traps the exercise text
warns about (an input that requires grad, a second output with its own parameters, an
output without a grad buffer). A failure names the mistake it saw and where to look;
``labkit.checks.hint()`` then gives further hints, one at a time.
"""

from __future__ import annotations

import random

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from labkit import bridge
from labkit.backend import ensure as _backend
from labkit.checks import NOT_DONE, CheckResult, LearnerTimeout, call_learner, describe_exception
from labkit.checks import verdict as _result
from labkit.core.main_grad import attach_main_grad, zero_main_grad

__all__ = ["check_connected_params", "check_bridge_backward"]

# ---- connected_params -------------------------------------------------------------------------

_LAYERS = ("a", "b", "c", "d", "e", "f")


class _Probe(nn.Module):
    """A module whose outputs leave out some parameters, in ways that trip shortcuts.

    ``plan`` (made by :func:`_plan`) says which layer is frozen, unused or used only under
    ``no_grad``, how many inputs there are, and what each output computes."""

    def __init__(self, plan: dict, gen: torch.Generator):
        super().__init__()
        for name in _LAYERS:
            setattr(self, name, nn.Linear(4, 4))
        self.scale = nn.Parameter(torch.ones(4))
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=gen))
        self.plan = plan
        getattr(self, plan["frozen"]).weight.requires_grad_(False)

    def forward(self, *xs):
        h = xs[0] if len(xs) == 1 else xs[0] * xs[1]
        with torch.no_grad():
            gate = getattr(self, self.plan["nograd"])(h).sigmoid()
        outs = []
        for kind, layers in self.plan["outputs"]:
            if kind == "int":
                outs.append(getattr(self, layers[0])(h).argmax(-1))
                continue
            y = h
            for name in layers:
                y = torch.tanh(getattr(self, name)(y))
            if kind == "scaled":
                y = y * self.scale * gate
            outs.append(y)
        return outs[0] if self.plan["single"] else tuple(outs)


def _plan(rng: random.Random, trial: int) -> dict:
    """Random free choices; trial 0 feeds an input that requires grad to a single-output
    module, trial 1 a tuple whose second output needs parameters the first one does not."""
    names = list(_LAYERS)
    rng.shuffle(names)
    unused, nograd, frozen = names[0], names[1], names[2]
    usable = names[2:]                       # the frozen layer's bias still trains
    n_in = rng.choice((1, 2))
    needs = [rng.random() < 0.5 for _ in range(n_in)]
    if trial == 0:
        needs[0] = True
    if trial == 0:
        n_out, single = 1, True
    elif trial == 1:
        n_out, single = rng.choice((2, 3)), False
    else:
        n_out = rng.choice((1, 2, 3))
        single = n_out == 1 and rng.random() < 0.5
    outputs = []
    for i in range(n_out):
        if i > 0 and rng.random() < 0.3 and trial != 1:
            outputs.append(("int", [rng.choice(usable)]))
            continue
        k = rng.randint(1, 2)
        layers = rng.sample(usable, k)
        outputs.append((rng.choice(("plain", "scaled")), layers))
    if trial == 1:                           # outputs[1] uses a layer outputs[0] does not
        first = set(outputs[0][1])
        rest = [n for n in usable if n not in first]
        outputs[1] = ("plain", [rng.choice(rest)])
    if outputs[0][0] == "int":
        outputs[0] = ("plain", [usable[-1]])
    return {"unused": unused, "nograd": nograd, "frozen": frozen, "n_in": n_in,
            "needs_grad": needs, "outputs": outputs, "single": single}


def _names(module, params, inputs=()):
    by_id = {id(p): n for n, p in module.named_parameters()}
    out = []
    for p in params:
        if not isinstance(p, torch.Tensor):
            out.append(f"<a {type(p).__name__}>")
        elif id(p) in by_id:
            out.append(by_id[id(p)])
        elif any(p is x for x in inputs):
            out.append(f"<input {next(i for i, x in enumerate(inputs) if p is x)}>")
        else:
            out.append("<a tensor that is not a parameter of module>")
    return out


_CP_HINTS = [
    "Start a stack with the grad_fn of every output that requires grad (outputs may be one "
    "tensor or a tuple; an integer output has grad_fn None).",
    "Pop a node; if it has a `.variable` attribute it is an AccumulateGrad leaf: remember "
    "id(node.variable). Push every non-None node of node.next_functions. Keep a visited set.",
    "Finally keep only module's parameters, in their order: "
    "tuple(p for p in module.parameters() if id(p) in found).",
]


def _cp_diagnose(got, plan, module, inputs, outputs) -> str | None:
    """None when ``got`` is right, else what is wrong (first mistake found)."""
    if got is None:
        return "returned None (did you forget `return`?)"
    if not isinstance(got, tuple):
        kind = type(got).__name__
        return (f"returned a {kind}, expected a tuple: the runner appends the parameters to "
                "its tuple of input tensors (`inputs + params`), which needs a tuple. "
                "Wrap your result in tuple(...)")
    if not all(isinstance(p, torch.Tensor) for p in got):
        bad = next(p for p in got if not isinstance(p, torch.Tensor))
        return (f"the tuple holds a {type(bad).__name__} ({bad!r:.40}): return the parameter "
                "tensors themselves (node.variable), not names or nodes")
    expected = _names(module, bridge.get_connected_params(outputs, module))
    actual = _names(module, got, inputs)
    if actual == expected:
        return None
    where = f"(module with {plan['n_in']} input(s) and " + (
        "a single tensor output)" if plan["single"] else f"a tuple of {len(plan['outputs'])} "
        "outputs)")
    if any(a.startswith("<input") for a in actual):
        req = [i for i, x in enumerate(inputs) if x.requires_grad]
        return (f"you returned {[a for a in actual if a.startswith('<input')]}: an input "
                f"tensor {where}. Inputs that require grad ({req} here) are autograd leaves "
                "too, so they also end in an AccumulateGrad node, but they are not "
                "parameters: they get a dgrad, not a wgrad. Keep only the tensors that are "
                "parameters of `module`")
    if any(a.startswith("<a") for a in actual):
        return (f"you returned {actual}: some of these are not parameters of `module` "
                "(intermediate activations?). Collect only what AccumulateGrad nodes hold "
                "(`node.variable`) and keep the ones that are module parameters")
    if len(actual) != len(set(actual)):
        dup = sorted({a for a in actual if actual.count(a) > 1})
        return (f"{dup} appear more than once in {actual}: a parameter reached along two "
                "paths is still one graph input. Keep a visited set of nodes (or of "
                "parameter ids)")
    extra = [n for n in actual if n not in expected]
    missing = [n for n in expected if n not in actual]
    frozen_w = f"{plan['frozen']}.weight"
    if extra:
        why = []
        if frozen_w in extra:
            why.append(f"{frozen_w} is frozen (requires_grad=False)")
        if any(n.startswith(plan["unused"] + ".") for n in extra):
            why.append(f"layer {plan['unused']} is never used")
        if any(n.startswith(plan["nograd"] + ".") for n in extra):
            why.append(f"layer {plan['nograd']} is used only under torch.no_grad()")
        unreached = [n for n in extra if n != frozen_w
                     and not n.startswith((plan["unused"] + ".", plan["nograd"] + "."))]
        if unreached:
            why.append(f"{unreached} are not used by any output that requires grad")
        return (f"{extra} should not be there {where}: " + "; ".join(why) + ". None of these "
                "has an AccumulateGrad node reachable from the outputs' grad_fn. Walk the "
                "autograd graph instead of listing module.parameters()")
    if missing:
        dims = {n: p.dim() for n, p in module.named_parameters()}
        if all(dims[n] < 2 for n in missing) and all(dims[n] >= 2 for n in actual) and \
                any(dims[n] >= 2 for n in expected):
            return (f"{missing} are missing {where}: you kept only parameters of 2 or more "
                    "dims (the weight matrices). Biases and scale vectors are parameters "
                    "too: the outputs depend on them, so the backward graph must compute "
                    "their wgrads as well. Keep every parameter with an AccumulateGrad node "
                    "on the way, whatever its shape")
        if not plan["single"]:
            first_only = _names(module, bridge.get_connected_params(outputs[0], module))
            if actual == first_only and first_only != expected:
                grad_outs = [i for i, o in enumerate(outputs) if o.requires_grad]
                return (f"{missing} are missing: you walked only outputs[0]. Here the module "
                        f"returns {len(outputs)} outputs and outputs {grad_outs} require "
                        "grad; the backward graph computes wgrads for all of them. Start "
                        "from the grad_fn of every output that requires grad")
        return (f"{missing} are missing {where}: the walk stopped early. Follow every entry "
                "of node.next_functions (skip the None ones), from every output that "
                "requires grad, down to the nodes that have a `.variable`")
    return (f"the right parameters in the wrong order: expected the order of "
            f"module.parameters(), got {actual}. The backward graph returns the wgrads by "
            "position, matched to the autograd.Function's inputs")


def check_connected_params(fn, *, trials: int = 5, quiet: bool = False) -> CheckResult:
    """``fn(outputs, module)`` must return the parameters of ``module`` that ``outputs``
    depend on, as a tuple in ``module.parameters()`` order.

    Trials randomize the number of inputs (and which require grad) and of outputs (and
    whether one is an integer output without grad); trial 1 feeds an input that requires
    grad, trial 2 a tuple whose second output needs parameters the first does not.

    Args:
        fn: the learner's ``connected_params``.
        trials: how many modules to try (at least 2 keeps both planted traps).
        quiet: return the :class:`CheckResult` without printing it.

    .. warning::
        Trials are seeded: the same wrong answer fails the same trial every time, so a
        learner can reproduce what the message describes.
    """
    name = "connected_params"
    if not callable(fn):
        return _result(name, False, f"expected a function, got {type(fn).__name__}",
                       quiet=quiet)
    for trial in range(trials):
        rng = random.Random(1000 + trial)
        gen = torch.Generator().manual_seed(trial)
        plan = _plan(rng, trial)
        module = _Probe(plan, gen)
        inputs = tuple(torch.randn(3, 4, generator=gen).requires_grad_(rg)
                       for rg in plan["needs_grad"])
        outputs = module(*inputs)
        try:
            got = call_learner(fn, outputs, module)
        except NotImplementedError:
            return _result(name, False, NOT_DONE,
                           kind="not_implemented", quiet=quiet)
        except LearnerTimeout as exc:
            return _result(name, False, f"trial {trial + 1} of {trials}: {exc}",
                           kind="timeout", more_hints=_CP_HINTS, quiet=quiet)
        except Exception as exc:  # noqa: BLE001 - reported to the learner
            text = str(exc)
            if isinstance(exc, AttributeError) and "NoneType" in text:
                why = ("a None reached your code as a node: an output without grad (an "
                       "integer output, or one computed under no_grad) has grad_fn None, "
                       "and node.next_functions holds (None, 0) for inputs that need no "
                       "gradient. Skip both")
            elif isinstance(exc, TypeError) and "not iterable" in text:
                why = ("`outputs` may be a single tensor or a tuple of tensors: handle both")
            elif "Boolean value of Tensor" in text and "ambiguous" in text:
                why = ("`p in some_list` (or a tensor in a set/dict key test, or `==`) "
                       "compares tensors elementwise with ==, which has no single truth "
                       "value. Compare parameters by identity: collect id(node.variable) "
                       "in a set and test id(p), or use `any(p is v for v in found)`")
            else:
                why = "see the line above"
            return _result(name, False, f"trial {trial + 1} of {trials}: your code raised "
                           f"{describe_exception(exc)}\n   what to look at: {why}",
                           kind="exception", more_hints=_CP_HINTS, quiet=quiet)
        reason = _cp_diagnose(got, plan, module, inputs, outputs)
        if reason:
            return _result(name, False, f"trial {trial + 1} of {trials}: {reason}",
                           more_hints=_CP_HINTS, quiet=quiet)
    return _result(name, True, f"passed {trials} random trials (inputs that require grad, "
                   "tuple outputs, frozen/unused/no_grad parameters)", trials=trials,
                   quiet=quiet)


# ---- bridge_backward ----------------------------------------------------------------------------

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


def _close(a, b) -> bool:
    if a is None or b is None:
        return a is None and b is None
    if not isinstance(a, torch.Tensor) or a.shape != b.shape:
        return False
    return bool(torch.allclose(a.detach().cpu().float(), b.detach().cpu().float(),
                               rtol=1e-4, atol=1e-5))


def _all_close(xs, ys) -> bool:
    return all(_close(x, y) for x, y in zip(xs, ys) if y is not None)


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
    try:
        plain = _max_diff(_train(B, fn, 5), _train(B, None, 5))
        kept = _max_diff(_train(B, fn, 5, keep_wgrads=True),
                         _train(B, None, 5, keep_wgrads=True))
    except Exception:  # noqa: BLE001 - the story is optional
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
    name = "bridge_backward"
    B = _backend(B)
    if not callable(fn):
        return _result(name, False, f"expected a function, got {type(fn).__name__}",
                       quiet=quiet)

    def failed(msg, kind="mismatch"):
        return _result(name, False, msg, kind=kind, more_hints=_bb_hints_for(msg),
                       quiet=quiet)

    def call(r, grads, where, watch=None):
        """(result, None) or (None, CheckResult)."""
        try:
            if watch is None:
                return call_learner(fn, r, grads), None
            with watch:
                return call_learner(fn, r, grads), None
        except NotImplementedError:
            return None, _result(name, False, "not done yet: fill in the cell marked YOUR "
                                 "CODE HERE", kind="not_implemented", quiet=quiet)
        except LearnerTimeout as exc:
            return None, failed(f"{where}: {exc}", kind="timeout")
        except Exception as exc:  # noqa: BLE001 - reported to the learner
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
            return None, failed(f"{where}: your code raised {describe_exception(exc)}\n"
                                f"   what to look at: {why}", kind="exception")

    # 1. probes on small modules, compared with eager autograd
    for trial in range(trials):
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
        self_copies = _SelfCopies()
        result, bad = call(r, grads, where, watch=self_copies)
        if bad is not None:
            return bad
        n_in = len(r.input_surface)
        if result is None:
            return failed(f"{where}: returned None (did you forget `return`?)")
        if isinstance(result, list):
            return failed(f"{where}: returned a list of {len(result)} gradients; step 5 "
                          "returns a tuple. What you return is the result of the "
                          "autograd.Function's backward, one entry per input of its forward, "
                          "and autograd expects a tuple: wrap it in tuple(...) or build it "
                          "with (*dgrads, *wgrads)")
        try:
            result = tuple(result)
        except TypeError:
            return failed(f"{where}: returned a {type(result).__name__}, expected a tuple of "
                          f"{n_in} gradients")
        if len(result) != n_in:
            return failed(
                f"{where}: returned {len(result)} gradients, expected {n_in}: one per tensor "
                f"of runner.input_surface ({r.num_dgrads} input(s), then "
                f"{len(r.params_to_backprop)} connected parameters), the dgrads first")
        if self_copies.count:
            return failed(f"{where}: grads[{in_buffer}] already is "
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
            return failed(f"{where}: {what} is a {type(result[i]).__name__} "
                          f"({_shape_of(result[i])}), but runner.static_grad_inputs[{i}] is "
                          "None: None stays None (step 5). None tells autograd that this "
                          "input gets no gradient; a tensor of zeros is a gradient it would "
                          "carry on with, in memory and work, for nothing")
        if r.status != bridge.GraphStatus.FWD_READY:
            return failed(f"{where}: after your function the runner's status is still "
                          f"{r.status.name}, so its next forward would be refused "
                          "(GraphOrderError): it must be FWD_READY once the backward graph "
                          "has replayed. Look at step 3")
        want = _eager_grads(module, xs, grads, r.params_to_backprop, flags)
        nd = r.num_dgrads
        moved = [i for i, (s, m) in enumerate(zip(orig, orig_mem))
                 if s is not None and _storage(s) != m]
        swapped = [i for i, (s, t) in enumerate(zip(orig, r.static_grad_outputs))
                   if s is not None and t is not s]
        if _all_close(result, want):
            pass
        elif moved:
            return failed(f"{where}: after your function the grad buffers at positions "
                          f"{moved} of runner.static_grad_outputs point to other memory: "
                          "you rebound the buffer (`buf.data = "
                          "g`, `buf.set_(g)`) instead of copying into it. The backward graph "
                          "was recorded with the buffers' old addresses and still reads "
                          "them, so it replayed on the previous grads. Write into the "
                          "buffer's own memory: buf.copy_(g) (step 1)")
        elif swapped or len(r.static_grad_outputs) != len(orig):
            return failed(f"{where}: runner.static_grad_outputs holds other tensors after "
                          "your function: you replaced the buffers (or the tuple) instead "
                          "of copying into them. The backward graph reads the buffers it "
                          "was recorded with: buf.copy_(g) into each of them (step 1)")
        elif _all_close(result, _eager_grads(module, xs, stale, r.params_to_backprop, flags)):
            now = [s for s in r.static_grad_outputs if s is not None]
            copied = all(_close(s, g) for s, g in zip(
                r.static_grad_outputs, grads) if s is not None)
            if copied and now:
                return failed(f"{where}: the gradients are those of the previous grads in "
                              "runner.static_grad_outputs: you copied the new grads in "
                              "after replaying. The graph reads the buffers when it "
                              "replays: copy first (step 1), then replay (step 2)")
            return failed(f"{where}: the gradients are those of the grads that were already "
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
                return failed(f"{where}: the backward graph ran on values that are not the "
                              "incoming grads: grads[i] belongs in "
                              "runner.static_grad_outputs[i] (zip them in the same order; "
                              "skip only the None buffers)")
            bad_i = next(i for i, (a, b) in enumerate(zip(result, want))
                         if b is not None and not _close(a, b))
            what = (f"dgrad {bad_i} (input {bad_i})" if bad_i < nd else
                    f"wgrad {bad_i - nd} (parameter {bad_i - nd} of runner.params_to_backprop)")
            if result[bad_i] is None:
                return failed(f"{where}: {what} is None, eager autograd gives a gradient: "
                              "return runner.static_grad_inputs in full, dgrads then wgrads")
            return failed(f"{where}: {what} differs from eager autograd's. Return the "
                          "entries of runner.static_grad_inputs in their order (dgrads "
                          "first, then wgrads), after the replay")
        for i in range(nd, n_in):
            w, s = result[i], r.static_grad_inputs[i]
            if isinstance(w, torch.Tensor) and s is not None and _storage(w) == _storage(s):
                return failed(
                    f"{where}: the wgrads you return are the backward graph's static buffers "
                    "(they share memory with runner.static_grad_inputs), and the next replay "
                    "of this graph overwrites them. Step 5: clone each wgrad before "
                    "returning it (dgrads may stay as they are)" + _clone_story(B, fn))

    # 2. a fused block: main_grad and grad_added_to_main_grad
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
    result, bad = call(r, (torch.randn_like(y),), where)
    if bad is not None:
        return bad
    truth = r.groundtruth_grad_added_to_main_grad
    now_false = [p for p, v in truth.items() if v and not p.grad_added_to_main_grad]
    now_true = [p for p, v in truth.items() if not v and p.grad_added_to_main_grad]
    if now_false:
        return failed(f"{where}: grad_added_to_main_grad is False on {len(now_false)} "
                      "parameters after your function; the captured backward left it True "
                      "(the fused weights, whose wgrad it already added into main_grad). The "
                      "DDP hook will add their wgrads into main_grad a second time. Look at "
                      "step 4")
    if now_true:
        return failed(f"{where}: grad_added_to_main_grad is True on {len(now_true)} "
                      f"parameters after your function, but the captured backward left it "
                      f"False on them (of {len(truth)}, only the {len(truth) - len(now_true)} "
                      "fused weights have it True): their wgrads are returned, not added, "
                      "and the DDP hook skips a parameter whose flag is True, so those "
                      "gradients are lost. Set each flag to its value in "
                      "runner.groundtruth_grad_added_to_main_grad, not to a constant "
                      "(step 4)")

    # 3. end to end: gradient accumulation, with and without main_grad
    for fused, what in ((False, "gradient accumulation in .grad"),
                        (True, "main_grad and fused linears")):
        try:
            got = _train(B, fn, 3, fused=fused)
        except Exception as exc:  # noqa: BLE001 - reported to the learner
            return failed(f"training through your function ({what}) raised "
                          f"{describe_exception(exc)}", kind="exception")
        diff = _max_diff(got, _train(B, None, 3, fused=fused))
        if diff > 1e-4:
            return failed(f"training a block through your function ({what}, 2 steps of 2 "
                          f"microbatches) ends {diff:.3g} away from eager training, although "
                          "one call matched: look for state your function keeps or changes "
                          "between calls")
    return _result(name, True, f"{trials} probes (outputs without grad buffers, inputs "
                   "without dgrads, 1-3 outputs) and a fused block match eager autograd; "
                   "training through it matches eager", trials=trials + 3, quiet=quiet)


# ---- graph_stage (diagnosis) ------------------------------------------------------------------

__all__.append("check_graph_stage")

_GS_HINTS = [
    "Look at how the broken version makes the samples of blocks 1, 2, ...: under "
    "torch.no_grad() nothing it computes requires grad, so those graphs are captured "
    "without a dgrad for their input. Which of those inputs require grad when the stage "
    "really runs?",
    "Each block after the first is fed the previous block's output, which requires grad "
    "(the block has trainable parameters). Block 0 is fed the stage input: its sample must "
    "require grad exactly when `sample` does.",
    "Keep the no_grad walk for the shapes, and give block i > 0 the sample "
    "h.detach().clone().requires_grad_(); leave the caller's `sample` itself unchanged.",
]


class _StageBlock(nn.Module):
    def __init__(self, d_in: int, d_out: int, gen: torch.Generator):
        super().__init__()
        self.lin = nn.Linear(d_in, d_out)
        with torch.no_grad():
            for p in self.lin.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) / d_in ** 0.5)

    def forward(self, x):
        return torch.tanh(self.lin(x))


def _stage_config(rng: random.Random, trial: int) -> dict:
    """Trial 0: a first stage (its input needs no grad), three or four blocks; trial 1: a
    later stage (its input requires grad); then random. Widths change from block to block,
    so one shape for every sample is wrong."""
    n = rng.choice((3, 4)) if trial < 2 else rng.randint(2, 4)
    needs = {0: False, 1: True}.get(trial, rng.random() < 0.5)
    widths = [rng.choice((3, 4, 5, 6)) for _ in range(n + 1)]
    return {"n": n, "needs": needs, "widths": widths, "batch": rng.choice((2, 3))}


def _stage_grads(call, blocks, x, target):
    for b in blocks:
        b.zero_grad(set_to_none=True)
    h = x
    for c in call:
        h = c(h)
    ((h - target) ** 2).sum().backward()
    return [p.grad for b in blocks for p in b.parameters()], x.grad


def check_graph_stage(fn, *, B=None, trials: int = 4, quiet: bool = False) -> CheckResult:
    """``fn(blocks, sample)`` must graph a pipeline stage: ``blocks`` (a list of modules run
    one after the other) with ``bridge.make_graphed_callables``, from ``sample`` (a tensor
    shaped like the stage input; it requires grad when the stage is not the first one).
    It returns the tuple of graphed blocks, and training through it must match eager.

    Trials randomize the number of blocks, their widths, the batch and whether the stage
    input requires grad (trial 1: it does not, as in a first stage; trial 2: it does).

    Args:
        fn: the learner's fixed ``graph_stage``.
        B: the backend (default: ``backend.get("auto")``); recovered after a capture that
            raised.
        trials: how many stages to try.
        quiet: return the :class:`CheckResult` without printing it.

    .. warning::
        A capture that raises leaves the capture stream current; the checker calls
        ``labkit.backend.recover(B)`` so the next cell starts clean.
    """
    from labkit import backend as _backend_mod

    name = "graph_stage"
    B = _backend(B)
    if not callable(fn):
        return _result(name, False, f"expected a function, got {type(fn).__name__}",
                       quiet=quiet)
    for trial in range(trials):
        rng = random.Random(4400 + trial)
        gen = torch.Generator().manual_seed(4400 + trial)
        cfg = _stage_config(rng, trial)
        w = cfg["widths"]
        blocks = [_StageBlock(w[i], w[i + 1], gen).to(B.device) for i in range(cfg["n"])]
        sample = torch.randn(cfg["batch"], w[0], generator=gen).to(B.device)
        sample.requires_grad_(cfg["needs"])
        kept = sample.detach().clone()
        where = (f"trial {trial + 1} of {trials} ({cfg['n']} blocks, widths {w}, stage input "
                 + ("requires grad" if cfg["needs"] else "needs no grad (a first stage)")
                 + ")")
        try:
            got = call_learner(fn, blocks, sample)
        except NotImplementedError:
            return _result(name, False, NOT_DONE,
                           kind="not_implemented", quiet=quiet)
        except LearnerTimeout as exc:
            _backend_mod.recover(B)
            return _result(name, False, f"{where}: {exc}", kind="timeout",
                           more_hints=_GS_HINTS, quiet=quiet)
        except Exception as exc:  # noqa: BLE001 - reported to the learner
            _backend_mod.recover(B)
            look = ("the samples you pass: one tuple (x,) per block, each shaped like that "
                    "block's input (block i's input is block i-1's output)")
            if "during capture" in str(exc) or "legacy stream" in str(exc):
                look = ("a capture that failed on the GPU. An eager forward of these blocks "
                        "whose outputs are still alive keeps its autograd graph, and that "
                        "graph's AccumulateGrad nodes belong to the default stream: the "
                        "backward capture then cannot run (torch warns about an AccumulateGrad "
                        "stream mismatch). Find shapes under torch.no_grad(), or drop those "
                        "outputs (del) before capturing (lesson 04 §2)")
            return _result(name, False, f"{where}: your code raised "
                           f"{describe_exception(exc)}\n   what to look at: {look}",
                           kind="exception", more_hints=_GS_HINTS, quiet=quiet)
        if got is None:
            return _result(name, False, f"{where}: returned None (did you forget `return`?)",
                           more_hints=_GS_HINTS, quiet=quiet)
        if sample.requires_grad != cfg["needs"] or not torch.equal(sample.detach(), kept):
            return _result(name, False, f"{where}: you changed the caller's `sample` "
                           f"(requires_grad {cfg['needs']} -> {sample.requires_grad}, or its "
                           "values): requires_grad_() works in place. Make a new tensor for "
                           "the samples you need instead", more_hints=_GS_HINTS, quiet=quiet)
        if isinstance(got, list):
            graphed = sum(getattr(c, "runner", None) is not None for c in got)
            return _result(name, False, f"{where}: returned a list of {len(got)} ("
                           f"{graphed} of them graphed blocks); the exercise returns "
                           "make_graphed_callables' tuple: call it ONCE, with the tuple of "
                           "blocks and a tuple of samples (one per block), so that the blocks "
                           "are captured together, into one memory pool, and return the tuple "
                           "it gives", more_hints=_GS_HINTS, quiet=quiet)
        call = got if isinstance(got, tuple) else (got,)
        if len(call) != cfg["n"]:
            return _result(name, False, f"{where}: returned {len(call)} graphed callable(s) "
                           f"for {cfg['n']} blocks: return make_graphed_callables' tuple, "
                           "one per block", more_hints=_GS_HINTS, quiet=quiet)
        runners = [getattr(c, "runner", None) for c in call]
        if any(r is None for r in runners):
            return _result(name, False, f"{where}: returned {[type(c).__name__ for c in call]}"
                           ": expected the graphed blocks that bridge.make_graphed_callables "
                           "returns", more_hints=_GS_HINTS, quiet=quiet)
        for i, r in enumerate(runners):
            s = r.static_args[0] if r.static_args else None
            live_needs = cfg["needs"] if i == 0 else True
            if not isinstance(s, torch.Tensor):
                continue
            if live_needs and not s.requires_grad:
                feed = ("the stage input, which requires grad here" if i == 0 else
                        f"block {i - 1}'s output, which requires grad (block {i - 1} has "
                        "trainable parameters)")
                return _result(name, False, f"{where}: block {i} was captured from a sample "
                               f"that does not require grad, but at run time it is fed {feed}"
                               ". Its backward graph has no dgrad for that input, so "
                               "everything upstream of it would get no gradient (labkit "
                               "refuses the call; torch would leave .grad None in silence). "
                               "Look at how the sample of each block is made",
                               more_hints=_GS_HINTS, quiet=quiet)
            if not live_needs and s.requires_grad:
                return _result(name, False, f"{where}: block 0 was captured from a sample "
                               "that requires grad, but this stage's input needs no grad: "
                               "its backward graph computes a dgrad nobody uses (wasted "
                               "work at every step). Block 0's sample must require grad "
                               "exactly when `sample` does", more_hints=_GS_HINTS,
                               quiet=quiet)
        x = torch.randn(cfg["batch"], w[0], generator=gen).to(B.device)
        target = torch.randn(cfg["batch"], w[-1], generator=gen).to(B.device)
        try:
            gg, gx = _stage_grads(call, blocks, x.clone().requires_grad_(cfg["needs"]), target)
        except Exception as exc:  # noqa: BLE001 - reported to the learner
            _backend_mod.recover(B)
            return _result(name, False, f"{where}: training through your graphed blocks "
                           f"raised {describe_exception(exc)}", kind="exception",
                           more_hints=_GS_HINTS, quiet=quiet)
        eg, ex = _stage_grads(blocks, blocks, x.clone().requires_grad_(cfg["needs"]), target)
        if not (_all_close(gg, eg) and _close(gx, ex)):
            return _result(name, False, f"{where}: gradients through your graphed blocks "
                           "differ from eager autograd: check that each block's sample has "
                           "that block's input shape and that you graph the blocks in order",
                           more_hints=_GS_HINTS, quiet=quiet)
    return _result(name, True, f"passed {trials} random stages (first and later stages, "
                   "2-4 blocks of changing widths): every input that requires grad gets "
                   "its gradient, and training matches eager", trials=trials, quiet=quiet)
