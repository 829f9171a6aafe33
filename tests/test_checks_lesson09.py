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
from labkit.decode.batch import ForwardBatch, ForwardMode
from labkit.decode.model import DUMMY_SLOT

E = backend.get("emulated")


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """Tiny tensors everywhere here: one intra-op thread."""


# ---- exercise 1: split_labels -------------------------------------------------------------

def make_split_labels(*, second_add=True, first_add=True, skip=("placeholder", "output",
                      "get_attr"), attr_pass="first", first_op_only=False, by_name=False,
                      compact=False, start=0, keys="node", keep_consecutive=False,
                      pieces_zero=False, as_set=False):
    """The reference, with one mistake (or a harmless variation) switched on by each flag."""
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
        if attr_pass:
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
    ({"skip": ("get_attr",)}, "labelled the placeholder"),
    ({"skip": ("placeholder", "get_attr")}, "labelled the output node"),
    ({"first_op_only": True}, "is in ops too"),
    ({"by_name": True}, "compare node.target"),
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
])
def test_split_labels_get_attr_labels_are_ignored(flags):
    """split_module asks for no label of a get_attr node, so none is required and any is
    accepted (vLLM's split_graph labels them where they stand)."""
    assert check_split_labels(make_split_labels(**flags))


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
                      setitem=False, exc=RuntimeError):
    """The reference, with one mistake (or a harmless variation) switched on by each flag."""
    def replay_piece(graph, static_args, output, args):
        def moved(new, static):
            if copy == "ptr":
                return new.data_ptr() != static.data_ptr()
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

        todo = []
        for i, (new, static) in enumerate(zip(args, static_args)):
            if not isinstance(new, torch.Tensor):
                bad = {"!=": new != static, "is": new is not static, "any": True,
                       "none": False}[numbers]
                if bad:
                    raise exc(f"argument {new!r} differs from the {static!r} it was captured "
                              f"with")
            elif moved(new, static):
                todo.append((i, new, static))
        if not copy_after:
            for t in todo:
                copy_in(*t)
        for _ in range(replay):
            graph.replay()
        if copy_after:
            for t in todo:
                copy_in(*t)
        if ret == "output":
            return output
        if ret == "clone":
            return tuple(o.clone() for o in output) if isinstance(output, tuple) else output.clone()
        if ret == "first":
            return output[0] if isinstance(output, tuple) else output
        if ret == "graph":
            return graph
        return None
    return replay_piece


def test_replay_piece_reference_passes(B, capsys):
    assert check_replay_piece(make_replay_piece(), B=B, trials=8, seed=2)
    assert "✅ replay_piece" in capsys.readouterr().out
    assert_usable(B)


@pytest.mark.parametrize("flags", [
    {"setitem": True},              # static[:n] = new
    {"exc": ValueError},            # any exception refuses the changed number
])
def test_replay_piece_harmless_variations_pass(flags):
    assert check_replay_piece(make_replay_piece(**flags), trials=6)


@pytest.mark.parametrize("flags, words", [
    ({"copy": "none"}, "a stale result: argument"),
    ({"copy": "all"}, "arrived in new memory"),
    ({"copy": "is"}, "comparing the objects, `is`, says that every view moved"),
    ({"copy": "shape"}, "decide by data_ptr(), not by shape"),
    ({"rows": False}, "one row per real token"),
    ({"zero_pad": True}, "only the first"),
    ({"replay": 0}, "did not replay the graph"),
    ({"replay": 2}, "replayed the graph twice"),
    ({"copy_after": True}, "after graph.replay()"),
    ({"ret": "none"}, "returned None"),
    ({"ret": "clone"}, "the right values, but in new tensors"),
    ({"ret": "graph"}, "returned the graph"),
    ({"ret": "first"}, "returned one tensor, but the piece returns a tuple"),
    ({"numbers": "none"}, "Raise (a RuntimeError naming the argument)"),
    ({"numbers": "is"}, "a float arrives as a new object every call"),
    ({"numbers": "any"}, "Your code raised on a step where every argument was right"),
    ({"replace": True}, "replaced static_args["),
    ({"wrong_direction": True}, "Copy it INTO the captured tensor"),
])
def test_replay_piece_mistakes(flags, words):
    r = check_replay_piece(make_replay_piece(**flags))
    assert not r and words in r.message, r.message
    assert_usable(E)


def test_replay_piece_mistakes_on_every_backend(B):
    for flags, words in (({"copy": "none"}, "stale result"),
                         ({"copy": "is"}, "copy only where new.data_ptr() != static"),
                         ({"numbers": "none"}, "Raise (a RuntimeError")):
        r = check_replay_piece(make_replay_piece(**flags), B=B)
        assert not r and words in r.message, r.message


def test_replay_piece_blank_and_not_a_function():
    def blank(graph, static_args, output, args):
        raise NotImplementedError()
    assert check_replay_piece(blank).kind == "not_implemented"
    assert "expected your function replay_piece" in check_replay_piece(3).message


def test_replay_piece_trials_cover_ints_floats_and_tuples():
    from labkit.checks.lesson09.replay_piece import _Trial

    gen = torch.Generator().manual_seed(0)
    a, b = _Trial(None, E, gen, int), _Trial(None, E, gen, float)
    assert isinstance(a.num, int) and isinstance(b.num, float)
    assert {"attn", "prev", "ids", "num"} <= set(a.kinds)


# ---- exercise 3: greedy_accept --------------------------------------------------------------

def make_greedy_accept(*, count="cumprod", view="bs", shift=0, cols="all", order="at",
                       dtype=None, host=None, inplace=False, memo=False, via_cumsum=False):
    """The reference, with one mistake (or a harmless variation) switched on by each flag."""
    cache = {}

    def greedy_accept(draft_tokens, target_logits):
        bs, k = draft_tokens.shape
        if memo and (bs, k) in cache:
            return cache[(bs, k)]
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
            cache[(bs, k)] = out
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
    ({"memo": True}, "after capture, replay 1 with new draft tokens"),
])
def test_greedy_accept_mistakes(flags, words):
    r = check_greedy_accept(make_greedy_accept(**flags))
    assert not r and words in r.message, r.message
    assert_usable(E)


def test_greedy_accept_host_read_on_every_backend(B):
    r = check_greedy_accept(make_greedy_accept(host="item"), B=B)
    assert not r and r.kind == "exception" and "nothing may wait for the device" in r.message
    assert_usable(B)


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
                       seq_int64=False, ids="zeros", lens_order="full first"):
    """The reference, with one mistake (or a harmless variation) switched on by each flag."""
    def capture_batch(model, num_tokens):
        L = model.args.max_seq_len
        n = num_tokens + count
        lens = _lens(model, n, zero_ok=zero_tail) if split else [n]
        if lens_order == "rest first":
            lens = lens[::-1]
        elif lens_order == "even":        # ceil(n / L) requests of (nearly) equal length
            k = -(-n // L)
            lens = [n // k + (i < n % k) for i in range(k)]
        dev = model.device
        s = model.num_slots - 1 if slot == "last" else slot
        pos = (torch.cat([torch.arange(x, device=dev) for x in lens]) if restart
               else torch.arange(n, device=dev))
        if loc == "index":
            locs = model.req_to_token[s].index_select(0, pos)
        elif loc == "slice":
            locs = model.req_to_token[s, :n]
        elif loc == "mod":
            locs = model.req_to_token[s].index_select(0, pos % L)
        else:   # "arange": pool locations 0..n-1
            locs = torch.arange(n, device=dev)
        return ForwardBatch(
            forward_mode=mode,
            input_ids=(torch.zeros(n, dtype=torch.int64, device=dev) if ids == "zeros"
                       else torch.randint(0, model.args.vocab_size, (n,), device=dev)),
            positions=pos,
            out_cache_loc=locs,
            req_pool_indices=torch.full((len(lens),), s, dtype=torch.int64, device=dev),
            seq_lens=torch.tensor(lens, dtype=torch.int64 if seq_int64 else torch.int32,
                                  device=dev),
            seq_lens_cpu=lens if cpu_lens == "same" else [n],
            extend_lens=lens if ext == "lens" else None,
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
    {"seq_int64": True},            # seq_lens int64: the runners accept either
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
    (make_capture_batch(restart=False), "each with its own positions 0..len-1"),
    (make_capture_batch(restart=False, loc="mod"), "each request has its own positions, from 0"),
    (make_capture_batch(zero_tail=True), "is a multiple of max_seq_len"),
    (make_capture_batch(count=1), "the capture batch has exactly num_tokens tokens"),
    (make_capture_batch(count=-1), "the bucket is"),
    (make_capture_batch(mode=ForwardMode.DECODE), "ForwardMode.EXTEND"),
    (make_capture_batch(cpu_lens="one"), "seq_lens_cpu"),
    (make_capture_batch(ext=None), "extend_lens is None"),
    (make_capture_batch(loc="arange"), "(slot 1's), which is not one of slot 0's"),
])
def test_capture_batch_mistakes(fn, words):
    r = check_capture_batch(fn, B=E)
    assert not r and words in r.message, r.message


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
    assert without != after and "nothing raised" in capsys.readouterr().out
    without, after = show_symptom(reference_capture_batch, B=E, steps=6)
    assert without == after and "the same tokens" in capsys.readouterr().out
