"""Lesson 01, exercise ``chrome_trace_events``: its checker.

``chrome_trace_events(spans) -> list[dict]``: one Chrome-trace "complete" event per span
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
from labkit.checks import DEFAULT_TIME_LIMIT, CheckResult, Exercise
from labkit.checks.lesson01._common import _uniform

__all__ = ["check_chrome_trace_events"]


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


EXERCISE = Exercise(
    "chrome_trace_events",
    hint="compare your events with the two printed in section 6 of the lesson",
    more_hints=(
        'one dict per span: {"name", "ph": "X", "ts", "dur", "pid", "tid"}; ts and dur '
        "are the span's start_us and dur_us, unchanged",
        "a dict from lane name to number, filled as lanes appear (e.g. {'CPU': 1, "
        "'GPU': 2}); that number goes in pid and tid",
    ),
)


def _the_spans(spans: list[T.Span]) -> list[T.Span]:
    """The reference's side of a trial: the spans themselves (the judge needs them, and
    any numbering of the lanes is right, so no reference trace is compared)."""
    return list(spans)


def _make_inputs(gen: torch.Generator):
    return (_spans_for(gen),)


def check_chrome_trace_events(fn, *, trials: int = 4,
                              time_limit: float | None = DEFAULT_TIME_LIMIT) -> CheckResult:
    """``fn(spans)`` must return one ``ph: "X"`` event per span (any order), µs units,
    a distinct (pid, tid) per lane. Metadata events (``ph: "M"``) may be added."""
    return EXERCISE.check(fn, _the_spans, _make_inputs, trials=trials,
                          judges=(_trace_problem,), time_limit=time_limit)
