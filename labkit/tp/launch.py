"""Run one function on N processes, one rank each, over ``torch.distributed``.

:func:`launch` is ``torchrun`` for a notebook and a test: it starts ``world_size``
processes, initialises the default process group in each (a ``FileStore`` in a temporary
directory: no port to pick), builds the :class:`~labkit.tp.comm.TPGroup`, calls
``fn(group, *args)`` and returns every rank's result, in rank order.

Backends: ``"gloo"`` (CPU processes; the emulator runs its graphs over it) and
``"nccl"`` (one GPU per process: rank ``r`` sets device ``r`` before anything touches
CUDA; two ranks on one GPU are refused, since NCCL cannot put two ranks of a
communicator on one device).

.. warning::
    A rank that waits in a collective its peers never call blocks until the process
    group's ``pg_timeout``; :func:`launch` itself gives up after ``timeout`` seconds,
    stops every rank it started and says which ranks had not finished.
"""

from __future__ import annotations

import datetime
import os
import queue as _queue
import sys
import tempfile
import traceback

import torch
import torch.multiprocessing as mp

__all__ = ["launch", "BACKENDS", "LaunchError", "check_world"]

BACKENDS = ("gloo", "nccl")


class LaunchError(RuntimeError):
    """A rank did not finish (timeout) or could not start."""


def check_world(world_size, backend: str) -> None:
    """Refuse a world size or backend that cannot run here, saying why and what to do."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(map(repr, BACKENDS))}, got "
                         f"{backend!r}")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a whole number >= 1, got {world_size!r}")
    if backend == "nccl":
        if not torch.cuda.is_available():
            raise RuntimeError("backend 'nccl' needs CUDA GPUs and torch.cuda.is_available() "
                               "is False here: use backend='gloo' with the emulated backend")
        n = torch.cuda.device_count()
        if world_size > n:
            raise RuntimeError(f"{world_size} NCCL ranks need {world_size} GPUs (one GPU per "
                               f"process) and {n} visible here: run with world_size <= {n}")


def _worker(rank, world_size, backend, init_file, pg_timeout, fn, args, results):
    import torch.distributed as dist

    from .comm import TPGroup
    try:
        torch.set_num_threads(1)   # N ranks share the host's cores
        kw = {}
        if backend == "nccl":
            torch.cuda.set_device(rank)            # before any CUDA work: one GPU per rank
            kw["device_id"] = torch.device("cuda", rank)
        dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank,
                                world_size=world_size,
                                timeout=datetime.timedelta(seconds=pg_timeout), **kw)
        try:
            out = fn(TPGroup.from_world(), *args)
        finally:
            # graphs that hold NCCL kernels go before their communicator does
            import gc
            gc.collect()
            if backend == "nccl":
                torch.cuda.synchronize()
            dist.destroy_process_group()
        results.put((rank, True, out))
    except BaseException as exc:  # report every failure, with its rank, to the parent
        tb = traceback.format_exc()
        try:
            results.put((rank, False, (exc, tb)))
        except Exception:
            results.put((rank, False, (RuntimeError(f"{type(exc).__name__}: {exc}"), tb)))


def launch(fn, world_size: int = 2, backend: str = "gloo", args: tuple = (),
           timeout: float = 120.0, pg_timeout: float = 60.0) -> list:
    """Run ``fn(group, *args)`` on ``world_size`` new processes; return their results.

    ``fn`` must be importable (a module-level function) where processes are spawned
    (``nccl``); ``gloo`` ranks are forked on Linux, so they start in a fraction of a
    second and inherit what this process imported.

    Raises:
        The exception of the lowest rank that raised, with a note naming the rank (and
        its traceback in the note); :class:`LaunchError` if ranks did not finish within
        ``timeout`` seconds.
    """
    check_world(world_size, backend)
    method = "fork" if backend == "gloo" and sys.platform.startswith("linux") else "spawn"
    if method == "fork":
        # The first capture imports torch._dynamo (and sympy) lazily, seconds of work:
        # done once here, every forked rank inherits it instead of repeating it.
        import torch._dynamo  # noqa: F401
    ctx = mp.get_context(method)
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="labkit_tp_") as tmp:
        init_file = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_worker, daemon=True,
                             args=(r, world_size, backend, init_file, pg_timeout, fn, args,
                                   results)) for r in range(world_size)]
        for p in procs:
            p.start()
        got: dict[int, tuple] = {}
        try:
            while len(got) < world_size:
                try:
                    rank, ok, value = results.get(timeout=timeout)
                except _queue.Empty:
                    missing = sorted(set(range(world_size)) - set(got))
                    raise LaunchError(
                        f"rank(s) {missing} did not finish within {timeout:.0f} s (finished: "
                        f"{sorted(got)}); a rank waiting in a collective that its peers "
                        "never call blocks like this. Every rank was stopped.") from None
                got[rank] = (ok, value)
                if not ok:
                    break            # one rank failed: the others may wait for it forever
        finally:
            for p in procs:
                p.join(timeout=5 if len(got) == world_size else 0.5)
                if p.is_alive():
                    p.kill()
                    p.join()
    failed = sorted(r for r, (ok, _) in got.items() if not ok)
    if failed:
        exc, tb = got[failed[0]][1]
        exc.add_note(f"(raised on rank {failed[0]} of {world_size}; its traceback:\n{tb})")
        raise exc
    return [got[r][1] for r in range(world_size)]
