"""Graphviz DOT in and out: CUDA's description of a graph read into a :class:`DAG`, and a
:class:`DAG` written for those who have graphviz.

On a GPU, ``torch.cuda.CUDAGraph.debug_dump(path)`` (``CUDAGraph::debug_dump`` in
``aten/src/ATen/cuda/CUDAGraph.cpp``) calls CUDA's ``cudaGraphDebugDotPrint`` with
``cudaGraphDebugDotFlagsVerbose``. The file holds one ``subgraph cluster_N`` per graph
(the captured graph first, then any child graphs), one *record* node per graph node, and
one edge per dependency::

    digraph dot {
    subgraph cluster_1 {
    label="graph_1" graph[style="dashed"];
    "graph_1_node_0"[style="bold" shape="record" label="{KERNEL
    | {ID | 0 (topoId: 1) | _ZN2at6native...\\<\\<\\<1,128,0\\>\\>\\>}
    | {{node handle | func handle} | {0x... | 0x...}}
    ...
    }"];
    "graph_1_node_1"[style="solid" shape="record" label="{
    MEMCPY
    | {{ID | node handle} | {1 (topoId: 0) | 0x...}}
    | {kind | DtoD (DEVICE to DEVICE)}
    ...}"];
    "graph_1_node_0" -> "graph_1_node_1" [headlabel=0];
    }
    }

The node type (``KERNEL``, ``MEMCPY``, ``MEMSET``, ``GRAPH``, ``HOST``, ``EMPTY``,
``EVENT_RECORD``, ``WAIT_EVENT``, ``MEM_ALLOC``, ``MEM_FREE``, ``CONDITIONAL``...) heads
the label; ``ID`` is the node's place in capture order; kernel names are mangled C++
symbols followed by the launch configuration ``<<<grid,block,shared bytes>>>``.
``tests/data/cuda_graph_fork_join.dot`` is a fixture in that format.
"""

from __future__ import annotations

import re

from labkit.inspect.dag import DAG, Node

__all__ = ["parse_dot", "to_dot", "short_symbol"]

_CUDA_KINDS = {"KERNEL": "kernel", "MEMCPY": "memcpy", "MEMSET": "memset", "GRAPH": "graph",
               "CONDITIONAL": "graph"}


# ---- reading DOT ---------------------------------------------------------------------------

_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|/\*.*?\*/|//[^\n]*|^#[^\n]*|->|--|[A-Za-z0-9_.]+'
                    r'|[\[\]{};,=]|\S', re.S | re.M)


def _tokens(text: str) -> list[str]:
    """DOT tokens: quoted strings whole, comments (``/* */``, ``//``, a ``#`` line) left
    out."""
    return [t for t in _TOKEN.findall(text)
            if not (t.startswith(("/*", "//")) or (t.startswith("#") and len(t) > 1))]


def _unquote(tok: str) -> str:
    """A DOT ID without its quotes; only ``\\"`` is an escape there (a record label keeps
    its own escapes, read by :func:`_record`)."""
    if len(tok) >= 2 and tok[0] == tok[-1] == '"':
        return tok[1:-1].replace('\\"', '"')
    return tok


def _plain(text: str) -> str:
    """A plain (non-record) label as written by :func:`to_dot`: ``\\n`` a newline,
    ``\\\\`` a backslash."""
    return re.sub(r"\\(.)", lambda m: "\n" if m.group(1) == "n" else m.group(1), text)


def _attrs(toks: list[str], i: int) -> tuple[dict, int]:
    """The attribute list opening at ``toks[i] == "["``; returns (attrs, index after "]")."""
    attrs, i = {}, i + 1
    while i < len(toks) and toks[i] != "]":
        if i + 2 < len(toks) and toks[i + 1] == "=":
            attrs[_unquote(toks[i])] = _unquote(toks[i + 2])    # a repeated key: the last
            i += 3
        else:
            i += 1                                             # "," ";" or a bare word
    return attrs, i + 1


def _statements(text: str):
    """``("node", cluster, id, attrs)`` and ``("edge", cluster, a, b)`` in file order."""
    toks = _tokens(text)
    clusters: list[str | None] = []          # the cluster each open "{" belongs to
    pending_cluster = None
    i = 0
    while i < len(toks):
        t = toks[i]
        if t == "subgraph":         # a cluster is a graph of its own (CUDA: one per graph);
            named = i + 1 < len(toks) and toks[i + 1] != "{"   # other subgraphs only group
            name = _unquote(toks[i + 1]) if named else ""
            pending_cluster = name if name.startswith("cluster") else None
            i += 2 if named else 1
            continue
        if t == "{":
            clusters.append(pending_cluster if pending_cluster is not None else
                            (clusters[-1] if clusters else None))
            pending_cluster, i = None, i + 1
            continue
        if t == "}":
            if clusters:
                clusters.pop()
            i += 1
            continue
        cluster = clusters[-1] if clusters else None
        if t in ("graph", "node", "edge") and i + 1 < len(toks) and toks[i + 1] == "[":
            _, i = _attrs(toks, i + 1)                         # defaults: not a node
            continue
        if t in ("strict", "digraph", "graph"):                # the header, and its name
            i += 2 if t != "strict" and i + 1 < len(toks) and toks[i + 1] != "{" else 1
            continue
        if i + 1 < len(toks) and toks[i + 1] == "=":            # label="graph_1"
            i += 3
            continue
        if t in ("->", "--", ";", ",", "[", "]", "="):
            i += 1
            continue
        chain = [_unquote(t)]                                   # a node id, maybe an edge
        j = i + 1
        while j + 1 < len(toks) and toks[j] in ("->", "--"):
            chain.append(_unquote(toks[j + 1]))
            j += 2
        attrs = {}
        if j < len(toks) and toks[j] == "[":
            attrs, j = _attrs(toks, j)
        if len(chain) == 1:
            yield ("node", cluster, chain[0], attrs)
        else:
            for a, b in zip(chain, chain[1:]):
                yield ("edge", cluster, a, b)
        i = j


def _record(label: str) -> list:
    """A record label (``{A | {B | C} | D}``) as nested lists of stripped strings; DOT's
    escapes (``\\{ \\} \\| \\< \\>``) become the characters themselves."""
    stack: list[list] = [[]]
    buf: list[str] = []

    def flush():
        stack[-1].append("".join(buf).strip())
        buf.clear()

    i = 0
    while i < len(label):
        ch = label[i]
        if ch == "\\" and i + 1 < len(label):
            nxt = label[i + 1]
            buf.append(nxt if nxt in "{}|<>\\\" " else ("\n" if nxt in "nlr" else ch + nxt))
            i += 2
            continue
        if ch == "{":
            if "".join(buf).strip():
                flush()
            buf.clear()
            stack.append([])
        elif ch == "}" and len(stack) > 1:
            flush()
            group = [x for x in stack.pop() if x != ""]
            stack[-1].append(group)
        elif ch == "|":
            flush()
        else:
            buf.append(ch)
        i += 1
    flush()
    top = [x for x in stack[0] if x != ""]
    return top[0] if len(top) == 1 and isinstance(top[0], list) else top


def _fields(group: list, out: dict | None = None) -> dict:
    """``key -> value`` pairs of a record: ``{key | value}`` rows and ``{{keys} | {values}}``
    tables; the first value wins for a repeated key."""
    out = {} if out is None else out
    if len(group) == 2 and all(isinstance(g, list) for g in group) and \
            len(group[0]) == len(group[1]) and all(isinstance(s, str) for s in group[0]):
        for k, v in zip(*group):
            if isinstance(v, str):
                out.setdefault(k, v)
        return out
    if len(group) >= 2 and all(isinstance(g, str) for g in group):
        out.setdefault(group[0], " | ".join(group[1:]))
        return out
    for g in group:
        if isinstance(g, list):
            _fields(g, out)
    return out


def _id_of(value: str | None) -> int | None:
    m = re.match(r"\s*(\d+)", value or "")
    return int(m.group(1)) if m else None


def _cuda_node(attrs: dict) -> tuple[str, str, str, str, int | None]:
    """(kind, name, label, detail, capture-order ID) of one node of a CUDA dump."""
    if attrs.get("class") in ("kernel", "memcpy", "memset", "graph", "other"):   # to_dot's
        label = _plain(attrs.get("label", ""))
        name = _plain(attrs.get("tooltip", label))
        return attrs["class"], name, label, _plain(attrs.get("xlabel", "")), None
    rec = _record(attrs.get("label", ""))
    head = next((x for x in rec if isinstance(x, str)), "") if rec else ""
    head = head.split()[0] if head.split() else ""
    fields = _fields(rec) if isinstance(rec, list) else {}
    ident = _id_of(fields.get("ID"))
    if head == "KERNEL":
        # {ID | 0 (topoId: 3) | symbol<<<grid,block,smem>>>}: the row is "ID" -> "0 ... | sym"
        row = fields.get("ID", "")
        sym = row.split(" | ", 1)[1] if " | " in row else row
        m = re.match(r"(.*?)<<<(.*)>>>\s*$", sym, re.S)
        name, launch = (m.group(1), f"<<<{m.group(2)}>>>") if m else (sym, "")
        return "kernel", name.strip(), short_symbol(name.strip()), launch, ident
    if head == "MEMCPY":
        way = fields.get("kind", "").split(" (")[0]
        size = fields.get("Width")
        detail = " ".join(x for x in (way, f"{size} B" if size else "") if x)
        return "memcpy", f"memcpy {way}".strip(), f"memcpy {way}".strip(), detail, ident
    if head == "MEMSET":
        try:
            nbytes = (int(fields["width"]) * int(fields["elementSize"])
                      * int(fields.get("height", 1)))
            detail = f"{nbytes} B, value {fields.get('value', '?')}"
        except (KeyError, ValueError):
            detail = ""
        return "memset", "memset", "memset", detail, ident
    kind = _CUDA_KINDS.get(head, "other")
    name = head.lower() if head else attrs.get("label", "?").strip() or "?"
    return kind, name, name, "", ident


def parse_dot(text: str, source: str = "dot") -> DAG:
    """The :class:`DAG` in a DOT text: a ``debug_dump`` file, or :func:`to_dot`'s output.

    Nodes keep capture order (CUDA's ``ID``; the order in the file when there is none).
    Only the captured graph itself is read: the nodes of child graphs (the second and later
    ``cluster`` of a CUDA dump) run inside their ``graph`` node, and the DAG's ``notes`` say
    how many were left out.

    Raises:
        TypeError: ``text`` is not a string (pass the file's text, not its path object).
        ValueError: ``text`` holds no node, or an edge names a node it does not define.
    """
    if not isinstance(text, str):
        raise TypeError(f"parse_dot takes the DOT text (a str), got {type(text).__name__}: "
                        "read the file first, e.g. parse_dot(Path(path).read_text())")
    stmts = list(_statements(text))
    nodes = [s for s in stmts if s[0] == "node"]
    if not nodes:
        raise ValueError(f"no node found in this DOT text ({len(text)} characters, starting "
                         f"{text[:60]!r}): is it a cudaGraphDebugDotPrint dump or to_dot's "
                         "output?")
    top = nodes[0][1]
    mine = [s for s in nodes if s[1] == top]
    left_out = len(nodes) - len(mine)
    read = [(_cuda_node(attrs), pos, dot_id) for pos, (_, _, dot_id, attrs) in enumerate(mine)]
    read.sort(key=lambda r: (r[0][4] if r[0][4] is not None else 1 << 30, r[1]))
    where = {dot_id: i for i, (_, _, dot_id) in enumerate(read)}
    out_nodes = [Node(i, kind, name, label, detail)
                 for i, ((kind, name, label, detail, _), _, _) in enumerate(read)]
    edges = []
    for _, cluster, a, b in (s for s in stmts if s[0] == "edge"):
        if cluster != top and (a not in where or b not in where):
            continue                                       # inside a child graph
        for end in (a, b):
            if end not in where:
                raise ValueError(f"the DOT edge {a} -> {b} names node {end!r}, which the "
                                 "text does not define")
        edges.append((where[a], where[b]))
    notes = (f"{left_out} nodes of child graphs not shown (they run inside their graph "
             "node)",) if left_out else ()
    return DAG(tuple(out_nodes), tuple(edges), source=source, notes=notes)


# ---- kernel names ----------------------------------------------------------------------

def _nested_name(body: str) -> list[str]:
    """The identifiers of a mangled name's leading (nested) name: ``2at6native3foo...``
    gives ``[at, native, foo]``; stops at the first character that is not a length."""
    out, i = [], 0
    while i < len(body):
        if body[i] == "L" and i + 1 < len(body) and body[i + 1].isdigit():
            i += 1                                      # internal linkage marker
        m = re.match(r"\d+", body[i:])
        if not m:
            break
        n, start = int(m.group()), i + len(m.group())
        ident = body[start:start + n]
        if len(ident) != n or not re.fullmatch(r"[A-Za-z_]\w*", ident):
            break
        out.append(ident)
        i = start + n
    return out


def _first_class(rest: str) -> str | None:
    """The first length-prefixed identifier in ``rest``, e.g. the kernel class a generic
    ``cutlass::Kernel<...>`` template runs."""
    for m in re.finditer(r"(?<!\d)(\d+)", rest):
        n = int(m.group(1))
        ident = rest[m.end():m.end() + n]
        if n >= 4 and len(ident) == n and re.fullmatch(r"[A-Za-z_]\w*", ident):
            return ident
    return None


def _functor(rest: str) -> str | None:
    """The last length-prefixed identifier in ``rest`` that names a functor: the innermost
    one (``AUnaryFunctor<..., MulFunctor<float>>`` gives ``MulFunctor``)."""
    found = None
    for m in re.finditer(r"(?<!\d)(\d+)", rest):
        n = int(m.group(1))
        ident = rest[m.end():m.end() + n]
        if len(ident) == n and re.fullmatch(r"[A-Za-z_]\w*", ident) and "unctor" in ident:
            found = ident
    return found


def short_symbol(symbol: str) -> str:
    """A readable name for a kernel symbol from a CUDA dump.

    ``_ZN2at6native29vectorized_elementwise_kernelILi4ENS0_21CUDAFunctorOnSelf_addIfEE...``
    becomes ``vectorized_elementwise_kernel[CUDAFunctorOnSelf_add]``: the function's own
    name and, for element-wise kernels, the functor that says which operation it runs (for
    a generic ``Kernel<...>`` template, the class it runs).
    Names that are not mangled (``ampere_sgemm_128x64_tn``) pass through, cut to 60
    characters. It is a heuristic, not a demangler: the full symbol stays in ``Node.name``.
    """
    s = str(symbol).strip()
    names = _nested_name(s[3:] if s.startswith("_ZN") else s[2:]) if s.startswith("_Z") else []
    if not names:
        return s if len(s) <= 60 else s[:57] + "..."
    functor = _functor(s)
    if functor is None and re.fullmatch(r"(device_)?[Kk]ernel\d*", names[-1]):
        functor = _first_class(s.split(names[-1], 1)[1])    # cutlass::Kernel<the gemm>
    name = f"{names[-1]}[{functor}]" if functor else names[-1]
    return name if len(name) <= 60 else name[:57] + "..."


# ---- writing DOT -----------------------------------------------------------------------

_FILL = {"kernel": "#dbe9f6", "memcpy": "#fde2c4", "memset": "#d8f0d2", "graph": "#e2e2e2",
         "other": "#ffffff"}
_SHAPE = {"kernel": "box", "memcpy": "cds", "memset": "box", "graph": "box3d",
          "other": "ellipse"}


def _q(s: str) -> str:
    return '"' + str(s).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def to_dot(dag: DAG, name: str = "captured") -> str:
    """``dag`` as Graphviz DOT text, drawn top to bottom like :func:`labkit.inspect.draw`.

    Render it where graphviz is installed (``dot -Tsvg graph.dot -o graph.svg``), or paste
    it into any DOT viewer. Each node carries its kind as ``class`` (a standard Graphviz
    attribute), its full name as ``tooltip`` and its short name as ``label``, so
    :func:`parse_dot` reads the text back into the same nodes and edges.
    """
    if not isinstance(dag, DAG):
        raise TypeError(f"to_dot takes a DAG (from captured_dag or parse_dot), got "
                        f"{type(dag).__name__}")
    lines = [f"digraph {_q(name)} {{", "  rankdir=TB;",
             '  node [fontname="Helvetica" fontsize=10 style="filled"];']
    for n in dag.nodes:
        attrs = {"class": n.kind, "label": n.label, "tooltip": n.name,
                 "shape": _SHAPE[n.kind], "fillcolor": _FILL[n.kind]}
        if n.detail:
            attrs["xlabel"] = n.detail
        if n.kind == "memset":
            attrs["style"] = "filled,dashed"
        body = " ".join(f"{k}={_q(v)}" for k, v in attrs.items())
        lines.append(f'  "n{n.index}" [{body}];')
    lines += [f'  "n{a}" -> "n{b}";' for a, b in dag.edges]
    lines.append("}")
    return "\n".join(lines) + "\n"
