"""labkit.pipeline: 1F1B schedules, the execution record, ordered capture (lesson 05)."""

import pytest
import torch

from labkit.pipeline import (
    GlobalRecord,
    graph_layers,
    max_in_flight,
    one_f_one_b,
    split_stages,
    train_step,
)
from labkit.pipeline import schedule as S
from labkit.pipeline.models import make_blocks
from labkit.pipeline.record import create_in_order

pytestmark = pytest.mark.usefixtures("one_thread")


def _diff(a, b):
    return max((x - y).abs().max().item() for x, y in zip(a, b))


# ---- schedules -----------------------------------------------------------------------------

@pytest.mark.parametrize("P,M", [(1, 1), (1, 4), (2, 3), (4, 8), (4, 2), (5, 5)])
def test_one_f_one_b_shape(P, M):
    orders = one_f_one_b(P, M)
    assert len(orders) == P
    for s, order in enumerate(orders):
        assert sorted(order) == sorted([("F", m) for m in range(M)] + [("B", m) for m in range(M)])
        first_b = next(i for i, (k, _) in enumerate(order) if k == "B")
        assert first_b == min(P - s - 1, M) + (1 if M > P - s - 1 else 0)
        assert [m for k, m in order if k == "F"] == list(range(M))
        assert [m for k, m in order if k == "B"] == list(range(M))
        assert max_in_flight(order) == min(P - s, M)
    assert S.describe(one_f_one_b(2, 3)) == "stage 0: F0 F1 B0 F2 B1 B2\nstage 1: F0 B0 F1 B1 F2 B2"


def test_simulate_and_plot():
    import matplotlib
    matplotlib.use("Agg")
    ev = S.simulate(one_f_one_b(4, 8))
    assert max(e.end for e in ev) == pytest.approx(3 * 8 + 3 * 3)   # M(tf+tb) + (P-1)(tf+tb)
    seq = S.execution_order(ev)
    done = set()
    for s, k, m in seq:                           # every dependency ran before
        if k == "F" and s > 0:
            assert (s - 1, "F", m) in done
        if k == "B":
            assert (s, "F", m) in done and (s == 3 or (s + 1, "B", m) in done)
        done.add((s, k, m))
    ax = S.plot_schedule(ev)
    assert ax is not None
    import matplotlib.pyplot as plt
    plt.close(ax.figure)
    with pytest.raises(ValueError, match="deadlock"):   # each order valid, together stuck
        S.simulate([[("F", 0), ("B", 0), ("F", 1), ("B", 1)],
                    [("F", 0), ("F", 1), ("B", 0), ("B", 1)]])
    with pytest.raises(ValueError, match="B0 comes before F0"):
        S.simulate([[("B", 0), ("F", 0)], [("F", 0), ("B", 0)]])


# ---- the record and ordered capture ----------------------------------------------------------

def _data(M, steps, B):
    g = torch.Generator().manual_seed(1)
    return [[(torch.randn(2, 4, 16, generator=g).to(B.device),
              torch.randn(2, 4, 16, generator=g).to(B.device)) for _ in range(M)]
            for _ in range(steps)]


def _pipeline(B, P, M, *, graphs=True, reuse=None, layers=4, steps=2, create=None):
    blocks = make_blocks(layers, seed=0, hidden=16, heads=2, ffn=32, device=B.device)
    record = GlobalRecord()
    calls = graph_layers(blocks, B, record, reuse=(P == 1) if reuse is None else reuse,
                         num_warmup=1) if graphs else list(blocks)
    stages = split_stages(calls, P)
    opt = torch.optim.SGD(blocks.parameters(), lr=0.1)
    losses = []
    for batch in _data(M, steps, B):
        opt.zero_grad()
        xs, ts = zip(*batch)
        losses.append(train_step(stages, xs, ts, record=record if graphs else None, B=B,
                                 create_graphs=create))
        opt.step()
    return {"params": [p.detach().clone() for p in blocks.parameters()], "losses": losses,
            "record": record, "calls": calls}


def test_record_is_the_real_order(B):
    blocks = make_blocks(2, seed=0, hidden=16, heads=2, ffn=32, device=B.device)
    record = GlobalRecord()
    stages = split_stages(graph_layers(blocks, B, record, reuse=True, num_warmup=1), 1)
    batch = _data(2, 1, B)[0]
    entries_seen = []
    train_step(stages, *zip(*batch), record=record, B=B,
               create_graphs={"create": lambda e: entries_seen.extend(
                   f"{x[1]} {x[0].name}" for x in e) or __import__(
                   "labkit.pipeline.record", fromlist=["x"]).create_in_order(e)})
    assert entries_seen == ["fwd layer0#0", "fwd layer1#0", "bwd layer1#0", "bwd layer0#0"]
    assert record.created


@pytest.mark.parametrize("P,M", [(1, 3), (2, 4)])
def test_ordered_capture_matches_eager(B, P, M):
    eager = _pipeline(B, P, M, graphs=False)
    graphed = _pipeline(B, P, M)
    torch.testing.assert_close(graphed["params"], eager["params"])
    torch.testing.assert_close(torch.tensor(graphed["losses"]), torch.tensor(eager["losses"]))
    runners = [len(c.runners) for c in graphed["calls"]]
    assert runners == ([1] * 4 if P == 1 else [M] * 4)   # PP>1: one per microbatch


def test_out_of_order_creation_corrupts_a_shared_pool(B):
    eager = _pipeline(B, 2, 4, graphs=False)
    for order in ("grouped", "torch"):
        bad = _pipeline(B, 2, 4, create={"order": order})
        assert _diff(bad["params"], eager["params"]) > 1e-4, order
    per_graph = _pipeline(B, 2, 4, create={"pool": "per_graph"})
    shared = _pipeline(B, 2, 4)
    torch.testing.assert_close(per_graph["params"], eager["params"])
    mem_shared = shared["record"].pool_bytes(B)
    mem_per = per_graph["record"].pool_bytes(B)
    assert mem_per["pools"] == 32 and mem_shared["pools"] == 1
    assert mem_per["reserved_bytes"] > mem_shared["reserved_bytes"]


def test_pp_runners_rotate_fifo_and_reuse_would_corrupt(B):
    graphed = _pipeline(B, 2, 4, steps=3)
    assert graphed["calls"][0].replay_log == [0, 1, 2, 3, 0, 1, 2, 3]
    eager = _pipeline(B, 2, 4, graphs=False, steps=3)
    reused = _pipeline(B, 2, 4, steps=3, reuse=True)      # PP==1 logic under 1F1B
    assert [len(c.runners) for c in reused["calls"]] == [2, 2, 1, 1]
    assert _diff(reused["params"], eager["params"]) > 1e-4


def test_te_style_graphs_per_microbatch(B):
    from labkit.pipeline.step import Stage
    from labkit.pipeline.te_style import make_te_style_layers, zero_grads_in_place

    P, M = 2, 4

    def run(slots):
        blocks = make_blocks(4, seed=0, hidden=16, heads=2, ffn=32, device=B.device)
        stages = split_stages(list(blocks), P)
        if slots is not None:
            sample = torch.randn(2, 4, 16, device=B.device)
            stages = [Stage(make_te_style_layers(st.layers, sample, B, slots(s),
                                                 first_input_requires_grad=s > 0))
                      for s, st in enumerate(stages)]
        opt = torch.optim.SGD(blocks.parameters(), lr=0.1)
        for batch in _data(M, 2, B):
            zero_grads_in_place(blocks.parameters())
            train_step(stages, *zip(*batch))
            opt.step()
        return [p.detach().clone() for p in blocks.parameters()], stages

    eager, _ = run(None)
    orders = one_f_one_b(P, M)
    good, stages = run(lambda s: max_in_flight(orders[s]))
    torch.testing.assert_close(good, eager)
    assert stages[0].layers[0].log == [0, 1, 0, 1] * 2        # microbatch % 2
    # fewer slots than microbatches in flight used to give gradients up to 0.148 off eager,
    # silently; now refused before anything runs (tests/test_misuse_pipeline.py has more)
    with pytest.raises(ValueError, match=r"num_slots=1: .*max_in_flight\(order\) = 2"):
        run(lambda s: 1)


def test_moe_router_graphed_dispatch_eager(B):
    from labkit.pipeline.moe import PartiallyGraphedMoE, ToyMoE

    torch.manual_seed(0)
    moe = ToyMoE(hidden=16, experts=4, ffn=32).to(B.device)
    ref = ToyMoE(hidden=16, experts=4, ffn=32).to(B.device)
    ref.load_state_dict(moe.state_dict())
    x = torch.randn(2, 4, 16, device=B.device, requires_grad=True)
    with pytest.raises(RuntimeError):
        g = B.CUDAGraph()
        with B.graph(g):
            moe(x)
    B.set_stream(B.default_stream())
    part = PartiallyGraphedMoE(moe, B, x, num_warmup=1)
    assert {id(p) for p in part.router_graph.params_to_backprop} == \
        {id(p) for p in (*moe.ln.parameters(), moe.router.weight)}
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        xx = torch.randn(2, 4, 16, generator=g).to(B.device)
        t = torch.randn(2, 4, 16, generator=g).to(B.device)
        for model, params in ((ref, ref), (part, moe)):
            params.zero_grad()
            xi = xx.clone().requires_grad_()
            ((model(xi) - t) ** 2).mean().backward()
            with torch.no_grad():
                for p in params.parameters():
                    if p.grad is not None:
                        p -= 0.1 * p.grad
    torch.testing.assert_close(list(moe.parameters()), list(ref.parameters()))


# ---- across processes --------------------------------------------------------------------------

def test_two_rank_gloo_pipeline_matches_single_process():
    from labkit.pipeline.distributed import PipelineConfig, eager_reference, run_pipeline

    cfg = PipelineConfig(P=2, M=4, layers=2, steps=2, hidden=16, backend="emulated")
    out = run_pipeline(cfg, timeout=28)                # step 1 records, step 2 replays
    ref = eager_reference(cfg)
    assert out["graphs"] == [4, 4]                     # 1 layer x 4 microbatches per rank
    torch.testing.assert_close(torch.tensor(out["losses"]), torch.tensor(ref["losses"]))
    torch.testing.assert_close(out["params"], ref["params"])


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_two_rank_nccl_pipeline_matches_single_process():
    from labkit.pipeline.distributed import PipelineConfig, eager_reference, run_pipeline

    cfg = PipelineConfig(P=2, M=4, layers=4, steps=3, hidden=16, backend="cuda")
    out = run_pipeline(cfg, timeout=120)
    ref = eager_reference(cfg, device="cuda:0")
    torch.testing.assert_close(torch.tensor(out["losses"]), torch.tensor(ref["losses"]),
                               rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(out["params"], ref["params"], rtol=1e-4, atol=1e-5)


# ---- checkers ------------------------------------------------------------------------------------


def test_pre_forward_hooks_called_by_hand_on_replay(B):
    from labkit.pipeline.runner import graph_safe

    blocks = make_blocks(2, seed=0, hidden=16, heads=2, ffn=32, device=B.device)
    calls = []
    blocks[0].register_forward_pre_hook(graph_safe(lambda mod, args: calls.append(1)))
    record = GlobalRecord()
    stages = split_stages(graph_layers(blocks, B, record, reuse=True, num_warmup=1), 1)
    for batch in _data(2, 2, B):
        before = len(calls)
        train_step(stages, *zip(*batch), record=record, B=B)
        assert len(calls) - before >= 2                # one per microbatch, both phases
    blocks[1].register_forward_pre_hook(lambda mod, args: None)
    with pytest.raises(RuntimeError, match="would not run"):
        train_step(stages, *zip(*_data(2, 1, B)[0]), record=record, B=B)


def test_create_cudagraphs_warms_every_runner_before_the_first_capture(B):
    """A warm-up between two captures into the shared pool would cache a cuBLAS workspace
    that the later captures record (see labkit.capture.own_cublas_workspace)."""
    blocks = make_blocks(2, seed=0, hidden=16, heads=2, ffn=32, device=B.device)
    record = GlobalRecord()
    stages = split_stages(graph_layers(blocks, B, record, reuse=False, num_warmup=1), 2)
    warmed = []

    def create(entries):
        warmed.extend(e[0]._warmed_up for e in entries if e[1] == "fwd")
        create_in_order(entries)

    train_step(stages, *zip(*_data(2, 1, B)[0]), record=record, B=B,
               create_graphs={"create": create})
    assert warmed and all(warmed)
