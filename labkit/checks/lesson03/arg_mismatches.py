"""Lesson 03, exercise ``arg_mismatches``: its checker.

``arg_mismatches(captured, received)``: Megatron-style argument checks as data, the
logic of :func:`labkit.guards.get_mismatch_errors`. Every difference is one tuple
``(where, field, captured_value, received_value)``: captured first, received second,
the order of the parameters:

- ``("args", "count", len(captured), len(received))`` when the counts differ (then
  compare the positions both have);
- ``(f"args[{i}]", "type", type(c).__name__, type(r).__name__)`` when one is a tensor
  and the other is not, or two non-tensors have different types (``2`` and ``2.0``
  differ: ``int`` is not ``float``); nothing else is reported for that position;
- for two tensors, one tuple for EACH of ``"shape"`` (a tuple of ints), ``"dtype"`` (a
  ``torch.dtype``) and ``"device"`` (a ``torch.device``) that differs; tensor *values*
  are never compared (a replay reads new values, that is the point);
- for two non-tensors of the same type, ``(f"args[{i}]", "value", c, r)`` if ``c != r``.

Order of the list does not matter. Eight trials, each aimed at one rule, with random
positions, shapes, dtypes and values: several fields of one tensor, a count mismatch, a
tensor against a number and two numbers of different types and values, a clean call
whose tensors hold other values, a device mismatch, ``int`` against ``float`` of equal
value, ``1`` captured against ``True`` received and a ``Parameter`` against a plain
tensor, a changed Python value, a random mix (with ``True`` captured against ``1``).
The received non-tensors are equal copies, not the same objects (``is not`` shows).
"""

from __future__ import annotations

import re
from collections import Counter

import torch

from labkit.backend import ensure as _backend
from labkit.checks import Reason, call_learner, fail, reject
from labkit.checks.lesson03._common import _learner_error, _rand_int, _run
from labkit.core.signature import ArgMetadata, mismatches

__all__ = ["check_arg_mismatches", "FIELDS"]


FIELDS = ("count", "type", "shape", "dtype", "device", "value")


def _arg_mismatches_reference(captured, received) -> list[tuple]:
    """The answer: :func:`labkit.core.signature.mismatches` as the exercise's tuples."""
    metas = [ArgMetadata.of(c) for c in captured]
    return [(m.where, m.field, m.captured, m.received) for m in mismatches(metas, received)]


_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.int64)


def _rand_tensor(gen, device, dtype=None, shape=None) -> torch.Tensor:
    if shape is None:
        shape = tuple(_rand_int(gen, 2, 6) for _ in range(_rand_int(gen, 1, 3)))
    if dtype is None:
        dtype = _DTYPES[_rand_int(gen, 0, len(_DTYPES) - 1)]
    return (torch.rand(shape, generator=gen) * 10).to(dtype).to(device)


def _rand_value(gen, kind=None):
    kind = kind or ("float", "int", "bool", "str")[_rand_int(gen, 0, 3)]
    if kind == "float":
        return round(float(torch.rand((), generator=gen)) * 4 + 0.05, 3)
    if kind == "int":
        return _rand_int(gen, 1, 64)
    if kind == "bool":
        return bool(_rand_int(gen, 0, 1))
    return ("gelu", "relu", "silu", "tanh")[_rand_int(gen, 0, 3)]


def _other_value(gen, v):
    """A different value of the same type."""
    if isinstance(v, bool):
        return not v
    if isinstance(v, int):
        return v + _rand_int(gen, 1, 9)
    if isinstance(v, float):
        return round(v * 2 + 0.5, 3)
    return v + "_new"


def _same_value(v):
    """``v`` again, equal (``==``) but a different object where Python allows it (floats,
    strings, large ints): what a new call receives, so that ``is not`` shows as a mistake."""
    if isinstance(v, bool) or v is None:
        return v
    if isinstance(v, float):
        return float(repr(v))
    if isinstance(v, int):
        return int(str(v))
    if isinstance(v, str):
        return "".join(list(v))
    return v


def _other_dtype(gen, dtype):
    choices = [d for d in _DTYPES if d != dtype]
    return choices[_rand_int(gen, 0, len(choices) - 1)]


def _other_shape(gen, shape):
    shape = list(shape)
    k = _rand_int(gen, 0, len(shape) - 1)
    shape[k] += _rand_int(gen, 1, 3)
    return tuple(shape)


def _plant_5(gen, device, captured: list, received: list, t: int, c) -> None:
    """Kind 5, in place: a device mismatch (meta exists everywhere), an int for an equal
    float, a bool for an int, a Parameter against a plain tensor."""
    received[t] = torch.empty(c.shape, dtype=c.dtype, device="meta")
    v = float(_rand_int(gen, 1, 8))
    captured.append(v)
    received.append(int(v))
    captured.append(1)         # bool is a subclass of int: isinstance(True, int) is True
    received.append(True)      # (kind 7 has the other direction: True captured, 1 received)
    # a Parameter against a plain tensor (a subclass: both are tensors), same metadata
    # or another dtype
    w = _rand_tensor(gen, device, dtype=torch.float32)
    other = w.to(_other_dtype(gen, w.dtype)) if bool(_rand_int(gen, 0, 1)) else w.clone()
    pair = [torch.nn.Parameter(w.clone()), other.detach()]
    if bool(_rand_int(gen, 0, 1)):
        pair.reverse()
    pos = _rand_int(gen, 0, len(captured))
    captured.insert(pos, pair[0])
    received.insert(pos, pair[1])


def _plant_7(gen, device, captured: list, received: list) -> None:
    """Kind 7, in place: a random mix of mismatches."""
    for i, x in enumerate(captured):
        roll = _rand_int(gen, 0, 5)
        if isinstance(x, torch.Tensor):
            if roll == 0:
                received[i] = x.to(_other_dtype(gen, x.dtype))
            elif roll == 1:
                received[i] = torch.zeros(_other_shape(gen, x.shape), dtype=x.dtype,
                                          device=device)
            elif roll == 2:
                received[i] = None
        elif roll <= 1:
            received[i] = _other_value(gen, x)
        elif roll == 2:
            received[i] = _rand_tensor(gen, device)
    captured.append(True)
    received.append(1)


def _arg_case(trial: int, gen: torch.Generator, device) -> tuple[list, list]:
    """(captured, received) for one trial; ``trial % 8`` picks the rule it is aimed at."""
    n = _rand_int(gen, 2, 4)
    captured: list = []
    for _ in range(n):
        captured.append(_rand_tensor(gen, device) if bool(_rand_int(gen, 0, 1))
                        else _rand_value(gen))
    t = _rand_int(gen, 0, n - 1)                  # one position holds a tensor for sure
    captured[t] = _rand_tensor(gen, device)
    received = [c.clone() if isinstance(c, torch.Tensor) else _same_value(c) for c in captured]
    kind = trial % 8
    c = captured[t]
    if kind == 1:      # several fields of one tensor, sometimes a changed value elsewhere
        shape = _other_shape(gen, c.shape)
        dtype = _other_dtype(gen, c.dtype)
        dev = "meta" if bool(_rand_int(gen, 0, 1)) else device
        # zeros, not empty: uninitialised memory may hold NaN, and NaN != NaN would make
        # the "did your function change a received tensor" check blame a right answer
        received[t] = torch.zeros(shape, dtype=dtype, device=dev)
    elif kind == 2:    # a count mismatch, and a shape mismatch at a position both have
        received[t] = torch.zeros(_other_shape(gen, c.shape), dtype=c.dtype, device=device)
        if bool(_rand_int(gen, 0, 1)):
            received = received + [_rand_value(gen)] * _rand_int(gen, 1, 2)
        else:
            captured = captured + [_rand_tensor(gen, device)]
    elif kind == 3:    # a tensor where a number was captured, and the other way round;
        v = _rand_value(gen, "float")    # two numbers of different types AND values
        captured.insert(0, v)
        received.insert(0, torch.tensor(v, device=device))
        received[t + 1] = float(c.reshape(-1)[0])
        pos = _rand_int(gen, 0, len(captured))
        k = _rand_int(gen, 1, 8)
        captured.insert(pos, k)
        received.insert(pos, k + 0.5 if bool(_rand_int(gen, 0, 1)) else str(k + 1))
    elif kind == 4:    # a clean call: same metadata, other tensor values, equal floats
        received = [torch.rand(x.shape, generator=gen).to(x.dtype).to(device) + 1
                    if isinstance(x, torch.Tensor) else _same_value(x) for x in captured]
        v = _rand_value(gen, "float")
        pos = _rand_int(gen, 0, len(captured))
        captured.insert(pos, v)
        received.insert(pos, _same_value(v))       # equal, not the same object
    elif kind == 5:    # a device mismatch (meta exists everywhere), an int for an equal float,
        _plant_5(gen, device, captured, received, t, c)    # a Parameter
    elif kind == 6:    # changed Python values of several kinds
        for kind_ in ("float", "str", "bool"):
            v = _rand_value(gen, kind_)
            pos = _rand_int(gen, 0, len(captured))
            captured.insert(pos, v)
            received.insert(pos, _other_value(gen, v))
    elif kind == 7:    # a random mix
        _plant_7(gen, device, captured, received)
    else:              # kind 0: one missing argument, and a None where a tensor was
        received = received[:-1]
        if t < len(received):
            received[t] = None
    return captured, received


def _norm(v):
    return tuple(v) if isinstance(v, torch.Size) else v


def _key(t) -> str:
    return repr(tuple(_norm(v) for v in t))


class _Shown:
    def __init__(self, text: str):
        self.text = text

    def __repr__(self) -> str:
        return self.text


def _fmt(t) -> str:
    """A learner's tuple for a message: tensors by shape and dtype, not by their values."""
    return repr(tuple(_Shown(_describe_arg(v)) if isinstance(v, torch.Tensor) else _norm(v)
                      for v in t))


_PLACE = re.compile(r"args\[\d+\]")


def _explain_arg_mismatches(exc: BaseException) -> Reason | None:
    text = str(exc)
    desc = _learner_error(exc)
    if isinstance(exc, RuntimeError) and ("Boolean value of Tensor" in text
                                          or "must match the size of tensor" in text):
        return Reason(
            f"your code raised {desc}\n   You compared two tensors with == or != (or used a "
            f"tensor in an `if`): that compares their values element by element. Values are "
            f"never compared; compare shape, dtype and device.",
            ["Compare c.shape with r.shape, c.dtype with r.dtype, c.device with r.device."])
    if isinstance(exc, AttributeError) and any(a in text for a in ("shape", "dtype", "device")):
        return Reason(
            f"your code raised {desc}\n   At some position one side is a tensor and the "
            f"other is not (or neither is): check the types first, and compare shapes only "
            f"when both are tensors.",
            ["isinstance(x, torch.Tensor) on both sides; when it differs, report a 'type' "
             "mismatch and nothing else for that position."])
    if isinstance(exc, IndexError):
        return Reason(
            f"your code raised {desc}\n   The two lists can have different lengths: compare "
            f"only the positions both have.",
            ["zip(captured, received) stops at the shorter list."])
    return None


def _malformed(actual) -> Reason | None:
    """The list itself: tuples of 4, known fields, places written as asked, once."""
    if actual is None:
        return Reason("your function returned None (did you forget `return`? A call that "
                        "matches returns an empty list)")
    if not isinstance(actual, (list, tuple)):
        return Reason(f"expected a list of tuples, got {type(actual).__name__}")
    for a in actual:
        if not isinstance(a, (tuple, list)) or len(a) != 4:
            return Reason(f"each mismatch must be a tuple of 4: (where, field, captured, "
                            f"received); got {a!r}")
    for a in actual:
        if a[1] not in FIELDS:
            return Reason(f"unknown field {a[1]!r} in {_fmt(a)}: the field is one of "
                            f"{', '.join(map(repr, FIELDS))}")
        if not isinstance(a[0], str):
            return Reason(f"the place must be a string like 'args[0]' (or 'args' for the "
                            f"count); got {a[0]!r} in {_fmt(a)}")
        if a[0] != "args" and not _PLACE.fullmatch(a[0]):
            digits = re.findall(r"\d+", a[0])
            want = f"'args[{digits[0]}]'" if digits else "'args[0]', 'args[1]', ..."
            return Reason(f"the place {a[0]!r} in {_fmt(a)} is not written as the exercise "
                            f"asks: position i is f\"args[{{i}}]\" ({want} here), and the "
                            f"count's place is 'args'. The messages of get_mismatch_errors "
                            f"use these names.")
    counts = Counter(_key(a) for a in actual)
    twice = [k for k, n in counts.items() if n > 1]
    if twice:
        return Reason(f"{twice[0]} is reported {counts[twice[0]]} times: report each "
                        f"mismatch once")
    return None


def _wrong_values(captured, received, extra: list, by_place: dict) -> Reason | None:
    """A reported tuple that exists in the reference, with other values."""
    # what the learner put in a tuple that exists in the reference, but with other values
    for a in extra:
        e = by_place.get((a[0], a[1]))
        if e is None:
            continue
        where, field = a[0], a[1]
        if _key((where, field, a[3], a[2])) == _key(e):
            return Reason(
                f"{_fmt(a)} has its last two values swapped: at {where} the captured {field} "
                f"is {_norm(e[2])!r} and the received one {_norm(e[3])!r}. The tuple is "
                f"(where, field, captured, received), captured first, like the parameters "
                f"arg_mismatches(captured, received).")
        if field in ("dtype", "device") and any(isinstance(v, str) for v in a[2:]):
            return Reason(
                f"{_fmt(a)} gives the {field} as a string; give the torch object itself "
                f"({'c.dtype, a torch.dtype' if field == 'dtype' else 'c.device, a torch.device'}"
                f"), as in {_fmt(e)}.")
        if field == "shape" and any(isinstance(v, list) or isinstance(v, str) for v in a[2:]):
            return Reason(f"{_fmt(a)} gives the shape as a {type(a[2]).__name__}; give a "
                            f"tuple of ints: tuple(c.shape).")
        if field == "type" and any(isinstance(v, type) for v in a[2:]):
            return Reason(f"{_fmt(a)} gives the types themselves; give their names, "
                            f"type(c).__name__ (a tensor's is 'Tensor').")
        if field == "count":
            return Reason(f"{_fmt(a)} is not the count tuple: captured has "
                            f"{len(captured)} arguments and received {len(received)}; the "
                            f"tuple is ('args', 'count', len(captured), len(received)).")
        return Reason(f"{_fmt(a)}: the values are wrong for {where}'s {field}, whose "
                        f"captured and received {field}s are not these.")
    return None


def _not_mismatches(captured, received, extra: list, by_place: dict,
                    got: dict) -> Reason | None:
    """A reported tuple that is no mismatch: what the learner's code did wrong."""
    tensors_at = {f"args[{i}]" for i, (c, r) in enumerate(zip(captured, received))
                  if isinstance(c, torch.Tensor) and isinstance(r, torch.Tensor)}
    shared = min(len(captured), len(received))
    for a in extra:
        where, field = a[0], a[1]
        type_at = by_place.get((where, "type"))
        i = int(where[5:-1]) if _PLACE.fullmatch(where) else None
        if i is not None and i >= shared:
            longer, n_long, n_short = (("captured", len(captured), len(received))
                                       if len(captured) > len(received) else
                                       ("received", len(received), len(captured)))
            return Reason(
                f"you reported {_fmt(a)}, but {where} exists only in {longer} ({longer} has "
                f"{n_long} arguments, the other list {n_short}): there is nothing to compare "
                f"it with (the None is a filler: itertools.zip_longest?). Compare only the "
                f"positions both lists have; the count tuple already says that one list is "
                f"longer.",
                ["zip(captured, received) stops at the shorter list."])
        if field == "type" and i is not None and isinstance(captured[i], torch.Tensor) \
                and isinstance(received[i], torch.Tensor):
            return Reason(
                f"you reported {_fmt(a)}, but {where} is a tensor on both sides: "
                f"{type(captured[i]).__name__} and {type(received[i]).__name__} (a "
                f"torch.nn.Parameter is a torch.Tensor subclass, as a weight passed to a "
                f"layer is). The 'type' rule is for a tensor against a non-tensor, or two "
                f"non-tensors; two tensors are compared by shape, dtype and device only.",
                ["Tell tensors from non-tensors with isinstance(x, torch.Tensor), not by "
                 "comparing type(c) with type(r)."])
        if field == "value" and i is not None and i < shared \
                and not isinstance(captured[i], torch.Tensor) \
                and type(captured[i]) is type(received[i]) and captured[i] == received[i]:
            return Reason(
                f"you reported {_fmt(a)}, but at {where} the captured {captured[i]!r} and the "
                f"received {received[i]!r} are equal (==) but not the same object: `is not` "
                f"compares identity, and two equal floats or strings made separately are two "
                f"objects. A graph baked in the VALUE: use != for values.",
                ["c != r compares values; c is not r compares objects."])
        if field == "value" and where in tensors_at:
            return Reason(
                f"you reported {_fmt(a)}, but {where} is a tensor on both sides with the same "
                f"shape, dtype and device: tensor VALUES are never compared. New values are "
                f"what a replay is for; only the metadata is fixed at capture.")
        if type_at is not None and _key(type_at) not in got:
            return Reason(
                f"you reported {_fmt(a)}, but at {where} the types differ "
                f"({type_at[2]} captured, {type_at[3]} received), and your list has no "
                f"'type' tuple for it: compare the types first; when they differ, the 'type' "
                f"tuple is the only one for that position.",
                ["type(c) is not type(r) (not isinstance: bool is a subclass of int), "
                 "before any value comparison."])
        if type_at is not None:
            return Reason(
                f"you reported {_fmt(a)}, but at {where} the types differ "
                f"({type_at[2]} captured, {type_at[3]} received): report only the 'type' "
                f"tuple there, nothing else for that position.",
                ["if / elif: once the types differ, skip the other comparisons of that "
                 "position."])
        if where == "args" or field == "count":
            return Reason(f"you reported {_fmt(a)}, but both lists have {len(captured)} "
                            f"arguments.")
        return Reason(f"you reported {_fmt(a)}, but {where}'s {field} is the same in the "
                        f"captured and the received arguments.")
    return None


def _missed(captured, received, missing: list, actual) -> Reason | None:
    """A mismatch the learner's list lacks."""
    reported = {a[0] for a in actual}
    for e in missing:
        where, field = e[0], e[1]
        if field == "count":
            return Reason(
                f"captured has {len(captured)} arguments and received {len(received)}, and "
                f"your list does not say so. Compare the number of arguments first, then the "
                f"positions both lists have.",
                ["('args', 'count', len(captured), len(received)), before the loop."])
        if field == "type":
            c, r = e[2], e[3]
            ci, ri = int(where[5:-1]), int(where[5:-1])
            cv, rv = captured[ci], received[ri]
            if not isinstance(cv, torch.Tensor) and not isinstance(rv, torch.Tensor) \
                    and cv == rv:
                return Reason(
                    f"at {where} the captured {cv!r} ({c}) and the received {rv!r} ({r}) are "
                    f"equal in Python, but their types differ and your list has nothing for "
                    f"it. Compare types before values: a graph captured with {cv!r} baked in "
                    f"{'an' if c[:1] in 'aeiou' else 'a'} {c}.",
                    ["type(c) is not type(r) (not isinstance: bool is a subclass of int)."])
            return Reason(
                f"at {where} one argument is a {c} and the other a {r}, and your list has "
                f"nothing for it: check whether each side is a tensor before comparing "
                f"anything else.")
        if where in reported:
            others = sorted({a[1] for a in actual if a[0] == where})
            return Reason(
                f"at {where} you reported {', '.join(others)} but not the {field}, which "
                f"differs too. Report EVERY field that differs, not only the first one per "
                f"argument: one message listing all mismatches is the point.",
                ["Three separate `if`s (shape, dtype, device), not `if/elif`."])
        return Reason(f"at {where} the {field} differs and your list has nothing for it.",
                        [f"Look at how your code compares the {field} of the two "
                         f"arguments at {where}."])
    return None


def _diagnose_arg_mismatches(captured, received, expected, actual) -> Reason | None:
    bad = _malformed(actual)
    if bad is not None:
        return bad
    want = {_key(e): e for e in expected}
    got = {_key(a): a for a in actual}
    missing = [want[k] for k in want if k not in got]
    extra = [got[k] for k in got if k not in want]
    if not missing and not extra:
        return None
    by_place = {(e[0], e[1]): e for e in expected}
    return (_wrong_values(captured, received, extra, by_place)
            or _not_mismatches(captured, received, extra, by_place, got)
            or _missed(captured, received, missing, actual))


def check_arg_mismatches(arg_mismatches, *, B=None, trials: int = 8, quiet: bool = False,
                         time_limit: float = 10.0):
    """Check ``arg_mismatches(captured, received)`` against the rules of
    :func:`labkit.guards.get_mismatch_errors`, as tuples ``(where, field, captured,
    received)``.

    Args:
        arg_mismatches: the learner's function of two lists.
        B: the backend; its device holds the tensors (``meta`` is the other device).
        trials: one rule per trial (``trial % 8``), random positions, shapes and values.
        quiet: do not print.
        time_limit: seconds the learner's code may run per call.
    """
    B = _backend(B)
    name = "arg_mismatches"
    if not callable(arg_mismatches):
        return fail(name, f"expected a function, got {type(arg_mismatches).__name__}",
                    quiet=quiet)

    def one_trial(trial, gen):
        captured, received = _arg_case(trial, gen, B.device)
        expected = _arg_mismatches_reference(captured, received)
        snapshot = [x.clone() if isinstance(x, torch.Tensor) and x.device.type != "meta"
                    else x for x in received]
        actual = call_learner(arg_mismatches, list(captured), list(received),
                              time_limit=time_limit)  # run_trials' attempt reports errors
        for s, x in zip(snapshot, received):
            if isinstance(s, torch.Tensor) and s is not x and not torch.equal(s, x):
                reject(Reason("your function changed a received tensor in place: it must "
                               "only look"))
        bad = _diagnose_arg_mismatches(captured, received, expected, actual)
        if bad is not None:
            shown = ", ".join(_describe_arg(x) for x in captured)
            got = ", ".join(_describe_arg(x) for x in received)
            reject(Reason(f"{bad}\n   captured: [{shown}]\n   received: [{got}]",
                          bad.hints))

    return _run(name, trials, one_trial, quiet=quiet, explain=_explain_arg_mismatches)


def _describe_arg(x) -> str:
    if isinstance(x, torch.Tensor):
        dev = "" if x.device.type in ("cpu", "cuda") else f" {x.device}"
        kind = "Parameter" if isinstance(x, torch.nn.Parameter) else "Tensor"
        return f"{kind}{tuple(x.shape)} {str(x.dtype).replace('torch.', '')}{dev}"
    return repr(x)
