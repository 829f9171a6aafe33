"""Toy models for lessons 04 and 05: a pre-norm transformer block and its pieces.

Small enough to train in milliseconds on a CPU through the emulator, real enough to have
what matters for graph capture: matmuls, softmax, layer norms, GELU, residuals, dropout,
and (optionally) Megatron-style fused linears that accumulate straight into
``main_grad``. Everything takes ``(batch, seq, hidden)`` and returns the same shape.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from labkit.bridge import FusedLinear

__all__ = ["TransformerBlock", "make_blocks", "CallCounter"]


def _check_block_args(hidden, heads, ffn, dropout, generator) -> None:
    from labkit.capture import _check_count

    for name, value in (("hidden", hidden), ("heads", heads), ("ffn", ffn)):
        _check_count(value, name, minimum=1)
    if hidden % heads:
        raise ValueError(f"hidden={hidden} must be a multiple of heads={heads} (each head gets "
                         f"hidden // heads features)")
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) \
            or not 0 <= dropout < 1:
        raise ValueError(f"dropout is a probability in [0, 1), got {dropout!r}")
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator or None, got "
                        f"{type(generator).__name__}")


class TransformerBlock(nn.Module):
    """Pre-norm block: ``x + Attn(LN(x))`` then ``h + MLP(LN(h))``.

    ``fused=True`` builds its linears as :class:`~labkit.bridge.FusedLinear`
    (gradient-accumulation fusion into ``main_grad``). ``dropout`` applies to the
    attention probabilities and the MLP output; ``generator`` makes the MLP dropout draw
    from a custom ``torch.Generator`` (as Megatron's RNG tracker does), which a graph
    must register.
    """

    def __init__(self, hidden: int = 32, heads: int = 4, ffn: int = 64, dropout: float = 0.0,
                 fused: bool = False, generator: torch.Generator | None = None):
        super().__init__()
        _check_block_args(hidden, heads, ffn, dropout, generator)
        lin = FusedLinear if fused else nn.Linear
        self.heads = heads
        self.ln1 = nn.LayerNorm(hidden)
        self.qkv = lin(hidden, 3 * hidden)
        self.proj = lin(hidden, hidden)
        self.ln2 = nn.LayerNorm(hidden)
        self.fc1 = lin(hidden, ffn)
        self.fc2 = lin(ffn, hidden)
        self.p = dropout
        self.generator = generator

    def _dropout(self, x, gen=None):
        if not self.training or self.p == 0.0:
            return x
        if gen is None:
            return nn.functional.dropout(x, self.p, True)
        keep = torch.rand(x.shape, device=x.device, dtype=x.dtype, generator=gen) >= self.p
        return x * keep / (1.0 - self.p)

    def forward(self, x):
        b, s, h = x.shape
        d = h // self.heads
        q, k, v = self.qkv(self.ln1(x)).split(h, dim=-1)
        q, k, v = (t.reshape(b, s, self.heads, d).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-1, -2)) / math.sqrt(d)
        causal = torch.ones(s, s, dtype=torch.bool, device=x.device).triu(1)
        att = att.masked_fill(causal, float("-inf")).softmax(-1)
        att = self._dropout(att)
        y = (att @ v).transpose(1, 2).reshape(b, s, h)
        x = x + self.proj(y)
        m = self.fc2(nn.functional.gelu(self.fc1(self.ln2(x))))
        return x + self._dropout(m, self.generator)


def make_blocks(n: int, seed: int = 0, device=None, **kw) -> nn.ModuleList:
    """``n`` blocks with deterministic weights (same ``seed`` → same model)."""
    from labkit.capture import _check_count

    _check_count(n, "n (the number of blocks)", minimum=1)
    g = torch.random.fork_rng(devices=[])
    with g:
        torch.manual_seed(seed)
        blocks = nn.ModuleList(TransformerBlock(**kw) for _ in range(n))
    return blocks.to(device) if device is not None else blocks


class CallCounter(nn.Module):
    """Wraps a module and counts its forwards in a *buffer*, like a router's running
    statistics or Megatron MoE's ``expert_bias``: state a forward graph updates in place,
    and warmup must not pollute."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        if not isinstance(inner, nn.Module):
            raise TypeError(f"CallCounter wraps a module, got {type(inner).__name__}")
        self.inner = inner
        self.register_buffer("calls", torch.zeros((), dtype=torch.float32))

    def forward(self, x):
        self.calls.add_(1)
        return self.inner(x)
