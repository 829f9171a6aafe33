"""Where a piecewise prefill step's host time goes, on the bench's model and workloads.

    python tools/piecewise_host_profile.py [--json out.json] [--ops WORKLOAD]

For every workload of ``labkit.bench.piecewise`` it prints the host time of each part of
one ``PiecewiseGraphRunner.replay`` (:func:`labkit.piecewise.profile.host_breakdown`)
beside the step's GPU busy time; ``--ops`` adds torch.profiler's table of the host's
most expensive ops for one workload. Lesson 09 plots the JSON it writes.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the breakdowns here")
    ap.add_argument("--ops", help="profile this workload's host ops (a name of the suite's)")
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--label", default="", help="a name for this code state (e.g. 'before')")
    ap.add_argument("--attention", default="auto", choices=("torch_native", "triton", "auto"),
                    help="the runner's attention between the pieces")
    a = ap.parse_args(argv)
    from labkit import backend
    from labkit import decode as D
    from labkit import piecewise as P
    from labkit.bench import piecewise as S
    from labkit.core.timing import events_busy_us, profile_gpu_events
    from labkit.piecewise.profile import host_breakdown

    B = backend.get("auto")
    on_gpu = B.name == "cuda"
    model_args, workloads = (S.MODEL, S.WORKLOADS) if on_gpu else (S.CPU_MODEL, S.CPU_WORKLOADS)
    if a.ops is not None and a.ops not in workloads:
        ap.error(f"--ops {a.ops!r}: choose one of {', '.join(map(repr, workloads))}")
    args = D.ModelArgs(**model_args)
    max_requests = max(len(p) + n for p, n in workloads.values())
    model = D.build_model(args, max_requests=max_requests, device=B.device)
    batches = S.make_batches(D, P, model, workloads)
    runner = P.PiecewiseGraphRunner(model, B, max_num_tokens=max(b.num_tokens for b in
                                                                   batches.values()),
                                    progress=False, attention=a.attention)
    runner.capture()
    out = {"label": a.label, "attention": runner.attn.name, "device": B.device_name() if hasattr(B, "device_name") else B.name,
           "torch": torch.__version__, "workloads": {}}
    for w, b in batches.items():
        parts = host_breakdown(runner, b, a.repeats)
        events = profile_gpu_events(lambda b=b: runner.replay(b), B)
        busy = None if events is None else round(events_busy_us(events), 1)
        out["workloads"][w] = {**parts, "gpu_busy": busy,
                               "kernels": None if events is None else len(events)}
        print(f"{w:24s} " + " | ".join(f"{k} {v:7.1f}" for k, v in parts.items())
              + f" | GPU busy {busy}")
    if a.ops:
        from torch.profiler import ProfilerActivity, profile
        b = batches[a.ops]
        runner.replay(b)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(10):
                runner.replay(b)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
