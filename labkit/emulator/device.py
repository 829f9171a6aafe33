"""The emulated device: tensors on ``emu:0`` whose data lives in host memory.

On a GPU most rules of capture are about the line between the device and the host: a
copy to the host, a tensor built from host data, a host scalar read once at capture. The
emulator draws that line with a device of its own. PyTorch's ``PrivateUse1`` slot is
named ``emu`` (``torch.utils.backend_registration._setup_privateuseone_for_python_backend``,
the Python-only route of PyTorch's ``test_privateuseone_python_backend``), and a tensor on
it is a :class:`DeviceTensor`: a wrapper subclass that reports ``device='emu:0'`` and
holds a CPU tensor, the way PyTorch's fake tensors make a CPU-only machine see ``cuda``
tensors. Every op on it goes through :meth:`DeviceTensor.__torch_dispatch__`, which runs
the op on the CPU tensors inside and applies the device rules a GPU applies:

* tensors of one op are on one device, except 0-dim host tensors (read as scalars) and
  host index tensors (``x[idx]``); anything else raises CUDA's "Expected all tensors to
  be on the same device" error;
* host <-> device copies go through :func:`copy_between` (``.to``, ``.cpu()``, ``copy_``,
  ``torch.tensor(data, device=...)``), which the recorder checks during capture;
* ``.numpy()`` of a device tensor is refused, as for a CUDA tensor;
* ``t.pin_memory()`` gives host memory the emulator treats as pinned (:func:`is_pinned`);
* ``torch.autocast(B.device.type)`` casts as CUDA's autocast does
  (:mod:`~labkit.emulator.autocast`);
* ``torch.manual_seed`` during a capture accepts only the seed the device already has, as
  ``CUDAGeneratorImpl::set_current_seed`` does (:mod:`~labkit.emulator.rng`);
* every allocation outside graph pools is shown to :mod:`~labkit.emulator.allocator`,
  which refuses one that would need ``cudaMalloc`` where a capture forbids it.

.. warning::
    ``pin_memory=True`` in a factory (``torch.empty(n, pin_memory=True)``) asks the
    device's own pinned allocator, which a Python device cannot provide: on the emulator
    write ``torch.empty(n).pin_memory()``. ``torch.Generator(device=B.device)`` fails for
    a like reason (the device's hooks cannot make a generator from Python, see
    :func:`labkit.emulator.rng.generator`): write ``B.Generator()`` or
    ``B.Generator(device=B.device)``. ``.cuda()`` needs CUDA: write ``.to(B.device)``.
"""

from __future__ import annotations

import copy
import weakref

import torch
from torch.overrides import handle_torch_function, has_torch_function_unary

from labkit.emulator.allocator import note_allocation
from labkit.emulator.rng import set_device_seed
from labkit.emulator.state import DEVICE_TYPE

__all__ = ["DEVICE_TYPE", "DEVICE", "DeviceTensor", "install", "is_device", "host",
           "wrap", "is_pinned", "same_device_error", "NUMPY_MESSAGE"]

DEVICE: torch.device = None  # type: ignore[assignment]  # torch.device("emu", 0), by install()
_CPU = torch.device("cpu")

NUMPY_MESSAGE = ("can't convert {device} device type tensor to numpy. Use Tensor.cpu() to "
                 "copy the tensor to host memory first.")


def same_device_error() -> RuntimeError:
    """CUDA's error for an op given a device tensor and a host tensor (as in TensorIterator)."""
    return RuntimeError(f"Expected all tensors to be on the same device, but found at least "
                        f"two devices, {DEVICE} and cpu!")


class DeviceTensor(torch.Tensor):
    """A tensor on the emulated device: its metadata says ``emu:0``, its data is ``_host``.

    Made only by the device's factories and copies (``torch.zeros(..., device=B.device)``,
    ``t.to(B.device)``) and by ops on other device tensors; never construct one directly.
    """

    _host: torch.Tensor

    @staticmethod
    def __new__(cls, data: torch.Tensor):
        t = torch.Tensor._make_wrapper_subclass(
            cls, data.size(), strides=data.stride(), storage_offset=data.storage_offset(),
            dtype=data.dtype, device=DEVICE, requires_grad=False,
            storage_size=data.untyped_storage().nbytes())
        t._host = data
        return t

    __torch_function__ = torch._C._disabled_torch_function_impl

    # ---- what a wrapper has no storage for: answered from the host data ----------------
    def data_ptr(self) -> int:
        return self._host.data_ptr()

    def untyped_storage(self) -> torch.UntypedStorage:
        return self._host.untyped_storage()

    @property
    def data(self):
        return torch._C.TensorBase.data.__get__(self)

    @data.setter
    def data(self, new):
        # `t.data = other` re-seats t on other's memory: the host data must follow
        torch._C.TensorBase.data.__set__(self, new)
        self._host = new._host if type(new) is DeviceTensor else new

    def __deepcopy__(self, memo):
        """A copy on the device (torch's own deepcopy re-seats a storage, which a wrapper
        cannot take); attributes such as a parameter's mark and ``.grad`` come along."""
        if id(self) in memo:
            return memo[id(self)]
        with torch.no_grad():
            new = _allocated(DeviceTensor(self._host.clone(memory_format=torch.preserve_format)))
        memo[id(self)] = new
        if self.requires_grad:
            new.requires_grad_(True)
        if self.grad is not None:
            new.grad = copy.deepcopy(self.grad, memo)
        for name, value in self.__dict__.items():
            if name != "_host":
                setattr(new, name, copy.deepcopy(value, memo))
        return new

    # ---- reading values on the host: a device-to-host copy first, as on a GPU -----------
    # (each first shows itself to an active TorchFunctionMode, as torch.Tensor's own do,
    # so labkit's linter and the capture see `.tolist()` where the learner wrote it)
    def tolist(self):
        if has_torch_function_unary(self):
            return handle_torch_function(DeviceTensor.tolist, (self,), self)
        return self.cpu().tolist()

    def numpy(self, *, force: bool = False):
        if has_torch_function_unary(self):
            return handle_torch_function(DeviceTensor.numpy, (self,), self, force=force)
        raise TypeError(NUMPY_MESSAGE.format(device=self.device))

    def __array__(self, dtype=None, copy=None):
        if has_torch_function_unary(self):
            return handle_torch_function(DeviceTensor.__array__, (self,), self, dtype=dtype)
        raise TypeError(NUMPY_MESSAGE.format(device=self.device))

    def __format__(self, spec):
        if has_torch_function_unary(self):
            return handle_torch_function(DeviceTensor.__format__, (self,), self, spec)
        if self.dim() == 0:
            return self.item().__format__(spec)
        return object.__format__(self, spec)

    def __repr__(self, *, tensor_contents=None):
        if has_torch_function_unary(self):
            return handle_torch_function(DeviceTensor.__repr__, (self,), self)
        from labkit.emulator.state import refuse_read_during_capture
        refuse_read_during_capture("printing a tensor")
        with torch.no_grad():
            contents = torch._tensor_str._tensor_str(self._host.detach(), len("tensor("))
            text = torch._tensor_str._str(self, tensor_contents=contents)
        param = text.startswith("Parameter(")       # torch's form for a subclass parameter
        if param:
            text = text[len("Parameter("):-1]
        text = "tensor(" + text[text.index("(") + 1:]
        return "Parameter containing:\n" + text if param else text

    __str__ = __repr__

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        packet = func.overloadpacket
        if packet in _COPIES:
            return copy_between(func, args, kwargs)
        hosts: list = []
        if packet is _aten._foreach_copy_:
            # across devices CUDA copies pair by pair (foreach_tensor_copy_list_kernel_slow_)
            for dst, src in zip(args[0], args[1]):
                _aten.copy_.default(dst, src, *args[2:], **kwargs)
            return None
        host_args = _unwrap(args, hosts)
        host_kwargs = {k: _unwrap(v, hosts) for k, v in kwargs.items()} if kwargs else {}
        if hosts and not allows_host_tensors(packet, hosts):
            raise same_device_error()            # before the op runs: nothing half-done
        return wrap_result(func, args, kwargs, func(*host_args, **host_kwargs))


# learners' code reads type(t).__name__: a device tensor is a "Tensor", as on a GPU
DeviceTensor.__name__ = DeviceTensor.__qualname__ = "Tensor"


# ---- unwrapping and wrapping ------------------------------------------------------------

def _unwrap(a, hosts: list):
    """``a`` with device tensors replaced by their host data; host tensors go to ``hosts``."""
    t = type(a)
    if t is DeviceTensor:
        return a._host
    if t is tuple or t is list:
        return t(_unwrap(x, hosts) for x in a)
    if t is torch.device:
        return _CPU if a.type == DEVICE_TYPE else a
    if isinstance(a, torch.Tensor):
        hosts.append(a)
    return a


def host(t):
    """The CPU tensor holding a device tensor's data (a host tensor is returned as is)."""
    return t._host if type(t) is DeviceTensor else t


def wrap(data: torch.Tensor) -> DeviceTensor:
    """A device tensor over the CPU tensor ``data`` (shares its memory)."""
    return DeviceTensor(data)


def is_device(t) -> bool:
    """True for a tensor on the emulated device."""
    return type(t) is DeviceTensor


_WRITES: dict = {}


def _written_returns(func) -> list:
    """For each return of ``func``: the index of the argument it aliases and writes, or None."""
    found = _WRITES.get(func)
    if found is None:
        sets = {}
        for i, a in enumerate(func._schema.arguments):
            if a.alias_info is not None and a.alias_info.is_write:
                for s in a.alias_info.before_set:
                    sets[s] = (i, a.name)
        found = []
        for r in func._schema.returns:
            ai = r.alias_info
            found.append(sets.get(next(iter(ai.before_set))) if ai is not None and ai.is_write
                         else None)
        _WRITES[func] = found
    return found


def wrap_result(func, args, kwargs, out):
    """The op's result on the device: in-place and ``out=`` ops return their own argument."""
    writes = _written_returns(func)
    if any(w is not None for w in writes):
        def arg(w):
            i, name = w
            a = args[i] if i < len(args) else kwargs[name]
            if type(a) is DeviceTensor:
                _follow_metadata(a, func)
            return a
        if len(writes) == 1:
            return arg(writes[0])
        return tuple(arg(w) if w is not None else _wrap_any(o) for w, o in zip(writes, out))
    _note_fresh(func, out)
    return _wrap_any(out)


def _follow_metadata(t: DeviceTensor, func) -> None:
    """After ``unsqueeze_``, ``t_``, ``resize_``, ``out=``...: give ``t`` its data's shape."""
    h = t._host
    if h.size() == t.size() and h.stride() == t.stride() \
            and h.storage_offset() == t.storage_offset():
        return
    try:
        with torch._C._DisableTorchDispatch():
            _aten.as_strided_.default(t, h.size(), h.stride(), h.storage_offset())
    except RuntimeError:
        raise RuntimeError(
            f"{func} grew a tensor on the emulated device in place (from {tuple(t.size())} "
            f"to {tuple(h.size())}), which the emulator cannot follow: allocate the output "
            f"with its final shape (torch.empty(shape, device=B.device)), or use the "
            f"op's functional form.") from None


def _wrap_any(out):
    t = type(out)
    if t is torch.Tensor:
        return DeviceTensor(out)
    if t is tuple or t is list:
        return t(_wrap_any(o) for o in out)
    return out


_FRESH: dict = {}


def _note_fresh(func, out) -> None:
    """Tell the allocator about the new device memory an op's outputs hold (its returns
    without an alias annotation; views and in-place results are not new memory)."""
    fresh = _FRESH.get(func)
    if fresh is None:
        fresh = _FRESH[func] = tuple(r.alias_info is None for r in func._schema.returns)
    if type(out) is torch.Tensor:
        if fresh[0]:
            note_allocation(out.untyped_storage())
        return
    if not any(fresh):
        return
    outs = out if type(out) in (tuple, list) and len(fresh) > 1 else (out,)
    for o, new in zip(outs, fresh):
        for t in (o if type(o) in (tuple, list) else (o,)):
            if new and type(t) is torch.Tensor:
                note_allocation(t.untyped_storage())


def _allocated(t: "DeviceTensor") -> "DeviceTensor":
    note_allocation(t._host.untyped_storage())
    return t


# ---- which ops take a host tensor next to device tensors --------------------------------

_INDEX_OPS = frozenset({"index", "index_put", "index_put_", "_index_put_impl_"})


def allows_host_tensors(packet, hosts) -> bool:
    """CUDA's rule: 0-dim host tensors are scalars anywhere; index ops take host indices."""
    if all(h.dim() == 0 for h in hosts):
        return True
    return packet.__name__ in _INDEX_OPS


# ---- copies between host and device -----------------------------------------------------

_aten = torch.ops.aten
_COPIES = {_aten._to_copy, _aten.copy_}


def copy_between(func, args, kwargs):
    """``_to_copy`` and ``copy_`` with a device tensor on either side, run on host data."""
    packet = func.overloadpacket
    if packet is _aten.copy_:
        dst, src = args[0], args[1]
        host(dst).copy_(host(src), *args[3:])
        return dst
    src = args[0]
    kw = dict(kwargs)
    target = kw.get("device")
    to_device = target is None and is_device(src) or (
        target is not None and torch.device(target).type == DEVICE_TYPE)
    kw["device"] = _CPU
    kw.pop("pin_memory", None)
    out = func(host(src), **kw)
    return _allocated(DeviceTensor(out)) if to_device else out


# ---- pinned host memory ------------------------------------------------------------------

_pinned: dict[int, weakref.finalize] = {}


def is_pinned(t) -> bool:
    """Whether host tensor ``t`` lives in memory from ``pin_memory()``."""
    if is_device(t) or not isinstance(t, torch.Tensor) or t.device.type != "cpu":
        return False
    return t.untyped_storage().data_ptr() in _pinned


def _pin_memory(self, device=None):
    out = torch.empty_like(self, memory_format=torch.contiguous_format)
    out.copy_(self)
    st = out.untyped_storage()
    ptr = st.data_ptr()
    if ptr:
        _pinned[ptr] = weakref.finalize(st, _pinned.pop, ptr, None)
    return out


def _is_pinned(self, device=None) -> bool:
    return is_pinned(self)


# ---- the device's factories and PyTorch's registration -----------------------------------

def _empty_memory_format(size, *, dtype=None, layout=None, device=None, pin_memory=None,
                         memory_format=None):
    return _allocated(DeviceTensor(torch.empty(
        size, dtype=dtype, layout=layout, device=_CPU,
        memory_format=memory_format or torch.contiguous_format)))


def _empty_strided(size, stride, *, dtype=None, layout=None, device=None, pin_memory=None):
    return _allocated(DeviceTensor(torch.empty_strided(size, stride, dtype=dtype,
                                                       layout=layout, device=_CPU)))


def _copy_from(src, dst, non_blocking=False):
    # torch.tensor(data, device=...) copies its host buffer here, below Python's modes
    from labkit.emulator.state import active_capture
    cap = active_capture()
    if cap is not None and cap.records_now():
        from labkit.core.rules import host_copy_rule
        cap.refuse_copy(host_copy_rule("host-to-device", is_pinned(host(src)), non_blocking))
    host(dst).copy_(host(src))
    return dst


class _Module:
    """``torch.emu``: what PyTorch asks a device's module (checkpointing, autocast, RNG).

    The device's kernels run on host data and draw from the host generator, so its RNG
    state is the host's."""

    @staticmethod
    def is_available() -> bool:
        return True

    @staticmethod
    def is_initialized() -> bool:
        return True

    @staticmethod
    def _is_in_bad_fork() -> bool:
        return False

    @staticmethod
    def _lazy_init() -> None:
        pass

    @staticmethod
    def current_device() -> int:
        return 0

    @staticmethod
    def device_count() -> int:
        return 1

    @staticmethod
    def set_device(device) -> None:
        pass

    @staticmethod
    def get_amp_supported_dtype() -> list:
        return [torch.float16, torch.bfloat16]

    @staticmethod
    def is_bf16_supported(including_emulation: bool = True) -> bool:
        return True

    @staticmethod
    def get_rng_state(device=None) -> torch.Tensor:
        return torch.get_rng_state()

    @staticmethod
    def set_rng_state(new_state, device=None) -> None:
        torch.set_rng_state(new_state)

    @staticmethod
    def manual_seed(seed: int) -> None:
        set_device_seed(seed)
        torch.default_generator.manual_seed(seed)

    @staticmethod
    def manual_seed_all(seed: int) -> None:
        # torch.manual_seed and torch.seed call this before they seed the host generator
        # (after CUDA's, as they would on a GPU): the seed is checked and noted here
        set_device_seed(seed)

    @staticmethod
    def synchronize(device=None) -> None:
        from labkit.emulator.state import refuse_device_sync
        refuse_device_sync("synchronize()")


class _Hooks(torch._C._acc.PrivateUse1Hooks if hasattr(torch._C, "_acc") else object):
    """PyTorch's questions about the device. Not "available" as an accelerator: the
    emulator is no accelerator, and a GPU machine's current accelerator stays CUDA."""

    def is_available(self) -> bool:
        return False

    def has_primary_context(self, dev_id) -> bool:
        return True

    def is_built(self) -> bool:
        return True


#: Factories that fill an ``out=`` tensor they resize: made on the host, then wrapped.
HOST_BUILT_FACTORIES = ("arange", "arange.start", "arange.start_step", "range",
                        "range.step", "linspace", "logspace", "randperm",
                        "randperm.generator", "eye", "eye.m", "tril_indices",
                        "triu_indices")


def _host_built(op):
    def factory(*args, **kwargs):
        kwargs["device"] = _CPU
        kwargs.pop("pin_memory", None)
        return _allocated(DeviceTensor(op(*args, **kwargs)))
    return factory


_SDP_FLASH = 1       # torch.nn.attention.SDPBackend.FLASH_ATTENTION


def _sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None,
          enable_gqa=False):
    """``scaled_dot_product_attention`` on the device: the kernel the CPU would pick.

    A device chooses its fused kernel in C++ (``_fused_sdp_choice_stub``), which a Python
    device has not, so SDPA would fall back to its math decomposition: a dozen ops whose
    count depends on the inputs' strides. Here it asks the CPU's choice and calls that
    kernel, one op with its own backward, as a GPU graph holds one attention kernel.
    """
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        # torch's composite SDPA turns a boolean mask into an additive one before it picks
        # a kernel (convert_boolean_attn_mask, aten/.../transformers/attention.cpp); the
        # CPU's flash kernel refuses a boolean mask
        attn_mask = torch.zeros_like(attn_mask, dtype=query.dtype).masked_fill_(
            attn_mask.logical_not(), float("-inf"))
    choice = _aten._fused_sdp_choice(host(query), host(key), host(value),
                                     host(attn_mask) if attn_mask is not None else None,
                                     dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)
    if choice == _SDP_FLASH:
        return _aten._scaled_dot_product_flash_attention_for_cpu(
            query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)[0]
    return _aten._scaled_dot_product_attention_math(
        query, key, value, attn_mask, dropout_p, is_causal, scale=scale,
        enable_gqa=enable_gqa)[0]


_installed: list = []


def install() -> torch.device:
    """Register the ``emu`` device with PyTorch (once per process); return it.

    Raises:
        RuntimeError: this torch has no Python device registration (``torch._C._acc``),
            or another library already gave PyTorch's ``PrivateUse1`` slot its name.
    """
    global DEVICE
    if _installed:
        return DEVICE
    if not hasattr(torch._C, "_acc"):
        raise RuntimeError(
            f"the emulated backend needs torch._C._acc (a device registered from Python), "
            f"which torch {torch.__version__} lacks: install torch 2.11 or newer "
            f"(pip install -U torch), or run on a GPU with backend.get('cuda').")
    name = torch._C._get_privateuse1_backend_name()
    if name not in ("privateuseone", DEVICE_TYPE):
        raise RuntimeError(
            f"the emulated backend names PyTorch's PrivateUse1 device {DEVICE_TYPE!r}, but "
            f"another library in this process already named it {name!r}: run the lab in a "
            f"process without that library (a fresh kernel).")
    if name == "privateuseone":
        from torch.utils.backend_registration import _setup_privateuseone_for_python_backend
        _setup_privateuseone_for_python_backend(DEVICE_TYPE, backend_module=_Module(),
                                                hook=_Hooks())
    DEVICE = torch.device(DEVICE_TYPE, 0)
    # backward on this thread, as for CPU tensors (a device's own autograd thread would
    # hand every op back and forth under the GIL)
    torch._C._set_multithreading_enabled(False)
    lib = torch.library.Library("aten", "IMPL")
    lib.impl("empty.memory_format", _empty_memory_format, "PrivateUse1")
    lib.impl("empty_strided", _empty_strided, "PrivateUse1")
    lib.impl("_copy_from", _copy_from, "PrivateUse1")
    for name in HOST_BUILT_FACTORIES:
        packet, _, overload = name.partition(".")
        op = getattr(getattr(_aten, packet), overload or "default")
        lib.impl(name, _host_built(op), "PrivateUse1")
    lib.impl("scaled_dot_product_attention", _sdpa, "AutogradPrivateUse1")
    lib.impl("_pin_memory", _pin_memory, "CPU")
    lib.impl("is_pinned", _is_pinned, "CPU")
    _installed.append(lib)
    from labkit.emulator.autocast import install as install_autocast
    install_autocast()
    return DEVICE
