"""Suite ``launch``: what one kernel launch costs, eager vs inside a graph (lesson 01).

The smallest launch-bound program: a chain of 100 dependent adds on 256 floats
(``labkit.timeline.chain``), whose kernels are shorter than the host's launch path
(Python → dispatcher → ATen → ``cudaLaunchKernel``), so the GPU waits for each launch. A
graph replays all 100 kernels from one launch. Per-kernel cost = ``median_us / 100``;
``gpu_busy_us`` shows how little of either number is the GPU computing.
"""

from __future__ import annotations

import torch

from labkit import timeline as T
from labkit.bench import make_row
from labkit.core.timing import measure_us, profile_gpu_busy_us

N_OPS, NUMEL = 100, 256


def run(B, quick: bool = False, log=print) -> list[dict]:
    repeats = 10 if quick else 50
    config = {"n_ops": N_OPS, "numel": NUMEL, "dtype": "float32"}
    steps = T.chain_steps(B, n_ops=N_OPS, numel=NUMEL)
    with torch.no_grad():
        steps.x.copy_(torch.randn(NUMEL, device=B.device))      # real data, same address
    rows = []
    for variant, fn in (("eager", steps.eager), ("graph", steps.graphed)):
        med = measure_us(fn, B, warmup=5, repeats=repeats, inner=5)
        busy = profile_gpu_busy_us(fn, B)
        rows.append(make_row(B, "launch", f"chain{N_OPS}x{NUMEL}", config, None, variant, med,
                             busy, extra={"us_per_kernel": round(med / N_OPS, 3)}))
        log(f"  launch {variant:6s} {med:9.1f} µs per chain ({med / N_OPS:.2f} µs/kernel)")
    return rows
