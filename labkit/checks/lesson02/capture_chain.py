"""Lesson 02, exercise ``capture_chain``: its checker.

``capture_chain(f1, f2, static_input) -> (g1, g2, static_mid, static_out)``: two graphs
in ONE shared pool, ``g1`` computing ``static_mid = f1(static_input)`` and ``g2``
computing ``static_out = f2(static_mid)``. Checked by replaying ``g1`` then ``g2`` on
fresh data, then each graph alone (``g1`` must not touch ``static_out``; ``g2`` must read
what is in ``static_mid``, not recompute it from ``static_input``), by
``g1.pool() == g2.pool()``, and that ``g1`` records f1 "and nothing else": no capture
calls both f1 and f2 (``capture_begin`` and the two functions log their calls), and on
the emulator ``g1`` holds no more ops than f1 captured alone.
"""

from __future__ import annotations

import contextlib
from collections import Counter

import torch

from labkit.backend import ensure as _backend
from labkit.capture import capture, recorded_kernels
from labkit.checks import (
    DEFAULT_TIME_LIMIT,
    CheckResult,
    Exercise,
    attempt,
    compare_outputs,
    extra_probe,
    reject,
)
from labkit.checks.lesson02._common import _call, _patched_method

__all__ = ["check_capture_chain"]


_F1 = {
    "2x+1": lambda x: x * 2.0 + 1.0,
    "x*x-0.5": lambda x: x * x - 0.5,
    "exp(-|x|)": lambda x: torch.exp(-x.abs()),
}
_F2 = {
    "3tanh(x)-x": lambda x: torch.tanh(x) * 3.0 - x,
    "sigmoid(x)+x": lambda x: torch.sigmoid(x) + x,
    "x/2-1": lambda x: x * 0.5 - 1.0,
}


def _logged(B, fn, name: str, calls: list):
    """``fn`` that logs ``(name, capturing?)`` into ``calls`` at every call."""
    def logged(*args, **kwargs):
        calls.append((name, B.is_current_stream_capturing()))
        return fn(*args, **kwargs)
    logged.__name__ = getattr(fn, "__name__", name)
    return logged


@contextlib.contextmanager
def _recording_captures(B, calls: list):
    """Log ``("begin", graph)`` into ``calls`` at every ``B.CUDAGraph.capture_begin``.

    ``B.graph(g)`` calls ``g.capture_begin`` on both backends (torch.cuda.graph and the
    emulator's graph mirror each other), so this marks where each capture starts.
    """
    def make(original):
        def capture_begin(self, *args, **kwargs):
            calls.append(("begin", self))
            return original(self, *args, **kwargs)
        return capture_begin

    with _patched_method(B.CUDAGraph, "capture_begin", make):
        yield


def _pick(table: dict, gen: torch.Generator):
    key = list(table)[int(torch.randint(0, len(table), (), generator=gen))]
    fn = table[key]
    fn.__name__ = key
    return fn


EXERCISE = Exercise(
    "capture_chain",
    hint="section 7 of the lesson captures two graphs into one pool, the second reading "
         "the first's static output",
    more_hints=(
        "two graphs, two captures: g1 records static_mid = f1(static_input); g2 records "
        "static_out = f2(static_mid), on the very tensor g1 writes",
        "one pool for both: pool = B.graph_pool_handle(), then `with B.graph(g1, "
        "pool=pool):` and `with B.graph(g2, pool=pool):` (or pool=g1.pool() for g2)",
    ),
)


def _reference(f1, f2, static_input, fresh, probe):
    return {"mid": [f1(x) for x in fresh], "out": [f2(f1(x)) for x in fresh]}


def _returned(B, capture_chain, f1, f2, static_input, calls: list) -> tuple:
    """``capture_chain``'s ``(g1, g2, static_mid, static_out)``, checked for its shape
    (anything else rejects the trial); ``calls`` logs the captures and f1's, f2's calls."""
    with _recording_captures(B, calls):
        result = _call(B, capture_chain, _logged(B, f1, "f1", calls),
                       _logged(B, f2, "f2", calls), static_input)
    if not isinstance(result, (tuple, list)) or len(result) != 4:
        got = type(result).__name__ + (f" of {len(result)}" if isinstance(
            result, (tuple, list)) else "")
        reject(f"expected a tuple (g1, g2, static_mid, static_out), got {got}")
    g1, g2, mid, out = result
    for name, g in (("g1", g1), ("g2", g2)):
        if not isinstance(g, B.CUDAGraph):
            reject(f"{name} is a {type(g).__name__}, expected a B.CUDAGraph()")
    for name, t in (("static_mid", mid), ("static_out", out)):
        if not isinstance(t, torch.Tensor):
            reject(f"{name} is a {type(t).__name__}, expected the tensor the graph writes")
    if g1 is g2:
        reject("g1 and g2 are the same graph object: the exercise asks for two graphs, g1 "
               "recording f1 only and g2 recording f2 only (two captures, section 7)")
    return g1, g2, mid, out


def _same_pool(g1, g2) -> bool:
    return tuple(g1.pool()) == tuple(g2.pool())


def _replayed(graphs: tuple, f1, f2, static_input, fresh, probe, spare: tuple) -> dict:
    """Replay the learner's graphs: in order on fresh inputs, then each alone on probes.

    ``spare``: two buffers allocated before ``capture_chain`` ran (see below).
    """
    g1, g2, mid, out = graphs
    first, second = spare
    mids, outs = [], []
    for x in fresh:
        static_input.copy_(x)
        g1.replay()
        g2.replay()
        mids.append(mid.clone())
        outs.append(out.clone())
    # does g1 read static_input? g1 alone, replayed back to back on two inputs,
    # with nothing allocated between, into buffers allocated before capture_chain
    # ran. (Not the loop above: a copy of the input made in capture_chain and kept
    # by nothing goes back to the caching allocator on a GPU, and the loop's clones
    # land there, so what g1 reads changes between those replays although g1 reads
    # no input; the emulator never hands memory outside a graph pool out again.)
    mid_constant = False
    if mid.shape == first.shape and mid.dtype == first.dtype:
        static_input.copy_(fresh[0])
        g1.replay()
        first.copy_(mid)
        static_input.copy_(fresh[1])
        g1.replay()
        second.copy_(mid)
        mid_constant = bool(torch.equal(first, second))
    # probe 1: g1 alone must write static_mid and must not compute static_out.
    # (It MAY scribble on static_out: in a shared pool g2's output can live in a
    # block g1 used for an intermediate; that is why shared pools replay in order.)
    static_input.copy_(probe)
    full = f2(f1(probe))
    was_full = bool(torch.allclose(out, full, rtol=1e-5, atol=1e-6))
    marker = torch.full_like(mid, 1234.5)
    mid.copy_(marker)
    g1.replay()
    g1_writes_mid = not torch.equal(mid, marker)
    g1_mid_ok = bool(torch.allclose(mid, f1(probe), rtol=1e-5, atol=1e-6))
    g1_touches_out = not was_full and bool(torch.allclose(out, full, rtol=1e-5, atol=1e-6))
    # probe 2: g2 alone must read what static_mid holds now
    planted = probe.flip(0) + 0.25
    mid.copy_(planted)
    g2.replay()
    return {"mid": mids, "out": outs, "g1_mid_ok": g1_mid_ok,
            "g1_touches_out": g1_touches_out,
            "g2_reads_mid": bool(torch.allclose(out, f2(planted), rtol=1e-5, atol=1e-6)),
            "g2_writes_mid": not torch.equal(mid, planted), "mid_constant": mid_constant,
            "g1_writes_mid": g1_writes_mid,
            "g2_recomputes": bool(torch.allclose(out, full, rtol=1e-5, atol=1e-6)),
            "g2_reads_input": bool(torch.allclose(out, f2(probe), rtol=1e-5, atol=1e-6))}


def _f1_with_f2(calls: list) -> bool:
    """Whether one capture called f1 and f2 both (f1, f2 and capture_begin log calls)."""
    begins = [i for i, (kind, _) in enumerate(calls) if kind == "begin"] + [len(calls)]
    return any({"f1", "f2"} <= {kind for kind, capturing in calls[a + 1:b] if capturing}
               for a, b in zip(begins, begins[1:]))


def _kernels(B, g1, f1, static_input) -> tuple[list, list]:
    """The ops g1 holds, and those f1 alone captures (emulator only: on a GPU counting
    kernels needs the profiler, too slow for a checker)."""
    g1_kernels = recorded_kernels(g1, B)
    g_f1, _ = capture(f1, torch.zeros_like(static_input), B=B)
    f1_kernels = recorded_kernels(g_f1, B)
    del g_f1
    return g1_kernels, f1_kernels


def _mid_values(expected, actual) -> str | None:
    """static_mid after g1.replay() is f1(static_input), in the tensor g1 writes."""
    msg = compare_outputs(expected["mid"], actual["mid"], rtol=1e-5, atol=1e-6,
                          where="static_mid ")
    if not msg:
        return None
    if compare_outputs(expected["out"], actual["mid"], rtol=1e-5, atol=1e-6) is None \
            and compare_outputs(expected["mid"], actual["out"], rtol=1e-5, atol=1e-6) is None:
        return ("static_mid and static_out: order swapped. What you return as static_mid "
                "holds f2(f1(x)) and what you return as static_out holds f1(x): return "
                "(g1, g2, static_mid, static_out) in this order")
    if not actual["g1_writes_mid"]:
        return (msg + " after g1.replay(). Replaying g1 leaves what you return as "
                "static_mid unchanged: it is not the tensor g1 writes (an eager result, "
                "or a copy of g1's output). Return the very tensor f1 returned inside "
                "g1's capture, not a copy of it")
    if actual["mid_constant"]:
        return (msg + " after g1.replay(). g1 writes static_mid, but the same values "
                "whatever static_input holds: g1 does not read static_input. Did you "
                "capture f1 on a copy of it (static_input.clone(), a tensor of your own)? "
                "The graph reads the tensor it was captured on: capture "
                "f1(static_input) itself")
    return msg + (" after g1.replay(): g1 must record static_mid = f1(static_input), "
                  "and static_mid must be the tensor g1 wrote (not a copy of it)")


def _g1_alone(expected, actual) -> str | None:
    if actual["g1_touches_out"]:
        return ("replaying g1 alone computed static_out = f2(f1(x)): g1 records f2 too. "
                "Each graph records one function: g1 f1, g2 f2")
    return None


def _g2_reads_mid(expected, actual) -> str | None:
    if actual["g2_writes_mid"] and not actual["g2_reads_mid"]:
        return ("replaying g2 alone overwrote static_mid: your g2 records f1. Graph order "
                "swapped? Return (g1, g2, static_mid, static_out), g1 the f1 graph")
    if actual["g2_reads_mid"]:
        return None
    head = ("g2 does not read g1's output: with new values written into static_mid, "
            "g2.replay() alone did not give f2(static_mid). ")
    if actual["g2_recomputes"]:
        why = "It gave f2(f1(static_input)): your g2 recomputes f1 from static_input. "
    elif actual["g2_reads_input"]:
        why = ("It gave f2(static_input): your g2 records f2 of static_input, not of "
               "static_mid. ")
    else:
        why = ("Your g2 reads another tensor, made before its capture (a copy of "
               "static_mid?), which no replay of g1 updates. ")
    return head + why + "Capture g2 on static_mid itself, the tensor g1 writes"


def _out_values(expected, actual) -> str | None:
    msg = compare_outputs(expected["out"], actual["out"], rtol=1e-5, atol=1e-6,
                          where="static_out ")
    if msg:
        return msg + (" after g1.replay(); g2.replay(): g2 must record "
                      "static_out = f2(static_mid)")
    if not actual["g1_mid_ok"]:
        return "replaying g1 alone did not write f1(static_input) into static_mid"
    return None


def _g1_records_f1_only(expected, actual) -> str | None:
    if actual["f1_with_f2"]:
        return ("one capture called f1 and f2 both: g1 records f2 as well (into a tensor "
                "you do not keep?). The exercise asks g1 to record static_mid = "
                "f1(static_input), f1 and nothing else: f2 belongs in g2 only")
    extra = len(actual["g1_kernels"]) - len(actual["f1_kernels"])
    if not (actual["f1_kernels"] and extra > 0):
        return None
    more = sorted((Counter(actual["g1_kernels"]) - Counter(actual["f1_kernels"])).elements())
    named = ", ".join(more) if more else f"{extra} more"
    copy = any("copy" in k for k in more)
    why = ("a copy of f1's result into a tensor of your own? static_mid can be f1's "
           "own output: no copy needed" if copy else
           "an op f1 does not have, into a tensor you do not keep?")
    return (f"g1 recorded {len(actual['g1_kernels'])} kernels, but f1 alone is "
            f"{len(actual['f1_kernels'])}: g1 records more than static_mid = "
            f"f1(static_input) (extra: {named}; {why}). The exercise asks g1 to "
            "record f1 and nothing else")


def _one_pool(expected, actual) -> str | None:
    if actual["same_pool"]:
        return None
    return ("the results are right, but g1 and g2 use different memory pools: the "
            "exercise asks for one shared pool: capture g2 with pool=g1.pool() or pass one "
            "B.graph_pool_handle() to both (section 7)")


#: in order, the first reason wins
JUDGES = (_mid_values, _g1_alone, _g2_reads_mid, _out_values, _g1_records_f1_only, _one_pool)


def check_capture_chain(capture_chain, *, B=None, trials: int = 3,
                        time_limit: float | None = DEFAULT_TIME_LIMIT) -> CheckResult:
    """``capture_chain(f1, f2, static_input)``: ``(g1, g2, static_mid, static_out)``, one pool.

    Probed: two distinct graphs; replaying g1 then g2 gives f1(x) and f2(f1(x)); g1 alone
    writes static_mid and leaves static_out alone; g2 alone reads whatever static_mid
    holds; both graphs in one pool. f1, f2 and the sizes are drawn at random.
    """
    B = _backend(B)

    def make_inputs(gen: torch.Generator):
        n = int(torch.randint(3, 40, (), generator=gen))
        f1, f2 = _pick(_F1, gen), _pick(_F2, gen)
        fresh = [torch.randn(n, generator=gen).to(B.device) for _ in range(3)]
        probe = torch.randn(n, generator=gen).to(B.device)
        return f1, f2, torch.zeros(n, device=B.device), fresh, probe

    def learner(f1, f2, static_input, fresh, probe):
        calls: list[tuple] = []     # ("begin", graph) / ("f1" or "f2", capturing?)
        # made before capture_chain runs: memory it frees cannot be in them (see _replayed)
        spare = torch.empty_like(static_input), torch.empty_like(static_input)
        graphs = _returned(B, capture_chain, f1, f2, static_input, calls)
        same = attempt(_same_pool, graphs[:2], not_done=False, kind="mismatch",
                       reason=lambda exc: f"g1.pool() / g2.pool() failed ({exc}): was each "
                                          "graph captured?")
        seen = attempt(_replayed, (graphs, f1, f2, static_input, fresh, probe, spare),
                       not_done=False, kind="mismatch",
                       reason=lambda exc: f"replaying g1 / g2 failed: "
                                          f"{type(exc).__name__}: {exc}")
        # probe 3: g1 records f1 "and nothing else": no capture called f1 and f2 both,
        # and (emulator) g1 holds as many ops as f1 captured alone
        kernels = ([], [])
        if B.is_emulated:
            kernels = extra_probe(_kernels, (B, graphs[0], f1, static_input), B=B,
                                  default=([], []))
        return dict(seen, same_pool=same, f1_with_f2=_f1_with_f2(calls),
                    g1_kernels=kernels[0], f1_kernels=kernels[1])

    return EXERCISE.check(learner, _reference, make_inputs, trials=trials, judges=JUDGES,
                          time_limit=time_limit)
