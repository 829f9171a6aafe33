"""The capture-hazard linter: run a function eagerly and report what a capture would refuse."""

from __future__ import annotations

import linecache
import os
import traceback
from dataclasses import dataclass, field
from typing import Callable, Iterable

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from labkit.capture import check_callable
from labkit.core.rules import (
    GENERATOR_RULE,
    HAZARDS,
    SEVERITIES,
    aten_rule,
    function_rule,
    host_copy_rule,
    sets_from_host_number,
    unregistered_generators,
)
from labkit.core.signature import short_repr
from labkit.core.signature import values_equal as _values_equal
from labkit.core.staging import host_side_is_staged
from labkit.core.validate import check_int
from labkit.guards.errors import def_frame as _def_frame
from labkit.guards.errors import error_lines
from labkit.guards.errors import is_internal as _is_internal
from labkit.guards.errors import user_frame as _user_frame

__all__ = ["lint_capture", "LintReport", "Finding", "HAZARDS"]

_SEVERITIES = SEVERITIES


@dataclass
class Finding:
    """One hazard: what, where in the user's code, and how to fix it."""

    kind: str
    op: str                      # what triggered it: ".item()", "aten.nonzero", ...
    message: str                 # why it is a hazard
    fix: str
    filename: str = ""
    lineno: int = 0
    function: str = ""
    code: str = ""

    @property
    def title(self) -> str:
        return HAZARDS[self.kind][0]

    @property
    def severity(self) -> str:
        return HAZARDS[self.kind][1]

    def where(self) -> str:
        """``line 4 (in step)``; a file's base name is added outside notebooks."""
        if not self.lineno:
            return "unknown location"
        f = self.filename
        cell = f.startswith("<") or "ipykernel_" in f or f.startswith("/tmp/ipykernel")
        loc = f"line {self.lineno}" if cell else f"{os.path.basename(f)}:{self.lineno}"
        return loc + (f" (in {self.function})" if self.function not in ("", "<module>") else "")

    def __str__(self) -> str:
        code = f": {self.code}" if self.code else ""
        return (f"{self.title} [{self.severity}]: {self.op} at {self.where()}{code}\n"
                f"   {self.message}\n   fix: {self.fix}")


@dataclass
class LintReport:
    """What :func:`lint_capture` found: ``findings`` (in order) and a readable summary."""

    function: str
    findings: list[Finding] = field(default_factory=list)
    calls: int = 0
    ops: int = 0                 # ATen ops seen in the first call

    @property
    def ok(self) -> bool:
        """True when nothing was found (it does not prove capture will work: see lint_capture)."""
        return not self.findings

    @property
    def kinds(self) -> list[str]:
        """The kinds found, in order of first appearance."""
        out: list[str] = []
        for f in self.findings:
            if f.kind not in out:
                out.append(f.kind)
        return out

    def __len__(self) -> int:
        return len(self.findings)

    def __iter__(self):
        return iter(self.findings)

    def _headline(self) -> str:
        n = len(self.findings)
        if not n:
            return (f"lint_capture({self.function}): no capture hazards found "
                    f"({self.calls} call{'s' if self.calls != 1 else ''})")
        by: dict[str, int] = {}
        for f in self.findings:
            by[f.severity] = by.get(f.severity, 0) + 1
        parts = ", ".join(f"{by[k]} {k}" for k in _SEVERITIES if k in by)
        return (f"lint_capture({self.function}): {n} finding{'s' if n != 1 else ''} "
                f"({parts})")

    def __str__(self) -> str:
        lines = [self._headline()]
        for i, f in enumerate(self.findings, 1):
            body = str(f).replace("\n", "\n   ")
            lines.append(f"{i:2d}. {body}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return str(self)

    def _repr_markdown_(self) -> str:
        head = f"**{self._headline()}**"
        if not self.findings:
            return head

        def esc(text: str) -> str:
            return text.replace("|", "\\|").replace("`", "'")

        rows = ["| # | hazard | severity | where | code | fix |", "|---|---|---|---|---|---|"]
        for i, f in enumerate(self.findings, 1):
            rows.append(f"| {i} | **{f.title}**: `{esc(f.op)}` | {f.severity} | {f.where()} | "
                        f"`{esc(f.code)}` | {esc(f.fix)} |")
        return head + "\n\n" + "\n".join(rows)


_LIFT = {"lift_fresh", "lift_fresh_copy", "lift"}
_COPIES = {"_to_copy", "copy_", "_copy_from", "_copy_from_and_resize"}
_VALUE_TYPES = (bool, int, float, complex)


def _default_generators() -> list[torch.Generator]:
    gens = [torch.default_generator]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        gens += list(torch.cuda.default_generators)
    return gens


def _storage_ptr(t: torch.Tensor) -> int:
    try:
        return t.untyped_storage().data_ptr()
    except Exception:
        return 0


@dataclass
class _OpRecord:
    name: str
    external: dict          # flat leaf index -> data_ptr of a tensor not made in this call
    values: dict            # flat leaf index -> Python value


class _Linter:
    """State shared by the two modes during one :func:`lint_capture`."""

    def __init__(self, generators: Iterable[torch.Generator]):
        self.findings: list[Finding] = []
        self._keys: set = set()
        self.registered = list(generators)
        self.defaults = _default_generators()
        self.quiet = 0                       # >0 inside a Python-level hazard we reported
        self.host_value = False              # inside `t[mask] = number` (masked_fill_ on a GPU)
        self.records: list[list[_OpRecord]] = []
        self.produced: set[int] = set()
        self.diverged = False

    # -- findings
    def add(self, kind: str, op: str, message: str, fix: str | None = None,
            frame: traceback.FrameSummary | None = None) -> None:
        frame = frame if frame is not None else _user_frame()
        filename = frame.filename if frame else ""
        lineno = frame.lineno if frame else 0
        key = (kind, op, filename, lineno)
        if key in self._keys:
            return
        self._keys.add(key)
        code = ""
        if frame is not None:
            code = (frame.line or linecache.getline(filename, lineno) or "").strip()
        self.findings.append(Finding(kind, op, message, fix or HAZARDS[kind][2], filename,
                                     lineno, frame.name if frame else "", code))

    # -- one call
    def start_call(self) -> None:
        self.records.append([])
        self.produced = set()

    @property
    def call(self) -> int:
        return len(self.records) - 1

    def on_python(self, name: str, func, args, kwargs) -> bool:
        """A Python-level tensor call; True when it is a hazard we reported."""
        # Generators are checked here, where they are the user's own objects: below the
        # dispatcher each op sees a fresh Python wrapper, so identity means nothing there.
        if unregistered_generators(args, kwargs, self.defaults + self.registered):
            self.add(GENERATOR_RULE.kind, f"{name}({GENERATOR_RULE.shown})", GENERATOR_RULE.why,
                     "call g.register_generator_state(gen) before capture (and pass "
                     "generators=[gen] here), or use the default generator")
        rule = function_rule(name, args, kwargs)
        if rule is None:
            return False
        self.add(rule.kind, rule.shown, rule.why)
        return True

    def on_aten(self, func, args, kwargs, out) -> None:
        name = func.overloadpacket.__name__
        aten = f"aten.{name}"
        if not self.quiet:
            rule = aten_rule(name, args, kwargs, host_value=self.host_value)
            if rule is not None:
                self.add(rule.kind, rule.shown, rule.why)
            elif name in _COPIES:
                self._check_host_copy(aten, name, args, kwargs, out)
        self._track(name, aten, args, kwargs, out)

    def _check_host_copy(self, aten, name, args, kwargs, out) -> None:
        src = args[1] if name in ("copy_", "_copy_from", "_copy_from_and_resize") and \
            len(args) > 1 else args[0] if args else None
        dst = args[0] if name == "copy_" else out
        if isinstance(src, torch.Tensor) and isinstance(dst, torch.Tensor) and \
                (src.device.type == "cpu") != (dst.device.type == "cpu"):
            way = "device-to-host" if dst.device.type == "cpu" else "host-to-device"
            host = dst if dst.device.type == "cpu" else src
            non_blocking = (args[2] if name == "copy_" and len(args) > 2
                            else kwargs.get("non_blocking", False))
            pinned = host.is_pinned()
            staged = pinned and host_side_is_staged(way, dst.shape, dst.stride(), dst.dtype,
                                                    src, non_blocking, host)
            rule = host_copy_rule(way, pinned, non_blocking, staged)
            if rule is not None:
                blocking = ", blocking" if rule.kind == "cpu_sync" else ""
                self.add(rule.kind, f"{aten} ({way}{blocking})", rule.why)

    # -- addresses and values, compared between calls
    def _track(self, name, aten, args, kwargs, out) -> None:
        flat, _ = tree_flatten((args, kwargs))
        in_storages = set()
        external, values = {}, {}
        for i, x in enumerate(flat):
            if isinstance(x, torch.Tensor):
                sp = _storage_ptr(x)
                in_storages.add(sp)
                if not sp or sp in self.produced:
                    continue
                if name in _LIFT:                 # torch.tensor's host constant: made here
                    self.produced.add(sp)
                elif not self.quiet:              # (reads inside a hazard already
                    external[i] = x.data_ptr()    # reported are not compared)
            elif isinstance(x, _VALUE_TYPES) and not self.quiet:
                values[i] = x
        for o in tree_flatten(out)[0]:
            if isinstance(o, torch.Tensor):
                sp = _storage_ptr(o)
                if sp and sp not in in_storages:
                    self.produced.add(sp)
        rec = _OpRecord(aten, external, values)
        calls = self.records
        calls[-1].append(rec)
        if self.call == 0 or self.diverged:
            return
        first = calls[0]
        k = len(calls[-1]) - 1
        if k >= len(first) or first[k].name != rec.name:
            self.diverged = True
            before = first[k].name if k < len(first) else "nothing (the first call had ended)"
            self.add("changed_ops", rec.name,
                     f"the second call ran {rec.name} where the first ran {before} "
                     f"(op #{k}): Python took another path")
            return
        ref = first[k]
        for i, ptr in rec.external.items():
            if i in ref.external and ref.external[i] != ptr:
                self.add("changed_address", rec.name,
                         f"{rec.name} reads a tensor made outside the function whose address "
                         f"changed between calls (a rebound name or attribute): the graph "
                         f"would keep reading the first address")
                break
        for i, v in rec.values.items():
            if i in ref.values and not _values_equal(ref.values[i], v):
                self.add("changed_value", rec.name,
                         f"{rec.name} got the Python value {short_repr(ref.values[i])} on the "
                         f"first call and {short_repr(v)} on the second: the graph keeps the "
                         f"value from capture")
                break

    def end_calls(self, fn) -> None:
        if len(self.records) >= 2 and not self.diverged and \
                len(self.records[1]) < len(self.records[0]):
            k = len(self.records[1])
            self.add("changed_ops", self.records[0][k].name,
                     f"the second call stopped after {k} ops, the first ran "
                     f"{len(self.records[0])}: Python took another path", frame=_def_frame(fn))


class _LintFunctionMode(TorchFunctionMode):
    def __init__(self, lint: _Linter):
        super().__init__()
        self.lint = lint

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if self.lint.on_python(name, func, args, kwargs):
            self.lint.quiet += 1
            try:
                return func(*args, **kwargs)
            finally:
                self.lint.quiet -= 1
        if sets_from_host_number(name, args):      # t[mask] = number: masked_fill_ on a GPU
            self.lint.host_value = True
            try:
                return func(*args, **kwargs)
            finally:
                self.lint.host_value = False
        return func(*args, **kwargs)


class _LintDispatchMode(TorchDispatchMode):
    def __init__(self, lint: _Linter):
        super().__init__()
        self.lint = lint

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.lint.on_aten(func, args, kwargs, out)
        return out


def _patched_synchronize(lint: _Linter, B):
    """Replace ``torch.cuda.synchronize`` (and ``B.synchronize``) by recorders, for a while."""
    targets = [(torch.cuda, "synchronize")]
    if B is not None and getattr(B, "synchronize", None) is not None:
        targets.append((B, "synchronize"))
    saved = [(obj, attr, getattr(obj, attr)) for obj, attr in targets]

    def make(original, real_ok):
        def synchronize(*a, **k):
            lint.add("cpu_sync", "synchronize()", "waits for the GPU to finish; during capture "
                     "nothing runs, so it is refused",
                     "move it out of the captured function (synchronize before reading "
                     "results, after replay())")
            if real_ok():
                return original(*a, **k)
        return synchronize

    for obj, attr, original in saved:
        real_ok = torch.cuda.is_available if obj is torch.cuda else (lambda: True)
        setattr(obj, attr, make(original, real_ok))
    return saved


def _check_lint_args(fn, kwargs, calls, generators) -> None:
    check_callable(fn, "lint_capture(fn, ...)")
    for gen in generators:
        if not isinstance(gen, torch.Generator):
            raise TypeError(f"lint_capture(generators=...) takes the torch.Generator objects "
                            f"you will register with the graph, got {type(gen).__name__}")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise TypeError(f"lint_capture(kwargs=...) takes a dict of keyword arguments for fn, "
                        f"got {type(kwargs).__name__}")
    check_int("calls (how many times fn runs under the linter)", calls, 1)


def lint_capture(fn: Callable, *args, kwargs: dict | None = None, B=None,
                 generators: Iterable[torch.Generator] = (), calls: int = 2) -> LintReport:
    """Report every capture hazard in ``fn(*args, **kwargs)`` before any real capture.

    Runs ``fn`` eagerly ``calls`` times (default 2) on the arguments you give, on either
    backend, under a ``TorchFunctionMode`` and a ``TorchDispatchMode`` that watch every
    tensor call and ATen op and *record* instead of raising, so it keeps going after the
    first hazard and reports them all. Each :class:`Finding` names the hazard, the line
    of your code (the first frame outside torch and labkit), why it breaks and the fix:

    * **CPU sync**: ``.item()``, ``float(t)``, ``int(t)``, a tensor as an index or size,
      printing, ``torch.equal``, ``synchronize()``, ``masked_fill`` with a tensor value,
      a blocking copy with pinned host memory;
    * **Python branch on a tensor value**: ``if t:``, ``while t > 0:``, ``t and ...``;
    * **data-dependent shapes**: ``nonzero``, ``x[mask]``, ``x[mask] = t`` with a tensor
      ``t`` (a Python number is fine), ``masked_select``, ``unique``, ``bincount``,
      ``repeat_interleave`` with tensor repeats and no ``output_size``;
    * **host tensors**: ``.cpu()``, ``.tolist()``, ``.numpy()``, ``torch.tensor(data)``,
      and any copy between the device and pageable host memory (a ``non_blocking`` copy
      with ``pin_memory()`` memory is captured: no finding);
    * **unregistered generators**: an op with ``generator=g`` where ``g`` is neither the
      default generator nor in ``generators`` (the ones you will register);
    * comparing the calls: **addresses that change** (an op reads a tensor made outside
      ``fn`` that lives elsewhere on the next call: a rebound global or attribute),
      **Python values that change** (a scalar the graph would bake in), and **a different
      op sequence** (Python state or lazy initialisation);
    * **Python values baked in**: each top-level non-tensor argument (a note).

    .. warning::
        ``fn`` really runs ``calls`` times: its side effects happen, in-place updates
        apply. Lint on copies if that matters. A clean report does not prove capture will
        work (custom CUDA kernels, other libraries' syncs, allocations of a different size
        on the next call are invisible here), and hazards in code paths not taken by
        these arguments are not seen.
    """
    generators = list(generators)
    _check_lint_args(fn, kwargs, calls, generators)
    kwargs = dict(kwargs or {})
    name = getattr(fn, "__name__", None) or type(fn).__name__
    lint = _Linter(generators)
    report = LintReport(function=name, calls=0)
    def_frame = _def_frame(fn)
    for i, a in enumerate(args):
        if isinstance(a, _VALUE_TYPES):
            lint.add("baked_argument", f"args[{i}] = {short_repr(a)}",
                     f"a Python {type(a).__name__} argument: capture runs the function once "
                     f"with {short_repr(a)}, and every replay uses that value", frame=def_frame)
    for k, a in kwargs.items():
        if isinstance(a, _VALUE_TYPES):
            lint.add("baked_argument", f"{k}={short_repr(a)}",
                     f"a Python {type(a).__name__} argument: capture runs the function once "
                     f"with {short_repr(a)}, and every replay uses that value", frame=def_frame)
    saved = _patched_synchronize(lint, B)
    try:
        for _ in range(calls):
            lint.start_call()
            try:
                with _LintFunctionMode(lint), _LintDispatchMode(lint):
                    fn(*args, **kwargs)
            except Exception as exc:
                tb = [fr for fr in traceback.extract_tb(exc.__traceback__)
                      if not _is_internal(fr.filename)]
                lint.add("raised", f"{type(exc).__name__}",
                         f"{type(exc).__name__}: {error_lines(exc)[-1]}",
                         frame=tb[-1] if tb else def_frame)
                report.calls += 1
                break
            report.calls += 1
        lint.end_calls(fn)
    finally:
        for obj, attr, original in saved:
            setattr(obj, attr, original)
    # in the order of the code: by file (first seen first), then line
    rank: dict[str, int] = {}
    for f in lint.findings:
        rank.setdefault(f.filename, len(rank))
    report.findings = sorted(lint.findings, key=lambda f: (rank[f.filename], f.lineno))
    report.ops = len(lint.records[0]) if lint.records else 0
    return report
