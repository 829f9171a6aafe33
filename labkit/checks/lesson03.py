"""Checkers for lesson 03 (constraint pitfalls).

Two exercises, run on the backend of ``labkit.backend.get("auto")`` (or ``B=``):

* ``capturable_clip(x)``: the capturable rewrite of

  .. code-block:: python

      def clip(x):
          m = x.abs().max()
          if m > 1:            # a Python branch on a tensor: not capturable
              return x / m
          return x

  The checker lints the learner's function with :func:`labkit.guards.lint_capture` (any
  hazard that fails capture is reported with its line and fix), then captures it on the
  backend and replays it on inputs from *both* regimes (``max |x|`` above and below 1):
  a graph that baked in one branch gives wrong results for the other.
* ``arg_mismatches(captured, received)``: Megatron-style argument checks as data. Return
  every difference as a tuple ``(where, field, received, captured)``:

  - ``("args", "count", len(received), len(captured))`` when the counts differ (then
    compare the positions both have);
  - ``(f"args[{i}]", "type", type(r).__name__, type(c).__name__)`` when one is a tensor
    and the other is not, or two non-tensors have different types;
  - for two tensors, one tuple for EACH of ``"shape"`` (as tuples of ints), ``"dtype"``
    and ``"device"`` that differs;
  - for two non-tensors of the same type, ``(f"args[{i}]", "value", r, c)`` if ``r != c``.

  Order does not matter. Checked on cases with several mismatches in one argument, a
  count mismatch, a tensor-vs-number mismatch, a device mismatch and a clean call.
"""

from __future__ import annotations

import torch

from labkit.backend import recover as _recover
from labkit.checks import CheckResult, check, compare_outputs

__all__ = ["check_capturable_clip", "check_arg_mismatches"]


def _backend(B):
    if B is not None:
        return B
    from labkit import backend

    return backend.get("auto")


# ---- exercise 1: capturable_clip --------------------------------------------------------

def _clip_reference(x: torch.Tensor) -> torch.Tensor:
    m = x.abs().max()
    return torch.where(m > 1, x / m, x)


def check_capturable_clip(capturable_clip, *, B=None, trials: int = 3) -> CheckResult:
    """``capturable_clip(x)`` must equal ``clip`` in both regimes AND capture on the backend."""
    from labkit.capture import capture
    from labkit.guards import lint_capture

    B = _backend(B)

    def make_inputs(gen: torch.Generator):
        n = int(torch.randint(4, 33, (), generator=gen))
        xs = []
        for k in range(4):   # alternate: max |x| above 1, then at most 1
            x = torch.randn(n, generator=gen)
            x = x * 3.0 if k % 2 == 0 else x / (x.abs().max() * 1.25)
            xs.append(x.to(B.device))
        return (xs,)

    def reference(xs):
        return [_clip_reference(x) for x in xs]

    def learner(xs):
        report = lint_capture(capturable_clip, xs[0].clone(), B=B)
        fatal = [f for f in report.findings if f.severity == "fails capture"]
        if fatal:
            return {"lint": fatal}
        static_x = xs[0].clone()
        try:
            g, static_out = capture(capturable_clip, static_x, B=B)
        finally:
            _recover(B)
        outs = []
        for x in xs:
            static_x.copy_(x)
            g.replay()
            outs.append(static_out.clone() if isinstance(static_out, torch.Tensor)
                        else static_out)
        return {"outs": outs}

    def compare(expected, actual) -> str | None:
        if "lint" in actual:
            f = actual["lint"][0]
            more = f" (and {len(actual['lint']) - 1} more)" if len(actual["lint"]) > 1 else ""
            code = f": {f.code}" if f.code else ""
            return (f"your function cannot be captured{more}: {f.title} ({f.op}) at "
                    f"{f.where()}{code}\n   fix: {f.fix}")
        msg = compare_outputs(expected, actual["outs"], rtol=1e-5, atol=1e-6,
                              where="after capture + replay, input ")
        if msg:
            return msg + (" (inputs alternate between max |x| > 1 and <= 1: does your "
                          "graph compute both cases?)")
        return None

    return check(
        learner, reference, make_inputs, trials=trials, name="capturable_clip",
        compare=compare,
        hint="keep the decision on the device: m = x.abs().max(); "
             "return torch.where(m > 1, x / m, x)",
    )


# ---- exercise 2: arg_mismatches ---------------------------------------------------------

def _arg_mismatches_reference(captured, received) -> list[tuple]:
    out = []
    if len(received) != len(captured):
        out.append(("args", "count", len(received), len(captured)))
    for i, (r, c) in enumerate(zip(received, captured)):
        where = f"args[{i}]"
        rt, ct = isinstance(r, torch.Tensor), isinstance(c, torch.Tensor)
        if rt != ct or (not rt and type(r) is not type(c)):
            out.append((where, "type", type(r).__name__, type(c).__name__))
        elif rt:
            if tuple(r.shape) != tuple(c.shape):
                out.append((where, "shape", tuple(r.shape), tuple(c.shape)))
            if r.dtype != c.dtype:
                out.append((where, "dtype", r.dtype, c.dtype))
            if r.device != c.device:
                out.append((where, "device", r.device, c.device))
        elif r != c:
            out.append((where, "value", r, c))
    return out


def _case(trial: int, gen: torch.Generator, device) -> tuple[list, list]:
    rows = int(torch.randint(2, 9, (), generator=gen))
    cols = int(torch.randint(2, 9, (), generator=gen))
    scale = round(float(torch.rand((), generator=gen)) + 0.1, 3)
    x = torch.randn(rows, cols, generator=gen).to(device)
    m = torch.zeros(rows, device=device, dtype=torch.bool)
    captured = [x, scale, m]
    kind = trial % 6
    if kind == 1:    # several mismatches in one argument, and a changed value
        received = [torch.randn(rows + 1, cols, generator=gen).to(device).half(), scale * 2, m]
    elif kind == 2:  # a count mismatch plus a shape mismatch
        received = [x.clone(), scale, m[:-1], 7]
    elif kind == 3:  # a tensor where a number was captured, and a number where a tensor was
        received = [x.clone(), torch.tensor(scale).to(device), 1.0]
    elif kind == 4:  # a clean call: nothing to report
        received = [x.clone(), scale, m.clone()]
    elif kind == 5:  # a device mismatch (meta exists on every machine) and an int for a float
        received = [torch.empty(rows, cols, device="meta"), int(scale * 10) or 1, m]
    else:            # one missing argument
        received = [x.clone(), scale]
    return captured, received


def check_arg_mismatches(arg_mismatches, *, B=None, trials: int = 6) -> CheckResult:
    """``arg_mismatches(captured, received)`` must list every mismatch as a tuple."""
    B = _backend(B)

    def make_inputs(gen: torch.Generator):
        return _case(gen.initial_seed(), gen, B.device)

    def norm(v):
        return tuple(v) if isinstance(v, torch.Size) else v

    def key(t) -> str:
        return repr(tuple(norm(v) for v in t)) if isinstance(t, (tuple, list)) else repr(t)

    def compare(expected, actual) -> str | None:
        if not isinstance(actual, (list, tuple)):
            hint = " (did you forget `return`?)" if actual is None else ""
            return f"expected a list of tuples, got {type(actual).__name__}{hint}"
        bad = [a for a in actual if not isinstance(a, (tuple, list)) or len(a) != 4]
        if bad:
            return (f"each mismatch must be a tuple (where, field, received, captured); "
                    f"got {bad[0]!r}")
        want = {key(e): e for e in expected}
        got = {key(a): a for a in actual}
        missing = [want[k] for k in want if k not in got]
        extra = [got[k] for k in got if k not in want]
        if not missing and not extra:
            return None
        lines = []
        if missing:
            lines.append("missing " + ", ".join(repr(tuple(m)) for m in missing[:3]))
        if extra:
            lines.append("unexpected " + ", ".join(repr(tuple(e)) for e in extra[:3]))
        why = ""
        same_where = {m[0] for m in missing} & {a[0] for a in actual}
        if missing and same_where:
            why = (" Report EVERY field that differs, not only the first one per argument: "
                   "one message listing all mismatches is the point.")
        elif missing and missing[0][1] == "count":
            why = " Compare the number of arguments first (then the positions both have)."
        elif not expected:
            why = " This call matches the capture: return an empty list."
        return "; ".join(lines) + "." + why

    return check(
        arg_mismatches, _arg_mismatches_reference, make_inputs, trials=trials,
        name="arg_mismatches", compare=compare,
        hint="loop over zip(received, captured) with enumerate; for tensors compare shape, "
             "dtype and device separately (never `r == c` on tensors)",
    )
