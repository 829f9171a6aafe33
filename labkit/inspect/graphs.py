"""Read a captured graph's DAG on either backend, and a fork/join capture to read.

On a GPU the DAG comes from CUDA itself: ``torch.cuda.CUDAGraph.debug_dump(path)`` writes
the graph as ``cudaGraphDebugDotPrint`` describes it (:mod:`labkit.inspect.dot` reads it).
It can do that only while torch still holds the graph's ``cudaGraph_t``: a graph made with
``keep_graph=True`` keeps it after capture. On the emulator the DAG comes from its record:
the ATen op of every recorded step, and the steps it waits for (the step before it on its
stream, plus the last step of every stream it joined with ``wait_stream`` or an event).
Either way, decide *before* capturing: :func:`inspectable_graph` makes a graph that keeps
what :func:`captured_dag` reads.
"""

from __future__ import annotations

import os
import tempfile
import warnings
from pathlib import Path

import torch

from labkit import backend
from labkit.backend import ensure
from labkit.core.validate import check_int
from labkit.inspect.dag import DAG, Node
from labkit.inspect.dot import parse_dot

__all__ = ["inspectable_graph", "captured_dag", "fork_join"]

#: The emulator's ATen ops that move bytes between memories: a memcpy node on a GPU.
_COPY_OPS = ("aten.copy_.", "aten._to_copy.", "aten._copy_from.")

_MAKE_ONE = ("create the graph with labkit.inspect.inspectable_graph(B) before capturing "
             "(on a GPU that is torch.cuda.CUDAGraph(keep_graph=True)), then capture into it")

def inspectable_graph(B=None):
    """A new, empty ``B.CUDAGraph`` that :func:`captured_dag` can read once it is captured.

    * cuda: ``torch.cuda.CUDAGraph(keep_graph=True)``: torch keeps the graph's
      ``cudaGraph_t`` after capture, so ``debug_dump`` can print it (as often as asked).
      It instantiates the graph at its first ``replay()`` (or ``g.instantiate()``) instead
      of at the end of capture. An older torch, without ``keep_graph``, gets
      ``enable_debug_mode()`` instead, which kept the ``cudaGraph_t`` there (for one
      ``debug_dump``).
    * emulated: the emulator's ``CUDAGraph(keep_graph=True)``, which keeps each recorded
      op's dependencies (which ops it waits for) after capture
      (:meth:`~labkit.emulator.graph.CUDAGraph.recorded_dependencies`).

    Capture into it as into any graph (``with B.graph(g): ...``); it replays the same.

    .. warning::
        Only a graph made this way can be drawn: on a GPU a plain ``B.CUDAGraph()`` drops
        its ``cudaGraph_t`` when capture ends (only the executable graph stays), so there
        is nothing left to describe. The emulator refuses plain graphs too, so that code
        written on a CPU works on a GPU.
    """
    B = ensure(B)
    try:
        return B.CUDAGraph(keep_graph=True)
    except TypeError:                      # an older torch: no keep_graph
        g = B.CUDAGraph()
        g.enable_debug_mode()
        return g


def _check_graph(g, B) -> None:
    if not isinstance(g, B.CUDAGraph):
        raise TypeError(f"captured_dag needs a captured {B.name} B.CUDAGraph (one made by "
                        f"inspectable_graph(B)), got {type(g).__name__} {g!r:.60}")


def _emulated_dag(g) -> DAG:
    if not g.keep_graph:
        raise RuntimeError("captured_dag: this emulated graph did not keep its dependencies "
                           f"(it is a plain B.CUDAGraph()): {_MAKE_ONE}")
    try:
        deps = g.recorded_dependencies()
    except RuntimeError as e:
        raise RuntimeError(f"captured_dag: {e}") from None
    ops = g.recorded_ops()
    if len(ops) != len(deps):
        raise RuntimeError(f"captured_dag: the emulator recorded {len(ops)} ops but "
                           f"{len(deps)} dependency lists: labkit.inspect and "
                           "labkit.emulator are out of step, report it")
    nodes = []
    for i, op in enumerate(ops):
        if op.startswith("<graph replay"):
            nodes.append(Node(i, "graph", op, "graph replay", op.strip("<>").split(": ")[-1]))
            continue
        kind = "memcpy" if op.startswith(_COPY_OPS) else "kernel"
        short = op.split(".")[1] if op.count(".") >= 2 else op
        nodes.append(Node(i, kind, op, short))
    edges = [(p, i) for i, ps in enumerate(deps) for p in ps]
    return DAG(tuple(nodes), tuple(edges), source="emulated")


def _cuda_dag(g) -> DAG:
    with tempfile.TemporaryDirectory(prefix="labkit-inspect-") as tmp:
        path = Path(tmp) / "graph.dot"
        with warnings.catch_warnings():
            # debug_dump announces itself with TORCH_WARN ("DEBUG: calling debug_dump()")
            warnings.simplefilter("ignore")
            g.debug_dump(os.fspath(path))
        text = path.read_text() if path.exists() else ""
    if not text.strip():
        raise RuntimeError(
            "captured_dag: torch's debug_dump wrote nothing for this graph: it holds no "
            "cudaGraph_t. Either it was never captured (or its capture failed, or it was "
            "reset), or it is a plain CUDAGraph, which drops its cudaGraph_t when capture "
            "ends (with enable_debug_mode() and no keep_graph, older torch printed a graph "
            f"once, then dropped it): {_MAKE_ONE}")
    return parse_dot(text, source="cuda")


def captured_dag(g, B=None) -> DAG:
    """The DAG that graph ``g`` captured: its kernels, memory copies and memsets, and
    which of them waits for which.

    Args:
        g: a graph made by :func:`inspectable_graph` and captured.
        B: the backend ``g`` belongs to (default: ``labkit.backend.get("auto")``).

    Returns:
        A :class:`~labkit.inspect.DAG`, nodes in capture order. On a GPU: CUDA's own nodes,
        kernel names shortened (the full symbol in ``Node.name``). On the emulator: one node
        per recorded ATen op (``aten.copy_`` drawn as a memcpy), so names and counts differ
        from a GPU's (one op may launch several kernels, or a memset); the dependencies
        follow the same stream rules.

    Raises:
        TypeError: ``g`` is not a ``B.CUDAGraph``.
        RuntimeError: ``g`` was not captured, or was not made by :func:`inspectable_graph`.
    """
    B = ensure(B)
    _check_graph(g, B)
    return _emulated_dag(g) if B.is_emulated else _cuda_dag(g)


def fork_join(B=None, *, join: bool = True, n: int = 8):
    """Capture a small fork/join into an inspectable graph: one op, then two independent
    ops on two streams, then one op that reads both.

    ::

        a = x + 1                           capturing stream
        side.wait_stream(capturing)         fork: the side stream joins the capture
        b = a * 2   (on side)   c = a - 1   two branches, parallel on a GPU
        capturing.wait_stream(side)         join (left out when join=False)
        d = b + c

    Args:
        B: the backend.
        join: False leaves the side stream's work unjoined: capture then fails at its end
            with CUDA's "capturing stream has unjoined work", on both backends.
        n: the length of the vectors.

    Returns:
        ``(g, x, d)``: the captured graph, its static input and its static output
        (``d == 3 * x + 2`` after a replay).

    Raises:
        RuntimeError: ``join=False``: the capture error, after :func:`labkit.backend.recover`
        put the default stream back and took the generator out of capture mode.
    """
    B = ensure(B)
    if not isinstance(join, bool):
        raise TypeError(f"join must be True or False, got {join!r:.40}")
    check_int("n (the length of the vectors)", n, 1)
    x = torch.arange(float(n), device=B.device)
    # high priority: torch hands out pooled streams round-robin, so a second stream of the
    # default priority could be torch's capture stream itself
    side = B.Stream(priority=-1)

    def body():
        a = x + 1
        side.wait_stream(B.current_stream())          # fork
        with B.stream(side):
            b = a * 2
        c = a - 1
        if join:
            B.current_stream().wait_stream(side)      # join
        return b + c

    warm = B.Stream()                                  # warm up eagerly, off the default
    warm.wait_stream(B.current_stream())
    with B.stream(warm):
        body()
    B.current_stream().wait_stream(warm)
    B.current_stream().wait_stream(side)
    g = inspectable_graph(B)
    try:
        with B.graph(g):
            d = body()
    except RuntimeError:
        backend.recover(B)
        raise
    return g, x, d
