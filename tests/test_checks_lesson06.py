"""Lesson 06 checkers: each accepts right answers and rejects real learner mistakes with a
message that names the mistake actually made (and never starts with the answer)."""

from __future__ import annotations

import bisect
from bisect import bisect_left as imported_bisect_left

import pytest
import torch

from labkit import checks
from labkit.checks.lesson06 import (
    budget_scenario,
    check_fill_slot,
    check_fixed_config,
    check_pad_to_bucket,
    check_sglang_buckets,
)
from labkit.decode import BatchTooLargeError, Pad, default_buckets, explore_buckets, pad_to_bucket


def _rejects(res, *words):
    assert not res, res.message
    for w in words:
        assert w in res.message, f"{w!r} not in:\n{res.message}"


# ---- sglang_buckets ------------------------------------------------------------------------


def _sglang_raw(max_bs):
    return ([1, 2, 4, 8, 12] + list(range(16, 257, 8)) + list(range(272, 512, 16))
            + list(range(512, max_bs + 1, 32)))


def _sglang_right(max_bs):
    return sorted({b for b in _sglang_raw(max_bs) if b <= max_bs} | {max_bs})


def _sglang_below_then_max(max_bs):
    """A tester's correct answer: every listed size below max_bs, then max_bs."""
    listed = ([1, 2, 4, 8, 12] + list(range(16, 257, 8)) + list(range(272, 512, 16))
              + list(range(512, max_bs + 1, 32)))
    return [b for b in listed if b < max_bs] + [max_bs]


def _pad_bisect_left_named_message(raw_bs, buckets):
    """A tester's correct answer: bisect_left, a message naming both numbers."""
    pos = bisect.bisect_left(buckets, raw_bs)
    if pos < len(buckets):
        return buckets[pos]
    raise BatchTooLargeError(f"{raw_bs} requests do not fit: the largest captured batch is "
                             f"{buckets[-1]}")


def test_testers_right_answers_pass():
    assert check_sglang_buckets(_sglang_below_then_max)
    assert check_pad_to_bucket(_pad_bisect_left_named_message)


def test_sglang_buckets_accepts_right_answers(capsys):
    assert check_sglang_buckets(default_buckets)
    assert check_sglang_buckets(_sglang_right)
    assert check_sglang_buckets(lambda m: tuple(_sglang_right(m)))  # any sequence of ints
    assert capsys.readouterr().out.count("✅ sglang_buckets: passed 7 random trials") == 3


SGLANG_WRONG = {
    # name: (answer, words the message must contain)
    "max_bs missing": (lambda m: sorted({b for b in _sglang_raw(m) if b <= m}),
                       ["max_bs=30 itself is missing"]),
    "not clipped": (lambda m: sorted(set(_sglang_raw(m)) | {m}), ["exceed max_bs=30"]),
    "duplicates": (lambda m: sorted([b for b in _sglang_raw(m) if b <= m] + [m]),
                   ["appear twice"]),
    "range(16, 256, 8) forgets 256": (
        lambda m: sorted({b for b in [1, 2, 4, 8, 12] + list(range(16, 256, 8))
                          + list(range(272, 512, 16)) + list(range(512, m + 1, 32))
                          if b <= m} | {m}), ["Missing [256]", "range's stop is exclusive"]),
    "no return": (lambda m: None, ["did you forget `return`"]),
    "a set": (lambda m: {b for b in _sglang_raw(m) if b <= m} | {m}, ["got a set"]),
    "max_bs appended unsorted": (lambda m: [b for b in _sglang_raw(m) if b < m] + [m]
                                 if m % 8 else sorted({b for b in _sglang_raw(m) if b <= m}
                                                      | {m})[::-1],
                                 ["not in ascending order"]),
    "powers of two": (lambda m: sorted({1 << i for i in range(12) if 1 << i <= m} | {m}),
                      ["Missing"]),
}


@pytest.mark.parametrize("case", sorted(SGLANG_WRONG))
def test_sglang_buckets_rejects(case):
    answer, words = SGLANG_WRONG[case]
    _rejects(check_sglang_buckets(answer), *words)


def test_sglang_buckets_first_message_is_not_the_answer(capsys):
    res = check_sglang_buckets(lambda m: sorted({b for b in _sglang_raw(m) if b <= m}))
    assert "range(272" not in res.message and res.more_hints
    assert "labkit.checks.hint()" in res.message
    assert "range(272, 512, 16)" in res.more_hints[-1]   # the answer comes last
    checks.hint()
    assert "hint 1 of 3" in capsys.readouterr().out


# ---- pad_to_bucket --------------------------------------------------------------------------


def _pad_right(raw_bs, buckets):
    i = bisect.bisect_left(buckets, raw_bs)
    if i == len(buckets):
        raise BatchTooLargeError(f"batch of {raw_bs} > largest bucket {buckets[-1]}")
    return buckets[i]


def _pad_imported(raw_bs, buckets):
    i = imported_bisect_left(buckets, raw_bs)  # from bisect import bisect_left
    if i == len(buckets):
        raise ValueError(f"{raw_bs} requests, but the largest graph is {buckets[-1]}")
    return buckets[i]


def _pad_bisect_minus_one(raw_bs, buckets):
    i = bisect.bisect(buckets, raw_bs - 1)   # bisect_right of raw-1 == bisect_left of raw
    if i == len(buckets):
        raise BatchTooLargeError(f"batch {raw_bs} too large for largest bucket {buckets[-1]}")
    return buckets[i]


def _pad_max_check_first(raw_bs, buckets):
    if raw_bs > buckets[-1]:
        raise BatchTooLargeError(f"{raw_bs} > {max(buckets)}")
    return buckets[bisect.bisect_left(buckets, raw_bs)]


def test_pad_to_bucket_accepts_right_answers(capsys):
    for answer in (_pad_right, _pad_imported, _pad_bisect_minus_one, _pad_max_check_first):
        assert check_pad_to_bucket(answer), answer.__name__
    assert capsys.readouterr().out.count("✅ pad_to_bucket: passed 6 random trials") == 4


def _pad_labkits_own(raw_bs, buckets):       # the answer key, called by name
    return pad_to_bucket(raw_bs, buckets)


def _pad_labkits_own_by_module(raw_bs, buckets):
    import labkit.decode

    return labkit.decode.pad_to_bucket(raw_bs, buckets)


@pytest.mark.parametrize("answer", [pad_to_bucket, _pad_labkits_own,
                                    _pad_labkits_own_by_module])
def test_pad_to_bucket_refuses_labkits_own_function(answer):
    res = check_pad_to_bucket(answer)
    _rejects(res, "labkit.decode.pad_to_bucket", "write the search yourself")
    import labkit.decode

    assert labkit.decode.pad_to_bucket is pad_to_bucket       # put back after the check


def _min_generator(raw_bs, buckets):          # the first escapee
    return min(b for b in buckets if b >= raw_bs)


def _oops(raw_bs, buckets):                   # the second escapee
    i = bisect.bisect_left(buckets, raw_bs)
    if i == len(buckets):
        raise ValueError("oops")
    return buckets[i]


def _always_largest(raw_bs, buckets):         # told "bisect_right" before
    if raw_bs > buckets[-1]:
        raise BatchTooLargeError(f"batch of {raw_bs} > largest bucket {buckets[-1]}")
    return buckets[-1]


def _bisect_right(raw_bs, buckets):
    i = bisect.bisect_right(buckets, raw_bs)
    if i == len(buckets):
        raise BatchTooLargeError(f"batch of {raw_bs} > largest bucket {buckets[-1]}")
    return buckets[i]


def _bisect_right_clamped(raw_bs, buckets):
    return buckets[min(bisect.bisect_right(buckets, raw_bs), len(buckets) - 1)]


def _index_error(raw_bs, buckets):
    return buckets[bisect.bisect_left(buckets, raw_bs)]


def _clamp_silently(raw_bs, buckets):
    return buckets[min(bisect.bisect_left(buckets, raw_bs), len(buckets) - 1)]


def _for_loop(raw_bs, buckets):
    for b in buckets:
        if b >= raw_bs:
            return b
    raise BatchTooLargeError(f"batch of {raw_bs} > largest bucket {buckets[-1]}")


def _index_loop(raw_bs, buckets):
    for i in range(len(buckets)):
        if buckets[i] >= raw_bs:
            return buckets[i]
    raise BatchTooLargeError(f"batch of {raw_bs} > largest bucket {buckets[-1]}")


def _one_below(raw_bs, buckets):
    i = bisect.bisect_left(buckets, raw_bs)
    if i == len(buckets):
        raise BatchTooLargeError(f"batch of {raw_bs} > largest bucket {buckets[-1]}")
    return buckets[max(i - 1, 0)]


def _returns_index(raw_bs, buckets):
    i = bisect.bisect_left(buckets, raw_bs)
    if i == len(buckets):
        raise BatchTooLargeError(f"batch of {raw_bs} > largest bucket {buckets[-1]}")
    return i


def _insort(raw_bs, buckets):
    bisect.insort(buckets, raw_bs)
    i = buckets.index(raw_bs)
    if i == len(buckets) - 1 and raw_bs not in buckets[:-1]:
        raise BatchTooLargeError(f"batch of {raw_bs} > largest bucket {buckets[-2]}")
    return buckets[i + 1] if buckets[i + 1:i + 2] and buckets[i] == raw_bs else buckets[i]


def _runtime_error(raw_bs, buckets):
    i = bisect.bisect_left(buckets, raw_bs)
    if i == len(buckets):
        raise RuntimeError(f"batch of {raw_bs} > largest bucket {buckets[-1]}")
    return buckets[i]


def _message_without_numbers(raw_bs, buckets):
    i = bisect.bisect_left(buckets, raw_bs)
    if i == len(buckets):
        raise BatchTooLargeError("batch too large")
    return buckets[i]


def _raises_at_top(raw_bs, buckets):           # '>=' where '>' belongs in a pre-check
    if raw_bs >= buckets[-1]:
        raise BatchTooLargeError(f"batch of {raw_bs} > largest bucket {buckets[-1]}")
    return buckets[bisect.bisect_left(buckets, raw_bs)]


PAD_WRONG = {
    "min() over a generator": (_min_generator, ["min()/max() over an empty generator",
                                                "asks for bisect"]),
    "ValueError('oops')": (_oops, ["ValueError('oops')", "must name the batch size"]),
    "always the largest bucket": (_always_largest, ["the largest bucket", "smallest one that "
                                                    "holds the batch"]),
    "bisect_right": (_bisect_right, ["fits the bucket 1 exactly", "bisect_right"]),
    "bisect_right, clamped": (_bisect_right_clamped, ["bisect_right"]),
    "bare IndexError": (_index_error, ["IndexError", "one past the end", "BatchTooLargeError"]),
    "silent clamp": (_clamp_silently, ["returned 16", "silently drop requests"]),
    "for loop": (_for_loop, ["answers are right", "walked the whole list", "bisect module"]),
    "index loop": (_index_loop, ["answers are right", "entry by entry", "bisect module"]),
    "one bucket too small": (_one_below, ["smaller than the batch", "which index"]),
    "returns the index": (_returns_index, ["position of the bucket", "not the bucket itself"]),
    "insort mutates the list": (_insort, ["changed the list", "read it only"]),
    "RuntimeError": (_runtime_error, ["RuntimeError", "wrong type", "BatchTooLargeError"]),
    "message without numbers": (_message_without_numbers, ["batch too large",
                                                            "must name the batch size"]),
    "raises for the largest bucket": (_raises_at_top, ["raised BatchTooLargeError",
                                                       "but 16 fits the bucket 16"]),
    "no return": (lambda r, b: None, ["did you forget `return`"]),
}


@pytest.mark.parametrize("case", sorted(PAD_WRONG))
def test_pad_to_bucket_rejects(case):
    answer, words = PAD_WRONG[case]
    _rejects(check_pad_to_bucket(answer, quiet=True), *words)


def test_pad_to_bucket_always_largest_is_not_called_bisect_right():
    res = check_pad_to_bucket(_always_largest, quiet=True)
    assert "bisect_right" not in res.message


def test_pad_to_bucket_hints_come_in_steps():
    res = check_pad_to_bucket(_bisect_right, quiet=True)
    assert "bisect_left(" not in res.message          # the answer is not the first hint
    assert len(res.more_hints) == 3 and "bisect_left" in res.more_hints[-1]


def test_pad_to_bucket_not_done_and_endless_loop():
    def stub(raw_bs, buckets):
        raise NotImplementedError()

    res = check_pad_to_bucket(stub, quiet=True)
    assert not res and res.kind == "not_implemented" and "not done yet" in res.message

    def endless(raw_bs, buckets):
        i = 0
        while buckets[i] < raw_bs:
            pass  # forgot i += 1
        return buckets[i]

    res = check_pad_to_bucket(endless, quiet=True, time_limit=0.3)
    assert not res and res.kind == "timeout" and "did not finish" in res.message


def test_pad_to_bucket_restores_bisect():
    check_pad_to_bucket(_pad_imported, quiet=True)
    assert bisect.bisect_left is imported_bisect_left
    assert globals()["imported_bisect_left"] is imported_bisect_left


# ---- fill_slot ------------------------------------------------------------------------------


def _fill_right(slot, src, raw_rows, padded_rows):
    buf, d = slot.tensor, slot.row_dim
    buf.narrow(d, 0, raw_rows).copy_(src)
    tail = buf.narrow(d, raw_rows, padded_rows - raw_rows)
    if slot.pad is Pad.ZERO_TAIL:
        tail.zero_()
    elif slot.pad is Pad.SENTINEL:
        tail.fill_(slot.fill_value)


def _rows(slot, lo, hi):
    """The index of rows lo..hi along slot.row_dim: tensor[:, lo:hi] when row_dim is 1."""
    return (slice(None),) * slot.row_dim + (slice(lo, hi),)


def _fill_right_by_string(slot, src, raw_rows, padded_rows):
    slot.tensor[_rows(slot, 0, raw_rows)] = src
    if slot.pad == "zero_tail":
        slot.tensor[_rows(slot, raw_rows, padded_rows)] = 0
    elif slot.pad == "sentinel":
        slot.tensor[_rows(slot, raw_rows, padded_rows)] = slot.fill_value


def _fill_dim0(slot, src, raw_rows, padded_rows):     # right for every buffer but one
    slot.tensor[:raw_rows].copy_(src)
    if slot.pad is Pad.ZERO_TAIL:
        slot.tensor[raw_rows:padded_rows].zero_()
    elif slot.pad is Pad.SENTINEL:
        slot.tensor[raw_rows:padded_rows].fill_(slot.fill_value)


def _fill_value_for_zero_tail(slot, src, raw_rows, padded_rows):   # "fill_value is its pad"
    slot.tensor.narrow(slot.row_dim, 0, raw_rows).copy_(src)
    if slot.pad is not Pad.HEAD_ONLY:
        slot.tensor.narrow(slot.row_dim, raw_rows, padded_rows - raw_rows).fill_(
            slot.fill_value)


def test_fill_slot_rows_along_row_dim(capsys):
    # mrope_positions, shape (3, n): its rows are along dim 1 (lesson 06 §3)
    res = check_fill_slot(_fill_dim0)
    _rejects(res, "row_dim=1", "rows are along dim 1")
    assert "not written" not in res.message


def test_fill_slot_zero_tail_is_zeros_whatever_fill_value_holds():
    res = check_fill_slot(_fill_value_for_zero_tail)
    _rejects(res, "zero_tail means zeros", "fill_value is the sentinel of Pad.SENTINEL slots")


def test_fill_slot_trials_cover_row_dim_and_nonzero_fill_values():
    from labkit.checks.lesson06 import fill_slot as L

    seen = set()
    for trial in range(1, 9):
        slot, src, raw, padded = L._fill_case(torch.Generator().manual_seed(trial), "cpu")
        seen.add((slot.pad, slot.row_dim, slot.fill_value != 0))
        assert tuple(src.shape) == tuple(slot.tensor.narrow(slot.row_dim, 0, raw).shape)
    assert (Pad.ZERO_TAIL, 0, True) in seen and (Pad.HEAD_ONLY, 0, True) in seen
    assert any(rd == 1 for _, rd, _ in seen)


def test_fill_slot_accepts_right_answers(capsys):
    assert check_fill_slot(_fill_right)
    assert check_fill_slot(_fill_right_by_string)
    assert check_fill_slot(_fill_by_assignment_and_dict)
    assert capsys.readouterr().out.count("✅ fill_slot: passed 8 random trials") == 3


def test_fill_slot_nothing_written_is_not_called_rebinding():
    res = check_fill_slot(_nothing_when_no_tail)
    assert "assigning slot.tensor" not in res.message, res.message


def _sentinel_hard_coded(slot, src, raw_rows, padded_rows):   # the escapee
    slot.tensor[:raw_rows].copy_(src)
    if slot.pad is Pad.ZERO_TAIL:
        slot.tensor[raw_rows:padded_rows].zero_()
    elif slot.pad is Pad.SENTINEL:
        slot.tensor[raw_rows:padded_rows].fill_(1)


def _head_only_everywhere(slot, src, raw_rows, padded_rows):
    slot.tensor[:raw_rows].copy_(src)


def _zero_all_tails(slot, src, raw_rows, padded_rows):
    slot.tensor[:raw_rows].copy_(src)
    if slot.pad is not Pad.HEAD_ONLY:
        slot.tensor[raw_rows:padded_rows].zero_()


def _zero_to_the_end(slot, src, raw_rows, padded_rows):
    slot.tensor[:raw_rows].copy_(src)
    if slot.pad is Pad.ZERO_TAIL:
        slot.tensor[raw_rows:].zero_()
    elif slot.pad is Pad.SENTINEL:
        slot.tensor[raw_rows:].fill_(slot.fill_value)


def _rebind(slot, src, raw_rows, padded_rows):
    slot.tensor = torch.cat([src.to(slot.tensor.dtype), slot.tensor[raw_rows:]])


def _clear_every_tail(slot, src, raw_rows, padded_rows):
    slot.tensor[:raw_rows].copy_(src)
    slot.tensor[raw_rows:padded_rows].fill_(slot.fill_value)


def _off_by_one_tail(slot, src, raw_rows, padded_rows):
    slot.tensor[:raw_rows].copy_(src)
    if slot.pad is Pad.ZERO_TAIL:
        slot.tensor[raw_rows + 1:padded_rows].zero_()
    elif slot.pad is Pad.SENTINEL:
        slot.tensor[raw_rows + 1:padded_rows].fill_(slot.fill_value)


def _copy_into_a_new_tensor(slot, src, raw_rows, padded_rows):
    t = slot.tensor.clone()
    t[:raw_rows] = src
    if slot.pad is Pad.ZERO_TAIL:
        t[raw_rows:padded_rows] = 0
    elif slot.pad is Pad.SENTINEL:
        t[raw_rows:padded_rows] = slot.fill_value


def _fill_whole_buffer_first(slot, src, raw_rows, padded_rows):
    if slot.pad is Pad.ZERO_TAIL:
        slot.tensor.zero_()
    elif slot.pad is Pad.SENTINEL:
        slot.tensor.fill_(slot.fill_value)
    slot.tensor[:raw_rows].copy_(src)


def _nothing_when_no_tail(slot, src, raw_rows, padded_rows):
    if padded_rows > raw_rows:       # the mistake: the head copy sits under the tail test
        slot.tensor[:raw_rows].copy_(src)
        if slot.pad is Pad.ZERO_TAIL:
            slot.tensor[raw_rows:padded_rows].zero_()
        elif slot.pad is Pad.SENTINEL:
            slot.tensor[raw_rows:padded_rows].fill_(slot.fill_value)


def _fill_by_assignment_and_dict(slot, src, raw_rows, padded_rows):
    """A tester's correct answer: slice assignment, fill value from a dict."""
    buf = slot.tensor
    buf[_rows(slot, 0, raw_rows)] = src.to(buf.dtype)
    fill = {Pad.ZERO_TAIL: 0, Pad.SENTINEL: slot.fill_value}.get(slot.pad)
    if fill is not None and padded_rows > raw_rows:
        buf[_rows(slot, raw_rows, padded_rows)] = fill


FILL_WRONG = {
    "nothing written when raw == padded": (_nothing_when_no_tail,
                                           ["wrote nothing", "fills its bucket exactly",
                                            "skip the head copy"]),
    "sentinel hard-coded as 1": (_sentinel_hard_coded, ["slot.fill_value", "not a constant"]),
    "tail never zeroed": (_head_only_everywhere, ["zero_tail leaves no stale value",
                                                  "illegal memory access"]),
    "sentinel written as 0": (_zero_all_tails, ["A sentinel of 0", "NaN"]),
    "tail cleared to the end": (_zero_to_the_end, ["Rows past padded_rows"]),
    "slot.tensor rebound": (_rebind, ["was not written", "in place"]),
    "every tail filled with fill_value": (_clear_every_tail, ["zero_tail means zeros",
                                                              "this slot's fill_value"]),
    "head_only tail cleared": (lambda slot, src, r, p: (
        _fill_right(slot, src, r, p),
        slot.tensor[r:p].zero_() if slot.pad is Pad.HEAD_ONLY else None),
        ["head_only leaves the tail"]),
    "tail off by one": (_off_by_one_tail, ["Rows [6] kept their stale values",
                                           "bounds of your slice"]),
    "written into a copy": (_copy_into_a_new_tensor, ["was not written",
                                                      "Writing into a copy"]),
    "whole buffer cleared first": (_fill_whole_buffer_first, ["Rows past padded_rows"]),
    "head not copied": (lambda slot, src, r, p: slot.tensor[r:p].zero_()
                        if slot.pad is Pad.ZERO_TAIL else None, ["rows 0..", "src"]),
}


@pytest.mark.parametrize("case", sorted(FILL_WRONG))
def test_fill_slot_rejects(case):
    answer, words = FILL_WRONG[case]
    _rejects(check_fill_slot(answer), *words)


def test_fill_slot_hard_coded_sentinel_is_named():
    res = check_fill_slot(_sentinel_hard_coded)
    assert "The tail holds 1 but this slot's sentinel is 3" in res.message
    assert ".fill_(slot.fill_value)" not in res.message and "fill_value" in res.more_hints[-1]


# ---- fixed_config (diagnosis) -------------------------------------------------------------------


def test_budget_scenario_is_a_real_diagnosis():
    """The broken config and the named schemes all fail; a config that passes exists."""
    sc = budget_scenario()
    trace, m, budget, waste = (sc["batch_sizes"], sc["max_bs"], sc["budget_bytes"],
                               sc["max_waste"])
    assert len(trace) == 450 and max(trace) == m == 64
    every = explore_buckets(m, trace, "every")
    assert every.memory_bytes_separate_pools > 20 * budget and every.memory_bytes > budget
    assert explore_buckets(m, trace, "sglang").memory_bytes > budget
    pow2 = explore_buckets(m, trace, "pow2")
    assert pow2.memory_bytes <= budget and pow2.padding_waste > waste


def test_fixed_config_accepts_right_answers(capsys):
    for cfg in ({"buckets": [4, 20, 24, 28, 56, 64], "shared_pool": True},
                {"buckets": [4, 22, 28, 58, 64], "shared_pool": True},
                {"buckets": [2, 4, 20, 24, 28, 56, 64], "shared_pool": True}):
        assert check_fixed_config(lambda cfg=cfg: cfg), cfg
    assert capsys.readouterr().out.count("✅ fixed_config") == 3


FIXED_WRONG = {
    "the broken config unchanged": ({"buckets": "every", "shared_pool": False},
                                    ["64 graphs", "over the 5.5 MiB budget",
                                     "a pool per graph keeps every", "count your graphs"]),
    "shared pool, still a graph per size": ({"buckets": "every", "shared_pool": True},
                                            ["64 graphs", "over the 5.5 MiB budget",
                                             "Which of them does the trace actually need"]),
    "SGLang's default list": ({"buckets": "sglang", "shared_pool": True},
                              ["12 graphs", "over the 5.5 MiB budget"]),
    "good buckets, a pool per graph": ({"buckets": [4, 20, 24, 28, 56, 64],
                                        "shared_pool": False},
                                       ["over the 5.5 MiB budget", "Which pool layout"]),
    "powers of two": ({"buckets": "pow2", "shared_pool": True},
                      ["Within budget", "19.2%", "limit is 8%"]),
    "the peaks forgotten": ({"buckets": [4, 20, 24, 28, 32], "shared_pool": True},
                            ["oversize steps", "The peaks need a graph"]),
    "bucket above max_bs": ({"buckets": [4, 24, 28, 64, 128], "shared_pool": True},
                            ["bucket 128 is outside 1..max_bs=64"]),
    "unsorted": ({"buckets": [64, 28, 24, 4], "shared_pool": True}, ["sorted ascending"]),
    "shared_pool as a string": ({"buckets": [4, 24, 28, 64], "shared_pool": "yes"},
                                ["'shared_pool' must be True or False"]),
    "wrong keys": ({"buckets": [4, 24, 28, 64]}, ["exactly the keys"]),
}


@pytest.mark.parametrize("case", sorted(FIXED_WRONG))
def test_fixed_config_rejects(case):
    cfg, words = FIXED_WRONG[case]
    _rejects(check_fixed_config(lambda: cfg, quiet=True), *words)


def test_fixed_config_not_done():
    def stub():
        raise NotImplementedError()

    res = check_fixed_config(stub, quiet=True)
    assert not res and res.kind == "not_implemented"
