"""One forward graph and one backward graph for one module (Megatron's ``_CudaGraphRunner``).

:class:`GraphRunner` owns the static buffers, warms up, captures both graphs into a pool,
guards each call's arguments and replays through :class:`~labkit.bridge.replay.ReplayNode`.
:func:`get_connected_params` finds the parameters whose weight gradients the backward
graph must produce; :func:`capture_stream` is the one stream runners warm up and capture on.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterable, Sequence

import torch

from labkit.backend import check_graph_options, ensure
from labkit.bridge.replay import GraphStatus, ReplayNode, replay_backward, replay_forward
from labkit.capture import (
    capturing,
    cleanup_on_failure,
    on_side_stream,
)
from labkit.core.main_grad import check_module as _check_module
from labkit.core.signature import ArgMetadata as ArgMeta
from labkit.core.signature import GraphArgumentError, get_mismatch_errors
from labkit.core.signature import values_equal as _values_equal
from labkit.core.validate import check_int

__all__ = ["GraphRunner", "get_connected_params", "capture_stream", "mismatch_errors"]


# ---- argument metadata and guards --------------------------------------------------------
# ArgMeta is labkit.core.signature.ArgMetadata (Megatron's ArgMetadata), GraphArgMismatch its
# GraphArgumentError: one home for argument metadata, re-exported under lesson 04's names.

def mismatch_errors(expected: Sequence[ArgMeta], args: Sequence) -> list[str]:
    """One line per difference between ``args`` and the captured metadata: shape, dtype,
    device of tensors, type and value of the rest, and the count (Megatron's
    ``get_mismatch_errors``, :func:`labkit.core.signature.get_mismatch_errors`)."""
    return get_mismatch_errors([ArgMeta.of(m) for m in expected], args)


def _raise_if_mismatch(name: str, expected: Sequence[ArgMeta], args: Sequence) -> None:
    errors = mismatch_errors(expected, args)
    if errors:
        raise GraphArgumentError(f"CUDA graph {name}", errors)


def _guard_signature(metas: Sequence[ArgMeta]) -> tuple:
    """What the per-call guard compares, computed once at capture: ``(n, tensor_checks,
    value_checks)`` with ``(index, shape, dtype, device)`` per tensor argument and
    ``(index, type, value)`` per baked-in value. Matching it is a few attribute reads;
    only a call that does not match builds lesson 03's full message."""
    tensors = tuple((i, torch.Size(m.shape), m.dtype, m.device)
                    for i, m in enumerate(metas) if m.is_tensor)
    values = tuple((i, m.type, m.value) for i, m in enumerate(metas) if not m.is_tensor)
    return len(metas), tensors, values


def _matches(sig: tuple, args: Sequence) -> bool:
    """The cheap check: same count, and each tensor's (shape, dtype, device) and each
    value's (type, value) as at capture. False means "run the full check"."""
    n, tensors, values = sig
    if len(args) != n:
        return False
    Tensor = torch.Tensor
    for i, shape, dtype, device in tensors:
        a = args[i]
        if not (isinstance(a, Tensor) and a.dtype is dtype and a.shape == shape
                and a.device == device):
            return False
    for i, typ, value in values:
        a = args[i]
        if type(a) is not typ or not (a is value or _values_equal(a, value)):
            return False
    return True


# ---- connected parameters ----------------------------------------------------------------

def _check_connected_params_args(outputs, module) -> None:
    _check_module(module, "get_connected_params(outputs, module)")
    if not isinstance(outputs, (torch.Tensor, tuple, list)):
        raise TypeError(f"get_connected_params: outputs must be a tensor or a tuple of "
                        f"tensors (what the layer returned), got {type(outputs).__name__}")


def get_connected_params(outputs, module: torch.nn.Module) -> tuple[torch.nn.Parameter, ...]:
    """The parameters of ``module`` that ``outputs`` depend on, in ``module.parameters()``
    order (Megatron's ``get_connected_params``).

    Walks the autograd graph from each output's ``grad_fn`` through ``next_functions``;
    the leaves are ``AccumulateGrad`` nodes, whose ``.variable`` is the parameter they
    accumulate into. Frozen parameters (no ``AccumulateGrad``) and parameters the outputs
    do not use are left out: they get no wgrad, so they must not be graph inputs.
    """
    _check_connected_params_args(outputs, module)
    outs = (outputs,) if isinstance(outputs, torch.Tensor) else tuple(outputs)
    stack = [t.grad_fn for t in outs
             if isinstance(t, torch.Tensor) and t.requires_grad and t.grad_fn is not None]
    visited, found = set(), set()
    while stack:
        fn = stack.pop()
        if fn in visited:
            continue
        visited.add(fn)
        var = getattr(fn, "variable", None)      # AccumulateGrad holds its leaf
        if var is not None:
            found.add(id(var))
        stack.extend(f for f, _ in fn.next_functions if f is not None)
    return tuple(p for p in module.parameters() if id(p) in found)


# ---- helpers -------------------------------------------------------------------------------

def _flat_outputs(out) -> tuple[tuple[torch.Tensor, ...], bool]:
    """(tensors, was_single) for a callable's return value: a tensor or a tuple of them."""
    if isinstance(out, torch.Tensor):
        return (out,), True
    if isinstance(out, (tuple, list)) and all(isinstance(o, torch.Tensor) for o in out):
        return tuple(out), False
    raise TypeError("a graphed callable must return a tensor or a tuple of tensors, got "
                    f"{type(out).__name__}")


_CAPTURE_STREAMS: dict = {}


def capture_stream(B):
    """The one side stream this backend's runners warm up *and* capture on.

    Autograd runs a parameter's ``AccumulateGrad`` node on the stream that node was
    created on. While a runner's captured forward waits for its backward capture, its
    autograd graph (and the AccumulateGrad nodes of the layer's parameters) is alive; if
    another runner of the same layer (PP > 1: one runner per microbatch in flight)
    then warmed up on a different stream, torch would warn "The AccumulateGrad node's
    stream does not match the stream of the node that produced the incoming gradient"
    and synchronise streams. Warming up and capturing on one stream keeps them equal."""
    key = (B.name, str(B.device))
    s = _CAPTURE_STREAMS.get(key)
    if s is None:
        s = _CAPTURE_STREAMS[key] = B.Stream()
    return s


# ---- argument checks: what a careless call gets told ------------------------------------------

def _refuse_kwargs(name: str, kwargs: dict) -> None:
    """Graphed callables take positional arguments only (they were captured that way)."""
    if kwargs:
        raise TypeError(
            f"{name}: a graphed callable takes positional arguments only (the graph was "
            f"captured from sample_args, a tuple of positional arguments), got keyword "
            f"argument(s) {', '.join(kwargs)}. Pass them positionally, in the order of "
            f"sample_args.")


def _check_arg_tuple(args, where: str, hint: str = "") -> tuple:
    """``args`` as a tuple of arguments; a Tensor (or anything else) is refused, because
    ``tuple(tensor)`` would silently split it along its first dimension."""
    if isinstance(args, (tuple, list)):
        return tuple(args)
    what = (f"a Tensor of shape {tuple(args.shape)}" if isinstance(args, torch.Tensor)
            else type(args).__name__)
    raise TypeError(f"{where} must be a tuple of the callable's positional arguments, got "
                    f"{what}. For one argument write (x,), not x{hint}.")


def _check_sample_devices(name: str, args: Sequence, B) -> None:
    """Every sample tensor on the backend's device type (a graph reads one device)."""
    for i, a in enumerate(args):
        dev = a.device if isinstance(a, (torch.Tensor, ArgMeta)) else None
        if dev is not None and torch.device(dev).type != B.device.type:
            raise ValueError(f"{name}: sample_args[{i}] is on {dev}, but the {B.name} "
                             f"backend captures on {B.device}. Move it first: "
                             f"x.to(B.device).")


def _check_runner_args(module, B, func, num_warmup, pool, generators) -> list:
    """:class:`GraphRunner`'s arguments, checked; returns ``generators`` as a list."""
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"GraphRunner needs the torch.nn.Module whose parameters the graphs "
                        f"train, got {type(module).__name__}. For a plain function pass "
                        f"GraphRunner(torch.nn.Module(), B, func=fn).")
    if func is not None and not callable(func):
        raise TypeError(f"GraphRunner(func=...) must be callable, got {type(func).__name__}")
    check_int("num_warmup", num_warmup, minimum=0)
    check_graph_options(B, pool, None, where="GraphRunner")
    generators = list(generators)
    for gen in generators:
        if not isinstance(gen, torch.Generator):
            raise TypeError(f"GraphRunner(generators=...) takes torch.Generator objects, "
                            f"got {type(gen).__name__}")
    return generators


def _requires_grad_error(name: str, i: int, why: str) -> RuntimeError:
    """``why``: "sample" (captured from a sample that did not require grad), "no_autograd"
    (captured under no_grad / in eval mode) or "no_bwd" (backward graph not created yet)."""
    reason, fix = {
        "sample": ("the sample it was captured with did not require grad, so the backward "
                   "graph computes no gradient for it",
                   "Capture with a sample that requires grad (sample.requires_grad_()), or "
                   f"pass args[{i}].detach() if no gradient is wanted"),
        "no_autograd": ("the graph was captured without autograd (under torch.no_grad() or "
                        "with the module in eval mode), so it has no backward graph",
                        "Call it under torch.no_grad() (inference), or capture it in "
                        "training mode with grad enabled"),
        "no_bwd": ("its backward graph has not been created yet",
                   "Call create_bwd_graph() first, or call it under torch.no_grad()"),
    }[why]
    return RuntimeError(
        f"{name}: args[{i}] requires grad, but {reason}: its .grad would silently stay None "
        f"where eager autograd fills it (an upstream pipeline stage would never train). "
        f"{fix}.")


# ---- the runner ----------------------------------------------------------------------------

class GraphRunner:
    """One forward graph and one backward graph for one module (Megatron's ``_CudaGraphRunner``).

    It holds the static buffers, captures each graph into ``pool`` and keeps forward and
    backward replays in turn::

        r = GraphRunner(module, B, pool=pool)
        r.create_fwd_graph(sample_args)    # warm up, capture the forward
        r.create_bwd_graph()               # capture autograd.grad of it
        y = r(x)                           # replay forward (through ReplayNode)
        y.sum().backward()                 # replays the backward graph

    Args:
        module: the ``torch.nn.Module`` whose parameters the graphs train.
        B: the backend, ``labkit.backend.get(...)`` (``None``: ``get("auto")``).
        pool: a memory-pool handle shared with other runners (``None``: a new pool).
        func: what to graph, if not ``module`` itself (one of its methods, say).
        num_warmup: eager forwards (and backwards) run before capture.
        generators: ``torch.Generator`` objects the module draws from; both graphs
            register them, so every replay draws fresh numbers.
        clone_wgrads: return cloned wgrads (``False``: the static buffers, as torch does).
        restore_grad_added: restore ``param.grad_added_to_main_grad`` after every
            backward replay (the captured backward's Python does not run again).
        restore_after_warmup: back up module buffers and ``main_grad`` around warm-up.
        name: how messages call the runner (default: the module's class name).
        forward_impl, backward_impl: the two halves of the bridge (default
            :func:`~labkit.bridge.replay.replay_forward` and
            :func:`~labkit.bridge.replay.replay_backward`); the exercises swap them.

    .. warning::
        ``clone_wgrads``, ``restore_grad_added`` and ``restore_after_warmup`` exist to show
        what each prevents: turned off, gradients or module state can be silently wrong.
        Runners sharing a ``pool`` must be created in the order they will replay, because
        a capture reuses memory that an earlier graph freed (lesson 05).
    """

    def __init__(self, module: torch.nn.Module, B, *, pool=None, func: Callable | None = None,
                 num_warmup: int = 2, generators: Iterable[torch.Generator] = (),
                 clone_wgrads: bool = True, restore_grad_added: bool = True,
                 restore_after_warmup: bool = True, name: str | None = None,
                 forward_impl: Callable | None = None, backward_impl: Callable | None = None):
        B = ensure(B)
        generators = _check_runner_args(module, B, func, num_warmup, pool, generators)
        self.module = module
        self.B = B
        self.pool = pool
        self.func = func if func is not None else module
        self.num_warmup = num_warmup
        self.generators = list(generators)
        self.clone_wgrads = clone_wgrads
        self.restore_grad_added = restore_grad_added
        self.restore_after_warmup = restore_after_warmup
        self.name = name or type(module).__name__
        self.forward_impl = forward_impl or replay_forward
        self.backward_impl = backward_impl or replay_backward

        self.status = GraphStatus.FWD_READY
        self.fwd_graph = None
        self.bwd_graph = None
        self.arg_metas: list[ArgMeta] = []
        self.static_args: list = []                 # static buffers / baked scalars
        self.input_surface: tuple[torch.Tensor, ...] = ()   # tensors + connected params
        self.num_dgrads = 0
        self.params_to_backprop: tuple[torch.nn.Parameter, ...] = ()
        self.output_surface: tuple[torch.Tensor, ...] = ()
        self.single_output = True
        self.output_requires_grad: tuple[bool, ...] = ()
        self.static_grad_outputs: tuple = ()
        self.static_grad_inputs: tuple = ()
        self.groundtruth_grad_added_to_main_grad: dict = {}
        self.grad_enabled = False
        self._warmed_up = False                     # warmup() ran: create_fwd_graph skips it
        self.replays = {"fwd": 0, "bwd": 0}
        self.copies = {"fwd": 0, "bwd": 0}          # copy_ calls made by replays
        # per-call fast path, derived from arg_metas once (see _prepare_guard)
        self._guard_src = None
        self._guard_sig: tuple = (0, (), ())
        self._tensor_pos: tuple | None = None       # None: every argument is a tensor
        self._no_dgrad_pos: tuple = ()              # tensor args captured without grad

    def __repr__(self):
        state = ("fwd+bwd" if self.bwd_graph is not None else
                 "fwd" if self.fwd_graph is not None else "no graphs")
        return f"<GraphRunner {self.name}: {state}, {self.status.name}>"

    # -- capture ---------------------------------------------------------------------------
    def _warmup(self):
        """Run real forwards (and backwards) so that capture sees no first-time work."""
        ctx = torch.enable_grad() if self.grad_enabled else torch.no_grad()
        with on_side_stream(self.B, capture_stream(self.B)), ctx:
            for _ in range(self.num_warmup):
                w_args = [a.detach().clone().requires_grad_(a.requires_grad)
                          if isinstance(a, torch.Tensor) else a for a in self.static_args]
                outs, _ = _flat_outputs(self.func(*w_args))
                if not self.grad_enabled:
                    continue
                outs = [o for o in outs if o.requires_grad]
                ins = [a for a in w_args if isinstance(a, torch.Tensor) and a.requires_grad]
                ins += [p for p in self.module.parameters() if p.requires_grad]
                if outs and ins:
                    # the values do not matter (torch passes uninitialised memory, Megatron
                    # zeros); ones make anything that leaks out of warmup visible
                    torch.autograd.grad(outs, ins, grad_outputs=[torch.ones_like(o)
                                                                 for o in outs],
                                        allow_unused=True)

    def _set_static_args(self, sample_args: Sequence, where: str) -> list:
        """Check ``sample_args`` and make the static buffers (and baked-in values) from them."""
        sample_args = _check_arg_tuple(sample_args, f"{self.name}: {where}(sample_args)")
        _check_sample_devices(self.name, sample_args, self.B)
        self.arg_metas = [ArgMeta.of(a) for a in sample_args]
        static = []
        for a, m in zip(sample_args, self.arg_metas):
            if isinstance(a, torch.Tensor):
                static.append(a.detach().clone().requires_grad_(a.requires_grad))
            elif isinstance(a, ArgMeta) and a.is_tensor:
                static.append(a.zeros())
            else:
                static.append(m.value)
        self.static_args = static
        self.grad_enabled = torch.is_grad_enabled() and self.module.training
        return static

    def warmup(self, sample_args: Sequence) -> None:
        """Run now the warm-ups that :meth:`create_fwd_graph` would run; it then skips them.

        Runners that share a pool are all warmed up before the pool's first capture
        (``make_graphed_callables`` and the pipeline's ``create_cudagraphs`` do this, as
        torch's ``make_graphed_callables`` does).

        .. warning::
            A warm-up between two captures into one pool can leave the pool's later
            graphs writing to a cuBLAS workspace they do not own (the backward's, cached
            anew from the general pool; see :func:`labkit.capture.own_cublas_workspace`).
        """
        if self.fwd_graph is not None:
            raise RuntimeError(f"{self.name}: the forward graph already exists: warm up "
                               "before create_fwd_graph, not after")
        self._set_static_args(sample_args, "warmup")
        with self._state_restored():
            self._warmup()
        self._warmed_up = True

    def create_fwd_graph(self, sample_args: Sequence) -> None:
        """Warm up, then capture the forward into ``self.pool`` (Megatron's ``create_fwd_graph``).

        ``sample_args``: tensors (their values seed the static buffers) or
        :class:`ArgMeta` (buffers start as zeros), or non-tensor values (baked in). The
        warm-ups are skipped if :meth:`warmup` already ran them.
        """
        if self.fwd_graph is not None:
            raise RuntimeError(f"{self.name}: the forward graph already exists (a runner "
                               "captures once; make a new GraphRunner for other arguments)")
        B = self.B
        static = self._set_static_args(sample_args, "create_fwd_graph")

        with self._state_restored():
            if not self._warmed_up:
                self._warmup()
            g = B.CUDAGraph()
            for gen in self.generators:              # RNG the layer draws from
                g.register_generator_state(gen)
            ctx = torch.enable_grad() if self.grad_enabled else torch.no_grad()
            with cleanup_on_failure(B), ctx, capturing(B, g, pool=self.pool,
                                                       stream=capture_stream(B)):
                outs = self.func(*static)
        outs, self.single_output = _flat_outputs(outs)
        if self.pool is None:
            self.pool = g.pool()                 # the backward graph shares it
        self.fwd_graph = g
        self.output_surface = outs
        self.output_requires_grad = tuple(bool(o.requires_grad) for o in outs)
        tensors = tuple(a for a in static if isinstance(a, torch.Tensor))
        self.num_dgrads = len(tensors)
        if self.grad_enabled:
            self.params_to_backprop = get_connected_params(outs, self.module)
        self.input_surface = tensors + self.params_to_backprop

    def create_bwd_graph(self) -> None:
        """Capture ``torch.autograd.grad`` of the forward graph's outputs (``create_bwd_graph``)."""
        if self.fwd_graph is None:
            raise RuntimeError(f"{self.name}: no forward graph to differentiate yet: call "
                               "create_fwd_graph(sample_args) first")
        if self.bwd_graph is not None:
            raise RuntimeError(f"{self.name}: the backward graph already exists")
        if not self.grad_enabled:
            raise RuntimeError(f"{self.name}: the forward graph was captured without "
                               "autograd (no_grad or eval mode): there is no backward")
        B = self.B
        g = B.CUDAGraph()
        for gen in self.generators:
            g.register_generator_state(gen)
        # one static grad-output buffer per output that requires grad
        self.static_grad_outputs = tuple(torch.zeros_like(o) if rg else None
                                         for o, rg in zip(self.output_surface,
                                                          self.output_requires_grad))
        outs = [o for o, rg in zip(self.output_surface, self.output_requires_grad) if rg]
        douts = [d for d in self.static_grad_outputs if d is not None]
        wants = [i for i in self.input_surface if i.requires_grad]
        flags_before = {p: p.grad_added_to_main_grad for p in self.params_to_backprop
                        if hasattr(p, "grad_added_to_main_grad")}
        try:
            with cleanup_on_failure(B), capturing(B, g, pool=self.pool,
                                                  stream=capture_stream(B)):
                grads = torch.autograd.grad(outs, wants, grad_outputs=douts,
                                            only_inputs=True, allow_unused=True)
        except BaseException:
            for p, v in flags_before.items():      # a failed capture leaves no trace either
                p.grad_added_to_main_grad = v
            raise
        self.bwd_graph = g
        # what the captured backward's Python left in the flags: restored at each replay
        self.groundtruth_grad_added_to_main_grad = {
            p: p.grad_added_to_main_grad for p in self.params_to_backprop
            if hasattr(p, "grad_added_to_main_grad")}
        for p, v in flags_before.items():      # capture itself leaves no trace
            p.grad_added_to_main_grad = v
        it = iter(grads)
        self.static_grad_inputs = tuple(next(it) if i.requires_grad else None
                                        for i in self.input_surface)
        # keep only the buffers: drop the forward's autograd graph (its saved activations
        # stay alive for the graphs, as pool memory, not as Python tensors)
        self.output_surface = tuple(o.detach() for o in self.output_surface)

    @contextlib.contextmanager
    def _state_restored(self):
        """Warm-up pollutes buffers and ``main_grad``: back them up, put them back after
        the body (as Megatron's ``create_fwd_graph``), if ``restore_after_warmup``."""
        backup = self._backup() if self.restore_after_warmup else None
        try:
            yield
        finally:
            if backup is not None:
                self._restore(backup)

    def _backup(self):
        bufs = [b.detach().clone() for b in self.module.buffers()]
        mains = [p.main_grad.detach().clone() if hasattr(p, "main_grad") else None
                 for p in self.module.parameters()]
        flags = [getattr(p, "grad_added_to_main_grad", None) for p in self.module.parameters()]
        return bufs, mains, flags

    def _restore(self, backup):
        bufs, mains, flags = backup
        with torch.no_grad():
            for b, saved in zip(self.module.buffers(), bufs):
                b.copy_(saved)
            for p, saved, flag in zip(self.module.parameters(), mains, flags):
                if saved is not None:
                    p.main_grad.copy_(saved)
                if flag is not None:
                    p.grad_added_to_main_grad = flag

    # -- replay ----------------------------------------------------------------------------
    def _prepare_guard(self) -> None:
        """Precompute the per-call guard from ``arg_metas`` (again if it is replaced)."""
        metas = self.arg_metas
        self._guard_sig = _guard_signature(metas)
        self._tensor_pos = (None if all(m.is_tensor for m in metas)
                            else tuple(i for i, m in enumerate(metas) if m.is_tensor))
        self._no_dgrad_pos = tuple(i for i, m in enumerate(metas)
                                   if m.is_tensor and not m.requires_grad)
        self._guard_src = metas

    def _check_requires_grad(self, args: Sequence, differentiable: bool) -> None:
        """Refuse an input that requires grad when the graphs cannot give it a gradient
        (torch's own graphed callables silently leave its ``.grad`` at ``None``)."""
        if not torch.is_grad_enabled():
            return
        if not differentiable:
            why = "no_bwd" if self.grad_enabled and self.bwd_graph is None else "no_autograd"
            for i, a in enumerate(args):
                if isinstance(a, torch.Tensor) and a.requires_grad:
                    raise _requires_grad_error(self.name, i, why)
            return
        for i in self._no_dgrad_pos:
            if args[i].requires_grad:
                raise _requires_grad_error(self.name, i, "sample")

    def __call__(self, *args, **kwargs):
        """Replay the forward graph with autograd attached (Megatron's
        ``replay_graph_capture``): check the arguments, then ``ReplayNode.apply``.

        The hot path is lean: the guard compares each argument with a signature made
        once at capture ((shape, dtype, device) per tensor, (type, value) per baked-in
        value); only when that fails does lesson 03's full check run, to list every
        mismatch in the error."""
        if kwargs:
            _refuse_kwargs(self.name, kwargs)
        if self.fwd_graph is None:
            raise RuntimeError(f"{self.name}: no forward graph to replay yet: call "
                               "create_fwd_graph(sample_args) (and create_bwd_graph() to "
                               "train) first")
        if self._guard_src is not self.arg_metas:
            self._prepare_guard()
        if not _matches(self._guard_sig, args):
            _raise_if_mismatch(self.name, self.arg_metas, args)
        differentiable = self.bwd_graph is not None and any(self.output_requires_grad)
        self._check_requires_grad(args, differentiable)
        pos = self._tensor_pos
        tensors = args if pos is None else tuple([args[i] for i in pos])
        if differentiable and torch.is_grad_enabled():
            out = ReplayNode.apply(self, *tensors, *self.params_to_backprop)
            self.status = GraphStatus.BWD_READY
        else:
            with torch.no_grad():
                out = self.forward_impl(self, tensors)
        return out[0] if self.single_output else tuple(out)
