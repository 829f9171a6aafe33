"""labkit.guards (lesson 03): argument metadata and mismatch errors, GuardedGraph,
expect_error, the capture-hazard linter, and the lesson 03 checkers."""

from __future__ import annotations

import inspect

import pytest
import torch

from labkit.capture import capture
from labkit.guards import (
    HAZARDS,
    ArgMetadata,
    GraphArgumentError,
    GuardedGraph,
    LintReport,
    error_lines,
    expect_error,
    get_mismatch_errors,
    lint_capture,
    metadata_tree,
)

# ---- ArgMetadata and get_mismatch_errors -------------------------------------------------


def test_arg_metadata_records_what_capture_fixes():
    t = torch.zeros(8, 8)
    m = ArgMetadata.of(t)
    assert (m.is_tensor, m.shape, m.dtype, m.device, m.data_ptr) == (
        True, (8, 8), torch.float32, t.device, t.data_ptr())
    assert m.describe() == "Tensor(8, 8) float32"
    v = ArgMetadata.of(0.5)
    assert (v.is_tensor, v.type, v.value, v.describe()) == (False, float, 0.5, "float 0.5")


def test_mismatch_message_format_from_the_issue():
    captured = [ArgMetadata.of(torch.zeros(8, 8))]
    assert get_mismatch_errors(captured, [torch.zeros(4, 8)]) == [
        "Tensor mismatch at args[0]: received shape (4, 8), captured (8, 8)"]
    assert get_mismatch_errors(captured, [torch.ones(8, 8)]) == []


def test_every_mismatch_is_reported_at_once():
    captured = metadata_tree((torch.zeros(8, 8), 0.5, [torch.zeros(3), 2]))
    kw = metadata_tree({"mask": torch.zeros(8, dtype=torch.bool), "mode": "a"})
    errors = get_mismatch_errors(
        captured, (torch.zeros(4, 8, dtype=torch.float16), 0.7, [torch.zeros(3), 2, 9]),
        kw, {"mask": 1.0, "bias": None})
    assert errors == [
        "Tensor mismatch at args[0]: received shape (4, 8), captured (8, 8)",
        "Tensor mismatch at args[0]: received dtype torch.float16, captured torch.float32",
        "Value mismatch at args[1]: received 0.7, captured 0.5",
        "Structure mismatch at args[2]: received 3 items, captured 2",
        "Type mismatch at kwargs['mask']: received float, captured Tensor",
        "Missing kwargs['mode']: it was passed at capture",
        "Unexpected kwargs['bias']: it was not passed at capture",
    ]


def test_count_type_device_and_address_mismatches():
    t = torch.zeros(3)
    captured = [ArgMetadata.of(t), ArgMetadata.of(1)]
    assert get_mismatch_errors(captured, [t]) == [
        "Count mismatch: received 1 positional args, captured 2"]
    assert get_mismatch_errors(captured, [t, 1.0]) == [
        "Type mismatch at args[1]: received float, captured int"]
    assert get_mismatch_errors(captured, [torch.empty(3, device="meta"), 1]) == [
        "Tensor mismatch at args[0]: received device meta, captured cpu"]
    assert get_mismatch_errors(captured, [t.clone(), 1]) == []
    assert get_mismatch_errors(captured, [t.clone(), 1], check_address=True)[0].startswith(
        "Address mismatch at args[0]")
    assert get_mismatch_errors(captured, [t, 1], check_address=True) == []


def test_graph_argument_error_lists_all_and_hints():
    err = GraphArgumentError("G(f)", ["Tensor mismatch at args[0]: received shape (1,), "
                                      "captured (2,)", "Value mismatch at args[1]: x"])
    text = str(err)
    assert text.splitlines()[0] == ("G(f) refuses these arguments (2 mismatches; nothing was "
                                    "copied or replayed):")
    assert "one graph per shape" in text and "baked in" in text
    assert isinstance(err, ValueError) and len(err.errors) == 2


# ---- GuardedGraph ------------------------------------------------------------------------

def _block(x, scale, mask=None, extra=()):
    y = x * scale
    if mask is not None:
        y = y + mask
    for e in extra:
        y = y + e
    return {"y": y, "sum": y.sum(-1)}


def test_guarded_graph_kwargs_nested_and_copy_only_when_moved(B):
    d = B.device
    gg = GuardedGraph(_block, B=B).capture(torch.zeros(3, 4, device=d), 2.0,
                                           mask=torch.zeros(3, 4, device=d),
                                           extra=[torch.zeros(4, device=d)])
    assert gg.signature().splitlines() == [
        "args[0]: Tensor(3, 4) float32", "args[1]: float 2.0",
        "kwargs['mask']: Tensor(3, 4) float32", "kwargs['extra'][0]: Tensor(4) float32"]
    x, m, e = (torch.randn(3, 4, device=d), torch.randn(3, 4, device=d),
               torch.randn(4, device=d))
    out = gg(x, 2.0, mask=m, extra=[e])
    torch.testing.assert_close(out["y"], x * 2 + m + e)
    assert gg.copies == 3
    gg.static_kwargs["mask"].copy_(m)
    gg(x, 2.0, mask=gg.static_kwargs["mask"], extra=[e])    # the static one: not copied
    assert gg.copies == 5


def test_guarded_graph_refuses_everything_at_once(B):
    d = B.device
    gg = GuardedGraph(_block, B=B, name="block").capture(torch.zeros(3, 4, device=d), 2.0,
                                                         mask=torch.zeros(3, 4, device=d))
    with pytest.raises(GraphArgumentError) as info:
        gg(torch.zeros(3, 5, device=d), 3.0, mask=None, bias=1)
    assert info.value.errors == [
        "Tensor mismatch at args[0]: received shape (3, 5), captured (3, 4)",
        "Value mismatch at args[1]: received 3.0, captured 2.0",
        "Type mismatch at kwargs['mask']: received NoneType, captured Tensor",
        "Unexpected kwargs['bias']: it was not passed at capture",
    ]
    assert gg.replays == 0 and gg.copies == 0
    assert gg.mismatches(torch.zeros(3, 4, device=d), 2.0, mask=torch.ones(3, 4, device=d)) == []


def test_guarded_graph_static_inputs_policy_catches_rebinding(B):
    gg = GuardedGraph(lambda x: x * 2, B=B, inputs="static").capture(
        torch.zeros(3, device=B.device))
    with pytest.raises(GraphArgumentError, match=r"Address mismatch at args\[0\]"):
        gg(torch.ones(3, device=B.device))
    gg.static_inputs[0].fill_(4.0)
    assert gg(gg.static_inputs[0]).tolist() == [8.0, 8.0, 8.0]
    with pytest.raises(ValueError, match="inputs must be"):
        GuardedGraph(lambda x: x, B=B, inputs="maybe")


def test_guarded_graph_clone_outputs_are_kept(B):
    gg = GuardedGraph(lambda x: x + 1, B=B, outputs="clone").capture(
        torch.zeros(2, device=B.device))
    a = gg(torch.ones(2, device=B.device))
    b = gg(torch.full((2,), 5.0, device=B.device))
    assert a.tolist() == [2.0, 2.0] and b.tolist() == [6.0, 6.0]
    assert a.data_ptr() != gg.static_outputs.data_ptr()


# ---- expect_error ------------------------------------------------------------------------

def test_expect_error_prints_first_lines_and_restores_the_stream(B, capsys):
    x = torch.randn(4, device=B.device)
    with expect_error(B) as caught:
        g = B.CUDAGraph()
        with B.graph(g):
            x.sum().item()
    out = capsys.readouterr().out
    assert out == ("error: CUDA error: operation not permitted when stream is capturing\n"
                   " then: CUDA error: operation failed due to a previous error during capture\n")
    assert caught.raised and "[labkit emulator]" not in out
    assert B.current_stream() == B.default_stream()


def test_expect_error_keeps_warnings_quiet(B, capsys):
    import warnings

    with expect_error(B) as caught:
        warnings.warn("The CUDA Graph is empty.")
        raise ValueError("boom\nmore")
    assert capsys.readouterr().out == "error: boom\n"
    assert [str(w.message) for w in caught.warnings] == ["The CUDA Graph is empty."]


def test_expect_error_without_error_and_other_exceptions(B, capsys):
    with expect_error(B) as caught:
        pass
    assert capsys.readouterr().out == "no error\n" and not caught.raised
    with pytest.raises(KeyboardInterrupt):
        with expect_error(B):
            raise KeyboardInterrupt


def test_error_lines_keeps_emulator_notes_only_when_asked():
    try:
        try:
            raise RuntimeError("first line\nsecond\n[labkit emulator] why")
        except RuntimeError:
            raise ValueError("outer")
    except ValueError as e:
        exc = e
    assert error_lines(exc) == ["first line", "outer"]
    assert error_lines(exc, lines=5) == ["first line\nsecond", "outer"]
    assert error_lines(exc, lines=5, emulator_notes=True)[0].endswith("[labkit emulator] why")


# ---- lint_capture ------------------------------------------------------------------------

_state = {"h": None, "scale": 1.0, "gen": None}


def _hazards(x, p):
    n = x.sum().item()                                  # L:item
    if x.mean() > 0:                                    # L:branch
        x = x * 2
    idx = x.nonzero()                                   # L:nonzero
    pos = x[x > 0]                                      # L:mask
    host = x.tolist()                                   # L:tolist
    c = torch.tensor([1.0, 2.0, 3.0, 4.0], device=x.device)             # L:tensor
    r = torch.rand(4, device=x.device, generator=_state["gen"])         # L:rng
    _state["h"] = torch.tanh(_state["h"] + x)           # L:rebind
    _state["scale"] *= 0.5
    z = x * _state["scale"]                             # L:scalar
    return z + c + r + p, n, idx, pos, host


def _line(fn, marker):
    lines, start = inspect.getsourcelines(fn)
    return start + next(i for i, ln in enumerate(lines) if f"# L:{marker}" in ln)


def test_lint_reports_every_hazard_with_its_line(B):
    _state.update(h=torch.zeros(4, device=B.device), scale=1.0,
                  gen=B.Generator())
    report = lint_capture(_hazards, torch.randn(4, device=B.device), 0.5, B=B)
    assert isinstance(report, LintReport) and not report.ok and report.calls == 2
    got = {(f.kind, f.lineno) for f in report.findings}
    expected = {
        ("cpu_sync", _line(_hazards, "item")),
        ("tensor_branch", _line(_hazards, "branch")),
        ("dynamic_shape", _line(_hazards, "nonzero")),
        ("dynamic_shape", _line(_hazards, "mask")),
        ("host_tensor", _line(_hazards, "tolist")),
        ("host_tensor", _line(_hazards, "tensor")),
        ("unregistered_generator", _line(_hazards, "rng")),
        ("changed_address", _line(_hazards, "rebind")),
        ("changed_value", _line(_hazards, "scalar")),
        ("baked_argument", inspect.getsourcelines(_hazards)[1]),
    }
    assert got == expected, (expected - got, got - expected)
    assert [f.lineno for f in report.findings] == sorted(f.lineno for f in report.findings)
    item = next(f for f in report.findings if f.kind == "cpu_sync")
    assert item.op == ".item()" and item.code.startswith("n = x.sum().item()")
    assert item.function == "_hazards"
    assert item.where() == f"test_guards.py:{item.lineno} (in _hazards)"
    text = str(report)
    assert text.startswith("lint_capture(_hazards): ")
    assert "fails capture" in text and "silently wrong" in text and "fix:" in text
    md = report._repr_markdown_()
    assert md.startswith("**lint_capture(_hazards)") and "| # | hazard |" in md


def test_lint_clean_function_and_registered_generator(B):
    gen = B.Generator()

    def fine(x):
        noise = torch.rand(x.shape, device=x.device, generator=gen)
        return torch.where(x > 0, x, 0) * 2 + noise

    report = lint_capture(fine, torch.randn(4, device=B.device), B=B, generators=[gen])
    assert report.ok and report.findings == [] and report.ops > 0
    assert str(report).startswith("lint_capture(fine): no capture hazards found")
    unregistered = lint_capture(fine, torch.randn(4, device=B.device), B=B)
    assert unregistered.kinds == ["unregistered_generator"]


def test_lint_sees_synchronize_and_restores_it(B):
    original = B.synchronize

    def syncs(x):
        y = x + 1
        B.synchronize()
        return y

    report = lint_capture(syncs, torch.ones(2, device=B.device), B=B)
    assert report.kinds == ["cpu_sync"] and report.findings[0].op == "synchronize()"
    assert B.synchronize is original


def test_lint_changed_ops_and_errors(B):
    class Alternating:
        def __init__(self):
            self.calls = 0

        def __call__(self, x):
            self.calls += 1
            return x * 2 if self.calls % 2 else x + 1

    report = lint_capture(Alternating(), torch.ones(2, device=B.device), B=B)
    assert report.kinds == ["changed_ops"]
    assert "Python took another path" in report.findings[0].message

    def broken(x):
        return x @ torch.ones(3, 2, device=x.device)

    report = lint_capture(broken, torch.ones(4, device=B.device), B=B)
    assert report.kinds == ["raised"] and report.calls == 1
    assert "RuntimeError" in report.findings[0].message
    assert report.findings[0].lineno == inspect.getsourcelines(broken)[1] + 1


def test_lint_keyword_python_values_are_notes(B):
    report = lint_capture(lambda x, k=1: x * k, torch.ones(2, device=B.device),
                          kwargs={"k": 3}, B=B)
    assert report.kinds == ["baked_argument"] and report.findings[0].severity == "check"


_PREDICTED = {
    "item": (lambda x: x.sum().item(), "cpu_sync"),
    "if_tensor": (lambda x: x * 2 if x.sum() > 0 else x, "tensor_branch"),
    "nonzero": (lambda x: x.nonzero(), "dynamic_shape"),
    "boolean_mask": (lambda x: x[x > 0], "dynamic_shape"),
    "tolist": (lambda x: x.tolist(), "host_tensor"),
    "print": (lambda x: print(x), "cpu_sync"),
}


@pytest.mark.parametrize("what", sorted(_PREDICTED))
def test_lint_predicts_what_real_capture_refuses(B, what, capsys):
    body, kind = _PREDICTED[what]
    x = torch.randn(4, device=B.device)
    assert lint_capture(body, x, B=B).kinds == [kind]
    with pytest.raises(RuntimeError):
        capture(body, x, B=B, warmup=0)
    assert B.current_stream() == B.default_stream()


def test_every_hazard_kind_has_a_title_severity_and_fix():
    for kind, (title, severity, fix) in HAZARDS.items():
        assert title and fix and severity in ("fails capture", "silently wrong", "check")


# The lesson 03 checkers (capturable_clip, arg_mismatches) are tested with their suites of
# learner mistakes in tests/test_checks_lesson03.py.


def test_error_text_joins_the_chain_root_cause_first():
    from labkit.guards import error_text
    try:
        try:
            raise RuntimeError("refused\nsecond line")
        except RuntimeError:
            raise RuntimeError("capture invalidated")
    except RuntimeError as e:
        assert error_text(e) == "refused\nsecond line\ncapture invalidated"


def test_lint_boolean_mask_assignment_goes_by_the_value(B):
    """``x[mask] = 0.0`` becomes masked_fill_ on a GPU (canDispatchToMaskedFill); with a
    device tensor as value it goes through nonzero, and masked_fill reads a device tensor
    value with .item(). The linter says what a real capture does (test_backend_behaviour)."""
    x = torch.randn(8, device=B.device)
    mask, zero = x > 0, torch.zeros((), device=B.device)

    def number(x, mask):
        y = x.clone()
        y[mask] = 0.0
        return y.masked_fill(mask, 1.0), torch.where(mask, zero, y)

    def tensor_value(x, mask):
        y = x.clone()
        y[mask] = zero
        return y

    assert lint_capture(number, x, mask, B=B).kinds == []
    assert lint_capture(tensor_value, x, mask, B=B).kinds == ["dynamic_shape"]
    assert lint_capture(lambda x, m: x.masked_fill(m, zero), x, mask, B=B).kinds == ["cpu_sync"]
    assert lint_capture(lambda x: torch.histc(x), x, B=B).kinds == ["cpu_sync"]
    assert lint_capture(lambda x: torch.histc(x, 4, -3, 3), x, B=B).kinds == []
