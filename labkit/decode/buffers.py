"""Static input buffers sized by ``max_bs``, each with its own padding policy.

A captured graph reads its inputs from fixed addresses, so the runner allocates every
input once, at the largest shape (SGLang's ``decode_cuda_graph_runner.py``)::

    input_ids        = zeros(max_num_token)          int64
    req_pool_indices = zeros(max_bs)                  int64
    seq_lens         = full(max_bs, fill_value)       int32   # a sentinel
    out_cache_loc    = zeros(max_num_token)           int64
    positions        = zeros(max_num_token)           int64

(a multimodal model adds ``mrope_positions = zeros(3, max_num_token)``, the three rotary
position ids of each token: rows along dim 1, see :class:`GraphSlot`), and before each
replay copies the real batch into the *head* of each buffer. What to do
with the *tail* — the padding rows between the real batch and the bucket size — is a
per-buffer decision (SGLang's ``CudaGraphBufferRegistry`` / ``GraphSlot``):

HEAD_ONLY  (input_ids)
    leave the tail alone. Whatever an earlier batch left there is a valid token id, and
    padded rows' results are thrown away, so stale values are harmless.
ZERO_TAIL  (req_pool_indices, positions, out_cache_loc)
    zero the tail. These are *indices*: padded rows gather and scatter through them. A
    stale value may point into a live request's KV cache (silent corruption: the padded
    row overwrites a real key) or past the end of a table (an index error on the CPU, an
    illegal memory access on a GPU). Zero points at the dummy slot / location 0, which
    exists precisely to absorb padded rows.
SENTINEL   (seq_lens)
    fill the tail with a fixed value (1): a padded row then sees exactly one key (its
    dummy one). 0 would mask every key and turn the row's softmax into NaN; a stale
    length would make it read keys it has no business with.

Each tail is set by its policy (the zero tails with one ``torch._foreach_zero_``), and every
head is copied with **one** ``torch._foreach_copy_`` (one call for the lot instead of one
per buffer).
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
