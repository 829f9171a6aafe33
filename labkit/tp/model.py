"""Lesson 06's decode model split tensor-parallel over the ranks of a :class:`TPGroup`.

:func:`build_tp_model` builds the 1-rank model (:func:`labkit.decode.build_model`, same
config, same seed: the same weights) and cuts it for this rank: each rank holds
``n_head / N`` query heads and ``n_kv / N`` KV heads (and its KV cache holds only
those), ``intermediate_size / N`` MLP rows, and the whole embedding, norms and LM head
(replicated here; vLLM and SGLang also split the vocabulary, which adds a gather and is
not what this lesson is about). Two all-reduces per layer, after the attention output and
after the MLP, make every rank's hidden state the 1-rank model's, so the logits and the
greedy tokens match it.

The result is a :class:`TPTransformer`, a :class:`~labkit.decode.model.Transformer` in
every respect the decode runner reads (``req_to_token``, ``setup_caches``, the batch and
attention backend), so :class:`labkit.decode.DecodeGraphRunner` captures it per bucket,
collectives included.
"""

from __future__ import annotations

import torch

from labkit.decode.model import CONFIGS, KVCache, ModelArgs, Transformer, build_model

from .comm import TPGroup
from .layers import ColumnParallelLinear, RowParallelLinear, shard_cols, shard_parts

__all__ = ["TPTransformer", "build_tp_model", "check_tp_args"]


def check_tp_args(args: ModelArgs | str, world_size: int) -> ModelArgs:
    """The model config, checked for a split over ``world_size`` ranks.

    Raises:
        ValueError: a head count or the MLP width is not a multiple of ``world_size``
            (every rank must hold whole heads and an equal share).
    """
    if isinstance(args, str):
        args = ModelArgs.from_name(args)
    elif not isinstance(args, ModelArgs):
        raise TypeError(f"model config must be a name ({', '.join(CONFIGS)}) or a "
                        f"ModelArgs, got {type(args).__name__}")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a whole number >= 1, got {world_size!r}")
    for name, n in (("n_head (query heads)", args.n_head),
                    ("n_local_heads (KV heads)", args.n_local_heads),
                    ("intermediate_size (MLP width)", args.intermediate_size)):
        if n % world_size:
            raise ValueError(f"cannot split the model over {world_size} ranks: {name} = {n} "
                             f"is not a multiple of {world_size}. Every rank holds an equal "
                             f"share of whole heads: choose a rank count that divides it, "
                             f"or a config whose head counts it divides")
    return args


class TPTransformer(Transformer):
    """One rank's share of a :class:`~labkit.decode.model.Transformer` (see the module)."""

    tp_group: TPGroup

    def setup_caches(self, max_requests: int) -> None:
        """As :meth:`Transformer.setup_caches`, with this rank's KV heads only."""
        super().setup_caches(max_requests)
        a = self.args
        num_locs = self.num_slots * a.max_seq_len
        p = self.output.weight
        for layer in self.layers:
            layer.attention.kv_cache = KVCache(num_locs, layer.attention.n_kv, a.head_dim,
                                               p.dtype, p.device)

    def extra_repr(self) -> str:
        g = self.tp_group
        return f"rank {g.rank} of {g.world_size}"


def _shard_layer(layer, args: ModelArgs, group: TPGroup) -> None:
    r, n = group.rank, group.world_size
    att, ff = layer.attention, layer.feed_forward
    hq, hkv, d = args.n_head, args.n_local_heads, args.head_dim
    att.wqkv = ColumnParallelLinear(shard_parts(att.wqkv.weight, [hq * d, hkv * d, hkv * d],
                                                r, n))
    att.wo = RowParallelLinear(shard_cols(att.wo.weight, r, n), group)
    att.n_head, att.n_kv = hq // n, hkv // n
    i = args.intermediate_size
    ff.w13 = ColumnParallelLinear(shard_parts(ff.w13.weight, [i, i], r, n))
    ff.w2 = RowParallelLinear(shard_cols(ff.w2.weight, r, n), group)
    ff.intermediate_size = i // n


def build_tp_model(args: ModelArgs | str, group: TPGroup, max_requests: int = 16,
                   device=None, dtype: torch.dtype | None = None,
                   seed: int = 0) -> TPTransformer:
    """This rank's share of ``build_model(args, max_requests, device, dtype, seed)``.

    Args:
        args: a config name or :class:`~labkit.decode.model.ModelArgs`.
        group: the tensor-parallel group (:class:`TPGroup`).
        max_requests, device, dtype, seed: as :func:`labkit.decode.build_model`, whose
            weights are cut here, so the split model computes what that one computes.
    """
    if not isinstance(group, TPGroup):
        raise TypeError(f"build_tp_model: group must be a labkit.tp.TPGroup, got "
                        f"{type(group).__name__}")
    args = check_tp_args(args, group.world_size)
    if dtype is None:
        dtype = torch.float16 if torch.device(device or "cpu").type == "cuda" else torch.float32
    full = build_model(args, max_requests=1, device="cpu", dtype=dtype, seed=seed)
    with torch.no_grad():
        for layer in full.layers:
            _shard_layer(layer, args, group)
    full.__class__ = TPTransformer
    full.tp_group = group
    model = full.to(device=device if device is not None else "cpu")
    model.freqs_cis = model.freqs_cis.float()
    model.setup_caches(max_requests)
    return model
