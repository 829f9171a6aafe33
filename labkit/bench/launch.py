"""Suite ``launch``: what one kernel launch costs, eager vs inside a graph (lesson 01).

The smallest launch-bound program: a chain of 100 dependent adds on 256 floats
(``labkit.timeline.chain``), whose kernels are shorter than the host's launch path
(Python → dispatcher → ATen → ``cudaLaunchKernel``), so the GPU waits for each launch. A
graph replays all 100 kernels from one launch. Per-kernel cost = ``median_us / 100``;
``gpu_busy_us`` shows how little of either number is the GPU computing. Both variants are
timed in interleaved rounds (:mod:`labkit.bench.rounds`), synced and back to back.
"""

from __future__ import annotations

import torch

from labkit import timeline as T
from labkit.bench import make_row, round_timer
from labkit.bench.rounds import DEFAULT_ROUNDS, interleave
from labkit.core.timing import profile_gpu_busy_us

N_OPS, NUMEL = 100, 256


def run(B, quick: bool = False, log=print, rounds: int = DEFAULT_ROUNDS,
        seed: int = 0) -> list[dict]:
    repeats = 10 if quick else 30
    config = {"n_ops": N_OPS, "numel": NUMEL, "dtype": "float32"}
    steps = T.chain_steps(B, n_ops=N_OPS, numel=NUMEL)
    with torch.no_grad():
        steps.x.copy_(torch.randn(NUMEL, device=B.device))      # real data, same address
    fns = {"eager": steps.eager, "graph": steps.graphed}
    timed = interleave(fns, round_timer(B, warmup=3, repeats=repeats, calls=20),
                       rounds=rounds, seed=seed)
    rows = []
    for variant, fn in fns.items():
        busy = profile_gpu_busy_us(fn, B)
        row = make_row(B, "launch", f"chain{N_OPS}x{NUMEL}", config, None, variant, None,
                       busy, rounds=timed[variant])
        row["extra"]["us_per_kernel"] = round(row["median_us"] / N_OPS, 3)
        rows.append(row)
        log(f"  launch {variant:6s} {row['median_us']:9.1f} µs per chain "
            f"({row['median_us'] / N_OPS:.2f} µs/kernel), back to back "
            f"{row['back_to_back_us']:9.1f} µs")
    return rows
