"""Lesson 03, exercise ``capturable_clip``: its checker.

``capturable_clip(x)``: the capturable rewrite of

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
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import torch

from labkit.backend import ensure as _backend
from labkit.checks import Reason, attempt, call_learner, compare_outputs, fail, reject
from labkit.checks.lesson03._common import _learner_error, _rand_int, _run

__all__ = ["check_capturable_clip"]


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


def _diagnose_clip(x: torch.Tensor, got: Any, where: str) -> Reason | None:
    want = _clip_reference(x)
    msg = compare_outputs(want, got, rtol=1e-5, atol=1e-6, where="")
    if msg is None:
        return None
    if isinstance(got, torch.Tensor) and got.shape == want.shape and got.dtype == want.dtype:
        for value, why, hints in _clip_variants(x):
            if torch.allclose(got.detach().cpu().float(), value.cpu(), rtol=1e-5, atol=1e-6):
                return Reason(f"{where}, on an input with {_regime(x)} of shape "
                                f"{tuple(x.shape)}: {why}. Compare with clip_if "
                                f"(section 3).", hints)
    return Reason(f"{where}, on an input with {_regime(x)} of shape {tuple(x.shape)}: "
                    f"{msg}. Compare your function with clip_if (section 3) on such an "
                    f"input.",
                    ["clip returns x / max|x| when max|x| > 1, else x itself.",
                     "Compute m = x.abs().max() and choose between the two results with "
                     "torch.where, on the device."])


def _eager_raised(x: torch.Tensor, exc: BaseException) -> Reason:
    return Reason(
        f"run eagerly on an input of shape {tuple(x.shape)} ({x.dim()}-D), your "
        f"code raised {_learner_error(exc)}\n   The exercise says a tensor of any "
        f"shape, a 0-d one too: clip needs nothing shape-specific.",
        ["x.abs().max() works on any shape (it reduces over every element)."])


def _capture_failed(exc: BaseException) -> Reason:
    return Reason(f"capture of your function failed: {_learner_error(exc)}. "
                  f"The linter found nothing: look for a host read it cannot see "
                  f"(section 10 says which).")


def _eagerly(fn, sets: list, B, time_limit: float) -> None:
    """Step 1: eagerly, on every rank from 0 to 4: the right values, the input left alone."""
    for x in (x for xs in sets for x in xs):
        arg = x.clone()
        got = attempt(fn, (arg,), time_limit=time_limit, B=B,
                      not_done=False, passthrough=(NotImplementedError,),
                      kind="mismatch", reason=lambda exc, x=x: _eager_raised(x, exc))
        if got is None:
            reject(Reason("your function returned None (did you forget `return`?)",
                          ["Return the tensor torch.where(...) gives."]))
        if not torch.equal(arg, x):
            reject(Reason("your function changed its input x in place (clip returns a "
                          "new tensor and leaves x alone; in a graph the static input "
                          "would be scaled again at every replay)",
                          ["Use x / m, not x /= m or x.div_(m)."]))
        bad = _diagnose_clip(x, got, "run eagerly")
        if bad is not None:
            reject(bad)


def _linted(fn, x: torch.Tensor, B) -> None:
    """Step 2: the linter: hazards that fail capture, with the line."""
    from labkit.guards import lint_capture

    report = lint_capture(fn, x.clone(), B=B)
    fatal = [f for f in report.findings if f.severity == "fails capture"]
    if fatal:
        f = fatal[0]
        more = f" (and {len(fatal) - 1} more)" if len(fatal) > 1 else ""
        code = f": {f.code}" if f.code else ""
        reject(Reason(
            f"your function gives the right values eagerly but cannot be captured{more}: "
            f"{f.title} ({f.op}) at {f.where()}{code}. Section 3 shows why and the "
            f"device-side alternatives.",
            [f"fix: {f.fix}",
             "Decide with a tensor condition, not a Python `if`: torch.where(cond, a, b) "
             "computes both a and b and picks on the device."]))


def _graphed(fn, xs: list, B, time_limit: float) -> None:
    """Step 3: capture once, on ``xs[0]``, and replay on inputs of both regimes."""
    from labkit.capture import capture

    static_x = xs[0].clone()
    g, static_out = attempt(
        capture, (lambda t: call_learner(fn, t, time_limit=time_limit), static_x),
        {"B": B}, B=B, not_done=False, passthrough=(NotImplementedError,),
        kind="mismatch", reason=_capture_failed)
    if not isinstance(static_out, torch.Tensor):
        reject(Reason(f"the captured function returned {type(static_out).__name__}, "
                      f"not a tensor",
                      ["A captured function's result is its static output: a tensor."]))
    for k in (1, 0, 3, 2):
        static_x.copy_(xs[k])
        g.replay()
        got = static_out.clone()
        if compare_outputs(_clip_reference(xs[k]), got, rtol=1e-5, atol=1e-6):
            reject(Reason(
                f"eagerly your function is right, but its graph (captured on an input "
                f"with {_regime(xs[0])}) is wrong on an input with {_regime(xs[k])}: "
                f"{compare_outputs(_clip_reference(xs[k]), got, where='')}. Something was "
                f"decided once, at capture: does your graph compute both cases?",
                ["Python runs once, at capture (sections 3 and 7): a Python value or "
                 "branch computed from the input is frozen into the graph.",
                 "Keep m and the condition as tensors: torch.where(m > 1, x / m, x)."]))


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
    B = _backend(B)
    name = "capturable_clip"
    if not callable(capturable_clip):
        return fail(name, f"expected a function, got {type(capturable_clip).__name__}",
                    quiet=quiet)

    def one_trial(trial, gen):
        sets = _clip_input_sets(gen, B.device)
        _eagerly(capturable_clip, sets, B, time_limit)
        xs = sets[_rand_int(gen, 0, len(sets) - 1)]       # the shape captured and replayed
        _linted(capturable_clip, xs[0], B)
        _graphed(capturable_clip, xs, B, time_limit)

    return _run(name, trials, one_trial, quiet=quiet, B=B)
