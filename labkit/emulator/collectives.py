"""Collectives in an emulated capture: ``torch.distributed``'s functional collectives,
recorded at capture and run again, over the process group, on every replay.

On a GPU the NCCL kernel of a captured collective is a node of the graph, and every
replay runs it again, on the same buffers, with whichever peers replay their graphs.
The functional collectives of :mod:`torch.distributed._functional_collectives` dispatch
to ``torch.ops._c10d_functional.all_reduce`` (and its siblings), which return a new
tensor, and ``torch.ops._c10d_functional.wait_tensor``, the wait.

The emulator records them the same way: at capture a collective allocates its output
from the graph's pool and records one step; at replay that step runs the collective on
the captured memory over the process group (gloo between CPU processes) and waits for
it, so every rank's replay meets the other ranks' replays, in recorded order. The wait
records nothing. A collective whose result is never waited for inside the capture is
recorded and replayed like the others. What a GPU does with it is not settled here: on an
H200 (torch 2.11, one NCCL rank) the capture did not raise CUDA's unjoined-work error, and
torch warned that the work was never waited for. labkit's own collectives always wait
(``labkit.tp.all_reduce``).

.. warning::
    What the emulator cannot show: NCCL's kernels, their timing and their overlap with
    compute; what ``NCCL_GRAPH_REGISTER`` and user-buffer registration change (how NCCL
    reaches the buffers of a captured collective, not what the graph computes); a
    replay of mismatched collectives on a GPU hangs inside NCCL kernels, here it blocks in
    gloo until the process group's timeout. Only the functional collectives are
    recorded: ``torch.distributed.all_reduce`` and the other ``c10d`` ops that return a
    ``Work`` are refused during an emulated capture (write the functional form), and so
    are collectives over a list of tensors (``*_coalesced``).
"""

from __future__ import annotations

import torch

__all__ = ["NAMESPACES", "record", "UNSUPPORTED_MESSAGE"]

#: The op namespaces whose ops are collectives.
NAMESPACES = ("_c10d_functional", "c10d")

UNSUPPORTED_MESSAGE = (
    "[labkit emulator] {op} during an emulated capture: the emulator records the functional "
    "collectives only (torch.distributed._functional_collectives.all_reduce(x, 'sum', group), "
    "or labkit.tp.all_reduce), one tensor in, one tensor out. {why}")


def record(cap, func, args, kwargs):
    """Record a collective (or its wait) into capture ``cap``; return what the op returns."""
    name = func._schema.name.split("::")[-1]
    if func.namespace != "_c10d_functional":
        raise RuntimeError(UNSUPPORTED_MESSAGE.format(
            op=f"{func}", why="torch.distributed's own collectives return a Work object, "
            "which an emulated graph cannot hold: use the functional form."))
    if name == "wait_tensor":
        return args[0]                           # on a GPU an edge of the graph, no step
    rets = func._schema.returns
    if len(rets) != 1 or str(rets[0].type) != "Tensor":
        raise RuntimeError(UNSUPPORTED_MESSAGE.format(
            op=f"{func}", why="Collectives over lists of tensors are not emulated."))
    inplace = rets[0].alias_info is not None and rets[0].alias_info.is_write
    out = args[0] if inplace else cap.allocate(cap._meta(func, args, kwargs))
    aargs = tuple(cap.alias(a) if isinstance(a, torch.Tensor) else a for a in args)
    aout = cap.alias(out)
    wait = torch.ops._c10d_functional.wait_tensor.default

    def step(func=func, aargs=aargs, kwargs=dict(kwargs), aout=aout, inplace=inplace):
        res = wait(func(*aargs, **kwargs))       # over the process group, now
        if not inplace:
            aout.copy_(res)

    cap._node()
    cap.ops.append(str(func))
    cap.steps.append(step)
    return out

