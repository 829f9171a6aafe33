"""labkit.bench: the results file, the rendering (synthetic rows, in a tmp dir only), the
command line on a machine without a GPU, and the suites' code on the emulator."""

from __future__ import annotations

import json

import pytest
import torch

from labkit import backend
from labkit import full_step as FS
from labkit.bench import SUITES, make_row, report, run_suite
from labkit.bench.__main__ import main

DEV = "Synthetic GPU"


def row(suite, variant, median, *, config_name="c", bs=1, busy=None, date="2026-01-01T00:00:00Z",
        device=DEV, **more):
    r = {"suite": suite, "config_name": config_name, "config": {"d": 1}, "batch_size": bs,
         "variant": variant, "median_us": median, "device": device, "torch": "0.0",
         "date": date}
    if busy is not None:
        r["gpu_busy_us"] = busy
    r.update(more)
    return r


def synthetic_rows():
    return [
        row("launch", "eager", 1050.0, config_name="chain100x256", bs=None, busy=110.0),
        row("launch", "graph", 115.0, config_name="chain100x256", bs=None, busy=108.0),
        row("train", "eager", 67700.0, config_name="bench", bs=4),
        row("train", "eager", 99999.0, config_name="bench", bs=4, date="2025-01-01T00:00:00Z"),
        row("train", "torch_make_graphed_callables", 19400.0, config_name="bench", bs=4),
        row("train", "labkit_full_step", 7400.0, config_name="bench", bs=4, busy=6900.0),
        row("train", "labkit_bridge", None, config_name="bench", bs=4,
            note="skipped: labkit.bridge has no make_graphed_callables"),
        *[row("decode", v, m * bs ** 0.3, config_name="gpt", bs=bs,
              back_to_back_us=0.7 * m * bs ** 0.3,
              extra={"kernels": 90, "kernel_floor_us": 80.0, "bytes_floor_us": 13.0 * bs ** 0.5})
          for bs in (1, 8, 64)
          for v, m in (("eager", 3000.0), ("labkit_graph", 400.0),
                       ("compile_reduce_overhead", 350.0))],
        row("serve", "eager", 2500.0, config_name="gpt", bs=None,
            extra={"decode_tokens_per_s": 9000.0}),
        row("serve", "labkit_graph_overlap", 300.0, config_name="gpt", bs=None,
            extra={"decode_tokens_per_s": 90000.0}),
        row("capture", "shared_pool", 900.0, config_name="6x", bs=8,
            extra={"reserved_MiB": 4.0, "graphs": 6}),
        row("capture", "separate_pools", 950.0, config_name="6x", bs=8,
            extra={"reserved_MiB": 12.0, "graphs": 6}),
        row("piecewise", "eager", 5000.0, config_name="gpt · prefill 8x8", bs=8,
            extra={"tokens": 64}),
        row("piecewise", "piecewise", 900.0, config_name="gpt · prefill 8x8", bs=8,
            extra={"tokens": 64, "bucket": 64}),
        row("tp", "labkit_graph", 300.0, config_name="gpt", bs=8),
        row("tp", "tp2_graph", 250.0, config_name="gpt", bs=8),
    ]


def test_latest_keeps_the_newest_row_per_key():
    rows = report.latest(synthetic_rows(), suite="train")
    eager = [r for r in rows if r["variant"] == "eager"]
    assert len(eager) == 1 and eager[0]["median_us"] == 67700.0
    assert [r["variant"] for r in rows] == ["eager", "labkit_bridge",
                                            "torch_make_graphed_callables", "labkit_full_step"]
    sp = report.speedups(rows)
    full = next(r for r in rows if r["variant"] == "labkit_full_step")
    assert sp[id(full)] == pytest.approx(67700 / 7400)


def test_append_validates_and_appends(tmp_path):
    path = tmp_path / "results.json"
    report.append_results(synthetic_rows()[:2], path)
    report.append_results(synthetic_rows()[2:4], path)
    assert len(json.loads(path.read_text())) == 4
    with pytest.raises(ValueError, match="lacks"):
        report.append_results([{"suite": "train"}], path)
    with pytest.raises(ValueError, match="needs a note"):
        report.append_results([row("train", "eager", None)], path)
    assert len(report.load_results(path)) == 4


def test_render_tables_and_plots_in_a_tmp_dir(tmp_path):
    docs = report.default_results_path().parent
    before = sorted(p.name for p in docs.iterdir()) if docs.exists() else None
    results = tmp_path / "results.json"
    report.append_results(synthetic_rows(), results)
    written = report.render(results, tmp_path / "out")
    names = sorted(p.name for p in written)
    assert names == sorted(["README.md", "launch-synthetic-gpu.png", "train-synthetic-gpu.png",
                            "decode-synthetic-gpu.png", "capture-synthetic-gpu.png",
                            "serve-synthetic-gpu.png", "piecewise-synthetic-gpu.png",
                            "tp-synthetic-gpu.png"])
    for p in written:
        if p.suffix == ".png":
            assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 1000
    md = (tmp_path / "out" / "README.md").read_text()
    for suite in SUITES:
        assert f"## {suite}" in md and f"({suite}-synthetic-gpu.png)" in md
    assert "| bench | 4 | `labkit_full_step` | 7.40 ms | — | 6.90 ms | 9.15× |" in md
    # both methods, named: the synced median and the back-to-back time of the same row
    assert "| synced | back to back | GPU busy |" in md
    assert "| gpt | 1 | `labkit_graph` | 400.0 µs | 280.0 µs |" in md
    assert "skipped: labkit.bridge has no make_graphed_callables" in md
    assert "99.99 ms" not in md                       # the older eager row is not shown
    assert "reserved_MiB=4" in md
    assert "at most 1.10× its GPU busy time" in md    # the targets line
    after = sorted(p.name for p in docs.iterdir()) if docs.exists() else None
    assert after == before                            # docs/ untouched


def test_render_refuses_a_missing_or_empty_results_file(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text("| the committed tables |\n")
    with pytest.raises(report.ResultsError, match="none.json does not exist"):
        report.render(tmp_path / "none.json", tmp_path)
    (tmp_path / "empty.json").write_text("[]")
    with pytest.raises(report.ResultsError, match="empty.json holds no rows"):
        report.render(tmp_path / "empty.json", tmp_path)
    assert readme.read_text() == "| the committed tables |\n"     # never replaced
    assert sorted(p.name for p in tmp_path.iterdir()) == ["README.md", "empty.json"]


@pytest.mark.parametrize("text, words", [
    ("{ not json", "is not valid JSON (line 1"),
    ('{"suite": "train"}', "must hold a JSON list of rows, not a dict"),
    ('[{"suite": "train"}]', "row 0: benchmark row lacks"),
    ('[1]', "row 0: a benchmark row must be an object"),
])
def test_load_results_names_the_file_and_the_problem(tmp_path, text, words):
    path = tmp_path / "results.json"
    path.write_text(text)
    with pytest.raises(report.ResultsError) as info:
        report.load_results(path)
    assert str(path) in str(info.value) and words in str(info.value)
    with pytest.raises(report.ResultsError):     # appending does not overwrite it either
        report.append_results(synthetic_rows()[:1], path)
    assert path.read_text() == text


def test_cli_render_only(tmp_path, capsys):
    results = tmp_path / "results.json"
    report.append_results(synthetic_rows(), results)
    assert main(["--render", "--results", str(results), "--out", str(tmp_path / "o")]) == 0
    assert (tmp_path / "o" / "README.md").exists()
    assert "wrote" in capsys.readouterr().out


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_cli_without_gpu_says_so_and_exits_0(tmp_path, capsys):
    results = tmp_path / "results.json"
    assert main(["train", "--results", str(results)]) == 0
    out = capsys.readouterr().out
    assert "needs a CUDA GPU" in out and "Nothing was measured" in out
    assert not results.exists()


def test_cli_unknown_suite(capsys):
    with pytest.raises(SystemExit) as info:
        main(["nope"])
    assert info.value.code == 2
    assert ("unknown suite(s) 'nope': choose from launch, decode, serve, train, capture, "
            "piecewise") in capsys.readouterr().err


def test_make_row_schema():
    r = make_row(backend.get("emulated"), "train", "tiny", {"a": 1}, 2, "eager", 12.3456789,
                 gpu_busy_us=None)
    report.validate_row(r)
    assert set(report.REQUIRED_KEYS) <= set(r) and "gpu_busy_us" not in r
    assert r["median_us"] == 12.346 and r["device"].startswith("CPU (emulated")


# ---- the suites' code, on the emulator (numbers meaningless; the code paths are not) -------

def test_suites_run_on_the_emulator():
    E = backend.get("emulated")
    quiet = lambda *a, **k: None  # noqa: E731
    tiny = FS.LMConfig(vocab_size=32, d_model=16, n_layers=2, n_heads=2, seq_len=8,
                       micro_batch=2, num_microbatches=2)
    rows = run_suite("launch", E, quick=True, log=quiet, rounds=2)
    rows += run_suite("capture", E, quick=True, log=quiet, batch_sizes=(2,), d_model=16,
                      n_layers=2, seq=8, rounds=2)
    rows += run_suite("train", E, quick=True, log=quiet, cfg=tiny, rounds=2)
    rows += run_suite("decode", E, quick=True, log=quiet, batch_sizes=(2,), rounds=2,
                      variants=("eager", "reference_eager", "labkit_graph",
                                "compile_reduce_overhead", "compile_reduce_overhead_static"))
    rows += run_suite("serve", E, quick=True, log=quiet, rounds=2)
    rows += run_suite("piecewise", E, quick=True, log=quiet, rounds=2)
    for r in rows:
        report.validate_row(r)
        if r["median_us"] is not None:      # every measured row keeps its two rounds
            rounds = r["extra"]["rounds"]
            assert rounds["median_us"] and all(len(v) == 2 for v in rounds.values()), r
            assert min(rounds["median_us"]) <= r["median_us"] <= max(rounds["median_us"])
    got = {(r["suite"], r["variant"]): r for r in rows}
    for key in [("launch", "eager"), ("launch", "graph"), ("capture", "shared_pool"),
                ("capture", "separate_pools"), ("train", "eager"),
                ("train", "torch_make_graphed_callables"), ("train", "labkit_full_step"),
                ("decode", "eager"), ("decode", "reference_eager"), ("decode", "labkit_graph"),
                ("capture", "decode_runner_torch_native")]:
        assert got[key]["median_us"] > 0, (key, got[key].get("note"))
    assert got[("train", "compile_reduce_overhead")]["median_us"] is None
    drift = {v: got[("train", v)]["extra"]["max_abs_diff_vs_eager"]
             for v in ("labkit_bridge", "labkit_full_step", "labkit_bridge_no_clone",
                       "torch_make_graphed_callables")}
    assert drift["labkit_bridge"] < 1e-5 and drift["labkit_full_step"] < 1e-5, drift
    # the static wgrad buffers, uncloned, break gradient accumulation (pytorch#181723)
    assert drift["labkit_bridge_no_clone"] > 1e-4, drift
    assert drift["torch_make_graphed_callables"] > 1e-4, drift
    assert "max_abs_diff_vs_eager" not in (got[("train", "eager")].get("extra") or {})
    assert "GPU" in got[("decode", "compile_reduce_overhead")]["note"]
    assert "GPU" in got[("decode", "compile_reduce_overhead_static")]["note"]
    for key in [("decode", "eager"), ("decode", "labkit_graph"), ("train", "labkit_full_step")]:
        assert got[key]["back_to_back_us"] > 0, key            # both methods, every row
    for v in ("eager", "labkit_graph", "labkit_graph_overlap"):
        r = got[("serve", v)]
        assert r["median_us"] > 0 and "note" not in r, (v, r.get("note"))   # same tokens
        assert r["config"]["overlap"] == v.endswith("overlap")
        assert r["extra"]["decode_tokens_per_s"] > 0
    assert "GPU" in got[("serve", "labkit_graph_compiled")]["note"]
    shared, separate = got[("capture", "shared_pool")], got[("capture", "separate_pools")]
    assert shared["extra"]["reserved_MiB"] < separate["extra"]["reserved_MiB"]
    runner = got[("capture", "decode_runner_torch_native")]
    assert runner["batch_size"] == 4 and runner["extra"]["graphs"] == 3   # buckets 1, 2, 4
    kernels = runner["extra"]["kernels_per_graph"]
    assert set(kernels) == {"1", "4"} and kernels["1"] == kernels["4"] > 0   # same step, padded
    pw = [r for r in rows if r["suite"] == "piecewise" and r["median_us"] is not None]
    assert {r["variant"] for r in pw} == {"eager", "piecewise", "full_graph"}
    for r in pw:      # every variant's greedy tokens are eager's
        assert r["extra"]["greedy_agree"] == 1.0, r
    assert "GPU" in got[("piecewise", "compile_dynamic")]["note"]


# ---- labkit.core.timing: the one timer, trace reader and GPU-busy time ---------------------

def test_bench_timing_is_core_timing():
    from labkit.bench import timing as bench_timing
    from labkit.core import timing

    for name in ("measure_us", "time_call", "profile_gpu_busy_us", "device_name"):
        assert getattr(bench_timing, name) is getattr(timing, name), name


def test_busy_us_counts_overlaps_once():
    from labkit.core.timing import busy_us

    assert busy_us([]) == 0.0
    assert busy_us([(0, 2), (5, 6)]) == 3
    assert busy_us([(0, 4), (1, 2), (3, 6), (10, 11)]) == 7     # 0..6 once, then 10..11


def test_time_call_medians_per_call_and_checks_its_arguments():
    from labkit.core.timing import Timing, measure_us, time_call

    E = backend.get("emulated")
    calls = []
    t = time_call(lambda: calls.append(1), E, warmup=2, repeats=3, inner=4)
    assert isinstance(t, Timing) and len(calls) == 2 + 3 * 4
    assert 0 < t.device_us and 0 < t.host_us
    assert measure_us(lambda: None, E, warmup=0, repeats=1) > 0
    with pytest.raises(ValueError, match="repeats must be >= 1, got 0"):
        time_call(lambda: None, E, repeats=0)
    with pytest.raises(TypeError, match="inner must be an int >= 1, got 2.5"):
        time_call(lambda: None, E, inner=2.5)
    with pytest.raises(TypeError, match="pass the function, not its result"):
        time_call(None, E)


def test_trace_reader_names_a_bad_trace(tmp_path):
    from labkit.core.timing import complete_events, read_chrome_trace

    events = [{"ph": "X", "name": "k", "cat": "kernel", "ts": 1, "dur": 2},
              {"ph": "M", "name": "process_name"}, {"ph": "i", "name": "marker", "ts": 3}]
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"traceEvents": events}))
    assert [e["name"] for e in complete_events(path)] == ["k"]
    assert read_chrome_trace({"traceEvents": []}) == {"traceEvents": []}
    with pytest.raises(ValueError, match="no trace file at"):
        read_chrome_trace(tmp_path / "missing.json")
    (tmp_path / "list.json").write_text("[]")
    with pytest.raises(ValueError, match="holds a JSON list"):
        read_chrome_trace(tmp_path / "list.json")
    with pytest.raises(TypeError, match="Chrome-trace dict or a path"):
        read_chrome_trace(5)
    with pytest.raises(ValueError, match="traceEvents\" must be a list"):
        complete_events({"traceEvents": {}})
    with pytest.raises(ValueError, match="trace event 0 \\('k'\\) has no numeric ts/dur"):
        complete_events({"traceEvents": [{"ph": "X", "name": "k", "ts": "x", "dur": 1}]})


def test_no_gpu_busy_time_and_an_emulator_label_without_a_gpu():
    from labkit.core.timing import device_name, profile_gpu_busy_us

    E = backend.get("emulated")
    assert profile_gpu_busy_us(lambda: None, E) is None
    assert device_name(E) == "CPU (emulated CUDA graphs)"


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_busy_time_of_a_chain_and_its_replay():
    from labkit import timeline as T
    from labkit.core.timing import GPU_EVENT_CATEGORIES, profile_gpu_busy_us, record_chrome_trace

    Bc = backend.get("cuda")
    steps = T.chain_steps(Bc, n_ops=20, numel=256)
    trace = record_chrome_trace(steps.graphed, Bc)
    kernels = [e for e in trace["traceEvents"] if e.get("cat") in GPU_EVENT_CATEGORIES]
    assert len(kernels) >= 20, f"{len(kernels)} GPU events for a replay of 20 adds"
    for fn in (steps.eager, steps.graphed):
        busy = profile_gpu_busy_us(fn, Bc)
        assert busy is not None and busy > 0


# ---- labkit.bench.emulator_cost (was labkit.emulator.cost) ---------------------------------

def test_emulator_cost_runs_and_replay_agrees_with_eager(capsys):
    from labkit.bench.emulator_cost import main, replay_vs_eager

    r = replay_vs_eager(d_model=16, nhead=2, batch=2, seq=4, iters=2)
    assert r["results_equal"] and r["ops_recorded"] > 0
    assert r["eager_us"] > 0 and r["replay_us"] > 0
    with pytest.raises(ValueError, match="d_model=10 must be a multiple of nhead=4"):
        replay_vs_eager(d_model=10, nhead=4)
    with pytest.raises(TypeError, match="iters must be an int >= 1, got 2.5"):
        replay_vs_eager(iters=2.5)
    with pytest.raises(SystemExit) as exit_:
        main(["--iters", "0"])
    assert exit_.value.code == 2
    assert "--iters: must be at least 1, got 0" in capsys.readouterr().err


def test_back_to_back_us_times_calls_without_a_sync_between_them():
    from labkit.core.timing import back_to_back_us

    E = backend.get("emulated")
    calls = []
    us = back_to_back_us(lambda: calls.append(1), E, calls=7, warmup=2, repeats=3)
    assert us > 0 and len(calls) == 2 + 7 * 3
    for bad, kw in ((TypeError, {"fn": 3}), (ValueError, {"calls": 0}),
                    (ValueError, {"repeats": 0})):
        args = {"fn": lambda: None, **kw}
        with pytest.raises(bad):
            back_to_back_us(args.pop("fn"), E, **args)


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_reference_model_computes_labkits_logits(kv_heads):
    """The baseline runs labkit's weights with gpt-fast's dense cache: same logits."""
    from labkit import decode as D
    from labkit.bench.reference import ReferenceGPT

    model = D.build_model(D.ModelArgs(vocab_size=64, n_layer=2, n_head=4,
                                      n_local_heads=kv_heads, dim=32, max_seq_len=32),
                          max_requests=4)
    with torch.no_grad():
        for layer in model.layers:
            layer.attention.kv_cache.kv.normal_()
    ref = ReferenceGPT(model, max_bs=4)
    ref.load_kv(model, [3, 1, 4])
    batch = D.make_decode_batch(model, [3, 1, 4], [5, 6, 7], [9, 0, 31])
    with torch.no_grad():
        want = D.EagerRunner(model).forward(batch)
        got = ref(batch.input_ids, batch.positions)
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()
    # and it really attends over its own cache: a changed cached key changes the logits
    with torch.no_grad():
        ref.caches[0].k_cache[0, :, 4].add_(1.0)
        assert not torch.allclose(ref(batch.input_ids, batch.positions)[0], want[0], atol=1e-4)


def test_floors_are_drawn_on_the_decode_plot(tmp_path):
    import matplotlib.pyplot as plt

    rows = [r for r in synthetic_rows() if r["suite"] == "decode"]
    open_before = set(plt.get_fignums())   # figures other tests left open are not ours
    path = report.plot_suite(rows, tmp_path / "d.png", title="decode")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert set(plt.get_fignums()) == open_before   # the figure was closed: none left open


def test_the_bench_offers_the_compile_modes_the_runner_takes():
    """``python -m labkit.bench`` keeps its own list (``--render`` must not import torch):
    it is the runner's, no more, no less."""
    from labkit.bench.__main__ import COMPILE_MODES
    from labkit.decode.validation import COMPILE_MODES as _COMPILE_MODES

    assert set(COMPILE_MODES) == set(_COMPILE_MODES)


# ---- the committed results, shipped with the package ---------------------------------------

def test_the_packaged_results_are_the_committed_ones():
    docs, packaged = report.checkout_results_path(), report.packaged_results_path()
    assert packaged.parent.name == "data" and packaged.parent.parent.name == "bench"
    assert docs.read_bytes() == packaged.read_bytes(), (
        f"{packaged} differs from {docs}: every install without a checkout (a wheel, Colab) "
        f"reads the packaged copy. `python -m labkit.bench` rewrites both when it appends; "
        f"after editing {docs} by hand, copy it over the packaged one")
    assert report.load_results(packaged) == report.load_results(docs)
    assert any(r["device"] == "NVIDIA H200" for r in report.load_results(packaged))


def test_the_default_is_docs_in_a_checkout_and_the_packaged_copy_elsewhere(tmp_path,
                                                                            monkeypatch):
    assert report.default_results_path() == report.checkout_results_path()   # this checkout
    monkeypatch.setattr(report, "_checkout_root", lambda: tmp_path)   # e.g. site-packages
    assert report.default_results_path() == report.packaged_results_path()
    assert report.load_results() == report.load_results(report.packaged_results_path())
    (tmp_path / "docs" / "benchmarks").mkdir(parents=True)             # docs/ alone: not one
    assert report.default_results_path() == report.packaged_results_path()
    (tmp_path / "pyproject.toml").write_text("")
    assert report.default_results_path() == tmp_path / "docs" / "benchmarks" / "results.json"


def test_appending_to_the_checkout_file_rewrites_the_packaged_copy(tmp_path, monkeypatch):
    docs = tmp_path / "docs" / "benchmarks" / "results.json"
    packaged = tmp_path / "labkit" / "bench" / "data" / "results.json"
    monkeypatch.setattr(report, "checkout_results_path", lambda: docs)
    monkeypatch.setattr(report, "packaged_results_path", lambda: packaged)
    report.append_results(synthetic_rows()[:2], docs)
    assert packaged.read_bytes() == docs.read_bytes()
    report.append_results(synthetic_rows()[2:4], docs)
    assert packaged.read_bytes() == docs.read_bytes() and len(report.load_results(packaged)) == 4
    other = tmp_path / "mine.json"                 # any other file: the copy is left alone
    report.append_results(synthetic_rows()[4:5], other)
    assert len(report.load_results(packaged)) == 4


def test_the_cli_appending_to_the_default_keeps_the_copy_in_sync(tmp_path, monkeypatch):
    """``python -m labkit.bench`` appends to ``default_results_path()`` (GPU only, so here
    the same call it makes, on a checkout in a tmp dir)."""
    (tmp_path / "docs" / "benchmarks").mkdir(parents=True)
    (tmp_path / "pyproject.toml").write_text("")
    packaged = tmp_path / "labkit" / "bench" / "data" / "results.json"
    monkeypatch.setattr(report, "_checkout_root", lambda: tmp_path)
    monkeypatch.setattr(report, "packaged_results_path", lambda: packaged)
    path = report.append_results(synthetic_rows()[:3], report.default_results_path())
    assert path == tmp_path / "docs" / "benchmarks" / "results.json"
    assert packaged.read_bytes() == path.read_bytes()


def test_a_wheel_install_reads_the_committed_results_from_an_empty_folder(tmp_path):
    """Build a wheel of the checkout (as tests/test_walkthrough_colab.py does: offline, from a
    copy), install it into a folder of its own and call ``load_results()`` with no path
    from an empty folder, with that folder first on ``sys.path``."""
    import importlib.util
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    spec = importlib.util.spec_from_file_location("_wt", root / "tests" /
                                                  "test_walkthrough_colab.py")
    wt = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(wt)
    wheel = wt.build_wheel(tmp_path / "build")
    target, empty = tmp_path / "site", tmp_path / "empty"
    empty.mkdir()
    p = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target",
                        str(target), str(wheel)], capture_output=True, text=True,
                       env=wt._pip_env())
    assert p.returncode == 0, p.stderr
    probe = ("import json, labkit, labkit.bench.report as r\n"
             "rows = r.load_results()\n"
             "print(json.dumps({'labkit': labkit.__file__, 'path': str(r.default_results_path()),"
             " 'rows': len(rows), 'h200': sorted({x['suite'] for x in rows"
             " if x['device'] == 'NVIDIA H200'})}))\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONHOME", "PYTHONSTARTUP")}
    env["PYTHONPATH"] = str(target)
    p = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env,
                       cwd=empty)
    assert p.returncode == 0, p.stderr
    got = json.loads(p.stdout.splitlines()[-1])
    assert Path(got["labkit"]).parent == target / "labkit", got   # the wheel's, not the checkout
    assert got["path"] == str(target / "labkit" / "bench" / "data" / "results.json")
    assert got["rows"] == len(report.load_results(report.checkout_results_path()))
    committed = report.load_results(report.checkout_results_path())
    assert "decode" in got["h200"] and got["h200"] == sorted(
        {x["suite"] for x in committed if x["device"] == "NVIDIA H200"})
    assert list(empty.iterdir()) == []
