"""Lesson 07, exercise ``update_found_inf``: its checker.

``update_found_inf(found_inf, loss)``: set the flag when ``loss`` is inf, -inf or NaN,
with tensor ops only, accumulating over the microbatches of a step. Checked by
capturing it on labkit's emulator (a host read is refused there exactly as on a GPU)
and replaying with finite and non-finite losses; a wrong answer is then probed with
single values (NaN alone, inf alone, a bad loss followed by a good one) to name the
mistake actually made.
"""

from __future__ import annotations

import torch

from labkit.checks import CheckResult, Exercise, attempt, describe_exception, extra_probe
from labkit.core.errors import in_library

__all__ = ["check_update_found_inf"]


def _trim_traceback(exc: BaseException) -> BaseException:
    """Cut the traceback after the learner's last frame, so the report points at the
    learner's line, not at the emulator code that refused the op."""
    keep, tb = None, exc.__traceback__
    while tb is not None:
        if not in_library(tb.tb_frame.f_code.co_filename):
            keep = tb
        tb = tb.tb_next
    if keep is not None:
        keep.tb_next = None
    return exc


def _reference_update_found_inf(found_inf, loss):
    found_inf.logical_or_(~torch.isfinite(loss))


def _raised(exc: BaseException) -> str:
    return f"your code raised {describe_exception(_trim_traceback(exc))}"


def _record(update, flag: torch.Tensor, losses: list) -> None:
    """What the graph records: the flag cleared, then one update per microbatch."""
    flag.zero_()
    for loss in losses:
        update(flag, loss)


def _captured_flag(update, values_per_replay: list[list[float]]) -> list[bool]:
    """Capture ``flag.zero_(); update(flag, loss_k) for each k`` on the emulator, replay it
    once per entry of ``values_per_replay`` and return the flag after each replay.

    A capture that raises (a host read, a Python ``if`` on a tensor) is cleaned up with
    :func:`labkit.backend.recover` and rejects the trial with the learner's line."""
    from labkit import backend

    E = backend.get("emulated")
    m = len(values_per_replay[0])
    # on the emulator's device: a capture records device ops only (host tensors are
    # updated once, at capture, as on a GPU)
    losses = [torch.zeros((), device=E.device) for _ in range(m)]
    flag = torch.zeros((), dtype=torch.bool, device=E.device)
    g = E.CUDAGraph()
    E.set_stream(E.default_stream())
    with E.stream(E.Stream()):
        g.capture_begin()
        # the learner's own error, not capture_end's: the capture is ended and the
        # emulator recovered (default stream back, RNG out of capture mode) first
        attempt(_record, (update, flag, losses), B=E,
                on_error=lambda: extra_probe(g.capture_end), reason=_raised)
        g.capture_end()
    seen = []
    for vals in values_per_replay:
        for loss, v in zip(losses, vals):
            loss.fill_(v)
        g.replay()
        seen.append(bool(flag))
    return seen


def _diagnose_found_inf(update) -> str:
    """Probe single cases to name the mistake: NaN alone, +inf, -inf, finite, a bad
    microbatch followed by a good one."""
    nan, inf = float("nan"), float("inf")
    one = extra_probe(_captured_flag, (update, [[1.0], [nan], [inf], [-inf], [2.0]]))
    two = extra_probe(_captured_flag, (update, [[nan, 1.0], [1.0, 1.0]])) \
        if one is not None else None
    if one is None or two is None:
        return "found_inf is wrong for some replays"
    finite, f_nan, f_inf, f_ninf, finite2 = one
    if not any(one) and not any(two):
        return ("found_inf never became True, even for a NaN/inf loss. Update it in place: "
                "`found_inf = ...` (or `found_inf | x`) makes a new tensor at capture, and "
                "the graph keeps writing the old one")
    if finite or finite2 or two[1]:
        return ("found_inf is True for an all-finite step: it must become True only when a "
                "loss is inf, -inf or NaN")
    if f_nan and not f_inf and not f_ninf:
        return ("losses of inf and -inf are not flagged: your test catches NaN only "
                "(torch.isnan, or loss != loss). An overflowed loss is inf, and it must skip "
                "the step too")
    if f_nan and f_inf != f_ninf:
        missed, caught = ("-inf", "inf") if f_inf else ("inf", "-inf")
        return (f"a loss of {missed} is not flagged: your test catches NaN and {caught} but "
                f"not {missed} (a comparison with one infinity, such as loss == "
                f"float('{caught}')?). A loss can overflow to either sign; "
                "torch.isfinite(loss) is False for inf, -inf and NaN alike")
    if (f_inf or f_ninf) and not f_nan:
        return ("a NaN loss is not flagged: your test catches inf only (torch.isinf, or a "
                "comparison: every comparison with NaN is False)")
    if f_inf != f_ninf:
        return ("inf and -inf are not treated alike: "
                + ("-inf" if f_inf else "inf") + " is not flagged (a one-sided comparison?)")
    if not two[0]:
        return ("found_inf missed a bad microbatch that was followed by a good one: your "
                "update overwrites the flag with the latest loss's verdict. Combine the "
                "flag with the new verdict instead, so that True stays True until the next "
                "step's zero_()")
    return "found_inf is wrong for some replays"


EXERCISE = Exercise(
    "update_found_inf",
    hint="compare with section 6.2: no `if`, .item() or bool() on a tensor inside the "
         "captured step; in-place tensor ops only",
    more_hints=("Which values must set the flag? torch has one test that is False for "
                "inf, -inf and NaN alike. And the flag must remember earlier microbatches.",
                "A bool tensor has an in-place logical or: found_inf.logical_or_(...), "
                "of ~torch.isfinite(loss) (it also works on exercise 4's float flag, "
                "where |= fails)"),
)


def _make_inputs(gen: torch.Generator):
    m = int(torch.randint(2, 5, (), generator=gen))
    bad = [float("nan"), float("inf"), float("-inf")]
    replays = [(torch.rand(m, generator=gen) * 5).tolist() for _ in range(5)]
    k = int(torch.randint(0, 3, (), generator=gen))
    replays[1][int(torch.randint(0, m - 1, (), generator=gen))] = bad[k]   # not last
    replays[3][m - 1] = bad[(k + 1) % 3]                                  # last
    replays[4][0] = bad[(k + 2) % 3]
    return (replays,)


def _observe(update):
    def run(replays):
        return _captured_flag(update, replays)
    return run


def check_update_found_inf(fn, *, trials: int = 3) -> CheckResult:
    """``fn(found_inf, loss)`` must set the bool scalar ``found_inf`` (in place) when
    ``loss`` is inf, -inf or NaN and leave it as it was otherwise, without reading any
    value on the host. Captured on labkit's emulator, once per microbatch, then replayed;
    the process stays usable after a learner's host read."""

    def the_flags(expected, actual) -> str | None:
        if expected == actual:
            return None
        return (f"{_diagnose_found_inf(fn)} (over 5 replays: expected {expected}, got "
                f"{actual})")

    return EXERCISE.check(_observe(fn), _observe(_reference_update_found_inf), _make_inputs,
                          trials=trials, judges=(the_flags,))
