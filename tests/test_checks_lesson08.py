"""Lesson 08's checkers: each real learner mistake is rejected with a message that names
it, and the reference answer passes."""

from __future__ import annotations

import pytest
import torch

from labkit import backend
from labkit.capture import capture
from labkit.checks.lesson08 import check_decoder, check_reduce_overhead

E = backend.get("emulated")


def usable():
    """After a check: default stream current, random ops allowed, a capture works."""
    assert E.current_stream() == E.default_stream()
    torch.rand(2)
    x = torch.zeros(2)
    g = E.CUDAGraph()
    with E.graph(g):
        x.add_(1)
    g.replay()
    assert x.tolist() == [1.0, 1.0]


# ---- exercise 1: reduce_overhead ----------------------------------------------------------

def make_reduce_overhead(*, warm=True, copy=True, clone_static=False, rerecord=True,
                         by_value=False, clone_out=False, record_every=False, copy_after=False,
                         warm_returns=True):
    """The reference, with one mistake switched on by each flag."""
    def reduce_overhead(fn, static, B):
        st = {"calls": 0, "graph": None, "buffers": [], "out": None, "seen": None}

        def moved(args):
            if by_value:
                return any(not torch.equal(args[i], st["seen"][i]) for i in static)
            return any(args[i].data_ptr() != st["buffers"][i].data_ptr() for i in static)

        def call(*args):
            st["calls"] += 1
            if warm and st["calls"] == 1:
                out = fn(*args)
                return out if warm_returns else None
            if st["graph"] is None or record_every or (rerecord and moved(args)):
                st["buffers"] = [a.clone() if (i not in static or clone_static) else a
                                 for i, a in enumerate(args)]
                st["seen"] = [a.clone() for a in args]
                st["graph"], st["out"] = capture(fn, *st["buffers"], B=B, warmup=0)
            elif copy and not copy_after:
                for i, (b, a) in enumerate(zip(st["buffers"], args)):
                    if i not in static:
                        b.copy_(a)
            st["graph"].replay()
            if copy_after:
                for i, (b, a) in enumerate(zip(st["buffers"], args)):
                    if i not in static:
                        b.copy_(a)
            out = st["out"]
            if clone_out:
                return tuple(o.clone() for o in out) if isinstance(out, tuple) else out.clone()
            return out
        return call
    return reduce_overhead


def test_reduce_overhead_reference_passes():
    assert check_reduce_overhead(make_reduce_overhead(), trials=8, seed=3)
    usable()


@pytest.mark.parametrize("flags, words", [
    ({"warm": False}, "call 1 captured a graph"),
    ({"copy": False}, "stale result"),
    ({"copy_after": True}, "stale result"),
    ({"clone_static": True}, "use static inputs as given"),
    ({"clone_static": True, "rerecord": False}, "never copied into a buffer"),
    ({"rerecord": False}, "replayed the old graph"),
    ({"by_value": True}, "compare data_ptr(), not values"),
    ({"clone_out": True}, "different tensor objects"),
    ({"record_every": True}, "captured a new graph although"),
    ({"warm_returns": False}, "call 1 returned None"),
])
def test_reduce_overhead_mistakes(flags, words):
    r = check_reduce_overhead(make_reduce_overhead(**flags), trials=8, seed=3)
    assert not r and words in r.message, r.message
    usable()


def test_reduce_overhead_never_captures():
    def eager_only(fn, static, B):
        return lambda *args: fn(*args)
    r = check_reduce_overhead(eager_only)
    assert not r and "call 2 captured no graph" in r.message


def test_reduce_overhead_calling_the_answer_is_refused(capsys):
    from labkit.compiled import ReduceOverhead

    r = check_reduce_overhead(lambda fn, static, B: ReduceOverhead(fn, static, B=B))
    assert not r and "labkit.compiled.ReduceOverhead" in r.message
    # the spy is gone afterwards
    assert ReduceOverhead.__init__.__name__ == "__init__"


def test_reduce_overhead_raising_inside_capture_leaves_a_usable_process():
    def syncs(fn, static, B):
        def call(*args):
            g = B.CUDAGraph()
            with B.graph(g):
                args[0].sum().item()          # a host read inside capture
        return call
    r = check_reduce_overhead(syncs)
    assert not r and r.kind == "exception" and "capture" in r.message
    usable()


def test_reduce_overhead_returns_not_callable_and_blank():
    r = check_reduce_overhead(lambda fn, static, B: None)
    assert not r and "expected a function" in r.message

    def blank(fn, static, B):
        raise NotImplementedError()
    r = check_reduce_overhead(blank)
    assert not r and r.kind == "not_implemented"


def test_reduce_overhead_trials_cover_every_static_pattern():
    """The four trials use no static input, all static, one, and a random subset."""
    from labkit.checks.lesson08.reduce_overhead import _static_sets
    g = torch.Generator().manual_seed(0)
    sets = _static_sets(g, 3)
    assert sets[0] == () and sets[1] == (0, 1, 2) and len(sets[2]) == 1


# ---- exercise 2: Decoder ------------------------------------------------------------------

class Right(torch.nn.Module):
    def __init__(self, max_len, dim, device):
        super().__init__()
        self.register_buffer("cache", torch.zeros(max_len, dim, device=device))

    def forward(self, x, pos):
        self.cache.index_copy_(0, pos, x)
        return self.cache.sum(0)


class RightSetitem(Right):
    def forward(self, x, pos):
        self.cache[pos] = x
        return self.cache.sum(0)


class PlainAttribute(torch.nn.Module):
    def __init__(self, max_len, dim, device):
        super().__init__()
        self.cache = torch.zeros(max_len, dim, device=device)

    def forward(self, x, pos):
        self.cache.index_copy_(0, pos, x)
        return self.cache.sum(0)


class Rebinds(Right):
    def forward(self, x, pos):
        self.cache = self.cache.index_copy(0, pos, x)
        return self.cache.sum(0)


class WritesArgument(Right):
    def forward(self, x, pos):
        self.cache.index_copy_(0, pos, x.mul_(1))
        return self.cache.sum(0)


class WrongRow(Right):
    def forward(self, x, pos):
        self.cache.index_copy_(0, (pos + 1) % self.cache.size(0), x)
        return self.cache.sum(0)


class WrongReturn(Right):
    def forward(self, x, pos):
        self.cache.index_copy_(0, pos, x)
        return self.cache.sum(1)


class RandomStart(Right):
    def __init__(self, max_len, dim, device):
        torch.nn.Module.__init__(self)
        self.register_buffer("cache", torch.randn(max_len, dim, device=device))


_SHARED = {}


class SharedCache(Right):
    def __init__(self, max_len, dim, device):
        torch.nn.Module.__init__(self)
        key = (max_len, dim)
        _SHARED.setdefault(key, torch.zeros(max_len, dim, device=device))
        self.register_buffer("cache", _SHARED[key])


class ReturnsNothing(Right):
    def forward(self, x, pos):
        self.cache.index_copy_(0, pos, x)


class TakesCache(torch.nn.Module):
    def __init__(self, max_len, dim, device):
        super().__init__()

    def forward(self, x, cache, pos):
        cache.index_copy_(0, pos, x)
        return cache.sum(0)


def test_decoder_reference_passes():
    assert check_decoder(Right, trials=5)
    assert check_decoder(RightSetitem, trials=5)


@pytest.mark.parametrize("cls, words", [
    (PlainAttribute, "plain tensor attribute, not a registered buffer"),
    (Rebinds, "moved to a new address"),
    (WritesArgument, "wrote into its argument x"),
    (WrongRow, "wrong rows"),
    (WrongReturn, "returned the wrong value"),
    (RandomStart, "start from zeros"),
    (SharedCache, "share one cache"),
    (ReturnsNothing, "returned None"),
    (TakesCache, "no buffer of shape"),
])
def test_decoder_mistakes(cls, words):
    r = check_decoder(cls, trials=3)
    assert not r and words in r.message, r.message


def test_decoder_not_a_class():
    r = check_decoder(lambda *a: None)
    assert not r and "expected your class Decoder" in r.message
