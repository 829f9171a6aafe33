"""A continuous-batching serving loop over a synthetic workload, eager or graphed.

Requests arrive as a Poisson process (measured in scheduler steps, so a run is exactly
reproducible), each with its own prompt and output length. Every step the scheduler

1. admits the requests that have arrived, while a KV slot is free, and prefills them
   eagerly in one EXTEND batch (variable length: never a graph);
2. runs one DECODE step for every running request — the batch size changes from step
   to step as requests join and finish, which is why the runner needs buckets;
3. appends each request's greedy token and frees the slots of finished requests.

Run it twice — ``serve(model, wl)`` and ``serve(model, wl, runner=graph_runner)`` — and
the generated tokens must be identical; the latencies are what differ.

``serve(..., overlap=True)`` is the loop of SGLang's overlap scheduler and vLLM's async
scheduling: the host prepares step N+1 while the GPU runs step N. The next tokens stay on
the device (the argmax goes into a per-slot table the next step's ``input_ids`` are
gathered from), each step's host metadata reaches the graph in one copy, and the host
reads a step's tokens back only after it has queued the next one
(:func:`decode_step_overlapped`).
"""

from __future__ import annotations

import copy
import math
import numbers
import time
import warnings
from dataclasses import dataclass, field

import numpy as np
import torch

from labkit.core.validate import check_int, is_int

from .batch import make_decode_batch, make_extend_batch
from .buffers import ints_to_device, pinned_zeros
from .model import greedy
from .runner import DecodeGraphRunner, EagerRunner

__all__ = ["Request", "synthetic_workload", "ServeResult", "serve", "decode_step_overlapped",
           "prefill_logits", "prefill_overlapped", "land", "TokenReadback"]


@dataclass
class Request:
    rid: int
    arrival_step: int
    prompt: list[int]
    max_new_tokens: int
    output: list[int] = field(default_factory=list)
    slot: int | None = None
    pending: int = 0   # tokens generated on the device, not read back yet (overlap mode)

    @property
    def seq_len(self) -> int:
        return len(self.prompt) + len(self.output) + self.pending

    @property
    def done(self) -> bool:
        return len(self.output) + self.pending >= self.max_new_tokens


def synthetic_workload(num_requests: int = 32, arrival_rate: float = 1.0,
                       prompt_len: tuple[int, int] = (4, 24), output_len: tuple[int, int] = (4, 32),
                       vocab_size: int = 128, max_seq_len: int | None = None,
                       seed: int = 0) -> list[Request]:
    """Seeded requests: exponential inter-arrival gaps (mean ``1 / arrival_rate`` steps),
    uniform prompt and output lengths (inclusive ranges), random prompt tokens. With
    ``max_seq_len`` the output length is clipped so every request fits its KV slot."""
    check_int("num_requests", num_requests, 0)
    if (not isinstance(arrival_rate, numbers.Real) or isinstance(arrival_rate, bool)
            or not math.isfinite(arrival_rate) or arrival_rate <= 0):
        raise ValueError(f"arrival_rate must be a finite number > 0 (requests per decode step), "
                         f"got {arrival_rate!r}")
    _check_range("prompt_len", prompt_len)
    _check_range("output_len", output_len)
    check_int("vocab_size", vocab_size, 1)
    if max_seq_len is not None:
        check_int("max_seq_len", max_seq_len, 2)
    check_int("seed", seed, 0)
    rng = np.random.default_rng(seed)
    t = 0.0
    reqs = []
    for rid in range(num_requests):
        t += rng.exponential(1.0 / arrival_rate)
        p = int(rng.integers(prompt_len[0], prompt_len[1] + 1))
        n = int(rng.integers(output_len[0], output_len[1] + 1))
        if max_seq_len is not None:
            if p >= max_seq_len:
                raise ValueError(f"prompt of {p} tokens does not fit max_seq_len={max_seq_len}")
            n = min(n, max_seq_len - p + 1)  # the last token is sampled, never fed back
        reqs.append(Request(rid, int(t), rng.integers(0, vocab_size, p).tolist(), n))
    return reqs


def _check_range(name: str, rng) -> None:
    """An inclusive (lo, hi) range of lengths, 1 <= lo <= hi."""
    if (not isinstance(rng, (tuple, list)) or len(rng) != 2
            or not all(is_int(v) for v in rng)):
        raise TypeError(f"{name} must be a (min, max) pair of ints, got {rng!r}")
    if not 1 <= rng[0] <= rng[1]:
        raise ValueError(f"{name}=({rng[0]}, {rng[1]}): need 1 <= min <= max")


@dataclass
class ServeResult:
    """Everything a notebook plots: tokens per request and per-step measurements."""

    tokens: dict[int, list[int]]
    decode_latency_s: list[float]        # wall time of each decode step
    decode_batch_size: list[int]         # requests in each decode step
    prefill_latency_s: list[float]
    wall_s: float
    generated_tokens: int
    runner_stats: dict | None = None     # the runner's counters during this run only

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.wall_s if self.wall_s else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        t = sum(self.decode_latency_s)
        return sum(self.decode_batch_size) / t if t else 0.0

    def summary(self) -> dict:
        lat = np.array(self.decode_latency_s) * 1e3
        return {
            "requests": len(self.tokens),
            "generated_tokens": self.generated_tokens,
            "decode_steps": len(self.decode_latency_s),
            "mean_batch": float(np.mean(self.decode_batch_size)) if lat.size else 0.0,
            "tokens_per_s": round(self.tokens_per_s, 1),
            "decode_tokens_per_s": round(self.decode_tokens_per_s, 1),
            "step_ms_p50": float(np.percentile(lat, 50)) if lat.size else 0.0,
            "step_ms_p90": float(np.percentile(lat, 90)) if lat.size else 0.0,
        }


class TokenReadback:
    """Two pinned host buffers for the tokens of a step, used in turn: one is being
    filled by the device while the host reads the other."""

    def __init__(self, max_bs: int, device):
        self.max_bs = check_int("TokenReadback: max_bs", max_bs, 1,
                                fix="the most requests one step reads back")
        self.buffers = [pinned_zeros(max_bs, torch.int64, device) for _ in range(2)]
        self.turn = 0

    def next(self, n: int) -> torch.Tensor:
        """The other buffer's first ``n`` entries, for this step's ``n`` tokens."""
        check_int("TokenReadback.next: n", n, 1, self.max_bs,
                  fix=f"the buffers hold {self.max_bs} tokens (max_bs): build "
                      f"TokenReadback(max_bs={n}, ...) for steps of {n} requests")
        self.turn ^= 1
        return self.buffers[self.turn][:n]


def decode_step_overlapped(runner, running: list[Request], next_tokens: torch.Tensor,
                           readback: TokenReadback, inflight: tuple | None) -> tuple:
    """Queue one decode step for ``running``, then read back the *previous* step's
    tokens while the GPU runs this one. Returns this step, for the next call to land.

    ``next_tokens`` (one entry per slot, on the device) holds each request's last token:
    the step reads its input from there and writes its output back there, so no token
    makes a round trip through the host between two steps.
    """
    _check_overlapped_step(runner, running, readback, inflight)
    slots = [r.slot for r in running]
    # 1. Host: this step's slots and positions are known without the last tokens (a
    #    length is a count), so they go out in one copy while the GPU may still be busy.
    runner.stage(slots, [r.seq_len - 1 for r in running], next_tokens)
    # 2. Device: replay, argmax, and the new tokens into the per-slot table. No sync.
    toks = greedy(runner.replay_staged())
    next_tokens.index_copy_(0, runner.buffers.req_pool_indices[:len(slots)], toks)
    # 3. Start copying the tokens to the host, and mark when they have arrived.
    host = readback.next(len(slots))
    host.copy_(toks, non_blocking=True)
    arrived = runner.B.Event()
    arrived.record()
    for r in running:
        r.pending += 1
    # 4. Only now wait, for the previous step: the GPU has this one queued meanwhile.
    land(inflight)
    return list(running), host, arrived


def land(inflight: tuple | None) -> None:
    """Wait for a queued step's tokens and append them to their requests."""
    if inflight is None:
        return
    requests, host, arrived = inflight
    arrived.synchronize()
    for r, t in zip(requests, host.tolist()):
        r.output.append(t)
        r.pending -= 1


def prefill_logits(runner, admitted: list[Request]) -> torch.Tensor:
    """Prefill ``admitted`` (each in its slot) in one EXTEND batch; the logits of each
    request's last prompt token, (len(admitted), vocab), still on the device."""
    return _prefill(runner, admitted)[0]


def _prefill(runner, admitted: list[Request]) -> tuple:
    """:func:`prefill_logits` and the batch it ran (its ``req_pool_indices``: the slots,
    already on the device)."""
    batch = make_extend_batch(runner.model, [r.slot for r in admitted],
                              [r.prompt for r in admitted])
    logits = runner.forward(batch)
    last, = ints_to_device([np.cumsum([len(r.prompt) for r in admitted]) - 1],
                           logits.device)
    return logits.index_select(0, last), batch


def prefill_overlapped(runner, admitted: list[Request], next_tokens: torch.Tensor) -> tuple:
    """``runner``: a captured graph runner (its backend ``runner.B`` records the event).

    Queue the prefill of ``admitted`` without waiting for it: each first token goes
    into ``next_tokens`` (the table the next decode step reads its input from) and
    starts its copy to the host. Returns what :func:`land` appends once it has arrived."""
    logits, batch = _prefill(runner, admitted)
    toks = greedy(logits)
    next_tokens.index_copy_(0, batch.req_pool_indices, toks)
    # A pinned buffer of its own: TokenReadback's two take turns between decode steps,
    # and a third user would overwrite one before it lands.
    host = pinned_zeros(len(admitted), torch.int64, next_tokens.device)
    host.copy_(toks, non_blocking=True)
    arrived = runner.B.Event()
    arrived.record()
    for r in admitted:
        r.pending += 1
    return list(admitted), host, arrived


def serve(model, workload: list[Request], runner=None, max_running: int | None = None,
          max_steps: int = 100_000, overlap: bool = False, prefill=None) -> ServeResult:
    """Serve ``workload`` (not modified: requests are copied) to completion.

    ``runner``: a :class:`~labkit.decode.runner.DecodeGraphRunner` (graphs for decode,
    eager for prefill and per its fallback) or None (everything eager).
    ``max_running``: live requests at once (default: every KV slot the model has).
    ``overlap``: prepare each decode step while the GPU runs the one before
    (:func:`decode_step_overlapped`); needs a captured ``DecodeGraphRunner`` whose
    largest bucket holds ``max_running`` requests. The tokens are the same either way.
    ``prefill``: a captured :class:`~labkit.piecewise.PiecewiseGraphRunner` on the same
    model: admissions are prefilled through its piecewise graphs instead of ``runner``.
    With ``overlap=True`` their first tokens stay on the device too (SGLang's overlap
    scheduler): read back with the next step's, so an admission does not stall the loop.
    """
    if not isinstance(overlap, bool):
        raise TypeError(f"serve: overlap must be True or False, got {overlap!r}")
    if overlap:   # first: the generic checks' advice (e.g. fallback='eager') does not apply
        _check_overlap(model, runner, max_running)
    runner = runner or EagerRunner(model)
    _check_serve_args(model, workload, runner, max_running, max_steps)
    _check_prefill_runner(model, prefill)
    prefiller = prefill or runner
    max_running = max_running or (model.num_slots - 1)
    cuda = model.device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    pending = sorted(copy.deepcopy(workload), key=lambda r: (r.arrival_step, r.rid))
    free = list(range(max_running, 0, -1))  # slot 0 is the dummy slot
    running: list[Request] = []
    finished: list[Request] = []
    dec_lat, dec_bs, pre_lat = [], [], []
    stats0 = dict(getattr(runner, "stats", {}))
    if overlap:
        next_tokens = torch.zeros(model.num_slots, dtype=torch.int64, device=model.device)
        readback = TokenReadback(max_running, model.device)
    inflight = None
    landing: list[tuple] = []     # prefills whose first tokens are still on their way
    step = 0
    sync()
    t_start = time.perf_counter()
    while (pending or running) and step < max_steps:
        admitted = []
        while pending and pending[0].arrival_step <= step and free:
            r = pending.pop(0)
            r.slot = free.pop()
            admitted.append(r)
        if admitted:
            t0 = time.perf_counter()
            if overlap:
                landing.append(prefill_overlapped(prefiller, admitted, next_tokens))
            else:
                toks = greedy(prefill_logits(prefiller, admitted)).tolist()
                sync()
                for r, t in zip(admitted, toks):
                    r.output.append(t)
            pre_lat.append(time.perf_counter() - t0)
            running += admitted
        running = _retire(running, finished, free)
        if running:
            t0 = time.perf_counter()
            if overlap:
                inflight = decode_step_overlapped(runner, running, next_tokens, readback,
                                                  inflight)
                for queued in landing:   # the GPU has this step queued behind them
                    land(queued)
                landing.clear()
            else:
                batch = make_decode_batch(model, [r.slot for r in running],
                                          [r.output[-1] for r in running],
                                          [r.seq_len - 1 for r in running])
                toks = greedy(runner.forward(batch)).tolist()
                sync()
                for r, t in zip(running, toks):
                    r.output.append(t)
            dec_lat.append(time.perf_counter() - t0)
            dec_bs.append(len(running))
            running = _retire(running, finished, free)
        elif not admitted and pending:
            step = max(step, pending[0].arrival_step)  # idle: jump to the next arrival
            continue
        step += 1
    for queued in landing:                             # prefills no step followed
        land(queued)
    land(inflight)                                     # the last step's tokens
    sync()
    wall = time.perf_counter() - t_start
    if pending or running:
        warnings.warn(f"serve stopped at max_steps={max_steps} with {len(pending) + len(running)} "
                      "requests unfinished: their outputs are partial (raise max_steps)",
                      RuntimeWarning, stacklevel=2)
    done = sorted(finished + running, key=lambda r: r.rid)
    return ServeResult(
        tokens={r.rid: r.output for r in done},
        decode_latency_s=dec_lat, decode_batch_size=dec_bs, prefill_latency_s=pre_lat,
        wall_s=wall, generated_tokens=sum(len(r.output) for r in done),
        runner_stats={k: v - stats0.get(k, 0) for k, v in getattr(runner, "stats", {}).items()}
        or None)


def _check_serve_args(model, workload, runner, max_running, max_steps) -> None:
    """serve()'s arguments, each against what the loop needs."""
    from .batch import check_model
    check_model(model, "serve")
    if not hasattr(runner, "forward"):
        raise TypeError(f"serve: runner must be a DecodeGraphRunner or EagerRunner (or None), "
                        f"got {type(runner).__name__}")
    if getattr(runner, "model", model) is not model:
        raise ValueError("serve: the runner was built for another model (its graphs read that "
                         "model's weights and KV cache): pass the runner's own model")
    slots = model.num_slots - 1
    if max_running is not None:
        check_int("max_running", max_running, 1)
        if max_running > slots:
            raise ValueError(f"max_running={max_running} > KV slots ({slots})")
    if hasattr(runner, "captured") and not runner.captured:
        raise RuntimeError("serve: the runner has no graphs yet: call runner.capture() first")
    largest = getattr(runner, "max_bucket", None)
    running = max_running or slots
    strict = getattr(runner, "fallback", "eager") == "error"
    if largest is not None and strict and running > largest:
        raise ValueError(f"serve: up to {running} requests run at once but the runner's largest "
                         f"graph is {largest} and fallback='error', so a large step would fail "
                         f"mid-run: pass max_running={largest}, capture with max_bs={running}, "
                         "or build the runner with fallback='eager'")
    check_int("max_steps", max_steps, 1)
    if isinstance(workload, Request) or not hasattr(workload, "__iter__"):
        raise TypeError("serve: workload must be a list of Request (synthetic_workload(...)), "
                        f"got {type(workload).__name__}")
    seen = set()
    for i, r in enumerate(workload):
        if not isinstance(r, Request):
            raise TypeError(f"serve: workload[{i}] is a {type(r).__name__}, not a Request")
        if r.rid in seen:
            raise ValueError(f"serve: request id {r.rid} appears twice: results are keyed by rid")
        seen.add(r.rid)
        if not r.prompt:
            raise ValueError(f"serve: request {r.rid} has an empty prompt")
        check_int(f"serve: request {r.rid}'s max_new_tokens", r.max_new_tokens, 1,
                  fix="the prefill already samples one token")
        if r.output or r.pending:
            raise ValueError(f"serve: request {r.rid} already has output {r.output[:4]}... "
                             f"({r.pending} token(s) pending): pass fresh requests (serve "
                             "copies them and never writes back)")
        if r.seq_len + r.max_new_tokens - 1 > model.args.max_seq_len:
            raise ValueError(f"serve: request {r.rid} needs {r.seq_len + r.max_new_tokens - 1} "
                             f"positions, more than max_seq_len={model.args.max_seq_len}")
        bad = [t for t in r.prompt if not 0 <= t < model.args.vocab_size]
        if bad:
            raise ValueError(f"serve: request {r.rid}'s prompt has token id {bad[0]}, outside "
                             f"the vocabulary 0..{model.args.vocab_size - 1}")


def _check_prefill_runner(model, prefill) -> None:
    """serve()'s ``prefill``: None, or a captured piecewise runner on ``model``. (Checked
    by what it is, not by class: labkit.piecewise is built on this package.)"""
    if prefill is None:
        return
    if not (hasattr(prefill, "split") and hasattr(prefill, "max_num_tokens")):
        raise TypeError("serve: prefill must be a captured PiecewiseGraphRunner (from "
                        f"labkit.piecewise) or None, got {type(prefill).__name__}")
    if prefill.model is not model:
        raise ValueError("serve: the prefill runner was built for another model (its graphs "
                         "read that model's weights and KV cache): build it on this model")
    if not prefill.captured:
        raise RuntimeError("serve: the prefill runner has no graphs yet: call "
                           "prefill.capture() first")


def _check_overlap(model, runner, max_running) -> None:
    """overlap=True stages every decode step into the runner's graphs: it needs a captured
    DecodeGraphRunner of DECODE graphs whose largest bucket holds every running request."""
    from .batch import check_model
    check_model(model, "serve")
    if not isinstance(runner, DecodeGraphRunner):
        given = "runner=None" if runner is None else type(runner).__name__
        raise ValueError("serve: overlap=True needs a captured DecodeGraphRunner (it stages "
                         "each decode step into the runner's static buffers and replays its "
                         f"graph); got {given}")
    running = max_running or (model.num_slots - 1)
    if running > runner.max_bucket:
        raise ValueError(f"serve: overlap=True runs every decode step as a graph, but up to "
                         f"{running} requests run at once and the largest graph is "
                         f"{runner.max_bucket}: pass max_running={runner.max_bucket} or "
                         f"capture with max_bs={running}")
    if runner.num_tokens_per_bs != 1:
        raise ValueError("serve: overlap=True needs a DECODE runner (one token per request), "
                         f"this one feeds {runner.num_tokens_per_bs}")


def _check_overlapped_step(runner, running, readback, inflight) -> None:
    """decode_step_overlapped's arguments (the values themselves: runner.stage checks them)."""
    fn = "decode_step_overlapped"
    if not isinstance(runner, DecodeGraphRunner):
        raise TypeError(f"{fn}: runner must be a captured DecodeGraphRunner (the step is staged "
                        f"into its static buffers), got {type(runner).__name__}")
    if not isinstance(running, list) or not running:
        raise ValueError(f"{fn}: running must be a non-empty list of Request, got "
                         f"{running!r:.60}: skip the step when nothing runs")
    for i, r in enumerate(running):
        if not isinstance(r, Request) or r.slot is None:
            raise TypeError(f"{fn}: running[{i}] must be a Request holding a slot (an admitted "
                            f"request), got {r!r:.60}")
    if not isinstance(readback, TokenReadback):
        raise TypeError(f"{fn}: readback must be a TokenReadback(max_bs, device), got "
                        f"{type(readback).__name__}")
    if len(running) > readback.max_bs:   # checked before any work is queued
        raise ValueError(f"{fn}: {len(running)} requests run, but readback holds "
                         f"{readback.max_bs} tokens per step: build TokenReadback(max_bs="
                         f"{len(running)}, ...) (serve sizes it by max_running)")
    if inflight is not None and not (isinstance(inflight, tuple) and len(inflight) == 3):
        raise TypeError(f"{fn}: inflight must be None (the first step) or what the previous "
                        f"call returned, got {inflight!r:.60}")


def _retire(running: list[Request], finished: list[Request], free: list[int]) -> list[Request]:
    still = []
    for r in running:
        if r.done:
            free.append(r.slot)
            finished.append(r)
        else:
            still.append(r)
    return still
