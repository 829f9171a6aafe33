"""labkit: the real implementations behind the CUDA Graphs Lab.

Each module is one idea and the engine of one lesson (see README.md's course map):

    backend    get("auto" | "cuda" | "emulated"): one namespace that mirrors torch.cuda
    emulator   a CPU stand-in for CUDA graphs with the same observable behaviour

Import what you need: ``from labkit import backend``.
"""

__version__ = "0.1.0"
