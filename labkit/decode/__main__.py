"""``python -m labkit.decode``: serve a synthetic workload eagerly and with decode graphs.

Prints the capture report, both runs' summaries, whether the tokens match, and what other
bucket schemes would have cost on the batch sizes this run saw. ``--json PATH`` writes it
all (plus per-step latencies) for plotting. On a GPU::

    python -m labkit.decode --backend cuda --config small --max-bs 64 --requests 256
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os

import torch

from labkit import backend
from labkit.core.validate import int_at_least

from . import CONFIGS, DecodeGraphRunner, build_model, explore_buckets, serve, synthetic_workload
from .buckets import DECODE_SCHEMES


def _positive_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(v) or v <= 0:
        raise argparse.ArgumentTypeError(f"must be a number > 0 (arrivals per step), got {text}")
    return v


def _buckets(text: str):
    """A scheme name or a comma-separated list of batch sizes (a single size is a list)."""
    if text in DECODE_SCHEMES:
        return text
    parts = [x.strip() for x in text.split(",")]
    if not all(x.isdigit() and int(x) >= 1 for x in parts):
        raise argparse.ArgumentTypeError(f"{text!r}: use {', '.join(DECODE_SCHEMES)} or batch "
                                         "sizes >= 1 separated by commas, e.g. 1,2,4,8")
    return sorted({int(x) for x in parts})


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m labkit.decode", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", default="auto", choices=backend.NAMES)
    ap.add_argument("--config", default="tiny", choices=list(CONFIGS), help="model config")
    ap.add_argument("--max-bs", type=int_at_least(1), default=16,
                    help="largest batch to capture (also the model's request slots)")
    ap.add_argument("--buckets", type=_buckets, default="sglang",
                    help=f"{' | '.join(DECODE_SCHEMES)} | 1,2,4,... (sizes <= --max-bs)")
    ap.add_argument("--requests", type=int_at_least(1), default=64)
    ap.add_argument("--rate", type=_positive_float, default=2.0, help="arrivals per decode step")
    ap.add_argument("--dtype", default=None, choices=["float32", "float16", "bfloat16"])
    ap.add_argument("--seed", type=int_at_least(0), default=0)
    ap.add_argument("--json", default=None, help="write results here")
    return ap


def main(argv=None) -> dict:
    ap = _parser()
    a = ap.parse_args(argv)
    if isinstance(a.buckets, list) and a.buckets[-1] > a.max_bs:
        ap.error(f"argument --buckets: bucket {a.buckets[-1]} > --max-bs {a.max_bs}")
    if a.json:
        folder = os.path.dirname(os.path.abspath(a.json))
        if not os.path.isdir(folder):
            ap.error(f"argument --json: folder {folder} does not exist")
    try:
        B = backend.get(a.backend)
    except RuntimeError as e:
        ap.error(f"argument --backend: {e}")
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")

    dtype = getattr(torch, a.dtype) if a.dtype else None
    model = build_model(a.config, max_requests=a.max_bs, device=B.device, dtype=dtype,
                        seed=a.seed)
    runner = DecodeGraphRunner(model, B, max_bs=a.max_bs, buckets=a.buckets)
    runner.capture()
    cap = runner.capture_report()
    wl = synthetic_workload(a.requests, arrival_rate=a.rate, vocab_size=model.args.vocab_size,
                            max_seq_len=model.args.max_seq_len, seed=a.seed)
    serve(model, wl[: min(8, len(wl))])            # warm the eager path too
    eager = serve(model, wl)
    graphed = serve(model, wl, runner=runner)
    mismatched = [rid for rid in eager.tokens if eager.tokens[rid] != graphed.tokens[rid]]
    explorer = [explore_buckets(a.max_bs, graphed.decode_batch_size, s).as_row()
                for s in ("sglang", "every", "pow2")]
    out = {
        "backend": B.name, "device": str(B.device), "config": a.config,
        "dtype": str(model.output.weight.dtype), "buckets": runner.buckets,
        "capture": {k: v for k, v in cap.items() if k != "per_bucket"},
        "capture_per_bucket": cap["per_bucket"],
        "eager": eager.summary(), "graphed": graphed.summary(),
        "runner_stats": graphed.runner_stats,
        "mismatched_requests": mismatched, "bucket_explorer": explorer,
        "eager_step_ms": [1e3 * t for t in eager.decode_latency_s],
        "graphed_step_ms": [1e3 * t for t in graphed.decode_latency_s],
        "step_batch_size": graphed.decode_batch_size,
    }
    print(f"backend {B.name} ({B.device}), model {a.config} {out['dtype']}, "
          f"{len(runner.buckets)} graphs: {runner.buckets}")
    print(f"capture: {cap['capture_seconds']:.2f} s, pool reserved "
          f"{cap['pool_reserved_bytes'] / 2**20:.1f} MiB")
    for name in ("eager", "graphed"):
        print(f"{name:8s}", out[name])
    print("speedup (decode tokens/s):",
          round(out["graphed"]["decode_tokens_per_s"] / max(out["eager"]["decode_tokens_per_s"],
                                                            1e-9), 2))
    print("tokens identical:", not mismatched, f"({len(mismatched)} requests differ)"
          if mismatched else "")
    for row in explorer:
        print("  ", row)
    if B.is_emulated:
        print("note: emulated backend — timings are CPU timings, not a GPU's.")
    if a.json:
        try:
            with open(a.json, "w") as f:
                json.dump(out, f, indent=1)
        except OSError as e:
            ap.exit(1, f"{ap.prog}: error: cannot write --json {a.json}: {e.strerror}\n")
    return out


if __name__ == "__main__":
    main()
