"""What a replay costs on the CPU emulator, next to running the same step eagerly.

The layer and its input live on the emulator's device (``B.device``), as they would on a
GPU, and both the eager step and the replay run there. A replay on the emulator runs the
recorded ATen ops and nothing else (no Python, no module ``__call__``, no autograd tape),
so it should cost no more than the eager step it recorded. The same step is also timed
eagerly on plain CPU tensors, which skip the emulated device's per-op wrapping: what the
device itself adds. This is a CPU figure about the emulator, not a GPU speedup; it is not
one of the GPU suites of ``python -m labkit.bench``.

    python -m labkit.bench.emulator_cost [--iters N]
"""

from __future__ import annotations

import argparse
import copy

import torch

from labkit import backend
from labkit.core.timing import measure_us
from labkit.core.validate import check_int

__all__ = ["replay_vs_eager", "main"]


def replay_vs_eager(d_model: int = 64, nhead: int = 4, batch: int = 4, seq: int = 16,
                    iters: int = 200, seed: int = 0) -> dict:
    """Time one fwd+bwd step of a small transformer layer eagerly and as an emulated replay,
    both on the emulator's device, and eagerly on plain CPU tensors.

    Args:
        d_model, nhead, batch, seq: the layer and its input; ``d_model`` a multiple of
            ``nhead``.
        iters: calls per timed sample (five samples, the median).
        seed: for the layer's weights and input.

    Returns:
        ``eager_us`` and ``replay_us`` (µs per step on the emulator's device), their
        ``ratio``, ``eager_cpu_us`` (µs per eager step on plain CPU tensors),
        ``ops_recorded`` (ATen ops in the graph), ``results_equal`` (replay's gradients
        match eager's), the ``config``, the ``torch`` version and the CPU ``threads``.
    """
    for name, value in (("d_model", d_model), ("nhead", nhead), ("batch", batch),
                        ("seq", seq), ("iters", iters)):
        check_int(name, value, 1)
    if d_model % nhead:
        raise ValueError(f"d_model={d_model} must be a multiple of nhead={nhead}")

    B = backend.get("emulated")
    torch.manual_seed(seed)
    cpu_layer = torch.nn.TransformerEncoderLayer(d_model, nhead, 2 * d_model, dropout=0.0,
                                                 batch_first=True)
    cpu_x = torch.randn(batch, seq, d_model, requires_grad=True)
    # a graph records the device's work only: the layer and its input go to B.device
    layer = copy.deepcopy(cpu_layer).to(B.device)
    x = cpu_x.detach().to(B.device).requires_grad_()

    def make_step(layer, x):
        params = list(layer.parameters())

        def step():
            out = layer(x)
            return torch.autograd.grad(out.pow(2).mean(), [x] + params)
        return step

    step, cpu_step = make_step(layer, x), make_step(cpu_layer, cpu_x)

    s = B.Stream()
    with B.stream(s):
        for _ in range(3):
            step()
    g = B.CUDAGraph()
    with B.graph(g):
        static_grads = step()
    g.replay()
    same = all(torch.allclose(a, b, atol=1e-6) for a, b in zip(static_grads, step()))
    warmup = max(2, iters // 10)
    eager_us = measure_us(step, B, warmup=warmup, repeats=5, inner=iters)
    replay_us = measure_us(g.replay, B, warmup=warmup, repeats=5, inner=iters)
    eager_cpu_us = measure_us(cpu_step, B, warmup=warmup, repeats=5, inner=iters)
    return {"ops_recorded": len(g), "eager_us": eager_us, "replay_us": replay_us,
            "ratio": replay_us / eager_us, "eager_cpu_us": eager_cpu_us,
            "results_equal": same,
            "config": dict(d_model=d_model, nhead=nhead, batch=batch, seq=seq),
            "torch": torch.__version__, "threads": torch.get_num_threads()}


def _positive(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {n}")
    return n


def main(argv: list[str] | None = None, prog: str = "python -m labkit.bench.emulator_cost") -> int:
    ap = argparse.ArgumentParser(
        prog=prog,
        description="Time one fwd+bwd step of a small transformer layer eagerly and as an "
                    "emulated graph replay on the emulator's device, and eagerly on plain "
                    "CPU tensors (CPU; no GPU timing).")
    ap.add_argument("--iters", type=_positive, default=200, help="timed calls per sample")
    args = ap.parse_args(argv)
    r = replay_vs_eager(iters=args.iters)
    print(f"small transformer layer fwd+bwd {r['config']}, torch {r['torch']}, "
          f"{r['threads']} threads")
    print(f"  ops recorded      {r['ops_recorded']}")
    print(f"  eager step        {r['eager_us']:.1f} us")
    print(f"  emulated replay   {r['replay_us']:.1f} us")
    print(f"  replay / eager    {r['ratio']:.2f}   (results equal: {r['results_equal']})")
    print(f"  eager, plain CPU  {r['eager_cpu_us']:.1f} us   (no emulated device)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
