"""The bench variants are declared once (labkit.bench.variants) and rows are a dataclass
(labkit.bench.rows): an undeclared variant is refused wherever rows are made, read,
ordered or compared, and every committed row reads and writes back to the same JSON."""

import json
from pathlib import Path

import pytest

from labkit import backend
from labkit.bench import decode, make_row, piecewise, report, serve, train
from labkit.bench import variants as V
from labkit.bench import verdicts as VD
from labkit.bench.rows import Row

RESULTS = Path(__file__).resolve().parents[1] / "docs" / "benchmarks" / "results.json"


def _row(suite="decode", variant="eager", **more):
    r = {"suite": suite, "config_name": "c", "config": {}, "batch_size": 1,
         "variant": variant, "median_us": 1.0, "device": "GPU", "torch": "0", "date": "d"}
    r.update(more)
    return r


def test_every_committed_row_round_trips_to_the_same_json():
    text = RESULTS.read_text(encoding="utf-8")
    rows = json.loads(text)
    again = [Row.from_dict(r).to_dict() for r in rows]
    assert json.dumps(again, indent=1) + "\n" == text


def test_a_row_keeps_optional_keys_out_where_unset_and_in_the_files_order():
    r = _row(run="r1", extra={"rounds": {"median_us": [1.0]}}, back_to_back_us=0.5)
    assert list(Row.from_dict(r).to_dict()) == [
        "suite", "config_name", "config", "batch_size", "variant", "median_us",
        "back_to_back_us", "device", "torch", "date", "run", "extra"]


def test_make_row_refuses_an_undeclared_variant_naming_suite_and_declared_ones():
    with pytest.raises(V.UndeclaredVariant,
                       match=r"undeclared bench variant 'labkit_grpah' in suite 'decode': "
                             r"the declared ones are eager, eager_triton, .*labkit_graph"):
        make_row(backend.get("emulated"), "decode", "c", {}, 1, "labkit_grpah", 1.0)


def test_an_undeclared_suite_is_refused_naming_the_declared_ones():
    with pytest.raises(V.UndeclaredVariant, match="unknown bench suite 'decod'.*launch, decode"):
        make_row(backend.get("emulated"), "decod", "c", {}, 1, "eager", 1.0)


def test_reading_and_ordering_refuse_an_undeclared_variant(tmp_path):
    with pytest.raises(ValueError, match="undeclared bench variant 'fast' in suite 'train'"):
        report.validate_row(_row("train", "fast"))
    path = tmp_path / "results.json"
    path.write_text(json.dumps([_row("train", "fast")]))
    with pytest.raises(report.ResultsError, match="row 0: undeclared bench variant 'fast'"):
        report.load_results(path)
    with pytest.raises(V.UndeclaredVariant, match="'fast' in suite 'train'"):
        report.latest([_row("train", "eager"), _row("train", "fast")])


def test_a_row_with_an_unknown_key_is_refused_not_dropped():
    with pytest.raises(ValueError, match=r"unknown keys \['median'\].*put suite-specific"):
        report.validate_row(_row(median=3.0))


def test_latest_sorts_by_declaration_order():
    rows = [_row(variant=v) for v in ("compile_reduce_overhead_static", "labkit_graph_staged",
                                      "eager", "labkit_graph")]
    assert [r["variant"] for r in report.latest(rows)] == [
        "eager", "labkit_graph", "labkit_graph_staged", "compile_reduce_overhead_static"]


def test_comparisons_refuse_a_mistyped_pair_instead_of_comparing_nothing():
    with pytest.raises(V.UndeclaredVariant, match="'labkit_grph' in suite 'decode'"):
        report.quote("decode", [("labkit_grph", "eager")], rows=[])
    assert report.quote("decode", [("labkit_best", "eager")], rows=[]) == []


@pytest.mark.parametrize("module", [decode, serve, train, piecewise])
def test_a_suite_refuses_an_undeclared_variant_before_building_anything(module):
    suite = module.__name__.rsplit(".", 1)[-1]
    with pytest.raises(V.UndeclaredVariant, match=f"'nope' in suite '{suite}'"):
        module.run(backend.get("emulated"), variants=("eager", "nope"))


def test_a_staged_variant_is_asked_for_through_its_runner():
    with pytest.raises(V.UndeclaredVariant, match="ask for 'labkit_graph' instead"):
        decode.run(backend.get("emulated"), variants=("labkit_graph_staged",))


def test_the_suites_read_their_variants_from_the_registry():
    assert decode.VARIANTS == tuple(v.name for v in V.declared("decode") if not v.staged_of)
    assert decode.STAGED == {"labkit_graph": "labkit_graph_staged",
                             "labkit_graph_compiled": "labkit_graph_compiled_staged"}
    assert set(decode.GPU_ONLY) == {"eager_triton", "labkit_graph_compiled",
                                    "compile_reduce_overhead", "compile_reduce_overhead_static"}
    for suite in V.SUITE_ORDER:
        assert V.SUITE_TEXT[suite] and all(v.text and v.suite == suite
                                           for v in V.declared(suite))
        assert len(set(V.names(suite))) == len(V.names(suite))
    for suite, pairs in VD.PAIRS.items():
        assert VD.check_pairs(suite, pairs) == list(pairs)
