"""The memory bill of many buckets, measured: lesson 10's GPU figures.

    python tools/memory_sweep.py                       on a CUDA GPU (a few minutes on an H200)
    python tools/memory_sweep.py --quick               fewer max_bs values
    python tools/memory_sweep.py --backend emulated --quick --out /tmp/m.json   (CPU, a test)

For lesson 06's decode model at two sizes (``--models``), for each ``max_bs`` and each of
SGLang's default list, powers of two and the lesson's custom list
(:func:`labkit.decode.memory.bucket_lists`), it captures one decode graph per bucket with
:func:`labkit.decode.memory.measure_bill` into one shared pool (largest first) and into a
private pool per bucket, and records the pools' reserved and allocated bytes per bucket and
in all, and the capture time. At the largest ``max_bs`` it adds the shared pool captured
smallest first, the shared pool with aliased outputs, and (in a child process started with
``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``, which must be set before CUDA starts)
the shared and private layouts with expandable segments.

Writes ``docs/benchmarks/memory.json`` and its copy ``labkit/bench/data/memory.json``,
which lesson 10 reads (so it prints the same figures on a CPU, a GPU and Colab).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))        # this checkout's labkit, not another one installed
OUTS = (ROOT / "docs" / "benchmarks" / "memory.json",
        ROOT / "labkit" / "bench" / "data" / "memory.json")

#: the two model sizes on a GPU (fp16) and on the emulator (fp32, small enough for a CPU)
MODELS = {
    "cuda": {
        "small": dict(vocab_size=1024, n_layer=8, n_head=8, n_local_heads=4, dim=256,
                      max_seq_len=256),
        "large": dict(vocab_size=32000, n_layer=4, n_head=16, n_local_heads=8, dim=1024,
                      max_seq_len=256),
    },
    "emulated": {
        "small": dict(vocab_size=128, n_layer=2, n_head=4, n_local_heads=2, dim=64,
                      intermediate_size=128, max_seq_len=64),
        "large": dict(vocab_size=8192, n_layer=2, n_head=4, n_local_heads=2, dim=128,
                      intermediate_size=256, max_seq_len=64),
    },
}
MAX_BS = {"cuda": (8, 16, 32, 64, 128, 256), "emulated": (8, 16)}
QUICK_MAX_BS = {"cuda": (16, 256), "emulated": (8,)}


def _bills(B, name, args, max_bs_values, extras: bool, expandable: bool, log) -> list[dict]:
    import torch

    from labkit.decode import ModelArgs, build_model
    from labkit.decode.memory import bucket_lists, measure_bill

    dtype = torch.float16 if B.name == "cuda" else torch.float32
    top = max(max_bs_values)
    model = build_model(ModelArgs(**args), max_requests=top, device=B.device, dtype=dtype)
    layouts = [("shared", "largest_first", False), ("private", "largest_first", False)]
    rows = []
    for max_bs in max_bs_values:
        for scheme, buckets in bucket_lists(max_bs).items():
            more = [("shared", "smallest_first", False), ("shared", "largest_first", True)]
            todo = layouts + (more if extras and max_bs == top and scheme == "sglang"
                              and not expandable else [])
            for pools, order, alias in todo:
                bill = measure_bill(model, B, buckets, pools=pools, order=order,
                                    alias_outputs=alias, model_name=name)
                row = bill.as_row() | {"max_bs": max_bs, "scheme": scheme,
                                       "model_args": args, "expandable_segments": expandable}
                if B.name == "cuda":     # did the allocator really use expandable segments?
                    row["segments_expandable"] = any(
                        s.get("is_expandable") for s in torch.cuda.memory_snapshot())
                rows.append(row)
                log(f"  {name:5s} max_bs {max_bs:3d} {scheme:6s} {bill.label:44s} "
                    f"{len(buckets):3d} graphs  reserved {bill.reserved_bytes / 2**20:8.2f} MiB"
                    f"  allocated {bill.allocated_bytes / 2**20:7.2f} MiB  "
                    f"{bill.capture_seconds:6.2f} s")
                if B.name == "cuda":
                    torch.cuda.empty_cache()
    return rows


def measure(backend: str, quick: bool, models: list[str], expandable: bool, log=print) -> dict:
    import torch

    from labkit import backend as backends
    from labkit.core.timing import device_name

    B = backends.get(backend)
    max_bs_values = (QUICK_MAX_BS if quick else MAX_BS)[B.name]
    rows = []
    for name in models:
        args = MODELS[B.name][name]
        if expandable:   # only the largest max_bs, SGLang's list: what expandable changes
            max_bs_values = (max(max_bs_values),)
        rows += _bills(B, name, args, max_bs_values, extras=True, expandable=expandable, log=log)
    info = {"device": device_name(B), "torch": torch.__version__, "backend": B.name,
            "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "quick": quick}
    if B.name == "cuda":
        info["allocator_conf"] = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    return {"info": info, "bills": rows}


def _child_expandable(args, log) -> dict | None:
    """Run the expandable-segments variant in a child process (the allocator reads
    ``PYTORCH_CUDA_ALLOC_CONF`` once, when CUDA starts)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "expandable.json"
        env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True")
        cmd = [sys.executable, __file__, "--child-expandable", "--out", str(out),
               "--backend", args.backend, "--models", *args.models]
        cmd += ["--quick"] if args.quick else []
        log("[expandable_segments:True, in a child process]")
        p = subprocess.run(cmd, env=env)
        if p.returncode or not out.exists():
            log(f"  the expandable-segments child failed (exit {p.returncode}): not stored")
            return None
        return json.loads(out.read_text())


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python tools/memory_sweep.py",
                                description="Graph pool memory as the bucket list grows "
                                            "(lesson 10); writes docs/benchmarks/memory.json "
                                            "and labkit/bench/data/memory.json.")
    p.add_argument("--backend", choices=("cuda", "emulated"), default="cuda",
                   help="cuda (default: the figures lesson 10 quotes) or emulated (a test)")
    p.add_argument("--quick", action="store_true", help="fewer max_bs values")
    p.add_argument("--models", nargs="+", choices=("small", "large"), default=["small", "large"],
                   help="model sizes (default: both)")
    p.add_argument("--out", type=Path, default=None, metavar="FILE",
                   help="write only this file (default: docs/benchmarks/memory.json and "
                        "labkit/bench/data/memory.json)")
    p.add_argument("--no-expandable", action="store_true",
                   help="skip the expandable-segments child process")
    p.add_argument("--child-expandable", action="store_true", help=argparse.SUPPRESS)
    return p


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    import torch

    if args.backend == "cuda" and not torch.cuda.is_available():
        print(f"tools/memory_sweep.py measures a GPU's graph pools and needs CUDA; "
              f"torch.cuda.is_available() is False here (torch {torch.__version__}). Nothing "
              "was measured. On a CPU, --backend emulated --quick --out FILE runs the "
              "sweep on labkit's emulator (a test of the code, not GPU figures).",
              file=sys.stderr)
        return 2
    if args.out is not None and args.out.is_dir():
        print(f"--out {args.out} is a folder: give a file name, e.g. {args.out / 'memory.json'}",
              file=sys.stderr)
        return 2
    data = measure(args.backend, args.quick, args.models, expandable=args.child_expandable)
    if args.child_expandable:
        data["info"]["expandable_segments"] = True
    elif not args.no_expandable and args.backend == "cuda":
        child = _child_expandable(args, print)
        if child is not None:
            data["bills"] += child["bills"]
            data["info"]["expandable_child"] = child["info"]
    text = json.dumps(data, indent=1) + "\n"
    for path in ([args.out] if args.out is not None else OUTS):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        print("wrote", path)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        sys.exit(130)
