"""Suite ``decode``: one decode step, labkit's graph runner vs what a user would pick instead.

An 8-layer, d=512, 8-head fp16 GPT from ``labkit.decode`` (KV caches filled with random
values, random tokens, random sequence lengths) at batch sizes 1, 8 and 64. All variants are
built first, then timed in **interleaved rounds** (:mod:`labkit.bench.rounds`: each round
times every (variant, batch size) once, in a shuffled order), and **both ways**:

``median_us`` — *synced per step*
    :func:`~labkit.core.timing.time_call`: the device is synchronized before every call,
    as in a serving loop that needs each step's tokens on the host. Host work around the
    replay is paid in full.
``back_to_back_us`` — *back to back*
    :func:`~labkit.core.timing.back_to_back_us`: 50 calls between two events, no sync
    in between, as in a loop whose next input stays on the device. Host work hides behind
    the device wherever it is shorter.

Variants (declared, with what each runs, in :mod:`labkit.bench.variants`; each row's
``config`` records what it ran):

``eager`` / ``eager_triton``
    ``EagerRunner.forward`` with stock torch attention (gather + SDPA) / with the Triton
    decode kernel launched from Python.
``labkit_graph``
    ``DecodeGraphRunner``, buckets [1, 8, 64] captured largest first in one pool,
    attention ``"auto"`` (the Triton kernel on a GPU); every timed call takes the full
    path (pad, fill the static buffers, page table out of graph, replay, slice).
    ``extra.replay_only_*``: ``graph.replay()`` alone.
``labkit_graph_staged`` / ``labkit_graph_compiled_staged``
    the same runners (no second capture), each call the serving loop's path instead:
    ``runner.stage(slots, positions, tokens)`` from host ints (one pinned buffer, one
    non-blocking copy into the buffer the graph reads, page table out of graph) and
    ``runner.replay_staged()``.
``labkit_graph_torch_attn``
    the same runner with stock torch attention.
``labkit_graph_compiled``
    the runner with ``compile_bs=64``: the model compiled (``mode="default"``: fusion, no
    cudagraphs of its own; the Triton kernel stays one opaque operator) and then captured
    by the runner: SGLang's compile-then-capture.
``compile_reduce_overhead``
    ``torch.compile(model, mode="reduce-overhead")`` on labkit's eager path (attention
    metadata planned on the host every call).
``reference_eager``
    :class:`~labkit.bench.reference.ReferenceGPT` run eagerly, no compile: a plain model's
    eager step, the fair "× over eager" (labkit's own eager path plans attention on the
    host every call and is slower than a plain model).
``compile_reduce_overhead_static``
    **the row labkit must beat**: :class:`~labkit.bench.reference.ReferenceGPT` (the same
    weights, gpt-fast's dense KV cache as buffers, positions on the device, SDPA) under
    ``torch.compile(mode="reduce-overhead")``, one compiled callable per batch size. Its
    logits are checked against labkit's eager ones first (``extra.max_abs_diff``).

Each row keeps its rounds (``extra.rounds``); ``median_us`` and ``back_to_back_us``
are the medians over rounds. GPU busy time and kernels come from one profiled call after
the rounds, with the five longest kernels (``extra.top_kernels``: name, µs summed over
the call) to show where the GPU time goes.

The floors (``extra``): ``bytes_floor_us`` = the bytes a step must read (weights and the
KV entries in use) over the copy bandwidth measured in the same run; ``kernel_floor_us`` =
the kernels the call ran × the per-node time of a graph of tiny kernels, measured too.

Rows a backend cannot produce are recorded as skipped with a note, never dropped.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass
from typing import Callable

import torch

from labkit.bench import (
    SuiteSkip,
    cudagraph_skips,
    make_row,
    round_timer,
    skipped_row,
    unmeasured_rows,
)
from labkit.bench.rounds import DEFAULT_ROUNDS, interleave
from labkit.bench.variants import check_names, declared, defaults, gpu_only
from labkit.bench.variants import variant as declared_variant
from labkit.core.timing import back_to_back_us, events_busy_us, measure_us, profile_gpu_events
from labkit.timeline import chain_steps

# the variants are declared in labkit.bench.variants; these are read from there
VARIANTS = defaults("decode")
STAGED = {v.staged_of: v.name for v in declared("decode") if v.staged_of}  # runner -> staged
GPU_ONLY = gpu_only("decode")
MODEL = dict(vocab_size=1024, n_layer=8, n_head=8, n_local_heads=8, dim=512, max_seq_len=256)
CPU_MODEL = dict(vocab_size=128, n_layer=2, n_head=4, n_local_heads=4, dim=64, max_seq_len=64)


def _batches(D, model, batch_sizes, gen):
    """One random decode batch per size: slots 1..bs, random tokens and lengths."""
    a = model.args
    out = {}
    for bs in batch_sizes:
        tokens = torch.randint(0, a.vocab_size, (bs,), generator=gen).tolist()
        starts = torch.randint(8, a.max_seq_len - 1, (bs,), generator=gen).tolist()
        out[bs] = D.make_decode_batch(model, list(range(1, bs + 1)), tokens, starts)
    return out


def _runner(D, model, B, batch_sizes, attention: str, compile_mode: str | None = None):
    kw = dict(max_bs=max(batch_sizes), buckets=sorted(batch_sizes), progress=False,
              attention=attention)
    if compile_mode:
        kw.update(compile_bs=max(batch_sizes), compile_mode=compile_mode)
    runner = D.DecodeGraphRunner(model, B, **kw)
    runner.capture()
    return runner


def copy_bandwidth(B, nbytes: int = 1 << 28) -> float | None:
    """Bytes read + written per µs by one device-to-device copy of ``nbytes``; None
    without a GPU."""
    if B.name != "cuda":
        return None
    src = torch.empty(nbytes, dtype=torch.uint8, device=B.device)
    dst = torch.empty_like(src)
    us = measure_us(lambda: dst.copy_(src), B, warmup=3, repeats=10)
    return 2 * nbytes / us


def node_us(B, nodes: int = 200) -> float | None:
    """Replay time per node of a graph of ``nodes`` tiny dependent kernels (lesson 01's
    captured chain, :func:`labkit.timeline.chain_steps`), back to back: what each kernel
    of a graph costs when it does next to nothing. None without a GPU."""
    if B.name != "cuda":
        return None
    steps = chain_steps(B, n_ops=nodes)
    return back_to_back_us(steps.graphed, B, calls=20) / nodes


def step_bytes(model, batch) -> int:
    """What one decode step must read: every weight except the embedding table (only the
    batch's rows of it), and the cached keys and values of every request's ``seq_len``
    positions in every layer."""
    a = model.args
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    emb = model.tok_embeddings.weight
    params += (batch.batch_size - emb.size(0)) * emb.size(1) * emb.element_size()
    elt = model.output.weight.element_size()
    kv = sum(batch.seq_lens_cpu) * a.n_layer * 2 * a.n_local_heads * a.head_dim * elt
    return params + kv


@dataclass
class Built:
    """One variant, built and checked: a callable per batch size and what its rows say."""

    fns: dict                      # batch size -> the step to time
    cfg: dict                      # what the rows' config adds
    note: str | None = None
    replays: dict | None = None    # batch size -> graph.replay, for extra.replay_only_*
    extra_of: Callable | None = None
    cleanup: Callable | None = None


def top_kernels(events, n: int = 5) -> list[list]:
    """The ``n`` kernels (copies, fills) that took the most GPU time in one profiled call:
    ``[[name, µs summed over its launches], ...]``, longest first."""
    total: dict[str, float] = {}
    for e in events:
        total[e["name"]] = total.get(e["name"], 0.0) + float(e["dur"])
    ranked = sorted(total.items(), key=lambda kv: -kv[1])[:n]
    return [[name[:80], round(us, 1)] for name, us in ranked]


def _check_close(diffs: dict, dtype, what: str) -> None:
    worst = max(diffs.values())
    tol = 5e-2 if dtype == torch.float16 else 1e-3
    if worst > tol:
        raise RuntimeError(f"{what}'s logits differ from labkit's by {worst:.3g} (> {tol}): "
                           "not the same computation")


def _build(variant, D, B, model, batches, batch_sizes, compile_mode, skips) -> dict:
    """``{variant name: Built}`` for one variant (two for a staged one), built from its
    declared record's options (:mod:`labkit.bench.variants`)."""
    from labkit.bench.reference import ReferenceGPT

    v = declared_variant("decode", variant)
    runs = v.option("runs")
    if v.gpu_only and B.name != "cuda":
        raise SuiteSkip(v.gpu_only)
    dtype = model.output.weight.dtype
    if runs == "eager":
        eager = D.EagerRunner(model, v.option("attention"))
        return {variant: Built({bs: (lambda b=b: eager.forward(b)) for bs, b in batches.items()},
                               {"attention": eager.attn.name, "runs": "EagerRunner.forward"})}
    if runs == "graph":
        compiled = v.option("compiled", False)
        runner = _runner(D, model, B, batch_sizes, v.option("attention"),
                         compile_mode if compiled else None)

        def full_path(b, runner=runner):
            b.metadata_ready = False       # time the full path, not the fast path
            return runner.forward(b)

        cfg = {"attention": runner.attn.name,
               "runs": "DecodeGraphRunner.forward (pad, fill, metadata, replay, slice)"}
        if compiled:
            cfg["compile_mode"] = compile_mode
        replays = {bs: runner.backend.graphs[bs].replay for bs in batch_sizes}
        out = {variant: Built({bs: (lambda b=b: full_path(b)) for bs, b in batches.items()},
                              cfg, replays=replays, cleanup=runner.backend.cleanup)}
        if variant in STAGED:   # the same graphs, the serving loop's path: *_staged
            host_values = {bs: (b.req_pool_indices.tolist(), b.positions.tolist(),
                                b.input_ids.tolist()) for bs, b in batches.items()}

            def staged(bs, runner=runner):
                runner.stage(*host_values[bs])
                return runner.replay_staged()

            out[STAGED[variant]] = Built(
                {bs: (lambda bs=bs: staged(bs)) for bs in batch_sizes},
                {**cfg, "runs": "DecodeGraphRunner.stage(host ints: one pinned copy) + "
                                "replay_staged()"}, replays=replays)
        return out
    if runs == "compile":
        er = D.EagerRunner(model)
        er.model = torch.compile(model, mode="reduce-overhead", dynamic=False)

        def fn(b):
            torch.compiler.cudagraph_mark_step_begin()
            return er.forward(b)

        fns = {bs: (lambda b=b: fn(b)) for bs, b in batches.items()}
        for f in fns.values():               # compile every size before timing
            f()
        note = ("torch skipped cudagraphs (see its log): compiled without graphs"
                if cudagraph_skips() > skips else None)
        return {variant: Built(fns, {"attention": "torch_native",
                                     "runs": "EagerRunner.forward, model under torch.compile("
                                             "mode='reduce-overhead')"}, note=note)}
    if runs == "reference":
        ref = ReferenceGPT(model, max(batch_sizes))
        ref.load_kv(model, list(range(1, max(batch_sizes) + 1)))
        eager = D.EagerRunner(model)
        diffs, fns = {}, {}
        for bs, b in batches.items():
            ids, pos = b.input_ids, b.positions
            if not v.option("compiled", False):
                def f(ids=ids, pos=pos):
                    return ref(ids, pos)
            else:
                compiled_ref = torch.compile(ref, mode="reduce-overhead", dynamic=False)

                def f(c=compiled_ref, ids=ids, pos=pos):
                    torch.compiler.cudagraph_mark_step_begin()
                    return c(ids, pos)
            with torch.no_grad():
                want = eager.forward(b)
                got = f().clone()
            diffs[bs] = (got - want).abs().max().item()
            fns[bs] = torch.no_grad()(f)
        _check_close(diffs, dtype, "the reference model")
        if not v.option("compiled", False):
            cfg = {"attention": "sdpa over a dense KV cache (gpt-fast)",
                   "runs": "ReferenceGPT eagerly (no compile)"}
            note = None
        else:
            cfg = {"attention": "sdpa over a dense KV cache (gpt-fast)",
                   "runs": "ReferenceGPT under torch.compile(mode='reduce-overhead'), one "
                           "callable per batch size"}
            note = ("torch skipped cudagraphs (see its log): compiled without graphs"
                    if cudagraph_skips() > skips else None)
        return {variant: Built(fns, cfg, note=note,
                               extra_of=lambda bs: {"max_abs_diff": float(f"{diffs[bs]:.3g}")})}
    raise ValueError(f"decode variant {variant!r} declares runs={runs!r}: this suite builds "
                     "'eager', 'graph', 'compile' or 'reference'")


def run(B, quick: bool = False, log=print, model_args: dict | None = None,
        batch_sizes=None, variants=VARIANTS, compile_mode: str = "default",
        rounds: int = DEFAULT_ROUNDS, seed: int = 0) -> list[dict]:
    variants = check_names("decode", variants)
    try:
        from labkit import decode as D
    except ImportError as e:
        return [skipped_row(B, "decode", "gpt", {}, None, v, f"labkit.decode: {e}")
                for v in variants]

    on_gpu = B.name == "cuda"
    if model_args is None:
        model_args = MODEL if on_gpu else CPU_MODEL
    if batch_sizes is None:
        batch_sizes = (1, 8, 64) if on_gpu else (1, 4)
    args = D.ModelArgs(**model_args)
    model = D.build_model(args, max_requests=max(batch_sizes), device=B.device)
    dtype = model.output.weight.dtype
    with torch.no_grad():
        for layer in model.layers:
            layer.attention.kv_cache.kv.normal_()
    name = f"gpt_{args.n_layer}L_d{args.dim}"
    config = {**model_args, "dtype": str(dtype).replace("torch.", "")}
    gen = torch.Generator().manual_seed(0)
    batches = _batches(D, model, batch_sizes, gen)
    repeats, warmup, calls = (5, 2, 20) if quick else (20, 3, 50)
    bandwidth, per_node = copy_bandwidth(B), node_us(B)
    floors = {bs: (None if bandwidth is None else step_bytes(model, b) / bandwidth)
              for bs, b in batches.items()}
    if bandwidth is not None:
        log(f"  floors: copy bandwidth {bandwidth / 1e3:.2f} GB/s (read + write), "
            f"{per_node:.2f} µs per graph node")
    rows: list[dict] = []
    built: dict[str, Built] = {}
    for variant in variants:                 # build (and check) everything first
        try:
            built.update(_build(variant, D, B, model, batches, batch_sizes, compile_mode,
                                cudagraph_skips()))
        except Exception as e:              # SuiteSkip too: a row saying why, never none
            rows += unmeasured_rows(B, "decode", name, config, batch_sizes, variant, e, log)
    if not built:
        return rows
    log(f"  timing {len(built)} variants × {len(batch_sizes)} batch sizes in {rounds} "
        "interleaved rounds")
    contenders = {(v, bs): b.fns[bs] for v, b in built.items() for bs in batch_sizes}
    timed = interleave(contenders, round_timer(B, warmup=warmup, repeats=repeats,
                                               calls=calls),
                       rounds=rounds, seed=seed, log=log)
    for variant, b in built.items():
        for bs in batch_sizes:
            extra = {}
            events = profile_gpu_events(b.fns[bs], B)
            busy = kernels = None
            if events is not None:
                busy, kernels = events_busy_us(events), len(events)
                extra.update(kernels=kernels, kernel_floor_us=round(kernels * per_node, 1),
                             bytes_floor_us=round(floors[bs], 1),
                             top_kernels=top_kernels(events))
            if b.replays is not None:
                extra.update(replay_only_us=round(measure_us(b.replays[bs], B, warmup=warmup,
                                                             repeats=repeats), 3),
                             replay_only_b2b_us=round(back_to_back_us(b.replays[bs], B,
                                                                      calls=calls), 3))
            if b.extra_of is not None:
                extra.update(b.extra_of(bs))
            row = make_row(B, "decode", name, {**config, **b.cfg}, bs, variant, None, busy,
                           note=b.note, extra=extra, rounds=timed[(variant, bs)])
            rows.append(row)
            log(f"  decode bs={bs:3d} {variant:31s} synced {row['median_us']:8.1f} µs | back "
                f"to back {row['back_to_back_us']:8.1f} µs" +
                (f" | busy {busy:6.1f} µs, {kernels} kernels" if busy is not None else ""))
    for b in built.values():
        if b.cleanup is not None:
            b.cleanup()
    built.clear()
    gc.collect()
    if on_gpu:
        torch._dynamo.reset()
        torch.cuda.empty_cache()
    return rows
