"""labkit's public paths under ``torch.set_default_device(B.device)`` (issue 29 §3).

gpt-fast and many scripts set torch's default device to the GPU. labkit's host tensors
(pinned staging buffers, seeded draws from a host generator, models built from a seed)
are made with an explicit ``device="cpu"``, so every path below runs and gives what it
gives with the default device left alone. Before: the staged decode step failed in
``pinned_zeros`` ("cannot pin 'torch.cuda.ByteTensor'" on a GPU, "can't convert emu:0
device type tensor to numpy" on the emulator); on a GPU a seeded model or draft drew its
weights from the device's generator or refused the host one.

Every test takes ``B``: the emulator everywhere, the GPU too (``pytest -m cuda``); the
fixture sets the default device to ``B.device`` and puts it back after.
"""

from __future__ import annotations

import pytest
import torch

from labkit import full_step as FS
from labkit.core.models import make_blocks
from labkit.decode import (
    DecodeGraphRunner,
    EagerRunner,
    build_model,
    make_decode_batch,
    make_extend_batch,
    serve,
    synthetic_workload,
)
from labkit.decode.buffers import pinned_zeros
from labkit.piecewise import PiecewiseGraphRunner
from labkit.speculative import (
    DraftGraphRunner,
    greedy_generate,
    make_draft,
    measure,
    speculative_generate,
)

pytestmark = pytest.mark.usefixtures("one_thread")
PROMPTS = [[5, 9, 2], [7, 1, 4, 4, 8], [3]]


@pytest.fixture
def on_device(B):
    """torch's default device set to ``B.device``, as gpt-fast does; put back after."""
    before = torch.get_default_device()
    torch.set_default_device(B.device)
    try:
        yield B
    finally:
        torch.set_default_device(None if before.type == "cpu" else before)


def _model(B, **kw):
    return build_model("tiny", max_requests=4, device=B.device, dtype=torch.float32, **kw)


def _same_params(a, b):
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    assert pa.keys() == pb.keys()
    for name in pa:
        assert torch.equal(pa[name].cpu(), pb[name].cpu()), name


def _on_host(make):
    """``make()`` with torch's default device left at the CPU (the reference)."""
    with torch.device("cpu"):
        return make()


def test_pinned_staging_memory_is_host_memory(on_device):
    t = pinned_zeros((2, 3), torch.int64, on_device.device)
    assert t.device.type == "cpu" and t.is_pinned() and t.numpy().shape == (2, 3)


def test_seeded_models_and_drafts_are_the_same_whatever_the_default_device(on_device):
    B = on_device
    ref = _on_host(lambda: _model(B, seed=3))
    model = _model(B, seed=3)
    _same_params(model, ref)
    _same_params(make_draft(model, n_layer=1, noise=0.1, seed=2),
                 _on_host(lambda: make_draft(ref, n_layer=1, noise=0.1, seed=2)))
    _same_params(FS.build_lm("tiny", B.device), _on_host(lambda: FS.build_lm("tiny", B.device)))
    blocks = make_blocks(2, seed=1, hidden=16, heads=2, ffn=32)
    assert next(blocks.parameters()).device == B.device, "None: torch's default device"
    _same_params(blocks, _on_host(lambda: make_blocks(2, seed=1, hidden=16, heads=2, ffn=32)))


def test_random_microbatches_are_drawn_on_the_host(on_device):
    cfg = FS.CONFIGS["tiny"]
    got = FS.random_microbatches(cfg, torch.Generator().manual_seed(4))
    ref = _on_host(lambda: FS.random_microbatches(cfg, torch.Generator().manual_seed(4)))
    for (t, y), (rt, ry) in zip(got, ref):
        assert t.device == on_device.device
        assert torch.equal(t.cpu(), rt) and torch.equal(y.cpu(), ry)


def test_decode_runner_forward_and_staged_step(on_device):
    B = on_device
    m = _model(B)
    EagerRunner(m).forward(make_extend_batch(m, [1, 2, 3], PROMPTS))
    r = DecodeGraphRunner(m, B, max_bs=4, progress=False)
    r.capture()
    batch = make_decode_batch(m, [1, 2, 3], [6, 6, 6], [len(p) for p in PROMPTS])
    ref = r.eager_forward(batch).clone()
    torch.testing.assert_close(r.forward(batch), ref, rtol=1e-4, atol=1e-4)
    r.stage([1, 2, 3], [len(p) for p in PROMPTS], [6, 6, 6])
    torch.testing.assert_close(r.replay_staged(), ref, rtol=1e-4, atol=1e-4)


def test_serve_overlapped_and_synced(on_device):
    B = on_device
    m = _model(B)
    r = DecodeGraphRunner(m, B, max_bs=4, progress=False)
    r.capture()
    wl = synthetic_workload(5, vocab_size=m.args.vocab_size, max_seq_len=m.args.max_seq_len,
                            output_len=(2, 6))
    eager = serve(m, wl).tokens
    assert serve(m, wl, runner=r).tokens == eager
    assert serve(m, wl, runner=r, overlap=True).tokens == eager


def test_piecewise_runner(on_device):
    B = on_device
    m = _model(B)
    r = PiecewiseGraphRunner(m, B, max_num_tokens=16, buckets=[8, 16], progress=False)
    r.capture()
    batch = make_extend_batch(m, [1, 2, 3], PROMPTS)
    torch.testing.assert_close(r.forward(batch), EagerRunner(m).forward(batch),
                               rtol=1e-4, atol=1e-4)


def test_speculative_generate_graphed(on_device):
    B = on_device
    target = _model(B)
    draft = make_draft(target, n_layer=1, noise=0.05)
    dr = DraftGraphRunner(draft, B, 2, max_bs=4)
    dr.capture()
    vr = DecodeGraphRunner(target, B, max_bs=4, num_tokens_per_bs=3, progress=False)
    vr.capture()
    out = speculative_generate(target, draft, PROMPTS, 8, draft_runner=dr, verify_runner=vr)
    plain = greedy_generate(target, PROMPTS, 8).tokens
    assert out.tokens == [plain[i] for i in range(len(PROMPTS))]
    assert out.draft_stats["eager"] == 0 and out.verify_stats["graph"] > 0


def test_speculative_measure(on_device):
    rows = measure(on_device, batch_size=2, num_steps=2, max_new_tokens=4, noises=(0.1,),
                   rounds=1)
    assert len(rows) == 4 and all(r["same_tokens"] for r in rows)


def test_full_step_trainer(on_device):
    B = on_device
    cfg = FS.CONFIGS["tiny"]
    gen = torch.Generator().manual_seed(0)
    batches = [[tuple(t.to(B.device) for t in mb) for mb in FS.random_microbatches(cfg, gen)]
               for _ in range(4)]
    models = [FS.build_lm(cfg, B.device) for _ in range(2)]
    eager = FS.EagerTrainer(models[0], FS.lm_loss,
                            FS.make_capturable_optimizer(models[0].parameters(), B, lr=1e-2))
    graph = FS.FullStepTrainer(models[1], FS.lm_loss,
                               FS.make_capturable_optimizer(models[1].parameters(), B, lr=1e-2),
                               B, cfg.num_microbatches, warmup_steps=1)
    for batch in batches:
        assert graph.step(batch).item() == pytest.approx(eager.step(batch).item(), rel=1e-5,
                                                         abs=1e-6)
    assert graph.captured
