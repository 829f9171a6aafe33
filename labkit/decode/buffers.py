"""Static input buffers sized by ``max_bs``, each with its own padding policy.

A captured graph reads its inputs from fixed addresses, so the runner allocates every
input once, at the largest shape (as SGLang's decode CUDA-graph runner does), and before
each replay copies the real batch into the *head* of each buffer. What happens to the
*tail*, the padding rows up to the bucket size, is decided per buffer (a ``GraphSlot``
with its ``PaddingPolicy`` in SGLang's ``CudaGraphBufferRegistry``):

* ``HEAD_ONLY`` (``input_ids``): left alone; any earlier token id is valid and padded
  rows' results are thrown away.
* ``ZERO_TAIL`` (``req_pool_indices``, ``positions``, ``out_cache_loc``): zeroed; these
  are indices, and 0 points at the dummy slot that absorbs padded rows.
* ``SENTINEL`` (``seq_lens``): filled with 1, so a padded row sees exactly its dummy key.

A multimodal model adds ``mrope_positions`` (three rotary position ids per token, rows
along dim 1: see :class:`GraphSlot`).

.. warning::
    A stale *index* in a tail may point into a live request's KV cache (a padded row then
    overwrites a real key, silently) or past a table's end (an index error on the CPU, an
    illegal memory access or a device-side assert on a GPU). A ``seq_lens`` tail of 0
    masks every key and turns the row's softmax into NaN.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

__all__ = ["Pad", "GraphSlot", "StaticBuffers", "SEQ_LEN_FILL_VALUE"]

SEQ_LEN_FILL_VALUE = 1


class Pad(str, enum.Enum):
    HEAD_ONLY = "head_only"
    ZERO_TAIL = "zero_tail"
    SENTINEL = "sentinel"


@dataclass
class GraphSlot:
    """One static buffer: its tensor, its padding policy, and whether it has a row per
    request (``per_token=False``) or per token (``per_token=True``).

    ``row_dim`` is the dimension that holds the rows: 0 for every buffer above, 1 for a
    buffer such as SGLang's multimodal rotary positions ``mrope_positions``, shaped
    ``(3, max_num_token)`` (three position ids per token: time, height, width), whose
    head and tail are ``tensor[:, :raw]`` and ``tensor[:, raw:padded]``.
    """

    name: str
    tensor: torch.Tensor
    pad: Pad
    per_token: bool
    fill_value: int = 0
    row_dim: int = 0

    def rows(self, bs: int, tokens_per_bs: int) -> int:
        return bs * tokens_per_bs if self.per_token else bs

    def part(self, lo: int, hi: int) -> torch.Tensor:
        """Rows ``lo..hi`` along ``row_dim`` (a view: same storage as the buffer)."""
        return self.tensor.narrow(self.row_dim, lo, hi - lo)


class StaticBuffers:
    """The registry of a runner's static inputs. ``buffers.input_ids`` etc. are the full
    ``max_bs``-sized tensors; :meth:`fill_from` loads a batch into them."""

    def __init__(self, max_bs: int, num_tokens_per_bs: int = 1, device=None,
                 seq_len_fill_value: int = SEQ_LEN_FILL_VALUE):
        self.max_bs = max_bs
        self.num_tokens_per_bs = num_tokens_per_bs
        self.max_num_token = max_bs * num_tokens_per_bs
        self.slots: dict[str, GraphSlot] = {}
        n, b = self.max_num_token, max_bs
        i64 = dict(dtype=torch.int64, device=device)
        self.register("input_ids", torch.zeros(n, **i64), Pad.HEAD_ONLY, per_token=True)
        self.register("req_pool_indices", torch.zeros(b, **i64), Pad.ZERO_TAIL, per_token=False)
        self.register("seq_lens", torch.full((b,), seq_len_fill_value, dtype=torch.int32,
                                             device=device),
                      Pad.SENTINEL, per_token=False, fill_value=seq_len_fill_value)
        self.register("out_cache_loc", torch.zeros(n, **i64), Pad.ZERO_TAIL, per_token=True)
        self.register("positions", torch.zeros(n, **i64), Pad.ZERO_TAIL, per_token=True)

    def register(self, name: str, tensor: torch.Tensor, pad: Pad | str, per_token: bool,
                 fill_value: int = 0, row_dim: int = 0) -> GraphSlot:
        """Add a static buffer (allocated once, at its largest shape) with its padding
        policy. ``row_dim``: the dimension of its rows (see :class:`GraphSlot`)."""
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"register({name!r}): expected a tensor, got {type(tensor).__name__}")
        if not 0 <= row_dim < tensor.dim():
            raise ValueError(f"register({name!r}): row_dim={row_dim} but the tensor has "
                             f"{tensor.dim()} dimension(s), shape {tuple(tensor.shape)}")
        need = self.max_num_token if per_token else self.max_bs
        if tensor.shape[row_dim] < need:
            raise ValueError(f"register({name!r}): {tensor.shape[row_dim]} rows along dim "
                             f"{row_dim}, but a full bucket needs {need} "
                             f"({'max_bs x tokens per request' if per_token else 'max_bs'})")
        slot = GraphSlot(name, tensor, Pad(pad), per_token, fill_value, row_dim)
        self.slots[name] = slot
        return slot

    def __getattr__(self, name: str) -> torch.Tensor:
        slots = self.__dict__.get("slots", {})
        if name in slots:
            return slots[name].tensor
        raise AttributeError(name)

    def policies(self) -> dict[str, str]:
        return {n: s.pad.value for n, s in self.slots.items()}

    def fill_from(self, batch, raw_bs: int, padded_bs: int,
                  override: dict[str, Pad | str] | None = None) -> None:
        """Copy ``batch`` into the heads; treat rows ``raw..padded`` by each policy.

        Args:
            batch: the real batch (a ``ForwardBatch``): one tensor per buffer name.
            raw_bs: its number of requests.
            padded_bs: the bucket it replays.
            override: ``{buffer: policy}`` for this call only, for demonstrations of what
                goes wrong (e.g. ``{"positions": "head_only"}`` leaves a stale tail).
        """
        override = {name: Pad(pad) for name, pad in (override or {}).items()}
        k = self.num_tokens_per_bs
        zero_tails, heads, srcs = [], [], []
        for name, slot in self.slots.items():
            raw, padded = slot.rows(raw_bs, k), slot.rows(padded_bs, k)
            pad = override.get(name, slot.pad)
            if pad is Pad.ZERO_TAIL:
                zero_tails.append(slot.part(raw, padded))
            elif pad is Pad.SENTINEL:
                slot.part(raw, padded).fill_(slot.fill_value)
            head, src = slot.part(0, raw), getattr(batch, name)
            if tuple(src.shape) != tuple(head.shape):
                raise ValueError(f"{name}: batch has shape {tuple(src.shape)}, expected "
                                 f"{tuple(head.shape)} ({raw} rows)")
            heads.append(head)
            srcs.append(src.to(head.dtype))
        if zero_tails:
            torch._foreach_zero_(zero_tails)  # every index tail in one call
        torch._foreach_copy_(heads, srcs)     # every head in one call

    def view(self, bs: int) -> dict[str, torch.Tensor]:
        """The first rows of every buffer for a bucket of ``bs`` requests (views, same
        addresses as the full buffers: what a graph captured for ``bs`` reads)."""
        k = self.num_tokens_per_bs
        return {n: s.part(0, s.rows(bs, k)) for n, s in self.slots.items()}

    def nbytes(self) -> int:
        return sum(s.tensor.numel() * s.tensor.element_size() for s in self.slots.values())
