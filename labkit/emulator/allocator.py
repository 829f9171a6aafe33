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

``torch.cuda.graph`` empties the cache as it enters (``torch.cuda.empty_cache()``), so at
the start of a capture a stream keeps only segments that hold live tensors; the emulator
does the same (:func:`empty_cache`), counting each stream's live bytes until their
storage dies.

.. warning::
    An approximation of the caching allocator. Blocks belong to one stream, so a stream's
    first allocation, one larger than any segment it holds, and one on a stream whose
    segments ``empty_cache`` released need ``cudaMalloc``, here as on a GPU. But the
    emulator does not place blocks inside segments: a segment that holds live tensors is
    taken to have room for any request of its kind (a GPU calls ``cudaMalloc`` when the
    free part is too small or too fragmented). And every ``B.Stream()`` is a new stream,
    where torch hands out 32 pooled streams per priority, round robin, so on a GPU a
    "new" stream can find the blocks an earlier one cached.
"""

from __future__ import annotations

import weakref

import labkit.emulator.pool as _pool
from labkit.emulator.state import (
    CAPTURE_UNSUPPORTED,
    active_capture,
    capture_error,
    captures_underway,
    thread_stream,
)

__all__ = ["note_allocation", "needs_new_segment", "empty_cache", "forget_streams"]

# stream id -> [has a small (2 MiB) segment, size of its largest large segment]
_segments: dict[int, list] = {}
# stream id -> [live bytes in small segments, live bytes in large ones]
_live: dict[int, list] = {}
# a weak reference to each live allocation's storage -> (stream id, 0 small / 1 large, bytes)
_refs: dict = {}


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


def _freed(ref) -> None:
    sid, kind, nbytes = _refs.pop(ref, (None, 0, 0))
    if sid is not None:
        _live[sid][kind] -= nbytes


def empty_cache() -> None:
    """``torch.cuda.empty_cache()``: release every stream's segments that hold no live
    allocation (``torch.cuda.graph`` does this as it enters, before the capture)."""
    for sid in list(_segments):
        live = _live.get(sid, (0, 0))
        have = _segments[sid]
        if live[0] <= 0:
            have[0] = False
        if live[1] <= 0:
            have[1] = 0


def forget_streams() -> None:
    """Drop every stream's segments, live or not (for tests)."""
    _segments.clear()


def note_allocation(storage) -> None:
    """A new allocation of device memory outside graph pools (``storage``, the host memory
    behind it), on this thread's current stream: refused, as CUDA refuses its
    ``cudaMalloc``, where a capture forbids it; else counted until the storage dies.

    Raises:
        RuntimeError: CUDA's "operation not permitted when stream is capturing"; the
            capture that forbids it is invalidated, so its ``capture_end`` fails too.
    """
    nbytes = storage.nbytes()
    if nbytes <= 0:
        return
    sid = thread_stream.stream.stream_id
    kind = 0 if nbytes <= _pool.SMALL_SIZE else 1
    have = _segments.get(sid)
    if have is None or not (have[0] if kind == 0 else nbytes <= have[1]):
        underway = captures_underway()          # a new segment: cudaMalloc
        if underway:
            mine = active_capture()
            if mine is not None and mine.records_now():
                return        # the graph's own pool (cudaMallocMaybeCapturing: relaxed)
            _refuse(mine, [c for c in underway if c is not mine and c.mode == "global"],
                    nbytes)
        _reserve(sid, nbytes)
    _live.setdefault(sid, [0, 0])[kind] += nbytes
    _refs[weakref.ref(storage, _freed)] = (sid, kind, nbytes)


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
