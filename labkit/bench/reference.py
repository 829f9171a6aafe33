"""The baseline a user would write instead: the same GPT, gpt-fast style, for torch.compile.

A decode benchmark is only fair against what a practitioner would pick instead of labkit,
and that is gpt-fast's recipe (pytorch-labs/gpt-fast ``model.py``): a dense KV cache per
layer registered as module buffers, ``(max_bs, n_kv, max_seq_len, head_dim)``; positions
on the device; a boolean mask built from them; stock SDPA; then
``torch.compile(mode="reduce-overhead")``, whose CUDA graph trees record one graph per
batch size. No page table, no buckets, no static buffers of one's own.

:class:`ReferenceGPT` runs on the *same weights* as a :class:`labkit.decode.Transformer`
(it holds the same modules) and only replaces the KV cache and the attention, so the two
compute the same logits: :meth:`ReferenceGPT.load_kv` copies the labkit model's token pool
into the dense cache, and the decode suite checks the two agree before it times anything.

One difference is by design, not a handicap: gpt-fast attends over all ``max_seq_len``
cached positions and masks the ones past each request's length (its shapes never change),
while labkit's attention reads only each request's ``seq_len`` keys through the page table.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from labkit.core.validate import check_int
from labkit.decode.model import apply_rotary_emb  # gpt-fast's formula, out of place

__all__ = ["ReferenceGPT"]


class DenseKVCache(nn.Module):
    """gpt-fast's ``KVCache``: one row per request, every position preallocated."""

    def __init__(self, max_bs: int, n_kv: int, max_seq_len: int, head_dim: int,
                 dtype: torch.dtype, device):
        super().__init__()
        shape = (max_bs, n_kv, max_seq_len, head_dim)
        self.register_buffer("k_cache", torch.zeros(shape, dtype=dtype, device=device),
                             persistent=False)
        self.register_buffer("v_cache", torch.zeros(shape, dtype=dtype, device=device),
                             persistent=False)

    def update(self, input_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """k, v (bs, n_kv, D): the new token of each request, at its own position."""
        bs = k.size(0)
        rows = torch.arange(bs, device=k.device)
        self.k_cache[rows, :, input_pos] = k
        self.v_cache[rows, :, input_pos] = v
        return self.k_cache[:bs], self.v_cache[:bs]


class ReferenceGPT(nn.Module):
    """A labkit decode model's weights with gpt-fast's dense cache and attention.

    ``forward(input_ids (bs,), input_pos (bs,)) -> logits (bs, vocab)`` in fp32, one new
    token per request, request ``i`` in cache row ``i``.
    """

    def __init__(self, model, max_bs: int):
        super().__init__()
        check_int("max_bs", max_bs, 1)
        a = model.args
        self.args = a
        self.max_bs = max_bs
        self.tok_embeddings, self.norm, self.output = model.tok_embeddings, model.norm, model.output
        self.layers = model.layers          # the same modules: the same weights
        p = model.output.weight
        self.caches = nn.ModuleList(
            DenseKVCache(max_bs, a.n_local_heads, a.max_seq_len, a.head_dim, p.dtype, p.device)
            for _ in model.layers)
        self.register_buffer("freqs_cis", model.freqs_cis, persistent=False)
        self.register_buffer("positions", torch.arange(a.max_seq_len, device=p.device),
                             persistent=False)

    @torch.no_grad()
    def load_kv(self, model, slots: list[int]) -> None:
        """Copy each request's keys and values from the labkit model's token pool (request
        ``i`` lives in ``slots[i]``) into cache row ``i``: both models then hold the same
        cache."""
        L = self.args.max_seq_len
        for cache, layer in zip(self.caches, model.layers):
            pool = layer.attention.kv_cache
            for i, s in enumerate(slots):
                locs = model.req_to_token[s]
                cache.k_cache[i] = pool.k_cache.index_select(0, locs).transpose(0, 1)[:, :L]
                cache.v_cache[i] = pool.v_cache.index_select(0, locs).transpose(0, 1)[:, :L]

    def _attention(self, layer, cache, x, freqs_cis, mask, input_pos):
        attn, a = layer.attention, self.args
        bs, Hq, Hkv, D = x.size(0), a.n_head, a.n_local_heads, a.head_dim
        q, k, v = attn.wqkv(x).split([Hq * D, Hkv * D, Hkv * D], dim=-1)
        q = apply_rotary_emb(q.view(bs, Hq, D), freqs_cis)
        k = apply_rotary_emb(k.view(bs, Hkv, D), freqs_cis)
        keys, vals = cache.update(input_pos, k, v.view(bs, Hkv, D))
        if Hq != Hkv:
            keys = keys.repeat_interleave(Hq // Hkv, dim=1)
            vals = vals.repeat_interleave(Hq // Hkv, dim=1)
        y = F.scaled_dot_product_attention(q.unsqueeze(2), keys, vals, attn_mask=mask)
        return attn.wo(y.view(bs, Hq * D))

    def forward(self, input_ids: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
        mask = (self.positions.view(1, -1) <= input_pos.view(-1, 1))[:, None, None, :]
        freqs_cis = self.freqs_cis[input_pos]
        x = self.tok_embeddings(input_ids)
        for layer, cache in zip(self.layers, self.caches):
            h = x + self._attention(layer, cache, layer.attention_norm(x), freqs_cis, mask,
                                    input_pos)
            x = h + layer.feed_forward(layer.ffn_norm(h))
        return self.output(self.norm(x)).float()
