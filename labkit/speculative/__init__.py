"""labkit.speculative — speculative decoding with graphs, on lesson 06's engine (issue #18).

A small draft model proposes k tokens per request with ONE graph per batch-size bucket
holding all k draft steps (SGLang's ``EAGLEDraftCudaGraphRunner`` with ``topk = 1``); the
target checks them in one graphed TARGET_VERIFY step (lesson 06's
``DecodeGraphRunner(target, B, num_tokens_per_bs=k + 1)``); greedy acceptance runs on the
device, with one host read-back per round. The tokens are exactly plain greedy decoding's.

    draft     make_draft (the target's first layers, weights perturbed), check_pair,
              damp_blocks (a target whose later blocks matter less)
    runner    DraftGraphRunner (the k-step draft loop, captured per bucket)
    loop      greedy_accept, speculative_generate, SpecResult, greedy_generate
    measure   measure, format_table: tokens/s of plain vs speculative decoding, eager vs
              graphed, at a few measured acceptance rates, time split by part

    from labkit import backend
    from labkit.decode import DecodeGraphRunner, build_model
    from labkit.speculative import DraftGraphRunner, make_draft, speculative_generate
    B = backend.get("auto")
    target = build_model("tiny", max_requests=4, device=B.device)
    draft = make_draft(target, n_layer=1, noise=0.05)
    dr = DraftGraphRunner(draft, B, num_steps=3); dr.capture()
    vr = DecodeGraphRunner(target, B, max_bs=4, num_tokens_per_bs=4); vr.capture()
    out = speculative_generate(target, draft, prompts, 16, draft_runner=dr, verify_runner=vr)
    out.tokens, out.acceptance_rate
"""

from .draft import check_pair, damp_blocks, draft_layers, make_draft
from .loop import SpecResult, greedy_accept, greedy_generate, speculative_generate
from .measure import PARTS, format_table, graph_savings, measure
from .runner import DraftGraphRunner

__all__ = ["make_draft", "check_pair", "draft_layers", "damp_blocks", "DraftGraphRunner",
           "greedy_accept", "SpecResult", "speculative_generate", "greedy_generate",
           "measure", "graph_savings", "format_table", "PARTS"]
