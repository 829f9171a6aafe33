"""A real pipeline across processes: one stage per rank, graphed layers, 1F1B with p2p.

Each rank builds the same model (same seed), keeps only its stage's layers, wraps them
in :class:`~labkit.pipeline.runner.CudaGraphManager` (``reuse=False``: PP > 1, one
runner per in-flight microbatch), and runs Megatron's non-interleaved 1F1B loop
(``forward_backward_pipelining_without_interleaving`` in
``megatron/core/pipeline_parallel/schedules.py``): warmup forwards, then steady
one-forward-one-backward, then cooldown backwards. Activations go to the next rank and
gradients to the previous one with ``torch.distributed`` point-to-point ops *outside*
the graphs; the combined "send forward, receive backward" steps are issued together
(``batch_isend_irecv``) as Megatron does, so that two neighbours sending to each other
at once cannot deadlock under NCCL.

Step 1 records, each rank in its own :class:`~labkit.pipeline.record.GlobalRecord` and
its own pool; the graphs are created at the end of step 1; steps 2+ replay.

:func:`run_pipeline` spawns ``P`` processes (gloo with the emulator, through host copies
of its device's tensors; NCCL with one GPU per rank), waits with a timeout, and gathers
each rank's losses and parameters, to be compared with :func:`eager_reference` (the same
model trained in one process).
"""

from __future__ import annotations

import os
import socket
import tempfile
import time
from dataclasses import asdict, dataclass

import torch

from labkit.core.validate import check_int

__all__ = ["PipelineConfig", "find_free_port", "make_problem", "eager_reference",
           "run_pipeline", "stage_worker"]


@dataclass
class PipelineConfig:
    P: int = 2                 # stages = ranks
    M: int = 4                 # microbatches per step
    layers: int = 4
    steps: int = 3
    batch: int = 2
    seq: int = 8
    hidden: int = 32
    lr: float = 0.1
    seed: int = 0
    graphs: bool = True        # graph the layers (record step 1, replay after)
    backend: str = "auto"      # labkit backend: "auto", "emulated" or "cuda"
    num_warmup: int = 1

    def __post_init__(self):
        _check_config(self)


HEADS = 4                      # attention heads of make_problem's blocks


def _check_config(cfg: "PipelineConfig") -> None:
    """Refuse a configuration in this process, before ranks start and fail one by one."""
    from labkit.backend import NAMES

    for name, minimum in (("P", 1), ("M", 1), ("layers", 1), ("steps", 1), ("batch", 1),
                          ("seq", 1), ("hidden", 1), ("seed", 0), ("num_warmup", 0)):
        check_int(f"PipelineConfig.{name}", getattr(cfg, name), minimum=minimum)
    if cfg.layers < cfg.P:
        raise ValueError(f"PipelineConfig: layers={cfg.layers} cannot fill P={cfg.P} stages "
                         f"(each stage needs a layer): use layers >= P")
    if cfg.hidden % HEADS:
        raise ValueError(f"PipelineConfig.hidden={cfg.hidden} must be a multiple of the "
                         f"{HEADS} attention heads")
    if isinstance(cfg.lr, bool) or not isinstance(cfg.lr, (int, float)) or not cfg.lr > 0:
        raise ValueError(f"PipelineConfig.lr must be a positive number, got {cfg.lr!r}")
    if not isinstance(cfg.graphs, bool):
        raise TypeError(f"PipelineConfig.graphs must be True or False, got {cfg.graphs!r}")
    if cfg.backend not in NAMES:
        raise ValueError(f"PipelineConfig.backend: unknown backend {cfg.backend!r}: choose one "
                         f"of {', '.join(map(repr, NAMES))}")


def find_free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_problem(cfg: PipelineConfig, device=None):
    """The full model and the data of every step, identical in every process."""
    from labkit.core.models import make_blocks

    # drawn on the host (the same numbers whatever torch's default device), then put on
    # ``device`` (default: torch's default device), model and data alike
    device = device if device is not None else torch.get_default_device()
    layers = make_blocks(cfg.layers, seed=cfg.seed, device=device, hidden=cfg.hidden,
                         heads=HEADS, ffn=2 * cfg.hidden)
    g = torch.Generator().manual_seed(cfg.seed + 1)
    shape = (cfg.batch, cfg.seq, cfg.hidden)
    data = [[(torch.randn(shape, generator=g, device="cpu").to(device),
              torch.randn(shape, generator=g, device="cpu").to(device))
             for _ in range(cfg.M)] for _ in range(cfg.steps)]
    return layers, data


def eager_reference(cfg: PipelineConfig, device=None) -> dict:
    """Train in one process, eagerly, with the same 1F1B order: losses and parameters."""
    from labkit.pipeline.step import split_stages, train_step

    layers, data = make_problem(cfg, device)
    stages = split_stages(list(layers), cfg.P)
    opt = torch.optim.SGD(layers.parameters(), lr=cfg.lr)
    losses = []
    for batch in data:
        opt.zero_grad()
        xs, ts = zip(*batch)
        losses.append(train_step(stages, xs, ts))
        opt.step()
    return {"losses": losses, "params": [p.detach().cpu() for p in layers.parameters()]}


# ---- point-to-point, Megatron's p2p_communication in miniature ---------------------------

def _p2p(sends=(), recvs=(), *, via_host: bool = False):
    """Issue sends ``(tensor, peer)`` and receives ``(tensor, peer)`` together; wait.

    ``via_host``: move host copies of the tensors (received ones are copied back in
    place). For the emulated device, which no torch.distributed backend knows: gloo moves
    host memory there as NCCL moves device memory on a GPU. The copies are eager, outside
    every graph, as the p2p ops themselves are."""
    import torch.distributed as dist

    def wire(t):
        return t.cpu() if via_host else t

    wires = [(t, wire(t)) for t, _ in recvs]          # (where it lands, what receives)
    ops = [dist.P2POp(dist.isend, wire(t), p) for t, p in sends]
    ops += [dist.P2POp(dist.irecv, w, p) for (_, w), (_, p) in zip(wires, recvs)]
    if not ops:
        return
    for req in dist.batch_isend_irecv(ops):
        req.wait()
    for t, w in wires:
        if w is not t:
            t.copy_(w)


def stage_worker(rank: int, cfg: PipelineConfig) -> dict:
    """The body of one rank (call after ``init_process_group``)."""
    from labkit import backend
    from labkit.pipeline.record import GlobalRecord
    from labkit.pipeline.runner import graph_layers
    from labkit.pipeline.schedule import num_warmup_microbatches
    from labkit.pipeline.step import Stage, mse_loss, split_stages

    P, M = cfg.P, cfg.M
    B = backend.get(cfg.backend)
    layers, data = make_problem(cfg, B.device)
    mine = split_stages(list(layers), P)[rank].layers
    params = [p for layer in mine for p in layer.parameters()]
    record = GlobalRecord()
    if cfg.graphs:
        first = sum(len(s.layers) for s in split_stages(list(layers), P)[:rank])
        stage = Stage(graph_layers(mine, B, record, reuse=(P == 1), prefix="layer",
                                   num_warmup=cfg.num_warmup))
        for i, mgr in enumerate(stage.layers):
            mgr.name = f"layer{first + i}"
    else:
        stage = Stage(mine)
    opt = torch.optim.SGD(params, lr=cfg.lr)
    shape = (cfg.batch, cfg.seq, cfg.hidden)
    prev, nxt = rank - 1, rank + 1
    first_stage, last_stage = rank == 0, rank == P - 1

    def empty():
        return torch.empty(shape, device=B.device)

    def p2p(sends=(), recvs=()):
        _p2p(sends, recvs, via_host=B.is_emulated)

    losses_all = []
    for step_data in data:
        opt.zero_grad()
        pending: list = []          # (x, y) of in-flight microbatches, oldest first
        losses = []
        fwd_m = 0

        def recv_forward():
            if first_stage:
                return None
            x = empty()
            p2p(recvs=[(x, prev)])
            return x

        def forward(x):
            nonlocal fwd_m
            m = fwd_m
            fwd_m += 1
            if first_stage:
                x = step_data[m][0]
            else:
                x = x.requires_grad_()
            y = stage(x)
            if last_stage:
                y = mse_loss(y, step_data[m][1]) / M
                losses.append(y)
            pending.append((x, y))
            return y

        def backward(g):
            x, y = pending.pop(0)
            torch.autograd.backward(y, None if last_stage else g)
            return None if first_stage else x.grad

        w = num_warmup_microbatches(P, M, rank)
        for _ in range(w):                                   # warmup
            y = forward(recv_forward())
            p2p(sends=[(y.detach(), nxt)])
        x = recv_forward() if M - w > 0 else None
        for i in range(M - w):                               # steady 1F1B
            y = forward(x)
            g = None
            if not last_stage:                               # send_forward_recv_backward
                g = empty()
                p2p(sends=[(y.detach(), nxt)], recvs=[(g, nxt)])
            gx = backward(g)
            if i == M - w - 1:                               # send_backward
                if not first_stage:
                    p2p(sends=[(gx, prev)])
            else:                                            # send_backward_recv_forward
                x = None if first_stage else empty()
                p2p(sends=[(gx, prev)] if not first_stage else [],
                     recvs=[(x, prev)] if not first_stage else [])
        for _ in range(w):                                   # cooldown
            g = empty()
            p2p(recvs=[(g, nxt)])
            gx = backward(g)
            if not first_stage:
                p2p(sends=[(gx, prev)])
        losses_all.append([loss.item() for loss in losses])
        if cfg.graphs and not record.created:
            # drop step 1's autograd graph first (see labkit.pipeline.step.train_step):
            # its AccumulateGrad nodes live on the eager stream and would break capture
            losses.clear()
            pending.clear()
            x = y = gx = g = None  # noqa: F841
            record.create_cudagraphs(B)                      # end of step 1
        opt.step()
    return {"rank": rank, "losses": losses_all if last_stage else None,
            "params": [p.detach().cpu() for p in params],
            "graphs": sum(len(m.runners) for m in stage.layers) if cfg.graphs else 0}


def _entry(rank: int, cfg_dict: dict, port: int, outdir: str, dist_backend: str):
    import torch.distributed as dist

    torch.set_num_threads(1)
    cfg = PipelineConfig(**cfg_dict)
    if dist_backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(dist_backend, rank=rank, world_size=cfg.P,
                            init_method=f"tcp://127.0.0.1:{port}")
    dist.barrier()                 # every rank up (and NCCL's communicator built) first
    try:
        result = stage_worker(rank, cfg)
        torch.save(result, os.path.join(outdir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def run_pipeline(cfg: PipelineConfig, *, timeout: float = 60.0,
                 dist_backend: str | None = None) -> dict:
    """Spawn ``cfg.P`` ranks, run ``cfg.steps`` steps, return ``{"losses", "params",
    "graphs", "seconds"}`` gathered from all ranks (params in model order).

    ``dist_backend`` defaults to NCCL when the labkit backend is CUDA (one GPU per rank)
    and gloo otherwise. Raises ``TimeoutError`` (after terminating the ranks it started)
    if they do not finish within ``timeout`` seconds.
    """
    import torch.multiprocessing as mp

    from labkit import backend

    if not isinstance(cfg, PipelineConfig):
        raise TypeError(f"run_pipeline takes a PipelineConfig, got {type(cfg).__name__}")
    if dist_backend not in (None, "gloo", "nccl"):
        raise ValueError(f"unknown dist_backend {dist_backend!r}: choose 'gloo', 'nccl' or "
                         f"None (NCCL on the cuda backend, gloo otherwise)")
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    name = backend.resolve(cfg.backend)
    cfg = PipelineConfig(**{**asdict(cfg), "backend": name})
    if dist_backend is None:
        dist_backend = "nccl" if name == "cuda" else "gloo"
    if dist_backend == "nccl" and torch.cuda.device_count() < cfg.P:
        raise RuntimeError(f"NCCL pipeline needs {cfg.P} GPUs, found "
                           f"{torch.cuda.device_count()}")
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as outdir:
        ctx = mp.start_processes(_entry, args=(asdict(cfg), find_free_port(), outdir,
                                               dist_backend),
                                 nprocs=cfg.P, join=False, start_method="spawn")
        deadline = time.monotonic() + timeout
        try:
            while not ctx.join(timeout=max(0.1, min(1.0, deadline - time.monotonic()))):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"pipeline ranks did not finish in {timeout:.0f} s")
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.terminate()
                    p.join(5)
        results = [torch.load(os.path.join(outdir, f"rank{r}.pt")) for r in range(cfg.P)]
    return {"losses": results[-1]["losses"],
            "params": [p for r in results for p in r["params"]],
            "graphs": [r["graphs"] for r in results],
            "seconds": time.perf_counter() - t0}
