"""The rules of capture: what a CUDA graph capture refuses, in one table.

The emulator's recorder (:mod:`labkit.emulator.recorder`) refuses these during capture and
the linter (:func:`labkit.guards.lint_capture`) reports them before one, both reading this
module, so the two cannot disagree.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = ["Rule", "HAZARDS", "SEVERITIES", "FUNCTION_RULES", "ATEN_RULES", "MASK_INDEX_OPS",
           "REFUSE", "HOST_COPY", "AT_ATEN", "function_rule", "aten_rule", "HOST_COPY_MESSAGE",
           "RNG_MESSAGE", "GENERATOR_RULE", "unregistered_generators", "sets_from_host_number",
           "masked_fill_fast_path", "host_copy_rule"]

#: kind -> (title, severity, default fix). Severities: "fails capture" (capture raises on
#: a GPU), "silently wrong" (capture works, replays compute something else), "check".
HAZARDS: dict[str, tuple[str, str, str]] = {
    "cpu_sync": (
        "CPU sync", "fails capture",
        "keep the value on the device (tensor ops, torch.where, clamp) or read it from the "
        "static output after replay(); nothing inside a graph may wait for the GPU"),
    "tensor_branch": (
        "Python branch on a tensor value", "fails capture",
        "compute both sides and select with torch.where(cond, a, b), or decide outside the "
        "graph and capture one graph per branch"),
    "dynamic_shape": (
        "data-dependent shape", "fails capture",
        "use a fixed-size form: torch.where(mask, x, 0) instead of x[mask], "
        "torch.nonzero_static(x, size=n), or pad to a maximum size"),
    "host_tensor": (
        "host tensor", "fails capture",
        "keep tensors on the device inside the graph; build constants once, outside, on "
        "B.device and pass them in; read results from the static output after replay()"),
    "unregistered_generator": (
        "unregistered generator", "fails capture",
        "call g.register_generator_state(gen) before capture, or use the default generator"),
    "changed_address": (
        "address changes between calls", "silently wrong",
        "allocate the tensor once (a static buffer) and update it in place (copy_, "
        "add_, ...): replay reads the address captured, not the Python name"),
    "changed_value": (
        "Python value changes between calls", "silently wrong",
        "capture bakes the value in: keep it in a device tensor you fill before replay "
        "(t.fill_(v) or copy_), or capture one graph per value"),
    "changed_ops": (
        "different ops on the next call", "check",
        "replay repeats the path taken at capture. If the first call only initialised "
        "things (lazy init), warming up before capture is enough; if the path depends on "
        "Python state, move that state into tensors or capture one graph per path"),
    "baked_argument": (
        "Python value baked in", "check",
        "every replay uses the value passed at capture; pass a tensor instead if it "
        "changes (GuardedGraph refuses a different value)"),
    "raised": (
        "the function raised", "fails capture",
        "fix the error first: the function must run eagerly before it can be captured"),
}

SEVERITIES = ("fails capture", "silently wrong", "check")

#: What the emulator does when a rule's trigger runs during capture.
REFUSE = "refuse"          # CUDA's "operation not permitted when stream is capturing"
HOST_COPY = "host_copy"    # torch's "Cannot copy between CPU and CUDA tensors ..." error
AT_ATEN = "at_aten"        # refused at the ATen op the call reaches (.item(): _local_scalar_dense)

HOST_COPY_MESSAGE = (
    "Cannot copy between CPU and CUDA tensors during CUDA graph capture unless the CPU "
    "tensor is pinned. Please use tensor.pin_memory() or allocate the tensor with "
    "pin_memory=True."
)

RNG_MESSAGE = "Attempt to increase offset for a CUDA generator not in capture mode."


class Rule(NamedTuple):
    """One thing capture refuses.

    Args:
        kind: its :data:`HAZARDS` key (``"cpu_sync"``, ``"dynamic_shape"``, ...).
        shown: how the linter names the trigger (``".item()"``, ``"aten.nonzero"``).
        why: why capture refuses it, one clause.
        emulator: what the emulator does during capture: :data:`REFUSE`,
            :data:`HOST_COPY`, :data:`AT_ATEN` (an ATen rule refuses the op the call
            reaches: ``.item()`` reaches ``aten._local_scalar_dense``), or ``None`` where
            the emulator cannot show it.
    """

    kind: str
    shown: str
    why: str
    emulator: str | None = REFUSE


_HOST_READ = "reads a tensor's value on the host"
_DATA_SHAPE = "its output shape depends on the data"

#: Python-level calls (seen by a ``TorchFunctionMode``), by ``func.__name__``.
FUNCTION_RULES: dict[str, Rule] = {
    "item": Rule("cpu_sync", ".item()", f"{_HOST_READ}, so the CPU waits for the GPU; "
                 "capture refuses it", AT_ATEN),
    "__float__": Rule("cpu_sync", "float(tensor)", _HOST_READ, AT_ATEN),
    "__int__": Rule("cpu_sync", "int(tensor)", _HOST_READ, AT_ATEN),
    "__index__": Rule("cpu_sync", "tensor used as a Python int", "a slice bound, range() or "
                      "size taken from a tensor reads its value on the host", AT_ATEN),
    "__bool__": Rule("tensor_branch", "if tensor / bool(tensor)", "a Python `if`/`while`/"
                     "`and` on a tensor reads its value on the host to choose a branch; a "
                     "graph records one branch only", AT_ATEN),
    "__repr__": Rule("cpu_sync", "printing a tensor", "formatting reads the values on the host"),
    "__str__": Rule("cpu_sync", "printing a tensor", "formatting reads the values on the host"),
    "__format__": Rule("cpu_sync", "formatting a tensor",
                       "formatting reads the values on the host"),
    "tolist": Rule("host_tensor", ".tolist()", "copies a tensor to host memory (and waits "
                   "for it)", HOST_COPY),
    "numpy": Rule("host_tensor", ".numpy()", "needs the tensor in host memory (for a device "
                  "tensor a TypeError, in or out of capture)", HOST_COPY),
    "__array__": Rule("host_tensor", "np.asarray(tensor)", "needs the tensor in host memory "
                      "(for a device tensor a TypeError, in or out of capture)", HOST_COPY),
    "cpu": Rule("host_tensor", ".cpu()", "copies a tensor to host memory: on a GPU, a "
                "device-to-host copy during capture is refused", HOST_COPY),
    "tensor": Rule("host_tensor", "torch.tensor(...)", "builds a tensor from host data "
                   "through a temporary pageable buffer: on a GPU that host-to-device copy "
                   "is refused during capture (a copy from pinned memory can be captured, "
                   "and then every replay reads the host buffer again)", HOST_COPY),
    "as_tensor": Rule("host_tensor", "torch.as_tensor(...)", "builds a tensor from host data "
                      "(on a GPU a host-to-device copy, refused from pageable memory during "
                      "capture)", HOST_COPY),
}

#: ATen ops (seen by a ``TorchDispatchMode``), by overload packet name.
ATEN_RULES: dict[str, Rule] = {
    "_local_scalar_dense": Rule("cpu_sync", "aten._local_scalar_dense",
                                "reads a tensor's value on the host (the op behind .item(), "
                                "float(t) and int(t))"),
    "is_nonzero": Rule("cpu_sync", "aten.is_nonzero",
                       "reads a tensor's value on the host to test it"),
    "equal": Rule("cpu_sync", "aten.equal", "torch.equal compares on the host"),
    "histogram": Rule("cpu_sync", "aten.histogram", "reads the data range on the host"),
    "nonzero": Rule("dynamic_shape", "aten.nonzero", "returns as many rows as there are "
                    "non-zeros: the output shape depends on the data"),
    "nonzero_numpy": Rule("dynamic_shape", "aten.nonzero_numpy", _DATA_SHAPE),
    "argwhere": Rule("dynamic_shape", "aten.argwhere", _DATA_SHAPE),
    "masked_select": Rule("dynamic_shape", "aten.masked_select",
                          "x[mask] / masked_select: the output shape depends on the data"),
    "unique": Rule("dynamic_shape", "aten.unique", _DATA_SHAPE),
    "_unique": Rule("dynamic_shape", "aten._unique", _DATA_SHAPE),
    "_unique2": Rule("dynamic_shape", "aten._unique2", _DATA_SHAPE),
    "unique_dim": Rule("dynamic_shape", "aten.unique_dim", _DATA_SHAPE),
    "unique_consecutive": Rule("dynamic_shape", "aten.unique_consecutive", _DATA_SHAPE),
    "unique_dim_consecutive": Rule("dynamic_shape", "aten.unique_dim_consecutive", _DATA_SHAPE),
    # on a GPU the refusal is torch's host-copy check, not CUDA's: _bincount_cuda_template
    # copies the smallest value to the host (.cpu()) before it reads the largest
    "bincount": Rule("dynamic_shape", "aten.bincount", "its output length depends on the "
                     "largest value, so it copies values to the host", HOST_COPY),
}

#: Indexing ops that refuse a boolean (or uint8) mask among their indices.
MASK_INDEX_OPS = frozenset({"index", "index_put", "index_put_", "_index_put_impl_"})

_MASK_RULE = Rule("dynamic_shape", "with a boolean mask", "indexing with a boolean mask "
                  "selects as many elements as are True: the shape depends on the data")
_MASK_ASSIGN_RULE = Rule("dynamic_shape", "with a boolean mask", "assigning through a boolean "
                         "mask turns it into indices with nonzero, whose count depends on the "
                         "data (t[mask] = a Python number takes masked_fill_ instead)")
_REPEAT_RULE = Rule("dynamic_shape", "aten.repeat_interleave", "with tensor repeats the output "
                    "length depends on the data (pass output_size=...)")
_HISTC_RULE = Rule("cpu_sync", "aten.histc without min/max", "with min == max (the default) "
                   "it copies the data's smallest and largest values to the host to choose "
                   "the bins; pass min= and max=", HOST_COPY)
_MASKED_FILL_RULE = Rule("cpu_sync", "masked_fill with a tensor value", "a 0-dim value tensor "
                         "on the device is read on the host with .item() (masked_fill__cuda); "
                         "pass a Python number, or use torch.where(mask, value, x)")


def host_copy_rule(way: str, pinned: bool, non_blocking: bool,
                   staged: bool = False) -> Rule | None:
    """What capture does with a copy between host and device memory (H200, torch 2.11).

    Args:
        way: ``"host-to-device"`` or ``"device-to-host"``.
        pinned: the host side is page-locked memory (``pin_memory()``).
        non_blocking: the copy was asked for with ``non_blocking=True``.
        staged: the copy cannot be one ``cudaMemcpy`` and goes through a pageable host
            temporary on a GPU (:func:`labkit.core.staging.host_side_is_staged`), which
            makes pinned memory count as pageable.

    Returns:
        The rule it breaks: pageable memory is refused by torch's own check (``HOST_COPY``);
        a blocking copy with pinned memory waits for the GPU, which fails the capture
        (``REFUSE``). None for a pinned ``non_blocking`` copy: it is captured, and every
        replay copies that host buffer again.
    """
    if pinned and staged:
        return Rule("host_tensor", f"a {way} copy", f"this {way} copy cannot be one "
                    f"cudaMemcpy (a non-contiguous view, a broadcast or, for a blocking copy, "
                    f"a dtype conversion), so on a GPU it goes through a contiguous temporary "
                    f"in pageable host memory, and a copy of pageable memory is refused "
                    f"during capture: copy whole contiguous pinned buffers and slice on the "
                    f"device, and convert dtypes on the device (non_blocking=True)", HOST_COPY)
    if not pinned:
        fix = ("read results after replay() instead" if way == "device-to-host" else
               "make device tensors before capture")
        return Rule("host_tensor", f"a {way} copy", f"a {way} copy of pageable memory is "
                    f"refused during capture: {fix}, or copy with pin_memory() memory and "
                    f"non_blocking=True", HOST_COPY)
    if not non_blocking:
        return Rule("cpu_sync", f"a blocking {way} copy", f"a blocking {way} copy waits for "
                    "it to finish, which fails the capture; from pinned memory write "
                    "non_blocking=True")
    return None


GENERATOR_RULE = Rule("unregistered_generator", "generator=...", "draws from a custom "
                      "torch.Generator that is not registered with the graph; capture raises "
                      f"'{RNG_MESSAGE}'")


def unregistered_generators(args: tuple, kwargs: dict, known) -> list[torch.Generator]:
    """The generators a call draws from (``generator=`` or positional) that are not in ``known``.

    Args:
        args, kwargs: a Python-level call's arguments.
        known: the default generators and those registered with the graph
            (``g.register_generator_state(gen)``); compared by identity.
    """
    found = []
    for gen in [(kwargs or {}).get("generator"), *args]:
        if isinstance(gen, torch.Generator) and not any(gen is k for k in known) \
                and not any(gen is f for f in found):
            found.append(gen)
    return found


def function_rule(name: str, args: tuple = (), kwargs: dict | None = None) -> Rule | None:
    """The rule a Python-level tensor call breaks, or None.

    Args:
        name: ``func.__name__`` as a ``TorchFunctionMode`` sees it.
        args, kwargs: the call's arguments (``torch.tensor(t)`` of a tensor is a copy on
            the device, not host data).
    """
    rule = FUNCTION_RULES.get(name)
    if rule is not None and name in ("tensor", "as_tensor"):
        data = args[0] if args else (kwargs or {}).get("data")
        if isinstance(data, torch.Tensor):
            return None
    return rule


def sets_from_host_number(name: str, args: tuple) -> bool:
    """True for ``t[index] = number`` (``Tensor.__setitem__`` with a Python number).

    For a CUDA tensor, ``THPVariable_setitem`` turns the number into a CPU tensor, which
    lets ATen's ``_index_put_impl_`` take its ``masked_fill_`` path for a boolean mask
    (see :func:`masked_fill_fast_path`). Both the emulator and the linter watch Python
    calls for it, because below the dispatcher the number is just a 0-dim tensor.
    """
    return (name == "__setitem__" and len(args) >= 3
            and isinstance(args[2], (bool, int, float, complex)))


def masked_fill_fast_path(args: tuple, kwargs: dict | None = None,
                          host_value: bool = False) -> bool:
    """Whether ``index_put_(self, indices, values, accumulate)`` becomes ``masked_fill_``.

    Mirrors ``canDispatchToMaskedFill`` in ATen's ``_index_put_impl_``: no accumulation,
    one value on the host (a CPU tensor with one element next to a device tensor, or
    ``host_value``: the value was a Python number), and exactly one index, a boolean (or
    uint8) mask on ``self``'s device. That path needs no ``nonzero``, so it does not sync.
    """
    kwargs = kwargs or {}
    self = args[0] if args else kwargs.get("self")
    indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
    values = args[2] if len(args) > 2 else kwargs.get("values")
    accumulate = args[3] if len(args) > 3 else kwargs.get("accumulate", False)
    if accumulate or not isinstance(self, torch.Tensor) or not isinstance(values, torch.Tensor) \
            or values.numel() != 1:
        return False
    if not (host_value or (values.device.type == "cpu" and self.device.type != "cpu")):
        return False
    defined = [i for i in (indices or ()) if i is not None]
    return (len(defined) == 1 and isinstance(defined[0], torch.Tensor)
            and defined[0].dtype in (torch.bool, torch.uint8)
            and defined[0].device == self.device)


def aten_rule(name: str, args: tuple = (), kwargs: dict | None = None,
              host_value: bool = False) -> Rule | None:
    """The rule an ATen op breaks, or None.

    Args:
        name: the op's overload packet name (``func.overloadpacket.__name__``).
        args, kwargs: its arguments: a boolean mask index, ``repeat_interleave`` without
            ``output_size`` and ``masked_fill`` with a tensor value are refused by what they
            are given, not by name alone.
        host_value: the op runs inside ``t[mask] = number``
            (:func:`sets_from_host_number`), whose value stays on the host on a GPU.
    """
    kwargs = kwargs or {}
    rule = ATEN_RULES.get(name)
    if rule is not None:
        return rule
    if name in MASK_INDEX_OPS:
        idx = args[1] if len(args) > 1 else kwargs.get("indices", ())
        if any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)
               for i in (idx or ())):
            if name != "index" and masked_fill_fast_path(args, kwargs, host_value):
                return None
            if name == "index":
                return _MASK_RULE._replace(shown=f"aten.{name} with a boolean mask")
            return _MASK_ASSIGN_RULE._replace(shown=f"aten.{name} with a boolean mask")
        return None
    if name == "repeat_interleave" and kwargs.get("output_size") is None and any(
            isinstance(a, torch.Tensor) for a in args):
        return _REPEAT_RULE
    if name == "histc":
        lo = args[2] if len(args) > 2 else kwargs.get("min", 0)
        hi = args[3] if len(args) > 3 else kwargs.get("max", 0)
        if lo == hi:
            return _HISTC_RULE
        return None
    if name in ("masked_fill", "masked_fill_"):
        self = args[0] if args else kwargs.get("self")
        value = args[2] if len(args) > 2 else kwargs.get("value")
        if isinstance(value, torch.Tensor) and isinstance(self, torch.Tensor) and not (
                value.device.type == "cpu" and self.device.type != "cpu"):
            return _MASKED_FILL_RULE
    return None
