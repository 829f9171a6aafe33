"""Lesson 01 checkers: the reference passes; real learner mistakes are rejected with a
message that names the mistake actually made (and never the full answer first)."""

from __future__ import annotations

from labkit import timeline as T
from labkit.checks.lesson01 import check_chrome_trace_events, check_simulate_launch_bound


def _msg(res) -> str:
    assert not res, "a wrong answer passed"
    return res.message


# ---- simulate_launch_bound ----------------------------------------------------------------

def _idle_loop(n, launch_us, kernel_us):
    end = 0.0
    for i in range(n):
        end = max((i + 1) * launch_us, end) + kernel_us
    return end - n * kernel_us


def test_simulate_reference_passes(capsys):
    assert check_simulate_launch_bound(_idle_loop)
    assert check_simulate_launch_bound(
        lambda n, L, K: T.gpu_idle_us(T.simulate(n, L, K, gap_us=0)))
    assert capsys.readouterr().out.count("✅ simulate_launch_bound: passed 6 random trials") == 2


def test_simulate_rejects_n_gaps_of_launch_minus_kernel():
    msg = _msg(check_simulate_launch_bound(lambda n, L, K: n * (L - K)))
    assert "(launch-bound)" in msg and "off by one kernel time" in msg


def test_simulate_newcomers_loop_passes():
    def idle(n, L, K):                      # counts from 1, sums the busy time
        t_free = busy = 0.0
        for i in range(1, n + 1):
            t_free = max(t_free, i * L) + K
            busy += K
        return t_free - busy
    assert check_simulate_launch_bound(idle)


def test_simulate_rejects_forgetting_the_first_launch():
    msg = _msg(check_simulate_launch_bound(lambda n, L, K: (n - 1) * max(0.0, L - K)))
    assert "(launch-bound)" in msg and "one launch time too little" in msg
    assert "FIRST launch" in msg


def test_simulate_rejects_kernels_starting_with_their_launch():
    def idle(n, L, K):                      # kernel i starts at i*L, the START of launch i
        end = 0.0
        for i in range(n):
            end = max(i * L, end) + K
        return end - n * K
    msg = _msg(check_simulate_launch_bound(idle))
    assert "one launch time too little" in msg and "not when it starts (i*launch_us)" in msg


def test_simulate_rejects_a_rounded_result():
    msg = _msg(check_simulate_launch_bound(lambda n, L, K: round(_idle_loop(n, L, K))))
    assert "rounded to a whole number" in msg


def test_simulate_rejects_the_idle_fraction():
    def fraction(n, L, K):
        idle = _idle_loop(n, L, K)
        return idle / (idle + n * K)
    msg = _msg(check_simulate_launch_bound(fraction))
    assert "idle FRACTION" in msg and "µs" in msg


def test_simulate_rejects_the_launch_bound_only_formula():
    msg = _msg(check_simulate_launch_bound(lambda n, L, K: n * (L - K) + K))
    assert "(GPU-bound)" in msg and "one kernel of a stream at a time" in msg
    assert "negative idle time" in msg


def test_simulate_rejects_clamping_to_zero():
    msg = _msg(check_simulate_launch_bound(lambda n, L, K: max(0.0, n * (L - K) + K)))
    assert "Even GPU-bound, the GPU waits for the first launch" in msg


def test_simulate_rejects_total_launch_time():
    msg = _msg(check_simulate_launch_bound(lambda n, L, K: n * L))
    assert "CPU's total launch time" in msg


def test_simulate_rejects_off_by_one_kernel():
    msg = _msg(check_simulate_launch_bound(lambda n, L, K: _idle_loop(n, L, K) - K))
    assert "off by one kernel time" in msg


def test_simulate_rejects_the_lessons_default_gap():
    msg = _msg(check_simulate_launch_bound(lambda n, L, K: T.gpu_idle_us(T.simulate(n, L, K))))
    assert "default 0.1 µs gap" in msg and "the exercise has no gap" in msg


def test_simulate_rejects_kernels_that_ignore_the_previous_one():
    def no_queue(n, L, K):
        end = 0.0
        for i in range(n):
            end = (i + 1) * L + K          # forgets max(..., end of kernel i-1)
        return end - n * K

    msg = _msg(check_simulate_launch_bound(no_queue))
    assert "one kernel of a stream at a time" in msg


def test_simulate_rejects_non_numbers():
    assert "got NoneType (did you forget `return`?)" in _msg(
        check_simulate_launch_bound(lambda n, L, K: None))
    assert "expected a number of µs, got str" in _msg(
        check_simulate_launch_bound(lambda n, L, K: f"{_idle_loop(n, L, K)} µs"))
    assert "got bool" in _msg(check_simulate_launch_bound(lambda n, L, K: True))


def test_simulate_first_hint_is_not_the_answer():
    msg = _msg(check_simulate_launch_bound(lambda n, L, K: n * (L - K) + K))
    assert "max(" not in msg and "n*kernel_us" not in msg


# ---- chrome_trace_events ------------------------------------------------------------------

def _with(**changes):
    def fn(spans):
        return [dict(e, **{k: (v(e) if callable(v) else v) for k, v in changes.items()})
                for e in T.chrome_trace_events(spans)]
    return fn


def test_trace_reference_passes(capsys):
    assert check_chrome_trace_events(T.chrome_trace_events)
    assert check_chrome_trace_events(lambda spans: T.chrome_trace_events(spans)[::-1])

    def lanes_from_ten(spans):
        ids = {}
        return [{"name": s.name, "ph": "X", "ts": s.start_us, "dur": s.dur_us,
                 "pid": ids.setdefault(s.lane, 10 + len(ids)),
                 "tid": ids.setdefault(s.lane, 10 + len(ids))} for s in spans]

    assert check_chrome_trace_events(lanes_from_ten)
    assert capsys.readouterr().out.count("✅ chrome_trace_events: passed 4 random trials") == 3


def test_trace_rejects_nanoseconds_and_milliseconds():
    msg = _msg(check_chrome_trace_events(_with(ts=lambda e: e["ts"] * 1e3,
                                               dur=lambda e: e["dur"] * 1e3)))
    assert "that is ns" in msg and "µs" in msg
    msg = _msg(check_chrome_trace_events(_with(ts=lambda e: e["ts"] / 1e3,
                                               dur=lambda e: e["dur"] / 1e3)))
    assert "that is ms" in msg


def test_trace_rejects_one_track_for_all_lanes():
    msg = _msg(check_chrome_trace_events(_with(pid=0, tid=0)))
    assert "share (pid, tid)" in msg and "own" in msg


def test_trace_rejects_a_string_lane_id():
    def by_name(spans):
        return [{"name": s.name, "ph": "X", "ts": s.start_us, "dur": s.dur_us,
                 "pid": s.lane, "tid": s.lane} for s in spans]

    msg = _msg(check_chrome_trace_events(by_name))
    assert "a NUMBER per lane" in msg and "not the lane's name" in msg


def test_trace_rejects_pid_and_tid_that_differ():
    ids = {}
    msg = _msg(check_chrome_trace_events(
        _with(pid=1, tid=lambda e: ids.setdefault(e["cat"], len(ids) + 1))))
    assert "the lane's one number in both" in msg


def test_trace_rejects_a_new_number_per_span():
    def per_span(spans):
        return [{"name": s.name, "ph": "X", "ts": s.start_us, "dur": s.dur_us,
                 "pid": i, "tid": i} for i, s in enumerate(spans)]

    msg = _msg(check_chrome_trace_events(per_span))
    assert "one lane must stay on one track" in msg


def test_trace_rejects_begin_events_and_missing_keys():
    assert "ph 'X'" in _msg(check_chrome_trace_events(_with(ph="B")))

    def no_dur(spans):
        return [{k: v for k, v in e.items() if k != "dur"} for e in T.chrome_trace_events(spans)]

    assert "lacks the key(s) ['dur']" in _msg(check_chrome_trace_events(no_dur))


def test_trace_rejects_the_wrapper_and_missing_events():
    msg = _msg(check_chrome_trace_events(lambda spans: T.to_chrome_trace(T.Timeline(spans))))
    assert "not the {'traceEvents': [...]} wrapper" in msg

    def one_per_lane(spans):
        seen, out = set(), []
        for e in T.chrome_trace_events(spans):
            if e["cat"] not in seen:
                seen.add(e["cat"])
                out.append(e)
        return out

    assert "one per span" in _msg(check_chrome_trace_events(one_per_lane))


def test_trace_first_hint_is_not_the_answer():
    msg = _msg(check_chrome_trace_events(_with(pid=0, tid=0)))
    assert '"ph": "X"' not in msg and "{'CPU': 1" not in msg


def test_endless_loop_gets_a_verdict():
    def endless(n, L, K):
        i = 0
        while i < n:
            i = i * 1                          # never grows
        return 0.0

    res = check_simulate_launch_bound(endless, time_limit=0.3)
    assert not res and res.kind == "timeout" and "did not finish within 0.3 s" in res.message
