"""Exercise 2 (diagnosis): a decode step that reduce-overhead skips, rewritten as a module.

The broken step writes its KV cache through an argument (``cache.index_copy_``), a mutated
input that is not static, so graph trees skip it. The fix the lesson teaches (§4) is
gpt-fast's: the cache is a registered buffer of a module, written in place. The checker
builds the learner's ``Decoder(max_len, dim, device)``, steps it against the reference,
and checks that no argument is written, that the cache is a buffer, written in place at a
fixed address, and one per instance. On a GPU it also compiles the module with
``mode="reduce-overhead"`` and checks that torch records and replays a graph, no skip.
"""

from __future__ import annotations

import torch

from labkit import backend
from labkit.checks import NOT_DONE, LearnerTimeout, call_learner, describe_exception, fail, passed

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
    gen = torch.Generator().manual_seed(seed)
    for trial in range(trials):
        max_len = int(torch.randint(4, 12, (), generator=gen))
        dim = int(torch.randint(2, 9, (), generator=gen))
        where = f"trial {trial + 1} (max_len={max_len}, dim={dim})"
        try:
            msg = _one_trial(cls, max_len, dim, B.device, gen)
        except NotImplementedError:
            return fail(NAME, NOT_DONE, kind="not_implemented")
        except LearnerTimeout as e:
            return fail(NAME, str(e), kind="timeout")
        except Exception as e:
            return fail(NAME, f"{where}: your code raised {describe_exception(e)}",
                        kind="exception", more_hints=HINTS)
        if msg:
            return fail(NAME, f"{where}: {msg}", more_hints=HINTS)
    extra = ""
    if B.name == "cuda" and compile_on_gpu:
        msg = _compiled_on_gpu(cls, B)
        if msg:
            return fail(NAME, msg, more_hints=HINTS)
        extra = "; compiled with reduce-overhead on this GPU: recorded and replayed, 0 skips"
    return passed(NAME, f"same values as the broken step in {trials} random trials, no "
                        f"argument written, the cache a buffer written in place{extra}")


def _cache_buffer(mod, max_len, dim):
    for name, buf in mod.named_buffers():
        if tuple(buf.shape) == (max_len, dim):
            return name, buf
    return None, None


def _one_trial(cls, max_len, dim, device, gen):
    a = call_learner(cls, max_len, dim, device)
    b = call_learner(cls, max_len, dim, device)           # a second instance, stepped between
    name, buf = _cache_buffer(a, max_len, dim)
    if buf is None:
        plain = [k for k, v in vars(a).items()
                 if isinstance(v, torch.Tensor) and tuple(v.shape) == (max_len, dim)]
        if plain:
            return (f"the cache self.{plain[0]} is a plain tensor attribute, not a registered "
                    f"buffer. Buffers (and parameters) are the inputs graph trees treat as "
                    f"static (§3): self.register_buffer({plain[0]!r}, ...)")
        return (f"no buffer of shape ({max_len}, {dim}) in named_buffers(): keep the cache "
                f"in the module, registered with self.register_buffer")
    ref_cache = torch.zeros(max_len, dim, device=device)
    ref_other = torch.zeros(max_len, dim, device=device)
    ptr = buf.data_ptr()
    for step in range(4):
        x = torch.randn(1, dim, generator=gen).to(device)
        pos = torch.randint(0, max_len, (1,), generator=gen).to(device)
        versions = (x._version, pos._version)
        got = call_learner(a, x, pos)
        want = reference_step(x.clone(), ref_cache, pos)
        if (x._version, pos._version) != versions:
            which = "x" if x._version != versions[0] else "pos"
            return (f"forward wrote into its argument {which} (its version counter moved). "
                    f"An argument that is written is a mutated input: the very skip this "
                    f"exercise removes. Write only into the module's buffer")
        if got is None:
            return f"step {step + 1}: forward returned None; return the cache's column sums"
        _, now = _cache_buffer(a, max_len, dim)
        if now is None or now.data_ptr() != ptr:
            return (f"step {step + 1}: the cache buffer moved to a new address (it was "
                    f"replaced, e.g. self.{name} = ...index_copy(...) or torch.cat). A graph "
                    f"reads the buffer at the address it recorded: write in place "
                    f"(index_copy_, or self.{name}[pos] = x)")
        if not torch.allclose(now, ref_cache, atol=1e-6):
            return (f"step {step + 1}: the cache holds the wrong rows: write x at row pos "
                    f"(and start from zeros)")
        if not (isinstance(got, torch.Tensor) and got.shape == want.shape
                and torch.allclose(got, want, atol=1e-5)):
            return (f"step {step + 1}: forward returned the wrong value: the broken step "
                    f"returns cache.sum(0), shape ({dim},)")
        other = torch.randn(1, dim, generator=gen).to(device)
        call_learner(b, other, pos)
        reference_step(other, ref_other, pos)
        _, a_now = _cache_buffer(a, max_len, dim)
        if not torch.allclose(a_now, ref_cache, atol=1e-6):
            return ("two Decoder instances share one cache (stepping the second changed the "
                    "first's): create the buffer in __init__, one per instance")
    return None


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
