"""The ``tp`` suite: a decode step split over N GPUs, graphed vs eager (lesson 10).

Variants, per batch size (1, 8, 64 on a GPU):

    eager, labkit_graph     the 1-rank model (lesson 06's runner), on each rank's GPU
    tpN_eager, tpN_graph    the model split over N ranks (labkit.tp), all-reduces inside
                            the graphs (tpN_graph) or issued one by one (tpN_eager)

``python -m labkit.bench tp`` starts one process per rank itself: N = 2 where two GPUs are
visible (``--tp-ranks N`` for another count), else N = 1, NCCL either way; with one GPU
the tp1 rows show the cost of a 1-rank NCCL all-reduce inside the graph, and the tp2 rows
are written as skipped, saying they need 2 GPUs.

Every rank builds and checks all variants (the split model's graphs against the 1-rank
model, :data:`labkit.tp.demos.TOLERANCE`), then all ranks time the same variants in the
same interleaved rounds (:mod:`labkit.bench.rounds`, seeded: the same order on every
rank, with a barrier before each), so the collectives of the split variants meet. Rank 0's
times are the rows.

On the emulated backend (tests) the ranks are gloo processes on the CPU and the model is
tiny: that checks the suite's code, not a GPU's speed.
"""

from __future__ import annotations

import torch

from labkit.bench import make_row, round_timer, skipped_row
from labkit.bench.rounds import DEFAULT_ROUNDS, interleave

__all__ = ["run", "preflight", "MODEL", "CPU_MODEL", "default_world_size"]

MODEL = dict(vocab_size=1024, n_layer=8, n_head=8, n_local_heads=8, dim=512, max_seq_len=256)
CPU_MODEL = dict(vocab_size=128, n_layer=2, n_head=4, n_local_heads=4, dim=64,
                 intermediate_size=128, max_seq_len=64)


def default_world_size() -> int:
    """2 where two GPUs are visible, else 1."""
    return 2 if torch.cuda.is_available() and torch.cuda.device_count() >= 2 else 1


def preflight(world_size: int, on_gpu: bool = True, model_args: dict | None = None) -> None:
    """Refuse, before anything starts, a rank count this machine or the model cannot
    take (a ValueError / RuntimeError that says what to do)."""
    from labkit.decode import ModelArgs
    from labkit.tp import check_tp_args
    from labkit.tp.launch import check_world

    check_world(world_size, "nccl" if on_gpu else "gloo")
    check_tp_args(ModelArgs(**(model_args or (MODEL if on_gpu else CPU_MODEL))), world_size)


def _timed_rank(group, backend_name: str, model_args: dict, batch_sizes, rounds: int,
                quick: bool, seed: int):
    """On every rank: build, check, time. Rank 0 returns the rows."""
    import torch.distributed as dist

    from labkit import backend
    from labkit.decode import DecodeGraphRunner, EagerRunner, ModelArgs, build_model
    from labkit.tp import TPDecodeGraphRunner, build_tp_model
    from labkit.tp.demos import demo_batch, tolerance

    B = backend.get(backend_name)
    args, n = ModelArgs(**model_args), group.world_size
    max_bs = max(batch_sizes)
    full = build_model(args, max_requests=max_bs, device=B.device)
    part = build_tp_model(args, group, max_requests=max_bs, device=B.device)
    kw = dict(max_bs=max_bs, buckets=sorted(batch_sizes), progress=False)
    graph, tp_graph = DecodeGraphRunner(full, B, **kw), TPDecodeGraphRunner(part, B, **kw)
    graph.capture()
    tp_graph.capture()
    eager, tp_eager = EagerRunner(full), EagerRunner(part)
    fb = {bs: demo_batch(full, bs, seed) for bs in batch_sizes}
    pb = {bs: demo_batch(part, bs, seed) for bs in batch_sizes}
    atol, rtol = tolerance(full.output.weight.dtype)
    diffs = {}
    for bs in batch_sizes:                    # check before timing: a wrong split is no row
        want, got = eager.forward(fb[bs]), tp_graph.replay(pb[bs])
        diffs[bs] = float((got - want).abs().max())
        if not torch.allclose(got, want, atol=atol, rtol=rtol):
            raise RuntimeError(f"tp{n}_graph bs={bs}: logits differ from the 1-rank model by "
                               f"{diffs[bs]:.3g} (atol {atol}, rtol {rtol})")
    contenders = {}
    for bs in batch_sizes:
        contenders[("eager", bs)] = lambda b=fb[bs]: eager.forward(b)
        contenders[("labkit_graph", bs)] = lambda b=fb[bs]: graph.replay(b)
        contenders[(f"tp{n}_eager", bs)] = lambda b=pb[bs]: tp_eager.forward(b)
        contenders[(f"tp{n}_graph", bs)] = lambda b=pb[bs]: tp_graph.replay(b)
    repeats, warmup, calls = (5, 2, 10) if quick else (20, 3, 50)
    if B.name != "cuda":
        repeats, warmup, calls = 3, 1, 3
    timer = round_timer(B, warmup=warmup, repeats=repeats, calls=calls,
                        b2b_repeats=2 if quick else 3)

    def time_one(fn):
        dist.barrier(group=group.cpu_group)   # every rank starts each variant together
        return timer(fn)

    timed = interleave(contenders, time_one, rounds=rounds, seed=seed)
    if group.rank != 0:
        return None
    name = f"gpt_{args.n_layer}L_d{args.dim}"
    config = {**model_args, "dtype": str(full.output.weight.dtype).replace("torch.", "")}
    return [make_row(B, "tp", name, {**config, "ranks": 1 if v in ("eager", "labkit_graph")
                                     else n}, bs, v, None, rounds=timed[(v, bs)],
                     extra={"max_abs_diff_vs_1_rank": round(diffs[bs], 6)}
                     if v.startswith("tp") else None)
            for (v, bs) in contenders]


def run(B, quick: bool = False, log=print, model_args: dict | None = None, batch_sizes=None,
        world_size: int | None = None, rounds: int = DEFAULT_ROUNDS,
        seed: int = 0) -> list[dict]:
    """Time the suite on ``world_size`` ranks (default: :func:`default_world_size` on a
    GPU, 2 gloo ranks on the emulator) and return rank 0's rows, plus skipped tp2 rows
    when only one GPU is visible."""
    from labkit.tp import launch

    on_gpu = B.name == "cuda"
    model_args = dict(model_args or (MODEL if on_gpu else CPU_MODEL))
    batch_sizes = tuple(batch_sizes or ((1, 8, 64) if on_gpu else (1, 2)))
    if world_size is None:
        world_size = default_world_size() if on_gpu else 2
    preflight(world_size, on_gpu, model_args)
    log(f"  {world_size} rank(s) over {'NCCL' if on_gpu else 'gloo (emulated graphs)'}, "
        f"bs {', '.join(map(str, batch_sizes))}, {rounds} interleaved rounds")
    results = launch(_timed_rank, world_size, "nccl" if on_gpu else "gloo",
                     args=("cuda" if on_gpu else "emulated", model_args, batch_sizes, rounds,
                           quick, seed), timeout=600)
    rows = results[0]
    for r in rows:
        log(f"  tp bs={r['batch_size']:3d} {r['variant']:13s} synced {r['median_us']:9.1f} µs"
            f" | back to back {r['back_to_back_us']:9.1f} µs")
    if on_gpu and world_size < 2:
        why = (f"needs 2 GPUs (one per rank), {torch.cuda.device_count()} visible: run "
               "`python -m labkit.bench tp` on a machine with two")
        log(f"  tp2 rows skipped: {why}")
        name = rows[0]["config_name"]
        rows += [skipped_row(B, "tp", name, {**model_args, "ranks": 2}, bs, v, why)
                 for bs in batch_sizes for v in ("tp2_eager", "tp2_graph")]
    return rows
