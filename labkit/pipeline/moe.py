"""MoE partial graphing: graph the static router, keep the data-dependent dispatch eager.

A mixture-of-experts layer sends each token to the expert its router picks. How many
tokens each expert gets depends on the data, so the dispatch has data-dependent shapes
(``nonzero``, boolean masks, per-expert batch sizes, and on many GPUs an all-to-all
with sizes known only at run time). A CUDA graph cannot capture that: the capture is
refused (``operation not permitted when stream is capturing``) or, worse, it would bake
in one step's token counts.

Megatron therefore graphs only the static sub-regions of an MoE layer
(``cuda_graph_modules`` = ``moe_router``, ``moe_preprocess``;
``transformer_layer.py``): layer norm, router logits, softmax and top-k have
fixed shapes, and their graph hands its outputs (normalised hidden states, routing
probabilities, expert indices) to the eager dispatch. The bridge makes this work for
training: the router's graph is a :class:`~labkit.bridge.GraphRunner` whose wgrads
(router weights, layer norm) come back from its backward graph, while the experts'
gradients come from eager autograd, all in the same ``loss.backward()``.
"""

from __future__ import annotations

import torch
from torch import nn

from labkit.bridge import GraphRunner
from labkit.core.validate import check_int

__all__ = ["ToyMoE", "PartiallyGraphedMoE"]


class ToyMoE(nn.Module):
    """``x + sum_k p_k * expert_{i_k}(LN(x))`` with a top-``k`` softmax router.

    ``route`` is the static part (fixed shapes); ``dispatch`` the data-dependent one.
    """

    def __init__(self, hidden: int = 32, experts: int = 4, ffn: int = 64, topk: int = 2):
        super().__init__()
        for name, value in (("hidden", hidden), ("experts", experts), ("ffn", ffn),
                            ("topk", topk)):
            check_int(name, value, minimum=1)
        if topk > experts:
            raise ValueError(f"topk={topk} cannot exceed experts={experts}: each token picks "
                             f"topk distinct experts")
        self.ln = nn.LayerNorm(hidden)
        self.router = nn.Linear(hidden, experts, bias=False)
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(hidden, ffn), nn.GELU(), nn.Linear(ffn, hidden))
            for _ in range(experts))
        self.topk = topk

    def route(self, x):
        """LN, router logits, softmax, top-k: graphable (no data-dependent shape)."""
        h = self.ln(x)
        probs = self.router(h).softmax(-1)
        top_p, top_i = probs.topk(self.topk, dim=-1)
        return h, top_p, top_i

    def dispatch(self, x, h, top_p, top_i):
        """Send each token to its experts: the token count per expert depends on data."""
        shape = h.shape
        h = h.reshape(-1, shape[-1])
        top_p = top_p.reshape(-1, self.topk)
        top_i = top_i.reshape(-1, self.topk)
        out = torch.zeros_like(h)
        for e, expert in enumerate(self.experts):
            token, slot = (top_i == e).nonzero(as_tuple=True)    # data-dependent shape
            if token.numel() == 0:
                continue
            y = expert(h[token]) * top_p[token, slot].unsqueeze(-1)
            out = out.index_add(0, token, y)
        return x + out.reshape(shape)

    def forward(self, x):
        return self.dispatch(x, *self.route(x))


class PartiallyGraphedMoE(nn.Module):
    """``ToyMoE`` with ``route`` replayed from a graph pair and ``dispatch`` eager."""

    def __init__(self, moe: ToyMoE, B, sample_input: torch.Tensor, **runner_kw):
        super().__init__()
        if not (isinstance(moe, nn.Module) and hasattr(moe, "route")
                and hasattr(moe, "dispatch")):
            raise TypeError(f"PartiallyGraphedMoE needs a module with route() (graphed) and "
                            f"dispatch() (eager), like ToyMoE; got {type(moe).__name__}")
        if not isinstance(sample_input, torch.Tensor):
            raise TypeError(f"sample_input must be a tensor shaped like the layer's input, got "
                            f"{type(sample_input).__name__}")
        self.moe = moe
        self.router_graph = GraphRunner(moe, B, func=moe.route, name="moe_router",
                                        **runner_kw)
        self.router_graph.create_fwd_graph((sample_input,))
        self.router_graph.create_bwd_graph()

    def forward(self, x):
        h, top_p, top_i = self.router_graph(x)       # graphed: fwd and bwd replays
        return self.moe.dispatch(x, h, top_p, top_i)  # eager
