"""labkit.decode.buckets under misuse: every bad input is an error that names what was
given and what was expected; nothing is computed wrongly in silence."""

from __future__ import annotations

import numpy as np
import pytest

from labkit.decode import (
    BatchTooLargeError,
    default_buckets,
    explore_buckets,
    make_buckets,
    pad_to_bucket,
    pow2_buckets,
)


@pytest.mark.parametrize("fn", [default_buckets, pow2_buckets, lambda m: make_buckets(m)])
@pytest.mark.parametrize("max_bs, err, words", [
    (0, ValueError, "max_bs must be >= 1, got 0"),
    (-8, ValueError, "max_bs must be >= 1, got -8"),
    (16.0, TypeError, "got 16.0 (float)"),
    ("16", TypeError, "got '16' (str)"),
    (True, TypeError, "got True (bool)"),
])
def test_max_bs_must_be_a_positive_int(fn, max_bs, err, words):
    with pytest.raises(err, match=words.replace("(", r"\(").replace(")", r"\)")):
        fn(max_bs)


def test_numpy_ints_are_ints():
    assert default_buckets(np.int64(16)) == [1, 2, 4, 8, 12, 16]
    assert make_buckets(16, np.array([8, 2, 4])) == [2, 4, 8]


@pytest.mark.parametrize("sizes, err, words", [
    ([], ValueError, "buckets is empty"),
    ([1, 2.5, 4], TypeError, r"buckets\[1\] must be an int >= 1, got 2.5 \(float\): a bucket "),
    (["8", "16"], TypeError, r"buckets\[0\] must be an int >= 1, got '8' \(str\)"),
    ([4, 0, 8], ValueError, r"buckets\[1\] must be >= 1, got 0: a bucket is a batch size"),
    ([1, 2, 32], ValueError, "bucket 32 exceeds max_bs=16"),
    ("1,2,4", ValueError, r"unknown bucket scheme '1,2,4'.*such as \[1, 2, 4, 8\]"),
    (8, TypeError, "must be a list of batch sizes"),
])
def test_make_buckets_rejects_bad_lists(sizes, err, words):
    with pytest.raises(err, match=words):
        make_buckets(16, sizes)


def test_make_buckets_sorts_and_dedups_a_custom_list():
    assert make_buckets(16, [8, 2, 2, 4, 16]) == [2, 4, 8, 16]


def test_unknown_scheme_lists_the_choices():
    with pytest.raises(ValueError, match="unknown bucket scheme 'pow4': use one of 'sglang', "
                                         "'sglang_spec', 'every', 'pow2'"):
        make_buckets(16, "pow4")


@pytest.mark.parametrize("buckets, err, words", [
    ([1, 8, 4, 16], ValueError, r"sorted ascending .*buckets\[1\]=8 and buckets\[2\]=4"),
    ([1, 4, 4, 8], ValueError, "without repeats"),
    ([], ValueError, "buckets is empty"),
    ([1, 2, "4"], TypeError, r"buckets\[2\] must be an int >= 1, got '4'"),
])
def test_pad_to_bucket_rejects_lists_bisect_cannot_search(buckets, err, words):
    with pytest.raises(err, match=words):
        pad_to_bucket(3, buckets)


def test_pad_to_bucket_unsorted_would_otherwise_be_silently_wrong():
    import bisect

    unsorted = [1, 16, 4, 8]
    assert unsorted[bisect.bisect_left(unsorted, 3)] == 16   # what bisect alone would say
    with pytest.raises(ValueError, match="sorted"):
        pad_to_bucket(3, unsorted)


@pytest.mark.parametrize("raw, err, words", [
    (0, ValueError, "raw_bs must be >= 1, got 0: a batch has at least one request"),
    (2.0, TypeError, r"got 2.0 \(float\)"),
    (None, TypeError, r"got None \(NoneType\)"),
])
def test_pad_to_bucket_rejects_bad_batch_sizes(raw, err, words):
    with pytest.raises(err, match=words):
        pad_to_bucket(raw, [1, 2, 4])


def test_pad_to_bucket_oversize_names_both_sizes():
    with pytest.raises(BatchTooLargeError, match="batch of 5 requests .* largest captured graph "
                                                 r"\(4\)"):
        pad_to_bucket(5, [1, 2, 4])


@pytest.mark.parametrize("workload, err, words", [
    ([1, 0, 3], ValueError, r"workload\[1\] must be >= 1, got 0: the workload is the batch"),
    ([1, 2.5], TypeError, r"workload\[1\] must be an int >= 1, got 2.5 \(float\)"),
])
def test_explore_buckets_rejects_bad_workloads(workload, err, words):
    with pytest.raises(err, match=words):
        explore_buckets(16, workload)


def test_explore_buckets_rejects_negative_memory_model():
    with pytest.raises(ValueError, match="activation_bytes_per_row must be >= 0, got -1: a number"):
        explore_buckets(16, [1, 2], activation_bytes_per_row=-1)


def test_speculative_list_is_finer():
    spec = default_buckets(300, speculative=True)
    assert spec[:12] == [1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16]
    assert spec[-4:] == [256, 272, 288, 300]
    assert make_buckets(300, "sglang_spec") == spec
    plain = default_buckets(300)
    assert len(spec) > len(plain) and set(plain) - set(spec) == {1, 2, 4, 8, 12} - set(spec)


# ---- static buffers (labkit.decode.buffers) -------------------------------------------------

import types  # noqa: E402

import torch  # noqa: E402

from labkit.decode import Pad, StaticBuffers  # noqa: E402


def _batch(raw, k=1, base=10):
    n = raw * k
    return types.SimpleNamespace(
        input_ids=torch.arange(base, base + n), req_pool_indices=torch.arange(1, raw + 1),
        seq_lens=torch.full((raw,), 7), out_cache_loc=torch.arange(100, 100 + n),
        positions=torch.arange(n), mrope_positions=torch.arange(3 * n).view(3, n) + 1)


def test_mrope_positions_is_one_more_static_buffer():
    buf = StaticBuffers(max_bs=8, num_tokens_per_bs=2)
    mrope = torch.full((3, buf.max_num_token), 99, dtype=torch.int64)
    buf.register("mrope_positions", mrope, Pad.ZERO_TAIL, per_token=True, row_dim=1)
    b = _batch(3, k=2)
    buf.fill_from(b, 3, 4)                      # 6 real token columns, 2 padded ones
    assert torch.equal(mrope[:, :6], b.mrope_positions)
    assert mrope[:, 6:8].eq(0).all()            # the tail: zeros, like positions
    assert mrope[:, 8:].eq(99).all()            # past the bucket: untouched
    assert buf.view(4)["mrope_positions"].shape == (3, 8)
    assert buf.view(4)["mrope_positions"].data_ptr() == mrope.data_ptr()


def test_register_rejects_buffers_that_cannot_hold_a_bucket():
    buf = StaticBuffers(max_bs=8)
    with pytest.raises(ValueError, match=r"row_dim=2 but the tensor has 2 dimension"):
        buf.register("m", torch.zeros(3, 8), Pad.ZERO_TAIL, per_token=True, row_dim=2)
    with pytest.raises(ValueError, match="4 rows along dim 1, but a full bucket needs 8"):
        buf.register("m", torch.zeros(3, 4), Pad.ZERO_TAIL, per_token=True, row_dim=1)
    with pytest.raises(TypeError, match="expected a tensor, got list"):
        buf.register("m", [0] * 8, Pad.ZERO_TAIL, per_token=False)


def test_fill_from_names_a_batch_of_the_wrong_shape():
    buf = StaticBuffers(max_bs=8)
    b = _batch(3)
    b.positions = torch.arange(4)
    with pytest.raises(ValueError, match=r"positions: batch has shape \(4,\), expected \(3,\)"):
        buf.fill_from(b, 3, 4)


# ---- the bucket panel (labkit.decode.plots) -------------------------------------------------


def test_bucket_panel_redraws_and_keeps_its_picture_at_its_own_size():
    pytest.importorskip("ipywidgets")
    import matplotlib

    matplotlib.use("Agg")
    from labkit.decode import plots
    from labkit.widgets import png_size

    panel = plots.bucket_panel([1, 2, 3, 5, 8, 13, 16] * 3, max_bs=16, widgets=True)
    before = panel._image.value
    assert panel._image.layout.width == f"{png_size(before)[0]}px"
    panel._slider.value = 8
    assert "max_bs 8" in panel.text() and "6 of 21 steps too large" in panel.text()
    assert panel._image.value != before and "max_bs 8" in panel._label.value
