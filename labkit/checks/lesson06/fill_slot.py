"""Lesson 06, exercise ``fill_slot``: its checker.

``fill_slot(slot, src, raw_rows, padded_rows)``: load one static buffer
(a :class:`~labkit.decode.GraphSlot`) in place: ``src`` into rows ``0..raw_rows``, the
padding tail ``raw_rows..padded_rows`` by the slot's policy (``head_only``: leave it,
``zero_tail``: zeros, ``sentinel``: ``slot.fill_value``), rows past the bucket left
alone. Reference: :meth:`labkit.decode.StaticBuffers.fill_from` on a one-buffer registry.
"""

from __future__ import annotations

import torch

from labkit.checks import CheckResult, LearnerTimeout, check, describe_exception
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
    last: dict = {}

    def make_inputs(gen: torch.Generator):
        slot, src, raw, padded = _fill_case(gen, device)
        last.update(pad=slot.pad, raw=raw, padded=padded, stale=slot.tensor.detach().cpu().clone(),
                    n=slot.tensor.shape[slot.row_dim], fill=slot.fill_value, name=slot.name,
                    row_dim=slot.row_dim, shape=tuple(slot.tensor.shape))
        return slot, src, raw, padded

    def run(f):
        def call(slot, src, raw, padded):
            buf = slot.tensor
            try:
                f(slot, src, raw, padded)
            except (NotImplementedError, LearnerTimeout):
                raise
            except Exception as exc:
                if slot.row_dim == 0:
                    raise
                return {"raised": exc}           # named with the slot's row_dim below
            return {"buffer": buf.detach().cpu().clone(), "rebound": slot.tensor is not buf}
        call.__name__ = getattr(f, "__name__", "fill_slot")
        return call

    def compare(expected, actual) -> str | None:
        pad, raw, padded, n = last["pad"], last["raw"], last["padded"], last["n"]
        rd, stale = last["row_dim"], last["stale"]
        what = (f"{last['name']} ({pad.value}, fill_value={last['fill']}), {n} rows, "
                f"raw_rows={raw}, padded_rows={padded}")
        if rd:
            what += f", shape {last['shape']}, row_dim={rd}"
        along = (f" This slot's rows are along dim {rd} (slot.row_dim={rd}, shape "
                 f"{last['shape']}, as SGLang's mrope_positions holds three position ids per "
                 f"token): its head is slot.tensor[:, :raw_rows] and src has shape "
                 f"(3, raw_rows). Slice along slot.row_dim, not along dim 0"
                 if rd else "")
        if "raised" in actual:
            return (f"{what}: your code raised {describe_exception(actual['raised'])}\n  "
                    + along)
        e, a = expected["buffer"], actual["buffer"]

        def part(t, lo, hi):
            return t.narrow(rd, lo, hi - lo)

        if torch.equal(a, e) and not actual["rebound"]:
            return None
        if actual["rebound"]:
            return (f"{what}: the buffer the graph reads was not written. A graph recorded "
                    "the address of slot.tensor; assigning slot.tensor = ... changes nothing "
                    "it reads. Write into it in place")
        if torch.equal(a, stale) and raw == padded:
            return (f"{what}: your function wrote nothing. This batch fills its bucket "
                    "exactly, so there is no padding tail, but the head still holds the real "
                    "requests: copy src into rows 0..raw_rows every time. Does a condition "
                    "on the tail (padded_rows > raw_rows, an early return) skip the head "
                    "copy too?")
        if torch.equal(a, stale):
            return (f"{what}: not one row of slot.tensor changed: the buffer the graph reads "
                    "was not written. Writing into a copy (slot.tensor.clone(), a new "
                    "tensor) or rebinding a local name changes nothing the graph reads. "
                    "Write into slot.tensor in place")
        if not torch.equal(part(a, 0, raw), part(e, 0, raw)):
            return (f"{what}: rows 0..{raw} should be the batch {part(e, 0, raw).tolist()}, "
                    f"got {part(a, 0, raw).tolist()}: the head holds the real requests, "
                    f"src.{along}")
        if not torch.equal(part(a, padded, n), part(e, padded, n)):
            return (f"{what}: rows {padded}..{n} changed from {part(e, padded, n).tolist()} "
                    f"to {part(a, padded, n).tolist()}. Rows past padded_rows belong to larger "
                    f"buckets and are not read by this replay: touch only up to padded_rows."
                    f"{along}")
        tail_a, tail_e = part(a, raw, padded), part(e, raw, padded)
        msg = (f"{what}: the padding tail (rows {raw}..{padded}) is {tail_a.tolist()}, "
               f"expected {tail_e.tolist()}.")
        rows = range(raw, padded)
        bad = [r for r in rows if not torch.equal(part(a, r, r + 1), part(e, r, r + 1))]
        stale_rows = [r for r in bad if torch.equal(part(a, r, r + 1), part(stale, r, r + 1))]
        if pad is not Pad.HEAD_ONLY and stale_rows and len(stale_rows) < padded - raw and \
                stale_rows == bad:
            return (msg + f" Rows {stale_rows} kept their stale values while the rest of the "
                    "tail is right: the tail is every row from raw_rows up to (not including) "
                    "padded_rows; check the bounds of your slice" + along)
        values = set(tail_a.reshape(-1).tolist())
        fill = last["fill"]
        if pad is Pad.ZERO_TAIL:
            if torch.equal(tail_a, part(stale, raw, padded)):
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

    return check(
        run(fn), run(_fill_reference), make_inputs, trials=trials, name="fill_slot",
        compare=compare, more_hints=_FILL_HINTS,
    )
