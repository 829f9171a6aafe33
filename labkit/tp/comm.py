"""The tensor-parallel group and its one collective: an all-reduce that a graph can hold.

:class:`TPGroup` is what the model's layers see of ``torch.distributed``: the rank, the
number of ranks, the process group the activations are reduced over (``device_group``:
NCCL on GPUs, gloo on the emulator) and a gloo group for host-side checks (``cpu_group``),
the two groups of vLLM's and SGLang's ``GroupCoordinator``.

:func:`all_reduce` is vLLM's / SGLang's ``tensor_model_parallel_all_reduce`` written on
the functional collectives (``torch.ops._c10d_functional.all_reduce`` then
``wait_tensor``, what :func:`torch.distributed._functional_collectives.all_reduce`
dispatches to): a new output tensor, and the wait right after it, so a capture holds the
collective *and* the capturing stream's wait for it. The same code runs eagerly, inside a
CUDA graph with NCCL, and inside an emulated graph over gloo
(:mod:`labkit.emulator.collectives`).

The rule a graph adds: **every rank captures the same collectives in the same order.** A
replay runs the recorded collectives blindly; a rank whose graph holds one more (or a
different size) waits forever for a partner that never comes. :func:`record_collectives`
notes every collective captured while it is active, and :func:`check_same_collectives`
compares the notes of all ranks over the gloo group, naming the first difference.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

__all__ = ["TPGroup", "all_reduce", "record_collectives", "check_same_collectives",
           "check_same_values", "CollectiveMismatchError", "capturing"]


class CollectiveMismatchError(RuntimeError):
    """Ranks captured different collectives (or would): their replays would hang."""


@dataclass
class TPGroup:
    """One tensor-parallel group: this process's rank among ``world_size``.

    Args:
        device_group: the process group activations are all-reduced over.
        cpu_group: a gloo group over the same ranks for host values (signatures, bucket
            lists); the device group itself where that is gloo already.
    """

    rank: int
    world_size: int
    device_group: object = field(repr=False)
    cpu_group: object = field(repr=False)
    backend: str = "gloo"

    @property
    def group_name(self) -> str:
        return self.device_group.group_name

    @classmethod
    def from_world(cls) -> "TPGroup":
        """The default process group (``dist.init_process_group`` must have run)."""
        if not dist.is_initialized():
            raise RuntimeError("TPGroup.from_world(): torch.distributed is not initialised: "
                               "call dist.init_process_group(...) first, or run through "
                               "labkit.tp.launch(fn, world_size), which does")
        pg = dist.group.WORLD
        backend = dist.get_backend(pg)
        cpu = pg if backend == "gloo" else dist.new_group(backend="gloo")
        return cls(dist.get_rank(), dist.get_world_size(), pg, cpu, backend)


def capturing(device: torch.device) -> bool:
    """Is a graph being captured on the current stream of ``device``'s backend?"""
    if device.type == "cuda":
        return torch.cuda.is_current_stream_capturing()
    if device.type == "emu":
        from labkit.backend import get
        return get("emulated").is_current_stream_capturing()
    return False


class _Log(threading.local):
    entries: list | None = None


_log = _Log()


@contextlib.contextmanager
def record_collectives():
    """Note every collective :func:`all_reduce` issues *under capture* while active.

    Yields the list it fills: one ``(op, shape, dtype)`` tuple per collective, in order.
    """
    outer, _log.entries = _log.entries, []
    try:
        yield _log.entries
    finally:
        _log.entries = outer


def all_reduce(x: torch.Tensor, group: TPGroup) -> torch.Tensor:
    """Sum ``x`` over the group's ranks: a new tensor (``x`` is left as it is).

    vLLM's ``RowParallelLinear.forward`` calls ``tensor_model_parallel_all_reduce`` on its
    partial output when ``reduce_results`` is set and ``tp_size > 1``; this one reduces
    for one rank too, so a 1-rank NCCL group still puts the collective into the graph.
    """
    out = torch.ops._c10d_functional.all_reduce(x, "sum", group.group_name)
    out = torch.ops._c10d_functional.wait_tensor(out)
    if _log.entries is not None and capturing(x.device):
        _log.entries.append(("all_reduce", tuple(x.shape), str(x.dtype).replace("torch.", "")))
    return out


def _gather(value, group: TPGroup) -> list:
    values = [None] * group.world_size
    dist.all_gather_object(values, value, group=group.cpu_group)
    return values


def check_same_values(value, group: TPGroup, what: str, fix: str) -> None:
    """Raise :class:`CollectiveMismatchError` on every rank unless every rank passed an
    equal ``value`` (a host value, exchanged over the gloo group)."""
    values = _gather(value, group)
    if any(v != values[0] for v in values):
        shown = "; ".join(f"rank {r}: {v}" for r, v in enumerate(values))
        raise CollectiveMismatchError(f"ranks differ in {what} ({shown}). {fix}")


def check_same_collectives(entries: list, group: TPGroup, what: str = "this graph") -> None:
    """Raise :class:`CollectiveMismatchError` on every rank unless every rank captured the
    same collectives (op, shape, dtype) in the same order into ``what``.

    .. warning::
        Run it right after capture, before any replay: a replay of mismatched graphs hangs
        (NCCL's kernels wait for the missing partner), and on a GPU nothing says why.
    """
    sigs = _gather(list(entries), group)
    if all(s == sigs[0] for s in sigs):
        return
    n = max(len(s) for s in sigs)
    first = next(i for i in range(n) if len({repr(s[i]) if i < len(s) else None
                                             for s in sigs}) > 1)
    shown = "; ".join(f"rank {r}: {s[first] if first < len(s) else 'nothing'}"
                      for r, s in enumerate(sigs))
    counts = ", ".join(f"rank {r}: {len(s)}" for r, s in enumerate(sigs))
    raise CollectiveMismatchError(
        f"ranks captured different collectives into {what} (counts {counts}); the first "
        f"difference is collective #{first}: {shown}. Every rank must capture the same "
        "collectives in the same order (same buckets, same branches), or a replay waits "
        "forever for a partner that never comes.")
