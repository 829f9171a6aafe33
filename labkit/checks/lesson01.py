"""Checkers for lesson 01 (launch-bound timeline).

Two exercises, each checked against :mod:`labkit.timeline`:

* ``simulate_launch_bound(n, launch_us, kernel_us) -> float``: the GPU's idle time in µs
  for an eager chain of ``n`` kernels (no gap between kernels: ``gap_us=0``, where the
  lesson's ``T.simulate`` adds a default 0.1 µs), from the first launch to the last
  kernel's end. Reference: ``gpu_idle_us(simulate(n, launch_us, kernel_us, gap_us=0))``.
* ``chrome_trace_events(spans) -> list[dict]``: one Chrome-trace "complete" event per span
  (any order), with ``ts``/``dur`` in µs and one number per lane, used for both ``pid``
  and ``tid`` (as the exercise states). Any numbering is accepted as long as lanes stay
  apart, so it is checked by what the text and Perfetto need, not by equality with the
  reference. The spans come in a random order, with two or three lanes.
"""

from __future__ import annotations

import json
import math
from numbers import Real

import torch

from labkit import timeline as T
from labkit.checks import DEFAULT_TIME_LIMIT, CheckResult, check

__all__ = ["check_simulate_launch_bound", "check_chrome_trace_events"]

LESSON_GAP_US = 0.1  # T.simulate's default gap between two kernels (the exercise has none)


def _uniform(gen: torch.Generator, lo: float, hi: float) -> float:
    return round(float(torch.empty(()).uniform_(lo, hi, generator=gen)), 2)


def _idle_reference(n: int, launch_us: float, kernel_us: float) -> float:
    return T.gpu_idle_us(T.simulate(n, launch_us, kernel_us, gap_us=0.0))


def check_simulate_launch_bound(fn, *, trials: int = 6,
                                time_limit: float | None = DEFAULT_TIME_LIMIT) -> CheckResult:
    """``fn(n, launch_us, kernel_us)`` must return the GPU idle time (µs) of an eager chain.

    Trials alternate between launch-bound (kernel shorter than a launch) and GPU-bound
    (kernel longer) chains, and include a single kernel, so a formula that holds in one
    regime only is caught.
    """
    last: dict = {}

    def make_inputs(gen: torch.Generator):
        trial = gen.initial_seed()
        n = 1 if trial == 3 else int(torch.randint(2, 40, (), generator=gen))
        launch_us = _uniform(gen, 2.0, 15.0)
        if trial % 2:  # launch-bound: kernels shorter than a launch
            kernel_us = round(launch_us * _uniform(gen, 0.05, 0.8), 2)
        else:          # GPU-bound: kernels longer than a launch
            kernel_us = round(launch_us * _uniform(gen, 1.3, 6.0), 2)
        if trial == 5:  # whole microseconds, as ints: the text does not promise floats
            launch_us, kernel_us = int(round(launch_us)) or 1, int(round(kernel_us)) + 1
        last.update(n=n, launch_us=launch_us, kernel_us=kernel_us)
        return n, launch_us, kernel_us

    def compare(expected: float, actual) -> str | None:
        n, L, K = last["n"], last["launch_us"], last["kernel_us"]
        case = f"n={n}, launch_us={L}, kernel_us={K}"
        regime = "launch-bound" if K < L else "GPU-bound"
        if isinstance(actual, torch.Tensor) and actual.numel() == 1:
            actual = actual.item()
        if not isinstance(actual, Real) or isinstance(actual, bool):
            hint = " (did you forget `return`?)" if actual is None else ""
            return f"expected a number of µs, got {type(actual).__name__}{hint}"
        actual = float(actual)
        if math.isclose(actual, expected, rel_tol=1e-6, abs_tol=1e-6):
            return None
        with_gap = T.gpu_idle_us(T.simulate(n, L, K, gap_us=LESSON_GAP_US))
        no_queue = n * L + K - n * K  # kernel i starts at the end of launch i, always
        why = ""
        if n > 1 and math.isclose(actual, with_gap, rel_tol=1e-6, abs_tol=1e-6):
            why = (f" That is the idle time with T.simulate's default {LESSON_GAP_US} µs gap "
                   "between kernels (section 2's table uses it); the exercise has no gap.")
        elif regime == "GPU-bound" and math.isclose(actual, no_queue, rel_tol=1e-6,
                                                    abs_tol=1e-6):
            why = (" Your kernels start as soon as their launch ends, even while the previous "
                   "kernel still runs: the GPU runs one kernel of a stream at a time, so a "
                   "kernel also waits for the previous one to finish.")
            if actual < 0:
                why += " (A negative idle time is the sign: kernels overlapping each other.)"
        elif actual < 0:
            why = (" Idle time cannot be negative: when kernels outlast launches the queue "
                   "fills up and the GPU waits only for the very first launch.")
        elif regime == "GPU-bound" and math.isclose(actual, 0.0, abs_tol=1e-9):
            why = " Even GPU-bound, the GPU waits for the first launch before kernel 0 can start."
        elif regime == "launch-bound" and math.isclose(actual, expected - L, rel_tol=1e-6,
                                                       abs_tol=1e-6):
            why = (" That is exactly one launch time too little: the GPU also idles while the "
                   "FIRST launch runs. Kernel i can start only when launch i has ENDED, at "
                   "(i+1)*launch_us, not when it starts (i*launch_us); so kernel 0 starts at "
                   "launch_us, and the window starts at 0.")
        elif actual != expected and float(round(expected)) == actual:
            why = (" That is the right idle time rounded to a whole number: return the float "
                   "itself (no round(), int() or //).")
        elif expected > 0 and math.isclose(actual, expected / (expected + n * K),
                                           rel_tol=1e-6, abs_tol=1e-9):
            why = (" That is the idle FRACTION of the window; the exercise asks for the idle "
                   "time in µs.")
        elif math.isclose(actual, expected - K, rel_tol=1e-6, abs_tol=1e-6):
            why = (" You are off by one kernel time: the window runs from the first launch "
                   "to the END of the last kernel, which starts only after the last launch.")
        elif math.isclose(actual, n * L, rel_tol=1e-6, abs_tol=1e-6):
            why = (" That is the CPU's total launch time; subtract the time kernels keep "
                   "the GPU busy.")
        return (f"for {case} ({regime}) the GPU idles {expected:g} µs, you returned "
                f"{actual:g}.{why}")

    return check(
        fn, _idle_reference, make_inputs, trials=trials, name="simulate_launch_bound",
        compare=compare, time_limit=time_limit,
        hint="work the failing case by hand on section 2's two-lane picture, in both regimes "
             "(kernel_us < launch_us and kernel_us > launch_us)",
        more_hints=[
            "kernel i starts when BOTH are done: launch i (it ends at (i+1)*launch_us) and "
            "kernel i-1",
            "loop over the kernels keeping the end of the previous one; idle = end of the "
            "last kernel - n*kernel_us (the window starts at 0, the first launch)",
        ],
    )


def _spans_for(gen: torch.Generator) -> list[T.Span]:
    n = int(torch.randint(1, 6, (), generator=gen))
    launch_us = _uniform(gen, 1.0, 12.0)
    kernel_us = _uniform(gen, 0.5, 20.0)
    graphed = bool(torch.randint(0, 2, (), generator=gen))
    spans = list(T.simulate(n, launch_us, kernel_us, graphed=graphed).spans)
    if int(torch.randint(0, 2, (), generator=gen)):  # a third lane, as in measured traces
        spans.append(T.Span(T.OPS, "aten::add", 0.0, _uniform(gen, 1.0, 5.0)))
    order = torch.randperm(len(spans), generator=gen).tolist()  # any order, as Perfetto takes
    return [spans[i] for i in order]


def _trace_problem(spans: list[T.Span], events) -> str | None:
    """What is wrong with ``events`` as the trace of ``spans``, or None."""
    if events is None:
        return "got None (did you forget `return`?)"
    if isinstance(events, dict) and "traceEvents" in events:
        return ("return the list of events itself, not the {'traceEvents': [...]} wrapper "
                "(to_chrome_trace adds that)")
    if not isinstance(events, (list, tuple)):
        return f"expected a list of dicts, got {type(events).__name__}"
    bad = [e for e in events if not isinstance(e, dict)]
    if bad:
        return f"every event must be a dict, got a {type(bad[0]).__name__}"
    xs = [e for e in events if e.get("ph") != "M"]  # metadata events are allowed extras
    if len(xs) != len(spans):
        return f"expected {len(spans)} events (one per span), got {len(xs)}"
    try:
        json.dumps(xs)
    except (TypeError, ValueError) as exc:
        return f"events must be JSON-serialisable (plain str/int/float): {exc}"
    for i, e in enumerate(xs):
        missing = [k for k in ("name", "ph", "ts", "dur", "pid", "tid") if k not in e]
        if missing:
            return f"event {i} ({e.get('name', '?')!r}) lacks the key(s) {missing}"
    # Events may come in any order (Perfetto sorts them): pair them up by time, then name.
    def key(start, dur, name):
        ok = isinstance(start, Real) and isinstance(dur, Real)
        return (0, float(start), str(name), float(dur)) if ok else (1, 0.0, str(name), 0.0)
    spans = sorted(spans, key=lambda s: key(s.start_us, s.dur_us, s.name))
    xs = sorted(xs, key=lambda e: key(e["ts"], e["dur"], e["name"]))
    lane_ids: dict[str, tuple] = {}
    for s, e in zip(spans, xs):
        where = f"the event for span {s.name!r} (lane {s.lane!r}, start {s.start_us} µs)"
        if e["ph"] != "X":
            return (f"{where} has ph={e['ph']!r}; a span with a start and a duration is a "
                    "'complete' event, ph 'X'")
        if e["name"] != s.name:
            return f"{where} has name {e['name']!r}, expected {s.name!r}"
        for key, want in (("ts", s.start_us), ("dur", s.dur_us)):
            got = e[key]
            if not isinstance(got, Real) or isinstance(got, bool):
                return f"{where}: {key} must be a number, got {type(got).__name__}"
            if not math.isclose(got, want, rel_tol=1e-9, abs_tol=1e-9):
                unit = ""
                if want and math.isclose(got, want * 1e3, rel_tol=1e-9):
                    unit = " (that is ns: Chrome traces count in µs, as Span does: don't convert)"
                elif want and math.isclose(got, want / 1e3, rel_tol=1e-9):
                    unit = " (that is ms: Chrome traces count in µs, as Span does: don't convert)"
                return f"{where}: {key} is {got!r}, expected {want!r}{unit}"
        for key in ("pid", "tid"):
            got = e[key]
            if not isinstance(got, Real) or isinstance(got, bool):
                return (f"{where}: {key} is {got!r}, a {type(got).__name__}; the exercise asks "
                        "for a NUMBER per lane (Chrome traces number their processes and "
                        "threads), not the lane's name")
        if e["pid"] != e["tid"]:
            return (f"{where} has pid={e['pid']!r} and tid={e['tid']!r}: the exercise asks "
                    "for the lane's one number in both")
        ident = (e["pid"], e["tid"])
        if s.lane in lane_ids and lane_ids[s.lane] != ident:
            return (f"{where}: lane {s.lane!r} has (pid, tid) {lane_ids[s.lane]} and {ident}; "
                    "one lane must stay on one track")
        lane_ids[s.lane] = ident
    shared = {}
    for lane, ident in lane_ids.items():
        if ident in shared:
            return (f"lanes {shared[ident]!r} and {lane!r} share (pid, tid) {ident}: Perfetto "
                    "would draw both on one track (launches and kernels mixed up); give each "
                    "lane its own")
        shared[ident] = lane
    return None


def check_chrome_trace_events(fn, *, trials: int = 4,
                              time_limit: float | None = DEFAULT_TIME_LIMIT) -> CheckResult:
    """``fn(spans)`` must return one ``ph: "X"`` event per span (any order), µs units,
    a distinct (pid, tid) per lane. Metadata events (``ph: "M"``) may be added."""
    last: dict = {}

    def make_inputs(gen: torch.Generator):
        spans = _spans_for(gen)
        last["spans"] = list(spans)
        return (spans,)

    def compare(expected, actual) -> str | None:
        return _trace_problem(last["spans"], actual)

    return check(
        fn, T.chrome_trace_events, make_inputs, trials=trials, name="chrome_trace_events",
        compare=compare, time_limit=time_limit,
        hint="compare your events with the two printed in section 6 of the lesson",
        more_hints=[
            'one dict per span: {"name", "ph": "X", "ts", "dur", "pid", "tid"}; ts and dur '
            "are the span's start_us and dur_us, unchanged",
            "a dict from lane name to number, filled as lanes appear (e.g. {'CPU': 1, "
            "'GPU': 2}); that number goes in pid and tid",
        ],
    )
