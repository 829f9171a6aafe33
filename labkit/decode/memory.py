"""The memory bill of many buckets: what each captured decode graph keeps, and why.

Lesson 10's engine. :func:`measure_bill` captures lesson 06's decode model for a list of
buckets, one graph per bucket, the way a pool layout and a capture order say, and reads
the graph memory pools after every capture:

* ``pools="shared"``: one ``graph_pool_handle()`` for every bucket (SGLang's runner,
  ``cuda_graph_runner.py``, captures into one global pool), captured in ``order``;
* ``pools="private"``: a new pool per bucket (``B.graph(g)`` without ``pool=``).

On a GPU a pool's bytes are read from ``torch.cuda.memory_snapshot()``: the segments whose
``segment_pool_id`` is the pool's handle, ``total_size`` summed (reserved) and
``allocated_size`` summed (live blocks) (``labkit.backend``'s ``pool_stats``). On the
emulator the same two figures come from :mod:`labkit.emulator.pool`, which carves its
pools as ``CUDACachingAllocator`` does (512-byte rounding, 2 MiB segments for requests up
to 1 MiB, 20 MiB segments up to 10 MiB, larger ones rounded to 2 MiB, best fit, split and
coalesce), so reserved and allocated mean the same thing on both backends.

.. warning::
    What the emulator cannot show, and the GPU figures (``tools/memory_sweep.py``) do:
    the cuBLAS workspace (torch allocates one per (cuBLAS handle, stream) from the caching
    allocator, 32 MiB on a Hopper GPU by ``parseChosenWorkspaceSize`` in
    ``aten/src/ATen/cuda/CublasHandlePool.cpp``; labkit's captures allocate it from the
    graph's own pool, :func:`labkit.capture.own_cublas_workspace`, so every new pool pays
    one); ``expandable_segments`` (the emulator's segments never grow in place); and the
    memory of the kernels themselves (the GPU's context, Triton's and cuBLAS's code). Its
    tensors are the model's own, with the model's shapes and dtypes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from labkit.backend import ensure as ensure_backend
from labkit.capture import capturing
from labkit.core.validate import check_int

from .batch import check_model
from .buckets import default_buckets, make_buckets, pow2_buckets

__all__ = ["POOLS", "ORDERS", "BucketRow", "Bill", "measure_bill", "bucket_lists",
           "custom_buckets", "bill_table", "stored_sweep"]

#: pool layouts :func:`measure_bill` knows
POOLS = ("shared", "private")
#: capture orders :func:`measure_bill` knows
ORDERS = ("largest_first", "smallest_first")


@dataclass
class BucketRow:
    """One captured bucket: how long it took and what the pools held after it."""

    bs: int
    seconds: float                 # warm-ups + capture
    reserved_bytes: int            # every pool of the bill, after this capture
    allocated_bytes: int
    reserved_delta_bytes: int      # what this capture added
    allocated_delta_bytes: int
    output_bytes: int              # the graph's static output (bs x vocab logits)


@dataclass
class Bill:
    """What capturing ``buckets`` cost, one :class:`BucketRow` per bucket in capture order."""

    backend: str
    model: str
    dtype: str
    buckets: list[int]
    pools: str
    order: str
    alias_outputs: bool
    rows: list[BucketRow] = field(default_factory=list)
    num_pools: int = 0
    outside_bytes: int = 0         # the shared output buffer of alias_outputs (not in a pool)
    # GPU: torch.cuda.memory_reserved() after the captures minus before (None: emulator).
    # Device-wide: memory other pools gave back meanwhile (each capture empties the cache)
    # counts too, so it is a cross-check of the pools' figures, not a bound.
    device_reserved_delta_bytes: int | None = None

    @property
    def reserved_bytes(self) -> int:
        return self.rows[-1].reserved_bytes if self.rows else 0

    @property
    def allocated_bytes(self) -> int:
        return self.rows[-1].allocated_bytes if self.rows else 0

    @property
    def capture_seconds(self) -> float:
        return sum(r.seconds for r in self.rows)

    @property
    def label(self) -> str:
        alias = ", outputs aliased" if self.alias_outputs else ""
        return f"{self.pools} pool{'s' if self.pools == 'private' else ''}, {self.order}{alias}"

    def as_row(self) -> dict:
        """A JSON-ready summary (what ``tools/memory_sweep.py`` stores)."""
        return {"backend": self.backend, "model": self.model, "dtype": self.dtype,
                "buckets": list(self.buckets), "graphs": len(self.buckets),
                "pools": self.pools, "order": self.order, "alias_outputs": self.alias_outputs,
                "num_pools": self.num_pools, "reserved_bytes": self.reserved_bytes,
                "outside_bytes": self.outside_bytes,
                "device_reserved_delta_bytes": self.device_reserved_delta_bytes,
                "allocated_bytes": self.allocated_bytes,
                "capture_seconds": round(self.capture_seconds, 4),
                "per_bucket": [vars(r) | {"seconds": round(r.seconds, 4)} for r in self.rows]}


def custom_buckets(max_bs: int) -> list[int]:
    """The lesson's own list: few graphs, spaced by 4x (1, 4, 16, 64, ...), ``max_bs`` in."""
    max_bs = check_int("max_bs", max_bs, 1)
    out, b = [], 1
    while b < max_bs:
        out.append(b)
        b *= 4
    return out + [max_bs]


def bucket_lists(max_bs: int) -> dict[str, list[int]]:
    """The three lists the lesson compares for ``max_bs``: SGLang's default, powers of two
    and :func:`custom_buckets`."""
    return {"sglang": default_buckets(max_bs), "pow2": pow2_buckets(max_bs),
            "custom": custom_buckets(max_bs)}


def _check_choice(name: str, value, choices: tuple) -> str:
    if value not in choices:
        raise ValueError(f"{name}={value!r}: choose one of {', '.join(map(repr, choices))}")
    return value


def _pool_totals(B, pools: list) -> tuple[int, int]:
    """Reserved and allocated bytes summed over ``pools`` (on a GPU: one snapshot read)."""
    if B.name == "cuda":
        keys = {tuple(p) for p in pools}
        segs = [s for s in torch.cuda.memory_snapshot()
                if tuple(s.get("segment_pool_id", (0, 0))) in keys]
        return (sum(s["total_size"] for s in segs), sum(s["allocated_size"] for s in segs))
    reserved = allocated = 0
    for p in pools:
        st = B.pool_stats(p)
        reserved += int(st.get("reserved_bytes", 0))
        allocated += int(st.get("allocated_bytes", 0))
    return reserved, allocated


def _aliased(fn, buf: torch.Tensor):
    """``fn`` whose logits land in the head of one buffer shared by every bucket."""
    def run():
        out = fn()
        buf[:out.shape[0]].copy_(out)
        return buf[:out.shape[0]]
    return run


def measure_bill(model, B, buckets, *, pools: str = "shared", order: str = "largest_first",
                 alias_outputs: bool = False, num_warmups: int = 2,
                 model_name: str = "") -> Bill:
    """Capture one decode graph per bucket and measure the graph pools after each.

    Args:
        model: lesson 06's decode model (``labkit.decode.build_model``), with at least
            ``max(buckets)`` request slots.
        B: the backend (``labkit.backend.get(...)``).
        buckets: a scheme name (``"sglang"``, ``"pow2"``, ...) for the model's slots, or the
            sizes themselves.
        pools: ``"shared"`` (one pool for all) or ``"private"`` (one pool per bucket).
        order: ``"largest_first"`` (SGLang's: the smaller graphs reuse the blocks the larger
            one freed) or ``"smallest_first"``.
        alias_outputs: every graph writes its logits into one ``max_bs``-row buffer made
            before capture, outside the pools, so the graphs' outputs alias each other
            instead of each keeping its own block (one bucket replays at a time, and its
            caller reads the rows before the next replay). Costs one copy per replay.
        num_warmups: warm-ups per bucket before its capture (as the runner does).
        model_name: a label for the bill.

    Returns:
        A :class:`Bill`. The graphs are released before it returns.

    .. warning::
        Pools are process-wide: the figures are those of the pools this call made, not of
        the device. A pool's memory goes back to the device only when its graphs are gone
        and the cache is emptied (``torch.cuda.empty_cache()`` on a GPU).
    """
    from .runner import DecodeGraphRunner

    check_model(model, "measure_bill")
    B = ensure_backend(B, "measure_bill(model, B, ...)")
    _check_choice("pools", pools, POOLS)
    _check_choice("order", order, ORDERS)
    if not isinstance(alias_outputs, bool):
        raise TypeError(f"alias_outputs must be True or False, got {alias_outputs!r:.40}")
    num_warmups = check_int("num_warmups", num_warmups, 1,
                            fix="warm up at least once: lazy init must not run in capture")
    slots = model.num_slots - 1
    blist = make_buckets(slots, buckets)
    runner = DecodeGraphRunner(model, B, max_bs=blist[-1], buckets=blist, progress=False)
    bill = Bill(B.name, model_name, str(model.output.weight.dtype).replace("torch.", ""),
                blist, pools, order, alias_outputs)
    vocab = model.args.vocab_size
    buf = (torch.empty(blist[-1], vocab, device=B.device, dtype=model.output.weight.dtype)
           if alias_outputs else None)
    bill.outside_bytes = 0 if buf is None else buf.numel() * buf.element_size()
    keep, used = [], []
    shared = B.graph_pool_handle() if pools == "shared" else None
    stream = B.Stream()
    before = (0, 0)
    device_before = torch.cuda.memory_reserved(B.device) if B.name == "cuda" else None
    try:
        with torch.no_grad():
            for bs in sorted(blist, reverse=order == "largest_first"):
                t0 = time.perf_counter()
                fn = runner.capture_prepare(bs)
                if buf is not None:
                    fn = _aliased(fn, buf)
                for _ in range(num_warmups):
                    B.synchronize()
                    with B.stream(stream):
                        fn()
                B.synchronize()
                pool = shared if shared is not None else B.graph_pool_handle()
                g = B.CUDAGraph()
                with capturing(B, g, pool=pool, stream=stream):
                    out = fn()
                B.synchronize()
                secs = time.perf_counter() - t0
                keep.append((g, out))
                if tuple(g.pool()) not in used:
                    used.append(tuple(g.pool()))
                now = _pool_totals(B, used)
                bill.rows.append(BucketRow(bs, secs, now[0], now[1], now[0] - before[0],
                                           now[1] - before[1],
                                           out.numel() * out.element_size()))
                before = now
        bill.num_pools = len(used)
        if device_before is not None:
            bill.device_reserved_delta_bytes = torch.cuda.memory_reserved(B.device) - device_before
    finally:
        for g, _ in keep:
            g.reset()
        keep.clear()
    return bill


def bill_table(bills: list[Bill], unit: int = 2**20) -> str:
    """One line per bill: graphs, pools, reserved and allocated (MiB) in the pools, and the
    bytes kept outside them (the shared output buffer of ``alias_outputs``)."""
    lines = [f"{'layout':44s}{'graphs':>7s}{'pools':>6s}{'reserved MiB':>14s}"
             f"{'allocated MiB':>15s}{'outside MiB':>13s}"]
    for b in bills:
        lines.append(f"{b.label:44s}{len(b.buckets):7d}{b.num_pools:6d}"
                     f"{b.reserved_bytes / unit:14.2f}{b.allocated_bytes / unit:15.3f}"
                     f"{b.outside_bytes / unit:13.3f}")
    return "\n".join(lines)


def stored_sweep(path=None) -> dict | None:
    """The GPU sweep ``tools/memory_sweep.py`` stored (``labkit/bench/data/memory.json``, a
    copy of ``docs/benchmarks/memory.json``), or None when none is stored yet."""
    import json
    from pathlib import Path

    default = Path(__file__).parents[1] / "bench" / "data" / "memory.json"
    p = Path(path) if path is not None else default
    if not p.exists():
        return None
    return json.loads(p.read_text())
