"""Tokens per second of plain and speculative greedy decoding, eager and graphed.

:func:`measure` builds one target, its plain decode graphs and its verify graphs, then
for each draft noise level a draft (the target's first ``draft_layers`` blocks, perturbed)
with its draft graphs, and decodes the same prompts four ways: plain greedy eager and
graphed (lesson 06's ``serve``), speculative eager and graphed. Each row is one way, with
the measured acceptance rate, decode tokens per second, and the time of a round split by
part (draft, verify, accept, host). Every way is built (and warmed up) first, then they
are timed in interleaved rounds (:func:`labkit.core.rounds.interleave`: each round
decodes the prompts once per way, in an order shuffled per round), and a row's figures are
medians over the rounds, its ``rounds`` the per-round values. :func:`verdicts` judges
each speculative row against plain greedy decoding of the same mode, round by round
("faster" only when ahead in at least 4 of 5 rounds). :func:`graph_savings` pairs the
eager and graphed rows of each draft: what the graphs save in each part. On the CPU
emulator the same code runs (the "tiny" model, in seconds); its times are the CPU's, not
a GPU's.

.. warning::
    Decode tokens per second count only the decode phase (the prefill is excluded) of a
    fixed batch whose requests all start together; the last rounds run with fewer
    requests as some finish. ``same_tokens`` says whether a row's tokens equal plain
    eager greedy decoding's: it can be False in fp16 (ties, see
    :mod:`labkit.speculative.loop`), so the default dtype here is float32.
"""

from __future__ import annotations

import math
import numbers
import statistics

import torch

from labkit.backend import ensure as ensure_backend
from labkit.core.rounds import DEFAULT_ROUNDS, interleave, verdict
from labkit.core.timing import device_name
from labkit.core.validate import check_int
from labkit.decode import DecodeGraphRunner, ModelArgs, build_model, make_buckets

from .draft import damp_blocks, make_draft
from .loop import greedy_generate, speculative_generate
from .runner import DraftGraphRunner

__all__ = ["measure", "verdicts", "graph_savings", "format_table", "PARTS"]

PARTS = ("draft", "verify", "accept", "host")
_MODES = ("eager", "graphed")


def _sample(run) -> dict[str, float]:
    """The ``time_one`` of :func:`interleave`: one decode of the prompts, its figures.
    ``token_us`` (decode time per new token, µs) is the time a verdict compares: the
    ways decode the same tokens, so it ranks them as tokens per second does."""
    res = run()
    rate = res.decode_tokens_per_s
    if not rate:
        raise ValueError("measure: a run decoded no token after the prefill; ask for "
                         "max_new_tokens >= 2")
    out = {"token_us": 1e6 / rate, "tokens_per_s": rate}
    if hasattr(res, "round_s"):                     # speculative: each part of a round
        s = res.summary()
        out.update({"round_ms": s["round_ms"], **{f"{p}_ms": s[f"{p}_ms"] for p in PARTS}})
    else:
        out["round_ms"] = 1e3 * statistics.fmean(res.decode_latency_s)
    return out


def _prompts(vocab: int, batch_size: int, prompt_len: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch_size, prompt_len), generator=g,
                         device="cpu").tolist()


def _check_modes(modes) -> tuple[str, ...]:
    if isinstance(modes, str) or not hasattr(modes, "__iter__"):
        raise TypeError(f"measure: modes must be a tuple of mode names, e.g. {_MODES} or "
                        f"('graphed',), got {modes!r:.40} ({type(modes).__name__})")
    modes = tuple(modes)
    if not modes or any(m not in _MODES for m in modes):
        raise ValueError(f"measure: modes must be a non-empty subset of {_MODES}, got {modes!r}")
    return modes


def _check_noises(noises) -> tuple[float, ...]:
    if isinstance(noises, (str, bytes)) or not hasattr(noises, "__iter__"):
        raise TypeError(f"measure: noises must be a list of noise levels, one draft each, "
                        f"e.g. (0.0, 0.1), got {noises!r:.40} ({type(noises).__name__})")
    noises = tuple(noises)
    for i, v in enumerate(noises):
        if (not isinstance(v, numbers.Real) or isinstance(v, bool) or not math.isfinite(v)
                or v < 0):
            raise ValueError(f"measure: noises[{i}] = {v!r:.40}: each noise level is a finite "
                             "number >= 0 (a relative weight scale, e.g. 0.05)")
    return noises


def _check_fit(args: ModelArgs, num_steps: int, prompt_len: int, max_new_tokens: int,
               draft_layers) -> None:
    """Before any run: k, the draft's depth and every request's positions fit the target."""
    width = args.max_seq_len
    check_int("measure: num_steps", num_steps, 1, width - 2,
              fix=f"a round verifies k + 1 tokens and drafts up to position p + k, within "
                  f"the target's max_seq_len={width}")
    check_int("measure: draft_layers", draft_layers, 1, args.n_layer,
              fix=f"the draft keeps the first blocks of the target's {args.n_layer}")
    need = prompt_len + max_new_tokens - 1 + num_steps
    if need > width:
        raise ValueError(f"measure: a request needs prompt_len + max_new_tokens - 1 + num_steps "
                         f"= {prompt_len} + {max_new_tokens} - 1 + {num_steps} = {need} "
                         f"positions, more than the target's max_seq_len={width}: lower one of "
                         "them")


def measure(B=None, config: str | ModelArgs = "tiny", batch_size: int = 4, num_steps: int = 4,
            max_new_tokens: int = 32, prompt_len: int = 8, draft_layers: int = 1,
            noises=(0.0, 0.1, 0.3), tail_scale: float = 1.0, rounds: int = DEFAULT_ROUNDS,
            modes=_MODES, dtype: torch.dtype | None = torch.float32,
            seed: int = 0) -> list[dict]:
    """Rows of decode tokens/s: plain greedy vs speculative, eager vs graphed.

    Args:
        B: the backend (default ``get("auto")``).
        config: the target's config (lesson 06's ``CONFIGS`` name or a ModelArgs).
        batch_size: requests decoded together (also the graphs' ``max_bs``).
        num_steps: k, draft tokens per round.
        max_new_tokens, prompt_len: per request (random prompts, seeded).
        draft_layers: blocks of the target the draft keeps (its cost).
        noises: one draft per value (relative weight noise, see
            :func:`~labkit.speculative.draft.make_draft`): the acceptance rate follows.
        tail_scale: the target's blocks after the draft's are damped by it
            (:func:`~labkit.speculative.draft.damp_blocks`; 1: lesson 06's model as is).
        rounds: interleaved rounds after one warm-up run of every way; each round
            decodes the prompts once per way, in a shuffled order. A row's figures are
            medians over the rounds (a verdict wants at least 5).
        modes: "eager" and/or "graphed".
        dtype: the models' dtype (float32 by default: see the module's warning).
        seed: the models' and prompts' seed.

    Returns:
        one dict per (method, draft, mode); ``rounds`` holds its per-round ``token_us``
        and ``tokens_per_s``; ``format_table(rows)`` prints them, ``verdicts(rows)``
        compares them.
    """
    B = ensure_backend(B, "measure(B=...)")
    check_int("measure: batch_size", batch_size, 1)
    check_int("measure: rounds", rounds, 1, fix="a verdict wants at least 5")
    check_int("measure: prompt_len", prompt_len, 1)
    check_int("measure: max_new_tokens", max_new_tokens, 1)
    check_int("measure: num_steps", num_steps, 1, fix="k, the draft tokens per round")
    modes, noises = _check_modes(modes), _check_noises(noises)
    target = build_model(config, max_requests=batch_size, device=B.device, dtype=dtype,
                         seed=seed)
    _check_fit(target.args, num_steps, prompt_len, max_new_tokens, draft_layers)
    if tail_scale != 1.0:
        damp_blocks(target, draft_layers, tail_scale)
    prompts = _prompts(target.args.vocab_size, batch_size, prompt_len, seed)
    common = {"device": device_name(B), "config": config if isinstance(config, str) else "custom",
              "dtype": str(target.output.weight.dtype).replace("torch.", ""),
              "batch": batch_size, "k": num_steps, "tail_scale": tail_scale}

    plain = DecodeGraphRunner(target, B, max_bs=batch_size, progress=False)
    plain.capture()
    verify = DecodeGraphRunner(target, B, max_bs=batch_size, num_tokens_per_bs=num_steps + 1,
                               buckets=make_buckets(batch_size, "sglang_spec"), progress=False)
    verify.capture()
    ways = {}                # (method, draft, mode) -> one decode of the prompts
    for mode in modes:
        runner = plain if mode == "graphed" else None
        ways[("greedy", "-", mode)] = (
            lambda runner=runner: greedy_generate(target, prompts, max_new_tokens, runner))
    for noise in noises:                    # every draft and its runners are built up front
        draft = make_draft(target, n_layer=draft_layers, noise=noise, seed=seed)
        label = f"{draft_layers}/{target.args.n_layer} blocks, noise {noise:g}"
        for mode in modes:
            graphed = mode == "graphed"
            dr = DraftGraphRunner(draft, B, num_steps, max_bs=batch_size)
            if graphed:
                dr.capture()
            kw = {"draft_runner": dr, "verify_runner": verify if graphed else None, "B": B}
            ways[("speculative", label, mode)] = (
                lambda draft=draft, kw=kw: speculative_generate(target, draft, prompts,
                                                                max_new_tokens, **kw))
    first = {key: run() for key, run in ways.items()}   # warm-up; tokens and acceptance
    timed = interleave(ways, _sample, rounds=rounds, seed=seed)
    tokens = {k: [res.tokens[i] for i in range(batch_size)] for k, res in first.items()}
    reference = next((tokens[k] for k in ways if k[0] == "greedy"), None)
    rows = []
    for key, res in first.items():
        method, label, mode = key
        t = timed[key]
        med = {m: statistics.median(v) for m, v in t.items()}
        spec = method == "speculative"
        rows.append({**common, "method": method, "mode": mode, "draft": label,
                     "acceptance_%": 100 * res.acceptance_rate if spec else None,
                     "tokens_per_round": res.tokens_per_round if spec else 1.0,
                     "tokens_per_s": med["tokens_per_s"], "round_ms": med["round_ms"],
                     **{f"{p}_ms": med[f"{p}_ms"] if spec else None for p in PARTS},
                     "same_tokens": reference is None or tokens[key] == reference,
                     "rounds": {m: t[m] for m in ("token_us", "tokens_per_s")}})
    greedy_rate = {r["mode"]: r["tokens_per_s"] for r in rows if r["method"] == "greedy"}
    for r in rows:
        r["vs_greedy"] = (r["tokens_per_s"] / greedy_rate[r["mode"]]
                          if r["mode"] in greedy_rate else None)
    return rows


def verdicts(rows: list[dict]) -> list[tuple[dict, object]]:
    """``[(row, Verdict)]``: each speculative row against plain greedy decoding of the same
    mode, round by round on the decode time per token (:func:`labkit.core.rounds.verdict`:
    "faster" only when ahead in at least 4 of 5 rounds, else level). Rows of one
    :func:`measure` call only: they were timed in the same rounds."""
    _check_rows(rows, "verdicts", ("method", "mode", "draft", "rounds"))
    plain = {r["mode"]: r for r in rows if r["method"] == "greedy"}
    out = []
    for r in rows:
        p = plain.get(r["mode"])
        if r["method"] != "speculative" or p is None:
            continue
        out.append((r, verdict("speculative", r["rounds"]["token_us"], "plain",
                               p["rounds"]["token_us"], method="token_us",
                               label="time per token")))
    return out


def graph_savings(rows: list[dict]) -> list[dict]:
    """Per draft and part: the eager and graphed ms per round, and what graphs save."""
    _check_rows(rows, "graph_savings", ("batch", "tail_scale", "method", "draft", "mode",
                                        "round_ms", *(f"{p}_ms" for p in PARTS)))
    out = []
    by = {(r["batch"], r["tail_scale"], r["method"], r["draft"], r["mode"]): r for r in rows}
    for (bs, tail, method, draft, mode), g in by.items():
        e = by.get((bs, tail, method, draft, "eager"))
        if mode != "graphed" or e is None:
            continue
        parts = ("round",) if method == "greedy" else ("round", *PARTS)
        for p in parts:
            em, gm = e[f"{p}_ms"], g[f"{p}_ms"]
            out.append({"batch": bs, "tail_scale": tail, "method": method, "draft": draft,
                        "part": p, "eager_ms": em, "graphed_ms": gm, "saved_ms": em - gm,
                        "saved_%": 100 * (em - gm) / em if em else 0.0})
    return out


def format_table(rows: list[dict], columns: list[str] | None = None) -> str:
    """A Markdown table of ``rows`` (floats rounded for reading, None as "-")."""
    _check_rows(rows, "format_table", ())
    if not rows:
        return "(no rows)"
    if columns is not None and (isinstance(columns, str) or not hasattr(columns, "__iter__")
                                or not all(isinstance(c, str) for c in columns)):
        raise TypeError(f"format_table: columns must be a list of column names (str), got "
                        f"{columns!r:.60}: e.g. ['method', 'mode', 'tokens_per_s']")
    columns = list(columns or rows[0])

    def cell(v):
        if v is None:
            return "-"
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 10 else f"{v:.1f}"
        return str(v)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(r.get(c)) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


def _check_rows(rows, fn: str, keys: tuple[str, ...]) -> None:
    """``rows`` is a list of dicts (measure()'s rows), each with ``keys``."""
    if isinstance(rows, dict) or not isinstance(rows, (list, tuple)):
        raise TypeError(f"{fn}: rows must be a list of dicts (the rows measure() returns), got "
                        f"{type(rows).__name__}" + (": wrap one row as [row]"
                                                    if isinstance(rows, dict) else ""))
    for i, r in enumerate(rows):
        if not isinstance(r, dict):
            raise TypeError(f"{fn}: rows[{i}] is {r!r:.40} ({type(r).__name__}), not a dict: "
                            "pass the rows measure() returns")
        missing = [k for k in keys if k not in r]
        if missing:
            raise ValueError(f"{fn}: rows[{i}] lacks {', '.join(map(repr, missing))}: pass the "
                             "rows measure() returns")
