"""What a replay costs on the emulator, next to running the same step eagerly.

A replay on the CPU runs the recorded ATen ops and nothing else: no Python, no module
``__call__``, no autograd tape. So it should cost no more than the eager step it recorded
(usually less). This is a CPU figure about the emulator, not a GPU speedup.

    python -m labkit.emulator.cost
"""

from __future__ import annotations

import time

import torch


def _best_us(fn, iters: int, rounds: int = 5) -> float:
    for _ in range(max(2, iters // 10)):
        fn()
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        best = min(best, (time.perf_counter() - t0) / iters * 1e6)
    return best


def replay_vs_eager(d_model: int = 64, nhead: int = 4, batch: int = 4, seq: int = 16,
                    iters: int = 200, seed: int = 0) -> dict:
    """Time one fwd+bwd step of a small transformer layer eagerly and as a replay."""
    from labkit import backend
    from labkit.capture import _check_count

    for name, value in (("d_model", d_model), ("nhead", nhead), ("batch", batch),
                        ("seq", seq), ("iters", iters)):
        _check_count(value, name, minimum=1)
    if d_model % nhead:
        raise ValueError(f"d_model={d_model} must be a multiple of nhead={nhead}")

    B = backend.get("emulated")
    torch.manual_seed(seed)
    layer = torch.nn.TransformerEncoderLayer(d_model, nhead, 2 * d_model, dropout=0.0,
                                             batch_first=True)
    params = list(layer.parameters())
    x = torch.randn(batch, seq, d_model, requires_grad=True)

    def step():
        out = layer(x)
        return torch.autograd.grad(out.pow(2).mean(), [x] + params)

    s = B.Stream()
    with B.stream(s):
        for _ in range(3):
            step()
    g = B.CUDAGraph()
    with B.graph(g):
        static_grads = step()
    g.replay()
    same = all(torch.allclose(a, b, atol=1e-6) for a, b in zip(static_grads, step()))
    eager_us = _best_us(step, iters)
    replay_us = _best_us(g.replay, iters)
    return {"ops_recorded": len(g), "eager_us": eager_us, "replay_us": replay_us,
            "ratio": replay_us / eager_us, "results_equal": same,
            "config": dict(d_model=d_model, nhead=nhead, batch=batch, seq=seq),
            "torch": torch.__version__, "threads": torch.get_num_threads()}


def main(argv: list[str] | None = None) -> int:
    import argparse

    def positive(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
        if n < 1:
            raise argparse.ArgumentTypeError(f"must be at least 1, got {n}")
        return n

    ap = argparse.ArgumentParser(
        prog="python -m labkit.emulator.cost",
        description="Time one fwd+bwd step of a small transformer layer eagerly and as an "
                    "emulated graph replay (CPU; no GPU timing).")
    ap.add_argument("--iters", type=positive, default=200, help="timed calls per round")
    args = ap.parse_args(argv)
    r = replay_vs_eager(iters=args.iters)
    print(f"small transformer layer fwd+bwd {r['config']}, torch {r['torch']}, "
          f"{r['threads']} threads")
    print(f"  ops recorded      {r['ops_recorded']}")
    print(f"  eager step        {r['eager_us']:.1f} us")
    print(f"  emulated replay   {r['replay_us']:.1f} us")
    print(f"  replay / eager    {r['ratio']:.2f}   (results equal: {r['results_equal']})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
