"""labkit.bench's interleaved rounds, with a fake timer: every variant once per round in a
shuffled order, one value per round per variant, the medians, and the verdict rule (faster
only for 4 of 5 rounds won)."""

from __future__ import annotations

import itertools
import random

import pytest

from labkit import backend
from labkit.bench import make_row, report
from labkit.bench import rounds as R
from labkit.bench import verdicts as V


class FakeTimer:
    """A ``time_one`` that notes which contender it timed and returns preset figures."""

    def __init__(self, figures=None):
        self.calls = []
        self.figures = figures or {}

    def __call__(self, fn):
        key = fn()
        self.calls.append(key)
        n = sum(1 for k in self.calls if k == key)
        base = self.figures.get(key, [100.0] * 99)[n - 1]
        return {"median_us": base, "back_to_back_us": base / 2, "host_us": 1.0}


def contenders(keys):
    return {k: (lambda k=k: k) for k in keys}


def test_every_contender_once_per_round_in_a_shuffled_order():
    keys = [(v, bs) for v in ("eager", "labkit_graph", "compile") for bs in (1, 8, 64)]
    timer = FakeTimer()
    out = R.interleave(contenders(keys), timer, rounds=5, seed=3)
    rounds = [timer.calls[i * len(keys):(i + 1) * len(keys)] for i in range(5)]
    for r in rounds:
        assert sorted(r) == sorted(keys)                 # each once per round
    assert len({tuple(r) for r in rounds}) > 1           # the order changes between rounds
    assert any(r != keys for r in rounds)                # and is not the declared order
    for k in keys:                                       # one value per round per method
        assert {m: len(v) for m, v in out[k].items()} == {
            "median_us": 5, "back_to_back_us": 5, "host_us": 5}


def test_the_order_is_fixed_by_the_seed():
    keys = list("abcdefg")
    t1, t2, t3 = FakeTimer(), FakeTimer(), FakeTimer()
    R.interleave(contenders(keys), t1, rounds=4, seed=7)
    R.interleave(contenders(keys), t2, rounds=4, seed=7)
    R.interleave(contenders(keys), t3, rounds=4, seed=8)
    assert t1.calls == t2.calls and t1.calls != t3.calls


def test_values_are_kept_in_round_order():
    figures = {"a": [5.0, 4.0, 3.0, 2.0, 1.0], "b": [10.0, 20.0, 30.0, 40.0, 50.0]}
    out = R.interleave(contenders("ab"), FakeTimer(figures), rounds=5)
    assert out["a"]["median_us"] == figures["a"] and out["b"]["median_us"] == figures["b"]


@pytest.mark.parametrize("rounds", [0, -1, 2.5, True, "5"])
def test_rounds_must_be_a_whole_number(rounds):
    with pytest.raises(ValueError, match="rounds must be a whole number >= 1"):
        R.interleave(contenders("a"), FakeTimer(), rounds=rounds)


def test_a_timer_that_changes_its_methods_is_refused():
    flip = itertools.cycle([{"median_us": 1.0}, {"back_to_back_us": 1.0}])
    with pytest.raises(ValueError, match="different methods across rounds"):
        R.interleave(contenders("a"), lambda fn: next(flip), rounds=2)


def test_the_rows_medians_are_over_rounds_and_the_rounds_are_kept():
    figures = {"x": [300.0, 100.0, 500.0, 200.0, 400.0]}
    out = R.interleave(contenders("x"), FakeTimer(figures), rounds=5)
    row = make_row(backend.get("emulated"), "decode", "c", {}, 1, "labkit_graph", None,
                   rounds=out["x"])
    report.validate_row(row)
    assert row["median_us"] == 300.0 and row["back_to_back_us"] == 150.0
    assert row["extra"]["rounds"]["median_us"] == figures["x"]
    assert row["extra"]["rounds"]["back_to_back_us"] == [v / 2 for v in figures["x"]]
    assert row["extra"]["host_us"] == 1.0 and "host_us" not in row["extra"]["rounds"]
    assert isinstance(row["run"], str)


# ---- the verdict rule -------------------------------------------------------------------

def test_four_of_five_rounds_won_is_faster():
    v = R.verdict("labkit", [1, 1, 1, 1, 9], "torch", [2, 2, 2, 2, 2])
    assert v.winner == "labkit" and v.wins == (4, 1)
    assert "labkit is faster than torch (in 4 of 5 rounds" in v.text()


def test_three_of_five_is_level_whatever_the_medians_say():
    v = R.verdict("labkit", [1, 1, 1, 9, 9], "torch", [2, 2, 2, 2, 2])
    assert v.winner is None and v.ratio == 0.5          # a median far ahead is not enough
    text = v.text()
    assert "level within the noise of this host" in text
    assert "labkit 1.0 µs (1.0 µs–9.0 µs)" in text and "torch 2.0 µs (2.0 µs–2.0 µs)" in text


def test_the_other_side_can_win_and_ties_count_for_no_one():
    v = R.verdict("a", [3, 3, 3, 3, 3], "b", [1, 1, 1, 1, 3], method="back_to_back_us")
    assert v.winner == "b" and v.wins == (0, 4) and v.text().startswith("back to back: b is")
    assert R.verdict("a", [1] * 5, "b", [1] * 5).winner is None


def test_rounds_are_paired_not_pooled():
    # a wins every round by a hair although its rounds spread over b's whole range
    a = [10.0, 20.0, 30.0, 40.0, 50.0]
    b = [x + 0.1 for x in a]
    random.Random(0).shuffle(order := list(range(5)))
    v = R.verdict("a", [a[i] for i in order], "b", [b[i] for i in order])
    assert v.winner == "a" and v.wins == (5, 0)


def test_rows_of_other_rounds_are_not_compared():
    with pytest.raises(ValueError, match="same rounds"):
        R.verdict("a", [1, 2, 3], "b", [1, 2])


# ---- verdicts among result rows -----------------------------------------------------------

def _row(variant, synced, b2b, bs=8, run="r1", busy=None):
    r = {"suite": "decode", "config_name": "gpt", "config": {}, "batch_size": bs,
         "variant": variant, "median_us": sorted(synced)[2],
         "back_to_back_us": sorted(b2b)[2], "device": "GPU", "torch": "0", "date": "d",
         "run": run, "extra": {"rounds": {"median_us": synced, "back_to_back_us": b2b}}}
    if busy is not None:
        r["gpu_busy_us"] = busy
    return r


def test_labkit_best_is_the_quickest_labkit_row_per_method():
    rows = [_row("labkit_graph", [5, 5, 5, 5, 5], [3, 3, 3, 3, 3]),
            _row("labkit_graph_compiled_staged", [4, 4, 4, 4, 4], [9, 9, 9, 9, 9]),
            _row("compile_reduce_overhead_static", [6, 6, 6, 6, 6], [2, 2, 2, 2, 2])]
    comps = [c for c in V.comparisons(rows)
             if c.verdict.b == "compile_reduce_overhead_static"]
    by_method = {c.verdict.method: c.verdict for c in comps}
    assert by_method["median_us"].a == "labkit_graph_compiled_staged"
    assert by_method["median_us"].winner == "labkit_graph_compiled_staged"
    assert by_method["back_to_back_us"].a == "labkit_graph"
    assert by_method["back_to_back_us"].winner == "compile_reduce_overhead_static"


def test_rows_of_different_runs_are_not_paired():
    rows = [_row("labkit_graph", [1] * 5, [1] * 5, run="r1"),
            _row("eager", [9] * 5, [9] * 5, run="r2")]
    assert V.comparisons(rows) == []
    rows[1]["run"] = "r1"
    assert [c.verdict.winner for c in V.comparisons(rows)] == ["labkit_graph"] * 2


def test_target_checks_say_met_or_missed_with_the_figures():
    rows = [_row("labkit_graph", [5, 5, 5, 5, 5], [9.5, 9.5, 9.5, 9.5, 9.5], busy=9.0),
            _row("compile_reduce_overhead_static", [6, 6, 6, 6, 6], [10, 10, 10, 10, 10])]
    lines = V.target_checks(rows)
    b2b = next(x for x in lines if "back to back: labkit_graph is" in x)
    assert b2b.startswith("MISSED") and "0.950×" in b2b and "target ≤ 0.90×" in b2b
    synced = next(x for x in lines if "synced" in x)
    assert synced.startswith("met") and "won 5 of 5 rounds" in synced
    busy = next(x for x in lines if "GPU busy" in x)
    assert busy.startswith("met") and "1.056×" in busy       # 3 decimals: 0.904 is no 0.90


def test_render_shows_ranges_verdicts_and_targets(tmp_path):
    rows = [_row("labkit_graph", [5, 4, 6, 5, 5], [3, 3, 3, 3, 3]),
            _row("compile_reduce_overhead_static", [6, 6, 6, 6, 6], [2, 2, 2, 2, 2])]
    path = tmp_path / "results.json"
    report.append_results(rows, path)
    report.render(path, tmp_path / "out")
    md = (tmp_path / "out" / "README.md").read_text()
    assert "| `labkit_graph` | 5.0 µs (4.0 µs–6.0 µs) | 3.0 µs (3.0 µs–3.0 µs) |" in md
    assert "Verdicts on GPU (5 interleaved rounds):" in md
    assert ("synced: labkit_graph is faster than compile_reduce_overhead_static (in 4 of 5 "
            "rounds; 0.83× its time at the median") in md      # round 3 is a tie: no one's
    assert ("back to back: compile_reduce_overhead_static is faster than labkit_graph (in 5 of "
            "5 rounds; 0.67× its time at the median") in md
    assert "MISSED: decode batch 8, back to back" in md
    assert "'rounds'" not in md and "rounds=" not in md      # not dumped into the notes


@pytest.mark.parametrize("bad", [{"median_us": []}, {"median_us": ["1"]},
                                 {"median_us": [1, 2], "back_to_back_us": [1]}, [1, 2]])
def test_malformed_rounds_are_refused(bad):
    r = _row("eager", [1] * 5, [1] * 5)
    r["extra"]["rounds"] = bad
    with pytest.raises(ValueError, match="extra.rounds"):
        report.validate_row(r)


def test_a_suite_interleaves_variants_and_batch_sizes(monkeypatch):
    """The decode suite on the emulator, its timer replaced: every (variant, batch size)
    timed once per round, the order shuffled, and the rows' rounds are the timer's."""
    from labkit.bench import decode

    calls, figure = [], itertools.count(1.0)

    def fake_round_timer(B, **kw):
        def time_one(fn):
            calls.append(fn)
            x = float(next(figure))
            return {"median_us": x, "back_to_back_us": x, "host_us": x}
        return time_one

    monkeypatch.setattr(decode, "round_timer", fake_round_timer)
    monkeypatch.setattr(decode, "profile_gpu_events", lambda fn, B: None)
    E = backend.get("emulated")
    rows = decode.run(E, quick=True, log=lambda *a: None, batch_sizes=(1, 2),
                      variants=("eager", "labkit_graph"), rounds=3)
    measured = [r for r in rows if r["median_us"] is not None]
    keys = {(r["variant"], r["batch_size"]) for r in measured}
    assert keys == {(v, bs) for v in ("eager", "labkit_graph", "labkit_graph_staged")
                    for bs in (1, 2)}
    per_round = len(keys)
    assert len(calls) == 3 * per_round
    rounds = [calls[i * per_round:(i + 1) * per_round] for i in range(3)]
    assert all(len(set(map(id, r))) == per_round for r in rounds)   # each once a round
    assert len({tuple(map(id, r)) for r in rounds}) > 1                # shuffled
    seen = sorted(v for r in measured for v in r["extra"]["rounds"]["median_us"])
    assert seen == [float(i) for i in range(1, 3 * per_round + 1)]      # every value kept


def test_the_short_line_a_lesson_prints():
    level = R.verdict("labkit_graph", [351.0, 400, 420, 510, 380],
                      "compile_reduce_overhead_static", [379.0, 390, 541, 500, 400])
    names = {"labkit_graph": "labkit", "compile_reduce_overhead_static": "reduce-overhead"}
    assert level.short(names) == ("labkit ≈ reduce-overhead: level, 3/5 rounds to labkit "
                                  "(351–510 µs vs 379–541 µs)")
    won = R.verdict("a", [2000.0] * 5, "b", [1000.0] * 5, method="back_to_back_us")
    assert won.short() == "b faster than a: 5/5 rounds, 0.50× its time"
    assert R.verdict("a", [14900.0, 19800], "b", [13600.0, 23900]).short().endswith(
        "(14.9–19.8 ms vs 13.6–23.9 ms)")


def test_quote_reads_the_pairs_a_lesson_names():
    rows = [_row("labkit_graph", [5, 5, 5, 5, 5], [3, 3, 3, 3, 3], bs=1),
            _row("compile_reduce_overhead_static", [6, 6, 6, 6, 6], [2, 2, 2, 2, 2], bs=1),
            _row("eager", [60, 60, 60, 60, 60], [50, 50, 50, 50, 50], bs=1)]
    for r in rows:
        r["device"] = "NVIDIA H200"
    lines = report.quote("decode", [("labkit_best", "compile_reduce_overhead_static")],
                    labels={"compile_reduce_overhead_static": "reduce-overhead"}, rows=rows)
    assert lines == [
        "batch 1   synced:       labkit_graph faster than reduce-overhead: 5/5 rounds, "
        "0.83× its time",
        "batch 1   back to back: reduce-overhead faster than labkit_graph: 5/5 rounds, "
        "0.67× its time"]
    assert report.quote("decode", [("labkit_graph", "eager")], rows=rows, device="other") == []


def test_a_lesson_prints_the_median_and_the_range_of_its_rounds():
    timer = FakeTimer({"graphed": [802.4, 853.2, 781.0, 790.0, 810.0]})
    out = R.interleave(contenders(["graphed"]), timer, rounds=5)
    assert R.median_range(out["graphed"]["median_us"]) == "802.4 µs (781.0 µs–853.2 µs)"
    assert R.median_range([1.5, 0.25, 0.3], "wall_s") == "0.30 s (0.25 s–1.50 s)"
    assert R.median_range([15057.3, 14210.0, 15310.9], "decode_tokens_per_s") == \
        "15057/s (14210/s–15311/s)"
    assert R.median_range([2400.0, 1200.0, 1300.0]) == "1.30 ms (1.20 ms–2.40 ms)"


@pytest.mark.parametrize("bad, err", [([], ValueError), (5.0, TypeError), ("12", TypeError)])
def test_median_range_needs_rounds(bad, err):
    with pytest.raises(err, match="median_range"):
        R.median_range(bad)


def test_a_rate_is_not_judged_as_a_time():
    # tokens/s: higher is faster; read as a time, the slower side would be called faster
    with pytest.raises(ValueError, match="lower is faster.*rate 'decode_tokens_per_s'"):
        R.verdict("graphed", [9.0] * 5, "eager", [3.0] * 5, method="decode_tokens_per_s")


class FakeServe:
    """What serve() returns, as far as serve_sample reads it."""

    def __init__(self, latencies, wall):
        self.decode_latency_s, self.wall_s = latencies, wall

    def summary(self):
        n = len(self.decode_latency_s)
        return {"decode_tokens_per_s": n / sum(self.decode_latency_s) if n else 0.0,
                "tokens_per_s": n / self.wall_s}


def test_serve_sample_times_a_whole_run_per_round():
    from labkit.bench.serve import serve_sample

    runs = {"synced": lambda: FakeServe([0.003, 0.001, 0.002], 1.0),
            "overlapped": lambda: FakeServe([0.001, 0.0005, 0.002], 2.0)}
    out = R.interleave(runs, serve_sample, rounds=5)
    assert out["synced"]["median_us"] == [2000.0] * 5
    assert out["overlapped"]["wall_s"] == [2.0] * 5
    step = R.verdict("overlapped", out["overlapped"]["median_us"], "synced",
                     out["synced"]["median_us"])
    whole = R.verdict("overlapped", out["overlapped"]["wall_s"], "synced",
                      out["synced"]["wall_s"], method="wall_s")
    assert step.winner == "overlapped" and whole.winner == "synced"
    with pytest.raises(ValueError, match="no step"):
        serve_sample(lambda: FakeServe([], 1.0))


def test_time_loops_prints_medians_ranges_and_the_last_loops_verdicts():
    from labkit.bench.serve import time_loops

    lines = []
    walls = iter([1.0, 2.0, 1.1, 2.1, 1.2, 1.9, 0.9, 2.2, 1.0, 2.0] * 2)
    runs = {"eager": lambda: FakeServe([0.004, 0.004, 0.004], next(walls)),
            "graphed": lambda: FakeServe([0.001, 0.001, 0.001], next(walls))}
    out = time_loops(runs, where="on a fake host", rounds=5, log=lines.append)
    assert set(out) == {"eager", "graphed"} and all(len(v["median_us"]) == 5
                                                    for v in out.values())
    assert lines[0] == "median (min–max) over 5 interleaved rounds, on a fake host"
    assert lines[1].startswith("decode step p50 eager 4.00 ms (4.00 ms–4.00 ms)")
    assert "graphed 1.0 µs" not in lines[1] and "graphed 1.00 ms" in lines[1]
    assert lines[4] == "verdicts (faster = ahead in at least 4 of 5 rounds):"
    assert lines[5].startswith("decode step:  graphed faster than eager: 5/5 rounds")
    # the whole run's walls alternate between the loops in a shuffled order: whatever it
    # says, it is a verdict line for the whole run of the last loop against the first
    assert lines[6].startswith("whole run:    ") and "graphed" in lines[6]
    with pytest.raises(ValueError, match="at least two"):
        time_loops({"eager": runs["eager"]}, where="x")


def test_a_lesson_may_quote_a_pair_outside_the_suites_list():
    rows = [_row("labkit_graph", [5, 5, 5, 5, 5], [3, 3, 3, 3, 3], bs=1),
            _row("reference_eager", [6, 4, 6, 4, 6], [50, 50, 50, 50, 50], bs=1),
            _row("eager", [60, 60, 60, 60, 60], [50, 50, 50, 50, 50], bs=1)]
    for r in rows:
        r["device"] = "NVIDIA H200"
    assert ("eager", "reference_eager") not in V.PAIRS["decode"]
    lines = report.quote("decode", [("eager", "reference_eager")], rows=rows)
    assert lines == [
        "batch 1   synced:       reference_eager faster than eager: 5/5 rounds, 0.10× its time",
        "batch 1   back to back: eager ≈ reference_eager: level, 0/5 rounds to eager "
        "(50–50 µs vs 50–50 µs)"]
    with pytest.raises(ValueError, match="pass suite= too"):
        V.comparisons(rows, pairs=[("eager", "reference_eager")])
