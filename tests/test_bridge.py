"""labkit.bridge: fwd/bwd graphs joined by an autograd.Function (lesson 04).

Every test takes the ``B`` fixture, so it runs on the emulator here and on torch.cuda on
a GPU machine (``pytest -m cuda``).
"""

import re

import pytest
import torch

from labkit import bridge
from labkit.bridge import GraphArgMismatch, GraphOrderError, GraphRunner, GraphStatus
from labkit.core.models import CallCounter, TransformerBlock, make_blocks

pytestmark = pytest.mark.usefixtures("one_thread")


def _diff(a, b):
    return max((x - y).abs().max().item() for x, y in zip(a, b))


def _train(B, mode, *, micro=1, steps=3, **kw):
    """Train two blocks; mode: eager | bridge | torch. Returns the final parameters."""
    model = torch.nn.Sequential(*make_blocks(2, seed=0, hidden=16, heads=2, ffn=32,
                                             device=B.device))
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(2, 4, 16, generator=g).to(B.device),
             torch.randn(2, 4, 16, generator=g).to(B.device)) for _ in range(steps * micro)]
    sample = torch.randn(2, 4, 16, device=B.device, requires_grad=True)
    if mode == "bridge":
        call = bridge.make_graphed_callables(model, (sample,), B=B, num_warmup_iters=1, **kw)
    elif mode == "torch":
        call = B.make_graphed_callables(model, (sample,), num_warmup_iters=1)
    else:
        call = model
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for s in range(steps):
        opt.zero_grad()                       # set_to_none=True, the default
        for m in range(micro):
            x, t = data[s * micro + m]
            (((call(x) - t) ** 2).mean() / micro).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def test_bridge_equals_eager_and_torch(B):
    eager = _train(B, "eager")
    torch.testing.assert_close(_train(B, "bridge"), eager)
    torch.testing.assert_close(_train(B, "torch"), eager)


def test_gradient_accumulation_needs_cloned_wgrads(B):
    """Two microbatches per step: the clone keeps the bridge exact. Without it (what torch's
    make_graphed_callables returns, pytorch#181723) AccumulateGrad steals the static wgrad
    buffer as .grad and the next replay overwrites it."""
    eager = _train(B, "eager", micro=2)
    torch.testing.assert_close(_train(B, "bridge", micro=2), eager)
    no_clone = _train(B, "bridge", micro=2, clone_wgrads=False)
    assert _diff(no_clone, eager) > 1e-4


@pytest.mark.xfail(strict=True, raises=AssertionError, reason=(
    "pytorch/pytorch#181723 (open): torch.cuda.make_graphed_callables returns its static "
    "wgrad buffers uncloned, so with .grad = None AccumulateGrad steals one and the next "
    "microbatch's replay overwrites it. An XPASS means torch fixed it: update lesson 04 "
    "and the zero_grads_in_place note of labkit.pipeline.te_style."))
def test_torchs_graphed_callables_accumulate_like_eager(B):
    eager = _train(B, "eager", micro=2)
    torch.testing.assert_close(_train(B, "torch", micro=2), eager)


def _fused_run(B, graphed, *, steps=2, micro=2, **kw):
    torch.manual_seed(0)
    block = TransformerBlock(hidden=16, heads=2, ffn=32, fused=True).to(B.device)
    bridge.attach_main_grad(block)
    call = block
    if graphed:
        call = bridge.make_graphed_callables(
            block, (torch.randn(2, 4, 16, device=B.device, requires_grad=True),), B=B,
            num_warmup_iters=1, **kw)
    g = torch.Generator().manual_seed(2)
    first = None
    for s in range(steps):
        bridge.zero_main_grad(block)
        for _ in range(micro):
            x = torch.randn(2, 4, 16, generator=g).to(B.device)
            (call(x) ** 2).mean().backward()
        grads = [p.main_grad.clone() for p in block.parameters()]
        first = first or grads
        with torch.no_grad():
            for p in block.parameters():
                p -= 0.1 * p.main_grad
    return first, [p.detach().clone() for p in block.parameters()], block


def test_main_grad_fusion_and_grad_added_flag(B):
    g_eager, p_eager, _ = _fused_run(B, False)
    g_graph, p_graph, block = _fused_run(B, True)
    torch.testing.assert_close(g_graph, g_eager)
    torch.testing.assert_close(p_graph, p_eager)
    # forgetting the flag: the DDP hook adds the fused linears' wgrads a second time
    g_bad, _, _ = _fused_run(B, True, restore_grad_added=False)
    fused = {id(m.weight) for m in block.modules() if isinstance(m, bridge.FusedLinear)}
    for (name, p), ge, gb in zip(block.named_parameters(), g_eager, g_bad):
        if id(p) in fused:
            torch.testing.assert_close(gb, 2 * ge)
        else:
            torch.testing.assert_close(gb, ge)


@pytest.mark.parametrize("restore", [True, False])
def test_warmup_pollution_is_undone(B, restore):
    torch.manual_seed(0)
    model = CallCounter(TransformerBlock(hidden=16, heads=2, ffn=32, fused=True)).to(B.device)
    bridge.attach_main_grad(model)
    x = torch.randn(2, 4, 16, device=B.device)
    model(x).sum().backward()                  # mid-step: main_grad holds a microbatch
    before = [p.main_grad.clone() for p in model.parameters()]
    calls = model.calls.item()
    bridge.make_graphed_callables(model, (x.clone().requires_grad_(),), B=B,
                                  num_warmup_iters=2, restore_after_warmup=restore)
    same = _diff(before, [p.main_grad for p in model.parameters()]) == 0
    assert same is restore
    assert (model.calls.item() == calls) is restore


def test_status_machine(B):
    g = bridge.make_graphed_callables(
        TransformerBlock(hidden=16, heads=2, ffn=32).to(B.device),
        (torch.randn(2, 4, 16, device=B.device, requires_grad=True),), B=B, num_warmup_iters=1)
    x = torch.randn(2, 4, 16, device=B.device, requires_grad=True)
    y = g(x)
    assert g.runner.status is GraphStatus.BWD_READY
    with pytest.raises(GraphOrderError, match="backward graph is due"):
        g(x)
    y.sum().backward(retain_graph=True)
    assert g.runner.status is GraphStatus.FWD_READY
    with pytest.raises(GraphOrderError, match="forward graph is due"):
        y.sum().backward()
    with torch.no_grad():                      # no backward coming: status stays
        g(x)
    assert g.runner.status is GraphStatus.FWD_READY


def test_guards_refuse_mismatched_arguments(B):
    lin = torch.nn.Linear(8, 8).to(B.device)
    r = GraphRunner(lin, B, func=lambda x, scale: lin(x) * scale, num_warmup=1)
    r.create_fwd_graph((torch.randn(4, 8, device=B.device, requires_grad=True), 2.0))
    r.create_bwd_graph()
    x = torch.randn(4, 8, device=B.device)
    cases = {
        "received shape (5, 8), captured (4, 8)": (torch.randn(5, 8, device=B.device), 2.0),
        "received dtype torch.float64": (x.double(), 2.0),
        "Count mismatch": (x,),
        "Value mismatch at args[1]": (x, 3.0),
        "Type mismatch at args[0]": ([1.0], 2.0),
    }
    for message, args in cases.items():
        with pytest.raises(GraphArgMismatch, match=re.escape(message)):
            r(*args)
    torch.testing.assert_close(r(x, 2.0), lin(x) * 2.0)


def test_old_names_are_the_shared_layers_objects():
    """labkit.bridge and labkit.pipeline.models re-export; they define no second copy."""
    from labkit.core import main_grad, models
    from labkit.pipeline import models as pipeline_models

    for name in ("attach_main_grad", "zero_main_grad", "FusedLinear"):
        assert getattr(bridge, name) is getattr(main_grad, name), name
    for name in ("TransformerBlock", "make_blocks", "CallCounter"):
        assert getattr(pipeline_models, name) is getattr(models, name), name


def test_connected_params_walks_to_accumulate_grad():
    m = torch.nn.ModuleDict({"a": torch.nn.Linear(3, 3), "b": torch.nn.Linear(3, 3),
                             "c": torch.nn.Linear(3, 3)})
    m["b"].weight.requires_grad_(False)
    y = m["b"](m["a"](torch.randn(2, 3)))            # c unused, b.weight frozen
    got = bridge.get_connected_params(y, m)
    assert [id(p) for p in got] == [id(m["a"].weight), id(m["a"].bias), id(m["b"].bias)]


def test_copy_only_when_data_ptr_differs(B):
    lin = torch.nn.Linear(8, 8).to(B.device)
    r = GraphRunner(lin, B, num_warmup=1)
    r.create_fwd_graph((torch.randn(4, 8, device=B.device),))
    r.create_bwd_graph()
    static = r.static_args[0]
    with torch.no_grad():
        static.copy_(torch.randn(4, 8, device=B.device))
        r(static)                                 # already in place: no copy
        assert r.copies["fwd"] == 0
        r(torch.randn(4, 8, device=B.device))
        assert r.copies["fwd"] == 1


def test_registered_generator_keeps_dropout_random(B):
    gen = B.Generator()
    gen.manual_seed(0)
    sample = (torch.randn(2, 4, 16, device=B.device, requires_grad=True),)
    with pytest.raises(RuntimeError, match="Attempt to increase offset"):
        bridge.make_graphed_callables(
            TransformerBlock(hidden=16, heads=2, ffn=32, dropout=0.5, generator=gen)
            .to(B.device), sample, B=B, num_warmup_iters=1)
    B.set_stream(B.default_stream())
    block = TransformerBlock(hidden=16, heads=2, ffn=32, dropout=0.5, generator=gen)
    g = bridge.make_graphed_callables(block.to(B.device), sample, B=B, num_warmup_iters=1,
                                      generators=[gen])
    x = torch.randn(2, 4, 16, device=B.device, requires_grad=True)
    y1 = g(x)
    a = y1.detach().clone()
    y1.sum().backward()
    with torch.no_grad():
        b = g(x).clone()
    assert not torch.equal(a, b)


# ---- checkers ------------------------------------------------------------------------------


def _backward_without(step):
    def fn(r, grads):
        if step != "copy":
            for g, s in zip(grads, r.static_grad_outputs):
                if s is not None:
                    s.copy_(g)
        r.bwd_graph.replay()
        if step != "status":
            r.status = GraphStatus.FWD_READY
        if step != "flag":
            for p, a in r.groundtruth_grad_added_to_main_grad.items():
                p.grad_added_to_main_grad = a
        n = r.num_dgrads
        w = r.static_grad_inputs[n:]
        if step != "clone":
            w = tuple(x.clone() for x in w)
        return (*r.static_grad_inputs[:n], *w)
    return fn




class _Logged(torch.nn.Module):
    """A linear layer that logs, per forward, whether a capture was under way."""

    def __init__(self, name, log, B):
        super().__init__()
        self.name, self.log, self.B = name, log, B
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        self.log.append((self.name, "capture" if self.B.is_current_stream_capturing()
                         else "eager"))
        return self.lin(x)


def test_make_graphed_callables_warms_every_callable_before_the_first_capture(B):
    log = []
    layers = tuple(_Logged(n, log, B).to(B.device) for n in ("a", "b", "c"))
    samples = tuple((torch.randn(2, 8, device=B.device, requires_grad=True),) for _ in layers)
    bridge.make_graphed_callables(layers, samples, B=B, num_warmup_iters=2)
    assert log == [(n, "eager") for n in "aabbcc"] + [(n, "capture") for n in "abc"]


def test_create_fwd_graph_skips_the_warmups_warmup_ran(B):
    log = []
    r = GraphRunner(_Logged("a", log, B).to(B.device), B, num_warmup=2)
    sample = (torch.randn(2, 8, device=B.device, requires_grad=True),)
    r.warmup(sample)
    r.create_fwd_graph(sample)
    assert log == [("a", "eager"), ("a", "eager"), ("a", "capture")]
    with pytest.raises(RuntimeError, match="warm up before create_fwd_graph, not after"):
        r.warmup(sample)
