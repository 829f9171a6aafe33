"""Lesson 07's checkers: each real learner mistake is rejected with a message that names
it, and the reference answer passes."""

from __future__ import annotations

import re

import pytest
import torch
from helpers import assert_usable

from labkit import backend
from labkit.checks import lesson07 as L
from labkit.checks.lesson07 import make_step as LM

E = backend.get("emulated")


# ---- exercise 1: fill_static_buffers ------------------------------------------------------

def fill_right(buffers, microbatches):
    for bufs, mb in zip(buffers, microbatches):
        for buf, new in zip(bufs, mb):
            buf.copy_(new, non_blocking=True)


def fill_foreach(buffers, microbatches):
    dst = [t for b in buffers for t in b]
    src = [t for m in microbatches for t in m]
    torch._foreach_copy_(dst, src, non_blocking=True)


def fill_rebinds(buffers, microbatches):
    for i, mb in enumerate(microbatches):
        buffers[i] = mb


def fill_loop_variable(buffers, microbatches):
    for bufs, mb in zip(buffers, microbatches):
        for buf, new in zip(bufs, mb):
            buf = new  # noqa: F841


def fill_first_only(buffers, microbatches):
    for b, m in zip(buffers[0], microbatches[0]):
        b.copy_(m, non_blocking=True)


def fill_tokens_only(buffers, microbatches):
    for bufs, mb in zip(buffers, microbatches):
        bufs[0].copy_(mb[0], non_blocking=True)


def fill_blocking(buffers, microbatches):
    for bufs, mb in zip(buffers, microbatches):
        for buf, new in zip(bufs, mb):
            buf.copy_(new)


def fill_slice_assign(buffers, microbatches):
    for bufs, mb in zip(buffers, microbatches):
        for buf, new in zip(bufs, mb):
            buf[:] = new


def fill_wrong_direction(buffers, microbatches):
    for bufs, mb in zip(buffers, microbatches):
        for buf, new in zip(bufs, mb):
            new.copy_(buf, non_blocking=True)


def fill_reversed(buffers, microbatches):
    for bufs, mb in zip(buffers, reversed(microbatches)):
        for buf, new in zip(bufs, mb):
            buf.copy_(new, non_blocking=True)


def fill_own_stream(buffers, microbatches):
    with E.stream(E.Stream()):
        for bufs, mb in zip(buffers, microbatches):
            for buf, new in zip(bufs, mb):
                buf.copy_(new, non_blocking=True)


def fill_clone_tuple(buffers, microbatches):
    for i, mb in enumerate(microbatches):
        buffers[i] = tuple(t.clone() for t in mb)


def fill_syncs_stream(buffers, microbatches):
    fill_right(buffers, microbatches)
    backend.get("auto").current_stream().synchronize()


def fill_syncs_event(buffers, microbatches):
    fill_right(buffers, microbatches)
    E.current_stream().record_event().synchronize()


def fill_syncs_backend(buffers, microbatches):
    fill_right(buffers, microbatches)
    backend.get("auto").synchronize()


def fill_syncs_torch_cuda(buffers, microbatches):
    fill_right(buffers, microbatches)
    torch.cuda.synchronize()


def fill_flattened(buffers, microbatches):
    """A tester's correct answer: both lists flattened, then one loop."""
    dst = [t for bufs in buffers for t in bufs]
    src = [t for mb in microbatches for t in mb]
    for d, s in zip(dst, src):
        d.copy_(s, non_blocking=True)


@pytest.mark.parametrize("fn", [fill_right, fill_foreach, fill_flattened])
def test_fill_reference_passes(fn):
    assert L.check_fill_static_buffers(fn, device="cpu")


@pytest.mark.parametrize("fn,words", [
    (fill_rebinds, "different tensors than before the call"),
    (fill_clone_tuple, "Don't assign to buffers[i]"),
    (fill_loop_variable, "no buffer was written: rebinding a loop variable"),
    (fill_first_only, "buffers[1][0] (tokens of microbatch 1)"),
    (fill_tokens_only, "buffers[0][1] (targets of microbatch 0)"),
    (fill_blocking, "is blocking: the exercise asks for non_blocking=True"),
    (fill_slice_assign, "buf[:] = new is a blocking copy"),
    (fill_wrong_direction, "the copy goes the wrong way"),
    (fill_reversed, "each microbatch goes into its own buffers"),
    (fill_own_stream, "Streams are not your job"),
    (fill_syncs_stream, "calls Stream.synchronize(): the exercise says synchronize nothing"),
    (fill_syncs_event, "calls Event.synchronize(): the exercise says synchronize nothing"),
    (fill_syncs_backend, "calls B.synchronize(): the exercise says synchronize nothing"),
    (fill_syncs_torch_cuda, "calls torch.cuda.synchronize(): the exercise says synchronize"),
])
def test_fill_wrong_answers(fn, words, capsys):
    res = L.check_fill_static_buffers(fn, device="cpu")
    assert not res
    assert words in res.message, res.message
    assert "copy_(new, non_blocking=True)" not in res.message     # not the answer first
    assert res.more_hints and "non_blocking=True" in res.more_hints[-1]
    assert "Traceback" not in capsys.readouterr().out
    assert_usable(E)


def test_fill_torch_cuda_sync_on_a_cpu_names_the_rule_not_the_install():
    res = L.check_fill_static_buffers(fill_syncs_torch_cuda, device="cpu")
    assert "not compiled with CUDA" not in res.message, res.message
    assert res.kind == "mismatch"


def test_fill_sync_watch_restores_what_it_patched():
    from labkit.emulator import streams
    before = (torch.cuda.synchronize, streams.Stream.synchronize, E.synchronize)
    L.check_fill_static_buffers(fill_syncs_stream, device="cpu", trials=1)
    assert (torch.cuda.synchronize, streams.Stream.synchronize, E.synchronize) == before


def test_fill_still_holding_old_data_names_the_tensor():
    res = L.check_fill_static_buffers(fill_first_only, device="cpu")
    assert "still hold the old data: fill every tensor of every microbatch" in res.message


# ---- exercise 2: run_iteration ------------------------------------------------------------

def run_right(it, warmup_steps, ops):
    if it < warmup_steps:
        return ops.eager()
    if not ops.captured:
        ops.capture()
    return ops.replay()


def run_no_replay_after_capture(it, warmup_steps, ops):
    if it < warmup_steps:
        return ops.eager()
    if not ops.captured:
        ops.capture()
        return None
    return ops.replay()


def run_off_by_one(it, warmup_steps, ops):
    if it <= warmup_steps:
        return ops.eager()
    if not ops.captured:
        ops.capture()
    return ops.replay()


def run_recaptures(it, warmup_steps, ops):
    if it < warmup_steps:
        return ops.eager()
    ops.capture()
    return ops.replay()


def run_never_captures(it, warmup_steps, ops):
    if it < warmup_steps:
        return ops.eager()
    return ops.replay()


def run_forgets_return(it, warmup_steps, ops):
    if it < warmup_steps:
        ops.eager()
        return None
    if not ops.captured:
        ops.capture()
    return ops.replay()


def run_capture_too_early(it, warmup_steps, ops):
    if not ops.captured and it == max(warmup_steps - 1, 0):
        ops.capture()
        return ops.replay()
    if it < warmup_steps:
        return ops.eager()
    return ops.replay()


def run_capture_then_eager(it, warmup_steps, ops):
    if it < warmup_steps:
        return ops.eager()
    if not ops.captured:
        ops.capture()
        return ops.eager()
    return ops.replay()


def run_keyed_on_equality(it, warmup_steps, ops):
    """A tester's correct answer: capture exactly at it == warmup_steps."""
    if it < warmup_steps:
        return ops.eager()
    if it == warmup_steps:
        ops.capture()
    return ops.replay()


def run_short_circuit(it, warmup_steps, ops):
    """A tester's correct answer: `ops.captured or ops.capture()`."""
    if it >= warmup_steps:
        ops.captured or ops.capture()
        return ops.replay()
    return ops.eager()


def run_clones_the_loss(it, warmup_steps, ops):
    """A right answer: the static loss is cloned, as a real tensor allows."""
    if it < warmup_steps:
        return ops.eager()
    if not ops.captured:
        ops.capture()
    return ops.replay().clone()


def run_item(it, warmup_steps, ops):
    if it < warmup_steps:
        return ops.eager().item()
    if not ops.captured:
        ops.capture()
    return ops.replay().item()


@pytest.mark.parametrize("fn", [run_keyed_on_equality, run_short_circuit,
                                run_clones_the_loss])
def test_run_iteration_testers_answers_pass(fn):
    assert L.check_run_iteration(fn)


def test_run_iteration_reference_passes():
    assert L.check_run_iteration(run_right)


@pytest.mark.parametrize("fn,words", [
    (run_no_replay_after_capture, "Capture records the step and computes nothing"),
    (run_off_by_one, "expected 'capture + replay'"),
    (run_recaptures, "Capture once"),
    (run_never_captures, "without a preceding successful capture"),
    (run_forgets_return, "did you forget `return`?"),
    (run_capture_too_early, "Too early"),
    (run_capture_then_eager, "Replay the graph you just captured"),
    (run_item, ".item()"),
])
def test_run_iteration_wrong_answers(fn, words):
    res = L.check_run_iteration(fn)
    assert not res
    assert words in res.message, res.message
    assert res.more_hints


# ---- exercise 3: update_found_inf ---------------------------------------------------------

def inf_right(found_inf, loss):
    found_inf.logical_or_(~torch.isfinite(loss))


def inf_ior(found_inf, loss):
    found_inf |= ~torch.isfinite(loss)


def inf_nan_only(found_inf, loss):
    found_inf.logical_or_(torch.isnan(loss))


def inf_self_compare(found_inf, loss):
    found_inf.logical_or_(loss != loss)


def inf_isinf_only(found_inf, loss):
    found_inf.logical_or_(torch.isinf(loss))


def inf_greater(found_inf, loss):
    found_inf.logical_or_(loss > 1e30)


def inf_host_if(found_inf, loss):
    if not torch.isfinite(loss):
        found_inf.fill_(True)


def inf_item(found_inf, loss):
    if not torch.isfinite(loss).item():
        found_inf.fill_(True)


def inf_overwrites(found_inf, loss):
    found_inf.copy_(~torch.isfinite(loss))


def inf_rebinds(found_inf, loss):
    found_inf = found_inf | ~torch.isfinite(loss)  # noqa: F841


def inf_inverted(found_inf, loss):
    found_inf.logical_or_(torch.isfinite(loss))


def inf_nan_or_plus_inf(found_inf, loss):
    found_inf.logical_or_(torch.isnan(loss) | (loss == float("inf")))


def inf_minus_itself(found_inf, loss):
    """A tester's correct answer: inf - inf and nan - nan are nan, finite - finite is 0."""
    found_inf |= (loss - loss) != 0


@pytest.mark.parametrize("fn", [inf_right, inf_ior, inf_minus_itself])
def test_update_found_inf_reference_passes(fn):
    assert L.check_update_found_inf(fn)


@pytest.mark.parametrize("fn,words", [
    (inf_nan_only, "your test catches NaN only"),
    (inf_self_compare, "your test catches NaN only"),
    (inf_isinf_only, "a NaN loss is not flagged"),
    (inf_greater, "a NaN loss is not flagged"),
    (inf_overwrites, "overwrites the flag with the latest loss's verdict"),
    (inf_rebinds, "Update it in place"),
    (inf_inverted, "True for an all-finite step"),
    (inf_nan_or_plus_inf, "a loss of -inf is not flagged"),
])
def test_update_found_inf_wrong_answers(fn, words):
    res = L.check_update_found_inf(fn)
    assert not res
    assert words in res.message, res.message
    assert "accumulate" not in res.message or fn is inf_overwrites
    assert_usable(E)


def test_nan_and_plus_inf_is_not_told_it_catches_nan_only():
    res = L.check_update_found_inf(inf_nan_or_plus_inf)
    assert "NaN only" not in res.message and "catches NaN and inf but not -inf" in res.message


def test_nan_only_is_not_told_to_accumulate():
    res = L.check_update_found_inf(inf_nan_only)
    assert "logical_or_" not in res.message and "overwrite" not in res.message


@pytest.mark.parametrize("fn,line", [(inf_host_if, "if not torch.isfinite(loss):"),
                                     (inf_item, "if not torch.isfinite(loss).item():")])
def test_update_found_inf_host_read_names_the_line_and_leaves_a_usable_process(fn, line):
    res = L.check_update_found_inf(fn)
    assert not res and res.kind == "exception"
    assert "operation not permitted when stream is capturing" in res.message
    assert line in res.message
    assert_usable(E)


# ---- exercise 4 (diagnosis): make_step -----------------------------------------------------

from labkit import full_step as FS  # noqa: E402


def step_fixed(model, opt, found_inf, static_batch):
    grads = FS.ensure_grads(model.parameters())

    def step():
        torch._foreach_zero_(grads)
        found_inf.fill_(False)
        loss = FS.forward_backward(model, FS.lm_loss, static_batch)
        found_inf.logical_or_(~torch.isfinite(loss))
        opt.step()
        return loss
    return step


def step_as_given(model, opt, found_inf, static_batch):     # the bug to find
    grads = FS.ensure_grads(model.parameters())
    found_inf.zero_()

    def step():
        torch._foreach_zero_(grads)
        loss = FS.forward_backward(model, FS.lm_loss, static_batch)
        found_inf.logical_or_(~torch.isfinite(loss))
        opt.step()
        return loss
    return step


def step_never_zeroed(model, opt, found_inf, static_batch):
    grads = FS.ensure_grads(model.parameters())

    def step():
        torch._foreach_zero_(grads)
        loss = FS.forward_backward(model, FS.lm_loss, static_batch)
        found_inf.logical_or_(~torch.isfinite(loss))
        opt.step()
        return loss
    return step


def step_zero_after_update(model, opt, found_inf, static_batch):
    grads = FS.ensure_grads(model.parameters())

    def step():
        torch._foreach_zero_(grads)
        loss = FS.forward_backward(model, FS.lm_loss, static_batch)
        found_inf.logical_or_(~torch.isfinite(loss))
        found_inf.zero_()
        opt.step()
        return loss
    return step


def step_rebinds_flag(model, opt, found_inf, static_batch):
    grads = FS.ensure_grads(model.parameters())

    def step():
        torch._foreach_zero_(grads)
        found_inf = torch.zeros((), dtype=torch.bool)
        loss = FS.forward_backward(model, FS.lm_loss, static_batch)
        found_inf.logical_or_(~torch.isfinite(loss))
        opt.step()
        return loss
    return step


def step_flag_after_optimizer(model, opt, found_inf, static_batch):
    grads = FS.ensure_grads(model.parameters())

    def step():
        torch._foreach_zero_(grads)
        found_inf.zero_()
        loss = FS.forward_backward(model, FS.lm_loss, static_batch)
        opt.step()
        found_inf.logical_or_(~torch.isfinite(loss))
        return loss
    return step


def step_grads_not_zeroed(model, opt, found_inf, static_batch):
    FS.ensure_grads(model.parameters())

    def step():
        found_inf.zero_()
        loss = FS.forward_backward(model, FS.lm_loss, static_batch)
        found_inf.logical_or_(~torch.isfinite(loss))
        opt.step()
        return loss
    return step


def step_zero_at_the_end(model, opt, found_inf, static_batch):
    """Skips the bad step, but clears the flag before the host can read it."""
    grads = FS.ensure_grads(model.parameters())

    def step():
        torch._foreach_zero_(grads)
        loss = FS.forward_backward(model, FS.lm_loss, static_batch)
        found_inf.logical_or_(~torch.isfinite(loss))
        opt.step()
        found_inf.zero_()
        return loss
    return step


def step_fresh_flag_copied_in(model, opt, found_inf, static_batch):
    """A tester's correct answer: a flag made inside step(), copied into found_inf."""
    grads = FS.ensure_grads(model.parameters())

    def step():
        torch._foreach_zero_(grads)
        flag = torch.zeros((), dtype=torch.bool, device=found_inf.device)
        loss = FS.forward_backward(model, FS.lm_loss, static_batch)
        flag.logical_or_(~torch.isfinite(loss))
        found_inf.copy_(flag)
        opt.step()
        return loss
    return step


def step_fill_false_and_loop_zero(model, opt, found_inf, static_batch):
    """A tester's correct answer: fill_(False) and a loop of zero_()."""
    grads = FS.ensure_grads(model.parameters())

    def step():
        found_inf.fill_(False)
        for g in grads:
            g.zero_()
        loss = FS.forward_backward(model, FS.lm_loss, static_batch)
        found_inf.logical_or_(~torch.isfinite(loss))
        opt.step()
        return loss
    return step


def step_ior_flag(model, opt, found_inf, static_batch):   # exercise 3's |= on a float flag
    grads = FS.ensure_grads(model.parameters())

    def step():
        torch._foreach_zero_(grads)
        found_inf.zero_()
        loss = FS.forward_backward(model, FS.lm_loss, static_batch)
        inf_ior(found_inf, loss)                 # an exercise-3 answer right for a bool flag
        opt.step()
        return loss
    return step


def step_counts_bad_grads(model, opt, found_inf, static_batch):   # a count, not a flag
    grads = FS.ensure_grads(model.parameters())

    def step():
        torch._foreach_zero_(grads)
        found_inf.zero_()
        loss = FS.forward_backward(model, FS.lm_loss, static_batch)
        for g in grads:
            found_inf.add_((~torch.isfinite(g)).any())
        opt.step()
        return loss
    return step


def step_returns_nothing(model, opt, found_inf, static_batch):   # the fix, minus `return`
    grads = FS.ensure_grads(model.parameters())

    def step():
        torch._foreach_zero_(grads)
        found_inf.zero_()
        loss = FS.forward_backward(model, FS.lm_loss, static_batch)
        found_inf.logical_or_(~torch.isfinite(loss))
        opt.step()
    return step


def step_host_if(model, opt, found_inf, static_batch):   # a host read inside the step
    grads = FS.ensure_grads(model.parameters())

    def step():
        torch._foreach_zero_(grads)
        found_inf.zero_()
        loss = FS.forward_backward(model, FS.lm_loss, static_batch)
        if not torch.isfinite(loss):
            found_inf.fill_(True)
        opt.step()
        return loss
    return step


def test_make_step_rejects_a_step_that_returns_nothing():
    res = L.check_make_step(step_returns_nothing, trials=1)
    assert not res
    assert "step() returned None" in res.message and "the loss" in res.message
    assert res.more_hints and "return" in res.more_hints[0]


def test_make_step_bitwise_or_on_the_float_flag_is_named_not_taken_for_a_stub():
    """torch raises NotImplementedError for |= on a float tensor: that is the learner's
    mistake, not the exercise's unfinished stub."""
    res = L.check_make_step(step_ior_flag, trials=1)
    assert not res and res.kind != "not_implemented"
    assert "float32" in res.message and "no bitwise or" in res.message
    assert "logical_or_" in res.message
    assert res.more_hints and "float" in res.more_hints[0]
    assert_usable(E)


def test_make_step_flag_other_than_0_or_1_is_named():
    """The fused step skips only on exactly 1.0: a count of bad gradients does not skip."""
    res = L.check_make_step(step_counts_bad_grads, trials=1)
    assert not res
    assert "skips a step only when the flag is exactly 1.0" in res.message, res.message
    assert res.more_hints and "exactly 1.0" in res.more_hints[0]


def test_make_step_host_read_names_the_line_and_its_hint():
    res = L.check_make_step(step_host_if, trials=1)
    assert not res
    assert "if not torch.isfinite(loss):" in res.message
    assert "previous error during capture" not in res.message     # the cause, not its echo
    assert "found_inf.zero_()" not in res.more_hints[0]
    assert "host" in res.more_hints[0]
    assert_usable(E)


@pytest.mark.parametrize("fn,first", [
    (step_as_given, "found_inf.zero_() belong to"),
    (step_grads_not_zeroed, "gradients"),
    (step_flag_after_optimizer, "opt.step()"),
])
def test_make_step_first_hint_is_about_the_mistake_seen(fn, first):
    res = L.check_make_step(fn, trials=1)
    assert res.more_hints and first in res.more_hints[0], res.more_hints


def test_make_step_reference_and_a_variant_pass():
    assert L.check_make_step(LM._reference_make_step)
    assert L.check_make_step(step_fixed, trials=1)
    assert L.check_make_step(step_fresh_flag_copied_in, trials=1)
    assert L.check_make_step(step_fill_false_and_loop_zero, trials=1)


def test_make_step_cleared_at_the_end_names_the_host_read():
    """The optimizer skipped the step; the message must say so and name the real
    requirement (the host reads the flag after the replay), not a missing verdict."""
    res = L.check_make_step(step_zero_at_the_end, trials=1)
    assert not res
    assert "the optimizer did skip the bad step" in res.message
    assert "reads the flag after the replay" in res.message
    assert "get its verdict" not in res.message


@pytest.mark.parametrize("fn,words", [
    (step_as_given, "happens only once"),
    (step_never_zeroed, "happens only once"),
    (step_zero_after_update, "the bad step was not flagged"),
    (step_zero_after_update, "is nothing clearing it between the verdict and opt.step()"),
    (step_zero_at_the_end, "clear it at the start of step(), not at the end"),
    (step_rebinds_flag, "the very tensor the optimizer holds"),
    (step_flag_after_optimizer, "the flag must be set before opt.step()"),
    (step_grads_not_zeroed, "are the gradients zeroed in place"),
])
def test_make_step_wrong_answers(fn, words):
    res = L.check_make_step(fn, trials=1)
    assert not res
    assert words in res.message, res.message
    assert "found_inf.zero_() into step()" not in res.message     # not the answer first
    assert_usable(E)


# ---- exercise 4: wrong tests of the loss, a replaced flag, another optimizer --------------

def _step_with_flag_update(update):
    def make_step(model, opt, found_inf, static_batch):
        grads = FS.ensure_grads(model.parameters())

        def step():
            torch._foreach_zero_(grads)
            found_inf.zero_()
            loss = FS.forward_backward(model, FS.lm_loss, static_batch)
            update(found_inf, loss)
            opt.step()
            return loss
        return step
    return make_step


step_nan_only = _step_with_flag_update(lambda f, loss: f.logical_or_(torch.isnan(loss)))
step_isinf_only = _step_with_flag_update(lambda f, loss: f.logical_or_(torch.isinf(loss)))


def step_replaces_opt_flag(model, opt, found_inf, static_batch):
    """Puts a new tensor into opt.found_inf: the optimizer skips, the given flag stays 0."""
    grads = FS.ensure_grads(model.parameters())

    def step():
        torch._foreach_zero_(grads)
        loss = FS.forward_backward(model, FS.lm_loss, static_batch)
        opt.found_inf = (~torch.isfinite(loss)).float()
        opt.step()
        return loss
    return step


def _step_with_own_optimizer(**kw):
    def make_step(model, opt, found_inf, static_batch):
        params = list(model.parameters())
        grads = FS.ensure_grads(params)
        mine = torch.optim.AdamW(params, lr=1e-2, **kw)
        if kw.get("foreach"):
            mine.found_inf = found_inf

        def step():
            torch._foreach_zero_(grads)
            found_inf.zero_()
            loss = FS.forward_backward(model, FS.lm_loss, static_batch)
            found_inf.logical_or_(~torch.isfinite(loss))
            mine.step()
            return loss
        return step
    return make_step


step_own_adamw = _step_with_own_optimizer()
step_own_foreach_with_flag = _step_with_own_optimizer(capturable=True, foreach=True)
step_own_capturable = _step_with_own_optimizer(capturable=True)


@pytest.mark.parametrize("fn,missed", [(step_nan_only, "inf"), (step_isinf_only, "nan")])
def test_make_step_a_test_of_the_loss_that_misses_a_kind_is_named(fn, missed):
    """The bad steps cover a NaN loss and a +inf loss: isnan-only and isinf-only fail, and
    the message names the loss that was missed."""
    res = L.check_make_step(fn, trials=1)
    assert not res
    assert "the bad step was not flagged" in res.message, res.message
    assert re.search(rf"replay \d+'s loss was {missed}, yet", res.message), res.message
    assert f"your test of the loss misses {missed}" in res.message, res.message
    assert res.more_hints and "NaN, inf, -inf" in res.more_hints[0]
    assert_usable(E)


def test_make_step_bad_steps_are_a_nan_and_an_inf_loss_in_either_order():
    """Every trial has a NaN-loss step and a +inf-loss step, good steps between and after,
    and the order changes between trials."""
    gen = lambda s: torch.Generator().manual_seed(s)                      # noqa: E731
    seen = set()
    for s in range(8):
        inputs = LM._make_inputs(gen(s))
        bad, n, _ = inputs
        (k1, a), (k2, b) = bad
        assert {a, b} == {"nan", "inf"} and 1 <= k1 and k1 + 2 <= k2 <= n - 2
        seen.add(a)
    assert seen == {"nan", "inf"}
    out = LM._run_guarded(LM._reference_make_step, [(1, "inf"), (3, "nan")], 5, seed=7)
    losses = [float(x) for x in out["losses"]]
    assert losses[1] == float("inf") and losses[3] != losses[3]
    assert out["flags"] == [0.0, 1.0, 0.0, 1.0, 0.0]
    assert out["moved"] == [True, False, True, False, True]


def test_update_found_inf_hint_does_not_suggest_ior():
    """|= works on exercise 3's bool flag but fails on exercise 4's float one."""
    res = L.check_update_found_inf(inf_nan_only)
    assert not res and all("|= ...)" not in h for h in res.more_hints), res.more_hints


def test_make_step_replacing_opt_found_inf_is_named():
    res = L.check_make_step(step_replaces_opt_flag, trials=1)
    assert not res
    assert "puts a new tensor into opt.found_inf" in res.message, res.message
    assert "update found_inf in place" in res.message
    assert "you clear the flag after opt.step()" not in res.message
    assert res.more_hints and "opt.found_inf" in res.more_hints[0]


@pytest.mark.parametrize("fn,words", [
    (step_own_adamw, "optimizer built without capturable=True"),
    (step_own_foreach_with_flag, "only torch's fused AdamW reads found_inf"),
    (step_own_capturable, "step() runs another optimizer"),
])
def test_make_step_another_optimizer_than_opt_is_named(fn, words):
    res = L.check_make_step(fn, trials=1)
    assert not res
    assert words in res.message, res.message
    assert "call opt.step()" in res.message.lower(), res.message
    assert ".item()" not in res.message                       # not a host read
    assert "the flag must be set before opt.step()" not in res.message
    assert res.more_hints and "`opt`" in res.more_hints[0]
    assert_usable(E)
