"""The ``torch_native`` attention backend: how a batch of requests finds its keys, eagerly
or in a graph, in stock torch ops.

This is SGLang's split (``base_attn_backend.py``), in plain torch ops:

``init_forward_metadata(batch)``
    eager path: build the metadata for exactly this batch, any way you like.

``init_cuda_graph_state(max_bs, max_num_tokens)``
    once: allocate the metadata tensors at their largest shape. Graphs captured later
    read these addresses, so they are never reallocated.

``init_forward_metadata_out_graph(batch)``
    host-side / dynamic-shape preparation, run *outside* the graph before capture and
    before every replay. It may read Python ints (``seq_lens_cpu``) and use them as
    shapes. Here: copy each request's row of ``req_to_token`` into the page table, but
    only the first ``max(seq_lens)`` columns — a width that changes every step, so this
    copy could never be recorded into a graph.

``init_forward_metadata_in_graph(batch)``
    static-shape tensor ops only, executed *inside* the captured region so they are
    recorded and re-run on every replay: here, the key mask ``arange < seq_lens`` (and
    the causal mask of a verify block). No ``.item()``, no ``.cpu()``, no ``nonzero``,
    no Python branch on a tensor value.

Decode attention then gathers keys and values through the page table (one
``index_select``: the pool stores them side by side), masks the keys a request may not see
with a comparison against an ``arange`` (turned once per step into SDPA's additive bias,
rather than by SDPA in every layer), and runs SDPA. Every
shape depends on the bucket size alone, never on the data.

Prefill (EXTEND, also a mixed batch of prompts and decode tokens) is eager only: its
layout comes from the host lengths. Every request's queries are padded to the longest and
attend in one SDPA per layer, as one kernel over all requests does in a serving engine
(FlashAttention's varlen prefill).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from labkit.core.validate import is_int

__all__ = ["DecodeMetadata", "ExtendMetadata", "TorchNativeAttnBackend"]


@dataclass
class DecodeMetadata:
    """page_table (bs, W): pool locations of each request's keys 0..W-1.
    kv_mask (bs, tokens_per_request, W): True where query t of request i may see key j.
    attn_bias: the same mask as SDPA's additive bias (0 / -inf, the model's dtype), built
    once per step from ``kv_mask`` so that no layer converts a boolean mask again."""

    page_table: torch.Tensor
    kv_mask: torch.Tensor
    attn_bias: torch.Tensor | None = None


@dataclass
class ExtendMetadata:
    """page_table (n, W): pool locations of each request's keys 0..W-1 (W = max seq_len).
    q_index (n * Lq,): the token in each padded query row (Lq = max extend_len).
    out_index (num_tokens,): the padded row each token's output is read back from.
    attn_bias (n, 1, Lq, W): 0 where a query may see a key (causal), -inf where not."""

    page_table: torch.Tensor
    q_index: torch.Tensor
    out_index: torch.Tensor
    attn_bias: torch.Tensor


def _expand_kv(x: torch.Tensor, n_head: int, dim: int) -> torch.Tensor:
    """Grouped-query attention: repeat each KV head for its query heads. expand + reshape
    rather than repeat_interleave, whose general form has a data-dependent output size."""
    rep = n_head // x.size(dim)
    if rep == 1:
        return x
    shape = list(x.shape)
    x = x.unsqueeze(dim + 1).expand(*shape[:dim + 1], rep, *shape[dim + 1:])
    return x.reshape(*shape[:dim], shape[dim] * rep, *shape[dim + 1:])


class TorchNativeAttnBackend:
    name = "torch_native"

    def __init__(self, model):
        if getattr(model, "num_slots", 0) == 0 or not hasattr(model, "req_to_token"):
            raise TypeError("an attention backend needs a labkit.decode Transformer with caches "
                            f"set up (build_model(...)), got {type(model).__name__}")
        self.model = model
        self.cache_generation = getattr(model, "cache_generation", 0)  # the KV cache it reads
        self.req_to_token = model.req_to_token
        self.max_seq_len = model.args.max_seq_len
        self.dtype = model.output.weight.dtype  # the attention bias is in the model's dtype
        self.forward_metadata: DecodeMetadata | None = None
        self.cuda_graph_state: dict | None = None
        self._bias_consts: tuple[torch.Tensor, torch.Tensor] | None = None

    # ---- eager -------------------------------------------------------------------------
    def init_forward_metadata(self, batch) -> None:
        if batch.forward_mode.is_extend():
            self.forward_metadata = self._extend_metadata(batch)
            return
        page_table = self._page_table(batch)
        arange = torch.arange(page_table.size(1), device=page_table.device)
        kv_mask = self._kv_mask(batch, arange)
        self.forward_metadata = DecodeMetadata(page_table, kv_mask, self._bias(kv_mask))

    def _extend_metadata(self, batch) -> "ExtendMetadata":
        """A prefill batch as ``n`` requests × ``max(extend_lens)`` query rows, from the
        host lengths: which token fills each query row (a request's padded rows repeat
        its first token, so every row sees at least one key), which row each token's
        output comes back from, and the causal bias from the tokens' positions."""
        lens, n = batch.extend_lens, len(batch.extend_lens)
        width, rows = max(batch.seq_lens_cpu), max(lens)
        starts = [0]
        for e in lens[:-1]:
            starts.append(starts[-1] + e)
        q_index = [s + (j if j < e else 0) for s, e in zip(starts, lens) for j in range(rows)]
        out_index = [i * rows + j for i, e in enumerate(lens) for j in range(e)]
        idx = torch.tensor(q_index + out_index, dtype=torch.int64, device=batch.positions.device)
        q_index, out_index = idx[: n * rows], idx[n * rows:]
        page_table = self._page_table(batch)
        qpos = batch.positions.index_select(0, q_index).view(n, rows, 1)
        arange = torch.arange(width, device=qpos.device).view(1, 1, -1)
        return ExtendMetadata(page_table, q_index, out_index, self._bias(arange <= qpos))

    def _page_table(self, batch) -> torch.Tensor:
        """Eager: the pool locations of each request's first ``max(seq_lens)`` keys."""
        width = max(batch.seq_lens_cpu)
        return self.req_to_token[:, :width].index_select(0, batch.req_pool_indices)

    @staticmethod
    def _kv_mask(batch, arange: torch.Tensor) -> torch.Tensor:
        """Static shape: (bs, k, W) from seq_lens (bs,) and positions (bs*k,)."""
        bs = batch.req_pool_indices.numel()
        pos = batch.positions.view(bs, -1)
        within = arange.view(1, 1, -1) < batch.seq_lens.view(bs, 1, 1)   # keys beyond seq_len
        causal = arange.view(1, 1, -1) <= pos.unsqueeze(-1)              # verify block causality
        return within & causal

    def _bias(self, kv_mask: torch.Tensor) -> torch.Tensor:
        """kv_mask (bs, k, W) bool → SDPA's additive bias (bs, 1, k, W): 0 where a key is
        visible, -inf where not: exactly what SDPA would make of the boolean mask in every
        layer, made once (one ``where``)."""
        zero, ninf = self._bias_values(kv_mask.device)
        return torch.where(kv_mask, zero, ninf).unsqueeze(1)

    def _bias_values(self, device) -> tuple[torch.Tensor, torch.Tensor]:
        vals = self._bias_consts
        if vals is None or vals[0].device != device or vals[0].dtype != self.dtype:
            dtype = self.dtype
            vals = (torch.zeros((), dtype=dtype, device=device),
                    torch.full((), float("-inf"), dtype=dtype, device=device))
            self._bias_consts = vals
        return vals

    # ---- CUDA graph --------------------------------------------------------------------
    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        if not (is_int(max_bs) and is_int(max_num_tokens) and max_bs >= 1
                and max_num_tokens >= max_bs and max_num_tokens % max_bs == 0):
            raise ValueError(f"init_cuda_graph_state: need ints max_bs >= 1 and max_num_tokens a "
                             f"multiple of it (k tokens per request), got {max_bs!r}, "
                             f"{max_num_tokens!r}")
        dev = self.req_to_token.device
        k = max_num_tokens // max_bs
        self.cuda_graph_state = {
            "page_table": torch.zeros((max_bs, self.max_seq_len), dtype=torch.int64, device=dev),
            "kv_mask": torch.zeros((max_bs, k, self.max_seq_len), dtype=torch.bool, device=dev),
            "arange": torch.arange(self.max_seq_len, device=dev),
        }
        self._bias_values(dev)  # the bias constants exist before any capture
        # Host-side caches of views (metadata only, built once): the per-bucket metadata
        # objects and the width-sliced views the out-of-graph copy writes through, so a
        # step does not re-slice the same tensors every time.
        self._graph_md: dict[int, DecodeMetadata] = {}
        self._src_cols: dict[int, torch.Tensor] = {}
        self._dst_cols: dict[tuple[int, int], torch.Tensor] = {}

    def init_forward_metadata_out_graph(self, batch, in_capture: bool = False) -> None:
        """Outside the graph: may use host ints as shapes. ``batch`` is the padded view
        over the runner's static buffers; its ``seq_lens_cpu`` covers the padded rows too.

        One kernel: ``index_select`` of the first ``width`` columns of each request's
        ``req_to_token`` row, written straight into the page table (``out=``)."""
        st = self.cuda_graph_state
        if st is None:
            raise RuntimeError("init_forward_metadata_out_graph before init_cuda_graph_state"
                               "(max_bs, max_num_tokens): the graph's metadata tensors do not "
                               "exist yet (DecodeGraphRunner calls both, in that order)")
        bs = batch.req_pool_indices.numel()
        width = max(batch.seq_lens_cpu)  # a Python int that changes every step
        src = self._src_cols.get(width)
        if src is None:
            src = self._src_cols[width] = self.req_to_token[:, :width]
        dst = self._dst_cols.get((bs, width))
        if dst is None:
            dst = self._dst_cols[(bs, width)] = st["page_table"][:bs, :width]
        torch.index_select(src, 0, batch.req_pool_indices, out=dst)
        # Columns >= width keep whatever an earlier batch left there: always valid pool
        # locations, and masked out by kv_mask, so never read into a result.
        md = self._graph_md.get(bs)
        if md is None:  # one metadata object per bucket: its graph's attn_bias lives on it
            md = self._graph_md[bs] = DecodeMetadata(st["page_table"][:bs], st["kv_mask"][:bs])
        self.forward_metadata = md

    def init_forward_metadata_in_graph(self, batch) -> None:
        """Inside the graph: pure static-shape ops, recorded at capture, re-run at replay.
        The mask is written straight into the static ``kv_mask`` (no temporary + copy), then
        turned into the additive bias every layer's SDPA reads."""
        md = self.forward_metadata
        bs = md.kv_mask.size(0)
        arange = self.cuda_graph_state["arange"].view(1, 1, -1)
        torch.le(arange, batch.positions.view(bs, -1, 1), out=md.kv_mask)   # causal
        md.kv_mask.logical_and_(arange < batch.seq_lens.view(bs, 1, 1))   # within seq_len
        md.attn_bias = self._bias(md.kv_mask)

    # ---- the attention op --------------------------------------------------------------
    def forward(self, q, k, v, kv_cache, batch, kv=None) -> torch.Tensor:
        """q (T, Hq, D), k/v (T, Hkv, D) for the T new tokens → (T, Hq, D). ``kv``: k and v
        as one (T, 2, Hkv, D) tensor when the caller has it (one scatter into the cache).
        The output goes into ``batch.attn_out`` when it is set."""
        kv_cache.store(batch.out_cache_loc, k, v, kv=kv)
        out = batch.attn_out                  # written in place when the caller gave one
        if batch.forward_mode.is_extend():
            return self._forward_extend(q, kv_cache, batch, out)
        y = self._forward_decode(q, kv_cache, batch)
        return y if out is None else out.copy_(y)

    def _forward_decode(self, q, kv_cache, batch) -> torch.Tensor:
        md = self.forward_metadata
        bs, width = md.page_table.shape
        T, Hq, D = q.shape
        # One gather for keys and values together: the pool stores them side by side.
        kv = kv_cache.kv.index_select(0, md.page_table.reshape(-1)).view(bs, width, 2, -1, D)
        keys, vals = kv[:, :, 0].transpose(1, 2), kv[:, :, 1].transpose(1, 2)  # (bs, Hkv, W, D)
        keys, vals = _expand_kv(keys, Hq, 1), _expand_kv(vals, Hq, 1)
        qh = q.view(bs, T // bs, Hq, D).transpose(1, 2)                   # (bs, Hq, k, D)
        mask = md.attn_bias if md.attn_bias is not None else md.kv_mask.unsqueeze(1)
        y = F.scaled_dot_product_attention(qh, keys, vals, attn_mask=mask)
        return y.transpose(1, 2).reshape(T, Hq, D)

    def _forward_extend(self, q, kv_cache, batch, out=None) -> torch.Tensor:
        """Prefill (or a mixed batch): every request's queries at once, padded to the
        longest, against its keys gathered through the page table: one SDPA per layer
        whatever the number of requests. The layout comes from the host lengths,
        planned once per batch (:meth:`_extend_metadata`)."""
        md = self.forward_metadata
        n, width = md.page_table.shape
        Hq, D = q.shape[1:]
        kv = kv_cache.kv.index_select(0, md.page_table.reshape(-1)).view(n, width, 2, -1, D)
        keys, vals = kv[:, :, 0].transpose(1, 2), kv[:, :, 1].transpose(1, 2)  # (n, Hkv, W, D)
        keys, vals = _expand_kv(keys, Hq, 1), _expand_kv(vals, Hq, 1)
        qh = q.index_select(0, md.q_index).view(n, -1, Hq, D).transpose(1, 2)  # (n, Hq, Lq, D)
        y = F.scaled_dot_product_attention(qh, keys, vals, attn_mask=md.attn_bias)
        return torch.index_select(y.transpose(1, 2).reshape(-1, Hq, D), 0, md.out_index,
                                  out=out)
