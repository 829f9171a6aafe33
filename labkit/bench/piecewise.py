"""Suite ``piecewise``: prefill and mixed batches, eager vs piecewise graphs vs torch.compile.

The model of the ``decode`` suite (8 layers, d=512, fp16; a smaller one on the emulator),
batches of several shapes, every variant timed in the same process:

``eager``
    ``EagerRunner.forward``: every kernel launched from Python; attention is one padded
    SDPA per layer for all the batch's requests.
``piecewise``
    :class:`~labkit.piecewise.PiecewiseGraphRunner` (vLLM's token buckets up to the largest
    batch's token count, ``attention="auto"``): the pieces between attentions replayed,
    attention eager on the real tokens (one Triton kernel per layer on a GPU).
``compile_dynamic``
    what a user would pick instead: ``torch.compile(model, dynamic=True)`` (default mode)
    on the same eager path, every workload compiled before timing
    (``extra.graphs_compiled``: the graphs Dynamo compiled for all the workloads).
``full_graph``
    pure decode batches only: lesson 06's :class:`~labkit.decode.DecodeGraphRunner`, the
    FULL graph vLLM's dispatcher picks for them.

All variants are built first, then every (variant, workload) is timed in interleaved
rounds (:mod:`labkit.bench.rounds`), synced and back to back; ``gpu_busy_us`` is the
GPU-busy floor: the union of the call's kernel intervals in a
profile (:func:`labkit.core.timing.events_busy_us`). ``extra.kernels`` is how many
kernels, copies and fills the call ran (a graph's included).
"""

from __future__ import annotations

import gc
import random

import torch

from labkit.bench import SuiteSkip, make_row, round_timer, unmeasured_rows
from labkit.bench.rounds import DEFAULT_ROUNDS, interleave
from labkit.bench.variants import check_names, defaults, gpu_only
from labkit.core.timing import events_busy_us, profile_gpu_events

VARIANTS = defaults("piecewise")   # declared in labkit.bench.variants
GPU_ONLY = gpu_only("piecewise")
MODEL = dict(vocab_size=1024, n_layer=8, n_head=8, n_local_heads=8, dim=512, max_seq_len=256)
CPU_MODEL = dict(vocab_size=128, n_layer=2, n_head=4, n_local_heads=4, dim=64, max_seq_len=64)

# name -> (prompt lengths, decode requests): each one batch
WORKLOADS = {
    "prefill 8x8": ([8] * 8, 0),
    "prefill 3+17+40+4": ([3, 17, 40, 4], 0),
    "prefill 2x120": ([120, 120], 0),
    "mixed 48 + 16 decodes": ([48], 16),
    "decode 32": ([], 32),
}
CPU_WORKLOADS = {
    "prefill 4x4": ([4] * 4, 0),
    "mixed 8 + 4 decodes": ([8], 4),
    "decode 4": ([], 4),
}


def make_batches(D, P, model, workloads, seed=0) -> dict:
    """One batch per workload. Decode requests get a prefix of random length in their
    slot first (so their keys exist); prompts take the slots after them."""
    rng = random.Random(seed)
    a = model.args
    out = {}
    for name, (prompt_lens, n_dec) in workloads.items():
        dec_slots = list(range(1, n_dec + 1))
        prefixes = [rng.randrange(4, a.max_seq_len // 2) for _ in dec_slots]
        if dec_slots:
            D.EagerRunner(model).forward(D.make_extend_batch(
                model, dec_slots, [[rng.randrange(a.vocab_size) for _ in range(n)]
                                   for n in prefixes]))
        pre_slots = list(range(n_dec + 1, n_dec + 1 + len(prompt_lens)))
        prompts = [[rng.randrange(a.vocab_size) for _ in range(n)] for n in prompt_lens]
        tokens = [rng.randrange(a.vocab_size) for _ in dec_slots]
        if not prompt_lens:
            out[name] = D.make_decode_batch(model, dec_slots, tokens, prefixes)
        else:
            out[name] = P.make_mixed_batch(model, dict(zip(pre_slots, prompts)),
                                           {s: (t, p) for s, t, p in
                                            zip(dec_slots, tokens, prefixes)})
    return out


def _build(variant, D, P, B, model, batches, tokens, log) -> tuple[dict, dict, dict, list]:
    """``(fns {workload: fn}, cfg, extra {workload: dict}, cleanups)`` for one variant."""
    on_gpu = B.name == "cuda"
    if variant in GPU_ONLY and not on_gpu:
        raise SuiteSkip(GPU_ONLY[variant])
    if variant == "eager":
        eager = D.EagerRunner(model)
        return ({w: (lambda b=b: eager.forward(b)) for w, b in batches.items()},
                {"runs": "EagerRunner.forward"}, {}, [])
    if variant == "piecewise":
        pw = P.PiecewiseGraphRunner(model, B, max_num_tokens=max(tokens.values()),
                                    progress=False, attention="auto")
        log_ = pw.capture()
        cap = {"graphs": len(pw.backend.graphs), "buckets": len(pw.buckets),
               "capture_s": round(sum(r["seconds"] for r in log_), 2),
               "pool_MiB": round(log_[-1]["pool_reserved_bytes"] / 2**20, 1)}
        log(f"  piecewise capture: {cap}")
        extra = {}
        for w, b in batches.items():
            pw.replay(b)
            extra[w] = {"bucket": pw.last_replay[1], "pieces": pw.num_pieces, **cap}
        return ({w: (lambda b=b: pw.replay(b)) for w, b in batches.items()},
                {"runs": "PiecewiseGraphRunner.replay", "buckets": "vllm",
                 "attention": pw.attn.name}, extra,
                [pw.backend.cleanup])
    if variant == "compile_dynamic":
        import torch._dynamo.utils as du
        ce = D.EagerRunner(model)
        ce.model = torch.compile(model, dynamic=True)
        before = du.counters["stats"]["unique_graphs"]
        for b in batches.values():          # compile every workload before timing
            with torch.no_grad():
                ce.forward(b)
        frames = du.counters["stats"]["unique_graphs"] - before
        return ({w: (lambda b=b: ce.forward(b)) for w, b in batches.items()},
                {"runs": "EagerRunner.forward, model under torch.compile(dynamic=True)"},
                {w: {"graphs_compiled": frames} for w in batches}, [])
    if variant == "full_graph":
        dec = {w: b for w, b in batches.items() if b.forward_mode is D.ForwardMode.DECODE}
        if not dec:
            raise SuiteSkip("no pure decode workload")
        full = D.DecodeGraphRunner(model, B, max_bs=max(b.batch_size for b in dec.values()),
                                   progress=False)
        full.capture()

        def fn(b):
            b.metadata_ready = False      # the full path, not the fast path
            return full.forward(b)
        return ({w: (lambda b=b: fn(b)) for w, b in dec.items()},
                {"runs": "DecodeGraphRunner.forward"}, {}, [full.backend.cleanup])
    raise ValueError(f"piecewise variant {variant!r} is declared but _build has no branch "
                     "for it: add one")


def run(B, quick: bool = False, log=print, model_args: dict | None = None,
        workloads: dict | None = None, variants=VARIANTS, rounds: int = DEFAULT_ROUNDS,
        seed: int = 0) -> list[dict]:
    from labkit import decode as D
    from labkit import piecewise as P

    variants = check_names("piecewise", variants)
    on_gpu = B.name == "cuda"
    model_args = model_args or (MODEL if on_gpu else CPU_MODEL)
    workloads = workloads or (WORKLOADS if on_gpu else CPU_WORKLOADS)
    args = D.ModelArgs(**model_args)
    max_requests = max(len(p) + n for p, n in workloads.values())
    model = D.build_model(args, max_requests=max_requests, device=B.device)
    dtype = model.output.weight.dtype
    name = f"gpt_{args.n_layer}L_d{args.dim}"
    config = {**model_args, "dtype": str(dtype).replace("torch.", "")}
    batches = make_batches(D, P, model, workloads)
    tokens = {w: b.num_tokens for w, b in batches.items()}
    repeats, warmup, calls = (5, 2, 10) if quick else (15, 3, 20)
    eager = D.EagerRunner(model)
    with torch.no_grad():
        want = {w: eager.forward(b).argmax(-1) for w, b in batches.items()}
    rows, built, cleanups = [], {}, []
    for variant in variants:                 # build (and check) everything first
        try:
            fns, cfg, extra, clean = _build(variant, D, P, B, model, batches, tokens, log)
            cleanups += clean
            agree = {}
            for w, fn in fns.items():
                with torch.no_grad():
                    agree[w] = (fn().argmax(-1) == want[w]).float().mean().item()
            built[variant] = (fns, cfg, extra, agree)
        except Exception as e:              # SuiteSkip too: a row saying why, never none
            rows += unmeasured_rows(B, "piecewise", name, config, [None], variant, e, log)
    contenders = {(v, w): fn for v, (fns, *_) in built.items() for w, fn in fns.items()}
    if contenders:
        log(f"  timing {len(contenders)} (variant, workload) pairs in {rounds} interleaved "
            "rounds")
        timed = interleave(contenders, round_timer(B, warmup=warmup, repeats=repeats,
                                                   calls=calls),
                           rounds=rounds, seed=seed, log=log)
    for variant, (fns, cfg, extra, agree) in built.items():
        for w, fn in fns.items():
            b = batches[w]
            events = profile_gpu_events(fn, B)
            busy = None if events is None else events_busy_us(events)
            ex = {"tokens": b.num_tokens, "requests": b.batch_size,
                  "greedy_agree": round(agree[w], 4), **extra.get(w, {})}
            if events is not None:
                ex["kernels"] = len(events)
            row = make_row(B, "piecewise", f"{name} · {w}", {**config, **cfg, "workload": w},
                           b.batch_size, variant, None, busy, extra=ex,
                           rounds=timed[(variant, w)])
            rows.append(row)
            log(f"  piecewise {w:22s} {variant:16s} synced {row['median_us']:8.1f} µs | back "
                f"to back {row['back_to_back_us']:8.1f} µs" +
                (f" | busy {busy:7.1f} µs, {len(events)} kernels" if busy is not None else ""))
    for clean in cleanups:
        clean()
    built.clear()
    gc.collect()
    if on_gpu:
        torch._dynamo.reset()
        torch.cuda.empty_cache()
    return rows
