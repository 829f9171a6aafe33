"""``python -m labkit demo``'s command line, and the rule for where a demo may write its PNG."""

from __future__ import annotations

import argparse
import contextlib
import os
import struct
import sys
import tempfile
import time
import warnings
from pathlib import Path

from labkit.demo.common import _device, _footer, _on_cpu_note
from labkit.demo.lessons import DEMOS

__all__ = ["BACKENDS", "is_demo_png", "check_out_path", "add_arguments", "run"]

#: ``--backend`` accepts exactly these (``labkit.backend.get``'s names).
BACKENDS = ("auto", "cuda", "emulated")

_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
_MARK_KEY = "Software"
_MARK = "labkit demo"


# --------------------------------------------------------------------------- the PNG

def _png_text_chunks(path: Path, limit: int = 1 << 20) -> dict[str, str] | None:
    """The tEXt chunks before the image data of a PNG file, or None if it is not a PNG."""
    try:
        with open(path, "rb") as fh:
            if fh.read(8) != _PNG_SIGNATURE:
                return None
            out: dict[str, str] = {}
            while fh.tell() < limit:
                head = fh.read(8)
                if len(head) < 8:
                    return out
                length, kind = struct.unpack(">I4s", head)
                if kind in (b"IDAT", b"IEND"):
                    return out
                data = fh.read(length)
                fh.read(4)  # CRC
                if kind == b"tEXt" and b"\0" in data:
                    key, _, value = data.partition(b"\0")
                    out[key.decode("latin-1")] = value.decode("latin-1")
            return out
    except OSError:
        return None


def is_demo_png(path) -> bool:
    """True when ``path`` is a PNG that ``python -m labkit demo`` saved.

    Args:
        path: a file path. Its PNG text chunk ``Software`` must start with
            ``labkit demo`` (every demo PNG carries one); anything else, a missing or
            unreadable file included, gives False.
    """
    chunks = _png_text_chunks(Path(path))
    return bool(chunks) and chunks.get(_MARK_KEY, "").startswith(_MARK)


def check_out_path(path) -> str | None:
    """Why a demo must not write its PNG to ``path``, or None when it may.

    Args:
        path: the ``--out`` value. Accepted: a path ending in ``.png`` (any case) in a
            folder that exists and this user can write, where no file is yet or a PNG
            that a demo saved (:func:`is_demo_png`).

    .. warning::
        A demo overwrites only its own earlier PNGs: anything else at ``path`` (a
        learner's picture, a notebook, a folder) is refused, since a presenter typing a
        wrong path must not lose a file.
    """
    p = Path(path)
    if str(path).endswith(("/", os.sep)) and not p.is_dir():
        return (f"--out {path} names a folder that does not exist; create it first "
                f"(mkdir -p {p}) and give a file in it, e.g. --out {p / 'labkit-demo-01.png'}")
    if p.is_dir():
        return (f"--out {path} is a folder; the demo saves one PNG file: give a file path "
                f"ending in .png, e.g. --out {p / 'labkit-demo-01.png'}")
    if p.suffix.lower() != ".png":
        return (f"--out {path} does not end in .png; the demo saves a PNG picture: give a "
                f"path ending in .png, e.g. --out {p.with_suffix('.png')}")
    parent = p.parent if str(p.parent) else Path(".")
    if not parent.is_dir():
        return (f"--out {path}: the folder {parent} does not exist; create it first "
                f"(mkdir -p {parent}) or pick another path")
    if not os.access(parent, os.W_OK):
        return (f"--out {path}: this user cannot write to the folder {parent}; pick another "
                f"path (e.g. in your home folder or /tmp)")
    if p.exists() and not is_demo_png(p):
        return (f"--out {path}: a file is already there and it is not a PNG that a labkit "
                f"demo saved, so it is left alone; pick another path, or move that file away")
    return None


def _save(fig, path: Path, number: str) -> None:
    """Write the PNG next to its destination first, then move it there in one step."""
    fd, tmp = tempfile.mkstemp(prefix=".labkit-demo-", suffix=".png", dir=path.parent or ".")
    os.close(fd)
    try:
        fig.savefig(tmp, format="png", dpi=110,
                    metadata={_MARK_KEY: f"{_MARK} {number} (python -m labkit demo {number})"})
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


# --------------------------------------------------------------------------- command line

def _demo_number(text: str) -> str:
    """argparse type for NN: '1', '01' -> '01'; anything else is refused with the choices."""
    choices = ", ".join(DEMOS)
    if not text.isdigit() or f"{int(text):02d}" not in DEMOS:
        raise argparse.ArgumentTypeError(
            f"no demo {text!r}: expected a lesson number, one of {choices} "
            "(python -m labkit demo --list says what each shows)")
    return f"{int(text):02d}"


HELP = ("run lesson NN's headline demo: print its figures, save its picture as a PNG "
        "(--list: what each shows)")
DESCRIPTION = ("Run a lesson's headline demo from a terminal: it prints the figures it measured "
               "and saves the picture as a PNG. Without a GPU it runs on labkit's CPU emulator "
               "and says so.")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``python -m labkit demo``."""
    parser.add_argument("number", nargs="?", type=_demo_number, metavar="NN",
                        help="the lesson whose demo to run: " + ", ".join(DEMOS))
    parser.add_argument("--list", action="store_true",
                        help="say what each demo shows (with NN: only that one)")
    parser.add_argument("--backend", choices=BACKENDS, default="auto",
                        help="auto (a GPU when there is one, else the emulator; "
                             "LABKIT_BACKEND overrides it), cuda, or emulated (default: auto)")
    parser.add_argument("--out", metavar="PATH", default=None,
                        help="where to save the picture (a .png path; default "
                             "./labkit-demo-NN.png). Only a PNG an earlier demo saved is "
                             "overwritten.")


def _list(number: str | None = None) -> str:
    """What each demo shows (``--list``), or only demo ``number`` (``--list NN``)."""
    lines = ["python -m labkit demo NN: each lesson's headline demo (prints its figures, "
             "saves a PNG)", ""]
    for d in DEMOS.values() if number is None else [DEMOS[number]]:
        lines.append(f"  {d.number}  {d.lesson}")
        lines.append(f"      {d.shows}")
    lines += ["", "--backend auto|cuda|emulated (default auto), --out PATH.png "
                  "(default ./labkit-demo-NN.png)"]
    return "\n".join(lines)


def _error(message: str) -> int:
    print(f"python -m labkit demo: error: {message}", file=sys.stderr)
    return 2


def run(args) -> int:
    """Run one demo from parsed arguments; returns the exit status (no traceback ever)."""
    if args.list:
        print(_list(args.number))
        return 0
    if args.number is None:
        return _error("give a demo number, e.g. `python -m labkit demo 01`, or --list to "
                      "see them (" + ", ".join(DEMOS) + ")")
    demo = DEMOS[args.number]
    out = Path(args.out if args.out is not None else f"labkit-demo-{demo.number}.png")
    problem = check_out_path(args.out if args.out is not None else out)   # keeps a trailing /
    if problem:
        return _error(problem)

    import matplotlib

    matplotlib.use("Agg", force=True)      # a file, no window: works over ssh and in CI
    import matplotlib.pyplot as plt
    import torch

    from labkit import backend

    try:
        B = backend.get(args.backend)
    except (RuntimeError, ValueError) as e:
        return _error(f"--backend {args.backend}: {e} On the command line: --backend "
                      "emulated runs the demo on the CPU emulator.")
    if B.is_emulated:
        torch.set_num_threads(1)           # tiny tensors: one thread is faster and steadier
    print(f"labkit demo {demo.number} · lesson {demo.number}, {demo.lesson}")
    print(f"backend: {B.name} | device: {B.device} ({_device(B)}) | torch {torch.__version__}")
    if B.is_emulated:
        print(_on_cpu_note(B) + "; what needs a GPU is labelled emulated or simulated")
    print()
    t0 = time.perf_counter()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # library notices; the demo prints what matters
            fig = demo.run(B, B.is_emulated)
            _footer(fig, B, demo.number)
            _save(fig, out, demo.number)
            plt.close(fig)
    except Exception as e:  # noqa: BLE001 - a command line ends in a message, not a traceback
        with contextlib.suppress(Exception):
            backend.recover(B)
        first = (str(e).strip().splitlines() or [""])[0]
        print(f"\ndemo {demo.number} failed on backend {B.name}: {type(e).__name__}: {first}\n"
              "Check the setup with `python -m labkit doctor`; `--backend emulated` runs the "
              "same demo on the CPU emulator.", file=sys.stderr)
        return 1
    print(f"\nsaved {out} ({time.perf_counter() - t0:.1f} s)")
    return 0
