"""Lesson 08's checkers: each real learner mistake is rejected with a message that names
it, and the reference answer passes."""

from __future__ import annotations

import pytest
import torch
from helpers import assert_usable

from labkit import backend
from labkit.capture import capture
from labkit.checks.lesson08 import check_decoder, check_reduce_overhead

E = backend.get("emulated")


# ---- exercise 1: reduce_overhead ----------------------------------------------------------

def make_reduce_overhead(*, warm=True, copy=True, clone_static=False, rerecord=True,
                         by_value=False, clone_out=False, record_every=False, copy_after=False,
                         warm_returns=True, by_identity=False, store_args=False,
                         reverse_copy=False, warmup=0, replay_on_record=True, replays=1,
                         eager_later=False, first_static_only=False, reuse_buffers=False,
                         warm_again_on_move=False, first_output_only=False, pass_B=True,
                         sync=False, as_list=False, copy_static_too=False):
    """The reference, with one mistake (or a harmless variation) switched on by each flag."""
    def reduce_overhead(fn, static, B):
        st = {"calls": 0, "graph": None, "buffers": [], "out": None, "seen": None}

        def moved(args):
            where = list(static)[:1] if first_static_only else static
            if by_value:
                return any(not torch.equal(args[i], st["seen"][i]) for i in where)
            if by_identity:
                return any(args[i] is not st["buffers"][i] for i in where)
            return any(args[i].data_ptr() != st["buffers"][i].data_ptr() for i in where)

        def copy_in(args):
            for i, (b, a) in enumerate(zip(st["buffers"], args)):
                if i not in static or copy_static_too:
                    a.copy_(b) if reverse_copy else b.copy_(a)

        def call(*args):
            st["calls"] += 1
            if warm and st["calls"] == 1:
                out = fn(*args)
                return out if warm_returns else None
            if warm_again_on_move and st["graph"] is not None and moved(args):
                st["graph"] = None
                return fn(*args)
            if st["graph"] is None or record_every or (rerecord and moved(args)):
                if reuse_buffers and st["buffers"]:
                    st["buffers"] = [a if i in static else st["buffers"][i]
                                     for i, a in enumerate(args)]
                elif store_args:
                    st["buffers"] = list(args)
                else:
                    st["buffers"] = [a.clone() if (i not in static or clone_static) else a
                                     for i, a in enumerate(args)]
                st["seen"] = [a.clone() for a in args]
                kw = {"B": B} if pass_B else {}
                st["graph"], st["out"] = capture(fn, *st["buffers"], warmup=warmup, **kw)
                if not replay_on_record:
                    return st["out"]
            elif eager_later:
                return fn(*args)
            elif copy and not copy_after:
                copy_in(args)
            for _ in range(replays):
                st["graph"].replay()
            if copy_after:
                copy_in(args)
            if sync:
                B.synchronize()
            out = st["out"]
            if clone_out:
                return tuple(o.clone() for o in out) if isinstance(out, tuple) else out.clone()
            if isinstance(out, tuple) and first_output_only:
                return out[0]
            if isinstance(out, tuple) and as_list:
                return list(out)
            return out
        return call
    return reduce_overhead


def test_reduce_overhead_reference_passes():
    assert check_reduce_overhead(make_reduce_overhead(), trials=8, seed=3)
    assert_usable(E)


@pytest.mark.parametrize("flags", [
    {"sync": True},                 # B.synchronize() after the replay: outside any capture
    {"as_list": True},              # fn's tuple handed back as a list of the same tensors
    {"copy_static_too": True},      # a static input copied into itself: a no-op
])
def test_reduce_overhead_harmless_variations_pass(flags):
    assert check_reduce_overhead(make_reduce_overhead(**flags), trials=8, seed=3)


@pytest.mark.parametrize("flags, words", [
    ({"warm": False}, "call 1 captured a graph"),
    ({"copy": False}, "stale result"),
    ({"copy_after": True}, "stale result"),
    ({"clone_static": True}, "use static inputs as given"),
    ({"clone_static": True, "rerecord": False}, "never copied into a buffer"),
    ({"rerecord": False}, "replayed the old graph"),
    ({"by_value": True}, "compare data_ptr(), not values"),
    ({"by_identity": True}, "compare data_ptr(), not the tensor objects"),
    ({"clone_out": True}, "not the graph's outputs"),
    ({"record_every": True}, "captured a new graph although"),
    ({"warm_returns": False}, "call 1 returned None"),
    # the caller's tensors: kept as buffers, or written by a copy the wrong way round
    ({"store_args": True}, "you kept the argument, not a copy"),
    ({"reverse_copy": True}, "copy each argument INTO its buffer"),
    # capture()'s own warm-up on top of call 1's
    ({"warmup": 3}, "call 2 ran fn eagerly 3 times besides capturing it"),
    ({"warmup": 1}, "warmup=0"),
    ({"replay_on_record": False}, "call 2 did not replay the graph"),
    ({"replays": 2}, "replayed the graph twice"),
    ({"eager_later": True}, "call 3 ran fn eagerly"),
    ({"first_static_only": True}, "for every position in static"),
    ({"reuse_buffers": True}, "copies of the non-static inputs made now"),
    ({"warm_again_on_move": True}, "ran fn eagerly instead of recording"),
    ({"first_output_only": True}, "returned one Tensor, but fn"),
    ({"pass_B": False}, "not on the backend B"),
])
def test_reduce_overhead_mistakes(flags, words):
    r = check_reduce_overhead(make_reduce_overhead(**flags), trials=8, seed=3)
    assert not r and words in r.message, r.message
    assert_usable(E)


def test_reduce_overhead_copied_static_with_no_static_inputs_says_so():
    """With static=() nothing may send a call to a new recording: the message says that,
    not that static inputs were copied."""
    r = check_reduce_overhead(make_reduce_overhead(record_every=True))
    assert not r and "static=(): no input can call for a new recording" in r.message


_GLOBAL = {"calls": 0, "graph": None, "buffers": None, "out": None}


def global_state(fn, static, B):
    """The reference with its state in a module-level dict, shared by every function."""
    def call(*args):
        _GLOBAL["calls"] += 1
        if _GLOBAL["calls"] == 1:
            return fn(*args)
        if _GLOBAL["graph"] is None or any(
                args[i].data_ptr() != _GLOBAL["buffers"][i].data_ptr() for i in static):
            _GLOBAL["buffers"] = [a if i in static else a.clone() for i, a in enumerate(args)]
            _GLOBAL["graph"], _GLOBAL["out"] = capture(fn, *_GLOBAL["buffers"], B=B, warmup=0)
        else:
            for i, (b, a) in enumerate(zip(_GLOBAL["buffers"], args)):
                if i not in static:
                    b.copy_(a)
        _GLOBAL["graph"].replay()
        return _GLOBAL["out"]
    return call


def test_reduce_overhead_global_state_is_named():
    r = check_reduce_overhead(global_state)
    assert not r and "Keep the state inside, one per function" in r.message, r.message
    assert_usable(E)


def test_reduce_overhead_sync_inside_capture_reports_the_sync():
    """The capture's follow-on error ("a previous error during capture") is not the news:
    the report names the refused synchronize()."""
    def syncs(fn, static, B):
        st = {"n": 0}

        def call(*args):
            st["n"] += 1
            if st["n"] == 1:
                return fn(*args)
            if st["n"] == 2:
                st["g"] = B.CUDAGraph()
                with B.graph(st["g"]):
                    st["o"] = fn(*[a.clone() for a in args])
                    B.synchronize()
            st["g"].replay()
            return st["o"]
        return call
    r = check_reduce_overhead(syncs)
    assert not r and r.kind == "exception" and "synchronize()" in r.message, r.message
    assert "previous error during capture" not in r.message
    assert_usable(E)


def test_reduce_overhead_torch_cuda_on_the_emulator_is_explained():
    def cuda_graph(fn, static, B):
        st = {"n": 0}

        def call(*args):
            st["n"] += 1
            if st["n"] == 1:
                return fn(*args)
            st["g"] = torch.cuda.CUDAGraph()
            return None
        return call
    if torch.cuda.is_available():
        pytest.skip("torch.cuda.CUDAGraph works here")
    r = check_reduce_overhead(cuda_graph)
    assert not r and "not torch.cuda" in r.message, r.message


def test_reduce_overhead_never_captures():
    def eager_only(fn, static, B):
        return lambda *args: fn(*args)
    r = check_reduce_overhead(eager_only)
    assert not r and "call 2 captured no graph" in r.message


def test_reduce_overhead_calling_the_answer_is_refused(capsys):
    from labkit.compiled import ReduceOverhead

    r = check_reduce_overhead(lambda fn, static, B: ReduceOverhead(fn, static, B=B))
    assert not r and "labkit.compiled.ReduceOverhead" in r.message
    # the spies are gone afterwards
    assert ReduceOverhead.__init__.__name__ == "__init__"
    assert ReduceOverhead.__call__.__name__ == "__call__"

    def without_init(fn, static, B):      # the answer's methods, on an object built by hand
        r = object.__new__(ReduceOverhead)
        r.fn, r.static, r.B, r.kinds, r.graph, r.buffers, r.outputs = (
            fn, tuple(static), B, [], None, [], None)
        return r
    r = check_reduce_overhead(without_init)
    assert not r and "labkit.compiled.ReduceOverhead" in r.message


def test_reduce_overhead_raising_inside_capture_leaves_a_usable_process():
    def syncs(fn, static, B):
        def call(*args):
            g = B.CUDAGraph()
            with B.graph(g):
                args[0].sum().item()          # a host read inside capture
        return call
    r = check_reduce_overhead(syncs)
    assert not r and r.kind == "exception" and "capture" in r.message
    assert_usable(E)


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


class NonPersistent(Right):
    """persistent=False leaves the buffer out of state_dict(); it is still a buffer."""
    def __init__(self, max_len, dim, device):
        torch.nn.Module.__init__(self)
        self.register_buffer("cache", torch.zeros(max_len, dim, device=device), persistent=False)


class ReturnsClone(Right):
    def forward(self, x, pos):
        self.cache.index_copy_(0, pos, x)
        return self.cache.sum(0).clone()


class WritesPos(Right):
    def forward(self, x, pos):
        pos.clamp_(0, self.cache.size(0) - 1)
        self.cache.index_copy_(0, pos, x)
        return self.cache.sum(0)


class SqueezesX(Right):
    """Reshapes x in place: the report blames the write, not a crash in the reference."""
    def forward(self, x, pos):
        x.squeeze_(0)
        self.cache[pos] = x
        return self.cache.sum(0)


class KeepDim(Right):
    def forward(self, x, pos):
        self.cache.index_copy_(0, pos, x)
        return self.cache.sum(0, keepdim=True)


class ReturnsBeforeWrite(Right):
    def forward(self, x, pos):
        out = self.cache.sum(0).clone()
        self.cache.index_copy_(0, pos, x)
        return out


class Accumulates(Right):
    def forward(self, x, pos):
        self.cache[pos] += x
        return self.cache.sum(0)


class ZeroesEachStep(Right):
    def forward(self, x, pos):
        self.cache.zero_()
        self.cache.index_copy_(0, pos, x)
        return self.cache.sum(0)


class Float64(RightSetitem):
    def __init__(self, max_len, dim, device):
        torch.nn.Module.__init__(self)
        self.register_buffer("cache", torch.zeros(max_len, dim, device=device,
                                                  dtype=torch.float64))


class AsTrainableParameter(Right):
    def __init__(self, max_len, dim, device):
        torch.nn.Module.__init__(self)
        self.cache = torch.nn.Parameter(torch.zeros(max_len, dim, device=device))


class ClassLevel(Right):
    cache = None

    def __init__(self, max_len, dim, device):
        torch.nn.Module.__init__(self)
        type(self).cache = torch.zeros(max_len, dim, device=device)


class Lazy(Right):
    def __init__(self, max_len, dim, device):
        torch.nn.Module.__init__(self)
        self.size_ = (max_len, dim)

    def forward(self, x, pos):
        if not hasattr(self, "cache"):
            self.register_buffer("cache", torch.zeros(*self.size_, device=x.device))
        return super().forward(x, pos)


class Transposed(torch.nn.Module):
    def __init__(self, max_len, dim, device):
        super().__init__()
        self.register_buffer("cache", torch.zeros(dim, max_len, device=device))

    def forward(self, x, pos):
        self.cache[:, pos] = x.T
        return self.cache.sum(1)


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
    assert check_decoder(NonPersistent, trials=5)
    assert check_decoder(ReturnsClone, trials=5)


@pytest.mark.parametrize("cls, words", [
    (PlainAttribute, "plain tensor attribute, not registered with the module"),
    (Rebinds, "moved to a new address"),
    (WritesArgument, "wrote into its argument x"),
    (WrongRow, "but pos is"),
    (WrongReturn, "forward returned a tensor of shape ("),
    (RandomStart, "does not start as zeros"),
    (SharedCache, "share one cache"),
    (WritesPos, "wrote into its argument pos"),
    (SqueezesX, "wrote into its argument x"),
    (KeepDim, "shape (1, "),
    (ReturnsBeforeWrite, "after this step's write"),
    (Accumulates, "forward added x"),
    (ZeroesEachStep, "besides row pos="),
    (Float64, "is torch.float64, but x"),
    (AsTrainableParameter, "is an nn.Parameter with requires_grad=True"),
    (ClassLevel, "class attribute (ClassLevel.cache)"),
    (Lazy, "appears only when forward first runs"),
    (Transposed, "its buffers are cache ("),
    (ReturnsNothing, "returned None"),
    (TakesCache, "no buffer of shape"),
])
def test_decoder_mistakes(cls, words):
    r = check_decoder(cls, trials=3)
    assert not r and words in r.message, r.message


def test_decoder_not_a_class():
    r = check_decoder(lambda *a: None)
    assert not r and "expected your class Decoder" in r.message


def test_decoder_cache_on_another_device():
    """A cache made without device=device is refused by name (seen here with "meta")."""
    from labkit.checks.lesson08.decoder import _one_trial

    class IgnoresDevice(Right):
        def __init__(self, max_len, dim, device):
            torch.nn.Module.__init__(self)
            self.register_buffer("cache", torch.zeros(max_len, dim))

    msg = _one_trial(IgnoresDevice, 4, 3, torch.device("meta"), torch.Generator())
    assert msg and "is on cpu, but Decoder was asked for meta" in msg


# ---- issue #29: a newcomer's findings -----------------------------------------------------

def pairs_by_zip(fn, static, B):
    """Buffers for the non-static inputs only, then zip(buffers, args) over EVERY argument:
    right only while the non-static inputs come first."""
    st = {"n": 0, "graph": None}

    def call(*args):
        st["n"] += 1
        if st["n"] == 1:
            return fn(*args)
        copied = [i for i in range(len(args)) if i not in static]
        if st["graph"] is None or any(args[i].data_ptr() != st["args"][i].data_ptr()
                                      for i in static):
            st["bufs"] = [args[i].detach().clone() for i in copied]
            full = list(args)
            for b, i in zip(st["bufs"], copied):
                full[i] = b
            st["args"] = full
            st["graph"], st["out"] = capture(fn, *full, B=B, warmup=0)
        else:
            for b, a in zip(st["bufs"], args):
                b.copy_(a)
        st["graph"].replay()
        return st["out"]
    return call


def non_static_first(fn, static, B):
    """Takes the first len(args) - len(static) inputs for the non-static ones."""
    st = {"n": 0, "graph": None}

    def call(*args):
        st["n"] += 1
        if st["n"] == 1:
            return fn(*args)
        m = len(args) - len(static)
        if st["graph"] is None or any(args[i].data_ptr() != st["args"][i].data_ptr()
                                      for i in range(m, len(args))):
            st["args"] = [a.detach().clone() if i < m else a for i, a in enumerate(args)]
            st["graph"], st["out"] = capture(fn, *st["args"], B=B, warmup=0)
        else:
            for i in range(m):
                st["args"][i].copy_(args[i])
        st["graph"].replay()
        return st["out"]
    return call


def one_based(fn, static, B):
    """Reads static as 1-based positions: `for i, a in enumerate(args, 1)`."""
    st = {"n": 0, "graph": None}

    def call(*args):
        st["n"] += 1
        if st["n"] == 1:
            return fn(*args)
        if st["graph"] is None or any(a.data_ptr() != b.data_ptr() for i, (a, b) in
                                      enumerate(zip(args, st["args"]), 1) if i in static):
            st["args"] = [a if i in static else a.detach().clone()
                          for i, a in enumerate(args, 1)]
            st["graph"], st["out"] = capture(fn, *st["args"], B=B, warmup=0)
        else:
            for i, (b, a) in enumerate(zip(st["args"], args), 1):
                if i not in static:
                    b.copy_(a)
        st["graph"].replay()
        return st["out"]
    return call


def test_reduce_overhead_trials_put_static_positions_before_non_static_ones():
    """The lesson's own example is f(w, x) with static=(0,): every seed's trials hold a
    static position followed by a non-static one, with one static input and with several."""
    from labkit.checks.lesson08.reduce_overhead import _static_sets

    def mixed(s, arity):
        return any(i in s and j not in s for i in range(arity) for j in range(i + 1, arity))
    for seed in range(20):
        g = torch.Generator().manual_seed(seed)
        for arity in (2, 3, 4):
            sets = _static_sets(g, arity)
            assert mixed(sets[2], arity) and len(sets[2]) == 1, (seed, arity, sets)
            assert mixed(sets[3], arity), (seed, arity, sets)


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_reduce_overhead_buffers_paired_with_the_wrong_arguments(seed):
    """zip(buffers, args) over every argument: the replay reads a static input's values
    where a non-static input belongs; the report says so, by position."""
    r = check_reduce_overhead(pairs_by_zip, seed=seed)
    assert not r and "where input" in r.message and "pair" in r.message, r.message


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_reduce_overhead_non_static_inputs_taken_to_come_first(seed):
    r = check_reduce_overhead(non_static_first, seed=seed)
    assert not r and "positions in static" in r.message and "anywhere" in r.message, r.message


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_reduce_overhead_one_based_positions_are_named(seed):
    """static read as 1-based: the report names the positions that went wrong and says
    static counts from 0, instead of listing every non-static input as stale."""
    r = check_reduce_overhead(one_based, seed=seed)
    assert not r and "count from 0" in r.message, r.message


class HostReadRow(Right):
    """The row written at pos.item(): a host read, which breaks the graph (lesson 08 §6)."""
    def forward(self, x, pos):
        self.cache[pos.item()] = x[0]
        return self.cache.sum(0)


class IntRow(Right):
    def forward(self, x, pos):
        self.cache[int(pos)] = x[0]
        return self.cache.sum(0)


class AsFrozenParameter(Right):
    """The lesson says parameters are static too: a parameter that needs no grad is a fine
    cache (it moves with the module, it is written in place without autograd)."""
    def __init__(self, max_len, dim, device):
        torch.nn.Module.__init__(self)
        self.cache = torch.nn.Parameter(torch.zeros(max_len, dim, device=device),
                                        requires_grad=False)


class MarkedAttribute(Right):
    """A plain attribute marked with mark_static_address: torch.compile uses it in place,
    but it is no module state."""
    def __init__(self, max_len, dim, device):
        torch.nn.Module.__init__(self)
        self.cache = torch.zeros(max_len, dim, device=device)
        torch._dynamo.mark_static_address(self.cache)


_SHARED_AGAIN = {}


class SharedAcrossChecks(Right):
    """One cache per shape for every instance: the second checker cell finds it written."""
    def __init__(self, max_len, dim, device):
        torch.nn.Module.__init__(self)
        key = (max_len, dim)
        _SHARED_AGAIN.setdefault(key, torch.zeros(max_len, dim, device=device))
        self.register_buffer("cache", _SHARED_AGAIN[key])


class TolistRow(Right):
    def forward(self, x, pos):
        for p in pos.tolist():
            self.cache[p] = x[0]
        return self.cache.sum(0)


class BranchOnPos(Right):
    def forward(self, x, pos):
        if pos >= 0:
            self.cache.index_copy_(0, pos, x)
        return self.cache.sum(0)


class EmptyCache(Right):
    """torch.empty: whatever the memory held, zeros by chance or not."""
    def __init__(self, max_len, dim, device):
        torch.nn.Module.__init__(self)
        self.register_buffer("cache", torch.empty(max_len, dim, device=device))


def test_decoder_empty_cache_is_caught_even_where_memory_holds_zeros():
    r = check_decoder(EmptyCache, compile_on_gpu=False)
    assert not r and "does not start as zeros" in r.message and "torch.empty" in r.message


@pytest.mark.parametrize("cls", [HostReadRow, IntRow, TolistRow, BranchOnPos])
def test_decoder_host_read_fails_on_every_backend(cls):
    r = check_decoder(cls, compile_on_gpu=False)
    assert not r and "host" in r.message and "pos itself" in r.message, r.message
    assert_usable(backend.get("auto"))


def test_decoder_frozen_parameter_passes():
    assert check_decoder(AsFrozenParameter, trials=3)


def test_decoder_marked_attribute_says_why_the_mark_is_not_enough():
    r = check_decoder(MarkedAttribute)
    assert not r and "mark_static_address" in r.message and ".to(" in r.message, r.message


def test_decoder_plain_attribute_message_is_true():
    """dynamo marks a module's tensor attributes static too: the report must not say
    that only buffers and parameters are."""
    r = check_decoder(PlainAttribute)
    assert not r and ".to(" in r.message, r.message
    assert "Buffers (and parameters) are the inputs graph trees treat as static" not in r.message


def test_decoder_shared_cache_is_named_in_a_second_check_too():
    _SHARED_AGAIN.clear()
    for _ in range(2):           # the exercise has two checker cells
        r = check_decoder(SharedAcrossChecks, compile_on_gpu=False)
        assert not r and "share one cache" in r.message, r.message


# ---- a newcomer's findings (newcomer89) ---------------------------------------------------

def copies_moved_inputs_only(fn, static, B):
    """Copies a non-static input only when it arrives at another address than on the last
    call (lesson 09's replay_piece rule, carried over): a caller that refills the tensor it
    passed before, or a new tensor at a freed one's address, gets a stale replay."""
    st = {"n": 0, "graph": None, "last": {}}

    def call(*args):
        st["n"] += 1
        if st["n"] == 1:
            return fn(*args)
        if st["graph"] is None or any(args[i].data_ptr() != st["bufs"][i].data_ptr()
                                      for i in static):
            st["bufs"] = [a if i in static else a.detach().clone() for i, a in enumerate(args)]
            st["graph"], st["out"] = capture(fn, *st["bufs"], B=B, warmup=0)
        else:
            for i, (b, a) in enumerate(zip(st["bufs"], args)):
                if i not in static and st["last"].get(i) != a.data_ptr():
                    b.copy_(a)
        st["last"] = {i: a.data_ptr() for i, a in enumerate(args)}
        st["graph"].replay()
        return st["out"]
    return call


def clones_static_on_rerecord(fn, static, B):
    """Records the first graph right, but a new recording (a static input at a new address)
    on copies of every input, the static ones too: an in-place change of the new static
    input is then missed."""
    st = {"n": 0, "graph": None}

    def call(*args):
        st["n"] += 1
        if st["n"] == 1:
            return fn(*args)
        if st["graph"] is None or any(args[i].data_ptr() != st["ptrs"][i] for i in static):
            again = st["graph"] is not None
            st["bufs"] = [a.detach().clone() if again or i not in static else a
                          for i, a in enumerate(args)]
            st["ptrs"] = [a.data_ptr() for a in args]
            st["graph"], st["out"] = capture(fn, *st["bufs"], B=B, warmup=0)
        else:
            for i, (b, a) in enumerate(zip(st["bufs"], args)):
                if i not in static:
                    b.copy_(a)
        st["graph"].replay()
        return st["out"]
    return call


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_reduce_overhead_input_refilled_in_place_is_copied_again(seed):
    """The same tensor passed again with new values (or a new tensor at a freed one's
    address) must be copied too: torch's CUDAGraphNode.run copies every non-static input
    before each replay (_copy_inputs_and_remove_from_src), whatever its address."""
    r = check_reduce_overhead(copies_moved_inputs_only, seed=seed)
    assert not r and "in place" in r.message and "whatever its address" in r.message, r.message
    assert_usable(E)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_reduce_overhead_new_recording_clones_the_static_input(seed):
    r = check_reduce_overhead(clones_static_on_rerecord, seed=seed)
    assert not r and "changed in place" in r.message and "re-record" in r.message, r.message
    assert_usable(E)


class AliasedCache(Right):
    """A registered buffer and a second, plain name for it that forward uses: .to(device)
    moves the buffer and leaves the plain name on the old tensor."""
    def __init__(self, max_len, dim, device):
        torch.nn.Module.__init__(self)
        self.register_buffer("cache", torch.zeros(max_len, dim, device=device))
        self.kv = self.cache

    def forward(self, x, pos):
        self.kv.index_copy_(0, pos, x)
        return self.kv.sum(0)


def test_decoder_alias_left_behind_by_to_is_named():
    """The text: the cache 'moves with the module: Decoder(...).to(device) takes it along'.
    A forward that writes a plain second name for the buffer works until the module moves."""
    r = check_decoder(AliasedCache, compile_on_gpu=False)
    assert not r and "self.kv" in r.message and ".to(" in r.message, r.message
    assert_usable(backend.get("auto"))


def test_decoder_right_answers_survive_a_move():
    """Built on the CPU and moved with .to(): the right answers still pass."""
    for cls in (Right, RightSetitem, NonPersistent, AsFrozenParameter):
        assert check_decoder(cls, compile_on_gpu=False), cls.__name__


@pytest.mark.parametrize("seed", [1, 2])
def test_reduce_overhead_first_static_position_only_is_not_blamed_on_counting(seed):
    """Comparing static[0] only looks, with static=(0, 1), like counting from 1 (both
    re-record at position 0 alone): the report must not give counting as the only cause."""
    r = check_reduce_overhead(make_reduce_overhead(first_static_only=True), seed=seed)
    assert not r and "static[0]" in r.message, r.message


def reads_values_to_skip_copies(fn, static, B):
    """Right, but copies a non-static input only when its values differ from the buffer's:
    torch.equal, a device→host sync on every call, the very cost reduce-overhead removes."""
    st = {"n": 0, "graph": None}

    def call(*args):
        st["n"] += 1
        if st["n"] == 1:
            return fn(*args)
        if st["graph"] is None or any(args[i].data_ptr() != st["bufs"][i].data_ptr()
                                      for i in static):
            st["bufs"] = [a if i in static else a.detach().clone() for i, a in enumerate(args)]
            st["graph"], st["out"] = capture(fn, *st["bufs"], B=B, warmup=0)
        else:
            for i, (b, a) in enumerate(zip(st["bufs"], args)):
                if i not in static and not torch.equal(b, a):
                    b.copy_(a)
        st["graph"].replay()
        return st["out"]
    return call


def test_reduce_overhead_host_read_on_every_call_is_refused():
    r = check_reduce_overhead(reads_values_to_skip_copies)
    assert not r and "host" in r.message and "torch.equal" in r.message, r.message
    assert "copies them all" in r.message                       # and says what to do instead


def item_to_decide_the_copy(fn, static, B):
    """Right, but asks .item() of an input on every call to decide whether to copy."""
    st = {"n": 0, "graph": None}

    def call(*args):
        st["n"] += 1
        if st["n"] == 1:
            return fn(*args)
        if st["graph"] is None or any(args[i].data_ptr() != st["bufs"][i].data_ptr()
                                      for i in static):
            st["bufs"] = [a if i in static else a.detach().clone() for i, a in enumerate(args)]
            st["graph"], st["out"] = capture(fn, *st["bufs"], B=B, warmup=0)
        else:
            for i, (b, a) in enumerate(zip(st["bufs"], args)):
                if i not in static and a.flatten()[0].item() == a.flatten()[0].item():
                    b.copy_(a)
        st["graph"].replay()
        return st["out"]
    return call


def test_reduce_overhead_item_on_every_call_is_named():
    r = check_reduce_overhead(item_to_decide_the_copy)
    assert not r and ".item()" in r.message and "host" in r.message, r.message
