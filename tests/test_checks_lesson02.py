"""Lesson 02 checkers: the reference passes; real learner mistakes are rejected with a
message that names the mistake actually made (and never the full answer first).

Runs on every backend (``B`` fixture): the emulator here, the GPU too where there is one.
"""

from __future__ import annotations

import pytest
import torch

from labkit.capture import side_stream_warmup
from labkit.checks.lesson02 import check_capture_chain, check_graphed_run, check_serve


def _msg(res) -> str:
    assert not res, "a wrong answer passed"
    return res.message


# ---- graphed_run ------------------------------------------------------------------------

def _graphed_run(B, *, warmups=3, side=True, clone="all", copy=True, capture_in_loop=False,
                 eager_after=False, print_in_capture=False, waits=("before", "after"),
                 warm_on_batch=False, order="copy replay clone"):
    """The reference, with one knob per real mistake."""
    def graphed_run(fn, static_input, batches):
        if warmups:
            s = B.Stream() if side else B.default_stream()
            if "before" in waits:
                s.wait_stream(B.current_stream())
            with B.stream(s):
                for _ in range(warmups):
                    fn(batches[0] if warm_on_batch else static_input)
            if "after" in waits:
                B.current_stream().wait_stream(s)
        g = B.CUDAGraph()
        if not capture_in_loop:
            with B.graph(g):
                static_out = fn(static_input)
                if print_in_capture:
                    print(static_out)  # the learner's line the report must name
        results = []
        for i, batch in enumerate(batches):
            if capture_in_loop:
                g = B.CUDAGraph()
                with B.graph(g):
                    static_out = fn(static_input)
            for step in order.split():       # the three steps of a batch, in this order
                if step == "copy":
                    if copy:
                        static_input.copy_(batch)
                    else:
                        static_input = batch  # noqa: F841 - the rebinding bug
                elif step == "replay":
                    g.replay()
                    if eager_after:
                        fn(batch)
                else:
                    keep = clone == "all" or (clone == "all but last" and i < len(batches) - 1)
                    results.append(static_out.clone() if keep else static_out)
        if clone == "after the loop":
            results = [r.clone() for r in results]
        return results
    return graphed_run


def test_graphed_run_reference_passes(B, capsys):
    assert check_graphed_run(_graphed_run(B), B=B)
    assert capsys.readouterr().out == "✅ graphed_run: passed 3 random trials\n"


def test_graphed_run_with_side_stream_warmup_helper_passes(B):
    def graphed_run(fn, static_input, batches):
        side_stream_warmup(fn, static_input, B=B, iters=3)
        g = B.CUDAGraph()
        with B.graph(g):
            out = fn(static_input)
        res = []
        for b in batches:
            static_input.copy_(b)
            g.replay()
            res.append(out.clone())
        return res
    assert check_graphed_run(graphed_run, B=B)


def test_graphed_run_newcomers_answer_passes(B):
    # stream= on the capture, slice assignment instead of copy_, empty_like().copy_()
    def graphed_run(fn, static_input, batches):
        side = B.Stream()
        side.wait_stream(B.current_stream())
        with B.stream(side):
            for _ in range(3):
                fn(static_input)
        B.current_stream().wait_stream(side)
        graph = B.CUDAGraph()
        with B.graph(graph, stream=side):
            static_out = fn(static_input)
        results = []
        for b in batches:
            static_input[...] = b
            graph.replay()
            results.append(torch.empty_like(static_out).copy_(static_out))
        return results
    assert check_graphed_run(graphed_run, B=B)


def test_graphed_run_rejects_a_side_stream_without_wait_stream(B):
    msg = _msg(check_graphed_run(_graphed_run(B, waits=()), B=B))
    assert "without `s.wait_stream(B.current_stream())`" in msg
    assert "without `B.current_stream().wait_stream(s)`" in msg and "section 2" in msg
    msg = _msg(check_graphed_run(_graphed_run(B, waits=("before",)), B=B))
    assert "without `B.current_stream().wait_stream(s)` after it" in msg
    assert "s.wait_stream(B.current_stream())" not in msg
    msg = _msg(check_graphed_run(_graphed_run(B, waits=("after",)), B=B))
    assert "without `s.wait_stream(B.current_stream())` before the warm-up" in msg
    assert "B.current_stream().wait_stream(s)" not in msg


def test_graphed_run_rejects_warming_up_on_a_batch(B):
    msg = _msg(check_graphed_run(_graphed_run(B, warm_on_batch=True), B=B))
    assert "3 of the 3 warm-up runs called fn on a tensor that is not static_input" in msg
    assert "fn(static_input)" in msg and "section 2" in msg


def test_graphed_run_rejects_cloning_after_the_loop(B):
    msg = _msg(check_graphed_run(_graphed_run(B, clone="after the loop"), B=B))
    assert "you kept references to the static output (static_out) and cloned after the loop" \
        in msg and "every replay overwrote them (section 5)" in msg
    assert "copy_" not in msg


def test_graphed_run_rejects_a_clone_taken_before_the_replay(B):
    # copy_, clone, replay: each result is the previous batch's; the copy_ is in time
    msg = _msg(check_graphed_run(_graphed_run(B, order="copy clone replay"), B=B))
    assert "you clone static_out BEFORE g.replay()" in msg
    assert "every replay ran on its own batch" in msg
    assert "copy_-ed into it before g.replay()" not in msg   # not blamed on the copy_
    msg = _msg(check_graphed_run(_graphed_run(B, order="clone copy replay"), B=B))
    assert "you clone static_out BEFORE g.replay()" in msg


def test_graphed_run_rejects_a_copy_made_after_the_replay(B):
    msg = _msg(check_graphed_run(_graphed_run(B, order="replay copy clone"), B=B))
    assert "You copy_ a batch into the static input AFTER g.replay()" in msg
    assert "clone static_out BEFORE" not in msg


def test_graphed_run_first_hint_is_about_the_mistake_seen(B, capsys):
    from labkit.checks import hint

    for kw, about, not_about in [
            (dict(clone="none"), "replay do to the static output", "wait_stream"),
            (dict(order="copy clone replay"), "In which order", "wait_stream"),
            (dict(copy=False), "How does a new batch reach", "wait_stream"),
            (dict(capture_in_loop=True), "only what runs inside `with B.graph(g):`", "clone"),
            (dict(warmups=1), "side stream", "clone")]:
        _msg(check_graphed_run(_graphed_run(B, **kw), B=B))
        capsys.readouterr()
        hint()
        first = capsys.readouterr().out
        assert first.startswith("hint 1 of") and about in first, (kw, first)
        assert not_about not in first, (kw, first)


def test_graphed_run_rejects_no_warmup(B):
    msg = _msg(check_graphed_run(_graphed_run(B, warmups=0), B=B))
    assert "never ran before the capture: no warm-up" in msg and "section 2" in msg


def test_graphed_run_rejects_warmup_on_the_default_stream(B):
    msg = _msg(check_graphed_run(_graphed_run(B, side=False), B=B))
    assert "3 of the 3 warm-up runs ran on the default stream" in msg
    assert "side stream" in msg


def test_graphed_run_rejects_a_single_warmup(B):
    msg = _msg(check_graphed_run(_graphed_run(B, warmups=1), B=B))
    assert "fn ran eagerly 1 time(s) before the capture" in msg
    assert "exactly 3 warm-up runs" in msg


def test_graphed_run_twenty_warmups_named_as_warmups(B):
    msg = _msg(check_graphed_run(_graphed_run(B, warmups=20), B=B))
    assert "fn ran eagerly 20 time(s) before the capture" in msg
    assert "exactly 3 warm-up runs" in msg
    assert "batches" not in msg.splitlines()[0]  # not "20 times for 12 batches"


def test_graphed_run_rejects_the_last_result_uncloned(B):
    msg = _msg(check_graphed_run(_graphed_run(B, clone="all but last"), B=B))
    assert "the last result IS the graph's static output" in msg
    assert "the last one too" in msg


def test_graphed_run_rejects_no_clone(B):
    msg = _msg(check_graphed_run(_graphed_run(B, clone="none"), B=B))
    assert "results are the same tensor, the graph's static output" in msg
    assert "section 5" in msg


def test_graphed_run_rejects_rebinding_the_static_input(B):
    msg = _msg(check_graphed_run(_graphed_run(B, copy=False), B=B))
    assert "values differ" in msg and "hold the same values" in msg
    assert "copy_" in msg and "rebinding" in msg


def test_graphed_run_rejects_eager_calls_after_capture(B):
    msg = _msg(check_graphed_run(_graphed_run(B, eager_after=True), B=B))
    assert "ran eagerly" in msg and "after the capture" in msg


def test_graphed_run_rejects_a_capture_per_batch(B):
    msg = _msg(check_graphed_run(_graphed_run(B, capture_in_loop=True), B=B))
    assert "fn was captured" in msg and "capture ONE graph before the loop" in msg


def test_graphed_run_rejects_plain_eager(B):
    msg = _msg(check_graphed_run(lambda fn, s, bs: [fn(b) for b in bs], B=B))
    assert "never called during a capture" in msg


def test_graphed_run_print_in_capture_is_reported_at_the_learners_line(B):
    res = check_graphed_run(_graphed_run(B, print_in_capture=True), B=B)
    msg = _msg(res)
    assert "print(static_out)" in msg and "(in graphed_run)" in msg
    assert "emulator/graph.py" not in msg and "previous error" not in msg
    assert "Traceback" not in msg
    # the failed capture left a usable process: capture + replay + a random op work
    x = torch.ones(3, device=B.device)
    g = B.CUDAGraph()
    with B.graph(g):
        y = x * 2
    g.replay()
    torch.randn(2, device=B.device)
    assert y.tolist() == [2.0, 2.0, 2.0]


def test_graphed_run_rejects_capturing_another_tensor(B):
    def on_first_batch(fn, static_input, batches):
        side_stream_warmup(fn, static_input, B=B, iters=3)
        g = B.CUDAGraph()
        with B.graph(g):
            out = fn(batches[0])              # captured on a batch, not on static_input
        res = []
        for b in batches:
            static_input.copy_(b)
            g.replay()
            res.append(out.clone())
        return res

    msg = _msg(check_graphed_run(on_first_batch, B=B))
    assert "captured on a tensor that is not static_input" in msg
    assert "never reaches it" in msg


def test_graphed_run_static_graph_is_right_but_not_the_exercise(B):
    from labkit.capture import StaticGraph

    def with_static_graph(fn, static_input, batches):
        sg = StaticGraph(fn, B=B)
        sg.capture(static_input)
        return [sg(b).clone() for b in batches]

    msg = _msg(check_graphed_run(with_static_graph, B=B))
    assert "your results are right, but fn was captured on a tensor that is not" in msg
    assert "StaticGraph" in msg


def test_graphed_run_with_the_capture_helper_passes(B):
    from labkit.capture import capture

    def with_capture(fn, static_input, batches):
        g, out = capture(fn, static_input, B=B)
        res = []
        for b in batches:
            static_input.copy_(b)
            g.replay()
            res.append(out.clone())
        return res

    assert check_graphed_run(with_capture, B=B)


def test_graphed_run_endless_loop_gets_a_verdict(B):
    def endless(fn, static_input, batches):
        g = B.CUDAGraph()
        with B.graph(g):
            out = fn(static_input)
            while True:                       # inside the capture
                out = out + 0
        return [out]

    res = check_graphed_run(endless, B=B, time_limit=0.5)
    assert not res and res.kind == "timeout" and "did not finish within 0.5 s" in res.message
    x = torch.ones(2, device=B.device)       # the process is usable afterwards
    g = B.CUDAGraph()
    with B.graph(g):
        y = x + 1
    g.replay()
    torch.rand(1, device=B.device)
    assert y.tolist() == [2.0, 2.0]


def test_graphed_run_hints_come_one_step_at_a_time(B, capsys):
    from labkit.checks import hint

    msg = _msg(check_graphed_run(_graphed_run(B, warmups=0), B=B))
    assert "labkit.checks.hint()" in msg
    capsys.readouterr()
    shown = []
    for _ in range(3):
        assert hint() is None          # printed once, not shown again as a cell's value
        shown.append(capsys.readouterr().out)
    assert shown[0].startswith("hint 1 of 2 for graphed_run") and "wait_stream" in shown[0]
    assert shown[1].startswith("hint 2 of 2") and "No more hints" in shown[2]


def test_graphed_run_returns_none_and_stub():
    from labkit import backend

    B = backend.get("emulated")

    def forgot_return(fn, static_input, batches):
        _graphed_run(B)(fn, static_input, batches)

    assert "did you forget `return" in _msg(check_graphed_run(forgot_return, B=B))

    def stub(fn, static_input, batches):
        raise NotImplementedError()

    assert "not done yet" in _msg(check_graphed_run(stub, B=B))


def test_graphed_run_first_hint_is_not_the_answer(B):
    msg = _msg(check_graphed_run(_graphed_run(B, warmups=0), B=B))
    assert "static_out.clone()" not in msg and "wait_stream(B.current_stream())" not in msg


# ---- capture_chain ------------------------------------------------------------------------

def _chain_ref(B):
    def capture_chain(f1, f2, static_input):
        pool = B.graph_pool_handle()
        g1, g2 = B.CUDAGraph(), B.CUDAGraph()
        with B.graph(g1, pool=pool):
            mid = f1(static_input)
        with B.graph(g2, pool=pool):
            out = f2(mid)
        return g1, g2, mid, out
    return capture_chain


def test_capture_chain_reference_passes(B, capsys):
    assert check_capture_chain(_chain_ref(B), B=B)

    def with_g1_pool(f1, f2, static_input):
        g1, g2 = B.CUDAGraph(), B.CUDAGraph()
        with B.graph(g1):
            mid = f1(static_input)
        with B.graph(g2, pool=g1.pool()):
            out = f2(mid)
        return g1, g2, mid, out

    assert check_capture_chain(with_g1_pool, B=B)
    assert capsys.readouterr().out.count("✅ capture_chain: passed 3 random trials") == 2


def test_capture_chain_rejects_one_graph_returned_twice(B):
    def one_graph(f1, f2, static_input):
        g = B.CUDAGraph()
        with B.graph(g):
            mid = f1(static_input)
            out = f2(mid)
        return g, g, mid, out

    msg = _msg(check_capture_chain(one_graph, B=B))
    assert "g1 and g2 are the same graph object" in msg and "two" in msg


def test_capture_chain_rejects_g2_that_never_reads_g1s_output(B):
    def recomputes(f1, f2, static_input):
        pool = B.graph_pool_handle()
        g1, g2 = B.CUDAGraph(), B.CUDAGraph()
        with B.graph(g1, pool=pool):
            mid = f1(static_input)
        with B.graph(g2, pool=pool):
            out = f2(f1(static_input))
        return g1, g2, mid, out

    msg = _msg(check_capture_chain(recomputes, B=B))
    assert "g2 does not read g1's output" in msg and "static_mid" in msg
    assert "your g2 recomputes f1 from static_input" in msg and "a copy" not in msg


def test_capture_chain_rejects_g2_on_a_copy_of_the_mid(B):
    def copy_first(f1, f2, static_input):
        pool = B.graph_pool_handle()
        g1, g2 = B.CUDAGraph(), B.CUDAGraph()
        with B.graph(g1, pool=pool):
            mid = f1(static_input)
        mid_copy = mid.clone()           # made outside any capture: never updated again
        with B.graph(g2, pool=pool):
            out = f2(mid_copy)
        return g1, g2, mid, out

    msg = _msg(check_capture_chain(copy_first, B=B))
    assert "g2 does not read g1's output" in msg and "a copy of static_mid" in msg
    assert "recomputes f1" not in msg


def _chain(B, *, g1_on="input", g2_on="mid", returned_mid="g1's"):
    """The reference with one knob per mistake: what g1 and g2 are captured on, and which
    tensor is returned as static_mid."""
    def capture_chain(f1, f2, static_input):
        pool = B.graph_pool_handle()
        g1, g2 = B.CUDAGraph(), B.CUDAGraph()
        x = static_input.clone() if g1_on == "a copy of the input" else static_input
        eager_mid = f1(static_input)
        with B.graph(g1, pool=pool):
            mid = f1(x)
        read = {"mid": mid, "input": static_input, "eager mid": eager_mid}[g2_on]
        with B.graph(g2, pool=pool):
            out = f2(read)
        return g1, g2, (mid if returned_mid == "g1's" else eager_mid), out
    return capture_chain


def test_capture_chain_names_what_g1_reads_and_writes(B):
    msg = _msg(check_capture_chain(_chain(B, g1_on="a copy of the input"), B=B))
    assert "g1 does not read static_input" in msg and "a copy of it" in msg
    assert "static_mid must be the tensor g1 wrote" not in msg   # not blamed on static_mid
    msg = _msg(check_capture_chain(_chain(B, g2_on="eager mid", returned_mid="eager"), B=B))
    assert "not the tensor g1 writes (an eager result" in msg
    assert "does not read static_input" not in msg


def test_capture_chain_g1_on_a_copy_whose_memory_is_reused(B):
    """g1 captured on a copy of the input that nothing keeps alive: on a GPU the copy's
    memory goes back to the caching allocator once capture_chain returns, and the
    checker's own tensors land there, so what g1 reads changes from one replay to the next
    (that is why "a copy of the input" read differently on CUDA). Here g2 writes into the
    copy, which stands for that reuse on any backend: the report still says that g1 does not
    read static_input, as it does for a copy that never changes."""
    kept = []                       # x stays alive: g2 writes into memory it owns

    def reused(f1, f2, static_input):
        pool = B.graph_pool_handle()
        g1, g2 = B.CUDAGraph(), B.CUDAGraph()
        x = static_input.clone()
        kept.append(x)
        with B.graph(g1, pool=pool):
            mid = f1(x)
        with B.graph(g2, pool=pool):
            out = f2(mid)
            x.copy_(out)            # the copy's memory rewritten between g1's replays
        return g1, g2, mid, out

    msg = _msg(check_capture_chain(reused, B=B))
    assert "g1 does not read static_input" in msg and "a copy of it" in msg, msg


def test_capture_chain_names_what_g2_reads_instead(B):
    msg = _msg(check_capture_chain(_chain(B, g2_on="input"), B=B))
    assert "It gave f2(static_input): your g2 records f2 of static_input" in msg
    assert "recomputes f1" not in msg and "a copy of static_mid" not in msg


def test_capture_chain_names_an_extra_copy_in_g1(B):
    if not B.is_emulated:
        pytest.skip("kernel counts are probed on the emulator only (a GPU needs the profiler)")

    def copies(f1, f2, static_input):
        pool = B.graph_pool_handle()
        g1, g2 = B.CUDAGraph(), B.CUDAGraph()
        mid = torch.empty_like(static_input)
        with B.graph(g1, pool=pool):
            mid.copy_(f1(static_input))
        with B.graph(g2, pool=pool):
            out = f2(mid)
        return g1, g2, mid, out

    msg = _msg(check_capture_chain(copies, B=B))
    assert "extra: aten.copy_.default" in msg and "no copy needed" in msg
    assert "f2 as well" not in msg


def test_capture_chain_rejects_g1_recording_both(B):
    def g1_does_all(f1, f2, static_input):
        pool = B.graph_pool_handle()
        g1, g2 = B.CUDAGraph(), B.CUDAGraph()
        with B.graph(g1, pool=pool):
            mid = f1(static_input)
            out = f2(mid)
        with B.graph(g2, pool=pool):
            f2(mid)
        return g1, g2, mid, out         # g1's out: replaying g1 alone computes it

    msg = _msg(check_capture_chain(g1_does_all, B=B))
    assert "g1 records f2 too" in msg


def test_capture_chain_rejects_separate_pools(B):
    def separate(f1, f2, static_input):
        g1, g2 = B.CUDAGraph(), B.CUDAGraph()
        with B.graph(g1):
            mid = f1(static_input)
        with B.graph(g2):
            out = f2(mid)
        return g1, g2, mid, out

    msg = _msg(check_capture_chain(separate, B=B))
    assert "different memory pools" in msg and "section 7" in msg


def test_capture_chain_rejects_a_cloned_mid(B):
    def returns_clone(f1, f2, static_input):
        g1, g2, mid, out = _chain_ref(B)(f1, f2, static_input)
        return g1, g2, mid.clone(), out

    msg = _msg(check_capture_chain(returns_clone, B=B))
    assert "static_mid" in msg and "values differ" in msg and "not a copy" in msg


def test_capture_chain_rejects_graphs_swapped(B):
    def swapped(f1, f2, static_input):
        g1, g2, mid, out = _chain_ref(B)(f1, f2, static_input)
        return g2, g1, mid, out

    msg = _msg(check_capture_chain(swapped, B=B))
    assert "replaying g2 alone overwrote static_mid: your g2 records f1" in msg
    assert "order swapped" in msg


def test_capture_chain_rejects_static_tensors_swapped(B):
    def swapped(f1, f2, static_input):
        g1, g2, mid, out = _chain_ref(B)(f1, f2, static_input)
        return g1, g2, out, mid

    msg = _msg(check_capture_chain(swapped, B=B))
    assert "static_mid and static_out: order swapped" in msg
    assert "values differ" not in msg


def test_capture_chain_rejects_g1_that_also_computes_f2(B):
    def chain(f1, f2, static_input):
        pool = B.graph_pool_handle()
        g1, g2 = B.CUDAGraph(), B.CUDAGraph()
        with B.graph(g1, pool=pool):
            mid = f1(static_input)
            _peek = f2(mid)            # a throwaway: nobody keeps it
        with B.graph(g2, pool=pool):
            out = f2(mid)
        return g1, g2, mid, out

    msg = _msg(check_capture_chain(chain, B=B))
    assert "one capture called f1 and f2 both: g1 records f2 as well" in msg
    assert "f1 and nothing else" in msg


def test_capture_chain_rejects_g1_with_an_extra_op_on_the_emulator(B):
    if not B.is_emulated:
        pytest.skip("kernel counts are probed on the emulator only (a GPU needs the profiler)")

    def chain(f1, f2, static_input):
        pool = B.graph_pool_handle()
        g1, g2 = B.CUDAGraph(), B.CUDAGraph()
        with B.graph(g1, pool=pool):
            mid = f1(static_input)
            _extra = mid.sin()         # not f2, but still more than f1
        with B.graph(g2, pool=pool):
            out = f2(mid)
        return g1, g2, mid, out

    msg = _msg(check_capture_chain(chain, B=B))
    assert "g1 records more than static_mid = f1(static_input)" in msg
    assert "f1 and nothing else" in msg


def test_capture_chain_newcomers_answer_passes(B):
    def chain(f1, f2, static_input):
        first = B.CUDAGraph()
        with B.graph(first):
            static_mid = f1(static_input)
        second = B.CUDAGraph()
        with B.graph(second, pool=first.pool()):
            static_out = f2(static_mid)
        return first, second, static_mid, static_out
    assert check_capture_chain(chain, B=B)


def test_capture_chain_rejects_wrong_return_values(B):
    assert "expected a tuple (g1, g2, static_mid, static_out), got NoneType" in _msg(
        check_capture_chain(lambda f1, f2, x: None, B=B))
    assert "g1 is a function, expected a B.CUDAGraph()" in _msg(
        check_capture_chain(lambda f1, f2, x: (f1, f2, f1(x), f2(f1(x))), B=B))


# ---- serve (diagnosis) ----------------------------------------------------------------------

def _serve(B, *, copy=True, clone="all", capture_per_request=False, warmup=True,
           on_request=False):
    def serve(model, requests):
        static_x = requests[0] if on_request else torch.zeros_like(requests[0])
        if warmup:
            side_stream_warmup(model, static_x, B=B)
        g = B.CUDAGraph()
        with B.graph(g):
            static_y = model(static_x)
        outputs = []
        for i, x in enumerate(requests):
            if capture_per_request:
                g = B.CUDAGraph()
                with B.graph(g):
                    static_y = model(static_x)
            if copy:
                static_x.copy_(x)
            else:
                static_x = x  # noqa: F841 - the bug of the broken version
            g.replay()
            keep = clone == "all" or (clone == "all but last" and i < len(requests) - 1)
            outputs.append(static_y.clone() if keep else static_y)
        if clone == "after the loop":
            outputs = [y.clone() for y in outputs]
        return outputs
    return serve


def test_serve_reference_passes(B, capsys):
    assert check_serve(_serve(B), B=B)
    assert capsys.readouterr().out == "✅ serve: passed 3 random trials\n"


def test_serve_rejects_the_broken_version(B):
    msg = _msg(check_serve(_serve(B, copy=False, clone="none"), B=B))
    assert "results are the same tensor" in msg and "section 5" in msg


def test_serve_rejects_half_fixes(B):
    # static_x = x frees the captured input: a GPU reuses its memory, the emulator keeps
    # reading its old values, so the message rests on the tensor being gone, not on values
    msg = _msg(check_serve(_serve(B, copy=False), B=B))
    assert "by replay 1 the tensor model was captured on (your static input) was gone" in msg
    assert "static_x = x?" in msg and "copy_ each batch into it" in msg and "section 4" in msg
    msg = _msg(check_serve(_serve(B, clone="none"), B=B))
    assert "results are the same tensor" in msg
    msg = _msg(check_serve(_serve(B, clone="all but last"), B=B))
    assert "the last result IS the graph's static output (static_y)" in msg


def test_serve_rejects_rebinding_an_alias_of_a_live_static_input(B):
    def serve(model, requests):
        static_x = torch.zeros_like(requests[0])
        side_stream_warmup(model, static_x, B=B)
        g = B.CUDAGraph()
        with B.graph(g):
            static_y = model(static_x)
        outputs = []
        for x in requests:
            inp = static_x
            inp = x  # noqa: F841 - rebinds the alias; static_x stays alive and unwritten
            g.replay()
            outputs.append(static_y.clone())
        return outputs
    msg = _msg(check_serve(serve, B=B))
    assert "gone" not in msg
    assert "hold the same values" in msg and "copy_ into it (section 4" in msg


def test_serve_rejects_eager_and_per_request_capture(B):
    msg = _msg(check_serve(lambda model, requests: [model(x) for x in requests], B=B))
    assert "model was never called during a capture" in msg
    msg = _msg(check_serve(_serve(B, capture_per_request=True), B=B))
    assert "model was captured" in msg


def test_serve_hints_come_in_steps(B):
    res = check_serve(_serve(B, copy=False, clone="none"), B=B)
    assert "copy_" not in res.message.split("hint:")[-1]
    # the message names the shared static output: the first hint is about that mistake,
    # and the answer (the clone) comes only after it
    assert len(res.more_hints) == 2 and "section 5" in res.more_hints[0]
    assert ".clone()" not in res.more_hints[0] and ".clone()" in res.more_hints[1]


def test_serve_rejects_dropping_the_warmup(B):
    msg = _msg(check_serve(_serve(B, warmup=False), B=B))
    assert "you dropped the warm-up" in msg and "section 2" in msg


def test_serve_rejects_a_request_as_the_static_input(B):
    msg = _msg(check_serve(_serve(B, on_request=True), B=B))
    assert "serve changed the caller's requests[0] in place" in msg
    assert "Your static input IS a caller's request" in msg


def test_serve_rejects_cloning_after_the_loop(B):
    msg = _msg(check_serve(_serve(B, clone="after the loop"), B=B))
    assert "you kept references to the static output (static_y) and cloned after the loop" \
        in msg and "(section 5)" in msg


def test_serve_newcomers_answer_passes(B):
    def serve(model, requests):
        static_x = torch.empty_like(requests[0])
        static_x.copy_(requests[0])
        side_stream_warmup(model, static_x, B=B)
        g = B.CUDAGraph()
        with B.graph(g):
            static_y = model(static_x)
        answers = []
        for req in requests:
            static_x.copy_(req)
            g.replay()
            answers.append(static_y.detach().clone())
        return answers
    assert check_serve(serve, B=B)
