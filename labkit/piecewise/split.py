"""Cut a model's graph at its attention calls: the pieces that piecewise CUDA graphs capture.

vLLM does this in ``split_graph`` (``vllm/compilation/backends.py``): walk the FX graph,
give every *splitting op* (the attention op) a subgraph of its own and every run of
nodes between two of them one subgraph, then hand the labels to torch's
``torch.fx.passes.split_module.split_module`` with ``keep_original_order=True`` (the
graph has in-place writes, so nodes must not be reordered). The result is a top-level
``GraphModule`` that calls ``submod_0, submod_1, ...`` in order, each a ``GraphModule`` of
its own.

vLLM gets its graph from Dynamo (a custom ``torch.compile`` backend); here the model is
traced with ``torch.fx.symbolic_trace``: the lesson's model is plain Python, the trace
takes milliseconds, and the code of every piece can be printed and read. The attention op
is :func:`labkit.decode.model.attend`, kept one node by ``torch.fx.wrap``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx
from torch.fx.passes.split_module import split_module

from labkit.decode.model import attend

__all__ = ["SplitItem", "SplitModel", "split_labels", "split_graph", "split_at_attention"]


@dataclass
class SplitItem:
    """One piece of a split graph (vLLM's ``SplitItem``)."""

    submod_name: str        # "submod_3": the attribute of the split module that runs it
    graph_id: int           # its position in the model, 0 first
    is_splitting_graph: bool  # True: an attention call, run eagerly between the pieces
    graph: fx.GraphModule


@dataclass
class SplitModel:
    """A traced model cut at its attention calls.

    split_gm   the top-level module: ``split_gm(input_ids, positions, batch)`` runs the
               pieces in order and equals ``model(input_ids, positions, batch)``
    items      one :class:`SplitItem` per piece, in order
    """

    split_gm: fx.GraphModule
    items: list[SplitItem]

    @property
    def pieces(self) -> list[SplitItem]:
        """The pieces a CUDA graph can hold: every item that is not an attention call."""
        return [it for it in self.items if not it.is_splitting_graph]

    @property
    def attention(self) -> list[SplitItem]:
        return [it for it in self.items if it.is_splitting_graph]

    def describe(self) -> str:
        """One line per item: its name, what it is and how many FX nodes it holds."""
        lines = []
        for it in self.items:
            ops = [n for n in it.graph.graph.nodes if n.op not in ("placeholder", "output")]
            if it.is_splitting_graph:
                calls = [n for n in ops if n.op == "call_function"]
                kind = f"{_op_name(calls[-1])} (eager)"
            else:
                kind = "piece (graphed)"
            lines.append(f"{it.submod_name:<10} {kind:<22} {len(ops):>3} nodes")
        return "\n".join(lines)


def _op_name(node: fx.Node) -> str:
    return getattr(node.target, "__name__", str(node.target))


def _is_splitting_op(node: fx.Node, ops) -> bool:
    return node.op == "call_function" and node.target in ops


def _check_ops(ops, fn: str, name: str = "ops") -> tuple:
    """``ops`` as a tuple of functions, or an error naming what was given."""
    if callable(ops):
        given = getattr(ops, "__name__", repr(ops)[:40])
        raise TypeError(f"{fn}: {name} must be a tuple of functions, got "
                        f"{type(ops).__name__} {given}: pass ({given},) for one op, or "
                        "(attend, other_op) for several")
    if isinstance(ops, (str, bytes)) or not hasattr(ops, "__iter__"):
        raise TypeError(f"{fn}: {name} must be a tuple of functions, got "
                        f"{type(ops).__name__} {ops!r:.40}: pass the ops themselves, e.g. "
                        "(attend,) with attend from labkit.decode.model")
    ops = tuple(ops)
    bad = [op for op in ops if not callable(op)]
    if bad:
        raise TypeError(f"{fn}: every entry of {name} must be a function (the op itself, "
                        f"e.g. labkit.decode.model.attend), got {bad[0]!r:.40} "
                        f"({type(bad[0]).__name__})")
    return ops


def _check_graph_module(gm, fn: str) -> None:
    if not isinstance(gm, fx.GraphModule):
        raise TypeError(f"{fn}: gm must be a torch.fx.GraphModule, got {type(gm).__name__}: "
                        "trace the model first (torch.fx.symbolic_trace(model)), or call "
                        "split_at_attention(model)")


def split_labels(gm: fx.GraphModule, ops=(attend,)) -> dict[fx.Node, int]:
    """The subgraph id of every node of ``gm``, cut at every call of one of ``ops`` (the
    labelling of vLLM's ``split_graph``).

    Every splitting op gets an id of its own; the nodes between two of them share one.
    Placeholders, the output and ``get_attr`` nodes get no label: ``split_module`` asks for
    none (it hands every piece the modules and tensors it reads).
    """
    _check_graph_module(gm, "split_labels")
    ops = _check_ops(ops, "split_labels")
    subgraph_id = 0
    labels: dict[fx.Node, int] = {}
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output", "get_attr"):
            continue
        if _is_splitting_op(node, ops):
            subgraph_id += 1
            labels[node] = subgraph_id
            subgraph_id += 1
        else:
            labels[node] = subgraph_id
    return labels


def split_graph(gm: fx.GraphModule, ops=(attend,)) -> SplitModel:
    """Split ``gm`` at every call of one of ``ops`` (:func:`split_labels`), then build one
    ``GraphModule`` per id with torch's ``split_module``: vLLM's ``split_graph``."""
    _check_graph_module(gm, "split_graph")
    ops = _check_ops(ops, "split_graph")
    labels = split_labels(gm, ops)
    splitting = {labels[n] for n in labels if _is_splitting_op(n, ops)}
    # keep_original_order: the pieces write in place (rotary embeddings, the KV cache), so
    # their nodes must run in the order the model wrote them.
    split_gm = split_module(gm, None, lambda node: labels[node], keep_original_order=True)
    items = []
    for name, module in split_gm.named_children():
        if not name.startswith("submod_"):
            continue   # a module the pieces read (copied in by split_module), not a piece
        graph_id = int(name.removeprefix("submod_"))
        items.append(SplitItem(name, graph_id, graph_id in splitting, module))
    items.sort(key=lambda it: it.graph_id)   # by integer id: submod_10 after submod_9
    return SplitModel(split_gm, items)


def split_at_attention(model: torch.nn.Module, splitting_ops=(attend,)) -> SplitModel:
    """Trace ``model`` (a :class:`labkit.decode.model.Transformer`) with
    ``torch.fx.symbolic_trace`` and cut it at every call of ``splitting_ops``: the
    attention op, and any other op whose work depends on the requests (vLLM lists its
    Mamba mixers and short convolutions beside attention in ``splitting_ops``).

    Raises ``ValueError`` when a piece still reads the batch: an op that looks at the
    requests (their lengths, their slots) would be captured with the capture batch's
    requests and replayed with them for every batch. Add it to ``splitting_ops`` (and
    ``torch.fx.wrap`` it, so the trace keeps it one node).

    .. warning::
        The trace runs the model's Python once with placeholder values: checks that read
        a batch's *values* are not in the traced graph. Run batches through
        :class:`~labkit.piecewise.PiecewiseGraphRunner`, which checks them first.
    """
    if not hasattr(model, "layers") or not hasattr(model, "req_to_token"):
        raise TypeError("split_at_attention: model must be a labkit.decode Transformer with "
                        f"caches set up (build_model(...)), got {type(model).__name__}")
    ops = _check_ops(splitting_ops, "split_at_attention", "splitting_ops")
    if attend not in ops:
        raise ValueError(f"split_at_attention: splitting_ops must be functions and include "
                         f"labkit.decode.model.attend, got {ops!r:.120}: attention is the op "
                         "every piece is cut at; pass (attend, *your_ops)")
    gm = fx.symbolic_trace(model)
    split = split_graph(gm, ops)
    n_attn = sum(1 for n in gm.graph.nodes if n.op == "call_function" and n.target is attend)
    if n_attn != len(model.layers):
        raise RuntimeError(f"split_at_attention: found {n_attn} attention calls in the trace "
                           f"of a model with {len(model.layers)} layers; every layer must call "
                           "labkit.decode.model.attend exactly once")
    for it in split.pieces:
        readers = [n for n in it.graph.graph.nodes
                   if n.op != "placeholder" and any(getattr(a, "name", None) == "batch"
                                                    for a in n.all_input_nodes)]
        if readers:
            n = readers[0]
            what = f"{_op_name(n)}(...)" if n.op == "call_function" else n.format_node()
            raise ValueError(
                f"split_at_attention: piece {it.submod_name} reads the batch ({what}): an op "
                "that depends on the requests cannot be captured once per token count, its "
                "graph would replay the capture batch's requests. Make that op a splitting op: "
                "torch.fx.wrap it and pass splitting_ops=(attend, that_op)")
    return split
