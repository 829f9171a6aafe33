"""Lesson 06's demonstration of a stale padding tail: what the runner's padding policy
prevents, shown by switching it off for one buffer (:func:`demo_stale_tail`)."""

from __future__ import annotations

import torch

from labkit.core.validate import check_int

from .batch import ForwardBatch
from .buckets import pad_to_bucket
from .buffers import Pad
from .runner import DecodeGraphRunner

__all__ = ["demo_stale_tail"]


def demo_stale_tail(runner: DecodeGraphRunner, batch: ForwardBatch, buffer: str = "positions",
                    stale_value: int | None = None) -> torch.Tensor:
    """Replay ``batch`` with ``buffer``'s padding tail NOT cleared and a stale,
    out-of-range value sitting in it — what another user of a shared buffer (or a larger
    table from an earlier run) can leave behind.

    The padded rows then gather/scatter through that value: on the CPU (emulator) the
    op raises ``IndexError``; on a GPU it is a device-side assert or an illegal memory
    access that poisons the CUDA context, so run it in a subprocess there.
    ``batch`` must not fill its bucket exactly (it needs a tail).
    """
    if not isinstance(runner, DecodeGraphRunner):
        raise TypeError(f"demo_stale_tail: runner must be a DecodeGraphRunner, got "
                        f"{type(runner).__name__}")
    runner.check_replayable(batch, "demo_stale_tail")
    raw = batch.batch_size
    bs = pad_to_bucket(raw, runner.buckets)
    if bs == raw:
        raise ValueError(f"batch of {raw} fills bucket {bs} exactly: no padding tail to go stale")
    m = runner.model
    table_size = {"positions": m.args.max_seq_len,         # rows of the rotary table
                  "req_pool_indices": m.num_slots,         # rows of req_to_token
                  "out_cache_loc": m.req_to_token.numel()}  # locations in the KV pool
    if buffer not in table_size:
        raise ValueError(f"{buffer!r} is not an index buffer; choose one of {list(table_size)}")
    if stale_value is None:
        stale_value = table_size[buffer] + 1000
    else:
        check_int("stale_value", stale_value, None)
    slot = runner.buffers.slots[buffer]
    k = runner.num_tokens_per_bs
    slot.tensor[slot.rows(raw, k):slot.rows(bs, k)] = stale_value
    # A replay with a padding_override always loads the batch again (never the fast path),
    # with this buffer's tail left as it is now.
    return runner.replay(batch, padding_override={buffer: Pad.HEAD_ONLY})
