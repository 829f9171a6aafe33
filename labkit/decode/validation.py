"""The decode runner's argument checks and the option values it accepts: each error names
what was given, what was expected and what to do (:class:`labkit.decode.runner.DecodeGraphRunner`,
its staged path, and :mod:`labkit.piecewise`, which checks the same)."""

from __future__ import annotations

import numpy as np
import torch

from labkit.core.validate import check_int

from .batch import ForwardMode

_FALLBACKS = ("error", "eager")
# torch.compile modes that leave the capturing to the runner: "default" fuses without
# autotuning (seconds per bucket), SGLang's "max-autotune-no-cudagraphs" also tunes the GEMMs
# (minutes). "reduce-overhead" would record torch's own graphs inside ours.
_COMPILE_MODES = ("max-autotune-no-cudagraphs", "default")
_SCHEMES = ("sglang", "every", "pow2")


_WARMUP_WHY = "first-call work (lazy init, autotuning) must happen before capture"


def _check_device(model, B) -> None:
    if model.device.type != torch.device(B.device).type:
        raise ValueError(f"model is on {model.device} but backend {B.name!r} runs on "
                         f"{B.device}: build the model with device=B.device")


def _check_same_caches(attn, model, fn: str) -> None:
    """The KV cache this runner was built over is still the model's: setup_caches() again
    allocates new pools, and graphs (and page tables) would keep reading the old ones."""
    if getattr(attn, "cache_generation", 0) != getattr(model, "cache_generation", 0):
        raise RuntimeError(f"{fn}: model.setup_caches() ran after this runner was built, so "
                           "its graphs and attention backend still point at the old KV cache: "
                           "build (and capture) a new runner after setup_caches")


def _check_staged(runner, slots, positions, tokens, fn: str):
    """stage()'s host values, checked on the host with numpy (cheap: this runs every step):
    a bad slot, position or token id would otherwise reach the graph as an out-of-range
    index. Returns slots and positions as int64 arrays."""
    from .batch import _check_slots, _check_tokens, _int_list
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
        _check_slots(slots.tolist(), num_rows, fn)       # raises, saying which and why
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
            _check_tokens(toks.tolist(), model.args.vocab_size, fn, "tokens")
    return slots, positions


def _check_options(model, *, max_bs, buckets, disable_padding, num_tokens_per_bs, forward_mode,
                   fallback, num_warmups, compile_bs, progress, compile_mode):
    """DecodeGraphRunner's options, each against its type and range (or fixed set).
    Returns ``buckets`` as given, or as a list when it was another iterable (read once)."""
    slots = model.num_slots - 1
    check_int("max_bs", max_bs, 1, slots,
              fix=f"the model has {slots} request slots (build_model(max_requests=...)), so "
              "no batch is larger; leave max_bs=None for all of them")
    if isinstance(buckets, str):
        if buckets not in _SCHEMES:
            raise ValueError(f"unknown bucket scheme {buckets!r}: choose one of "
                             f"{', '.join(_SCHEMES)} or pass a list of batch sizes")
    elif buckets is not None:
        if not hasattr(buckets, "__iter__"):
            raise TypeError(f"buckets must be a scheme name ({', '.join(_SCHEMES)}) or a list "
                            f"of batch sizes, got {type(buckets).__name__}")
        sizes = buckets = list(buckets)
        if not sizes:
            raise ValueError("buckets is an empty list: give at least one batch size")
        for b in sizes:
            check_int("every bucket size", b, 1, max_bs, fix=f"max_bs is {max_bs}")
    for name, flag in (("disable_padding", disable_padding), ("progress", progress)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be True or False, got {flag!r}")
    check_int("num_tokens_per_bs", num_tokens_per_bs, 1, model.args.max_seq_len,
              fix="the tokens each request feeds per step (1 for decode)")
    graphable = (ForwardMode.DECODE, ForwardMode.TARGET_VERIFY)
    if forward_mode is not None:
        if forward_mode not in graphable:
            raise ValueError(f"forward_mode must be ForwardMode.DECODE or "
                             f"ForwardMode.TARGET_VERIFY (or None), got {forward_mode!r}")
        if forward_mode is ForwardMode.DECODE and num_tokens_per_bs != 1:
            raise ValueError(f"forward_mode=DECODE feeds one token per request, but "
                             f"num_tokens_per_bs={num_tokens_per_bs}: use TARGET_VERIFY")
    if fallback not in _FALLBACKS:
        raise ValueError(f"fallback must be one of {', '.join(map(repr, _FALLBACKS))}, got "
                         f"{fallback!r}")
    check_int("num_warmups", num_warmups, 1, fix=_WARMUP_WHY)
    check_int("compile_bs", compile_bs, 0, fix="buckets up to this size are compiled; 0: none")
    if compile_mode not in _COMPILE_MODES:
        raise ValueError(f"compile_mode must be one of {', '.join(map(repr, _COMPILE_MODES))} "
                         f"(modes without CUDA graphs of their own: the runner captures), got "
                         f"{compile_mode!r}")
    return buckets
