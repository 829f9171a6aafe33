"""Exercise 3: ``greedy_accept(draft_tokens, target_logits)``, speculative decoding's
acceptance on the device.

``accepted[i]`` is the length of the longest prefix of request i's draft tokens that the
target agrees with (``d[j] == argmax`` of the target's logits at position j), and
``target_tokens`` the target's argmax at each of the k + 1 positions
(:func:`labkit.speculative.loop.greedy_accept`). Tensor ops only: no host read.

The checker builds logits with a clear argmax and draft rows of every kind: all accepted,
none, a first mismatch anywhere with later tokens that agree again (they must not
count), for random bs, k and vocabulary sizes; the drafts int64 or int32, the logits
float32 or float16 (``target_tokens`` and ``accepted`` are int64 whatever they are). The
first batch keeps at least one draft in every row, so that the batch's minimum given to
every request is told from a count that is 0 everywhere. A wrong ``accepted`` is named by
the mistake it matches: agreements summed instead of the prefix (``sum`` without
``cumprod``), ``argmax`` of the mismatch mask (0 when all agree), the bonus token
counted, drafts compared with the target one position off, the batch's minimum for
every request; an agreement mask returned as ``target_tokens`` is named too. Then the
function is captured
on the emulator, which refuses a host read (``.item()``, ``.tolist()``, ``nonzero``,
``if`` on a tensor) as a GPU does, and the graph is replayed with new inputs: it must
follow them. Before each replay the function is also called eagerly on the same new
inputs: a wrong eager result (a result cached from an earlier call) is named as the eager
trials name it; only a right eager result beside a wrong replay is blamed on a value
worked out on the host during the capture.
"""

from __future__ import annotations

import torch

from labkit import backend
from labkit.capture import capture
from labkit.checks import (
    DEFAULT_TIME_LIMIT,
    attempt,
    describe_exception,
    fail,
    reject,
    run_check,
)
from labkit.checks.lesson09._common import one_thread, short_description
from labkit.core.signature import fmt_shape

__all__ = ["check_greedy_accept", "reference_greedy_accept"]

NAME = "greedy_accept"
HINTS = [
    "t = argmax of target_logits.view(bs, k + 1, -1) over the vocabulary: the target's token "
    "at each of the k + 1 positions. Draft token j is right when draft_tokens[:, j] == t[:, j].",
    "agree = (draft_tokens == t[:, :k]).long(); agree.cumprod(1) stays 1 up to the first "
    "mismatch and is 0 from there on, so its sum over dim 1 is the accepted prefix. Return "
    "(that sum, t).",
]
_HOST_READ_HINTS = [
    "Inside a graph nothing may wait for the device: every value stays a tensor. The report "
    "names the line that turns a tensor into a Python number, list or bool (.item(), "
    ".tolist(), int(t), an `if` or a loop over a tensor's values, nonzero()): that line goes.",
    HINTS[1],
]
_REPLAY_HINTS = [
    "A replay runs only the device work recorded during the capture: a number your code "
    "worked out on the host then, or a result it kept from an earlier call, is not "
    "recomputed. Compute everything from draft_tokens and target_logits with tensor ops, "
    "at every call.",
    HINTS[1],
]


def reference_greedy_accept(draft_tokens, target_logits):
    """The answer (labkit.speculative.loop.greedy_accept)."""
    bs, k = draft_tokens.shape
    t = target_logits.view(bs, k + 1, -1).argmax(-1)
    agree = (draft_tokens == t[:, :k]).long()
    return agree.cumprod(1).sum(1), t


def _dtypes(gen, trial):
    """The drafts' and the logits' dtypes for a trial: int64 and float32 first, int32
    drafts second (engines keep token ids in either), then at random; the logits float32
    or float16."""
    if trial < 2:
        return (torch.int64, torch.int32)[trial], torch.float32
    draft = (torch.int64, torch.int32)[int(torch.randint(0, 2, (), generator=gen))]
    return draft, (torch.float32, torch.float16)[int(torch.randint(0, 2, (), generator=gen))]


def _case(gen, bs, k, vocab, device, dtypes=(torch.int64, torch.float32), some=False):
    """Draft tokens and logits (of ``dtypes``); rows cycle through: all accepted, none, a
    first mismatch at a random place (drafts after it agree with the target again).
    ``some``: every row keeps at least one draft (when k > 1), so that a count shared by
    the whole batch, its minimum, is not 0."""
    lo = 1 if some and k > 1 else 0
    t = torch.randint(0, vocab, (bs, k + 1), generator=gen)
    logits = 0.1 * torch.randn(bs, k + 1, vocab, generator=gen)
    logits.scatter_(2, t.unsqueeze(2), 5.0)                     # a clear argmax
    d = t[:, :k].clone()
    start = int(torch.randint(0, 3, (), generator=gen))
    for i in range(bs):
        kind = (i + start) % 3
        if kind == 0:
            continue                                            # all accepted
        m = lo if kind == 1 else int(torch.randint(lo, k, (), generator=gen))
        d[i, m] = (t[i, m] + int(torch.randint(1, vocab, (), generator=gen))) % vocab
        for j in range(m + 1, k):                               # later: agree, or not
            if bool(torch.rand((), generator=gen) < 0.3):
                d[i, j] = (t[i, j] + 1) % vocab
    return (d.to(device, dtypes[0]),
            logits.reshape(bs * (k + 1), vocab).to(device, dtypes[1]))


def _variants(d, logits):
    """What the usual mistakes compute, by name."""
    bs, k = d.shape
    t = logits.view(bs, k + 1, -1).argmax(-1)
    agree = (d == t[:, :k]).long()
    right = agree.cumprod(1).sum(1)
    off = (d == t[:, 1:]).long().cumprod(1).sum(1) if k else right
    return {
        "min": right.min().expand(bs),
        "sum": agree.sum(1),
        "argmax": (d != t[:, :k]).long().argmax(1),
        "bonus": right + 1,
        "off": off,
        "transposed": logits.view(k + 1, bs, -1).argmax(-1).T,
    }


def _judge(d, logits, got) -> str | None:
    want_a, want_t = reference_greedy_accept(d, logits)
    bs, k = d.shape
    if got is None:
        return "returned None (did you forget `return accepted, target_tokens`?)"
    if not isinstance(got, (tuple, list)) or len(got) != 2 or not all(
            isinstance(x, torch.Tensor) for x in got):
        what = (f"a {type(got).__name__} of {len(got)}" if isinstance(got, (tuple, list))
                else type(got).__name__)
        return f"returned {what}; expected a tuple of two tensors (accepted, target_tokens)"
    acc, tt = got
    if tuple(tt.shape) == (bs, k) and _is_mask(tt, d == want_t[:, :k]):
        return ("target_tokens holds the agreement mask (draft_tokens == the target's "
                "tokens, one True/False per draft), not the target's tokens: return the "
                "argmax itself, the token ids at each of the k + 1 positions, shape "
                f"(bs, k + 1) = ({bs}, {k + 1})")
    if tuple(acc.shape) == (bs, k + 1) and tuple(tt.shape) == (bs,):
        return ("returned (target_tokens, accepted): the order is (accepted, target_tokens)")
    if tuple(tt.shape) != (bs, k + 1):
        extra = (" (the argmax at the k draft positions only: the last position, after all k "
                 "drafts, holds the bonus token, so target_tokens has k + 1 columns)"
                 if tuple(tt.shape) == (bs, k) else "")
        return (f"target_tokens has shape {fmt_shape(tt.shape)}; expected (bs, k + 1) = "
                f"({bs}, {k + 1}){extra}")
    if tuple(acc.shape) != (bs,):
        return (f"accepted has shape {fmt_shape(acc.shape)}; expected (bs,) = ({bs},): one "
                f"count per request")
    for name, x in (("accepted", acc), ("target_tokens", tt)):
        if x.dtype != torch.int64 and x.dtype == d.dtype:
            return (f"{name} is {x.dtype}, the dtype of draft_tokens here; expected "
                    f"torch.int64 whatever dtype the drafts come in (argmax gives int64 token "
                    f"ids, a sum of a long tensor int64 counts): do not cast to the drafts' "
                    f"dtype")
        if x.dtype != torch.int64:
            return (f"{name} is {x.dtype}; expected torch.int64 (token ids and counts are "
                    f"long: argmax and sum of a long tensor give int64)")
        if x.device != d.device:
            return f"{name} is on {x.device}; expected {d.device}, where the inputs are"
    v = _variants(d, logits)
    if not torch.equal(tt, want_t):
        if torch.equal(tt, v["transposed"]):
            return ("target_tokens are the argmax of the wrong rows: target_logits holds each "
                    "request's k + 1 rows one after the other (request-major), so view it as "
                    "(bs, k + 1, vocab), not (k + 1, bs, vocab)")
        i = int((tt != want_t).any(1).nonzero()[0])
        return (f"target_tokens[{i}] is {tt[i].tolist()}; the target's argmax at its k + 1 "
                f"positions is {want_t[i].tolist()}")
    if torch.equal(acc, want_a):
        return None
    rows = (acc != want_a).nonzero().flatten().tolist()
    i = rows[0]
    row = f"request {i}: drafts {d[i].tolist()}, target's tokens {want_t[i].tolist()}"
    if torch.equal(acc, v["min"]) and int(acc[0]) > 0:
        return (f"accepted is {int(acc[0])} for every request, the batch's minimum (its "
                f"smallest count), but each request keeps its own prefix ({row}: expected "
                f"{int(want_a[i])}). Count per row, over dim 1, and take no min/max across "
                f"the requests: accepted[i] belongs to request i alone")
    if torch.equal(acc, v["argmax"]) and all(int(want_a[r]) == k for r in rows):
        return (f"accepted[{i}] is 0 where every draft token agrees ({row}): argmax of the "
                f"mismatch mask is 0 when the mask has no True at all. Count the agreeing "
                f"prefix instead (cumprod, then sum)")
    if torch.equal(acc, v["sum"]):
        return (f"accepted[{i}] is {int(acc[i])}, expected {int(want_a[i])} ({row}): you "
                f"counted every agreeing draft token, also those after the first mismatch. "
                f"Only the prefix before the first mismatch is accepted: the target's tokens "
                f"after a rejected draft were computed from a wrong context (cumprod, then sum)")
    if torch.equal(acc, v["bonus"]):
        return (f"accepted is one more than the accepted draft tokens in every row ({row}: "
                f"expected {int(want_a[i])}, got {int(acc[i])}): count draft tokens only, "
                f"0..k. The bonus token is target_tokens[i, accepted[i]], not counted")
    if torch.equal(acc, v["off"]):
        return (f"accepted[{i}] is {int(acc[i])}, expected {int(want_a[i])} ({row}): you "
                f"compared the drafts with the target one position off. Row j of a request's "
                f"logits is the target's prediction after [newest, d1..dj], the token at "
                f"position j: draft_tokens[:, j] is checked against target_tokens[:, j]")
    return f"accepted[{i}] is {int(acc[i])}, expected {int(want_a[i])} ({row})"


def _is_mask(x, agree) -> bool:
    """Whether ``x`` holds the agreement mask ``agree`` (bool, or 0/1 of any dtype)."""
    if x.dtype == torch.bool:
        return torch.equal(x, agree)
    return bool(((x == 0) | (x == 1)).all()) and torch.equal(x != 0, agree)


def check_greedy_accept(fn, *, B=None, trials: int = 6, seed: int = 0):
    """Check the learner's ``greedy_accept`` (module docstring). ``B``: the backend to
    capture on (default: the emulator)."""
    if not callable(fn):
        return fail(NAME, f"expected your function greedy_accept, got {type(fn).__name__}")
    B = backend.get("emulated") if B is None else backend.ensure(B, "check_greedy_accept(B=...)")
    with one_thread(B.device):
        return _check(fn, B, trials, seed)


def _check(fn, B, trials, seed):
    def body() -> str:
        gen = torch.Generator().manual_seed(seed)

        def draw(lo, hi):
            return int(torch.randint(lo, hi, (), generator=gen))
        shapes = [(draw(3, 7), draw(2, 6), draw(6, 40)) for _ in range(trials)]
        if trials > 1:
            shapes[1] = (shapes[1][0], 1, shapes[1][2])        # k = 1
        if trials > 2:
            shapes[2] = (1,) + shapes[2][1:]                     # one request
        for t, shape in enumerate(shapes):
            _one_trial(fn, B, gen, t, *shape)
        return (f"the accepted prefix and the target's tokens right in {trials} random "
                f"batches (all accepted, none, a mismatch anywhere), captured without "
                f"a host read, and the replays follow new inputs")

    return run_check(NAME, body, more_hints=HINTS)


def _one_trial(fn, B, gen, t: int, bs: int, k: int, vocab: int) -> None:
    """Trial ``t``: ``fn`` eagerly on a random batch (inputs left alone, the right
    answer), then captured and replayed (:func:`_captured`)."""
    dtypes = _dtypes(gen, t)
    where = (f"trial {t + 1} (bs={bs}, k={k}, vocab={vocab}, draft_tokens "
             f"{str(dtypes[0]).removeprefix('torch.')}, target_logits "
             f"{str(dtypes[1]).removeprefix('torch.')})")
    d, logits = _case(gen, bs, k, vocab, B.device, dtypes, some=(t == 0))
    d0, l0 = d.clone(), logits.clone()
    versions = (d._version, logits._version)
    got = attempt(fn, (d, logits), time_limit=DEFAULT_TIME_LIMIT,
                  reason=lambda e: f"{where}: your code raised {describe_exception(e)}")
    if not (torch.equal(d, d0) and torch.equal(logits, l0)) or versions != (
            d._version, logits._version):
        reject(f"{where}: your code changed its inputs (draft_tokens or target_logits): "
               "read them, write nothing into them")
    msg = _judge(d0, l0, got)
    if msg:
        reject(f"{where}: {msg}")
    _captured(fn, B, gen, bs, k, vocab, where, dtypes)


def _capture_failed(where: str):
    def reason(e: BaseException) -> str:
        return (f"{where}: capturing your greedy_accept failed: {short_description(e)}\n"
                f"   Inside a captured graph nothing may wait for the device: no .item(), "
                f".tolist(), int(t), nonzero() or `if`/`for` over a tensor's values (each "
                f"reads a value on the host). Use tensor ops only: compare, cumprod, sum")
    return reason


def _captured(fn, B, gen, bs, k, vocab, where, dtypes) -> None:
    """Capture ``fn`` on B and replay it with new inputs: no host read, results that follow.
    Before each replay ``fn`` runs eagerly on the same new inputs: a wrong eager result is
    a mistake in the logic, named as the eager trials name it."""
    d, logits = _case(gen, bs, k, vocab, B.device, dtypes)
    g, out = attempt(capture, (fn, d, logits), {"B": B, "warmup": 1},
                     time_limit=DEFAULT_TIME_LIMIT, B=B, reason=_capture_failed(where),
                     hints=_HOST_READ_HINTS)
    for r in range(2):
        nd, nl = _case(gen, bs, k, vocab, B.device, dtypes)
        again = f"{where}, called again with new draft tokens and logits"
        eager = attempt(fn, (nd.clone(), nl.clone()), time_limit=DEFAULT_TIME_LIMIT,
                        reason=lambda e, again=again: f"{again}: your code raised "
                        f"{describe_exception(e)}")
        msg = _judge(nd, nl, eager)
        if msg:
            reject(f"{again}: {msg}")
        d.copy_(nd)
        logits.copy_(nl)
        g.replay()
        B.synchronize()
        msg = _judge(nd, nl, out)
        if msg:
            reject(f"{where}: after capture, replay {r + 1} with new draft tokens and "
                   f"logits is wrong (your function called eagerly on them is right): "
                   f"{msg}. The graph replays only the device work: a value your code "
                   f"worked out on the host while capturing (.numpy(), a Python loop, a "
                   f"result kept from an earlier call) stays what it was then",
                   hints=_REPLAY_HINTS)
