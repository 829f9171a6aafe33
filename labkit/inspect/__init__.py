"""Seeing what was captured: a graph's kernels, copies and dependencies, drawn as a DAG.

The engine of lesson 10's "what did capture record?", used in lessons 02, 05 and 06::

    from labkit.inspect import captured_dag, draw, inspectable_graph, to_dot

    g = inspectable_graph(B)          # decide before capture: a graph that keeps its DAG
    with B.graph(g):
        y = model(x)
    dag = captured_dag(g, B)          # nodes (kernel / memcpy / memset), edges (waits for)
    print(dag.describe())
    draw(dag)                         # matplotlib: layers top to bottom, branches side by side
    print(to_dot(dag))                # Graphviz DOT, for those who have graphviz

On a GPU the DAG is CUDA's own (``CUDAGraph.debug_dump``, i.e. ``cudaGraphDebugDotPrint``);
on the emulator it is the emulator's record (ATen ops and the streams' order). Same
picture style on both. :func:`fork_join` captures work forked onto a second stream and
joined back (two parallel branches), or not joined (CUDA's capture error).
"""

from labkit.inspect.dag import DAG, KINDS, Node
from labkit.inspect.dot import parse_dot, short_symbol, to_dot
from labkit.inspect.draw import draw, layout
from labkit.inspect.graphs import captured_dag, fork_join, inspectable_graph

__all__ = ["DAG", "Node", "KINDS", "inspectable_graph", "captured_dag", "fork_join",
           "parse_dot", "to_dot", "short_symbol", "draw", "layout"]
