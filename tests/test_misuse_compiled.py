"""labkit.compiled under misuse (issue 29 §3): each wrong input is an error that names what
was given, what was expected and what to do, never a torch error without the shapes, a
silent cast or a replay of a stale value; after the error the function replays correctly.

The replay checks read metadata only (shapes, dtypes, strides, Python values), so the
emulated backend shows them all; ``test_refused_call_leaves_the_graph_usable`` runs on the
GPU too (``pytest -m cuda``).
"""

from __future__ import annotations

import re

import pytest
import torch

from labkit import compiled as C

pytestmark = pytest.mark.usefixtures("one_thread")


def matmul(w, x):
    return x @ w


def scaled(w, x, s=1.0):
    return (x @ w) * s


def _recorded(B, fn=matmul, args=None, static=(0,)):
    """A ReduceOverhead that has warmed up and recorded on ``args``."""
    g = torch.Generator().manual_seed(0)
    args = args or (torch.randn(8, 8, generator=g).to(B.device),
                    torch.randn(4, 8, generator=g).to(B.device))
    r = C.ReduceOverhead(fn, static=static, B=B)
    r(*args)
    r(*args)
    assert r.kinds == ["warm-up", "record"]
    return r, args


def _raises(err, words, call):
    with pytest.raises(err, match=re.escape(words)):
        call()


# ---- ReduceOverhead(fn, static=...) ----------------------------------------------------------


@pytest.mark.parametrize("static, words", [
    (0, "static must be a tuple of argument positions, e.g. static=(0,), got 0 (int)"),
    ("0", "static must be a tuple of argument positions, e.g. static=(0,), got '0' (str)"),
    (None, "got None (NoneType)"),
])
def test_static_that_is_not_a_tuple_of_positions(E, static, words):
    """Before: ``'int' object is not iterable``."""
    _raises(TypeError, words, lambda: C.ReduceOverhead(matmul, static=static, B=E))


def test_static_position_of_a_non_tensor(E):
    """Before: AttributeError 'float' object has no attribute 'data_ptr' (at the replay)."""
    r = C.ReduceOverhead(lambda x, s: x * s, static=(1,), B=E)
    _raises(TypeError, "static=(1,) names input 1, which is a float (2.0), not a tensor: "
                       "static lists the tensors used at their own address (parameters, "
                       "buffers); leave 1 out of static",
            lambda: r(torch.ones(2, device=E.device), 2.0))
    assert r.kinds == [], "refused before the warm-up"


# ---- a replay with other arguments than the recording's --------------------------------------


def test_smaller_batch_names_both_shapes(E):
    """Before: torch's "The size of tensor a (4) must match the size of tensor b (2)"."""
    r, (w, x) = _recorded(E)
    _raises(ValueError, "input 1 has shape (2, 8), the graph was recorded with (4, 8): a replay "
                        "runs the recorded shape (the copy into the graph's buffer would "
                        "broadcast or fail). Pass shape (4, 8), or use one ReduceOverhead per "
                        "signature (torch.compile guards on it and compiles, warms up and "
                        "records again)", lambda: r(w, x[:2]))


def test_broadcastable_batch_is_refused_not_broadcast(E):
    """Before: a (1, 8) input was broadcast into the (4, 8) buffer and four equal rows came
    back, silently."""
    r, (w, x) = _recorded(E)
    _raises(ValueError, "input 1 has shape (1, 8), the graph was recorded with (4, 8)",
            lambda: r(w, x[:1]))


def test_other_dtype_is_refused_not_cast(E):
    """Before: a float64 input was cast into the float32 buffer and a float32 result came
    back, silently."""
    r, (w, x) = _recorded(E, fn=lambda w, x: x.float() @ w)
    _raises(ValueError, "input 1 has dtype torch.float64, the graph was recorded with "
                        "torch.float32: a replay runs the recorded dtype (the copy into the "
                        "graph's buffer would cast). Pass dtype torch.float32",
            lambda: r(w, x.double()))


def test_changed_python_argument_is_refused_not_ignored(E):
    """Before: the recorded s=1.0 was replayed for s=3.0, silently."""
    r, (w, x, _) = _recorded(E, fn=scaled, args=(torch.randn(8, 8, device=E.device),
                                                   torch.randn(4, 8, device=E.device), 1.0))
    _raises(ValueError, "input 2 is 3.0, the graph was recorded with 1.0: a recording bakes "
                        "non-tensor arguments in, so a replay would compute with 1.0. Pass the "
                        "recorded value, make it a tensor (copied every call)",
            lambda: r(w, x, 3.0))
    assert r(w, x, 1.0) is r.outputs, "the recorded value replays"


def test_other_number_of_arguments(E):
    """Before: the extra argument was dropped by zip() and the recording replayed."""
    r, (w, x) = _recorded(E, fn=scaled)
    _raises(TypeError, "this call passes 3 argument(s), the graph was recorded with 2: pass "
                       "the same arguments every call", lambda: r(w, x, 2.0))


def test_tensor_where_the_recording_had_a_python_value(E):
    r, (w, x, _) = _recorded(E, fn=scaled, args=(torch.randn(8, 8, device=E.device),
                                                   torch.randn(4, 8, device=E.device), 2.0))
    _raises(TypeError, "input 2 is a Tensor, the graph was recorded with a float there",
            lambda: r(w, x, torch.tensor(2.0, device=E.device)))


@pytest.mark.parametrize("view, name, got, want", [
    (lambda w: w[:, :4], "shape", "(8, 4)", "(8, 8)"),
    (lambda w: w.t(), "strides", "(1, 8)", "(8, 1)"),
    (lambda w: w.view(torch.int32), "dtype", "torch.int32", "torch.float32"),
])
def test_static_input_at_the_recorded_address_in_another_layout(E, view, name, got, want):
    """Before: a view of the static weight at its own address (same data_ptr) replayed the
    recorded full weight, silently."""
    r, (w, x) = _recorded(E)
    _raises(ValueError, f"static input 0 has {name} {got}, the graph was recorded with {want}: "
                        f"a replay runs the recorded {name} (the graph reads the tensor it "
                        "recorded at this address, as recorded)", lambda: r(view(w), x))


def test_refused_call_leaves_the_graph_usable(B):
    """After each refusal the next good call replays, with the new values."""
    r, (w, x) = _recorded(B)
    for bad in ((w, x[:2]), (w, x.double()), (w[:, :4], x), (w, x, 1.0)):
        with pytest.raises((TypeError, ValueError)):
            r(*bad)
    x2 = torch.randn_like(x)
    y = r(w, x2)
    torch.testing.assert_close(y, x2 @ w)
    assert r.kinds == ["warm-up", "record", "replay"]


def test_static_moved_still_records_again(E):
    """Not a misuse: a static input at another address records anew, as before."""
    r, (w, x) = _recorded(E)
    w2 = torch.randn(8, 4, device=E.device)
    torch.testing.assert_close(r(w2, x), x @ w2)
    assert r.kinds[-1] == "record"


# ---- call_kind, watch_skips, recording_sweep -------------------------------------------------


def test_call_kind_needs_a_function(E):
    """Before: ``'str' object is not callable``, with no word of which argument."""
    _raises(TypeError, "call_kind(fn, *args): fn must be callable (the compiled function), got "
                       "str; call it as call_kind(fn, x, B=B)", lambda: C.call_kind("f", 1, B=E))


@pytest.mark.parametrize("field", ["count", "messages"])
def test_watch_skips_without_with(field):
    """Before: AttributeError '_GeneratorContextManager' object has no attribute 'count'."""
    _raises(AttributeError, f"watch_skips() is the block that collects the skips, not their "
                            f"log: write `with watch_skips() as log:` and read log.{field} after "
                            "the block", lambda: getattr(C.watch_skips(), field))


def test_watch_skips_still_a_context_manager_and_not_reentrant():
    watch = C.watch_skips()
    with watch as log:
        assert isinstance(log, C.SkipLog)
        with pytest.raises(RuntimeError, match="already collecting; nest a new one"):
            watch.__enter__()
        with C.watch_skips() as inner:
            assert inner is not log
    assert log.count == 0 and log.messages == []
    with watch as again:                         # used again after the block: a new log
        assert again is not log
    with pytest.raises(AttributeError, match="no attribute 'cont'"):
        watch.cont                               # a typo is still an AttributeError


@pytest.mark.parametrize("kw, err, words", [
    ({"make_fn": matmul, "make_args": None, "sizes": [1]}, TypeError,
     "recording_sweep: make_args must be a function, e.g. lambda n: (torch.randn(n, 64, "
     "device=B.device),); got NoneType"),
    ({"make_fn": 3, "make_args": lambda n: (n,), "sizes": [1]}, TypeError,
     "make_fn must be a function, e.g. lambda: torch.compile(f, mode=...); got int"),
    ({"make_fn": lambda: matmul, "make_args": lambda n: (n,), "sizes": 8}, TypeError,
     "sizes must be a list of input sizes, e.g. [1, 2, 4, 8], got 8 (int)"),
    ({"make_fn": lambda: matmul, "make_args": lambda n: (n,), "sizes": []}, ValueError,
     "sizes is empty"),
    ({"make_fn": lambda: matmul, "make_args": lambda n: (n,), "sizes": [4, 0]}, ValueError,
     "sizes[1] must be >= 1, got 0"),
    ({"make_fn": lambda: matmul, "make_args": lambda n: (n,), "sizes": [4], "calls": 0},
     ValueError, "calls must be >= 1, got 0"),
])
def test_recording_sweep_checks_its_arguments_before_the_gpu(E, kw, err, words):
    """Before: every one of these said only "needs a GPU" on the CPU, and failed inside the
    sweep on the GPU."""
    _raises(err, words, lambda: C.recording_sweep(B=E, **kw))


def test_recording_sweep_args_must_be_a_tuple():
    """A tensor returned by make_args would be unpacked row by row into arguments."""
    _raises(TypeError, "make_args(4) returned a Tensor; return the arguments as a tuple",
            lambda: C._sweep_args(lambda n: torch.zeros(n, 3), 4))
    assert C._sweep_args(lambda n: [n], 4) == (4,)
