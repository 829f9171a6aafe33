"""Moved to :mod:`labkit.bench.emulator_cost` (a benchmark, not part of the emulator).

This name stays until ``tests/test_emulator.py`` and ``tests/test_misuse_backend.py``
import the new one; ``python -m labkit.emulator.cost`` still runs it.
"""

from labkit.bench.emulator_cost import main, replay_vs_eager

__all__ = ["replay_vs_eager", "main"]

if __name__ == "__main__":
    raise SystemExit(main(prog="python -m labkit.emulator.cost"))
