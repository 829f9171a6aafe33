"""What a captured graph is: nodes (kernels, memory copies, memsets) and dependency edges.

One small data structure for both backends, so that a GPU's graph (read from CUDA's own
description of it) and the emulator's (read from its record) are drawn, compared and
exported the same way.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

__all__ = ["KINDS", "Node", "DAG"]

#: What a node does. ``graph``: a child graph (or a graph replayed inside the capture);
#: ``other``: any other CUDA node type (host callback, event, empty, memory alloc/free...),
#: named in the node's label.
KINDS = ("kernel", "memcpy", "memset", "graph", "other")


@dataclass(frozen=True)
class Node:
    """One node of a captured graph.

    Args:
        index: its position in capture order (0 is the first node captured).
        kind: one of :data:`KINDS`.
        name: the full name: a CUDA kernel's symbol, or the emulator's ATen op
            (``aten.addmm.default``).
        label: a short name to draw (``addmm``, ``vectorized_elementwise_kernel[...]``).
        detail: what else CUDA said about it, e.g. the launch configuration
            ``<<<1,128,0>>>`` or a copy's direction and size; empty if nothing.
    """

    index: int
    kind: str
    name: str
    label: str
    detail: str = ""

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"Node.kind must be one of {', '.join(KINDS)}, got {self.kind!r}")


@dataclass(frozen=True)
class DAG:
    """A captured graph: its nodes in capture order and its dependency edges.

    An edge ``(a, b)`` means node ``b`` starts only after node ``a`` finished: on one
    stream each node depends on the one before it; a fork (``side.wait_stream(s)``) gives
    a node two children, a join (``s.wait_stream(side)``) a node two parents. Nodes with
    no path between them may run at the same time on a GPU.

    Args:
        nodes: the nodes, ``nodes[i].index == i``.
        edges: ``(parent, child)`` index pairs.
        source: where it was read from: ``"cuda"`` (torch's ``debug_dump``),
            ``"emulated"`` (the emulator's record) or ``"dot"`` (a DOT text).
        notes: what the reader left out and why (e.g. the inside of child graphs).

    Raises:
        ValueError: an edge names a node that is not there, or the edges form a cycle.
    """

    nodes: tuple[Node, ...]
    edges: tuple[tuple[int, int], ...]
    source: str = "dot"
    notes: tuple[str, ...] = field(default=())

    def __post_init__(self):
        object.__setattr__(self, "nodes", tuple(self.nodes))
        object.__setattr__(self, "edges", tuple(sorted({(int(a), int(b)) for a, b in self.edges})))
        object.__setattr__(self, "notes", tuple(self.notes))
        for i, n in enumerate(self.nodes):
            if not isinstance(n, Node) or n.index != i:
                raise ValueError(f"DAG.nodes[{i}] must be a Node with index {i}, got {n!r:.80}")
        for a, b in self.edges:
            if not (0 <= a < len(self.nodes) and 0 <= b < len(self.nodes)) or a == b:
                raise ValueError(f"DAG edge {(a, b)} does not join two different nodes of "
                                 f"0..{len(self.nodes) - 1}")
        self.generations()        # raises on a cycle

    # ---- structure --------------------------------------------------------------------
    def parents(self, i: int) -> list[int]:
        """The nodes node ``i`` waits for."""
        return [a for a, b in self.edges if b == i]

    def children(self, i: int) -> list[int]:
        """The nodes that wait for node ``i``."""
        return [b for a, b in self.edges if a == i]

    def generations(self) -> list[list[int]]:
        """Nodes layered by topological generation: layer 0 holds the nodes with no parent,
        layer ``k`` those whose longest chain of ancestors is ``k`` long. Nodes in one layer
        never depend on each other: they are the graph's parallel branches."""
        level = [0] * len(self.nodes)
        indegree = [0] * len(self.nodes)
        kids: list[list[int]] = [[] for _ in self.nodes]
        for a, b in self.edges:
            indegree[b] += 1
            kids[a].append(b)
        ready = [i for i, d in enumerate(indegree) if d == 0]
        done = 0
        while ready:
            i = ready.pop()
            done += 1
            for k in kids[i]:
                level[k] = max(level[k], level[i] + 1)
                indegree[k] -= 1
                if indegree[k] == 0:
                    ready.append(k)
        if done != len(self.nodes):
            stuck = [i for i, d in enumerate(indegree) if d > 0]
            raise ValueError(f"the edges form a cycle (nodes {stuck[:8]} never become ready): "
                             "a captured graph is acyclic, so these edges were not read "
                             "from one")
        layers: list[list[int]] = [[] for _ in range(max(level, default=-1) + 1)]
        for i, lv in enumerate(level):
            layers[lv].append(i)
        return layers

    @property
    def width(self) -> int:
        """The most nodes in one generation: 1 for a single chain (one stream)."""
        return max((len(layer) for layer in self.generations()), default=0)

    def counts(self) -> dict[str, int]:
        """How many nodes of each kind, in :data:`KINDS` order (kinds absent are left out)."""
        c = Counter(n.kind for n in self.nodes)
        return {k: c[k] for k in KINDS if c[k]}

    def describe(self) -> str:
        """One line: nodes by kind, edges, generations, the widest generation."""
        kinds = ", ".join(f"{v} {k}{'s' if v != 1 and k != 'other' else ''}"
                          for k, v in self.counts().items()) or "empty"
        shape = ("one chain" if self.width <= 1 else
                 f"up to {self.width} nodes side by side")
        text = (f"{len(self.nodes)} nodes ({kinds}), {len(self.edges)} edges, "
                f"{len(self.generations())} generations: {shape}")
        return text + "".join(f"; {n}" for n in self.notes)

    def __len__(self) -> int:
        return len(self.nodes)

    def __repr__(self) -> str:
        return f"<DAG from {self.source}: {self.describe()}>"
