"""labkit.capture (lesson 02): the capture/replay template, StaticGraph, recorded kernels,
pools, and the lesson 02 checkers. Runs on every backend (``B`` fixture)."""

from __future__ import annotations

import pytest
import torch

from labkit.capture import (
    Captured,
    StaticGraph,
    capture,
    format_pool_stats,
    recorded_kernels,
    short_kernel_name,
    side_stream_warmup,
)
from labkit.guards import GraphArgumentError


def _mlp(B):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(),
                               torch.nn.Linear(16, 4)).to(B.device)


# ---- the template ------------------------------------------------------------------------

def test_side_stream_warmup_runs_on_a_side_stream(B):
    seen = []

    def fn(x):
        seen.append(B.current_stream() == B.default_stream())
        return x + 1

    out = side_stream_warmup(fn, torch.zeros(3, device=B.device), B=B, iters=3)
    assert seen == [False, False, False]
    assert B.current_stream() == B.default_stream()
    assert out.tolist() == [1.0, 1.0, 1.0]


def test_capture_then_copy_replay_read_matches_eager(B):
    mlp = _mlp(B)
    static_x = torch.zeros(4, 8, device=B.device)
    with torch.no_grad():
        result = capture(mlp, static_x, B=B)
    assert isinstance(result, Captured)
    g, static_y = result
    for _ in range(3):
        x = torch.randn(4, 8, device=B.device)
        static_x.copy_(x)
        g.replay()
        with torch.no_grad():
            torch.testing.assert_close(static_y, mlp(x))


def test_capture_restores_the_stream_when_capture_fails(B):
    x = torch.randn(4, device=B.device)
    with pytest.raises(RuntimeError):
        capture(lambda t: t.sum().item(), x, B=B, warmup=0)
    assert B.current_stream() == B.default_stream()


# ---- StaticGraph -------------------------------------------------------------------------

def test_static_graph_matches_eager_and_owns_its_input(B):
    mlp = _mlp(B)
    sample = torch.randn(4, 8, device=B.device)
    sg = StaticGraph(mlp, B=B).capture(sample)
    assert sg.static_inputs[0] is not sample                 # its own static buffer
    for _ in range(3):
        x = torch.randn(4, 8, device=B.device)
        y = sg(x)
        with torch.no_grad():
            torch.testing.assert_close(y, mlp(x))
    assert (sg.replays, sg.copies) == (3, 3)
    sg.static_inputs[0].copy_(sample)                         # fill it in place ...
    sg(sg.static_inputs[0])                                   # ... and no copy is needed
    assert sg.copies == 3


def test_static_graph_output_is_overwritten_in_place(B):
    sg = StaticGraph(lambda x: x * 2, B=B).capture(torch.zeros(3, device=B.device))
    first = sg(torch.ones(3, device=B.device))
    kept = first.clone()
    second = sg(torch.full((3,), 5.0, device=B.device))
    assert second is first                                    # the same static tensor
    assert first.tolist() == [10.0, 10.0, 10.0]               # the held result changed
    assert kept.tolist() == [2.0, 2.0, 2.0]                   # the clone did not


def test_static_graph_refuses_use_before_capture(B):
    sg = StaticGraph(lambda x: x + 1, B=B, name="inc")
    for call in (lambda: sg(torch.ones(2, device=B.device)), sg.replay, sg.pool):
        with pytest.raises(RuntimeError, match=r"StaticGraph\(inc\) has not been captured yet"):
            call()


def test_static_graph_lists_every_mismatch_and_changes_nothing(B):
    sg = StaticGraph(lambda x, s: x * s, B=B, name="scale").capture(
        torch.ones(8, 8, device=B.device), 0.5)
    before = sg.static_inputs[0].clone()
    bad = torch.randn(4, 8, device=B.device, dtype=torch.float16)
    with pytest.raises(GraphArgumentError) as info:
        sg(bad, 0.7)
    msg = str(info.value)
    assert "StaticGraph(scale) refuses these arguments (3 mismatches" in msg
    assert "Tensor mismatch at args[0]: received shape (4, 8), captured (8, 8)" in msg
    assert "Tensor mismatch at args[0]: received dtype torch.float16, captured torch.float32" in msg
    assert "Value mismatch at args[1]: received 0.7, captured 0.5" in msg
    assert "one graph per shape" in msg and "baked in" in msg
    assert info.value.errors and len(info.value.errors) == 3
    assert torch.equal(sg.static_inputs[0], before) and sg.replays == 0 and sg.copies == 0


def test_static_graph_refuses_broadcastable_shapes_and_other_counts(B):
    sg = StaticGraph(lambda x: x + 1, B=B).capture(torch.zeros(4, 8, device=B.device))
    with pytest.raises(GraphArgumentError, match=r"received shape \(8,\), captured \(4, 8\)"):
        sg(torch.ones(8, device=B.device))          # copy_ would broadcast it silently
    with pytest.raises(GraphArgumentError, match="Count mismatch: received 2 positional"):
        sg(torch.ones(4, 8, device=B.device), torch.ones(1, device=B.device))
    with pytest.raises(GraphArgumentError, match="received device meta"):
        sg(torch.empty(4, 8, device="meta"))


def test_static_graph_capture_once_then_reset(B):
    sg = StaticGraph(lambda x: x + 1, B=B).capture(torch.zeros(2, device=B.device))
    with pytest.raises(RuntimeError, match="already captured"):
        sg.capture(torch.zeros(2, device=B.device))
    sg.reset()
    assert not sg.captured
    sg.capture(torch.zeros(3, device=B.device))
    assert sg(torch.ones(3, device=B.device)).tolist() == [2.0, 2.0, 2.0]


def test_static_graph_refuses_samples_on_another_device(B):
    with pytest.raises(ValueError, match=r"args\[0\] is on meta"):
        StaticGraph(lambda x: x, B=B).capture(torch.empty(2, device="meta"))


def test_static_graph_python_values_are_baked_in(B):
    sg = StaticGraph(lambda x, k: x * k, B=B).capture(torch.ones(2, device=B.device), 3.0)
    assert sg(torch.ones(2, device=B.device), 3.0).tolist() == [3.0, 3.0]
    assert "float 3.0" in repr(sg)


# ---- looking inside ----------------------------------------------------------------------

def test_recorded_kernels(B):
    x = torch.randn(64, device=B.device)
    with torch.no_grad():
        g, y = capture(lambda t: torch.relu(t * 2 + 1), x, B=B)
    names = recorded_kernels(g, B)
    assert names and all(isinstance(n, str) for n in names)
    if B.is_emulated:
        assert names == ["aten.mul.Tensor", "aten.add.Tensor", "aten.relu.default"]
    else:                               # one replay observed: its kernels, and the result
        assert len(names) >= 2
        torch.testing.assert_close(y, torch.relu(x * 2 + 1))


def test_short_kernel_name():
    long = ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add"
            "<float>, std::array<char*, 3ul> >(int, at::native::CUDAFunctor_add<float>, "
            "std::array<char*, 3ul>)")
    assert short_kernel_name(long) == "vectorized_elementwise_kernel[CUDAFunctor_add]"
    assert short_kernel_name("aten.addmm.default") == "aten.addmm.default"
    assert short_kernel_name("Memcpy DtoD (Device -> Device)") == "Memcpy DtoD"
    assert len(short_kernel_name("sm90_xmma_gemm_" + "x" * 200)) <= 80


def test_graphs_share_one_pool(B):
    x = torch.randn(256, device=B.device)
    pool = B.graph_pool_handle()
    g1, mid = capture(lambda t: t * 2, x, B=B, pool=pool)
    g2, out = capture(lambda t: t + 1, mid, B=B, pool=pool)
    g3, _ = capture(lambda t: t - 1, x, B=B)                    # a private pool
    assert tuple(g1.pool()) == tuple(g2.pool()) == tuple(pool)
    assert tuple(g3.pool()) != tuple(pool)
    g1.replay()
    g2.replay()
    torch.testing.assert_close(out, x * 2 + 1)
    stats = B.pool_stats(pool)
    assert stats["allocated_bytes"] >= 2 * 256 * 4
    assert stats["reserved_bytes"] >= stats["allocated_bytes"]


def test_format_pool_stats():
    line = format_pool_stats({"reserved_bytes": 2 * 2**20, "allocated_bytes": 1024,
                              "peak_bytes": 3072}, "shared")
    assert line == "shared: reserved 2.00 MiB, allocated 1.0 KiB, peak 3.0 KiB"
    assert "(device-wide)" in format_pool_stats({"peak_bytes": 1, "peak_is_device_wide": True})


# ---- the lesson 02 checkers --------------------------------------------------------------


def test_static_graph_nested_arguments(B):
    d = B.device
    sg = StaticGraph(lambda xs, k: xs[0] * k + xs[1], B=B).capture(
        [torch.zeros(3, device=d), torch.zeros(3, device=d)], 2.0)
    out = sg([torch.ones(3, device=d), torch.full((3,), 5.0, device=d)], 2.0)
    assert out.tolist() == [7.0, 7.0, 7.0] and sg.copies == 2
    assert "captured for ([Tensor(3) float32, Tensor(3) float32], float 2.0)" in repr(sg)
    with pytest.raises(GraphArgumentError, match=r"received shape \(4,\), captured \(3,\)"):
        sg([torch.ones(3, device=d), torch.ones(4, device=d)], 2.0)


# ---- the garbage collector during a capture ------------------------------------------------

def test_paused_gc_pauses_the_collector_and_restores_it():
    import gc

    from labkit.capture import paused_gc
    assert gc.isenabled()
    with paused_gc():
        assert not gc.isenabled()
        with paused_gc():                   # nested: the inner exit must not re-enable it
            pass
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(ZeroDivisionError), paused_gc():
        1 / 0
    assert gc.isenabled(), "a body that raised left the collector off"
    gc.disable()
    try:
        with paused_gc():
            pass
        assert not gc.isenabled(), "paused_gc turned on a collector its caller had turned off"
    finally:
        gc.enable()


def test_labkit_captures_run_with_the_collector_paused(B):
    import gc

    from labkit import bridge
    seen = []

    def fn(x):
        seen.append(gc.isenabled())
        return x * 2

    capture(fn, torch.ones(3, device=B.device), B=B, warmup=2)
    assert seen == [True, True, False], seen      # two warm-ups, then the capture

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x):
            seen.append(gc.isenabled())
            return self.lin(x)

    seen.clear()
    blk = Block().to(B.device)
    bridge.make_graphed_callables(blk, (torch.randn(2, 4, device=B.device,
                                                    requires_grad=True),),
                                  num_warmup_iters=1, B=B)
    assert seen[-1] is False and gc.isenabled(), seen


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_dead_cycle_holding_a_graph_does_not_break_a_later_capture_cuda():
    # torch.cuda.graph no longer collects garbage before a capture (unless
    # torch.compiler.config.force_cudagraph_gc): a collection that falls inside a capture
    # and frees a graph resets it mid-capture, which invalidates the capture under way
    import gc

    from labkit import backend
    Bc = backend.get("cuda")
    x = torch.ones(16, device=Bc.device)
    thresholds = gc.get_threshold()

    def fn(t):
        gc.set_threshold(1, 1, 1)            # from here, collect at almost every allocation
        return [t * k for k in range(50)]

    try:
        gc.set_threshold(10**6, 10**6, 10**6)      # nothing is collected before the capture
        old = capture(lambda t: t + 1, x, B=Bc)
        holder = {"graph": old.graph}
        holder["self"] = holder              # a cycle: only the collector frees it
        del old, holder
        new = capture(fn, x, B=Bc, warmup=0)
        new.graph.replay()
        torch.cuda.synchronize()
        assert float(new.output[3][0]) == 3.0
    finally:
        gc.set_threshold(*thresholds)
        gc.collect()
