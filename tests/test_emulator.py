"""Emulator-only details: the pool allocator, what gets recorded, and corner cases."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from labkit import backend
from labkit.emulator import pool as P


@pytest.fixture(autouse=True)
def on_the_device():
    """Every tensor these tests make is on the emulated device, unless they say otherwise:
    capture records device work only (host work runs at once, as on a GPU)."""
    with torch.device(backend.get("emulated").device):
        yield


def capture(E, fn, pool=None):
    g = E.CUDAGraph()
    with E.graph(g, pool=pool):
        out = fn()
    return g, out


def test_best_fit_split_and_coalesce():
    mp = P.MemPool(P.new_handle())
    s1, b1 = mp.allocate(1000)          # rounded to 1024
    s2, b2 = mp.allocate(512)
    assert (b1.size, b2.size) == (1024, 512) and b2.offset == 1024
    assert mp.stats()["reserved_bytes"] == P.SMALL_SEGMENT
    del s1
    s3, b3 = mp.allocate(600)           # best fit: the freed 1024 block, not the tail
    assert b3.offset == 0
    del s2, s3
    st = mp.stats()
    assert st["allocated_bytes"] == 0 and st["peak_bytes"] == 1536
    s4, b4 = mp.allocate(P.SMALL_SEGMENT)   # all free blocks coalesced back into one
    assert b4.offset == 0 and len(mp.segments) == 1 + 1  # too big for small: large segment


def test_large_allocations_get_their_own_segments():
    mp = P.MemPool(P.new_handle())
    _, b = mp.allocate(3 * P.MB)
    assert b.segment.size == P.LARGE_SEGMENT and not b.segment.small
    _, b2 = mp.allocate(30 * P.MB)
    assert b2.segment.size == 30 * P.MB


def test_shared_pool_reserves_less_than_separate_pools(E):
    x = torch.randn(64, 64)

    def chain(pool_of):
        graphs = []
        for _ in range(4):
            g = E.CUDAGraph()
            with E.graph(g, pool=pool_of(graphs)):
                tmp = x @ x
                y = tmp.relu()
                del tmp
            graphs.append((g, y))
        return graphs

    shared = chain(lambda gs: gs[0][0].pool() if gs else E.graph_pool_handle())
    separate = chain(lambda gs: None)
    reserved_shared = E.pool_stats(shared[0][0].pool())["reserved_bytes"]
    reserved_separate = sum(E.pool_stats(g.pool())["reserved_bytes"] for g, _ in separate)
    assert reserved_shared < reserved_separate


def test_outputs_are_poisoned_by_dtype(E):
    f = torch.ones(3)
    i = torch.ones(3, dtype=torch.int64)
    _, (a, b, c) = capture(E, lambda: (f * 2, i * 2, f > 0))
    assert torch.isnan(a).all()
    assert (b == torch.iinfo(torch.int64).max).all()
    assert c.all()


def test_recorded_ops_skip_views_and_empties(E):
    x = torch.randn(4, 4)
    g, _ = capture(E, lambda: (torch.empty(3), x.t()[1].unsqueeze(0) + 1))
    assert g.recorded_ops() == ["aten.add.Tensor"]


def test_zeros_during_capture_is_a_recorded_memset(E):
    g, z = capture(E, lambda: torch.zeros(3))
    assert torch.isnan(z).all()
    g.replay()
    assert z.tolist() == [0.0, 0.0, 0.0]


def test_metadata_inplace_ops_run_once(E):
    x = torch.arange(6.0).reshape(2, 3)
    y = x.clone()
    g, _ = capture(E, lambda: (y.t_(), y.mul_(2)))
    assert y.shape == (3, 2)
    g.replay()
    g.replay()
    assert y.shape == (3, 2) and torch.equal(y, x.t() * 4)


def test_batchnorm_running_stats_update_on_replay_only(E):
    bn = torch.nn.BatchNorm1d(4)
    x = torch.randn(8, 4)
    g, out = capture(E, lambda: bn(x))
    assert torch.equal(bn.running_mean, torch.zeros(4))
    g.replay()
    torch.testing.assert_close(bn.running_mean, 0.1 * x.mean(0))


def test_replay_does_not_bump_version_counters(E):
    w = torch.randn(3, requires_grad=True)
    x = torch.randn(3)
    g, _ = capture(E, lambda: x.add_(1))   # (capturing add_ bumps x's version, as on a GPU)
    y = w * x                 # saves x for backward
    g.replay()                # a GPU kernel writing x does not bump its version
    y.sum().backward()        # so autograd does not complain
    assert w.grad is not None


def test_replay_inside_capture_is_one_step(E):
    x = torch.ones(2)
    g1, y = capture(E, lambda: x + 1)
    g2, z = capture(E, lambda: (g1.replay(), y * 10)[1])
    assert len(g2) == 2
    x.fill_(4)
    g2.replay()
    assert z.tolist() == [50.0, 50.0]


def test_error_says_why_and_capture_invalidated(E):
    x = torch.randn(3)
    g = E.CUDAGraph()
    with pytest.raises(RuntimeError) as info:
        with E.graph(g):
            x.sum().item()
    assert "previous error during capture" in str(info.value)
    assert "[labkit emulator]" in str(info.value.__context__)
    E.set_stream(E.default_stream())
    with pytest.raises(RuntimeError, match="without a preceding successful capture"):
        g.replay()


def test_host_copy_error_does_not_invalidate(E):
    x = torch.randn(3)
    g = E.CUDAGraph()
    with E.graph(g):
        y = x * 2
        with pytest.raises(RuntimeError, match="pinned"):
            y.tolist()
    g.replay()
    torch.testing.assert_close(y, x * 2)


def test_foreach_copy_and_index_put_recorded(E):
    dst = [torch.zeros(3), torch.zeros(2)]
    src = [torch.ones(3), torch.full((2,), 5.0)]
    idx, nine = torch.tensor([0, 2]), torch.tensor(9.0)     # made before capture
    g, _ = capture(E, lambda: (torch._foreach_copy_(dst, src), dst[0].index_put_((idx,), nine)))
    assert dst[0].tolist() == [0.0, 0.0, 0.0]
    g.replay()
    assert dst[0].tolist() == [9.0, 1.0, 9.0] and dst[1].tolist() == [5.0, 5.0]


class _ReplayedOps(TorchDispatchMode):
    """The ATen ops that run while it is active (what a replay executes)."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func)
        return func(*args, **(kwargs or {}))


def test_out_variant_used_for_functional_ops(E):
    """A functional op replays as its ``.out`` overload, writing straight into the static
    output: no temporary result and no ``copy_`` (the fallback)."""
    x = torch.randn(5)
    g, y = capture(E, lambda: torch.sin(x))
    ptr = y.data_ptr()
    with _ReplayedOps() as seen:
        g.replay()
    assert seen.ops == [torch.ops.aten.sin.out]
    assert y.data_ptr() == ptr
    torch.testing.assert_close(y, torch.sin(x))



def test_without_an_out_variant_replay_copies(E, monkeypatch):
    """The fallback the test above rules out: the functional op, then ``copy_``."""
    from labkit.emulator import recorder

    monkeypatch.setattr(recorder, "_out_variant", lambda func: None)
    x = torch.randn(5)
    g, y = capture(E, lambda: torch.sin(x))
    with _ReplayedOps() as seen:
        g.replay()
    assert seen.ops == [torch.ops.aten.sin.default, torch.ops.aten.copy_.default]
    torch.testing.assert_close(y, torch.sin(x))


def test_replay_vs_eager_measurement_runs_and_agrees():
    from labkit.bench.emulator_cost import replay_vs_eager

    r = replay_vs_eager(d_model=16, nhead=2, batch=2, seq=4, iters=3)
    assert r["results_equal"] and r["ops_recorded"] > 20
    assert r["eager_us"] > 0 and r["replay_us"] > 0


def test_captures_underway_are_tracked_per_thread_and_cleared(E):
    """Every thread's capture is known process-wide (a device-wide synchronize() from
    another thread must see it), and a capture that ends, well or not, leaves the list."""
    import threading

    from labkit.emulator.state import captures_underway

    x = torch.ones(2)
    seen = []
    g = E.CUDAGraph()
    with E.graph(g):
        t = threading.Thread(target=lambda: seen.append(len(captures_underway())))
        t.start()
        t.join()
        x * 2
    assert seen == [1] and captures_underway() == []
    with pytest.raises(RuntimeError):
        with E.graph(E.CUDAGraph()):
            x.sum().item()
    assert captures_underway() == []


def test_bincount_and_histc_refuse_like_torchs_host_copy_check(E):
    """On a GPU these copy values to the host: torch's host-copy check refuses them, and
    the capture itself stays valid (H200, torch 2.11)."""
    r = torch.tensor([2, 0, 1, 1])
    x = torch.randn(8)
    g = E.CUDAGraph()
    with E.graph(g):
        y = x * 2
        for op in (lambda: torch.bincount(r), lambda: torch.histc(x)):
            with pytest.raises(RuntimeError, match="unless the CPU tensor is pinned"):
                op()
        h = torch.histc(x, bins=4, min=-3, max=3)          # a given range: no copy
    g.replay()
    torch.testing.assert_close(y, x * 2)
    torch.testing.assert_close(h, torch.histc(x, bins=4, min=-3, max=3))


def test_item_and_nested_capture_are_named_by_what_the_learner_wrote():
    """.item() is refused under the ATen op it reaches, and the message names both; a
    capture begun inside another one is refused as a nested capture, not a bare sync."""
    from labkit import backend
    from labkit.core.errors import capture_cause

    B = backend.get("emulated")
    x = torch.ones(3)

    def first_error(fn):
        try:
            fn()
        except Exception as e:     # the first error of the chain is the one that explains
            root = capture_cause(e)
            assert root is not e and "previous error during capture" in str(e)
            assert capture_cause(root) is root
            return str(root)
        finally:
            backend.recover(B)
        raise AssertionError("not refused")

    def item():
        with B.graph(B.CUDAGraph()):
            x.sum().item()

    def nested():
        with B.graph(B.CUDAGraph()):
            x.mul(2)
            with B.graph(B.CUDAGraph()):
                x.add(1)

    text = first_error(item)
    assert "aten._local_scalar_dense" in text and ".item()" in text, text
    text = first_error(nested)
    assert "a capture is already underway on this thread" in text, text
    assert "captures do not nest" in text, text


# ---- issue 29: what the emulator approximates, and what it cannot do -----------------------

def test_torch_generator_on_the_emulated_device_cannot_work(E):
    """A Python device cannot give PyTorch a generator (labkit.emulator.rng.generator says
    why): torch's own error stays, and B.Generator(device=B.device) is the way. If a
    torch makes this work, this test fails: then B.Generator can become torch.Generator."""
    with pytest.raises(NotImplementedError, match="getNewGenerator"):
        torch.Generator(device=E.device)
    assert E.Generator(device=E.device).device == torch.device("cpu")
    assert E.Generator(device="cpu").device == torch.device("cpu")


def test_allocations_outside_the_capture_follow_each_streams_segments(E):
    """The allocator model: a stream's first allocation, and one larger than any segment
    it holds, need cudaMalloc; one a segment it holds can take does not. Entering
    E.graph empties the cache as torch.cuda.graph does: only segments with live tensors
    stay (a segment with live tensors is taken to have room)."""
    from labkit.emulator.allocator import needs_new_segment

    side = E.Stream()
    assert needs_new_segment(side.stream_id, 1024)
    with E.stream(side):
        kept = torch.empty(1024, dtype=torch.uint8)       # a small (2 MiB) segment, live
        torch.empty(3 * 2**20, dtype=torch.uint8)          # a large (20 MiB) one, freed
    assert not needs_new_segment(side.stream_id, 2**20)   # small: fits the 2 MiB segment
    assert not needs_new_segment(side.stream_id, 15 * 2**20)
    assert needs_new_segment(side.stream_id, 21 * 2**20)
    x = torch.ones(4)
    g = E.CUDAGraph()
    with E.graph(g, capture_error_mode="thread_local"):
        assert needs_new_segment(side.stream_id, 15 * 2**20)   # released: nothing live
        y = x * 2
        with E.stream(side):
            torch.empty(100, dtype=torch.uint8)          # the live small segment has room
    g.replay()
    assert y.tolist() == [2.0] * 4
    with pytest.raises(RuntimeError, match="operation failed due to a previous error"):
        with E.graph(E.CUDAGraph(), capture_error_mode="thread_local"):
            with E.stream(side):
                torch.empty(3 * 2**20, dtype=torch.uint8)
    del kept


def test_views_and_inplace_ops_outside_the_capture_allocate_nothing(E):
    x = torch.ones(8)
    side = E.Stream()                                    # never allocated: any new memory
    g = E.CUDAGraph()                                    # would need cudaMalloc
    with E.graph(g, capture_error_mode="thread_local"):
        y = x * 3
        with E.stream(side):
            x[:4].add_(1)
            x.view(2, 4).t()
    g.replay()
    assert y.tolist() == [6.0] * 4 + [3.0] * 4


def test_staged_copies_follow_copy_kernel_cuda():
    from labkit.core.staging import host_side_is_staged

    p = torch.zeros(3, 4)
    row = p[1:]                                   # contiguous view: one memcpy
    assert not host_side_is_staged("host-to-device", row.shape, row.stride(), row.dtype, row,
                                   True, row)
    col = p[:, :2]
    assert host_side_is_staged("host-to-device", (3, 2), (2, 1), col.dtype, col, True, col)
    # a dtype conversion: on the device when non_blocking (the pinned source is copied as
    # is), on the host when blocking (a new pageable tensor)
    assert not host_side_is_staged("host-to-device", (3, 4), (4, 1), torch.float16, p, True, p)
    assert host_side_is_staged("host-to-device", (3, 4), (4, 1), torch.float16, p, False, p)
    # broadcast source: expanded, then made contiguous on the host
    one = torch.zeros(4)
    assert host_side_is_staged("host-to-device", (3, 4), (4, 1), one.dtype, one, True, one)
    assert not host_side_is_staged("host-to-device", (1, 4), (4, 1), one.dtype, one, True, one)


def test_autocast_under_capture_records_the_casts(E):
    w = torch.randn(4, 4)
    x = torch.randn(2, 4)
    with torch.autocast(E.device.type, dtype=torch.float16):
        g, y = capture(E, lambda: x @ w)
    ops = g.recorded_ops()
    assert ops.count("aten._to_copy.default") == 2 and "aten.mm.default" in ops
    g.replay()
    assert y.dtype == torch.float16
