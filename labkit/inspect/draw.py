"""A captured graph drawn with matplotlib alone: layers by topological generation, top to
bottom, parallel branches side by side. No graphviz needed, so every machine (and Colab)
draws it the same; :func:`labkit.inspect.to_dot` exports it for those who have graphviz."""

from __future__ import annotations

from labkit.core.validate import check_int
from labkit.inspect.dag import DAG

__all__ = ["draw", "layout"]

#: How each kind of node looks: face colour, edge colour, box style, line style.
STYLE = {
    "kernel": ("#dbe9f6", "#2b6cb0", "round,pad=0.04", "solid"),
    "memcpy": ("#fde2c4", "#c05621", "sawtooth,pad=0.04,tooth_size=0.06", "solid"),
    "memset": ("#d8f0d2", "#2f855a", "square,pad=0.04", "dashed"),
    "graph": ("#e2e2e2", "#4a4a4a", "round4,pad=0.04", "solid"),
    "other": ("#ffffff", "#888888", "round,pad=0.04", "dotted"),
}
_DX, _DY = 2.4, 1.0            # distance between node centres, across and down
_W, _H = 2.0, 0.46             # a node's box


def layout(dag: DAG) -> dict[int, tuple[float, float]]:
    """Node centres ``{index: (x, y)}``: generation ``k`` at ``y = -k``; within a
    generation, nodes ordered by where their parents are (then by capture order) and
    centred on ``x = 0``."""
    if not isinstance(dag, DAG):
        raise TypeError(f"layout takes a DAG (from captured_dag or parse_dot), got "
                        f"{type(dag).__name__}")
    pos: dict[int, tuple[float, float]] = {}
    for depth, layer in enumerate(dag.generations()):
        def key(i):
            xs = [pos[p][0] for p in dag.parents(i) if p in pos]
            return (sum(xs) / len(xs) if xs else 0.0, i)
        layer = sorted(layer, key=key)
        for k, i in enumerate(layer):
            pos[i] = ((k - (len(layer) - 1) / 2) * _DX, -depth * _DY)
    return pos


def _text(label: str, n: int = 34) -> str:
    """A node's label on at most two lines: ``kernel[Functor]`` splits before the functor;
    each line is cut to ``n`` characters."""
    lines = label.split("[", 1)
    lines = [lines[0], "[" + lines[1]] if len(lines) == 2 else lines
    return "\n".join(x if len(x) <= n else x[:n - 1] + "…" for x in lines)


def _subset(dag: DAG, keep: int) -> DAG:
    """The first ``keep`` nodes in capture order and the edges among them."""
    edges = tuple((a, b) for a, b in dag.edges if a < keep and b < keep)
    return DAG(dag.nodes[:keep], edges, source=dag.source, notes=dag.notes)


def draw(dag: DAG, ax=None, *, title: str | None = None, max_nodes: int = 80):
    """Draw ``dag``: kernels as blue boxes, memory copies orange (arrow-shaped), memsets
    green (dashed), child graphs grey; an arrow per dependency.

    Args:
        dag: what :func:`~labkit.inspect.captured_dag` (or ``parse_dot``) returned.
        ax: a matplotlib Axes to draw on; ``None`` makes a figure sized to the graph.
        title: the Axes title; default: where the DAG came from and what it holds.
        max_nodes: draw at most this many nodes, the first in capture order (the title
            says so when some are left out).

    Returns:
        The matplotlib Axes.
    """
    if not isinstance(dag, DAG):
        raise TypeError(f"draw takes a DAG (from labkit.inspect.captured_dag or parse_dot), "
                        f"got {type(dag).__name__}")
    check_int("max_nodes", max_nodes, 1)
    from matplotlib.patches import FancyBboxPatch, Patch

    shown = dag if len(dag) <= max_nodes else _subset(dag, max_nodes)
    pos = layout(shown)
    layers = shown.generations()
    width = max((len(layer) for layer in layers), default=1)
    if ax is None:
        import matplotlib.pyplot as plt

        _, ax = plt.subplots(figsize=(min(9.0, 1.2 + 2.6 * width),
                                      min(14.0, 0.9 + 0.5 * len(layers))))
    for i, (x, y) in pos.items():
        n = shown.nodes[i]
        face, edge, box, line = STYLE[n.kind]
        ax.add_patch(FancyBboxPatch((x - _W / 2, y - _H / 2), _W, _H, boxstyle=box,
                                    facecolor=face, edgecolor=edge, linestyle=line,
                                    linewidth=1.0, zorder=2))
        ax.text(x, y, _text(n.label), ha="center", va="center", fontsize=7, zorder=3,
                linespacing=1.0)
    for a, b in shown.edges:
        (xa, ya), (xb, yb) = pos[a], pos[b]
        bend = 0.0 if ya - yb <= _DY * 1.01 else (0.25 if xb >= xa else -0.25)
        ax.annotate("", xy=(xb, yb + _H / 2), xytext=(xa, ya - _H / 2), zorder=1,
                    arrowprops=dict(arrowstyle="-|>", color="#555555", lw=0.9,
                                    shrinkA=1, shrinkB=1,
                                    connectionstyle=f"arc3,rad={bend}"))
    xs = [x for x, _ in pos.values()] or [0.0]
    ax.set_xlim(min(xs) - _DX / 2, max(xs) + _DX / 2)
    ax.set_ylim(-(len(layers) - 1) * _DY - _DY * 0.6, _DY * 0.6)
    ax.set_axis_off()
    kinds = shown.counts()
    ax.legend(handles=[Patch(facecolor=STYLE[k][0], edgecolor=STYLE[k][1],
                             linestyle=STYLE[k][3], label=f"{k} ({v})")
                       for k, v in kinds.items()],
              loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7, frameon=False)
    if title is None:
        title = f"captured graph ({dag.source}): {len(dag)} nodes, {len(dag.edges)} edges"
        if shown is not dag:
            title += f"; the first {len(shown)} drawn"
    ax.set_title(title, fontsize=9)
    return ax
