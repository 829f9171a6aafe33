"""Exercise 1: ``split_labels(gm, ops)``, vLLM's ``split_graph`` labelling of an FX graph.

The learner's function returns ``{node: subgraph id}`` for every node of ``gm`` but the
placeholders, the output and the ``get_attr`` nodes (``split_module`` asks for no label of
those: an entry for one of them, whatever its value, None included, is ignored):
every call of one of
``ops`` gets an id of its own, the nodes between two of them share one, ids increase in
node order and are numbered as vLLM numbers them (split ops odd, pieces even, an empty
piece leaves its id unused) (:func:`labkit.piecewise.split.split_graph`).

The checker builds graphs that hold every case the text names: lesson 09's own model
traced with ``torch.fx.symbolic_trace`` (cut at ``attend``), the text's own examples
(``relu, attend, add`` and ``attend, attend_1, add``, no ``get_attr`` node), and
hand-built graphs with no
split op, one, several, two in a row, a split op first and last, two different ops in
``ops`` beside a decoy function whose name starts like one of them and another function
with exactly the ``__name__`` (and ``__qualname__``) of one of them, a different object
that is not in ``ops`` (a function redefined in a later notebook cell is such an object;
matching by name is caught), and ``get_attr`` nodes
(read first by a split op, hoisted to the top of the graph, or read by several pieces;
a split op reads one made right before it, a hoisted one or none, at random), which a
labelling must step over: one that lets a ``get_attr`` open a piece numbers the pieces
wrongly where none precedes a split op.
Each answer is judged by structure first (which nodes share an id), so that a wrong split
is named by the nodes it joins or cuts; then ``split_module(gm, None, lambda n:
labels[n], keep_original_order=True)`` must compute what ``gm`` computes; last the ids must
be vLLM's own numbers.
"""

from __future__ import annotations

import numbers
import operator

import torch
import torch.fx as fx
import torch.nn as nn
from torch.fx.passes.split_module import split_module

from labkit.checks import (
    DEFAULT_TIME_LIMIT,
    attempt,
    compare_outputs,
    describe_exception,
    fail,
    reject,
    run_check,
)
from labkit.checks.lesson09._common import one_thread

__all__ = ["check_split_labels", "reference_split_labels"]

NAME = "split_labels"
HINTS = [
    "Walk gm.graph.nodes once, keeping a counter subgraph_id (from 0). Skip placeholders, "
    "the output and get_attr nodes (split_module asks for no label of those). A node is a "
    "split op when node.op == 'call_function' and node.target in ops.",
    "At a split op: subgraph_id += 1, label the op, subgraph_id += 1 again (the nodes after "
    "it start a new piece). Any other node gets the current subgraph_id.",
]
_RULE = ("every call of an op in ops gets an id of its own, and the nodes after it start a "
         "new one")
_NUMBERING = ("Number as vLLM does: start at 0; at a split op add 1, give the op that id, and "
              "add 1 again for the nodes after it. Split ops get odd ids, pieces even ones, "
              "and an empty piece (a split op first, or two in a row) leaves its id unused")


def reference_split_labels(gm, ops):
    """The answer: :func:`labkit.piecewise.split.split_labels`."""
    from labkit.piecewise.split import split_labels

    return split_labels(gm, ops)


# ---- the split ops and the graphs --------------------------------------------------------

def mix(x, w):
    """A split-op stand-in that mixes the rows, as attention does."""
    return x * w.mean() + x.mean(0, keepdim=True)


def gate(x):
    """A second split op (a Mamba-style mixer in vLLM's splitting_ops)."""
    return torch.sigmoid(x) * x.sum(0, keepdim=True)


def mix_norm(x):
    """A decoy: not a split op, although its name starts like one."""
    return x / (x.norm() + 1.0)


def attend(x):
    """A split op named as lesson 09's, for the text's own examples (``relu, attend, add``
    and ``attend, attend_1, add``); not :func:`labkit.decode.model.attend`."""
    return x * torch.sigmoid(x).mean(0, keepdim=True)


def _gate_twin(x):
    """A decoy named exactly like ``gate`` (``__name__``, ``__qualname__``, module), as a
    function redefined in a later cell is, but another object: not in ``ops``."""
    return x * torch.sigmoid(x)


_gate_twin.__name__ = _gate_twin.__qualname__ = gate.__qualname__


class _Root(nn.Module):
    """What the hand-built graphs read: buffers, a parameter, a Linear, a nested buffer."""

    def __init__(self, d, gen):
        super().__init__()
        for i in range(3):
            self.register_buffer(f"w{i}", torch.randn(d, generator=gen))
        self.p = nn.Parameter(torch.randn(d, generator=gen))
        self.lin = nn.Linear(d, d)
        with torch.no_grad():
            self.lin.weight.copy_(torch.randn(d, d, generator=gen) / d ** 0.5)
            self.lin.bias.copy_(torch.randn(d, generator=gen))
        self.inner = nn.Module()
        self.inner.register_buffer("scale", torch.rand(d, generator=gen) + 0.5)


_ATTRS = ("w0", "w1", "w2", "p", "inner.scale")
_UNARY = (torch.relu, torch.tanh, torch.sin, mix_norm)
_BINARY = (operator.add, operator.mul, torch.add)


def _pick(gen, seq):
    return seq[int(torch.randint(0, len(seq), (), generator=gen))]


class _Builder:
    """A random graph, appended node by node (so ``node.users`` is in node order)."""

    def __init__(self, gen, d):
        self.gen, self.g = gen, fx.Graph()
        self.root = _Root(d, gen)
        n_in = int(torch.randint(1, 4, (), generator=gen))
        self.inputs = [self.g.placeholder(f"x{i}") for i in range(n_in)]
        self.values = list(self.inputs)
        self.cur = self.inputs[0]
        self.hoisted = []

    def hoist(self, k):
        """k get_attr nodes at the top of the graph, read later (as Dynamo's graphs do)."""
        for _ in range(k):
            self.hoisted.append(self.g.get_attr(_pick(self.gen, _ATTRS)))

    def attr(self):
        if self.hoisted and bool(torch.rand((), generator=self.gen) < 0.5):
            return _pick(self.gen, self.hoisted)
        return self.g.get_attr(_pick(self.gen, _ATTRS))

    def plain(self):
        """One node that is not a split op."""
        kind = int(torch.randint(0, 5, (), generator=self.gen))
        g, cur = self.g, self.cur
        if kind == 0:
            node = g.call_function(_pick(self.gen, _UNARY), (cur,))
        elif kind == 1:
            node = g.call_function(_pick(self.gen, _BINARY), (cur, _pick(self.gen, self.values)))
        elif kind == 2:
            node = g.call_method(_pick(self.gen, ("mul", "add")), (cur, 0.5))
        elif kind == 3:
            node = g.call_module("lin", (cur,))
        else:
            node = g.call_function(operator.mul, (cur, self.attr()))
        self.push(node)

    def split(self, op, reads=None):
        """A call of ``op``; ``mix`` reads, as ``reads`` says or at random: a get_attr made
        right before it ("new"), a hoisted one ("hoisted") or no attribute at all ("value":
        an earlier value), so that get_attr nodes are no landmark of a split op."""
        if op is mix:
            reads = reads or _pick(self.gen, ("new", "hoisted", "value"))
            if reads == "new" or (reads == "hoisted" and not self.hoisted):
                w = self.g.get_attr(_pick(self.gen, _ATTRS))
            elif reads == "hoisted":
                w = _pick(self.gen, self.hoisted)
            else:
                w = _pick(self.gen, self.values)
            node = self.g.call_function(mix, (self.cur, w))
        else:
            node = self.g.call_function(op, (self.cur,))
        self.push(node)

    def use(self, attr):
        self.push(self.g.call_function(operator.mul, (self.cur, attr)))

    def use_hoisted(self):
        """Every hoisted get_attr read at least once."""
        for a in self.hoisted:
            if not a.users:
                self.push(self.g.call_function(operator.mul, (self.cur, a)))

    def push(self, node):
        self.cur = node
        self.values.append(node)

    def finish(self):
        extra = _pick(self.gen, self.values)
        self.g.output((self.cur, extra) if extra is not self.cur else self.cur)
        return fx.GraphModule(self.root, self.g)


def _text_example(gen, which):
    """The text's own examples, no get_attr node: ``relu, attend, add`` (which 0) or
    ``attend, attend_1, add`` (which 1)."""
    d = int(torch.randint(3, 7, (), generator=gen))
    g = fx.Graph()
    x = g.placeholder("x")
    if which == 0:
        h = g.call_function(attend, (g.call_function(torch.relu, (x,)),))
        label = "the text's example: relu, attend, add"
    else:
        h = g.call_function(attend, (g.call_function(attend, (x,)),))
        label = "the text's example: attend, attend_1, add"
    g.output(g.call_function(operator.add, (h, x)))
    gm = fx.GraphModule(nn.Module(), g)
    rows = int(torch.randint(2, 5, (), generator=gen))
    return gm, (attend,), label, (torch.randn(rows, d, generator=gen),)


def _hand_built(gen, case, which=1):
    """(gm, ops, label, inputs) for one of the cases the text names (``which``: the text's
    example, for case "text")."""
    if case == "text":
        return _text_example(gen, which)
    d = int(torch.randint(3, 7, (), generator=gen))
    b = _Builder(gen, d)
    b.hoist(int(torch.randint(1, 3, (), generator=gen)))
    shared = b.hoisted[0]           # read before the first split op and after the last
    plain = lambda lo, hi: [b.plain() for _ in range(int(torch.randint(lo, hi, (), generator=gen)))]  # noqa: E731
    if case == "none":
        ops = (mix,)
        plain(3, 7)
        label = "no call of mix"
    elif case == "one":
        ops = (mix,)
        plain(1, 4)
        b.use(shared)
        b.split(mix)
        plain(1, 4)
        b.use(shared)
        label = "one call of mix"
    elif case == "several":
        ops = (mix,)
        plain(1, 3)
        b.use(shared)
        n = int(torch.randint(2, 4, (), generator=gen))
        for i in range(n):
            b.split(mix)
            if i == 0:
                b.split(mix, reads="value")     # two in a row, no get_attr between
            plain(1, 3)
        b.use(shared)
        label = f"{n + 1} calls of mix, two of them in a row"
    elif case == "ends":
        ops = (mix,)
        b.split(mix, reads=_pick(gen, ("value", "hoisted")))   # first: nothing before it
        plain(1, 4)
        b.use(shared)
        b.use_hoisted()
        b.split(mix)                  # last: its result is the output
        label = "mix first and last"
    else:   # "two ops": both functions of ops called, a decoy beside them
        ops = (gate, mix) if bool(torch.rand((), generator=gen) < 0.5) else (mix, gate)
        plain(0, 2)
        b.split(gate)
        b.push(b.g.call_function(mix_norm, (b.cur,)))
        b.use(shared)
        plain(0, 2)
        b.split(mix)
        b.push(b.g.call_function(_gate_twin, (b.cur,)))
        plain(1, 3)
        b.use(shared)
        b.split(gate)
        label = (f"ops={tuple(op.__name__ for op in ops)}, a decoy mix_norm and another "
                 f"function named gate between")
    b.use_hoisted()
    gm = b.finish()
    rows = int(torch.randint(2, 5, (), generator=gen))
    inputs = tuple(torch.randn(rows, d, generator=gen) for _ in b.inputs)
    ops = _pick(gen, (tuple, list))(ops)      # the text says "a tuple or list"
    return gm, ops, label, inputs


def _model_case():
    """Lesson 09's model traced, cut at attend; inputs that run it (a 2-request prefill)."""
    from labkit.decode import build_model, make_extend_batch
    from labkit.decode.attention import make_attn_backend
    from labkit.decode.model import attend

    model = build_model("tiny", max_requests=2, device="cpu", dtype=torch.float32)
    gm = fx.symbolic_trace(model)
    batch = make_extend_batch(model, [1, 2], [[1, 2, 3], [4, 5]])
    batch.attn_backend = make_attn_backend("torch_native", model)
    batch.attn_backend.init_forward_metadata(batch)
    return gm, (attend,), "lesson 09's model, traced, ops=(attend,)", (
        batch.input_ids, batch.positions, batch)


CASES = ("model", "text", "none", "one", "several", "ends", "two ops")


# ---- judging -----------------------------------------------------------------------------

# the nodes split_module asks no label of: a label there, whatever its value, is ignored
_UNLABELLED = ("placeholder", "output", "get_attr")


def _desc(node) -> str:
    if node.op == "call_function":
        fname = getattr(node.target, "__name__", str(node.target))
        return f"`{node.name}`" if fname == node.name else f"`{node.name}` ({fname})"
    if node.op == "call_module":
        return f"`{node.name}` (module {node.target})"
    return f"`{node.name}`"


def _names(nodes, limit=3) -> str:
    shown = ", ".join(f"`{n.name}`" for n in nodes[:limit])
    return shown + (f" and {len(nodes) - limit} more" if len(nodes) > limit else "")


def _is_split(node, ops) -> bool:
    return node.op == "call_function" and node.target in ops


def _labels_by(gm, is_split) -> dict:
    """vLLM's labelling of the nodes that are not get_attr, with another split test."""
    subgraph_id, labels = 0, {}
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output", "get_attr"):
            continue
        if is_split(node):
            labels[node] = subgraph_id + 1
            subgraph_id += 2
        else:
            labels[node] = subgraph_id
    return labels


_VARIANTS = {
    # node.name in the ops' names: the first call of each op only (mix, not mix_1)
    "by name": lambda n, ops: n.op == "call_function" and n.name in
    [getattr(op, "__name__", "") for op in ops],
    # the called function's name in the ops' names: also another function named so
    "by function name": lambda n, ops: n.op == "call_function" and getattr(
        n.target, "__name__", None) in [getattr(op, "__name__", "") for op in ops],
    # only the first function of ops
    "first op only": lambda n, ops: n.op == "call_function" and n.target is ops[0],
}


def _label_form(gm, got) -> str | None:
    """A dict from the graph's own nodes."""
    if got is None:
        return "returned None (did you forget `return labels`?)"
    if not isinstance(got, dict):
        return (f"returned a {type(got).__name__}; expected a dict {{fx.Node: int}} with one "
                f"entry per labelled node")
    index = {n: i for i, n in enumerate(gm.graph.nodes)}
    for k in got:
        if not isinstance(k, fx.Node):
            return (f"the keys must be the graph's fx.Node objects (labels[node] = id), got "
                    f"{type(k).__name__} keys such as {k!r}")
        if k not in index:
            return f"labels holds node `{k.name}`, which is not a node of gm.graph"
    return None


def _label_values(nodes, got, want) -> str | None:
    """A label for every node that needs one, each an int."""
    for n in nodes:
        if n in want and n not in got:
            return (f"node {_desc(n)} has no label: every node except the placeholders, the "
                    f"output and get_attr nodes gets one")
    for n, v in got.items():
        if isinstance(v, bool) or not isinstance(v, numbers.Integral):
            return (f"the label of `{n.name}` is {v!r} ({type(v).__name__}); labels are "
                    f"subgraph ids, ints")
    return None


def _split_variants(gm, ops, got, want, main, splits) -> str | None:
    """The two ways of missing some split ops, recognised by the labels they give."""
    for variant, is_split in _VARIANTS.items():
        other = _labels_by(gm, lambda n, f=is_split: f(n, ops))
        if any(other[n] != want[n] for n in main) and all(got[n] == other[n] for n in main):
            if variant == "by function name":
                twin = next(n for n in main if is_split(n, ops) and not _is_split(n, ops))
                name = getattr(twin.target, "__name__", str(twin.target))
                return (f"your code split at {_desc(twin)}, a call of another function that "
                        f"is also named {name} (the same __name__ and __qualname__, a "
                        f"different object, not in ops): compare node.target with the "
                        f"functions in ops, not names (node.target in ops)")
            s = next(n for n in splits if not is_split(n, ops))
            op = getattr(s.target, "__name__", str(s.target))
            if variant == "by name":
                first = next(n for n in splits if n.target is s.target and is_split(n, ops))
                return (f"the split op {_desc(s)} was not split out, although {_desc(first)}, "
                        f"another call of {op}, was. node.name is each node's own name "
                        f"({first.name}, {s.name}, ...): compare node.target (the function "
                        f"the node calls) with the functions in ops, not names")
            return (f"the calls of {op} (such as {_desc(s)}) were not split out, although "
                    f"those of {ops[0].__name__} were: {op} is in ops too. Split at a call "
                    f"of ANY function in ops (node.target in ops)")
    return None


def _each_split(ops, got, main, splits, index) -> str | None:
    """Each split op alone, with an id of its own."""
    for s in splits:
        sharing = [n for n in main if n is not s and got[n] == got[s]]
        if not sharing:
            continue
        before = [n for n in sharing if index[n] < index[s]]
        after = [n for n in sharing if index[n] > index[s]]
        if before and after:
            return (f"the split op {_desc(s)} was not split out: it shares id "
                    f"{got[s]} with {_names(before)} before it and {_names(after)} after "
                    f"it, but {_RULE}")
        if any(_is_split(n, ops) for n in sharing):
            other = next(n for n in sharing if _is_split(n, ops))
            return (f"two split ops, {_desc(s)} and {_desc(other)}, share id {got[s]}: "
                    f"{_RULE}, even when two of them follow each other")
        if after:
            return (f"the split op {_desc(s)} shares id {got[s]} with {_names(after)} "
                    f"after it: after a split op, add 1 again, so that the nodes after it "
                    f"start a new piece")
        return (f"the split op {_desc(s)} shares id {got[s]} with {_names(before)} "
                f"before it: add 1 before labelling a split op, so that it gets an id of its "
                f"own")
    return None


def _pieces(ops, got, main, splits) -> str | None:
    """The pieces: one id each, a new one after every split op."""
    segments, seg = [], []
    for n in main:
        if _is_split(n, ops):
            segments.append(seg)
            seg = []
        else:
            seg.append(n)
    segments.append(seg)
    seen = {}
    for i, seg in enumerate(segments):
        ids = sorted({got[n] for n in seg})
        if len(ids) > 1:
            a = seg[0]
            b = next(n for n in seg if got[n] != got[a])
            return (f"nodes {_desc(a)} (id {got[a]}) and {_desc(b)} (id {got[b]}) have no "
                    f"split op between them but different ids: the nodes between two split "
                    f"ops are one piece, one id")
        if ids:
            if ids[0] in seen:
                j, first = seen[ids[0]]
                cut = splits[j]
                return (f"{_desc(first)} before the split op {_desc(cut)} and {_desc(seg[0])} "
                        f"after it share id {ids[0]}: {_RULE}")
            seen[ids[0]] = (i, seg[0])
    return None


def _increasing(got, main) -> str | None:
    """Ids increase in node order."""
    last, prev = None, None
    for n in main:
        if last is not None and got[n] != last and got[n] < last:
            return (f"ids must increase in node order: {_desc(n)} has id {got[n]}, after "
                    f"{_desc(prev)} with id {last} (pieces run in the order of their ids)")
        last, prev = got[n], n
    return None


def judge_labels(gm, ops, got, want) -> str | None:
    """Why ``got`` is not ``want`` (the reference's labels of ``gm``), or None."""
    why = _label_form(gm, got)
    if why:
        return why
    got = {n: v for n, v in got.items() if n.op not in _UNLABELLED}   # never read: ignored
    nodes = list(gm.graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    main = [n for n in nodes if n in want and n.op != "get_attr"]
    splits = [n for n in main if _is_split(n, ops)]
    return (_label_values(nodes, got, want)
            or _split_variants(gm, ops, got, want, main, splits)
            or _each_split(ops, got, main, splits, index)
            or _pieces(ops, got, main, splits)
            or _increasing(got, main))


def _numbering(gm, ops, got, want) -> str | None:
    """``got``: the learner's labels without get_attr entries (split_module reads none)."""
    diff = [n for n in gm.graph.nodes if n in want and got[n] != want[n]]
    if not diff:
        return None
    n = next((d for d in diff if _is_split(d, ops)), diff[0])
    start = (" Your ids start at 1." if min(got.values()) == 1 and min(want.values()) == 0
             else "")
    return (f"the pieces are right, but the ids are not vLLM's: {_desc(n)} has id {got[n]}, "
            f"expected {want[n]}.{start} {_NUMBERING}")


def _same_output(gm, labels, inputs) -> str | None:
    """split_module with the learner's labels must compute what gm computes."""
    try:
        split = split_module(gm, None, lambda node: labels[node], keep_original_order=True)
    except Exception as e:
        return (f"split_module(gm, None, lambda n: labels[n], keep_original_order=True) "
                f"failed with your labels: {type(e).__name__}: {e}")
    with torch.no_grad():
        want = gm(*inputs)
        got = split(*inputs)
    diff = compare_outputs(want, got, rtol=1e-5, atol=1e-6)
    if diff:
        return (f"split_module(gm, ...) with your labels computes something else than gm: "
                f"{diff}")
    return None


def check_split_labels(fn, *, trials: int = 12, seed: int = 0):
    """Check the learner's ``split_labels(gm, ops)`` (see the module docstring)."""
    with one_thread():
        return _check(fn, trials, seed)


def _check(fn, trials, seed):
    if not callable(fn):
        return fail(NAME, f"expected your function split_labels, got {type(fn).__name__}")

    def body() -> str:
        gen = torch.Generator().manual_seed(seed)
        for trial in range(trials):
            _one_trial(fn, gen, trial)
        return (f"vLLM's labels in {trials} graphs (lesson 09's model, the text's examples, "
                f"no split op, one, several, two in a row, first and last, two ops in ops, "
                f"get_attr nodes anywhere), and split_module of them computes what gm does")

    return run_check(NAME, body, more_hints=HINTS)


def _one_trial(fn, gen, trial: int) -> None:
    """Trial ``trial``: a case's graph, the learner's labels judged, then split_module."""
    case = CASES[trial % len(CASES)]
    try:
        # the text's examples: attend, attend_1, add first (an empty piece), then relu, ...
        which = 1 - (trial // len(CASES)) % 2
        gm, ops, label, inputs = (_model_case() if case == "model"
                                  else _hand_built(gen, case, which))
        want = reference_split_labels(gm, ops)
    except Exception as e:      # a bug in the checker, not in the learner's code
        reject(f"the checker itself failed (not your fault): {type(e).__name__}: {e}",
               hints=[], kind="checker_error")
    where = f"trial {trial + 1} ({label})"
    got = attempt(fn, (gm, ops), time_limit=DEFAULT_TIME_LIMIT,
                  reason=lambda e: f"{where}: your code raised {describe_exception(e)}")
    msg = judge_labels(gm, ops, got, want)
    if not msg:
        labels = {n: v for n, v in got.items() if n.op not in _UNLABELLED}
        msg = _same_output(gm, labels, inputs) or _numbering(gm, ops, labels, want)
    if msg:
        reject(f"{where}: {msg}")
