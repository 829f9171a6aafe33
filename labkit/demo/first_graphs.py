"""The demos of lessons 00-03: a first graph, launch-bound work, capture and replay, and
the pitfalls of capture."""

from __future__ import annotations

import statistics

from labkit.demo.common import _device, _measure_us

# --------------------------------------------------------------------------- 00

def _demo_00(B, small):
    import matplotlib.pyplot as plt
    import torch

    from labkit.capture import capture

    print(f"CUDA available to torch: {torch.cuda.is_available()} -> backend {B.name!r}: "
          + ("torch.cuda's own graphs" if B.name == "cuda" else "labkit's CPU emulator"))
    static_x = torch.zeros(4, device=B.device)            # the graph reads this memory
    g, static_y = capture(lambda t: t * 2 + 1, static_x, B=B)   # warm up, then record
    rows = []
    for values in ([0.0, 1.0, 2.0, 3.0], [10.0, 20.0, 30.0, 40.0]):
        static_x.copy_(torch.tensor(values))              # new data, same memory
        g.replay()                                        # the recorded kernels run again
        B.synchronize()
        rows.append((values, static_y.tolist()))
        print(f"copy_ {values} -> replay() -> static_y {static_y.tolist()}")
    right = all(y == [2 * v + 1 for v in x] for x, y in rows)
    print(f"every replay gave 2·x + 1 for the new x: {right}")

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4))
    for k, (ax, (x, y)) in enumerate(zip(axes, rows)):
        idx = range(len(x))
        ax.bar([i - 0.2 for i in idx], x, width=0.4, color="#9ecae1", label="static_x (copy_ in)")
        ax.bar([i + 0.2 for i in idx], y, width=0.4, color="#08519c",
               label="static_y (after replay)")
        for i, v in zip(idx, y):
            ax.text(i + 0.2, v, f"{v:g}", ha="center", va="bottom", fontsize=8)
        ax.set_xticks(list(idx))
        ax.set_xlabel("element")
        ax.set_title(f"replay {k + 1}", fontsize=10)
    axes[0].legend(fontsize=8, loc="upper left")
    fig.suptitle(f"a first graph: y = 2·x + 1 captured once, replayed on new data ({B.name})",
                 fontsize=11)
    fig.tight_layout()
    return fig


# --------------------------------------------------------------------------- 01

def _demo_01(B, small):
    from labkit import timeline as T

    m = T.measure_launch_cost(B, n_ops=100, numel=256, repeats=10 if small else 30)
    print(f"{'':26s}{'eager':>9s}{'graph':>9s}{'ratio':>8s}")
    print(f"{'µs per kernel, this run':26s}{m['eager_us_per_kernel']:9.2f}"
          f"{m['graph_us_per_kernel']:9.2f}{m['speedup']:7.1f}×  ({m['timer']}, {m['device']})")
    print(f"verdict over {len(m['rounds']['eager_step_us'])} interleaved rounds: "
          f"{m['verdict'].short()}")
    print(f"CPU cost to issue one eager op: {m['cpu_us_per_launch']:.2f} µs")
    if B.is_emulated:
        print("emulated: the 'graph' column is the emulator replaying the recorded ops on "
              "this CPU, without the emulated device's Python layer that each eager op "
              "passes: no GPU graph's figure. The timelines below are SIMULATED: this "
              "CPU's launch cost, kernel times from a roofline model of an H200.")
    n, numel = 20, 256
    if B.is_emulated:
        preset = T.preset_for(_device(B))                   # not a GPU: the H200 preset
        kernel_us = T.roofline_kernel_us(*T.add_chain_cost(numel), preset)
        launch_us = m["cpu_us_per_launch"]
        pictures = [
            T.simulate(n, launch_us, kernel_us, preset=preset,
                       label=f"eager: {n} adds of {numel} elements"),
            T.simulate(n, launch_us, kernel_us, graphed=True, preset=preset,
                       label=f"graphed: {n} adds of {numel} elements"),
        ]
    else:
        steps = T.chain_steps(B, n_ops=n, numel=numel)
        pictures = [
            T.profile_timeline(steps.eager, B, label=f"eager: {n} adds of {numel} elements"),
            T.profile_timeline(steps.graphed, B, label=f"graphed: {n} adds of {numel} elements"),
        ]
    sums = [T.summarize(tl) for tl in pictures]
    for tl, s in zip(pictures, sums):
        print(f"{tl.label:30s} [{tl.tag}]  step {s['step_us']:7.1f} µs  "
              f"GPU idle {s['gpu_idle_fraction']:4.0%}")
    print(f"the eager step is {sums[0]['step_us'] / sums[1]['step_us']:.1f}× as long as the "
          f"same kernels in one graph [{pictures[0].tag}]")
    fig = T.plot_timelines(pictures)                        # one time axis: lengths compare
    return fig


# --------------------------------------------------------------------------- 02

def _demo_02(B, small):
    import matplotlib.pyplot as plt
    import torch

    from labkit.capture import capture, recorded_kernels
    from labkit.core.rounds import interleave, verdict

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(),
                                torch.nn.Linear(64, 8)).to(B.device)
    static_x = torch.zeros(4, 16, device=B.device)
    with torch.no_grad():
        g, static_y = capture(model, static_x, B=B)        # warm-up, capture, private pool
        kernels = recorded_kernels(g, B)
        what = ("CUDA kernels of one replay" if B.name == "cuda"
                else "ATen ops the emulator recorded")
        print(f"recorded {len(kernels)} kernels ({what}): {', '.join(kernels)}")
        ok, kept = [], []
        for _ in range(3):
            batch = torch.randn(4, 16, device=B.device)
            static_x.copy_(batch)                           # new data into the same memory
            g.replay()
            B.synchronize()
            ok.append(torch.allclose(static_y, model(batch), atol=1e-5))
            kept.append((batch, static_y))                  # a reference, not a clone
        print(f"3 replays, each equal to model(batch): {all(ok)}")
        print("a reference kept from replay 1 now holds replay 3's result: "
              f"{torch.allclose(kept[0][1], model(kept[2][0]), atol=1e-5)} (clone() what you keep)")
        # both timed in interleaved rounds, so that a drifting host slows both alike
        timed = interleave({"eager forward": lambda: model(static_x), "graph replay": g.replay},
                           lambda fn: {"median_us": _measure_us(fn, B, small)})
    eager_us, replay_us = (statistics.median(timed[k]["median_us"])
                           for k in ("eager forward", "graph replay"))
    ratio = eager_us / replay_us
    print(f"eager forward {eager_us:8.1f} µs | graph replay {replay_us:8.1f} µs | {ratio:.1f}× "
          f"[{_device(B)}]")
    v = verdict("graph replay", timed["graph replay"]["median_us"],
                "eager forward", timed["eager forward"]["median_us"])
    print(f"medians of {len(v.a_rounds)} interleaved rounds; verdict: {v.short()}")
    if B.is_emulated:
        print("emulated: both times are this CPU's; the emulator replays the recorded ops in "
              "Python, so the ratio says nothing about a GPU (lesson 01 simulates that)")

    fig, ax = plt.subplots(figsize=(8, 3.2))
    bars = ax.barh(["graph replay", "eager forward"], [replay_us, eager_us],
                   color=["#31a354", "#3182bd"])
    for b, v in zip(bars, (replay_us, eager_us)):
        ax.text(v, b.get_y() + b.get_height() / 2, f" {v:.1f} µs", va="center", fontsize=9)
    ax.set_xlim(0, max(eager_us, replay_us) * 1.3)
    ax.set_xlabel("µs per call (median)" + (" · emulator on a CPU: not GPU speed"
                                            if B.is_emulated else ""))
    ax.set_title(f"MLP 16→64→8, batch 4: one replay runs {len(kernels)} recorded kernels\n"
                 f"replay {ratio:.1f}× as fast as eager on {_device(B)}", fontsize=10)
    fig.tight_layout()
    return fig


# --------------------------------------------------------------------------- 03

def _demo_03(B, small):
    import matplotlib.pyplot as plt
    import torch
    from matplotlib.patches import Rectangle

    from labkit import backend
    from labkit.capture import capture
    from labkit.guards import error_lines, lint_capture

    gen = B.Generator()
    state = {"h": torch.zeros(4, device=B.device), "decay": 1.0}

    # lesson 03 §10: every pitfall in one function
    def step(x, p):
        n = x.sum().item()
        if x.mean() > 0:
            x = x * 2
        kept = x[x > 0]
        as_list = x.tolist()
        bias = torch.tensor([1.0, 2.0, 3.0, 4.0], device=x.device)
        noise = torch.rand(4, device=x.device, generator=gen)
        state["h"] = torch.tanh(state["h"] + x)
        state["decay"] *= 0.5
        y = x * state["decay"] + bias + noise + p
        B.synchronize()
        del n, kept, as_list
        return y

    x = torch.randn(4, device=B.device)
    try:
        capture(step, x, 0.5, B=B)
        first = "(captured: unexpected)"
    except Exception as e:                   # what capture by hand says: the first hazard
        first = error_lines(e)[0]
    finally:
        backend.recover(B)                   # default stream back, RNG out of capture mode
    print(f"capture by hand stops at the first hazard: {first}")
    report = lint_capture(step, x, 0.5, B=B)
    print(str(report).splitlines()[0])
    for i, f in enumerate(report.findings, 1):
        print(f"{i:3d}. {f.title} [{f.severity}] at line {f.lineno}: {f.code}")

    colors = {"fails capture": "#de2d26", "silently wrong": "#fd8d3c", "check": "#9ecae1"}
    rows = report.findings
    fig, ax = plt.subplots(figsize=(10, 0.42 * len(rows) + 1.2))
    for i, f in enumerate(rows):
        y = len(rows) - 1 - i
        ax.add_patch(Rectangle((0, y + 0.08), 0.22, 0.84,
                               color=colors.get(f.severity, "0.7")))
        ax.text(0.11, y + 0.5, f.severity, ha="center", va="center", fontsize=8)
        ax.text(0.24, y + 0.5, f"line {f.lineno}: {f.title}", va="center", fontsize=9,
                weight="bold")
        code = f.code or ""
        code = code if len(code) <= 44 else code[:43] + "…"
        ax.text(0.64, y + 0.5, code, va="center", fontsize=8, family="monospace")
    ax.set_xlim(0, 1)
    ax.set_ylim(0, len(rows))
    ax.axis("off")
    ax.set_title(f"lint_capture: {len(rows)} hazards found in one eager run; capture by hand "
                 f"stops at the first ({B.name})\nlines of step() in labkit/demo/first_graphs.py",
                 fontsize=10)
    fig.tight_layout()
    return fig
