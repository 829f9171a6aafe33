"""Device memory outside graph pools: when a GPU would call ``cudaMalloc`` for it.

During a capture, ``cudaMalloc`` is a *potentially unsafe* call. CUDA refuses it, and
invalidates the capture, from the capturing thread under ``capture_error_mode="global"``
or ``"thread_local"``, and from any other thread under ``"global"``
(``cudaStreamCaptureMode``); ``"relaxed"`` lets it through. PyTorch's own allocations in
the capture come from the graph's pool and switch their thread to relaxed for the
``cudaMalloc`` (``cudaMallocMaybeCapturing``), so they are safe. What is not safe is an
allocation on a stream *outside* the capture, by the capturing thread (work on the
default stream, say) or by another thread (a data loader): PyTorch's caching allocator
serves it from the stream's cached blocks if one fits, and calls ``cudaMalloc`` for a new
segment if none does.

This module keeps, per stream, the segments that stream's allocations outside graph pools
have reserved, carved as :mod:`~labkit.emulator.pool` carves graph pools: requests up to
1 MiB share 2 MiB segments, larger ones 20 MiB segments (up to 10 MiB) or a segment of
their own. :func:`note_allocation`, called for every such allocation, refuses one that
needs a new segment where CUDA would refuse the ``cudaMalloc``.

.. warning::
    An approximation of the caching allocator: it does not follow frees outside graph
    pools, so a segment a stream has used once is taken to be free again (a GPU calls
    ``cudaMalloc`` when the cached blocks are still in use, or too fragmented), and every
    ``B.Stream()`` is a new stream (torch hands out 32 pooled streams per priority, round
    robin, so on a GPU a "new" stream can find blocks an earlier one cached). What it
    gets right: blocks belong to one stream, so a stream's first allocation, and one
    larger than any segment it has, need ``cudaMalloc``.
"""

from __future__ import annotations

import labkit.emulator.pool as _pool
from labkit.emulator.state import (
    CAPTURE_UNSUPPORTED,
    active_capture,
    capture_error,
    captures_underway,
)
from labkit.emulator.streams import current_stream

__all__ = ["note_allocation", "needs_new_segment", "forget_streams"]

# stream id -> [has a small (2 MiB) segment, size of its largest large segment]
_segments: dict[int, list] = {}


def needs_new_segment(stream_id: int, nbytes: int) -> bool:
    """Whether ``nbytes`` on this stream needs a segment it has not reserved yet."""
    size = _pool.round_size(nbytes)
    have = _segments.get(stream_id)
    if size <= _pool.SMALL_SIZE:
        return have is None or not have[0]
    return have is None or have[1] < size


def _reserve(stream_id: int, nbytes: int) -> None:
    size = _pool.round_size(nbytes)
    have = _segments.setdefault(stream_id, [False, 0])
    if size <= _pool.SMALL_SIZE:
        have[0] = True
    else:
        have[1] = max(have[1], _pool.segment_size(size))


def forget_streams() -> None:
    """Drop every stream's segments (as ``torch.cuda.empty_cache()`` releases them)."""
    _segments.clear()


def note_allocation(nbytes: int) -> None:
    """An allocation of ``nbytes`` of device memory outside graph pools, on this thread's
    current stream: refused, as CUDA refuses its ``cudaMalloc``, where a capture forbids it.

    Raises:
        RuntimeError: CUDA's "operation not permitted when stream is capturing"; the
            capture that forbids it is invalidated, so its ``capture_end`` fails too.
    """
    sid = current_stream().stream_id
    have = _segments.get(sid)
    if have is not None and (have[0] if nbytes <= _pool.SMALL_SIZE else nbytes <= have[1]):
        return                # a segment this stream holds can serve it: no cudaMalloc
    if nbytes <= 0:
        return
    underway = captures_underway()
    if underway:
        mine = active_capture()
        if mine is not None and mine.records_now():
            return            # the graph's own pool (cudaMallocMaybeCapturing: relaxed)
        _refuse(mine, [c for c in underway if c is not mine and c.mode == "global"], nbytes)
    _reserve(sid, nbytes)


def _refuse(mine, others: list, nbytes: int) -> None:
    here = mine is not None and mine.mode != "relaxed"
    if not (here or others):
        return
    what = (f"a new allocation of {nbytes} bytes on a stream outside the capture, which "
            f"no block that stream has cached can hold, so it needs cudaMalloc")
    for cap in ([mine] if here else []) + others:
        cap.invalidate(what)
    if here:
        why = (f"{what}: capture_error_mode={mine.mode!r} refuses that call from the "
               "capturing thread. Allocate before the capture, or do the work on a stream "
               "joined to the capture (its memory then comes from the graph's pool)")
    else:
        why = (f"{what}: another thread is capturing with capture_error_mode='global', "
               "which refuses it from every thread. That thread can capture with "
               "capture_error_mode='thread_local'")
    raise capture_error(CAPTURE_UNSUPPORTED, "cudaErrorStreamCaptureUnsupported", why + ".")
