"""labkit: the real implementations behind the CUDA Graphs Lab.

Each module is one idea and the engine of one lesson (see README.md's course map), on top
of a shared layer; imports only go down (``tests/test_layers.py``):

    core       the shared layer: argument metadata, capture rules, timing, toy models,
               main_grad helpers, error chains, argument checks
    backend    get("auto" | "cuda" | "emulated"): one namespace that mirrors torch.cuda
    emulator   a CPU stand-in for CUDA graphs with the same observable behaviour
    timeline   01: launch cost, CPU/GPU lane timelines (measured or simulated), traces
    capture    02: the capture/replay template and StaticGraph
    inspect    02, 05, 06, 10: a captured graph read as a DAG (CUDA's debug_dump or the
               emulator's record) and drawn; DOT in and out
    guards     03: guarded graphs (Megatron's ArgMetadata) and a capture-hazard linter
    bridge     04: forward and backward graphs joined by an autograd.Function
    pipeline   05: 1F1B schedules and capture in the recorded order
    decode     06: SGLang-style decode bucketing, static buffers, the graph runner;
               10: the memory bill of many buckets (decode.memory)
    full_step  07: the whole training step as graphs
    compiled   08: torch.compile's CUDA graph trees, by hand (ReduceOverhead) and observed
    piecewise  09: the model cut at attention, pieces per token bucket, FULL/PIECEWISE dispatch
    speculative 09: the draft runner (k draft steps in one graph), verify, greedy acceptance
    bench      GPU benchmarks (python -m labkit.bench)
    checks     the exercise checkers
    demo       python -m labkit demo NN: a lesson's headline demo from a terminal

Import what you need: ``from labkit import backend``.
"""

__version__ = "0.1.0"
