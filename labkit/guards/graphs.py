"""``GuardedGraph``: a ``StaticGraph`` that refuses every silent misuse of its arguments."""

from __future__ import annotations

from typing import Callable

import torch
from torch.utils._pytree import tree_map

from labkit.capture import StaticGraph, same_memory, static_copy
from labkit.core.signature import (
    GraphArgumentError,
    get_mismatch_errors,
    leaf_pairs,
    metadata_tree,
    signature_lines,
)

__all__ = ["GuardedGraph"]


class GuardedGraph(StaticGraph):
    """A :class:`~labkit.capture.StaticGraph` that refuses every silent misuse.

    ::

        gg = GuardedGraph(block, B=B).capture(x, mask=m, scale=0.5)
        out = gg(x2, mask=m2, scale=0.5)     # checked, copied, replayed
        gg(x2[:4], mask=m2, scale=0.7)       # GraphArgumentError listing both mismatches

    Beyond ``StaticGraph`` (positional arguments, nested lists/tuples/dicts allowed) it
    accepts keyword arguments, and it has two policies:

    ``inputs="copy"`` (default)
        A tensor at another address is ``copy_``-ed into its static input; a tensor at
        the static input's own address is not copied at all. Megatron's runner does the
        same (copy only when ``data_ptr`` differs), which lets a producer write straight
        into the static buffer and skip the copy. ``gg.copies`` counts real copies.
    ``inputs="static"``
        Only the static inputs themselves are accepted (``gg.static_inputs`` /
        ``gg.static_kwargs``, filled in place by the caller); any other tensor is refused
        with an ``Address mismatch``. This catches the rebinding bug at the call site.
    ``outputs="static"`` (default) or ``"clone"``
        ``"clone"`` returns copies of the outputs, so a result you keep is never
        overwritten by the next replay (at the cost of one copy per output).

    Every check runs before anything is copied, and one :class:`GraphArgumentError`
    lists all mismatches: never a silent broadcast, conversion or stale Python value.
    """

    def __init__(self, fn: Callable, *, B=None, pool=None, stream=None, warmup: int = 3,
                 name: str | None = None, inputs: str = "copy", outputs: str = "static"):
        if inputs not in ("copy", "static"):
            raise ValueError(f"inputs must be 'copy' or 'static', got {inputs!r}")
        if outputs not in ("static", "clone"):
            raise ValueError(f"outputs must be 'static' or 'clone', got {outputs!r}")
        super().__init__(fn, B=B, pool=pool, stream=stream, warmup=warmup, name=name)
        self.inputs_policy = inputs
        self.outputs_policy = outputs
        self.static_kwargs: dict = {}
        self.kwarg_metadata: dict = {}

    def capture(self, *sample_args, **sample_kwargs) -> "GuardedGraph":
        """Allocate static inputs like the samples (nested too), warm up, capture."""
        if self.captured:
            raise RuntimeError(
                f"{self._label()} is already captured. A graph is recorded once; for other "
                f"shapes or values create another GuardedGraph (or call reset() first).")
        self._check_devices(sample_args, "args")
        self._check_devices(sample_kwargs, "kwargs")
        args = tree_map(static_copy, tuple(sample_args))
        kwargs = tree_map(static_copy, dict(sample_kwargs))
        self.static_outputs = self._record(args, kwargs)
        self.static_inputs, self.static_kwargs = args, kwargs
        self.arg_metadata = tuple(metadata_tree(a) for a in args)
        self.kwarg_metadata = {k: metadata_tree(v) for k, v in kwargs.items()}
        return self

    def mismatches(self, *args, **kwargs) -> list[str]:
        """What :meth:`__call__` would refuse, as a list of lines (empty: the call is fine)."""
        self._require_captured("checking arguments")
        return get_mismatch_errors(self.arg_metadata, args, self.kwarg_metadata, kwargs,
                                   check_address=self.inputs_policy == "static")

    def __call__(self, *args, **kwargs):
        """Check everything, copy what moved, replay, return the outputs (or clones)."""
        errors = self.mismatches(*args, **kwargs)
        if errors:
            raise GraphArgumentError(self._label(), errors)
        with torch.no_grad():
            for static, val in leaf_pairs((self.static_inputs, self.static_kwargs),
                                          (tuple(args), kwargs)):
                if isinstance(val, torch.Tensor) and not same_memory(val, static):
                    static.copy_(val)
                    self.copies += 1
        self.replay()
        if self.outputs_policy == "clone":
            return tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t,
                            self.static_outputs)
        return self.static_outputs

    def reset(self) -> None:
        super().reset()
        self.static_kwargs, self.kwarg_metadata = {}, {}

    def signature(self) -> str:
        """What was captured, one argument a line (portable: no devices or addresses)."""
        self._require_captured("signature()")
        return "\n".join(signature_lines(self.arg_metadata, self.kwarg_metadata))

    def _label(self) -> str:
        return f"GuardedGraph({self.name})"
