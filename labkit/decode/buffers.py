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

The five decode inputs are typed views of one device buffer, ``arena``: :meth:`StaticBuffers.stage`
fills them, padding included, from host values with one pinned, non-blocking copy (the
overlapped serving loop's path; :meth:`StaticBuffers.fill_from` loads a batch of device
tensors instead).

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

from labkit.core.validate import check_int

__all__ = ["Pad", "GraphSlot", "StaticBuffers", "SEQ_LEN_FILL_VALUE", "pinned_zeros",
           "ints_to_device"]

SEQ_LEN_FILL_VALUE = 1


def pinned_zeros(shape, dtype: torch.dtype, device) -> torch.Tensor:
    """Zeros in host memory for copies to and from ``device``: pinned (page-locked) when
    ``device`` is not the host, so a ``non_blocking`` copy overlaps the host's work.

    ``.pin_memory()``, not ``pin_memory=True``: the emulated device has no pinned
    allocator of its own, and both backends pin this way. ``device="cpu"`` explicitly:
    host memory whatever ``torch.set_default_device`` says."""
    host = torch.zeros(shape, dtype=dtype, device="cpu")
    return host if torch.device(device).type == "cpu" else host.pin_memory()


def ints_to_device(rows, device, dtype: torch.dtype = torch.int64) -> list[torch.Tensor]:
    """Lists of host ints → ``dtype`` tensors on ``device``, in ONE non-blocking copy.

    ``torch.tensor(values, device="cuda")`` copies from pageable memory, and PyTorch makes
    a blocking host→device copy wait for the stream: every such call drains the GPU's
    queue. Here the lists go into one pinned host tensor and cross in one non-blocking
    copy, whose pinned block PyTorch's host allocator keeps until the copy has run; the
    returned tensors are views of the one device tensor.
    """
    rows = [list(r) for r in rows]
    flat = torch.tensor([v for r in rows for v in r], dtype=dtype, device="cpu")
    if torch.device(device).type == "cpu":
        whole = flat
    else:
        whole = flat.pin_memory().to(device, non_blocking=True)
    return list(whole.split([len(r) for r in rows]))


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
        self.max_bs = check_int("StaticBuffers: max_bs", max_bs, 1,
                                fix="the largest batch (requests) a graph replays")
        self.num_tokens_per_bs = check_int("StaticBuffers: num_tokens_per_bs",
                                           num_tokens_per_bs, 1,
                                           fix="the tokens each request feeds per step")
        self.max_num_token = max_bs * num_tokens_per_bs
        self.slots: dict[str, GraphSlot] = {}
        n, b = self.max_num_token, max_bs
        # The five inputs of a decode step live in ONE device buffer (``arena``), each a
        # typed view of its own bytes, so that one host→device copy can fill them all
        # (:meth:`stage`). SGLang keeps one tensor per field; this layout is labkit's own.
        # int64 fields first, then int32.
        self._layout: list[tuple[str, torch.dtype, int, int]] = []  # name, dtype, offset, bytes
        offset = 0
        for name, dtype, rows in (("input_ids", torch.int64, n),
                                  ("req_pool_indices", torch.int64, b),
                                  ("out_cache_loc", torch.int64, n),
                                  ("positions", torch.int64, n), ("seq_lens", torch.int32, b)):
            self._layout.append((name, dtype, offset, rows * dtype.itemsize))
            offset += rows * dtype.itemsize
        self.arena = torch.zeros(offset, dtype=torch.uint8, device=device)
        views = {name: self.arena[o:o + nb].view(dtype) for name, dtype, o, nb in self._layout}
        views["seq_lens"].fill_(seq_len_fill_value)
        self.register("input_ids", views["input_ids"], Pad.HEAD_ONLY, per_token=True)
        self.register("req_pool_indices", views["req_pool_indices"], Pad.ZERO_TAIL,
                      per_token=False)
        self.register("seq_lens", views["seq_lens"], Pad.SENTINEL, per_token=False,
                      fill_value=seq_len_fill_value)
        self.register("out_cache_loc", views["out_cache_loc"], Pad.ZERO_TAIL, per_token=True)
        self.register("positions", views["positions"], Pad.ZERO_TAIL, per_token=True)
        self._staging: list | None = None   # pinned host mirrors of the arena, see stage()
        self._turn = 0

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
        self._check_rows(raw_bs, padded_bs, "fill_from")
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

    def stage(self, values: dict[str, list[int]], raw_bs: int, padded_bs: int, B) -> None:
        """Fill the arena's buffers from host values with ONE non-blocking copy.

        ``values`` maps each of the arena's buffers to its ``raw`` head (Python ints);
        ``input_ids`` may be left out, and then keeps what is on the device (the
        overlapped serving loop writes the next tokens there on the device). The tails
        up to ``padded_bs`` follow each buffer's policy, written on the host too. The
        values go into a pinned host mirror of the arena, and one ``copy_(...,
        non_blocking=True)`` moves the whole arena: the host goes on at once, and the copy
        runs on the current stream, after the replay queued before it.

        .. warning::
            The host must not rewrite a pinned buffer whose copy has not run yet: the copy
            reads it when the stream reaches it, not when it is queued. So there are two
            mirrors, used in turn, and each is rewritten only after the event recorded
            behind its last copy has passed.
        """
        need = {n for n, *_ in self._layout} - {"input_ids"}
        if not need <= set(values) or not set(values) <= need | {"input_ids"}:
            raise ValueError(f"stage: give values for {sorted(need)} (and optionally "
                             f"input_ids), got {sorted(values)}")
        self._check_rows(raw_bs, padded_bs, "stage")
        if self._staging is None:
            self._staging = [self._pinned_mirror() for _ in range(2)]
        host, views, done = self._staging[self._turn]
        if done is not None:
            done.synchronize()            # this mirror's last copy has been read
        k = self.num_tokens_per_bs
        for name, *_ in self._layout:
            slot, mirror = self.slots[name], views[name]
            raw, padded = slot.rows(raw_bs, k), slot.rows(padded_bs, k)
            if name in values:
                head = values[name]
                if len(head) != raw:
                    raise ValueError(f"stage: {name} has {len(head)} values, expected {raw}")
                mirror[:raw] = head
            if slot.pad is not Pad.HEAD_ONLY:
                mirror[raw:padded] = slot.fill_value
        start = 0 if "input_ids" in values else self._layout[1][2]   # input_ids comes first
        self.arena[start:].copy_(host[start:], non_blocking=True)
        event = B.Event()
        event.record()
        self._staging[self._turn] = (host, views, event)
        self._turn ^= 1

    def _check_rows(self, raw_bs: int, padded_bs: int, fn: str) -> None:
        """0 <= raw_bs <= padded_bs, and every buffer holds the rows of padded_bs: the real
        rows, then the bucket they pad to."""
        check_int(f"{fn}: padded_bs", padded_bs, 1, fix="the bucket replayed")
        check_int(f"{fn}: raw_bs", raw_bs, 0, padded_bs,
                  fix=f"the batch's requests, padded up to padded_bs={padded_bs}")
        for slot in self.slots.values():
            need = slot.rows(padded_bs, self.num_tokens_per_bs)
            have = slot.tensor.shape[slot.row_dim]
            if need > have:
                raise ValueError(f"{fn}: padded_bs={padded_bs} needs {need} rows of "
                                 f"{slot.name}, which holds {have} (max_bs={self.max_bs}): "
                                 "replay a bucket the buffers hold")

    def _pinned_mirror(self) -> tuple:
        """A host copy of the arena in pinned (page-locked) memory, which a non-blocking
        copy can read while the host goes on, and numpy views of its fields."""
        host = pinned_zeros(self.arena.shape, torch.uint8, self.arena.device)
        views = {name: host[o:o + nb].view(dtype).numpy() for name, dtype, o, nb in self._layout}
        return host, views, None

    def view(self, bs: int) -> dict[str, torch.Tensor]:
        """The first rows of every buffer for a bucket of ``bs`` requests (views, same
        addresses as the full buffers: what a graph captured for ``bs`` reads)."""
        k = self.num_tokens_per_bs
        return {n: s.part(0, s.rows(bs, k)) for n, s in self.slots.items()}

    def nbytes(self) -> int:
        return sum(s.tensor.numel() * s.tensor.element_size() for s in self.slots.values())
