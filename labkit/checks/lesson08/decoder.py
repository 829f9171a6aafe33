"""Exercise 2 (diagnosis): a decode step that reduce-overhead skips, rewritten as a module.

The broken step writes its KV cache through an argument (``cache.index_copy_``), a mutated
input that is not static, so graph trees skip it. The fix the lesson teaches (§4) is
gpt-fast's: the cache is module state, a registered buffer (or a parameter that needs no
grad: dynamo treats both as static), written in place. The checker builds the learner's
``Decoder(max_len, dim, device)``, steps it against the reference, and checks that no
argument is written, that the cache is made in ``__init__`` (zeros, x's dtype, on
``device``), one per instance, written in place at a fixed address (row ``pos`` replaced,
a row written twice included, the others kept), and still the one forward writes after
``Decoder(..., "cpu").to(device)``; a wrong cache is described by what it is
(a plain attribute, marked with ``mark_static_address`` or not, a class attribute, a
parameter that needs grad, another shape, made lazily in ``forward``), a wrong row by
where ``x`` went. Then it captures one step of a fresh ``Decoder`` on the backend and
replays it with new ``x`` and ``pos``: a host read (``pos.item()``, ``int(pos)``) fails
the capture on every backend, as it breaks torch.compile's graph. On a GPU it also
compiles the module with ``mode="reduce-overhead"`` and checks that torch records and
replays a graph, no skip.

A plain tensor attribute is refused although torch.compile would not copy it either
(dynamo marks every tensor attribute of a module static, ``VariableBuilder.wrap_tensor``):
it is no module state, so ``Decoder(...).to(device)`` leaves it where it was made, which
the exercise's text rules out.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from labkit import backend
from labkit.capture import capture
from labkit.checks import (
    DEFAULT_TIME_LIMIT,
    attempt,
    call_learner,
    describe_exception,
    extra_probe,
    fail,
    outcome,
    reject,
    run_check,
    short_description,
)
from labkit.core.signature import fmt_shape

NAME = "Decoder"
HINTS = [
    "The log names the mutated input: the cache passed as an argument. Which inputs does "
    "the tree never copy (§3)? Make the cache one of them.",
    "In __init__: self.register_buffer('cache', torch.zeros(max_len, dim, device=device)). "
    "In forward(x, pos): write the row in place (self.cache.index_copy_(0, pos, x)) and "
    "return self.cache.sum(0).",
]


def reference_step(x, cache, pos):
    """The broken function of the exercise: right values, wrong place for the cache."""
    cache.index_copy_(0, pos, x)
    return cache.sum(0)


def check_decoder(cls, *, trials: int = 3, seed: int = 0, compile_on_gpu: bool = True):
    """Check the learner's ``Decoder`` class (see the module docstring)."""
    if not isinstance(cls, type) or not issubclass(cls, torch.nn.Module):
        return fail(NAME, f"expected your class Decoder (a torch.nn.Module subclass), got "
                          f"{type(cls).__name__ if not isinstance(cls, type) else cls.__name__}")
    B = backend.get("auto")

    def body() -> str:
        gen = torch.Generator().manual_seed(seed)
        for trial in range(trials):
            max_len = int(torch.randint(4, 12, (), generator=gen))
            dim = int(torch.randint(2, 9, (), generator=gen))
            where = f"trial {trial + 1} (max_len={max_len}, dim={dim})"
            _judged(attempt(_one_trial, (cls, max_len, dim, B.device, gen),
                            reason=_raised(f"{where}: your code raised")), where)
        _judged(attempt(_moved, (cls, B.device), reason=_raised(
            "building a Decoder on the CPU to move it with .to(): your code raised")))
        _judged(attempt(_captured, (cls, B, gen), B=B, reason=_raised(
            "capturing a step of your Decoder: your code raised")))
        extra = ""
        if B.name == "cuda" and compile_on_gpu:
            _judged(_compiled_on_gpu(cls, B))
            extra = "; compiled with reduce-overhead on this GPU: recorded and replayed, 0 skips"
        return (f"same values as the broken step in {trials} random trials, no argument "
                f"written, the cache module state written in place, a step captured and "
                f"replayed with new x and pos{extra}")

    return run_check(NAME, body, more_hints=HINTS)


def _raised(start: str):
    """The report of an error out of the learner's code: ``start`` and the error."""
    return lambda exc: f"{start} {describe_exception(exc)}"


def _judged(msg: str | None, where: str = "") -> None:
    """Reject with a probe's finding, if any (``where: msg``)."""
    if msg:
        reject(f"{where}: {msg}" if where else msg)


_EMPTY = {torch.ops.aten.empty.memory_format, torch.ops.aten.empty_strided.default,
          torch.ops.aten.empty_like.default, torch.ops.aten.new_empty.default}


class _GarbageEmpty(TorchDispatchMode):
    """Fills every float tensor ``torch.empty`` (and its kin) makes with NaN: memory that
    happens to hold zeros must not pass for a zeroed cache."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in _EMPTY and isinstance(out, torch.Tensor) and out.is_floating_point():
            out.fill_(float("nan"))
        return out


def _build(cls, max_len, dim, device):
    """The learner's ``cls(max_len, dim, device)``, built with uninitialised memory made
    visible (:class:`_GarbageEmpty`)."""
    with _GarbageEmpty():
        return call_learner(cls, max_len, dim, device)


def _cache_buffer(mod, max_len, dim):
    """The cache: a (max_len, dim) buffer, or parameter that needs no grad, of ``mod``."""
    for name, buf in mod.named_buffers():
        if tuple(buf.shape) == (max_len, dim):
            return name, buf
    for name, p in mod.named_parameters():
        if tuple(p.shape) == (max_len, dim) and not p.requires_grad:
            return name, p
    return None, None


def _no_buffer(mod, max_len, dim, device):
    """Why ``mod`` has no (max_len, dim) buffer right after __init__: what it has instead."""
    want = (max_len, dim)
    for k, v in vars(mod).items():
        if isinstance(v, torch.Tensor) and tuple(v.shape) == want:
            marked = getattr(v, "_dynamo_static_input_type", None) is not None
            what = ("marked with torch._dynamo.mark_static_address" if marked
                    else "not registered with the module")
            why = ("The mark tells torch.compile to use it in place (dynamo does that for "
                   "every tensor attribute of a module anyway), but it does not make the "
                   "tensor module state" if marked else
                   "torch.compile would not copy it (dynamo treats a module's tensor "
                   "attributes as static, like buffers), but it is no module state")
            return (f"the cache self.{k} is a plain tensor attribute, {what}. {why}: "
                    f"Decoder(...).to(device) (or .cuda(), .half()) moves the module's "
                    f"buffers and parameters and leaves it where it was made, so a Decoder "
                    f"built on the CPU and moved to the GPU keeps its cache on the CPU. The "
                    f"text asks for a cache that moves with the module: "
                    f"self.register_buffer({k!r}, torch.zeros(max_len, dim, device=device))")
    for k, v in mod.named_parameters():
        if tuple(v.shape) == want:
            return (f"the cache self.{k} is an nn.Parameter with requires_grad=True: "
                    f"autograd refuses an in-place write into it (a leaf that requires grad), "
                    f"and model.parameters() hands it to the optimizer as a weight. A cache is "
                    f"state, never trained: register it as a buffer, "
                    f"self.register_buffer({k!r}, torch.zeros(max_len, dim, device=device)) "
                    f"(a Parameter with requires_grad=False works too)")
    for klass in type(mod).__mro__:
        for k, v in vars(klass).items():
            if isinstance(v, torch.Tensor) and tuple(v.shape) == want:
                return (f"the cache self.{k} is a class attribute ({klass.__name__}.{k}): "
                        f"one tensor shared by every instance, and not a registered buffer: "
                        f"create it in __init__ with self.register_buffer({k!r}, "
                        f"torch.zeros(max_len, dim, device=device))")
    others = ", ".join(f"{k} {fmt_shape(v.shape)}" for k, v in mod.named_buffers())
    if others:
        return (f"no buffer of shape ({max_len}, {dim}) after Decoder({max_len}, {dim}, "
                f"device): its buffers are {others}. The cache is torch.zeros(max_len, "
                f"dim): one row per position, in that order")
    # created lazily, in forward?
    dim_x = torch.zeros(1, dim, device=device)
    extra_probe(call_learner, (mod, dim_x, torch.zeros(1, dtype=torch.long, device=device)))
    name, _ = _cache_buffer(mod, max_len, dim)
    if name is not None:
        return (f"the cache buffer self.{name} appears only when forward first runs. Create "
                f"it in __init__ (self.register_buffer({name!r}, torch.zeros(max_len, dim, "
                f"device=device))): each Decoder holds its zeroed cache from the start, and a "
                f"forward that adds a buffer to its module changes what torch.compile traced, "
                f"so the next call is compiled again")
    return (f"no buffer of shape ({max_len}, {dim}) in named_buffers(): keep the cache in the "
            f"module, created in __init__ with self.register_buffer")


def _one_trial(cls, max_len, dim, device, gen):
    a = _build(cls, max_len, dim, device)
    b = _build(cls, max_len, dim, device)                 # a second instance, stepped between
    name, buf = _cache_buffer(a, max_len, dim)
    if buf is None:
        return _no_buffer(a, max_len, dim, device)
    _, other = _cache_buffer(b, max_len, dim)
    if other is not None and _overlap(buf, other):
        return (f"two Decoder instances share one cache (Decoder({max_len}, {dim}, device) "
                f"twice gives the same memory for self.{name}, which an earlier check may "
                f"have written already): create the tensor in __init__, torch.zeros(max_len, "
                f"dim, device=device), one per instance")
    want_dtype = torch.zeros(0).dtype
    if buf.dtype != want_dtype:
        return (f"the cache self.{name} is {buf.dtype}, but x and the broken step's cache "
                f"(torch.zeros(max_len, dim)) are {want_dtype}: leave out dtype= (writing x "
                f"into it must not convert, and the sums must come back as {want_dtype})")
    if buf.device.type != torch.device(device).type:
        return (f"the cache self.{name} is on {buf.device}, but Decoder was asked for "
                f"{torch.device(device)}: torch.zeros(max_len, dim, device=device)")
    if bool((buf != 0).any()):
        return (f"the cache self.{name} does not start as zeros (right after __init__ it "
                f"holds other values: torch.empty keeps whatever the memory held, torch.randn "
                f"is random): torch.zeros(max_len, dim, device=device), as in the broken step")
    ref_cache = torch.zeros(max_len, dim, device=device)
    ref_other = torch.zeros(max_len, dim, device=device)
    ptr = buf.data_ptr()
    first_pos = None
    for step in range(4):
        x = torch.randn(1, dim, generator=gen).to(device)
        if step == 3:       # a row written before: a write replaces it
            pos = first_pos
        else:
            pos = torch.randint(0, max_len, (1,), generator=gen).to(device)
            first_pos = pos if first_pos is None else first_pos
        x0, pos0 = x.clone(), pos.clone()
        versions = (x._version, pos._version)
        prev = ref_cache.clone()
        got = call_learner(a, x, pos)
        for arg, arg0, v, label in ((x, x0, versions[0], "x"), (pos, pos0, versions[1], "pos")):
            if (arg._version != v or arg.shape != arg0.shape
                    or not torch.equal(arg, arg0)):
                return (f"forward wrote into its argument {label} (its version counter "
                        f"moved). An argument that is written is a mutated input: the very "
                        f"skip this exercise removes. Write only into the module's buffer")
        want = reference_step(x0, ref_cache, pos0)
        if got is None:
            return f"step {step + 1}: forward returned None; return the cache's column sums"
        _, now = _cache_buffer(a, max_len, dim)
        if now is None or now.data_ptr() != ptr:
            return (f"step {step + 1}: the cache buffer moved to a new address (it was "
                    f"replaced, e.g. self.{name} = ...index_copy(...) or torch.cat). A graph "
                    f"reads the buffer at the address it recorded: write in place "
                    f"(index_copy_, or self.{name}[pos] = x)")
        if not torch.allclose(now, ref_cache, atol=1e-6):
            return f"step {step + 1}: " + _wrong_rows(now, prev, x0, int(pos0), name)
        if not isinstance(got, torch.Tensor):
            return (f"step {step + 1}: forward returned {type(got).__name__}, expected a "
                    f"tensor: the broken step returns cache.sum(0), shape ({dim},)")
        if got.shape != want.shape:
            return (f"step {step + 1}: forward returned a tensor of shape {fmt_shape(got.shape)}, "
                    f"expected shape ({dim},): the broken step returns cache.sum(0), the sum "
                    f"over the positions (rows), one value per column")
        if got.dtype != want.dtype:
            return (f"step {step + 1}: forward returned {got.dtype}, expected {want.dtype} "
                    f"(the broken step's cache.sum(0))")
        if not torch.allclose(got, want, atol=1e-5):
            return (f"step {step + 1}: forward returned the right shape ({dim},) but wrong "
                    f"values: the broken step returns cache.sum(0) of the cache after this "
                    f"step's write")
        other = torch.randn(1, dim, generator=gen).to(device)
        call_learner(b, other, pos0.clone())
        reference_step(other, ref_other, pos0)
        _, a_now = _cache_buffer(a, max_len, dim)
        if not torch.allclose(a_now, ref_cache, atol=1e-6):
            return ("two Decoder instances share one cache (stepping the second changed the "
                    "first's): create the buffer in __init__, one per instance")
    return None


def _overlap(a, b) -> bool:
    """Whether tensors ``a`` and ``b`` share memory (the same storage, bytes in common)."""
    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False
    size = a.element_size()
    lo_a, lo_b = a.data_ptr(), b.data_ptr()
    return lo_a < lo_b + b.numel() * size and lo_b < lo_a + a.numel() * size


def _moved(cls, device):
    """Build a ``Decoder`` on the CPU, move it with ``.to(device)`` as the text says it may
    be, and step it once: the step must write the module's cache buffer, now on ``device``.

    .. warning::
        ``.to()`` replaces each buffer and parameter with a moved copy
        (``Module._apply``); a plain attribute that names the same tensor (``self.kv =
        self.cache``) keeps the old one, so a forward that writes through it fails after
        the move (or writes a tensor the module no longer holds) although every step on one
        device is right. Values are fixed, not drawn: the trials' generator stays as it was.
    """
    device = torch.device(device)
    if device.type == "cpu":
        return None                             # nothing to move to
    max_len, dim, row = 5, 3, 3
    mod = _build(cls, max_len, dim, "cpu")
    call_learner(mod.to, device)
    name, cache = _cache_buffer(mod, max_len, dim)
    if cache is None or cache.device.type != device.type:
        return None                             # the trials name a cache that is no state
    x = torch.arange(1.0, dim + 1.0).reshape(1, dim).to(device)
    pos = torch.tensor([row]).to(device)
    ref = torch.zeros(max_len, dim, device=device)
    want = reference_step(x.clone(), ref, pos.clone())
    # an error is an answer here: a tensor left behind on the CPU, met by x on device
    kind, got = outcome(call_learner, (mod, x, pos))
    raised, got = (got, None) if kind == "raised" else (None, got)
    _, now = _cache_buffer(mod, max_len, dim)
    if (raised is None and torch.allclose(now, ref) and isinstance(got, torch.Tensor)
            and got.shape == want.shape and got.device.type == device.type
            and torch.allclose(got, want.to(got.dtype))):
        return None
    left = [k for k, v in vars(mod).items()
            if isinstance(v, torch.Tensor) and v.device.type == "cpu"]
    did = (f"forward raised {describe_exception(raised).splitlines()[0]}" if raised else
           f"forward did not write row {row} of the moved cache self.{name} or return its "
           f"new sums")
    head = (f"a Decoder({max_len}, {dim}, 'cpu') moved with .to({device}) (the text: the cache "
            f"moves with the module), then stepped with x and pos on {device}: "
            f"{did.rstrip('.!')}. ")
    if left:
        return head + (f"self.{left[0]} is a plain tensor attribute that stayed on the CPU: "
                       f".to() replaces each registered buffer with a moved copy and leaves "
                       f"a second name for it on the old tensor. In forward, use the "
                       f"registered buffer itself (self.{name}), not another name for it")
    return head + (f"Something forward uses did not move with the module (a tensor or a "
                   f"device kept from __init__): in forward, use the registered buffer "
                   f"self.{name}, and take devices from x or the buffer")


_HOST_READ = ("forward reads a value back to the host ({what}): lesson 08 §6, under "
              "torch.compile that is a graph break (two graphs with eager Python between), "
              "and a CUDA graph capture refuses it (a GPU would wait for the value). Index "
              "with the tensor pos itself: self.{name}.index_copy_(0, pos, x) or "
              "self.{name}[pos] = x")


def _captured(cls, B, gen):
    """Capture one step of a fresh ``Decoder`` on ``B`` (warm-up 1) and replay it on new
    ``x`` and ``pos``: the cache and the output must follow. A host read in forward fails
    the capture on every backend (the emulator refuses it as a GPU does)."""
    max_len, dim = 6, 3
    mod = _build(cls, max_len, dim, B.device)
    name, cache = _cache_buffer(mod, max_len, dim)
    if cache is None:
        return None                         # the eager trials named it already
    x = torch.randn(1, dim, generator=gen).to(B.device)
    pos = torch.tensor([2]).to(B.device)
    ref = torch.zeros(max_len, dim, device=B.device)
    reference_step(x.clone(), ref, pos.clone())             # what the warm-up writes
    def failed(e: BaseException) -> str:
        text = short_description(e)
        host = any(w in text for w in ("capturing", "graph capture", "on the host",
                                        "host memory", "_local_scalar_dense"))
        return (f"a step of your Decoder, captured into a graph on {B.name}, failed: {text}"
                + ("\n   " + _HOST_READ.format(what="pos.item(), int(pos), pos.tolist(), an "
                                                   "`if` on a tensor", name=name)
                   if host else "\n   forward must run inside a capture as it is (§1: "
                                "torch.compile's graph trees capture it)"))

    g, out = attempt(capture, (mod, x, pos), {"B": B, "warmup": 1}, B=B,
                     time_limit=DEFAULT_TIME_LIMIT, not_done=False,
                     passthrough=(NotImplementedError,), kind="mismatch", reason=failed)
    for step, p in enumerate((4, 0, 2)):
        new_x = torch.randn(1, dim, generator=gen).to(B.device)
        x.copy_(new_x)
        pos.fill_(p)
        g.replay()
        B.synchronize()
        want = reference_step(new_x, ref, torch.tensor([p]).to(B.device))
        _, now = _cache_buffer(mod, max_len, dim)
        if not (torch.allclose(now, ref, atol=1e-6) and isinstance(out, torch.Tensor)
                and out.shape == want.shape and torch.allclose(out, want, atol=1e-5)):
            return (f"a step of your Decoder, captured into a graph on {B.name} and replayed "
                    f"with new x and pos={p} (replay {step + 1}), did not write row {p} or "
                    f"return the new sums, although the same steps run eagerly are right: "
                    f"the graph replays only the device work recorded while capturing, and "
                    f"a value forward worked out on the host then stays what it was. "
                    + _HOST_READ.format(what="the row number taken out of pos", name=name))
    return None


def _wrong_rows(now, prev, x, pos, name):
    """Say how the cache after a step differs from the broken step's (prev + x at row pos)."""
    row = x.reshape(-1)
    if torch.equal(now, prev):
        return (f"forward left the cache unchanged: write x into row pos of self.{name}, in "
                f"place (self.{name}.index_copy_(0, pos, x))")
    if torch.allclose(now[pos], prev[pos] + row, atol=1e-5) and not torch.allclose(
            now[pos], row, atol=1e-5):
        return (f"row {pos} holds its old values plus x: forward added x (index_add_, +=) "
                f"where the broken step writes it. Replace the row: index_copy_(0, pos, x) "
                f"or self.{name}[pos] = x")
    others = [r for r in range(now.shape[0]) if r != pos and not torch.equal(now[r], prev[r])]
    hits = [r for r in others if torch.allclose(now[r], row, atol=1e-5)]
    if hits and not torch.allclose(now[pos], row, atol=1e-5):
        return (f"x went to row {hits[0]}, but pos is {pos}: write x at row pos "
                f"(index_copy_(0, pos, x) or self.{name}[pos] = x)")
    if others:
        return (f"forward changed row(s) {others} besides row pos={pos} (the broken step "
                f"writes row pos only, and the other rows keep what earlier steps wrote)")
    return (f"row pos={pos} of the cache does not hold x after the step: write x at row pos "
            f"(index_copy_(0, pos, x) or self.{name}[pos] = x)")


def _compiled_on_gpu(cls, B):
    """Compile a Decoder with reduce-overhead; expect no skip and a replay by call 3."""
    from labkit import compiled as C

    torch._dynamo.reset()
    mod = cls(8, 4, B.device)
    step = torch.compile(mod, mode="reduce-overhead")
    kinds = []
    with C.watch_skips() as skips:
        for i in range(3):
            x = torch.randn(1, 4, device=B.device)
            pos = torch.tensor([i], device=B.device)
            kinds.append(C.call_kind(step, x, pos, B=B)[1])
    torch._dynamo.reset()
    if skips.count:
        first = skips.messages[0].splitlines()[0] if skips.messages else "(no message)"
        return f"compiled with reduce-overhead on this GPU, torch still skipped: {first}"
    if kinds[-1] != "replay":
        return (f"compiled with reduce-overhead on this GPU, the calls were {kinds}; the third "
                f"should replay a graph")
    return None
