"""labkit.inspect: a captured graph read as a DAG on both backends, CUDA's DOT dump parsed,
the picture drawn, the DOT export read back.

Tests taking ``B`` run on the emulator here and on a GPU with ``pytest -m cuda``: the same
assertions hold for CUDA's own description of the graph (``CUDAGraph.debug_dump``).
"""

from pathlib import Path

import matplotlib
import pytest
import torch
from helpers import assert_usable

from labkit.capture import side_stream_warmup
from labkit.inspect import (
    DAG,
    Node,
    captured_dag,
    draw,
    fork_join,
    inspectable_graph,
    layout,
    parse_dot,
    short_symbol,
    to_dot,
)

matplotlib.use("Agg")

FIXTURE = Path(__file__).parent / "data" / "cuda_graph_fork_join.dot"


def _capture(B, fn, *args):
    """Warm ``fn`` up, then capture it into an inspectable graph; (graph, output)."""
    side_stream_warmup(fn, *args, B=B, iters=1)
    g = inspectable_graph(B)
    with B.graph(g):
        out = fn(*args)
    return g, out


def _chain(dag):
    """Is ``dag`` one chain: node i waits for node i - 1 only?"""
    return list(dag.edges) == [(i, i + 1) for i in range(len(dag) - 1)]


# ---- both backends: what was captured ------------------------------------------------------

def test_one_stream_is_a_chain(B):
    x = torch.randn(64, device=B.device)
    g, y = _capture(B, lambda t: torch.relu(t * 2 + 1), x)
    dag = captured_dag(g, B)
    assert dag.source == B.name
    assert dag.counts() == {"kernel": 3} and _chain(dag)
    assert dag.width == 1 and len(dag.generations()) == 3
    if B.is_emulated:
        assert [n.label for n in dag.nodes] == ["mul", "add", "relu"]
        assert dag.nodes[0].name == "aten.mul.Tensor"
    g.replay()                                   # an inspectable graph replays as any other
    B.synchronize()
    torch.testing.assert_close(y, torch.relu(x * 2 + 1))


def test_fork_and_join_are_two_parallel_branches(B):
    g, x, d = fork_join(B)
    dag = captured_dag(g, B)
    # add, then mul (side stream) and sub (capturing stream), then the add that joins them
    assert dag.counts() == {"kernel": 4}
    assert dag.edges == ((0, 1), (0, 2), (1, 3), (2, 3))
    assert dag.generations() == [[0], [1, 2], [3]] and dag.width == 2
    assert "up to 2 nodes side by side" in dag.describe()
    g.replay()
    B.synchronize()
    assert d.tolist() == (3 * x + 2).tolist()


def test_a_missing_join_is_the_capture_error(B):
    with pytest.raises(RuntimeError, match="capturing stream has unjoined work"):
        fork_join(B, join=False)
    assert_usable(B)                       # fork_join recovered: default stream, generator


def test_a_plain_graph_cannot_be_read(B):
    x = torch.randn(8, device=B.device)
    side_stream_warmup(lambda t: t * 2, x, B=B, iters=1)
    g = B.CUDAGraph()
    with B.graph(g):
        x * 2
    with pytest.raises(RuntimeError, match=r"inspectable_graph\(B\) before capturing"):
        captured_dag(g, B)


def test_a_graph_not_captured_cannot_be_read(B):
    with pytest.raises(RuntimeError, match="never captured"):
        captured_dag(inspectable_graph(B), B)


def test_captured_dag_refuses_what_is_not_a_graph(B):
    with pytest.raises(TypeError, match="needs a captured .* B.CUDAGraph .* got str"):
        captured_dag("g", B)
    with pytest.raises(TypeError, match="backend namespace"):
        captured_dag(inspectable_graph(B), "cuda")


# ---- the emulator's record in detail ---------------------------------------------------------

def test_emulated_copies_are_memcpy_nodes(E):
    x, y = torch.randn(8, device=E.device), torch.empty(8, device=E.device)
    g, _ = _capture(E, lambda: (y.copy_(x), y.mul_(2)))
    dag = captured_dag(g, E)
    assert [(n.kind, n.label) for n in dag.nodes] == [("memcpy", "copy_"), ("kernel", "mul_")]


def test_emulated_replay_inside_a_capture_is_one_graph_node(E):
    x = torch.randn(8, device=E.device)
    inner, _ = _capture(E, lambda: x.mul_(2))
    outer, _ = _capture(E, lambda: (inner.replay(), x.add_(1)))
    dag = captured_dag(outer, E)
    assert [n.kind for n in dag.nodes] == ["graph", "kernel"] and _chain(dag)
    assert dag.nodes[0].detail == "1 ops" and dag.nodes[0].label == "graph replay"


def test_reset_forgets_the_dag(E):
    g, _, _ = fork_join(E)
    assert len(captured_dag(g, E)) == 4
    g.reset()
    with pytest.raises(RuntimeError, match="never captured"):
        captured_dag(g, E)


def test_fork_join_checks_its_arguments(E):
    with pytest.raises(TypeError, match="join must be True or False, got 'no'"):
        fork_join(E, join="no")
    with pytest.raises(ValueError, match="n .* must be >= 1, got 0"):
        fork_join(E, n=0)


# ---- CUDA's DOT dump -----------------------------------------------------------------------

def test_parse_dot_fixture():
    dag = parse_dot(FIXTURE.read_text(), source="cuda")
    assert [(n.kind, n.label, n.detail) for n in dag.nodes] == [
        ("memset", "memset", "512 B, value 0"),
        ("kernel", "vectorized_elementwise_kernel[CUDAFunctorOnSelf_add]", "<<<1,128,0>>>"),
        ("kernel", "ampere_sgemm_32x32_sliced1x4_tn", "<<<{4,2,1},128,0>>>"),
        ("kernel", "vectorized_elementwise_kernel[MulFunctor]", "<<<1,128,0>>>"),
        ("memcpy", "memcpy DtoD", "DtoD 512 B"),
        ("kernel", "vectorized_elementwise_kernel[CUDAFunctor_add]", "<<<1,128,0>>>"),
    ]
    assert dag.nodes[1].name.startswith("_ZN2at6native29vectorized_elementwise_kernel")
    assert dag.edges == ((0, 1), (1, 2), (1, 4), (2, 3), (3, 5), (4, 5))
    assert dag.generations() == [[0], [1], [2, 4], [3], [5]]
    assert dag.counts() == {"kernel": 4, "memcpy": 1, "memset": 1}


def test_parse_dot_orders_nodes_by_capture_id_not_file_order():
    text = FIXTURE.read_text()
    swapped = text.replace('"graph_1_node_0"[', '"tmp"[').replace(
        '"graph_1_node_5"[', '"graph_1_node_0"[').replace('"tmp"[', '"graph_1_node_5"[')
    dag = parse_dot(swapped)            # node ids swapped, the ID fields are not
    assert dag.nodes[0].kind == "memset" and dag.nodes[5].label.endswith("[CUDAFunctor_add]")


CHILD = """digraph dot {
subgraph cluster_1 {
label="graph_1" graph[style="dashed"];
"graph_1_node_0"[style="bold" shape="record" label="{KERNEL
| {ID | 0 (topoId: 1) | _Z5saxpyifPfS_\\<\\<\\<1,32,0\\>\\>\\>}}"];
"graph_1_node_1"[style="solid" shape="record" label="{GRAPH | {ID | 1 (topoId: 0)}}"];
"graph_1_node_0" -> "graph_1_node_1" [headlabel=0];
}
subgraph cluster_2 {
label="graph_2" graph[style="dashed"];
"graph_2_node_0"[style="bold" shape="record" label="{KERNEL
| {ID | 0 (topoId: 1) | _Z4axpyifPfS_\\<\\<\\<1,32,0\\>\\>\\>}}"];
"graph_2_node_1"[style="bold" shape="record" label="{EMPTY | {ID | 1 (topoId: 0)}}"];
"graph_2_node_0" -> "graph_2_node_1";
}
}
"""


def test_parse_dot_reads_the_captured_graph_and_says_what_it_left_out():
    dag = parse_dot(CHILD)
    assert [(n.kind, n.label) for n in dag.nodes] == [("kernel", "saxpy"), ("graph", "graph")]
    assert dag.edges == ((0, 1),)
    assert dag.notes == ("2 nodes of child graphs not shown (they run inside their graph node)",)
    assert "2 nodes of child graphs not shown" in repr(dag)


def test_parse_dot_reads_plain_dot_too():
    dag = parse_dot("/* a comment */ strict digraph {\n// another\n#line 1\n"
                    'a [label="x"]; subgraph { b [label="y"] }\n a -> b -> c; c [label=z]\n}')
    assert [n.name for n in dag.nodes] == ["x", "y", "z"]
    assert dag.edges == ((0, 1), (1, 2)) and [n.kind for n in dag.nodes] == ["other"] * 3


def test_parse_dot_keeps_unknown_node_types_as_other():
    dag = parse_dot('digraph dot {\n"a"[shape="record" label="{EVENT_RECORD | {ID | 0}}"];\n'
                    '"b"[shape="record" label="{HOST | {ID | 1}}"];\n"a" -> "b";\n}\n')
    assert [(n.kind, n.label) for n in dag.nodes] == [("other", "event_record"),
                                                        ("other", "host")]


def test_parse_dot_refuses_bad_input():
    with pytest.raises(TypeError, match="DOT text .* got PosixPath"):
        parse_dot(FIXTURE)
    with pytest.raises(ValueError, match="no node found"):
        parse_dot("digraph dot {\n}\n")
    with pytest.raises(ValueError, match="names node 'c', which the text does not define"):
        parse_dot('digraph g { "a" [label="x"]; "b" [label="y"]; "a" -> "c"; }')
    with pytest.raises(ValueError, match="cycle"):
        parse_dot('digraph g { "a" [label="x"]; "b" [label="y"]; "a" -> "b"; "b" -> "a"; }')


@pytest.mark.parametrize("symbol, short", [
    ("_ZN2at6native29vectorized_elementwise_kernelILi4ENS0_15CUDAFunctor_addIfEESt5arrayIPcLm3EEE"
     "EviT0_T1_", "vectorized_elementwise_kernel[CUDAFunctor_add]"),
    ("_ZN2at6native43_GLOBAL__N__50f1b6c4_10_Dropout_cu_0e96ed3824fused_dropout_kernel_vecIffjLi1E"
     "Li4EbEEvNS_4cuda6detail10TensorInfoIKT_T1_EENS5_IS6_S8_EENS5_IT4_S8_EES8_T0_NS_15Philox"
     "CudaStateE", "fused_dropout_kernel_vec"),
    ("_Z5saxpyifPfS_", "saxpy"),
    ("_ZN7cutlass7Kernel2I43cutlass_80_tensorop_s1688gemm_64x64_32x6_tnEEvNT_6ParamsE",
     "Kernel2[cutlass_80_tensorop_s1688gemm_64x64_32x6_tn]"),
    ("ampere_sgemm_128x64_tn", "ampere_sgemm_128x64_tn"),
    ("sm90_xmma_gemm_" + "x" * 100, "sm90_xmma_gemm_" + "x" * 42 + "..."),
])
def test_short_symbol(symbol, short):
    assert short_symbol(symbol) == short


# ---- DOT export ----------------------------------------------------------------------------

def test_to_dot_reads_back_the_same_dag(E):
    for dag in (parse_dot(FIXTURE.read_text()), captured_dag(fork_join(E)[0], E)):
        back = parse_dot(to_dot(dag))
        assert back.nodes == dag.nodes and back.edges == dag.edges
        text = to_dot(dag)
        assert text.count(" -> ") == len(dag.edges) and text.count("[class=") == len(dag)


def test_to_dot_escapes_what_it_writes():
    odd = Node(0, "kernel", 'k<"quoted">\\path', 'a "b"\nc')
    dag = DAG((odd, Node(1, "memset", "memset", "memset", "4 B")), ((0, 1),))
    back = parse_dot(to_dot(dag, name='my "graph"'))
    assert back.nodes == dag.nodes and back.edges == dag.edges
    with pytest.raises(TypeError, match="to_dot takes a DAG"):
        to_dot(FIXTURE.read_text())


# ---- the DAG itself ------------------------------------------------------------------------

def test_dag_refuses_what_is_not_a_dag():
    a, b = Node(0, "kernel", "a", "a"), Node(1, "kernel", "b", "b")
    with pytest.raises(ValueError, match="kind must be one of kernel, memcpy"):
        Node(0, "Kernel", "a", "a")
    with pytest.raises(ValueError, match=r"nodes\[0\] must be a Node with index 0"):
        DAG((b,), ())
    with pytest.raises(ValueError, match=r"edge \(0, 2\) does not join two different nodes"):
        DAG((a, b), ((0, 2),))
    with pytest.raises(ValueError, match=r"edge \(1, 1\)"):
        DAG((a, b), ((1, 1),))
    with pytest.raises(ValueError, match="cycle"):
        DAG((a, b), ((0, 1), (1, 0)))


def test_layout_puts_parallel_branches_side_by_side():
    pos = layout(parse_dot(FIXTURE.read_text()))
    assert pos[2][1] == pos[4][1] and pos[2][0] != pos[4][0]      # one layer, two columns
    assert pos[0][1] > pos[1][1] > pos[2][1] > pos[3][1] > pos[5][1]  # top to bottom
    assert pos[0][0] == pos[1][0] == 0                              # a chain stays centred


# ---- the picture ---------------------------------------------------------------------------

def test_draw_draws_every_node_and_edge():
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyBboxPatch

    dag = parse_dot(FIXTURE.read_text(), source="cuda")
    ax = draw(dag)
    boxes = [p for p in ax.patches if isinstance(p, FancyBboxPatch)]
    arrows = [t for t in ax.texts if getattr(t, "arrow_patch", None) is not None]
    assert len(boxes) == 6 and len(arrows) == 6
    assert ax.get_title() == "captured graph (cuda): 6 nodes, 6 edges"
    assert [t.get_text() for t in ax.get_legend().get_texts()] == [
        "kernel (4)", "memcpy (1)", "memset (1)"]
    fig, mine = plt.subplots()
    assert draw(dag, ax=mine, title="mine") is mine and mine.get_title() == "mine"
    plt.close("all")


def test_draw_says_when_it_draws_part_of_the_graph():
    import matplotlib.pyplot as plt

    ax = draw(parse_dot(FIXTURE.read_text()), max_nodes=3)
    assert ax.get_title().endswith("6 nodes, 6 edges; the first 3 drawn")
    assert len(ax.patches) == 3
    plt.close("all")


def test_draw_refuses_bad_arguments():
    with pytest.raises(TypeError, match="draw takes a DAG .* got str"):
        draw("graph.dot")
    with pytest.raises(ValueError, match="max_nodes must be >= 1, got 0"):
        draw(parse_dot(FIXTURE.read_text()), max_nodes=0)


def test_parse_dot_reads_real_h200_dumps():
    """cudaGraphDebugDotPrint's own files, written by tools/inspect_gpu_probe.py on an
    H200 (torch 2.11, CUDA 13.0): the fork/join capture and lesson 02's MLP."""
    data = Path(__file__).parent / "data"
    fj = parse_dot((data / "h200_fork_join.dot").read_text())
    assert len(fj.nodes) == 4 and {n.kind for n in fj.nodes} == {"kernel"}
    assert sorted(fj.edges) == [(0, 1), (0, 2), (1, 3), (2, 3)]
    assert fj.width == 2                                    # the two branches side by side
    assert [n.label for n in fj.nodes][1] == "vectorized_elementwise_kernel[MulFunctor]"
    mlp = parse_dot((data / "h200_mlp.dot").read_text())
    assert [n.label for n in mlp.nodes] == ["gemmSN_TN_kernel", "vectorized_elementwise_kernel",
                                            "gemmSN_TN_kernel"]
    assert sorted(mlp.edges) == [(0, 1), (1, 2)]
