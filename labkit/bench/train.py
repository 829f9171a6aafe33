"""Suite ``train``: one training step, eager vs per-layer graphs vs the whole step (07).

The model is ``labkit.full_step``'s ``"bench"`` LM: 6 pre-norm transformer layers, d=256,
4 microbatches of 4×64 tokens per step, AdamW. Variants:

``eager``
    ``zero_grad`` + forward/backward of every microbatch + ``AdamW.step()``, no graphs.
``labkit_bridge``
    each layer replaced by labkit's from-scratch fwd/bwd graph pair
    (``labkit.bridge.make_graphed_callables``, lesson 04); embedding, head, loss and
    optimizer stay eager.
``labkit_bridge_no_clone``
    the same with ``clone_wgrads=False``: the weight gradients returned as the static
    buffers, as torch's function returns them, instead of Megatron's clone per weight
    gradient per microbatch. It shows what the clone costs, and trains wrongly: over 4
    microbatches ``.grad`` ends up aliasing the static buffer, which the next replay
    overwrites (lesson 04 §5, pytorch#181723).
``torch_make_graphed_callables``
    the same with ``torch.cuda.make_graphed_callables`` (one call for all layers: one
    pool, forwards captured in order, backwards in reverse); wrong in the same way.
``labkit_full_step``
    ``FullStepTrainer``: fwd+bwd of all microbatches as one graph and
    ``AdamW(capturable=True)`` as a second, sharing a pool (Megatron's ``full_iteration``).
``labkit_full_step_compiled`` (GPU only)
    the same ``FullStepTrainer`` around ``torch.compile(model)`` (``mode="default"``: no
    cudagraphs of its own): the warm-up steps compile the forward and the backward, the
    capture then records Inductor's fused kernels. Compile-then-capture for training.
``compile_reduce_overhead`` (GPU only)
    the model under ``torch.compile(mode="reduce-overhead")``; loss and optimizer eager.

Every variant starts from the same seeded weights and cycles through the same random
batches; each timed call is one full step (for the graph variants: copying the batch
into the static buffers included), timed both ways: synced before every step
(``median_us``) and back to back (``back_to_back_us``, 20 steps between two events). All
variants are built first and then timed in interleaved rounds
(:mod:`labkit.bench.rounds`); GPU busy comes from one profiled step after the rounds.
Each row records ``max_abs_diff_vs_eager``: how far the variant's weights are from
eager's after the same build steps.
"""

from __future__ import annotations

import dataclasses
import gc
import itertools

import torch

from labkit import full_step as FS
from labkit.bench import SuiteSkip, cudagraph_skips, make_row, round_timer, unmeasured_rows
from labkit.bench.rounds import DEFAULT_ROUNDS, interleave
from labkit.bench.variants import check_names, defaults
from labkit.bench.variants import variant as declared_variant
from labkit.core.timing import profile_gpu_busy_us

VARIANTS = defaults("train")       # declared in labkit.bench.variants
LR = 1e-3


def _sample(cfg: FS.LMConfig, B) -> torch.Tensor:
    return torch.randn(cfg.micro_batch, cfg.seq_len, cfg.d_model, device=B.device,
                       requires_grad=True)


def _graph_layers(model: FS.TinyLM, graphed) -> None:
    for i, g in enumerate(graphed):
        model.blocks[i] = g


def build(variant: str, cfg: FS.LMConfig, B):
    """A fresh model and a ``step(batch)`` callable for one variant (declared in
    :mod:`labkit.bench.variants`)."""
    why_not = declared_variant("train", variant).gpu_only
    if why_not and B.name != "cuda":
        raise SuiteSkip(why_not)
    model = FS.build_lm(cfg, B.device)
    blocks = tuple(model.blocks)
    samples = tuple((_sample(cfg, B),) for _ in blocks)
    if variant == "eager":
        return FS.EagerTrainer(model, FS.lm_loss, torch.optim.AdamW(model.parameters(), lr=LR))
    if variant in ("labkit_bridge", "labkit_bridge_no_clone"):
        try:
            from labkit import bridge
        except ImportError as e:
            raise SuiteSkip(f"labkit.bridge is not importable ({e})") from None
        mgc = getattr(bridge, "make_graphed_callables", None)
        if mgc is None:
            raise SuiteSkip("labkit.bridge has no make_graphed_callables(callables, "
                            "sample_args, B=...)")
        kw = {"clone_wgrads": False} if variant == "labkit_bridge_no_clone" else {}
        _graph_layers(model, mgc(blocks, samples, B=B, **kw))
        return FS.EagerTrainer(model, FS.lm_loss, torch.optim.AdamW(model.parameters(), lr=LR))
    if variant == "torch_make_graphed_callables":
        _graph_layers(model, B.make_graphed_callables(blocks, samples))
        return FS.EagerTrainer(model, FS.lm_loss, torch.optim.AdamW(model.parameters(), lr=LR))
    if variant == "labkit_full_step":
        opt = FS.make_capturable_optimizer(model.parameters(), B, lr=LR)
        return FS.FullStepTrainer(model, FS.lm_loss, opt, B, cfg.num_microbatches,
                                  warmup_steps=2)
    if variant == "labkit_full_step_compiled":
        opt = FS.make_capturable_optimizer(model.parameters(), B, lr=LR)
        return FS.FullStepTrainer(torch.compile(model), FS.lm_loss, opt, B,
                                  cfg.num_microbatches, warmup_steps=2)
    if variant == "compile_reduce_overhead":
        FS.ensure_grads(model.parameters())    # .grad allocated outside the cudagraph pool
        compiled = torch.compile(model, mode="reduce-overhead")
        return FS.EagerTrainer(compiled, FS.lm_loss,
                               torch.optim.AdamW(model.parameters(), lr=LR))
    raise ValueError(f"train variant {variant!r} is declared but train.build has no branch "
                     "for it: add one")


def _drift_from_eager(trained: dict) -> dict:
    """variant → ``{"max_abs_diff_vs_eager": ...}``: how far its weights are from eager's
    after the same steps from the same weights (every variant trains; a wrong gradient
    shows here, e.g. the static wgrad buffers under gradient accumulation)."""
    ref = trained.get("eager")
    if ref is None:
        return {}
    out = {}
    for variant, params in trained.items():
        if variant != "eager":
            diff = max((a - b).abs().max().item() for a, b in zip(params, ref))
            out[variant] = {"max_abs_diff_vs_eager": float(f"{diff:.3g}")}
    return out


def run(B, quick: bool = False, log=print, cfg: FS.LMConfig | str | None = None,
        variants=VARIANTS, rounds: int = DEFAULT_ROUNDS, seed: int = 0) -> list[dict]:
    variants = check_names("train", variants)
    if cfg is None:
        cfg = "bench" if B.name == "cuda" else "tiny"
    name = cfg if isinstance(cfg, str) else "custom"
    cfg = FS.CONFIGS[cfg] if isinstance(cfg, str) else cfg
    config = {**dataclasses.asdict(cfg), "optimizer": "AdamW", "lr": LR}
    repeats, warmup = (4, 2) if quick else (10, 3)
    gen = torch.Generator().manual_seed(0)
    batches = [FS.random_microbatches(cfg, gen, device=B.device) for _ in range(4)]
    rows, steps, notes, trained = [], {}, {}, {}
    for variant in variants:                 # build (and warm up) everything first
        try:
            skips = cudagraph_skips()
            trainer = build(variant, cfg, B)
            cycle = itertools.cycle(batches)

            def step(trainer=trainer, cycle=cycle):
                return trainer.step(next(cycle))

            for _ in range(warmup + 3):      # past FullStepTrainer's warm-up and capture
                step()
            trained[variant] = [p.detach().clone() for p in trainer.model.parameters()]
            if variant == "compile_reduce_overhead" and cudagraph_skips() > skips:
                notes[variant] = "torch skipped cudagraphs for part of the model (see its log)"
            steps[variant] = step
        except Exception as e:              # SuiteSkip too: a row saying why, never none
            rows += unmeasured_rows(B, "train", name, config, [cfg.micro_batch], variant, e,
                                    log)
    if steps:
        log(f"  timing {len(steps)} variants in {rounds} interleaved rounds")
        timed = interleave(steps, round_timer(B, warmup=warmup, repeats=repeats, calls=20,
                                              b2b_repeats=2),
                           rounds=rounds, seed=seed, log=log)
        drift = _drift_from_eager(trained)
        for variant, step in steps.items():
            busy = profile_gpu_busy_us(step, B)
            row = make_row(B, "train", name, config, cfg.micro_batch, variant, None, busy,
                           note=notes.get(variant), rounds=timed[variant],
                           extra=drift.get(variant))
            rows.append(row)
            log(f"  train {variant:30s} synced {row['median_us'] / 1e3:9.3f} ms | back to back "
                f"{row['back_to_back_us'] / 1e3:9.3f} ms" +
                (f" | busy {busy / 1e3:8.3f} ms" if busy else ""))
    steps.clear()
    gc.collect()
    if B.name == "cuda":
        torch._dynamo.reset()
        torch.cuda.empty_cache()
    order = {v: i for i, v in enumerate(variants)}
    return sorted(rows, key=lambda r: order.get(r["variant"], len(order)))
