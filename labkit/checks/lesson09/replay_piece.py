"""Exercise 2: ``replay_piece(graph, static_args, output, args)``, one piece's replay.

What :meth:`labkit.piecewise.runner.PiecewiseBackend.replay_piece` does for the piece of
one token bucket: copy into the captured tensors only the arguments whose memory moved
(``new.data_ptr() != static.data_ptr()``: an attention output is a new tensor every step;
the previous piece's output and the runner's static buffers arrive as views of the
captured tensors, new objects at the same address), and only their real rows
(``static[:new.size(0)].copy_(new)``); refuse a non-tensor argument that differs from the
one captured with a ``RuntimeError`` naming it, before any replay; replay once; return
``output`` itself.

The checker captures a random row-wise piece on the emulator (any backend can be passed)
with a graph class that records, at each replay, what the captured tensors held and how
often they were written (their version counters), and calls the learner's function as the
runner would, step after step: a bucket filled exactly, a few tokens, one token; the
arguments in a random order (one or two attention outputs, a view into the same buffer as
its captured tensor but at another offset (same storage, another ``data_ptr()``: it must
be copied), the previous piece's output, a static int buffer, a static buffer passed as its
first rows (the same ``data_ptr()``, another shape: copied for its shape, it is named), an
int or a float, which arrives as a new float object every call); the piece returns one
tensor, a tuple or a list (``tuple(output)`` is a new object for a list). A copy that went
to the wrong rows, or one row short, is named as such. Every call runs under
:class:`HostReads`: a
read of a tensor's value on the host (``torch.equal``, ``.item()``, ``.tolist()``, an
``if`` on a tensor) is a device→host sync on every step and is refused. A last call
changes the number (a float by less than 1, without crossing an integer, so that
``int(new) != int(static)`` misses it, and in the first float trial by 0.01 to 0.04 only,
which a comparison after rounding misses): the learner's code must raise a ``RuntimeError``
whose message names the argument (its position in ``args`` or the value given), without
replaying. Only a ``RuntimeError`` counts as a refusal: another exception is a bug,
reported with its line.
"""

from __future__ import annotations

import linecache
import math
import re
import types

import torch

from labkit import backend
from labkit.capture import capture
from labkit.checks import (
    Reason,
    attempt,
    call_learner,
    compare_outputs,
    describe_exception,
    fail,
    outcome,
    reject,
    run_check,
)
from labkit.checks.lesson09._common import HostReads, one_thread, short_description
from labkit.core.errors import in_library

__all__ = ["check_replay_piece", "reference_replay_piece"]

NAME = "replay_piece"
HINTS = [
    "Walk zip(args, static_args). A tensor whose data_ptr() differs from its captured "
    "tensor's arrived in new memory: copy it in. One at the same data_ptr() is the captured "
    "memory itself. Anything else (an int, a float) must equal what was captured.",
    "static[:new.size(0)].copy_(new) for a moved tensor; raise RuntimeError(f\"argument {i} "
    "is {new!r}, captured with {static!r}\") when a non-tensor != its captured value, before "
    "any replay; then graph.replay() and return output.",
]
_REFUSE_HINTS = [
    "A graph replays the number it was captured with, whatever the caller passes now: the "
    "only safe answer to a changed number is to refuse the call, before the graph runs.",
    "Check every non-tensor argument first: if new != static: raise RuntimeError(f\"argument "
    "{i} is {new!r}, captured with {static!r}\"). Only then copy and replay.",
]
_HOST_READ_HINTS = [
    "Whether a tensor moved is a question about its address, which the host knows without "
    "reading any value: new.data_ptr() != static.data_ptr().",
    "Copy without looking at the values: static[:new.size(0)].copy_(new) whenever the "
    "addresses differ. Compare only the non-tensor arguments by value (new != static).",
]


def reference_replay_piece(graph, static_args, output, args):
    """The answer (the body of PiecewiseBackend.replay_piece)."""
    for new, static in zip(args, static_args):
        if not isinstance(new, torch.Tensor):
            if new != static:
                raise RuntimeError(f"argument {new!r} differs from the {static!r} it was "
                                   f"captured with")
        elif new.data_ptr() != static.data_ptr():
            static[: new.size(0)].copy_(new)
    graph.replay()
    return output


def _spy_backend(B):
    """``B`` with a CUDAGraph that calls ``spy.on_replay()`` before each replay."""
    spy = types.SimpleNamespace(on_replay=lambda: None)

    class SpyGraph(B.CUDAGraph):
        def replay(self, *a, **k):
            spy.on_replay()
            return super().replay(*a, **k)

    return types.SimpleNamespace(**{**vars(B), "CUDAGraph": SpyGraph}), spy


# ---- one trial ---------------------------------------------------------------------------

_ORDINAL = {1: "once", 2: "twice"}
_MOVED = ("attn", "view")     # the kinds of argument that arrive in new memory


class _Trial:
    """One captured piece, called step after step as the runner calls it."""

    def __init__(self, fn, B, gen, number, out_kind=None):
        self.fn, self.gen = fn, gen
        self.B, self.spy = _spy_backend(B)
        dev = B.device
        self.b = int(torch.randint(4, 10, (), generator=gen))         # the bucket
        self.d = int(torch.randint(2, 6, (), generator=gen))
        n_attn = int(torch.randint(1, 3, (), generator=gen))
        kinds = ["attn"] * n_attn + ["view", "prev", "ids", "head", "num"]
        order = torch.randperm(len(kinds), generator=gen).tolist()
        self.kinds = [kinds[i] for i in order]
        self.out_kind = (_OUT_KINDS[int(torch.randint(0, 3, (), generator=gen))]
                         if out_kind is None else out_kind)
        self.num = (int(torch.randint(2, 5, (), generator=gen)) if number is int
                    else float(torch.randint(1, 8, (), generator=gen)) / 4)
        b, d = self.b, self.d
        self.prev_buffer = torch.randn(b, d, generator=gen).to(dev)   # the last piece's output
        self.ids_buffer = torch.randint(0, 50, (b + 3,), generator=gen).to(dev)  # runner's buffer
        # captured whole; later steps pass its first n rows: the same address, fewer rows
        self.head_buffer = torch.randn(b, d, generator=gen).to(dev)
        # captured as its first b rows; later steps pass rows further down the same buffer
        self.view_buffer = torch.randn(2 * b + 1, d, generator=gen).to(dev)
        self.static_args = []
        for k in self.kinds:
            if k == "attn":
                self.static_args.append(torch.randn(b, d, generator=gen).to(dev))
            elif k == "view":
                self.static_args.append(self.view_buffer[:b])
            elif k == "prev":
                self.static_args.append(self.prev_buffer)
            elif k == "ids":
                self.static_args.append(self.ids_buffer[:b])
            elif k == "head":
                self.static_args.append(self.head_buffer)
            else:
                self.static_args.append(self.num)
        self.graph, self.output = capture(self.piece, *self.static_args, B=self.B, warmup=1)
        self.static_kept = list(self.static_args)
        self.copied_fewer = False      # a step with fewer rows than the bucket was copied
        self.current = "capturing the piece"

    def piece(self, *args):
        """A row-wise piece (norms, MLPs, residual adds work token by token)."""
        h = 0
        for k, a in zip(self.kinds, args):
            if k == "attn":
                h = h + a
            elif k == "view":
                h = h + 0.5 * a
            elif k == "prev":
                h = h + a.tanh()
            elif k == "ids":
                h = h + 0.01 * a.unsqueeze(1).to(torch.float32)
            elif k == "head":
                h = h - 0.25 * a
        num = next(a for k, a in zip(self.kinds, args) if k == "num")
        out = torch.relu(h * num + 0.1)
        if self.out_kind == "tensor":
            return out
        return (out, out.sum(1)) if self.out_kind == "tuple" else [out, out.sum(1)]

    def label(self) -> str:
        names = {"attn": "attention output", "view": "a view at another offset of its "
                 "captured tensor's buffer", "prev": "previous piece's output",
                 "ids": "static int buffer", "head": "the first rows of its captured "
                 "tensor (same address, fewer rows)",
                 "num": f"the {type(self.num).__name__} {self.num}"}
        out = {"tensor": "one tensor", "tuple": "a tuple", "list": "a list"}[self.out_kind]
        return (f"bucket {self.b}, arguments ({', '.join(names[k] for k in self.kinds)}), "
                f"{out} out")

    def args_for(self, n, num=None):
        """This step's arguments: new attention outputs (n rows), views of the static ones."""
        dev = self.prev_buffer.device
        self.prev_buffer.copy_(torch.randn(self.b, self.d, generator=self.gen).to(dev))
        self.ids_buffer.copy_(torch.randint(0, 50, (self.b + 3,), generator=self.gen).to(dev))
        args = []
        for k in self.kinds:
            if k == "attn":
                args.append(torch.randn(n, self.d, generator=self.gen).to(dev))
            elif k == "view":      # same storage as the captured rows, another data_ptr()
                rows = self.view_buffer[self.b + 1: self.b + 1 + n]
                rows.copy_(torch.randn(n, self.d, generator=self.gen).to(dev))
                args.append(rows)
            elif k == "prev":
                args.append(self.prev_buffer.view(self.b, self.d))   # same memory, new object
            elif k == "ids":
                args.append(self.ids_buffer[: self.b])
            elif k == "head":      # the runner wrote this step's n rows there
                self.head_buffer[:n].copy_(torch.randn(n, self.d, generator=self.gen).to(dev))
                args.append(self.head_buffer[:n])
            else:
                v = self.num if num is None else num
                args.append(float(repr(v)) if isinstance(v, float) else v)  # a new object
        return args

    def expected(self, n, args):
        rows = [a[:n] if isinstance(a, torch.Tensor) else a for a in args]
        out = self.piece(*[r.clone() if isinstance(r, torch.Tensor) else r for r in rows])
        return out

    def call(self, args, reads=None):
        """The learner's function on this step's arguments (under ``reads`` if given)."""
        if reads is None:
            return call_learner(self.fn, self.graph, self.static_args, self.output, args)
        with reads:
            return call_learner(self.fn, self.graph, self.static_args, self.output, args)

    def step(self, n):
        """Call the learner for a step of n real tokens; return a message or None."""
        where = f"a step of {n} token{'s' if n > 1 else ''}"
        self.current = where
        args = self.args_for(n)
        tensors = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
        moved = [i for i in tensors if self.kinds[i] in _MOVED]
        same = [i for i in tensors if self.kinds[i] not in _MOVED]
        statics = self.static_args
        before = {i: (statics[i]._version, statics[i].clone()) for i in tensors}
        caller = {i: (args[i]._version, args[i].clone()) for i in moved}
        seen = []

        def on_replay():
            seen.append({i: (statics[i]._version, statics[i].clone()) for i in tensors})
        self.spy.on_replay = on_replay
        want = self.expected(n, args)
        reads = HostReads()
        try:
            got = self.call(args, reads)
        finally:
            self.spy.on_replay = lambda: None
        read = reads.message()
        if read:
            return Reason(f"{where}: your code reads tensor values back to the host "
                          f"({read}): a device→host sync on every step; decide by data_ptr() "
                          f"whether a tensor moved (new.data_ptr() != static.data_ptr()), and "
                          f"compare only the non-tensor arguments by value", _HOST_READ_HINTS)
        return (self._replayed_once(where, seen)
                or self._callers_untouched(where, moved, caller, args)
                or self._real_rows(where, moved, args, seen[0], before, n)
                or self._copied_moved_only(where, same, moved, args, before, n)
                or self.judge_output(where, got, want, n))

    def _replayed_once(self, where, seen):
        """One replay, and the captured tensors still the ones captured."""
        statics = self.static_args
        if not seen:
            if any(a is not b for a, b in zip(statics, self.static_kept)):
                return self.replaced(where)
            return (f"{where}: your code did not replay the graph. Copying fills the captured "
                    f"tensors; graph.replay() runs the piece on them, and only then does "
                    f"output hold this step's result")
        if len(seen) > 1:
            times = _ORDINAL.get(len(seen), f"{len(seen)} times")
            return (f"{where}: your code replayed the graph {times}. "
                    f"Replay once per call: each replay runs every kernel of the piece again")
        return None

    def _callers_untouched(self, where, moved, caller, args):
        """The caller's new tensors are read, not written."""
        for i in moved:
            v, val = caller[i]
            # a view shares its buffer's version counter with the captured rows: values only
            wrote = (args[i]._version != v) if self.kinds[i] == "attn" else False
            if wrote or not torch.equal(args[i], val):
                return (f"{where}: your code wrote into argument {i}, the new "
                        f"{'attention output' if self.kinds[i] == 'attn' else 'tensor'} "
                        f"(the caller's tensor). Copy it INTO the captured tensor: "
                        f"static[:new.size(0)].copy_(new)")
        return None

    def _real_rows(self, where, moved, args, at, before, n):
        """What the replay read: the new tensors' rows, copied before it, the padding rows
        left alone."""
        statics = self.static_args
        if any(a is not b for a, b in zip(statics, self.static_kept)):
            return self.replaced(where)
        for i in moved:
            real = at[i][1][:n]
            if not torch.equal(real, args[i]):
                if torch.equal(statics[i][:n], args[i]):
                    return (f"{where}: your code copied argument {i} (a tensor in new memory) "
                            f"after graph.replay(): the replay read the last step's values. "
                            f"Copy first, then replay")
                if at[i][0] != before[i][0] or not torch.equal(at[i][1], before[i][1]):
                    return self.wrong_rows(where, i, args[i], at[i][1], n)
                return self.stale(where, i, args[i])
            if not torch.equal(at[i][1][n:], before[i][1][n:]):
                rows = f"row {n}" if n == self.b - 1 else f"rows {n}..{self.b - 1}"
                return (f"{where}: your code wrote {rows} of the captured "
                        f"tensor of argument {i}: only the first {n} rows are real tokens (the "
                        f"rest is the bucket's padding, which no op outside attention mixes "
                        f"in). Copy the real rows only: static[:new.size(0)].copy_(new)")
        return None

    def _copied_moved_only(self, where, same, moved, args, before, n):
        """Only the tensors in new memory are copied (by data_ptr, not by shape)."""
        statics = self.static_args
        if n < self.b:
            self.copied_fewer = True
        extra = [i for i in same if statics[i]._version != before[i][0]]
        shorter = [i for i in extra if args[i].shape != statics[i].shape]
        if shorter and len(shorter) == len(extra):     # copied for its shape alone
            i = shorter[0]
            return (f"{where}: your code copied argument {i}, which has "
                    f"{args[i].size(0)} rows where its captured tensor has {self.b}, but the "
                    f"same data_ptr(): it is the captured tensor's first rows, the captured "
                    f"memory itself, already holding this step's values (a copy onto itself "
                    f"is a wasted kernel per piece per step): decide by data_ptr(), not by "
                    f"shape, and copy only where new.data_ptr() != static.data_ptr()")
        if extra:
            copied = len(extra) + len(moved)
            return (f"{where}: your code copied {copied} tensor arguments, but only "
                    f"{len(moved)} arrived in new memory (argument{'s' if len(moved) > 1 else ''} "
                    f"{', '.join(map(str, moved))}). Argument {extra[0]} is the captured tensor "
                    f"itself: a view of it, so a new Python object at every call, at the same "
                    f"data_ptr(). Copying it onto itself is a wasted kernel per piece per step: "
                    f"copy only where new.data_ptr() != static.data_ptr() (comparing the "
                    f"objects, `is`, says that every view moved)")
        return None

    def wrong_rows(self, where, i, new, held, n):
        """Argument i moved and your code wrote its captured tensor, but its first n rows do
        not hold the new rows: name where they went."""
        rows = n - 1 if n > 1 else 0
        for o in range(1, self.b - n + 1):
            if torch.equal(held[o:o + n], new):
                return (f"{where}: your code copied argument {i} (a tensor of {n} rows in new "
                        f"memory) into rows {o}..{o + n - 1} of its captured tensor, but the "
                        f"real tokens are its first rows, 0..{n - 1} (the rest is the bucket's "
                        f"padding): static[:new.size(0)].copy_(new)")
        if rows and torch.equal(held[:rows], new[:rows]):
            return (f"{where}: your code copied argument {i} one row short: rows "
                    f"0..{rows - 1} of its captured tensor hold the new tensor's, row {rows} "
                    f"does not. All {n} rows of the new tensor are real tokens: "
                    f"static[:new.size(0)].copy_(new), new.size(0) rows")
        bad = [r for r in range(n) if not torch.equal(held[r], new[r])]
        return (f"{where}: your code wrote the captured tensor of argument {i} (a tensor of "
                f"{n} rows in new memory), but before the replay its rows {_rows_list(bad)} "
                f"did not hold the new tensor's rows: copy the new rows, in order, into the "
                f"first rows: static[:new.size(0)].copy_(new)")

    def stale(self, where, i, new):
        """Argument i moved and was not copied before the replay."""
        static = self.static_args[i]
        shape = (f" (this time its shape equals the captured tensor's, {tuple(new.shape)}, and "
                 f"your code did copy it when it had fewer rows: decide by data_ptr(), not by "
                 f"shape)" if new.shape == static.shape and self.copied_fewer else "")
        if self.kinds[i] == "view":
            return (f"{where}: a stale result: argument {i} is a view into the same buffer as "
                    f"its captured tensor, at another offset (the same untyped_storage(), "
                    f"another data_ptr()), and it was not copied{shape}. Its rows sit elsewhere "
                    f"in that buffer, and the graph reads the captured rows only: compare "
                    f"data_ptr() (the address of the tensor's first element), not the storage's, "
                    f"and copy it in")
        return (f"{where}: a stale result: argument {i} (an attention output, a new "
                f"tensor at every step) was not copied into the tensor the graph was "
                f"captured with{shape}. The graph reads the captured tensor's address "
                f"only: copy the new tensor's rows there before the replay")

    def replaced(self, where):
        i = next(j for j, (a, b) in enumerate(zip(self.static_args, self.static_kept))
                 if a is not b)
        self.static_args[i] = self.static_kept[i]
        return (f"{where}: your code replaced static_args[{i}] with the new tensor: the graph "
                f"still reads the tensor it was captured with, at its address. Copy the new "
                f"values into that tensor instead: static[:new.size(0)].copy_(new)")

    def judge_output(self, where, got, want, n):
        out = self.output
        if got is out:
            diff = compare_outputs(_rows(want, n), _rows(got, n), atol=1e-5)
            return f"{where}: the output's first {n} rows are wrong: {diff}" if diff else None
        if got is None:
            return f"{where}: your code returned None: return output, the piece's static output"
        if got is self.graph:
            return (f"{where}: your code returned the graph: return output, the piece's "
                    f"static output")
        if isinstance(out, (tuple, list)):
            if isinstance(got, torch.Tensor):
                return (f"{where}: your code returned one tensor, but the piece returns a "
                        f"{type(out).__name__} of {len(out)}: return output as it is")
            if (isinstance(got, (tuple, list)) and len(got) == len(out)
                    and all(a is b for a, b in zip(got, out))):
                return (f"{where}: your code returned a new {type(got).__name__} holding "
                        f"output's tensors, not output itself: return output as it is (the "
                        f"same object: `result is output`), whatever the captured function "
                        f"returned, a tensor, or a tuple or list of them (tuple(output) is a "
                        f"new object when output is a list)")
        values = compare_outputs(_rows(want, n), _rows(got, n), atol=1e-5) is None
        why = ("the right values, but in new tensors" if values else "other tensors")
        return (f"{where}: your code returned {why}, not output, the static output the "
                f"graph writes. Return output itself: the next piece was captured reading "
                f"it, so a new tensor there would have to be copied at every step")

    def changed_number(self, small=False):
        """The number differs from the captured one: the call must raise a RuntimeError
        naming the argument, before any replay. ``small``: a float changes by 0.01 to 0.04
        only (one decimal rounds it back to the captured value). Returns a message, or
        None."""
        gen = self.gen
        if isinstance(self.num, int):
            other = self.num + int(torch.randint(1, 4, (), generator=gen))
        elif small:     # num is a multiple of 0.25: 0.01..0.04 away, the same integer part,
            # towards the value one decimal rounds num to (x.25 -> x.2, x.75 -> x.8)
            delta = 0.01 * int(torch.randint(1, 5, (), generator=gen))
            frac = self.num - math.floor(self.num)
            other = round(self.num - delta if frac == 0.25 else self.num + delta, 2)
        else:   # less than 1 away, the same integer part: int(new) == int(static)
            base, frac = math.floor(self.num), self.num - math.floor(self.num)
            while True:
                f = round(0.05 + 0.9 * float(torch.rand((), generator=gen)), 2)
                if abs(f - frac) >= 0.1:
                    break
            other = base + f
        self.current = f"the step whose number changed to {other!r}"
        args = self.args_for(self.b, num=other)
        i = self.kinds.index("num")
        replays = []
        self.spy.on_replay = lambda: replays.append(1)
        try:                    # a raise is the answer asked for: judged below
            kind, err = outcome(self.call, (args,))
        finally:
            self.spy.on_replay = lambda: None
        err = err if kind == "raised" else None
        given = (f"argument {i} was the {type(other).__name__} {other!r}, but the graph was "
                 f"captured with {self.num!r}")
        if err is None:
            close = (f" ({other!r} and {self.num!r} differ by less than 1: compare the values "
                     f"themselves, new != static, not int(new) or a rounded value)"
                     if int(other) == int(self.num) else "")
            return (f"{given}, and your code replayed it anyway{close}: a graph replays the "
                    f"values it was captured with, so the result is silently computed with "
                    f"{self.num!r}. Raise a RuntimeError naming the argument when a "
                    f"non-tensor argument differs, before graph.replay()")
        text = describe_exception(err)
        if not isinstance(err, RuntimeError) or not _raised_here(err):
            if not _raised_here(err):
                return (f"{given}, and your code raised {text}\n   That is a bug in your "
                        f"code, not a refusal: refuse a changed number yourself, with "
                        f"raise RuntimeError(...) naming the argument")
            if isinstance(err, AssertionError):
                return (f"{given}; your code refused it with an assert (AssertionError): "
                        f"{text}\n   An assert is for bugs in your own code (python -O removes "
                        f"it); a caller's changed number is refused with raise "
                        f"RuntimeError(...) naming the argument")
            kind = type(err).__name__
            return (f"{given}; your code refused it with {_a(kind)} {kind}, not a "
                    f"RuntimeError: {text}\n   The text asks for a RuntimeError (what torch "
                    f"and the runner raise for a call a graph cannot serve): raise "
                    f"RuntimeError(...) naming the argument")
        if replays:
            times = _ORDINAL.get(len(replays), f"{len(replays)} times")
            return (f"{given}; your code raised, but only after replaying the graph {times} "
                    f"with the captured {self.num!r}: check every argument before "
                    f"graph.replay(), and replay only when all of them match")
        if not _names_argument(str(err), i, other):
            return (f"{given}; your code raised RuntimeError({str(err)!r}), which names no "
                    f"argument: say which one changed, by its position in args ({i}) or the "
                    f"value given ({other!r}), e.g. f\"argument {{i}} is {{new!r}}, captured "
                    f"with {{static!r}}\"")
        return None


_OUT_KINDS = ("tensor", "tuple", "list")


def _rows_list(rows) -> str:
    shown = ", ".join(map(str, rows[:6]))
    return shown + (", ..." if len(rows) > 6 else "")


def _a(word: str) -> str:
    return "an" if word[:1].lower() in "aeiou" else "a"


_NUMBER = re.compile(r"\d+(?:\.\d+)?(?:[eE][-+]?\d+)?")


def _names_argument(text: str, i: int, value) -> bool:
    """Does the message name argument ``i``: its position, or the value given (a float
    in any rounding to 2 decimals or more)?"""
    for tok in _NUMBER.findall(text):
        if tok.isdigit() and int(tok) == i:
            return True
        if isinstance(value, int) and tok.isdigit() and int(tok) == value:
            return True
        if isinstance(value, float) and not tok.isdigit() and abs(float(tok) - value) <= 0.006:
            return True
    return False


def _rows(x, n):
    return tuple(t[:n] for t in x) if isinstance(x, (tuple, list)) else x[:n]


_RAISE = re.compile(r"\b(raise|assert)\b")


def _raised_here(e) -> bool:
    """Did the learner's own code raise ``e`` on purpose (a ``raise`` or ``assert``
    statement of its own), not torch, labkit or a bug (an attribute that does not exist)?
    The reference above counts as the learner's."""
    tb, last = e.__traceback__, None
    while tb is not None:
        last = tb
        tb = tb.tb_next
    if last is None:
        return False
    name = last.tb_frame.f_code.co_filename
    if name != __file__ and in_library(name):
        return False
    line = linecache.getline(name, last.tb_lineno)
    return not line or bool(_RAISE.search(line))


def _explain(e, trial) -> str:
    """The learner's exception on a step where every argument was right."""
    text = short_description(e)
    s = str(e)
    if "must match the size" in s or "expanded size" in s:
        return (f"{text}\n   The attention output has one row per real token, fewer than the "
                f"bucket's {trial.b} rows of the captured tensor: copy into the first rows, "
                f"static[:new.size(0)].copy_(new)")
    if isinstance(e, RuntimeError) and _raised_here(e):
        i = trial.kinds.index("num")
        floats = (": a float arrives as a new object every call, so `is not` says two equal "
                  "floats differ" if isinstance(trial.num, float) else "")
        return (f"{text}\n   Your code refused a step where every argument was right: "
                f"argument {i} was {trial.num!r}, equal to the value captured. Refuse only a "
                f"non-tensor that differs (new != static){floats}")
    return text


def check_replay_piece(fn, *, B=None, trials: int = 6, seed: int = 0):
    """Check the learner's ``replay_piece(graph, static_args, output, args)`` (module
    docstring). ``B``: the backend to capture on (default: the emulator)."""
    if not callable(fn):
        return fail(NAME, f"expected your function replay_piece, got {type(fn).__name__}")
    B = backend.get("emulated") if B is None else backend.ensure(B, "check_replay_piece(B=...)")
    with one_thread(B.device):
        return _check(fn, B, trials, seed)


def _check(fn, B, trials, seed):
    def body() -> str:
        gen = torch.Generator().manual_seed(seed)
        for t in range(trials):
            _one_trial(fn, B, gen, t)
        return (f"copies only the moved arguments' real rows, reads no value on the host, "
                f"replays once, returns output itself, refuses a changed number with a "
                f"RuntimeError naming it ({trials} random pieces, {4 * trials} steps)")

    return run_check(NAME, body, more_hints=HINTS)


def _one_trial(fn, B, gen, t: int) -> None:
    """Trial ``t``: a random captured piece, four steps, then a changed number."""
    try:
        number = (int, float)[t % 2] if t < 2 else (
            int if bool(torch.rand((), generator=gen) < 0.5) else float)
        trial = _Trial(fn, B, gen, number, out_kind=_OUT_KINDS[t] if t < 3 else None)
    except Exception as e:       # a bug in the checker, not in the learner's code
        backend.recover(B)
        reject(f"the checker itself failed (not your fault): {type(e).__name__}: {e}",
               hints=[], kind="checker_error")
    where = f"trial {t + 1} ({trial.label()})"
    b = trial.b
    steps = [int(torch.randint(2, b, (), generator=gen)), b, 1,
             int(torch.randint(1, b + 1, (), generator=gen))]

    def run() -> str | None:
        for n in steps:
            msg = trial.step(n)
            if msg:
                reject(f"{where}: {msg}", hints=getattr(msg, "hints", None) or HINTS)
        # the first float trial changes its float by a hair: rounding misses it
        return trial.changed_number(small=(t == 1) or bool(torch.rand((), generator=gen)
                                                           < 0.5))

    msg = attempt(run, B=B, reason=lambda e: f"{where}, {trial.current}: your code raised "
                  f"{_explain(e, trial)}")
    if msg:
        reject(f"{where}: {msg}", hints=_REFUSE_HINTS)
