"""Lesson 06, exercise ``fill_slot``: its checker.

``fill_slot(slot, src, raw_rows, padded_rows)``: load one static buffer
(a :class:`~labkit.decode.GraphSlot`) in place: ``src`` into rows ``0..raw_rows``, the
padding tail ``raw_rows..padded_rows`` by the slot's policy (``head_only``: leave it,
``zero_tail``: zeros, ``sentinel``: ``slot.fill_value``), rows past the bucket left
alone. Reference: :meth:`labkit.decode.StaticBuffers.fill_from` on a one-buffer registry.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from labkit.checks import CheckResult, Exercise, attempt, describe_exception
from labkit.decode import GraphSlot, Pad, StaticBuffers

__all__ = ["check_fill_slot"]


_POLICY_CASES = {1: Pad.ZERO_TAIL, 2: Pad.SENTINEL, 3: Pad.HEAD_ONLY, 4: Pad.ZERO_TAIL,
                 5: Pad.SENTINEL, 6: Pad.ZERO_TAIL}
_SLOT_NAMES = {Pad.HEAD_ONLY: "input_ids", Pad.ZERO_TAIL: "positions",
               Pad.SENTINEL: "seq_lens"}
# sentinel values per trial: never 0 (a zeroed tail must show) and not always 1
_SENTINELS = {2: 3, 5: 1}

_FILL_HINTS = [
    "Section 3 lists the three policies and what each does to the padding tail; the "
    "message above names the rows that differ.",
    "Work on slot.tensor in place, along slot.row_dim: rows 0..raw_rows are the head, "
    "rows raw_rows..padded_rows the tail (slot.tensor.narrow(slot.row_dim, lo, hi - lo) "
    "is a view of rows lo..hi); the rows after padded_rows are not yours.",
    "head.copy_(src); then by slot.pad: Pad.ZERO_TAIL → tail.zero_(), Pad.SENTINEL → "
    "tail.fill_(slot.fill_value), Pad.HEAD_ONLY → nothing",
]


def _fill_reference(slot: GraphSlot, src: torch.Tensor, raw_rows: int, padded_rows: int):
    """labkit's own fill_from, on a registry that holds just this buffer."""
    reg = StaticBuffers(max_bs=1, device=slot.tensor.device)
    reg.slots = {}
    reg.register(slot.name, slot.tensor, slot.pad, per_token=False, fill_value=slot.fill_value,
                 row_dim=slot.row_dim)
    batch = type("OneBuffer", (), {slot.name: src})()
    reg.fill_from(batch, raw_rows, padded_rows)


# trial -> row_dim of the buffer: trial 6 is mrope_positions, shape (3, n), rows along dim 1
_ROW_DIM_CASES = {6: 1}


def _fill_case(gen: torch.Generator, device) -> tuple[GraphSlot, torch.Tensor, int, int]:
    """``(slot, src, raw_rows, padded_rows)`` for the trial ``gen`` was seeded with.

    Trials 1-5 are 1-D buffers of the three policies (trial 4: no tail at all); trial 6 is
    ``mrope_positions`` (shape ``(3, n)``, ``row_dim=1``); later trials draw the policy,
    the rank and ``row_dim``. Every buffer starts full of stale values (never 0 or the
    sentinel). ``fill_value`` is random for every policy (trials 1 and 3: a zero_tail and
    a head_only slot that carry a nonzero one): only ``Pad.SENTINEL`` uses it.
    """
    device = torch.device(device)
    trial = gen.initial_seed()
    pad = _POLICY_CASES.get(trial) or list(Pad)[int(torch.randint(0, 3, (), generator=gen))]
    n = int(torch.randint(8, 17, (), generator=gen))
    if trial == 4:   # a batch that fills its bucket exactly: no tail at all
        raw = padded = int(torch.randint(1, n, (), generator=gen))
    else:
        raw = int(torch.randint(1, n - 2, (), generator=gen))
        padded = int(torch.randint(raw + 1, n, (), generator=gen))  # rows past it stay
    dtype = (torch.int32, torch.int64)[int(torch.randint(0, 2, (), generator=gen))]
    if trial in _ROW_DIM_CASES:
        row_dim, shape = _ROW_DIM_CASES[trial], (3, n)
    elif trial > max(_ROW_DIM_CASES) and bool(torch.randint(0, 2, (), generator=gen)):
        row_dim = int(torch.randint(0, 2, (), generator=gen))
        shape = (n, 3) if row_dim == 0 else (3, n)
    else:
        row_dim, shape = 0, (n,)
    stale = torch.randint(50, 100, shape, generator=gen).to(dtype)
    src_shape = list(shape)
    src_shape[row_dim] = raw
    src = torch.randint(2, 40, src_shape, generator=gen).to(device)   # int64, as a batch has
    if pad is Pad.SENTINEL:
        fill = _SENTINELS.get(trial) or int(torch.randint(2, 10, (), generator=gen))
    elif trial in (1, 3):
        fill = int(torch.randint(2, 10, (), generator=gen))
    else:
        fill = int(torch.randint(0, 10, (), generator=gen))
    name = "mrope_positions" if row_dim == 1 and pad is Pad.ZERO_TAIL else _SLOT_NAMES[pad]
    slot = GraphSlot(name, stale.clone().to(device), pad, per_token=False, fill_value=fill,
                     row_dim=row_dim)
    return slot, src, raw, padded


EXERCISE = Exercise("fill_slot", more_hints=tuple(_FILL_HINTS))


class _Case(NamedTuple):
    """One trial's slot and batch, as the messages name them."""

    pad: Pad
    raw: int
    padded: int
    stale: torch.Tensor   # the buffer before the call (an "earlier batch")
    n: int                # rows of the buffer
    fill: int
    name: str
    row_dim: int
    shape: tuple

    def what(self) -> str:
        what = (f"{self.name} ({self.pad.value}, fill_value={self.fill}), {self.n} rows, "
                f"raw_rows={self.raw}, padded_rows={self.padded}")
        return what + (f", shape {self.shape}, row_dim={self.row_dim}" if self.row_dim else "")

    def along(self) -> str:
        rd = self.row_dim
        return (f" This slot's rows are along dim {rd} (slot.row_dim={rd}, shape "
                f"{self.shape}, as SGLang's mrope_positions holds three position ids per "
                f"token): its head is slot.tensor[:, :raw_rows] and src has shape "
                f"(3, raw_rows). Slice along slot.row_dim, not along dim 0" if rd else "")


def _case(slot: GraphSlot, raw: int, padded: int) -> _Case:
    return _Case(slot.pad, raw, padded, slot.tensor.detach().cpu().clone(),
                 slot.tensor.shape[slot.row_dim], slot.fill_value, slot.name, slot.row_dim,
                 tuple(slot.tensor.shape))


def _run(f):
    """The trial: ``f`` on the slot; what the buffer holds after it, and the case. An error
    on a slot whose rows are along dim 1 is named with that."""
    def call(slot, src, raw, padded):
        buf, case = slot.tensor, _case(slot, raw, padded)

        def along_dim_1(exc: BaseException) -> str | None:
            if not case.row_dim or isinstance(exc, NotImplementedError):
                return None                     # the stub stays "not done"
            return (f"{case.what()}: your code raised {describe_exception(exc)}\n  "
                    + case.along())

        attempt(f, (slot, src, raw, padded), explain=along_dim_1)
        return {"buffer": buf.detach().cpu().clone(), "rebound": slot.tensor is not buf,
                "case": case}
    call.__name__ = getattr(f, "__name__", "fill_slot")
    return call


def _part(t: torch.Tensor, rd: int, lo: int, hi: int) -> torch.Tensor:
    return t.narrow(rd, lo, hi - lo)


def _written_in_place(expected, actual) -> str | None:
    c, a, e = actual["case"], actual["buffer"], expected["buffer"]
    if torch.equal(a, e) and not actual["rebound"]:
        return None
    if actual["rebound"]:
        return (f"{c.what()}: the buffer the graph reads was not written. A graph recorded "
                "the address of slot.tensor; assigning slot.tensor = ... changes nothing "
                "it reads. Write into it in place")
    if torch.equal(a, c.stale) and c.raw == c.padded:
        return (f"{c.what()}: your function wrote nothing. This batch fills its bucket "
                "exactly, so there is no padding tail, but the head still holds the real "
                "requests: copy src into rows 0..raw_rows every time. Does a condition "
                "on the tail (padded_rows > raw_rows, an early return) skip the head "
                "copy too?")
    if torch.equal(a, c.stale):
        return (f"{c.what()}: not one row of slot.tensor changed: the buffer the graph reads "
                "was not written. Writing into a copy (slot.tensor.clone(), a new "
                "tensor) or rebinding a local name changes nothing the graph reads. "
                "Write into slot.tensor in place")
    return None


def _head_and_beyond(expected, actual) -> str | None:
    c, a, e = actual["case"], actual["buffer"], expected["buffer"]
    rd, raw, padded, n = c.row_dim, c.raw, c.padded, c.n
    if not torch.equal(_part(a, rd, 0, raw), _part(e, rd, 0, raw)):
        return (f"{c.what()}: rows 0..{raw} should be the batch "
                f"{_part(e, rd, 0, raw).tolist()}, got {_part(a, rd, 0, raw).tolist()}: the "
                f"head holds the real requests, src.{c.along()}")
    if not torch.equal(_part(a, rd, padded, n), _part(e, rd, padded, n)):
        return (f"{c.what()}: rows {padded}..{n} changed from "
                f"{_part(e, rd, padded, n).tolist()} to {_part(a, rd, padded, n).tolist()}. "
                f"Rows past padded_rows belong to larger buckets and are not read by this "
                f"replay: touch only up to padded_rows.{c.along()}")
    return None


def _the_tail(expected, actual) -> str | None:
    c, a, e = actual["case"], actual["buffer"], expected["buffer"]
    rd, raw, padded, pad, stale, along = c.row_dim, c.raw, c.padded, c.pad, c.stale, c.along()
    if torch.equal(a, e):
        return None
    tail_a, tail_e = _part(a, rd, raw, padded), _part(e, rd, raw, padded)
    msg = (f"{c.what()}: the padding tail (rows {raw}..{padded}) is {tail_a.tolist()}, "
           f"expected {tail_e.tolist()}.")
    bad = [r for r in range(raw, padded)
           if not torch.equal(_part(a, rd, r, r + 1), _part(e, rd, r, r + 1))]
    stale_rows = [r for r in bad
                  if torch.equal(_part(a, rd, r, r + 1), _part(stale, rd, r, r + 1))]
    if pad is not Pad.HEAD_ONLY and stale_rows and len(stale_rows) < padded - raw and \
            stale_rows == bad:
        return (msg + f" Rows {stale_rows} kept their stale values while the rest of the "
                "tail is right: the tail is every row from raw_rows up to (not including) "
                "padded_rows; check the bounds of your slice" + along)
    values = set(tail_a.reshape(-1).tolist())
    fill = c.fill
    if pad is Pad.ZERO_TAIL:
        if torch.equal(tail_a, _part(stale, rd, raw, padded)):
            return (msg + " zero_tail leaves no stale value: these are indices that padded "
                    "rows gather and scatter through, and a stale one points into a live "
                    "request's KV cache or past the end of a table (an illegal memory "
                    "access on a GPU). Section 3 says which row they must point at"
                    + along)
        if values == {fill} and fill != 0:
            return (msg + f" zero_tail means zeros: the tail holds {fill}, this slot's "
                    "fill_value, but fill_value is the sentinel of Pad.SENTINEL slots "
                    "only (every slot carries one; the policy decides whether it is "
                    "used). A zero_tail index must point at row 0, the dummy slot")
        return (msg + " zero_tail means zeros: index 0 is the dummy slot, the only place "
                "padded rows may write" + along)
    if pad is Pad.SENTINEL:
        if values == {0}:
            return (msg + " A sentinel of 0 masks every key: the padded row's softmax "
                    "becomes NaN. The value to write is the slot's own sentinel")
        if len(values) == 1 and fill not in values:
            return (msg + f" The tail holds {values.pop()} but this slot's sentinel is "
                    f"{fill}: take the value from slot.fill_value, not a constant (SGLang "
                    "asks the attention backend for it: usually 1, not always)")
        return msg + " The sentinel policy fills every tail row with the slot's sentinel" \
            + along
    return (msg + " head_only leaves the tail as it is: any stale token id is valid and "
            "padded rows' outputs are thrown away, so clearing it costs a launch for "
            "nothing (and for a token id, no value is 'safer' than another)" + along)


#: in order, the first reason wins
JUDGES = (_written_in_place, _head_and_beyond, _the_tail)


def check_fill_slot(fn, *, device=None, trials: int = 8) -> CheckResult:
    """``fn(slot, src, raw_rows, padded_rows)`` must load ``slot.tensor`` in place.

    The buffer starts full of stale values from an "earlier batch" (never 0 or the
    sentinel), so a tail that is not cleared, a sentinel written as 0 and rows past the
    bucket that were touched all show. The sentinel's value changes from trial to trial
    (it is ``slot.fill_value``, which in SGLang depends on the attention backend), and so
    does the buffer's dtype (int32 or int64; ``src`` is always int64, as a batch has it).
    Slots of the other policies carry a random ``fill_value`` too (they must ignore it),
    and some buffers hold their rows along dim 1 (``slot.row_dim``, as SGLang's
    ``mrope_positions`` of shape ``(3, n)``). See :func:`_fill_case`.
    """
    if device is None:
        from labkit import backend

        device = backend.get("auto").device
    device = torch.device(device)

    def make_inputs(gen: torch.Generator):
        return _fill_case(gen, device)

    return EXERCISE.check(_run(fn), _run(_fill_reference), make_inputs, trials=trials,
                          judges=JUDGES)
