"""Misuse of labkit.bridge (lesson 04's engine): each case asserts the error type and the
words that make the message clear, or the correct result (issue 11). Tests that take
``B`` also run on a GPU (``pytest -m cuda``)."""

import re

import pytest
import torch
from helpers import assert_usable

from labkit import bridge
from labkit.bridge import GraphRunner
from labkit.core.models import CallCounter, TransformerBlock
from labkit.guards import error_text

pytestmark = pytest.mark.usefixtures("one_thread")

SHAPE = (2, 4, 16)


def _block(B):
    torch.manual_seed(0)
    return TransformerBlock(hidden=16, heads=2, ffn=32).to(B.device)


def _graphed(B, block, *, requires_grad=True):
    sample = (torch.randn(SHAPE, device=B.device, requires_grad=requires_grad),)
    return bridge.make_graphed_callables(block, sample, B=B, num_warmup_iters=1)



# ---- requires_grad at call time ---------------------------------------------------------------

def test_input_requiring_grad_that_the_sample_did_not_is_refused(B):
    """torch's graphed callables silently leave x.grad None here (documented); eager fills it."""
    g = _graphed(B, _block(B), requires_grad=False)
    x = torch.randn(SHAPE, device=B.device, requires_grad=True)
    with pytest.raises(RuntimeError) as err:
        g(x)
    msg = str(err.value)
    for words in ("args[0] requires grad", "did not require grad", ".grad would silently stay "
                  "None", "sample.requires_grad_()", "args[0].detach()"):
        assert words in msg, (words, msg)
    with torch.no_grad():                      # no gradient wanted: fine
        g(x)
    y = g(x.detach())                          # fine, and equal to eager
    torch.testing.assert_close(y, g.module(x.detach()))


def test_torchs_own_graphed_callable_drops_that_gradient(B):
    """What the check above prevents (torch documents it: requires_grad must match)."""
    block = _block(B)
    g = B.make_graphed_callables(block, (torch.randn(SHAPE, device=B.device),),
                                 num_warmup_iters=1)
    x = torch.randn(SHAPE, device=B.device, requires_grad=True)
    g(x).sum().backward()
    assert x.grad is None


def test_sample_requiring_grad_and_input_not_is_fine(B):
    block = _block(B)
    g = _graphed(B, block, requires_grad=True)
    x = torch.randn(SHAPE, device=B.device)
    y = g(x)
    y.sum().backward()
    w = [p.grad.clone() for p in block.parameters()]
    block.zero_grad()
    block(x).sum().backward()
    torch.testing.assert_close(w, [p.grad for p in block.parameters()])


def test_graph_captured_without_autograd_refuses_an_input_requiring_grad(B):
    block = _block(B).eval()
    g = _graphed(B, block)                     # eval mode: no backward graph
    x = torch.randn(SHAPE, device=B.device, requires_grad=True)
    with pytest.raises(RuntimeError, match=r"captured without autograd .* Call it under "
                                           r"torch.no_grad\(\) \(inference\)"):
        g(x)
    with torch.no_grad():
        torch.testing.assert_close(g(x), block(x))


def test_forward_graph_without_its_backward_refuses_an_input_requiring_grad(B):
    r = GraphRunner(_block(B), B, num_warmup=1)
    r.create_fwd_graph((torch.randn(SHAPE, device=B.device, requires_grad=True),))
    with pytest.raises(RuntimeError, match=r"backward graph has not been created yet.*"
                                           r"create_bwd_graph\(\)"):
        r(torch.randn(SHAPE, device=B.device, requires_grad=True))


# ---- how a graphed callable is called ---------------------------------------------------------

def test_keyword_arguments_are_refused_by_name(B):
    g = _graphed(B, _block(B))
    x = torch.randn(SHAPE, device=B.device)
    with pytest.raises(TypeError, match=r"positional arguments only .* got keyword "
                                        r"argument\(s\) x\. Pass them positionally"):
        g(x=x)
    with pytest.raises(TypeError, match=r"keyword argument\(s\) mask"):
        g.runner(x, mask=None)


def test_call_before_capture(B):
    r = GraphRunner(_block(B), B)
    with pytest.raises(RuntimeError, match=r"no forward graph to replay yet: call "
                                           r"create_fwd_graph\(sample_args\)"):
        r(torch.randn(SHAPE, device=B.device))


# ---- sample_args and callables ----------------------------------------------------------------

def test_sample_args_as_a_bare_tensor_is_refused(B):
    """A batch of one: tuple(x) would silently capture x[0], a different shape."""
    x = torch.randn(1, 4, 16, device=B.device, requires_grad=True)
    with pytest.raises(TypeError, match=re.escape("sample_args must be a tuple of the "
                                                  "callable's positional arguments, got a "
                                                  "Tensor of shape (1, 4, 16). For one "
                                                  "argument write (x,), not x")):
        bridge.make_graphed_callables(_block(B), x, B=B)


def test_several_callables(B):
    a, b = _block(B), _block(B)
    s = (torch.randn(SHAPE, device=B.device),)
    with pytest.raises(TypeError, match="pass several callables as a tuple, not a list"):
        bridge.make_graphed_callables([a, b], (s, s), B=B)
    with pytest.raises(ValueError, match=r"2 callables but 1 entries in sample_args; give "
                                         "one tuple of sample arguments per callable"):
        bridge.make_graphed_callables((a, b), (s,), B=B)
    with pytest.raises(TypeError, match=r"sample_args\[1\] must be a tuple .*got a Tensor"):
        bridge.make_graphed_callables((a, b), (s, s[0]), B=B)
    with pytest.raises(ValueError, match="callables is an empty tuple"):
        bridge.make_graphed_callables((), (), B=B)
    with pytest.raises(TypeError, match=r"callables\[1\] is a str, not a module or function"):
        bridge.make_graphed_callables((a, "b"), (s, s), B=B)


def test_sample_on_another_device(B):
    meta = torch.empty(SHAPE, device="meta")
    with pytest.raises(ValueError, match=r"sample_args\[0\] is on meta, but the .* backend "
                                         r"captures on .*x.to\(B.device\)"):
        bridge.make_graphed_callables(_block(B), (meta,), B=B)


@pytest.mark.parametrize("kw, exc, words", [
    ({"num_warmup": -1}, ValueError, "num_warmup must be >= 0, got -1"),
    ({"num_warmup": 1.5}, TypeError, "num_warmup must be an int >= 0, got 1.5 (float)"),
    ({"generators": [0]}, TypeError, "takes torch.Generator objects, got int"),
    ({"func": "forward"}, TypeError, "func=...) must be callable, got str"),
])
def test_runner_options(B, kw, exc, words):
    with pytest.raises(exc, match=re.escape(words)):
        GraphRunner(_block(B), B, **kw)


def test_runner_needs_a_module(B):
    with pytest.raises(TypeError, match=r"needs the torch.nn.Module .*got function.*"
                                        r"GraphRunner\(torch.nn.Module\(\), B, func=fn\)"):
        GraphRunner(lambda x: x, B)


def test_runner_steps_out_of_order(B):
    r = GraphRunner(_block(B), B, num_warmup=1)
    with pytest.raises(RuntimeError, match=r"no forward graph to differentiate yet: call "
                                           r"create_fwd_graph\(sample_args\) first"):
        r.create_bwd_graph()
    with pytest.raises(TypeError, match="create_fwd_graph.*got a Tensor of shape"):
        r.create_fwd_graph(torch.randn(SHAPE, device=B.device))
    r.create_fwd_graph((torch.randn(SHAPE, device=B.device, requires_grad=True),))
    with pytest.raises(RuntimeError, match="forward graph already exists .*new GraphRunner"):
        r.create_fwd_graph((torch.randn(SHAPE, device=B.device),))
    r.create_bwd_graph()
    with pytest.raises(RuntimeError, match="backward graph already exists"):
        r.create_bwd_graph()
    with torch.no_grad():
        r2 = GraphRunner(_block(B), B, num_warmup=1)
        r2.create_fwd_graph((torch.randn(SHAPE, device=B.device),))
    with pytest.raises(RuntimeError, match=r"captured without autograd \(no_grad or eval "
                                           r"mode\): there is no backward"):
        r2.create_bwd_graph()


# ---- a failed capture leaves a usable process (both backends) ------------------------------

class _HostReadInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, g):
        return g * float(g.sum().item())       # eager: fine; captured: refused


class _ReadsHostInBackward(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(16, 16)

    def forward(self, x):
        return _HostReadInBackward.apply(self.lin(x))


class _ReadsHostInForward(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(16, 16)

    def forward(self, x):
        return self.lin(x) * float(x.sum().item())


def test_failed_forward_capture_leaves_a_usable_process(B):
    before = B.current_stream()
    module = CallCounter(_ReadsHostInForward()).to(B.device)
    with pytest.raises(RuntimeError) as err:
        bridge.make_graphed_callables(module, (torch.randn(SHAPE, device=B.device),), B=B,
                                      num_warmup_iters=2)
    assert "operation not permitted when stream is capturing" in error_text(err.value)
    assert module.calls.item() == 0           # warmup's buffer updates undone even so
    assert_usable(B, before)


def test_failed_backward_capture_leaves_a_usable_process(B):
    before = B.current_stream()
    module = _ReadsHostInBackward().to(B.device)
    r = GraphRunner(module, B, num_warmup=1)
    r.create_fwd_graph((torch.randn(SHAPE, device=B.device, requires_grad=True),))
    with pytest.raises(RuntimeError) as err:
        r.create_bwd_graph()
    assert "operation not permitted when stream is capturing" in error_text(err.value)
    assert r.bwd_graph is None
    assert_usable(B, before)


# ---- main_grad helpers and connected params ----------------------------------------------------

def test_main_grad_helpers_take_the_module():
    lin = torch.nn.Linear(4, 4)
    with pytest.raises(TypeError, match=re.escape("attach_main_grad: module must be a "
                                                  "torch.nn.Module, got a generator "
                                                  "(model.parameters()?)")):
        bridge.attach_main_grad(lin.parameters())
    with pytest.raises(TypeError, match="dtype must be a floating torch.dtype .*got torch.int32"):
        bridge.attach_main_grad(lin, dtype=torch.int32)
    with pytest.raises(TypeError, match="zero_main_grad: module must be a torch.nn.Module"):
        bridge.zero_main_grad([lin])


def test_connected_params_arguments():
    lin = torch.nn.Linear(4, 4)
    y = lin(torch.randn(2, 4))
    with pytest.raises(TypeError, match="module must be a torch.nn.Module, got list"):
        bridge.get_connected_params(y, [lin])
    with pytest.raises(TypeError, match="outputs must be a tensor or a tuple of tensors .*"
                                        "got NoneType"):
        bridge.get_connected_params(None, lin)
    assert bridge.get_connected_params([y], lin) == (lin.weight, lin.bias)


def test_pool_and_warmup_of_make_graphed_callables(B):
    s = (torch.randn(SHAPE, device=B.device),)
    with pytest.raises(TypeError, match=r"make_graphed_callables\(pool=...\): pool must be a "
                                        "memory-pool handle"):
        bridge.make_graphed_callables(_block(B), s, B=B, pool="shared")
    with pytest.raises(ValueError, match="num_warmup_iters must be >= 0, got -2"):
        bridge.make_graphed_callables(_block(B), s, B=B, num_warmup_iters=-2)


def test_a_backend_name_where_the_namespace_belongs():
    words = re.escape("B must be the backend namespace that labkit.backend.get() returns, "
                      "got str 'cuda': write B = labkit.backend.get('cuda')")
    lin = torch.nn.Linear(4, 4)
    with pytest.raises(TypeError, match=words):
        GraphRunner(lin, "cuda")
    with pytest.raises(TypeError, match=words):
        bridge.make_graphed_callables(lin, (torch.randn(2, 4),), B="cuda")
