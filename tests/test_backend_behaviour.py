"""What CUDA graphs do, asserted once and run on every backend.

Each test states one rule of CUDA graphs (as observed on an H200 with torch 2.11). On a
GPU the rule is checked against torch.cuda itself; on the CPU against labkit's emulator.
"""

import numpy as np
import pytest
import torch

from labkit import backend
from labkit.capture import paused_gc
from labkit.guards import error_text


def capture(B, fn, pool=None):
    """Capture ``fn()`` into a new graph on a side stream; return (graph, fn's result).

    The collector is paused during the capture (``labkit.capture.paused_gc``): a graph of
    an earlier test freed mid-capture would invalidate it for a reason not under test."""
    g = B.CUDAGraph()
    with paused_gc(), B.graph(g, pool=pool):
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
    gen = B.Generator()
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


# ---- data-dependent output sizes -------------------------------------------------------
# An op whose output size depends on the values must learn that size before it allocates
# its output: on a GPU it copies a count to the host and waits (nonzero_cuda_out_impl's
# memcpy_and_sync, repeat_interleave_common's .item()), which capture refuses. Its
# fixed-size relatives need no count and capture.

def _dd_inputs(B):
    x = torch.randn(8, device=B.device)
    reps = torch.tensor([2, 0, 1, 1], device=B.device)
    return x, x > 0, reps, torch.zeros((), device=B.device)


def _assign(x, mask, value):
    y = x.clone()
    y[mask] = value
    return y


DATA_DEPENDENT_SIZE = {         # op, and the root cause a GPU reports (H200, torch 2.11)
    "nonzero": (lambda x, m, r, z: torch.nonzero(m), SYNC_MSG),
    "where_one_argument": (lambda x, m, r, z: torch.where(m), SYNC_MSG),
    "boolean_mask_read": (lambda x, m, r, z: x[m], SYNC_MSG),
    "masked_select": (lambda x, m, r, z: torch.masked_select(x, m), SYNC_MSG),
    "boolean_mask_assign_device_tensor": (lambda x, m, r, z: _assign(x, m, z), SYNC_MSG),
    "unique": (lambda x, m, r, z: torch.unique(x), SYNC_MSG),
    "unique_consecutive": (lambda x, m, r, z: torch.unique_consecutive(x), SYNC_MSG),
    "repeat_interleave_tensor_repeats": (lambda x, m, r, z: x[:4].repeat_interleave(r), SYNC_MSG),
    "repeat_interleave_repeats_only": (lambda x, m, r, z: torch.repeat_interleave(r), SYNC_MSG),
    # _bincount_cuda_template copies the smallest value to the host with .cpu(): torch's
    # own host-copy check refuses it first (and the capture itself is not invalidated)
    "bincount": (lambda x, m, r, z: torch.bincount(r), HOST_COPY_MSG),
    # histc with min == max (the default) copies the data's range to the host
    "histc_without_range": (lambda x, m, r, z: torch.histc(x), HOST_COPY_MSG),
    # not a size, but the same wait: a device tensor as masked_fill's value is read with
    # .item() (masked_fill__cuda)
    "masked_fill_device_tensor_value": (lambda x, m, r, z: x.masked_fill(m, z), SYNC_MSG),
}

FIXED_SIZE = {
    "where_three_arguments": lambda x, m, r, z: torch.where(m, x, 0),
    "where_device_tensor_value": lambda x, m, r, z: torch.where(m, z, x),
    "masked_fill_number": lambda x, m, r, z: x.masked_fill(m, 0.0),
    "boolean_mask_assign_number": lambda x, m, r, z: _assign(x, m, 0.0),  # -> masked_fill_
    "nonzero_static": lambda x, m, r, z: torch.nonzero_static(m, size=8),
    "repeat_interleave_output_size": lambda x, m, r, z: x[:4].repeat_interleave(r, output_size=4),
    "repeat_interleave_int": lambda x, m, r, z: x.repeat_interleave(2),
    "histc_with_range": lambda x, m, r, z: torch.histc(x, bins=4, min=-3, max=3),
}


@pytest.mark.parametrize("what", sorted(DATA_DEPENDENT_SIZE))
def test_data_dependent_size_fails_capture(B, what):
    (op, message), inputs = DATA_DEPENDENT_SIZE[what], _dd_inputs(B)
    op(*inputs)                                 # eagerly it works (and is warmed up)
    B.synchronize()
    with pytest.raises(RuntimeError) as info:
        capture(B, lambda: op(*inputs))
    assert message in error_text(info.value)
    assert_usable(B)


@pytest.mark.parametrize("what", sorted(FIXED_SIZE))
def test_fixed_size_relatives_capture_and_replay(B, what):
    op, inputs = FIXED_SIZE[what], _dd_inputs(B)
    x, mask, _, _ = inputs
    op(*inputs)
    B.synchronize()
    g, out = capture(B, lambda: op(*inputs))
    for _ in range(2):                          # new data, same memory: replay follows it
        x.copy_(torch.randn(8, device=B.device))
        mask.copy_(x > 0)
        g.replay()
        torch.testing.assert_close(out, op(*inputs), rtol=0, atol=0)


# ---- other threads during a capture ----------------------------------------------------

@pytest.mark.parametrize("mode", ["global", "thread_local", "relaxed"])
def test_another_threads_kernels_are_not_captured(B, mode):
    """Another thread's kernels run for real during a capture and are not in the graph.

    An in-place kernel needs no allocation, so no mode refuses it (modes decide about
    potentially unsafe API calls such as cudaMalloc, below)."""
    import threading

    counter = torch.zeros(1, device=B.device)
    x = torch.ones(2, device=B.device)
    capturing, done = threading.Event(), threading.Event()

    def other():
        capturing.wait()
        counter.add_(1)                         # on this thread's own (default) stream
        done.set()

    t = threading.Thread(target=other)
    t.start()
    g = B.CUDAGraph()
    with B.graph(g, capture_error_mode=mode):
        y = x * 3
        capturing.set()
        assert done.wait(timeout=60)
    t.join()
    B.synchronize()
    assert counter.item() == 1.0                # it ran once, for real
    for _ in range(3):
        g.replay()
    B.synchronize()
    assert counter.item() == 1.0 and y.tolist() == [3.0, 3.0]


def _more_than_cached(B) -> int:
    """A size no cached block can hold: on a GPU more than the allocator has reserved; the
    emulator's streams in these tests are new, so any size needs a segment there."""
    reserved = torch.cuda.memory_reserved() if B.name == "cuda" else 0
    return reserved + 256 * 2**20


@pytest.mark.parametrize("mode", ["global", "thread_local", "relaxed"])
def test_capture_error_mode_and_another_threads_cudamalloc(B, mode):
    """Under "global" another thread's cudaMalloc is refused and the capture invalidated;
    "thread_local" and "relaxed" let it through (observed on an H200, torch 2.11). The
    other thread asks for more than the allocator has cached, so it must call cudaMalloc
    (the emulator models the per-stream cache: labkit.emulator.allocator)."""
    import threading

    x = torch.ones(4, device=B.device)
    capturing, done, seen = threading.Event(), threading.Event(), {}
    nbytes = _more_than_cached(B)

    def other():
        capturing.wait()
        try:
            with B.stream(B.Stream(priority=-1)):
                torch.empty(nbytes, dtype=torch.uint8, device=B.device)
            seen["other"] = None
        except RuntimeError as e:
            seen["other"] = e
        done.set()

    t = threading.Thread(target=other)
    t.start()
    g = B.CUDAGraph()
    try:
        with B.graph(g, capture_error_mode=mode):
            y = x * 2
            capturing.set()
            assert done.wait(timeout=60)
        captured = None
    except RuntimeError as e:
        captured = e
    finally:
        t.join()
        backend.recover(B)
    if mode == "global":
        assert seen["other"] is not None and SYNC_MSG in error_text(seen["other"])
        assert captured is not None
        assert "operation failed due to a previous error during capture" in error_text(captured)
    else:
        assert seen["other"] is None and captured is None
        g.replay()
        assert y.tolist() == [2.0] * 4


@pytest.mark.parametrize("mode", ["global", "thread_local", "relaxed"])
def test_synchronize_from_another_thread_invalidates_the_capture(B, mode):
    """No capture_error_mode lets another thread synchronize the device: it would wait for
    the capturing stream. The call is refused and the capture invalidated (H200, torch
    2.11); the emulator does the same."""
    import threading

    x = torch.ones(2, device=B.device)
    capturing, done, seen = threading.Event(), threading.Event(), {}

    def other():
        capturing.wait()
        try:
            B.synchronize()
            seen["other"] = None
        except RuntimeError as e:
            seen["other"] = e
        done.set()

    t = threading.Thread(target=other)
    t.start()
    with pytest.raises(RuntimeError) as info:
        with B.graph(B.CUDAGraph(), capture_error_mode=mode):
            x * 2
            capturing.set()
            assert done.wait(timeout=60)
    t.join()
    assert seen["other"] is not None and SYNC_MSG in error_text(seen["other"])
    assert "operation failed due to a previous error during capture" in error_text(info.value)
    assert_usable(B)


# ---- the host is not the device (issue 17; every rule read off an H200, torch 2.11) ------

INVALIDATED_MSG = "operation failed due to a previous error during capture"
UNJOINED_MSG = "capturing stream has unjoined work"


def _sync_replay(B, g):
    g.replay()
    B.synchronize()


TO_HOST = {
    "cpu": lambda y: y.cpu(),
    "to_cpu": lambda y: y.to("cpu"),
    "tolist": lambda y: y.tolist(),
}


@pytest.mark.parametrize("what", sorted(TO_HOST))
def test_copy_to_the_host_during_capture_is_refused(B, what):
    x = torch.arange(4.0, device=B.device)
    with pytest.raises(RuntimeError) as info:
        capture(B, lambda: TO_HOST[what](x * 2))
    assert HOST_COPY_MSG in error_text(info.value)
    assert_usable(B)


def test_numpy_of_a_device_tensor_is_refused_always(B):
    x = torch.arange(4.0, device=B.device)
    with pytest.raises(TypeError, match="device type tensor to numpy. Use Tensor.cpu()"):
        x.numpy()
    assert x.cpu().numpy().tolist() == [0.0, 1.0, 2.0, 3.0]


FROM_HOST = {
    "tensor_list": lambda B, x: torch.tensor([1.0, 2.0, 3.0, 4.0], device=B.device) + x,
    "tensor_scalar": lambda B, x: x + torch.tensor(2.0, device=B.device),
    "as_tensor_numpy": lambda B, x: torch.as_tensor(np.ones(4, dtype=np.float32),
                                                    device=B.device) + x,
    "host_to_device": lambda B, x: torch.ones(4).to(B.device) + x,
}


@pytest.mark.parametrize("what", sorted(FROM_HOST))
def test_a_device_tensor_from_host_data_during_capture_is_refused(B, what):
    x = torch.arange(4.0, device=B.device)
    with pytest.raises(RuntimeError) as info:
        capture(B, lambda: FROM_HOST[what](B, x))
    assert HOST_COPY_MSG in error_text(info.value)
    assert_usable(B)


def test_to_the_device_it_is_on_is_no_copy(B):
    x = torch.arange(4.0, device=B.device)
    g, y = capture(B, lambda: x.to(B.device) + 1)
    _sync_replay(B, g)
    assert y.tolist() == [1.0, 2.0, 3.0, 4.0]


def test_a_0dim_host_tensor_is_read_once_at_capture(B):
    x = torch.arange(4.0, device=B.device)
    scale = torch.tensor(2.0)                     # a host tensor, used as a scalar
    g, y = capture(B, lambda: x * scale)
    _sync_replay(B, g)
    assert y.tolist() == [0.0, 2.0, 4.0, 6.0]
    scale.fill_(5.0)                              # changes nothing: the 2.0 is baked in
    _sync_replay(B, g)
    assert y.tolist() == [0.0, 2.0, 4.0, 6.0]
    assert (x * scale).tolist() == [0.0, 5.0, 10.0, 15.0]    # eagerly it is read each call


def test_host_work_during_capture_runs_on_the_host_now(B):
    x = torch.arange(4.0, device=B.device)
    host = torch.ones(3)

    def body():
        factor = torch.tensor(7.0).item()        # a host read: no device sync
        assert torch.equal(host * 2, torch.full((3,), 2.0))
        return x * factor

    g, y = capture(B, body)
    _sync_replay(B, g)
    assert y.tolist() == [0.0, 7.0, 14.0, 21.0]


def test_a_host_tensor_with_dimensions_is_on_another_device(B):
    x = torch.arange(4.0, device=B.device)
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
        x + torch.ones(4)
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
        x.add_(torch.ones(4))
    assert x.tolist() == [0.0, 1.0, 2.0, 3.0]             # refused before anything ran
    with pytest.raises(RuntimeError) as info:
        capture(B, lambda: x * torch.tensor([2.0]))
    assert "Expected all tensors to be on the same device" in error_text(info.value)
    assert_usable(B)


def test_host_index_tensor_eagerly_yes_in_capture_no(B):
    x = torch.arange(4.0, device=B.device)
    idx = torch.tensor([0, 2])
    assert x[idx].tolist() == [0.0, 2.0]          # copied to the device for you
    with pytest.raises(RuntimeError) as info:
        capture(B, lambda: x[idx])                # ... from pageable memory: refused
    assert HOST_COPY_MSG in error_text(info.value)
    assert_usable(B)


@pytest.mark.parametrize("non_blocking", [False, True])
def test_copies_with_pageable_host_memory_are_refused(B, non_blocking):
    x = torch.arange(4.0, device=B.device)
    dst = torch.zeros(4, device=B.device)
    for body in (lambda: dst.copy_(torch.full((4,), 3.0), non_blocking=non_blocking),
                 lambda: torch.zeros(4).copy_(x * 2, non_blocking=non_blocking)):
        with pytest.raises(RuntimeError) as info:
            capture(B, body)
        assert HOST_COPY_MSG in error_text(info.value)
        assert_usable(B)


def test_pin_memory_gives_pinned_host_memory(B):
    pinned = torch.full((4,), 3.0).pin_memory()
    assert pinned.is_pinned() and pinned.device.type == "cpu"
    assert not torch.full((4,), 3.0).is_pinned()
    assert pinned.tolist() == [3.0] * 4


def test_async_copy_from_pinned_memory_rereads_it_every_replay(B):
    dst = torch.zeros(4, device=B.device)
    pinned = torch.full((4,), 3.0).pin_memory()
    g, _ = capture(B, lambda: dst.copy_(pinned, non_blocking=True))
    _sync_replay(B, g)
    assert dst.tolist() == [3.0] * 4
    pinned.fill_(9.0)                             # the graph reads the host buffer again
    _sync_replay(B, g)
    assert dst.tolist() == [9.0] * 4


def test_async_copy_into_pinned_memory_writes_it_every_replay(B):
    x = torch.arange(4.0, device=B.device)
    host = torch.zeros(4).pin_memory()
    g, _ = capture(B, lambda: host.copy_(x * 2, non_blocking=True))
    assert host.tolist() == [0.0] * 4             # nothing ran at capture
    x.fill_(1.0)
    _sync_replay(B, g)
    assert host.tolist() == [2.0] * 4


def test_a_blocking_copy_with_pinned_memory_fails_the_capture(B):
    x = torch.arange(4.0, device=B.device)
    dst = torch.zeros(4, device=B.device)
    pinned = torch.full((4,), 3.0).pin_memory()
    for body in (lambda: dst.copy_(pinned), lambda: pinned.copy_(x * 2)):
        with pytest.raises(RuntimeError) as info:
            capture(B, body)
        assert INVALIDATED_MSG in error_text(info.value)
        assert_usable(B)


def test_repr_of_a_device_tensor_outside_capture(B):
    text = repr(torch.arange(3.0, device=B.device))
    assert text.startswith("tensor([0., 1., 2.]") and f"device='{B.device}'" in text


# ---- streams in capture ------------------------------------------------------------------

def _fork(B):
    # a high-priority stream: torch hands out pooled streams round-robin, so after enough
    # of them a B.Stream() of the default priority is the capture stream itself
    cur, side = B.current_stream(), B.Stream(priority=-1)
    side.wait_stream(cur)
    return cur, side


def test_a_fork_joined_back_is_captured(B):
    x = torch.arange(4.0, device=B.device)

    def body():
        cur, side = _fork(B)
        with B.stream(side):
            assert B.is_current_stream_capturing()    # the side stream joined the capture
            y = x * 2
        cur.wait_stream(side)
        return y

    g, y = capture(B, body)
    x.fill_(1.0)
    _sync_replay(B, g)
    assert y.tolist() == [2.0] * 4


def test_a_fork_joined_by_events_is_captured(B):
    x = torch.arange(4.0, device=B.device)

    def body():
        cur, side = B.current_stream(), B.Stream(priority=-1)
        forked = B.Event()
        forked.record(cur)
        side.wait_event(forked)
        with B.stream(side):
            y = x * 3
        done = B.Event()
        done.record(side)
        cur.wait_event(done)
        return y

    g, y = capture(B, body)
    _sync_replay(B, g)
    assert y.tolist() == [0.0, 3.0, 6.0, 9.0]


def test_a_fork_through_two_side_streams_joined_at_the_end(B):
    x = torch.arange(4.0, device=B.device)

    def body():
        cur, s1, s2 = B.current_stream(), B.Stream(priority=-1), B.Stream(priority=-1)
        s1.wait_stream(cur)
        with B.stream(s1):
            y = x * 2
        s2.wait_stream(s1)
        with B.stream(s2):
            z = y + 1
        cur.wait_stream(s2)
        return z

    g, z = capture(B, body)
    _sync_replay(B, g)
    assert z.tolist() == [1.0, 3.0, 5.0, 7.0]


def test_a_fork_with_no_work_needs_no_join(B):
    x = torch.arange(4.0, device=B.device)

    def body():
        _fork(B)
        return x * 2

    g, y = capture(B, body)
    _sync_replay(B, g)
    assert y.tolist() == [0.0, 2.0, 4.0, 6.0]


def _unjoined(B, x):
    cur, side = _fork(B)
    with B.stream(side):
        return x * 2


def _work_after_the_join(B, x):
    cur, side = _fork(B)
    with B.stream(side):
        y = x * 2
    cur.wait_stream(side)
    with B.stream(side):
        y.add_(1)
    return y


def _one_of_two_forks_joined(B, x):
    cur, s1, s2 = B.current_stream(), B.Stream(priority=-1), B.Stream(priority=-1)
    s1.wait_stream(cur)
    with B.stream(s1):
        x * 2
    s2.wait_stream(cur)
    with B.stream(s2):
        z = x + 1
    cur.wait_stream(s2)
    return z


@pytest.mark.parametrize("body", [_unjoined, _work_after_the_join, _one_of_two_forks_joined])
def test_side_stream_work_never_joined_fails_at_capture_end(B, body):
    x = torch.arange(4.0, device=B.device)
    with pytest.raises(RuntimeError) as info:
        capture(B, lambda: body(B, x))
    assert UNJOINED_MSG in error_text(info.value)
    assert_usable(B)


@pytest.mark.parametrize("which", ["unrelated side stream", "default stream"])
def test_work_on_a_stream_outside_the_capture_runs_now(B, which):
    x = torch.arange(4.0, device=B.device)
    w = torch.zeros(4, device=B.device)
    # a high-priority stream: torch hands out pooled streams round-robin, so a second
    # B.Stream() of the default priority may be the capture stream itself
    other = B.Stream(priority=-1) if which == "unrelated side stream" else B.default_stream()

    def body():
        with B.stream(other):
            assert not B.is_current_stream_capturing()
            w.add_(1)                             # not part of the graph: runs now
        return x * 2

    g, y = capture(B, body)
    B.synchronize()
    assert w.tolist() == [1.0] * 4
    _sync_replay(B, g)
    assert w.tolist() == [1.0] * 4 and y.tolist() == [0.0, 2.0, 4.0, 6.0]


# ---- torch's own capturable optimizer ------------------------------------------------------

def test_torch_capturable_adamw_is_captured_and_matches_eager(B):
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(6, device=B.device))
    q = torch.nn.Parameter(p.detach().clone())
    grads = [torch.randn(6, device=B.device) for _ in range(4)]
    p.grad = torch.zeros_like(p)
    opt = torch.optim.AdamW([p], lr=0.1, capturable=True, foreach=True)
    ref = torch.optim.AdamW([q], lr=0.1)
    p.grad.copy_(grads[0])
    opt.step()                                    # the state exists before capture
    s = B.Stream()
    s.wait_stream(B.current_stream())
    B.current_stream().wait_stream(s)
    g, _ = capture(B, opt.step)
    q.grad = grads[0].clone()
    ref.step()
    for grad in grads[1:]:
        p.grad.copy_(grad)
        _sync_replay(B, g)
        q.grad = grad.clone()
        ref.step()
    torch.testing.assert_close(p.detach(), q.detach())
    assert opt.state[p]["step"].item() == 4.0


def test_a_pageable_copy_on_a_stream_outside_the_capture_is_refused(B):
    """Torch's own check looks at the *current* stream only; on another stream a copy with
    pageable memory reaches CUDA, where it is a synchronous memcpy: the default "global"
    capture mode refuses it and invalidates the capture (H200, torch 2.11)."""
    x = torch.arange(4.0, device=B.device)
    dst = torch.zeros(4, device=B.device)
    other = B.Stream(priority=-1)         # not the capture stream (see above)

    def body():
        with B.stream(other):
            dst.copy_(torch.full((4,), 7.0))
        return x * 2

    with pytest.raises(RuntimeError) as info:
        capture(B, body)
    assert SYNC_MSG in error_text(info.value) and INVALIDATED_MSG in error_text(info.value)
    assert_usable(B)


# ---- issue 29: autocast, device generators, seeds, staged copies, unsafe calls ----------
# Each rule was seen on an H200 with torch 2.11 before the emulator reproduced it.

def _amp_layer(B):
    torch.manual_seed(0)
    return torch.nn.Linear(8, 4).to(B.device)


AUTOCAST_DTYPES = {        # op under torch.autocast(device, float16) -> the dtype CUDA gives
    "matmul (lower_precision_fp)": (lambda x, h: x @ x.t(), torch.float16),
    "linear (lower_precision_fp)": (lambda x, h: torch.nn.functional.linear(x, x), torch.float16),
    "softmax (fp32_set_opt_dtype)": (lambda x, h: torch.softmax(h, -1), torch.float32),
    "sum (fp32_set_opt_dtype)": (lambda x, h: h.sum(), torch.float32),
    "exp (fp32)": (lambda x, h: h.exp(), torch.float32),
    "layer_norm (fp32)": (lambda x, h: torch.nn.functional.layer_norm(h, (8,)), torch.float32),
    "mse_loss (fp32)": (lambda x, h: torch.nn.functional.mse_loss(h, h), torch.float32),
    "sum with a dtype given (fp32_set_opt_dtype keeps it)":
        (lambda x, h: h.sum(dtype=torch.float16), torch.float16),
    "Tensor.norm (linalg_vector_norm: fp32_set_opt_dtype)": (lambda x, h: h.norm(), torch.float32),
    "aten.norm.Scalar (fp32_append_dtype)":
        (lambda x, h: torch.ops.aten.norm.Scalar(h, 2), torch.float32),
    "addcmul (promote)": (lambda x, h: torch.addcmul(h, h, x), torch.float32),
    "addcmul of float16 only (promote)": (lambda x, h: torch.addcmul(h, h, h), torch.float16),
    "add (not listed: no cast)": (lambda x, h: h + 1, torch.float16),
    "relu of float32 (not listed)": (lambda x, h: torch.relu(x), torch.float32),
}


@pytest.mark.parametrize("what", sorted(AUTOCAST_DTYPES))
def test_autocast_casts_each_op_by_cudas_policy(B, what):
    op, dtype = AUTOCAST_DTYPES[what]
    x = torch.randn(4, 8, device=B.device)
    h = x.half()
    with torch.autocast(B.device.type, dtype=torch.float16):
        assert op(x, h).dtype == dtype
    with torch.autocast(B.device.type, dtype=torch.float16, enabled=False):
        assert (x @ x.t()).dtype == torch.float32        # disabled: no cast
    with torch.autocast(B.device.type):
        assert (x @ x.t()).dtype == torch.float16        # the default dtype, as for CUDA


def test_autocast_bfloat16_host_tensors_and_gradients(B):
    lin = _amp_layer(B)
    x = torch.randn(2, 8, device=B.device, requires_grad=True)
    with torch.autocast(B.device.type, dtype=torch.bfloat16):
        y = lin(x)
        host = torch.ones(2, 2)
        assert (host @ host).dtype == torch.float32       # the host's own autocast is off
    assert y.dtype == torch.bfloat16
    y.float().sum().backward()
    assert x.grad.dtype == torch.float32 and lin.weight.grad.dtype == torch.float32


def test_autocast_refuses_binary_cross_entropy(B):
    p = torch.rand(4, device=B.device)
    with torch.autocast(B.device.type, dtype=torch.float16):
        with pytest.raises(RuntimeError, match="binary_cross_entropy and torch.nn.BCELoss are "
                                               "unsafe to autocast"):
            torch.nn.functional.binary_cross_entropy(p, p)
        with_logits = torch.nn.functional.binary_cross_entropy_with_logits(p, p)
    assert with_logits.dtype == torch.float32


def test_autocast_inside_a_capture_replays_the_casts(B):
    """The casts are kernels in the graph: each replay casts the weight as it is now, so an
    in-place update of the float32 weight shows. (With the cast cache on, a GPU would reuse
    the float16 copy made before the capture: that is why this test, like
    make_graphed_callables, turns the cache off; the emulator has no cache.)"""
    lin = _amp_layer(B)
    x = torch.randn(2, 8, device=B.device)
    with torch.autocast(B.device.type, dtype=torch.float16, cache_enabled=False):
        lin(x)                                           # warm up (cuBLAS)
        B.synchronize()
        g, y = capture(B, lambda: lin(x))
    with torch.no_grad():
        lin.weight.add_(1.0)
    x.copy_(torch.randn(2, 8, device=B.device))
    g.replay()
    with torch.autocast(B.device.type, dtype=torch.float16, cache_enabled=False):
        expected = lin(x)
    assert y.dtype == torch.float16
    torch.testing.assert_close(y, expected)


def test_make_graphed_callables_refuses_the_autocast_cache(B):
    lin = _amp_layer(B)
    sample = (torch.randn(2, 8, device=B.device, requires_grad=True),)
    with torch.autocast(B.device.type, dtype=torch.float16):
        with pytest.raises(RuntimeError, match="does not support the autocast caching. "
                                               "Please set `cache_enabled=False`"):
            B.make_graphed_callables(lin, sample)
    with torch.autocast(B.device.type, dtype=torch.float16, cache_enabled=False):
        graphed = B.make_graphed_callables(lin, sample)
        x = torch.randn(2, 8, device=B.device, requires_grad=True)
        y = graphed(x)
        expected = lin(x)
    assert y.dtype == torch.float16
    torch.testing.assert_close(y, expected)
    y.float().sum().backward()
    assert x.grad is not None and x.grad.dtype == torch.float32


def test_the_emulator_has_a_policy_for_every_op_cuda_autocasts():
    """Reads the installed torch's AutocastCUDA kernels: a torch that autocasts a new op
    fails here until labkit.emulator.autocast.POLICIES says how."""
    from labkit.emulator.autocast import autocast_ops, missing_policies

    assert "aten::mm" in autocast_ops()
    assert missing_policies() == []


def test_an_op_the_emulated_device_never_dispatches_needs_no_policy():
    """cuDNN's RNN is autocast on CUDA builds only (torch 2.11 on an H200 lists it, a CPU
    wheel does not): the table names it as never reached, with the reason, and gives it
    no policy."""
    from labkit.emulator.autocast import NOT_REACHED, POLICIES, missing_policies

    assert "cuDNN" in NOT_REACHED["aten::_cudnn_rnn"] and "aten::_cudnn_rnn" not in POLICIES
    assert "aten::_cudnn_rnn" not in missing_policies()


def test_a_generator_for_the_device(B):
    gen = B.Generator(device=B.device)
    gen.manual_seed(7)
    first = torch.rand(4, device=B.device, generator=gen)
    gen.manual_seed(7)
    assert torch.equal(first, torch.rand(4, device=B.device, generator=gen))
    g = B.CUDAGraph()
    g.register_generator_state(gen)
    with B.graph(g):
        r = torch.rand(4, device=B.device, generator=gen)
    g.replay()
    before = r.clone()
    g.replay()
    assert not torch.equal(before, r)


SEED_MSG = ("CUDAGeneratorImpl::set_current_seed can be called during stream capture only "
            "if new seed is the same as the original seed")


def test_manual_seed_during_a_capture(B):
    """Since torch 2.10 a capture lets torch.manual_seed set the seed the generator already
    has (a no-op) and refuses another, without invalidating the capture."""
    torch.manual_seed(1234)
    x = torch.ones(4, device=B.device)

    def same_seed():
        torch.manual_seed(1234)
        return x * 2

    g, y = capture(B, same_seed)
    _sync_replay(B, g)
    assert y.tolist() == [2.0] * 4
    with pytest.raises(RuntimeError, match=SEED_MSG):
        capture(B, lambda: torch.manual_seed(4321))
    assert B.current_stream() == B.default_stream()      # capture_end ran, and succeeded
    torch.randn(2, device=B.device)                        # the generator is not stuck
    assert torch.initial_seed() == 1234                    # refused before the host's seed
    assert_usable(B)


STAGED = {      # a copy with pinned memory that cannot be one cudaMemcpy
    "column_view_to_device": lambda B, p, d, x: p[:, :2].to(B.device, non_blocking=True),
    "copy_from_a_column_view": lambda B, p, d, x: d.copy_(p[:, :2], non_blocking=True),
    "copy_into_a_column_view": lambda B, p, d, x: p[:, :2].copy_(x * 2, non_blocking=True),
    "transposed_into_contiguous": lambda B, p, d, x: torch.empty(4, 3, device=B.device)
    .copy_(p.t(), non_blocking=True),
    # a blocking copy converts the dtype on the host, into a new (pageable) tensor: torch's
    # check refuses it before the blocking memcpy could fail the capture
    "blocking_with_a_dtype_conversion": lambda B, p, d, x: p.to(B.device, dtype=torch.float16),
}

ONE_MEMCPY = {  # pinned copies that are one cudaMemcpy: captured, re-read every replay
    "rows_slice": lambda B, p: p[1:].to(B.device, non_blocking=True),
    "transposed_keeps_its_strides": lambda B, p: p.t().to(B.device, non_blocking=True),
    "dtype_converted_on_the_device": lambda B, p: p.to(B.device, dtype=torch.float16,
                                                       non_blocking=True),
}


@pytest.mark.parametrize("what", sorted(STAGED))
def test_a_pinned_copy_staged_through_pageable_memory_is_refused(B, what):
    """copy_kernel_cuda copies a non-contiguous view through a contiguous temporary, and
    a host temporary is pageable: the pinned-memory check refuses it during capture."""
    pinned = torch.arange(12.0).reshape(3, 4).pin_memory()
    dst = torch.zeros(3, 2, device=B.device)
    x = torch.ones(3, 2, device=B.device)
    STAGED[what](B, pinned, dst, x)                       # eagerly it works
    B.synchronize()
    with pytest.raises(RuntimeError) as info:
        capture(B, lambda: STAGED[what](B, pinned, dst, x))
    assert HOST_COPY_MSG in error_text(info.value)
    assert_usable(B)


@pytest.mark.parametrize("what", sorted(ONE_MEMCPY))
def test_a_pinned_copy_that_is_one_memcpy_is_captured(B, what):
    pinned = torch.arange(12.0).reshape(3, 4).pin_memory()
    g, y = capture(B, lambda: ONE_MEMCPY[what](B, pinned))
    pinned.mul_(10)                                       # the graph reads it again
    _sync_replay(B, g)
    assert torch.equal(y.cpu(), ONE_MEMCPY[what](B, pinned).cpu())


@pytest.mark.parametrize("mode", ["global", "thread_local", "relaxed"])
def test_an_allocation_on_a_stream_outside_the_capture(B, mode):
    """Work on a stream outside the capture allocates from the caching allocator's blocks
    for that stream; one no cached block can hold needs cudaMalloc, which "global" and
    "thread_local" refuse from the capturing thread (invalidating the capture), and
    "relaxed" lets through."""
    x = torch.ones(4, device=B.device)
    other = B.Stream(priority=-1)            # not the capture stream (see above)
    nbytes = _more_than_cached(B)

    def capture_it():
        g = B.CUDAGraph()
        with B.graph(g, capture_error_mode=mode):
            y = x * 2
            with B.stream(other):
                torch.empty(nbytes, dtype=torch.uint8, device=B.device)
        return g, y

    if mode == "relaxed":
        g, y = capture_it()
        _sync_replay(B, g)
        assert y.tolist() == [2.0] * 4
        return
    with pytest.raises(RuntimeError) as info:
        capture_it()
    assert SYNC_MSG in error_text(info.value) and INVALIDATED_MSG in error_text(info.value)
    assert_usable(B)


def test_an_unknown_capture_error_mode_leaves_the_capture_stream_current(B):
    """torch.cuda.graph enters the capture stream, then capture_begin checks the mode."""
    with pytest.raises(RuntimeError, match="Unknown capture error mode. Expected `global`, "
                                           "`thread_local`, or `relaxed`, got local"):
        with B.graph(B.CUDAGraph(), capture_error_mode="local"):
            pass
    assert B.current_stream() != B.default_stream()
    assert not B.is_current_stream_capturing()
    backend.recover(B)
    assert_usable(B)
