"""Lesson 09's checkers: each real learner mistake is rejected with a message that names
it, and the reference answer (and harmless variations of it) pass.

The checkers of exercises 2 to 4 take the backend: their reference and a few mistakes run
on both (the ``B`` fixture; ``pytest -m cuda`` on a GPU), the rest on the emulator.
"""

from __future__ import annotations

import pytest
import torch
from helpers import assert_usable

from labkit import backend
from labkit.checks.lesson09 import (
    check_capture_batch,
    check_greedy_accept,
    check_replay_piece,
    check_split_labels,
)
from labkit.checks.lesson09.capture_batch import (
    _trial,
    broken_capture_batch,
    reference_capture_batch,
    show_symptom,
)
from labkit.decode import build_model
from labkit.decode.batch import ForwardBatch, ForwardMode
from labkit.decode.model import DUMMY_SLOT, ModelArgs

E = backend.get("emulated")


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """Tiny tensors everywhere here: one intra-op thread."""


# ---- exercise 1: split_labels -------------------------------------------------------------

def make_split_labels(*, second_add=True, first_add=True, skip=("placeholder", "output",
                      "get_attr"), attr_pass="first", first_op_only=False, by_name=False,
                      by_fn_name=False, by_qualname=False, compact=False, start=0, keys="node",
                      keep_consecutive=False, pieces_zero=False, as_set=False, attr_value=None):
    """The reference, with one mistake (or a harmless variation) switched on by each flag."""
    def qualname(f):
        return f"{getattr(f, '__module__', '')}.{getattr(f, '__qualname__', '')}"

    def split_labels(gm, ops):
        ops_ = set(ops) if as_set else ops
        names = [op.__name__ for op in ops]

        def is_split(node):
            if node.op != "call_function":
                return False
            if first_op_only:
                return node.target is ops[0]
            if by_name:
                return node.name in names
            if by_fn_name:      # the called function's __name__: also a twin's
                return getattr(node.target, "__name__", None) in names
            if by_qualname:     # module + __qualname__: a function redefined in a cell too
                return qualname(node.target) in {qualname(op) for op in ops}
            return node.target in ops_

        subgraph_id, labels, n_ops = start, {}, 0
        prev_split = False
        for node in gm.graph.nodes:
            if node.op in skip:
                continue
            if is_split(node):
                n_ops += 1
                if pieces_zero:
                    labels[node] = n_ops
                    continue
                if first_add and not (keep_consecutive and prev_split):
                    subgraph_id += 1
                labels[node] = subgraph_id
                if second_add and not keep_consecutive:
                    subgraph_id += 1
                prev_split = True
            else:
                if keep_consecutive and prev_split:
                    subgraph_id += 1
                labels[node] = 0 if pieces_zero else subgraph_id
                prev_split = False
        if compact:     # no id left unused: renumber 0, 1, 2, ... in order
            order = {v: i for i, v in enumerate(sorted(set(labels.values())))}
            labels = {n: order[v] for n, v in labels.items()}
        if attr_pass == "value":
            for node in gm.graph.nodes:
                if node.op == "get_attr":
                    labels[node] = attr_value
        elif attr_pass:
            for node in gm.graph.nodes:
                if node.op == "get_attr":
                    users = [u for u in node.users if u in labels]
                    if users:
                        labels[node] = labels[users[0] if attr_pass == "first" else users[-1]]
        if keys == "name":
            return {n.name: v for n, v in labels.items()}
        if keys == "list":
            return list(labels.values())
        if keys == "none":
            return None
        return labels
    return split_labels


def split_labels_one_pass(gm, ops):
    """Harmless: get_attr nodes labelled by their first user (split_module reads no such label)."""
    labels, sid = {}, 0
    nodes = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
    for node in nodes:
        if node.op == "get_attr":
            continue
        if node.op == "call_function" and node.target in ops:
            labels[node] = sid + 1
            sid += 2
        else:
            labels[node] = sid
    for node in nodes:
        if node.op == "get_attr":
            first = min((u for u in node.users if u in labels), key=nodes.index)
            labels[node] = labels[first]
    return labels


def test_split_labels_reference_passes(capsys):
    assert check_split_labels(make_split_labels(), trials=12, seed=1)
    assert check_split_labels(make_split_labels(as_set=True))
    assert check_split_labels(split_labels_one_pass)
    assert capsys.readouterr().out.count("✅ split_labels") == 3


@pytest.mark.parametrize("flags, words", [
    ({"first_add": False, "second_add": False}, "was not split out"),
    ({"second_add": False}, "after it: after a split op, add 1 again"),
    ({"first_add": False}, "before it: add 1 before labelling a split op"),
    ({"first_op_only": True}, "is in ops too"),
    ({"by_name": True}, "compare node.target"),
    # the same __name__ (and __qualname__) as gate, another object: names are no identity
    ({"by_fn_name": True}, "compare node.target with the functions in ops, not names"),
    ({"by_qualname": True}, "compare node.target with the functions in ops, not names"),
    ({"compact": True}, "the ids are not vLLM's"),
    ({"start": 1}, "Your ids start at 1"),
    ({"keys": "name"}, "keys must be the graph's fx.Node objects"),
    ({"keys": "list"}, "returned a list"),
    ({"keys": "none"}, "did you forget `return labels`"),
    ({"keep_consecutive": True}, "even when two of them follow each other"),
    ({"pieces_zero": True}, "share id 0: every call of an op in ops gets an id of its own"),
])
def test_split_labels_mistakes(flags, words):
    r = check_split_labels(make_split_labels(**flags))
    assert not r and words in r.message, r.message


@pytest.mark.parametrize("flags", [
    {"attr_pass": None},                                           # get_attr nodes skipped
    {"skip": ("placeholder", "output"), "attr_pass": None},        # labelled where they stand
    {"attr_pass": "last"},                                         # any label: never read
    {"attr_pass": "value", "attr_value": None},                    # None: ignored too
    {"attr_pass": "value", "attr_value": -1},
    {"attr_pass": "value", "attr_value": 999},
    {"attr_pass": "value", "attr_value": "x"},
    # placeholders and the output labelled too: split_module reads no label there either
    {"skip": ("get_attr",)},
    {"skip": ("placeholder", "get_attr")},
    {"skip": (), "attr_pass": None},
])
def test_split_labels_get_attr_labels_are_ignored(flags):
    """split_module asks for no label of a get_attr node, so none is required and any
    entry there, whatever its value, is ignored (vLLM's split_graph labels them where they
    stand)."""
    assert check_split_labels(make_split_labels(**flags))


def placeholders_labelled(value):
    """The reference, plus a label of any value on every placeholder and the output."""
    ref = make_split_labels()

    def split_labels(gm, ops):
        labels = ref(gm, ops)
        for n in gm.graph.nodes:
            if n.op in ("placeholder", "output"):
                labels[n] = value
        return labels
    return split_labels


@pytest.mark.parametrize("value", [None, -1, 7, "x"])
def test_split_labels_placeholder_and_output_labels_are_ignored(value):
    """The text says a label on a placeholder, the output or a get_attr node is ignored
    (split_module asks for none): any value there passes."""
    assert check_split_labels(placeholders_labelled(value))


def compact_with_get_attr(gm, ops):
    """A compact numbering (no id unused) that labels get_attr nodes where they stand, so
    that a get_attr opens a piece: on the text's `attend, attend_1, add` it gives 0, 1, 2
    where vLLM gives 1, 3, 4."""
    labels, sid, kind = {}, -1, None
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if node.op == "call_function" and node.target in ops:
            sid += 1
            labels[node] = sid
            kind = "split"
        else:
            if kind != "piece":
                sid += 1
                kind = "piece"
            labels[node] = sid
    return labels


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_split_labels_compact_numbering_is_caught(seed):
    r = check_split_labels(compact_with_get_attr, seed=seed)
    assert not r and "the ids are not vLLM's" in r.message, r.message


def test_split_labels_checks_the_texts_own_examples():
    """The graphs include the text's examples, `relu, attend, add` (0, 1, 2) and `attend,
    attend_1, add` (1, 3, 4), with no get_attr node at all."""
    from labkit.checks.lesson09.split_labels import _hand_built, reference_split_labels

    gen = torch.Generator().manual_seed(0)
    seen = set()
    for which in (0, 1):
        gm, ops, _, _ = _hand_built(gen, "text", which)
        labels = reference_split_labels(gm, ops)
        seen.add(tuple((n.name, labels[n]) for n in gm.graph.nodes if n in labels))
        assert not [n for n in gm.graph.nodes if n.op == "get_attr"]
    assert seen == {(("relu", 0), ("attend", 1), ("add", 2)),
                    (("attend", 1), ("attend_1", 3), ("add", 4))}


def test_split_labels_get_attr_placement_varies():
    """In the graphs one check draws, some split op reads a get_attr made right before it
    and some do not (a split op first, two in a row, one reading a hoisted get_attr or no
    attribute at all): a labelling that lets a get_attr open a piece is caught."""
    from labkit.checks.lesson09.split_labels import CASES, _hand_built

    gen = torch.Generator().manual_seed(0)
    before = []
    for trial in range(12):
        case = CASES[trial % len(CASES)]
        if case == "model":
            continue
        gm, ops, _, _ = _hand_built(gen, case)
        nodes = [n for n in gm.graph.nodes if n.op != "placeholder"]
        before += [i > 0 and nodes[i - 1].op == "get_attr" for i, n in enumerate(nodes)
                   if n.op == "call_function" and n.target in ops]
    assert any(before) and not all(before), before


def test_split_labels_missing_label_names_the_nodes_that_need_none():
    ref = make_split_labels()

    def only_split_ops(gm, ops):
        return {n: v for n, v in ref(gm, ops).items() if v % 2 == 1}
    r = check_split_labels(only_split_ops)
    assert not r and "has no label: every node except the placeholders, the output and " \
        "get_attr nodes gets one" in r.message, r.message


def test_split_labels_on_lesson_09s_model_first():
    """Trial 1 is the lesson's own model: a mistake is reported there first."""
    r = check_split_labels(make_split_labels(second_add=False))
    assert not r and "trial 1 (lesson 09's model" in r.message


def test_split_labels_blank_raise_and_not_a_function():
    def blank(gm, ops):
        raise NotImplementedError()
    assert check_split_labels(blank).kind == "not_implemented"

    def crashes(gm, ops):
        return {n: n.meta["id"] for n in gm.graph.nodes}
    r = check_split_labels(crashes)
    assert not r and r.kind == "exception" and "KeyError" in r.message
    r = check_split_labels(None)
    assert not r and "expected your function split_labels" in r.message


def test_split_labels_int_values_and_foreign_nodes():
    ref = make_split_labels()
    r = check_split_labels(lambda gm, ops: {n: float(v) for n, v in ref(gm, ops).items()})
    assert not r and "labels are subgraph ids, ints" in r.message

    def other_graph(gm, ops):
        labels = ref(gm, ops)
        g = torch.fx.Graph()
        labels[g.placeholder("stranger")] = 0
        return labels
    r = check_split_labels(other_graph)
    assert not r and "not a node of gm.graph" in r.message


def test_split_labels_decreasing_ids():
    """Pieces numbered backwards: ids must increase in node order."""
    ref = make_split_labels()

    def backwards(gm, ops):
        labels = ref(gm, ops)
        top = max(labels.values())
        return {n: top - v for n, v in labels.items()}
    r = check_split_labels(backwards)
    assert not r and "ids must increase in node order" in r.message


def test_split_labels_pieces_cut_without_a_split_op():
    """A new id in the middle of a piece (e.g. at every call_module) is named."""
    def cut_at_modules(gm, ops):
        labels, sid = {}, 0
        for node in gm.graph.nodes:
            if node.op in ("placeholder", "output", "get_attr"):
                continue
            if (node.op == "call_function" and node.target in ops) or node.op == "call_module":
                sid += 1
                labels[node] = sid
                sid += 1
            else:
                labels[node] = sid
        for node in gm.graph.nodes:
            if node.op == "get_attr":
                labels[node] = labels[next(u for u in node.users if u in labels)]
        return labels
    r = check_split_labels(cut_at_modules)
    assert not r and "have no split op between them but different ids" in r.message


def test_split_labels_graphs_hold_every_case():
    """The hand-built graphs: no split op, one, several with two in a row, first and last,
    two ops with a decoy; get_attr nodes read first by a split op and hoisted ones."""
    from labkit.checks.lesson09.split_labels import CASES, _hand_built, mix

    gen = torch.Generator().manual_seed(0)
    seen = {}
    for case in CASES[1:]:
        gm, ops, _, _ = _hand_built(gen, case)
        nodes = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
        calls = [n for n in nodes if n.op == "call_function" and n.target in ops]
        seen[case] = (nodes, calls, ops)
    assert not seen["none"][1] and len(seen["one"][1]) == 1
    nodes, calls, _ = seen["several"]
    real = [n for n in nodes if n.op != "get_attr"]
    assert any(real[real.index(a) + 1] is b for a, b in zip(calls, calls[1:]))  # in a row
    nodes, calls, _ = seen["ends"]
    real = [n for n in nodes if n.op != "get_attr"]
    assert real[0] is calls[0] and real[-1] is calls[-1]
    nodes, calls, ops = seen["two ops"]
    assert {c.target for c in calls} == set(ops) and len(ops) == 2
    assert any(getattr(n.target, "__name__", "") == "mix_norm" for n in nodes)
    # a twin: a call of another function with exactly the name of one in ops
    twins = [n for n in nodes if n.op == "call_function" and n.target not in ops
             and any(n.target.__name__ == op.__name__ and n.target.__qualname__ ==
                     op.__qualname__ and n.target.__module__ == op.__module__ for op in ops)]
    assert twins
    attrs = [n for case in seen for n in seen[case][0] if n.op == "get_attr"]
    assert any(next(iter(a.users)).target is mix for a in attrs)     # read first by a split op
    # a hoisted get_attr read before a split op and after it (its first user matters)
    nodes, calls, _ = seen["one"]
    first = [n for n in nodes if n.op == "get_attr"][0]
    users = list(first.users)
    assert nodes.index(users[0]) < nodes.index(calls[0]) < nodes.index(users[-1])


# ---- exercise 2: replay_piece ---------------------------------------------------------------

def make_replay_piece(*, copy="ptr", rows=True, replay=1, copy_after=False, ret="output",
                      numbers="!=", wrong_direction=False, replace=False, zero_pad=False,
                      setitem=False, exc=RuntimeError, message="values",
                      raise_after_replay=False, host=None, check_first=False, bug=False):
    """The reference, with one mistake (or a harmless variation) switched on by each flag."""
    def replay_piece(graph, static_args, output, args):
        def moved(new, static):
            if copy == "ptr":
                return new.data_ptr() != static.data_ptr()
            if copy == "storage":                 # the storage's address: misses a view
                return new.untyped_storage().data_ptr() != static.untyped_storage().data_ptr()
            if copy == "equal":                   # by value: a host read every step
                return not torch.equal(new, static[: new.size(0)])
            if copy == "is":
                return new is not static
            if copy == "shape":
                return new.shape != static.shape
            if copy == "all":
                return True
            return False                          # copy == "none"

        def copy_in(i, new, static):
            if replace:
                static_args[i] = new
            elif wrong_direction:
                new.copy_(static[: new.size(0)])
            elif zero_pad:
                static.zero_()
                static[: new.size(0)].copy_(new)
            elif not rows:
                static.copy_(new)
            elif setitem:
                static[: new.shape[0]] = new
            else:
                static[: new.size(0)].copy_(new)
            if host == "item":                    # a sanity check that syncs
                assert not torch.isnan(static).any().item()
            elif host == "tolist":
                assert static.tolist()
            elif host == "bool":
                if (static != static).any():
                    raise RuntimeError("nan")
            elif host == "int":
                int(new[0, 0] * 0)

        def differs(new, static):
            return {"!=": new != static, "is": new is not static, "any": True, "none": False,
                    "int": int(new) != int(static)}[numbers]

        def refuse(i, new, static):
            text = {"values": f"argument {new!r} differs from the {static!r} it was captured "
                              f"with",
                    "position": f"argument {i} differs",
                    "none": "a non-tensor argument changed"}[message]
            if exc == "assert":
                assert False, text
            return exc(text)

        if check_first:          # every number checked before anything is copied
            for i, (new, static) in enumerate(zip(args, static_args)):
                if not isinstance(new, torch.Tensor) and differs(new, static):
                    raise refuse(i, new, static)
        todo, err = [], None
        for i, (new, static) in enumerate(zip(args, static_args)):
            if not isinstance(new, torch.Tensor):
                if differs(new, static):
                    if bug:
                        new.rows                  # an AttributeError of the learner's
                    err = refuse(i, new, static)
                    if not raise_after_replay:
                        raise err
            elif moved(new, static):
                todo.append((i, new, static))
        if not copy_after:
            for t in todo:
                copy_in(*t)
        for _ in range(replay):
            graph.replay()
        if err is not None:
            raise err
        if copy_after:
            for t in todo:
                copy_in(*t)
        if ret == "output":
            return output
        if ret == "clone":
            return tuple(o.clone() for o in output) if isinstance(output, tuple) else output.clone()
        if ret == "first":
            return output[0] if isinstance(output, tuple) else output
        if ret == "list":
            return list(output) if isinstance(output, tuple) else output
        if ret == "graph":
            return graph
        return None
    return replay_piece


class ArgumentChanged(RuntimeError):
    """A learner's own RuntimeError subclass."""


def test_replay_piece_reference_passes(B, capsys):
    assert check_replay_piece(make_replay_piece(), B=B, trials=8, seed=2)
    assert "✅ replay_piece" in capsys.readouterr().out
    assert_usable(B)


def test_replay_piece_checker_reference_passes():
    from labkit.checks.lesson09.replay_piece import reference_replay_piece
    assert check_replay_piece(reference_replay_piece)


@pytest.mark.parametrize("flags", [
    {"setitem": True},              # static[:n] = new
    {"message": "position"},        # the message names the position only
    {"exc": ArgumentChanged},       # a RuntimeError subclass
    {"check_first": True},          # every number checked first, then copies and the replay
    {"check_first": True, "message": "position"},
])
def test_replay_piece_harmless_variations_pass(flags):
    assert check_replay_piece(make_replay_piece(**flags), trials=6)


@pytest.mark.parametrize("flags, words", [
    ({"copy": "none"}, "a stale result: argument"),
    ({"copy": "all"}, "arrived in new memory"),
    ({"copy": "is"}, "comparing the objects, `is`, says that every view moved"),
    ({"copy": "shape"}, "decide by data_ptr(), not by shape"),
    # a view into the captured tensor's buffer at another offset: same storage, moved rows
    ({"copy": "storage"}, "compare data_ptr() (the address of the tensor's first element), "
                          "not the storage's"),
    ({"rows": False}, "one row per real token"),
    ({"zero_pad": True}, "only the first"),
    ({"replay": 0}, "did not replay the graph"),
    ({"replay": 2}, "replayed the graph twice"),
    ({"copy_after": True}, "after graph.replay()"),
    ({"ret": "none"}, "returned None"),
    ({"ret": "clone"}, "the right values, but in new tensors"),
    ({"ret": "graph"}, "returned the graph"),
    ({"ret": "first"}, "returned one tensor, but the piece returns a tuple"),
    ({"ret": "list"}, "returned a new list holding output's tensors, not output itself"),
    ({"numbers": "none"}, "Raise a RuntimeError naming the argument"),
    ({"numbers": "is"}, "a float arrives as a new object every call"),
    ({"numbers": "any"}, "refused a step where every argument was right"),
    # a float changed by less than 1, without crossing an integer
    ({"numbers": "int"}, "differ by less than 1: compare the values themselves"),
    ({"replace": True}, "replaced static_args["),
    ({"wrong_direction": True}, "Copy it INTO the captured tensor"),
    # only a RuntimeError refuses, and its message names the argument
    ({"exc": ValueError}, "refused it with a ValueError, not a RuntimeError"),
    ({"exc": Exception}, "refused it with an Exception, not a RuntimeError"),
    ({"exc": "assert"}, "refused it with an assert (AssertionError)"),
    ({"message": "none"}, "RuntimeError('a non-tensor argument changed'), which names no "
                          "argument"),
    ({"raise_after_replay": True}, "raised, but only after replaying the graph once"),
    # reading values on the host: a sync every step
    ({"copy": "equal"}, "reads tensor values back to the host (torch.equal, at line"),
    ({"host": "item"}, "reads tensor values back to the host (.item(), int(t), float(t) or "
                       "an `if` on a tensor, at line"),
    ({"host": "tolist"}, "reads tensor values back to the host (.tolist(), at line"),
    ({"host": "bool"}, "reads tensor values back to the host (.item(), int(t)"),
    ({"host": "int"}, "a device→host sync on every step; decide by data_ptr()"),
])
def test_replay_piece_mistakes(flags, words):
    r = check_replay_piece(make_replay_piece(**flags))
    assert not r and words in r.message, r.message
    assert_usable(E)


def test_replay_piece_a_host_read_names_its_line_and_first_hint():
    r = check_replay_piece(make_replay_piece(copy="equal"))
    assert not r and "`return not torch.equal(new, static[: new.size(0)])`" in r.message
    assert "data_ptr()" in r.more_hints[0], r.more_hints


def test_replay_piece_other_exceptions_are_bugs_not_refusals():
    """Only a RuntimeError of the learner's own refuses: another exception, on a right
    step or on the changed one, is reported as a bug, with its line."""
    r = check_replay_piece(make_replay_piece(numbers="any", exc=ValueError))
    assert not r and r.kind == "exception"
    assert "your code raised ValueError" in r.message and "refused a step" not in r.message
    assert "at line" in r.message
    r = check_replay_piece(make_replay_piece(bug=True))
    assert not r and "your code raised AttributeError" in r.message, r.message
    assert "That is a bug in your code, not a refusal" in r.message and "new.rows" in r.message


def test_replay_piece_the_refusing_step_replays_nothing():
    """The replays on the step with the changed number are counted: none is allowed."""
    r = check_replay_piece(make_replay_piece(raise_after_replay=True, check_first=False))
    assert not r and "check every argument before graph.replay()" in r.message
    assert check_replay_piece(make_replay_piece(check_first=True))


def test_replay_piece_changed_float_stays_within_its_integer():
    """The changed float differs by a non-integer amount without crossing an integer, so
    int(new) != int(static) misses it; the changed int is another int."""
    from labkit.checks.lesson09.replay_piece import _Trial

    gen = torch.Generator().manual_seed(3)
    for number in (float, float, int):
        t = _Trial(make_replay_piece(), E, gen, number)
        seen = []

        def spy(graph, static_args, output, args, t=t):
            seen.extend(a for a in args if not isinstance(a, torch.Tensor))
            return make_replay_piece()(graph, static_args, output, args)
        t.fn = spy
        assert t.changed_number() is None
        new = seen[-1]
        assert new != t.num and int(new) == int(t.num) if number is float else \
            isinstance(new, int) and new != t.num


def test_replay_piece_host_reads_spares_labkit_and_the_reference():
    """HostReads notes the learner's own reads only: a graph's replay, data_ptr() and the
    reference's comparisons of Python numbers are none."""
    from labkit.checks.lesson09._common import HostReads

    reads = HostReads()
    x = torch.arange(6.0)
    with reads:
        x.data_ptr()
        x.untyped_storage().data_ptr()
        _ = x.shape, x.size(0), len(x)
        x[:3].copy_(x[3:])
    assert reads.message() is None
    with reads:
        float(x[0])
    assert ".item(), int(t), float(t)" in reads.message()
    assert "test_checks_lesson09.py" in reads.message()


def _replay_piece_with(copy_in=None, moved=None, ret=None):
    """The reference with its copy, its test of a moved tensor or its return replaced."""
    def replay_piece(graph, static_args, output, args):
        for new, static in zip(args, static_args):
            if not isinstance(new, torch.Tensor):
                if new != static:
                    raise RuntimeError(f"argument {new!r} differs from {static!r}")
            elif (moved or (lambda n, s: n.data_ptr() != s.data_ptr()))(new, static):
                (copy_in or (lambda s, n: s[: n.size(0)].copy_(n)))(static, new)
        graph.replay()
        return (ret or (lambda o: o))(output)
    return replay_piece


def test_replay_piece_a_new_tuple_of_a_list_output_is_caught():
    """tuple(output) is output itself for a tuple, a new object for a list: the pieces
    return a list too."""
    r = check_replay_piece(_replay_piece_with(
        ret=lambda o: tuple(o) if isinstance(o, (tuple, list)) else o))
    assert not r and "returned a new tuple holding output's tensors" in r.message, r.message


def test_replay_piece_trials_return_lists_too():
    from labkit.checks.lesson09.replay_piece import _Trial

    gen = torch.Generator().manual_seed(0)
    outs = {type(_Trial(None, E, gen, int, out_kind=k).output).__name__
            for k in ("tensor", "tuple", "list")}
    assert outs == {"Tensor", "tuple", "list"}


def test_replay_piece_same_address_with_fewer_rows_is_not_copied():
    """A tensor at the captured address with fewer rows (the captured memory's first
    rows) is the captured memory itself: copying it because its shape differs is named."""
    r = check_replay_piece(_replay_piece_with(
        moved=lambda n, s: n.shape != s.shape or n.data_ptr() != s.data_ptr()))
    assert not r and "same data_ptr()" in r.message and "not by shape" in r.message, r.message


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_replay_piece_numbers_compared_after_rounding_are_caught(seed):
    """A float changed by a hair (0.01 to 0.04) rounds back to the captured value."""
    def rounds(graph, static_args, output, args):
        for i, (new, static) in enumerate(zip(args, static_args)):
            if not isinstance(new, torch.Tensor):
                if round(new, 1) != round(static, 1):
                    raise RuntimeError(f"argument {i} is {new!r}, captured with {static!r}")
            elif new.data_ptr() != static.data_ptr():
                static[: new.size(0)].copy_(new)
        graph.replay()
        return output
    r = check_replay_piece(rounds, seed=seed)
    assert not r and "not int(new) or a rounded value" in r.message, r.message


def test_replay_piece_trials_pass_a_same_address_tensor_with_fewer_rows():
    from labkit.checks.lesson09.replay_piece import _Trial

    gen = torch.Generator().manual_seed(0)
    t = _Trial(None, E, gen, int)
    i = t.kinds.index("head")
    new, static = t.args_for(2)[i], t.static_args[i]
    assert new.data_ptr() == static.data_ptr() and new.shape != static.shape


@pytest.mark.parametrize("copy_in, words", [
    (lambda s, n: s[-n.size(0):].copy_(n), "into rows"),                  # the last rows
    (lambda s, n: s[1: n.size(0) + 1].copy_(n), "into rows 1.."),         # one row down
    (lambda s, n: s[: n.size(0) - 1].copy_(n[:-1]), "one row short"),     # n - 1 rows
])
def test_replay_piece_copies_into_the_wrong_rows_are_named(copy_in, words):
    """A copy that went to the wrong rows, or one row short, is not "not copied"."""
    r = check_replay_piece(_replay_piece_with(copy_in=copy_in))
    assert not r and words in r.message and "was not copied" not in r.message, r.message


def test_replay_piece_mistakes_on_every_backend(B):
    for flags, words in (({"copy": "none"}, "stale result"),
                         ({"copy": "is"}, "copy only where new.data_ptr() != static"),
                         ({"numbers": "none"}, "Raise a RuntimeError"),
                         ({"copy": "equal"}, "reads tensor values back to the host")):
        r = check_replay_piece(make_replay_piece(**flags), B=B)
        assert not r and words in r.message, r.message


def test_replay_piece_blank_and_not_a_function():
    def blank(graph, static_args, output, args):
        raise NotImplementedError()
    assert check_replay_piece(blank).kind == "not_implemented"
    assert "expected your function replay_piece" in check_replay_piece(3).message


def test_replay_piece_trials_cover_ints_floats_tuples_and_views():
    from labkit.checks.lesson09.replay_piece import _Trial

    gen = torch.Generator().manual_seed(0)
    a, b = _Trial(None, E, gen, int), _Trial(None, E, gen, float)
    assert isinstance(a.num, int) and isinstance(b.num, float)
    assert {"attn", "view", "prev", "ids", "num"} <= set(a.kinds)
    # the view: the captured tensor's storage, another data_ptr()
    i = a.kinds.index("view")
    new, static = a.args_for(2)[i], a.static_args[i]
    assert new.untyped_storage().data_ptr() == static.untyped_storage().data_ptr()
    assert new.data_ptr() != static.data_ptr()


# ---- exercise 3: greedy_accept --------------------------------------------------------------

def make_greedy_accept(*, count="cumprod", view="bs", shift=0, cols="all", order="at",
                       dtype=None, host=None, inplace=False, memo=None, via_cumsum=False):
    """The reference, with one mistake (or a harmless variation) switched on by each flag.
    ``memo``: results kept from an earlier call, by shape ("shape": wrong when called
    again with new inputs) or by the inputs' address ("ptr": right eagerly, but the
    capture records no work, so the replays repeat the captured call's result)."""
    cache = {}

    def greedy_accept(draft_tokens, target_logits):
        bs, k = draft_tokens.shape
        key = (bs, k) if memo == "shape" else (draft_tokens.data_ptr(), target_logits.data_ptr())
        if memo and key in cache:
            return cache[key]
        if view == "bs":
            t = target_logits.view(bs, k + 1, -1).argmax(-1)
        else:
            t = target_logits.view(k + 1, bs, -1).argmax(-1).T
        if inplace:
            draft_tokens.clamp_(0, target_logits.size(-1) - 1).mul_(1)
            draft_tokens.add_(0)
        agree = (draft_tokens == t[:, shift:shift + k]).long()
        if host == "item":
            acc = []
            for i in range(bs):
                n = 0
                while n < k and agree[i, n].item():
                    n += 1
                acc.append(n)
            accepted = torch.tensor(acc, device=draft_tokens.device)
        elif host == "tolist":
            accepted = torch.tensor([next((j for j, a in enumerate(row) if not a), k)
                                     for row in agree.tolist()], device=draft_tokens.device)
        elif host == "nonzero":
            miss = (agree == 0).nonzero()
            accepted = torch.full((bs,), k, device=draft_tokens.device)
            for i, j in miss.flip(0):
                accepted[i] = j
        elif host == "if":
            accepted = agree.cumprod(1).sum(1) if bool(agree.all()) is False else \
                torch.full((bs,), k, device=draft_tokens.device)
        elif count == "cumprod":
            accepted = ((1 - agree).cumsum(1) == 0).sum(1) if via_cumsum else \
                agree.cumprod(1).sum(1)
        elif count == "sum":
            accepted = agree.sum(1)
        elif count == "argmax":
            accepted = (1 - agree).argmax(1)
        elif count == "bonus":
            accepted = agree.cumprod(1).sum(1) + 1
        if dtype is not None:
            accepted = accepted.to(dtype)
        tokens = t if cols == "all" else t[:, :k]
        out = (accepted, tokens) if order == "at" else (tokens, accepted)
        if memo:
            cache[key] = out
        return out
    return greedy_accept


def test_greedy_accept_reference_passes(B, capsys):
    assert check_greedy_accept(make_greedy_accept(), B=B, trials=8, seed=1)
    assert check_greedy_accept(make_greedy_accept(via_cumsum=True), B=B)
    assert capsys.readouterr().out.count("✅ greedy_accept") == 2
    assert_usable(B)


def test_greedy_accept_with_labkit_greedy_passes():
    from labkit.decode import greedy

    def with_greedy(draft_tokens, target_logits):
        bs, k = draft_tokens.shape
        t = greedy(target_logits.view(bs, k + 1, -1))
        agree = (draft_tokens == t[:, :k]).long()
        return agree.cumprod(1).sum(1), t
    assert check_greedy_accept(with_greedy)


@pytest.mark.parametrize("flags, words", [
    ({"count": "sum"}, "also those after the first mismatch"),
    ({"count": "argmax"}, "argmax of the mismatch mask is 0"),
    ({"count": "bonus"}, "count draft tokens only"),
    ({"shift": 1}, "one position off"),
    ({"view": "kb"}, "request-major"),
    ({"cols": "k"}, "target_tokens has k + 1 columns"),
    ({"order": "ta"}, "the order is (accepted, target_tokens)"),
    ({"dtype": torch.int32}, "expected torch.int64"),
    ({"dtype": torch.bool}, "expected torch.int64"),
    ({"host": "item"}, "aten._local_scalar_dense"),
    ({"host": "tolist"}, "no .item(), .tolist()"),
    ({"host": "nonzero"}, "capturing your greedy_accept failed"),
    ({"host": "if"}, "capturing your greedy_accept failed"),
    ({"inplace": True}, "changed its inputs"),
    # a result kept from an earlier call: wrong eagerly too, named as a logic mistake
    ({"memo": "shape"}, "called again with new draft tokens and logits: target_tokens["),
    # right eagerly, but the capture recorded no work: the replays repeat one result
    ({"memo": "ptr"}, "after capture, replay 1 with new draft tokens and logits is wrong "
                      "(your function called eagerly on them is right)"),
])
def test_greedy_accept_mistakes(flags, words):
    r = check_greedy_accept(make_greedy_accept(**flags))
    assert not r and words in r.message, r.message
    assert_usable(E)


def _greedy_accept_with(result):
    """The reference's values, returned as ``result(accepted, target_tokens, agree,
    draft_tokens)`` makes them."""
    def greedy_accept(draft_tokens, target_logits):
        bs, k = draft_tokens.shape
        t = target_logits.view(bs, k + 1, -1).argmax(-1)
        agree = draft_tokens == t[:, :k]
        return result(agree.long().cumprod(1).sum(1), t, agree, draft_tokens)
    return greedy_accept


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_greedy_accept_target_tokens_cast_to_the_drafts_dtype(seed):
    """The drafts come as int64 or int32: target_tokens cast to theirs is caught."""
    r = check_greedy_accept(_greedy_accept_with(lambda a, t, agree, d: (a, t.to(d.dtype))),
                            seed=seed)
    assert not r and "the dtype of draft_tokens" in r.message, r.message


def test_greedy_accept_trials_vary_the_drafts_dtype():
    r = check_greedy_accept(make_greedy_accept(), trials=6)
    assert r
    from labkit.checks.lesson09.greedy_accept import _dtypes

    gen = torch.Generator().manual_seed(0)
    assert {_dtypes(gen, t)[0] for t in range(6)} == {torch.int64, torch.int32}


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_greedy_accept_batch_minimum_is_named(seed):
    """Every request given the batch's smallest count: not "one position off"."""
    r = check_greedy_accept(_greedy_accept_with(
        lambda a, t, agree, d: (a.min().expand(a.shape).clone(), t)), seed=seed)
    assert not r and "minimum" in r.message and "one position off" not in r.message, r.message


@pytest.mark.parametrize("as_long", [False, True])
def test_greedy_accept_agreement_mask_as_target_tokens_is_named(as_long):
    r = check_greedy_accept(_greedy_accept_with(
        lambda a, t, agree, d: (a, agree.long() if as_long else agree)))
    assert not r and "agreement mask" in r.message, r.message
    assert "at the k draft positions only" not in r.message


def test_greedy_accept_host_read_on_every_backend(B):
    r = check_greedy_accept(make_greedy_accept(host="item"), B=B)
    assert not r and r.kind == "exception" and "nothing may wait for the device" in r.message
    assert_usable(B)


def test_greedy_accept_hints_follow_the_mistake():
    """A host read gets the host-read hint first; a wrong replay the replay hint."""
    r = check_greedy_accept(make_greedy_accept(host="tolist"))
    assert not r and r.more_hints[0].startswith("Inside a graph nothing may wait"), r.more_hints
    r = check_greedy_accept(make_greedy_accept(memo="ptr"))
    assert not r and r.more_hints[0].startswith("A replay runs only the device work")
    r = check_greedy_accept(make_greedy_accept(count="sum"))
    assert not r and r.more_hints[0].startswith("t = argmax")


def test_greedy_accept_returns_nonsense():
    for got, words in ((None, "did you forget"), (3, "expected a tuple of two tensors"),
                       ((1, 2, 3), "a tuple of 3")):
        r = check_greedy_accept(lambda d, logits, got=got: got)
        assert not r and words in r.message, r.message

    def blank(draft_tokens, target_logits):
        raise NotImplementedError()
    assert check_greedy_accept(blank).kind == "not_implemented"


def test_greedy_accept_cases_hold_every_kind_of_row():
    from labkit.checks.lesson09.greedy_accept import _case, reference_greedy_accept

    gen = torch.Generator().manual_seed(0)
    d, logits = _case(gen, 6, 4, 20, "cpu")
    acc, t = reference_greedy_accept(d, logits)
    assert 4 in acc.tolist() and 0 in acc.tolist()
    agree = d == t[:, :4]
    # a row where a draft token agrees again after the first mismatch
    assert any(bool(agree[i, int(acc[i]) + 1:].any()) for i in range(6) if acc[i] < 3)


# ---- exercise 4: capture_batch --------------------------------------------------------------

def _lens(model, n, zero_ok=False):
    L = model.args.max_seq_len
    tail = [n % L] if (n % L or zero_ok) else []
    return [L] * (n // L) + tail


def make_capture_batch(*, slot=0, split=True, restart=True, count=0, mode=ForwardMode.EXTEND,
                       loc="index", cpu_lens="same", ext="lens", zero_tail=False,
                       ids="zeros", lens_order="full first", dtypes=None, seq="lens",
                       start=0, pool_index=None):
    """The reference, with one mistake (or a harmless variation) switched on by each flag.
    ``dtypes``: {field: dtype} overriding the text's; ``seq``: "lens" or "full" (every
    request max_seq_len long, its tokens at the end: a prefix); ``start``: the first
    position of every request; ``pool_index``: req_pool_indices' value (else ``slot``)."""
    dt = {"input_ids": torch.int64, "positions": torch.int64, "out_cache_loc": torch.int64,
          "req_pool_indices": torch.int64, "seq_lens": torch.int32, **(dtypes or {})}

    def capture_batch(model, num_tokens):
        L = model.args.max_seq_len
        n = num_tokens + count
        lens = _lens(model, n, zero_ok=zero_tail) if split else [n]
        if start:
            cut = L - start          # positions start..L-1 at most
            lens = [x for m in lens for x in ([m] if m <= cut else [cut, m - cut])]
        if lens_order == "rest first":
            lens = lens[::-1]
        elif lens_order == "even":        # ceil(n / L) requests of (nearly) equal length
            k = -(-n // L)
            lens = [n // k + (i < n % k) for i in range(k)]
        dev = model.device
        s = model.num_slots - 1 if slot == "last" else slot
        if seq == "full":
            pos = torch.cat([torch.arange(L - x, L, device=dev) for x in lens])
            seq_lens = [L] * len(lens)
        else:
            pos = (torch.cat([torch.arange(start, start + x, device=dev) for x in lens])
                   if restart else torch.arange(n, device=dev))
            seq_lens = list(lens)        # with start: positions run past seq_len
        row = model.req_to_token[s]
        if loc == "index":
            locs = row.index_select(0, pos)
        elif loc == "slice":
            locs = row[:n]
        elif loc == "mod":
            locs = row.index_select(0, pos % L)
        elif loc == "pos":       # location == position: true of an identity table only
            locs = pos.clone()
        elif loc == "next":      # slot 0's locations, one position off
            locs = row.index_select(0, (pos + 1).clamp(max=L - 1))
        elif loc == "minus1":    # vLLM's "skip this token" slot mapping
            locs = torch.full_like(pos, -1)
        else:   # "arange": pool locations 0..n-1
            locs = torch.arange(n, device=dev)
        idx = s if pool_index is None else pool_index
        return ForwardBatch(
            forward_mode=mode,
            input_ids=(torch.zeros(n, device=dev) if ids == "zeros"
                       else torch.randint(0, model.args.vocab_size, (n,), device=dev)
                       ).to(dt["input_ids"]),
            positions=pos.to(dt["positions"]),
            out_cache_loc=locs.to(dt["out_cache_loc"]),
            req_pool_indices=torch.full((len(lens),), idx, dtype=dt["req_pool_indices"],
                                        device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=dt["seq_lens"], device=dev),
            seq_lens_cpu={"same": seq_lens, "one": [n], "tensor": torch.tensor(seq_lens),
                          "tuple": tuple(seq_lens)}[cpu_lens],
            extend_lens={"lens": lens, None: None, "tensor": torch.tensor(lens),
                         "tuple": tuple(lens)}[ext],
        )
    return capture_batch


def extend_batch_in_slot0(model, num_tokens):
    from labkit.decode import make_extend_batch

    return make_extend_batch(model, [DUMMY_SLOT], [[0] * num_tokens])


def test_capture_batch_reference_passes(B, capsys):
    assert check_capture_batch(reference_capture_batch, B=B)
    assert check_capture_batch(make_capture_batch(), B=B, trials=3, seed=5)
    assert capsys.readouterr().out.count("✅ capture_batch") == 2
    assert_usable(B)


@pytest.mark.parametrize("flags", [
    {"ids": "random"},              # any token ids in the vocabulary
    {"lens_order": "rest first"},   # the partial request first
    {"lens_order": "even"},         # any split into requests of at most max_seq_len
])
def test_capture_batch_harmless_variations_pass(flags):
    assert check_capture_batch(make_capture_batch(**flags), B=E)


@pytest.mark.parametrize("fn, words", [
    (broken_capture_batch, "req_pool_indices holds slot 1: slots 1..3 belong to requests"),
    (make_capture_batch(slot="last"), "req_pool_indices holds slot 3"),
    (extend_batch_in_slot0, "make_extend_batch (and make_decode_batch) refuse slot 0"),
    (make_capture_batch(split=False), "one request holds at most"),
    (make_capture_batch(split=False, loc="slice"), "slot 0 has"),
    (make_capture_batch(restart=False), "its positions start again at 0"),
    (make_capture_batch(restart=False, loc="mod"), "each request has its own positions, from 0"),
    (make_capture_batch(zero_tail=True), "is a multiple of max_seq_len"),
    (make_capture_batch(count=1), "the capture batch has exactly num_tokens tokens"),
    (make_capture_batch(count=-1), "the bucket is"),
    (make_capture_batch(mode=ForwardMode.DECODE), "ForwardMode.EXTEND"),
    (make_capture_batch(cpu_lens="one"), "seq_lens_cpu"),
    (make_capture_batch(ext=None), "extend_lens is None"),
    # the models' req_to_token is a permutation: locations must be looked up in it
    (make_capture_batch(loc="arange"), "a live request's: attention stores each token's K/V"),
    (make_capture_batch(loc="pos"), "your locations equal the positions: that holds for an "
                                    "identity table only"),
    (make_capture_batch(loc="next"), "for position 0 of slot 0 (out_cache_loc[0]) is not "
                                     "req_to_token[0, 0] = 0"),
    (make_capture_batch(loc="minus1"), "there is no 'skip' location"),
    # every request starts at position 0: seq_lens == extend_lens
    (make_capture_batch(seq="full"), "but a request of"),
    (make_capture_batch(start=1), "but every capture request starts at position 0"),
    # the dtypes the text lists, a message per field
    (make_capture_batch(dtypes={"seq_lens": torch.int64}),
     "batch.seq_lens is torch.int64; the text asks for torch.int32"),
    (make_capture_batch(dtypes={"input_ids": torch.int32}),
     "batch.input_ids is torch.int32; the text asks for torch.int64"),
    (make_capture_batch(dtypes={"input_ids": torch.float32}), "batch.input_ids is torch.float32"),
    (make_capture_batch(dtypes={"positions": torch.int32}), "batch.positions is torch.int32"),
    (make_capture_batch(dtypes={"out_cache_loc": torch.int32}),
     "batch.out_cache_loc is torch.int32"),
    (make_capture_batch(dtypes={"req_pool_indices": torch.int32}),
     "batch.req_pool_indices is torch.int32"),
    # host lists
    (make_capture_batch(cpu_lens="tensor"), "seq_lens_cpu is a tensor (torch.int64, on cpu); "
                                            "it is host data: a list of Python ints"),
    (make_capture_batch(ext="tensor"), "extend_lens is a tensor"),
    (make_capture_batch(ext="tuple"), "extend_lens is ("),
    # slots: -1 is the last row, a live request's; past the table's rows
    (make_capture_batch(slot=-1), "-1 is row 3, slot 3, a live request's slot"),
    (make_capture_batch(pool_index=4), "req_pool_indices holds 4, but req_to_token has rows "
                                       "0..3 only"),
])
def test_capture_batch_mistakes(fn, words):
    r = check_capture_batch(fn, B=E)
    assert not r and words in r.message, r.message


def test_capture_batch_seq_lens_message_names_seq_lens():
    r = check_capture_batch(make_capture_batch(seq="full"), B=E)
    assert not r and "seq_lens[0] is" in r.message and \
        "starting at position 0 has length" in r.message, r.message


def test_capture_batch_layout_mistakes_get_the_layout_hint_first():
    for fn in (make_capture_batch(seq="full"), make_capture_batch(start=1),
               make_capture_batch(ext="tensor"), make_capture_batch(zero_tail=True)):
        r = check_capture_batch(fn, B=E)
        assert not r and r.more_hints[0].startswith("Every request of the capture batch is "
                                                     "a fresh prefill in slot 0"), r.message
    r = check_capture_batch(broken_capture_batch, B=E)
    assert not r and r.more_hints[0].startswith("Which cache does attention write")


def test_capture_batch_positions_not_restarted_are_named():
    """Split into requests of at most max_seq_len, in slot 0, but the positions run on
    (torch.arange(num_tokens)): indexing slot 0's row fails past max_seq_len, and the
    report names the positions, not the split."""
    r = check_capture_batch(make_capture_batch(restart=False), B=E)
    assert not r and "positions" in r.message and "start again at 0" in r.message, r.message
    assert "Split the tokens into requests" not in r.message


def test_capture_batch_one_request_past_max_seq_len_is_named():
    """No split at all: the report says to split (and where the positions start)."""
    r = check_capture_batch(make_capture_batch(split=False), B=E)
    assert not r and "one request holds at most" in r.message, r.message


@pytest.mark.parametrize("fn", [
    make_capture_batch(count=1),
    make_capture_batch(mode=ForwardMode.DECODE),
    make_capture_batch(dtypes={"seq_lens": torch.int64}),
    make_capture_batch(split=False),
    make_capture_batch(restart=False),
    make_capture_batch(loc="pos"),
    extend_batch_in_slot0,
])
def test_capture_batch_hints_do_not_ask_for_the_slot_when_it_is_right(fn):
    r = check_capture_batch(fn, B=E)
    assert not r and r.more_hints, r.message
    assert "Which slot" not in r.more_hints[0] and "Which cache" not in r.more_hints[0], \
        r.more_hints[0]


def test_capture_batch_models_have_a_permuted_table():
    """The checker's models: req_to_token a permutation of the pool's locations (location
    0 at the dummy slot's position 0), through which eager and piecewise runs agree with an
    identity-table model."""
    from labkit.checks.lesson09.capture_batch import _model
    from labkit.decode import EagerRunner, make_decode_batch, make_extend_batch

    model = _model(E, 12, 0)
    table = model.req_to_token
    assert sorted(table.flatten().tolist()) == list(range(table.numel()))
    assert int(table[0, 0]) == 0
    assert not torch.equal(table.flatten(), torch.arange(table.numel(), device=table.device))
    plain = build_model(ModelArgs.from_name("tiny", max_seq_len=12), max_requests=3,
                        device=E.device, dtype=torch.float32, seed=0)
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6], [5, 3, 5, 8, 9, 7, 9]]
    outs = []
    for m in (model, plain):
        runner = EagerRunner(m)
        runner.forward(make_extend_batch(m, [1, 2, 3], prompts))
        outs.append(runner.forward(make_decode_batch(m, [1, 2, 3], [7, 7, 7], [5, 3, 7])))
    assert torch.equal(outs[0], outs[1])


def test_capture_batch_broken_on_every_backend(B):
    r = check_capture_batch(broken_capture_batch, B=B)
    assert not r and "slot 1" in r.message


def test_capture_batch_checks_the_live_kv_after_capture():
    """The runner part on its own: the broken batch overwrites slot 1's K/V during the
    capture (named by slot, layer and positions); the right one leaves it alone."""
    gen = torch.Generator().manual_seed(0)
    msg = _trial(broken_capture_batch, E, gen, 0, 12, [4, 8])
    assert msg and "the K/V of slot 1 (a live request" in msg and "changed in layer 0" in msg
    assert _trial(reference_capture_batch, E, gen, 0, 12, [4, 13, 24]) is None


def test_capture_batch_a_side_effect_on_the_model_is_caught():
    """A batch that passes every rule but changes the model (here its embeddings) makes
    the pieces differ from eager: the last check says so."""
    def meddles(model, num_tokens):
        with torch.no_grad():
            model.tok_embeddings.weight.mul_(1.01)
        return reference_capture_batch(model, num_tokens)
    r = check_capture_batch(meddles, B=E)
    assert not r and "differs from the same step run eagerly" in r.message


def test_capture_batch_blank_and_not_a_function():
    def blank(model, num_tokens):
        raise NotImplementedError()
    assert check_capture_batch(blank, B=E).kind == "not_implemented"
    assert "expected your function capture_batch" in check_capture_batch("x").message


def test_show_symptom(capsys):
    without, after = show_symptom(broken_capture_batch, B=E, steps=6)
    out = capsys.readouterr().out
    assert without != after and "nothing raised" in out
    lines = out.splitlines()
    assert lines[0].index("[") == lines[1].index("["), out      # the two lists aligned
    without, after = show_symptom(reference_capture_batch, B=E, steps=6)
    assert without == after and "the same tokens" in capsys.readouterr().out


def test_show_symptom_reports_a_raise_and_a_blank(capsys):
    def blank(model, num_tokens):
        raise NotImplementedError()
    assert show_symptom(blank, B=E, steps=2) is None
    assert capsys.readouterr().out.startswith("❌ blank: not done yet")

    def typo(model, num_tokens):
        return model.req_to_tokens[0]
    assert show_symptom(typo, B=E, steps=2) is None
    out = capsys.readouterr().out
    assert out.startswith("❌ show_symptom(typo): your function raised AttributeError"), out
    assert "return model.req_to_tokens[0]" in out and "check_capture_batch(typo)" in out
    assert "Traceback" not in out
    assert show_symptom(make_capture_batch(ext=None), B=E, steps=2) is None
    out = capsys.readouterr().out
    assert out.startswith("❌ show_symptom(capture_batch): the capture with your function's "
                          "batch raised"), out
    assert_usable(E)


# ---- hints ------------------------------------------------------------------------------

def _hint(capsys) -> str:
    import labkit.checks

    capsys.readouterr()
    assert labkit.checks.hint() is None
    return capsys.readouterr().out.rstrip("\n")


def test_hint_after_not_done_names_that_exercise(capsys):
    """A not-done ❌ after another exercise's failure: hint() is about the blank one."""
    assert not check_split_labels(lambda gm, ops: {})

    def blank(draft_tokens, target_logits):
        raise NotImplementedError()
    r = check_greedy_accept(blank)
    assert "stuck?" not in r.message                 # nothing tried yet: no hint tail
    out = _hint(capsys)
    assert out.startswith("greedy_accept is not done yet: fill in the cell marked YOUR CODE "
                          "HERE, then run its checker again. hint 1 of 2 for greedy_accept: "
                          "t = argmax"), out
    assert "split_labels" not in out


def test_hint_after_a_pass_gives_no_stale_hint(capsys):
    """A ✅ forgets that exercise's failure."""
    assert not check_greedy_accept(make_greedy_accept(count="sum"))
    assert check_greedy_accept(make_greedy_accept())
    out = _hint(capsys)
    assert out.startswith("No failed check: greedy_accept passed"), out
    assert "hint 1" not in out


def test_hint_follows_the_mistake_seen(capsys):
    """Where the checker knows the mistake, the first hint is about it."""
    check_greedy_accept(make_greedy_accept(host="item"))
    assert "Inside a graph nothing may wait for the device" in _hint(capsys)
    check_capture_batch(make_capture_batch(restart=False, loc="mod"), B=E)
    assert "a fresh prefill in slot 0" in _hint(capsys)
    check_replay_piece(make_replay_piece(host="tolist"))
    assert "data_ptr()" in _hint(capsys)
