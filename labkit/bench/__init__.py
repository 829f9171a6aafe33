"""labkit.bench — GPU benchmarks: eager vs CUDA graphs vs torch.compile.

    python -m labkit.bench                     all suites (needs a CUDA GPU)
    python -m labkit.bench train decode        some of them
    python -m labkit.bench --render            re-render docs/benchmarks/ from results.json

Six suites, one module each, each the measured counterpart of a lesson:

    launch    per-kernel cost, eager vs graph: a chain of 100 tiny adds      (lesson 01)
    decode    labkit.decode's runner vs eager vs torch.compile, bs 1/8/64    (lesson 06)
    serve     the serving loop: eager, graphed, graphed and overlapped     (lesson 06)
    train     eager vs per-layer graphs vs the whole step as one graph       (04, 05, 07)
    capture   time and pool memory per captured graph, shared vs separate    (lesson 05)
    piecewise prefill/mixed batches: eager vs piecewise graphs vs compile      (lesson 09)

Every number is one row (see :mod:`labkit.bench.report` for the schema), appended to
``docs/benchmarks/results.json`` and rendered to ``docs/benchmarks/README.md`` with a PNG
plot per suite. How things are timed, and why, is in :mod:`labkit.core.timing`
(:mod:`labkit.core.timing` is how the suites time).

On a machine without a GPU the command says so and exits (code 0): the CPU emulator
reproduces what graphs do, not how fast a GPU runs them, so it has nothing to measure
here. The suite functions still accept the emulated backend, with tiny configurations,
so that tests can exercise the benchmark code itself on a CPU.
"""

from __future__ import annotations

import datetime as _dt
import importlib

# torch is imported where it is used, so that `python -m labkit.bench --render` (and its
# error messages) do not wait for it

__all__ = ["SUITES", "make_row", "skipped_row", "unmeasured_rows", "run_suite", "SuiteSkip"]

SUITES = ("launch", "decode", "serve", "train", "capture", "piecewise")


class SuiteSkip(Exception):
    """Raised by a variant that cannot run here; becomes a row with a ``note``."""


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def make_row(B, suite: str, config_name: str, config: dict, batch_size: int | None,
             variant: str, median_us: float | None, gpu_busy_us: float | None = None,
             note: str | None = None, extra: dict | None = None,
             back_to_back_us: float | None = None) -> dict:
    """One result row in the schema of :mod:`labkit.bench.report`. ``median_us`` is the
    synced per-call time; ``back_to_back_us``, where a suite measures it, the per-call time
    of calls issued back to back (:func:`labkit.core.timing.back_to_back_us`)."""
    row = {"suite": suite, "config_name": config_name, "config": dict(config),
           "batch_size": batch_size, "variant": variant,
           "median_us": None if median_us is None else round(float(median_us), 3)}
    if back_to_back_us is not None:
        row["back_to_back_us"] = round(float(back_to_back_us), 3)
    if gpu_busy_us is not None:
        row["gpu_busy_us"] = round(float(gpu_busy_us), 3)
    import torch

    from labkit.core.timing import device_name

    row.update(device=device_name(B), torch=torch.__version__, date=_now())
    if note:
        row["note"] = note
    if extra:
        row["extra"] = extra
    return row


def skipped_row(B, suite, config_name, config, batch_size, variant, why: str) -> dict:
    """A row saying a variant was not measured, and why."""
    return make_row(B, suite, config_name, config, batch_size, variant, None,
                    note=f"skipped: {why}")


def unmeasured_rows(B, suite: str, config_name: str, config: dict, batch_sizes, variant: str,
                    exc: Exception, log=print) -> list[dict]:
    """The rows of a variant that did not run, one per batch size, and the line that says
    why: ``skipped`` for a :class:`SuiteSkip`, ``FAILED`` with the error's first line for
    anything else (one broken variant must not lose the other variants' numbers)."""
    if isinstance(exc, SuiteSkip):
        why, word = str(exc), "skipped"
    else:
        first = (str(exc).splitlines() or [""])[0][:200]
        why, word = f"{type(exc).__name__}: {first}", "FAILED"
    log(f"  {suite} {variant:31s} {word}: {why}")
    return [skipped_row(B, suite, config_name, config, bs, variant, why) for bs in batch_sizes]


def run_suite(name: str, B, quick: bool = False, log=print, **kw) -> list[dict]:
    """Run one suite on backend ``B`` and return its rows (nothing is written).
    ``kw`` goes to the suite's ``run`` (e.g. ``batch_sizes``, ``cfg``, ``compile_mode``)."""
    if name not in SUITES:
        raise ValueError(f"unknown suite {name!r}: choose from {', '.join(SUITES)}")
    module = importlib.import_module(f"labkit.bench.{name}")
    return module.run(B, quick=quick, log=log, **kw)
