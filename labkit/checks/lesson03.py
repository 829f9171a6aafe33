"""Checkers for lesson 03 (constraint pitfalls).

Three exercises, run on the backend of ``labkit.backend.get("auto")`` (or ``B=``):

* ``capturable_clip(x)``: the capturable rewrite of

  .. code-block:: python

      def clip(x):
          m = x.abs().max()
          if m > 1:            # a Python branch on a tensor: not capturable
              return x / m
          return x

  The checker runs the learner's function eagerly on inputs of both regimes
  (``max |x|`` above and below 1, every rank from 0-d to 4-D with random sizes, a large
  negative element included) and names the wrong formula it sees (an identity, a
  division that is always done, a per-element condition, a clamp, ``max(x)`` without
  ``abs``, a maximum per row or per slice of any dims); then it
  lints the function with :func:`labkit.guards.lint_capture` (a hazard that fails capture
  is reported with its line); then it captures the function on the backend and replays it
  on inputs of both regimes: a graph that baked in one branch gets the other one wrong.
* ``arg_mismatches(captured, received)``: Megatron-style argument checks as data, the
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
* ``build_server(B)`` (diagnosis): the learner fixes a broken server that captures
  ``softmax(logits / temperature)`` once and replays it per batch. The checker gives
  ``build_server`` a backend that counts captures and replays, then calls the returned
  ``serve(batches, temperatures)``: exactly one graph captured in ``build_server``, none
  in ``serve``, one replay per batch, no softmax run eagerly in ``serve`` (results come from
  the graph), results that are separate tensors equal to eager. A wrong answer is told
  which pitfall it still has: results that share memory or were cloned after the loop
  (section 6), logits the graph never saw (section 1), a temperature stuck at its capture
  value (section 7), results one batch behind, a tensor the graph reads that was given up
  before a replay (a name given a new tensor: told by the tensor being gone, since a GPU
  reuses its freed memory and the emulator keeps reading it, so the values differ).

Every checker leaves a usable process after a learner's failed capture
(:func:`labkit.backend.recover`), gives learner code a time budget
(:func:`labkit.checks.call_learner`), and keeps further hints for
:func:`labkit.checks.hint`.
"""

from __future__ import annotations

import itertools
import linecache
import math
import os
import re
import traceback
import types
import weakref
from collections import Counter
from typing import Any, Callable

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from labkit.backend import ensure as _backend
from labkit.backend import recover as _recover
from labkit.checks import NOT_DONE, LearnerTimeout, call_learner, compare_outputs, fail, passed
from labkit.core.errors import exception_chain, in_library
from labkit.core.signature import ArgMetadata, mismatches
from labkit.core.validate import check_int

__all__ = ["check_capturable_clip", "check_arg_mismatches", "check_build_server"]


class _Failure(Exception):
    """One trial failed: ``message`` names the mistake, ``more_hints`` go further."""

    def __init__(self, message: str, more_hints: list[str] | None = None):
        super().__init__(message)
        self.message = message
        self.more_hints = list(more_hints or [])




def _learner_error(exc: BaseException) -> str:
    """The root cause of ``exc`` (a failed capture raises twice), with the learner's line.

    ``TypeError: message`` and ``at line N of your cell: code``: the first line of the
    deepest error in the chain, at the deepest frame outside labkit and torch.
    """
    root = exception_chain(exc)[0]
    first = str(root).splitlines()[0] if str(root) else ""
    text = f"{type(root).__name__}: {first}" if first else type(root).__name__
    pick = None
    for tb_exc in (root, exc):
        for fr in traceback.extract_tb(tb_exc.__traceback__):
            if not in_library(fr.filename):
                pick = fr
        if pick is not None:
            break
    if pick is None:
        return text
    cell = pick.filename.startswith(("<ipython-input", "<cell")) \
        or "ipykernel_" in pick.filename
    where = "your cell" if cell else os.path.basename(pick.filename)
    loc = f"line {pick.lineno} of {where}"
    if pick.name != "<module>":
        loc += f" (in {pick.name})"
    line = (pick.line or linecache.getline(pick.filename, pick.lineno)).strip()
    return f"{text}\n   at {loc}: {line}" if line else f"{text}\n   at {loc}"


def _generator(seed: int) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(seed)
    return g


def _run(name: str, trials: int, one_trial: Callable[[int, torch.Generator], None], *,
         quiet: bool, explain: Callable[[BaseException], _Failure] | None = None,
         B=None):
    """Run ``one_trial(trial, gen)`` for each trial; turn what goes wrong into one report."""
    check_int("trials", trials, 1, fix="a checker passes only after at least one trial")
    for trial in range(1, trials + 1):
        gen = _generator(1000 * trial + 3)
        torch.manual_seed(trial)
        try:
            one_trial(trial, gen)
        except NotImplementedError as exc:
            if str(exc):      # torch's own (an op a device lacks), not the blank's stub
                return fail(name, f"trial {trial} of {trials}: your code raised "
                            f"{_learner_error(exc)}", kind="exception", quiet=quiet,
                            trials=trial - 1, failed_trial=trial)
            return fail(name, NOT_DONE, kind="not_implemented", quiet=quiet,
                        trials=trial - 1, failed_trial=trial)
        except _Failure as f:
            return fail(name, f"trial {trial} of {trials}: {f.message}",
                        more_hints=f.more_hints, quiet=quiet, trials=trial - 1,
                        failed_trial=trial)
        except LearnerTimeout as exc:
            if B is not None:
                _recover(B)
            return fail(name, f"trial {trial} of {trials}: {exc}", kind="timeout",
                        quiet=quiet, trials=trial - 1, failed_trial=trial)
        except Exception as exc:  # the learner's code raised
            if B is not None:
                _recover(B)
            f = explain(exc) if explain is not None else None
            if f is None:
                f = _Failure(f"your code raised {_learner_error(exc)}")
            return fail(name, f"trial {trial} of {trials}: {f.message}",
                        more_hints=f.more_hints, kind="exception", quiet=quiet,
                        trials=trial - 1, failed_trial=trial, details={"exception": exc})
    plural = "trial" if trials == 1 else "trials"
    return passed(name, f"passed {trials} random {plural}", quiet=quiet, trials=trials)


# =========================================================================================
# exercise 1: capturable_clip
# =========================================================================================

def _clip_reference(x: torch.Tensor) -> torch.Tensor:
    m = x.abs().max()
    return torch.where(m > 1, x / m, x)


# The ranks tried eagerly, in this order: a per-row maximum shows at 2-D, a maximum per
# matrix (the last two dims) at 3-D, an answer that breaks on a 0-d tensor last.
_RANKS = (1, 2, 3, 4, 0)


def _clip_shape(gen: torch.Generator, rank: int) -> tuple[int, ...]:
    """A random shape of ``rank`` dims (each of size >= 2, so that every slice has a
    neighbour: a maximum per slice differs from the maximum over the whole tensor)."""
    if rank == 0:
        return ()
    if rank == 1:
        return (_rand_int(gen, 4, 32),)
    if rank == 2:
        return (_rand_int(gen, 2, 5), _rand_int(gen, 3, 8))
    hi = 4 if rank == 3 else 3
    return tuple(_rand_int(gen, 2, hi) for _ in range(rank))


def _clip_inputs(gen: torch.Generator, device, shape: tuple[int, ...]) -> list[torch.Tensor]:
    """Four inputs of ``shape``: max|x| above 1 (two elements beyond 1), at most 1, above
    1 from a negative element (max(x) between 1 and max|x|), at most 1 from a negative
    element. A 0-d input is the one element: big, small, -big, -small."""
    n = math.prod(shape)
    if n == 1:
        big = 2.0 + 2.0 * float(torch.rand((), generator=gen))
        small = 0.5 + 0.4 * float(torch.rand((), generator=gen))
        return [torch.tensor(v).reshape(shape).to(device) for v in (big, small, -big, -small)]
    xs = []
    for k in range(4):
        x = torch.rand(n, generator=gen) * 1.6 - 0.8          # values in (-0.8, 0.8)
        i = int(torch.randint(0, n, (), generator=gen))
        j = (i + 1 + int(torch.randint(0, n - 1, (), generator=gen))) % n
        big = 2.0 + 2.0 * float(torch.rand((), generator=gen))
        above = 1.1 + 0.5 * float(torch.rand((), generator=gen))   # in (1, big)
        small = 0.5 + 0.4 * float(torch.rand((), generator=gen))
        if k == 0:        # max |x| > 1, the largest element positive, another one above 1
            x[i], x[j] = big, -above
        elif k == 1:      # max |x| <= 1
            x = x / x.abs().max() * small
        elif k == 2:      # max |x| > 1 from a negative element; 1 < max(x) < max |x|
            x[i], x[j] = -big, above
        else:             # max |x| <= 1 from a negative element, a row maximum below it
            x = x.clamp(-0.6, 0.3)
            x[i] = -small
        xs.append(x.reshape(shape).to(device))
    return xs


def _clip_input_sets(gen: torch.Generator, device) -> list[list[torch.Tensor]]:
    """One set of four inputs (:func:`_clip_inputs`) per rank of :data:`_RANKS`, random
    sizes: the text says "any shape"."""
    return [_clip_inputs(gen, device, _clip_shape(gen, rank)) for rank in _RANKS]


def _per_slice(rest: tuple[int, ...]) -> str:
    """What one maximum over the other dims is taken per: ``x[i]``, ``x[i, j]``, ..."""
    if rest == tuple(range(len(rest))):
        return "x[" + ", ".join("ijkl"[:len(rest)]) + "]"
    return f"index of dim{'s' if len(rest) > 1 else ''} {', '.join(map(str, rest))}"


def _clip_variants(x: torch.Tensor) -> list[tuple[torch.Tensor, str, list[str]]]:
    """Wrong formulas learners write, with what to say when one of them is seen."""
    m = x.abs().max()
    out = [
        (x.clone(), "it returned x unchanged although max|x| > 1",
         ["clip divides by max|x| when max|x| > 1; your function never divides."]),
        (x / m, "it divided by max|x| although max|x| <= 1, where clip returns x as is",
         ["The division must depend on a condition, decided on the device."]),
        (torch.where(x.abs() > 1, x / m, x),
         "it scaled only the elements with |x| > 1; clip makes ONE decision for the whole "
         "tensor, from max|x|, and then divides every element",
         ["The condition is on the scalar m = max|x|, not on each element."]),
        (x.clamp(-1, 1),
         "it clamped each element to [-1, 1]; clip divides the whole tensor by max|x|, so "
         "the ratios between elements stay the same",
         ["Clamping cuts the large elements only; dividing by max|x| scales them all."]),
    ]
    mx = x.max()
    out.append((torch.where(mx > 1, x / mx, x),
                "it used max(x) where clip uses max(|x|): a large negative element counts too",
                ["x.abs().max(), not x.max()."]))
    whole = ["x.abs().max() with no dim gives the maximum over all elements, whatever the "
             "shape."]
    if x.dim() == 2:
        for dim in (0, 1):
            mr = x.abs().amax(dim=dim, keepdim=True)
            out.append((torch.where(mr > 1, x / mr, x),
                        f"it took max|x| along dim={dim} (one maximum per "
                        f"{'column' if dim == 0 else 'row'}); clip uses one maximum over "
                        f"the whole tensor, whatever its shape", whole))
    elif x.dim() > 2:
        for k in range(1, x.dim()):
            for dims in itertools.combinations(range(x.dim()), k):
                mr = x.abs().amax(dim=dims, keepdim=True)
                rest = tuple(d for d in range(x.dim()) if d not in dims)
                over = f"dim {dims[0]}" if k == 1 else f"dims {dims}"
                out.append((torch.where(mr > 1, x / mr, x),
                            f"it took max|x| over {over} of a {x.dim()}-D input (one maximum "
                            f"per {_per_slice(rest)}); clip uses one maximum over the whole "
                            f"tensor, whatever its shape", whole))
    return out


def _regime(x: torch.Tensor) -> str:
    return "max|x| > 1" if bool(x.abs().max() > 1) else "max|x| <= 1"


def _diagnose_clip(x: torch.Tensor, got: Any, where: str) -> _Failure | None:
    want = _clip_reference(x)
    msg = compare_outputs(want, got, rtol=1e-5, atol=1e-6, where="")
    if msg is None:
        return None
    if isinstance(got, torch.Tensor) and got.shape == want.shape and got.dtype == want.dtype:
        for value, why, hints in _clip_variants(x):
            if torch.allclose(got.detach().cpu().float(), value.cpu(), rtol=1e-5, atol=1e-6):
                return _Failure(f"{where}, on an input with {_regime(x)} of shape "
                                f"{tuple(x.shape)}: {why}. Compare with clip_if "
                                f"(section 3).", hints)
    return _Failure(f"{where}, on an input with {_regime(x)} of shape {tuple(x.shape)}: "
                    f"{msg}. Compare your function with clip_if (section 3) on such an "
                    f"input.",
                    ["clip returns x / max|x| when max|x| > 1, else x itself.",
                     "Compute m = x.abs().max() and choose between the two results with "
                     "torch.where, on the device."])


def check_capturable_clip(capturable_clip, *, B=None, trials: int = 3,
                          quiet: bool = False, time_limit: float = 10.0):
    """Check ``capturable_clip(x)``: ``clip``'s values, no hazard, and a graph that keeps
    both regimes.

    Args:
        capturable_clip: the learner's function of one tensor.
        B: the backend (default ``labkit.backend.get("auto")``).
        trials: random trials; each runs four inputs of a random shape of every rank from
            0 to 4 eagerly, then captures on one of those shapes.
        quiet: do not print.
        time_limit: seconds the learner's code may run per call.

    .. warning::
        The checker captures the learner's function for real. After a capture that raised,
        it calls :func:`labkit.backend.recover` so the notebook stays usable.
    """
    from labkit.capture import capture
    from labkit.guards import lint_capture

    B = _backend(B)
    name = "capturable_clip"
    if not callable(capturable_clip):
        return fail(name, f"expected a function, got {type(capturable_clip).__name__}",
                    quiet=quiet)

    def call(x):
        return call_learner(capturable_clip, x, time_limit=time_limit)

    def one_trial(trial, gen):
        sets = _clip_input_sets(gen, B.device)
        # 1. eagerly, on every rank from 0 to 4: the right values, the input left alone
        for x in (x for xs in sets for x in xs):
            arg = x.clone()
            try:
                got = call(arg)
            except (NotImplementedError, LearnerTimeout):
                raise
            except Exception as exc:
                raise _Failure(
                    f"run eagerly on an input of shape {tuple(x.shape)} ({x.dim()}-D), your "
                    f"code raised {_learner_error(exc)}\n   The exercise says a tensor of any "
                    f"shape, a 0-d one too: clip needs nothing shape-specific.",
                    ["x.abs().max() works on any shape (it reduces over every element)."]
                ) from exc
            if got is None:
                raise _Failure("your function returned None (did you forget `return`?)",
                               ["Return the tensor torch.where(...) gives."])
            if not torch.equal(arg, x):
                raise _Failure("your function changed its input x in place (clip returns a "
                               "new tensor and leaves x alone; in a graph the static input "
                               "would be scaled again at every replay)",
                               ["Use x / m, not x /= m or x.div_(m)."])
            bad = _diagnose_clip(x, got, "run eagerly")
            if bad is not None:
                raise bad
        xs = sets[_rand_int(gen, 0, len(sets) - 1)]       # the shape captured and replayed
        # 2. the linter: hazards that fail capture, with the line
        report = lint_capture(capturable_clip, xs[0].clone(), B=B)
        fatal = [f for f in report.findings if f.severity == "fails capture"]
        if fatal:
            f = fatal[0]
            more = f" (and {len(fatal) - 1} more)" if len(fatal) > 1 else ""
            code = f": {f.code}" if f.code else ""
            raise _Failure(
                f"your function gives the right values eagerly but cannot be captured{more}: "
                f"{f.title} ({f.op}) at {f.where()}{code}. Section 3 shows why and the "
                f"device-side alternatives.",
                [f"fix: {f.fix}",
                 "Decide with a tensor condition, not a Python `if`: torch.where(cond, a, b) "
                 "computes both a and b and picks on the device."])
        # 3. capture once, replay on both regimes
        static_x = xs[0].clone()
        try:
            g, static_out = capture(lambda t: call(t), static_x, B=B)
        except (NotImplementedError, LearnerTimeout):
            raise
        except Exception as exc:
            _recover(B)
            raise _Failure(f"capture of your function failed: {_learner_error(exc)}. "
                           f"The linter found nothing: look for a host read it cannot see "
                           f"(section 10 says which).") from exc
        if not isinstance(static_out, torch.Tensor):
            raise _Failure(f"the captured function returned {type(static_out).__name__}, "
                           f"not a tensor",
                           ["A captured function's result is its static output: a tensor."])
        for k in (1, 0, 3, 2):
            static_x.copy_(xs[k])
            g.replay()
            got = static_out.clone()
            if compare_outputs(_clip_reference(xs[k]), got, rtol=1e-5, atol=1e-6):
                raise _Failure(
                    f"eagerly your function is right, but its graph (captured on an input "
                    f"with {_regime(xs[0])}) is wrong on an input with {_regime(xs[k])}: "
                    f"{compare_outputs(_clip_reference(xs[k]), got, where='')}. Something was "
                    f"decided once, at capture: does your graph compute both cases?",
                    ["Python runs once, at capture (sections 3 and 7): a Python value or "
                     "branch computed from the input is frozen into the graph.",
                     "Keep m and the condition as tensors: torch.where(m > 1, x / m, x)."])

    return _run(name, trials, one_trial, quiet=quiet, B=B)


# =========================================================================================
# exercise 2: arg_mismatches
# =========================================================================================

FIELDS = ("count", "type", "shape", "dtype", "device", "value")


def _arg_mismatches_reference(captured, received) -> list[tuple]:
    """The answer: :func:`labkit.core.signature.mismatches` as the exercise's tuples."""
    metas = [ArgMetadata.of(c) for c in captured]
    return [(m.where, m.field, m.captured, m.received) for m in mismatches(metas, received)]


_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.int64)


def _rand_int(gen, lo, hi) -> int:
    return int(torch.randint(lo, hi + 1, (), generator=gen))


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
        received[t] = torch.empty(c.shape, dtype=c.dtype, device="meta")    # a Parameter
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
    elif kind == 6:    # changed Python values of several kinds
        for kind_ in ("float", "str", "bool"):
            v = _rand_value(gen, kind_)
            pos = _rand_int(gen, 0, len(captured))
            captured.insert(pos, v)
            received.insert(pos, _other_value(gen, v))
    elif kind == 7:    # a random mix
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


def _explain_arg_mismatches(exc: BaseException) -> _Failure | None:
    text = str(exc)
    desc = _learner_error(exc)
    if isinstance(exc, RuntimeError) and ("Boolean value of Tensor" in text
                                          or "must match the size of tensor" in text):
        return _Failure(
            f"your code raised {desc}\n   You compared two tensors with == or != (or used a "
            f"tensor in an `if`): that compares their values element by element. Values are "
            f"never compared; compare shape, dtype and device.",
            ["Compare c.shape with r.shape, c.dtype with r.dtype, c.device with r.device."])
    if isinstance(exc, AttributeError) and any(a in text for a in ("shape", "dtype", "device")):
        return _Failure(
            f"your code raised {desc}\n   At some position one side is a tensor and the "
            f"other is not (or neither is): check the types first, and compare shapes only "
            f"when both are tensors.",
            ["isinstance(x, torch.Tensor) on both sides; when it differs, report a 'type' "
             "mismatch and nothing else for that position."])
    if isinstance(exc, IndexError):
        return _Failure(
            f"your code raised {desc}\n   The two lists can have different lengths: compare "
            f"only the positions both have.",
            ["zip(captured, received) stops at the shorter list."])
    return None


def _diagnose_arg_mismatches(captured, received, expected, actual) -> _Failure | None:
    if actual is None:
        return _Failure("your function returned None (did you forget `return`? A call that "
                        "matches returns an empty list)")
    if not isinstance(actual, (list, tuple)):
        return _Failure(f"expected a list of tuples, got {type(actual).__name__}")
    for a in actual:
        if not isinstance(a, (tuple, list)) or len(a) != 4:
            return _Failure(f"each mismatch must be a tuple of 4: (where, field, captured, "
                            f"received); got {a!r}")
    for a in actual:
        if a[1] not in FIELDS:
            return _Failure(f"unknown field {a[1]!r} in {_fmt(a)}: the field is one of "
                            f"{', '.join(map(repr, FIELDS))}")
        if not isinstance(a[0], str):
            return _Failure(f"the place must be a string like 'args[0]' (or 'args' for the "
                            f"count); got {a[0]!r} in {_fmt(a)}")
        if a[0] != "args" and not _PLACE.fullmatch(a[0]):
            digits = re.findall(r"\d+", a[0])
            want = f"'args[{digits[0]}]'" if digits else "'args[0]', 'args[1]', ..."
            return _Failure(f"the place {a[0]!r} in {_fmt(a)} is not written as the exercise "
                            f"asks: position i is f\"args[{{i}}]\" ({want} here), and the "
                            f"count's place is 'args'. The messages of get_mismatch_errors "
                            f"use these names.")
    counts = Counter(_key(a) for a in actual)
    twice = [k for k, n in counts.items() if n > 1]
    if twice:
        return _Failure(f"{twice[0]} is reported {counts[twice[0]]} times: report each "
                        f"mismatch once")
    want = {_key(e): e for e in expected}
    got = {_key(a): a for a in actual}
    missing = [want[k] for k in want if k not in got]
    extra = [got[k] for k in got if k not in want]
    if not missing and not extra:
        return None
    by_place = {(e[0], e[1]): e for e in expected}
    tensors_at = {f"args[{i}]" for i, (c, r) in enumerate(zip(captured, received))
                  if isinstance(c, torch.Tensor) and isinstance(r, torch.Tensor)}
    # what the learner put in a tuple that exists in the reference, but with other values
    for a in extra:
        e = by_place.get((a[0], a[1]))
        if e is None:
            continue
        where, field = a[0], a[1]
        if _key((where, field, a[3], a[2])) == _key(e):
            return _Failure(
                f"{_fmt(a)} has its last two values swapped: at {where} the captured {field} "
                f"is {_norm(e[2])!r} and the received one {_norm(e[3])!r}. The tuple is "
                f"(where, field, captured, received), captured first, like the parameters "
                f"arg_mismatches(captured, received).")
        if field in ("dtype", "device") and any(isinstance(v, str) for v in a[2:]):
            return _Failure(
                f"{_fmt(a)} gives the {field} as a string; give the torch object itself "
                f"({'c.dtype, a torch.dtype' if field == 'dtype' else 'c.device, a torch.device'}"
                f"), as in {_fmt(e)}.")
        if field == "shape" and any(isinstance(v, list) or isinstance(v, str) for v in a[2:]):
            return _Failure(f"{_fmt(a)} gives the shape as a {type(a[2]).__name__}; give a "
                            f"tuple of ints: tuple(c.shape).")
        if field == "type" and any(isinstance(v, type) for v in a[2:]):
            return _Failure(f"{_fmt(a)} gives the types themselves; give their names, "
                            f"type(c).__name__ (a tensor's is 'Tensor').")
        if field == "count":
            return _Failure(f"{_fmt(a)} is not the count tuple: captured has "
                            f"{len(captured)} arguments and received {len(received)}; the "
                            f"tuple is ('args', 'count', len(captured), len(received)).")
        return _Failure(f"{_fmt(a)}: the values are wrong for {where}'s {field}, whose "
                        f"captured and received {field}s are not these.")
    shared = min(len(captured), len(received))
    for a in extra:
        where, field = a[0], a[1]
        type_at = by_place.get((where, "type"))
        i = int(where[5:-1]) if _PLACE.fullmatch(where) else None
        if i is not None and i >= shared:
            longer, n_long, n_short = (("captured", len(captured), len(received))
                                       if len(captured) > len(received) else
                                       ("received", len(received), len(captured)))
            return _Failure(
                f"you reported {_fmt(a)}, but {where} exists only in {longer} ({longer} has "
                f"{n_long} arguments, the other list {n_short}): there is nothing to compare "
                f"it with (the None is a filler: itertools.zip_longest?). Compare only the "
                f"positions both lists have; the count tuple already says that one list is "
                f"longer.",
                ["zip(captured, received) stops at the shorter list."])
        if field == "type" and i is not None and isinstance(captured[i], torch.Tensor) \
                and isinstance(received[i], torch.Tensor):
            return _Failure(
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
            return _Failure(
                f"you reported {_fmt(a)}, but at {where} the captured {captured[i]!r} and the "
                f"received {received[i]!r} are equal (==) but not the same object: `is not` "
                f"compares identity, and two equal floats or strings made separately are two "
                f"objects. A graph baked in the VALUE: use != for values.",
                ["c != r compares values; c is not r compares objects."])
        if field == "value" and where in tensors_at:
            return _Failure(
                f"you reported {_fmt(a)}, but {where} is a tensor on both sides with the same "
                f"shape, dtype and device: tensor VALUES are never compared. New values are "
                f"what a replay is for; only the metadata is fixed at capture.")
        if type_at is not None and _key(type_at) not in got:
            return _Failure(
                f"you reported {_fmt(a)}, but at {where} the types differ "
                f"({type_at[2]} captured, {type_at[3]} received), and your list has no "
                f"'type' tuple for it: compare the types first; when they differ, the 'type' "
                f"tuple is the only one for that position.",
                ["type(c) is not type(r) (not isinstance: bool is a subclass of int), "
                 "before any value comparison."])
        if type_at is not None:
            return _Failure(
                f"you reported {_fmt(a)}, but at {where} the types differ "
                f"({type_at[2]} captured, {type_at[3]} received): report only the 'type' "
                f"tuple there, nothing else for that position.",
                ["if / elif: once the types differ, skip the other comparisons of that "
                 "position."])
        if where == "args" or field == "count":
            return _Failure(f"you reported {_fmt(a)}, but both lists have {len(captured)} "
                            f"arguments.")
        return _Failure(f"you reported {_fmt(a)}, but {where}'s {field} is the same in the "
                        f"captured and the received arguments.")
    # only missing ones left
    reported = {a[0] for a in actual}
    for e in missing:
        where, field = e[0], e[1]
        if field == "count":
            return _Failure(
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
                return _Failure(
                    f"at {where} the captured {cv!r} ({c}) and the received {rv!r} ({r}) are "
                    f"equal in Python, but their types differ and your list has nothing for "
                    f"it. Compare types before values: a graph captured with {cv!r} baked in "
                    f"{'an' if c[:1] in 'aeiou' else 'a'} {c}.",
                    ["type(c) is not type(r) (not isinstance: bool is a subclass of int)."])
            return _Failure(
                f"at {where} one argument is a {c} and the other a {r}, and your list has "
                f"nothing for it: check whether each side is a tensor before comparing "
                f"anything else.")
        if where in reported:
            others = sorted({a[1] for a in actual if a[0] == where})
            return _Failure(
                f"at {where} you reported {', '.join(others)} but not the {field}, which "
                f"differs too. Report EVERY field that differs, not only the first one per "
                f"argument: one message listing all mismatches is the point.",
                ["Three separate `if`s (shape, dtype, device), not `if/elif`."])
        return _Failure(f"at {where} the {field} differs and your list has nothing for it.",
                        [f"Look at how your code compares the {field} of the two "
                         f"arguments at {where}."])
    return None


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
                              time_limit=time_limit)
        for s, x in zip(snapshot, received):
            if isinstance(s, torch.Tensor) and s is not x and not torch.equal(s, x):
                raise _Failure("your function changed a received tensor in place: it must "
                               "only look")
        bad = _diagnose_arg_mismatches(captured, received, expected, actual)
        if bad is not None:
            shown = ", ".join(_describe_arg(x) for x in captured)
            got = ", ".join(_describe_arg(x) for x in received)
            raise _Failure(f"{bad.message}\n   captured: [{shown}]\n   received: [{got}]",
                           bad.more_hints)

    return _run(name, trials, one_trial, quiet=quiet, explain=_explain_arg_mismatches)


def _describe_arg(x) -> str:
    if isinstance(x, torch.Tensor):
        dev = "" if x.device.type in ("cpu", "cuda") else f" {x.device}"
        kind = "Parameter" if isinstance(x, torch.nn.Parameter) else "Tensor"
        return f"{kind}{tuple(x.shape)} {str(x.dtype).replace('torch.', '')}{dev}"
    return repr(x)


# =========================================================================================
# exercise 3 (diagnosis): build_server
# =========================================================================================

SERVER_SHAPE = (4, 16)


def _counting_backend(B):
    """A copy of the backend namespace whose graphs count their captures and replays.

    At each replay it also notes (``stats["dropped"]``) every tensor the captures read
    that is gone by then (see :class:`_CaptureReads`).
    """
    stats = {"captures": 0, "replays": 0, "replaying": False, "reads": {}, "dropped": None}

    class CountingGraph(B.CUDAGraph):
        def capture_begin(self, *args, **kwargs):
            stats["captures"] += 1
            return super().capture_begin(*args, **kwargs)

        def replay(self):
            if stats["dropped"] is None:
                gone = [shape for ref, shape, _ in stats["reads"].values() if ref() is None]
                if gone:
                    stats["dropped"] = (stats["replays"], gone)
            stats["replays"] += 1
            stats["replaying"] = True     # the emulator replays ATen ops: not eager ones
            try:
                return super().replay()
            finally:
                stats["replaying"] = False

    counted = types.SimpleNamespace(**vars(B))
    counted.CUDAGraph = CountingGraph
    return counted, stats


_METADATA = {"__get__", "size", "dim", "stride", "numel", "data_ptr", "element_size",
             "is_contiguous", "storage_offset", "untyped_storage", "__len__", "nelement"}


def _version(t: torch.Tensor) -> int | None:
    """``t``'s version counter (bumped by every in-place write), None if it has none."""
    try:
        return t._version
    except RuntimeError:        # inference tensors have no version counter
        return None


def _never_written(stats: dict) -> list[tuple]:
    """Shapes of the one-element tensors the captures read that nothing wrote since."""
    out = []
    for ref, shape, version in stats["reads"].values():
        t = ref()
        if t is not None and t.numel() == 1 and version is not None \
                and _version(t) == version:
            out.append(shape)
    return out


def _shape_str(shape: tuple) -> str:
    return "(" + ", ".join(map(str, shape)) + ("," if len(shape) == 1 else "") + ")"


class _CaptureReads(TorchFunctionMode):
    """Notes, weakly, every tensor made before a capture that the capture reads.

    A graph reads its inputs by address and keeps no Python reference to them. If the
    learner gives the only name of one a new tensor (``t = torch.tensor(temperature)``),
    the captured one is freed: the emulator's recorded ops still alias its memory (so
    replays keep reading the value it held at capture), while a GPU's caching allocator
    hands the block to the next tensor allocated (so replays read whatever lands there).
    Whether the tensor object is still alive at a replay is the same on both backends.
    Active around ``build_server``; records only while the current stream captures.
    """

    def __init__(self, B, stats: dict):
        super().__init__()
        self.B, self.reads = B, stats["reads"]
        self.made: dict[int, weakref.ref] = {}   # tensors the captures created

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        capturing = getattr(func, "__name__", "") not in _METADATA and \
            self.B.is_current_stream_capturing()
        if capturing:
            for t in tree_flatten((args, kwargs))[0]:
                if isinstance(t, torch.Tensor) and id(t) not in self.reads:
                    made = self.made.get(id(t))
                    if made is None or made() is not t:
                        self.reads[id(t)] = (weakref.ref(t), tuple(t.shape), _version(t))
        out = func(*args, **kwargs)
        if capturing:
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor) and id(t) not in self.reads:
                    self.made[id(t)] = weakref.ref(t)
        return out


_SOFTMAX_OPS = ("softmax", "_softmax", "_safe_softmax", "log_softmax", "_log_softmax", "exp",
                "exp_")


class _EagerSoftmaxCounter(TorchDispatchMode):
    """Counts softmax (and exp) ATen ops run eagerly: not captured, not replayed."""

    def __init__(self, B, stats: dict):
        super().__init__()
        self.B, self.stats, self.count = B, stats, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.__name__.split(".")[0] in _SOFTMAX_OPS and not self.stats["replaying"] \
                and not self.B.is_current_stream_capturing():
            self.count += 1
        return func(*args, **(kwargs or {}))


def _implied_temperature(probs: torch.Tensor, logits: torch.Tensor) -> float | None:
    """The t with probs == softmax(logits / t), if probs is one (least squares on logs)."""
    if bool((probs <= 0).any()):
        return None
    lp = probs.log()
    lp = lp - lp.mean(dim=-1, keepdim=True)
    lg = logits - logits.mean(dim=-1, keepdim=True)
    denom = float((lp * lp).sum())
    if denom < 1e-12:
        return math.inf          # uniform: no logits seen at all
    return float((lg * lp).sum()) / denom


def check_build_server(build_server, *, B=None, trials: int = 2, quiet: bool = False,
                       time_limit: float = 20.0):
    """Check the fixed ``build_server(B)``: its ``serve(batches, temperatures)`` must
    replay ONE graph, captured in ``build_server``, once per batch, and return
    ``softmax(logits / t)`` for every batch as separate tensors.

    Args:
        build_server: the learner's function of a backend.
        B: the backend (default ``labkit.backend.get("auto")``); the learner's function
            gets a copy whose graphs count their captures and replays.
        trials: each builds a server and serves 3 to 6 random batches.
        quiet: do not print.
        time_limit: seconds ``build_server`` and ``serve`` may each run.
    """
    B = _backend(B)
    name = "build_server"
    if not callable(build_server):
        return fail(name, f"expected a function, got {type(build_server).__name__}",
                    quiet=quiet)

    def one_trial(trial, gen):
        counted, stats = _counting_backend(B)
        try:
            with _CaptureReads(B, stats):
                serve = call_learner(build_server, counted, time_limit=time_limit)
        except (NotImplementedError, LearnerTimeout, _Failure):
            raise
        except Exception as exc:
            _recover(B)
            raise _Failure(f"build_server raised {_learner_error(exc)}",
                           ["The line named above raised while building the server. An "
                            "error inside the capture is a pitfall of section 3 (a host read: "
                            ".item(), print, an `if` on a tensor)."]) from exc
        if not callable(serve):
            raise _Failure(f"build_server must return the function serve; it returned "
                           f"{type(serve).__name__}",
                           ["build_server builds the server once and returns the inner "
                            "function serve itself, not the result of calling it."])
        if stats["captures"] == 0:
            raise _Failure("build_server captured no graph: capture the softmax once there, "
                           "with the B it is given (capture(..., B=B))",
                           ["The checker counts captures made with the B that build_server "
                            "is given: a capture with another backend, or none, counts "
                            "nothing."])
        built = stats["captures"]
        if built > 1:
            raise _Failure(
                f"build_server captured {built} graphs: the exercise asks for ONE graph, "
                f"captured once. Every graph you capture keeps its memory pool reserved for "
                f"as long as it lives, and serve replays only one of them: drop the others.",
                ["Which capture does serve replay? Keep that one; delete the others (a "
                 "leftover first attempt?)."])
        n = _rand_int(gen, 3, 6)
        batches = [(torch.randn(SERVER_SHAPE, generator=gen) * 3).to(B.device)
                   for _ in range(n)]
        temps = [round(0.4 + 2.0 * float(torch.rand((), generator=gen)), 2) for _ in range(n)]
        while len(set(temps)) < n:
            temps = [t + 0.01 * i for i, t in enumerate(temps)]
        before = stats["replays"]
        eager = _EagerSoftmaxCounter(B, stats)
        try:
            with eager:
                results = call_learner(serve, [b.clone() for b in batches], list(temps),
                                       time_limit=time_limit)
        except (NotImplementedError, LearnerTimeout):
            raise
        except Exception as exc:
            _recover(B)
            raise _Failure(f"serve raised {_learner_error(exc)}") from exc
        new_captures = stats["captures"] - built
        replays = stats["replays"] - before
        if new_captures:
            raise _Failure(
                f"serve captured {new_captures} new graph{'s' if new_captures > 1 else ''} "
                f"for {n} batches: capture once, in build_server; serve only fills the static "
                f"inputs and replays (a capture per call costs more than running eagerly).",
                ["What changes from batch to batch must live in static tensors that serve "
                 "fills in place (section 7)."])
        if replays != n:
            raise _Failure(
                f"serve replayed the graph {replays} times for {n} batches: compute every "
                f"batch by one replay of the captured graph (not eagerly).",
                ["Per batch: fill the static inputs in place, replay once, read the static "
                 "output."])
        if eager.count:
            raise _Failure(
                f"serve ran {eager.count} softmax/exp op(s) eagerly, outside the graph, for "
                f"{n} batches: replaying the graph beside an eager computation does not "
                f"count. Every result must come from the graph: read (and clone) its static "
                f"output after each replay.",
                ["The replay computes softmax(logits / t); what does serve still compute "
                 "itself? Drop it and keep what the graph wrote."])
        if not isinstance(results, (list, tuple)) or len(results) != n:
            got = (f"{len(results)} items" if isinstance(results, (list, tuple))
                   else type(results).__name__)
            raise _Failure(f"serve must return a list of {n} results (one per batch); "
                           f"got {got}",
                           ["Append one result per batch to a list, in the order of the "
                            "batches, and return the list."])
        for i, r in enumerate(results):
            if not isinstance(r, torch.Tensor) or tuple(r.shape) != SERVER_SHAPE:
                raise _Failure(f"result {i} is not a tensor of shape {SERVER_SHAPE}: "
                               f"{type(r).__name__}"
                               f"{tuple(r.shape) if isinstance(r, torch.Tensor) else ''}",
                               ["Each result is a copy of the graph's static output, "
                                "the softmax of one batch."])
        ptrs = [r.data_ptr() for r in results]
        if len(set(ptrs)) < n:
            i = next(i for i in range(n) if ptrs.index(ptrs[i]) != i)
            j = ptrs.index(ptrs[i])
            raise _Failure(
                f"results {j} and {i} are the same memory: the graph's static output, which "
                f"every replay overwrites, so all your results show the last batch "
                f"(section 6).",
                ["Keep a copy of the static output after each replay: .clone()."])
        expected = [torch.softmax(b / t, dim=-1) for b, t in zip(batches, temps)]
        wrong = [i for i in range(n)
                 if not torch.allclose(results[i].float(), expected[i], rtol=1e-4, atol=1e-6)]
        if not wrong:
            return
        if stats["dropped"] is not None:
            # checked before the values: on a GPU, replays of a freed input read whatever
            # the allocator put in its memory since, so the values say nothing reliable
            at, shapes = stats["dropped"]
            shape = shapes[0]
            if shape == SERVER_SHAPE:
                what, example = " (your static logits?)", "static_logits = logits"
                fix = "copy_ each batch into it (section 1)"
            elif math.prod(shape) == 1:
                what, example = " (your temperature?)", "t = torch.tensor(temperature)"
                fix = "fill_ it with each temperature (section 7)"
            else:
                what, example = "", "x = new_tensor"
                fix = "fill it in place before each replay (sections 1 and 7)"
            raise _Failure(
                f"result {wrong[0]} is not softmax(logits / t). By replay {at + 1}, a tensor "
                f"of shape {_shape_str(shape)}{what} that the graph reads was gone: nothing "
                f"in your code held it any more. Giving a name a new tensor ({example}) "
                f"does not change what the graph reads: it still reads the old tensor's "
                f"memory (on a GPU that memory is free, and the next tensor allocated may "
                f"land there). Keep the captured tensor and {fix}.",
                ["The graph was captured on the tensors that existed then; it reads them by "
                 "address at every replay. Write new values into them in place."])
        implied = [_implied_temperature(results[i].detach().float().cpu(),
                                        batches[i].cpu()) for i in range(n)]
        uniform = torch.full(SERVER_SHAPE, 1.0 / SERVER_SHAPE[1])
        if n > 1 and all(torch.allclose(r.float(), expected[-1], rtol=1e-4, atol=1e-6)
                         for r in results):
            raise _Failure(
                "every result equals the LAST batch's softmax: you kept references to the "
                "static output and cloned after the loop: every replay overwrote them "
                "(section 6).",
                ["Clone the static output right after each replay, inside the loop."])
        if all(torch.allclose(results[i].float().cpu(), uniform, atol=1e-5) for i in wrong) \
                or all(torch.allclose(results[i].float(), results[0].float()) for i in wrong):
            raise _Failure(
                "your results do not depend on the batches: the graph keeps reading the "
                "logits it was captured with. Assigning a new tensor to a name does not "
                "change the memory the graph reads (section 1).",
                ["Fill the static input in place: static_logits.copy_(logits)."])
        if any(i > 0 for i in wrong) and all(
                i == 0 or torch.allclose(results[i].float(), expected[i - 1], rtol=1e-4,
                                         atol=1e-6) for i in wrong):
            raise _Failure(
                "each result is the previous batch's: serve replays before it fills the "
                "static inputs. Fill first, then replay, then read.",
                ["The replay reads the static inputs when it runs: what is in them at "
                 "that moment is what it computes."])
        finite = [t for t in implied if t is not None and math.isfinite(t)]
        if len(finite) == n and max(finite) - min(finite) < 1e-3 and _never_written(stats):
            raise _Failure(
                f"every result is softmax(logits / {finite[0]:.3g}): the temperature is the "
                f"one the graph was captured with, whatever serve is given. The graph divides "
                f"by a tensor of shape {_shape_str(_never_written(stats)[0])} that nothing "
                f"wrote after the capture: giving a name a new tensor does not change what "
                f"the graph reads (section 7).",
                ["Fill the captured temperature tensor in place before each replay: "
                 "t.fill_(temperature)."])
        if len(finite) == n and max(finite) - min(finite) < 1e-3:
            raise _Failure(
                f"every result is softmax(logits / {finite[0]:.3g}): the temperature is the "
                f"one the graph was captured with, whatever serve is given. A Python number "
                f"read inside the captured function is baked in at capture (section 7).",
                ["Keep the temperature in a static tensor the captured function divides by, "
                 "and fill_ it before each replay (or divide the logits before copying them "
                 "in)."])
        i = wrong[0]
        diff = compare_outputs(expected[i], results[i].float(), rtol=1e-4, atol=1e-6)
        raise _Failure(f"result {i} (temperature {temps[i]}) is not softmax(logits / t): "
                       f"{diff}. Compare your serve with the broken one step by step: which "
                       f"pitfalls of sections 1, 6 and 7 does it still have?",
                       ["Section 1: a new batch reaches the graph only by copy_ into its "
                        "static input. Section 6: the next replay overwrites the static "
                        "output. Section 7: a Python number is baked in at capture.",
                        "Print, for one batch, what the graph read (the static logits and "
                        "temperature just before the replay) and compare with the batch."])

    return _run(name, trials, one_trial, quiet=quiet, B=B)
