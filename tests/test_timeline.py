"""labkit.timeline (lesson 01): simulation math, idle time, roofline, traces (the lesson 01
checkers are in test_checks_lesson01.py).

Everything here is deterministic and fast except the measurement tests, which only check
that the numbers are sane; the ``cuda`` ones record a real profiler trace on a GPU.
"""

import json
import math
import warnings

import pytest
import torch

from labkit import backend
from labkit import timeline as T
from labkit.checks import lesson01 as C

# --------------------------------------------------------------------------- simulation


def test_eager_launch_bound_schedule():
    tl = T.simulate(3, launch_us=5.0, kernel_us=2.0, gap_us=0.0)
    cpu = [(s.start_us, s.end_us) for s in tl.lane(T.CPU)]
    gpu = [(s.start_us, s.end_us) for s in tl.lane(T.GPU)]
    assert cpu == [(0, 5), (5, 10), (10, 15)]
    assert gpu == [(5, 7), (10, 12), (15, 17)]  # each kernel waits for its launch
    assert tl.makespan_us == 17
    assert T.gpu_busy_us(tl) == 6
    assert T.gpu_idle_us(tl) == 11
    assert tl.source == "simulated" and tl.tag == "simulated"


def test_eager_gpu_bound_schedule_queues_kernels():
    tl = T.simulate(3, launch_us=2.0, kernel_us=5.0, gap_us=0.0)
    gpu = [(s.start_us, s.end_us) for s in tl.lane(T.GPU)]
    assert gpu == [(2, 7), (7, 12), (12, 17)]  # back to back: the queue hides launches
    assert T.gpu_idle_us(tl) == 2  # only the first launch
    assert T.gpu_idle_fraction(tl) == pytest.approx(2 / 17)


def test_graphed_schedule_one_launch():
    tl = T.simulate(4, launch_us=5.0, kernel_us=2.0, graphed=True, gap_us=0.5)
    assert [s.name for s in tl.lane(T.CPU)] == ["cudaGraphLaunch"]
    gpu = [(s.start_us, s.end_us) for s in tl.lane(T.GPU)]
    assert gpu == [(5, 7), (7.5, 9.5), (10, 12), (12.5, 14.5)]
    assert T.gpu_idle_us(tl) == pytest.approx(5 + 3 * 0.5)
    custom = T.simulate(4, 5.0, 2.0, graphed=True, graph_launch_us=8.0, gap_us=0.0)
    assert custom.lane(T.GPU)[0].start_us == 8.0 and custom.makespan_us == 16.0


def test_graph_removes_launch_cost_not_kernel_time():
    # launch-bound: the graph wins by about launch/kernel
    eager, graphed = T.simulate_pair(100, 10.0, 1.0, gap_us=0.0)
    assert eager.makespan_us == pytest.approx(100 * 10 + 1)
    assert graphed.makespan_us == pytest.approx(10 + 100 * 1)
    # GPU-bound: same gap in both modes → the same step time
    eager, graphed = T.simulate_pair(50, 3.0, 20.0, gap_us=0.2)
    assert eager.makespan_us == pytest.approx(graphed.makespan_us)


def test_per_kernel_durations_and_validation():
    tl = T.simulate(3, 4.0, [1.0, 10.0, 1.0], gap_us=0.0)
    assert [(s.start_us, s.dur_us) for s in tl.lane(T.GPU)] == [(4, 1), (8, 10), (18, 1)]
    with pytest.raises(ValueError, match="3 kernels"):
        T.simulate(3, 4.0, [1.0, 2.0])
    with pytest.raises(ValueError):
        T.Timeline([], source="guessed")
    empty = T.simulate(0, 5.0, 1.0)
    assert T.gpu_idle_us(empty) == 0 and T.gpu_idle_fraction(empty) == 0


def test_idle_matches_closed_form():
    for n, L, K in [(1, 5, 2), (10, 5, 2), (10, 2, 5), (7, 3, 3), (40, 10.5, 0.9)]:
        tl = T.simulate(n, L, K, gap_us=0.0)
        makespan = n * L + K if K <= L else L + n * K
        assert T.gpu_idle_us(tl) == pytest.approx(makespan - n * K)


def test_overlapping_kernels_count_once():
    spans = [T.Span(T.GPU, "a", 0, 10), T.Span(T.GPU, "b", 5, 10), T.Span(T.GPU, "c", 20, 5)]
    tl = T.Timeline(spans, source="measured")
    assert T.gpu_busy_us(tl) == 20
    assert T.gpu_idle_us(tl) == 5


def test_preset_h200_reproduces_reference():
    """The H200 preset was chosen to match the lesson's reference measurement."""
    ref = T.REFERENCE_H200
    p = T.GPU_PRESETS["H200"]
    eager, graphed = T.simulate_pair(100, ref["eager_us_per_kernel"], p.kernel_floor_us,
                                     preset="H200")
    assert eager.makespan_us / 100 == pytest.approx(ref["eager_us_per_kernel"], rel=0.05)
    assert graphed.makespan_us / 100 == pytest.approx(ref["graph_us_per_kernel"], rel=0.05)
    assert graphed.tag == "simulated (H200)"


def test_summarize_is_stable():
    s = T.summarize(T.simulate(10, 5.0, 2.0, gap_us=0.0))
    assert s == {"tag": "simulated", "label": "eager: 10 kernels", "launches": 10,
                 "kernels": 10, "step_us": 52.0, "gpu_busy_us": 20.0, "gpu_idle_us": 32.0,
                 "gpu_idle_fraction": 0.6154}


# --------------------------------------------------------------------------- roofline


def test_presets_present_and_sane():
    for name in ("H100", "H200", "A100", "T4", "L4"):
        p = T.GPU_PRESETS[name]
        assert p.fp16_tflops > p.fp32_tflops > 0
        assert p.hbm_gbps > 0 and 0 < p.kernel_floor_us < 10
    assert T.GPU_PRESETS["H200"].hbm_gbps > T.GPU_PRESETS["H100"].hbm_gbps
    assert T.get_preset("h100") is T.GPU_PRESETS["H100"]
    with pytest.raises(KeyError, match="H200"):
        T.get_preset("Z9000")


def test_roofline_regimes():
    p = T.GPU_PRESETS["A100"]
    assert T.roofline_kernel_us(10, 10, p) == p.kernel_floor_us  # tiny: the floor
    gb = 1e9
    assert T.roofline_kernel_us(1, gb, p) == pytest.approx(gb / (p.hbm_gbps * 1e9) * 1e6)
    tf = 1e12
    assert T.roofline_kernel_us(tf, 1, p, "fp16") == pytest.approx(1e6 / p.fp16_tflops)
    assert T.roofline_kernel_us(tf, 1, p, "fp32") == pytest.approx(1e6 / p.fp32_tflops)
    with pytest.raises(ValueError):
        T.roofline_kernel_us(1, 1, p, "int8")
    assert T.add_chain_cost(1000) == (1000.0, 8000.0)
    assert T.add_chain_cost(1000, torch.float16) == (1000.0, 4000.0)


def test_simulated_sweep_has_a_crossover():
    numels = [2 ** k for k in range(8, 28, 2)]
    rows = T.sweep_simulated(numels, launch_us=10.0, preset="H200", n_kernels=100)
    assert [r["numel"] for r in rows] == numels
    small, big = rows[0], rows[-1]
    assert small["eager_us"] / small["graph_us"] > 5  # launch-bound: graphs win big
    assert big["eager_us"] / big["graph_us"] < 1.01  # GPU-bound: nothing to win
    c = T.crossover(rows)
    assert c is not None and numels[0] < c <= numels[-1]
    # the crossover sits where a kernel outlasts a launch
    k = {r["numel"]: r["kernel_us"] for r in rows}
    assert k[c] > 10.0


def test_crossover_requires_staying_close():
    rows = [{"numel": 1, "eager_us": 10, "graph_us": 10},
            {"numel": 2, "eager_us": 30, "graph_us": 10},
            {"numel": 4, "eager_us": 10.5, "graph_us": 10}]
    assert T.crossover(rows) == 4
    assert T.crossover(rows[:2]) is None


# --------------------------------------------------------------------------- traces


def test_chrome_trace_structure(tmp_path):
    tl = T.simulate(3, 5.0, 2.0, preset="T4")
    path = tmp_path / "t.json"
    trace = T.to_chrome_trace(tl, path)
    assert json.loads(path.read_text()) == trace
    xs = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(xs) == len(tl.spans)
    for e in xs:
        assert set(e) >= {"name", "ph", "pid", "tid", "ts", "dur"}
    lane_ids = {(e["pid"], e["tid"]) for e in xs}
    assert len(lane_ids) == 2  # one track per lane
    by_name = {e["name"]: e for e in xs}
    assert by_name["kernel 1"]["ts"] == tl.lane(T.GPU)[1].start_us  # µs, unconverted
    names = [e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"]
    assert any("simulated (T4)" in n for n in names)
    assert C._trace_problem(list(tl.spans), T.chrome_trace_events(tl.spans)) is None


def _kineto_like_trace():
    """A hand-made trace in the shape torch.profiler writes on a GPU (absolute µs)."""
    t0 = 1.7e12
    ev = [
        {"ph": "M", "name": "process_name", "pid": 1, "tid": 0, "args": {"name": "python"}},
        {"ph": "X", "cat": "cpu_op", "name": "aten::add", "pid": 1, "tid": 1, "ts": t0, "dur": 8},
        {"ph": "X", "cat": "cpu_op", "name": "aten::empty", "pid": 1, "tid": 1, "ts": t0 + 1,
         "dur": 1},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": 1,
         "ts": t0 + 4, "dur": 3, "args": {"correlation": 7}},
        {"ph": "X", "cat": "kernel", "name": "void vectorized_elementwise_kernel<...>", "pid": 0,
         "tid": 7, "ts": t0 + 9, "dur": 1.5, "args": {"correlation": 7}},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "pid": 1, "tid": 1,
         "ts": t0 + 20, "dur": 4},
        {"ph": "X", "cat": "kernel", "name": "k2", "pid": 0, "tid": 7, "ts": t0 + 25, "dur": 1},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaDeviceSynchronize", "pid": 1, "tid": 1,
         "ts": t0 + 24, "dur": 5},
        {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#1", "pid": 1, "tid": 1,
         "ts": t0 - 1, "dur": 40},
        {"ph": "s", "cat": "ac2g", "name": "ac2g", "id": 7, "pid": 1, "tid": 1, "ts": t0 + 4},
    ]
    return {"traceEvents": ev}


def test_timeline_from_chrome_trace(tmp_path):
    tl = T.timeline_from_chrome_trace(_kineto_like_trace(), label="x", device="GPU0")
    assert tl.source == "measured" and tl.tag == "measured (GPU0)"
    assert tl.lanes == [T.OPS, T.CPU, T.GPU]
    assert [s.name for s in tl.lane(T.CPU)] == ["cudaLaunchKernel", "cudaGraphLaunch"]
    assert [s.name for s in tl.lane(T.OPS)] == ["aten::add"]  # outermost op only
    assert [s.start_us for s in tl.lane(T.GPU)] == [9, 25]  # shifted to start at 0
    assert T.gpu_busy_us(tl) == 2.5
    path = tmp_path / "k.json"
    path.write_text(json.dumps(_kineto_like_trace()))
    again = T.timeline_from_chrome_trace(path, ops_lane=False)
    assert again.lanes == [T.CPU, T.GPU]
    with pytest.raises(ValueError, match="no GPU kernels"):
        T.timeline_from_chrome_trace({"traceEvents": _kineto_like_trace()["traceEvents"][:4]})


# --------------------------------------------------------------------------- plots, panel


def test_plots_render():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    eager, graphed = T.simulate_pair(8, 5.0, 1.0, preset="H100")
    ax = T.plot_timeline(eager)
    assert "simulated (H100)" in ax.get_title(loc="left")
    fig = T.plot_timelines([eager, graphed])
    assert len(fig.axes) == 2
    ax = T.plot_sweep(T.sweep_simulated([2 ** k for k in range(10, 26, 3)], 10.0))
    assert "simulated (H200)" in ax.get_title()
    plt.close("all")


def test_panel_static_fallback_and_widgets():
    static = T.timeline_panel(widgets=False)
    bundle = static._repr_mimebundle_()
    assert static.widget is None and set(bundle) == {"text/plain", "image/png"}
    pytest.importorskip("ipywidgets")
    live = T.timeline_panel(launch_us=10, kernel_us=2, n_kernels=10)
    bundle = live._repr_mimebundle_()
    assert "image/png" in bundle  # fallback travels with the widget
    assert "application/vnd.jupyter.widget-view+json" in bundle
    before = live.text()
    live._kernel.value = 50.0  # moving a slider redraws
    assert live.text() != before and live.kernel_us == 50.0
    # the picture is shown at its own pixel size (at most the cell's), never stretched
    from labkit.widgets import png_size

    width, _ = png_size(live._image.value)
    assert live._image.layout.width == f"{width}px" and live._image.layout.max_width == "100%"
    assert live.widget.layout.align_items == "flex-start"
    live._n.value = 30
    assert live._image.layout.width == f"{png_size(live._image.value)[0]}px"


def test_png_size_reads_the_header_and_refuses_other_bytes():
    import matplotlib.pyplot as plt

    from labkit.widgets import FIGURE_DPI, figure_png, png_size

    fig = plt.figure(figsize=(4, 2))
    assert png_size(figure_png(fig)) == (4 * FIGURE_DPI, 2 * FIGURE_DPI)
    with pytest.raises(ValueError, match="expected PNG bytes"):
        png_size(b"GIF89a....")


# --------------------------------------------------------------------------- measurement


def test_measure_launch_cost_keys_and_sanity(B):
    m = T.measure_launch_cost(B, n_ops=20, numel=64, repeats=3)
    for key in ("eager_us_per_kernel", "graph_us_per_kernel", "speedup", "eager_step_us",
                "graph_step_us", "cpu_us_per_launch", "cpu_us_per_replay"):
        assert math.isfinite(m[key]) and m[key] > 0, key
    assert m["backend"] == B.name and m["n_ops"] == 20
    assert m["eager_us_per_kernel"] == pytest.approx(m["eager_step_us"] / 20)
    assert m["speedup"] == pytest.approx(m["eager_step_us"] / m["graph_step_us"])
    assert m["timer"] == ("cuda events" if B.name == "cuda" else "perf_counter")
    if B.name != "cuda":
        assert "emulator" in m["note"]


def test_measure_launch_cost_times_in_interleaved_rounds(B):
    import statistics
    m = T.measure_launch_cost(B, n_ops=10, numel=16, repeats=2, rounds=3)
    eager, graph = m["rounds"]["eager_step_us"], m["rounds"]["graph_step_us"]
    assert len(eager) == len(graph) == 3             # one value per round, per side
    assert m["eager_step_us"] == statistics.median(eager)
    assert m["graph_step_us"] == statistics.median(graph)
    v = m["verdict"]
    assert (v.a, v.b, len(v.a_rounds)) == ("graph", "eager", 3)
    assert list(v.a_rounds) == graph and list(v.b_rounds) == eager


def test_sweep_measured_runs(B):
    rows = T.sweep_measured(B, [16, 256], n_ops=5, repeats=2)
    assert [r["numel"] for r in rows] == [16, 256]
    assert all(r["source"] == "measured" and r["eager_us"] > 0 for r in rows)


def test_profile_timeline_refuses_without_gpu():
    E = backend.get("emulated")
    with pytest.raises(RuntimeError, match="simulate"):
        T.profile_timeline(lambda: None, E)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_profile_timeline_on_gpu(tmp_path):
    Bc = backend.get("cuda")
    x = torch.zeros(256, device=Bc.device)

    def chain():
        y = x
        for _ in range(20):
            y = y + 1
        return y

    eager = T.profile_timeline(chain, Bc, label="eager", trace_path=tmp_path / "e.json")
    assert (tmp_path / "e.json").exists()
    assert eager.source == "measured"
    assert len(eager.lane(T.GPU)) >= 20
    assert sum(s.name.startswith(("cudaLaunch", "cuLaunch")) for s in eager.lane(T.CPU)) >= 20
    assert 0 < T.gpu_idle_fraction(eager) < 1

    g = Bc.CUDAGraph()
    s = Bc.Stream()
    s.wait_stream(Bc.current_stream())
    with Bc.stream(s):
        chain()
    Bc.current_stream().wait_stream(s)
    with Bc.graph(g):
        chain()
    graphed = T.profile_timeline(g.replay, Bc, label="graphed")
    launches = [sp.name for sp in graphed.lane(T.CPU)]
    assert any("GraphLaunch" in n for n in launches), launches
    # CUPTI normally reports a graph's kernels one by one; the lesson's picture relies on it
    assert len(graphed.lane(T.GPU)) >= 20, f"{len(graphed.lane(T.GPU))} kernels in the trace"
    assert graphed.makespan_us < eager.makespan_us
    assert T.gpu_idle_fraction(graphed) < T.gpu_idle_fraction(eager)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_launch_cost_measured_with_cuda_events_on_gpu():
    # a measurement, not a speed target (those live in labkit.bench): it runs, times with
    # CUDA events, and its figures are consistent with each other
    m = T.measure_launch_cost(backend.get("cuda"), n_ops=100, numel=256, repeats=20)
    assert m["timer"] == "cuda events" and m["eager_step_us"] > 0 and m["graph_step_us"] > 0
    assert m["speedup"] == pytest.approx(m["eager_step_us"] / m["graph_step_us"])


def test_preset_for_device_names():
    assert T.preset_for("NVIDIA H200").name == "H200"
    assert T.preset_for("NVIDIA A100-SXM4-80GB").name == "A100"
    assert T.preset_for("Tesla T4").name == "T4"
    assert T.preset_for("NVIDIA L4").name == "L4"
    with pytest.warns(UserWarning, match=r"no GPU preset matches 'NVIDIA L40S' \(presets: "
                      r"H200, .*\), so simulations model the H200 \(default='H200'\)"):
        assert T.preset_for("NVIDIA L40S").name == "H200"  # not an L4: falls back
    with warnings.catch_warnings():
        warnings.simplefilter("error")                    # a CPU: nothing to model, no word
        assert T.preset_for("CPU (emulated CUDA graphs)").name == "H200"
    assert T.preset_for("something else", default="T4").name == "T4"


def test_chain_steps_replay_computes_the_chain(B):
    steps = T.chain_steps(B, n_ops=7, numel=4)
    steps.graphed()
    B.synchronize()
    assert steps.out.tolist() == [7.0] * 4
    assert steps.eager().tolist() == [7.0] * 4
    steps.x.fill_(1.0)  # replay reads x by address
    steps.graphed()
    B.synchronize()
    assert steps.out.tolist() == [8.0] * 4


def test_simulated_serving_costs_the_sum_synced_and_the_larger_overlapped():
    from labkit.timeline import CPU, GPU, gpu_idle_fraction, simulate_serving

    synced = simulate_serving(6, 300.0, 250.0, overlap=False)
    over = simulate_serving(6, 300.0, 250.0, overlap=True)
    assert synced.makespan_us == 6 * (300 + 250)
    assert over.makespan_us == 6 * 300 + 250          # host-bound: max(host, gpu) per step
    gpu_bound = simulate_serving(6, 100.0, 250.0, overlap=True)
    assert gpu_bound.makespan_us == 100 + 6 * 250     # GPU-bound: the GPU never waits
    assert gpu_idle_fraction(gpu_bound) < 0.1 < gpu_idle_fraction(synced)
    for tl in (synced, over):
        assert len(tl.lane(CPU)) == len(tl.lane(GPU)) == 6 and tl.source == "simulated"
        gpu = tl.lane(GPU)
        assert all(a.end_us <= b.start_us for a, b in zip(gpu, gpu[1:])), "one step at a time"
        host = tl.lane(CPU)
        assert all(h.end_us <= g.start_us for h, g in zip(host, gpu)), "prepared before it runs"
    # overlapped: step i+1 is prepared while step i runs; synced: never
    assert any(h.start_us < g.end_us for h, g in zip(over.lane(CPU)[1:], over.lane(GPU)))
    assert not any(h.start_us < g.end_us for h, g in zip(synced.lane(CPU)[1:], synced.lane(GPU)))
    with pytest.raises(ValueError):
        simulate_serving(0, 1.0, 1.0, overlap=True)
    with pytest.raises(TypeError, match="overlap must be True or False"):
        simulate_serving(2, 1.0, 1.0, overlap="yes")
