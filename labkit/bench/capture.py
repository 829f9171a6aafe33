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
"""

from __future__ import annotations

import gc
import statistics
import time

import torch

from labkit import full_step as FS
from labkit.bench import make_row
from labkit.capture import on_side_stream

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


def run(B, quick: bool = False, log=print, batch_sizes=None, d_model: int = D_MODEL,
        n_layers: int = N_LAYERS, seq: int = SEQ) -> list[dict]:
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
    return rows
