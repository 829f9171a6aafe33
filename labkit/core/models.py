"""The toy models the training lessons graph.

Lessons 04 and 05 (and the pipeline) use :class:`TransformerBlock`: a pre-norm block with
what matters for capture (matmuls, softmax, layer norms, GELU, residuals, dropout, and
optionally Megatron-style fused linears that accumulate into ``main_grad``), taking and
returning ``(batch, seq, hidden)``. :class:`CallCounter` adds a buffer a forward updates.
Lesson 07 and the benchmark train :class:`TinyLM`, a small causal language model built
by :func:`build_lm` from an :class:`LMConfig`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from labkit.core.main_grad import FusedLinear
from labkit.core.validate import check_int

__all__ = ["TransformerBlock", "make_blocks", "CallCounter", "LMConfig", "CONFIGS", "Block",
           "TinyLM", "build_lm", "lm_loss", "random_microbatches"]


# ---- the block lessons 04 and 05 graph --------------------------------------------------

def _check_block_args(hidden, heads, ffn, dropout, generator) -> None:
    for name, value in (("hidden", hidden), ("heads", heads), ("ffn", ffn)):
        check_int(name, value, minimum=1)
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

    ``fused=True`` builds its linears as :class:`~labkit.core.main_grad.FusedLinear`
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
    check_int("n (the number of blocks)", n, minimum=1)
    # Built on the host from the host generator (the same weights whatever
    # torch.set_default_device says), then put on ``device`` (default: torch's default device).
    with torch.random.fork_rng(devices=[]), torch.device("cpu"):
        torch.manual_seed(seed)
        blocks = nn.ModuleList(TransformerBlock(**kw) for _ in range(n))
    return blocks.to(device if device is not None else torch.get_default_device())


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


# ---- the language model lesson 07 and the benchmark train -------------------------

@dataclass(frozen=True)
class LMConfig:
    """A small causal language model and the shape of one training step."""

    vocab_size: int = 64
    d_model: int = 32
    n_layers: int = 2
    n_heads: int = 4
    seq_len: int = 16
    micro_batch: int = 2          # sequences per microbatch
    num_microbatches: int = 2     # microbatches per step (gradient accumulation)

    @property
    def tokens_per_step(self) -> int:
        return self.micro_batch * self.seq_len * self.num_microbatches


CONFIGS = {
    # CPU tests and the notebook on the emulator: a step takes milliseconds.
    "tiny": LMConfig(),
    # The benchmark (labkit.bench train): 6 layers, d=256, 4 microbatches of 4x64 tokens.
    "bench": LMConfig(vocab_size=1024, d_model=256, n_layers=6, n_heads=4, seq_len=64,
                      micro_batch=4, num_microbatches=4),
}


class Block(nn.Module):
    """One pre-norm transformer layer with its causal mask, callable as ``block(x)``.

    The mask lives in a buffer and is passed inside ``forward``, so a block takes one
    tensor and returns one: the shape ``make_graphed_callables`` graphs layer by layer
    (the ``torch_make_graphed_callables`` row of the benchmark). No biases, as in most
    current LLMs; it also removes the key bias, whose gradient is zero in exact
    arithmetic (softmax ignores a constant shift) but rounding noise in practice, noise
    that Adam would scale up to a full ``lr``-sized step and make runs hard to compare.
    """

    def __init__(self, d_model: int, n_heads: int, seq_len: int):
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(d_model, n_heads, 4 * d_model, dropout=0.0,
                                                batch_first=True, norm_first=True, bias=False)
        self.register_buffer("causal_mask",
                             nn.Transformer.generate_square_subsequent_mask(seq_len),
                             persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x, src_mask=self.causal_mask, is_causal=True)


class TinyLM(nn.Module):
    """Embedding → ``n_layers`` × :class:`Block` → LayerNorm → vocabulary head."""

    def __init__(self, cfg: LMConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Parameter(torch.randn(cfg.seq_len, cfg.d_model) * 0.02)
        self.blocks = nn.ModuleList(Block(cfg.d_model, cfg.n_heads, cfg.seq_len)
                                    for _ in range(cfg.n_layers))
        self.norm = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if tokens.dim() != 2 or tokens.shape[-1] != self.cfg.seq_len:
            raise ValueError(
                f"TinyLM expects tokens of shape (batch, seq_len={self.cfg.seq_len}), got "
                f"{tuple(tokens.shape)}: its position table and causal masks are built for "
                f"seq_len={self.cfg.seq_len}. Build the model for this length "
                f"(build_lm(cfg, seq_len={tokens.shape[-1] if tokens.dim() else '...'})) or "
                "pad/cut the sequences.")
        if tokens.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"TinyLM expects integer token ids (int64), got {tokens.dtype}")
        x = self.embed(tokens) + self.pos
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def build_lm(cfg: LMConfig | str = "tiny", device=None, seed: int = 0, **overrides) -> TinyLM:
    """A seeded :class:`TinyLM` on ``device`` (fp32). Same seed, same weights."""
    if isinstance(cfg, str):
        if cfg not in CONFIGS:
            raise ValueError(f"unknown config {cfg!r}: choose one of {', '.join(CONFIGS)} "
                             "or pass an LMConfig")
        cfg = CONFIGS[cfg]
    cfg = replace(cfg, **overrides) if overrides else cfg
    with torch.random.fork_rng(devices=[]), torch.device("cpu"):   # the same weights on
        torch.manual_seed(seed)                                       # every default device
        model = TinyLM(cfg)
    return model.to(device if device is not None else "cpu")


def lm_loss(model: nn.Module, microbatch) -> torch.Tensor:
    """Next-token cross-entropy of one microbatch ``(tokens, targets)``."""
    if not isinstance(microbatch, (tuple, list)) or len(microbatch) != 2:
        what = (f"a {type(microbatch).__name__} of {len(microbatch)}"
                if isinstance(microbatch, (tuple, list)) else f"a {type(microbatch).__name__}")
        raise ValueError(f"lm_loss expects a microbatch (tokens, targets), got {what}: "
                         "give every microbatch its targets (random_microbatches makes pairs)")
    tokens, targets = microbatch
    if tokens.shape != targets.shape:
        raise ValueError(f"lm_loss: targets of shape {tuple(targets.shape)} for tokens of "
                         f"shape {tuple(tokens.shape)}: each token needs its target (the next "
                         "token), so both have the shape (batch, seq_len)")
    logits = model(tokens)
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def random_microbatches(cfg: LMConfig | str, generator: torch.Generator | None = None,
                        device=None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One step of random token data: ``num_microbatches`` pairs ``(tokens, targets)``,
    each ``(micro_batch, seq_len)`` int64, targets = tokens shifted by one. Drawn where
    ``generator`` lives (the host's generator by default), whatever torch's default device,
    then put on ``device`` (default: torch's default device)."""
    if isinstance(cfg, str):
        if cfg not in CONFIGS:
            raise ValueError(f"unknown config {cfg!r}: choose one of {', '.join(CONFIGS)} "
                             "or pass an LMConfig")
        cfg = CONFIGS[cfg]
    drawn_on = generator.device if generator is not None else "cpu"
    out = []
    for _ in range(cfg.num_microbatches):
        seq = torch.randint(0, cfg.vocab_size, (cfg.micro_batch, cfg.seq_len + 1),
                            generator=generator, device=drawn_on)
        seq = seq.to(device if device is not None else torch.get_default_device())
        out.append((seq[:, :-1].contiguous(), seq[:, 1:].contiguous()))
    return out
