"""What every demo shares: the ``Demo`` record and the helpers that label what ran it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

__all__ = ["Demo"]


@dataclass(frozen=True)
class Demo:
    """One lesson's headline demo: what it shows, and the function that runs it."""

    number: str
    lesson: str
    shows: str
    run: Callable  # run(B, small: bool) -> matplotlib Figure; prints its figures


def _on_cpu_note(B) -> str:
    return ("emulated: labkit's CPU emulator runs the graphs; times below are this CPU's, "
            "not a GPU's") if B.is_emulated else ""


def _device(B) -> str:
    from labkit.core import timing

    return timing.device_name(B)


def _footer(fig, B, number: str) -> None:
    """A line under the picture naming the demo and what ran it (the figure grows for it)."""
    where = (f"backend emulated: {_device(B)}; measured times are this CPU's, "
             "simulated ones say so"
             if B.is_emulated else f"backend cuda: {_device(B)}")
    w, h = fig.get_size_inches()
    extra = 0.3
    fig.set_size_inches(w, h + extra)
    for ax in fig.axes:                       # same size in inches, moved up by `extra`
        pos = ax.get_position()
        ax.set_position([pos.x0, (pos.y0 * h + extra) / (h + extra), pos.width,
                         pos.height * h / (h + extra)])
    fig.text(0.995, 0.008, f"labkit demo {number} · {where}", ha="right", va="bottom",
             fontsize=7, color="0.4")


def _measure_us(fn, B, small: bool) -> float:
    from labkit.core import timing

    return timing.measure_us(fn, B, warmup=2 if small else 5, repeats=10 if small else 30)
