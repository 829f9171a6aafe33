"""Suite ``decode``: one decode step, eager vs labkit's graph runner vs torch.compile (06).

An 8-layer, d=512, 8-head fp16 GPT from ``labkit.decode`` (KV caches filled with random
values, random tokens, random sequence lengths) at batch sizes 1, 8 and 64. Variants:

``eager``
    ``EagerRunner.forward``: build the attention metadata, run the model.
``labkit_graph``
    ``DecodeGraphRunner`` with buckets [1, 8, 64] captured largest first in one pool;
    each timed call takes the full path (pad to the bucket, fill the static buffers,
    rebuild metadata out of graph, replay, slice), not the planned fast path. Attention
    ``"auto"``: on a GPU the Triton decode kernel that reads keys through the page table
    (:mod:`labkit.decode.triton_attention`); ``eager`` uses the same kernels.
    ``extra.replay_only_us``: ``graph.replay()`` alone, without the host work around it.
``labkit_graph_torch_attn``
    the same runner with ``attention="torch_native"``: stock kernels only (gather the
    keys with ``index_select``, then SDPA): the plain recipe.
``labkit_graph_compiled``
    the torch_native runner with ``compile_bs=64``: the model is compiled (no cudagraphs
    of its own) and the compiled model is captured into the runner's graphs (SGLang's
    ``torch_compile_max_bs``). The runner compiles with
    ``mode="max-autotune-no-cudagraphs"``, whose GEMM autotuning takes minutes; the
    suite asks for ``compile_mode`` (default ``"default"``: fusion, no autotuning)
    unless told otherwise, and records which in the row's config.
``compile_reduce_overhead``
    ``torch.compile(model, mode="reduce-overhead")`` on the eager path: torch's own
    CUDA graphs, one recording per batch size. If torch skips its graphs (e.g. for a
    mutated input), the row says so.

Rows a backend or the installed ``labkit.decode`` cannot produce are recorded as skipped
with a note, never silently dropped.
"""

from __future__ import annotations

import gc

import torch

from labkit.bench import SuiteSkip, make_row, skipped_row
from labkit.core.timing import measure_us, profile_gpu_busy_us

VARIANTS = ("eager", "labkit_graph", "labkit_graph_torch_attn", "labkit_graph_compiled",
            "compile_reduce_overhead")
MODEL = dict(vocab_size=1024, n_layer=8, n_head=8, n_local_heads=8, dim=512, max_seq_len=256)
CPU_MODEL = dict(vocab_size=128, n_layer=2, n_head=4, n_local_heads=4, dim=64, max_seq_len=64)


def _cudagraph_skips() -> int:
    try:
        from torch._dynamo.utils import counters
        return int(counters["inductor"]["cudagraph_skips"])
    except Exception:
        return 0


def _batches(D, model, batch_sizes, gen):
    """One random decode batch per size: slots 1..bs, random tokens and lengths."""
    a = model.args
    out = {}
    for bs in batch_sizes:
        tokens = torch.randint(0, a.vocab_size, (bs,), generator=gen).tolist()
        starts = torch.randint(8, a.max_seq_len - 1, (bs,), generator=gen).tolist()
        out[bs] = D.make_decode_batch(model, list(range(1, bs + 1)), tokens, starts)
    return out


def _runner(D, model, B, batch_sizes, compile_bs: int = 0, compile_mode: str | None = None,
            attention: str = "torch_native"):
    kw = dict(max_bs=max(batch_sizes), buckets=sorted(batch_sizes), progress=False)
    if attention != "torch_native":
        kw["attention"] = attention
    if compile_bs:
        kw["compile_bs"] = compile_bs
    try:
        runner = D.DecodeGraphRunner(model, B, **kw)
    except TypeError as e:
        raise SuiteSkip(f"labkit.decode.DecodeGraphRunner does not take {sorted(kw)}: {e}")
    if compile_bs and compile_mode and hasattr(runner, "_compiled"):
        # the runner compiles lazily into `_compiled`; hand it our mode instead
        runner._compiled = torch.compile(model, mode=compile_mode, dynamic=False)
    runner.capture()
    return runner


def run(B, quick: bool = False, log=print, model_args: dict | None = None,
        batch_sizes=None, variants=VARIANTS, compile_mode: str = "default",
        attention: str = "auto") -> list[dict]:
    try:
        from labkit import decode as D
    except ImportError as e:
        return [skipped_row(B, "decode", "gpt", {}, None, v, f"labkit.decode: {e}")
                for v in variants]
    on_gpu = B.name == "cuda"
    if model_args is None:
        model_args = MODEL if on_gpu else CPU_MODEL
    if batch_sizes is None:
        batch_sizes = (1, 8, 64) if on_gpu else (1, 4)
    args = D.ModelArgs(**model_args)
    model = D.build_model(args, max_requests=max(batch_sizes), device=B.device)
    dtype = model.output.weight.dtype
    with torch.no_grad():
        for layer in model.layers:
            layer.attention.kv_cache.k_cache.normal_()
            layer.attention.kv_cache.v_cache.normal_()
    name = f"gpt_{args.n_layer}L_d{args.dim}"
    config = {**model_args, "dtype": str(dtype).replace("torch.", "")}
    gen = torch.Generator().manual_seed(0)
    batches = _batches(D, model, batch_sizes, gen)
    repeats, warmup = (10, 3) if quick else (50, 10)
    rows = []

    def record(variant, fns, note=None, cfg_extra=None, replays=None):
        for bs in batch_sizes:
            med = measure_us(fns[bs], B, warmup=warmup, repeats=repeats)
            busy = profile_gpu_busy_us(fns[bs], B)
            extra = None
            if replays is not None:
                extra = {"replay_only_us": round(measure_us(replays[bs], B, warmup=warmup,
                                                            repeats=repeats), 3)}
            rows.append(make_row(B, "decode", name, {**config, **(cfg_extra or {})}, bs,
                                 variant, med, busy, note=note, extra=extra))
            log(f"  decode bs={bs:3d} {variant:26s} {med:9.1f} µs"
                + (f" (replay alone {extra['replay_only_us']:.1f})" if extra else ""))

    for variant in variants:
        try:
            skips = _cudagraph_skips()
            if variant == "eager":
                eager = D.EagerRunner(model, attention)
                record(variant, {bs: (lambda b=b: eager.forward(b)) for bs, b in batches.items()},
                       cfg_extra={"attention": eager.attn.name})
            elif variant in ("labkit_graph", "labkit_graph_torch_attn", "labkit_graph_compiled"):
                compiled = variant == "labkit_graph_compiled"
                if compiled and not on_gpu:
                    raise SuiteSkip("compiling before capture is measured on a GPU only")
                attn = attention if variant == "labkit_graph" else "torch_native"
                runner = _runner(D, model, B, batch_sizes,
                                 compile_bs=max(batch_sizes) if compiled else 0,
                                 compile_mode=compile_mode if compiled else None,
                                 attention=attn)

                def full_path(b, runner=runner):
                    b.metadata_ready = False       # time the full path, not the fast path
                    return runner.forward(b)

                cfg_extra = {"attention": runner.attn.name}
                if compiled:
                    cfg_extra["compile_mode"] = compile_mode
                record(variant, {bs: (lambda b=b: full_path(b)) for bs, b in batches.items()},
                       cfg_extra=cfg_extra,
                       replays={bs: runner.backend.graphs[bs].replay for bs in batch_sizes})
                runner.backend.cleanup()
            elif variant == "compile_reduce_overhead":
                if not on_gpu:
                    raise SuiteSkip("reduce-overhead records CUDA graphs only on a GPU")
                er = D.EagerRunner(model)
                er.model = torch.compile(model, mode="reduce-overhead", dynamic=False)
                note = None

                def fwd(b, er=er):
                    return er.forward(b)

                fns = {bs: (lambda b=b: fwd(b)) for bs, b in batches.items()}
                for f in fns.values():               # compile every size before timing
                    f()
                if _cudagraph_skips() > skips:
                    note = "torch skipped cudagraphs (see its log): compiled without graphs"
                record(variant, fns, note=note, cfg_extra={"attention": "torch_native"})
            else:
                raise ValueError(f"unknown decode variant {variant!r}")
        except SuiteSkip as why:
            for bs in batch_sizes:
                rows.append(skipped_row(B, "decode", name, config, bs, variant, str(why)))
            log(f"  decode {variant:26s} skipped: {why}")
        except Exception as e:
            first = (str(e).splitlines() or [""])[0][:200]
            for bs in batch_sizes:
                rows.append(skipped_row(B, "decode", name, config, bs, variant,
                                        f"{type(e).__name__}: {first}"))
            log(f"  decode {variant:26s} FAILED: {type(e).__name__}: {first}")
        finally:
            gc.collect()
            if on_gpu:
                torch._dynamo.reset()
                torch.cuda.empty_cache()
    return rows
