"""The demos, one per lesson: each runs that lesson's key demonstration with
labkit's own engines, prints what it measured and returns its picture."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

__all__ = ["Demo", "DEMOS"]


@dataclass(frozen=True)
class Demo:
    """One lesson's headline demo: what it shows, and the function that runs it."""

    number: str
    lesson: str
    shows: str
    run: Callable  # run(B, small: bool) -> matplotlib Figure; prints its figures


# --------------------------------------------------------------------------- helpers

def _on_cpu_note(B) -> str:
    return ("emulated: labkit's CPU emulator runs the graphs; times below are this CPU's, "
            "not a GPU's") if B.is_emulated else ""


def _device(B) -> str:
    from labkit.core import timing

    return timing.device_name(B)


def _footer(fig, B, number: str) -> None:
    """A line under the picture naming the demo and what ran it (the figure grows for it)."""
    where = (f"backend emulated: {_device(B)}; measured times are this CPU's, "
             "simulated ones say so"
             if B.is_emulated else f"backend cuda: {_device(B)}")
    w, h = fig.get_size_inches()
    extra = 0.3
    fig.set_size_inches(w, h + extra)
    for ax in fig.axes:                       # same size in inches, moved up by `extra`
        pos = ax.get_position()
        ax.set_position([pos.x0, (pos.y0 * h + extra) / (h + extra), pos.width,
                         pos.height * h / (h + extra)])
    fig.text(0.995, 0.008, f"labkit demo {number} · {where}", ha="right", va="bottom",
             fontsize=7, color="0.4")


def _measure_us(fn, B, small: bool) -> float:
    from labkit.core import timing

    return timing.measure_us(fn, B, warmup=2 if small else 5, repeats=10 if small else 30)


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
        eager_us = _measure_us(lambda: model(static_x), B, small)
        replay_us = _measure_us(g.replay, B, small)
    ratio = eager_us / replay_us
    print(f"eager forward {eager_us:8.1f} µs | graph replay {replay_us:8.1f} µs | {ratio:.1f}× "
          f"[{_device(B)}]")
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
                 f"stops at the first ({B.name})\nlines of step() in labkit/demo/lessons.py",
                 fontsize=10)
    fig.tight_layout()
    return fig


# --------------------------------------------------------------------------- 04

def _train_04(B, mode, *, micro=2, steps=3, **kw):
    """Lesson 04 §5: two blocks, `micro` microbatches per step, gradients accumulating."""
    import torch

    from labkit import bridge
    from labkit.core.models import make_blocks

    shape = (2, 8, 32)
    model = torch.nn.Sequential(*make_blocks(2, seed=0, device=B.device))
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(shape, generator=g).to(B.device),
             torch.randn(shape, generator=g).to(B.device)) for _ in range(steps * micro)]
    sample = (torch.randn(shape, device=B.device, requires_grad=True),)
    if mode == "torch":
        call = B.make_graphed_callables(model, sample)
    elif mode == "bridge":
        call = bridge.make_graphed_callables(model, sample, B=B, **kw)
    else:
        call = model
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for s in range(steps):
        opt.zero_grad()
        for m in range(micro):
            x, t = data[s * micro + m]
            loss = ((call(x) - t) ** 2).mean() / micro
            loss.backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def _demo_04(B, small):
    import matplotlib.pyplot as plt
    import torch

    if B.name == "cuda":     # autograd's GPU thread makes its first cuBLAS call here, once
        w = torch.ones(8, 8, device=B.device, requires_grad=True)
        (w @ w).sum().backward()
    if hasattr(torch.autograd.graph, "set_warn_on_accumulate_grad_stream_mismatch"):
        torch.autograd.graph.set_warn_on_accumulate_grad_stream_mismatch(False)  # lesson 04

    eager = _train_04(B, "eager")
    variants = {
        "labkit bridge (wgrads cloned)": _train_04(B, "bridge"),
        "bridge, clone_wgrads=False": _train_04(B, "bridge", clone_wgrads=False),
        "torch.make_graphed_callables": _train_04(B, "torch"),
    }
    tol = 1e-4
    diffs = {name: max((a - b).abs().max().item() for a, b in zip(p, eager))
             for name, p in variants.items()}
    print("2 transformer blocks, 3 SGD steps of 2 microbatches (gradients accumulate):")
    for name, d in diffs.items():
        print(f"  {name:32s} max |Δ weight| vs eager {d:9.2e}  "
              f"{'== eager' if d < tol else 'WRONG'}")
    print(f"(torch {torch.__version__}; torch's row depends on the installed torch: "
          "pytorch issue #181723)")

    fig, ax = plt.subplots(figsize=(9, 3.2))
    names = list(diffs)[::-1]
    vals = [max(diffs[n], 1e-12) for n in names]
    bars = ax.barh(names, vals, color=["#31a354" if diffs[n] < tol else "#de2d26" for n in names])
    for b, n in zip(bars, names):
        d = diffs[n]
        ax.text(b.get_width(), b.get_y() + b.get_height() / 2,
                f"  {d:.1e} ({'== eager' if d < tol else 'wrong'})", va="center", fontsize=9)
    ax.axvline(tol, color="0.3", ls=":", lw=1)
    ax.text(tol, len(names) - 1.5, f" tolerance {tol:g}", fontsize=8, color="0.3",
            va="center")                      # in the gap under the top bar, clear of the bars
    ax.set_xscale("log")
    ax.set_xlim(1e-12, 1e3)
    ax.set_xlabel("largest |weight difference| from eager training after 3 steps (log)")
    ax.set_title("gradient accumulation through graphs: the wgrad clone is what keeps it "
                 f"right ({B.name})", fontsize=10)
    fig.tight_layout()
    return fig


# --------------------------------------------------------------------------- 05

def _run_05(B, P, M, *, graphs=True, steps=2, create=None, layers=4):
    """Lesson 05's training loop: `layers` blocks in P stages, M microbatches, 1F1B."""
    import torch

    from labkit.core.models import make_blocks
    from labkit.pipeline import GlobalRecord, graph_layers, split_stages, train_step

    shape = (2, 8, 32)
    g = torch.Generator().manual_seed(1)
    data = [[(torch.randn(shape, generator=g).to(B.device),
              torch.randn(shape, generator=g).to(B.device)) for _ in range(M)]
            for _ in range(steps)]
    blocks = make_blocks(layers, seed=0, device=B.device)
    record = GlobalRecord()
    calls = graph_layers(blocks, B, record, reuse=(P == 1)) if graphs else list(blocks)
    stages = split_stages(calls, P)
    opt = torch.optim.SGD(blocks.parameters(), lr=0.1)
    for batch in data:
        opt.zero_grad()
        xs, ts = zip(*batch)
        train_step(stages, xs, ts, record=record if graphs else None, B=B, create_graphs=create)
        opt.step()
    return [p.detach().clone() for p in blocks.parameters()]


def _demo_05(B, small):
    import matplotlib.pyplot as plt

    from labkit.pipeline import max_in_flight, one_f_one_b, plot_schedule, simulate
    from labkit.pipeline import schedule as S

    P, M = 4, 8
    orders = one_f_one_b(P, M)
    in_flight = {"GPipe": [max_in_flight(o) for o in S.gpipe(P, M)],
                 "1F1B": [max_in_flight(o) for o in orders]}
    print(f"schedule of {P} stages × {M} microbatches (a simulation: forward 1, backward 2 units)")
    print("microbatches in flight per stage, 1F1B: ", in_flight["1F1B"])
    print("microbatches in flight per stage, GPipe:", in_flight["GPipe"])

    layers, micro = (2, 3) if small else (4, 4)             # small: the emulator's seconds
    eager = _run_05(B, 2, micro, graphs=False, layers=layers)
    print(f"real training of {layers} blocks, PP=2, {micro} microbatches, 2 steps; graphs "
          f"created after step 1 in one shared pool ({B.name}):")
    tol, delta = 1e-4, {}
    for order in ("recorded", "grouped", "torch"):
        got = _run_05(B, 2, micro, create={"order": order}, layers=layers)
        d = delta[order] = max((a - b).abs().max().item() for a, b in zip(got, eager))
        print(f"  created in {order:9s} order: max |Δ weight| vs eager {d:9.2e}  "
              f"{'== eager' if d < tol else 'WRONG'}")

    # left: the two schedules (same bubble, different memory); right: what the creation
    # order does to real training, the demo's point
    fig = plt.figure(figsize=(13, 5.4))
    grid = fig.add_gridspec(2, 2, width_ratios=[2.7, 1], wspace=0.06)
    sched = [fig.add_subplot(grid[0, 0])]
    sched.append(fig.add_subplot(grid[1, 0], sharex=sched[0]))
    for ax, name, events in ((sched[0], "GPipe", S.gpipe(P, M)), (sched[1], "1F1B", orders)):
        plot_schedule(simulate(events), ax=ax)
        ax.set_title(f"{name} (simulated): {ax.get_title()}; microbatches in flight per stage "
                     f"{in_flight[name]}", fontsize=10)
    sched[0].tick_params(labelbottom=False)
    sched[0].set_xlabel("")

    ax = fig.add_subplot(grid[:, 1])
    floor = 1e-9                                   # the log axis starts here; 0 sits on it
    names = list(delta)
    ys = range(len(names))[::-1]
    for y, name in zip(ys, names):
        d, ok = delta[name], delta[name] < tol
        color = "#55A868" if ok else "#C44E52"
        if d > floor:
            ax.barh(y, d - floor, left=floor, color=color, height=0.45)
        else:
            ax.plot([floor], [y], marker="|", ms=16, mew=4, color=color, clip_on=False)
        ax.text(floor * 1.6, y + 0.27, f"created in {name} order", fontsize=10, va="bottom")
        ax.annotate(f"{'0' if d == 0 else f'{d:.1e}'}  {'== eager' if ok else 'WRONG'}",
                    (max(d, floor), y), xytext=(6, 0), textcoords="offset points",
                    va="center", fontsize=10, fontweight="bold", color=color)
    ax.axvline(tol, color="0.4", ls=":", lw=1)
    ax.text(tol, -0.55, f" == eager below {tol:g}", fontsize=8, color="0.35", va="bottom")
    ax.set_xscale("log")
    ax.set_xlim(floor, 1e3)
    ax.set_ylim(-0.6, len(names) - 0.2)
    ax.set_yticks([])
    ax.set_xlabel("max |Δ weight| vs eager training (log)")
    ax.set_title(f"real training, PP=2, {micro} microbatches ({B.name}):\n"
                 "graphs created in which order?", fontsize=10)
    ax.grid(True, axis="x", alpha=0.3)
    fig.subplots_adjust(left=0.06, right=0.985, top=0.9, bottom=0.1)
    return fig


# --------------------------------------------------------------------------- 06

def _demo_06(B, small):
    import torch

    from labkit.decode import DecodeGraphRunner, build_model, plots, serve, synthetic_workload

    max_bs = 16
    model = build_model("tiny", max_requests=max_bs, device=B.device, dtype=torch.float32)
    runner = DecodeGraphRunner(model, B, max_bs=max_bs, progress=False)
    runner.capture()
    rep = runner.capture_report()
    print(f"captured {rep['graphs']} decode graphs (buckets {runner.buckets}) in "
          f"{rep['capture_seconds']:.2f} s, largest first, one pool")
    a = model.args
    n = 24 if small else 64
    workload = synthetic_workload(n, arrival_rate=2.0, vocab_size=a.vocab_size,
                                  max_seq_len=a.max_seq_len, seed=0)
    serve(model, workload[:8])                              # warm the eager path once
    eager = serve(model, workload)
    graphed = serve(model, workload, runner=runner)
    for name, res in (("eager", eager), ("graphed", graphed)):
        s = res.summary()
        print(f"{name:8s} decode {s['decode_tokens_per_s']:9.1f} tokens/s | step p50 "
              f"{s['step_ms_p50']:6.2f} ms | wall {res.wall_s:.2f} s")
    speedup = graphed.decode_tokens_per_s / eager.decode_tokens_per_s
    print(f"speed-up (decode tokens/s): {speedup:.2f}× [{_device(B)}]")
    print(f"tokens identical, request by request: {graphed.tokens == eager.tokens} | "
          f"{len(graphed.decode_batch_size)} decode steps, "
          f"{len(set(graphed.decode_batch_size))} different batch sizes, every one a graph "
          f"replay: {graphed.runner_stats['graph'] == len(graphed.decode_latency_s)}")
    if B.is_emulated:
        note = ("emulator timings on this CPU: they say nothing about GPU speed "
                "(the emulator replays a graph op by op)")
        print("emulated: " + note)
    else:
        note = f"measured on {_device(B)} (tiny model, fp32)"
    fig = plots.plot_serving({"eager": eager, "graphed": graphed}, note=note)
    return fig


# --------------------------------------------------------------------------- 07

def _demo_07(B, small):
    import matplotlib.pyplot as plt
    import torch

    from labkit import full_step as FS

    cfg = FS.CONFIGS["tiny"]
    gen = torch.Generator().manual_seed(0)
    m_eager, m_graph = FS.build_lm(cfg, B.device), FS.build_lm(cfg, B.device)  # same weights
    eager = FS.EagerTrainer(m_eager, FS.lm_loss,
                            FS.make_capturable_optimizer(m_eager.parameters(), B, lr=1e-2))
    trainer = FS.FullStepTrainer(m_graph, FS.lm_loss,
                                 FS.make_capturable_optimizer(m_graph.parameters(), B, lr=1e-2),
                                 B, cfg.num_microbatches, warmup_steps=2)
    data = [FS.random_microbatches(cfg, gen, device=B.device) for _ in range(6)]
    rows = []
    print("step  what ran          loss (eager)  loss (graphs)")
    for it, batch in enumerate(data):
        what = FS.phase(it, trainer.fwd_bwd.warmup_steps, trainer.captured)
        e = eager.step(batch).item()
        g = trainer.step(batch).item()
        what = "capture + replay" if what == "capture" else what
        rows.append((it, what, e, g))
        print(f"{it:4d}  {what:17s} {e:12.6f} {g:14.6f}")
    same = all(torch.allclose(q, p, rtol=1e-4, atol=1e-5)
               for p, q in zip(eager.model.parameters(), trainer.model.parameters()))
    print(f"weights after 6 steps equal eager training's: {same} | "
          f"{len(trainer.graphs)} graphs (forward+backward of all microbatches, optimizer), "
          "one pool")
    eager_us = _measure_us(lambda: eager.step(data[-1]), B, small)
    graph_us = _measure_us(lambda: trainer.step(data[-1]), B, small)
    print(f"eager step {eager_us / 1e3:8.3f} ms | whole-step graphs {graph_us / 1e3:8.3f} ms | "
          f"{eager_us / graph_us:.1f}× [{_device(B)}]")
    if B.is_emulated:
        print("emulated: a replay here runs the recorded ops on the CPU, skipping Python, "
              "modules and autograd; the ratio is the emulator's, not what a GPU gains")

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 3.6), gridspec_kw={"width_ratios": [3, 2]})
    its = [r[0] for r in rows]
    ax1.plot(its, [r[2] for r in rows], "o-", color="#3182bd", label="eager", ms=8)
    ax1.plot(its, [r[3] for r in rows], "x--", color="#de2d26", label="whole-step graphs", ms=9)
    for it, what, _, g in rows:
        ax1.annotate(what, (it, g), textcoords="offset points", xytext=(0, 9), ha="center",
                     fontsize=7)
    ax1.set_xlabel("training step")
    ax1.set_ylabel("loss")
    ax1.legend(fontsize=8)
    ax1.margins(y=0.2)
    ax1.set_title(f"same losses, step by step (weights equal: {same})", fontsize=10)
    bars = ax2.bar(["eager step", "whole-step\ngraphs"], [eager_us / 1e3, graph_us / 1e3],
                   color=["#3182bd", "#31a354"])
    for b in bars:
        ax2.text(b.get_x() + b.get_width() / 2, b.get_height(), f"{b.get_height():.3f} ms",
                 ha="center", va="bottom", fontsize=9)
    ax2.set_ylabel("ms per step (median)")
    ax2.set_ylim(0, max(eager_us, graph_us) / 1e3 * 1.18)
    ax2.set_title(f"{eager_us / graph_us:.1f}× on {_device(B)}"
                  + ("\n(emulator: not a GPU's gain)" if B.is_emulated else ""), fontsize=10)
    fig.tight_layout()
    return fig


# --------------------------------------------------------------------------- 08

def _demo_08(B, small):
    import matplotlib.pyplot as plt
    import torch

    from labkit import compiled as C

    gen = torch.Generator().manual_seed(0)
    weights = [(torch.randn(64, 64, generator=gen) / 8).to(B.device) for _ in range(8)]

    def mlp(x, *ws):
        for w in ws:
            x = torch.relu(x @ w)
        return x

    static = tuple(range(1, 1 + len(weights)))           # the weights: static inputs
    by_hand = C.ReduceOverhead(mlp, static=static, B=B)
    xs = [torch.randn(16, 64, generator=gen).to(B.device) for _ in range(5)]
    print("reduce-overhead's life cycle by hand (labkit.compiled.ReduceOverhead, on "
          f"{B.name}):")
    right = True
    for i, x in enumerate(xs):
        ok = torch.allclose(by_hand(x, *weights), mlp(x, *weights), atol=1e-5)
        right &= ok
        print(f"  call {i + 1}: {by_hand.kinds[-1]:8s} equals eager: {ok}")
    hand_kinds = list(by_hand.kinds)                     # before the timed calls add more
    rows = {"eager": _measure_us(lambda: mlp(xs[0], *weights), B, small),
            "by hand: copy x + replay": _measure_us(lambda: by_hand(xs[0], *weights), B, small)}
    torch_kinds = []
    if B.name == "cuda":
        torch._dynamo.reset()
        compiled = torch.compile(mlp, mode="reduce-overhead")
        torch_kinds = [C.call_kind(compiled, x, *weights, B=B)[1] for x in xs]
        print("torch.compile(mode='reduce-overhead'), the same five calls:",
              ", ".join(torch_kinds))
        rows["torch reduce-overhead"] = _measure_us(lambda: compiled(xs[0], *weights), B, small)

        def writes_arg(x, cache):
            cache.add_(x)                                # a mutated input, not static
            return cache.sum()

        torch._dynamo.reset()
        with C.watch_skips() as skips:
            f = torch.compile(writes_arg, mode="reduce-overhead")
            for x in xs[:3]:
                f(x, torch.zeros_like(x))
        first = skips.messages[0].splitlines()[0] if skips.messages else "(nothing logged)"
        print(f"a function that writes its argument: cudagraph_skips +{skips.count}: {first}")
    else:
        torch._dynamo.reset()
        with C.watch_skips() as skips:
            f = torch.compile(lambda t: t * 2 + 1, mode="reduce-overhead")
            for _ in range(3):
                f(torch.ones(4))
        print(f"CPU: torch.compile(mode='reduce-overhead') records no CUDA graphs here; for a "
              f"CPU-only function torch counted cudagraph_skips +{skips.count} and logged "
              f"{len(skips.messages)} line(s)")
    for name, us in rows.items():
        print(f"{name:26s} {us:9.1f} µs per call [{_device(B)}]")
    if B.is_emulated:
        print("emulated: a replay here runs the recorded ops on the CPU; the times are this "
              "CPU's, not what a GPU gains")

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 3.4), gridspec_kw={"width_ratios": [3, 2]})
    colors = {"warm-up": "#fdae6b", "record": "#de2d26", "replay": "#31a354", "eager": "#9e9ac8"}
    lanes = [("by hand", hand_kinds)] + ([("torch", torch_kinds)] if torch_kinds else [])
    for row, (label, kinds) in enumerate(lanes):
        for i, k in enumerate(kinds):
            ax1.barh(row, 0.9, left=i, color=colors.get(k, "0.7"))
            ax1.text(i + 0.45, row, k, ha="center", va="center", fontsize=9)
    ax1.set_yticks(range(len(lanes)), [lbl for lbl, _ in lanes])
    ax1.set_xticks([i + 0.45 for i in range(len(xs))], [f"call {i + 1}" for i in range(len(xs))])
    ax1.invert_yaxis()
    ax1.set_title(f"what each call did (all equal eager: {right})", fontsize=10)
    bars = ax2.bar([n.replace(": ", ":\n") for n in rows], list(rows.values()),
                   color=["#3182bd", "#31a354", "#756bb1"][:len(rows)])
    for b in bars:
        ax2.text(b.get_x() + b.get_width() / 2, b.get_height(), f"{b.get_height():.0f} µs",
                 ha="center", va="bottom", fontsize=9)
    ax2.set_ylabel("µs per call (median)")
    ax2.set_ylim(0, max(rows.values()) * 1.2)
    ax2.tick_params(axis="x", labelsize=8)
    ax2.set_title(f"8 matmul+relu layers on {_device(B)}"
                  + ("\n(emulator: not a GPU's gain)" if B.is_emulated else ""), fontsize=10)
    fig.tight_layout()
    return fig


# --------------------------------------------------------------------------- 09

def _demo_09(B, small):
    import matplotlib.pyplot as plt
    import torch

    from labkit import piecewise as P
    from labkit import speculative as S
    from labkit.decode import (
        DecodeGraphRunner,
        EagerRunner,
        build_model,
        make_decode_batch,
        make_extend_batch,
    )

    model = build_model("tiny", max_requests=8, device=B.device, dtype=torch.float32)
    pw = P.PiecewiseGraphRunner(model, B, max_num_tokens=32, buckets=[8, 16, 32],
                                progress=False)
    pw.capture()
    full = DecodeGraphRunner(model, B, max_bs=4, progress=False)
    full.capture()
    print(f"split at attention: {pw.num_pieces} pieces, {model.args.n_layer} attention calls; "
          f"captured {len(pw.backend.graphs)} piece graphs (token buckets {pw.buckets}) and "
          f"{len(full.backend.graphs)} full decode graphs")
    dispatcher = P.Dispatcher(model, full=full, piecewise=pw)
    eager = EagerRunner(model)
    eager.forward(make_extend_batch(model, [1, 2, 3, 4], [[7] * 9, [8] * 5, [9] * 12, [5] * 3]))
    batches = {                     # slots 1..4 are running requests, 5..8 new prompts
        "prefill 4x4": make_extend_batch(model, [5, 6, 7, 8], [[1, 2, 3, 4]] * 4),
        "mixed 8 + 4 decodes": P.make_mixed_batch(
            model, {5: list(range(8))}, {1: (3, 9), 2: (3, 5), 3: (3, 12), 4: (3, 3)}),
        "decode 4": make_decode_batch(model, [1, 2, 3, 4], [3, 3, 3, 3], [9, 5, 12, 3]),
    }
    names, eager_us, graph_us, modes = [], [], [], []
    for name, batch in batches.items():
        mode = dispatcher.dispatch(batch)
        same = torch.equal(dispatcher.forward(batch).argmax(-1), eager.forward(batch).argmax(-1))
        e = _measure_us(lambda b=batch: eager.forward(b), B, small)
        g = _measure_us(lambda b=batch: dispatcher.forward(b), B, small)
        print(f"{name:22s} {mode.value.upper():9s} eager {e:9.1f} µs | graphs {g:9.1f} µs | "
              f"same greedy tokens as eager: {same}")
        names.append(name)
        eager_us.append(e)
        graph_us.append(g)
        modes.append(mode.value.upper())
    target = build_model("tiny", max_requests=4, device=B.device, dtype=torch.float32)
    draft = S.make_draft(target, n_layer=1)
    prompts = [[1, 2, 3, 4], [5, 6, 7], [8, 9]]
    spec = S.speculative_generate(target, draft, prompts, 16, num_steps=3, B=B)
    plain = S.greedy_generate(target, prompts, 16)
    same = spec.tokens == [plain.tokens[i] for i in range(len(prompts))]
    print(f"speculative decoding, k=3, draft = 1 of {target.args.n_layer} blocks: "
          f"acceptance {100 * spec.acceptance_rate:.0f}%, {spec.tokens_per_round:.2f} tokens "
          f"per round, same tokens as plain greedy: {same}")
    fig, ax = plt.subplots(figsize=(8.5, 3.6))
    x = range(len(names))
    ax.bar([i - 0.2 for i in x], eager_us, 0.4, label="eager", color="#bbbbbb")
    ax.bar([i + 0.2 for i in x], graph_us, 0.4, label="dispatched to graphs", color="#4c72b0")
    ax.set_xticks(list(x), [f"{n}\n({m})" for n, m in zip(names, modes)], fontsize=8)
    ax.set_ylabel("µs per forward")
    ax.set_title("Lesson 09: each batch on the graphs that fit it (FULL / PIECEWISE)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    if B.is_emulated:
        print(_on_cpu_note(B))
    return fig


DEMOS: dict[str, Demo] = {d.number: d for d in (
    Demo("00", "start here",
         "which backend runs; a first graph: copy_ new data in, replay(), read the static "
         "output (bars: x and 2x+1 for two replays)", _demo_00),
    Demo("01", "launch-bound timeline",
         "measured µs per kernel eager vs graph; the CPU/GPU timeline of 20 tiny adds, eager "
         "vs one graph (profiled on a GPU, simulated from this CPU's launch cost without one)",
         _demo_01),
    Demo("02", "raw capture and replay",
         "an MLP captured with warm-up + capture, the kernels it recorded, replays equal to "
         "eager, and eager forward vs replay time (bars)", _demo_02),
    Demo("03", "constraint pitfalls",
         "capture by hand stops at the first hazard; lint_capture finds all 10 in one run "
         "(chart: each hazard, its line and severity)", _demo_03),
    Demo("04", "fwd/bwd autograd bridge",
         "gradient accumulation through graphed layers: labkit's bridge equals eager, "
         "without the wgrad clone (and torch's make_graphed_callables) it does not (bars)",
         _demo_04),
    Demo("05", "1F1B ordered capture",
         "GPipe vs 1F1B schedule charts (simulated), microbatches in flight, and real "
         "training: graphs created in recorded order equal eager, other orders do not",
         _demo_05),
    Demo("06", "decode bucketing",
         "a serving loop eager vs bucketed decode graphs: tokens/s, step times, identical "
         "tokens (lesson 06's serving chart)", _demo_06),
    Demo("07", "whole-step capture",
         "a training step as two graphs (fwd+bwd of every microbatch, optimizer): losses "
         "equal eager step by step, and ms per step eager vs graphs", _demo_07),
    Demo("08", "torch.compile and CUDA graph trees",
         "reduce-overhead's life cycle (warm-up, record, replay) by hand on any backend and, "
         "on a GPU, torch's own, with a skip verdict; µs per call (bars)", _demo_08),
    Demo("09", "piecewise graphs and the draft runner",
         "prefill, mixed and decode batches dispatched to piecewise or full graphs, equal to "
         "eager, µs per forward (bars); speculative decoding equal to plain greedy", _demo_09),
)}


