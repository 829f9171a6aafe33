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
"""

from __future__ import annotations

import gc
import statistics
import time

import torch

from labkit import full_step as FS
from labkit.bench import make_row
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


def _decode_buckets(B, max_bs: int, model_args: dict, log) -> list[dict]:
    """Capture every default bucket up to ``max_bs`` with ``DecodeGraphRunner``."""
    from labkit import decode as D
    from labkit.decode.triton_attention import triton_available
    args = D.ModelArgs(**model_args)
    attentions = ["torch_native"] + (["triton"] if triton_available(B.device) else [])
    name = f"gpt_{args.n_layer}L_d{args.dim}"
    rows = []
    for attention in attentions:
        model = D.build_model(args, max_requests=max_bs, device=B.device)
        runner = D.DecodeGraphRunner(model, B, max_bs=max_bs, attention=attention,
                                     progress=False)
        runner.capture()
        rep = runner.capture_report()
        med = statistics.median(r["seconds"] for r in runner.capture_log) * 1e6
        config = {**model_args, "dtype": str(model.output.weight.dtype).replace("torch.", ""),
                  "buckets": "sglang", "graph": "decode step, one per bucket"}
        graphs = runner.backend.graphs
        # how many kernels one step launches depends on the torch version's decompositions:
        # a figure for the bench, not a budget for the unit tests
        kernels = {str(bs): len(recorded_kernels(graphs[bs], B))
                   for bs in sorted({min(graphs), max(graphs)})}
        extra = {"graphs": rep["graphs"], "capture_seconds": round(rep["capture_seconds"], 3),
                 "reserved_MiB": round(rep["pool_reserved_bytes"] / 2**20, 2),
                 "allocated_MiB": round(rep["pool_allocated_bytes"] / 2**20, 2),
                 "kernels_per_graph": kernels}
        rows.append(make_row(B, "capture", name, config, max_bs, f"decode_runner_{attention}",
                             med, extra=extra))
        log(f"  capture max_bs={max_bs} decode_runner_{attention}: {rep['graphs']} graphs in "
            f"{rep['capture_seconds']:.2f} s, pool reserved {extra['reserved_MiB']:.1f} MiB")
        runner.backend.cleanup()
        del runner, model
        gc.collect()
        if B.name == "cuda":
            torch.cuda.empty_cache()
    return rows


def run(B, quick: bool = False, log=print, batch_sizes=None, d_model: int = D_MODEL,
        n_layers: int = N_LAYERS, seq: int = SEQ, decode_max_bs: int | None = None) -> list[dict]:
    on_gpu = B.name == "cuda"
    dtype = torch.float16 if on_gpu else torch.float32
    if batch_sizes is None:
        batch_sizes = (1, 8) if quick else (1, 8, 64)
    torch.manual_seed(0)
    layers = [FS.Block(d_model, N_HEADS, seq).to(B.device, dtype).eval() for _ in range(n_layers)]
    config = {"layers": n_layers, "d_model": d_model, "heads": N_HEADS, "seq_len": seq,
              "dtype": str(dtype).replace("torch.", ""), "graph": "one layer forward"}
    rows = []
    for bs in batch_sizes:
        x = torch.randn(bs, seq, d_model, device=B.device, dtype=dtype)
        for variant, shared in (("separate_pools", False), ("shared_pool", True)):
            times, mem, keep = _capture_chain(B, layers, x, shared)
            med = statistics.median(times)
            rows.append(make_row(B, "capture", f"{n_layers}x_layer_d{d_model}", config, bs,
                                 variant, med, extra=mem))
            log(f"  capture bs={bs:3d} {variant:15s} {med:9.1f} µs/graph, pool reserved "
                f"{mem['reserved_MiB']:.2f} MiB")
            del keep
            gc.collect()
            if on_gpu:
                torch.cuda.empty_cache()
    from labkit.bench import decode as decode_suite
    if decode_max_bs is None:
        decode_max_bs = 256 if on_gpu and not quick else 4
    model_args = decode_suite.MODEL if on_gpu else decode_suite.CPU_MODEL
    rows += _decode_buckets(B, decode_max_bs, model_args, log)
    return rows
