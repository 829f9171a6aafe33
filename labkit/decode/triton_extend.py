"""Prefill attention as one Triton kernel that reads keys *through* the page table.

The torch path (:meth:`~labkit.decode.torch_attention.TorchNativeAttnBackend._forward_extend`)
gathers every request's keys into a dense tensor, pads the queries to the longest
request and runs SDPA under a causal bias: some ten ops per layer, each a launch from
Python. Between piecewise graphs that Python is the step's cost (lesson 09). SGLang's
``extend_attention_fwd`` (``python/sglang/srt/layers/attention/triton_ops/
extend_attention.py``) does it in one kernel; this is that idea at its smallest:

* one program per (request, query head, block of ``BLOCK_M`` new tokens);
* the new tokens' keys are already in the pool (:meth:`KVCache.store` runs first), so a
  program walks its request's keys ``0 .. position`` through the page table, prefix and
  new tokens alike, with a causal mask and an online softmax in fp32;
* no padding of the queries: a program past its request's new tokens returns at once.

CUDA only, like the decode kernel (:func:`~labkit.decode.triton_attention.triton_available`).
No autotuner: the block sizes are fixed (``BLOCK_M`` follows the longest extend).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch

from .buffers import ints_to_device

__all__ = ["ExtendKernelMetadata", "extend_attention", "extend_metadata"]

try:  # triton comes with CUDA builds of torch; CPU wheels have none
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

BLOCK_N = 64


@dataclass
class ExtendKernelMetadata:
    """What the kernel reads per request, planned once per batch for every layer.

    info       (4, n) int32 on the device: each request's first token in the flat batch,
               its new tokens, its length with them, its slot (one copy from the host)
    max_extend the longest request's new tokens (a host int: the grid's third axis)
    """

    info: torch.Tensor
    max_extend: int


def extend_metadata(batch, device) -> ExtendKernelMetadata:
    """Plan a prefill (or mixed) batch for :func:`extend_attention`, from its host lists:
    one non-blocking copy (:func:`~labkit.decode.buffers.ints_to_device`; no sync, no
    per-layer work)."""
    lens = list(batch.extend_lens)
    starts = list(itertools.accumulate(lens, initial=0))[:-1]
    n = len(lens)
    flat, = ints_to_device([starts + lens + list(batch.seq_lens_cpu) + [0] * n], device,
                           torch.int32)
    info = flat.view(4, n)
    info[3].copy_(batch.req_pool_indices)            # the slots are on the device already
    return ExtendKernelMetadata(info, max(lens))


if triton is not None:

    @triton.jit
    def _extend_kernel(Q, KV, PageTable, Info, Out, sm_scale, n_req,
                       stride_qt, stride_qh, stride_kvl, stride_kvs, stride_kvh, stride_pt,
                       stride_ot, stride_oh,
                       GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr):
        r = tl.program_id(0)                    # request
        h = tl.program_id(1)                    # query head
        start_m = tl.program_id(2) * BLOCK_M    # its first new token in this program
        ext = tl.load(Info + n_req + r)
        if start_m < ext:
            q_start = tl.load(Info + r)
            seq_len = tl.load(Info + 2 * n_req + r)
            slot = tl.load(Info + 3 * n_req + r)
            prefix = seq_len - ext              # keys cached before this step
            kv_h = h // GROUP
            offs_m = start_m + tl.arange(0, BLOCK_M)
            offs_d = tl.arange(0, HEAD_DIM)
            m_valid = offs_m < ext
            q = tl.load(Q + (q_start + offs_m)[:, None] * stride_qt + h * stride_qh
                        + offs_d[None, :], mask=m_valid[:, None], other=0.0)
            pos = prefix + offs_m               # each query's position: it sees keys <= pos
            hi = tl.minimum(seq_len, prefix + start_m + BLOCK_M)
            m_i = tl.zeros([BLOCK_M], dtype=tl.float32) - float("inf")
            l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
            acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
            for start_n in range(0, hi, BLOCK_N):
                offs_n = start_n + tl.arange(0, BLOCK_N)
                n_valid = offs_n < hi
                loc = tl.load(PageTable + slot * stride_pt + offs_n, mask=n_valid, other=0)
                base = KV + loc * stride_kvl + kv_h * stride_kvh
                k = tl.load(base[None, :] + offs_d[:, None], mask=n_valid[None, :], other=0.0)
                s = tl.dot(q, k) * sm_scale     # (BLOCK_M, BLOCK_N), fp32
                seen = n_valid[None, :] & (offs_n[None, :] <= pos[:, None])
                s = tl.where(seen, s, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(s, 1))
                alpha = tl.exp(m_i - m_new)     # rescale what was summed so far
                p = tl.exp(s - m_new[:, None])
                v = tl.load(base[:, None] + stride_kvs + offs_d[None, :],
                            mask=n_valid[:, None], other=0.0)
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
                l_i = l_i * alpha + tl.sum(p, 1)
                m_i = m_new
            out = acc / l_i[:, None]            # key 0 is seen by every query: l_i > 0
            tl.store(Out + (q_start + offs_m)[:, None] * stride_ot + h * stride_oh
                     + offs_d[None, :], out.to(Out.dtype.element_ty), mask=m_valid[:, None])


def extend_attention(q: torch.Tensor, kv_pool: torch.Tensor, page_table: torch.Tensor,
                     md: ExtendKernelMetadata, out: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of every new token of a prefill (or mixed) batch over its request's keys.

    q           (T, Hq, D): the batch's new tokens, request after request (unit last stride)
    kv_pool     (num_locs, 2, Hkv, D): the layer's pool, the new tokens' K/V stored already
    page_table  (num_slots, max_seq_len): ``req_to_token``, read at each request's slot
    md          :func:`extend_metadata` of the batch
    out         (T, Hq, D) to write into (default: a new tensor)

    Returns ``out``. One launch: the grid is (requests, Hq, blocks of the longest extend).
    """
    if triton is None:
        raise RuntimeError("extend_attention needs Triton (a CUDA build of torch); use "
                           "TorchNativeAttnBackend on this machine")
    T, hq, d = q.shape
    n = md.info.size(1)
    if out is None:
        out = torch.empty((T, hq, d), dtype=q.dtype, device=q.device)
    block_m = 16 if md.max_extend <= 16 else 64
    grid = (n, hq, triton.cdiv(md.max_extend, block_m))
    _extend_kernel[grid](q, kv_pool, page_table, md.info, out, 1.0 / math.sqrt(d), n,
                         q.stride(0), q.stride(1), kv_pool.stride(0), kv_pool.stride(1),
                         kv_pool.stride(2), page_table.stride(0), out.stride(0),
                         out.stride(1), GROUP=hq // kv_pool.size(2), HEAD_DIM=d,
                         BLOCK_M=block_m, BLOCK_N=BLOCK_N, num_warps=4)
    return out
