"""Command line: ``python -m labkit <command>``.

    python -m labkit doctor [--json]              what this machine has
    python -m labkit exercises [--check|--force]  regenerate exercises/ from solutions/
    python -m labkit demo NN [--backend B] [--out PATH.png]
                                                  lesson NN's headline demo: prints its
                                                  figures, saves its picture as a PNG
    python -m labkit demo --list                  what each demo (00..07) shows
"""

from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    from labkit import demo, doctor, exercises

    parser = argparse.ArgumentParser(
        prog="python -m labkit",
        description="CUDA Graphs Lab command line.",
    )
    sub = parser.add_subparsers(dest="command", metavar="command", required=True)
    p_doc = sub.add_parser("doctor", help="what this machine has (Python, torch, GPU, "
                                          "backend, notebook tools)",
                           description="What this machine has for the CUDA Graphs Lab.")
    doctor.add_arguments(p_doc)
    p_doc.set_defaults(run=doctor.run)
    p_ex = sub.add_parser("exercises", help="regenerate exercises/*.ipynb from "
                                            "solutions/*.ipynb (never overwrites your edits)",
                          description="Generate exercises/NN_*.ipynb from "
                                      "solutions/NN_*.ipynb. Files you edited are never "
                                      "overwritten without --force, and --force backs them "
                                      "up to exercises/backup/ first.")
    exercises.add_arguments(p_ex)
    p_ex.set_defaults(run=exercises.run)
    p_demo = sub.add_parser("demo", help="run lesson NN's headline demo: print its figures, "
                                         "save its picture as a PNG (--list: what each shows)",
                            description="Run a lesson's headline demo from a terminal: it "
                                        "prints the figures it measured and saves the "
                                        "picture as a PNG. Without a GPU it runs on labkit's "
                                        "CPU emulator and says so.")
    demo.add_arguments(p_demo)
    p_demo.set_defaults(run=demo.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
        parser.print_help()
        return 0
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BrokenPipeError:  # `python -m labkit doctor | head`
        sys.exit(0)
    except KeyboardInterrupt:
        sys.exit(130)
