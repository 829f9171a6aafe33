"""labkit.decode — lesson 06: decode bucketing the SGLang way.

A tiny GPT with a static KV cache, batch-size buckets, padded static buffers, the decode
graph runner and a continuous-batching serving loop. One module per idea:

    model      ModelArgs, Transformer, build_model   (gpt-fast's shape; KV pool as buffers)
    batch      ForwardMode, ForwardBatch, make_decode_batch, make_extend_batch
    attention  make_attn_backend: an attention backend by name
    torch_attention   TorchNativeAttnBackend (metadata: out of graph / in graph; stock ops)
    triton_attention  TritonAttnBackend, decode_attention (GPU: keys read through the page
                      table; imported on demand, it needs Triton)
    buckets    default_buckets, pad_to_bucket, explore_buckets
    buffers    StaticBuffers, Pad                     (per-buffer padding policy)
    graph_runner_base  GraphBackend, FullGraphBackend, BaseGraphRunner, EagerRunner
               (every graph runner's base: lessons 06 and 09 build on it)
    options    DecodeRunnerOptions                    (the runner's options, checked at once)
    runner     DecodeGraphRunner                      (one BucketEntry per bucket, one LoadedStep)
    demos      demo_stale_tail (lesson 06's stale padding tail)
    serving    synthetic_workload, serve (synced, or overlap=True: the next step is staged with
               one copy and queued before the last step's tokens are read back)

    from labkit import backend
    from labkit.decode import build_model, DecodeGraphRunner, synthetic_workload, serve
    B = backend.get("auto")
    model = build_model("tiny", max_requests=16, device=B.device)
    runner = DecodeGraphRunner(model, B, max_bs=16); runner.capture()
    wl = synthetic_workload(32, vocab_size=model.args.vocab_size,
                            max_seq_len=model.args.max_seq_len)
    eager, graphed = serve(model, wl), serve(model, wl, runner=runner)
    assert eager.tokens == graphed.tokens
"""

from .attention import ATTENTION_BACKENDS, DecodeMetadata, TorchNativeAttnBackend, make_attn_backend
from .batch import ForwardBatch, ForwardMode, make_decode_batch, make_extend_batch
from .buckets import (
                      BatchTooLargeError,
                      BucketReport,
                      default_buckets,
                      explore_buckets,
                      make_buckets,
                      pad_to_bucket,
                      pow2_buckets,
)
from .buffers import SEQ_LEN_FILL_VALUE, GraphSlot, Pad, StaticBuffers
from .demos import demo_stale_tail
from .graph_runner_base import BaseGraphRunner, EagerRunner, FullGraphBackend, GraphBackend
from .model import CONFIGS, DUMMY_SLOT, ModelArgs, Transformer, build_model, greedy
from .options import DecodeRunnerOptions
from .runner import DecodeGraphRunner
from .serving import Request, ServeResult, serve, synthetic_workload

__all__ = [
    "ATTENTION_BACKENDS", "DecodeMetadata", "TorchNativeAttnBackend", "make_attn_backend",
    "ForwardBatch", "ForwardMode", "make_decode_batch", "make_extend_batch",
    "BatchTooLargeError", "BucketReport", "default_buckets", "explore_buckets", "make_buckets",
    "pad_to_bucket", "pow2_buckets",
    "SEQ_LEN_FILL_VALUE", "GraphSlot", "Pad", "StaticBuffers",
    "CONFIGS", "DUMMY_SLOT", "ModelArgs", "Transformer", "build_model", "greedy",
    "BaseGraphRunner", "DecodeGraphRunner", "DecodeRunnerOptions", "EagerRunner",
    "FullGraphBackend", "GraphBackend", "demo_stale_tail",
    "Request", "ServeResult", "serve", "synthetic_workload",
]
