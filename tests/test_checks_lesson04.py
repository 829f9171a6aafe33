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


def test_connected_params_accepts_the_reference(capsys):
    assert check_connected_params(bridge.get_connected_params)
    assert check_connected_params(cp_reference)
    assert capsys.readouterr().out.count("✅ connected_params") == 2


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
])
def test_connected_params_rejects_learner_mistakes(fn, words):
    res = check_connected_params(fn, quiet=True)
    assert not res, fn.__name__
    assert words in res.message, (fn.__name__, res.message)
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
       assign=False):
    """The reference bridge_backward with one learner mistake switched on."""

    def fn(runner, grads):
        pairs = list(zip(grads, runner.static_grad_outputs))
        if swap:
            pairs = list(zip(reversed(grads), runner.static_grad_outputs))

        def do_copy():
            for g, static in pairs:
                if static is None and skip_none:
                    continue
                if assign:
                    static = g          # noqa: F841 - the mistake: rebinding a name
                    continue
                if g.data_ptr() != static.data_ptr():
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
                p.grad_added_to_main_grad = added
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
            out += tuple(runner.static_grad_inputs[:n])
        if wgrads:
            out += tuple(ws)
        return out

    return fn


def test_bridge_backward_accepts_the_reference(B, one_thread, capsys):
    assert check_bridge_backward(bridge.replay_backward, B=B)
    assert check_bridge_backward(bb(), B=B)
    assert capsys.readouterr().out.count("✅ bridge_backward") == 2


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
])
def test_bridge_backward_rejects_learner_mistakes(B, one_thread, mistake, words):
    res = check_bridge_backward(bb(**mistake), B=B, quiet=True)
    assert not res, mistake
    assert words in res.message, (mistake, res.message)


def test_bridge_backward_uncloned_explains_why_the_end_to_end_cell_can_pass(B, one_thread):
    """Returning the static buffers themselves trains right with .grad accumulation (the
    notebook's end-to-end cell prints True) but not with a deferred reduction: the
    message says both, with the measured numbers."""
    res = check_bridge_backward(bb(clone=False), B=B, quiet=True)
    assert "end-to-end cell's .grad line can print True" in res.message
    assert "deferred reduction" in res.message


def test_bridge_backward_not_done_and_forgot_return(B, one_thread):
    def blank(runner, grads):
        raise NotImplementedError()

    res = check_bridge_backward(blank, B=B, quiet=True)
    assert not res and res.kind == "not_implemented"

    def no_return(runner, grads):
        bridge.replay_backward(runner, grads)

    res = check_bridge_backward(no_return, B=B, quiet=True)
    assert not res and "did you forget `return`" in res.message
