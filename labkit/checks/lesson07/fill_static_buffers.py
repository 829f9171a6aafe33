"""Lesson 07, exercise ``fill_static_buffers``: its checker.

``fill_static_buffers(buffers, microbatches)``: copy every microbatch into its static
buffers *in place*, with non-blocking copies, on the stream the caller made current.
Checked by what a captured graph would see (the tensors that were in ``buffers``
before the call must hold the new data afterwards) and by watching every ``copy_``
the function makes (its ``non_blocking`` flag, the stream it runs on).
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from labkit import full_step as FS
from labkit.checks import CheckResult, Exercise, attempt, compare_outputs

__all__ = ["check_fill_static_buffers"]


def _leaves(buffers) -> list[torch.Tensor]:
    out = []
    for mb in buffers:
        out.extend(mb if isinstance(mb, (tuple, list)) else [mb])
    return out


def _current_stream(device: torch.device):
    if device.type == "cuda":
        return torch.cuda.current_stream(device)
    from labkit import backend

    return backend.get("emulated").current_stream()


def _side_stream(device: torch.device):
    if device.type == "cuda":
        return torch.cuda.Stream(device)
    from labkit import backend

    return backend.get("emulated").Stream()


def _stream_ctx(s):
    if isinstance(s, torch.cuda.Stream):
        return torch.cuda.stream(s)
    from labkit import backend

    return backend.get("emulated").stream(s)


class _CopyLog(TorchDispatchMode):
    """Records every op that writes into one of ``targets`` (by storage): which op, its
    ``non_blocking`` flag (copies) and the stream current at that moment."""

    def __init__(self, targets, device):
        super().__init__()
        self.targets = {t.untyped_storage().data_ptr(): i for i, t in enumerate(targets)}
        self.device = device
        self.writes: list[tuple[int, str, bool | None, object]] = []

    def _note(self, t, op, nb):
        i = self.targets.get(t.untyped_storage().data_ptr()) if isinstance(t, torch.Tensor) \
            else None
        if i is not None:
            self.writes.append((i, op, nb, _current_stream(self.device)))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if name == "copy_":
            nb = kwargs.get("non_blocking", args[2] if len(args) > 2 else False)
            self._note(args[0], "copy_", bool(nb))
        elif name == "_foreach_copy_":
            nb = kwargs.get("non_blocking", args[2] if len(args) > 2 else False)
            for t in args[0]:
                self._note(t, "copy_", bool(nb))
        elif func._schema.is_mutable:
            for arg, t in zip(func._schema.arguments, args):
                if arg.is_write:
                    for x in (t if isinstance(t, (list, tuple)) else [t]):
                        self._note(x, name, None)
        return func(*args, **kwargs)


class _SyncWatch:
    """Notes every host synchronization made while active, instead of letting a CPU-only
    torch refuse ``torch.cuda.synchronize()`` with "Torch not compiled with CUDA enabled"
    (which a learner would read as a broken install, not as the rule). Patched: the
    ``synchronize`` of ``torch.cuda``, ``torch.accelerator`` and every labkit backend
    namespace, and of the Stream and Event classes of both backends."""

    def __init__(self):
        self.calls: list[str] = []
        self._undo: list[tuple[object, str, object]] = []

    def _patch(self, owner, attr: str, label: str, call_through: bool):
        orig = getattr(owner, attr, None)
        if orig is None:
            return

        def noted(*args, **kwargs):
            self.calls.append(label)
            if call_through:
                return orig(*args, **kwargs)
            return None

        self._undo.append((owner, attr, orig))
        setattr(owner, attr, noted)

    def __enter__(self):
        from labkit import backend

        on_gpu = torch.cuda.is_available()
        emulated = backend.get("emulated")
        self._patch(torch.cuda, "synchronize", "torch.cuda.synchronize()", on_gpu)
        self._patch(torch.cuda.Stream, "synchronize", "Stream.synchronize()", on_gpu)
        self._patch(torch.cuda.Event, "synchronize", "Event.synchronize()", on_gpu)
        if hasattr(torch, "accelerator"):
            self._patch(torch.accelerator, "synchronize", "torch.accelerator.synchronize()",
                        on_gpu)
        self._patch(emulated.Stream, "synchronize", "Stream.synchronize()", True)
        self._patch(emulated.Event, "synchronize", "Event.synchronize()", True)
        for ns in list(backend._cache.values()):
            self._patch(ns, "synchronize", "B.synchronize()", ns.name == "emulated" or on_gpu)
        return self

    def __exit__(self, *exc):
        for owner, attr, orig in reversed(self._undo):
            setattr(owner, attr, orig)
        self._undo.clear()
        return False


_NO_GPU_WORDS = ("Torch not compiled with CUDA", "Found no NVIDIA driver",
                 "No CUDA GPUs are available")


_FILL_HINTS = [
    "A graph holds the addresses of the buffer tensors: write INTO them, element-wise, "
    "with Tensor.copy_. Which tensor is the destination, which the source?",
    "Loop over microbatches and, inside, over the tensors of each one (tokens, targets); "
    "copy with non_blocking=True. Streams and waits are the loader's job, not yours.",
    "for bufs, mb in zip(buffers, microbatches):\n"
    "        for buf, new in zip(bufs, mb):\n"
    "            buf.copy_(new, non_blocking=True)",
]


EXERCISE = Exercise(
    "fill_static_buffers",
    hint="compare with section 2 (static inputs): the graph reads the buffers' addresses",
    more_hints=tuple(_FILL_HINTS),
)


def _cuda_on_cpu(exc: BaseException) -> str | None:
    """A torch.cuda call this machine cannot run: named as the mistake it is."""
    if not isinstance(exc, (AssertionError, RuntimeError)) or \
            not any(w in str(exc) for w in _NO_GPU_WORDS):
        return None
    return ("your fill called torch.cuda, which this machine cannot run ("
            f"{type(exc).__name__}: {str(exc).splitlines()[0]}); but the fill needs no "
            "torch.cuda call on a GPU either: copy_ on the stream that is current, create no "
            "stream, synchronize nothing. StaticBatchLoader.load makes the waits around "
            "your call")


def _make_inputs(device: torch.device):
    def make_inputs(gen: torch.Generator):
        m = int(torch.randint(2, 5, (), generator=gen))
        b = int(torch.randint(1, 4, (), generator=gen))
        t = int(torch.randint(3, 9, (), generator=gen))
        mbs = []
        for _ in range(m):
            seq = torch.randint(0, 100, (b, t + 1), generator=gen)
            mbs.append((seq[:, :-1].contiguous().to(device), seq[:, 1:].contiguous().to(device)))
        buffers = [(torch.randint(100, 200, (b, t), generator=gen).to(device),
                    torch.randint(200, 300, (b, t), generator=gen).to(device))
                   for _ in range(m)]
        return buffers, mbs
    return make_inputs


def _observe(fill, device: torch.device):
    """The trial: ``fill`` called on a side stream, as the loader does, watching its
    writes and synchronizations; what the captured buffer tensors hold afterwards."""
    def run(buffers, microbatches):
        captured = _leaves(buffers)                 # what a graph would hold on to
        ptrs = [t.data_ptr() for t in captured]
        sources = [t.clone() for t in _leaves(microbatches)]
        side = _side_stream(device)
        side.wait_stream(_current_stream(device))   # as the loader does: inputs are ready
        log = _CopyLog(captured, device)
        syncs = _SyncWatch()
        with _stream_ctx(side), syncs, log:
            attempt(fill, (buffers, microbatches), explain=_cuda_on_cpu)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        now = _leaves(buffers)
        rebound = (len(now) != len(captured) or any(a is not b for a, b in zip(now, captured))
                   or [t.data_ptr() for t in captured] != ptrs)
        return {"syncs": syncs.calls,
                "contents": [t.clone() for t in captured],
                "rebound": rebound,
                "sources_changed": any(not torch.equal(a, b)
                                       for a, b in zip(sources, _leaves(microbatches))),
                "writes": [(i, op, nb, st == side) for i, op, nb, st in log.writes],
                "width": len(buffers[0]) if buffers else 0}
    return run


def _where(k: int, width: int) -> str:
    i, j = divmod(k, width)
    return f"buffers[{i}][{j}] ({'tokens' if j == 0 else 'targets'} of microbatch {i})"


def _no_sync(expected, actual) -> str | None:
    if not actual["syncs"]:
        return None
    return (f"your fill calls {actual['syncs'][0]}: the exercise says synchronize "
            "nothing. A synchronize makes the host wait for work queued on the GPU, "
            "which throws away what non_blocking=True bought; "
            "StaticBatchLoader.load orders the copies with event waits between its "
            "stream and the compute stream, so the host never waits")


def _same_tensors(expected, actual) -> str | None:
    if not actual["rebound"]:
        return None
    return ("the buffers now hold different tensors than before the call: a graph "
            "captured the OLD ones and keeps reading their addresses, which still "
            "hold the old data. Don't assign to buffers[i] (or to an element of it): "
            "write into the tensors that are there")


def _contents(expected, actual) -> str | None:
    """Every captured buffer holds its own microbatch's data."""
    width = actual["width"] or 2
    exp, act = expected["contents"], actual["contents"]
    wrong = [k for k, (e, a) in enumerate(zip(exp, act)) if not torch.equal(e, a)]
    if not wrong:
        return None
    if actual["sources_changed"]:
        return ("your function changed the microbatches and left the buffers as they "
                "were: the copy goes the wrong way. In dst.copy_(src) the tensor "
                "before the dot is the one written")
    written = {i for i, *_ in actual["writes"]}
    k = wrong[0]
    if len(wrong) == len(act) and not written:
        return ("no buffer was written: rebinding a loop variable (buf = new) "
                "changes nothing the graph sees; write into the buffer tensor")
    for other, e in enumerate(exp):
        if other != k and torch.equal(act[k], e):
            return (f"{_where(k, width)} holds the data of {_where(other, width)}: "
                    "each microbatch goes into its own buffers, in the same order")
    untouched = [w for w in wrong if w not in written]
    if untouched:
        missed = ", ".join(_where(w, width) for w in untouched[:3])
        return (f"{missed} still hold the old data: fill every tensor of every "
                f"microbatch (this trial has {len(act) // width} microbatches of "
                f"{width} tensors)")
    return (f"{_where(k, width)} does not hold the microbatch's data after your fill: "
            + (compare_outputs(exp[k], act[k]) or "values differ"))


def _the_copies(expected, actual) -> str | None:
    """Each buffer written by a non-blocking copy_ on the stream current at the call."""
    width = actual["width"] or 2
    copies = {i: (op, nb, on_side) for i, op, nb, on_side in actual["writes"]}
    for k in range(len(actual["contents"])):
        op, nb, on_side = copies.get(k, (None, None, True))
        if op is None:
            continue
        if op != "copy_":
            return (f"{_where(k, width)} was written by {op}, not by a copy: use "
                    "Tensor.copy_(src, non_blocking=True), the op StaticBatchLoader uses")
        if not nb:
            return (f"the copy into {_where(k, width)} is blocking: the exercise asks for "
                    "non_blocking=True (from pinned host memory the copy then overlaps "
                    "other work instead of stalling the host). Note that buf[:] = new is "
                    "a blocking copy too")
        if not on_side:
            return (f"the copy into {_where(k, width)} ran on another stream than the one "
                    "current when your function was called. Streams are not your job: "
                    "StaticBatchLoader calls you on its side stream, with the waits around "
                    "the call; copy on the current stream")
    return None


JUDGES = (_no_sync, _same_tensors, _contents, _the_copies)


def check_fill_static_buffers(fn, *, device: torch.device | str | None = None,
                              trials: int = 3) -> CheckResult:
    """``fn(buffers, microbatches)`` must copy ``microbatches[i]`` into ``buffers[i]`` in
    place, with ``copy_(..., non_blocking=True)``, on the stream current when it is called.

    ``buffers`` is a list with one ``(tokens, targets)`` tuple per microbatch; the
    microbatches have the same shapes and dtypes (their number and shapes are random per
    trial). The check keeps the buffer tensors that existed before the call (the ones a
    graph captured) and compares *their* contents with the microbatches. It calls ``fn``
    inside a side stream, as ``StaticBatchLoader.load`` does: streams are not ``fn``'s job.
    """
    if device is None:
        from labkit import backend

        device = backend.get("auto").device
    device = torch.device(device)
    return EXERCISE.check(_observe(fn, device), _observe(FS.fill_static_buffers, device),
                          _make_inputs(device), trials=trials, judges=JUDGES)
