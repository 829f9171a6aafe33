"""labkit.full_step under misuse: every wrong input gets an error that names what was given,
what was expected and what to do, before anything is captured; a capture that fails
anyway leaves a usable process. Runs on every backend (the ``B`` fixture)."""

from __future__ import annotations

import pytest
import torch
from helpers import assert_usable

from labkit import full_step as FS
from labkit.guards import error_text

CFG = FS.CONFIGS["tiny"]


def batch(B, seed=0, cfg=CFG):
    return FS.random_microbatches(cfg, torch.Generator().manual_seed(seed), device=B.device)


def trainer(B, warmup_steps=1, **kw):
    model = FS.build_lm(CFG, B.device)
    opt = FS.make_capturable_optimizer(model.parameters(), B, lr=1e-2)
    return FS.FullStepTrainer(model, FS.lm_loss, opt, B, CFG.num_microbatches,
                              warmup_steps=warmup_steps, **kw)


def assert_host_read_refused(info, B):
    """The capture failed for the host read, in each backend's own words."""
    text = error_text(info.value)
    assert "operation not permitted when stream is capturing" in text, text
    if B.name == "cuda":
        assert "cudaErrorStreamCaptureUnsupported" in text, text
    else:
        assert "aten._local_scalar_dense" in text, text
        assert "reads a tensor's value on the host" in text, text


@pytest.mark.parametrize("n, error, message", [
    (0, ValueError, "num_microbatches must be >= 1, got 0: every step has at least one"),
    (-1, ValueError, "num_microbatches must be >= 1, got -1"),
    (1.5, TypeError, r"num_microbatches must be an int >= 1, got 1.5 \(float\)"),
    (True, TypeError, r"num_microbatches must be an int >= 1, got True \(bool\)"),
])
def test_num_microbatches_must_be_a_positive_int(B, n, error, message):
    model = FS.build_lm(CFG, B.device)
    opt = FS.make_capturable_optimizer(model.parameters(), B)
    with pytest.raises(error, match=message):
        FS.FullStepTrainer(model, FS.lm_loss, opt, B, n)
    with pytest.raises(error, match=message):
        FS.StaticBatchLoader(B, n)


@pytest.mark.parametrize("value", ["yes", "2", ""])
def test_foreach_load_switch_takes_0_or_1(B, monkeypatch, value):
    monkeypatch.setenv("LABKIT_FOREACH_LOAD", value)
    with pytest.raises(ValueError, match=f"LABKIT_FOREACH_LOAD={value!r}: set it to 1 .* or 0"):
        FS.StaticBatchLoader(B, 2)


def test_forward_backward_refuses_no_microbatches():
    model = FS.build_lm(CFG)
    with pytest.raises(ValueError, match="0 microbatches: a step needs at least one"):
        FS.forward_backward(model, FS.lm_loss, [])


def test_non_capturable_optimizer_is_refused_before_capture(B):
    model = FS.build_lm(CFG, B.device)
    with pytest.raises(ValueError) as info:
        FS.FullStepTrainer(model, FS.lm_loss, torch.optim.AdamW(model.parameters()), B, 2)
    msg = str(info.value)
    assert "AdamW has capturable=False" in msg
    assert "step count lives on the host" in msg
    assert "make_capturable_optimizer" in msg
    assert "AdamW(..., capturable=True)" in msg
    assert_usable(B)


def test_torchs_own_capturable_adamw_is_taken(B):
    """Built by hand rather than by make_capturable_optimizer: accepted on every backend."""
    model = FS.build_lm(CFG, B.device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, capturable=True)
    t = FS.FullStepTrainer(model, FS.lm_loss, opt, B, CFG.num_microbatches, warmup_steps=1)
    for k in range(3):
        assert torch.isfinite(t.step(batch(B, k))).item()
    assert t.captured


def test_a_backend_name_instead_of_a_backend():
    model = FS.build_lm(CFG)
    opt = torch.optim.AdamW(model.parameters(), capturable=True)
    with pytest.raises(TypeError, match=r"FullStepTrainer\(\.\.\., B, \.\.\.\) must be the backend "
                                        r"namespace .* got str 'emulated'.*labkit.backend.get"):
        FS.FullStepTrainer(model, FS.lm_loss, opt, "emulated", 2)


def test_not_an_optimizer(B):
    model = FS.build_lm(CFG, B.device)
    with pytest.raises(TypeError, match="must be a torch.optim.Optimizer, got list"):
        FS.FullStepTrainer(model, FS.lm_loss, list(model.parameters()), B, 2)


def test_failed_capture_leaves_a_usable_process(B):
    flag = {"sync": False}

    def step_fn():
        y = torch.ones(3, device=B.device) * 2
        if flag["sync"]:
            y.sum().item()                           # a host read: refused in capture
        return y

    w = FS.FullCudaGraphWrapper(step_fn, B, warmup_steps=1)
    w()
    flag["sync"] = True
    with pytest.raises(RuntimeError) as info:
        w()
    assert_host_read_refused(info, B)
    assert w.graph is None and w.result is None       # nothing half-built is kept
    assert_usable(B)
    flag["sync"] = False
    assert torch.equal(w().cpu(), torch.full((3,), 2.0))   # it can capture again
    assert_usable(B)


def test_trainer_with_a_syncing_loss_fails_cleanly(B):
    def loss_with_print(model, mb):
        loss = FS.lm_loss(model, mb)
        print(f"loss {loss.item():.3f}")             # a learner's debug print
        return loss

    model = FS.build_lm(CFG, B.device)
    opt = FS.make_capturable_optimizer(model.parameters(), B)
    t = FS.FullStepTrainer(model, loss_with_print, opt, B, CFG.num_microbatches,
                           warmup_steps=1)
    t.step(batch(B))
    with pytest.raises(RuntimeError) as info:
        t.step(batch(B, 1))
    assert_host_read_refused(info, B)
    assert not t.captured
    assert_usable(B)


def test_first_step_with_another_sequence_length(B):
    t = trainer(B)
    short = FS.random_microbatches(FS.LMConfig(seq_len=8), torch.Generator().manual_seed(0),
                                   device=B.device)
    with pytest.raises(ValueError) as info:
        t.step(short)
    msg = str(info.value)
    assert "(batch, seq_len=16)" in msg and "(2, 8)" in msg and "seq_len=8" in msg
    assert_usable(B)


def test_later_step_with_another_sequence_length(B):
    t = trainer(B)
    t.step(batch(B))
    short = [(x[:, :8], y[:, :8]) for x, y in batch(B, 1)]
    with pytest.raises(ValueError, match="fixed shapes: pad to the captured shape"):
        t.step(short)


@pytest.mark.parametrize("bad,where", [(64, "id 64"), (-1, "id -1")])
def test_tokens_out_of_vocabulary(B, bad, where):
    t = trainer(B)
    mbs = batch(B)
    mbs[1][0][0, 3] = bad
    with pytest.raises(ValueError) as info:
        t.step(mbs)
    msg = str(info.value)
    assert "microbatch 1: tokens hold the " + where in msg
    assert "vocabulary [0, 64)" in msg and "vocab_size" in msg
    assert_usable(B)


def test_tokens_out_of_vocabulary_after_capture_on_the_cpu(E):
    """Tokens in host memory are checked at every step (no device sync needed); the loader
    copies them to the device."""
    def host_batch(seed):
        return FS.random_microbatches(CFG, torch.Generator().manual_seed(seed))

    t = trainer(E)
    t.step(host_batch(0))
    t.step(host_batch(1))
    assert t.captured
    mbs = host_batch(2)
    mbs[0][1][0, 0] = 100
    with pytest.raises(ValueError, match="microbatch 0: targets hold the id 100"):
        t.step(mbs)
    t.step(host_batch(3))                             # the static buffers were not touched


def test_fewer_targets_than_tokens(B):
    t = trainer(B)
    mbs = batch(B)
    mbs[0] = (mbs[0][0], mbs[0][1][:1])
    with pytest.raises(ValueError, match=r"microbatch 0: targets \(1, 16\) for tokens \(2, 16\)"):
        t.step(mbs)


def test_a_microbatch_without_targets(B):
    t = trainer(B)
    mbs = batch(B)
    mbs[1] = (mbs[1][0],)
    with pytest.raises(ValueError, match=r"microbatch 1 is a tuple of 1; lm_loss needs a pair"):
        t.step(mbs)
    with pytest.raises(ValueError, match="lm_loss expects a microbatch .tokens, targets., "
                                         "got a Tensor"):
        FS.lm_loss(FS.build_lm(CFG, B.device), mbs[0][0])


def test_fewer_microbatches_than_the_trainer_has(B):
    t = trainer(B)
    with pytest.raises(ValueError) as info:
        t.step(batch(B)[:1])
    msg = str(info.value)
    assert "got 1 microbatches" in msg and "num_microbatches=2" in msg
    assert "pass exactly that many" in msg


def test_a_batch_that_is_not_a_list(B):
    t = trainer(B)
    with pytest.raises(TypeError, match="expects a list of 2 microbatches, got a Tensor"):
        t.step(torch.zeros(2, 16, dtype=torch.long, device=B.device))


def test_unknown_config_and_bad_wrapper_options(B):
    with pytest.raises(ValueError, match="unknown config 'small': choose one of tiny, bench"):
        FS.build_lm("small")
    with pytest.raises(ValueError, match="warmup_steps must be >= 0, got -1: the number of eager"):
        FS.FullCudaGraphWrapper(lambda: None, B, warmup_steps=-1)
    with pytest.raises(ValueError, match="capture_error_mode must be 'global', "
                                         "'thread_local' or 'relaxed', got 'local'"):
        FS.FullCudaGraphWrapper(lambda: None, B, capture_error_mode="local")


def test_found_inf_must_be_the_flag_the_fused_step_reads(B):
    params = [torch.nn.Parameter(torch.ones(2, device=B.device))]
    with pytest.raises(TypeError, match=r"make_capturable_optimizer: found_inf must be a "
                                        r"float32 tensor .*got a torch.bool tensor: make it "
                                        r"with torch.zeros\(\(\), device="):
        FS.make_capturable_optimizer(params, B, found_inf=torch.zeros((), dtype=torch.bool,
                                                                      device=B.device))
    with pytest.raises(ValueError, match=r"found_inf must be a 0-dim tensor on .*got shape "
                                         r"\(1,\) on"):
        FS.make_capturable_optimizer(params, B, found_inf=torch.zeros(1, device=B.device))
    with pytest.raises(ValueError, match=r"got shape \(\) on cpu"):   # host memory
        FS.make_capturable_optimizer(params, B, found_inf=torch.zeros(()))


def test_trainer_flag_other_than_the_optimizers_is_refused(B):
    model = FS.build_lm(CFG, B.device)
    opt = FS.make_capturable_optimizer(model.parameters(), B,
                                       found_inf=torch.zeros((), device=B.device))
    with pytest.raises(ValueError, match="found_inf is not the flag the optimizer reads.*"
                                         "would not be skipped.*found_inf=optimizer.found_inf"):
        FS.FullStepTrainer(model, FS.lm_loss, opt, B, CFG.num_microbatches,
                           found_inf=torch.zeros((), device=B.device))
    t = FS.FullStepTrainer(model, FS.lm_loss, opt, B, CFG.num_microbatches)
    assert t.found_inf is opt.found_inf and t.check_finite     # left out: the optimizer's


def test_float_tokens_are_refused(B):
    model = FS.build_lm(CFG, B.device)
    with pytest.raises(TypeError, match="integer token ids"):
        model(torch.zeros(2, 16, device=B.device))


def test_no_warmup_step(B):
    """warmup_steps=0: torch's AdamW creates its state in its first step, which would be
    inside the capture, so the trainer refuses; once one eager optimizer step has created
    it, the trainer captures at once and trains like eager."""
    model, twin = FS.build_lm(CFG, B.device), FS.build_lm(CFG, B.device)
    opt = FS.make_capturable_optimizer(model.parameters(), B, lr=1e-2)
    with pytest.raises(ValueError, match="warmup_steps=0, and the state of AdamW does "
                                         "not exist yet.*Use warmup_steps >= 1"):
        FS.FullStepTrainer(model, FS.lm_loss, opt, B, CFG.num_microbatches, warmup_steps=0)
    e = FS.EagerTrainer(twin, FS.lm_loss, FS.make_capturable_optimizer(twin.parameters(), B,
                                                                       lr=1e-2))
    first = batch(B)
    FS.EagerTrainer(model, FS.lm_loss, opt).step(first)     # the state exists from here
    e.step(first)
    t = FS.FullStepTrainer(model, FS.lm_loss, opt, B, CFG.num_microbatches, warmup_steps=0)
    for k in range(1, 4):
        b = batch(B, k)
        assert t.step(b).item() == pytest.approx(e.step(b).item(), rel=1e-5)
    assert t.captured and t.fwd_bwd.captured_at == 0


def test_flag_must_be_float32(B):
    with pytest.raises(TypeError, match="found_inf must be a float32 tensor .*got torch.bool"):
        FS.nonfinite_flag(torch.zeros((), dtype=torch.bool, device=B.device),
                          torch.ones(2, device=B.device))


def test_random_microbatches_by_name():
    assert len(FS.random_microbatches("tiny")) == CFG.num_microbatches
    with pytest.raises(ValueError, match="unknown config 'huge'"):
        FS.random_microbatches("huge")
