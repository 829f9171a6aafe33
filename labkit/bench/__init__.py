"""labkit.bench — GPU benchmarks: eager vs CUDA graphs vs torch.compile.

    python -m labkit.bench                     all suites (needs a CUDA GPU)
    python -m labkit.bench train decode        some of them
    python -m labkit.bench --render            re-render docs/benchmarks/ from results.json

Seven suites, one module each, each the measured counterpart of a lesson:

    launch    per-kernel cost, eager vs graph: a chain of 100 tiny adds      (lesson 01)
    decode    labkit.decode's runner vs eager vs torch.compile, bs 1/8/64    (lesson 06)
    serve     the serving loop: eager, graphed, graphed and overlapped     (lesson 06)
    train     eager vs per-layer graphs vs the whole step as one graph       (04, 05, 07)
    capture   time and pool memory per captured graph, shared vs separate    (lesson 05)
    piecewise prefill/mixed batches: eager vs piecewise graphs vs compile      (lesson 09)
    tp        decode split over 2 GPUs (NCCL all-reduces in the graph) vs 1   (lesson 10)

Every suite builds all its variants first and then times them in interleaved rounds
(:mod:`labkit.bench.rounds`, ``--rounds N``, 5 by default), so that a drifting host hits
every variant alike; :mod:`labkit.bench.verdicts` turns the rounds into the sentences the
lessons quote ("faster" only when one side wins 4 of 5 rounds).

Every variant a suite times is declared once, with what it runs, in
:mod:`labkit.bench.variants`; a row of an undeclared one is refused.

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
import statistics

from labkit.bench.rows import Row

# torch is imported where it is used, so that `python -m labkit.bench --render` (and its
# error messages) do not wait for it

__all__ = ["SUITES", "make_row", "skipped_row", "unmeasured_rows", "run_suite", "SuiteSkip",
           "round_timer", "cudagraph_skips"]

SUITES = ("launch", "decode", "serve", "train", "capture", "piecewise", "tp")


class SuiteSkip(Exception):
    """Raised by a variant that cannot run here; becomes a row with a ``note``."""


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


# One id per process: rows of the same run were timed in the same interleaved rounds, and
# only those are paired into verdicts (labkit.bench.verdicts).
RUN_ID = _now()


def make_row(B, suite: str, config_name: str, config: dict, batch_size: int | None,
             variant: str, median_us: float | None, gpu_busy_us: float | None = None,
             note: str | None = None, extra: dict | None = None,
             back_to_back_us: float | None = None, rounds: dict | None = None) -> dict:
    """One result row (:class:`labkit.bench.rows.Row`) as the dict ``results.json`` holds;
    :class:`~labkit.bench.variants.UndeclaredVariant` if ``variant`` is not declared for
    ``suite`` in :mod:`labkit.bench.variants`. ``median_us`` is the
    synced per-call time; ``back_to_back_us``, where a suite measures it, the per-call time
    of calls issued back to back (:func:`labkit.core.timing.back_to_back_us`).

    ``rounds`` is the row's entry of :func:`labkit.bench.rounds.interleave` (method → one
    value per round). Then ``median_us`` and ``back_to_back_us``, where None, become the
    medians over rounds, ``extra.rounds`` keeps the values, and ``extra.host_us`` (if
    timed) the median host time."""
    if rounds:
        extra = dict(extra or {})
        kept = {m: [round(float(v), 3) for v in rounds[m]]
                for m in ("median_us", "back_to_back_us") if m in rounds}
        if median_us is None and "median_us" in kept:
            median_us = statistics.median(kept["median_us"])
        if back_to_back_us is None and "back_to_back_us" in kept:
            back_to_back_us = statistics.median(kept["back_to_back_us"])
        if "host_us" in rounds and "host_us" not in extra:
            extra["host_us"] = round(statistics.median(rounds["host_us"]), 1)
        for m, vals in rounds.items():          # per-round figures a suite timed itself
            if m not in kept and m != "host_us":
                kept[m] = [round(float(v), 3) for v in vals]
        extra["rounds"] = kept
    import torch

    from labkit.core.timing import device_name

    return Row(suite=suite, config_name=config_name, config=dict(config),
               batch_size=batch_size, variant=variant,
               median_us=None if median_us is None else round(float(median_us), 3),
               back_to_back_us=None if back_to_back_us is None
               else round(float(back_to_back_us), 3),
               gpu_busy_us=None if gpu_busy_us is None else round(float(gpu_busy_us), 3),
               device=device_name(B), torch=torch.__version__, date=_now(), run=RUN_ID,
               note=note or None, extra=extra or None).to_dict()


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


def cudagraph_skips() -> int:
    """How many times torch.compile skipped cudagraphs in this process so far (Inductor's
    ``cudagraph_skips`` counter): a variant that raised it ran without graphs."""
    try:
        from torch._dynamo.utils import counters
        return int(counters["inductor"]["cudagraph_skips"])
    except Exception:
        return 0


def round_timer(B, *, warmup: int, repeats: int, calls: int, b2b_repeats: int = 3):
    """The ``time_one`` of :func:`labkit.bench.rounds.interleave` for a GPU suite: one
    round's sample of a callable, timed both ways (:mod:`labkit.core.timing`):
    ``{"median_us": synced median, "host_us": host time to issue it, "back_to_back_us":
    per call of ``calls`` calls between two events}``."""
    from labkit.core.timing import back_to_back_us, time_call

    def time_one(fn):
        synced, host = time_call(fn, B, warmup=warmup, repeats=repeats)
        b2b = back_to_back_us(fn, B, calls=calls, warmup=2, repeats=b2b_repeats)
        return {"median_us": synced, "host_us": host, "back_to_back_us": b2b}
    return time_one


def run_suite(name: str, B, quick: bool = False, log=print, **kw) -> list[dict]:
    """Run one suite on backend ``B`` and return its rows (nothing is written).
    ``kw`` goes to the suite's ``run`` (e.g. ``rounds``, ``batch_sizes``, ``cfg``,
    ``compile_mode``)."""
    if name not in SUITES:
        raise ValueError(f"unknown suite {name!r}: choose from {', '.join(SUITES)}")
    module = importlib.import_module(f"labkit.bench.{name}")
    return module.run(B, quick=quick, log=log, **kw)
