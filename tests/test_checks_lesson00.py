"""Lesson 00's checker: the reference passes; each real mistake is rejected with a message
naming that mistake (not the full answer first)."""

from __future__ import annotations

import pytest
import torch

from labkit.checks.lesson00 import check_scale_and_shift


def _loop(x, a, b):
    return torch.stack([torch.stack([a * v + b for v in row]) for row in x])


def _index_loop(x, a, b):
    out = torch.empty_like(x)
    for i in range(x.shape[0]):
        for j in range(x.shape[1]):
            out[i, j] = a * x[i, j] + b
    return out


WRONG = [
    ("minus", lambda x, a, b: a * x - b, "b is subtracted: the task adds it"),
    ("swapped", lambda x, a, b: b * x + a, "a and b are swapped"),
    ("no shift", lambda x, a, b: a * x, "b is never added"),
    ("no scale", lambda x, a, b: x + b, "x is never multiplied by a"),
    ("a*(x+b)", lambda x, a, b: a * (x + b), "b is multiplied by a too"),
    ("x*a*b", lambda x, a, b: x * a * b, "b multiplies x instead of being added"),
    ("tolist", lambda x, a, b: torch.tensor((a * x + b).tolist()), "calls .tolist()"),
    ("for loop", _loop, "loops over x"),
    ("index loop", _index_loop, "indexes x element by element"),
    ("item", lambda x, a, b: a * x + b + 0 * x.sum().item(), "calls .item()"),
    ("no return", lambda x, a, b: None, "did you forget `return`?"),
    ("float32 always", lambda x, a, b: (a * x + b).float(), "dtype: expected torch.float64"),
    ("list", lambda x, a, b: (a * x + b).tolist(), "calls .tolist()"),
    ("other", lambda x, a, b: a * x + b + 0.5, "values differ: max abs diff 0.5"),
]


def test_reference_passes(capsys):
    assert check_scale_and_shift(lambda x, a, b: a * x + b, device="cpu")
    assert capsys.readouterr().out == "✅ scale_and_shift: passed 3 random trials\n"
    assert check_scale_and_shift(lambda x, a, b: x * a + b, device="cpu", trials=8)
    assert check_scale_and_shift(lambda x, a, b: torch.add(torch.mul(x, a), b), device="cpu")


@pytest.mark.parametrize("name, fn, words", WRONG, ids=[w[0] for w in WRONG])
def test_mistake_is_named(capsys, name, fn, words):
    result = check_scale_and_shift(fn, device="cpu", trials=8)
    out = capsys.readouterr().out
    assert not result and out.startswith("❌ scale_and_shift:")
    assert words in out, out
    assert "return a * x + b" not in out          # never the full answer first


def test_not_done_yet(capsys):
    def blank(x, a, b):
        raise NotImplementedError()

    assert not check_scale_and_shift(blank, device="cpu")
    assert "not done yet" in capsys.readouterr().out


def test_the_trials_vary_what_the_text_leaves_free():
    seen = []

    def spy(x, a, b):
        seen.append((tuple(x.shape), x.dtype, a, b))
        return a * x + b

    assert check_scale_and_shift(spy, device="cpu", trials=8, )
    assert len({s[0] for s in seen}) > 1 and {s[1] for s in seen} == {torch.float32,
                                                                       torch.float64}
    assert all(abs(a) >= 1.25 and abs(b) >= 1.25 and abs(a - b) >= 0.25 for *_, a, b in seen)
