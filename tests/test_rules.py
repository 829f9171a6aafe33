"""labkit.core.rules: the emulator refuses exactly what the linter flags, rule by rule."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from labkit import backend
from labkit.core import rules
from labkit.guards import expect_error, lint_capture

B = backend.get("emulated")
REPEATS = torch.tensor([1, 2, 1, 1], device=B.device)
GEN = B.Generator()
PINNED = torch.linspace(-1, 2, 4).pin_memory()     # page-locked host memory


def _clone_set(x):
    y = x.clone()
    y[x > 0] = torch.zeros((), device=x.device)   # a device tensor value: nonzero on a GPU
    return y


def _clone_set_number(x):
    y = x.clone()
    y[x > 0] = 0                      # a Python number: masked_fill_ on a GPU, no sync
    return y


def _index(x):
    return x[: (x > 0).long().sum()]


def _branch(x):
    if x.sum() > 0:
        return x * 2
    return x


# One trigger per rule: the rule's table key -> a function of a (4,) float tensor.
TRIGGERS = {
    "item": lambda x: x * x.sum().item(),
    "__float__": lambda x: x * float(x.sum()),
    "__int__": lambda x: x * int(x.sum()),
    "__index__": _index,
    "__bool__": _branch,
    "__repr__": lambda x: (repr(x), x)[1],
    "__str__": lambda x: (str(x), x)[1],
    "__format__": lambda x: (f"{x.sum():.2f}", x)[1],
    "tolist": lambda x: (x.tolist(), x)[1],
    "numpy": lambda x: (x.numpy(), x)[1],
    "__array__": lambda x: (np.asarray(x), x)[1],
    "cpu": lambda x: x.cpu() * 2,
    "tensor": lambda x: x * torch.tensor([2.0], device=x.device),
    "as_tensor": lambda x: x * torch.as_tensor([2.0], device=x.device),
    "_local_scalar_dense": lambda x: x * x.sum().item(),
    "is_nonzero": lambda x: (torch.is_nonzero(x.sum()), x)[1],
    "equal": lambda x: (torch.equal(x, x * 1), x)[1],
    "histogram": lambda x: torch.histogram(x, bins=4)[0],
    "nonzero": lambda x: x.nonzero(),
    "argwhere": lambda x: torch.argwhere(x),
    "masked_select": lambda x: x.masked_select(x > 0),
    "_unique2": lambda x: torch.unique(x),
    "unique_dim": lambda x: torch.unique(x.view(2, 2), dim=0),
    "unique_consecutive": lambda x: torch.unique_consecutive(x),
    "bincount": lambda x: torch.bincount(x.long().abs()),
    "index (boolean mask)": lambda x: x[x > 0],
    "index_put_ (boolean mask)": _clone_set,
    "repeat_interleave (tensor repeats)": lambda x: x.repeat_interleave(REPEATS),
    "unregistered generator": lambda x: x + torch.rand(4, device=x.device, generator=GEN),
    "synchronize": lambda x: (B.synchronize(), x * 2)[1],
    "histc (no range)": lambda x: torch.histc(x),
    "blocking copy from pinned memory": lambda x: x.clone().copy_(PINNED),
    # a strided view of pinned memory is no one cudaMemcpy: staged through pageable memory
    "an async copy from a strided pinned view": lambda x: x.clone()[:2].copy_(
        PINNED[::2], non_blocking=True),
    "masked_fill (tensor value)": lambda x: x.masked_fill(x > 0,
                                                          torch.zeros((), device=x.device)),
}

# What the linter does not flag, the emulator does not refuse.
CLEAN = {
    "index with integer indices": lambda x: x[torch.arange(2, device=x.device)],
    "repeat_interleave with output_size": lambda x: x.repeat_interleave(REPEATS, output_size=5),
    "repeat_interleave with an int": lambda x: x.repeat_interleave(2),
    "torch.where instead of a mask": lambda x: torch.where(x > 0, x, 0),
    "torch.as_tensor of a tensor": lambda x: torch.as_tensor(x) * 2,
    "the default generator": lambda x: x + torch.rand(4, device=x.device),
    "a boolean mask assigned a Python number": _clone_set_number,
    "masked_fill with a number": lambda x: x.masked_fill(x > 0, 0.0),
    "histc with a range": lambda x: torch.histc(x, bins=4, min=-1, max=2),
    "an async copy from pinned memory": lambda x: x.clone().copy_(PINNED, non_blocking=True),
    "an async copy from a contiguous pinned slice": lambda x: x.clone()[:2].copy_(
        PINNED[:2], non_blocking=True),
}

# ATen table entries no trigger reaches on torch 2.13 (decompositions and aliases of others:
# argwhere runs nonzero, is_nonzero runs _local_scalar_dense, unique runs _unique2).
UNREACHED = {"nonzero_numpy", "_unique", "unique", "unique_dim_consecutive", "argwhere",
             "is_nonzero"}


def _emulator_refuses(fn) -> bool:
    x = torch.linspace(-1, 2, 4, device=B.device)
    try:
        fn(x)                                  # eager first, as a warm-up would
    except TypeError:                          # .numpy() of a device tensor: never allowed
        return True
    s = B.Stream()
    with expect_error(B) as caught, B.stream(s):
        g = B.CUDAGraph()
        with B.graph(g, stream=s):
            fn(x)
    return caught.raised


def test_every_rule_has_a_trigger():
    keys = set(rules.FUNCTION_RULES) | set(rules.ATEN_RULES)
    missing = keys - set(TRIGGERS) - UNREACHED
    assert not missing, f"add a trigger for {sorted(missing)}"
    flagged = {f.op for fn in TRIGGERS.values()
               for f in lint_capture(fn, torch.linspace(-1, 2, 4, device=B.device), B=B)}
    unseen = {r.shown for k, r in rules.ATEN_RULES.items() if k not in UNREACHED} - flagged
    assert not unseen, f"no trigger reaches {sorted(unseen)}"


@pytest.mark.parametrize("name", sorted(TRIGGERS))
def test_emulator_refuses_what_the_linter_flags(name, capsys):
    fn = TRIGGERS[name]
    report = lint_capture(fn, torch.linspace(-1, 2, 4, device=B.device), B=B)
    flagged = [f for f in report if f.severity == "fails capture"]
    assert flagged, f"the linter flags nothing for {name}"
    base = name.split(" ")[0]
    rule = rules.FUNCTION_RULES.get(base) or rules.ATEN_RULES.get(base)
    if rule is not None:
        assert rule.kind in {f.kind for f in flagged}, (name, [f.op for f in flagged])
    # every ATen rule is enforced by the emulator; a Python-level one says how in its table
    python_level = {r.shown: r for r in rules.FUNCTION_RULES.values()}
    enforced = [f for f in flagged if f.op not in python_level or python_level[f.op].emulator]
    assert _emulator_refuses(fn) == bool(enforced), (name, [f.op for f in flagged])


@pytest.mark.parametrize("name", sorted(CLEAN))
def test_what_the_linter_passes_the_emulator_captures(name, capsys):
    fn = CLEAN[name]
    report = lint_capture(fn, torch.linspace(-1, 2, 4, device=B.device), B=B)
    assert not [f for f in report if f.severity == "fails capture"], str(report)
    assert not _emulator_refuses(fn)
