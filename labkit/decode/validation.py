"""The graph runners' argument checks and the option values they accept: each error names
what was given, what was expected and what to do. Lesson 06's
:class:`~labkit.decode.runner.DecodeGraphRunner` (its options:
:class:`~labkit.decode.options.DecodeRunnerOptions`; its staged path), the shared
:mod:`labkit.decode.graph_runner_base` and lesson 09's :mod:`labkit.piecewise` check with
these."""

from __future__ import annotations

import numpy as np
import torch

from .batch import _int_list, check_slots, check_tokens
from .buffers import Pad

__all__ = ["FALLBACKS", "COMPILE_MODES", "WARMUP_WHY", "check_fallback", "check_device",
           "check_same_caches", "check_staged", "check_padding_override"]

#: What a runner does with a batch above its largest graph: ``"error"`` raises
#: :class:`~labkit.decode.buckets.BatchTooLargeError`, ``"eager"`` runs it eagerly (warned
#: once, counted). Each runner has its own default (decode: "error", a decode batch that
#: outgrows the graphs is a sizing mistake; piecewise: "eager", a long prompt is normal) and
#: :func:`check_fallback` lists that default first.
FALLBACKS = ("error", "eager")
# torch.compile modes that leave the capturing to the runner: "default" fuses without
# autotuning (seconds per bucket), SGLang's "max-autotune-no-cudagraphs" also tunes the GEMMs
# (minutes). "reduce-overhead" would record torch's own graphs inside ours.
COMPILE_MODES = ("max-autotune-no-cudagraphs", "default")

WARMUP_WHY = "first-call work (lazy init, autotuning) must happen before capture"


def check_fallback(fallback, default: str) -> str:
    """``fallback`` is one of :data:`FALLBACKS`, or a ValueError listing them with the
    runner's ``default`` first. Returns ``fallback``."""
    if fallback not in FALLBACKS:
        choices = (default,) + tuple(f for f in FALLBACKS if f != default)
        raise ValueError(f"fallback must be one of {', '.join(map(repr, choices))}, got "
                         f"{fallback!r}")
    return fallback


def check_device(model, B) -> None:
    """The model lives on the backend's device type, or a ValueError saying how to build it."""
    if model.device.type != torch.device(B.device).type:
        raise ValueError(f"model is on {model.device} but backend {B.name!r} runs on "
                         f"{B.device}: build the model with device=B.device")


def check_same_caches(attn, model, fn: str) -> None:
    """The KV cache this runner was built over is still the model's: setup_caches() again
    allocates new pools, and graphs (and page tables) would keep reading the old ones."""
    if getattr(attn, "cache_generation", 0) != getattr(model, "cache_generation", 0):
        raise RuntimeError(f"{fn}: model.setup_caches() ran after this runner was built, so "
                           "its graphs and attention backend still point at the old KV cache: "
                           "build (and capture) a new runner after setup_caches")


def check_staged(runner, slots, positions, tokens, fn: str):
    """stage()'s host values, checked on the host with numpy (cheap: this runs every step):
    a bad slot, position or token id would otherwise reach the graph as an out-of-range
    index. Returns slots and positions as int64 arrays."""
    model = runner.model
    num_rows, width = model.req_to_token.shape

    def ints(name, values, what):
        if isinstance(values, torch.Tensor):
            raise TypeError(f"{fn}: {name} is a tensor; pass host ints ({name}.tolist()): "
                            "a device tensor would have to be read back, a sync every step")
        try:
            a = np.asarray(values)
        except (ValueError, TypeError):                   # ragged nested lists and the like
            a = None
        if (a is None or a.ndim != 1 or a.dtype.kind not in "iu"
                or any(isinstance(v, (bool, np.bool_)) for v in values)):
            values = _int_list(name, values, what)        # raises, naming the first bad one
            big = [v for v in values if not -2**63 <= v < 2**63]
            if big:
                raise ValueError(f"{fn}: {name} holds {big[0]}, not a 64-bit integer: "
                                 f"{name} holds {what}")
            a = np.asarray(values, dtype=np.int64)
        return a.astype(np.int64, copy=False)

    slots, positions = ints("slots", slots, "request slots"), ints("positions", positions,
                                                                    "positions")
    if not 1 <= len(slots) <= runner.max_bucket:
        raise ValueError(f"{fn}: {len(slots)} requests; a staged step holds 1.."
                         f"{runner.max_bucket} (the largest captured bucket)")
    if len(positions) != len(slots):
        raise ValueError(f"{fn}: {len(slots)} slots but {len(positions)} positions: one each")
    if slots.min() < 1 or slots.max() >= num_rows or len(np.unique(slots)) != len(slots):
        check_slots(slots.tolist(), num_rows, fn)       # raises, saying which and why
    if positions.min() < 0 or positions.max() >= width:
        bad = positions[(positions < 0) | (positions >= width)][0]
        raise ValueError(f"{fn}: position {bad} is outside 0..{width - 1} "
                         f"(max_seq_len = {width})")
    if isinstance(tokens, torch.Tensor):
        if (tokens.dtype != torch.int64 or tokens.shape != (num_rows,)
                or tokens.device != model.device):
            raise ValueError(f"{fn}: a token table must be an int64 tensor of one token per "
                             f"slot, shape ({num_rows},), on {model.device}; got "
                             f"{tokens.dtype} {tuple(tokens.shape)} on {tokens.device}. For one "
                             "token per request pass host ints instead (tokens.tolist())")
    else:
        toks = ints("tokens", tokens, "token ids")
        if len(toks) != len(slots):
            raise ValueError(f"{fn}: {len(slots)} slots but {len(toks)} tokens: one each")
        if toks.min() < 0 or toks.max() >= model.args.vocab_size:
            check_tokens(toks.tolist(), model.args.vocab_size, fn, "tokens")
    return slots, positions


def check_padding_override(override, slots, fn: str) -> dict:
    """A ``{buffer: policy}`` dict naming buffers among ``slots`` (a runner's
    :attr:`StaticBuffers.slots <labkit.decode.buffers.StaticBuffers.slots>`) and policies
    among :class:`~labkit.decode.buffers.Pad`'s, or an error naming the first bad entry.
    Returns it."""
    if not isinstance(override, dict):
        raise TypeError(f"{fn}: padding_override must be a dict {{buffer: policy}}, got "
                        f"{type(override).__name__}")
    pads = [p.value for p in Pad]
    for name, pad in override.items():
        if name not in slots:
            raise ValueError(f"{fn}: padding_override names buffer {name!r}; the buffers "
                             f"are {', '.join(slots)}")
        if pad not in pads and not isinstance(pad, Pad):
            raise ValueError(f"{fn}: padding_override[{name!r}] = {pad!r}; choose one of "
                             f"{', '.join(pads)}")
    return override
