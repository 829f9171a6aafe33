"""The checker framework: right answers pass, wrong ones get a helpful message."""

from __future__ import annotations

import torch

from labkit.checks import CheckResult, check, compare_outputs
from labkit.checks.lesson00 import check_scale_and_shift


def _inputs(gen):
    return (torch.randn(3, 4, generator=gen),)


def _double(x):
    return x * 2


def test_accepts_a_right_answer(capsys):
    res = check(lambda x: x + x, _double, _inputs, trials=4, name="double")
    out = capsys.readouterr().out
    assert isinstance(res, CheckResult) and res and res.trials == 4
    assert out == "✅ double: passed 4 random trials\n"


def test_rejects_wrong_values_with_max_abs_diff_and_hint(capsys):
    res = check(lambda x: x * 3, _double, _inputs, name="double", hint="multiply by two")
    out = capsys.readouterr().out
    assert not res and res.kind == "mismatch" and res.failed_trial == 1
    assert out.startswith("❌ double: trial 1 of 3: values differ: max abs diff")
    assert "of 12 elements differ" in out
    assert "hint: multiply by two" in out
    assert "Traceback" not in out


def test_rejects_wrong_shape_dtype_and_type(capsys):
    assert "shape: expected (3, 4), got (4, 3)" in check(
        lambda x: (x * 2).t(), _double, _inputs, quiet=True).message
    assert "dtype: expected torch.float32, got torch.float64" in check(
        lambda x: (x * 2).double(), _double, _inputs, quiet=True).message
    res = check(lambda x: None, _double, _inputs, quiet=True)
    assert "expected a torch.Tensor, got None (did you forget `return`?)" in res.message
    assert capsys.readouterr().out == ""


def test_fails_on_a_later_trial_and_says_which():
    calls = []

    def flaky(x):
        calls.append(1)
        return x * 2 if len(calls) < 2 else x * 2 + 1

    res = check(flaky, _double, _inputs, quiet=True, name="double")
    assert not res and res.failed_trial == 2 and res.trials == 1
    assert "trial 2 of 3" in res.message


def test_turns_an_exception_into_a_message(capsys):
    def broken(x):
        y = x.view(5, 5)  # the line the report should show
        return y

    res = check(broken, _double, _inputs, name="double")
    out = capsys.readouterr().out
    assert not res and res.kind == "exception"
    assert out.startswith("❌ double: trial 1 of 3: your code raised RuntimeError:")
    assert "y = x.view(5, 5)" in out
    assert "(in broken)" in out
    assert "Traceback" not in out


def test_handles_not_implemented(capsys):
    def stub(x):
        # YOUR CODE HERE
        raise NotImplementedError()

    res = check(stub, _double, _inputs, name="double")
    out = capsys.readouterr().out
    assert not res and res.kind == "not_implemented"
    assert out == "❌ double: not done yet: fill in the cell marked YOUR CODE HERE\n"


def test_inputs_are_fresh_copies_and_seeded():
    seen = []

    def mutating(x):
        seen.append(x.clone())
        x.mul_(2)  # mutate the learner's copy: the reference must not see it
        return x

    assert check(mutating, _double, _inputs, quiet=True)
    # every trial has different data, and the same seed gives the same data again
    assert not torch.equal(seen[0], seen[1])
    seen2 = []
    check(lambda x: seen2.append(x.clone()) or x * 2, _double, _inputs, quiet=True)
    assert all(torch.equal(a, b) for a, b in zip(seen, seen2))


def test_not_a_function_and_custom_compare():
    assert "expected a function, got None" in check(None, _double, _inputs, quiet=True).message
    res = check(lambda x: x, _double, _inputs, quiet=True,
                compare=lambda e, a: None if e.shape == a.shape else "shape")
    assert res


def test_checker_errors_are_not_blamed_on_the_learner():
    def bad_inputs(gen):
        raise ValueError("oops")

    res = check(_double, _double, bad_inputs, quiet=True, name="double")
    assert not res and res.kind == "checker_error" and "not your fault" in res.message


def test_compare_outputs_nested():
    t = torch.ones(2)
    assert compare_outputs((t, {"a": 1.0}), (t.clone(), {"a": 1.0})) is None
    assert "length: expected 2, got 1" in compare_outputs((t, t), (t,))
    assert "[1] ['a'] value" in compare_outputs((t, {"a": 1.0}), (t, {"a": 2.0}))


def test_lesson00_scale_and_shift(capsys):
    assert check_scale_and_shift(lambda x, a, b: a * x + b, device="cpu")
    assert capsys.readouterr().out == "✅ scale_and_shift: passed 3 random trials\n"
    wrong = check_scale_and_shift(lambda x, a, b: b * x + a, device="cpu")
    assert not wrong and "values differ" in wrong.message and "hint:" in wrong.message
    listy = check_scale_and_shift(lambda x, a, b: (a * x + b).tolist(), device="cpu")
    assert "expected a torch.Tensor, got a list" in listy.message


# --- hints in steps and the time budget -------------------------------------------------

from labkit import checks as _checks  # noqa: E402


def _hint(capsys) -> str:
    """What one ``hint()`` call printed (it returns None: a cell shows the hint once)."""
    capsys.readouterr()
    assert _checks.hint() is None
    return capsys.readouterr().out.rstrip("\n")


def test_hints_come_one_step_at_a_time(capsys):
    res = check(lambda x: x * 3, _double, _inputs, name="double", hint="look at the factor",
                more_hints=["it is a multiplication", "multiply by two"], quiet=True)
    assert not res and res.more_hints == ["it is a multiplication", "multiply by two"]
    assert "labkit.checks.hint()" in res.message
    assert "multiply by two" not in res.message  # the answer is never the first hint
    assert _hint(capsys) == "hint 1 of 2 for double: it is a multiplication"
    assert _hint(capsys) == "hint 2 of 2 for double: multiply by two"
    assert _hint(capsys).startswith("No more hints for double")


def test_hint_prints_once_and_returns_nothing(capsys):
    # a notebook shows a cell's last value: hint() returning its text showed it twice
    check(lambda x: x * 3, _double, _inputs, name="double", more_hints=["a"], quiet=True)
    capsys.readouterr()
    assert _checks.hint() is None
    assert capsys.readouterr().out == "hint 1 of 1 for double: a\n"


def test_a_failure_without_hints_does_not_say_no_more_hints(capsys):
    check(lambda x: x * 3, _double, _inputs, name="double", quiet=True)
    out = _hint(capsys)
    assert "No more hints" not in out
    assert out.startswith("No further hint for this failure of double: its message says")


def test_a_reason_brings_the_hints_of_its_mistake(capsys):
    def compare(e, a):
        return None if torch.equal(e, a) else _checks.Reason("wrong", ["about this mistake"])

    res = check(lambda x: x * 3, _double, _inputs, name="double", compare=compare,
                more_hints=["general"], quiet=True)
    assert not res and res.more_hints == ["about this mistake"]
    assert _hint(capsys) == "hint 1 of 1 for double: about this mistake"


def test_a_pass_does_not_reset_the_hints_of_the_last_failure(capsys):
    check(lambda x: x * 3, _double, _inputs, name="double", more_hints=["a", "b"], quiet=True)
    check(lambda x: x * 2, _double, _inputs, name="double", quiet=True)
    assert _hint(capsys) == "hint 1 of 2 for double: a"


def test_fail_and_passed_build_printed_results(capsys):
    bad = _checks.fail("thing", "the tail is not cleared", more_hints=["look at rows past raw_bs"])
    good = _checks.passed("thing", "passed 3 random trials")
    out = capsys.readouterr().out
    assert not bad and bad.kind == "mismatch" and good
    assert out.startswith("❌ thing: the tail is not cleared")
    assert "✅ thing: passed 3 random trials" in out


def test_an_endless_loop_gets_a_verdict_not_a_hang():
    def endless(x):
        while True:
            x = x + 1

    import time as _time
    t0 = _time.monotonic()
    res = check(endless, _double, _inputs, name="double", quiet=True, time_limit=0.3)
    assert _time.monotonic() - t0 < 5
    assert not res and res.kind == "timeout"
    assert "did not finish within 0.3 s" in res.message and "loop" in res.message


def test_time_budget_also_holds_off_the_main_thread():
    import threading

    def endless():
        n = 0
        while True:
            n += 1

    box = {}

    def worker():
        try:
            _checks.call_learner(endless, time_limit=0.3)
        except _checks.LearnerTimeout as exc:
            box["exc"] = exc

    t = threading.Thread(target=worker)
    t.start()
    t.join(10)
    assert not t.is_alive() and "did not finish within 0.3 s" in str(box["exc"])


def test_call_learner_restores_the_alarm_handler():
    import signal
    before = signal.getsignal(signal.SIGALRM)
    assert _checks.call_learner(lambda: 3, time_limit=1.0) == 3
    assert signal.getsignal(signal.SIGALRM) is before
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)


def test_a_library_catch_all_does_not_swallow_the_timeout():
    def library_op():
        try:
            _time.sleep(0.01)
        except Exception:   # torch has catch-alls like this around dispatch and meta code
            pass

    def endless():
        while True:
            library_op()

    import time as _time
    t0 = _time.monotonic()
    try:
        _checks.call_learner(endless, time_limit=0.3)
    except _checks.LearnerTimeout:
        pass
    else:
        raise AssertionError("no timeout")
    assert _time.monotonic() - t0 < 5


def test_learner_raised_names_the_three_outcomes(capsys):
    from labkit.checks import LearnerTimeout, learner_raised

    stub = learner_raised("ex", NotImplementedError(), "trial 1: your code raised",
                          more_hints=["h"], quiet=True)
    assert stub.kind == "not_implemented" and "not done yet" in stub.message
    late = learner_raised("ex", LearnerTimeout(5.0), "unused", quiet=True)
    assert late.kind == "timeout" and "did not finish within 5 s" in late.message
    bug = learner_raised("ex", KeyError("buckets"), "trial 2: your code raised",
                         describe=lambda e: f"{type(e).__name__} {e}", quiet=True)
    assert bug.kind == "exception" and "trial 2: your code raised KeyError 'buckets'" in bug.message
    assert not (stub.passed or late.passed or bug.passed)
