"""torch.compile's CUDA graph trees, by hand and observed (lesson 08).

``torch.compile(mode="reduce-overhead")`` runs each compiled function through
``torch/_inductor/cudagraph_trees.py``: a warm-up call, a recording call, then replays,
with the non-static inputs copied into the graph's static buffers before each replay.

:class:`ReduceOverhead` is that life cycle for one function, written on ``B`` so that it
runs on the emulator too (the reference of lesson 08's first exercise, which keeps one
graph; this class keeps torch's sibling recordings, one per address of the static inputs).
:func:`call_kind`, :func:`tree_summary` and :class:`watch_skips` look at what torch itself
did: which kind of call just ran, what the tree holds, which "skipping cudagraphs due
to ..." verdicts were given. :func:`recording_sweep` measures the memory and time of one
recording per input shape (GPU only).

.. warning::
    :func:`call_kind` and :func:`tree_summary` read private state of torch's
    ``CUDAGraphTreeManager`` (its path state and node counters). They are for looking,
    in a lesson, at torch 2.11-2.13; never drive a program with them.
"""

from __future__ import annotations

import contextlib
import logging
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from labkit.backend import ensure
from labkit.capture import capture
from labkit.core.validate import check_int

__all__ = [
    "ReduceOverhead", "Recording",
    "call_kind", "tree_summary", "TreeSummary",
    "watch_skips", "SkipLog",
    "recording_sweep",
]


# ---- reduce-overhead for one function, by hand ----------------------------------------

@dataclass
class Recording:
    """One recorded graph of a :class:`ReduceOverhead` function (torch: a ``CUDAGraphNode``).

    ``buffers`` are the graph's inputs: each static input as the caller gave it, a copy of
    every other tensor argument; ``outputs`` what the capture returned (the graph's static
    outputs); ``static_ptrs`` the ``data_ptr()`` of each static input at recording.
    """

    graph: object
    buffers: list
    outputs: object
    static_ptrs: tuple

    def check_invariants(self, args, static: Sequence[int]) -> bool:
        """Can this recording run ``args``: is every static input at its recorded address?

        torch's ``CUDAGraphNode.check_invariants`` checks that, and more (the tree's own
        outputs at their addresses, the same tensors alive); a failure there is
        ``StaticInputIdxMismatch``.
        """
        return all(args[i].data_ptr() == p for i, p in zip(static, self.static_ptrs))


class ReduceOverhead:
    """One function under CUDA graph trees' life cycle: warm up, record, replay.

    ::

        f = ReduceOverhead(lambda w, x: x @ w, static=(0,), B=B)
        f(w, x1)     # call 1: runs eagerly (the warm-up)
        f(w, x2)     # call 2: records a graph on static copies of x, replays it
        f(w, x3)     # call 3 on: copies x3 into x's static buffer, replays
        f(w2, x4)    # w2 at another address: records a second graph, a sibling
        f(w, x5)     # w again: replays the first recording; nothing is recorded

    ``static`` lists the positions of the *static inputs*: parameters and buffers in
    torch (``static_input_idxs``), used at their own address and never copied. Every other
    tensor argument is copied into a static buffer of the graph before each replay
    (``CUDAGraphNode.run`` → ``_copy_inputs_and_remove_from_src`` in torch). Non-tensor
    arguments are baked in at recording, as in any capture. Tensor arguments live on
    ``B.device``: a graph records no host work (a ValueError names the input that is not).

    A function can hold several recordings, as torch's tree holds several *sibling*
    nodes of one function (``CUDAGraphTreeManager.roots[function_id]``, or a node's
    ``children[function_id]``): a call replays the first recording whose
    :meth:`Recording.check_invariants` holds (its static inputs at the recorded addresses),
    and records a new sibling when none does. So alternating two weight tensors records
    twice and then only replays, in torch as here. ``recordings`` lists them, in the order
    they were made; ``graph``, ``buffers`` and ``outputs`` are those of the recording that
    ran last.

    ``kinds`` lists what each call was: ``"warm-up"``, ``"record"``, ``"replay"``.

    .. warning::
        Nothing bounds the number of recordings: every new address of a static input
        records one more graph and keeps it. torch does the same: a re-recording for a
        static input at a new address (``StaticInputIdxMismatch``) is not counted against
        ``triton.cudagraph_unexpected_rerecord_limit`` (torch 2.11:
        ``exceed_rerecord_limit`` is always False under ``inline_inbuilt_nn_modules``; 2.13:
        that status is not counted), so a program that hands the function new parameter
        tensors grows the tree on every new address.

    .. warning::
        Each recording here keeps its own input copies and outputs alive (strong
        references, a private pool each); torch's siblings share the tree's one pool, and
        roots that run in different generations may reuse each other's memory. What a
        recording returns is its graph's static outputs: the next replay *of that
        recording* overwrites them in place. ``clone()`` what you keep, as with
        ``torch.compile(mode="reduce-overhead")``.
    """

    def __init__(self, fn: Callable, static: Sequence[int] = (), *, B=None):
        if not callable(fn):
            raise TypeError(f"ReduceOverhead(fn): fn must be callable, got {type(fn).__name__}.")
        self.fn = fn
        if isinstance(static, (str, bytes)) or not hasattr(static, "__iter__"):
            raise TypeError(f"ReduceOverhead: static must be a tuple of argument positions, "
                            f"e.g. static=(0,), got {static!r:.40} ({type(static).__name__})")
        self.static = tuple(static)
        for i in self.static:
            check_int("static index", i, 0)
        self.B = ensure(B)
        self.kinds: list[str] = []
        self.recordings: list[Recording] = []   # torch: the function's sibling nodes
        # the recording that ran last, and its graph, inputs and outputs
        self.current: Recording | None = None
        self.graph = None
        self.buffers: list = []
        self.outputs = None

    def __call__(self, *args):
        if max(self.static, default=-1) >= len(args):
            raise IndexError(
                f"ReduceOverhead: static={self.static} names input {max(self.static)}, but "
                f"the call passed {len(args)} argument(s). List positions of this call's "
                f"arguments.")
        self._check_static_are_tensors(args)
        self._check_devices(args)
        if not self.kinds:
            self.kinds.append("warm-up")
            return self.fn(*args)
        node = self._find(args)
        if node is None:
            self.kinds.append("record")
            node = self._record(args)
            self.recordings.append(node)
        else:
            self._check_recorded_signature(node, args)
            self.kinds.append("replay")
            self._copy_inputs(node, args)
        self.current = node
        self.graph, self.buffers, self.outputs = node.graph, node.buffers, node.outputs
        node.graph.replay()
        return node.outputs

    def _check_devices(self, args) -> None:
        # a graph records only the device's work: a host tensor's ops would run once, at
        # recording, and every replay would hand back that stale result (torch's trees
        # skip such a function: "skipping cudagraphs due to cpu device")
        for i, a in enumerate(args):
            if isinstance(a, torch.Tensor) and a.device != self.B.device:
                raise ValueError(
                    f"ReduceOverhead: input {i} is on {a.device}, but the graph records work "
                    f"on B.device ({self.B.device}) only: make it there "
                    f"(torch.randn(..., device=B.device)) or move it (t.to(B.device)).")

    def _check_static_are_tensors(self, args) -> None:
        for i in self.static:
            if not isinstance(args[i], torch.Tensor):
                raise TypeError(
                    f"ReduceOverhead: static={self.static} names input {i}, which is a "
                    f"{type(args[i]).__name__} ({args[i]!r:.40}), not a tensor: static lists "
                    f"the tensors used at their own address (parameters, buffers); leave "
                    f"{i} out of static.")

    def _check_recorded_signature(self, node, args) -> None:
        # A replay runs the recorded kernels on the recorded buffers: every argument must
        # be what the recording saw, else the copy broadcasts, casts or fails, and a
        # baked-in value is silently reused (torch.compile's guards would compile again).
        again = ("or use one ReduceOverhead per signature (torch.compile guards on it and "
                 "compiles, warms up and records again)")
        if len(args) != len(node.buffers):
            raise TypeError(f"ReduceOverhead: this call passes {len(args)} argument(s), the "
                            f"graph was recorded with {len(node.buffers)}: pass the same "
                            f"arguments every call, {again}.")
        for i, (a, rec) in enumerate(zip(args, node.buffers)):
            if isinstance(rec, torch.Tensor) != isinstance(a, torch.Tensor):
                raise TypeError(f"ReduceOverhead: input {i} is a {type(a).__name__}, the graph "
                                f"was recorded with a {type(rec).__name__} there: {again}.")
            if not isinstance(a, torch.Tensor):
                if not _same_value(a, rec):
                    raise ValueError(
                        f"ReduceOverhead: input {i} is {a!r:.40}, the graph was recorded with "
                        f"{rec!r:.40}: a recording bakes non-tensor arguments in, so a replay "
                        f"would compute with {rec!r:.40}. Pass the recorded value, make it a "
                        f"tensor (copied every call), {again}.")
                continue
            static = i in self.static
            for name, got, want in (("shape", tuple(a.shape), tuple(rec.shape)),
                                    ("dtype", a.dtype, rec.dtype),
                                    ("strides", a.stride() if static else None,
                                     rec.stride() if static else None)):
                if got == want:
                    continue
                why = ("the graph reads the tensor it recorded at this address, as recorded"
                       if static else "the copy into the graph's buffer would "
                       + ("broadcast or fail" if name == "shape" else "cast"))
                raise ValueError(
                    f"ReduceOverhead: {'static input' if static else 'input'} {i} has {name} "
                    f"{got}, the graph was recorded with {want}: a replay runs the recorded "
                    f"{name} ({why}). Pass {name} {want}, {again}.")

    def _is_copied(self, i: int, a) -> bool:
        return isinstance(a, torch.Tensor) and i not in self.static

    def _find(self, args) -> Recording | None:
        """The first recording whose invariants hold for ``args`` (torch's ``_run`` loop)."""
        return next((r for r in self.recordings if r.check_invariants(args, self.static)),
                    None)

    def _record(self, args) -> Recording:
        # the copied inputs get buffers of their own; static ones are the caller's tensors
        buffers = [a.detach().clone() if self._is_copied(i, a) else a
                   for i, a in enumerate(args)]
        with torch.no_grad():
            graph, outputs = capture(self.fn, *buffers, B=self.B, warmup=0)
        return Recording(graph, buffers, outputs,
                         tuple(args[i].data_ptr() for i in self.static))

    def _copy_inputs(self, node: Recording, args) -> None:
        with torch.no_grad():
            for i, (buf, a) in enumerate(zip(node.buffers, args)):
                if self._is_copied(i, a):
                    buf.copy_(a)


def _same_value(a, b) -> bool:
    """``a == b`` for a baked-in argument; False where equality cannot be shown (an ``==``
    that raises, or answers with an array of several truths)."""
    if a is b:
        return True
    try:
        return bool(a == b)
    except Exception:
        return False


# ---- looking at torch's own tree --------------------------------------------------------

def _manager(B):
    """The CUDA graph tree manager of B's device, or None (no GPU, or nothing recorded)."""
    if ensure(B).name != "cuda":
        return None
    from torch._inductor import cudagraph_trees
    return cudagraph_trees.get_manager(B.device.index or 0, create_if_none_exists=False)


def _peek(counter) -> int:
    """The next value of an ``itertools.count``, read from its repr without consuming it."""
    return int(re.match(r"count\((-?\d+)", repr(counter)).group(1))


@dataclass
class TreeSummary:
    """What a device's CUDA graph tree holds now."""

    graphs: int = 0           # graphs recorded so far (CUDAGraphNode objects made)
    warmups: int = 0          # warm-up runs so far (CUDAWarmupNode objects made)
    roots: int = 0            # recorded graphs that start a path
    depth: int = 0            # the longest path from a root, in graphs
    state: str = "NONE"       # the manager's path state after the last call
    generation: int = 0       # the manager's current generation
    mark_step_counter: int = 0

    def __str__(self) -> str:
        return (f"{self.graphs} graph(s) recorded ({self.roots} root(s), longest path "
                f"{self.depth}), {self.warmups} warm-up run(s), state {self.state}, "
                f"generation {self.generation}")


def tree_summary(B) -> TreeSummary:
    """Count the recorded graphs, warm-ups, roots and the deepest path of B's device."""
    from torch._inductor.cudagraph_trees import MarkStepBox

    m = _manager(B)
    if m is None:
        return TreeSummary(mark_step_counter=MarkStepBox.mark_step_counter)

    def depth(node) -> int:
        kids = [c for cs in node.children.values() for c in cs]
        return 1 + max((depth(c) for c in kids), default=0)

    roots = [n for ns in m.roots.values() for n in ns]
    return TreeSummary(graphs=_peek(m.graph_counter), warmups=-1 - _peek(m.warmup_node_counter),
                       roots=len(roots), depth=max((depth(r) for r in roots), default=0),
                       state=m.path_state.name, generation=m.current_gen,
                       mark_step_counter=MarkStepBox.mark_step_counter)


def call_kind(fn: Callable, *args, B=None):
    """Call ``fn(*args)`` and say what torch's tree did: ``(output, kind)``.

    ``kind`` is ``"warm-up"`` (a new warm-up node), ``"record"`` (a new graph), ``"replay"``
    (neither, and the tree is executing a graph) or ``"eager"`` (no graph ran: the
    function's graphs were skipped, or there is no GPU).

    .. warning::
        A heuristic read from the tree's counters and state: a skipped function called
        while another function's graph path is executing reads as ``"replay"``. It is
        right for one compiled function at a time, as the lesson uses it.
    """
    if not callable(fn):
        raise TypeError(f"call_kind(fn, *args): fn must be callable (the compiled function), "
                        f"got {type(fn).__name__}; call it as call_kind(fn, x, B=B)")
    B = ensure(B)
    before = tree_summary(B)
    out = fn(*args)
    after = tree_summary(B)
    if after.graphs > before.graphs:
        kind = "record"
    elif after.warmups > before.warmups:
        kind = "warm-up"
    elif after.state == "EXECUTION" and _manager(B) is not None:
        kind = "replay"
    else:
        kind = "eager"
    return out, kind


# ---- skip verdicts ----------------------------------------------------------------------

@dataclass
class SkipLog:
    """The skips seen inside :class:`watch_skips`: the counter's rise and the messages."""

    count: int = 0
    messages: list[str] = field(default_factory=list)


class _Collect(logging.Handler):
    def __init__(self, out: list[str]):
        super().__init__(logging.WARNING)
        self.out = out

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.getMessage()
        if "skipping cudagraph" in msg:
            self.out.append(msg)


class watch_skips:
    """Collect torch's cudagraph skip verdicts given inside the block, and keep them quiet.

    ``with watch_skips() as log:`` gives a :class:`SkipLog`: ``count`` is the rise of
    ``counters["inductor"]["cudagraph_skips"]`` (torch's own counter), ``messages`` the
    "skipping cudagraphs due to ..." lines torch logged
    (``log_cudagraph_skip_and_bump_counter``, through the ``cudagraphs`` log artifact of
    ``torch._inductor.cudagraph_utils``). Outside this block the same lines print as
    warnings, with or without ``TORCH_LOGS``.

    .. warning::
        Not every graph torch leaves ungraphed is counted: with graph partitioning on,
        ``cudagraph_partition_post_compile`` turns graphs off for its fail reasons without
        a log line or a count. Check the recorded graphs too (:func:`tree_summary`).
    """

    def __init__(self):
        self._block = None

    def __enter__(self) -> SkipLog:
        if self._block is not None:
            raise RuntimeError("watch_skips: this watch is already collecting; nest a new one "
                               "(with watch_skips() as inner: ...)")
        self._block = _watch_skips()
        return self._block.__enter__()

    def __exit__(self, *exc) -> bool | None:
        block, self._block = self._block, None
        return block.__exit__(*exc)

    def __getattr__(self, name: str):
        if name in ("count", "messages"):
            raise AttributeError(
                f"watch_skips() is the block that collects the skips, not their log: write "
                f"`with watch_skips() as log:` and read log.{name} after the block")
        raise AttributeError(f"'watch_skips' object has no attribute {name!r}")


@contextlib.contextmanager
def _watch_skips():
    """watch_skips' block: collect the verdicts into a SkipLog, restore the loggers after."""
    from torch._dynamo.utils import counters

    log = SkipLog()
    start = counters["inductor"]["cudagraph_skips"]
    handler = _Collect(log.messages)
    loggers = [logging.getLogger(name) for name in list(logging.root.manager.loggerDict)
               if name.startswith("torch._inductor")
               and name.endswith(("__perf_hints", "__cudagraphs"))]
    saved = [(lg, lg.propagate, lg.level) for lg in loggers]
    for lg in loggers:
        lg.addHandler(handler)
        lg.propagate = False            # the verdicts go to the SkipLog, not to stderr
        if lg.level == logging.NOTSET or lg.level > logging.WARNING:
            lg.setLevel(logging.WARNING)
    try:
        yield log
    finally:
        for lg, propagate, level in saved:
            lg.removeHandler(handler)
            lg.propagate, lg.level = propagate, level
        log.count = counters["inductor"]["cudagraph_skips"] - start


# ---- one recording per shape: what it costs ---------------------------------------------

def recording_sweep(make_fn: Callable[[], Callable], make_args: Callable[[int], tuple],
                    sizes: Sequence[int], B=None, *, calls: int = 3) -> list[dict]:
    """Memory and time of CUDA graph trees' recordings for a sweep of input sizes (GPU).

    ``make_fn()`` returns the compiled function (called once, before the sweep);
    ``make_args(n)`` the arguments for size ``n``. Each size is called ``calls`` times
    (warm-up, record, replay), in order. A row per size: the seconds of each call, what
    :func:`call_kind` saw, the bytes reserved in the tree's memory pool by then (every
    warm-up and recording allocates there) and the graphs recorded so far.
    """
    sizes = _check_sweep(make_fn, make_args, sizes, calls)
    B = ensure(B)
    if B.name != "cuda":
        raise RuntimeError(
            f"recording_sweep measures torch's CUDA graph trees, which need a GPU; this "
            f"backend is {B.name!r}. The lesson shows the H200's stored output instead.")
    fn = make_fn()
    if not callable(fn):
        raise TypeError(f"recording_sweep: make_fn() returned a {type(fn).__name__}, not the "
                        "compiled function: make_fn=lambda: torch.compile(f, "
                        "mode='reduce-overhead')")
    rows = []
    for n in sizes:
        args = _sweep_args(make_args, n)
        seconds, kinds = [], []
        for _ in range(calls):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            _, kind = call_kind(fn, *args, B=B)
            torch.cuda.synchronize()
            seconds.append(time.perf_counter() - t0)
            kinds.append(kind)
        m = _manager(B)
        pool = B.pool_stats(m.cuda_graphs_thread_pool)["reserved_bytes"] if m else 0
        rows.append({"size": n, "seconds": seconds, "kinds": kinds,
                     "pool_reserved_bytes": pool, "graphs": tree_summary(B).graphs})
    return rows


def _check_sweep(make_fn, make_args, sizes, calls) -> list[int]:
    """recording_sweep's arguments, checked before any GPU work; the sizes as a list."""
    for name, f, example in (("make_fn", make_fn, "lambda: torch.compile(f, mode=...)"),
                             ("make_args", make_args, "lambda n: (torch.randn(n, 64, "
                                                      "device=B.device),)")):
        if not callable(f):
            raise TypeError(f"recording_sweep: {name} must be a function, e.g. {example}; got "
                            f"{type(f).__name__}")
    if isinstance(sizes, (str, bytes)) or not hasattr(sizes, "__iter__"):
        raise TypeError(f"recording_sweep: sizes must be a list of input sizes, e.g. "
                        f"[1, 2, 4, 8], got {sizes!r:.40} ({type(sizes).__name__})")
    sizes = [check_int(f"recording_sweep: sizes[{i}]", n, 1) for i, n in enumerate(sizes)]
    if not sizes:
        raise ValueError("recording_sweep: sizes is empty: give the input sizes to record, "
                         "e.g. [1, 2, 4, 8]")
    check_int("recording_sweep: calls", calls, 1,
              fix="3 shows the warm-up, the recording and one replay")
    return sizes


def _sweep_args(make_args, n: int) -> tuple:
    """``make_args(n)``, which must be the call's arguments as a tuple (or a list)."""
    args = make_args(n)
    if not isinstance(args, (tuple, list)):
        raise TypeError(f"recording_sweep: make_args({n}) returned a {type(args).__name__}; "
                        "return the arguments as a tuple, e.g. lambda n: (x_of_size(n),) "
                        "(a tensor would be unpacked row by row into arguments)")
    return tuple(args)
