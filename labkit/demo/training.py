"""The training demos: lesson 04's autograd bridge, lesson 05's 1F1B ordered capture and
lesson 07's whole-step capture."""

from __future__ import annotations

from labkit.demo.common import _device, _measure_us

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
