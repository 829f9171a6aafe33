"""The prefill attention kernel (labkit.decode.triton_extend) against the torch path.

On a GPU the kernel runs for real (marker ``cuda``). Where Triton is installed without a
GPU, the same comparison runs under Triton's interpreter (``TRITON_INTERPRET=1`` must be
set before triton is imported, so that case runs in a subprocess).
"""

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

from labkit import backend
from labkit import decode as D
from labkit import piecewise as P
from labkit.decode.attention import make_attn_backend

HAS_TRITON = importlib.util.find_spec("triton") is not None

# (prefill {slot: prompt length}, decode {slot: prefix length}): the cases a kernel gets
# wrong first: one token, a request longer than one key block, a prefix before the new
# tokens, requests of every size side by side.
CASES = [
    ({1: 1}, {}),
    ({1: 70, 2: 3}, {}),
    ({1: 20, 2: 70, 3: 2}, {4: 30, 5: 7}),
    ({}, {1: 5, 2: 90}),
    ({1: 16, 2: 17, 3: 64, 4: 65}, {}),
]


def compare(device: str, dtype: torch.dtype, n_head=4, n_kv=2) -> list[float]:
    """Max |kernel - torch path| for every case, with K/V of the prefix random."""
    from labkit.decode.triton_extend import extend_attention, extend_metadata
    torch.manual_seed(0)
    args = D.ModelArgs(vocab_size=64, n_layer=1, n_head=n_head, n_local_heads=n_kv, dim=64,
                       max_seq_len=160)
    model = D.build_model(args, max_requests=6, device=device).to(dtype)
    attn = make_attn_backend("torch_native", model)
    cache = model.layers[0].attention.kv_cache
    errs = []
    for prefill, decode in CASES:
        cache.kv.normal_()
        batch = P.make_mixed_batch(model, {s: [1] * n for s, n in prefill.items()},
                                   {s: (2, p) for s, p in decode.items()})
        T, hd = batch.num_tokens, args.head_dim
        # q as the model hands it over: a strided view of one wider tensor
        q = torch.randn(T, n_head + 2, hd, device=device, dtype=dtype)[:, :n_head]
        kv = torch.randn(T, 2, n_kv, hd, device=device, dtype=dtype)
        batch.attn_backend = attn
        attn.init_forward_metadata(batch)
        want = attn.forward(q, kv[:, 0], kv[:, 1], cache, batch, kv=kv)   # stores kv too
        got = extend_attention(q, cache.kv, model.req_to_token, extend_metadata(batch, device))
        assert got.shape == want.shape and got.dtype == want.dtype
        errs.append((got.float() - want.float()).abs().max().item())
    return errs


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_kernel_equals_torch_path_on_gpu():
    errs = compare("cuda", torch.float16)
    assert max(errs) < 2e-3, errs


@pytest.mark.skipif(not HAS_TRITON or torch.cuda.is_available(),
                    reason="the interpreter case: Triton installed, no GPU")
def test_kernel_equals_torch_path_interpreted():
    code = ("import torch; from tests.test_triton_extend import compare; "
            "print(max(compare('cpu', torch.float32)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, "TRITON_INTERPRET": "1"}, timeout=300,
                         cwd=os.path.dirname(os.path.dirname(__file__)))
    assert out.returncode == 0, out.stderr[-2000:]
    assert float(out.stdout.split()[-1]) < 1e-5


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_piecewise_with_the_kernel_matches_eager():
    B = backend.get("cuda")
    model = D.build_model("tiny", max_requests=8, device=B.device)
    pw = P.PiecewiseGraphRunner(model, B, max_num_tokens=64, progress=False,
                                attention="triton")
    pw.capture()
    eager = D.EagerRunner(model)
    batch = P.make_mixed_batch(model, {1: list(range(1, 20)), 2: [5, 6, 7]}, {})
    want = eager.forward(batch)
    batch2 = P.make_mixed_batch(model, {1: list(range(1, 20)), 2: [5, 6, 7]}, {})
    got = pw.forward(batch2)
    assert pw.attn.name == "triton" and pw.last_replay == (22, pw.last_replay[1])
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    pw.backend.cleanup()
