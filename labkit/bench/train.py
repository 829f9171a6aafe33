"""Suite ``train``: one training step, eager vs per-layer graphs vs the whole step (07).

The model is ``labkit.full_step``'s ``"bench"`` LM: 6 pre-norm transformer layers, d=256,
4 microbatches of 4×64 tokens per step, AdamW. Variants:

``eager``
    ``zero_grad`` + forward/backward of every microbatch + ``AdamW.step()``, no graphs.
``labkit_bridge``
    each layer replaced by labkit's from-scratch fwd/bwd graph pair
    (``labkit.bridge.make_graphed_callables``, lesson 04); embedding, head, loss and
    optimizer stay eager.
``torch_make_graphed_callables``
    the same with ``torch.cuda.make_graphed_callables`` (one call for all layers: one
    pool, forwards captured in order, backwards in reverse).
``labkit_full_step``
    ``FullStepTrainer``: fwd+bwd of all microbatches as one graph and
    ``AdamW(capturable=True)`` as a second, sharing a pool (Megatron's ``full_iteration``).
``compile_reduce_overhead`` (GPU only)
    the model under ``torch.compile(mode="reduce-overhead")``; loss and optimizer eager.

Every variant starts from the same seeded weights and cycles through the same random
batches; each timed call is one full step (for the graph variants: copying the batch
into the static buffers included). All variants are built and warmed up first, then
timed interleaved, one step of each in turn (the per-layer variants are host-bound, and
host speed drifts: measured one after the other, a 10% comparison could flip).
"""

from __future__ import annotations

import dataclasses
import gc
import itertools

import torch

from labkit import full_step as FS
from labkit.bench import SuiteSkip, make_row, skipped_row
from labkit.bench.timing import gpu_busy_us, measure_interleaved_us, measure_us

VARIANTS = ("eager", "labkit_bridge", "torch_make_graphed_callables", "labkit_full_step",
            "compile_reduce_overhead")
LR = 1e-3


def _sample(cfg: FS.LMConfig, B) -> torch.Tensor:
    return torch.randn(cfg.micro_batch, cfg.seq_len, cfg.d_model, device=B.device,
                       requires_grad=True)


def _graph_layers(model: FS.TinyLM, graphed) -> None:
    for i, g in enumerate(graphed):
        model.blocks[i] = g


def build(variant: str, cfg: FS.LMConfig, B):
    """A fresh model and a ``step(batch)`` callable for one variant."""
    model = FS.build_lm(cfg, B.device)
    blocks = tuple(model.blocks)
    samples = tuple((_sample(cfg, B),) for _ in blocks)
    if variant == "eager":
        return FS.EagerTrainer(model, FS.lm_loss, torch.optim.AdamW(model.parameters(), lr=LR))
    if variant == "labkit_bridge":
        try:
            from labkit import bridge
        except ImportError as e:
            raise SuiteSkip(f"labkit.bridge is not importable ({e})") from None
        mgc = getattr(bridge, "make_graphed_callables", None)
        if mgc is None:
            raise SuiteSkip("labkit.bridge has no make_graphed_callables(callables, "
                            "sample_args, B=...)")
        _graph_layers(model, mgc(blocks, samples, B=B))
        return FS.EagerTrainer(model, FS.lm_loss, torch.optim.AdamW(model.parameters(), lr=LR))
    if variant == "torch_make_graphed_callables":
        _graph_layers(model, B.make_graphed_callables(blocks, samples))
        return FS.EagerTrainer(model, FS.lm_loss, torch.optim.AdamW(model.parameters(), lr=LR))
    if variant == "labkit_full_step":
        opt = FS.make_capturable_optimizer(model.parameters(), B, lr=LR)
        return FS.FullStepTrainer(model, FS.lm_loss, opt, B, cfg.num_microbatches,
                                  warmup_steps=2)
    if variant == "compile_reduce_overhead":
        if B.name != "cuda":
            raise SuiteSkip("reduce-overhead records CUDA graphs only on a GPU")
        FS.ensure_grads(model.parameters())    # .grad allocated outside the cudagraph pool
        compiled = torch.compile(model, mode="reduce-overhead")
        return FS.EagerTrainer(compiled, FS.lm_loss,
                               torch.optim.AdamW(model.parameters(), lr=LR))
    raise ValueError(f"unknown train variant {variant!r}")


def _cudagraph_skips() -> int:
    try:
        from torch._dynamo.utils import counters
        return int(counters["inductor"]["cudagraph_skips"])
    except Exception:
        return 0


def run(B, quick: bool = False, log=print, cfg: FS.LMConfig | str | None = None,
        variants=VARIANTS) -> list[dict]:
    """Build every variant, then time them interleaved (one step of each in turn, see
    :func:`~labkit.bench.timing.measure_interleaved_us`), then profile each for
    ``gpu_busy_us``. A variant that cannot be built becomes a row with a note."""
    if cfg is None:
        cfg = "bench" if B.name == "cuda" else "tiny"
    name = cfg if isinstance(cfg, str) else "custom"
    cfg = FS.CONFIGS[cfg] if isinstance(cfg, str) else cfg
    config = {**dataclasses.asdict(cfg), "optimizer": "AdamW", "lr": LR}
    repeats, warmup = (8, 4) if quick else (30, 6)
    gen = torch.Generator().manual_seed(0)
    batches = [FS.random_microbatches(cfg, gen, device=B.device) for _ in range(4)]
    rows: dict[str, dict] = {}
    steps = {}

    def failed(variant, e):
        first = (str(e).splitlines() or [""])[0][:200]
        rows[variant] = skipped_row(B, "train", name, config, cfg.micro_batch, variant,
                                    f"{type(e).__name__}: {first}")
        steps.pop(variant, None)
        log(f"  train {variant:30s} FAILED: {type(e).__name__}: {first}")

    skips = _cudagraph_skips()
    for variant in variants:
        try:
            trainer = build(variant, cfg, B)
            cycle = itertools.cycle(batches)

            def step(trainer=trainer, cycle=cycle):
                return trainer.step(next(cycle))

            for _ in range(warmup):      # warm-up, capture, compile: before any timing
                step()
            steps[variant] = step
        except SuiteSkip as why:
            rows[variant] = skipped_row(B, "train", name, config, cfg.micro_batch, variant,
                                        str(why))
            log(f"  train {variant:30s} skipped: {why}")
        except Exception as e:  # one broken variant must not lose the others' numbers
            failed(variant, e)
    compile_note = None
    if "compile_reduce_overhead" in steps and _cudagraph_skips() > skips:
        compile_note = "torch skipped cudagraphs for part of the model (see its log)"
    try:
        medians = measure_interleaved_us(steps, B, warmup=1, repeats=repeats)
    except Exception as e:      # fall back to one variant at a time, to find the culprit
        log(f"  train: interleaved timing failed ({type(e).__name__}: {e}); one at a time")
        medians = {}
        for variant, step in list(steps.items()):
            try:
                medians[variant] = measure_us(step, B, warmup=1, repeats=repeats)
            except Exception as e2:
                failed(variant, e2)
    for variant, step in list(steps.items()):
        try:
            busy = gpu_busy_us(step, B)
        except Exception as e:
            failed(variant, e)
            continue
        med = medians[variant]
        rows[variant] = make_row(B, "train", name, config, cfg.micro_batch, variant, med, busy,
                                 note=compile_note if variant == "compile_reduce_overhead"
                                 else None, extra={"timing": "interleaved"})
        log(f"  train {variant:30s} {med / 1e3:9.3f} ms")
    steps.clear()
    gc.collect()
    if B.name == "cuda":
        torch._dynamo.reset()
        torch.cuda.empty_cache()
    return [rows[v] for v in variants if v in rows]
