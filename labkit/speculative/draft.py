"""A toy draft model built from the target itself, and the checks that a pair fits.

A draft is lesson 06's :class:`~labkit.decode.model.Transformer` again: the target's
embedding, its first ``n_layer`` blocks, its final norm and its output head, copied, then
(optionally) every copied weight perturbed by Gaussian noise of a *relative* scale. Fewer
layers make the draft cheaper than the target (fewer kernels per step, which is what a
launch-bound decode step pays for); the noise makes it disagree more often. Neither sets
the acceptance rate: it is whatever the target's greedy choices and the draft's turn out
to share, and :func:`~labkit.speculative.loop.speculative_generate` measures it.

A separate small draft model is what SGLang calls STANDALONE speculative decoding, run by
``StandaloneWorker``, a subclass of ``EAGLEWorker`` (sgl-project/sglang,
``python/sglang/srt/speculative/standalone_worker.py``). EAGLE's draft shares the target's
embedding and LM head outright (``EAGLEWorker.__init__`` calls ``set_embed_and_head``,
``eagle_worker.py`` at 00559eac) and keeps a KV pool of its own ("Draft and target worker
own their own KV cache pools"). This draft copies them instead,
so that noise on the draft never touches the target; its KV pool is its own too, with one
request slot per target slot, so a request keeps the same slot in both models.

.. warning::
    A draft and its target must agree on the vocabulary (the draft's token ids are fed to
    the target as they are) and on the device, and the draft needs at least the target's
    request slots and sequence length: :func:`check_pair` says which of these fails.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import replace

import torch

from labkit.core.validate import check_int
from labkit.decode import build_model
from labkit.decode.batch import check_model

__all__ = ["make_draft", "check_pair", "draft_layers", "damp_blocks"]


def draft_layers(draft) -> int:
    """How many transformer blocks a draft runs (its cost per step, roughly)."""
    check_model(draft, "draft_layers(draft)")
    return len(draft.layers)


def make_draft(target, n_layer: int | None = None, noise: float = 0.0, seed: int = 0):
    """A draft model from ``target``: its first ``n_layer`` blocks, weights perturbed.

    Args:
        target: a :func:`~labkit.decode.build_model` model (caches set up).
        n_layer: blocks to keep, ``1..target.args.n_layer`` (default: all of them; with
            ``noise=0`` the draft then predicts exactly what the target does).
        noise: relative noise: every copied weight ``w`` becomes
            ``w + noise * rms(w) * N(0, 1)``, so one value means the same for every
            tensor whatever its scale. 0 keeps the copy exact.
        seed: seeds the noise (drawn on the CPU, so a seed gives the same draft on every
            device).

    Returns:
        a Transformer on the target's device and dtype, with ``max_requests`` equal to
        the target's and its own KV cache.
    """
    check_model(target, "make_draft(target)")
    full = target.args.n_layer
    n_layer = full if n_layer is None else check_int(
        "make_draft: n_layer", n_layer, 1, full,
        fix=f"the draft keeps the first n_layer of the target's {full} blocks")
    if (not isinstance(noise, numbers.Real) or isinstance(noise, bool)
            or not math.isfinite(noise) or noise < 0):
        raise ValueError(f"make_draft: noise must be a finite number >= 0 (a relative scale, "
                         f"e.g. 0.05), got {noise!r}")
    check_int("make_draft: seed", seed, None)
    p = target.output.weight
    draft = build_model(replace(target.args, n_layer=n_layer),
                        max_requests=target.num_slots - 1, device=p.device, dtype=p.dtype)
    # Parameters only: the KV pools, req_to_token and the rotary table are non-persistent
    # buffers, so the draft keeps caches of its own.
    own = draft.state_dict()
    draft.load_state_dict({k: v for k, v in target.state_dict().items() if k in own})
    if noise:
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for w in draft.parameters():
                # drawn on the host from a seeded generator: the same draft on every device
                rms = w.float().pow(2).mean().sqrt().cpu()
                step = noise * rms * torch.randn(w.shape, generator=g, device="cpu")
                w.add_(step.to(w.device, w.dtype))
    return draft


def damp_blocks(model, first: int, scale: float) -> None:
    """Scale what blocks ``first..`` of ``model`` write into the residual stream, in place.

    Each block adds ``wo(attention)`` and ``w2(feed-forward)`` to the residual stream;
    both output projections are multiplied by ``scale``. The block still runs every
    kernel (the model costs what it cost), but its effect on the output shrinks.

    Why a lesson wants this: lesson 06's models are random, and in a random model every
    block moves the greedy choice, so a draft made of the first block agrees with an
    8-block target only now and then. Damping the target's later blocks makes such a
    cheap draft agree more often, so the measurement can show a range of acceptance
    rates at one draft cost. The acceptance rate is still measured, never set.
    """
    check_model(model, "damp_blocks(model)")
    n = len(model.layers)
    first = check_int("damp_blocks: first", first, 0, n,
                      fix=f"the first block to damp (the model has {n})")
    if (not isinstance(scale, numbers.Real) or isinstance(scale, bool)
            or not math.isfinite(scale) or scale < 0):
        raise ValueError(f"damp_blocks: scale must be a finite number >= 0 (1 leaves the "
                         f"model as it is), got {scale!r}")
    with torch.no_grad():
        for block in model.layers[first:]:
            block.attention.wo.weight.mul_(scale)
            block.feed_forward.w2.weight.mul_(scale)


def check_pair(target, draft, fn: str = "speculative decoding") -> None:
    """Raise if ``draft`` cannot propose tokens for ``target``, saying what to change."""
    check_model(target, f"{fn}: target")
    check_model(draft, f"{fn}: draft")
    if draft is target:
        raise ValueError(f"{fn}: draft is the target itself; they must be two models (each "
                         "writes its own KV cache at the same slots). For a draft that "
                         "predicts exactly what the target does use make_draft(target)")
    tv, dv = target.args.vocab_size, draft.args.vocab_size
    if tv != dv:
        raise ValueError(f"{fn}: the draft's vocabulary has {dv} tokens but the target's has "
                         f"{tv}; the draft's token ids are fed to the target as they are, so "
                         "both must share one vocabulary: build the draft with "
                         "make_draft(target) or with vocab_size=target.args.vocab_size")
    if draft.device != target.device:
        raise ValueError(f"{fn}: the draft is on {draft.device} but the target on "
                         f"{target.device}: build both on the same device (B.device)")
    if draft.num_slots < target.num_slots:
        raise ValueError(f"{fn}: the draft has {draft.num_slots - 1} request slots, the target "
                         f"{target.num_slots - 1}; a request uses the same slot in both, so "
                         f"build the draft with max_requests={target.num_slots - 1}")
    if draft.args.max_seq_len < target.args.max_seq_len:
        raise ValueError(f"{fn}: the draft holds {draft.args.max_seq_len} positions per "
                         f"request, the target {target.args.max_seq_len}: build the draft with "
                         f"max_seq_len={target.args.max_seq_len}")
