"""Suite ``capture``: what capturing costs, in time and in pool memory (lesson 05).

Six transformer layers (``labkit.full_step.Block``, d=256, fp16 on a GPU) are captured
one graph each, as a chain: graph *i* reads graph *i-1*'s static output. Two ways:

* ``separate_pools``: every graph gets its own private pool. Each keeps its own
  intermediate blocks reserved forever, even those freed before its capture ended;
* ``shared_pool``: all six capture into one pool, in the order they will replay. A block
  one capture freed is handed to the next, so the pool holds little more than the
  largest graph's working set plus the live outputs.

``median_us`` is the median host time of one capture (``with B.graph(...)`` including
its synchronizations); ``extra`` has the pool memory after all six captures
(``reserved_MiB``: what the pool holds on the device, ``allocated_MiB``: live blocks).

Then lesson 06's decode runner at serving scale: every SGLang bucket of ``max_bs=256``
(36 graphs) for the decode suite's model, captured largest first into one pool, once per
attention backend (``decode_runner_<attention>``). ``median_us`` is then the median time
per bucket (two warm-ups + capture), ``extra`` the totals: graphs, seconds, pool memory,
and the kernels one step launches in the smallest and the largest bucket's graph.

Every (variant, batch size) is captured once per round, in interleaved rounds
(:mod:`labkit.bench.rounds`): ``median_us`` is the median over rounds, ``extra.rounds``
each round's figure; the pool memory, which does not vary, is the first round's.
"""

from __future__ import annotations

import gc
import statistics
import time

import torch

from labkit import full_step as FS
from labkit.bench import make_row
from labkit.bench.rounds import DEFAULT_ROUNDS, interleave
from labkit.bench.variants import declared
from labkit.bench.variants import variant as declared_variant
from labkit.capture import on_side_stream, recorded_kernels

N_LAYERS, D_MODEL, N_HEADS, SEQ = 6, 256, 4, 64


def _capture_chain(B, layers, x, shared: bool) -> tuple[list[float], dict, list]:
    """Capture each layer's forward into its own graph; return (capture µs per graph,
    pool stats, graphs and outputs to keep alive)."""
    with torch.no_grad(), on_side_stream(B):          # warm up: lazy init off the capture
        h = x
        for layer in layers:
            h = layer(h)
    B.synchronize()
    pool = B.graph_pool_handle() if shared else None
    times, keep, pools, h = [], [], [], x
    with torch.no_grad():
        for layer in layers:
            g = B.CUDAGraph()
            t0 = time.perf_counter()
            with B.graph(g, pool=pool):
                out = layer(h)
            B.synchronize()
            times.append((time.perf_counter() - t0) * 1e6)
            keep.append((g, out))
            pools.append(g.pool())
            h = out
    for g, _ in keep:                                   # replay in capture order: valid
        g.replay()
    B.synchronize()
    uniq = list(dict.fromkeys(tuple(p) for p in pools))
    stats = [B.pool_stats(p) for p in uniq]
    mem = {"graphs": len(layers), "pools": len(uniq),
           "reserved_MiB": round(sum(st["reserved_bytes"] for st in stats) / 2**20, 2),
           "allocated_MiB": round(sum(st["allocated_bytes"] for st in stats) / 2**20, 2)}
    return times, mem, keep


def _decode_capture(B, max_bs: int, model_args: dict, attention: str) -> dict:
    """Build the decode model and capture every default bucket up to ``max_bs`` with
    ``DecodeGraphRunner``; return the figures of that capture (and free it)."""
    from labkit import decode as D
    args = D.ModelArgs(**model_args)
    model = D.build_model(args, max_requests=max_bs, device=B.device)
    runner = D.DecodeGraphRunner(model, B, max_bs=max_bs, attention=attention, progress=False)
    runner.capture()
    rep = runner.capture_report()
    graphs = runner.backend.graphs
    # how many kernels one step launches depends on the torch version's decompositions:
    # a figure for the bench, not a budget for the unit tests
    kernels = {str(bs): len(recorded_kernels(graphs[bs], B))
               for bs in sorted({min(graphs), max(graphs)})}
    out = {"per_bucket_us": statistics.median(r["seconds"] for r in runner.capture_log) * 1e6,
           "dtype": str(model.output.weight.dtype).replace("torch.", ""),
           "extra": {"graphs": rep["graphs"],
                     "capture_seconds": round(rep["capture_seconds"], 3),
                     "reserved_MiB": round(rep["pool_reserved_bytes"] / 2**20, 2),
                     "allocated_MiB": round(rep["pool_allocated_bytes"] / 2**20, 2),
                     "kernels_per_graph": kernels}}
    runner.backend.cleanup()
    del runner, model
    gc.collect()
    if B.name == "cuda":
        torch.cuda.empty_cache()
    return out


def run(B, quick: bool = False, log=print, batch_sizes=None, d_model: int = D_MODEL,
        n_layers: int = N_LAYERS, seq: int = SEQ, decode_max_bs: int | None = None,
        rounds: int = DEFAULT_ROUNDS, seed: int = 0) -> list[dict]:
    from labkit.bench import decode as decode_suite
    from labkit.decode.triton_attention import triton_available

    on_gpu = B.name == "cuda"
    dtype = torch.float16 if on_gpu else torch.float32
    if batch_sizes is None:
        batch_sizes = (1, 8) if quick else (1, 8, 64)
    if decode_max_bs is None:
        decode_max_bs = 256 if on_gpu and not quick else 4
    model_args = decode_suite.MODEL if on_gpu else decode_suite.CPU_MODEL
    torch.manual_seed(0)
    layers = [FS.Block(d_model, N_HEADS, seq).to(B.device, dtype).eval() for _ in range(n_layers)]
    config = {"layers": n_layers, "d_model": d_model, "heads": N_HEADS, "seq_len": seq,
              "dtype": str(dtype).replace("torch.", ""), "graph": "one layer forward"}
    inputs = {bs: torch.randn(bs, seq, d_model, device=B.device, dtype=dtype)
              for bs in batch_sizes}
    first: dict = {}                          # each contender's first-round figures

    def chain(bs, shared):
        times, mem, keep = _capture_chain(B, layers, inputs[bs], shared)
        del keep
        gc.collect()
        if on_gpu:
            torch.cuda.empty_cache()
        return {"median_us": statistics.median(times), "mem": mem}

    def decode(attention):
        got = _decode_capture(B, decode_max_bs, model_args, attention)
        return {"median_us": got["per_bucket_us"], "got": got,
                "capture_seconds": got["extra"]["capture_seconds"]}

    contenders = {}
    pools = [v for v in declared("capture") if v.option("shared") is not None]
    for bs in batch_sizes:
        for v in pools:
            contenders[(v.name, bs)] = (lambda bs=bs, shared=v.option("shared"):
                                        chain(bs, shared))
    for v in declared("capture"):
        attention = v.option("attention")
        if attention is None or (attention == "triton" and not triton_available(B.device)):
            continue
        contenders[(v.name, decode_max_bs)] = (lambda attention=attention: decode(attention))

    def time_one(fn):
        out = fn()
        first.setdefault(fn, out)
        return {k: v for k, v in out.items() if isinstance(v, (int, float))}

    timed = interleave(contenders, time_one, rounds=rounds, seed=seed, log=log)
    rows = []
    for (variant, bs), fn in contenders.items():
        got = first[fn]
        if declared_variant("capture", variant).option("attention"):
            cfg = {**model_args, "dtype": got["got"]["dtype"], "buckets": "sglang",
                   "graph": "decode step, one per bucket"}
            name = f"gpt_{model_args['n_layer']}L_d{model_args['dim']}"
            row = make_row(B, "capture", name, cfg, bs, variant, None,
                           extra=dict(got["got"]["extra"]), rounds=timed[(variant, bs)])
            ex = row["extra"]
            log(f"  capture max_bs={bs} {variant}: {ex['graphs']} graphs, median "
                f"{row['median_us'] / 1e3:.1f} ms per bucket, pool reserved "
                f"{ex['reserved_MiB']:.1f} MiB")
        else:
            row = make_row(B, "capture", f"{n_layers}x_layer_d{d_model}", config, bs, variant,
                           None, extra=dict(got["mem"]), rounds=timed[(variant, bs)])
            log(f"  capture bs={bs:3d} {variant:15s} {row['median_us']:9.1f} µs/graph, pool "
                f"reserved {got['mem']['reserved_MiB']:.2f} MiB")
        rows.append(row)
    return rows
