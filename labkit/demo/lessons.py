"""The demos, one per lesson: each runs that lesson's key demonstration with
labkit's own engines, prints what it measured and returns its picture.

This module is the registry (``DEMOS``, number -> ``Demo``); the demos themselves live in
``first_graphs`` (lessons 00-03), ``training`` (04, 05, 07) and ``serving`` (06, 08, 09),
their shared helpers in ``common``.
"""

from __future__ import annotations

from labkit.demo.common import Demo
from labkit.demo.first_graphs import _demo_00, _demo_01, _demo_02, _demo_03
from labkit.demo.serving import _demo_06, _demo_08, _demo_09
from labkit.demo.training import _demo_04, _demo_05, _demo_07

__all__ = ["Demo", "DEMOS"]


DEMOS: dict[str, Demo] = {d.number: d for d in (
    Demo("00", "start here",
         "which backend runs; a first graph: copy_ new data in, replay(), read the static "
         "output (bars: x and 2x+1 for two replays)", _demo_00),
    Demo("01", "launch-bound timeline",
         "measured µs per kernel eager vs graph; the CPU/GPU timeline of 20 tiny adds, eager "
         "vs one graph (profiled on a GPU, simulated from this CPU's launch cost without one)",
         _demo_01),
    Demo("02", "raw capture and replay",
         "an MLP captured with warm-up + capture, the kernels it recorded, replays equal to "
         "eager, and eager forward vs replay time (bars)", _demo_02),
    Demo("03", "constraint pitfalls",
         "capture by hand stops at the first hazard; lint_capture finds all 10 in one run "
         "(chart: each hazard, its line and severity)", _demo_03),
    Demo("04", "fwd/bwd autograd bridge",
         "gradient accumulation through graphed layers: labkit's bridge equals eager, "
         "without the wgrad clone (and torch's make_graphed_callables) it does not (bars)",
         _demo_04),
    Demo("05", "1F1B ordered capture",
         "GPipe vs 1F1B schedule charts (simulated), microbatches in flight, and real "
         "training: graphs created in recorded order equal eager, other orders do not",
         _demo_05),
    Demo("06", "decode bucketing",
         "a serving loop eager vs bucketed decode graphs: tokens/s, step times, identical "
         "tokens (lesson 06's serving chart)", _demo_06),
    Demo("07", "whole-step capture",
         "a training step as two graphs (fwd+bwd of every microbatch, optimizer): losses "
         "equal eager step by step, and ms per step eager vs graphs", _demo_07),
    Demo("08", "torch.compile and CUDA graph trees",
         "reduce-overhead's life cycle (warm-up, record, replay) by hand on any backend and, "
         "on a GPU, torch's own, with a skip verdict; µs per call (bars)", _demo_08),
    Demo("09", "piecewise graphs and the draft runner",
         "prefill, mixed and decode batches dispatched to piecewise or full graphs, equal to "
         "eager, µs per forward (bars); speculative decoding equal to plain greedy", _demo_09),
)}
