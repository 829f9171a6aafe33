"""Checkers for lesson 04 (the fwd/bwd bridge), against :mod:`labkit.bridge`.

* ``connected_params(outputs, module) -> tuple``: the parameters ``outputs`` depend on,
  found by walking the autograd graph to its ``AccumulateGrad`` leaves, in
  ``module.parameters()`` order.
* ``bridge_backward(runner, grads) -> tuple``: the backward half of the bridge: copy the
  incoming grads into ``runner.static_grad_outputs``, replay ``runner.bwd_graph``, set the
  status back to FWD_READY, restore ``grad_added_to_main_grad``, return the dgrads and the
  *cloned* wgrads (one per tensor of ``runner.input_surface``).

The backward checker first probes the function on a small graphed layer (status, number
of gradients, clone, flag) so that a typical mistake gets a precise message, then trains
a transformer block through it and compares the parameters with eager training.
"""

from __future__ import annotations

import torch
from torch import nn

from labkit import bridge
from labkit.checks import FAIL, PASS, CheckResult, check, describe_exception

__all__ = ["check_connected_params", "check_bridge_backward"]


def _backend(B):
    if B is None:
        from labkit import backend
        B = backend.get("auto")
    return B


# ---- connected_params -------------------------------------------------------------------------

class _Probe(nn.Module):
    """A module whose outputs leave out some parameters, in ways that trip shortcuts."""

    def __init__(self, variant: int, gen: torch.Generator):
        super().__init__()
        self.variant = variant
        self.embed = nn.Linear(4, 4)
        self.unused = nn.Parameter(torch.randn(4, generator=gen))      # never used
        self.frozen = nn.Parameter(torch.randn(4, generator=gen), requires_grad=False)
        self.head = nn.Linear(4, 4)
        self.scale = nn.Parameter(torch.ones(4))
        self.side = nn.Linear(4, 2)
        with torch.no_grad():
            for p in (*self.embed.parameters(), *self.head.parameters(),
                      *self.side.parameters()):
                p.copy_(torch.randn(p.shape, generator=gen))

    def forward(self, x):
        h = self.embed(x) + self.frozen
        if self.variant == 0:        # everything but unused/frozen/side
            return self.head(h) * self.scale
        if self.variant == 1:        # a tuple; an integer output; scale used twice
            y = self.head(h * self.scale) * self.scale
            return y, self.side(x).argmax(-1)
        # variant 2: the output skips head entirely; side is only used under no_grad
        with torch.no_grad():
            gate = self.side(x).sigmoid()
        return (h * self.scale * gate[..., :1]).sum(-1)


def _names(module, params):
    by_id = {id(p): n for n, p in module.named_parameters()}
    out = []
    for p in params:
        if not isinstance(p, torch.Tensor):
            out.append(f"<{type(p).__name__}>")
        else:
            out.append(by_id.get(id(p), "<a tensor that is not one of module's parameters>"))
    return out


def check_connected_params(fn, *, trials: int = 3) -> CheckResult:
    """``fn(outputs, module)`` must return the parameters of ``module`` that ``outputs``
    depend on, in ``module.parameters()`` order."""

    def make_inputs(gen: torch.Generator):
        trial = gen.initial_seed() - 1
        module = _Probe(trial % 3, gen)
        x = torch.randn(3, 4, generator=gen)
        return module(x), module

    def reference(outputs, module):
        return _names(module, bridge.get_connected_params(outputs, module))

    def learner(outputs, module):
        got = fn(outputs, module)
        if got is None:
            return None
        return _names(module, list(got))

    def compare(expected, actual):
        if actual is None:
            return "expected a tuple of parameters, got None (did you forget `return`?)"
        if actual == expected:
            return None
        extra = [n for n in actual if n not in expected]
        missing = [n for n in expected if n not in actual]
        if not extra and not missing:
            if len(actual) != len(set(actual)):
                return (f"some parameters appear twice: {actual}. A parameter reached along "
                        "two paths is still one graph input: keep a `visited` set")
            return (f"the right parameters in the wrong order: expected {expected}, got "
                    f"{actual}. Return them in module.parameters() order: the wgrads the "
                    "backward graph returns are matched to the Function's inputs by position")
        why = []
        if extra:
            why.append(f"{extra} should not be there")
            if "unused" in extra or "frozen" in extra or "side.weight" in extra:
                why.append("a parameter counts only if an AccumulateGrad node for it is "
                           "reachable from the outputs' grad_fn (unused, frozen and no_grad "
                           "parameters have none): walk the graph instead of listing "
                           "module.parameters()")
        if missing:
            why.append(f"{missing} are missing: follow every grad_fn.next_functions entry "
                       "(skip the None ones) until you reach nodes with a `.variable`")
        return f"expected {expected}, got {actual}: " + "; ".join(why)

    return check(learner, reference, make_inputs, trials=trials, name="connected_params",
                 compare=compare,
                 hint="stack = [o.grad_fn for o in outputs if o.requires_grad]; pop nodes, "
                      "collect id(node.variable) where present, push node.next_functions")


# ---- bridge_backward ----------------------------------------------------------------------------

def _probe_runner(B, fn, fused: bool):
    from labkit.pipeline.models import TransformerBlock

    torch.manual_seed(0)
    block = TransformerBlock(hidden=16, heads=2, ffn=32, fused=fused).to(B.device)
    if fused:
        bridge.attach_main_grad(block)
    r = bridge.GraphRunner(block, B, num_warmup=1, backward_impl=fn, name="probe")
    r.create_fwd_graph((torch.randn(2, 4, 16, device=B.device, requires_grad=True),))
    r.create_bwd_graph()
    return block, r


def _train(B, backward_impl, seed: int, *, fused: bool = False, micro: int = 2,
           steps: int = 2, clone_wgrads: bool = True):
    """Train a block through a runner using ``backward_impl``; None = eager."""
    from labkit.pipeline.models import TransformerBlock

    torch.manual_seed(seed)
    block = TransformerBlock(hidden=16, heads=2, ffn=32, fused=fused).to(B.device)
    if fused:
        bridge.attach_main_grad(block)
    g = torch.Generator().manual_seed(seed)
    data = [(torch.randn(2, 4, 16, generator=g).to(B.device),
             torch.randn(2, 4, 16, generator=g).to(B.device)) for _ in range(micro * steps)]
    if backward_impl is None:
        call = block
    else:
        call = bridge.GraphRunner(block, B, num_warmup=1, backward_impl=backward_impl,
                                  clone_wgrads=clone_wgrads, name="block")
        call.create_fwd_graph((torch.zeros(2, 4, 16, device=B.device, requires_grad=True),))
        call.create_bwd_graph()
    xgrads = []
    for s in range(steps):
        if fused:
            bridge.zero_main_grad(block)
        else:
            block.zero_grad(set_to_none=True)
        for m in range(micro):
            x, t = data[s * micro + m]
            x = x.clone().requires_grad_()
            (((call(x) - t) ** 2).mean() / micro).backward()
            xgrads.append(x.grad)
        with torch.no_grad():
            for p in block.parameters():
                grad = p.main_grad if fused else p.grad
                p -= 0.1 * grad
    return {"params": [p.detach().clone() for p in block.parameters()],
            "input grads": xgrads}


def _fail(msg: str, hint: str, kind: str = "mismatch", quiet: bool = False) -> CheckResult:
    text = f"{FAIL} bridge_backward: {msg}\n   hint: {hint}"
    if not quiet:
        print(text)
    return CheckResult("bridge_backward", False, text, kind=kind)


def check_bridge_backward(fn, *, B=None, quiet: bool = False) -> CheckResult:
    """``fn(runner, grads)`` must do what :func:`labkit.bridge.replay_backward` does."""
    B = _backend(B)
    if not callable(fn):
        return _fail(f"expected a function, got {type(fn).__name__}", "def bridge_backward("
                     "runner, grads): ...", quiet=quiet)
    # 1. probe one call on a fused block (main_grad + flag)
    try:
        block, r = _probe_runner(B, fn, fused=True)
        bridge.zero_main_grad(block)
        x = torch.randn(2, 4, 16, device=B.device, requires_grad=True)
        y = r(x)
        gy = torch.randn_like(y)
        for p in r.groundtruth_grad_added_to_main_grad:
            p.grad_added_to_main_grad = False          # as zero_main_grad leaves it
        result = fn(r, (gy,))
    except NotImplementedError:
        text = f"{FAIL} bridge_backward: not done yet: fill in the cell marked YOUR CODE HERE"
        if not quiet:
            print(text)
        return CheckResult("bridge_backward", False, text, kind="not_implemented")
    except Exception as exc:  # noqa: BLE001 - reported to the learner
        return _fail(f"your code raised {describe_exception(exc)}",
                     "copy each grad into runner.static_grad_outputs[i] (skip None buffers), "
                     "then runner.bwd_graph.replay()", kind="exception", quiet=quiet)
    n = len(r.input_surface)
    if result is None:
        return _fail("returned None (did you forget `return`?)",
                     f"return one gradient per tensor of runner.input_surface ({n} here)",
                     quiet=quiet)
    result = tuple(result)
    if len(result) != n:
        return _fail(f"returned {len(result)} gradients, expected {n} (one per tensor of "
                     f"runner.input_surface: {r.num_dgrads} input(s), then "
                     f"{len(r.params_to_backprop)} connected parameters)",
                     "return (*dgrads, *wgrads) from runner.static_grad_inputs", quiet=quiet)
    if r.status != bridge.GraphStatus.FWD_READY:
        return _fail("after the backward the runner's status is still "
                     f"{r.status.name}, so its next forward would be refused",
                     "set runner.status = GraphStatus.FWD_READY once the backward graph "
                     "has replayed", quiet=quiet)
    eager_x = x.detach().clone().requires_grad_()
    with torch.no_grad():
        saved = [p.main_grad.clone() for p in block.parameters()]
    ref_block = type(block)(hidden=16, heads=2, ffn=32).to(B.device)
    ref_block.load_state_dict(block.state_dict())
    ref_dx, = torch.autograd.grad(ref_block(eager_x), eager_x, gy)
    if result[0] is None or not torch.allclose(result[0], ref_dx, rtol=1e-4, atol=1e-5):
        return _fail("the input gradient (dgrad) differs from eager autograd's",
                     "the backward graph reads runner.static_grad_outputs: copy_ the "
                     "incoming grads into them before runner.bwd_graph.replay()", quiet=quiet)
    del saved
    for i, w in enumerate(result[r.num_dgrads:]):
        s = r.static_grad_inputs[r.num_dgrads + i]
        if w is not None and s is not None and \
                w.untyped_storage().data_ptr() == s.untyped_storage().data_ptr():
            return _fail("the weight gradients you return share memory with the backward "
                         "graph's static buffers, which its next replay overwrites: "
                         "an AccumulateGrad that steals the tensor as .grad would see the "
                         "next microbatch's gradient (pytorch issue #181723)",
                         "return w.clone() for each wgrad (dgrads may stay as they are)",
                         quiet=quiet)
    flags = {p: p.grad_added_to_main_grad for p in r.groundtruth_grad_added_to_main_grad}
    if any(flags[p] != v for p, v in r.groundtruth_grad_added_to_main_grad.items()):
        return _fail("grad_added_to_main_grad is not restored after the replay, so the DDP "
                     "hook adds the fused layers' wgrads into main_grad a second time",
                     "for p, added in runner.groundtruth_grad_added_to_main_grad.items(): "
                     "p.grad_added_to_main_grad = added", quiet=quiet)

    # 2. end to end: gradient accumulation, with and without main_grad
    for fused in (False, True):
        res = check(lambda seed, fused=fused: _train(B, fn, seed, fused=fused),
                    lambda seed, fused=fused: _train(B, None, seed, fused=fused),
                    lambda gen: (int(gen.initial_seed()),), trials=1, quiet=True,
                    name="bridge_backward", rtol=1e-4, atol=1e-5,
                    hint="compare your function with the steps in the docstring of "
                         "labkit.bridge.replay_backward")
        if not res:
            what = "with main_grad and fused layers" if fused else "with gradient accumulation"
            text = res.message.replace("bridge_backward:", f"bridge_backward ({what}):", 1)
            if not quiet:
                print(text)
            return CheckResult("bridge_backward", False, text, kind=res.kind)
    text = (f"{PASS} bridge_backward: probes passed, and training through it matches eager "
            "(gradient accumulation, main_grad)")
    if not quiet:
        print(text)
    return CheckResult("bridge_backward", True, text, trials=3)
