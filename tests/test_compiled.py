"""labkit.compiled: reduce-overhead's life cycle by hand on both backends, and the probes
that read torch's own CUDA graph trees (their GPU half is marked ``cuda``)."""

from __future__ import annotations

import pytest
import torch

from labkit import backend
from labkit import compiled as C

E = backend.get("emulated")


def layer(w, x):
    return torch.relu(x @ w)


def test_life_cycle_warm_up_record_replay():
    w = torch.randn(4, 4, device=E.device)
    f = C.ReduceOverhead(layer, static=(0,), B=E)
    outs = []
    for _ in range(4):
        x = torch.randn(3, 4, device=E.device)
        outs.append(f(w, x))
        assert torch.allclose(outs[-1], layer(w, x))
    assert f.kinds == ["warm-up", "record", "replay", "replay"]
    assert outs[1] is outs[2] is outs[3]            # the graph's static output


def test_static_input_in_place_is_read_and_a_new_tensor_records_again():
    w = torch.randn(4, 4, device=E.device)
    f = C.ReduceOverhead(layer, static=(0,), B=E)
    x = torch.randn(3, 4, device=E.device)
    f(w, x), f(w, x)
    with torch.no_grad():
        w.mul_(3)
    assert torch.allclose(f(w, x), layer(w, x)) and f.kinds[-1] == "replay"
    w2 = torch.randn(4, 4, device=E.device)
    assert torch.allclose(f(w2, x), layer(w2, x)) and f.kinds[-1] == "record"
    assert f.kinds[-1] == "record" and f(w2, x) is not None and f.kinds[-1] == "replay"


def test_alternating_two_weights_records_two_siblings_then_only_replays():
    """torch's tree keeps one sibling node per address of the static inputs and replays
    whichever passes check_invariants: two weights, two recordings, never a third."""
    w1 = torch.randn(4, 4, device=E.device)
    w2 = torch.randn(4, 4, device=E.device)
    f = C.ReduceOverhead(layer, static=(0,), B=E)
    for step in range(8):
        w = (w1, w2)[step % 2]
        x = torch.randn(3, 4, device=E.device)
        assert torch.allclose(f(w, x), layer(w, x))
    assert f.kinds == ["warm-up", "record", "record"] + ["replay"] * 5
    assert len(f.recordings) == 2
    assert [r.static_ptrs for r in f.recordings] == [(w2.data_ptr(),), (w1.data_ptr(),)]
    assert f.graph is f.recordings[0].graph          # the last call (w2) ran the first one


def test_each_sibling_keeps_its_own_outputs_and_copies():
    w1 = torch.randn(4, 4, device=E.device)
    w2 = torch.randn(4, 4, device=E.device)
    f = C.ReduceOverhead(layer, static=(0,), B=E)
    x = torch.randn(3, 4, device=E.device)
    f(w1, x)
    out1, out2 = f(w1, x), f(w2, x)
    assert out1 is not out2 and f.recordings[0].buffers[1] is not f.recordings[1].buffers[1]
    assert f(w1, x) is out1 and f.kinds[-1] == "replay"   # the first recording's output
    assert f.recordings[0].buffers[0] is w1 and f.recordings[1].buffers[0] is w2


def test_a_replay_is_checked_against_the_sibling_it_replays():
    """Each sibling was recorded with its own arguments: a call is checked against the
    recording it replays, not the last one recorded."""
    w1 = torch.randn(4, 4, device=E.device)
    w2 = torch.randn(4, 4, device=E.device)
    f = C.ReduceOverhead(layer, static=(0,), B=E)
    x3, x5 = torch.randn(3, 4, device=E.device), torch.randn(5, 4, device=E.device)
    f(w1, x3), f(w1, x3), f(w2, x5)                  # warm-up, record (3 rows), record (5)
    assert torch.allclose(f(w1, x3), layer(w1, x3)) and f.kinds[-1] == "replay"
    assert torch.allclose(f(w2, x5), layer(w2, x5)) and f.kinds[-1] == "replay"
    with pytest.raises(ValueError, match="shape"):
        f(w1, x5)                                    # w1's recording holds 3 rows


def test_recording_check_invariants_reads_every_static_position():
    a, b, x = (torch.randn(2, 2, device=E.device) for _ in range(3))
    f = C.ReduceOverhead(lambda a, x, b: a @ x @ b, static=(0, 2), B=E)
    f(a, x, b), f(a, x, b)
    node = f.recordings[0]
    assert node.check_invariants((a, torch.zeros(2, 2), b), f.static)
    assert not node.check_invariants((a, x, b.clone()), f.static)
    assert not node.check_invariants((a.clone(), x, b), f.static)
    f(a, x, b.clone())
    assert f.kinds[-1] == "record" and len(f.recordings) == 2


def test_non_static_inputs_are_copied_not_aliased():
    f = C.ReduceOverhead(lambda a, b: a + b, B=E)
    a, b = torch.ones(3, device=E.device), torch.ones(3, device=E.device)
    f(a, b), f(a, b)
    assert f.buffers[0] is not a and f.buffers[0].data_ptr() != a.data_ptr()
    a2 = torch.full((3,), 5.0, device=E.device)
    assert f(a2, b).tolist() == [6.0, 6.0, 6.0]


def test_tuple_outputs():
    f = C.ReduceOverhead(lambda a, b: (a * b, a - b), B=E)
    for _ in range(3):
        a, b = torch.randn(2, device=E.device), torch.randn(2, device=E.device)
        got = f(a, b)
    assert torch.allclose(got[0], a * b) and torch.allclose(got[1], a - b)


def test_bad_input_is_named():
    with pytest.raises(TypeError, match="fn must be callable, got int"):
        C.ReduceOverhead(3, B=E)
    f = C.ReduceOverhead(layer, static=(5,), B=E)
    with pytest.raises(IndexError, match=r"static=\(5,\) names input 5, but the call passed 2"):
        f(torch.ones(2, 2), torch.ones(2, 2))
    with pytest.raises(TypeError, match="backend namespace"):
        C.ReduceOverhead(layer, B="emulated")
    host = torch.ones(2, 2)             # a host tensor: the graph would not record its ops
    with pytest.raises(ValueError, match=r"input 1 is on cpu, but the graph records work on "
                                         r"B\.device \(emu:0\)"):
        C.ReduceOverhead(layer, B=E)(torch.ones(2, 2, device=E.device), host)


def test_probes_without_a_gpu():
    s = C.tree_summary(E)
    assert (s.graphs, s.warmups, s.roots, s.state) == (0, 0, 0, "NONE")
    out, kind = C.call_kind(lambda t: t + 1, torch.ones(2), B=E)
    assert kind == "eager" and out.tolist() == [2.0, 2.0]
    with pytest.raises(RuntimeError, match="need a GPU; this backend is 'emulated'"):
        C.recording_sweep(lambda: None, lambda n: (), [1], E)


def test_peek_reads_a_counter_without_consuming_it():
    import itertools
    c = itertools.count(-1, -1)
    next(c), next(c)
    assert C._peek(c) == -3 and next(c) == -3


def test_watch_skips_counts_a_cpu_only_function_and_logs_nothing():
    """A CPU-only graph bumps torch's cudagraph_skips counter without a log line: the
    lowering logs its verdict only for graphs with a CUDA device."""
    torch._dynamo.reset()
    with C.watch_skips() as skips:
        f = torch.compile(lambda t: t * 2 + 1, mode="reduce-overhead")
        for _ in range(3):
            f(torch.ones(4))
    assert skips.count == 1 and skips.messages == []


# ---- on a GPU: torch's own tree -------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_torch_tree_kinds_and_mutation_skip_on_gpu():
    B = backend.get("cuda")
    torch._dynamo.reset()
    f = torch.compile(lambda x: x * 2 + 1, mode="reduce-overhead")
    x = torch.randn(64, device=B.device)
    kinds = [C.call_kind(f, x, B=B)[1] for _ in range(4)]
    assert kinds == ["warm-up", "record", "replay", "replay"]
    s = C.tree_summary(B)
    assert s.graphs == 1 and s.warmups == 1 and s.roots == 1 and s.state == "EXECUTION"

    def step(x, cache):
        cache.add_(x)
        return cache.sum()

    torch._dynamo.reset()
    with C.watch_skips() as skips:
        g = torch.compile(step, mode="reduce-overhead")
        kinds = [C.call_kind(g, x, torch.zeros_like(x), B=B)[1] for _ in range(3)]
    assert skips.count == 1 and "mutated inputs" in skips.messages[0]
    assert kinds == ["eager"] * 3
    torch._dynamo.reset()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_torch_tree_keeps_a_sibling_per_static_address_on_gpu():
    """What ReduceOverhead models: torch records one node per address of a static input
    and replays whichever passes check_invariants (two weights in turn: two recordings)."""
    B = backend.get("cuda")
    torch._dynamo.reset()
    w1, w2 = (torch.randn(64, 64, device=B.device) for _ in range(2))
    for w in (w1, w2):
        torch._dynamo.mark_static_address(w)
    x = torch.randn(8, 64, device=B.device)
    f = torch.compile(lambda w, x: torch.relu(x @ w), mode="reduce-overhead")
    with torch.no_grad(), torch._inductor.utils.fresh_inductor_cache():
        kinds = [C.call_kind(f, w, x, B=B)[1] for w in (w1, w2) * 3]
    assert kinds == ["warm-up", "record", "record", "replay", "replay", "replay"]
    assert C.tree_summary(B).graphs == 2
    mine = C.ReduceOverhead(lambda w, x: torch.relu(x @ w), static=(0,), B=B)
    assert [mine(w, x) is not None and mine.kinds[-1] for w in (w1, w2) * 3] == kinds
    torch._dynamo.reset()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_recording_sweep_on_gpu():
    B = backend.get("cuda")
    torch._dynamo.reset()

    def make():
        return torch.compile(lambda x: x.sin() * 2, mode="reduce-overhead", dynamic=False)

    rows = C.recording_sweep(make, lambda n: (torch.randn(n, device=B.device),), [8, 16], B)
    assert [r["kinds"] for r in rows] == [["warm-up", "record", "replay"]] * 2
    assert [r["graphs"] for r in rows] == [1, 2] and rows[-1]["pool_reserved_bytes"] > 0
    torch._dynamo.reset()
