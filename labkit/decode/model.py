"""A tiny GPT in gpt-fast's shape, with a KV cache whose address never moves.

Read it top to bottom in one sitting: a dataclass config, RMSNorm, rotary embeddings,
attention, an MLP, the block, the model. Two things differ from gpt-fast, both because
lesson 06 serves *many requests at once* the way SGLang does:

* The KV cache is one **token pool** per layer, ``(num_slots * max_seq_len, 2, n_kv, head_dim)``
  (a token's key and value side by side; ``k_cache`` / ``v_cache`` are its two halves),
  registered as buffers at ``setup_caches`` time. A request owns a *slot* (a row of
  ``req_to_token``) and each of its tokens a *location* in the pool. The buffers are
  allocated once, so every CUDA graph captured later reads and writes the same addresses.
  Slot 0 is reserved as the **dummy slot**: padded rows of a bucket (and the warmup runs
  before capture) write their throw-away K/V there, never into a live request.
* Attention itself lives in :mod:`labkit.decode.attention` (SGLang's "attention backend"),
  because the part that CUDA graphs care about — how a batch of requests finds its keys —
  is exactly the part that changes between prefill and decode.

Kernel count matters here: a decode step is launch-bound, and even inside a CUDA graph
every kernel node costs the GPU a gap of its own. So the hot path is written to launch few:
a fused ``F.rms_norm``, one ``wqkv`` GEMM whose output stays in place (query and key heads
rotated together, in place, by one complex multiply; keys and values stored with one
scatter), ``w1``/``w3`` as one ``w13`` GEMM. The numbers are those of the textbook formulas.

The model's forward is ``model(input_ids, positions, batch) -> logits``: tokens are flat
(``num_tokens``), ``batch`` (a :class:`~labkit.decode.batch.ForwardBatch`) says which
request each token belongs to and where its K/V goes.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.fx
import torch.nn as nn
import torch.nn.functional as F

from labkit.core.validate import check_int

__all__ = ["ModelArgs", "CONFIGS", "RMSNorm", "KVCache", "Attention", "FeedForward",
           "TransformerBlock", "Transformer", "precompute_freqs_cis", "apply_rotary_emb",
           "rotary_emb_", "attend",
           "build_model", "greedy", "DUMMY_SLOT"]

DUMMY_SLOT = 0  # req_to_token row 0 / pool location 0: where padded rows write


def find_multiple(n: int, k: int) -> int:
    return n if n % k == 0 else n + k - (n % k)


@dataclass
class ModelArgs:
    """The model's shape (gpt-fast's ModelArgs, trimmed)."""

    vocab_size: int = 256
    n_layer: int = 2
    n_head: int = 4
    dim: int = 64
    n_local_heads: int = -1          # KV heads (grouped-query attention); -1 → n_head
    intermediate_size: int | None = None
    max_seq_len: int = 128           # per request: prompt + generated tokens
    rope_base: float = 10000.0
    norm_eps: float = 1e-5

    def __post_init__(self):
        if self.n_local_heads == -1:
            self.n_local_heads = self.n_head
        if self.intermediate_size is None:
            self.intermediate_size = find_multiple(int(2 * 4 * self.dim / 3), 32)
        for name in ("vocab_size", "n_layer", "n_head", "dim", "n_local_heads",
                     "intermediate_size", "max_seq_len"):
            check_int(f"ModelArgs.{name}", getattr(self, name), 1)
        if self.dim % self.n_head:
            raise ValueError(f"ModelArgs: dim={self.dim} is not a multiple of n_head={self.n_head}")
        if self.n_head % self.n_local_heads:
            raise ValueError(f"ModelArgs: n_head={self.n_head} is not a multiple of "
                             f"n_local_heads={self.n_local_heads} (KV heads)")
        if (self.dim // self.n_head) % 2:
            raise ValueError(f"ModelArgs: head_dim={self.dim // self.n_head} must be even "
                             "(rotary embeddings rotate pairs)")
        self.head_dim = self.dim // self.n_head

    @classmethod
    def from_name(cls, name: str, **overrides) -> "ModelArgs":
        if name not in CONFIGS:
            raise ValueError(f"unknown model config {name!r}: choose one of "
                             f"{', '.join(CONFIGS)} (or pass a ModelArgs)")
        return replace(CONFIGS[name], **overrides)


CONFIGS = {
    # CPU tests and the notebook on the emulator: milliseconds per step.
    "tiny": ModelArgs(vocab_size=128, n_layer=2, n_head=4, n_local_heads=2, dim=64,
                      intermediate_size=128, max_seq_len=64),
    # A GPU demo that is clearly launch-bound: many layers of small kernels.
    "small": ModelArgs(vocab_size=1024, n_layer=8, n_head=8, n_local_heads=4, dim=256,
                       max_seq_len=256),
}


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x * rsqrt(mean(x^2) + eps) * weight. ``F.rms_norm`` is one fused kernel on a GPU
        # (it normalises in fp32 even when the model runs in fp16) instead of the seven
        # (cast, pow, mean, add, rsqrt, mul, cast, mul) of the spelled-out formula; in a
        # launch-bound decode step every kernel counts, graphed or not.
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


def precompute_freqs_cis(seq_len: int, n_elem: int, base: float = 10000.0) -> torch.Tensor:
    """(seq_len, n_elem // 2, 2): cos and sin of every position, computed once."""
    freqs = 1.0 / (base ** (torch.arange(0, n_elem, 2)[: n_elem // 2].float() / n_elem))
    t = torch.arange(seq_len, dtype=torch.float32)
    freqs = torch.outer(t, freqs)
    return torch.stack([freqs.cos(), freqs.sin()], dim=-1)


def apply_rotary_emb(x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    """x: (num_tokens, heads, head_dim); freqs_cis: (num_tokens, head_dim // 2, 2).
    The reference formula (the model itself uses :func:`rotary_emb_`, same numbers)."""
    xs = x.float().reshape(*x.shape[:-1], -1, 2)
    fc = freqs_cis.view(xs.size(0), 1, xs.size(2), 2)
    out = torch.stack([xs[..., 0] * fc[..., 0] - xs[..., 1] * fc[..., 1],
                       xs[..., 1] * fc[..., 0] + xs[..., 0] * fc[..., 1]], dim=-1)
    return out.flatten(-2).type_as(x)


def rotary_emb_(x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` (num_tokens, heads, head_dim) **in place** by ``freqs_cis``
    (num_tokens, head_dim // 2, 2), in fp32; returns ``x``.

    The pairs (x0, x1) are complex numbers x0 + i·x1 and the rotation is one complex
    multiply by cos + i·sin: the same (x0·c − x1·s, x1·c + x0·s) as
    :func:`apply_rotary_emb`, in one kernel instead of nine (plus a cast in and a cast
    back in fp16). The result is written back into ``x``, so the query and key heads of
    the fused ``wqkv`` output are rotated together and stay where the attention and the
    KV cache read them. Under ``torch.compile`` the real formula is used (inductor fuses
    it into one kernel and does not lower complex arithmetic).
    """
    if torch.compiler.is_compiling():
        return x.copy_(apply_rotary_emb(x, freqs_cis))
    xc = torch.view_as_complex(x.float().unflatten(-1, (-1, 2)))
    fc = torch.view_as_complex(freqs_cis).unsqueeze(1)
    return x.copy_(torch.view_as_real(xc * fc).flatten(-2))


class KVCache(nn.Module):
    """One layer's K and V token pools, allocated once (their addresses never move).

    ``k_cache[loc]`` is the key of the token stored at pool location ``loc``;
    ``loc = req_to_token[slot, position]``. Both pools live in one buffer,
    ``kv`` (num_locs, 2, n_kv, head_dim), with ``k_cache`` / ``v_cache`` its two
    halves (views): a token's key and value sit side by side, as they come out of
    ``wqkv``, so storing them is one scatter and gathering them one ``index_select``.
    """

    def __init__(self, num_locs: int, n_kv: int, head_dim: int, dtype: torch.dtype,
                 device=None):
        super().__init__()
        self.register_buffer("kv",
                             torch.zeros((num_locs, 2, n_kv, head_dim), dtype=dtype,
                                         device=device), persistent=False)

    @property
    def k_cache(self) -> torch.Tensor:
        return self.kv[:, 0]

    @property
    def v_cache(self) -> torch.Tensor:
        return self.kv[:, 1]

    def store(self, locs: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              kv: torch.Tensor | None = None) -> None:
        """Write new K/V in place: one scatter at ``locs``, a static-shape op. ``kv``: the
        same keys and values as one (T, 2, n_kv, head_dim) tensor, if the caller has it
        (the model's ``wqkv`` output is laid out so); otherwise they are stacked first."""
        if kv is None:
            kv = torch.stack([k, v], dim=1)
        self.kv.index_put_((locs,), kv)     # the same scatter as index_copy_(0, locs, kv)


def attend(q: torch.Tensor, kv: torch.Tensor, kv_cache: KVCache, batch) -> torch.Tensor:
    """The attention op: store the new tokens' K/V and attend over each request's keys,
    through the batch's attention backend. q (T, Hq, D), kv (T, 2, Hkv, D) → (T, Hq, D).

    One call per layer, and the only code whose shapes depend on the requests rather
    than on the token count: lesson 09 cuts the model's graph at every call of it
    (``torch.fx.wrap`` keeps it one node when the model is traced), as vLLM's
    ``splitting_ops`` cut at its attention op.
    """
    return batch.attn_backend.forward(q, kv[:, 0], kv[:, 1], kv_cache, batch, kv=kv)


torch.fx.wrap("attend")


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        self.n_head, self.n_kv, self.head_dim = args.n_head, args.n_local_heads, args.head_dim
        total = (args.n_head + 2 * args.n_local_heads) * args.head_dim
        self.wqkv = nn.Linear(args.dim, total, bias=False)
        self.wo = nn.Linear(args.dim, args.dim, bias=False)
        self.kv_cache: KVCache | None = None  # set by Transformer.setup_caches

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor, batch) -> torch.Tensor:
        T = x.size(0)
        Hq, Hkv, D = self.n_head, self.n_kv, self.head_dim
        qkv = self.wqkv(x).view(T, Hq + 2 * Hkv, D)
        if torch.compiler.is_compiling():
            # The reference formula, out of place: Inductor does not lower complex
            # arithmetic. (It still stores the keys in a kernel of their own: on the H200,
            # torch 2.11, the compiled step has as many kernels as with the in-place form.)
            q = apply_rotary_emb(qkv[:, :Hq], freqs_cis)
            kv = torch.stack([apply_rotary_emb(qkv[:, Hq:Hq + Hkv], freqs_cis),
                              qkv[:, Hq + Hkv:]], dim=1)
        else:
            # Rotate the query and key heads together, in place: q, k and v stay views of
            # the one wqkv output (k and v side by side, so the cache stores them in one
            # scatter).
            rotary_emb_(qkv[:, : Hq + Hkv], freqs_cis)
            q, kv = qkv[:, :Hq], qkv[:, Hq:].view(T, 2, Hkv, D)
        y = attend(q, kv, self.kv_cache, batch)
        return self.wo(y.reshape(T, -1))


class FeedForward(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        # w1 (gate) and w3 (up) as one matrix, [w1; w3]: one GEMM instead of two (SGLang's
        # gate_up_proj). Initialised like two separate Linears (same fan-in, same draws).
        self.intermediate_size = args.intermediate_size
        self.w13 = nn.Linear(args.dim, 2 * args.intermediate_size, bias=False)
        self.w2 = nn.Linear(args.intermediate_size, args.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w13(x).split(self.intermediate_size, dim=-1)
        return self.w2(F.silu(gate) * up)


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs, layer_id: int):
        super().__init__()
        self.attention = Attention(args, layer_id)
        self.feed_forward = FeedForward(args)
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)

    def forward(self, x, freqs_cis, batch):
        h = x + self.attention(self.attention_norm(x), freqs_cis, batch)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(TransformerBlock(args, i) for i in range(args.n_layer))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.num_slots = 0
        self.cache_generation = 0  # bumped by every setup_caches: runners built before see it
        self.register_buffer(
            "freqs_cis", precompute_freqs_cis(args.max_seq_len, args.head_dim, args.rope_base),
            persistent=False)

    def setup_caches(self, max_requests: int) -> None:
        """Allocate the KV pools and the request→token table, once.

        ``max_requests`` live requests get slots ``1..max_requests``; slot 0 is the dummy
        slot. Every slot owns ``max_seq_len`` consecutive pool locations, so
        ``req_to_token`` is an identity layout here (a real server hands out pages on
        demand); all code still goes through the table, as SGLang's does.
        """
        check_int("max_requests", max_requests, 1,
                  fix="the number of live requests (slot 0 is the dummy slot on top)")
        a = self.args
        p = self.output.weight
        self.cache_generation += 1
        self.num_slots = max_requests + 1
        num_locs = self.num_slots * a.max_seq_len
        for layer in self.layers:
            layer.attention.kv_cache = KVCache(num_locs, a.n_local_heads, a.head_dim,
                                               p.dtype, p.device)
        self.register_buffer(
            "req_to_token",
            torch.arange(num_locs, device=p.device).view(self.num_slots, a.max_seq_len),
            persistent=False)

    @property
    def device(self) -> torch.device:
        return self.output.weight.device

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch) -> torch.Tensor:
        """input_ids, positions: (num_tokens,) → logits (num_tokens, vocab), fp32."""
        if self.num_slots == 0:
            raise RuntimeError("call model.setup_caches(max_requests) before running it")
        if getattr(batch, "attn_backend", None) is None:
            raise RuntimeError("the model reads K/V through batch.attn_backend, and this batch "
                               "has none: run batches through EagerRunner(model).forward(batch) "
                               "or a DecodeGraphRunner, which set it")
        # index_select, not freqs_cis[positions]: the same static-shape gather, and an
        # out-of-range position raises (CPU) / faults (GPU) instead of being clamped.
        freqs_cis = self.freqs_cis.index_select(0, positions)
        x = self.tok_embeddings(input_ids)
        for layer in self.layers:
            x = layer(x, freqs_cis, batch)
        return self.output(self.norm(x)).float()


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """Greedy sampling: the most likely next token of every row (deterministic, so an
    eager run and a graphed run must produce the very same tokens)."""
    return logits.argmax(dim=-1)


def build_model(args: ModelArgs | str = "tiny", max_requests: int = 16, device=None,
                dtype: torch.dtype | None = None, seed: int = 0) -> Transformer:
    """A seeded model with caches set up: fp32 on CPU, fp16 on CUDA unless told."""
    if isinstance(args, str):
        args = ModelArgs.from_name(args)
    elif not isinstance(args, ModelArgs):
        raise TypeError(f"build_model: args must be a config name ({', '.join(CONFIGS)}) or a "
                        f"ModelArgs, got {type(args).__name__}")
    device = torch.device(device if device is not None else "cpu")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"build_model: device={device} but no CUDA GPU is available here; "
                           "use device=B.device of B = labkit.backend.get('auto')")
    if dtype is None:
        dtype = torch.float16 if device.type == "cuda" else torch.float32
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"build_model: dtype must be a floating torch dtype (torch.float32, "
                        f"torch.float16, torch.bfloat16), got {dtype!r}")
    check_int("build_model: seed", seed, None)
    # Built on the host from the host generator, whatever torch.set_default_device says:
    # the same seed gives the same weights on every device (then moved to ``device``).
    with torch.random.fork_rng(devices=[]), torch.device("cpu"):
        torch.manual_seed(seed)
        model = Transformer(args)
    model = model.to(device=device, dtype=dtype).eval()
    model.freqs_cis = model.freqs_cis.float()  # rotary tables stay fp32
    model.setup_caches(max_requests)
    return model
