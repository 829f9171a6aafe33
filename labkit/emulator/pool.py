"""Graph memory pools on the CPU, carved the way CUDA's caching allocator carves them.

Blocks come from big byte segments, as in ``CUDACachingAllocator``: sizes round up to
512 bytes; requests up to 1 MiB come from 2 MiB segments, larger ones from 20 MiB
segments (up to 10 MiB) or a segment of their own rounded to 2 MiB; a free block is
chosen best-fit (smallest that fits, lowest address on ties), split when the rest is
worth keeping, and coalesced with free neighbours when freed. A block is freed when the
last tensor using it dies (a ``weakref.finalize`` on the NumPy view its storage owns).

.. warning::
    The aliasing is real: graphs that share a pool reuse each other's freed blocks, so
    replaying them out of capture order overwrites live data, as on a GPU.
"""

from __future__ import annotations

import bisect
import itertools
import weakref
from dataclasses import dataclass, field

import numpy as np
import torch

KB, MB = 1024, 1024 * 1024
MIN_BLOCK = 512            # kMinBlockSize
SMALL_SIZE = 1 * MB        # kSmallSize: requests up to this come from small segments
SMALL_SEGMENT = 2 * MB     # kSmallBuffer
LARGE_SEGMENT = 20 * MB    # kLargeBuffer, for requests up to MIN_LARGE_ALLOC
MIN_LARGE_ALLOC = 10 * MB
ROUND_LARGE = 2 * MB


def round_size(nbytes: int) -> int:
    return max(MIN_BLOCK, (nbytes + MIN_BLOCK - 1) // MIN_BLOCK * MIN_BLOCK)


def segment_size(nbytes: int) -> int:
    if nbytes <= SMALL_SIZE:
        return SMALL_SEGMENT
    if nbytes < MIN_LARGE_ALLOC:
        return LARGE_SEGMENT
    return (nbytes + ROUND_LARGE - 1) // ROUND_LARGE * ROUND_LARGE


@dataclass(eq=False)
class Segment:
    pool: "MemPool"
    array: np.ndarray
    small: bool
    storage: torch.UntypedStorage = field(init=False)

    def __post_init__(self):
        self.storage = torch.from_numpy(self.array).untyped_storage()

    @property
    def ptr(self) -> int:
        return self.storage.data_ptr()

    @property
    def size(self) -> int:
        return self.array.nbytes


@dataclass(eq=False)
class Block:
    segment: Segment
    offset: int
    size: int
    free: bool = True
    prev: "Block | None" = None
    next: "Block | None" = None

    def key(self):
        return (self.size, self.segment.ptr, self.offset)


class MemPool:
    """One private graph pool: segments, blocks, and the statistics lesson 05 plots."""

    def __init__(self, handle: tuple[int, int]):
        self.handle = handle
        self.segments: list[Segment] = []
        self._free: dict[bool, list[tuple]] = {True: [], False: []}   # small? -> sorted keys
        self._by_key: dict[tuple, Block] = {}
        self._pending: list[Block] = []       # freed by finalizers, merged on next use
        self.allocated_bytes = 0
        self.peak_bytes = 0
        self.use_count = 0                    # graphs that captured into this pool

    # ---- free lists -------------------------------------------------------------
    def _insert_free(self, b: Block) -> None:
        b.free = True
        k = b.key()
        self._by_key[k] = b
        bisect.insort(self._free[b.segment.small], k)

    def _remove_free(self, b: Block) -> None:
        k = b.key()
        lst = self._free[b.segment.small]
        lst.pop(bisect.bisect_left(lst, k))
        del self._by_key[k]
        b.free = False

    def _drain(self) -> None:
        while self._pending:
            self._release(self._pending.pop())

    def _release(self, b: Block) -> None:
        self.allocated_bytes -= b.size
        # coalesce with free neighbours in the same segment, like the caching allocator
        p = b.prev
        if p is not None and p.free:
            self._remove_free(p)
            p.size += b.size
            p.next = b.next
            if b.next:
                b.next.prev = p
            b = p
        n = b.next
        if n is not None and n.free:
            self._remove_free(n)
            b.size += n.size
            b.next = n.next
            if n.next:
                n.next.prev = b
        self._insert_free(b)

    # ---- allocation -------------------------------------------------------------
    def allocate(self, nbytes: int) -> tuple[torch.UntypedStorage, Block]:
        """A storage of at least ``nbytes`` carved from this pool (best fit)."""
        self._drain()
        size = round_size(nbytes)
        small = size <= SMALL_SIZE
        lst = self._free[small]
        i = bisect.bisect_left(lst, (size, -1, -1))
        if i < len(lst):
            block = self._by_key[lst[i]]
            self._remove_free(block)
        else:
            seg = Segment(self, np.empty(segment_size(size), dtype=np.uint8), small)
            self.segments.append(seg)
            _register_segment(seg)
            block = Block(seg, 0, seg.size, free=False)
        rest = block.size - size
        if (small and rest >= MIN_BLOCK) or (not small and rest > SMALL_SIZE):
            tail = Block(block.segment, block.offset + size, rest, prev=block, next=block.next)
            if block.next:
                block.next.prev = tail
            block.next = tail
            block.size = size
            self._insert_free(tail)
        self.allocated_bytes += block.size
        self.peak_bytes = max(self.peak_bytes, self.allocated_bytes)
        view = block.segment.array[block.offset:block.offset + block.size]
        weakref.finalize(view, self._pending.append, block)
        return torch.from_numpy(view).untyped_storage(), block

    def stats(self) -> dict:
        self._drain()
        return {
            "pool": self.handle,
            "reserved_bytes": sum(s.size for s in self.segments),
            "allocated_bytes": self.allocated_bytes,
            "peak_bytes": self.peak_bytes,
            "segments": len(self.segments),
            "graphs": self.use_count,
        }


# ---- the process-wide registry -------------------------------------------------------
_ids = itertools.count(1)
_pools: dict[tuple[int, int], MemPool] = {}
_seg_starts: list[int] = []          # sorted segment base pointers
_seg_by_start: dict[int, Segment] = {}


def _register_segment(seg: Segment) -> None:
    bisect.insort(_seg_starts, seg.ptr)
    _seg_by_start[seg.ptr] = seg


def segment_of(ptr: int) -> Segment | None:
    """The pool segment holding address ``ptr``, if any."""
    i = bisect.bisect_right(_seg_starts, ptr) - 1
    if i >= 0:
        seg = _seg_by_start[_seg_starts[i]]
        if ptr < seg.ptr + seg.size:
            return seg
    return None


def new_handle() -> tuple[int, int]:
    """A fresh pool id, shaped like torch.cuda's ``(id, 0)`` MempoolId."""
    return (next(_ids), 0)


def check_handle(handle, where: str) -> tuple[int, int]:
    """``handle`` as a pool id, or a TypeError that says what a pool handle is.

    ``torch.cuda`` takes a ``(id, 0)`` pair of non-negative ints (a ``MempoolId``) and
    refuses anything else with a TypeError; so does the emulator, in plainer words.
    """
    ok = (isinstance(handle, (tuple, list)) and len(handle) == 2
          and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in handle))
    if not ok:
        raise TypeError(
            f"{where}: pool must be a memory-pool handle, the (id, 0) pair that "
            f"B.graph_pool_handle() or a captured graph's g.pool() returns (or None for a "
            f"private pool); got {type(handle).__name__} {handle!r:.60}. To share one pool: "
            f"pool = B.graph_pool_handle(), then pass pool=pool to each capture. "
            f"('shared' and 'per_graph' are options of labkit's "
            f"GlobalRecord.create_cudagraphs, not of B.graph.)")
    return tuple(handle)


def pool_for(handle: tuple[int, int]) -> MemPool:
    handle = check_handle(handle, "capture_begin")
    if handle not in _pools:
        _pools[handle] = MemPool(handle)
    return _pools[handle]


def release_pool(pool: MemPool) -> None:
    """Called when a graph that used ``pool`` is reset or deleted."""
    pool.use_count -= 1


def pool_stats(pool=None) -> dict:
    """Bytes reserved (segments) and allocated (live blocks), and the peak, of one pool.

    ``pool`` is a handle from ``graph_pool_handle()`` or ``g.pool()``; ``None`` sums
    every pool. Freed blocks stay reserved by the pool: that is what lets a later capture
    reuse them, and why sharing a pool saves memory.
    """
    if pool is not None:
        pool = check_handle(pool, "pool_stats")
        if pool not in _pools:
            return {"pool": pool, "reserved_bytes": 0, "allocated_bytes": 0,
                    "peak_bytes": 0, "segments": 0, "graphs": 0}
        return _pools[tuple(pool)].stats()
    per = [p.stats() for p in _pools.values()]
    return {
        "pool": None,
        "reserved_bytes": sum(s["reserved_bytes"] for s in per),
        "allocated_bytes": sum(s["allocated_bytes"] for s in per),
        "peak_bytes": sum(s["peak_bytes"] for s in per),
        "segments": sum(s["segments"] for s in per),
        "graphs": sum(s["graphs"] for s in per),
    }
