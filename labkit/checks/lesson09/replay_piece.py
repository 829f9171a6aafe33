"""Exercise 2: ``replay_piece(graph, static_args, output, args)``, one piece's replay.

What :meth:`labkit.piecewise.runner.PiecewiseBackend.replay_piece` does for the piece of
one token bucket: copy into the captured tensors only the arguments whose storage moved
(an attention output is a new tensor every step; the previous piece's output and the
runner's static buffers arrive as views of the captured tensors, new objects at the same
address), and only their real rows (``static[:new.size(0)].copy_(new)``); refuse a
non-tensor argument that differs from the one captured; replay; return the static output.

The checker captures a random row-wise piece on the emulator (any backend can be passed)
with a graph class that records, at each replay, what the captured tensors held and how
often they were written (their version counters), and calls the learner's function as the
runner would, step after step: a bucket filled exactly, a few tokens, one token; the
arguments in a random order (one or two attention outputs, the previous piece's output,
a static int buffer, an int or a float, which arrives as a new float object every call).
A last call changes the number: it must raise.
"""

from __future__ import annotations

import types

import torch

from labkit import backend
from labkit.capture import capture
from labkit.checks import (
    NOT_DONE,
    LearnerTimeout,
    call_learner,
    compare_outputs,
    fail,
    passed,
)
from labkit.checks.lesson09._common import one_thread, short_description
from labkit.core.errors import in_library

__all__ = ["check_replay_piece", "reference_replay_piece"]

NAME = "replay_piece"
HINTS = [
    "Walk zip(args, static_args). A tensor whose data_ptr() differs from its captured "
    "tensor's arrived in new memory: copy it in. One at the same data_ptr() is the captured "
    "memory itself. Anything else (an int, a float) must equal what was captured.",
    "static[:new.size(0)].copy_(new) for a moved tensor; raise RuntimeError(...) when a "
    "non-tensor != its captured value; then graph.replay() and return output.",
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


class _Trial:
    """One captured piece, called step after step as the runner calls it."""

    def __init__(self, fn, B, gen, number, tuple_out=None):
        self.fn, self.gen = fn, gen
        self.B, self.spy = _spy_backend(B)
        dev = B.device
        self.b = int(torch.randint(4, 10, (), generator=gen))         # the bucket
        self.d = int(torch.randint(2, 6, (), generator=gen))
        n_attn = int(torch.randint(1, 3, (), generator=gen))
        kinds = ["attn"] * n_attn + ["prev", "ids", "num"]
        order = torch.randperm(len(kinds), generator=gen).tolist()
        self.kinds = [kinds[i] for i in order]
        self.tuple_out = (bool(torch.rand((), generator=gen) < 0.5) if tuple_out is None
                          else tuple_out)
        self.num = (int(torch.randint(2, 5, (), generator=gen)) if number is int
                    else float(torch.randint(1, 8, (), generator=gen)) / 4)
        b, d = self.b, self.d
        self.prev_buffer = torch.randn(b, d, generator=gen).to(dev)   # the last piece's output
        self.ids_buffer = torch.randint(0, 50, (b + 3,), generator=gen).to(dev)  # runner's buffer
        self.static_args = []
        for k in self.kinds:
            if k == "attn":
                self.static_args.append(torch.randn(b, d, generator=gen).to(dev))
            elif k == "prev":
                self.static_args.append(self.prev_buffer)
            elif k == "ids":
                self.static_args.append(self.ids_buffer[:b])
            else:
                self.static_args.append(self.num)
        self.graph, self.output = capture(self.piece, *self.static_args, B=self.B, warmup=1)
        self.static_kept = list(self.static_args)
        self.copied_fewer = False      # a step with fewer rows than the bucket was copied

    def piece(self, *args):
        """A row-wise piece (norms, MLPs, residual adds work token by token)."""
        h = 0
        for k, a in zip(self.kinds, args):
            if k == "attn":
                h = h + a
            elif k == "prev":
                h = h + a.tanh()
            elif k == "ids":
                h = h + 0.01 * a.unsqueeze(1).to(torch.float32)
        num = next(a for k, a in zip(self.kinds, args) if k == "num")
        out = torch.relu(h * num + 0.1)
        return (out, out.sum(1)) if self.tuple_out else out

    def label(self) -> str:
        names = {"attn": "attention output", "prev": "previous piece's output",
                 "ids": "static int buffer", "num": f"the {type(self.num).__name__} {self.num}"}
        return (f"bucket {self.b}, arguments ({', '.join(names[k] for k in self.kinds)}), "
                f"{'a tuple' if self.tuple_out else 'one tensor'} out")

    def args_for(self, n, num=None):
        """This step's arguments: new attention outputs (n rows), views of the static ones."""
        dev = self.prev_buffer.device
        self.prev_buffer.copy_(torch.randn(self.b, self.d, generator=self.gen).to(dev))
        self.ids_buffer.copy_(torch.randint(0, 50, (self.b + 3,), generator=self.gen).to(dev))
        args = []
        for k in self.kinds:
            if k == "attn":
                args.append(torch.randn(n, self.d, generator=self.gen).to(dev))
            elif k == "prev":
                args.append(self.prev_buffer.view(self.b, self.d))   # same memory, new object
            elif k == "ids":
                args.append(self.ids_buffer[: self.b])
            else:
                v = self.num if num is None else num
                args.append(float(repr(v)) if isinstance(v, float) else v)  # a new object
        return args

    def expected(self, n, args):
        rows = [a[:n] if isinstance(a, torch.Tensor) else a for a in args]
        out = self.piece(*[r.clone() if isinstance(r, torch.Tensor) else r for r in rows])
        return out

    def step(self, n):
        """Call the learner for a step of n real tokens; return a message or None."""
        args = self.args_for(n)
        tensors = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
        moved = [i for i in tensors if self.kinds[i] == "attn"]
        same = [i for i in tensors if self.kinds[i] != "attn"]
        statics = self.static_args
        before = {i: (statics[i]._version, statics[i].clone()) for i in tensors}
        caller = {i: (args[i]._version, args[i].clone()) for i in moved}
        seen = []

        def on_replay():
            seen.append({i: (statics[i]._version, statics[i].clone()) for i in tensors})
        self.spy.on_replay = on_replay
        want = self.expected(n, args)
        got = call_learner(self.fn, self.graph, statics, self.output, args)
        self.spy.on_replay = lambda: None
        where = f"a step of {n} token{'s' if n > 1 else ''}"
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
        for i in moved:
            v, val = caller[i]
            if args[i]._version != v or not torch.equal(args[i], val):
                return (f"{where}: your code wrote into argument {i}, the new attention "
                        f"output (the caller's tensor). Copy it INTO the captured tensor: "
                        f"static[:new.size(0)].copy_(new)")
        at = seen[0]
        if any(a is not b for a, b in zip(statics, self.static_kept)):
            return self.replaced(where)
        for i in moved:
            real = at[i][1][:n]
            if not torch.equal(real, args[i]):
                if torch.equal(statics[i][:n], args[i]):
                    return (f"{where}: your code copied argument {i} (an attention output) "
                            f"after graph.replay(): the replay read the last step's values. "
                            f"Copy first, then replay")
                shape = (f" (this time its shape equals the captured tensor's, "
                         f"{tuple(args[i].shape)}, and your code did copy it when it had "
                         f"fewer rows: decide by data_ptr(), not by shape)"
                         if args[i].shape == statics[i].shape and self.copied_fewer else "")
                return (f"{where}: a stale result: argument {i} (an attention output, a new "
                        f"tensor at every step) was not copied into the tensor the graph was "
                        f"captured with{shape}. The graph reads the captured tensor's address "
                        f"only: copy the new tensor's rows there before the replay")
            if not torch.equal(at[i][1][n:], before[i][1][n:]):
                rows = f"row {n}" if n == self.b - 1 else f"rows {n}..{self.b - 1}"
                return (f"{where}: your code wrote {rows} of the captured "
                        f"tensor of argument {i}: only the first {n} rows are real tokens (the "
                        f"rest is the bucket's padding, which no op outside attention mixes "
                        f"in). Copy the real rows only: static[:new.size(0)].copy_(new)")
        if n < self.b:
            self.copied_fewer = True
        extra = [i for i in same if statics[i]._version != before[i][0]]
        if extra:
            copied = len(extra) + len(moved)
            return (f"{where}: your code copied {copied} tensor arguments, but only "
                    f"{len(moved)} arrived in new memory (argument{'s' if len(moved) > 1 else ''} "
                    f"{', '.join(map(str, moved))}). Argument {extra[0]} is the captured tensor "
                    f"itself: a view of it, so a new Python object at every call, at the same "
                    f"data_ptr(). Copying it onto itself is a wasted kernel per piece per step: "
                    f"copy only where new.data_ptr() != static.data_ptr() (comparing the "
                    f"objects, `is`, says that every view moved)")
        return self.judge_output(where, got, want, n)

    def replaced(self, where):
        i = next(j for j, (a, b) in enumerate(zip(self.static_args, self.static_kept))
                 if a is not b)
        self.static_args[i] = self.static_kept[i]
        return (f"{where}: your code replaced static_args[{i}] with the new tensor: the graph "
                f"still reads the tensor it was captured with, at its address. Copy the new "
                f"values into that tensor instead: static[:new.size(0)].copy_(new)")

    def judge_output(self, where, got, want, n):
        out = self.output
        if got is None:
            return f"{where}: your code returned None: return output, the piece's static output"
        if got is self.graph:
            return (f"{where}: your code returned the graph: return output, the piece's "
                    f"static output")
        if isinstance(out, tuple):
            if isinstance(got, torch.Tensor):
                return (f"{where}: your code returned one tensor, but the piece returns a tuple "
                        f"of {len(out)}: return output as it is")
            same = (isinstance(got, (tuple, list)) and len(got) == len(out)
                    and all(a is b for a, b in zip(got, out)))
        else:
            same = got is out
        if not same:
            values = compare_outputs(_rows(want, n), _rows(got, n), atol=1e-5) is None
            why = ("the right values, but in new tensors" if values else "other tensors")
            return (f"{where}: your code returned {why}, not output, the static output the "
                    f"graph writes. Return output itself: the next piece was captured reading "
                    f"it, so a new tensor there would have to be copied at every step")
        diff = compare_outputs(_rows(want, n), _rows(got, n), atol=1e-5)
        if diff:
            return f"{where}: the output's first {n} rows are wrong: {diff}"
        return None

    def changed_number(self):
        """The number differs from the captured one: the call must raise."""
        other = self.num + 1 if isinstance(self.num, int) else self.num + 0.5
        args = self.args_for(self.b, num=other)
        i = self.kinds.index("num")
        try:
            call_learner(self.fn, self.graph, self.static_args, self.output, args)
        except (NotImplementedError, LearnerTimeout):
            raise
        except Exception:
            return None
        return (f"argument {i} was the {type(other).__name__} {other!r}, but the graph was "
                f"captured with {self.num!r}, and your code replayed it anyway: a graph "
                f"replays the values it was captured with, so the result is silently computed "
                f"with {self.num!r}. Raise (a RuntimeError naming the argument) when a "
                f"non-tensor argument differs")


def _rows(x, n):
    return tuple(t[:n] for t in x) if isinstance(x, (tuple, list)) else x[:n]


def _raised_here(e) -> bool:
    """Did the learner's own code raise ``e`` (a ``raise`` statement), not torch?"""
    tb, last = e.__traceback__, None
    while tb is not None:
        last = tb
        tb = tb.tb_next
    return last is not None and not in_library(last.tb_frame.f_code.co_filename)


def _explain(e, trial) -> str:
    """The learner's exception, with what it most likely means."""
    text = short_description(e)
    s = str(e)
    if "must match the size" in s or "expanded size" in s:
        return (f"{text}\n   The attention output has one row per real token, fewer than the "
                f"bucket's {trial.b} rows of the captured tensor: copy into the first rows, "
                f"static[:new.size(0)].copy_(new)")
    if _raised_here(e):
        i = trial.kinds.index("num")
        floats = (": a float arrives as a new object every call, so `is not` says two equal "
                  "floats differ" if isinstance(trial.num, float) else "")
        return (f"{text}\n   Your code raised on a step where every argument was right: "
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
    gen = torch.Generator().manual_seed(seed)
    for t in range(trials):
        try:
            number = (int, float)[t % 2] if t < 2 else (
                int if bool(torch.rand((), generator=gen) < 0.5) else float)
            trial = _Trial(fn, B, gen, number, tuple_out=(t == 0) if t < 2 else None)
        except Exception as e:       # a bug in the checker, not in the learner's code
            backend.recover(B)
            return fail(NAME, f"the checker itself failed (not your fault): "
                              f"{type(e).__name__}: {e}", kind="checker_error")
        where = f"trial {t + 1} ({trial.label()})"
        b = trial.b
        steps = [int(torch.randint(2, b, (), generator=gen)), b, 1,
                 int(torch.randint(1, b + 1, (), generator=gen))]
        try:
            for n in steps:
                msg = trial.step(n)
                if msg:
                    return fail(NAME, f"{where}: {msg}", more_hints=HINTS)
            msg = trial.changed_number()
        except NotImplementedError:
            return fail(NAME, NOT_DONE, kind="not_implemented")
        except LearnerTimeout as e:
            return fail(NAME, str(e), kind="timeout")
        except Exception as e:
            backend.recover(B)
            return fail(NAME, f"{where}: your code raised {_explain(e, trial)}",
                        kind="exception", more_hints=HINTS)
        if msg:
            return fail(NAME, f"{where}: {msg}", more_hints=HINTS)
    return passed(NAME, f"copies only the moved arguments' real rows, replays once, returns "
                        f"the static output, refuses a changed number ({trials} random pieces, "
                        f"{4 * trials} steps)")
