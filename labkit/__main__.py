"""Command line: ``python -m labkit <command>``."""

from __future__ import annotations

import sys

USAGE = """\
usage: python -m labkit <command> [options]

commands:
  doctor               what this machine has (Python, torch, GPU, backend, tools)
  exercises            regenerate exercises/*.ipynb from solutions/*.ipynb
  exercises --check    exit 1, listing them, if exercises/ is stale
"""


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE, end="")
        return 0
    command, rest = argv[0], argv[1:]
    if command == "doctor":
        from labkit.doctor import main as doctor_main

        return doctor_main(rest)
    if command == "exercises":
        from labkit.exercises import main as exercises_main

        return exercises_main(rest)
    print(f"unknown command {command!r}\n", file=sys.stderr)
    print(USAGE, end="", file=sys.stderr)
    return 2


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BrokenPipeError:  # `python -m labkit doctor | head`
        sys.exit(0)
