"""``python -m labkit.speculative``: tokens/s of plain vs speculative greedy decoding.

For each batch size and target damping it prints :func:`~labkit.speculative.measure.measure`'s
rows (plain greedy and speculative decoding, eager and graphed, one draft per noise level,
medians over ``--rounds`` interleaved rounds), the verdict of each speculative row against
plain greedy decoding (:func:`~labkit.speculative.measure.verdicts`) and
:func:`~labkit.speculative.measure.graph_savings`
(what the graphs save in each part of a round). ``--json PATH`` writes every row. On a GPU::

    python -m labkit.speculative --backend cuda --config small --batch-size 1 8 \\
        --num-steps 4 --max-new-tokens 128 --noises 0 0.05 0.2 0.5 --tail-scale 1 0.3
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os

import torch

from labkit import backend
from labkit.core.rounds import DEFAULT_ROUNDS
from labkit.core.timing import device_name
from labkit.core.validate import int_at_least
from labkit.decode import CONFIGS

from .measure import PARTS, format_table, graph_savings, measure, verdicts

COLUMNS = ["batch", "tail_scale", "method", "mode", "draft", "acceptance_%", "tokens_per_round",
           "tokens_per_s", "vs_greedy", "round_ms", *(f"{p}_ms" for p in PARTS), "same_tokens"]


def _non_negative(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(v) or v < 0:
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return v


def _backend_label(B) -> str:
    return f"{device_name(B)} ({B.name})"


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m labkit.speculative", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", default="auto", choices=backend.NAMES)
    ap.add_argument("--config", default="tiny", choices=list(CONFIGS), help="target config")
    ap.add_argument("--batch-size", type=int_at_least(1), nargs="+", default=[4])
    ap.add_argument("--num-steps", type=int_at_least(1), default=4,
                    help="draft tokens per round (k)")
    ap.add_argument("--max-new-tokens", type=int_at_least(1), default=32)
    ap.add_argument("--prompt-len", type=int_at_least(1), default=8)
    ap.add_argument("--draft-layers", type=int_at_least(1), default=1,
                    help="blocks of the target the draft keeps")
    ap.add_argument("--noises", type=_non_negative, nargs="+", default=[0.0, 0.1, 0.3],
                    help="relative weight noise of each draft")
    ap.add_argument("--tail-scale", type=_non_negative, nargs="+", default=[1.0],
                    help="damping of the target's blocks after the draft's (1: none)")
    ap.add_argument("--rounds", type=int_at_least(1), default=DEFAULT_ROUNDS,
                    help=f"interleaved rounds (default {DEFAULT_ROUNDS}; a verdict wants 5)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    ap.add_argument("--seed", type=int_at_least(0), default=0)
    ap.add_argument("--json", default=None, help="write every row here")
    return ap


def main(argv=None) -> list[dict]:
    ap = _parser()
    a = ap.parse_args(argv)
    if a.json and not os.path.isdir(os.path.dirname(os.path.abspath(a.json))):
        ap.error(f"argument --json: folder {os.path.dirname(os.path.abspath(a.json))} "
                 "does not exist")
    layers, width = CONFIGS[a.config].n_layer, CONFIGS[a.config].max_seq_len
    if a.draft_layers > layers:
        ap.error(f"argument --draft-layers: the {a.config} target has {layers} blocks")
    if a.num_steps > width - 2:
        ap.error(f"argument --num-steps: {a.num_steps} draft tokens do not fit the {a.config} "
                 f"target's max_seq_len={width} (a round drafts up to position p + k and "
                 f"verifies k + 1 tokens): use 1..{width - 2}")
    need = a.prompt_len + a.max_new_tokens - 1 + a.num_steps
    if need > width:
        ap.error(f"--prompt-len {a.prompt_len} + --max-new-tokens {a.max_new_tokens} - 1 + "
                 f"--num-steps {a.num_steps} = {need} positions, more than the {a.config} "
                 f"target's max_seq_len={width}: lower one of them")
    try:
        B = backend.get(a.backend)
    except RuntimeError as e:
        ap.error(f"argument --backend: {e}")
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    print(f"{_backend_label(B)}, target {a.config} {a.dtype}, k={a.num_steps}, "
          f"{a.max_new_tokens} new tokens per request, draft = {a.draft_layers} of {layers} "
          "blocks", flush=True)
    rows = []
    for bs in a.batch_size:
        for tail in a.tail_scale:
            part = measure(B, a.config, batch_size=bs, num_steps=a.num_steps,
                           max_new_tokens=a.max_new_tokens, prompt_len=a.prompt_len,
                           draft_layers=a.draft_layers, noises=a.noises, tail_scale=tail,
                           rounds=a.rounds, dtype=getattr(torch, a.dtype), seed=a.seed)
            # Printed now: a run cut short (a time limit) still shows what it measured.
            print(format_table(part, COLUMNS), flush=True)
            for r, v in verdicts(part):
                print(f"{r['mode']} {r['draft']}: {v.text()}", flush=True)
            rows += part
    print()
    print("what the graphs save per round (ms):")
    print(format_table(graph_savings(rows)))
    if B.is_emulated:
        print("note: emulated backend — timings are CPU timings, not a GPU's.")
    if a.json:
        try:
            with open(a.json, "w") as f:
                json.dump({"rows": rows, "graph_savings": graph_savings(rows)}, f, indent=1)
        except OSError as e:
            ap.exit(1, f"{ap.prog}: error: cannot write --json {a.json}: {e.strerror}\n")
    return rows


if __name__ == "__main__":
    main()
