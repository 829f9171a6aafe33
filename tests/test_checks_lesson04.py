"""Lesson 04 checkers: the reference passes; real learner mistakes are rejected with a
message that names the mistake (issue 10 §1)."""

from __future__ import annotations

import pytest
import torch

from labkit import bridge
from labkit.bridge import GraphStatus
from labkit.checks.lesson04 import check_bridge_backward, check_connected_params

# ---- connected_params ----------------------------------------------------------------------


def _walk(outputs, *, first_only=False, dedupe=True, skip_none=True, inputs_too=False,
          order="module", as_list=False, depth=None):
    """The reference walk with one learner mistake switched on."""
    if isinstance(outputs, torch.Tensor):
        outs = (outputs,)
    else:
        outs = tuple(outputs)
    if first_only:
        outs = outs[:1]
    stack = [(o.grad_fn, 0) for o in outs
             if not skip_none or (o.requires_grad and o.grad_fn is not None)]
    visited, found = set(), []
    while stack:
        node, d = stack.pop()
        if dedupe and node in visited:
            continue
        visited.add(node)
        if hasattr(node, "variable"):
            found.append(node.variable)
        if depth is not None and d >= depth:
            continue
        stack.extend((n, d + 1) for n, _ in node.next_functions
                     if n is not None or not skip_none)
    return found


def cp_reference(outputs, module):
    found = {id(v) for v in _walk(outputs)}
    return tuple(p for p in module.parameters() if id(p) in found)


def cp_every_leaf(outputs, module):
    """Returns every AccumulateGrad variable: inputs that require grad included."""
    return tuple(_walk(outputs))


def cp_every_leaf_sorted(outputs, module):
    found = {id(v) for v in _walk(outputs)}
    params = [p for p in module.parameters() if id(p) in found]
    others = [v for v in _walk(outputs) if all(v is not p for p in module.parameters())]
    return tuple(params + others)


def cp_first_output_only(outputs, module):
    found = {id(v) for v in _walk(outputs, first_only=True)}
    return tuple(p for p in module.parameters() if id(p) in found)


def cp_all_trainable(outputs, module):
    return tuple(p for p in module.parameters() if p.requires_grad)


def cp_all_parameters(outputs, module):
    return tuple(module.parameters())


def cp_discovery_order(outputs, module):
    ids = {id(p) for p in module.parameters()}
    seen, out = set(), []
    for v in _walk(outputs):
        if id(v) in ids and id(v) not in seen:
            seen.add(id(v))
            out.append(v)
    return tuple(out)


def cp_no_visited_set(outputs, module):
    ids = {id(p) for p in module.parameters()}
    found = [v for v in _walk(outputs, dedupe=False) if id(v) in ids]
    order = {id(p): i for i, p in enumerate(module.parameters())}
    return tuple(sorted(found, key=lambda v: order[id(v)]))


def cp_no_none_skip(outputs, module):
    found = {id(v) for v in _walk(outputs, skip_none=False)}
    return tuple(p for p in module.parameters() if id(p) in found)


def cp_one_level(outputs, module):
    found = {id(v) for v in _walk(outputs, depth=1)}
    return tuple(p for p in module.parameters() if id(p) in found)


def cp_list(outputs, module):
    return list(cp_reference(outputs, module))


def cp_names(outputs, module):
    ids = {id(v) for v in _walk(outputs)}
    return tuple(n for n, p in module.named_parameters() if id(p) in ids)


def cp_forgot_return(outputs, module):
    cp_reference(outputs, module)


def cp_recursive(outputs, module):
    """A tester's correct answer: a recursive walk."""
    outs = [outputs] if torch.is_tensor(outputs) else list(outputs)
    hit, seen = set(), set()

    def visit(node):
        if node is None or node in seen:
            return
        seen.add(node)
        v = getattr(node, "variable", None)
        if v is not None:
            hit.add(id(v))
        for nxt, _ in node.next_functions:
            visit(nxt)

    for o in outs:
        if o.requires_grad:
            visit(o.grad_fn)
    return tuple(p for p in module.parameters() if id(p) in hit)


def cp_autograd_grad(outputs, module):
    """A tester's correct answer: ask autograd.grad which parameters get a gradient."""
    outs = (outputs,) if isinstance(outputs, torch.Tensor) else tuple(outputs)
    ws = [p for p in module.parameters() if p.requires_grad]
    gs = torch.autograd.grad([o.sum() for o in outs if o.requires_grad], ws,
                             allow_unused=True, retain_graph=True)
    return tuple(p for p, g in zip(ws, gs) if g is not None)


def cp_matrices_only(outputs, module):
    """Keeps only the weights (2 or more dims), thinking biases need no wgrad."""
    return tuple(p for p in cp_reference(outputs, module) if p.dim() >= 2)


def cp_membership_eq(outputs, module):
    """`p in list` compares tensors with ==: an ambiguous Boolean."""
    found, kept = _walk(outputs), []
    for p in module.parameters():
        if p in found:
            kept.append(p)
    return tuple(kept)


def test_connected_params_accepts_the_reference(capsys):
    assert check_connected_params(bridge.get_connected_params)
    assert check_connected_params(cp_reference)
    assert check_connected_params(cp_recursive)
    assert check_connected_params(cp_autograd_grad)
    assert capsys.readouterr().out.count("✅ connected_params") == 4


@pytest.mark.parametrize("fn, words", [
    (cp_every_leaf, "an input tensor"),
    (cp_every_leaf_sorted, "Inputs that require grad"),
    (cp_first_output_only, "you walked only outputs[0]"),
    (cp_all_trainable, "not used by any output"),
    (cp_all_parameters, "is frozen (requires_grad=False)"),
    (cp_discovery_order, "wrong order"),
    (cp_no_visited_set, "appear more than once"),
    (cp_no_none_skip, "grad_fn None"),
    (cp_one_level, "the walk stopped early"),
    (cp_list, "returned a list, expected a tuple"),
    (cp_names, "return the parameter tensors themselves"),
    (cp_forgot_return, "did you forget `return`"),
    (cp_membership_eq, "Compare parameters by identity"),
    (cp_matrices_only, "you kept only parameters of 2 or more dims"),
])
def test_connected_params_rejects_learner_mistakes(fn, words):
    res = check_connected_params(fn, quiet=True)
    assert not res, fn.__name__
    assert words in res.message, (fn.__name__, res.message)
    if fn is not cp_one_level:
        assert "the walk stopped early" not in res.message   # blamed only on a short walk
    assert "tuple(p for p in module.parameters()" not in res.message   # not the answer first


def test_connected_params_trials_plant_the_traps():
    """Trial 1 feeds an input that requires grad; trial 2 a second output with its own
    parameters. Both mistakes fail in the trial meant for them."""
    assert "trial 1 of" in check_connected_params(cp_every_leaf, quiet=True).message
    assert "trial 2 of" in check_connected_params(cp_first_output_only, quiet=True).message


def test_connected_params_not_done_and_not_callable():
    def blank(outputs, module):
        raise NotImplementedError()

    res = check_connected_params(blank, quiet=True)
    assert not res and res.kind == "not_implemented" and "not done yet" in res.message
    res = check_connected_params("connected_params", quiet=True)
    assert not res and "expected a function, got str" in res.message


# ---- bridge_backward ------------------------------------------------------------------------


def bb(*, copy=True, skip_none=True, copy_after=False, status=True, flag=True, clone=True,
       detach_only=False, dgrads=True, wgrads=True, clone_none=False, swap=False,
       assign=False, drop_none_first=False, rebind=None, always_copy=False,
       none_to_zeros=False, as_list=False, flags_all_true=False):
    """The reference bridge_backward with one learner mistake switched on."""

    def fn(runner, grads):
        pairs = list(zip(grads, runner.static_grad_outputs))
        if swap:
            pairs = list(zip(reversed(grads), runner.static_grad_outputs))
        if drop_none_first:   # pairs grads with the buffers left after dropping the Nones
            pairs = list(zip(grads, [s for s in runner.static_grad_outputs if s is not None]))

        def do_copy():
            for g, static in pairs:
                if static is None and skip_none:
                    continue
                if assign:
                    static = g          # noqa: F841 - the mistake: rebinding a name
                    continue
                if rebind == "data":
                    static.data = g
                    continue
                if rebind == "set":
                    static.set_(g)
                    continue
                if always_copy or g.data_ptr() != static.data_ptr():
                    static.copy_(g)

        if copy and not copy_after:
            do_copy()
        runner.bwd_graph.replay()
        if copy_after:
            do_copy()
        if status:
            runner.status = GraphStatus.FWD_READY
        if flag:
            for p, added in runner.groundtruth_grad_added_to_main_grad.items():
                p.grad_added_to_main_grad = True if flags_all_true else added
        n = runner.num_dgrads
        ws = runner.static_grad_inputs[n:]
        if clone_none:     # clones every entry: the dgrad of an input without grad is None
            return tuple(g.clone() for g in runner.static_grad_inputs)
        if detach_only:
            ws = tuple(w.detach() if w is not None else None for w in ws)
        elif clone:
            ws = tuple(w.clone() if w is not None else None for w in ws)
        out = ()
        if dgrads:
            ds = runner.static_grad_inputs[:n]
            if none_to_zeros:      # "a gradient of zeros is safer than None"
                xs = runner.static_args
                ds = [d if d is not None else torch.zeros_like(x) for d, x in zip(ds, xs)]
            out += tuple(ds)
        if wgrads:
            out += tuple(ws)
        return list(out) if as_list else out

    return fn


def bb_empty_like_copy(runner, grads):
    """A tester's correct answer: wgrads copied into empty_like instead of clone()."""
    for buf, g in zip(runner.static_grad_outputs, grads):
        if buf is not None and buf.data_ptr() != g.data_ptr():
            buf.copy_(g)
    runner.bwd_graph.replay()
    runner.status = GraphStatus.FWD_READY
    for p, flag in runner.groundtruth_grad_added_to_main_grad.items():
        p.grad_added_to_main_grad = flag
    return tuple(t if (i < runner.num_dgrads or t is None) else torch.empty_like(t).copy_(t)
                 for i, t in enumerate(runner.static_grad_inputs))


def test_bridge_backward_accepts_the_reference(B, one_thread, capsys):
    assert check_bridge_backward(bridge.replay_backward, B=B)
    assert check_bridge_backward(bb(), B=B)
    assert check_bridge_backward(bb_empty_like_copy, B=B)
    assert capsys.readouterr().out.count("✅ bridge_backward") == 3


@pytest.mark.parametrize("mistake, words", [
    ({"skip_none": False}, "no grad buffer): step 1 says to skip"),
    ({"copy": False}, "copy_ the incoming grads"),
    ({"copy_after": True}, "you copied the new grads in after replaying"),
    ({"assign": True}, "assigning to a name"),
    ({"status": False}, "it must be FWD_READY"),
    ({"flag": False}, "grad_added_to_main_grad is False"),
    ({"clone": False}, "clone each wgrad"),
    ({"detach_only": True}, "clone each wgrad"),
    ({"dgrads": False}, "one per tensor of runner.input_surface"),
    ({"wgrads": False}, "one per tensor of runner.input_surface"),
    ({"clone_none": True}, "None stays None"),
    ({"swap": True}, "grads[i] belongs in runner.static_grad_outputs[i]"),
    ({"drop_none_first": True}, "grads[i] belongs in runner.static_grad_outputs[i]"),
    ({"rebind": "data"}, "you rebound the buffer"),
    ({"rebind": "set"}, "you rebound the buffer"),
    ({"always_copy": True}, "already is runner.static_grad_outputs"),
    ({"none_to_zeros": True}, "None stays None"),
    ({"as_list": True}, "returned a list"),
    ({"flags_all_true": True}, "grad_added_to_main_grad is True on"),
])
def test_bridge_backward_rejects_learner_mistakes(B, one_thread, mistake, words):
    res = check_bridge_backward(bb(**mistake), B=B, quiet=True)
    assert not res, mistake
    assert words in res.message, (mistake, res.message)


def test_bridge_backward_names_the_direction_of_a_wrong_main_grad_flag(B, one_thread):
    res = check_bridge_backward(bb(flags_all_true=True), B=B, quiet=True)
    assert "grad_added_to_main_grad is False" not in res.message, res.message
    assert "left it False" in res.message and "lost" in res.message
    res = check_bridge_backward(bb(flag=False), B=B, quiet=True)
    assert "is True on" not in res.message


def test_bridge_backward_first_hint_is_the_step_of_the_mistake(B, one_thread):
    res = check_bridge_backward(bb(flag=False), B=B, quiet=True)
    assert res.more_hints[0].startswith("Steps 2-4")
    res = check_bridge_backward(bb(clone=False), B=B, quiet=True)
    assert res.more_hints[0].startswith("Step 5")
    res = check_bridge_backward(bb(copy=False), B=B, quiet=True)
    assert res.more_hints[0].startswith("Step 1")


def test_bridge_backward_uncloned_explains_why_the_end_to_end_cell_can_pass(B, one_thread):
    """Returning the static buffers themselves trains right with .grad accumulation (the
    notebook's end-to-end cell prints True) but not with a deferred reduction: the
    message says both, with the measured numbers."""
    res = check_bridge_backward(bb(clone=False), B=B, quiet=True)
    assert "end-to-end cell's .grad line can print True" in res.message
    assert "deferred reduction" in res.message


def test_bridge_backward_detached_wgrads_are_stolen_by_accumulate_grad(B, one_thread):
    """A .detach()ed wgrad is a new tensor object over the buffer: AccumulateGrad steals it,
    so even .grad accumulation is wrong. The message must not claim the .grad line can
    print True."""
    res = check_bridge_backward(bb(detach_only=True), B=B, quiet=True)
    assert "even training with gradients accumulated in .grad differs" in res.message
    assert "steals it as .grad" in res.message
    assert "can print True" not in res.message


def test_bridge_backward_rebinding_is_not_called_copy_after_replay(B, one_thread):
    for how in ("data", "set"):
        res = check_bridge_backward(bb(rebind=how), B=B, quiet=True)
        assert "after replaying" not in res.message, res.message


def test_bridge_backward_first_trial_has_a_none_buffer_before_a_real_one(B, one_thread):
    """Pairing grads with the non-None buffers fails in trial 1 (outputs without grad come
    before one with grad there)."""
    res = check_bridge_backward(bb(drop_none_first=True), B=B, quiet=True)
    assert "trial 1 of" in res.message and "without grad (grad buffer None), with grad" \
        in res.message, res.message


def test_bridge_backward_not_done_and_forgot_return(B, one_thread):
    def blank(runner, grads):
        raise NotImplementedError()

    res = check_bridge_backward(blank, B=B, quiet=True)
    assert not res and res.kind == "not_implemented"

    def no_return(runner, grads):
        bridge.replay_backward(runner, grads)

    res = check_bridge_backward(no_return, B=B, quiet=True)
    assert not res and "did you forget `return`" in res.message


# ---- graph_stage (diagnosis) ------------------------------------------------------------------

from labkit.checks.lesson04 import check_graph_stage  # noqa: E402


def gs(*, fix="all", first="keep", inplace=False, same_sample=False, forget_return=False):
    """The exercise's graph_stage: ``fix`` says which samples of blocks 1.. require grad
    ("none" is the broken version, "last" fixes only the last block, "flag" copies the
    stage input's flag); ``first`` says what block 0 gets."""

    def fn(blocks, sample):
        samples, h = [], sample
        with torch.no_grad():
            for i, blk in enumerate(blocks):
                if same_sample:
                    s = sample
                elif i == 0:
                    s = {"keep": sample,
                         "grad": sample.detach().clone().requires_grad_()}[first]
                    if inplace:
                        s = sample.requires_grad_()
                elif fix == "all" or (fix == "last" and i == len(blocks) - 1):
                    s = h.detach().clone().requires_grad_()
                elif fix == "flag":
                    s = h.detach().clone().requires_grad_(sample.requires_grad)
                else:
                    s = h.clone()
                samples.append((s,))
                h = blk(h)
        out = bridge.make_graphed_callables(tuple(blocks), tuple(samples), num_warmup_iters=1)
        if not forget_return:
            return out

    return fn


def gs_one_call_per_block(blocks, sample):
    """Right samples, but make_graphed_callables once per block: a list of graphed blocks."""
    samples, h = [sample.detach().clone().requires_grad_(sample.requires_grad)], sample
    with torch.no_grad():
        for blk in blocks[:-1]:
            h = blk(h)
            samples.append(h.detach().clone().requires_grad_())
    return [bridge.make_graphed_callables(b, (s,)) for b, s in zip(blocks, samples)]


def gs_no_grad_walk(blocks, sample):
    """A tester's correct answer: the shapes from a walk under no_grad, then fresh leaves."""
    samples, h = [(sample.detach().clone().requires_grad_(sample.requires_grad),)], sample
    with torch.no_grad():
        for blk in blocks[:-1]:
            h = blk(h)
            samples.append((torch.zeros_like(h, requires_grad=True),))
    return bridge.make_graphed_callables(tuple(blocks), tuple(samples))


def gs_eager_walk(blocks, sample):
    """The shapes from a walk *with* grad whose last output is still alive at capture."""
    samples, h = [(sample.detach().clone().requires_grad_(sample.requires_grad),)], sample
    for blk in blocks[:-1]:
        h = blk(h)
        samples.append((torch.zeros_like(h, requires_grad=True),))
    return bridge.make_graphed_callables(tuple(blocks), tuple(samples))


def test_graph_stage_accepts_the_reference(B, one_thread, capsys):
    assert check_graph_stage(gs(), B=B)
    assert check_graph_stage(gs_no_grad_walk, B=B)
    assert capsys.readouterr().out.count("✅ graph_stage") == 2


def test_graph_stage_eager_walk_with_live_autograd_graph(B, one_thread):
    # On a GPU the live autograd graph of the eager walk (AccumulateGrad nodes on the
    # default stream) invalidates the backward capture (seen on the H200, torch 2.11); the
    # emulator does not model autograd's per-stream state, so there the answer passes.
    res = check_graph_stage(gs_eager_walk, B=B, quiet=True)
    if B.name == "cuda":
        assert not res and "torch.no_grad()" in res.message and "AccumulateGrad" in res.message
    else:
        assert res


@pytest.mark.parametrize("mistake, words", [
    ({"fix": "none"}, "block 1 was captured from a sample that does not require grad"),
    ({"fix": "last"}, "block 1 was captured from a sample that does not require grad"),
    ({"fix": "flag"}, "trial 1 of"),
    ({"first": "grad"}, "computes a dgrad nobody uses"),
    ({"inplace": True}, "you changed the caller's `sample`"),
    ({"same_sample": True}, "your code raised"),
    ({"forget_return": True}, "did you forget `return`"),
])
def test_graph_stage_rejects_learner_mistakes(B, one_thread, mistake, words):
    res = check_graph_stage(gs(**mistake), B=B, quiet=True)
    assert not res, mistake
    assert words in res.message, (mistake, res.message)
    assert "requires_grad_()" not in res.message.split("Look at")[0] or "in place" in \
        res.message   # the first message names the mistake, not the fix


def test_graph_stage_names_a_list_of_graphed_blocks(B, one_thread):
    res = check_graph_stage(gs_one_call_per_block, B=B, quiet=True)
    assert not res
    assert "returned a list of" in res.message and "a tuple" in res.message, res.message
    assert "graphed callable(s) for" not in res.message     # not "returned 1 ..."


def test_graph_stage_broken_version_fails_in_the_first_stage_trial(B, one_thread):
    res = check_graph_stage(gs(fix="none"), B=B, quiet=True)
    assert "trial 1 of" in res.message and "needs no grad (a first stage)" in res.message
    res = check_graph_stage(gs(fix="flag"), B=B, quiet=True)
    assert "block 0's output, which requires grad" in res.message


def test_graph_stage_recovers_after_a_failed_capture(B, one_thread):
    def bad_shapes(blocks, sample):
        return bridge.make_graphed_callables(
            tuple(blocks), tuple((sample.detach().clone(),) for _ in blocks))

    res = check_graph_stage(bad_shapes, B=B, quiet=True)
    assert not res and res.kind == "exception"
    assert check_graph_stage(gs(), B=B, quiet=True)        # the backend still captures


def test_graph_stage_not_done_and_not_callable(B):
    def blank(blocks, sample):
        raise NotImplementedError()

    res = check_graph_stage(blank, B=B, quiet=True)
    assert not res and res.kind == "not_implemented"
    res = check_graph_stage(42, B=B, quiet=True)
    assert not res and "expected a function, got int" in res.message
