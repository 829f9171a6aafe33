"""labkit.piecewise under misuse (issue 29 §3): each wrong input is an error that names what
was given, what was expected and what to do, not a Python error from deep inside.

Cases already covered by tests/test_piecewise.py (unknown bucket schemes, fallback, a piece
that reads the batch, a dispatcher given bad runners) are not repeated here.
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.fx as fx

from labkit.decode import DecodeGraphRunner, build_model, make_extend_batch
from labkit.decode.model import attend
from labkit.piecewise import (
    Dispatcher,
    PiecewiseGraphRunner,
    capture_batch,
    make_mixed_batch,
    split_at_attention,
    split_graph,
    split_labels,
)

pytestmark = pytest.mark.usefixtures("one_thread")
_CACHE: dict = {}


def _model(B):
    key = ("model", B.name)
    if key not in _CACHE:
        _CACHE[key] = build_model("tiny", max_requests=4, device=B.device, dtype=torch.float32)
    return _CACHE[key]


def _runner(B):
    key = ("runner", B.name)
    if key not in _CACHE:
        r = PiecewiseGraphRunner(_model(B), B, max_num_tokens=16, buckets=[16], progress=False)
        r.capture()
        _CACHE[key] = r
    return _CACHE[key]


def _raises(err, words, call):
    with pytest.raises(err, match=re.escape(words)):
        call()


# ---- splitting ops: a function where a tuple is expected ----------------------------------


@pytest.mark.parametrize("call, fn, name", [
    (lambda m, gm, B: PiecewiseGraphRunner(m, B, max_num_tokens=16, splitting_ops=attend),
     "split_at_attention", "splitting_ops"),
    (lambda m, gm, B: split_at_attention(m, attend), "split_at_attention", "splitting_ops"),
    (lambda m, gm, B: split_labels(gm, attend), "split_labels", "ops"),
    (lambda m, gm, B: split_graph(gm, attend), "split_graph", "ops"),
])
def test_one_op_where_a_tuple_is_expected(E, call, fn, name):
    """Before: "'function' object is not iterable" or "argument of type 'function' is not
    iterable"."""
    m = _model(E)
    _raises(TypeError, f"{fn}: {name} must be a tuple of functions, got function attend: "
                       "pass (attend,) for one op, or (attend, other_op) for several",
            lambda: call(m, fx.symbolic_trace(m), E))


@pytest.mark.parametrize("ops, words", [
    (("attend",), "every entry of ops must be a function (the op itself, e.g. "
                  "labkit.decode.model.attend), got 'attend' (str)"),
    ("attend", "ops must be a tuple of functions, got str 'attend': pass the ops themselves, "
               "e.g. (attend,) with attend from labkit.decode.model"),
    (None, "ops must be a tuple of functions, got NoneType None"),
])
def test_ops_that_are_not_functions(E, ops, words):
    _raises(TypeError, words, lambda: split_labels(fx.symbolic_trace(_model(E)), ops))


def test_splitting_ops_without_attention_says_what_to_pass(E):
    _raises(ValueError, "splitting_ops must be functions and include labkit.decode.model.attend",
            lambda: split_at_attention(_model(E), (torch.relu,)))
    _raises(ValueError, "pass (attend, *your_ops)",
            lambda: split_at_attention(_model(E), (torch.relu,)))


@pytest.mark.parametrize("fn", [split_labels, split_graph])
def test_split_needs_a_traced_graph(E, fn):
    """Before: AttributeError 'Transformer' object has no attribute 'graph'."""
    _raises(TypeError, f"{fn.__name__}: gm must be a torch.fx.GraphModule, got Transformer: "
                       "trace the model first (torch.fx.symbolic_trace(model)), or call "
                       "split_at_attention(model)", lambda: fn(_model(E)))


# ---- capture_batch ---------------------------------------------------------------------------


@pytest.mark.parametrize("n, err, words", [
    (0, ValueError, "capture_batch: num_tokens must be >= 1, got 0: the token count of the "
                    "bucket to capture"),
    (-8, ValueError, "num_tokens must be >= 1, got -8"),
    (2.5, TypeError, "capture_batch: num_tokens must be an int >= 1, got 2.5 (float)"),
    (True, TypeError, "num_tokens must be an int >= 1, got True (bool)"),
])
def test_capture_batch_token_count(E, n, err, words):
    """Before: 0 gave torch.cat's "expected a non-empty list of Tensors", -8 the same, 2.5
    "can't multiply sequence by non-int of type 'float'"."""
    _raises(err, words, lambda: capture_batch(_model(E), n))


def test_capture_batch_needs_a_model():
    _raises(TypeError, "capture_batch: model must be a labkit.decode Transformer with caches set "
                       "up", lambda: capture_batch(torch.nn.Linear(2, 2), 8))


# ---- runner and dispatcher calls on something that is not a batch ---------------------------


@pytest.mark.parametrize("call, words", [
    (lambda r, d: r.can_run({"input_ids": [1]}),
     "PiecewiseGraphRunner.can_run: expected a ForwardBatch (make_extend_batch / "
     "make_mixed_batch), got dict"),
    (lambda r, d: d.forward({"input_ids": [1]}),
     "Dispatcher: expected a ForwardBatch (make_decode_batch, make_extend_batch, "
     "make_mixed_batch), got dict"),
    (lambda r, d: d.dispatch([1, 2]), "Dispatcher: expected a ForwardBatch"),
])
def test_not_a_batch(E, call, words):
    """Before: AttributeError 'dict' object has no attribute 'num_tokens'."""
    r = _runner(E)
    d = Dispatcher(_model(E), None, r)
    _raises(TypeError, words, lambda: call(r, d))
    assert d.stats == {"none": 0, "piecewise": 0, "full": 0}, "nothing ran"


def test_runner_still_right_after_the_refusals(B):
    r = _runner(B)
    m = _model(B)
    for bad in ({"a": 1}, None):
        with pytest.raises(TypeError):
            r.can_run(bad)
    batch = make_extend_batch(m, [1, 2], [[3, 4, 5], [6, 7]])
    from labkit.decode import EagerRunner
    torch.testing.assert_close(r.forward(batch), EagerRunner(m).forward(batch),
                               rtol=1e-4, atol=1e-4)


# ---- make_mixed_batch and the dispatcher's FULL graphs --------------------------------------


@pytest.mark.parametrize("prefill, decode, err, words", [
    ({1: "abc"}, {}, TypeError,
     "make_mixed_batch: prefill[1] must be a list of token ids (ints), got 'abc' (str)"),
    ({1: [3, 4.0]}, {}, TypeError,
     "make_mixed_batch: prefill[1][1] must be an int, got 4.0 (float): a prompt is a list of "
     "token ids"),
    ({1: [3, 4]}, {2: (5, "3")}, TypeError,
     "make_mixed_batch: decode[2]'s position must be an int >= 0, got '3' (str): the tokens "
     "already in the request's cache"),
    ({1: [3, 4]}, {2: (5, -1)}, ValueError, "decode[2]'s position must be >= 0, got -1"),
    ({}, {2: (None, 3)}, TypeError, "make_mixed_batch: decode[2]'s token must be an int"),
])
def test_mixed_batch_names_the_entry_given(E, prefill, decode, err, words):
    """Before: the errors named make_extend_batch's lists ("prompts[0][0]", "prefix_lens[1]"),
    which the caller never passed."""
    _raises(err, words, lambda: make_mixed_batch(_model(E), prefill, decode))


def test_dispatcher_refuses_full_graphs_no_batch_can_use(E):
    """Before: a TARGET_VERIFY runner as ``full`` was accepted and never ran a batch (every
    decode batch went to the pieces or eager), silently."""
    m = _model(E)
    verify = DecodeGraphRunner(m, E, max_bs=2, num_tokens_per_bs=3, progress=False)
    verify.capture()
    _raises(ValueError, "Dispatcher: full must hold DECODE graphs (one token per request: the "
                        "batches FULL runs); this runner captured TARGET_VERIFY with 3 tokens "
                        "per request, so no batch would ever run on it. Pass a "
                        "DecodeGraphRunner(model, B) (num_tokens_per_bs=1)",
            lambda: Dispatcher(m, verify, _runner(E)))
