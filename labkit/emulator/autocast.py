"""Autocast on the emulated device: CUDA's casting policy, op by op, for ``emu``.

``torch.autocast(B.device.type, ...)`` on a GPU dispatches each op to ``AutocastCUDA``,
whose kernels (ATen's ``autocast_mode.cpp``) cast the op's floating-point inputs by the
op's *cast policy* and call the op again below autocast. A device registered from Python
has no such kernels: its ``AutocastPrivateUse1`` key holds nothing, and every op under
``torch.autocast("emu")`` raised NotImplementedError. :func:`install` gives that key the
same policies, written in Python:

* ``lower_precision_fp`` (matmuls, convolutions, ``linear``, attention): inputs cast to the
  autocast dtype (``torch.get_autocast_dtype("emu")``; float16 by default, as for CUDA);
* ``fp32`` (``exp``, ``log``, norms, losses...): inputs cast to float32;
* ``fp32_set_opt_dtype`` (``softmax``, ``sum``, ``cumsum``...): ``dtype=float32`` unless
  given, when the first input is eligible;
* ``fp32_append_dtype`` (``norm``): redispatched to the overload that takes a dtype;
* ``promote`` (``addcmul``, ``cat``-like ops, ``index_put``...): all inputs to the widest
  floating type among them;
* ``binary_cross_entropy`` is refused with ATen's message.

An input is cast only if it is a floating-point tensor on the emulated device and not
float64 (``at::autocast::is_eligible``). The ops are exactly those the installed torch
registers for ``AutocastCUDA`` (read from its dispatcher), each with the policy of
``AT_FORALL_LOWER_PRECISION_FP`` / ``AT_FORALL_FP32`` / ... in ATen's ``autocast_mode.h``
(:data:`POLICIES`); every other op passes through untouched, as on a GPU.

.. warning::
    Casts are not cached. On a GPU, with ``cache_enabled=True`` (the default), the
    float16 copy of a weight (a leaf that requires grad) is made once per autocast region
    and reused, until the outermost ``autocast`` exits. The values are the same here;
    what differs is when a cast runs: a graph captured inside an autocast region on a GPU
    can read a cached cast made before the capture, which is why
    ``make_graphed_callables`` refuses the cache (the emulator runs torch's own check).
"""

from __future__ import annotations

import torch

from labkit.emulator.state import DEVICE_TYPE

__all__ = ["POLICIES", "BANNED", "BCE_MESSAGE", "install", "autocast_ops", "missing_policies"]

_LOWER = "lower_precision_fp"
_FP32 = "fp32"
_SET_OPT = "fp32_set_opt_dtype"
_APPEND = "fp32_append_dtype"
_PROMOTE = "promote"
_BANNED = "banned"

#: ``aten::op[.overload]`` -> cast policy, from ATen's ``autocast_mode.h`` op lists and the
#: ``AutocastCUDA`` block of ``autocast_mode.cpp``. ``rms_norm`` joined ``fp32`` in torch
#: 2.12; on older torch it has no AutocastCUDA kernel, and so none here either.
POLICIES: dict[str, str] = {
    **{f"aten::{op}": _LOWER for op in (
        "_convolution.deprecated", "_convolution", "conv1d", "conv2d", "conv3d", "conv_tbc",
        "conv_transpose1d", "conv_transpose2d.input", "conv_transpose3d.input",
        "convolution", "prelu", "addmm", "addmv", "addr", "matmul", "einsum", "mm", "mv",
        "linalg_vecdot", "linear", "addbmm", "baddbmm", "bmm", "chain_matmul",
        "linalg_multi_dot", "_thnn_fused_lstm_cell", "_thnn_fused_gru_cell", "lstm_cell",
        "gru_cell", "rnn_tanh_cell", "rnn_relu_cell", "_scaled_dot_product_flash_attention",
        "scaled_dot_product_attention", "cudnn_convolution", "cudnn_convolution_transpose")},
    **{f"aten::{op}": _FP32 for op in (
        "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p",
        "reciprocal", "rsqrt", "sinh", "tan", "pow.Tensor_Scalar", "pow.Tensor_Tensor",
        "pow.Scalar", "softplus", "layer_norm", "native_layer_norm", "group_norm",
        "frobenius_norm.dim", "nuclear_norm", "nuclear_norm.dim", "cosine_similarity",
        "poisson_nll_loss", "cosine_embedding_loss", "nll_loss", "nll_loss2d",
        "hinge_embedding_loss", "kl_div", "l1_loss", "smooth_l1_loss", "huber_loss",
        "mse_loss", "margin_ranking_loss", "multilabel_margin_loss", "soft_margin_loss",
        "triplet_margin_loss", "multi_margin_loss", "binary_cross_entropy_with_logits",
        "dist", "pdist", "cdist", "renorm", "logsumexp", "upsample_nearest1d",
        "_upsample_nearest_exact1d", "upsample_nearest2d", "_upsample_nearest_exact2d",
        "upsample_nearest3d", "_upsample_nearest_exact3d", "upsample_linear1d",
        "upsample_bilinear2d", "_upsample_bilinear2d_aa", "upsample_trilinear3d",
        "upsample_bicubic2d", "_upsample_bicubic2d_aa", "rms_norm")},
    **{f"aten::{op}": _SET_OPT for op in (
        "prod", "prod.dim_int", "prod.dim_Dimname", "softmax.int", "softmax.Dimname",
        "log_softmax.int", "log_softmax.Dimname", "cumprod", "cumprod.dimname", "cumsum",
        "cumsum.dimname", "linalg_vector_norm", "linalg_matrix_norm",
        "linalg_matrix_norm.str_ord", "sum", "sum.dim_IntList", "sum.dim_DimnameList")},
    **{f"aten::{op}": _APPEND for op in (
        "norm.Scalar", "norm.ScalarOpt_dim", "norm.names_ScalarOpt_dim")},
    **{f"aten::{op}": _PROMOTE for op in (
        "addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "vdot", "grid_sampler",
        "index_put", "tensordot", "scatter_add")},
    "aten::binary_cross_entropy": _BANNED,
}

BANNED = ("aten::binary_cross_entropy",)

#: ``at::autocast::binary_cross_entropy_banned``'s message.
BCE_MESSAGE = (
    "torch.nn.functional.binary_cross_entropy and torch.nn.BCELoss are unsafe to autocast.\n"
    "Many models use a sigmoid layer right before the binary cross entropy layer.\n"
    "In this case, combine the two layers using "
    "torch.nn.functional.binary_cross_entropy_with_logits\n"
    "or torch.nn.BCEWithLogitsLoss.  binary_cross_entropy_with_logits and BCEWithLogits are\n"
    "safe to autocast.")

#: ``norm`` overloads without a dtype -> the overload ``fp32_append_dtype`` redispatches to
_APPEND_TARGET = {"Scalar": "ScalarOpt_dtype", "ScalarOpt_dim": "ScalarOpt_dim_dtype",
                  "names_ScalarOpt_dim": "names_ScalarOpt_dim_dtype"}


def autocast_ops() -> list[str]:
    """The ops the installed torch gives an ``AutocastCUDA`` kernel, as ``aten::op[.overload]``."""
    return sorted(n for n in torch._C._dispatch_get_all_op_names()
                  if torch._C._dispatch_has_kernel_for_dispatch_key(n, "AutocastCUDA"))


#: Ops CUDA autocasts that the emulated device never dispatches, and why: no policy needed.
NOT_REACHED = {
    # cuDNN's RNN kernel has an autocast wrapper of its own (aten/src/ATen/cudnn/
    # AutocastRNN.cpp, built with cuDNN only, so a CPU wheel registers none); torch picks
    # it for CUDA tensors alone. (An nn.LSTM does not run on the emulated device at all:
    # for a non-CPU device torch takes the fused _thnn_fused_lstm_cell, which only CUDA
    # implements.) Seen on an H200, torch 2.11.
    "aten::_cudnn_rnn": "cuDNN's RNN kernel, chosen for CUDA tensors only",
}


def missing_policies() -> list[str]:
    """Ops that CUDA autocasts in this torch but :data:`POLICIES` does not know, less
    those the emulated device never reaches (:data:`NOT_REACHED`) (want: [])."""
    return [n for n in autocast_ops() if n not in POLICIES and n not in NOT_REACHED]


# ---- the casts (at::autocast::cached_cast, without the cache) ------------------------------

def _eligible(t) -> bool:
    """``at::autocast::is_eligible`` for PrivateUse1: a floating device tensor, not float64."""
    return (isinstance(t, torch.Tensor) and t.device.type == DEVICE_TYPE
            and t.is_floating_point() and t.dtype != torch.float64)


def _cast(x, to: torch.dtype):
    if isinstance(x, (list, tuple)):
        return type(x)(_cast(v, to) for v in x)
    if _eligible(x) and x.dtype != to:
        return torch.ops.aten.to.dtype(x, to)
    return x


def _kinds(op) -> list[str | None]:
    """Per schema argument: 'tensor', 'optional' (Tensor?), 'list' (Tensor[]) or None."""
    kinds = []
    for a in op._schema.arguments:
        t = a.type
        if isinstance(t, torch.TensorType):
            kinds.append("tensor")
        elif isinstance(t, torch.OptionalType) and isinstance(t.getElementType(),
                                                               torch.TensorType):
            kinds.append("optional")
        elif isinstance(t, torch.ListType) and isinstance(t.getElementType(),
                                                           torch.TensorType):
            kinds.append("list")
        else:
            kinds.append(None)
    return kinds


def _map_tensors(op, kinds, args, kwargs, fn, which=("tensor", "optional", "list")):
    """``args, kwargs`` with ``fn`` applied to the tensor-typed arguments of ``which`` kinds."""
    names = [a.name for a in op._schema.arguments]
    args = [fn(v) if kinds[i] in which else v for i, v in enumerate(args)]
    kwargs = {k: fn(v) if kinds[names.index(k)] in which else v for k, v in kwargs.items()}
    return args, kwargs


def _promote_type(op, kinds, args, kwargs) -> torch.dtype:
    """``at::autocast::promote_type``: the widest floating type among Tensor / Tensor[]
    arguments (``Tensor?`` ones are not looked at), starting from the autocast dtype."""
    lower = torch.get_autocast_dtype(DEVICE_TYPE)
    current = lower
    seen: list = []
    _map_tensors(op, kinds, args, kwargs, lambda v: seen.append(v), which=("tensor", "list"))
    for v in seen:
        for t in (v if isinstance(v, (list, tuple)) else [v]):
            if not (isinstance(t, torch.Tensor) and t.device.type == DEVICE_TYPE
                    and t.is_floating_point()) or t.dtype == torch.float64:
                continue
            if current == torch.float32 or t.dtype == torch.float32:
                current = torch.float32
            elif current == lower and t.dtype == lower:
                current = lower
            else:
                raise RuntimeError("Unexpected floating ScalarType in "
                                   "at::autocast::prioritize")
    return current


def _kernel(op, policy: str):
    """The Python ``AutocastPrivateUse1`` kernel of ``op`` under ``policy``."""
    kinds = _kinds(op)
    names = [a.name for a in op._schema.arguments]
    target = None
    if policy == _APPEND:
        target = getattr(op.overloadpacket, _APPEND_TARGET[op._overloadname])

    def kernel(*args, **kwargs):
        with torch._C._ExcludeDispatchKeyGuard(_AUTOCAST_KEYS):
            if policy == _BANNED:
                raise RuntimeError(BCE_MESSAGE)
            if policy == _LOWER:
                to = torch.get_autocast_dtype(DEVICE_TYPE)
                a, k = _map_tensors(op, kinds, args, kwargs, lambda v: _cast(v, to))
                return op(*a, **k)
            if policy == _FP32:
                a, k = _map_tensors(op, kinds, args, kwargs, lambda v: _cast(v, torch.float32))
                return op(*a, **k)
            if policy == _PROMOTE:
                to = _promote_type(op, kinds, args, kwargs)
                a, k = _map_tensors(op, kinds, args, kwargs, lambda v: _cast(v, to))
                return op(*a, **k)
            first = args[0] if args else kwargs.get(names[0])
            if policy == _SET_OPT:
                if not _eligible(first):
                    return op(*args, **kwargs)
                i = names.index("dtype")
                a, k = list(args), dict(kwargs)
                if i < len(a):
                    a[i] = torch.float32 if a[i] is None else a[i]
                elif k.get("dtype") is None:
                    k["dtype"] = torch.float32
                return op(*a, **k)
            # fp32_append_dtype: the dtype overload, with float32 for an eligible input
            out_type = torch.float32 if _eligible(first) else first.dtype
            bound = dict(zip(names, args))
            bound.update(kwargs)
            return target(*[bound[a.name] if a.name in bound else a.default_value
                            for a in op._schema.arguments], dtype=out_type)

    return kernel


def _autocast_keys():
    keys = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastPrivateUse1)
    for name in ("AutocastCPU", "AutocastCUDA", "AutocastXPU", "AutocastMPS", "AutocastHPU",
                 "AutocastIPU", "AutocastXLA", "AutocastMTIA", "AutocastMAIA"):
        key = getattr(torch._C.DispatchKey, name, None)
        if key is not None:
            keys = keys | torch._C.DispatchKeySet(key)
    return keys


#: ``DispatchKey::AutocastFunctionality``: every backend's autocast key, excluded while an
#: autocast kernel runs the op again (as ``WrapFunction_`` does in C++)
_AUTOCAST_KEYS = _autocast_keys()

_libs: list = []


def install() -> None:
    """Register the policies for ``AutocastPrivateUse1`` (once per process)."""
    if _libs:
        return
    fallthrough = torch.library.Library("_", "IMPL")
    fallthrough.fallback(torch.library.fallthrough_kernel, "AutocastPrivateUse1")
    lib = torch.library.Library("aten", "IMPL")
    for name in autocast_ops():
        policy = POLICIES.get(name)
        if policy is None:
            continue
        packet, _, overload = name[len("aten::"):].partition(".")
        op = getattr(getattr(torch.ops.aten, packet), overload or "default")
        lib.impl(name[len("aten::"):], _kernel(op, policy), "AutocastPrivateUse1")
    _libs.extend((fallthrough, lib))
