"""What lesson 10's collectives section runs on every rank (module-level functions, so
:func:`labkit.tp.launch` can start them in new processes), and the tolerance it states.

:func:`compare_with_one_rank` is the lesson's claim as a function: one rank's share of the
model, captured per bucket with its all-reduces inside the graphs, gives the 1-rank
model's logits (within :data:`TOLERANCE`) and exactly its greedy tokens.
:func:`mismatched_capture` and :func:`unwaited_capture` are two ways to break the rules.
"""

from __future__ import annotations

import torch

from labkit import backend as _backend
from labkit.decode import (
    EagerRunner,
    build_model,
    make_decode_batch,
    serve,
    synthetic_workload,
)

from .comm import TPGroup, all_reduce, check_same_collectives, record_collectives
from .model import build_tp_model
from .runner import TPDecodeGraphRunner

__all__ = ["TOLERANCE", "tolerance", "compare_with_one_rank", "mismatched_capture",
           "unwaited_capture", "rank_dependent_buckets", "capture_while_thread_allocates",
           "demo_batch"]

#: (atol, rtol) of the split model's logits against the 1-rank model's, per dtype: the
#: split sums the same products in another order (per-rank partial sums, then the
#: all-reduce), so the last bits differ; the greedy tokens must not.
TOLERANCE = {torch.float32: (1e-4, 1e-4), torch.float16: (2e-2, 1e-2),
             torch.bfloat16: (1e-1, 5e-2)}


def tolerance(dtype: torch.dtype) -> tuple[float, float]:
    """(atol, rtol) for logits of a model in ``dtype`` (see :data:`TOLERANCE`)."""
    return TOLERANCE[dtype]


def demo_batch(model, bs: int, seed: int = 0):
    """A DECODE batch of ``bs`` requests at random positions, the same on every rank."""
    gen = torch.Generator().manual_seed(seed)
    a = model.args
    tokens = torch.randint(0, a.vocab_size, (bs,), generator=gen).tolist()
    starts = torch.randint(4, a.max_seq_len - 1, (bs,), generator=gen).tolist()
    return make_decode_batch(model, list(range(1, bs + 1)), tokens, starts)


def _fill_caches(model, seed: int = 0) -> None:
    """Random K/V in every slot, the same numbers in the 1-rank model and (cut by heads)
    in every rank's share: attention then reads something other than zeros."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in model.layers:
            kv = layer.attention.kv_cache.kv
            kv.copy_(torch.randn(kv.shape, generator=gen).to(kv.dtype))


def _shard_caches(full, part, group: TPGroup) -> None:
    with torch.no_grad():
        for lf, lp in zip(full.layers, part.layers):
            h = lp.attention.n_kv
            lp.attention.kv_cache.kv.copy_(
                lf.attention.kv_cache.kv[:, :, group.rank * h:(group.rank + 1) * h])


def compare_with_one_rank(group: TPGroup, backend: str = "emulated", config="tiny",
                          max_bs: int = 4, batch_sizes=(1, 3), num_requests: int = 6,
                          max_new_tokens: int = 6, dtype: str | None = None) -> dict:
    """Run on every rank: the split model, captured per bucket, against the 1-rank model.
    ``dtype``: ``"float32"``, ``"float16"``, ``"bfloat16"`` or None (build_model's
    default: fp16 on a GPU, fp32 on the emulator).

    Returns (for this rank): ``max_abs_diff`` per batch size (graph replay of the split
    model vs the 1-rank model run eagerly), ``allclose`` under :data:`TOLERANCE`,
    ``tokens_equal`` (a served workload, greedy, split model graphed vs 1-rank eager),
    ``buckets``, and ``collectives``: bucket → what this rank captured into its graph.
    """
    B = _backend.get(backend)
    if dtype not in (None, "float32", "float16", "bfloat16"):
        raise ValueError(f"dtype must be 'float32', 'float16', 'bfloat16' or None, got "
                         f"{dtype!r}")
    dt = getattr(torch, dtype) if dtype else None
    full = build_model(config, max_requests=max_bs, device=B.device, dtype=dt)
    part = build_tp_model(config, group, max_requests=max_bs, device=B.device, dtype=dt)
    _fill_caches(full)
    _shard_caches(full, part, group)
    runner = TPDecodeGraphRunner(part, B, max_bs=max_bs, progress=False)
    runner.capture()
    ref = EagerRunner(full)
    atol, rtol = tolerance(full.output.weight.dtype)
    diffs, close = {}, {}
    for bs in batch_sizes:
        want = ref.forward(demo_batch(full, bs))
        got = runner.replay(demo_batch(part, bs)).clone()
        diffs[bs] = float((got - want).abs().max())
        close[bs] = bool(torch.allclose(got, want, atol=atol, rtol=rtol))
    wl = synthetic_workload(num_requests, vocab_size=full.args.vocab_size,
                            max_seq_len=full.args.max_seq_len, prompt_len=(2, 8),
                            output_len=(2, max_new_tokens))
    want = serve(full, wl, max_running=max_bs).tokens
    got = serve(part, wl, runner=runner, max_running=max_bs).tokens
    recorded = {bs: sum("all_reduce" in op for op in g.recorded_ops())
                for bs, g in runner.backend.graphs.items()} if B.name == "emulated" else None
    return {"rank": group.rank, "world_size": group.world_size, "backend": B.name,
            "recorded_all_reduces": recorded,
            "dtype": str(full.output.weight.dtype).replace("torch.", ""),
            "buckets": list(runner.buckets), "max_abs_diff": diffs, "allclose": close,
            "tokens_equal": got == want, "graph_replays": runner.stats["graph"],
            "collectives": {bs: list(sig) for bs, sig in runner.signatures.items()}}


def rank_dependent_buckets(group: TPGroup, backend: str = "emulated") -> list[int]:
    """Each rank picks its own ``max_bs`` (as a server that sizes its graphs from the free
    memory of its GPU would): the runner's check refuses before any warmup runs a
    collective, on every rank, naming each rank's list."""
    B = _backend.get(backend)
    part = build_tp_model("tiny", group, max_requests=8, device=B.device)
    runner = TPDecodeGraphRunner(part, B, max_bs=2 + 2 * group.rank, progress=False)
    runner.capture()
    return list(runner.buckets)


def _capture(B, fn):
    g = B.CUDAGraph()
    s = B.Stream()
    with record_collectives() as captured, B.graph(g, stream=s):
        out = fn()
    return g, out, captured


def mismatched_capture(group: TPGroup, backend: str = "emulated", check: bool = True):
    """Rank 0 captures one all-reduce, the others two (a rank-dependent branch). With
    ``check`` the signatures are compared after capture, which raises
    :class:`~labkit.tp.comm.CollectiveMismatchError` on every rank; without it the
    graphs are replayed, and the ranks with two wait for a partner (until the process
    group's timeout on gloo; forever on NCCL)."""
    B = _backend.get(backend)
    x = torch.ones(4, device=B.device)

    def step():
        y = all_reduce(x, group)
        if group.rank > 0:            # the mistake: a branch that differs between ranks
            y = all_reduce(y, group)
        return y

    g, out, captured = _capture(B, step)
    if check:
        check_same_collectives(captured, group, "the mismatched graph")
    g.replay()
    B.synchronize()
    return out.cpu().tolist()


def unwaited_capture(group: TPGroup, backend: str = "emulated"):
    """Capture a functional all-reduce whose result is never waited for, replay it, and
    return the result (the emulator records it like any collective; on an H200, one NCCL
    rank, the capture did not raise CUDA's unjoined-work error)."""
    B = _backend.get(backend)
    x = torch.ones(4, device=B.device)

    def step():
        return torch.ops._c10d_functional.all_reduce(x * 2, "sum", group.group_name)

    g, out, _ = _capture(B, step)
    g.replay()
    B.synchronize()
    return out.cpu().tolist()


def capture_while_thread_allocates(group: TPGroup, backend: str = "emulated",
                                   capture_error_mode: str = "global", nbytes: int = 1 << 22):
    """Capture the split model's decode graphs while another thread of this process
    allocates device memory on a stream of its own (a loader, a metrics thread). Under
    ``"global"`` its ``cudaMalloc`` is refused and the capture fails; ``"thread_local"``
    leaves other threads alone. Returns the replayed logits' shape."""
    import threading

    B = _backend.get(backend)
    part = build_tp_model("tiny", group, max_requests=2, device=B.device)
    runner = TPDecodeGraphRunner(part, B, max_bs=2, buckets=[2], progress=False,
                                 capture_error_mode=capture_error_mode)
    started, done, errors = threading.Event(), threading.Event(), []

    def other_thread():
        s = B.Stream()
        started.wait()
        try:
            with B.stream(s):
                torch.empty(nbytes, dtype=torch.uint8, device=B.device)
        except Exception as exc:       # what CUDA says to the other thread
            errors.append(exc)
        done.set()

    t = threading.Thread(target=other_thread)
    t.start()
    original = runner.backend.capture_one

    def capture_one(key, fn, hook=None):
        def forward():
            if B.is_current_stream_capturing():
                started.set()
                done.wait(10)
            return fn()
        return original(key, forward, hook)

    runner.backend.capture_one = capture_one
    try:
        runner.capture()
    finally:
        started.set()
        t.join()
    out = runner.replay(demo_batch(part, 2))
    return {"shape": tuple(out.shape), "other_thread_errors": [str(e)[:80] for e in errors]}
