"""Batch-size buckets: which graphs to capture and which one a batch replays.

A CUDA graph replays fixed shapes, and a decode step's shape is fixed by its batch size.
So the runner captures one graph per *bucket* and pads every real batch up to the
smallest bucket that holds it (real rows first, a padding tail after). SGLang's default
list is dense where batches are small (a padded row costs a larger share there) and sparse
where they are large (``server_args.py``):

    [1, 2, 4, 8, 12] + range(16, 257, 8) + range(272, 512, 16) + range(512, max_bs + 1, 32)

clipped to ``max_bs`` with ``max_bs`` itself always included. ``disable_padding=True``
(``--disable-cuda-graph-padding``) turns it into one graph per size: no padding waste,
``max_bs`` graphs.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from typing import Iterable, Sequence

from labkit.core.validate import check_int

__all__ = ["default_buckets", "pow2_buckets", "make_buckets", "pad_to_bucket",
           "BatchTooLargeError", "BucketReport", "explore_buckets", "SCHEMES", "DECODE_SCHEMES"]

#: the bucket schemes :func:`make_buckets` knows by name ("disable_padding" = "every")
SCHEMES = ("sglang", "sglang_spec", "every", "pow2")
#: the schemes of plain decode, which lesson 06 compares (its plots, ``python -m
#: labkit.decode``) and :class:`~labkit.decode.runner.DecodeGraphRunner` names first:
#: every scheme but ``"sglang_spec"``, SGLang's finer list under speculative decoding (a
#: verify or draft runner's)
DECODE_SCHEMES = tuple(s for s in SCHEMES if s != "sglang_spec")


class BatchTooLargeError(ValueError):
    """A batch has more requests than the largest captured graph."""


def _check_max_bs(max_bs) -> int:
    return check_int("max_bs", max_bs, 1,
                     fix="the largest batch a graph is captured for, e.g. max_bs=16")


def _check_bucket_list(buckets, *, sorted_required: bool) -> list[int]:
    """A bucket list as ints >= 1; ``sorted_required``: also strictly ascending."""
    if isinstance(buckets, (str, bytes)) or not hasattr(buckets, "__iter__"):
        raise TypeError(f"buckets must be a list of batch sizes, got {buckets!r} "
                        f"({type(buckets).__name__})")
    out = list(buckets)
    if not out:
        raise ValueError("buckets is empty: capture at least one graph, e.g. buckets=[1, 2, 4, 8]")
    for i, b in enumerate(out):
        check_int(f"buckets[{i}]", b, 1, fix="a bucket is a batch size")
    if sorted_required:
        for i in range(1, len(out)):
            if out[i] <= out[i - 1]:
                raise ValueError(
                    f"buckets must be sorted ascending without repeats (bisect needs that), "
                    f"but buckets[{i - 1}]={out[i - 1]} and buckets[{i}]={out[i]}. Build the "
                    f"list with make_buckets(max_bs, sizes), which sorts it")
    return [int(b) for b in out]


def default_buckets(max_bs: int, disable_padding: bool = False,
                    speculative: bool = False) -> list[int]:
    """SGLang's capture list for ``max_bs``, sorted ascending.

    Args:
        max_bs: the largest batch a graph is captured for (an int >= 1; it is always in).
        disable_padding: one graph per batch size, ``1..max_bs``
            (SGLang's ``--disable-cuda-graph-padding``).
        speculative: the finer list SGLang uses with speculative decoding
            (``ServerArgs._generate_cuda_graph_batch_sizes``)::

                list(range(1, 9)) + list(range(10, 33, 2)) + list(range(40, 65, 4))
                + list(range(72, 257, 8)) + list(range(272, max_bs + 1, 16))

            Every batch of a verify step carries ``k`` tokens per request, so a padded
            request costs ``k`` padded rows: the buckets sit closer together.
    """
    max_bs = _check_max_bs(max_bs)
    if disable_padding:
        return list(range(1, max_bs + 1))
    if speculative:
        bs = (list(range(1, 9)) + list(range(10, 33, 2)) + list(range(40, 65, 4))
              + list(range(72, 257, 8)) + list(range(272, max_bs + 1, 16)))
    else:
        bs = ([1, 2, 4, 8, 12] + list(range(16, 257, 8)) + list(range(272, 512, 16))
              + list(range(512, max_bs + 1, 32)))
    return sorted({b for b in bs if b <= max_bs} | {max_bs})


def pow2_buckets(max_bs: int) -> list[int]:
    """1, 2, 4, ... up to max_bs (max_bs included): few graphs, up to ~50% padding."""
    max_bs = _check_max_bs(max_bs)
    out = [1 << i for i in range(max(1, math.ceil(math.log2(max_bs)) + 1)) if 1 << i < max_bs]
    return out + [max_bs]


def make_buckets(max_bs: int, scheme: str | Iterable[int] = "sglang") -> list[int]:
    """The sorted bucket list for ``max_bs``.

    Args:
        max_bs: the largest batch a graph is captured for (an int >= 1).
        scheme: "sglang" (default list), "sglang_spec" (the finer list used with
            speculative decoding), "every" (no padding; "disable_padding" is the same),
            "pow2", or the sizes themselves (ints in ``1..max_bs``, any order; repeats
            are dropped).

    Raises ``TypeError``/``ValueError`` naming the bad value: a non-integer size, an empty
    list, a size < 1 or > ``max_bs``, an unknown scheme name.
    """
    max_bs = _check_max_bs(max_bs)
    if not isinstance(scheme, str):
        out = sorted(set(_check_bucket_list(scheme, sorted_required=False)))
        if out[-1] > max_bs:
            raise ValueError(f"bucket {out[-1]} exceeds max_bs={max_bs}: the static buffers "
                             f"are sized by max_bs, so no graph can be larger. Raise max_bs "
                             f"or drop the bucket")
        return out
    if scheme == "sglang":
        return default_buckets(max_bs)
    if scheme == "sglang_spec":
        return default_buckets(max_bs, speculative=True)
    if scheme in ("every", "disable_padding"):
        return default_buckets(max_bs, disable_padding=True)
    if scheme == "pow2":
        return pow2_buckets(max_bs)
    names = ", ".join(map(repr, SCHEMES))
    raise ValueError(f"unknown bucket scheme {scheme!r}: use one of {names} "
                     f"or a list of sizes such as [1, 2, 4, 8]")


def pad_to_bucket(raw_bs: int, buckets: Sequence[int]) -> int:
    """The smallest bucket >= raw_bs (``bisect_left`` on the sorted list).

    Raises :class:`BatchTooLargeError` when no bucket holds ``raw_bs`` — the caller
    decides whether that is an error or an eager fallback; it is never silent here.

    .. warning::
        ``buckets`` must be sorted ascending: bisect on an unsorted list returns a wrong
        bucket without an error, so the list is checked first (``TypeError``/``ValueError``
        naming the first bad entry).
    """
    check_int("raw_bs", raw_bs, 1, fix="a batch has at least one request")
    _check_bucket_list(buckets, sorted_required=True)
    i = bisect.bisect_left(buckets, raw_bs)
    if i == len(buckets):
        raise BatchTooLargeError(
            f"batch of {raw_bs} requests is larger than the largest captured graph "
            f"({buckets[-1]}). Capture up to a larger max_bs, admit fewer requests per step, "
            f"or pass fallback='eager' to run such batches without a graph.")
    return buckets[i]


@dataclass
class BucketReport:
    """What a bucket scheme costs on a workload (see :func:`explore_buckets`)."""

    scheme: str
    buckets: list[int]
    num_graphs: int
    real_rows: int             # sum of raw batch sizes that fit a bucket
    padded_rows: int           # sum of bucket sizes they replayed
    padding_waste: float       # share of computed rows that were padding
    oversize_batches: int      # batches larger than the largest bucket (eager / error)
    memory_bytes: int          # estimated graph memory, one shared pool
    memory_bytes_separate_pools: int  # the same graphs, each with its own pool

    def as_row(self) -> dict:
        return {"scheme": self.scheme, "graphs": self.num_graphs,
                "padding_waste_%": round(100 * self.padding_waste, 2),
                "oversize": self.oversize_batches,
                "memory_MiB": round(self.memory_bytes / 2**20, 2),
                "memory_MiB_separate": round(self.memory_bytes_separate_pools / 2**20, 2)}


def explore_buckets(max_bs: int, workload: Iterable[int], scheme: str | Iterable[int] = "sglang",
                    activation_bytes_per_row: int = 64 * 1024,
                    output_bytes_per_row: int = 4 * 1024,
                    graph_overhead_bytes: int = 64 * 1024) -> BucketReport:
    """Pure function: given ``max_bs``, a bucket scheme and the batch sizes a server saw,
    how many graphs, how much padding, how much memory.

    The memory model is deliberately simple. A graph's pool must hold its activations
    (``activation_bytes_per_row * bs``) while it runs, and its output stays alive after
    (``output_bytes_per_row * bs``, returned to the caller at every replay), plus a fixed
    per-graph overhead. Captured **largest first into one pool**, the smaller graphs reuse
    the largest one's activation blocks, so the pool costs roughly
    ``act(max) + sum(out(b)) + n * overhead``; with a pool each it would be the sum of all
    of them. Feed real numbers from ``DecodeGraphRunner.capture_report()`` to calibrate.
    """
    buckets = make_buckets(max_bs, scheme)
    name = scheme if isinstance(scheme, str) else "custom"
    for what, v in (("activation_bytes_per_row", activation_bytes_per_row),
                    ("output_bytes_per_row", output_bytes_per_row),
                    ("graph_overhead_bytes", graph_overhead_bytes)):
        check_int(what, v, 0, fix="a number of bytes")
    sizes = list(workload)
    for i, bs in enumerate(sizes):
        check_int(f"workload[{i}]", bs, 1, fix="the workload is the batch size of each decode step")
    real = padded = oversize = 0
    for bs in sizes:
        try:
            p = pad_to_bucket(int(bs), buckets)
        except BatchTooLargeError:
            oversize += 1
            continue
        real += int(bs)
        padded += p
    act = [activation_bytes_per_row * b for b in buckets]
    out = [output_bytes_per_row * b for b in buckets]
    n = len(buckets)
    return BucketReport(
        scheme=name, buckets=buckets, num_graphs=n, real_rows=real, padded_rows=padded,
        padding_waste=(padded - real) / padded if padded else 0.0,
        oversize_batches=oversize,
        memory_bytes=max(act) + sum(out) + n * graph_overhead_bytes,
        memory_bytes_separate_pools=sum(act) + sum(out) + n * graph_overhead_bytes,
    )
