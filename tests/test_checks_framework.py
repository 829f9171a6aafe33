"""The checkers' framework (issue #31): attempt, reject, run_check, Exercise, check's judges."""

from __future__ import annotations

import pytest
import torch

from labkit import checks
from labkit.checks import NOT_DONE, Exercise, Reason, Rejected, attempt, reject, run_check


def _stub(*args):
    raise NotImplementedError


def _boom(x):
    raise ValueError(f"bad {x}")


def test_attempt_returns_the_learners_value():
    assert attempt(lambda a, b=0: a + b, (2,), {"b": 3}) == 5


def test_attempt_turns_the_stub_into_not_done():
    with pytest.raises(Rejected) as info:
        attempt(_stub, (1,))
    assert info.value.kind == "not_implemented" and info.value.reason == NOT_DONE


def test_attempt_reports_an_exception_with_the_learners_line():
    with pytest.raises(Rejected) as info:
        attempt(_boom, (7,))
    r = info.value
    assert r.kind == "exception" and r.reason.startswith("your code raised ValueError: bad 7")
    assert "(in _boom)" in r.reason and isinstance(r.details["exception"], ValueError)


def test_attempt_a_stub_that_is_not_the_exercise_is_an_error():
    with pytest.raises(Rejected) as info:
        attempt(_stub, not_done=False, reason=lambda e: f"probe failed: {type(e).__name__}")
    r = info.value
    assert r.kind == "exception" and r.reason == "probe failed: NotImplementedError"


def test_attempt_a_timeout_says_how_long():
    def endless():
        while True:
            pass

    with pytest.raises(Rejected) as info:
        attempt(endless, time_limit=0.2)
    assert info.value.kind == "timeout" and "did not finish within 0.2 s" in info.value.reason


def test_attempt_lets_a_rejection_from_inside_through():
    def judged():
        reject("wrong shape", hints=["look at the shape"])

    with pytest.raises(Rejected) as info:
        attempt(judged)
    assert info.value.kind == "mismatch" and info.value.hints == ["look at the shape"]


def test_run_check_passes_and_fails_with_the_exercises_hints(capsys):
    ex = Exercise("thing", more_hints=("general", "specific"))
    assert ex.run(lambda: "all good")
    res = ex.run(lambda: reject("it is off by one"))
    assert not res and res.kind == "mismatch" and res.more_hints == ["general", "specific"]
    assert res.message.startswith("❌ thing: it is off by one")
    out = capsys.readouterr().out
    assert "✅ thing: all good" in out and "❌ thing: it is off by one" in out


def test_run_check_a_reason_brings_its_own_hints_and_a_timeout_none():
    res = run_check("thing", lambda: reject(Reason("wrong", ["about this"])),
                    more_hints=["general"], quiet=True)
    assert res.more_hints == ["about this"]
    slow = run_check("thing", lambda: (_ for _ in ()).throw(Rejected("slow", kind="timeout")),
                     more_hints=["general"], quiet=True)
    assert slow.kind == "timeout" and slow.more_hints == []


def test_run_check_the_stub_is_not_done():
    res = run_check("thing", lambda: attempt(_stub), quiet=True)
    assert res.kind == "not_implemented" and res.message == f"❌ thing: {NOT_DONE}"


def test_check_runs_the_judges_in_order_first_reason_wins():
    calls = []

    def first(e, a):
        calls.append("first")
        return None

    def second(e, a):
        calls.append("second")
        return "second saw it"

    def third(e, a):  # never reached
        calls.append("third")
        return "third"

    res = checks.check(lambda x: x, lambda x: x, lambda g: torch.randn(2, generator=g),
                       judges=(first, second, third), name="judged", quiet=True)
    assert not res and "trial 1 of 3: second saw it" in res.message
    assert calls == ["first", "second"]


def test_check_a_reject_on_the_learners_side_is_a_mismatch_of_that_trial():
    def learner(x):
        if x.sum() > -100:
            reject("the learner's object is wrong")
        return x

    res = Exercise("judged", hint="look here").check(
        learner, lambda x: x, lambda g: torch.randn(2, generator=g), quiet=True)
    assert res.kind == "mismatch" and res.failed_trial == 1
    assert res.message == ("❌ judged: trial 1 of 3: the learner's object is wrong"
                           "\n   hint: look here")


def test_attempt_explain_names_a_known_mistake_and_leaves_the_stub_alone():
    def explain(exc):
        return "you used cuda" if "CUDA" in str(exc) else None

    def cuda(*args):
        raise RuntimeError("Torch not compiled with CUDA enabled")

    with pytest.raises(Rejected) as info:
        attempt(cuda, explain=explain)
    assert info.value.kind == "mismatch" and info.value.reason == "you used cuda"
    with pytest.raises(Rejected) as info:
        attempt(_stub, explain=explain)
    assert info.value.kind == "not_implemented"


def test_attempt_on_error_runs_after_any_failure_and_not_after_success():
    ended = []
    attempt(lambda: 1, on_error=lambda: ended.append("end"))
    assert ended == []
    with pytest.raises(Rejected):
        attempt(_boom, (1,), on_error=lambda: ended.append("end"))
    with pytest.raises(KeyboardInterrupt):
        attempt(lambda: (_ for _ in ()).throw(KeyboardInterrupt()),
                on_error=lambda: ended.append("end"))
    assert ended == ["end", "end"]


def test_extra_probe_gives_the_default_but_not_a_timeout():
    assert checks.extra_probe(_boom, (1,), default="nothing") == "nothing"
    assert checks.extra_probe(lambda: 3) == 3

    def slow():
        raise checks.LearnerTimeout(1.0, "slow")

    with pytest.raises(checks.LearnerTimeout):
        checks.extra_probe(slow)


def test_recovering_recovers_the_backend_and_lets_the_error_go_on():
    from labkit import backend

    E = backend.get("emulated")
    g = E.CUDAGraph()

    def host_read():
        with checks.recovering(E), E.graph(g):
            x = torch.ones(2, device=E.device)
            if x.sum() > 0:  # a host read inside a capture: refused
                pass

    with pytest.raises(Rejected) as info:
        attempt(host_read)
    assert info.value.kind == "exception"
    assert E.current_stream() == E.default_stream()
    y = torch.randn(3, device=E.device)  # the RNG is out of capture mode again
    assert y.shape == (3,)


def test_run_trials_names_the_trial_and_seeds_each_one():
    seen = []

    def one_trial(trial, gen):
        seen.append((trial, gen.initial_seed()))
        if trial == 2:
            reject(Reason("wrong in trial 2", ["look at trial 2"]))

    res = checks.run_trials("thing", 3, one_trial, seed=lambda t: 10 * t, quiet=True)
    assert seen == [(1, 10), (2, 20)]
    assert res.message.startswith("❌ thing: trial 2 of 3: wrong in trial 2")
    assert res.failed_trial == 2 and res.trials == 1 and res.more_hints == ["look at trial 2"]
    ok = checks.run_trials("thing", 2, lambda t, g: None, quiet=True)
    assert ok and ok.message == "✅ thing: passed 2 random trials"


def test_run_trials_a_stub_predicate_tells_the_blank_from_torchs_own():
    def torch_own(trial, gen):
        raise NotImplementedError("aten::foo is not implemented for 'meta'")

    bare = lambda e: not str(e)  # noqa: E731
    res = checks.run_trials("thing", 1, torch_own, stub=bare, quiet=True)
    assert res.kind == "exception" and "NotImplementedError: aten::foo" in res.message
    res = checks.run_trials("thing", 1, lambda t, g: _stub(), stub=bare, quiet=True)
    assert res.kind == "not_implemented" and res.message == f"❌ thing: {NOT_DONE}"


def test_attempt_passthrough_leaves_an_error_to_the_attempt_further_out():
    def inner():
        attempt(_stub, not_done=False, passthrough=(NotImplementedError,),
                reason=lambda e: "inner saw it")

    with pytest.raises(Rejected) as info:
        attempt(inner)
    assert info.value.kind == "not_implemented"


def test_attempt_label_starts_a_timeouts_and_an_errors_reason_not_not_done():
    with pytest.raises(Rejected) as info:
        attempt(_boom, (3,), label="case 2")
    assert info.value.reason.startswith("case 2: your code raised ValueError: bad 3")
    with pytest.raises(Rejected) as info:
        attempt(_stub, label="case 2")
    assert info.value.reason == NOT_DONE
    with pytest.raises(Rejected) as info:
        attempt(_boom, (3,), label="case 2", label_errors=False,
                reason=lambda e: "case 2 (x=3): it raised")
    assert info.value.reason == "case 2 (x=3): it raised"


def test_attempt_hints_may_be_chosen_from_the_report():
    with pytest.raises(Rejected) as info:
        attempt(_boom, (3,), label="step 5", hints=lambda text: [f"about: {text[:6]}"])
    assert info.value.hints == ["about: step 5"]
    res = run_check("thing", lambda: attempt(_boom, (3,), hints=["h1", "h2"]), quiet=True)
    assert res.kind == "exception" and res.more_hints == ["h1", "h2"]


def test_outcome_takes_a_raise_as_an_answer_but_not_the_stub():
    assert checks.outcome(lambda x: x + 1, (1,)) == ("value", 2)
    kind, exc = checks.outcome(_boom, (4,))
    assert kind == "raised" and isinstance(exc, ValueError)
    with pytest.raises(Rejected) as info:
        checks.outcome(_stub, (1,))
    assert info.value.kind == "not_implemented"


def test_reject_fields_reach_run_checks_result():
    res = run_check("thing", lambda: reject("wrong", trials=2, failed_trial=3,
                                            details={"seen": 1}), quiet=True)
    assert res.trials == 2 and res.failed_trial == 3 and res.details == {"seen": 1}


def test_shown_prints_one_line_for_a_rejection_and_returns_none(capsys):
    assert checks.shown(lambda: 7, name="f", label="show(f)") == 7
    assert checks.shown(lambda: attempt(_stub), name="f", label="show(f)") is None
    assert checks.shown(lambda: attempt(_boom, (2,)), name="f", label="show(f)") is None
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"❌ f: {NOT_DONE}"
    assert out[1].startswith("❌ show(f): your code raised ValueError: bad 2")
