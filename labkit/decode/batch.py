"""What one forward pass receives: the forward mode and a bundle of flat tensors.

SGLang calls this a ``ForwardBatch``. Its tensors are what the CUDA graph's static buffers
hold (see :mod:`labkit.decode.buffers`); its ``*_cpu`` lists are host-side copies the
scheduler already has, so nothing here needs a device→host sync to read a length.

Build batches with :func:`make_decode_batch` / :func:`make_extend_batch`: they check every
token id, position and slot on the host (free: they are Python ints there) before any of
it reaches a device tensor, let alone a graph's static buffer.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Sequence

import torch

from labkit.core.validate import check_int, is_int

from .buffers import ints_to_device

__all__ = ["ForwardMode", "ForwardBatch", "make_decode_batch", "make_extend_batch", "check_batch",
           "check_model", "check_slots", "check_tokens"]

# The reserved request slot (also labkit.decode.model.DUMMY_SLOT): a bucket's padded rows
# write their throw-away K/V there, so no real request may own it.
_DUMMY_SLOT = 0


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


# The fields attention metadata is planned from (a plan goes stale when one changes), and
# the ones a fast-path replay copies again (they may change between plan and replay).
METADATA_FIELDS = ("req_pool_indices", "seq_lens", "out_cache_loc")
INPUT_FIELDS = ("input_ids", "positions")


def _record(batch: "ForwardBatch", names: Sequence[str]) -> tuple:
    """What a batch's tensors are *now*: each tensor itself (kept alive, so compared by
    identity: its id can never be reused by a new tensor) and its version counter (bumped
    by every in-place write: ``add_``, ``copy_``, ``t[i] = v``), plus the host lists."""
    tensors = tuple(getattr(batch, n) for n in names)
    return (names, tensors, tuple(t._version for t in tensors), list(batch.seq_lens_cpu),
            None if batch.extend_lens is None else list(batch.extend_lens), batch.forward_mode)


def _unchanged(record: tuple | None, batch: "ForwardBatch") -> bool:
    """Is ``batch`` still what ``record`` saw? Attribute reads only, no device work."""
    if record is None:
        return False
    names, tensors, versions, lens, ext, mode = record
    for name, t, v in zip(names, tensors, versions):
        now = getattr(batch, name)
        if now is not t or now._version != v:
            return False
    return (batch.forward_mode is mode and batch.seq_lens_cpu == lens
            and (batch.extend_lens == ext if ext is not None else batch.extend_lens is None))


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

    .. warning::
        A batch describes ONE step. Updating its fields in place for the next step (as a
        serving loop might) is detected — :meth:`needs_forward_metadata_init` compares
        the fields with the record taken when it was planned, and the runner re-plans —
        but building a new batch per step (:func:`make_decode_batch`) is the clear way.
    """

    forward_mode: ForwardMode
    input_ids: torch.Tensor
    positions: torch.Tensor
    out_cache_loc: torch.Tensor
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    seq_lens_cpu: list[int]
    extend_lens: list[int] | None = None
    # Set by the runner's plan() (SGLang's plan stream: mark_forward_metadata_ready right
    # next to the planning). The fast path relies on it; set it to False to force a re-plan.
    metadata_ready: bool = False
    attn_backend: object = field(default=None, repr=False)
    # Where the attention op writes its output, when the caller needs it at a fixed
    # address (the piecewise runner: the next piece's static input, so no copy follows;
    # vLLM's attention op takes its output buffer the same way). None: a new tensor.
    attn_out: torch.Tensor | None = field(default=None, repr=False, compare=False)
    # The plan record (fields as they were when planned) and the record of the values the
    # constructor checked on the host: compared by identity + version, never by a sync.
    _plan_record: tuple | None = field(default=None, repr=False, compare=False)
    _checked_record: tuple | None = field(default=None, repr=False, compare=False)

    @property
    def batch_size(self) -> int:
        return self.req_pool_indices.numel()

    @property
    def num_tokens(self) -> int:
        return self.input_ids.numel()

    @property
    def num_tokens_per_bs(self) -> int:
        return self.num_tokens // max(self.batch_size, 1)

    def mark_forward_metadata_ready(self) -> None:
        """Record that this batch's metadata was planned (the runner's ``plan`` calls it),
        and what its metadata fields were at that moment (SGLang's plan record)."""
        self.metadata_ready = True
        self._plan_record = _record(self, METADATA_FIELDS)

    def needs_forward_metadata_init(self) -> bool:
        """Must the forward path plan this batch? Yes unless it was planned and none of
        the fields the plan was made from (slots, ``seq_lens``, ``seq_lens_cpu``, cache
        locations, mode) changed since: a batch reused for the next step is re-planned,
        never replayed with the previous step's lengths."""
        return not (self.metadata_ready and _unchanged(self._plan_record, self))

    def mark_values_checked(self) -> None:
        """Record that every value was checked on the host (the constructors call it)."""
        self._checked_record = _record(self, METADATA_FIELDS + INPUT_FIELDS)

    def values_unchanged_since_check(self) -> bool:
        """True while no tensor or host list changed since :meth:`mark_values_checked`."""
        return _unchanged(self._checked_record, self)


# ---- checks on host values (no device work) ----------------------------------------------

def _int_list(name: str, values, what: str) -> list[int]:
    """``values`` as a list of Python ints, or a TypeError naming the first bad entry."""
    if isinstance(values, (str, bytes)) or not hasattr(values, "__len__"):
        raise TypeError(f"{name} must be a list of {what} (ints), got {type(values).__name__}")
    if isinstance(values, torch.Tensor):
        values = values.tolist()
    out = []
    for i, v in enumerate(values):
        out.append(check_int(f"{name}[{i}]", v, None, fix=f"{name} holds {what}"))
    return out


def check_model(model, fn: str) -> None:
    """``model`` is a labkit.decode Transformer with its caches set up, or a TypeError that
    names what ``fn`` was given."""
    if not hasattr(model, "req_to_token") or getattr(model, "num_slots", 0) == 0:
        raise TypeError(f"{fn}: model must be a labkit.decode Transformer with caches set up "
                        f"(build_model(...)), got {type(model).__name__}")


def check_slots(slots: list[int], num_rows: int, fn: str) -> None:
    """Each request slot (ints) is a live one (``1..num_rows - 1``: never the dummy slot)
    and owns its row alone, or a ValueError naming the first bad slot and why."""
    live = f"1..{num_rows - 1}"
    for i, s in enumerate(slots):
        if s == _DUMMY_SLOT:
            raise ValueError(
                f"{fn}: slots[{i}] is {_DUMMY_SLOT}, the reserved dummy slot (padded rows of "
                f"every bucket write their throw-away K/V there, so a request in it would be "
                f"overwritten). Use slots {live}.")
        if not 0 < s < num_rows:
            raise ValueError(f"{fn}: slots[{i}] = {s} is outside the model's request slots "
                             f"{live} (build_model(max_requests=...) sets how many)")
    if len(set(slots)) != len(slots):
        dup = sorted({s for s in slots if slots.count(s) > 1})
        raise ValueError(f"{fn}: slot(s) {dup} appear more than once: each request of a batch "
                         "owns its own slot (two rows writing one slot's cache would race)")


def check_tokens(ids: list[int], vocab: int, fn: str, where: str) -> None:
    """Every token id (ints) is in the vocabulary, or a ValueError naming the first one outside
    it and ``where`` it was."""
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise ValueError(f"{fn}: token id {bad[0]} in {where} is outside the vocabulary "
                         f"0..{vocab - 1} (model.args.vocab_size = {vocab})")


def _same_length(fn: str, **lists) -> None:
    lens = {k: len(v) for k, v in lists.items()}
    if len(set(lens.values())) > 1:
        given = ", ".join(f"{k}: {n}" for k, n in lens.items())
        raise ValueError(f"{fn}: one entry per request in each list, got lengths {given}")


def make_decode_batch(model, slots: Sequence[int], tokens: Sequence[Sequence[int]] | Sequence[int],
                      start_positions: Sequence[int],
                      mode: ForwardMode = ForwardMode.DECODE) -> ForwardBatch:
    """A DECODE (one token each) or TARGET_VERIFY (k tokens each) batch.

    ``tokens[i]`` is the token (or list of k tokens) request i feeds at positions
    ``start_positions[i], start_positions[i] + 1, ...``; its K/V goes to
    ``req_to_token[slots[i], position]``.

    .. warning::
        Every value is checked here, on the host, before it reaches a device tensor: a
        token id outside the vocabulary would become a device-side assert on a GPU (which
        kills the process), and a request in the dummy slot 0 would share the padded rows'
        cache. Slots are ``1..model.num_slots - 1``, distinct.
    """
    fn = "make_decode_batch"
    check_model(model, fn)
    if not isinstance(mode, ForwardMode) or mode not in (ForwardMode.DECODE,
                                                         ForwardMode.TARGET_VERIFY):
        raise ValueError(f"{fn}: mode must be ForwardMode.DECODE or ForwardMode.TARGET_VERIFY, "
                         f"got {mode!r} (prefill batches come from make_extend_batch)")
    slots = _int_list("slots", slots, "request slots")
    start_positions = _int_list("start_positions", start_positions, "positions")
    if isinstance(tokens, torch.Tensor):
        tokens = tokens.tolist()
    if isinstance(tokens, (str, bytes)) or not hasattr(tokens, "__len__"):
        raise TypeError(f"{fn}: tokens must be a list (one token, or one list of k tokens, "
                        f"per request), got {type(tokens).__name__}")
    rows = [[t] if is_int(t) else _int_list(f"tokens[{i}]", t, "token ids")
            for i, t in enumerate(tokens)]
    _same_length(fn, slots=slots, tokens=rows, start_positions=start_positions)
    if not rows:
        raise ValueError(f"{fn}: no requests (empty slots/tokens): a decode batch has at "
                         "least one request; skip the step when nothing is running")
    k = len(rows[0])
    if k == 0 or any(len(r) != k for r in rows):
        raise ValueError(f"{fn}: every request in a decode/verify batch feeds the same number "
                         f"(>= 1) of tokens, got {sorted({len(r) for r in rows})}")
    if mode is ForwardMode.DECODE and k != 1:
        raise ValueError(f"{fn}: a DECODE batch feeds one token per request, got {k}; pass "
                         "mode=ForwardMode.TARGET_VERIFY to verify k draft tokens")
    num_rows, width = model.req_to_token.shape
    check_slots(slots, num_rows, fn)
    check_tokens([t for r in rows for t in r], model.args.vocab_size, fn, "tokens")
    for i, p in enumerate(start_positions):
        if not 0 <= p <= width - k:
            raise ValueError(f"{fn}: start_positions[{i}] = {p}: its {k} token(s) need "
                             f"positions {p}..{p + k - 1}, outside 0..{width - 1} "
                             f"(max_seq_len = {width})")
    dev = model.device
    bs, n = len(rows), len(rows) * k
    pos = [p + j for p in start_positions for j in range(k)]
    seq_lens = [p + k for p in start_positions]
    flat = [slots[i // k] * width + pos[i] for i in range(n)]  # row-major index into the table
    # Everything the device needs in ONE host→device copy (a pageable copy each would
    # cost a launch and a wait apiece); the batch's tensors are views of it.
    packed = torch.tensor([t for r in rows for t in r] + pos + flat + slots + seq_lens,
                          dtype=torch.int64, device=dev)
    ids_t, pos_t, flat_t = packed[:n], packed[n:2 * n], packed[2 * n:3 * n]
    batch = ForwardBatch(
        forward_mode=mode,
        input_ids=ids_t,
        positions=pos_t,
        out_cache_loc=model.req_to_token.reshape(-1).index_select(0, flat_t),
        req_pool_indices=packed[3 * n:3 * n + bs],
        seq_lens=packed[3 * n + bs:].to(torch.int32),
        seq_lens_cpu=seq_lens,
    )
    batch.mark_values_checked()
    return batch


def make_extend_batch(model, slots: Sequence[int], prompts: Sequence[Sequence[int]],
                      prefix_lens: Sequence[int] | None = None) -> ForwardBatch:
    """An EXTEND (prefill) batch: request i feeds ``prompts[i]`` after ``prefix_lens[i]``
    tokens already in its slot (0 for a fresh request).

    .. warning::
        Checked on the host like :func:`make_decode_batch`: slots ``1..num_slots - 1``
        (slot 0 is the dummy slot), distinct; token ids inside the vocabulary; every
        prompt non-empty and ``prefix_len + len(prompt) <= max_seq_len``.
    """
    fn = "make_extend_batch"
    check_model(model, fn)
    slots = _int_list("slots", slots, "request slots")
    if isinstance(prompts, (str, bytes)) or not hasattr(prompts, "__len__"):
        raise TypeError(f"{fn}: prompts must be a list of token-id lists, got "
                        f"{type(prompts).__name__}")
    prompts = [_int_list(f"prompts[{i}]", p, "token ids") for i, p in enumerate(prompts)]
    prefix_lens = (_int_list("prefix_lens", prefix_lens, "token counts")
                   if prefix_lens is not None else [0] * len(slots))
    _same_length(fn, slots=slots, prompts=prompts, prefix_lens=prefix_lens)
    if not prompts:
        raise ValueError(f"{fn}: no requests (empty slots/prompts): nothing to prefill")
    num_rows, width = model.req_to_token.shape
    check_slots(slots, num_rows, fn)
    for i, (p, pre) in enumerate(zip(prompts, prefix_lens)):
        if not p:
            raise ValueError(f"{fn}: prompts[{i}] is empty: a prefill feeds at least one token")
        if pre < 0 or pre + len(p) > width:
            raise ValueError(f"{fn}: request {i} needs positions {pre}..{pre + len(p) - 1} "
                             f"(prefix_lens[{i}] = {pre}, {len(p)} prompt tokens), outside "
                             f"0..{width - 1} (max_seq_len = {width})")
        check_tokens(p, model.args.vocab_size, fn, f"prompts[{i}]")
    ids, pos, slot_rep = [], [], []
    for s, p, pre in zip(slots, prompts, prefix_lens):
        ids += p
        pos += range(pre, pre + len(p))
        slot_rep += [s] * len(p)
    seq_lens = [pre + len(p) for p, pre in zip(prompts, prefix_lens)]
    # One pinned, non-blocking copy for all of it: a serving loop builds this batch while
    # the GPU still runs the step before, and a blocking copy would wait for that step.
    ids_t, pos_t, slot_rep_t, slots_t, lens_t = ints_to_device(
        [ids, pos, slot_rep, slots, seq_lens], model.device)
    batch = ForwardBatch(
        forward_mode=ForwardMode.EXTEND,
        input_ids=ids_t,
        positions=pos_t,
        out_cache_loc=model.req_to_token[slot_rep_t, pos_t],
        req_pool_indices=slots_t,
        seq_lens=lens_t.to(torch.int32),
        seq_lens_cpu=seq_lens,
        extend_lens=[len(p) for p in prompts],
    )
    batch.mark_values_checked()
    return batch


# ---- checks on a batch about to run (the runners call these) -----------------------------

_INT_DTYPES = (torch.int32, torch.int64)


def check_batch(batch, model, fn: str) -> None:
    """Everything about a batch a runner is given: its layout, then its values.

    A batch from :func:`make_decode_batch` / :func:`make_extend_batch` that nobody changed
    since costs one record comparison (identity and version of its tensors, its host
    lists): the constructor already checked it all on the host. Anything else is checked
    in full (:func:`check_batch_layout`, :func:`check_batch_values`).
    """
    if not isinstance(batch, ForwardBatch):
        raise TypeError(f"{fn}: expected a ForwardBatch (make_decode_batch / make_extend_batch), "
                        f"got {type(batch).__name__}")
    if batch.values_unchanged_since_check():
        return
    check_batch_layout(batch, model, fn)
    check_batch_values(batch, model, fn)


def check_batch_layout(batch, model, fn: str) -> None:
    """Type, dtypes, devices and shapes: attribute reads only, no device work.

    A batch with ``bs`` requests of ``k`` tokens has ``bs * k`` ids, positions and cache
    locations, ``bs`` slots and ``bs`` sequence lengths (on the device and in
    ``seq_lens_cpu``), all integer tensors on the model's device.
    """
    if not isinstance(batch, ForwardBatch):
        raise TypeError(f"{fn}: expected a ForwardBatch (make_decode_batch / make_extend_batch), "
                        f"got {type(batch).__name__}")
    if not isinstance(batch.forward_mode, ForwardMode):
        raise TypeError(f"{fn}: batch.forward_mode must be a ForwardMode, got "
                        f"{batch.forward_mode!r}")
    names = METADATA_FIELDS + INPUT_FIELDS
    for name in names:
        t = getattr(batch, name)
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{fn}: batch.{name} must be a tensor, got {type(t).__name__}")
        if t.dtype not in _INT_DTYPES:
            raise TypeError(f"{fn}: batch.{name} has dtype {t.dtype}; expected an integer "
                            "tensor (torch.int64; seq_lens torch.int32)")
        if t.device != model.device:
            raise ValueError(f"{fn}: batch.{name} is on {t.device} but the model is on "
                             f"{model.device}: build the batch with the model "
                             "(make_decode_batch(model, ...)) or move it there")
        if t.dim() != 1:
            raise ValueError(f"{fn}: batch.{name} must be flat (1-D), got shape "
                             f"{tuple(t.shape)}")
    bs, n = batch.batch_size, batch.num_tokens
    if batch.forward_mode is ForwardMode.IDLE:
        return
    if bs == 0:
        raise ValueError(f"{fn}: the batch is empty (0 requests): there is nothing to run; "
                         "skip the step (or use ForwardMode.IDLE with EagerRunner)")
    sizes = {"positions": batch.positions.numel(), "out_cache_loc": batch.out_cache_loc.numel(),
             "seq_lens": batch.seq_lens.numel(), "seq_lens_cpu": len(batch.seq_lens_cpu)}
    want = {"positions": n, "out_cache_loc": n, "seq_lens": bs, "seq_lens_cpu": bs}
    for name, got in sizes.items():
        if got != want[name]:
            raise ValueError(f"{fn}: batch.{name} has {got} entries, expected {want[name]} "
                             f"(batch of {bs} requests, {n} tokens): its fields disagree, "
                             "build it with make_decode_batch / make_extend_batch")
    if batch.forward_mode.is_extend():
        if batch.extend_lens is None or len(batch.extend_lens) != bs or sum(batch.extend_lens) != n:
            raise ValueError(f"{fn}: an EXTEND batch needs extend_lens, one per request, "
                             f"summing to its {n} tokens; got {batch.extend_lens}")
    elif n % bs:
        raise ValueError(f"{fn}: {n} tokens for {bs} requests: a {batch.forward_mode.name} batch "
                         "feeds the same number of tokens per request")


def check_batch_values(batch, model, fn: str) -> None:
    """Every index a batch carries is in range and consistent, checked on the host.

    Free for a batch the constructors checked and nobody changed since (identity and
    version record); otherwise one device→host copy of the batch (a sync on a GPU) —
    the price of keeping a bad id away from the static buffers and the embedding, where
    on a GPU it is a device-side assert that ends the process.
    """
    if batch.forward_mode is ForwardMode.IDLE:
        return
    vocab = model.args.vocab_size
    num_rows, width = model.req_to_token.shape
    bs, n = batch.batch_size, batch.num_tokens
    host = torch.cat([batch.input_ids.long(), batch.positions.long(),
                      batch.out_cache_loc.long(), batch.req_pool_indices.long(),
                      batch.seq_lens.long()]).tolist()
    ids, pos = host[:n], host[n:2 * n]
    locs, slots, seq_lens = host[2 * n:3 * n], host[3 * n:3 * n + bs], host[3 * n + bs:]
    check_tokens(ids, vocab, fn, "batch.input_ids")
    check_slots(slots, num_rows, fn)
    bad = [p for p in pos if not 0 <= p < width]
    if bad:
        raise ValueError(f"{fn}: position {bad[0]} in batch.positions is outside "
                         f"0..{width - 1} (max_seq_len = {width})")
    if seq_lens != [int(s) for s in batch.seq_lens_cpu]:
        raise ValueError(f"{fn}: batch.seq_lens {seq_lens} and batch.seq_lens_cpu "
                         f"{list(batch.seq_lens_cpu)} disagree: update both (or build a new "
                         "batch with make_decode_batch)")
    lens = batch.extend_lens if batch.forward_mode.is_extend() else [n // bs] * bs
    starts = [0]
    for m in lens[:-1]:
        starts.append(starts[-1] + m)
    for i, (s0, m) in enumerate(zip(starts, lens)):
        if pos[s0 + m - 1] + 1 != seq_lens[i]:
            raise ValueError(f"{fn}: request {i}'s last position is {pos[s0 + m - 1]} but its "
                             f"seq_len is {seq_lens[i]}: seq_len counts every token up to and "
                             "including the new ones (last position + 1)")
    rep = [slots[i] for i, m in enumerate(lens) for _ in range(m)]
    expected = model.req_to_token.reshape(-1)[
        torch.tensor([s * width + p for s, p in zip(rep, pos)], device=model.device)].tolist()
    if expected != locs:
        j = next(j for j, (a, b) in enumerate(zip(expected, locs)) if a != b)
        raise ValueError(f"{fn}: batch.out_cache_loc[{j}] = {locs[j]}, but token {j} (slot "
                         f"{rep[j]}, position {pos[j]}) owns cache location {expected[j]} "
                         "(req_to_token[slot, position]): its K/V would land in the wrong place")
    batch.mark_values_checked()
