"""labkit.timeline and labkit.widgets under misuse (issue 11): every wrong input gets an
error naming what was given, what was expected and what to do, or the correct result.

CPU only and fast: the backend used is the emulator; nothing here needs a GPU.
"""

import json
import math

import matplotlib
import pytest
import torch

matplotlib.use("Agg")

from labkit import backend  # noqa: E402
from labkit import timeline as T  # noqa: E402
from labkit import widgets as W  # noqa: E402


@pytest.fixture(scope="module")
def B():
    return backend.get("emulated")


def tl():
    return T.simulate(3, 5.0, 2.0)


# --------------------------------------------------------------------------- Span / Timeline

@pytest.mark.parametrize("kw, err, words", [
    (dict(lane=1, name="k", start_us=0.0, dur_us=1.0), TypeError, "Span.lane must be a str"),
    (dict(lane="GPU", name=None, start_us=0.0, dur_us=1.0), TypeError, "Span.name must be a str"),
    (dict(lane="GPU", name="k", start_us=math.nan, dur_us=1.0), ValueError, "finite"),
    (dict(lane="GPU", name="k", start_us="0", dur_us=1.0), ValueError, "start_us"),
    (dict(lane="GPU", name="k", start_us=0.0, dur_us=-1.0), ValueError, "cannot be negative"),
    (dict(lane="GPU", name="k", start_us=0.0, dur_us=math.inf), ValueError, "finite"),
])
def test_span_rejects_bad_fields(kw, err, words):
    with pytest.raises(err, match=words):
        T.Span(**kw)


def test_timeline_rejects_non_spans_and_unknown_source():
    with pytest.raises(TypeError, match=r"Span objects only, got tuple.*Span\(lane, name"):
        T.Timeline([("GPU", "k", 0.0, 1.0)])
    with pytest.raises(TypeError, match="list of Span, got int"):
        T.Timeline(3)
    with pytest.raises(ValueError, match="'measured' or 'simulated', not 'real'"):
        T.Timeline([], source="real")
    with pytest.raises(TypeError, match="lane name must be a str"):
        tl().lane(0)
    with pytest.raises(ValueError, match="finite number of µs, got nan"):
        tl().shifted(math.nan)


def test_timeline_rejects_bad_label_device_meta():
    with pytest.raises(TypeError, match="label must be a str, got int"):
        T.Timeline([], label=1)
    with pytest.raises(TypeError, match="device must be a str .* or None, got GPUPreset"):
        T.Timeline([], device=T.GPU_PRESETS["H200"])
    with pytest.raises(TypeError, match="meta must be a dict, got list"):
        T.Timeline([], meta=[])


@pytest.mark.parametrize("kw, err, words", [
    (dict(hbm_gbps=0), ValueError, r"GPUPreset.hbm_gbps must be a finite number > 0 \(a datasheet"),
    (dict(fp32_tflops=math.nan), ValueError, "GPUPreset.fp32_tflops must be a finite"),
    (dict(kernel_floor_us=-1.0), ValueError, "GPUPreset.kernel_floor_us must be >= 0"),
    (dict(name=""), TypeError, "GPUPreset.name must be a non-empty str"),
])
def test_custom_preset_rejects_bad_numbers(kw, err, words):
    base = dict(name="X1", fp16_tflops=100, fp32_tflops=10, hbm_gbps=1000, kernel_floor_us=1.0)
    with pytest.raises(err, match=words):
        T.GPUPreset(**{**base, **kw})
    assert T.roofline_kernel_us(0.0, 0.0, T.GPUPreset(**base)) == 1.0


def test_timeline_accepts_a_generator_of_spans():
    spans = (T.Span(T.GPU, f"k{i}", float(i), 1.0) for i in range(3))
    assert T.Timeline(spans).makespan_us == 3.0


def test_empty_timeline_summarizes_to_zeros():
    s = T.summarize(T.simulate(0, 5.0, 2.0))
    assert (s["launches"], s["kernels"], s["step_us"], s["gpu_idle_fraction"]) == (0, 0, 0, 0)


# --------------------------------------------------------------------------- presets, roofline

def test_unknown_preset_names_the_choices():
    with pytest.raises(ValueError, match="no GPU preset 'H300'; choose one of H200, H100"):
        T.get_preset("H300")
    with pytest.raises(KeyError):  # old callers catch KeyError: still works
        T.get_preset("H300")
    with pytest.raises(TypeError, match="preset name or a GPUPreset, got int"):
        T.get_preset(200)
    assert T.get_preset("h100").name == "H100"


def test_preset_for_checks_its_inputs():
    with pytest.raises(TypeError, match="device_name must be a str"):
        T.preset_for(None)
    with pytest.raises(ValueError, match="no GPU preset 'B200'"):
        T.preset_for("NVIDIA A100", default="B200")
    with pytest.warns(UserWarning, match=r"no GPU preset matches 'Some GPU'.*model the T4"):
        assert T.preset_for("Some GPU", default="t4").name == "T4"


def test_peak_flops_unknown_dtype_lists_the_set():
    with pytest.raises(ValueError, match="one of 'fp16'.*'float32', not 'int8'"):
        T.GPU_PRESETS["H200"].peak_flops("int8")
    with pytest.raises(ValueError, match="not 'int8'"):
        T.roofline_kernel_us(1.0, 1.0, dtype="int8")


@pytest.mark.parametrize("flops, nbytes, err, words", [
    (-1.0, 8.0, ValueError, "flops must be a finite number >= 0, got -1"),
    (1.0, math.nan, ValueError, "bytes must be a finite number >= 0, got nan"),
    ("1e6", 8.0, TypeError, "flops must be a number, got '1e6'"),
])
def test_roofline_rejects_bad_amounts(flops, nbytes, err, words):
    with pytest.raises(err, match=words):
        T.roofline_kernel_us(flops, nbytes)


def test_add_chain_cost_checks_numel_and_dtype():
    with pytest.raises(ValueError, match="numel must be >= 0, got -5"):
        T.add_chain_cost(-5)
    with pytest.raises(TypeError, match="numel must be an int >= 0, got 2.5"):
        T.add_chain_cost(2.5)
    with pytest.raises(TypeError, match="dtype must be a torch.dtype such as torch.float32, got"):
        T.add_chain_cost(4, "fp16")
    assert T.add_chain_cost(4, torch.float16) == (4.0, 16.0)


# --------------------------------------------------------------------------- simulate

@pytest.mark.parametrize("args, kw, err, words", [
    ((-1, 5.0, 2.0), {}, ValueError, "n_kernels must be >= 0, got -1"),
    ((2.5, 5.0, 2.0), {}, TypeError, "n_kernels must be an int >= 0, got 2.5"),
    ((True, 5.0, 2.0), {}, TypeError, "n_kernels must be an int"),
    ((3, -5.0, 2.0), {}, ValueError, "launch_us must be >= 0 µs, got -5.0"),
    ((3, math.nan, 2.0), {}, ValueError, "launch_us must be a finite number of µs, got nan"),
    ((3, "5", 2.0), {}, TypeError, "launch_us must be a number of µs, got '5'"),
    ((3, 5.0, -2.0), {}, ValueError, "kernel_us must be >= 0"),
    ((3, 5.0, math.inf), {}, ValueError, "kernel_us must be a finite"),
    ((3, 5.0, "2"), {}, TypeError, "kernel_us must be a number of µs or a list"),
    ((3, 5.0, [1.0, 2.0]), {}, ValueError, "2 entries for 3 kernels; pass one number"),
    ((2, 5.0, [1.0, -2.0]), {}, ValueError, r"kernel_us\[1\] must be >= 0"),
    ((2, 5.0, [1.0, None]), {}, TypeError, r"kernel_us\[1\] must be a number"),
    ((3, 5.0, 2.0), dict(gap_us=-0.1), ValueError, "gap_us must be >= 0"),
    ((3, 5.0, 2.0), dict(graphed=True, graph_launch_us=math.nan), ValueError, "graph_launch_us"),
    ((3, 5.0, 2.0), dict(preset="H9000"), ValueError, "choose one of H200"),
    ((3, 5.0, 2.0), dict(label=7), TypeError, "label must be a str"),
])
def test_simulate_rejects_bad_inputs(args, kw, err, words):
    with pytest.raises(err, match=words):
        T.simulate(*args, **kw)


def test_simulate_accepts_tuple_and_tensor_free_lists():
    t = T.simulate(2, 5.0, (1.0, 3.0), gap_us=0.0)
    assert [s.dur_us for s in t.lane(T.GPU)] == [1.0, 3.0]


def test_simulate_pair_refuses_graphed_keyword():
    with pytest.raises(TypeError, match="makes both the eager and the graphed.*drop graphed"):
        T.simulate_pair(3, 5.0, 2.0, graphed=True)


@pytest.mark.parametrize("fn", [T.gpu_busy_us, T.gpu_idle_us, T.gpu_idle_fraction, T.summarize])
def test_metrics_need_a_timeline(fn):
    with pytest.raises(TypeError, match="tl must be a labkit.timeline.Timeline, got list.*simul"):
        fn([T.Span(T.GPU, "k", 0.0, 1.0)])


# --------------------------------------------------------------------------- chain / measurement

def test_chain_checks_its_inputs():
    with pytest.raises(TypeError, match="needs a tensor x, got list"):
        T.chain([0.0], 3)
    with pytest.raises(ValueError, match="n_ops must be >= 0, got -1"):
        T.chain(torch.zeros(2), -1)
    assert torch.equal(T.chain(torch.zeros(2), 0), torch.zeros(2))


@pytest.mark.parametrize("kw, err, words", [
    (dict(n_ops=0), ValueError, "n_ops must be >= 1, got 0"),
    (dict(n_ops=2.0), TypeError, "n_ops must be an int"),
    (dict(numel=0), ValueError, "numel must be >= 1, got 0"),
    (dict(warmup=-1), ValueError, "warmup must be >= 0"),
    (dict(dtype="float32"), TypeError, "dtype must be a torch.dtype"),
])
def test_chain_steps_rejects_bad_arguments_before_capturing(B, kw, err, words):
    with pytest.raises(err, match=words):
        T.chain_steps(B, **kw)


def test_measurements_need_a_backend_object():
    # the name of a backend, or a device, instead of the namespace get() returns: the
    # message names what was given and how to get the right thing
    with pytest.raises(TypeError, match=r"B must be the backend namespace .* got str 'cuda': "
                                        r"write B = labkit.backend.get\('cuda'\)"):
        T.measure_launch_cost("cuda")
    with pytest.raises(TypeError, match=r"B must be the backend namespace .* got device .*"
                                        r"pass B = labkit.backend.get\('auto'\)"):
        T.chain_steps(torch.device("cpu"))


@pytest.mark.parametrize("kw, err, words", [
    (dict(repeats=0), ValueError, "repeats must be >= 1, got 0"),
    (dict(n_ops=-3), ValueError, "n_ops must be >= 1, got -3"),
    (dict(numel=-1), ValueError, "numel must be >= 1"),
    (dict(rounds=0), ValueError, "rounds must be >= 1, got 0"),
    (dict(rounds=2.5), TypeError, "rounds"),
])
def test_measure_launch_cost_rejects_bad_counts(B, kw, err, words):
    with pytest.raises(err, match=words):
        T.measure_launch_cost(B, **kw)


def test_measure_launch_cost_still_works_after_misuse(B):
    with pytest.raises(ValueError):
        T.measure_launch_cost(B, n_ops=0)
    m = T.measure_launch_cost(B, n_ops=5, numel=8, repeats=2, warmup=1)
    assert m["n_ops"] == 5 and m["eager_step_us"] > 0


@pytest.mark.parametrize("numels, err, words", [
    ([], ValueError, "numels is empty"),
    (256, TypeError, "numels must be a list of ints"),
    ("256", TypeError, "numels must be a list of ints"),
    ([256, 0], ValueError, "each entry of numels must be >= 1, got 0"),
    ([256.5], TypeError, "each entry of numels must be an int"),
])
def test_sweeps_reject_bad_numels(B, numels, err, words):
    with pytest.raises(err, match=words):
        T.sweep_simulated(numels, 5.0)
    with pytest.raises(err, match=words):
        T.sweep_measured(B, numels)


def test_sweep_simulated_rejects_bad_options():
    with pytest.raises(ValueError, match="launch_us must be >= 0"):
        T.sweep_simulated([256], -1.0)
    with pytest.raises(ValueError, match="n_kernels must be >= 1, got 0"):
        T.sweep_simulated([256], 5.0, n_kernels=0)
    with pytest.raises(ValueError, match="choose one of H200"):
        T.sweep_simulated([256], 5.0, preset="h2000")


def test_sweep_measured_rejects_bad_counts_before_measuring(B):
    with pytest.raises(ValueError, match="repeats must be >= 1"):
        T.sweep_measured(B, [8], repeats=0)


def test_crossover_checks_rows_and_tolerance():
    rows = T.sweep_simulated([1, 10**8], 5.0)
    with pytest.raises(ValueError, match="row 0 lacks eager_us, graph_us; rows come from"):
        T.crossover([{"numel": 1}])
    with pytest.raises(TypeError, match="list of rows.*got dict"):
        T.crossover(rows[0])
    with pytest.raises(ValueError, match="tolerance must be a finite fraction >= 0"):
        T.crossover(rows, tolerance=-0.1)
    with pytest.raises(TypeError, match="tolerance must be a fraction such as 0.10, got '10%'"):
        T.crossover(rows, tolerance="10%")
    assert T.crossover([]) is None


# --------------------------------------------------------------------------- traces

def test_trace_from_missing_or_corrupt_file(tmp_path):
    with pytest.raises(ValueError, match="no trace file at .*nope.json.*export_chrome_trace"):
        T.timeline_from_chrome_trace(tmp_path / "nope.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="bad.json' is not Chrome-trace JSON"):
        T.timeline_from_chrome_trace(bad)
    arr = tmp_path / "arr.json"
    arr.write_text("[]")
    with pytest.raises(ValueError, match='JSON list, expected an object with "traceEvents"'):
        T.timeline_from_chrome_trace(arr)
    with pytest.raises(TypeError, match="dict or a path to its JSON file, got int"):
        T.timeline_from_chrome_trace(3)


def test_trace_dict_with_malformed_events():
    with pytest.raises(ValueError, match='"traceEvents" must be a list of events, got dict'):
        T.timeline_from_chrome_trace({"traceEvents": {}})
    bad = {"traceEvents": [{"ph": "X", "cat": "kernel", "name": "k", "dur": 1.0}]}
    with pytest.raises(ValueError, match="trace event 0 \\('k'\\) has no numeric ts/dur"):
        T.timeline_from_chrome_trace(bad)
    with pytest.raises(ValueError, match="no GPU kernels"):
        T.timeline_from_chrome_trace({})


def test_measure_fp16_long_chain_is_not_called_broken(B):
    # fp16 x + 1 stops growing at 2048: replay and eager agree, the capture is fine
    m = T.measure_launch_cost(B, n_ops=2100, numel=4, repeats=1, warmup=0, dtype=torch.float16)
    assert m["n_ops"] == 2100 and m["dtype"] == "torch.float16"


def test_to_chrome_trace_path_in_missing_folder(tmp_path):
    target = tmp_path / "missing" / "t.json"
    with pytest.raises(ValueError, match="folder that does not exist.*create it first"):
        T.to_chrome_trace(tl(), target)
    assert not target.parent.exists()
    with pytest.raises(ValueError, match="is a folder; pass a file name"):
        T.to_chrome_trace(tl(), tmp_path)
    with pytest.raises(TypeError, match="path must be a file path"):
        T.to_chrome_trace(tl(), 5)
    with pytest.raises(TypeError, match="tl must be a labkit.timeline.Timeline"):
        T.to_chrome_trace({"traceEvents": []})
    ok = tmp_path / "t.json"
    T.to_chrome_trace(tl(), ok)
    assert json.loads(ok.read_text())["otherData"]["source"] == "simulated"


def test_chrome_trace_events_wants_spans():
    with pytest.raises(TypeError, match="pass tl.spans"):
        T.chrome_trace_events(tl())
    with pytest.raises(TypeError, match="Span objects only, got dict"):
        T.chrome_trace_events([{"name": "k"}])


def test_profile_timeline_misuse(B, tmp_path):
    with pytest.raises(RuntimeError, match="needs a CUDA GPU.*simulate"):
        T.profile_timeline(lambda: None, B)

    class FakeCuda:       # passes as the cuda backend: the arguments are checked first
        name, device, CUDAGraph, graph = "cuda", torch.device("cpu"), object, object

    with pytest.raises(TypeError, match="pass the function, not its result"):
        T.profile_timeline(None, FakeCuda())
    with pytest.raises(ValueError, match="warmup must be >= 0"):
        T.profile_timeline(lambda: None, FakeCuda(), warmup=-1)
    with pytest.raises(ValueError, match="trace_path .* folder that does not exist"):
        T.profile_timeline(lambda: None, FakeCuda(), trace_path=tmp_path / "no" / "t.json")


# --------------------------------------------------------------------------- plots

def test_plot_misuse():
    with pytest.raises(TypeError, match="tl must be a labkit.timeline.Timeline, got tuple"):
        T.plot_timeline(T.simulate_pair(3, 5.0, 2.0))
    with pytest.raises(ValueError, match="xlim must be > 0 µs"):
        T.plot_timeline(tl(), xlim=0)
    with pytest.raises(ValueError, match="got no timelines"):
        T.plot_timelines([])
    with pytest.raises(TypeError, match=r"pass \[tl\], or use plot_timeline"):
        T.plot_timelines(tl())
    with pytest.raises(TypeError, match=r"timelines\[1\] must be a labkit.timeline.Timeline"):
        T.plot_timelines([tl(), "eager"])
    with pytest.raises(ValueError, match=r"one title per timeline \(2\)"):
        T.plot_timelines(list(T.simulate_pair(3, 5.0, 2.0)), titles=["only one"])
    with pytest.raises(ValueError, match="plot_sweep got no rows"):
        T.plot_sweep([])
    with pytest.raises(ValueError, match="row 0 lacks"):
        T.plot_sweep([{"numel": 1, "eager": 2}])
    with pytest.raises(ValueError, match="tolerance must be a finite fraction"):
        T.plot_sweep(T.sweep_simulated([256], 5.0), tolerance=math.nan)


# --------------------------------------------------------------------------- panel

@pytest.mark.parametrize("kw, err, words", [
    (dict(launch_us=0.0), ValueError, "launch_us must be > 0 µs"),
    (dict(launch_us=500.0), ValueError, r"launch_us must be within the slider's range 0.1..100"),
    (dict(kernel_us=-1.0), ValueError, "kernel_us must be > 0"),
    (dict(kernel_us=math.nan), ValueError, "kernel_us must be a finite"),
    (dict(n_kernels=0), ValueError, "n_kernels must be in 1..100, got 0: the slider's range"),
    (dict(n_kernels=500), ValueError, r"n_kernels must be in 1..100, got 500: the slider's range; "
                                      r"for a longer chain use simulate_pair"),
    (dict(n_kernels=12.0), TypeError, "n_kernels must be an int"),
    (dict(preset="A10"), ValueError, "no GPU preset 'A10'"),
    (dict(widgets="no"), TypeError, "widgets must be True, False or None"),
])
def test_timeline_panel_rejects_bad_settings(kw, err, words):
    with pytest.raises(err, match=words):
        T.timeline_panel(**{"widgets": False, **kw})


# --------------------------------------------------------------------------- widgets

def test_widgets_wanted_env_takes_a_fixed_set(monkeypatch):
    monkeypatch.setenv("LABKIT_WIDGETS", "maybe")
    with pytest.raises(ValueError,
                       match="LABKIT_WIDGETS='maybe' is not understood; set it to one of '1'"):
        W.widgets_wanted(None)
    for value, want in (("OFF", False), ("0", False), ("Yes", True), ("", True)):
        monkeypatch.setenv("LABKIT_WIDGETS", value)
        assert W.widgets_wanted(None) is want
    assert W.widgets_wanted(False) is False
    with pytest.raises(TypeError, match="widgets must be True, False or None"):
        W.widgets_wanted(1)


def test_png_helpers_reject_wrong_objects():
    import matplotlib.pyplot as plt

    with pytest.raises(TypeError,
                       match="needs a matplotlib Figure, got Axes; for an Axes pass ax.figure"):
        _, ax = plt.subplots()
        W.figure_png(ax)
    plt.close("all")
    with pytest.raises(TypeError, match="expected PNG bytes .*got str; pass figure_png"):
        W.png_size("plot.png")
    with pytest.raises(ValueError, match="expected PNG bytes"):
        W.png_size(b"GIF89a" + bytes(30))


def test_widget_helpers_reject_wrong_objects():
    import ipywidgets as w
    import matplotlib.pyplot as plt

    png = W.figure_png(plt.figure(figsize=(2, 1)))
    with pytest.raises(TypeError,
                       match="image must be an ipywidgets widget, got bytes; make it with image_w"):
        W.set_image(png, png)
    img = W.image_widget(png)
    with pytest.raises(ValueError, match="expected PNG bytes"):
        W.set_image(img, b"not a png at all, not at all.")
    assert img.value == png  # the failed update left the picture as it was
    with pytest.raises(TypeError, match=r"wrap a single widget as \[widget\]"):
        W.column(img)
    with pytest.raises(TypeError, match="widgets only, got bytes; show a picture with image_wi"):
        W.column([img, png])
    assert isinstance(W.column([img]), w.VBox)
    with pytest.raises(TypeError, match="static must be a dict"):
        W.mimebundle("text", None)


@pytest.mark.parametrize("name", ["H800", "Graphics Device", "TITAN V", "GH200 480GB"])
def test_preset_for_warns_for_any_gpu_without_a_preset(name):
    """Before: a GPU name without a vendor word (an H800, a pre-release "Graphics Device")
    was modelled as an H200 without a word."""
    with pytest.warns(UserWarning, match=rf"no GPU preset matches '{name}' \(presets: H200, "
                                         r".*\), so simulations model the H200 \(default='H200'\) "
                                         r"instead of this GPU. Pass default= to pick the "
                                         r"closest preset"):
        assert T.preset_for(name).name == "H200"


def test_preset_for_is_silent_for_the_cpu_and_refuses_an_empty_name():
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert T.preset_for("CPU (emulated CUDA graphs)").name == "H200"
        assert T.preset_for("cpu", default="T4").name == "T4"
    with pytest.raises(ValueError, match=r"preset_for: device_name is empty: pass the GPU's name "
                                         r"\(torch.cuda.get_device_name\(\)\)"):
        T.preset_for("  ")
