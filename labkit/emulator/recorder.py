"""Capture on the emulator: a ``TorchDispatchMode`` that records each ATen op, not runs it.

It sees the ops after autograd and autocast, the same stream of kernels a GPU would
record. Only the device's ops are recorded, and only on streams that are part of the
capture: host work, and work on other streams, runs at once, as on a GPU. Each op's
outputs come from the graph's pool, shaped by running the op on ``meta`` tensors, and
hold poison (NaN, or the dtype's maximum) until the first replay; each
recorded step holds aliases of the memory its arguments live in, so replay reads and
writes by address. What capture refuses is :mod:`labkit.core.rules`' table.

.. warning::
    In-place updates made during capture are not applied until replay, as on a GPU; view
    ops run for real (they only change metadata) and are not recorded.
"""

from __future__ import annotations

import warnings
from typing import Callable

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

import labkit.core.staging as staging
import labkit.emulator.collectives as _collectives
import labkit.emulator.device as _dev
import labkit.emulator.pool as _pool
from labkit.core import rules
from labkit.core.rules import HOST_COPY_MESSAGE, RNG_MESSAGE
from labkit.emulator.state import (
    CAPTURE_UNSUPPORTED,
    active_capture,
    capture_error,
    set_active_capture,
)
from labkit.emulator.streams import current_stream

aten = torch.ops.aten



# ---- classification of ops -------------------------------------------------------------

#: In-place ops that change a tensor's metadata, not its data: run them now, never replay.
METADATA_INPLACE = {"t_", "transpose_", "squeeze_", "unsqueeze_", "as_strided_", "detach_",
                    "swapaxes_", "swapdims_", "set_", "resize_", "resize_as_",
                    "_unsafe_view"}

#: Factories whose memory is uninitialised: allocate from the pool, record nothing.
EMPTY_FACTORIES = {"empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided",
                   "empty_permuted"}

def _kind(func) -> str:
    """'view', 'meta_inplace', 'empty' or 'compute' for an OpOverload (cached)."""
    k = _KIND_CACHE.get(func)
    if k is None:
        name = func.overloadpacket.__name__
        schema = func._schema
        writes = any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)
        aliased_ret = any(r.alias_info is not None for r in schema.returns)
        if name in METADATA_INPLACE:
            k = "meta_inplace"
        elif aliased_ret and not writes:
            k = "view"
        elif name in EMPTY_FACTORIES:
            k = "empty"
        else:
            k = "compute"
        _KIND_CACHE[func] = k
    return k


_KIND_CACHE: dict = {}
_OUT_CACHE: dict = {}


def _out_variant(func):
    """The ``.out`` overload of a functional op with exactly the same inputs, if any."""
    if func in _OUT_CACHE:
        return _OUT_CACHE[func]
    found = None
    ins = [(a.name, str(a.type)) for a in func._schema.arguments]
    nret = len(func._schema.returns)
    packet = func.overloadpacket
    for name in packet.overloads():
        op = getattr(packet, name)
        args = op._schema.arguments
        outs = [a.name for a in args if a.is_out]
        if len(outs) != nret or not outs:
            continue
        if [(a.name, str(a.type)) for a in args if not a.is_out] == ins:
            found = (op, outs)
            break
    _OUT_CACHE[func] = found
    return found


def _poison(t: torch.Tensor) -> None:
    if t.numel() == 0:
        return
    if t.dtype.is_floating_point or t.dtype.is_complex:
        t.fill_(float("nan"))
    elif t.dtype == torch.bool:
        t.fill_(True)
    else:
        t.fill_(torch.iinfo(t.dtype).max)


def _extent_bytes(size, stride, itemsize) -> int:
    if any(s == 0 for s in size):
        return 0
    return (1 + sum((s - 1) * st for s, st in zip(size, stride))) * itemsize


def _operands(args, kwargs) -> tuple[bool, list]:
    """Does an op touch the emulated device (a device tensor, or ``device=B.device``), and
    which host tensors does it take?"""
    on_device, hosts = False, []
    for x in tree_flatten((args, kwargs))[0]:
        if type(x) is _dev.DeviceTensor:
            on_device = True
        elif isinstance(x, torch.Tensor):
            hosts.append(x)
        elif type(x) is torch.device and x.type == _dev.DEVICE_TYPE:
            on_device = True
    return on_device, hosts


def _host_copy(func, args, kwargs) -> rules.Rule | None | bool:
    """For ``copy_`` / ``_to_copy`` between host and device: the rule it breaks during
    capture (:func:`labkit.core.rules.host_copy_rule`), or None if it is captured. False
    for any other op. Pinned memory that the copy would stage through a pageable
    temporary on a GPU counts as pageable (:mod:`~labkit.core.staging`)."""
    name = func.overloadpacket.__name__
    non_blocking = args[2] if name == "copy_" and len(args) > 2 else \
        kwargs.get("non_blocking", False)
    if name == "copy_" and len(args) >= 2 and _dev.is_device(args[0]) != _dev.is_device(args[1]):
        dst, src = args[0], args[1]
        to_host = _dev.is_device(src)
        host = dst if to_host else src
        layout = (dst.shape, dst.stride(), dst.dtype)
    elif name == "_to_copy" and args and kwargs.get("device") is not None and \
            _dev.is_device(args[0]) != (torch.device(kwargs["device"]).type == _dev.DEVICE_TYPE):
        src = host = args[0]
        to_host = _dev.is_device(src)
        if to_host:                         # .cpu(): a new pageable tensor
            return rules.host_copy_rule("device-to-host", False, non_blocking)
        layout = (src.shape, staging.to_copy_strides(src, kwargs.get("memory_format")),
                  kwargs.get("dtype") or src.dtype)
    else:
        return False
    way = "device-to-host" if to_host else "host-to-device"
    pinned = _dev.is_pinned(host)
    staged = pinned and staging.host_side_is_staged(way, *layout, src, non_blocking, host)
    return rules.host_copy_rule(way, pinned, non_blocking, staged)


def _to_meta(x):
    if isinstance(x, torch.Tensor):
        return torch.empty_strided(x.size(), x.stride(), dtype=x.dtype, device="meta")
    if isinstance(x, torch.device):
        return torch.device("meta")
    if isinstance(x, torch.Generator):
        return None
    return x


# ---- one capture ----------------------------------------------------------------------

class Capture:
    """The state of one capture in progress: the pool, the recorded steps, the modes."""

    def __init__(self, graph, mempool: _pool.MemPool, stream, mode: str = "global"):
        self.graph = graph
        self.mode = mode
        self.pool = mempool
        self.stream = stream
        self.steps: list[Callable[[], None]] = []
        self.ops: list[str] = []
        self.invalid: str | None = None
        self.host_value = False      # inside `t[mask] = number` (rules.sets_from_host_number)
        # streams in this capture -> the recorded nodes their next op depends on
        self.members: dict = {stream: ()}
        self.parents: list[tuple] = []       # node -> the nodes it depends on
        self._aliases: dict[tuple, torch.Tensor] = {}
        self._modes = (_CaptureFunctionMode(self), _CaptureDispatchMode(self))

    # lifecycle
    def start(self) -> None:
        if active_capture() is not None:
            raise RuntimeError("Another capture is already underway on this thread: "
                               "finish it (capture_end) before starting a new one.")
        set_active_capture(self)
        # autograd runs a device's backward on a worker thread of its own; a capture
        # watches this thread, so backward must run here (CPU tensors' backward does)
        self._autograd_threads = torch._C._is_multithreading_enabled()
        torch._C._set_multithreading_enabled(False)
        for m in self._modes:
            m.__enter__()

    def stop(self) -> None:
        for m in reversed(self._modes):
            m.__exit__(None, None, None)
        torch._C._set_multithreading_enabled(self._autograd_threads)
        set_active_capture(None)

    def invalidate(self, why: str = "error") -> None:
        if self.invalid is None:
            self.invalid = why

    # streams: which are in this capture, and is every fork joined back
    def records_now(self) -> bool:
        """Is the current stream part of this capture? (Other streams run their work now.)"""
        return current_stream() in self.members

    def join(self, waiter, source) -> None:
        """``waiter`` waits for the work captured so far on ``source`` (a member stream)."""
        self.join_deps(waiter, self.members[source])

    def join_deps(self, waiter, deps: tuple) -> None:
        mine = self.members.get(waiter, ())
        self.members[waiter] = tuple(sorted(set(mine) | set(deps)))

    def _node(self) -> None:
        s = current_stream()
        self.parents.append(self.members.get(s, ()))
        self.members[s] = (len(self.parents) - 1,)

    def unjoined(self) -> list:
        """Member streams with captured work the capturing stream never waited for."""
        seen, todo = set(), list(self.members[self.stream])
        while todo:
            n = todo.pop()
            if n not in seen:
                seen.add(n)
                todo.extend(self.parents[n])
        return [s for s, deps in self.members.items()
                if s != self.stream and not set(deps) <= seen]

    # addresses
    def alias(self, t: torch.Tensor) -> torch.Tensor:
        """A tensor on the same memory as ``t`` that does not keep ``t``'s block allocated.

        Pool memory is aliased through its segment, so user code can still free the block
        (and a later capture can reuse it), as on a GPU where a graph holds raw pointers.
        Other memory is aliased through its own storage. The alias has its own version
        counter: replay writes memory without bumping autograd's versions, like a GPU.
        """
        t = _dev.host(t)            # a device tensor: the host data it wraps
        st = t.untyped_storage()
        key = (st.data_ptr(), t.storage_offset(), tuple(t.size()), tuple(t.stride()), t.dtype)
        a = self._aliases.get(key)
        if a is None:
            seg = _pool.segment_of(st.data_ptr()) if st.data_ptr() else None
            if seg is not None:
                byte_off = st.data_ptr() - seg.ptr
                item = t.element_size()
                base, off = seg.storage, byte_off // item + t.storage_offset()
            else:
                base, off = st, t.storage_offset()
            a = torch.empty(0, dtype=t.dtype, device="cpu").set_(base, off, t.size(), t.stride())
            self._aliases[key] = a
        return a

    def allocate(self, like: torch.Tensor) -> torch.Tensor:
        """A poisoned tensor from the graph's pool with ``like``'s size, stride, dtype."""
        nbytes = _extent_bytes(like.size(), like.stride(), like.element_size())
        storage, _ = self.pool.allocate(nbytes)
        t = torch.empty(0, dtype=like.dtype, device="cpu").set_(storage, 0, like.size(),
                                                                 like.stride())
        _poison(t)
        return _dev.wrap(t)               # what capture allocates is device memory

    # recording
    def record(self, func, args, kwargs):
        copy = _host_copy(func, args, kwargs)
        if not self.records_now():          # a stream outside this capture: it runs now,
            if self.mode == "global" and copy and copy.kind == "host_tensor":
                # ... but a copy with pageable host memory is a synchronous memcpy, which
                # a "global" capture refuses from any stream (H200, torch 2.11)
                self.refuse(rules.Rule("cpu_sync", "a copy with pageable host memory on a "
                                       "stream outside the capture", "it is a synchronous "
                                       "cudaMemcpy, which capture_error_mode='global' "
                                       "forbids while any stream captures"))
            return func(*args, **kwargs)
        on_device, hosts = _operands(args, kwargs)
        if not on_device:                   # host work: the CPU runs it now, as on a GPU
            return func(*args, **kwargs)
        if func.namespace in _collectives.NAMESPACES:   # all_reduce, wait_tensor, ...
            return _collectives.record(self, func, args, kwargs)
        kind = _kind(func)
        name = func.overloadpacket.__name__
        rule = rules.aten_rule(name, args, kwargs, host_value=self.host_value)
        if rule is not None and rule.emulator == rules.REFUSE:
            self.refuse(rule)
        if rule is not None and rule.emulator == rules.HOST_COPY:
            self.refuse_host_copy(rule)

        if hosts and name == "_foreach_copy_":     # pair by pair across devices, as CUDA
            for dst, src in zip(args[0], args[1]):
                self.record(torch.ops.aten.copy_.default, (dst, src, *args[2:]), kwargs)
            return None
        if copy is not False:
            return self._record_copy(func, name, args, kwargs, copy)
        if kind in ("view", "meta_inplace"):
            return func(*args, **kwargs)
        if hosts:
            if not _dev.allows_host_tensors(func.overloadpacket, hosts):
                raise _dev.same_device_error()
            if any(h.dim() for h in hosts):
                self.refuse_host_copy(why=f"aten.{name} was given a host index tensor, which "
                                      "it copies to the device first, from pageable memory: "
                                      "make the indices a device tensor before capture")

        meta_out = self._meta(func, args, kwargs)
        if kind == "empty":
            return tree_map(lambda m: self.allocate(m) if isinstance(m, torch.Tensor) else m,
                            meta_out)
        return self._record_compute(func, name, args, kwargs, meta_out)

    def refuse_copy(self, rule: rules.Rule | None) -> None:
        """Refuse a host <-> device copy as capture does (None: it is captured)."""
        if rule is not None and rule.emulator == rules.HOST_COPY:
            self.refuse_host_copy(why=rule.why)
        if rule is not None:
            self.refuse(rule)

    def _record_copy(self, func, name, args, kwargs, rule: rules.Rule | None):
        """``copy_`` / ``_to_copy`` between host and device: a captured copy that re-reads
        (or re-writes) the pinned host buffer on every replay."""
        self.refuse_copy(rule)
        if name == "copy_":
            self._add_step(func, args, kwargs, [], True, bake=False)
            return args[0]
        src = args[0]
        meta = self._meta(func, args, kwargs)
        out = self.allocate(meta)
        copy = torch.ops.aten.copy_.default
        self._add_step(copy, (out, src), {}, [], True, bake=False)
        return out

    def _meta(self, func, args, kwargs):
        margs, mkwargs = tree_map(_to_meta, (args, kwargs))
        try:
            return func(*margs, **mkwargs)
        except NotImplementedError:
            # no meta kernel: learn the output's metadata by running it for real
            # (outputs are poisoned below, so no computed value escapes)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                return func(*args, **kwargs)

    def _record_compute(self, func, name, args, kwargs, meta_out):
        schema = func._schema
        # which returns alias a written argument (in-place / out=), and which are fresh
        arg_values = {}
        for i, a in enumerate(schema.arguments):
            if i < len(args) and not a.kwarg_only:
                arg_values[a.name] = args[i]
            elif a.name in kwargs:
                arg_values[a.name] = kwargs[a.name]
        written = {}
        for a in schema.arguments:
            if a.alias_info is not None and a.alias_info.is_write:
                for s in a.alias_info.before_set:
                    written[s] = arg_values.get(a.name)
        rets = list(schema.returns)
        meta_flat, spec = tree_flatten(meta_out)
        results, fresh = [], []          # fresh: (position in flat result, pool tensor)
        if len(rets) == 1 and isinstance(meta_out, (list, tuple)) and not rets[0].alias_info:
            ret_alias = [None] * len(meta_flat)          # e.g. Tensor[] of fresh tensors
        elif len(rets) == 1 and isinstance(meta_out, (list, tuple)):
            ret_alias = [rets[0].alias_info] * len(meta_flat)
        else:
            ret_alias = [r.alias_info for r in rets][: len(meta_flat)]
            ret_alias += [None] * (len(meta_flat) - len(ret_alias))
        for i, (m, ai) in enumerate(zip(meta_flat, ret_alias)):
            if ai is not None and ai.is_write:
                src = written.get(next(iter(ai.before_set)))
                results.append(src)
            elif isinstance(m, torch.Tensor):
                t = self.allocate(m)
                fresh.append((i, t))
                results.append(t)
            else:
                results.append(m)
        self._add_step(func, args, kwargs, fresh, len(meta_flat) == 1 and spec.num_leaves == 1
                       and not isinstance(meta_out, (list, tuple)))
        out = tree_unflatten(results, spec)
        return out

    def _add_step(self, func, args, kwargs, fresh, single, bake: bool = True):
        def arg(x):
            if type(x) is _dev.DeviceTensor:
                return self.alias(x)
            if isinstance(x, torch.Tensor):
                # a host tensor next to device ones: a 0-dim scalar is read now and baked in
                # (bake); pinned memory in a copy is read by address on every replay
                return x.detach().clone() if bake else self.alias(x)
            if type(x) is torch.device and x.type == _dev.DEVICE_TYPE:
                return torch.device("cpu")
            return x

        self._node()
        aargs, akwargs = tree_map(arg, (args, kwargs))
        outs = [(i, self.alias(t)) for i, t in fresh]
        self.ops.append(str(func))
        variant = _out_variant(func) if (outs and len(outs) == len(func._schema.returns)
                                         and all(i == j for j, (i, _) in enumerate(outs))) else None

        def copy_step(func=func, aargs=aargs, akwargs=akwargs, outs=outs, single=single):
            res = func(*aargs, **akwargs)
            if not outs:
                return
            if single:
                outs[0][1].copy_(res)
            else:
                flat, _ = tree_flatten(res)
                for i, o in outs:
                    o.copy_(flat[i])

        if variant is None:
            self.steps.append(copy_step)
            return
        out_op, names = variant
        okw = dict(akwargs)
        okw.update({n: o for n, (_, o) in zip(names, outs)})
        idx, steps = len(self.steps), self.steps

        def out_step(out_op=out_op, aargs=aargs, okw=okw):
            try:
                out_op(*aargs, **okw)
            except Exception:        # an out= kernel that disagrees: fall back for good
                steps[idx] = copy_step
                copy_step()

        self.steps.append(out_step)

    # refusals
    def refuse(self, rule: rules.Rule):
        self.invalidate(rule.shown)
        raise capture_error(CAPTURE_UNSUPPORTED, "cudaErrorStreamCaptureUnsupported",
                            f"{rule.shown}: {rule.why}. Nothing inside a captured region "
                            "may wait for the GPU.")

    def refuse_host_copy(self, rule: rules.Rule | None = None, why: str | None = None):
        if why is None:
            why = (f"{rule.shown}: {rule.why}" if rule is not None else
                   "this copies a captured tensor to host memory; read results after "
                   "replay() instead")
        raise RuntimeError(HOST_COPY_MESSAGE + f"\n[labkit emulator] {why}.")


class _CaptureDispatchMode(TorchDispatchMode):
    def __init__(self, cap: Capture):
        super().__init__()
        self.cap = cap

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return self.cap.record(func, args, kwargs or {})


class _CaptureFunctionMode(TorchFunctionMode):
    """Catches what never reaches ATen: host copies, printing, custom generators."""

    def __init__(self, cap: Capture):
        super().__init__()
        self.cap = cap

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not (self.cap.records_now() and _operands(args, kwargs)[0]):
            return func(*args, **kwargs)      # host work, or a stream outside the capture
        name = getattr(func, "__name__", "")
        rule = rules.function_rule(name, args, kwargs)
        if rule is not None and rule.emulator == rules.HOST_COPY:
            self.cap.refuse_host_copy()
        if rule is not None and rule.emulator == rules.REFUSE:
            self.cap.refuse(rule)
        known = [torch.default_generator, *self.cap.graph._generators]
        if rules.unregistered_generators(args, kwargs, known):
            raise RuntimeError(RNG_MESSAGE + "\n[labkit emulator] this op draws from a "
                               "custom torch.Generator: call "
                               "g.register_generator_state(generator) before capture.")
        if rules.sets_from_host_number(name, args):
            # on a GPU the number stays a CPU scalar: a boolean mask takes masked_fill_
            self.cap.host_value = True
            try:
                return func(*args, **kwargs)
            finally:
                self.cap.host_value = False
        return func(*args, **kwargs)


#: Random ATen ops: they advance a generator's offset.
RANDOM_OPS = {"rand", "randn", "randint", "randperm", "rand_like", "randn_like", "randint_like",
              "normal", "normal_", "bernoulli", "bernoulli_", "uniform_", "random_",
              "exponential_", "geometric_", "cauchy_", "log_normal_", "multinomial",
              "native_dropout", "rrelu_with_noise", "poisson", "_standard_gamma"}

STUCK_RNG_MESSAGE = "Offset increment outside graph capture encountered unexpectedly."


class StuckGeneratorMode(TorchDispatchMode):
    """The default generator after a failed capture: still in capture mode.

    On a GPU, a capture that fails never runs the generator's capture epilogue, so until
    the next capture that ends well every random op outside capture raises. This mode is
    pushed when a capture is invalidated and popped by the next successful capture_end.
    """

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if (active_capture() is None and func.overloadpacket.__name__ in RANDOM_OPS
                and kwargs.get("generator") is None):
            raise RuntimeError(
                STUCK_RNG_MESSAGE + "\n[labkit emulator] an earlier capture failed, which "
                "left the default generator in capture mode (as on a GPU). Any capture "
                "that ends well clears it: labkit.backend.recover(B) does one.")
        return func(*args, **kwargs)


UNCAPTURABLE_OPTIMIZER = ("Attempting CUDA graph capture of step() for an instance of {cls} "
                          "but param_groups' capturable is False.")


def refuse_uncapturable_optimizers() -> None:
    """Give torch's optimizers their GPU check during an emulated capture too.

    ``Optimizer._accelerator_graph_capture_health_check`` (``_cuda_graph_capture_health_check``
    before torch 2.12) refuses ``step()`` of an optimizer built without ``capturable=True``
    while a CUDA or XPU stream captures: its step count lives on the host and would be
    baked in. It asks ``torch.accelerator``, which the emulator is not; this wrapper asks
    the emulator, then runs torch's own check.
    """
    from torch.optim import Optimizer
    for name in ("_accelerator_graph_capture_health_check", "_cuda_graph_capture_health_check"):
        check = getattr(Optimizer, name, None)
        if check is None or getattr(check, "_labkit", False):
            continue

        def health_check(self, _check=check):
            cap = active_capture()
            if cap is not None and cap.records_now() and not all(
                    group["capturable"] for group in self.param_groups):
                raise RuntimeError(UNCAPTURABLE_OPTIMIZER.format(cls=type(self).__name__))
            return _check(self)

        health_check._labkit = True
        setattr(Optimizer, name, health_check)


def run_steps(steps: list[Callable[[], None]]) -> None:
    """Replay: call every recorded step in order, with autograd and autocast off."""
    with torch.no_grad(), torch.autocast("cpu", enabled=False):
        for step in steps:
            step()


__all__ = ["Capture", "active_capture", "run_steps", "HOST_COPY_MESSAGE", "RNG_MESSAGE"]
