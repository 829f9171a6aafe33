"""Lesson 06 checkers: each accepts a right answer and rejects the typical wrong ones with
a hint that names the mistake."""

from __future__ import annotations

import bisect

import torch

from labkit.checks.lesson06 import check_fill_slot, check_pad_to_bucket, check_sglang_buckets
from labkit.decode import BatchTooLargeError, Pad, default_buckets, pad_to_bucket

# ---- sglang_buckets ------------------------------------------------------------------------


def _sglang_raw(max_bs):
    return ([1, 2, 4, 8, 12] + list(range(16, 257, 8)) + list(range(272, 512, 16))
            + list(range(512, max_bs + 1, 32)))


def _sglang_right(max_bs):
    return sorted({b for b in _sglang_raw(max_bs) if b <= max_bs} | {max_bs})


def test_sglang_buckets_accepts_right_answers(capsys):
    assert check_sglang_buckets(default_buckets)
    assert check_sglang_buckets(_sglang_right)
    assert check_sglang_buckets(lambda m: tuple(_sglang_right(m)))  # any sequence of ints
    assert capsys.readouterr().out.count("✅ sglang_buckets: passed 7 random trials") == 3


def test_sglang_buckets_rejects_a_missing_max_bs():
    res = check_sglang_buckets(lambda m: sorted({b for b in _sglang_raw(m) if b <= m}))
    assert not res and "max_bs=30 itself is missing" in res.message


def test_sglang_buckets_rejects_no_clipping():
    res = check_sglang_buckets(lambda m: sorted(set(_sglang_raw(m)) | {m}))
    assert not res and "exceed max_bs=30" in res.message


def test_sglang_buckets_rejects_duplicates_and_range_ends():
    res = check_sglang_buckets(lambda m: sorted([b for b in _sglang_raw(m) if b <= m] + [m]))
    assert not res and "appear twice" in res.message
    wrong_end = lambda m: sorted(  # noqa: E731 - range(16, 256, 8) forgets 256
        {b for b in [1, 2, 4, 8, 12] + list(range(16, 256, 8)) + list(range(272, 512, 16))
         + list(range(512, m + 1, 32)) if b <= m} | {m})
    res = check_sglang_buckets(wrong_end)
    assert not res and "Missing [256]" in res.message
    res = check_sglang_buckets(lambda m: None)
    assert not res and "did you forget `return`" in res.message


# ---- pad_to_bucket --------------------------------------------------------------------------


def _pad_right(raw_bs, buckets):
    i = bisect.bisect_left(buckets, raw_bs)
    if i == len(buckets):
        raise BatchTooLargeError(f"batch of {raw_bs} > largest bucket {buckets[-1]}")
    return buckets[i]


def test_pad_to_bucket_accepts_right_answers(capsys):
    assert check_pad_to_bucket(pad_to_bucket)
    assert check_pad_to_bucket(_pad_right)

    def plain_value_error(raw_bs, buckets):
        for b in buckets:
            if b >= raw_bs:
                return b
        raise ValueError("too large")

    assert check_pad_to_bucket(plain_value_error)
    assert capsys.readouterr().out.count("✅ pad_to_bucket") == 3


def test_pad_to_bucket_rejects_bisect_right():
    def right(raw_bs, buckets):
        i = bisect.bisect_right(buckets, raw_bs)
        if i == len(buckets):
            raise BatchTooLargeError("too large")
        return buckets[i]

    res = check_pad_to_bucket(right)
    assert not res and "bisect_right" in res.message and "bisect_left" in res.message


def test_pad_to_bucket_rejects_silent_or_index_error_oversize():
    res = check_pad_to_bucket(lambda r, b: b[bisect.bisect_left(b, r)])
    assert not res and "raised IndexError" in res.message
    assert "must raise BatchTooLargeError" in res.message
    res = check_pad_to_bucket(lambda r, b: b[min(bisect.bisect_left(b, r), len(b) - 1)])
    assert not res and "raise BatchTooLargeError instead" in res.message


def test_pad_to_bucket_not_done_and_none():
    def stub(raw_bs, buckets):
        raise NotImplementedError()

    res = check_pad_to_bucket(stub)
    assert not res and res.kind == "not_implemented"
    res = check_pad_to_bucket(lambda r, b: None)
    assert not res and "did you forget `return`" in res.message


# ---- fill_slot ------------------------------------------------------------------------------


def _fill_right(slot, src, raw_rows, padded_rows):
    slot.tensor[:raw_rows].copy_(src)
    if slot.pad is Pad.ZERO_TAIL:
        slot.tensor[raw_rows:padded_rows].zero_()
    elif slot.pad is Pad.SENTINEL:
        slot.tensor[raw_rows:padded_rows].fill_(slot.fill_value)


def test_fill_slot_accepts_a_right_answer(capsys):
    assert check_fill_slot(_fill_right)
    assert capsys.readouterr().out == "✅ fill_slot: passed 6 random trials\n"


def test_fill_slot_rejects_a_tail_not_zeroed():
    def head_only_everywhere(slot, src, raw_rows, padded_rows):
        slot.tensor[:raw_rows].copy_(src)

    res = check_fill_slot(head_only_everywhere)
    assert not res and "zero_tail: zero it" in res.message and "dummy slot" in res.message


def test_fill_slot_rejects_a_zero_sentinel_and_rows_past_the_bucket():
    def zero_all_tails(slot, src, raw_rows, padded_rows):
        slot.tensor[:raw_rows].copy_(src)
        if slot.pad is not Pad.HEAD_ONLY:
            slot.tensor[raw_rows:padded_rows].zero_()

    res = check_fill_slot(zero_all_tails)
    assert not res and "sentinel" in res.message and "NaN" in res.message

    def zero_to_the_end(slot, src, raw_rows, padded_rows):
        slot.tensor[:raw_rows].copy_(src)
        slot.tensor[raw_rows:].zero_()

    res = check_fill_slot(zero_to_the_end)
    assert not res and "Rows past the bucket" in res.message


def test_fill_slot_rejects_rebinding_and_clearing_head_only():
    def rebind(slot, src, raw_rows, padded_rows):
        slot.tensor = torch.cat([src.to(slot.tensor.dtype), slot.tensor[raw_rows:]])

    res = check_fill_slot(rebind)
    assert not res and "in place" in res.message

    def clear_every_tail(slot, src, raw_rows, padded_rows):
        slot.tensor[:raw_rows].copy_(src)
        slot.tensor[raw_rows:padded_rows].fill_(slot.fill_value)

    res = check_fill_slot(clear_every_tail)
    assert not res and "head_only: leave the tail" in res.message
