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
from .model import greedy
from .runner import EagerRunner

__all__ = ["Request", "synthetic_workload", "ServeResult", "serve"]


@dataclass
class Request:
    rid: int
    arrival_step: int
    prompt: list[int]
    max_new_tokens: int
    output: list[int] = field(default_factory=list)
    slot: int | None = None

    @property
    def seq_len(self) -> int:
        return len(self.prompt) + len(self.output)

    @property
    def done(self) -> bool:
        return len(self.output) >= self.max_new_tokens


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


def serve(model, workload: list[Request], runner=None, max_running: int | None = None,
          max_steps: int = 100_000) -> ServeResult:
    """Serve ``workload`` (not modified: requests are copied) to completion.

    ``runner``: a :class:`~labkit.decode.runner.DecodeGraphRunner` (graphs for decode,
    eager for prefill and per its fallback) or None (everything eager).
    ``max_running``: live requests at once (default: every KV slot the model has).
    """
    runner = runner or EagerRunner(model)
    _check_serve_args(model, workload, runner, max_running, max_steps)
    max_running = max_running or (model.num_slots - 1)
    cuda = model.device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    pending = sorted(copy.deepcopy(workload), key=lambda r: (r.arrival_step, r.rid))
    free = list(range(max_running, 0, -1))  # slot 0 is the dummy slot
    running: list[Request] = []
    finished: list[Request] = []
    dec_lat, dec_bs, pre_lat = [], [], []
    stats0 = dict(getattr(runner, "stats", {}))
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
            batch = make_extend_batch(model, [r.slot for r in admitted],
                                      [r.prompt for r in admitted])
            logits = runner.forward(batch)
            last = np.cumsum([len(r.prompt) for r in admitted]) - 1
            toks = greedy(logits[torch.as_tensor(last, device=logits.device)]).tolist()
            sync()
            pre_lat.append(time.perf_counter() - t0)
            for r, t in zip(admitted, toks):
                r.output.append(t)
            running += admitted
        running = _retire(running, finished, free)
        if running:
            t0 = time.perf_counter()
            batch = make_decode_batch(model, [r.slot for r in running],
                                      [r.output[-1] for r in running],
                                      [r.seq_len - 1 for r in running])
            toks = greedy(runner.forward(batch)).tolist()
            sync()
            dec_lat.append(time.perf_counter() - t0)
            dec_bs.append(len(running))
            for r, t in zip(running, toks):
                r.output.append(t)
            running = _retire(running, finished, free)
        elif not admitted and pending:
            step = max(step, pending[0].arrival_step)  # idle: jump to the next arrival
            continue
        step += 1
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
    from .batch import _check_model
    _check_model(model, "serve")
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
        if r.output:
            raise ValueError(f"serve: request {r.rid} already has output {r.output[:4]}...: "
                             "pass fresh requests (serve copies them and never writes back)")
        if r.seq_len + r.max_new_tokens - 1 > model.args.max_seq_len:
            raise ValueError(f"serve: request {r.rid} needs {r.seq_len + r.max_new_tokens - 1} "
                             f"positions, more than max_seq_len={model.args.max_seq_len}")
        bad = [t for t in r.prompt if not 0 <= t < model.args.vocab_size]
        if bad:
            raise ValueError(f"serve: request {r.rid}'s prompt has token id {bad[0]}, outside "
                             f"the vocabulary 0..{model.args.vocab_size - 1}")


def _retire(running: list[Request], finished: list[Request], free: list[int]) -> list[Request]:
    still = []
    for r in running:
        if r.done:
            free.append(r.slot)
            finished.append(r)
        else:
            still.append(r)
    return still
