"""The decode graph runner's options: one dataclass, checked in one place.

:class:`DecodeRunnerOptions` holds what :class:`~labkit.decode.runner.DecodeGraphRunner`
can be asked for (vLLM's ``CUDAGraphOptions`` and SGLang's ``ServerArgs`` fields for the
graph runner play this part upstream). The runner takes them as keywords, as lessons and
tests write them, or as ``options=``; either way they are built by
:meth:`DecodeRunnerOptions.from_call` and checked by :meth:`DecodeRunnerOptions.checked`,
each against its type and range (or fixed set), with an error that names what was given,
what was expected and what to do::

    runner = DecodeGraphRunner(model, B, max_bs=8, fallback="eager")
    runner = DecodeGraphRunner(model, B, options=DecodeRunnerOptions(max_bs=8,
                                                                      fallback="eager"))
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Iterable

from labkit.core.validate import check_int

from .attention import check_attention_name
from .batch import ForwardMode
from .buckets import DECODE_SCHEMES, SCHEMES, make_buckets
from .validation import COMPILE_MODES, WARMUP_WHY, check_fallback

__all__ = ["DecodeRunnerOptions"]

# Unknown scheme names are answered with the plain-decode schemes first (lesson 06's),
# then speculative decoding's finer list.
_SCHEME_CHOICES = ", ".join(DECODE_SCHEMES + tuple(s for s in SCHEMES
                                                   if s not in DECODE_SCHEMES))


@dataclass(frozen=True)
class DecodeRunnerOptions:
    """What a :class:`~labkit.decode.runner.DecodeGraphRunner` captures and how it runs.

    max_bs             largest batch to capture (default: every slot the model has)
    buckets            "sglang" (default), "every", "pow2", "sglang_spec" (SGLang's finer
                       list under speculative decoding) or a list of sizes
    disable_padding    shorthand for buckets="every": one graph per batch size
    num_tokens_per_bs  1 for decode; k for TARGET_VERIFY (k draft tokens per request)
    forward_mode       the mode captured (default: DECODE for 1 token per request, else
                       TARGET_VERIFY)
    fallback           "error" (default): a DECODE batch larger than the largest bucket
                       raises BatchTooLargeError; "eager": run it eagerly, with a warning
                       the first time and a count in ``stats``
    padding_override   e.g. {"positions": "head_only"}: change a buffer's policy (demos)
    num_warmups        eager runs on the capture stream before each capture
    compile_bs         buckets <= this run through torch.compile before capture (GPU)
    progress           a progress bar while capturing
    attention          "torch_native" (default), "triton" (CUDA: decode attention
                       through the page table, no gather) or "auto"; see
                       :func:`~labkit.decode.attention.make_attn_backend`
    compile_mode       "max-autotune-no-cudagraphs" (SGLang's; tunes GEMMs, minutes) or
                       "default" (fusion only, seconds)

    .. warning::
        The dataclass itself checks nothing: :meth:`checked` does, against the model the
        runner is built over (its request slots bound ``max_bs``, its ``max_seq_len`` bounds
        ``num_tokens_per_bs``). A ``padding_override``'s buffer names are checked by the
        runner once its buffers exist (:func:`~labkit.decode.validation.check_padding_override`).
    """

    max_bs: int | None = None
    buckets: str | Iterable[int] | None = "sglang"
    disable_padding: bool = False
    num_tokens_per_bs: int = 1
    forward_mode: ForwardMode | None = None
    fallback: str = "error"
    padding_override: dict | None = None
    num_warmups: int = 2
    compile_bs: int = 0
    progress: bool = True
    attention: str = "torch_native"
    compile_mode: str = "max-autotune-no-cudagraphs"

    @classmethod
    def from_call(cls, options: DecodeRunnerOptions | None, kw: dict,
                  fn: str = "DecodeGraphRunner") -> DecodeRunnerOptions:
        """The options of a call ``fn(model, B, options=..., **kw)``: ``options`` (default:
        every default) with the keywords ``kw`` replacing its fields. An unknown keyword is
        a TypeError naming it and the known ones."""
        if options is None:
            options = cls()
        elif not isinstance(options, cls):
            raise TypeError(f"{fn}: options must be a DecodeRunnerOptions, got "
                            f"{type(options).__name__}; or pass the options as keywords")
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = [k for k in kw if k not in names]
        if unknown:
            raise TypeError(f"{fn}() got an unexpected keyword argument {unknown[0]!r}; its "
                            f"options are {', '.join(names)}")
        return dataclasses.replace(options, **kw) if kw else options

    def checked(self, model) -> DecodeRunnerOptions:
        """Every option against its type and range (or fixed set), for a runner over
        ``model``; returns them resolved: ``max_bs`` an int (every request slot when
        None), ``buckets`` the sorted list of sizes, ``num_tokens_per_bs`` an int,
        ``forward_mode`` the mode captured, ``padding_override`` a dict."""
        slots = model.num_slots - 1
        max_bs = slots if self.max_bs is None else self.max_bs
        check_int("max_bs", max_bs, 1, slots,
                  fix=f"the model has {slots} request slots (build_model(max_requests=...)), "
                  "so no batch is larger; leave max_bs=None for all of them")
        buckets = self._checked_buckets(int(max_bs))
        for name in ("disable_padding", "progress"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be True or False, got {getattr(self, name)!r}")
        k = self.num_tokens_per_bs
        check_int("num_tokens_per_bs", k, 1, model.args.max_seq_len,
                  fix="the tokens each request feeds per step (1 for decode)")
        mode = self._checked_mode(int(k))
        check_fallback(self.fallback, default="error")
        check_int("num_warmups", self.num_warmups, 1, fix=WARMUP_WHY)
        check_int("compile_bs", self.compile_bs, 0,
                  fix="buckets up to this size are compiled; 0: none")
        if self.compile_mode not in COMPILE_MODES:
            raise ValueError(f"compile_mode must be one of {', '.join(map(repr, COMPILE_MODES))} "
                             f"(modes without CUDA graphs of their own: the runner captures), "
                             f"got {self.compile_mode!r}")
        if self.padding_override is not None and not isinstance(self.padding_override, dict):
            raise TypeError("DecodeGraphRunner: padding_override must be a dict "
                            f"{{buffer: policy}}, got {type(self.padding_override).__name__}")
        check_attention_name(self.attention)
        scheme = "every" if self.disable_padding else buckets
        return dataclasses.replace(
            self, max_bs=int(max_bs), buckets=make_buckets(int(max_bs), scheme),
            num_tokens_per_bs=int(k), forward_mode=mode,
            padding_override=dict(self.padding_override or {}))

    def _checked_buckets(self, max_bs: int) -> str | list[int]:
        """``buckets`` checked: a scheme name (``"sglang"`` for None), or a list of sizes
        in ``1..max_bs`` (read once: it may be an iterator)."""
        buckets = self.buckets
        if buckets is None:
            return "sglang"
        if isinstance(buckets, str):
            if buckets not in SCHEMES:
                raise ValueError(f"unknown bucket scheme {buckets!r}: choose one of "
                                 f"{_SCHEME_CHOICES} or pass a list of batch sizes")
            return buckets
        if not hasattr(buckets, "__iter__"):
            raise TypeError(f"buckets must be a scheme name ({_SCHEME_CHOICES}) or a "
                            f"list of batch sizes, got {type(buckets).__name__}")
        buckets = list(buckets)
        if not buckets:
            raise ValueError("buckets is an empty list: give at least one batch size")
        for b in buckets:
            check_int("every bucket size", b, 1, max_bs, fix=f"max_bs is {max_bs}")
        return buckets

    def _checked_mode(self, k: int) -> ForwardMode:
        """The forward mode captured: the one given (DECODE or TARGET_VERIFY, DECODE only
        with one token per request), else DECODE for one token and TARGET_VERIFY for more."""
        mode = self.forward_mode
        if mode is None:
            return ForwardMode.DECODE if k == 1 else ForwardMode.TARGET_VERIFY
        if mode not in (ForwardMode.DECODE, ForwardMode.TARGET_VERIFY):
            raise ValueError(f"forward_mode must be ForwardMode.DECODE or "
                             f"ForwardMode.TARGET_VERIFY (or None), got {mode!r}")
        if mode is ForwardMode.DECODE and k != 1:
            raise ValueError(f"forward_mode=DECODE feeds one token per request, but "
                             f"num_tokens_per_bs={k}: use TARGET_VERIFY")
        return mode
