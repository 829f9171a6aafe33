"""Decode attention as one Triton kernel that reads keys *through* the page table.

:class:`~labkit.decode.torch_attention.TorchNativeAttnBackend` first gathers every
request's keys and values into a dense tensor for SDPA; SGLang's triton backend
(``decode_attention_fwd`` in ``python/sglang/srt/layers/attention/triton_ops/
decode_attention.py``) reads the KV pool through the page table instead, and this module
is that idea at its smallest: one program per (request, query head, slice of the keys),
an online softmax in fp32, and a second kernel that merges the slices (flash-decoding,
SGLang's stage 1 / stage 2). Lesson 06 tells the story.

It fits a CUDA graph because the grid is the bucket size alone and the loop bound
``seq_len`` is read on the device from the static ``seq_lens`` buffer; Triton compiles on
the first call, which the runner's warm-ups make before capture. Decode only (one query
token per request) and CUDA only: :func:`triton_available` says whether this machine can
run it; everything else takes the torch path. No autotuner: ``BLOCK_N`` is fixed.

.. warning::
    The kernel trusts ``seq_lens`` and ``page_table``: a stale padded row with a huge
    ``seq_len`` reads past its page-table row, an illegal memory access on a GPU. The
    runner's padding policy (``seq_lens`` tails filled with a sentinel) prevents it.
"""

from __future__ import annotations

import math

import torch

from .torch_attention import DecodeMetadata, TorchNativeAttnBackend
from .triton_extend import extend_attention, extend_metadata

__all__ = ["triton_available", "decode_attention", "decode_attention_op", "num_kv_splits",
           "TritonAttnBackend"]

try:  # triton comes with CUDA builds of torch; CPU wheels have none
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None


def triton_available(device=None) -> bool:
    """True when Triton is importable and ``device`` (default: CUDA if any) is a GPU."""
    if triton is None or not torch.cuda.is_available():
        return False
    return device is None or torch.device(device).type == "cuda"


if triton is not None:

    @triton.jit
    def _decode_kernel(Q, KV, PageTable, SeqLens, Out, Lse, sm_scale,
                       stride_qt, stride_qh, stride_kvl, stride_kvs, stride_kvh,
                       stride_pt, stride_ot, stride_oh, stride_os,
                       GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
                       NUM_SPLITS: tl.constexpr):
        b = tl.program_id(0)                    # request (row of the bucket)
        h = tl.program_id(1)                    # query head
        split = tl.program_id(2)                # which slice of the keys (flash-decoding)
        kv_h = h // GROUP                       # its KV head (grouped-query attention)
        seq_len = tl.load(SeqLens + b)          # read on the device: no host value
        chunk = tl.cdiv(seq_len, NUM_SPLITS)
        lo = split * chunk
        hi = tl.minimum(lo + chunk, seq_len)
        offs_d = tl.arange(0, HEAD_DIM)
        q = tl.load(Q + b * stride_qt + h * stride_qh + offs_d).to(tl.float32)
        m_i = tl.zeros([], dtype=tl.float32) - float("inf")   # running max
        l_i = tl.zeros([], dtype=tl.float32)                   # running sum of exp
        acc = tl.zeros([HEAD_DIM], dtype=tl.float32)
        for start in range(lo, hi, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            valid = offs_n < hi
            loc = tl.load(PageTable + b * stride_pt + offs_n, mask=valid, other=0)
            k_ptr = KV + loc[:, None] * stride_kvl + kv_h * stride_kvh + offs_d[None, :]
            k = tl.load(k_ptr, mask=valid[:, None], other=0.0).to(tl.float32)
            v = tl.load(k_ptr + stride_kvs, mask=valid[:, None], other=0.0).to(tl.float32)
            s = tl.sum(q[None, :] * k, 1) * sm_scale
            s = tl.where(valid, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 0))
            alpha = tl.exp(m_i - m_new)         # rescale what was summed so far
            p = tl.exp(s - m_new)
            acc = acc * alpha + tl.sum(p[:, None] * v, 0)
            l_i = l_i * alpha + tl.sum(p, 0)
            m_i = m_new
        out_ptr = Out + b * stride_ot + h * stride_oh + split * stride_os + offs_d
        if NUM_SPLITS == 1:
            tl.store(out_ptr, (acc / l_i).to(Out.dtype.element_ty))
        else:                                   # a partial result and its log-sum-exp
            empty = l_i == 0.0                  # a slice past the end of a short request
            tl.store(out_ptr, tl.where(empty, 0.0, acc / l_i))
            tl.store(Lse + (b * tl.num_programs(1) + h) * NUM_SPLITS + split,
                     tl.where(empty, float("-inf"), m_i + tl.log(l_i)))

    @triton.jit
    def _combine_kernel(Part, Lse, Out, stride_pt, stride_ph, stride_ps, stride_ot, stride_oh,
                        HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr):
        b = tl.program_id(0)
        h = tl.program_id(1)
        offs_s = tl.arange(0, NUM_SPLITS)
        offs_d = tl.arange(0, HEAD_DIM)
        lse = tl.load(Lse + (b * tl.num_programs(1) + h) * NUM_SPLITS + offs_s)
        w = tl.exp(lse - tl.max(lse, 0))        # each slice's share of the softmax mass
        part = tl.load(Part + b * stride_pt + h * stride_ph + offs_s[:, None] * stride_ps
                       + offs_d[None, :])
        out = tl.sum(w[:, None] * part, 0) / tl.sum(w, 0)
        tl.store(Out + b * stride_ot + h * stride_oh + offs_d, out.to(Out.dtype.element_ty))


def num_kv_splits(bs: int, n_head: int, max_seq_len: int, min_keys: int = 256,
                  target_programs: int = 256) -> int:
    """How many slices to cut each request's keys into (a power of two, static per bucket).

    One program per (request, head) is plenty at bs=64 (512 programs), but at bs=1 only
    ``n_head`` programs walk up to ``max_seq_len`` keys one block after another while the
    rest of the GPU idles. Flash-decoding cuts the keys into slices, one program each, and
    a second small kernel merges the partial softmaxes. The merge is one more kernel (one
    more graph node) per layer, so a slice must be worth it: at least ``min_keys`` keys
    (long contexts), never for a model of a few hundred positions. Depends on the batch
    size and the model only, never on the step's lengths: a captured grid cannot follow
    the data. (A padded bucket may split differently from its raw batch run eagerly: the
    same result up to rounding.)"""
    splits = 1
    while bs * n_head * splits < target_programs and splits * 2 * min_keys <= max_seq_len:
        splits *= 2
    return splits


def decode_attention(q: torch.Tensor, kv_pool: torch.Tensor, page_table: torch.Tensor,
                     seq_lens: torch.Tensor, num_splits: int = 1,
                     block_n: int | None = None) -> torch.Tensor:
    """Attention of one new token per request over that request's cached keys.

    q           (bs, Hq, D), any strides with a unit last one (a view of ``wqkv``'s output)
    kv_pool     (num_locs, 2, Hkv, D): the layer's pool, keys and values side by side
    page_table  (bs, W) int: pool locations of each request's keys 0..W-1
    seq_lens    (bs,) int: how many keys each request attends to (``<= W``)
    num_splits  slices of the keys per request (see :func:`num_kv_splits`); more than one
                adds a second kernel that merges them
    block_n     keys per loop step (default: 128 unsplit, 64 split, the faster of the two
                on an H200 for 8 heads of 64 and 256 keys)

    Returns (bs, Hq, D) in ``q``'s dtype. Every shape depends on ``bs`` only.
    """
    _check_decode_attention_args(q, kv_pool, page_table, seq_lens, num_splits, block_n)
    if triton is None:
        raise RuntimeError("decode_attention needs Triton (a CUDA build of torch); "
                           "use TorchNativeAttnBackend on this machine")
    bs, hq, d = q.shape
    hkv = kv_pool.size(2)
    if block_n is None:
        block_n = 128 if num_splits == 1 else 64
    out = torch.empty((bs, hq, d), dtype=q.dtype, device=q.device)
    common = dict(GROUP=hq // hkv, HEAD_DIM=d, BLOCK_N=block_n, NUM_SPLITS=num_splits,
                  num_warps=4)
    strides = (q.stride(0), q.stride(1), kv_pool.stride(0), kv_pool.stride(1),
               kv_pool.stride(2), page_table.stride(0))
    scale = 1.0 / math.sqrt(d)
    if num_splits == 1:
        _decode_kernel[(bs, hq, 1)](q, kv_pool, page_table, seq_lens, out, out, scale,
                                    *strides, out.stride(0), out.stride(1), 0, **common)
        return out
    part = torch.empty((bs, hq, num_splits, d), dtype=torch.float32, device=q.device)
    lse = torch.empty((bs, hq, num_splits), dtype=torch.float32, device=q.device)
    _decode_kernel[(bs, hq, num_splits)](q, kv_pool, page_table, seq_lens, part, lse, scale,
                                         *strides, part.stride(0), part.stride(1),
                                         part.stride(2), **common)
    _combine_kernel[(bs, hq)](part, lse, out, part.stride(0), part.stride(1), part.stride(2),
                              out.stride(0), out.stride(1), HEAD_DIM=d,
                              NUM_SPLITS=num_splits, num_warps=1)
    return out


@torch.library.custom_op("labkit::decode_attention", mutates_args=())
def decode_attention_op(q: torch.Tensor, kv_pool: torch.Tensor, page_table: torch.Tensor,
                        seq_lens: torch.Tensor, num_splits: int) -> torch.Tensor:
    """:func:`decode_attention` as a PyTorch operator, so that ``torch.compile`` keeps the
    kernel as one opaque call between the kernels it generates (and a CUDA graph captured
    around the compiled model records it like any other kernel). The eager path calls
    :func:`decode_attention` directly: an operator call costs more host time."""
    return decode_attention(q, kv_pool, page_table, seq_lens, num_splits)


@decode_attention_op.register_fake
def _decode_attention_fake(q, kv_pool, page_table, seq_lens, num_splits):
    return q.new_empty(q.shape)


def _pow2(n) -> bool:
    return isinstance(n, int) and not isinstance(n, bool) and n >= 1 and not n & (n - 1)


def _check_decode_attention_args(q, kv_pool, page_table, seq_lens, num_splits, block_n) -> None:
    """Shapes, dtypes, devices and strides: a kernel reads raw pointers, so a wrong shape
    here is a wrong read there (or an illegal address), never an error."""
    for name, t in (("q", q), ("kv_pool", kv_pool), ("page_table", page_table),
                    ("seq_lens", seq_lens)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"decode_attention: {name} must be a tensor, got {type(t).__name__}")
    if q.dim() != 3 or kv_pool.dim() != 4 or kv_pool.size(1) != 2:
        raise ValueError(f"decode_attention: q must be (bs, Hq, D) and kv_pool (num_locs, 2, "
                         f"Hkv, D), got {tuple(q.shape)} and {tuple(kv_pool.shape)}")
    bs, hq, d = q.shape
    hkv = kv_pool.size(2)
    if kv_pool.size(3) != d or hq % hkv:
        raise ValueError(f"decode_attention: kv_pool heads {hkv} x dim {kv_pool.size(3)} do not "
                         f"fit q's {hq} heads x dim {d} (Hq must be a multiple of Hkv)")
    if page_table.dim() != 2 or page_table.size(0) != bs or seq_lens.shape != (bs,):
        raise ValueError(f"decode_attention: page_table must be (bs={bs}, W) and seq_lens "
                         f"({bs},), got {tuple(page_table.shape)} and {tuple(seq_lens.shape)}")
    if page_table.dtype.is_floating_point or seq_lens.dtype.is_floating_point:
        raise TypeError("decode_attention: page_table and seq_lens must be integer tensors, "
                        f"got {page_table.dtype} and {seq_lens.dtype}")
    if q.dtype != kv_pool.dtype:
        raise TypeError(f"decode_attention: q is {q.dtype} but kv_pool is {kv_pool.dtype}")
    devices = {t.device for t in (q, kv_pool, page_table, seq_lens)}
    if len(devices) > 1:
        raise ValueError("decode_attention: all inputs on one device, got "
                         f"{sorted(map(str, devices))}")
    if q.stride(-1) != 1 or kv_pool.stride(-1) != 1 or page_table.stride(-1) != 1:
        raise ValueError("decode_attention needs unit stride in the last dimension")
    if not _pow2(d) or not _pow2(num_splits):
        raise ValueError(f"head_dim ({d}) and num_splits ({num_splits}) must be powers of two")
    if block_n is not None and not (_pow2(block_n) and block_n >= 16):
        raise ValueError(f"decode_attention: block_n must be a power of two >= 16, got {block_n!r}")


class TritonAttnBackend(TorchNativeAttnBackend):
    """:class:`TorchNativeAttnBackend` with decode attention done by :func:`decode_attention`
    and prefill attention by :func:`~labkit.decode.triton_extend.extend_attention`.

    The metadata split stays the same: the page table is still prepared **out of graph**
    (its width changes every step). **In graph** there is nothing left to prepare for a
    decode batch: the kernel reads ``seq_lens`` itself, so no key mask is built. Verify
    blocks (several tokens per request) take the inherited torch path.
    """

    name = "triton"

    def __init__(self, model):
        if not triton_available(model.device):
            raise RuntimeError(
                f"the triton attention backend needs Triton and a CUDA device (model is on "
                f"{model.device}, triton {'found' if triton else 'not installed'}): use "
                "attention='torch_native'")
        super().__init__(model)

    def init_forward_metadata(self, batch) -> None:
        if batch.forward_mode.is_extend():   # per request: where it starts, how long
            self.forward_metadata = extend_metadata(batch, self.req_to_token.device)
            return
        if batch.num_tokens_per_bs != 1:
            return super().init_forward_metadata(batch)
        self.forward_metadata = DecodeMetadata(self._page_table(batch), kv_mask=None)

    def init_forward_metadata_in_graph(self, batch) -> None:
        md = self.forward_metadata
        if md.kv_mask.size(1) != 1:          # a verify block: masks as before
            return super().init_forward_metadata_in_graph(batch)
        md.attn_bias = None                  # decode: the kernel stops at seq_len itself

    def _forward_extend(self, q, kv_cache, batch, out=None) -> torch.Tensor:
        return extend_attention(q, kv_cache.kv, self.req_to_token, self.forward_metadata, out)

    def _forward_decode(self, q, kv_cache, batch) -> torch.Tensor:
        md = self.forward_metadata
        if q.size(0) != md.page_table.size(0):           # several tokens per request
            return super()._forward_decode(q, kv_cache, batch)
        bs, hq = q.shape[:2]
        splits = num_kv_splits(bs, hq, self.max_seq_len)
        if torch.compiler.is_compiling():   # one opaque operator inside the compiled graph
            return decode_attention_op(q, kv_cache.kv, md.page_table, batch.seq_lens, splits)
        return decode_attention(q, kv_cache.kv, md.page_table, batch.seq_lens, splits)
