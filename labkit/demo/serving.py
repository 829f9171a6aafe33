"""The demos of lessons 06, 08 and 09: bucketed decode graphs, torch.compile's
reduce-overhead, and piecewise graphs with speculative decoding."""

from __future__ import annotations

from labkit.demo.common import _device, _measure_us, _on_cpu_note

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
