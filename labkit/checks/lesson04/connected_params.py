"""Lesson 04, exercise ``connected_params``: its checker.

``connected_params(outputs, module) -> tuple``: the parameters ``outputs`` depend on,
found by walking the autograd graph to its ``AccumulateGrad`` leaves, in
``module.parameters()`` order.
"""

from __future__ import annotations

import random

import torch
from torch import nn

from labkit import bridge
from labkit.checks import (
    DEFAULT_TIME_LIMIT,
    CheckResult,
    Exercise,
    attempt,
    describe_exception,
    fail,
    reject,
    run_check,
)

__all__ = ["check_connected_params"]


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


EXERCISE = Exercise("connected_params")


def _why_raised(exc: BaseException) -> str:
    """The learner's error, with what to look at for the usual ones."""
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
    return f"your code raised {describe_exception(exc)}\n   what to look at: {why}"


def _one_trial(fn, trial: int, label: str) -> None:
    """Trial ``trial`` (0-based): a random probe module, its outputs, the learner's
    answer judged by :func:`_cp_diagnose`."""
    rng = random.Random(1000 + trial)
    gen = torch.Generator().manual_seed(trial)
    plan = _plan(rng, trial)
    module = _Probe(plan, gen)
    inputs = tuple(torch.randn(3, 4, generator=gen).requires_grad_(rg)
                   for rg in plan["needs_grad"])
    outputs = module(*inputs)
    got = attempt(fn, (outputs, module), time_limit=DEFAULT_TIME_LIMIT, label=label,
                  hints=_CP_HINTS, reason=_why_raised)
    reason = _cp_diagnose(got, plan, module, inputs, outputs)
    if reason:
        reject(f"{label}: {reason}", hints=_CP_HINTS)


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
    if not callable(fn):
        return fail(EXERCISE.name, f"expected a function, got {type(fn).__name__}",
                    quiet=quiet)

    def body() -> str:
        for trial in range(trials):
            _one_trial(fn, trial, f"trial {trial + 1} of {trials}")
        return (f"passed {trials} random trials (inputs that require grad, tuple outputs, "
                "frozen/unused/no_grad parameters)")

    return run_check(EXERCISE.name, body, quiet=quiet, trials=trials)
