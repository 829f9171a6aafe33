"""What one forward pass receives: the forward mode and a bundle of flat tensors.

SGLang calls this a ``ForwardBatch``. Its tensors are what the CUDA graph's static buffers
hold (see :mod:`labkit.decode.buffers`); its ``*_cpu`` lists are host-side copies the
scheduler already has, so nothing here needs a device→host sync to read a length.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Sequence

import torch

__all__ = ["ForwardMode", "ForwardBatch", "make_decode_batch", "make_extend_batch"]


class ForwardMode(enum.Enum):
    EXTEND = "extend"                # prefill: variable tokens per request
    DECODE = "decode"                # one new token per request
    TARGET_VERIFY = "target_verify"  # spec decode: k draft tokens per request, checked at once
    IDLE = "idle"                    # nothing to do (a rank with no requests)

    def is_cuda_graph(self) -> bool:
        """Only fixed-shape-per-batch-size modes may replay a graph (SGLang's table)."""
        return self in (ForwardMode.DECODE, ForwardMode.TARGET_VERIFY, ForwardMode.IDLE)

    def is_extend(self) -> bool:
        return self is ForwardMode.EXTEND


@dataclass
class ForwardBatch:
    """One step's inputs. Token tensors are flat: ``num_tokens = batch_size * tokens/request``
    for DECODE / TARGET_VERIFY, the sum of ``extend_lens`` for EXTEND.

    input_ids        (num_tokens,) int64  token ids to feed
    positions        (num_tokens,) int64  each token's position in its request
    out_cache_loc    (num_tokens,) int64  KV-pool location each new token's K/V goes to
    req_pool_indices (batch_size,) int64  each request's slot (row of req_to_token)
    seq_lens         (batch_size,) int32  each request's length *including* the new tokens
    seq_lens_cpu     host copy of seq_lens (a list of ints)
    extend_lens      EXTEND only: new tokens per request (host ints)
    """

    forward_mode: ForwardMode
    input_ids: torch.Tensor
    positions: torch.Tensor
    out_cache_loc: torch.Tensor
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    seq_lens_cpu: list[int]
    extend_lens: list[int] | None = None
    # Set by whoever ran init_forward_metadata_out_graph for this batch ahead of time
    # (SGLang's plan stream). The runner's fast path relies on it.
    metadata_ready: bool = False
    attn_backend: object = field(default=None, repr=False)

    @property
    def batch_size(self) -> int:
        return self.req_pool_indices.numel()

    @property
    def num_tokens(self) -> int:
        return self.input_ids.numel()

    @property
    def num_tokens_per_bs(self) -> int:
        return self.num_tokens // max(self.batch_size, 1)

    def needs_forward_metadata_init(self) -> bool:
        return not self.metadata_ready


def make_decode_batch(model, slots: Sequence[int], tokens: Sequence[Sequence[int]] | Sequence[int],
                      start_positions: Sequence[int],
                      mode: ForwardMode = ForwardMode.DECODE) -> ForwardBatch:
    """A DECODE (one token each) or TARGET_VERIFY (k tokens each) batch.

    ``tokens[i]`` is the token (or list of k tokens) request i feeds at positions
    ``start_positions[i], start_positions[i] + 1, ...``; its K/V goes to
    ``req_to_token[slots[i], position]``.
    """
    rows = [[t] if isinstance(t, int) else list(t) for t in tokens]
    k = len(rows[0]) if rows else 1
    if any(len(r) != k for r in rows):
        raise ValueError("every request in a decode/verify batch feeds the same number of tokens")
    dev = model.device
    bs, n = len(rows), len(rows) * k
    pos = [p + j for p in start_positions for j in range(k)]
    seq_lens = [p + k for p in start_positions]
    num_rows, width = model.req_to_token.shape
    if pos and (min(pos) < 0 or max(pos) >= width):
        raise IndexError(f"a position in {min(pos)}..{max(pos)} is outside req_to_token's "
                         f"{width} columns (max_seq_len)")
    if slots and (min(slots) < 0 or max(slots) >= num_rows):
        raise IndexError(f"a slot in {list(slots)} is outside req_to_token's {num_rows} rows")
    flat = [slots[i // k] * width + pos[i] for i in range(n)]  # row-major index into the table
    # Everything the device needs in ONE host→device copy (a pageable copy each would
    # cost a launch and a wait apiece); the batch's tensors are views of it.
    packed = torch.tensor([t for r in rows for t in r] + pos + flat + list(slots) + seq_lens,
                          dtype=torch.int64, device=dev)
    ids_t, pos_t, flat_t = packed[:n], packed[n:2 * n], packed[2 * n:3 * n]
    return ForwardBatch(
        forward_mode=mode,
        input_ids=ids_t,
        positions=pos_t,
        out_cache_loc=model.req_to_token.reshape(-1).index_select(0, flat_t),
        req_pool_indices=packed[3 * n:3 * n + bs],
        seq_lens=packed[3 * n + bs:].to(torch.int32),
        seq_lens_cpu=seq_lens,
    )


def make_extend_batch(model, slots: Sequence[int], prompts: Sequence[Sequence[int]],
                      prefix_lens: Sequence[int] | None = None) -> ForwardBatch:
    """An EXTEND (prefill) batch: request i feeds ``prompts[i]`` after ``prefix_lens[i]``
    tokens already in its slot (0 for a fresh request)."""
    prefix_lens = list(prefix_lens) if prefix_lens is not None else [0] * len(slots)
    dev = model.device
    ids, pos, slot_rep = [], [], []
    for s, p, pre in zip(slots, prompts, prefix_lens):
        ids += list(p)
        pos += range(pre, pre + len(p))
        slot_rep += [s] * len(p)
    pos_t = torch.tensor(pos, dtype=torch.int64, device=dev)
    seq_lens = [pre + len(p) for p, pre in zip(prompts, prefix_lens)]
    return ForwardBatch(
        forward_mode=ForwardMode.EXTEND,
        input_ids=torch.tensor(ids, dtype=torch.int64, device=dev),
        positions=pos_t,
        out_cache_loc=model.req_to_token[torch.tensor(slot_rep, dtype=torch.int64, device=dev),
                                         pos_t],
        req_pool_indices=torch.tensor(list(slots), dtype=torch.int64, device=dev),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
        seq_lens_cpu=seq_lens,
        extend_lens=[len(p) for p in prompts],
    )
