"""Assertions several test modules share (importable: pytest puts tests/ on sys.path)."""

import torch

from labkit.capture import capture


def assert_usable(B, stream_before=None):
    """After a failed capture the process is usable: the stream that was current
    (``stream_before``; default: the default stream) is current again, nothing is capturing,
    and a new capture, its replay and a random op outside any capture all work."""
    assert B.current_stream() == (stream_before if stream_before is not None
                                  else B.default_stream())
    assert not B.is_current_stream_capturing()
    x = torch.ones(4, device=B.device)
    g, y = capture(lambda t: t * 3, x, B=B, warmup=1)
    x.fill_(2.0)
    g.replay()
    B.synchronize()
    assert y.tolist() == [6.0] * 4
    torch.rand(2, device=B.device)           # raises if the generator is left in capture mode


def prefill_slots(model, num_slots, seed=0, prompt_lens=(2, 20)):
    """Prefill slots ``1..num_slots`` of a ``labkit.decode`` model with seeded random prompts
    (lengths drawn from ``prompt_lens``, high end exclusive); return each slot's next
    (token, position)."""
    from labkit.decode import EagerRunner, make_extend_batch

    g = torch.Generator().manual_seed(seed)
    slots = list(range(1, num_slots + 1))
    lens = torch.randint(*prompt_lens, (num_slots,), generator=g).tolist()
    prompts = [torch.randint(0, model.args.vocab_size, (n,), generator=g).tolist() for n in lens]
    logits = EagerRunner(model).forward(make_extend_batch(model, slots, prompts))
    last = torch.tensor(lens).cumsum(0) - 1
    toks = logits[last.to(logits.device)].argmax(-1).tolist()
    return {s: (t, n) for s, t, n in zip(slots, toks, lens)}


class DecodeModels:
    """A tiny ``labkit.decode`` model per backend with every slot prefilled, and captured
    runners over it, each built once per test module (captures are the slow part)."""

    def __init__(self, max_bs, seed=0, prompt_lens=(2, 20)):
        self.max_bs, self.seed, self.prompt_lens = max_bs, seed, prompt_lens
        self._cache = {}

    def model(self, B):
        """``(model, {slot: (token, position)})`` for backend ``B``."""
        from labkit.decode import build_model

        key = ("model", B.name)
        if key not in self._cache:
            m = build_model("tiny", max_requests=self.max_bs, device=B.device,
                            dtype=torch.float32)
            self._cache[key] = (m, prefill_slots(m, self.max_bs, self.seed, self.prompt_lens))
        return self._cache[key]

    def runner(self, B, **kw):
        """A captured ``DecodeGraphRunner`` over :meth:`model` (``max_bs`` unless given)."""
        from labkit.decode import DecodeGraphRunner

        key = ("runner", B.name, tuple(sorted(kw.items(), key=str)))
        if key not in self._cache:
            m, _ = self.model(B)
            r = DecodeGraphRunner(m, B, progress=False, **{"max_bs": self.max_bs, **kw})
            r.capture()
            self._cache[key] = r
        return self._cache[key]
