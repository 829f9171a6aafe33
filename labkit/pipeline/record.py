"""The global execution record: step 1 runs eagerly and writes down the real order in
which every runner's forward and backward ran; graphs are then created in exactly that
order, in one shared pool (lesson 05).

Why the order: graphs that share a memory pool hand memory to each other. A block that
one graph's capture used and Python then freed (a saved activation, after the backward
graph that reads it was captured) is reused by the *next* capture in the pool. That is
safe only if, at replay time, the next graph also runs *after* the first one is done
with the block, i.e. if graphs replay in the order they were captured. The only order
known to be the replay order is the one step 1 actually ran, so Megatron records it
(``_CudagraphGlobalRecord``, ``megatron/core/transformer/cuda_graphs.py``) and
replays its creation (``create_cudagraphs``, called at the end of the schedule
function, ``schedules.py``).

The backward half of the order is caught by :class:`RecordNode`, a no-op
``autograd.Function`` put on each recorded output (Megatron's ``_CudagraphRecordNode``):
autograd calls its ``backward`` exactly when the backward pass reaches that layer, and it
appends ``(runner, "bwd")`` then.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from labkit.backend import ensure
from labkit.bridge import ArgMeta, GraphOrderError, GraphRunner, GraphStatus

__all__ = ["GlobalRecord", "RecordNode", "RunnerRecord", "reorder", "ORDERS"]


@dataclass(eq=False)
class RunnerRecord:
    """What step 1 recorded about one runner of a layer (Megatron keeps the two flags on
    ``_CudaGraphRunner`` as ``fwd_graph_recorded`` and ``bwd_graph_recorded``).

    Args:
        runner: the graph pair, created later from this record.
        index: its place among the layer's runners in creation order (``#index`` in its name).
        arg_metas: the arguments of its first forward, once recorded.
        fwd_recorded, bwd_recorded: whether its forward / backward is in the global record.
    """

    runner: GraphRunner
    index: int
    arg_metas: list[ArgMeta] | None = None
    fwd_recorded: bool = False
    bwd_recorded: bool = False


class GlobalRecord:
    """The ordered list of graph creations, and whether graphs exist yet.

    Megatron keeps one per process as class attributes; labkit makes it an object so
    that one notebook can run several experiments side by side. Entries are
    ``(runner, "fwd", arg_metas)`` and ``(runner, "bwd")``.
    """

    def __init__(self):
        self.entries: list[tuple] = []
        self.created = False
        self.pools: list = []          # the pool handles the graphs were created in
        # (P, M, schedule) of the step that recorded (set by train_step): later steps must
        # replay the graphs in the same order, so they must run the same step shape
        self.step_signature: tuple | None = None

    def record_fwd(self, runner: GraphRunner, arg_metas: list[ArgMeta]) -> None:
        self.entries.append((runner, "fwd", arg_metas))

    def record_bwd(self, runner: GraphRunner) -> None:
        self.entries.append((runner, "bwd"))

    def describe(self) -> list[str]:
        """``["fwd layer0#0", "fwd layer1#0", "bwd layer1#0", ...]``: runner names."""
        return [f"{e[1]} {e[0].name}" for e in self.entries]

    def create_cudagraphs(self, B, *, order: str | Callable = "recorded", pool="shared",
                          create: Callable | None = None) -> list[tuple]:
        """Create every recorded graph, then mark the record created (replay from now on).

        ``order``: ``"recorded"`` (Megatron, correct), or one of the wrong orders of
        :func:`reorder` to see what goes wrong, or a function ``entries -> entries``.
        ``pool``: ``"shared"`` (one pool for all graphs, Megatron's ``global_mempool``)
        or ``"per_graph"`` (a fresh pool for every graph: safe in any order, costs
        memory). ``create(entries)`` replaces the loop that creates the graphs (the
        exercise). Every runner is warmed up first (:meth:`GraphRunner.warmup`), so no
        eager work falls between two captures into the pool. Returns the entries in the
        order used.
        """
        if self.created:
            if self.entries:
                raise RuntimeError("runners asked for graphs after the graphs were created")
            return []
        _check_create_args(B, pool, create)
        if not self.entries:
            raise ValueError(
                "create_cudagraphs: nothing was recorded, so there are no graphs to create. "
                "Step 1 must run the layers wrapped in CudaGraphManager (graph_layers(layers, "
                "B, record, ...)) sharing this record, before create_cudagraphs.")
        entries = reorder(self.entries, order) if not callable(order) else order(
            list(self.entries))
        for e in self.entries:        # every warm-up before the pool's first capture
            if e[1] == "fwd":
                e[0].warmup(e[2])
        if pool == "shared":
            shared = B.graph_pool_handle()
            self.pools = [shared]
            for e in entries:
                e[0].pool = shared
            (create or create_in_order)(entries)
        elif pool == "per_graph":
            self.pools = []
            for e in entries:                 # a new pool for each graph as it is created
                e[0].pool = B.graph_pool_handle()
                self.pools.append(e[0].pool)
                (create or create_in_order)([e])
        self.created = True
        self.entries = []
        return entries

    def pool_bytes(self, B) -> dict:
        """Reserved / allocated bytes summed over the pools the graphs live in."""
        tot = {"reserved_bytes": 0, "allocated_bytes": 0, "pools": len(self.pools)}
        for h in self.pools:
            st = B.pool_stats(h)
            tot["reserved_bytes"] += st["reserved_bytes"]
            tot["allocated_bytes"] += st["allocated_bytes"]
        return tot


POOLS = ("shared", "per_graph")


def _check_create_args(B, pool, create) -> None:
    ensure(B)
    if pool not in POOLS:
        raise ValueError(f"create_cudagraphs: unknown pool {pool!r}: choose one of "
                         f"{', '.join(map(repr, POOLS))} (this chooses the policy; a pool "
                         f"handle is not accepted here)")
    if create is not None and not callable(create):
        raise TypeError(f"create must be a function entries -> None, got "
                        f"{type(create).__name__}")


def create_in_order(entries: list[tuple]) -> None:
    """Create each entry's graph, in the given order (the reference for the exercise)."""
    for entry in entries:
        runner, kind = entry[0], entry[1]
        if kind == "fwd":
            runner.create_fwd_graph(entry[2])
        else:
            runner.create_bwd_graph()


ORDERS = ("recorded", "grouped", "torch")


def reorder(entries: list[tuple], how: str) -> list[tuple]:
    """The record's entries in another creation order, to show why only one is right.

    * ``"recorded"``: as step 1 ran them (Megatron);
    * ``"grouped"``: each runner's forward then at once its backward, runner by runner
      (what "graph each layer on its own" does);
    * ``"torch"``: all forwards in recorded order, then all backwards in reverse
      forward order (``torch.cuda.make_graphed_callables``'s order, right for a model
      whose microbatches do not interleave).
    """
    if how not in ORDERS:
        raise ValueError(f"unknown order {how!r}: choose one of {', '.join(map(repr, ORDERS))}, "
                         f"or pass a function entries -> entries")
    if how == "recorded":
        return list(entries)
    fwds = [e for e in entries if e[1] == "fwd"]
    bwd_of = {id(e[0]): e for e in entries if e[1] == "bwd"}
    if how == "grouped":
        out = []
        for f in fwds:
            out.append(f)
            if id(f[0]) in bwd_of:
                out.append(bwd_of[id(f[0])])
        return out
    if how == "torch":
        return fwds + [bwd_of[id(f[0])] for f in reversed(fwds) if id(f[0]) in bwd_of]
    raise ValueError(f"unknown order {how!r}: choose one of {', '.join(map(repr, ORDERS))}, "
                     f"or pass a function entries -> entries")


class RecordNode(torch.autograd.Function):
    """Identity on a layer's differentiable outputs whose backward records the layer's
    backward into the global record (Megatron's ``_CudagraphRecordNode``).

    Step 1 is eager: the layer's own autograd graph computes the gradients; this node
    only notices *when* they pass, and keeps the runner's status machine honest.
    """

    @staticmethod
    def forward(ctx, state: RunnerRecord, record: GlobalRecord, *outs):
        if state.runner.status != GraphStatus.FWD_READY:
            raise GraphOrderError(f"{state.runner.name}: forward called again before its "
                                  "backward")
        ctx.state, ctx.record = state, record
        return outs if len(outs) > 1 else outs[0]

    @staticmethod
    def backward(ctx, *grads):
        state = ctx.state
        runner = state.runner
        if runner.status != GraphStatus.BWD_READY:
            raise GraphOrderError(f"{runner.name}: backward reached twice for one forward")
        runner.status = GraphStatus.FWD_READY
        if not state.bwd_recorded:
            ctx.record.record_bwd(runner)
            state.bwd_recorded = True
        return (None, None, *grads)
