"""``python -m labkit.bench [suite ...] [--rounds N] [--render] [--quick] [--results PATH]
[--out DIR] [--tp-ranks N]``"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from labkit.bench import SUITES, report, run_suite
from labkit.bench.rounds import DEFAULT_ROUNDS

NO_GPU = """\
labkit.bench measures GPU time and needs a CUDA GPU; torch.cuda.is_available() is False
here (torch {torch}). Nothing was measured. The CPU emulator reproduces what CUDA graphs
do, not how fast a GPU runs them, so it has nothing to benchmark.
  * on a GPU machine:  python -m labkit.bench {suites}
  * re-render the tables and plots from docs/benchmarks/results.json on any machine:
      python -m labkit.bench --render"""


COMPILE_MODES = ("default", "max-autotune-no-cudagraphs")  # the runner captures: no cudagraphs


def _whole(option: str):
    def parse(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            n = 0
        if n < 1:
            raise argparse.ArgumentTypeError(f"{option} takes a whole number >= 1, got "
                                             f"{text!r}")
        return n
    return parse


_rounds = _whole("--rounds")


def print_verdicts(rows, log=print) -> None:
    """The verdicts and target checks of freshly timed rows (:mod:`labkit.bench.verdicts`)."""
    from labkit.bench.verdicts import comparisons, target_checks

    rows = report.latest(rows)
    for c in comparisons(rows):
        log(f"  verdict: {c.text()}")
    for line in target_checks(rows):
        log(f"  target {line}")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m labkit.bench",
                                description="GPU benchmarks: eager vs CUDA graphs vs "
                                            "torch.compile; results appended to "
                                            "docs/benchmarks/results.json and rendered.")
    p.add_argument("suites", nargs="*", metavar="suite",
                   help=f"suites to run (default: all): {', '.join(SUITES)}")
    p.add_argument("--render", action="store_true",
                   help="re-render README.md and the plots from the results file (no GPU "
                        "needed); with suites, render after running them (the default)")
    p.add_argument("--quick", action="store_true", help="fewer repeats and batch sizes")
    p.add_argument("--rounds", type=_rounds, default=DEFAULT_ROUNDS, metavar="N",
                   help=f"interleaved rounds per suite (default: {DEFAULT_ROUNDS}; a verdict "
                        "says 'faster' only for 4 of 5 rounds won, so use at least 5)")
    p.add_argument("--results", type=Path, default=None, metavar="FILE",
                   help="results file (default: docs/benchmarks/results.json); --render "
                        "needs it to exist")
    p.add_argument("--out", type=Path, default=None, metavar="DIR",
                   help="where README.md and the plots go (default: beside the results)")
    p.add_argument("--no-save", action="store_true",
                   help="print the rows, write nothing")
    p.add_argument("--decode-compile-mode", default="default", choices=COMPILE_MODES,
                   help="torch.compile mode for the decode suite's labkit_graph_compiled "
                        "row (default: 'default', fusion only; the runner's own default is "
                        "'max-autotune-no-cudagraphs', minutes of GEMM autotuning)")
    p.add_argument("--tp-ranks", type=_whole("--tp-ranks"), default=None, metavar="N",
                   help="ranks (one GPU and one process each) of the tp suite (default: 2 "
                        "where two GPUs are visible, else 1)")
    return p


def parse(argv):
    p = parser()
    args = p.parse_args(argv)
    unknown = [s for s in args.suites if s not in SUITES]
    if unknown:
        p.error(f"unknown suite(s) {', '.join(map(repr, unknown))}: choose from "
                f"{', '.join(SUITES)}")
    if args.tp_ranks is not None and args.suites and "tp" not in args.suites:
        p.error("--tp-ranks sets the tp suite's rank count, and the tp suite is not among "
                f"the suites to run ({', '.join(args.suites)}): add `tp`")
    return args


def _tp_preflight(args) -> str | None:
    """The tp suite's rank count checked against this machine and the model: the error
    line, or None. (Run before any suite, so that a bad count costs no measurements.)"""
    from labkit.bench import tp

    ranks = args.tp_ranks if args.tp_ranks is not None else tp.default_world_size()
    try:
        tp.preflight(ranks)
    except (ValueError, RuntimeError) as exc:
        return f"--tp-ranks {ranks}: {exc}"
    return None


def main(argv=None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    results = args.results or report.default_results_path()
    try:
        if args.render and not args.suites:
            for path in report.render(results, args.out):
                print("wrote", path)
            return 0
        # read the results file before measuring anything: a corrupt one is reported now,
        # not after minutes of benchmarks whose rows then could not be appended
        report.load_results(results)
    except report.ResultsError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    suites = args.suites or list(SUITES)
    import torch

    if not torch.cuda.is_available():
        print(NO_GPU.format(torch=torch.__version__,
                            suites=" ".join(args.suites) or "[suite ...]"))
        return 0

    if "tp" in suites:
        err = _tp_preflight(args)
        if err:
            print(f"error: {err}", file=sys.stderr)
            return 2

    from labkit import backend

    B = backend.get("cuda")
    print(f"labkit.bench on {torch.cuda.get_device_name(B.device)}, torch {torch.__version__}")
    rows = []
    try:
        for name in suites:
            print(f"[{name}]")
            kw = {"compile_mode": args.decode_compile_mode} if name == "decode" else {}
            if name == "tp":
                kw = {"world_size": args.tp_ranks}
            suite_rows = run_suite(name, B, quick=args.quick, rounds=args.rounds, **kw)
            rows += suite_rows
            print_verdicts(suite_rows)
            if not args.no_save:   # each suite as it ends: a later failure loses nothing
                path = report.append_results(suite_rows, results)
                print(f"appended {len(suite_rows)} rows to {path}")
        if args.no_save:
            print(report.markdown_table(report.latest(rows)))
            return 0
        for p in report.render(results, args.out):
            print("wrote", p)
    except report.ResultsError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        sys.exit(130)
