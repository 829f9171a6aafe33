"""labkit's graphs own their cuBLAS workspace: a later clear (as torch.compile's
reduce-overhead does around its own recordings) cannot pull memory from under them.

On the emulated backend the clear is a no-op and the tests check the results only; on a
GPU (``pytest -m cuda``) they free every cached workspace, return the memory, scribble
over fresh allocations and replay.
"""

import pytest
import torch

from labkit import capture as C
from labkit.bridge import make_graphed_callables


def _clear_and_scribble(B):
    if B.name == "cuda":
        torch._C._cuda_clearCublasWorkspaces()
        torch.cuda.empty_cache()
    junk = [torch.full((1 << 20,), float("nan"), device=B.device) for _ in range(8)]
    return junk


def test_fresh_cublas_workspaces_is_safe_to_call(B):
    C.fresh_cublas_workspaces(B)
    a = torch.randn(64, 64, device=B.device)
    assert torch.allclose(a @ a, (a.double() @ a.double()).float(), atol=1e-3)


def test_captured_matmul_survives_a_workspace_clear(B):
    w = torch.randn(128, 128, device=B.device)
    x = torch.randn(32, 128, device=B.device)
    cap = C.capture(lambda t: torch.relu(t @ w) @ w, x, B=B)
    _ = _clear_and_scribble(B)
    x.copy_(torch.randn(32, 128, device=B.device))
    cap.graph.replay()
    B.synchronize()
    assert torch.allclose(cap.output, torch.relu(x @ w) @ w, rtol=1e-3, atol=1e-3)


def test_bridge_graphs_survive_a_workspace_clear(B):
    torch.manual_seed(0)
    layer = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(),
                                torch.nn.Linear(64, 64)).to(B.device)
    x = torch.randn(8, 64, device=B.device, requires_grad=True)
    graphed = make_graphed_callables(layer, (x,), B=B)
    _ = _clear_and_scribble(B)
    xi = torch.randn(8, 64, device=B.device, requires_grad=True)
    out = graphed(xi)
    out.sum().backward()
    B.synchronize()
    ref_x = xi.detach().clone().requires_grad_(True)
    ref = layer(ref_x)
    ref.sum().backward()
    assert torch.allclose(out, ref, rtol=1e-3, atol=1e-3)
    assert torch.allclose(xi.grad, ref_x.grad, rtol=1e-3, atol=1e-3)


def test_warmup_on_the_capture_stream_then_capture_survives_a_clear(B):
    # the hazard itself: warm-up caches a workspace on the stream capture will use
    w = torch.randn(256, 256, device=B.device)
    x = torch.randn(64, 256, device=B.device)
    s = B.Stream()
    s.wait_stream(B.current_stream())
    with B.stream(s):
        for _ in range(3):
            torch.relu(x @ w) @ w
    B.current_stream().wait_stream(s)
    cap = C.capture(lambda t: torch.relu(t @ w) @ w, x, B=B, stream=s, warmup=0)
    _ = _clear_and_scribble(B)
    x.copy_(torch.randn(64, 256, device=B.device))
    cap.graph.replay()
    B.synchronize()
    assert torch.allclose(cap.output, torch.relu(x @ w) @ w, rtol=1e-3, atol=1e-3)


def test_decode_graphs_survive_a_workspace_clear(B):
    from labkit.decode import DecodeGraphRunner, build_model, make_decode_batch

    m = build_model("tiny", max_requests=8, device=B.device, dtype=torch.float32)
    r = DecodeGraphRunner(m, B, progress=False, max_bs=8)
    r.capture()
    _ = _clear_and_scribble(B)
    slots = [1, 2, 3]
    batch = make_decode_batch(m, slots, [5, 6, 7], [0, 0, 0])
    eager = r.eager_forward(batch).clone()
    graphed = r.forward(batch)
    torch.testing.assert_close(graphed, eager, rtol=1e-4, atol=1e-4)


def _general_pool_blocks_on(stream) -> set:
    """(address, size) of every live block of the general pool allocated on ``stream``."""
    return {(b["address"], b["size"])
            for seg in torch.cuda.memory_snapshot()
            if tuple(seg["segment_pool_id"]) == (0, 0) and seg["stream"] == stream.cuda_stream
            for b in seg["blocks"] if b["state"] == "active_allocated"}


def test_bridge_graphs_of_several_layers_record_no_general_pool_workspace(B):
    """Two layers, one pool: a warm-up between two captures would cache a workspace from
    the general pool for the autograd thread's cuBLAS handle, and every backward capture
    after it would record that block, and the next clear frees it from under them. All
    warm-ups run before the first capture."""
    if B.name != "cuda":
        pytest.skip("the emulator has no cuBLAS workspaces")
    from labkit.bridge import capture_stream

    torch.manual_seed(0)
    layers = tuple(torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.GELU(),
                                       torch.nn.Linear(256, 256)).to(B.device)
                   for _ in range(2))
    samples = tuple((torch.randn(64, 256, device=B.device, requires_grad=True),)
                    for _ in layers)
    C.fresh_cublas_workspaces(B)
    make_graphed_callables(layers, samples, B=B)
    B.synchronize()
    stream = capture_stream(B)
    before = _general_pool_blocks_on(stream)
    C.fresh_cublas_workspaces(B)         # frees exactly the cached workspaces
    freed = before - _general_pool_blocks_on(stream)
    assert not freed, (f"{len(freed)} cached cuBLAS workspace(s) of the general pool on the "
                       f"capture stream after the captures: {sorted(freed)}")
