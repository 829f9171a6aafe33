"""Suite ``serve``: a continuous-batching serving loop, step after step (lesson 06).

The decode suite times one step at a fixed batch size; this one runs
:func:`labkit.decode.serve` over a seeded workload on the same 8-layer, d=512 fp16 GPT:
requests arrive, are prefilled eagerly, decode together in batches that change size from
step to step, and leave. Variants:

``eager``                     every step eager, with the graphs' attention kernel (the
                              Triton decode kernel on a GPU; with stock SDPA one smoke run
                              of this loop took tens of ms a step, not investigated)
``labkit_graph``              decode steps replay ``DecodeGraphRunner``'s graphs; each step
                              builds its batch, replays, and reads its tokens back (a sync)
``labkit_graph_overlap``      the same graphs, ``serve(..., overlap=True)``: step N+1 is
                              staged (one copy) and queued before step N's tokens are read
``labkit_graph_compiled``     compile-then-capture graphs (``compile_bs``), synced loop
``labkit_graph_compiled_overlap``  the same, overlapped
``labkit_graph_overlap_piecewise``  the overlapped loop with admissions prefilled through
                              a :class:`~labkit.piecewise.PiecewiseGraphRunner`
                              (``serve(..., prefill=...)``, one Triton attention kernel
                              per layer on a GPU), their first tokens read back lazily

``median_us`` is the median time of one decode step of the loop (wall clock on the host,
so it includes everything the loop does around the replay); ``extra`` holds decode
tokens/s over the whole run, end-to-end tokens/s, the steps and the mean batch size, and
on a GPU ``gpu_busy_fraction``: the GPU busy time of one profiled run (the union of its
kernels, copies and fills) over the median wall time of the unprofiled rounds (a
profiled run's own wall time is inflated by the profiler).
Every variant is built and warmed up first; then each round runs the whole workload once
per variant, in a shuffled order (:mod:`labkit.bench.rounds`), and a row's figures are
medians over rounds (``extra.rounds`` keeps each round's step median, tokens/s and wall
time). Variants that run the same kernels must generate the very same tokens (``labkit_graph``
and its overlapped twin as ``eager``; the compiled pair as each other: fused kernels round
differently, and in fp16 a rounding can flip a greedy token); a row whose tokens differ
from its family's first says so. A piecewise prefill runs its GEMMs at the bucket's token
count, which cuBLAS may round differently: its rows form families of their own and record
the share of requests whose tokens equal the family without it
(``extra.requests_same_tokens_as_<variant>``).
"""

from __future__ import annotations

import gc
import statistics

import torch

from labkit.bench import SuiteSkip, make_row, unmeasured_rows
from labkit.bench.decode import CPU_MODEL, MODEL
from labkit.bench.rounds import DEFAULT_ROUNDS, interleave, median_range, verdict, wins_needed
from labkit.bench.variants import check_names, defaults
from labkit.bench.variants import variant as declared_variant
from labkit.core.timing import profile_gpu_busy_us

VARIANTS = defaults("serve")       # declared, with their options, in labkit.bench.variants
PIECEWISE_TOKENS = 256      # the prefill runner's largest token bucket (GPU)
WORKLOAD = dict(num_requests=192, arrival_rate=8.0, prompt_len=(16, 64), output_len=(48, 128))
CPU_WORKLOAD = dict(num_requests=24, arrival_rate=2.0, prompt_len=(4, 12), output_len=(4, 16))


def serve_sample(run_once) -> dict[str, float]:
    """The ``time_one`` of :func:`labkit.bench.rounds.interleave` for a serving loop: run
    ``run_once()`` (one whole workload, returning a :class:`labkit.decode.ServeResult`)
    and return its figures for this round: ``median_us`` (the median decode step, µs),
    ``wall_s`` (the whole run), ``decode_tokens_per_s`` and ``tokens_per_s``.

    .. warning::
        Only ``median_us`` and ``wall_s`` are times that a verdict may compare; the
        ``*_per_s`` rates are for printing (:func:`labkit.bench.rounds.median_range`).
    """
    res = run_once()
    s = res.summary()
    lat = sorted(res.decode_latency_s)
    if not lat:
        raise ValueError("serve_sample: the run decoded no step; give the workload requests "
                         "with output_len >= 2")
    return {"median_us": 1e6 * lat[len(lat) // 2],
            "decode_tokens_per_s": s["decode_tokens_per_s"],
            "tokens_per_s": s["tokens_per_s"], "wall_s": res.wall_s}


def time_loops(loops, *, where: str, rounds: int = DEFAULT_ROUNDS, seed: int = 0,
               log=print) -> dict:
    """Run each serving loop once per round, interleaved; print each loop's median and
    min–max over the rounds, then the verdicts of the last loop against the first.

    Args:
        loops: name → a callable that runs the whole workload once and returns its
            :class:`labkit.decode.ServeResult` (e.g. ``lambda: serve(model, workload)``);
            at least two, the baseline first.
        where: what measured it, for the header line (``"measured on NVIDIA H200"``).
        rounds, seed: as for :func:`labkit.bench.rounds.interleave`.
        log: where the lines go.

    Returns:
        :func:`~labkit.bench.rounds.interleave`'s result: name → ``{method: [one value
        per round]}`` (methods of :func:`serve_sample`).
    """
    if not isinstance(loops, dict) or len(loops) < 2:
        raise ValueError(f"time_loops compares serving loops: give a dict of at least two "
                         f"name -> callable, the baseline first; got {loops!r:.80}")
    timed = interleave(loops, serve_sample, rounds=rounds, seed=seed)
    log(f"median (min–max) over {rounds} interleaved rounds, {where}")
    for method, label in (("median_us", "decode step p50"), ("wall_s", "whole run"),
                          ("decode_tokens_per_s", "decode tokens")):
        log((f"{label:16s}" + "".join(f"{name} {median_range(t[method], method):29s}"
                                      for name, t in timed.items())).rstrip())
    (first, t0), (last, t1) = list(timed.items())[0], list(timed.items())[-1]
    log(f"verdicts (faster = ahead in at least {wins_needed(rounds)} of {rounds} rounds):")
    for method, label in (("median_us", "decode step"), ("wall_s", "whole run")):
        v = verdict(last, t1[method], first, t0[method], method=method)
        log(f"{label + ':':13s} {v.short()}")
    return timed


def run(B, quick: bool = False, log=print, model_args: dict | None = None,
        workload: dict | None = None, max_running: int | None = None,
        variants=VARIANTS, rounds: int = DEFAULT_ROUNDS, seed: int = 0) -> list[dict]:
    from labkit import decode as D

    variants = check_names("serve", variants)
    on_gpu = B.name == "cuda"
    model_args = model_args or (MODEL if on_gpu else CPU_MODEL)
    workload = dict(workload or (WORKLOAD if on_gpu else CPU_WORKLOAD))
    if quick:
        workload["num_requests"] = max(8, workload["num_requests"] // 3)
    max_running = max_running or (64 if on_gpu else 4)
    args = D.ModelArgs(**model_args)
    model = D.build_model(args, max_requests=max_running, device=B.device)
    wl = D.synthetic_workload(vocab_size=args.vocab_size, max_seq_len=args.max_seq_len,
                              seed=0, **workload)
    name = f"gpt_{args.n_layer}L_d{args.dim}"
    config = {**model_args, "dtype": str(model.output.weight.dtype).replace("torch.", ""),
              "workload": {k: list(v) if isinstance(v, tuple) else v
                           for k, v in workload.items()},
              "max_running": max_running}
    rows, runs, cfgs, results, prefills = [], {}, {}, {}, {}
    runners: dict[bool, object] = {}

    def prefill_runner():
        if "pw" not in prefills:
            from labkit import piecewise as P
            pw = P.PiecewiseGraphRunner(model, B, max_num_tokens=PIECEWISE_TOKENS if on_gpu
                                        else 32, progress=False, attention="auto")
            pw.capture()
            prefills["pw"] = pw
        return prefills["pw"]

    def runner_for(compiled: bool):
        if compiled not in runners:
            # pow2 buckets: 7 graphs up to 64, so that the compiled runner compiles 7
            # shapes (seconds each), not SGLang's 12
            kw = dict(max_bs=max_running, progress=False, attention="auto", buckets="pow2")
            if compiled:
                kw.update(compile_bs=max_running, compile_mode="default")
            r = D.DecodeGraphRunner(model, B, **kw)
            r.capture()
            runners[compiled] = r
        return runners[compiled]

    for variant in variants:                 # build and warm up everything first
        try:
            v = declared_variant("serve", variant)
            compiled = v.option("compiled", False)
            if v.gpu_only and not on_gpu:
                raise SuiteSkip(v.gpu_only)
            runner = (D.EagerRunner(model, "auto") if v.option("runs") == "eager"
                      else runner_for(compiled))
            overlap = v.option("overlap", False)
            prefill = prefill_runner() if v.option("piecewise") else None
            D.serve(model, wl[:8], runner=runner, max_running=max_running, overlap=overlap,
                    prefill=prefill)

            def one_run(variant=variant, runner=runner, overlap=overlap, prefill=prefill):
                res = D.serve(model, wl, runner=runner, max_running=max_running,
                              overlap=overlap, prefill=prefill)
                results.setdefault(variant, res)          # the first round's tokens
                return res

            runs[variant] = one_run
            cfg = {**config, "overlap": overlap,
                   "runs": "serve(model, workload, runner=" + type(runner).__name__
                   + ("(...), overlap=True" if overlap else "(...)")
                   + (", prefill=PiecewiseGraphRunner(...))" if prefill else ")"),
                   "attention": runner.attn.name}
            if prefill is not None:
                cfg["prefill_buckets"] = prefill.buckets
            if v.option("runs") != "eager":
                cfg["buckets"] = runner.buckets
                if compiled:
                    cfg["compile_mode"] = "default"
            cfgs[variant] = cfg
        except Exception as e:              # SuiteSkip too: a row saying why, never none
            rows += unmeasured_rows(B, "serve", name, config, [None], variant, e, log)

    if runs:
        log(f"  running the workload {rounds} times per variant, interleaved")
        timed = interleave(runs, serve_sample, rounds=rounds, seed=seed, log=log)
    reference = {}
    for variant in runs:
        res = results[variant]
        # Same kernels, same tokens. Piecewise prefill runs its GEMMs at the bucket's token
        # count, and cuBLAS may round another shape differently: a family of its own.
        v = declared_variant("serve", variant)
        base_family = "compiled" if v.option("compiled") else "plain"
        piecewise = bool(v.option("piecewise"))
        family = base_family + (" + piecewise" if piecewise else "")
        first = reference.setdefault(family, (variant, res.tokens))
        note = (None if res.tokens == first[1] else
                f"tokens differ from {first[0]}'s, which runs the same kernels")
        s = res.summary()
        r = timed[variant]
        extra = {"decode_tokens_per_s": round(statistics.median(r["decode_tokens_per_s"]), 1),
                 "tokens_per_s": round(statistics.median(r["tokens_per_s"]), 1),
                 "decode_steps": s["decode_steps"], "mean_batch": round(s["mean_batch"], 1),
                 "wall_s": round(statistics.median(r["wall_s"]), 3)}
        if piecewise and base_family in reference:
            same = reference[base_family][1]
            extra["requests_same_tokens_as_" + reference[base_family][0]] = round(
                sum(res.tokens[k] == same[k] for k in same) / max(1, len(same)), 3)
        busy = profile_gpu_busy_us(runs[variant], B, warmup=0)
        if busy is not None:
            extra["gpu_busy_fraction"] = round(busy / (1e6 * extra["wall_s"]), 3)
        row = make_row(B, "serve", name, cfgs[variant], None, variant, None, note=note,
                       extra=extra, rounds=r)
        rows.append(row)
        log(f"  serve {variant:31s} step p50 {row['median_us']:8.1f} µs | decode "
            f"{extra['decode_tokens_per_s']:9.0f} tokens/s | end to end "
            f"{extra['tokens_per_s']:9.0f} tokens/s"
            + (f" | GPU busy {extra['gpu_busy_fraction']:.2f}" if busy is not None else "")
            + (f" | {note}" if note else ""))
    for r in list(runners.values()) + list(prefills.values()):
        r.backend.cleanup()
    gc.collect()
    if on_gpu:
        torch._dynamo.reset()
        torch.cuda.empty_cache()
    order = {v: i for i, v in enumerate(variants)}
    return sorted(rows, key=lambda r: order.get(r["variant"], len(order)))
