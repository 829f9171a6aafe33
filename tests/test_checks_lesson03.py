"""Lesson 03 checkers: each passes the reference (and other right answers) and rejects the
mistakes learners make, with a message that names the mistake actually made."""

from __future__ import annotations

import pytest
import torch
from helpers import assert_usable

from labkit.capture import capture
from labkit.checks import lesson03 as L
from labkit.checks.lesson03 import _common as LC
from labkit.checks.lesson03 import arg_mismatches as LA
from labkit.checks.lesson03 import capturable_clip as LCLIP
from labkit.checks.lesson03 import check_arg_mismatches, check_build_server, check_capturable_clip


def _blank(*args):
    raise NotImplementedError()


def _assert_rejects(res, *words):
    assert not res, res.message
    for w in words:
        assert w in res.message, f"{w!r} not in:\n{res.message}"



# ---- capturable_clip ------------------------------------------------------------------------

def clip_where(x):
    m = x.abs().max()
    return torch.where(m > 1, x / m, x)


def clip_clamp_min(x):
    return x / torch.clamp(x.abs().max(), min=1.0)


def clip_if(x):
    m = x.abs().max()
    if m > 1:
        return x / m
    return x


def clip_item(x):
    m = x.abs().max().item()
    return x / m if m > 1 else x


def clip_python_max(x):
    return x / max(x.abs().max(), 1.0)


def clip_always(x):
    return x / x.abs().max()


def clip_identity(x):
    return x


def clip_elementwise(x):
    m = x.abs().max()
    return torch.where(x.abs() > 1, x / m, x)


def clip_clamp(x):
    return x.clamp(-1, 1)


def clip_no_abs(x):
    m = x.max()
    return torch.where(m > 1, x / m, x)


def clip_per_row(x):
    m = x.abs().amax(dim=-1, keepdim=True)
    return torch.where(m > 1, x / m, x)


def clip_per_matrix(x):      # one maximum per matrix (the last two dims), as for a batch
    a = x.abs()
    m = a.amax(dim=(-2, -1), keepdim=True) if x.dim() >= 2 else a.max()
    return torch.where(m > 1, x / m, x)


def clip_in_place(x):
    m = x.abs().max()
    return x.div_(torch.where(m > 1, m, torch.ones_like(m)))


def clip_no_return(x):
    m = x.abs().max()
    torch.where(m > 1, x / m, x)


def test_capturable_clip_accepts_right_answers(B, capsys):
    assert check_capturable_clip(clip_where, B=B)
    assert check_capturable_clip(clip_clamp_min, B=B)
    assert capsys.readouterr().out.count("✅ capturable_clip: passed 3 random trials") == 2


def test_capturable_clip_blank_says_not_done(B):
    res = check_capturable_clip(_blank, B=B)
    assert not res and res.kind == "not_implemented"
    assert "not done yet" in res.message and "captured" not in res.message


@pytest.mark.parametrize("fn, words", [
    (clip_if, ["cannot be captured", "Python branch on a tensor value", "if m > 1:"]),
    (clip_item, ["cannot be captured", "CPU sync", ".item()"]),
    (clip_python_max, ["cannot be captured", "Python branch on a tensor value"]),
    (clip_always, ["divided by max|x| although max|x| <= 1"]),
    (clip_identity, ["returned x unchanged"]),
    (clip_elementwise, ["only the elements with |x| > 1", "ONE decision"]),
    (clip_clamp, ["clamped each element"]),
    (clip_no_abs, ["max(x) where clip uses max(|x|)"]),
    (clip_in_place, ["changed its input x in place"]),
    (clip_no_return, ["returned None", "return"]),
], ids=lambda v: getattr(v, "__name__", ""))
def test_capturable_clip_rejects(B, fn, words):
    res = check_capturable_clip(fn, B=B)
    _assert_rejects(res, *words)
    assert "torch.where(m > 1, x / m, x)" not in res.message   # never the answer first
    assert_usable(B)


def test_capturable_clip_rejects_a_per_row_maximum(B):
    # 2-D inputs come up in some trials: the per-row maximum is named there
    res = check_capturable_clip(clip_per_row, B=B, trials=6)
    _assert_rejects(res, "along dim=1", "one maximum over the whole tensor")


def test_capturable_clip_rejects_a_per_matrix_maximum(B):
    # the text says "any shape": a maximum per matrix is right on 1-D and 2-D inputs only
    res = check_capturable_clip(clip_per_matrix, B=B)
    _assert_rejects(res, "over dims (1, 2) of a 3-D input", "one maximum per x[i]",
                    "one maximum over the whole tensor")


def test_capturable_clip_tries_every_rank_from_0_to_4():
    seen = set()
    for trial in range(1, 4):
        for xs in LCLIP._clip_input_sets(LC._generator(1000 * trial + 3), torch.device("cpu")):
            assert len({tuple(x.shape) for x in xs}) == 1        # one shape per set
            seen.add(xs[0].dim())
            regimes = [bool(x.abs().max() > 1) for x in xs]
            assert regimes == [True, False, True, False]
    assert seen == {0, 1, 2, 3, 4}


def test_capturable_clip_rejects_an_answer_that_breaks_on_a_scalar(B):
    def rows_only(x):            # fine from 1-D up, raises on a 0-d tensor
        m = x.abs().reshape(-1, x.shape[-1]).max()
        return torch.where(m > 1, x / m, x)

    _assert_rejects(check_capturable_clip(rows_only, B=B), "shape ()", "IndexError")


def test_capturable_clip_rejects_a_graph_that_baked_a_branch_in(B):
    def decided_at_capture(x):   # right eagerly; what capture records always divides
        m = x.abs().max()
        if B.is_current_stream_capturing():
            return x / m
        return torch.where(m > 1, x / m, x)

    res = check_capturable_clip(decided_at_capture, B=B, trials=1)
    _assert_rejects(res, "its graph", "both cases")
    assert_usable(B)


def test_capturable_clip_leaves_a_usable_process_after_a_failed_capture(B):
    def syncs_only_in_capture(x):   # the linter runs eagerly and sees nothing
        if B.is_current_stream_capturing():
            x.sum().item()
        return clip_where(x)

    res = check_capturable_clip(syncs_only_in_capture, B=B, trials=1)
    _assert_rejects(res, "capture of your function failed")
    assert_usable(B)


def test_capturable_clip_times_out_an_endless_loop(B):
    def endless(x):
        while True:
            pass

    res = check_capturable_clip(endless, B=B, time_limit=0.3)
    assert not res and res.kind == "timeout" and "did not finish" in res.message
    assert_usable(B)


# ---- arg_mismatches -------------------------------------------------------------------------

def arg_mismatches(captured, received):
    out = []
    if len(captured) != len(received):
        out.append(("args", "count", len(captured), len(received)))
    for i, (c, r) in enumerate(zip(captured, received)):
        where = f"args[{i}]"
        c_is_t, r_is_t = isinstance(c, torch.Tensor), isinstance(r, torch.Tensor)
        if c_is_t != r_is_t or (not c_is_t and type(c) is not type(r)):
            out.append((where, "type", type(c).__name__, type(r).__name__))
        elif c_is_t:
            for field in ("shape", "dtype", "device"):
                a, b = getattr(c, field), getattr(r, field)
                if a != b:
                    out.append((where, field, a, b))     # torch.Size is a tuple of ints
        elif c != r:
            out.append((where, "value", c, r))
    return out


def _swapped(captured, received):           # the old (received, captured) order
    return [(w, f, b, a) for w, f, a, b in arg_mismatches(captured, received)]


def _strings(captured, received):           # dtype and device as strings
    return [(w, f, str(a), str(b)) if f in ("dtype", "device") else (w, f, a, b)
            for w, f, a, b in arg_mismatches(captured, received)]


def _first_only(captured, received):        # if/elif: one field per argument
    seen, out = set(), []
    for m in arg_mismatches(captured, received):
        if m[0] not in seen:
            seen.add(m[0])
            out.append(m)
    return out


def _no_count(captured, received):
    return [m for m in arg_mismatches(captured, received) if m[1] != "count"]


def _tensor_eq(captured, received):         # `c != r` on tensors
    out = []
    for i, (c, r) in enumerate(zip(captured, received)):
        if c != r:
            out.append((f"args[{i}]", "value", c, r))
    return out


def _values_too(captured, received):        # also compares tensor values
    out = arg_mismatches(captured, received)
    for i, (c, r) in enumerate(zip(captured, received)):
        if isinstance(c, torch.Tensor) and isinstance(r, torch.Tensor) and \
                c.shape == r.shape and c.dtype == r.dtype and c.device == r.device and \
                c.device.type != "meta" and not torch.equal(c, r):
            out.append((f"args[{i}]", "value", c, r))
    return out


def _no_type_check(captured, received):     # values of non-tensors only: 2 == 2.0
    out = []
    if len(captured) != len(received):
        out.append(("args", "count", len(captured), len(received)))
    for i, (c, r) in enumerate(zip(captured, received)):
        where = f"args[{i}]"
        if isinstance(c, torch.Tensor) != isinstance(r, torch.Tensor):
            out.append((where, "type", type(c).__name__, type(r).__name__))
        elif isinstance(c, torch.Tensor):
            out += [(where,) + m[1:] for m in arg_mismatches([c], [r])]
        elif c != r:
            out.append((where, "value", c, r))
    return out


def _isinstance_types(captured, received):  # isinstance(r, type(c)): True passes for int
    out = []
    for m in arg_mismatches(captured, received):
        if m[1] == "type" and m[2] == "int" and m[3] == "bool":
            continue
        if m[1] == "type" and m[2] == "bool" and m[3] == "int":
            continue
        out.append(m)
    return out


def _isinstance_one_way(captured, received):  # isinstance(r, type(c)): 1 captured, True received
    return [m for m in arg_mismatches(captured, received)
            if not (m[1] == "type" and m[2] == "int" and m[3] == "bool")]


def _newcomers_answer(captured, received):  # range(min(...)), torch.is_tensor, type(c) != type(r)
    diffs = []
    if len(captured) != len(received):
        diffs.append(("args", "count", len(captured), len(received)))
    for i in range(min(len(captured), len(received))):
        c, r, where = captured[i], received[i], f"args[{i}]"
        if torch.is_tensor(c) and torch.is_tensor(r):
            for field, get in (("shape", lambda t: tuple(t.shape)), ("dtype", lambda t: t.dtype),
                               ("device", lambda t: t.device)):
                if get(c) != get(r):
                    diffs.append((where, field, get(c), get(r)))
        elif torch.is_tensor(c) or torch.is_tensor(r) or type(c) != type(r):  # noqa: E721
            diffs.append((where, "type", type(c).__name__, type(r).__name__))
        elif c != r:
            diffs.append((where, "value", c, r))
    return diffs


def _shape_lists(captured, received):
    return [(w, f, list(a), list(b)) if f == "shape" else (w, f, a, b)
            for w, f, a, b in arg_mismatches(captured, received)]


def _type_objects(captured, received):
    out = []
    for w, f, a, b in arg_mismatches(captured, received):
        if f == "type":
            i = int(w[5:-1])
            a, b = type(captured[i]), type(received[i])
        out.append((w, f, a, b))
    return out


def _type_and_value(captured, received):    # reports the value too when the types differ
    out = arg_mismatches(captured, received)
    for w, f, a, b in list(out):
        if f == "type":
            i = int(w[5:-1])
            out.append((w, "value", captured[i], received[i]))
    return out


def _range_len(captured, received):         # IndexError when the lengths differ
    out = []
    for i in range(len(captured)):
        out += [(f"args[{i}]",) + m[1:] for m in arg_mismatches([captured[i]], [received[i]])]
    return out


def _no_tensor_check(captured, received):   # no type check: .shape of a float
    out = []
    if len(captured) != len(received):
        out.append(("args", "count", len(captured), len(received)))
    for i, (c, r) in enumerate(zip(captured, received)):
        for field in ("shape", "dtype", "device"):
            a, b = getattr(c, field), getattr(r, field)
            if a != b:
                out.append((f"args[{i}]", field, a, b))
    return out


def _two_ifs(captured, received):           # a type tuple AND a value tuple when both differ
    out = []
    if len(captured) != len(received):
        out.append(("args", "count", len(captured), len(received)))
    for i, (c, r) in enumerate(zip(captured, received)):
        where = f"args[{i}]"
        c_is_t, r_is_t = isinstance(c, torch.Tensor), isinstance(r, torch.Tensor)
        if c_is_t != r_is_t or (not c_is_t and type(c) is not type(r)):
            out.append((where, "type", type(c).__name__, type(r).__name__))
        if c_is_t and r_is_t:
            out += [(where,) + m[1:] for m in arg_mismatches([c], [r])]
        if not c_is_t and not r_is_t and c != r:   # a second `if`, not an `elif`
            out.append((where, "value", c, r))
    return out


def _is_not(captured, received):            # `c is not r` instead of `c != r`
    out = []
    for m in arg_mismatches(captured, received):
        if m[1] != "value":
            out.append(m)
    for i, (c, r) in enumerate(zip(captured, received)):
        if not isinstance(c, torch.Tensor) and type(c) is type(r) and c is not r:
            out.append((f"args[{i}]", "value", c, r))
    return out


def _type_names_first(captured, received):  # type(c) is not type(r), tensors too
    out = []
    if len(captured) != len(received):
        out.append(("args", "count", len(captured), len(received)))
    for i, (c, r) in enumerate(zip(captured, received)):
        where = f"args[{i}]"
        if type(c) is not type(r):
            out.append((where, "type", type(c).__name__, type(r).__name__))
        else:
            out += [(where,) + m[1:] for m in arg_mismatches([c], [r])]
    return out


def _zip_longest(captured, received):       # itertools.zip_longest: positions past the end
    import itertools

    out = []
    if len(captured) != len(received):
        out.append(("args", "count", len(captured), len(received)))
    for i, (c, r) in enumerate(itertools.zip_longest(captured, received)):
        out += [(f"args[{i}]",) + m[1:] for m in arg_mismatches([c], [r])]
    return out


def _arg_label(captured, received):         # "arg[0]" for "args[0]"
    return [(w.replace("args[", "arg["),) + tuple(m) for w, *m in arg_mismatches(captured,
                                                                                  received)]


def _none_when_clean(captured, received):
    return arg_mismatches(captured, received) or None


def test_arg_mismatches_accepts_the_reference(B, capsys):
    assert check_arg_mismatches(arg_mismatches, B=B)
    assert check_arg_mismatches(LA._arg_mismatches_reference, B=B)
    assert check_arg_mismatches(lambda c, r: tuple(arg_mismatches(c, r)[::-1]), B=B)
    assert check_arg_mismatches(_newcomers_answer, B=B)
    assert capsys.readouterr().out.count("✅ arg_mismatches: passed 8 random trials") == 4


def test_arg_mismatches_blank_says_not_done(B):
    res = check_arg_mismatches(_blank, B=B)
    assert not res and res.kind == "not_implemented" and "not done yet" in res.message


@pytest.mark.parametrize("fn, words", [
    (_swapped, ["last two values swapped", "(where, field, captured, received)"]),
    (_strings, ["as a string", "torch.dtype"]),
    (_first_only, ["Report EVERY field that differs", "but not the"]),
    (_no_count, ["does not say so", "number of arguments"]),
    (_tensor_eq, ["compared two tensors"]),
    (_values_too, ["tensor VALUES are never compared"]),
    (_no_type_check, ["the types differ", "no 'type' tuple for it", "compare the types first"]),
    (_isinstance_types, ["equal in Python, but their types differ"]),
    (_isinstance_one_way, ["the captured 1 (int) and the received True (bool)",
                           "equal in Python, but their types differ", "baked in an int"]),
    (_shape_lists, ["shape as a list", "tuple of ints"]),
    (_type_objects, ["give their names", "type(c).__name__"]),
    (_type_and_value, ["the types differ", "report only the 'type' tuple"]),
    (_range_len, ["IndexError", "different lengths"]),
    (_no_tensor_check, ["AttributeError", "check the types first"]),
    (_none_when_clean, ["returned None", "empty list"]),
    (_two_ifs, ["the types differ", "report only the 'type' tuple"]),
    (_is_not, ["equal (==) but not the same object", "`is not`", "use !="]),
    (_type_names_first, ["a tensor on both sides", "Parameter",
                         "compared by shape, dtype and device only"]),
    (_zip_longest, ["exists only in", "zip_longest", "the count tuple"]),
    (_arg_label, ["'arg[0]'", "'args[0]'"]),
], ids=lambda v: getattr(v, "__name__", ""))
def test_arg_mismatches_rejects(B, fn, words):
    res = check_arg_mismatches(fn, B=B)
    _assert_rejects(res, *words)
    # the wrong diagnosis of the old checker is not given to other mistakes
    if fn is not _first_only:
        assert "Report EVERY field" not in res.message


def test_arg_mismatches_reference_follows_the_exercise_text():
    """The answer key (labkit.core.signature.mismatches as tuples) on the rules the exercise
    states: count first, then each shared position; type only when the kinds differ; one
    tuple per differing tensor field; values of tensors never; 2 is not 2.0, 1 is not True."""
    ref = LA._arg_mismatches_reference
    t = torch.zeros(2, 3)
    assert ref([t, 2, "gelu"], [torch.ones(2, 3), 2, "gelu"]) == []
    assert ref([t, 2], [t]) == [("args", "count", 2, 1)]
    assert ref([t], [1.5]) == [("args[0]", "type", "Tensor", "float")]
    assert ref([2], [2.0]) == [("args[0]", "type", "int", "float")]
    assert ref([1], [True]) == [("args[0]", "type", "int", "bool")]
    assert ref([0.5], [0.7]) == [("args[0]", "value", 0.5, 0.7)]
    assert ref([t], [torch.zeros(3, 3, dtype=torch.float16, device="meta")]) == [
        ("args[0]", "shape", (2, 3), (3, 3)),
        ("args[0]", "dtype", torch.float32, torch.float16),
        ("args[0]", "device", torch.device("cpu"), torch.device("meta"))]
    assert ref([t, 1, 2], [t, 5]) == [("args", "count", 3, 2), ("args[1]", "value", 1, 5)]


def test_arg_mismatches_cases_cover_every_rule():
    fields = set()
    equal_but_typed = clean = False
    for trial in range(1, 9):
        captured, received = LA._arg_case(trial, LC._generator(1000 * trial + 3),
                                         torch.device("cpu"))
        ref = LA._arg_mismatches_reference(captured, received)
        fields |= {f for _, f, *_ in ref}
        clean |= not ref
        equal_but_typed |= any(f == "type" and captured[int(w[5:-1])] == received[int(w[5:-1])]
                               for w, f, *_ in ref if w != "args")
        per_arg = [w for w, *_ in ref]
        if trial == 1:
            assert max(per_arg.count(w) for w in per_arg) >= 2   # several fields of one tensor
    assert fields == set(L.FIELDS) and clean and equal_but_typed


# ---- build_server (diagnosis) ---------------------------------------------------------------

def _server(*, copy=True, clone=True, temp="tensor", replay_first=False, eager=False,
            recapture=False, two_captures=False, eager_beside_replay=False):
    def build_server(B):
        static_logits = torch.zeros(4, 16, device=B.device)
        settings = {"temperature": 1.0, "t": torch.ones((), device=B.device)}
        if temp == "new_tensor_kept":         # the captured temperature tensor lives on
            settings["kept"] = settings["t"]

        def probs(logits):
            if temp in ("tensor", "new_tensor", "new_tensor_kept"):
                return torch.softmax(logits / settings["t"], dim=-1)
            return torch.softmax(logits / settings["temperature"], dim=-1)

        graph = {}
        if two_captures:     # a leftover first attempt, never replayed
            capture(lambda x: torch.softmax(x, dim=-1), static_logits, B=B)
        graph["g"], graph["out"] = capture(probs, static_logits, B=B)

        def serve(batches, temperatures):
            results = []
            for logits, t in zip(batches, temperatures):
                if eager:
                    results.append(torch.softmax(logits / t, dim=-1))
                    continue
                if replay_first:
                    graph["g"].replay()
                if copy:
                    static_logits.copy_(logits)
                else:
                    static_logits_ = logits   # noqa: F841 - rebinding: the graph never sees it
                if temp == "tensor":
                    settings["t"].fill_(t)
                elif temp in ("new_tensor", "new_tensor_kept"):
                    settings["t"] = torch.tensor(t, device=B.device)
                else:
                    settings["temperature"] = t
                if recapture:
                    graph["g"], graph["out"] = capture(probs, static_logits, B=B)
                if not replay_first:
                    graph["g"].replay()
                if eager_beside_replay:  # replays for the counter, returns eager results
                    results.append(torch.softmax(logits / t, dim=-1))
                    continue
                results.append(graph["out"].clone() if clone is True else graph["out"])
            if clone == "after the loop":
                results = [r.clone() for r in results]
            return results

        return serve

    return build_server


def _server_divides_first(B):
    static_logits = torch.zeros(4, 16, device=B.device)
    g, out = capture(lambda x: torch.softmax(x, dim=-1), static_logits, B=B)

    def serve(batches, temperatures):
        results = []
        for logits, t in zip(batches, temperatures):
            static_logits.copy_(logits / t)       # the temperature applied before copying in
            g.replay()
            results.append(out.clone())
        return results

    return serve


def _server_newcomer(B):        # multiplies by a static 1/t of shape (1, 1)
    x = torch.zeros(4, 16, device=B.device)
    inv_t = torch.ones(1, 1, device=B.device)
    g, y = capture(lambda logits: torch.softmax(logits * inv_t, dim=-1), x, B=B)

    def serve(batches, temperatures):
        outs = []
        for logits, t in zip(batches, temperatures):
            x.copy_(logits)
            inv_t.fill_(1.0 / t)
            g.replay()
            outs.append(y.clone())
        return outs

    return serve


def _server_rebinds_logits(B):   # the static logits live only in a dict, rebound by serve
    state = {"logits": torch.zeros(4, 16, device=B.device)}
    t_static = torch.ones((), device=B.device)
    g, out = capture(lambda x: torch.softmax(x / t_static, dim=-1), state["logits"], B=B)

    def serve(batches, temperatures):
        results = []
        for logits, t in zip(batches, temperatures):
            state["logits"] = logits      # drops the captured static logits
            t_static.fill_(t)
            g.replay()
            results.append(out.clone())
        return results

    return serve


def test_build_server_rejects_static_logits_rebound_away(B):
    _assert_rejects(check_build_server(_server_rebinds_logits, B=B),
                    "By replay 1, a tensor of shape (4, 16) (your static logits?)",
                    "static_logits = logits", "copy_ each batch into it (section 1)")
    assert_usable(B)


def _server_lazy(B):
    def serve(batches, temperatures):
        return [torch.softmax(b / t, dim=-1) for b, t in zip(batches, temperatures)]

    return serve


def _server_item(B):
    static_logits = torch.zeros(4, 16, device=B.device)

    def probs(x):
        return torch.softmax(x / x.abs().max().item(), dim=-1)

    g, out = capture(probs, static_logits, B=B)
    return lambda batches, temperatures: []


def test_build_server_accepts_right_answers(B, capsys):
    assert check_build_server(_server(), B=B)
    assert check_build_server(_server_divides_first, B=B)
    assert check_build_server(_server_newcomer, B=B)
    assert capsys.readouterr().out.count("✅ build_server: passed 2 random trials") == 3


def test_build_server_blank_says_not_done(B):
    res = check_build_server(_blank, B=B)
    assert not res and res.kind == "not_implemented" and "not done yet" in res.message


@pytest.mark.parametrize("kw, words", [
    (dict(copy=False, clone=False, temp="python"), ["same memory", "section 6"]),  # as given
    (dict(copy=False, temp="python"), ["do not depend on the batches", "section 1"]),
    (dict(copy=False), ["do not depend on the batches", "section 1"]),
    (dict(temp="python"), ["temperature is the one the graph was captured with",
                           "section 7"]),
    # a captured tensor rebound away is freed: a GPU reuses its memory, the emulator keeps
    # reading its old value, so the message rests on the tensor being gone, not on values
    (dict(temp="new_tensor"), ["By replay 1, a tensor of shape () (your temperature?) that "
                               "the graph reads was gone", "t = torch.tensor(temperature)",
                               "fill_ it with each temperature (section 7)"]),
    (dict(temp="new_tensor_kept"), ["temperature is the one the graph was captured with",
                                    "a tensor of shape () that nothing wrote after the "
                                    "capture", "section 7"]),
    (dict(clone=False), ["same memory"]),
    (dict(replay_first=True), ["previous batch's", "Fill first, then replay"]),
    (dict(eager=True), ["replayed the graph 0 times"]),
    (dict(recapture=True), ["serve captured", "capture once, in build_server"]),
    (dict(clone="after the loop"), ["you kept references to the static output and cloned "
                                    "after the loop", "every replay overwrote them (section 6)"]),
    (dict(two_captures=True), ["build_server captured 2 graphs", "ONE graph"]),
    (dict(eager_beside_replay=True), ["softmax/exp op(s) eagerly", "must come from the graph"]),
], ids=lambda v: ",".join(f"{k}={v}" for k, v in v.items()) if isinstance(v, dict) else "")
def test_build_server_rejects(B, kw, words):
    res = check_build_server(_server(**kw), B=B)
    _assert_rejects(res, *words)
    # a further hint about THIS mistake, never "No more hints" before any was given
    assert res.more_hints and "labkit.checks.hint()" in res.message
    assert_usable(B)


def test_build_server_rejects_no_capture_and_a_failed_capture(B):
    res = check_build_server(_server_lazy, B=B)
    _assert_rejects(res, "captured no graph")
    assert res.more_hints
    res = check_build_server(_server_item, B=B)
    _assert_rejects(res, "build_server raised", ".item()")
    assert res.more_hints and "section 3" in res.more_hints[0]
    assert_usable(B)


def test_hints_come_in_steps_after_a_failure(B, capsys):
    import labkit.checks

    res = check_arg_mismatches(_first_only, B=B)
    assert not res and "labkit.checks.hint()" in res.message
    assert "if/elif" not in res.message                     # the next step is not shown first
    capsys.readouterr()
    labkit.checks.hint()
    assert "hint 1 of 1 for arg_mismatches" in capsys.readouterr().out
    res = check_capturable_clip(clip_if, B=B)
    labkit.checks.hint()
    labkit.checks.hint()
    out = capsys.readouterr().out
    assert "hint 1 of 2 for capturable_clip: fix:" in out and "hint 2 of 2" in out


@pytest.mark.parametrize("check", [check_capturable_clip, check_arg_mismatches, check_build_server])
def test_checkers_refuse_a_wrong_backend_or_trial_count(check):
    with pytest.raises(TypeError, match=r"B must be the backend namespace .*got str 'cuda': "
                                        r"write B = labkit.backend.get\('cuda'\)"):
        check(lambda *a: None, B="cuda", quiet=True)
    with pytest.raises(ValueError, match="trials must be >= 1, got 0: a checker passes only "
                                         "after at least one trial"):
        check(lambda *a: None, trials=0, quiet=True)
    with pytest.raises(TypeError, match=r"trials must be an int >= 1, got 2.5 \(float\)"):
        check(lambda *a: None, trials=2.5, quiet=True)
