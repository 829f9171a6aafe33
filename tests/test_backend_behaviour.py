"""What CUDA graphs do, asserted once and run on every backend.

Each test states one rule of CUDA graphs (as observed on an H200 with torch 2.11). On a
GPU the rule is checked against torch.cuda itself; on the CPU against labkit's emulator.
"""

import pytest
import torch

from labkit import backend
from labkit.guards import error_text


def capture(B, fn, pool=None):
    """Capture ``fn()`` into a new graph on a side stream; return (graph, fn's result)."""
    g = B.CUDAGraph()
    with B.graph(g, pool=pool):
        out = fn()
    return g, out


# ---- the contract ----------------------------------------------------------------------

def test_contract_attributes(B):
    for name in ("name", "device", "CUDAGraph", "graph", "graph_pool_handle",
                 "make_graphed_callables", "Stream", "stream", "current_stream",
                 "synchronize", "is_current_stream_capturing"):
        assert hasattr(B, name), name
    assert B.name in ("cuda", "emulated")
    assert isinstance(B.device, torch.device)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_backend_is_torch_cuda_itself():
    B = backend.get("cuda")
    assert B.CUDAGraph is torch.cuda.CUDAGraph and B.graph is torch.cuda.graph
    assert B.make_graphed_callables is torch.cuda.make_graphed_callables
    assert B.synchronize is torch.cuda.synchronize and B.Stream is torch.cuda.Stream


def test_auto_and_unknown_names():
    assert backend.get("auto").name == ("cuda" if torch.cuda.is_available() else "emulated")
    with pytest.raises(ValueError, match="unknown backend"):
        backend.get("tpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_cuda_without_gpu_says_what_to_do():
    with pytest.raises(RuntimeError, match="emulated"):
        backend.get("cuda")


# ---- capture records, does not compute ------------------------------------------------

def test_capture_does_not_compute(B):
    x = torch.randn(1000, device=B.device)
    g, y = capture(B, lambda: x * 2 + 3)
    B.synchronize()
    assert not torch.equal(y, x * 2 + 3)          # nothing computed yet
    g.replay()
    assert torch.equal(y, x * 2 + 3)


def test_inplace_update_waits_for_replay(B):
    c = torch.zeros(1, device=B.device)
    g, _ = capture(B, lambda: c.add_(1))
    seen = [c.item()]
    for _ in range(3):
        g.replay()
        seen.append(c.item())
    assert seen == [0.0, 1.0, 2.0, 3.0]


# ---- replay reads by address ----------------------------------------------------------

def test_replay_reads_inputs_by_address(B):
    static_in = torch.zeros(8, device=B.device)
    g, out = capture(B, lambda: static_in[:4] * 10)        # a view of the input
    static_in.copy_(torch.arange(8.0, device=B.device))   # copy_ is seen
    g.replay()
    assert out.tolist() == [0.0, 10.0, 20.0, 30.0]
    static_in.mul_(2)                                      # in-place updates are seen
    g.replay()
    assert out.tolist() == [0.0, 20.0, 40.0, 60.0]
    static_in = torch.full((8,), 100.0, device=B.device)  # rebinding is not
    g.replay()
    assert out.tolist() == [0.0, 20.0, 40.0, 60.0]


# ---- outputs are static ----------------------------------------------------------------

def test_outputs_are_static_and_overwritten(B):
    x = torch.ones(4, device=B.device)
    g, y = capture(B, lambda: x + 1)
    g.replay()
    ptr, held, kept = y.data_ptr(), y, y.clone()
    x.fill_(10)
    g.replay()
    assert y.data_ptr() == ptr
    assert held.tolist() == [11.0] * 4          # a held reference changes
    assert kept.tolist() == [2.0] * 4           # a clone does not


# ---- Python runs once ------------------------------------------------------------------

def test_python_runs_once(B):
    x = torch.ones(2, device=B.device)
    scale, calls = 3.0, []

    def body():
        calls.append(1)
        return x * scale

    g, y = capture(B, body)
    scale = 100.0
    for _ in range(3):
        g.replay()
    assert y.tolist() == [3.0, 3.0]             # the scalar was baked in
    assert len(calls) == 1                      # the side effect happened once


# ---- forbidden during capture ----------------------------------------------------------

SYNC_MSG = "operation not permitted when stream is capturing"
HOST_COPY_MSG = "Cannot copy between CPU and CUDA tensors during CUDA graph capture"

FORBIDDEN = {
    "item": (lambda x: x.sum().item(), SYNC_MSG),
    "tolist": (lambda x: x.tolist(), HOST_COPY_MSG),
    "print": (lambda x: print(x), SYNC_MSG),
    "if_tensor": (lambda x: bool(x.sum() > 0), SYNC_MSG),
    "nonzero": (lambda x: x.nonzero(), SYNC_MSG),
    "boolean_mask": (lambda x: x[x > 0], SYNC_MSG),
}


def assert_usable(B):
    B.set_stream(B.default_stream())
    y = torch.ones(3, device=B.device)
    g, z = capture(B, lambda: y * 2)
    g.replay()
    assert z.tolist() == [2.0, 2.0, 2.0]


@pytest.mark.parametrize("what", sorted(FORBIDDEN))
def test_forbidden_during_capture(B, what):
    body, message = FORBIDDEN[what]
    x = torch.randn(4, device=B.device)
    with pytest.raises(RuntimeError) as info:
        capture(B, lambda: body(x))
    assert message in error_text(info.value)
    assert_usable(B)                            # the process stays usable


def test_synchronize_during_capture(B):
    with pytest.raises(RuntimeError) as info:
        capture(B, B.synchronize)
    assert SYNC_MSG in error_text(info.value)
    assert_usable(B)


def test_capture_on_default_stream_refused(B):
    g = B.CUDAGraph()
    with pytest.raises(RuntimeError, match="non-default stream"):
        g.capture_begin()
    assert_usable(B)


def test_second_capture_needs_reset(B):
    a = torch.ones(2, device=B.device)
    g, _ = capture(B, lambda: a + 1)
    with pytest.raises(RuntimeError, match="already owns a captured graph"):
        with B.graph(g):
            a + 2
    B.set_stream(B.default_stream())
    g.reset()
    with B.graph(g):
        c = a + 2
    g.replay()
    assert c.tolist() == [3.0, 3.0]


def test_replay_without_capture(B):
    with pytest.raises(RuntimeError, match="without a preceding successful capture"):
        B.CUDAGraph().replay()


# ---- RNG -------------------------------------------------------------------------------

def test_default_generator_advances_per_replay(B):
    x = torch.ones(1000, device=B.device)
    g, y = capture(B, lambda: torch.nn.functional.dropout(x, 0.5))
    g.replay()
    first = y.clone()
    g.replay()
    assert not torch.equal(first, y)
    assert 0.4 < (y == 0).float().mean().item() < 0.6


def test_custom_generator_must_be_registered(B):
    gen = torch.Generator(device=B.device)
    gen.manual_seed(0)
    with pytest.raises(RuntimeError, match="Attempt to increase offset for a CUDA generator"):
        capture(B, lambda: torch.rand(4, device=B.device, generator=gen))
    B.set_stream(B.default_stream())
    g = B.CUDAGraph()
    g.register_generator_state(gen)
    with B.graph(g):
        r = torch.rand(4, device=B.device, generator=gen)
    g.replay()
    first = r.clone()
    g.replay()
    assert not torch.equal(first, r)


# ---- memory pools ----------------------------------------------------------------------

@pytest.mark.parametrize("shared, e_expected", [(True, 10.0), (False, 5.0)])
def test_three_successive_pool_reuse(B, shared, e_expected):
    """PyTorch's test_graph_three_successive: out-of-order replay corrupts a shared pool."""
    a = torch.ones(5, device=B.device)
    g0, g1, g2 = B.CUDAGraph(), B.CUDAGraph(), B.CUDAGraph()
    pool = B.graph_pool_handle() if shared else None
    with B.graph(g0, pool=pool):
        b = a.clone()
        c = b + 1
        d = b + 2
    with B.graph(g1, pool=g0.pool() if shared else None):
        e = c + 3
        del c
    with B.graph(g2, pool=g0.pool() if shared else None):
        f = d + 4
    for g in (g0, g1, g2):
        g.replay()
    assert (e[0].item(), f[0].item()) == (5.0, 7.0)          # capture order: right
    for g in (g0, g2, g1):
        g.replay()
    assert e[0].item() == e_expected                        # shared pool: f overwrote c


def test_capture_allocates_from_the_graphs_pool(B):
    x = torch.randn(256, 256, device=B.device)
    x @ x               # warm up first: cuBLAS initialises lazily, and not during capture
    B.synchronize()
    g, y = capture(B, lambda: x @ x)
    stats = B.pool_stats(g.pool())
    assert stats["allocated_bytes"] >= y.numel() * y.element_size()
    assert stats["reserved_bytes"] >= stats["allocated_bytes"]


# ---- autograd --------------------------------------------------------------------------

def test_autograd_grad_inside_capture(B):
    torch.manual_seed(0)
    lin = torch.nn.Linear(8, 4).to(B.device)
    x = torch.randn(16, 8, device=B.device, requires_grad=True)
    s = B.Stream()
    s.wait_stream(B.current_stream())
    with B.stream(s):                             # warm up on a side stream
        for _ in range(2):
            torch.autograd.grad(lin(x).tanh().sum(), (x, lin.weight))
    B.current_stream().wait_stream(s)
    g = B.CUDAGraph()
    with B.graph(g):
        gx, gw = torch.autograd.grad(lin(x).tanh().sum(), (x, lin.weight))
    for _ in range(3):
        with torch.no_grad():
            x.copy_(torch.randn(16, 8, device=B.device))
        g.replay()
        x2 = x.detach().clone().requires_grad_()
        ex, ew = torch.autograd.grad(lin(x2).tanh().sum(), (x2, lin.weight))
        torch.testing.assert_close(gx, ex)
        torch.testing.assert_close(gw, ew)


def _mlp(p_drop=0.0):
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(),
                               torch.nn.Dropout(p_drop), torch.nn.Linear(32, 4))


def test_make_graphed_callables_matches_eager(B):
    torch.manual_seed(0)
    graphed, eager = _mlp().to(B.device), _mlp().to(B.device)
    eager.load_state_dict(graphed.state_dict())
    opt_g = torch.optim.SGD(graphed.parameters(), lr=0.1)
    opt_e = torch.optim.SGD(eager.parameters(), lr=0.1)
    sample = torch.randn(16, 8, device=B.device, requires_grad=True)
    graphed = B.make_graphed_callables(graphed, (sample,))
    for _ in range(4):
        x = torch.randn(16, 8, device=B.device, requires_grad=True)
        target = torch.randn(16, 4, device=B.device)
        for model, opt in ((graphed, opt_g), (eager, opt_e)):
            opt.zero_grad()
            ((model(x) - target) ** 2).mean().backward()
            opt.step()
    for p, q in zip(graphed.parameters(), eager.parameters()):
        torch.testing.assert_close(p, q)


def test_make_graphed_callables_rejects_hooks(B):
    m = torch.nn.Linear(4, 4).to(B.device)
    m.register_forward_hook(lambda *a: None)
    with pytest.raises(AssertionError, match="must not have hooks"):
        B.make_graphed_callables(m, (torch.randn(2, 4, device=B.device),))


def test_make_graphed_callables_keeps_dropout_random(B):
    torch.manual_seed(0)
    m = B.make_graphed_callables(_mlp(0.5).to(B.device),
                                 (torch.randn(16, 8, device=B.device, requires_grad=True),))
    x = torch.randn(16, 8, device=B.device, requires_grad=True)
    first = m(x).detach().clone()
    second = m(x).detach().clone()
    assert not torch.equal(first, second)


# ---- is_current_stream_capturing --------------------------------------------------------

def test_is_current_stream_capturing(B):
    assert not B.is_current_stream_capturing()
    flags = []
    g = B.CUDAGraph()
    with B.graph(g):
        flags.append(B.is_current_stream_capturing())
    assert flags == [True]
    assert not B.is_current_stream_capturing()


def test_failed_capture_leaves_default_generator_in_capture_mode(B):
    """Observed on an H200: the generator's capture epilogue never runs after a failed
    capture, so random ops outside capture raise until a capture ends well."""
    x = torch.randn(4, device=B.device)
    with pytest.raises(RuntimeError):
        capture(B, lambda: x.sum().item())
    B.set_stream(B.default_stream())
    with pytest.raises(RuntimeError, match="Offset increment outside graph capture"):
        torch.randn(2, device=B.device)
    backend.recover(B)
    assert B.current_stream() == B.default_stream()
    assert torch.randn(2, device=B.device).shape == (2,)
