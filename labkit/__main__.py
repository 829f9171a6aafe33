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

    parser = argparse.ArgumentParser(prog="python -m labkit",
                                     description="CUDA Graphs Lab command line.")
    sub = parser.add_subparsers(dest="command", metavar="command", required=True)
    for name, command in (("doctor", doctor), ("exercises", exercises), ("demo", demo)):
        p = sub.add_parser(name, help=command.HELP, description=command.DESCRIPTION)
        command.add_arguments(p)
        p.set_defaults(run=command.run)
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
