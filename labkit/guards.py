"""Guards against the pitfalls of CUDA graphs (lesson 03): check before you replay.

A CUDA graph is a recording of kernels on fixed addresses with fixed shapes, made by
running Python *once*. Seed §1.3 lists what that implies; each rule becomes a bug when
broken, and most of those bugs are silent:

* static inputs, filled with ``copy_``: rebinding ``static_x = new_x`` gives stale
  results (on a GPU, reads of freed memory);
* fixed shapes: ``copy_`` of another batch size raises, or *broadcasts silently*;
* no CPU sync or data-dependent control flow: ``.item()``, ``if t:``, ``nonzero`` make
  capture fail;
* graph-safe RNG: an unregistered custom generator makes capture fail;
* capture on a side stream: ``capture_begin()`` on the default stream raises;
* outputs are static: a result kept across replays is overwritten;
* Python runs once: Python scalars are baked in, side effects happen once.

This module turns those rules into code that refuses to be misused:

* :class:`ArgMetadata` and :func:`get_mismatch_errors`, in the style of Megatron-LM's
  ``ArgMetadata`` / ``get_mismatch_errors`` (``megatron/core/transformer/cuda_graphs.py``):
  record shape, dtype, device, ``data_ptr`` and non-tensor values at capture; before a
  replay, report *every* mismatch in one message;
* :class:`GuardedGraph`: a :class:`~labkit.capture.StaticGraph` that also takes keyword
  arguments, copies an input only when its address differs from the static one
  (Megatron again), can refuse any tensor that is not the static input itself, and can
  hand out clones so a kept result is never overwritten;
* :func:`lint_capture`: a *capture-hazard linter* that runs a function eagerly under a
  ``TorchFunctionMode`` and a ``TorchDispatchMode`` that record instead of raising, and
  reports every hazard a capture would hit, each with the user's line and the fix,
  before any real capture;
* :class:`expect_error`: for notebooks, run code that must fail, print the first line of
  each error, and put the stream back (a failed ``B.graph`` leaves its capture stream
  current; torch does not undo the switch when ``capture_end`` raises).
"""

from __future__ import annotations

import inspect
import linecache
import os
import sysconfig
import traceback
import warnings
from dataclasses import dataclass, field
from typing import Callable, Iterable

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from labkit.backend import recover as _recover
from labkit.capture import StaticGraph, _same_memory, _static_copy
from labkit.core.rules import HAZARDS, SEVERITIES, aten_rule, function_rule
from labkit.core.signature import (  # noqa: F401  (old private names)
    ArgMetadata,
    GraphArgumentError,
    _short,
    _type_name,
    get_mismatch_errors,
    leaf_pairs,
    metadata_tree,
    signature_lines,
)
from labkit.core.signature import fmt_shape as _fmt_shape  # noqa: F401
from labkit.core.signature import values_equal as _values_equal

_leaf_pairs = leaf_pairs

__all__ = [
    "ArgMetadata", "metadata_tree", "get_mismatch_errors", "GraphArgumentError",
    "GuardedGraph", "expect_error", "error_lines", "error_text",
    "lint_capture", "LintReport", "Finding", "HAZARDS",
]


# =====================================================================================
# GuardedGraph
# =====================================================================================

class GuardedGraph(StaticGraph):
    """A :class:`~labkit.capture.StaticGraph` that refuses every silent misuse.

    ::

        gg = GuardedGraph(block, B=B).capture(x, mask=m, scale=0.5)
        out = gg(x2, mask=m2, scale=0.5)     # checked, copied, replayed
        gg(x2[:4], mask=m2, scale=0.7)       # GraphArgumentError listing both mismatches

    Beyond ``StaticGraph`` (positional arguments, nested lists/tuples/dicts allowed) it
    accepts keyword arguments, and it has two policies:

    ``inputs="copy"`` (default)
        A tensor at another address is ``copy_``-ed into its static input; a tensor at
        the static input's own address is not copied at all. Megatron's runner does the
        same (copy only when ``data_ptr`` differs), which lets a producer write straight
        into the static buffer and skip the copy. ``gg.copies`` counts real copies.
    ``inputs="static"``
        Only the static inputs themselves are accepted (``gg.static_inputs`` /
        ``gg.static_kwargs``, filled in place by the caller); any other tensor is refused
        with an ``Address mismatch``. This catches the rebinding bug at the call site.
    ``outputs="static"`` (default) or ``"clone"``
        ``"clone"`` returns copies of the outputs, so a result you keep is never
        overwritten by the next replay (at the cost of one copy per output).

    Every check runs before anything is copied, and one :class:`GraphArgumentError`
    lists all mismatches: never a silent broadcast, conversion or stale Python value.
    """

    def __init__(self, fn: Callable, *, B=None, pool=None, stream=None, warmup: int = 3,
                 name: str | None = None, inputs: str = "copy", outputs: str = "static"):
        if inputs not in ("copy", "static"):
            raise ValueError(f"inputs must be 'copy' or 'static', got {inputs!r}")
        if outputs not in ("static", "clone"):
            raise ValueError(f"outputs must be 'static' or 'clone', got {outputs!r}")
        super().__init__(fn, B=B, pool=pool, stream=stream, warmup=warmup, name=name)
        self.inputs_policy = inputs
        self.outputs_policy = outputs
        self.static_kwargs: dict = {}
        self.kwarg_metadata: dict = {}

    def capture(self, *sample_args, **sample_kwargs) -> "GuardedGraph":
        """Allocate static inputs like the samples (nested too), warm up, capture."""
        if self.captured:
            raise RuntimeError(
                f"{self._label()} is already captured. A graph is recorded once; for other "
                f"shapes or values create another GuardedGraph (or call reset() first).")
        self._check_devices(sample_args, "args")
        self._check_devices(sample_kwargs, "kwargs")
        args = tree_map(_static_copy, tuple(sample_args))
        kwargs = tree_map(_static_copy, dict(sample_kwargs))
        self.static_outputs = self._record(args, kwargs)
        self.static_inputs, self.static_kwargs = args, kwargs
        self.arg_metadata = tuple(metadata_tree(a) for a in args)
        self.kwarg_metadata = {k: metadata_tree(v) for k, v in kwargs.items()}
        return self

    def mismatches(self, *args, **kwargs) -> list[str]:
        """What :meth:`__call__` would refuse, as a list of lines (empty: the call is fine)."""
        self._require_captured("checking arguments")
        return get_mismatch_errors(self.arg_metadata, args, self.kwarg_metadata, kwargs,
                                   check_address=self.inputs_policy == "static")

    def __call__(self, *args, **kwargs):
        """Check everything, copy what moved, replay, return the outputs (or clones)."""
        errors = self.mismatches(*args, **kwargs)
        if errors:
            raise GraphArgumentError(self._label(), errors)
        with torch.no_grad():
            for static, val in leaf_pairs((self.static_inputs, self.static_kwargs),
                                          (tuple(args), kwargs)):
                if isinstance(val, torch.Tensor) and not _same_memory(val, static):
                    static.copy_(val)
                    self.copies += 1
        self.replay()
        if self.outputs_policy == "clone":
            return tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t,
                            self.static_outputs)
        return self.static_outputs

    def reset(self) -> None:
        super().reset()
        self.static_kwargs, self.kwarg_metadata = {}, {}

    def signature(self) -> str:
        """What was captured, one argument a line (portable: no devices or addresses)."""
        self._require_captured("signature()")
        return "\n".join(signature_lines(self.arg_metadata, self.kwarg_metadata))

    def _label(self) -> str:
        return f"GuardedGraph({self.name})"


# =====================================================================================
# Showing errors in a notebook
# =====================================================================================

_EMULATOR_TAG = "[labkit emulator]"


def _chain(exc: BaseException, limit: int = 4) -> list[BaseException]:
    """``exc`` and the exceptions it was raised while handling, root cause first."""
    out, seen = [], set()
    while exc is not None and id(exc) not in seen and len(out) < limit:
        seen.add(id(exc))
        out.append(exc)
        exc = exc.__cause__ or (None if exc.__suppress_context__ else exc.__context__)
    return out[::-1]


def _check_exception(exc, where: str) -> None:
    if not isinstance(exc, BaseException):
        raise TypeError(f"{where} takes the exception object (except ... as e: {where}(e); "
                        f"with pytest.raises(...) as err: {where}(err.value)), got "
                        f"{type(exc).__name__}")


def error_lines(exc: BaseException, lines: int = 1, emulator_notes: bool = False) -> list[str]:
    """The first ``lines`` lines of each error in ``exc``'s chain, root cause first.

    CUDA errors are long (a link to the CUDA docs, a note on asynchronous reporting);
    their first line says what happened, and it is the same on a GPU and on the emulator.
    The emulator adds a ``[labkit emulator] ...`` line explaining why; it is left out
    unless ``emulator_notes`` (it does not exist on a GPU).
    """
    _check_exception(exc, "error_lines")
    out = []
    for e in _chain(exc):
        text = [ln.rstrip() for ln in str(e).splitlines() if ln.strip()]
        if not emulator_notes:
            text = [ln for ln in text if not ln.startswith(_EMULATOR_TAG)]
        out.append("\n".join(text[:lines]) if text else type(e).__name__)
    return out


def error_text(exc: BaseException) -> str:
    """The whole text of every error in ``exc``'s chain, root cause first, one string.

    A failed capture raises twice: the refused operation, then ``capture_end`` reporting
    the invalidated capture. ``SYNC_MSG in error_text(e)`` asks whether the refusal is
    anywhere in that chain, whichever error the ``except`` clause caught."""
    _check_exception(exc, "error_text")
    return "\n".join(str(e) for e in _chain(exc, limit=16))


class expect_error:
    """Context manager for demonstrations: the block must raise; print the error briefly.

    ::

        with expect_error(B):
            with B.graph(B.CUDAGraph()):
                x.sum().item()
        # error: CUDA error: operation not permitted when stream is capturing
        #  then: CUDA error: operation failed due to a previous error during capture

    Prints the first line of every error in the chain (root cause first, then what it
    caused, e.g. ``capture_end`` reporting the invalidated capture), without the
    emulator's extra line, so the output is the same on a GPU and on the CPU. Afterwards
    it restores the default stream: a failed ``B.graph`` leaves its capture stream
    current. If nothing is raised it prints ``no error`` and says so in ``.raised``.
    The exception is kept in ``.exception`` for inspection; ``KeyboardInterrupt`` and
    other non-``Exception`` errors propagate. Warnings raised inside the block (on a GPU,
    a capture cut short by an error may warn that the graph is empty) are kept in
    ``.warnings`` and not printed, so a demonstration prints the same on every backend.
    """

    def __init__(self, B=None, lines: int = 1, emulator_notes: bool = False):
        if B is None:
            from labkit import backend

            B = backend.get("auto")
        from labkit.capture import _check_count

        _check_count(lines, "lines (first lines shown of each error)", minimum=1)
        self.B = B
        self.lines = lines
        self.emulator_notes = emulator_notes
        self.exception: BaseException | None = None
        self.messages: list[str] = []
        self.warnings: list = []
        self._catch = None

    @property
    def raised(self) -> bool:
        return self.exception is not None

    def __enter__(self) -> "expect_error":
        self._catch = warnings.catch_warnings(record=True)
        self.warnings = self._catch.__enter__()
        warnings.simplefilter("always")
        return self

    def __exit__(self, typ, exc, tb) -> bool:
        if self._catch is not None:
            self._catch.__exit__(None, None, None)
            self._catch = None
        try:
            _recover(self.B)
        except Exception:
            pass
        if exc is None:
            print("no error")
            return False
        if not isinstance(exc, Exception):
            return False
        self.exception = exc
        self.messages = error_lines(exc, self.lines, self.emulator_notes)
        for i, m in enumerate(self.messages):
            prefix = "error: " if i == 0 else " then: "
            print(prefix + m.replace("\n", "\n" + " " * len(prefix)))
        return True


# =====================================================================================
# The capture-hazard linter
# =====================================================================================

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


# ---- where the user's code is -----------------------------------------------------------

_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__))
_LABKIT_DIR = os.path.dirname(os.path.abspath(__file__))
_INTERNAL_LABKIT = tuple(os.path.join(_LABKIT_DIR, p) for p in
                         ("guards.py", "capture.py", "backend.py", "emulator"))
_STDLIB = tuple({os.path.abspath(p) for p in (sysconfig.get_paths().get("stdlib"),
                                              sysconfig.get_paths().get("platstdlib")) if p})


def _is_internal(filename: str) -> bool:
    if filename.startswith("<frozen") or filename.startswith("<string"):
        return True
    if filename.startswith("<"):
        return False
    path = os.path.abspath(filename)
    if path.startswith(_TORCH_DIR) or path.startswith(_INTERNAL_LABKIT):
        return True
    return any(path.startswith(s + os.sep) for s in _STDLIB) and "site-packages" not in path


def _user_frame() -> traceback.FrameSummary | None:
    """The innermost frame of the stack that is not torch, labkit's machinery or stdlib."""
    for fr in reversed(traceback.extract_stack()):
        if not _is_internal(fr.filename):
            return fr
    return None


# ---- classification --------------------------------------------------------------------

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
        for gen in [kwargs.get("generator"), *args]:
            if isinstance(gen, torch.Generator) and not any(gen is g for g in self.defaults) \
                    and not any(gen is g for g in self.registered):
                self.add("unregistered_generator", f"{name}(generator=...)",
                         "draws from a custom torch.Generator that is not registered with "
                         "the graph; capture raises 'Attempt to increase offset for a CUDA "
                         "generator not in capture mode.'",
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
            rule = aten_rule(name, args, kwargs)
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
            self.add("host_tensor", f"{aten} ({way})",
                     f"a {way} copy of pageable memory is refused during capture")

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
                         f"{rec.name} got the Python value {_short(ref.values[i])} on the "
                         f"first call and {_short(v)} on the second: the graph keeps the "
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


def _def_frame(fn) -> traceback.FrameSummary | None:
    try:
        target = inspect.unwrap(fn)
        if not inspect.isfunction(target) and not inspect.ismethod(target):
            target = type(fn).forward if hasattr(type(fn), "forward") else type(fn).__call__
        _, lineno = inspect.getsourcelines(target)
        filename = inspect.getsourcefile(target) or inspect.getfile(target)
        return traceback.FrameSummary(filename, lineno, getattr(target, "__name__", ""))
    except (TypeError, OSError):
        return None


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
    from labkit.capture import _check_callable, _check_count

    _check_callable(fn, "lint_capture(fn, ...)")
    for gen in generators:
        if not isinstance(gen, torch.Generator):
            raise TypeError(f"lint_capture(generators=...) takes the torch.Generator objects "
                            f"you will register with the graph, got {type(gen).__name__}")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise TypeError(f"lint_capture(kwargs=...) takes a dict of keyword arguments for fn, "
                        f"got {type(kwargs).__name__}")
    _check_count(calls, "calls (how many times fn runs under the linter)", minimum=1)


def lint_capture(fn: Callable, *args, kwargs: dict | None = None, B=None,
                 generators: Iterable[torch.Generator] = (), calls: int = 2) -> LintReport:
    """Report every capture hazard in ``fn(*args, **kwargs)`` before any real capture.

    Runs ``fn`` eagerly ``calls`` times (default 2) on the arguments you give, on either
    backend, under a ``TorchFunctionMode`` and a ``TorchDispatchMode`` that watch every
    tensor call and ATen op and *record* instead of raising, so it keeps going after the
    first hazard and reports them all. Each :class:`Finding` names the hazard, the line
    of your code (the first frame outside torch and labkit), why it breaks and the fix:

    * **CPU sync**: ``.item()``, ``float(t)``, ``int(t)``, a tensor as an index or size,
      printing, ``torch.equal``, ``synchronize()``;
    * **Python branch on a tensor value**: ``if t:``, ``while t > 0:``, ``t and ...``;
    * **data-dependent shapes**: ``nonzero``, ``x[mask]``, ``masked_select``, ``unique``,
      ``bincount``, ``repeat_interleave`` with tensor repeats;
    * **host tensors**: ``.cpu()``, ``.tolist()``, ``.numpy()``, ``torch.tensor(data)``,
      and on a GPU any host<->device copy;
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
            lint.add("baked_argument", f"args[{i}] = {_short(a)}",
                     f"a Python {type(a).__name__} argument: capture runs the function once "
                     f"with {_short(a)}, and every replay uses that value", frame=def_frame)
    for k, a in kwargs.items():
        if isinstance(a, _VALUE_TYPES):
            lint.add("baked_argument", f"{k}={_short(a)}",
                     f"a Python {type(a).__name__} argument: capture runs the function once "
                     f"with {_short(a)}, and every replay uses that value", frame=def_frame)
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
