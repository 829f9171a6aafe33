"""``python -m labkit demo NN``: each lesson's headline picture and numbers, from a terminal.

For a room where Jupyter is not at hand: one command per lesson runs that lesson's key
demonstration with labkit's own engines, prints the figures it measured and saves the
picture as a PNG::

    python -m labkit demo --list                 what each demo shows
    python -m labkit demo 01                     lesson 01, saved as ./labkit-demo-01.png
    python -m labkit demo 06 --out room/06.png   another path (it must end in .png)
    python -m labkit demo 04 --backend emulated  the CPU emulator, even on a GPU machine

On a GPU (``--backend cuda``, or ``auto`` where one is present) the numbers are measured on
it; each demo takes under 30 s on an H200. Without one (``emulated``) the graphs run on
labkit's CPU emulator, and every line and picture that would need a GPU says whether it is
the emulator's CPU timing or a simulation of a named GPU. The demos use small sizes on
the emulator so that each runs in seconds.

A demo writes its PNG only where that is safe: a path ending in ``.png`` whose folder
exists, and that is either free or holds a PNG an earlier demo saved (a presenter re-runs
demos; each PNG carries a ``Software: labkit demo NN`` text chunk that says so). Any other
file is left alone, with a message saying so.
"""

from labkit.demo.cli import (
           BACKENDS,
           DESCRIPTION,
           HELP,
           add_arguments,
           check_out_path,
           is_demo_png,
           run,
)
from labkit.demo.lessons import DEMOS, Demo

__all__ = ["Demo", "DEMOS", "BACKENDS", "is_demo_png", "check_out_path", "add_arguments",
           "run", "HELP", "DESCRIPTION"]
