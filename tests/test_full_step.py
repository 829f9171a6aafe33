"""Whole-step capture (labkit.full_step): one graph for fwd+bwd of every microbatch, one for
AdamW, and the static batch loader. Runs on every backend (the ``B`` fixture)."""

from __future__ import annotations

import pytest
import torch

from labkit import full_step as FS
from labkit.guards import error_text

SYNC_MSG = "operation not permitted when stream is capturing"


def assert_refused(info, B, *emulated_reason: str) -> None:
    """The capture was refused for a host read, with each backend's own words: torch's CUDA
    error on a GPU; the same error plus the op and the reason on the emulator."""
    text = error_text(info.value)
    assert SYNC_MSG in text, text
    if B.name == "cuda":
        assert "cudaErrorStreamCaptureUnsupported" in text, text
    else:
        assert all(part in text for part in emulated_reason), text


def data_stream(cfg, n, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [FS.random_microbatches(cfg, gen) for _ in range(n)]


def pair(B, cfg, **adam):
    """The same model twice: an eager trainer and a whole-step graph trainer, with the same
    (capturable) AdamW, so the only difference is graphs vs no graphs."""
    adam = {"lr": 1e-2, **adam}
    m_eager, m_graph = FS.build_lm(cfg, B.device), FS.build_lm(cfg, B.device)
    eager = FS.EagerTrainer(m_eager, FS.lm_loss,
                            FS.make_capturable_optimizer(m_eager.parameters(), B, **adam))
    graph = FS.FullStepTrainer(m_graph, FS.lm_loss,
                               FS.make_capturable_optimizer(m_graph.parameters(), B, **adam),
                               B, cfg.num_microbatches, warmup_steps=2)
    return eager, graph


def to_dev(batch, B):
    return [tuple(t.to(B.device) for t in mb) for mb in batch]


def test_whole_step_graph_trains_like_eager(B):
    cfg = FS.CONFIGS["tiny"]
    eager, graph = pair(B, cfg)
    grad_ptrs = [g.data_ptr() for g in graph.grads]
    losses = []
    for it, batch in enumerate(data_stream(cfg, 6)):
        batch = to_dev(batch, B)
        e = eager.step(batch).item()
        g = graph.step(batch)
        losses.append((e, g.item()))
        assert graph.captured == (it >= 2)            # captured once, at step warmup_steps
    assert graph.fwd_bwd.captured_at == 2 and graph.opt_step.captured_at == 2
    assert graph.fwd_bwd.calls == {"eager": 2, "capture": 1, "replay": 4}
    for e, g in losses:
        assert g == pytest.approx(e, rel=1e-5, abs=1e-6)
    for p, q in zip(eager.model.parameters(), graph.model.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-4, atol=1e-5)
    # backward accumulated into the same .grad tensors all along
    assert [p.grad.data_ptr() for p in graph.params] == grad_ptrs


def test_loss_is_the_graphs_static_output(B):
    cfg = FS.CONFIGS["tiny"]
    _, graph = pair(B, cfg)
    batches = [to_dev(b, B) for b in data_stream(cfg, 5, seed=1)]
    outs = [graph.step(b) for b in batches]
    assert outs[2] is outs[3] is outs[4]                # one static tensor, overwritten
    assert outs[0] is not outs[1]                       # eager steps: fresh results
    kept = outs[3].clone()
    graph.step(batches[0])
    assert not torch.equal(kept, outs[4])               # ...so clone what you keep


@pytest.mark.parametrize("foreach", [True, False], ids=["foreach_copy", "plain_copy"])
def test_static_loader_keeps_addresses_and_checks_shapes(B, foreach, monkeypatch):
    """Both ways of copying (the one-launch speed trick and the plain copy_ per tensor) fill
    the same buffers and refuse the same wrong batches."""
    monkeypatch.setenv("LABKIT_FOREACH_LOAD", "1" if foreach else "0")
    cfg = FS.CONFIGS["tiny"]
    loader = FS.StaticBatchLoader(B, cfg.num_microbatches)
    assert loader.foreach is foreach
    a, b = [to_dev(x, B) for x in data_stream(cfg, 2)]
    bufs = loader.load(a)
    ptrs = [t.data_ptr() for mb in bufs for t in mb]
    loader.load(b)
    B.synchronize()
    assert [t.data_ptr() for mb in loader.buffers for t in mb] == ptrs
    for buf, mb in zip(loader.buffers, b):
        for t, s in zip(buf, mb):
            assert torch.equal(t, s)
    bad = [(t[:, :-1], s[:, :-1]) for t, s in b]
    with pytest.raises(ValueError, match="fixed shapes"):
        loader.load(bad)
    with pytest.raises(ValueError, match="microbatch 1 has structure"):
        loader.load([b[0], list(b[1]) + [b[1][0]]])
    with pytest.raises(ValueError, match="fixed count"):
        loader.load(b[:1])


@pytest.mark.parametrize("skips", [False, True], ids=["foreach", "fused_found_inf"])
def test_capturable_optimizer_is_torchs_adamw_and_trains_like_it(B, skips):
    """make_capturable_optimizer gives torch's own AdamW on every backend: foreach, or fused
    and reading found_inf; it steps like a plain AdamW, eagerly and captured, and a
    replay with found_inf = 1.0 leaves weights, moments and step count as they were."""
    torch.manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(5, 3, device=B.device)),
          torch.nn.Parameter(torch.randn(7, device=B.device))]
    qs = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    flag = torch.zeros((), device=B.device) if skips else None
    ours = FS.make_capturable_optimizer(ps, B, lr=1e-2, weight_decay=0.1, found_inf=flag)
    ref = torch.optim.AdamW(qs, lr=1e-2, weight_decay=0.1)
    assert type(ours) is torch.optim.AdamW
    group = ours.param_groups[0]
    assert group["capturable"] and group["fused" if skips else "foreach"]
    assert getattr(ours, "found_inf", None) is flag
    FS.ensure_grads(ps)
    grads = [[torch.randn_like(p) for p in ps] for _ in range(6)]

    def load(k):
        for p, q, g in zip(ps, qs, grads[k]):
            p.grad.copy_(g)
            q.grad = g.clone()

    opt_step = FS.OptimizerCudaGraphWrapper(ours, B, warmup_steps=2)
    for k in range(4):                              # eager, eager, capture + replay, replay
        load(k)
        opt_step()
        ref.step()
    for p, q in zip(ps, qs):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    assert ours.state[ps[0]]["step"].item() == 4    # the count is a tensor on the device
    if not skips:
        return
    kept = [[t.clone() for t in (p, ours.state[p]["exp_avg"], ours.state[p]["step"])]
            for p in ps]
    flag.fill_(1.0)                                 # GradScaler's verdict: skip this step
    load(4)
    opt_step()
    for p, old in zip(ps, kept):
        now = (p, ours.state[p]["exp_avg"], ours.state[p]["step"])
        assert all(torch.equal(a, b) for a, b in zip(now, old))
    flag.fill_(0.0)
    load(5)
    opt_step()
    ref.step()                                      # the skipped step never happened
    for p, q in zip(ps, qs):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_optimizer_state_must_exist_before_capture(B):
    p = torch.nn.Parameter(torch.ones(3, device=B.device))
    p.grad = torch.ones(3, device=B.device)
    opt = FS.make_capturable_optimizer([p], B)
    opt_step = FS.OptimizerCudaGraphWrapper(opt, B, warmup_steps=0)
    with pytest.raises(ValueError, match="warmup_steps=0, and the state of AdamW does not "
                                         "exist yet.*every replay would reset it"):
        opt_step()
    assert opt_step.graph is None and not opt.state       # refused before any capture


def test_torch_adamw_without_capturable_is_refused(B):
    p = torch.nn.Parameter(torch.ones(3, device=B.device))
    p.grad = torch.ones(3, device=B.device)
    opt = torch.optim.AdamW([p])
    opt.step()                                        # state exists; step is a CPU tensor
    assert opt.state[p]["step"].device.type == "cpu"  # on the host on purpose
    with pytest.raises(RuntimeError) as info:
        with B.graph(B.CUDAGraph()):
            opt.step()
    # torch checks up front: reading a CPU step tensor is no device sync, so nothing else
    # would stop the capture from baking the step count into the graph
    assert "but param_groups' capturable is False" in error_text(info.value)


def test_nan_check_syncs_and_the_flag_does_not(B):
    x = torch.ones(4, device=B.device)

    def with_if():
        loss = (x * 2).sum()
        if torch.isnan(loss):                         # reads the value on the host
            loss = torch.zeros_like(loss)
        return loss

    with pytest.raises(RuntimeError) as info:
        with B.graph(B.CUDAGraph()):
            with_if()
    assert_refused(info, B, "aten._local_scalar_dense", "reads a tensor's value on the host")
    B.set_stream(B.default_stream())

    flag = torch.zeros((), device=B.device)            # float32: what the fused AdamW reads
    g = B.CUDAGraph()
    with B.graph(g):
        flag.zero_()
        FS.nonfinite_flag(flag, x * 2)
    g.replay()
    assert flag.item() == 0.0
    x[1] = float("nan")
    g.replay()
    assert flag.item() == 1.0                          # exactly 1.0: the fused step skips


def test_skip_nonfinite_step_leaves_weights_untouched(B):
    cfg = FS.CONFIGS["tiny"]
    model = FS.build_lm(cfg, B.device)
    trainer = FS.FullStepTrainer.skip_nonfinite(model, FS.lm_loss, B, cfg.num_microbatches,
                                                warmup_steps=1, lr=1e-2)
    batches = [to_dev(b, B) for b in data_stream(cfg, 4, seed=2)]
    for b in batches[:2]:
        trainer.step(b)
    assert trainer.optimizer.found_inf is trainer.found_inf   # the flag the fused step reads
    assert trainer.captured and trainer.found_inf.item() == 0.0
    with torch.no_grad():
        model.head.weight[0, 0] = float("inf")       # poison: every grad becomes non-finite
    before = [p.detach().clone() for p in model.parameters()]
    steps_before = trainer.optimizer.state[trainer.params[0]]["step"].clone()
    trainer.step(batches[2])
    assert trainer.found_inf.item() == 1.0            # read after replay, outside the graph
    for p, q in zip(model.parameters(), before):
        assert torch.equal(p, q) or (p.isinf().any() and q.isinf().any())
    assert torch.equal(trainer.optimizer.state[trainer.params[0]]["step"], steps_before)
    with torch.no_grad():
        model.head.weight[0, 0] = 0.0                 # repair, and training goes on
    trainer.step(batches[3])
    assert trainer.found_inf.item() == 0.0
    assert trainer.optimizer.state[trainer.params[0]]["step"].item() == steps_before.item() + 1


def test_data_dependent_shape_cannot_be_captured(B):
    x = torch.randn(16, 4, device=B.device)
    router = torch.randn(4, 2, device=B.device)

    def moe_dispatch():
        expert = (x @ router).argmax(-1)
        return [x[expert == e] for e in range(2)]    # how many tokens per expert? data!

    with pytest.raises(RuntimeError) as info:
        with B.graph(B.CUDAGraph()):
            moe_dispatch()
    assert_refused(info, B, "aten.index", "boolean mask")


def test_phase_logic():
    seq = []
    captured = False
    for it in range(5):
        p = FS.phase(it, 2, captured)
        captured = captured or p == "capture"
        seq.append(p)
    assert seq == ["eager", "eager", "capture", "replay", "replay"]
    assert FS.phase(0, 0, False) == "capture"
