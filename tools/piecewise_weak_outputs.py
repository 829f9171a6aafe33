"""Pool memory of piecewise graphs: labkit's strong output references against vLLM's weak ones.

An authoring tool for lesson 09 §4 (issue #29), not part of ``labkit``. vLLM's
``CUDAGraphWrapper`` keeps each captured output as a weak reference
(``entry.output = weak_ref_tensors(output)`` in ``CUDAGraphWrapper.__call__``,
``vllm/compilation/cuda_graph.py``): once a token count's capture pass is over, nothing
holds that count's tensors, and the next capture, of a smaller count into the same pool,
reuses their memory. labkit's :class:`~labkit.piecewise.runner.PiecewiseBackend` keeps
strong references (``inputs`` and ``outputs`` per bucket and piece), so every bucket's
piece outputs stay allocated. This script captures the same model both ways, prints the
pool each one reserved and holds allocated, and checks that both still equal eager::

    python tools/piecewise_weak_outputs.py                      # "small", up to 256 tokens
    python tools/piecewise_weak_outputs.py --model tiny --max-tokens 64 --backend emulated

The weak half needs a GPU: a weak reference here is a tensor built on a CUDA address it
does not own (``torch._C._construct_storage_from_data_pointer`` and
``torch._C._construct_CUDA_Tensor_From_Storage_And_Metadata``, as torch's CUDA graph trees
rebuild their outputs in ``CUDAGraphNode._reconstruct_from_tensor_metadata``). On the
emulator the script runs labkit's strong half only, and says so.
"""

from __future__ import annotations

import argparse
import sys

import torch

from labkit import backend
from labkit.decode import EagerRunner, build_model, make_extend_batch
from labkit.decode.model import CONFIGS
from labkit.piecewise import PiecewiseGraphRunner
from labkit.piecewise.runner import GraphedPiece, PiecewiseBackend


def weak(t):
    """A tensor on ``t``'s memory that does not keep it alive (``t`` itself if not a tensor)."""
    if not isinstance(t, torch.Tensor):
        return t
    storage = t.untyped_storage()
    meta = {"nbytes": storage.nbytes(), "data_ptr": storage.data_ptr(), "size": t.shape,
            "stride": t.stride(), "dtype": t.dtype, "device": t.device,
            "storage_offset": t.storage_offset()}
    alias = torch._C._construct_storage_from_data_pointer(meta["data_ptr"], meta["device"],
                                                          meta["nbytes"])
    return torch._C._construct_CUDA_Tensor_From_Storage_And_Metadata(meta, alias)


def _tensors(x):
    return [t for t in (x if isinstance(x, (tuple, list)) else (x,))
            if isinstance(t, torch.Tensor)]


class WeakOutputBackend(PiecewiseBackend):
    """labkit's piecewise backend with vLLM's bookkeeping: the pieces' outputs (memory of
    the graph pool) are held as weak references, by the piece that made them and by the
    pieces that read them. Attention's outputs (eager, outside the pool), the weights and
    the runner's static buffers stay strong: the replay copies into the first and reads
    the others."""

    def __init__(self, B, num_warmups: int = 2):
        super().__init__(B, num_warmups)
        self._pool_ptrs: set[int] = set()     # storages of piece outputs (the pool's memory)

    def capture_piece(self, index, submod, args):
        out = super().capture_piece(index, submod, args)
        key = (self.bucket, index)
        self._pool_ptrs.update(t.untyped_storage().data_ptr() for t in _tensors(out))
        self.outputs[key] = (type(out)(weak(o) for o in out) if isinstance(out, (tuple, list))
                             else weak(out))
        self.inputs[key] = tuple(
            weak(a) if isinstance(a, torch.Tensor)
            and a.untyped_storage().data_ptr() in self._pool_ptrs else a for a in args)
        return out     # the real output for the rest of this capture pass, as vLLM returns it


def weak_runner(model, B, **kw) -> PiecewiseGraphRunner:
    """A :class:`PiecewiseGraphRunner` whose pieces use :class:`WeakOutputBackend`."""
    runner = PiecewiseGraphRunner(model, B, **kw)
    runner.backend = WeakOutputBackend(B, runner.backend.num_warmups)
    for m in runner.split.split_gm.modules():
        if isinstance(m, GraphedPiece):
            m.backend = runner.backend
    return runner


def measure(make, model, B, batches) -> dict:
    """Capture with ``make()``, then run ``batches``: pool bytes, and the largest
    difference of the logits from eager's."""
    runner = make()
    runner.capture()
    stats = B.pool_stats(runner.backend.pool)
    eager = EagerRunner(model)
    diff = max((runner.forward(b()).float() - eager.forward(b()).float()).abs().max().item()
               for b in batches)
    row = {"graphs": len(runner.backend.graphs), "buckets": len(runner.buckets),
           "pieces": runner.num_pieces, "reserved": stats["reserved_bytes"],
           "allocated": stats["allocated_bytes"], "diff": diff}
    runner.backend.cleanup()
    return row


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python tools/piecewise_weak_outputs.py",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=sorted(CONFIGS), default="small",
                   help="labkit.decode config (default: small)")
    p.add_argument("--max-tokens", type=int, default=256,
                   help="largest token bucket captured (default 256)")
    p.add_argument("--backend", choices=("auto", "cuda", "emulated"), default="auto",
                   help="labkit backend (default auto: cuda when there is a GPU)")
    a = p.parse_args(argv)
    if not 1 <= a.max_tokens <= 8192:
        p.error(f"--max-tokens must be between 1 and 8192, got {a.max_tokens}")
    return a


def main(argv=None) -> int:
    a = parse_args(argv)
    B = backend.get(a.backend)
    model = build_model(a.model, max_requests=8, device=B.device)
    n = min(a.max_tokens, model.args.max_seq_len)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, model.args.vocab_size, (k,), generator=gen).tolist()
               for k in (max(1, n // 3), max(1, n // 2))]
    batches = [lambda p=p, s=s: make_extend_batch(model, [s], [p])
               for s, p in enumerate(prompts, start=1)]
    print(f"model {a.model} ({model.args.n_layer} layers, dim {model.args.dim}, "
          f"{model.output.weight.dtype}), buckets up to {a.max_tokens} tokens, {B.name}")
    rows = {"labkit (strong outputs)": measure(
        lambda: PiecewiseGraphRunner(model, B, max_num_tokens=a.max_tokens, progress=False),
        model, B, batches)}
    if B.name == "cuda":
        rows["vLLM's way (weak outputs)"] = measure(
            lambda: weak_runner(model, B, max_num_tokens=a.max_tokens, progress=False),
            model, B, batches)
    first = next(iter(rows.values()))
    print(f"{first['graphs']} graphs = {first['buckets']} buckets x {first['pieces']} pieces")
    print(f"{'':28s}{'pool reserved MiB':>18s}{'allocated MiB':>15s}{'max |logits - eager|':>22s}")
    for name, r in rows.items():
        print(f"{name:28s}{r['reserved'] / 2**20:18.1f}{r['allocated'] / 2**20:15.1f}"
              f"{r['diff']:22.2e}")
    if B.name != "cuda":
        print("(the weak half needs a GPU: weak references are built on CUDA addresses)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
