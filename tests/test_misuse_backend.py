"""Misuse of the backend, the emulator and the capture helpers (issue 11).

Each case is what a careless user types; each test asserts the error type and the words
that make the message clear (what was given, what was expected, what to do). The
"usable after a failure" tests take the ``B`` fixture, so they also run on a GPU
(``pytest -m cuda``).
"""

import re

import pytest
import torch
from helpers import assert_usable

from labkit import backend
from labkit.capture import (
    StaticGraph,
    capture,
    format_pool_stats,
    recorded_kernels,
    side_stream_warmup,
)
from labkit.guards import GuardedGraph, error_text, lint_capture

pytestmark = pytest.mark.usefixtures("one_thread")



def _host_read(t):
    return t * float(t.sum().item())         # fine eagerly, refused inside a capture


# ---- B.graph / CUDAGraph arguments (emulated: torch.cuda's own objects are not wrapped) ----

@pytest.mark.parametrize("pool, words", [
    ("shared", ["got str 'shared'", "B.graph_pool_handle()", "g.pool()",
                "options of labkit's GlobalRecord.create_cudagraphs"]),
    ((1,), ["got tuple (1,)", "(id, 0) pair"]),
    ((-1, 0), ["got tuple (-1, 0)"]),
    (True, ["got bool True"]),
])
def test_graph_refuses_a_pool_that_is_not_a_handle(E, pool, words):
    g = E.CUDAGraph()
    with pytest.raises(TypeError) as err:
        with E.graph(g, pool=pool):
            pass
    for w in words:
        assert w in str(err.value), (w, str(err.value))
    assert E.current_stream() == E.default_stream()     # refused before the stream switch
    with pytest.raises(TypeError, match="got str 'x'"):
        g.capture_begin(pool="x")


def test_pool_handles_that_torch_accepts_still_work(E):
    pool = E.graph_pool_handle()
    x = torch.ones(3)
    for handle in (pool, list(pool)):                    # torch takes a 2-sequence too
        g = E.CUDAGraph()
        with E.graph(g, pool=handle):
            y = x + 1
        g.replay()
        assert y.tolist() == [2.0] * 3


def test_graph_refuses_a_stream_that_is_not_a_stream(E):
    with pytest.raises(TypeError, match=r"graph\(stream=...\): expected a stream made by "
                                        r"B.Stream\(\) \(or None\), got str 'side'"):
        E.graph(E.CUDAGraph(), stream="side")
    with pytest.raises(TypeError, match=r"stream\(s\): expected .* got int 3"):
        E.stream(3)
    with pytest.raises(TypeError, match=r"set_stream\(s\): expected a stream made by "
                                        r"B.Stream\(\), got NoneType"):
        E.set_stream(None)
    with pytest.raises(TypeError, match=r"wait_stream\(other\).*got str"):
        E.Stream().wait_stream("default")
    assert E.current_stream() == E.default_stream()


def test_graph_refuses_an_unknown_capture_error_mode(E):
    # torch's own message for an unknown string, a TypeError for a non-string; both from
    # capture_begin, after the switch to the capture stream, as torch.cuda.graph does
    # (issue 29: the capture stream stays current; tests/test_backend_behaviour.py runs
    # that on both backends)
    for mode, exc, words in (
            ("Global", RuntimeError, "Expected `global`, `thread_local`, or `relaxed`, "
                                     "got Global"),
            (None, TypeError, "one of the strings 'global', 'thread_local', 'relaxed', "
                              "got NoneType")):
        with pytest.raises(exc, match=words):
            with E.graph(E.CUDAGraph(), capture_error_mode=mode):
                pass
        assert E.current_stream() != E.default_stream()
        backend.recover(E)
    assert E.current_stream() == E.default_stream()


def test_graph_needs_a_cudagraph(E):
    with pytest.raises(TypeError, match=r"needs a B.CUDAGraph\(\).*got str.*g = B.CUDAGraph\(\)"):
        E.graph("g")


def test_pool_stats_refuses_a_bad_handle(E):
    with pytest.raises(TypeError, match="pool_stats: pool must be a memory-pool handle"):
        E.pool_stats("shared")
    assert E.pool_stats(E.graph_pool_handle())["reserved_bytes"] == 0


def test_backend_names_are_a_fixed_set():
    with pytest.raises(ValueError, match="unknown backend 'CUDA': choose one of auto, cuda, "
                                         "emulated"):
        backend.get("CUDA")


# ---- capture helpers -------------------------------------------------------------------------

def test_capture_refuses_a_result_instead_of_a_function(E):
    x = torch.ones(3)
    with pytest.raises(TypeError, match=r"fn must be a function or module.*got Tensor.*"
                                        r"\(fn, not fn\(x\)\)"):
        capture(x * 2, x, B=E)
    with pytest.raises(TypeError, match="fn must be a function"):
        side_stream_warmup(None, x, B=E)
    with pytest.raises(TypeError, match="fn must be a function"):
        StaticGraph(42, B=E)


@pytest.mark.parametrize("value, exc, words", [
    (-1, ValueError, "warmup must be >= 0, got -1"),
    ("3", TypeError, "warmup must be an int >= 0, got '3' (str)"),
    (2.0, TypeError, "got 2.0 (float)"),
])
def test_warmup_counts_are_checked(E, value, exc, words):
    x = torch.ones(3)
    with pytest.raises(exc, match=re.escape(words)):
        capture(lambda t: t * 2, x, B=E, warmup=value)
    with pytest.raises(exc, match=re.escape(words)):
        StaticGraph(lambda t: t * 2, B=E, warmup=value)
    with pytest.raises(exc, match=re.escape(words.replace("warmup", "iters"))):
        side_stream_warmup(lambda t: t * 2, x, B=E, iters=value)


def test_static_graph_names_keyword_arguments(E):
    sg = StaticGraph(lambda t, scale=1.0: t * scale, B=E, warmup=1)
    with pytest.raises(TypeError, match="positional arguments only, got keyword argument"
                                        r"\(s\) scale in capture.*GuardedGraph"):
        sg.capture(torch.ones(2, device=E.device), scale=2.0)
    sg.capture(torch.ones(2, device=E.device))
    with pytest.raises(TypeError, match=r"keyword argument\(s\) scale in call"):
        sg(torch.ones(2, device=E.device), scale=2.0)
    assert sg(torch.full((2,), 2.0, device=E.device)).tolist() == [2.0, 2.0]


def test_recorded_kernels_of_nothing(E):
    with pytest.raises(RuntimeError, match="has not been captured.*Capture it first"):
        recorded_kernels(E.CUDAGraph(), E)
    with pytest.raises(TypeError, match="needs a emulated CUDAGraph .*got str"):
        recorded_kernels("g", E)
    sg = StaticGraph(lambda t: t + 1, B=E, warmup=1)
    with pytest.raises(RuntimeError,
                       match=r"has not been captured yet.*\.capture\(\*sample_args\)"):
        recorded_kernels(sg, E)
    sg.capture(torch.ones(2, device=E.device))
    assert recorded_kernels(sg, E) == ["aten.add.Tensor"]


def test_format_pool_stats_needs_the_dict(E):
    with pytest.raises(TypeError, match=r"needs the dict B.pool_stats\(handle\) returns, got "
                                        "tuple"):
        format_pool_stats(E.graph_pool_handle())


def test_guarded_graph_options_are_a_fixed_set(E):
    with pytest.raises(ValueError, match="inputs must be 'copy' or 'static', got 'Copy'"):
        GuardedGraph(lambda t: t, B=E, inputs="Copy")
    with pytest.raises(ValueError, match="outputs must be 'static' or 'clone', got 'cloned'"):
        GuardedGraph(lambda t: t, B=E, outputs="cloned")


def test_lint_capture_arguments(E):
    x = torch.ones(2)
    with pytest.raises(ValueError, match=r"calls \(how many times fn runs under the linter\) "
                                         "must be >= 1, got 0"):
        lint_capture(lambda t: t * 2, x, B=E, calls=0)
    with pytest.raises(TypeError, match="takes a dict of keyword arguments for fn, got tuple"):
        lint_capture(lambda t: t * 2, x, B=E, kwargs=(1,))
    with pytest.raises(TypeError, match="fn must be a function"):
        lint_capture(x, B=E)


# ---- a failed capture leaves a usable process (both backends) ------------------------------

@pytest.mark.parametrize("entry", ["capture", "StaticGraph", "GuardedGraph"])
def test_failed_capture_leaves_a_usable_process(B, entry):
    x = torch.ones(4, device=B.device)
    before = B.current_stream()
    with pytest.raises(RuntimeError) as err:
        if entry == "capture":
            capture(_host_read, x, B=B, warmup=1)
        elif entry == "StaticGraph":
            StaticGraph(_host_read, B=B, warmup=1).capture(x)
        else:
            GuardedGraph(_host_read, B=B, warmup=1).capture(x)
    assert "operation not permitted when stream is capturing" in error_text(err.value)
    assert_usable(B, before)


def test_failed_capture_on_a_side_stream_restores_that_stream(B):
    side = B.Stream()
    x = torch.ones(4, device=B.device)
    with B.stream(side):
        with pytest.raises(RuntimeError):
            capture(_host_read, x, B=B, warmup=1)
        assert_usable(B, side)


def test_a_refused_static_graph_can_capture_again(B):
    sg = StaticGraph(lambda t: _host_read(t) if t.shape[0] == 3 else t * 2, B=B, warmup=1)
    with pytest.raises(RuntimeError):
        sg.capture(torch.ones(3, device=B.device))
    assert not sg.captured
    assert sg.capture(torch.ones(2, device=B.device))(torch.ones(2, device=B.device)).tolist() \
        == [2.0, 2.0]


def test_register_generator_state_needs_a_generator(E):
    with pytest.raises(TypeError, match="takes a torch.Generator .*got int"):
        E.CUDAGraph().register_generator_state(0)


def test_recover_takes_the_namespace():
    with pytest.raises(TypeError, match=re.escape("recover takes the backend namespace that "
                                                  "get() returns")):
        backend.recover("emulated")


def test_cleanup_keeps_the_first_error_when_recovery_fails_too(E, monkeypatch):
    from labkit.capture import cleanup_on_failure

    def broken(B):
        raise RuntimeError("device lost")

    monkeypatch.setattr(backend, "recover", broken)
    with pytest.raises(ValueError, match="the capture's own error") as err:
        with cleanup_on_failure(E):
            raise ValueError("the capture's own error")
    assert "cleaning up after this failed capture also failed (RuntimeError: device lost)" \
        in "".join(getattr(err.value, "__notes__", []))


def test_capture_helpers_check_graph_options_before_warming_up(E):
    runs = []

    def fn(t):
        runs.append(1)
        return t * 2

    x = torch.ones(2)
    with pytest.raises(TypeError, match=r"capture\(pool=...\): pool must be a memory-pool "
                                        "handle.*got str 'shared'"):
        capture(fn, x, B=E, pool="shared")
    with pytest.raises(TypeError, match=r"capture\(stream=...\): expected a stream made by "
                                        r"B.Stream\(\).*got int"):
        capture(fn, x, B=E, stream=1)
    with pytest.raises(RuntimeError, match="Unknown capture error mode"):
        capture(fn, x, B=E, capture_error_mode="local")
    with pytest.raises(TypeError, match=r"StaticGraph\(pool=...\): pool must be"):
        StaticGraph(fn, B=E, pool="private")
    assert runs == []                        # refused before fn ran


def test_a_backend_name_where_the_namespace_belongs():
    words = re.escape("B must be the backend namespace that labkit.backend.get() returns, got "
                      "str 'auto': write B = labkit.backend.get('auto')")
    with pytest.raises(TypeError, match=words):
        capture(lambda t: t, torch.ones(1), B="auto")
    with pytest.raises(TypeError, match=words):
        StaticGraph(lambda t: t, B="auto")


def test_event_elapsed_time_needs_an_event(E):
    start = E.Event(enable_timing=True)
    start.record()
    with pytest.raises(TypeError, match="takes the Event recorded at the end, got float"):
        start.elapsed_time(1.0)


def test_emulator_cost_command_line(capsys):
    from labkit.bench import emulator_cost as cost

    with pytest.raises(SystemExit) as exit_:
        cost.main(["--iters", "0"])
    assert exit_.value.code == 2
    assert "--iters: must be at least 1, got 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cost.main(["--iterations", "5"])
    assert "unrecognized arguments: --iterations 5" in capsys.readouterr().err
    with pytest.raises(ValueError, match="d_model=10 must be a multiple of nhead=4"):
        cost.replay_vs_eager(d_model=10, nhead=4)


def test_small_capture_helpers_name_a_wrong_argument():
    from labkit.capture import on_side_stream, short_kernel_name

    with pytest.raises(TypeError, match="takes a kernel name \\(str\\), got NoneType"):
        short_kernel_name(None)
    with pytest.raises(TypeError, match=r"on_side_stream\(B\) must be the backend namespace"):
        with on_side_stream("emulated"):
            pass


def test_guard_helpers_name_a_wrong_argument(E):
    from labkit.guards import error_lines, expect_error, get_mismatch_errors, metadata_tree

    x = torch.ones(3)
    with pytest.raises(TypeError, match=re.escape("args must be a tuple or list of arguments, "
                                                  "got a Tensor of shape (3,); for one "
                                                  "argument write (x,)")):
        get_mismatch_errors((metadata_tree(x),), x)      # used to report 3 "arguments"
    with pytest.raises(TypeError, match="captured_args must be a tuple or list"):
        get_mismatch_errors(None, (x,))
    with pytest.raises(TypeError, match=re.escape("error_text(err.value)), got NoneType")):
        error_text(None)
    with pytest.raises(TypeError, match="error_lines takes the exception object"):
        error_lines("boom")
    with pytest.raises(ValueError, match="lines .* must be >= 1, got 0"):
        expect_error(E, lines=0)
    with pytest.raises(TypeError, match="takes the torch.Generator objects .* got int"):
        lint_capture(lambda t: t, x, B=E, generators=[1])
