"""Whole-step capture: one graph for the forward and backward of every microbatch (lesson 07).

Lessons 04 and 05 graph a training step *layer by layer*: a forward graph and a backward
graph per layer, joined to autograd by an ``autograd.Function``, replayed in 1F1B order.
Megatron-LM's ``full_iteration`` mode goes to the other extreme: the whole
``forward_backward_func`` (every microbatch's forward *and* backward, i.e. the entire
pipeline schedule) is captured as **one** ``CUDAGraph``, and the optimizer step as a
second graph in the same memory pool. A training step is then two ``replay()`` calls:
no Python, no autograd engine, no per-kernel launches. Nothing is left to remove.

The price is that *everything* in the step must be static:

* **inputs at fixed addresses.** The data loader hands out new tensors every step, but a
  graph reads the addresses it captured. :class:`StaticBatchLoader` (Megatron's
  ``StaticBufferLoader``) owns one set of buffers per microbatch and ``copy_``\\ s each new
  microbatch into them, on a side stream, before the replay;
* **gradients at fixed addresses.** Backward accumulates into ``param.grad``. If ``.grad``
  is ``None`` at capture, autograd allocates it inside the capture; so
  :func:`ensure_grads` creates every ``.grad`` before capture, and the step zeroes them
  *in place* (``set_to_none=False`` semantics): backward then accumulates into the same
  memory on every replay;
* **an optimizer whose state stays on the device.** ``torch.optim.AdamW()`` keeps its step
  count on the *host* on purpose (a CPU tensor: one less kernel launch per parameter and
  step) and computes the bias corrections ``1 - beta**step`` there, as Python floats.
  Captured, those floats would be baked into the graph and every replay would repeat the
  same step;
  so torch refuses up front (a health check of ``torch.optim.Optimizer`` that Adam and
  AdamW run in ``step()``: "... but param_groups' capturable is False").
  ``AdamW(capturable=True)`` keeps the step count on the device and does that arithmetic
  with tensor ops, and is what :func:`make_capturable_optimizer` returns on a GPU. On a
  CPU torch refuses
  ``capturable=True`` (it asserts a CUDA-like device), so the emulator gets
  :class:`CapturableAdamW`, a small AdamW whose whole state, step count included, lives
  in tensors and is updated with tensor ops only. :class:`FullStepTrainer` refuses a
  non-capturable optimizer when it is built, before any capture;
* **a fixed schedule.** The number of microbatches, their shapes and the order of every
  kernel are frozen at capture. A step whose *shapes* depend on the data (MoE token
  dispatch: how many tokens go to each expert) cannot be captured whole; a check that
  branches on a value (``if torch.isnan(loss): ...``) cannot run inside the graph at all.
  Keep a flag tensor instead (``found_inf`` below), updated in the graph, read after
  replay.

Capture happens once, at step ``warmup_steps``: the steps before it run eagerly. They are
real training steps, and they do what must not happen inside a capture: create the
optimizer state (created in the capture, every replay would reset it) and run the
lazy initialisation and autotuning of cuBLAS and friends. (They do not pre-allocate
memory for the graph: capture allocates from its own private pool, never from blocks
cached during warm-up.) Capture records the step and computes
nothing, so the capturing step replays right after capturing. From then on every step is
``loader.load(batch)`` + ``fwd_bwd_graph.replay()`` + ``optimizer_graph.replay()``, and the
loss comes back in the same static tensor every time (overwritten in place).

Names mirror Megatron (``megatron/core/full_cuda_graph.py``, ``optimizer_cuda_graph.py``):

==================================  =================================================
labkit                              Megatron
==================================  =================================================
:class:`StaticBatchLoader`          ``StaticBufferLoader`` (full_cuda_graph.py)
:class:`FullCudaGraphWrapper`       ``FullCudaGraphWrapper`` and its ``__call__``
:class:`OptimizerCudaGraphWrapper`  ``OptimizerCudaGraphWrapper`` (optimizer_cuda_graph.py)
:func:`forward_backward`            ``forward_backward_func`` (the pipeline schedule)
:class:`FullStepTrainer`            the wiring in ``training.py`` (``train``)
==================================  =================================================

Everything takes a backend ``B`` (``labkit.backend.get(...)``), so the same code runs on a
GPU and on labkit's CPU emulator.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable, Iterable, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

from labkit.capture import cleanup_on_failure, on_side_stream, own_cublas_workspace

__all__ = [
    "LMConfig", "CONFIGS", "Block", "TinyLM", "build_lm", "lm_loss", "random_microbatches",
    "StaticBatchLoader", "fill_static_buffers",
    "ensure_grads", "CapturableAdamW", "make_capturable_optimizer",
    "forward_backward", "nonfinite_flag", "phase",
    "FullCudaGraphWrapper", "OptimizerCudaGraphWrapper", "FullStepTrainer", "EagerTrainer",
]


# ---- the model lesson 07 trains --------------------------------------------------------

@dataclass(frozen=True)
class LMConfig:
    """A small causal language model and the shape of one training step."""

    vocab_size: int = 64
    d_model: int = 32
    n_layers: int = 2
    n_heads: int = 4
    seq_len: int = 16
    micro_batch: int = 2          # sequences per microbatch
    num_microbatches: int = 2     # microbatches per step (gradient accumulation)

    @property
    def tokens_per_step(self) -> int:
        return self.micro_batch * self.seq_len * self.num_microbatches


CONFIGS = {
    # CPU tests and the notebook on the emulator: a step takes milliseconds.
    "tiny": LMConfig(),
    # The benchmark (labkit.bench train): 6 layers, d=256, 4 microbatches of 4x64 tokens.
    "bench": LMConfig(vocab_size=1024, d_model=256, n_layers=6, n_heads=4, seq_len=64,
                      micro_batch=4, num_microbatches=4),
}


class Block(nn.Module):
    """One pre-norm transformer layer with its causal mask, callable as ``block(x)``.

    The mask lives in a buffer and is passed inside ``forward``, so a block takes one
    tensor and returns one: the shape ``make_graphed_callables`` graphs layer by layer
    (the ``torch_make_graphed_callables`` row of the benchmark). No biases, as in most
    current LLMs; it also removes the key bias, whose gradient is zero in exact
    arithmetic (softmax ignores a constant shift) but rounding noise in practice, noise
    that Adam would scale up to a full ``lr``-sized step and make runs hard to compare.
    """

    def __init__(self, d_model: int, n_heads: int, seq_len: int):
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(d_model, n_heads, 4 * d_model, dropout=0.0,
                                                batch_first=True, norm_first=True, bias=False)
        self.register_buffer("causal_mask",
                             nn.Transformer.generate_square_subsequent_mask(seq_len),
                             persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x, src_mask=self.causal_mask, is_causal=True)


class TinyLM(nn.Module):
    """Embedding → ``n_layers`` × :class:`Block` → LayerNorm → vocabulary head."""

    def __init__(self, cfg: LMConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Parameter(torch.randn(cfg.seq_len, cfg.d_model) * 0.02)
        self.blocks = nn.ModuleList(Block(cfg.d_model, cfg.n_heads, cfg.seq_len)
                                    for _ in range(cfg.n_layers))
        self.norm = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if tokens.dim() != 2 or tokens.shape[-1] != self.cfg.seq_len:
            raise ValueError(
                f"TinyLM expects tokens of shape (batch, seq_len={self.cfg.seq_len}), got "
                f"{tuple(tokens.shape)}: its position table and causal masks are built for "
                f"seq_len={self.cfg.seq_len}. Build the model for this length "
                f"(build_lm(cfg, seq_len={tokens.shape[-1] if tokens.dim() else '...'})) or "
                "pad/cut the sequences.")
        if tokens.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"TinyLM expects integer token ids (int64), got {tokens.dtype}")
        x = self.embed(tokens) + self.pos
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def build_lm(cfg: LMConfig | str = "tiny", device=None, seed: int = 0, **overrides) -> TinyLM:
    """A seeded :class:`TinyLM` on ``device`` (fp32). Same seed, same weights."""
    if isinstance(cfg, str):
        if cfg not in CONFIGS:
            raise ValueError(f"unknown config {cfg!r}: choose one of {', '.join(CONFIGS)} "
                             "or pass an LMConfig")
        cfg = CONFIGS[cfg]
    cfg = replace(cfg, **overrides) if overrides else cfg
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = TinyLM(cfg)
    return model.to(device if device is not None else "cpu")


def lm_loss(model: nn.Module, microbatch) -> torch.Tensor:
    """Next-token cross-entropy of one microbatch ``(tokens, targets)``."""
    if not isinstance(microbatch, (tuple, list)) or len(microbatch) != 2:
        what = (f"a {type(microbatch).__name__} of {len(microbatch)}"
                if isinstance(microbatch, (tuple, list)) else f"a {type(microbatch).__name__}")
        raise ValueError(f"lm_loss expects a microbatch (tokens, targets), got {what}: "
                         "give every microbatch its targets (random_microbatches makes pairs)")
    tokens, targets = microbatch
    if tokens.shape != targets.shape:
        raise ValueError(f"lm_loss: targets of shape {tuple(targets.shape)} for tokens of "
                         f"shape {tuple(tokens.shape)}: each token needs its target (the next "
                         "token), so both have the shape (batch, seq_len)")
    logits = model(tokens)
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def random_microbatches(cfg: LMConfig | str, generator: torch.Generator | None = None,
                        device=None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One step of random token data: ``num_microbatches`` pairs ``(tokens, targets)``,
    each ``(micro_batch, seq_len)`` int64, targets = tokens shifted by one."""
    if isinstance(cfg, str):
        if cfg not in CONFIGS:
            raise ValueError(f"unknown config {cfg!r}: choose one of {', '.join(CONFIGS)} "
                             "or pass an LMConfig")
        cfg = CONFIGS[cfg]
    out = []
    for _ in range(cfg.num_microbatches):
        seq = torch.randint(0, cfg.vocab_size, (cfg.micro_batch, cfg.seq_len + 1),
                            generator=generator)
        seq = seq.to(device) if device is not None else seq
        out.append((seq[:, :-1].contiguous(), seq[:, 1:].contiguous()))
    return out


# ---- static inputs -------------------------------------------------------------------------

def fill_static_buffers(buffers: Sequence, microbatches: Sequence,
                        non_blocking: bool = True) -> None:
    """Copy each microbatch into its buffers, in place: ``buffers[i]`` ← ``microbatches[i]``.

    Each ``buffers[i]`` and ``microbatches[i]`` is the same structure of tensors (a tensor,
    a tuple, a dict...). ``copy_`` keeps every buffer at its address, which is the whole
    point: the graph reads those addresses. Rebinding (``buffers[i] = microbatches[i]``)
    would leave the graph reading the old data forever.
    """
    if len(buffers) != len(microbatches):
        raise ValueError(f"{len(microbatches)} microbatches for {len(buffers)} static buffer "
                         "sets: the number of microbatches is part of the captured schedule")
    for i, (buf, mb) in enumerate(zip(buffers, microbatches)):
        dst, dst_spec = tree_flatten(buf)
        src, src_spec = tree_flatten(mb)
        if dst_spec != src_spec:
            raise ValueError(f"microbatch {i} has structure {src_spec}, the buffers {dst_spec}")
        for j, (d, s) in enumerate(zip(dst, src)):
            if d.shape != s.shape or d.dtype != s.dtype:
                raise ValueError(
                    f"microbatch {i}, tensor {j}: got {tuple(s.shape)} {s.dtype}, the static "
                    f"buffer is {tuple(d.shape)} {d.dtype}. A captured step has fixed shapes: "
                    "pad to the captured shape, or capture another graph for this one.")
            d.copy_(s, non_blocking=non_blocking)


class StaticBatchLoader:
    """Per-microbatch input buffers at fixed addresses, filled by ``copy_`` (Megatron's
    ``StaticBufferLoader``).

    ``load(microbatches)`` allocates the buffers on its first call (one set per
    microbatch, with each microbatch's structure, shape and dtype, on ``B.device``) and on
    every later call copies the new data into them. The copies run on a side stream
    with ``non_blocking=True``, so that host-to-device transfers from pinned memory
    overlap other work; the side stream first waits for the current stream (the previous
    step's replay may still be reading the buffers) and the current stream then waits
    for the side stream (the next replay must see the new data). On the emulator streams
    order nothing and the copies simply happen.

    ``buffers`` is what the step function reads, eager or captured.

    The per-step path is lean: the two stream dependencies reuse two events made once
    (``wait_stream`` would create a new event each time), and when every microbatch is
    a tensor or a flat tuple/list of tensors with the captured shapes and dtypes, all
    copies go out as one ``torch._foreach_copy_`` (one multi-tensor kernel for device
    sources) instead of a pytree walk and one ``copy_`` per tensor. Anything else takes
    :func:`fill_static_buffers`, with its checks and messages.
    """

    def __init__(self, B, num_microbatches: int, stream=None):
        _check_count("num_microbatches", num_microbatches)
        self.B = B
        self.num_microbatches = num_microbatches
        self.stream = stream if stream is not None else B.Stream()
        self.buffers: list = []
        self.loads = 0
        self._plan_src = None          # the buffers the fast-path plan below was made for
        self._kinds: list = []         # per microbatch: None (a tensor) or (type, length)
        self._dsts: list = []          # every buffer, flattened in microbatch order
        self._metas: list = []         # (shape, dtype) of each of _dsts
        self._events = None            # (data may be overwritten, data is loaded)

    def _allocate(self, mb):
        def alloc(t):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"a microbatch must hold tensors only, got {type(t).__name__}")
            return torch.empty(t.shape, dtype=t.dtype, device=self.B.device)
        return tree_map(alloc, mb)

    @staticmethod
    def _kind(structure):
        """None for a tensor, (type, length) for a flat tuple/list of tensors, else False
        (a structure the fast path leaves to pytree)."""
        if isinstance(structure, torch.Tensor):
            return None
        if type(structure) in (tuple, list) and all(isinstance(t, torch.Tensor)
                                                     for t in structure):
            return (type(structure), len(structure))
        return False

    def _make_plan(self) -> None:
        self._kinds = [self._kind(b) for b in self.buffers]
        self._dsts = [t for b in self.buffers for t in tree_flatten(b)[0]]
        self._metas = [(d.shape, d.dtype) for d in self._dsts]
        self._plan_src = self.buffers

    def _sources(self, microbatches: Sequence) -> list | None:
        """The tensors of ``microbatches`` in ``_dsts`` order, when each has the buffers'
        flat structure, shape and dtype; None sends the call down the checked path."""
        if self._plan_src is not self.buffers:
            self._make_plan()
        srcs: list = []
        for mb, kind in zip(microbatches, self._kinds):
            if kind is False:
                return None
            if kind is None:
                if not isinstance(mb, torch.Tensor):
                    return None
                srcs.append(mb)
            elif type(mb) is kind[0] and len(mb) == kind[1]:
                srcs.extend(mb)
            else:
                return None
        for s, (shape, dtype) in zip(srcs, self._metas):
            if not isinstance(s, torch.Tensor) or s.dtype is not dtype or s.shape != shape:
                return None
        return srcs

    def load(self, microbatches: Sequence) -> list:
        """Copy ``microbatches`` (a sequence of ``num_microbatches`` structures of
        tensors) into the static buffers and return the buffers."""
        if not isinstance(microbatches, (list, tuple)):
            microbatches = list(microbatches)
        if len(microbatches) != self.num_microbatches:
            raise ValueError(f"expected {self.num_microbatches} microbatches, got "
                             f"{len(microbatches)}: the captured schedule has a fixed count")
        B = self.B
        if self._events is None:
            self._events = (B.Event(), B.Event())
        free, loaded = self._events
        current = B.current_stream()
        free.record(current)                    # the previous replay may still read them
        self.stream.wait_event(free)
        with B.stream(self.stream):
            if not self.buffers:
                self.buffers = [self._allocate(mb) for mb in microbatches]
            srcs = self._sources(microbatches)
            if srcs is None:
                fill_static_buffers(self.buffers, microbatches, non_blocking=True)
            elif srcs:
                torch._foreach_copy_(self._dsts, srcs, non_blocking=True)
            loaded.record(self.stream)
        current.wait_event(loaded)              # the next replay must see the new data
        self.loads += 1
        return self.buffers


# ---- gradients and the optimizer ------------------------------------------------------------

def ensure_grads(params: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """Give every parameter a zeroed ``.grad`` now, outside any capture; return the grads.

    Backward *accumulates* into an existing ``.grad`` in place (``grad += new``), so once
    the tensors exist their addresses never change and a captured backward keeps writing
    into them. Zero them in place before each step (``torch._foreach_zero_``, or
    ``opt.zero_grad(set_to_none=False)``), never set them to ``None``.

    (PyTorch's whole-network example does the opposite, ``zero_grad(set_to_none=True)``
    before capture, so that backward allocates ``.grad`` from the graph's private pool.
    That works too, as long as nothing resets them afterwards; allocating them up front
    makes the fixed addresses visible and lets eager warm-up steps share them.)
    """
    grads = []
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        grads.append(p.grad)
    return grads


def _capturing() -> bool:
    """Is a CUDA graph (real or emulated) being captured on this thread now?"""
    from labkit.emulator.recorder import active_capture

    if active_capture() is not None:
        return True
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


class CapturableAdamW(torch.optim.Optimizer):
    """AdamW whose entire state (step count included) lives in tensors: graph-capturable.

    The update is the same as ``torch.optim.AdamW``'s::

        step += 1
        p *= 1 - lr * weight_decay
        m = beta1 * m + (1 - beta1) * g
        v = beta2 * v + (1 - beta2) * g²
        p -= lr / (1 - beta1**step) * m / (sqrt(v) / sqrt(1 - beta2**step) + eps)

    but ``beta**step`` is computed from the ``step`` *tensor* on the device, never read on
    the host, so a captured ``step()`` advances the count on every replay (exactly what
    ``capturable=True`` does in torch's own AdamW, which refuses CPU tensors). ``lr`` and
    the betas are Python floats, baked into the graph at capture: a learning-rate schedule
    would have to keep ``lr`` in a tensor as well.

    ``skip_if`` (optional): a bool scalar tensor, e.g. the trainer's ``found_inf``. When it
    is true at replay time the step leaves parameters, moments and the step count
    unchanged (GradScaler's "skip the step on inf/NaN", decided on the device with
    ``torch.where`` instead of an ``if`` on the host).

    State is created by the first ``step()``, which must run eagerly: created inside a
    capture it would be re-zeroed by every replay, so that raises. Warm up first, or call
    :meth:`init_state`.
    """

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2,
                 skip_if: torch.Tensor | None = None):
        if lr < 0 or eps < 0 or not (0 <= betas[0] < 1 and 0 <= betas[1] < 1):
            raise ValueError(f"invalid AdamW hyper-parameters lr={lr} betas={betas} eps={eps}")
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.skip_if = skip_if

    @torch.no_grad()
    def init_state(self) -> None:
        """Create the state of every parameter now (zeros; step count 0)."""
        for group in self.param_groups:
            for p in group["params"]:
                st = self.state[p]
                if not st:
                    if _capturing():
                        raise RuntimeError(
                            "CapturableAdamW: the optimizer state does not exist yet and a "
                            "graph is being captured. State created during capture would be "
                            "re-initialised by every replay. Run at least one eager step "
                            "(warmup_steps >= 1) or call opt.init_state() before capturing.")
                    st["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
                    st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)

    @torch.no_grad()
    def step(self, closure: Callable | None = None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.init_state()
        skip = self.skip_if
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            grads = [p.grad for p in params]
            states = [self.state[p] for p in params]
            m = [s["exp_avg"] for s in states]
            v = [s["exp_avg_sq"] for s in states]
            steps = [s["step"] for s in states]
            lr, (beta1, beta2) = group["lr"], group["betas"]
            eps, wd = group["eps"], group["weight_decay"]
            if skip is not None:            # keep the old values to restore on skip
                old = [torch._foreach_mul(ts, 1.0) for ts in (params, m, v)]
            torch._foreach_add_(steps, 1.0)
            if wd != 0:
                torch._foreach_mul_(params, 1.0 - lr * wd)
            torch._foreach_lerp_(m, grads, 1.0 - beta1)
            torch._foreach_mul_(v, beta2)
            torch._foreach_addcmul_(v, grads, grads, value=1.0 - beta2)
            # Bias corrections from the step *tensor*: no host read, so capturable.
            bc1 = [1.0 - torch.pow(beta1, s) for s in steps]
            bc2_sqrt = [torch.sqrt(1.0 - torch.pow(beta2, s)) for s in steps]
            denom = torch._foreach_sqrt(v)
            torch._foreach_div_(denom, bc2_sqrt)
            torch._foreach_add_(denom, eps)
            step_size = [lr / b for b in bc1]                  # lr / (1 - beta1**step)
            update = torch._foreach_div(m, denom)
            torch._foreach_mul_(update, step_size)
            torch._foreach_sub_(params, update)
            if skip is not None:
                for new_list, old_list in zip((params, m, v), old):
                    for new, prev in zip(new_list, old_list):
                        new.copy_(torch.where(skip, prev, new))
                torch._foreach_sub_(steps, [skip.to(s.dtype) for s in steps])
        return loss


def make_capturable_optimizer(params, B, lr: float = 1e-3,
                              betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                              weight_decay: float = 1e-2, impl: str = "auto", **kw):
    """An AdamW that can be captured: torch's ``AdamW(capturable=True, foreach=True)`` on a
    GPU, :class:`CapturableAdamW` on the emulator.

    ``impl``: ``"auto"`` (the above), ``"torch"`` (GPU only) or ``"labkit"`` (both;
    needed for ``skip_if``, which torch's foreach AdamW does not take).
    """
    if impl == "auto":
        impl = "torch" if B.name == "cuda" else "labkit"
    if impl == "torch":
        if B.name != "cuda":
            raise ValueError("torch's AdamW(capturable=True) runs on CUDA devices only; "
                             "use impl='labkit' (CapturableAdamW) on the emulator")
        return torch.optim.AdamW(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                 capturable=True, foreach=True, **kw)
    if impl == "labkit":
        return CapturableAdamW(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                               **kw)
    raise ValueError(f"impl must be 'auto', 'torch' or 'labkit', got {impl!r}")


# ---- the step function ----------------------------------------------------------------------

def forward_backward(model: nn.Module, loss_fn: Callable, microbatches: Sequence) -> torch.Tensor:
    """The forward and backward of every microbatch, in order; returns the mean loss.

    This is the function a whole-step graph captures (Megatron's
    ``forward_backward_func`` with no pipeline: forward, backward, next microbatch). Each
    microbatch's loss is scaled by ``1/M`` before ``backward`` so the accumulated grads
    are those of the mean loss over the step. The returned loss is detached: in a graph
    it is the static output that every replay overwrites.
    """
    n = len(microbatches)
    if n == 0:
        raise ValueError("forward_backward got 0 microbatches: a step needs at least one")
    total = None
    for mb in microbatches:
        loss = loss_fn(model, mb) / n
        loss.backward()
        total = loss.detach() if total is None else total + loss.detach()
    return total


def nonfinite_flag(found_inf: torch.Tensor, values: torch.Tensor | Sequence[torch.Tensor]) -> None:
    """``found_inf |= any value is inf or NaN``, in place and without reading anything on the
    host: graph-safe. Read ``found_inf`` after replay (one sync, where you choose), never
    branch on it inside the captured step."""
    if not isinstance(found_inf, torch.Tensor) or found_inf.dtype != torch.bool:
        raise TypeError(f"found_inf must be a bool tensor, got "
                        f"{getattr(found_inf, 'dtype', type(found_inf).__name__)}: make it "
                        "with torch.zeros((), dtype=torch.bool, device=...)")
    if isinstance(values, torch.Tensor):
        values = [values]
    norms = torch._foreach_norm(list(values))       # inf/NaN anywhere -> inf/NaN norm
    bad = ~torch.isfinite(torch.stack(norms).sum())
    found_inf.logical_or_(bad)


def phase(iteration: int, warmup_steps: int, captured: bool) -> str:
    """What a whole-step wrapper does at ``iteration``: ``"eager"``, ``"capture"``
    (then replay, in the same iteration) or ``"replay"``."""
    if iteration < warmup_steps:
        return "eager"
    return "replay" if captured else "capture"


# ---- the wrappers ---------------------------------------------------------------------------

def _check_count(name: str, value, minimum: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


class FullCudaGraphWrapper:
    """Run ``step_fn()`` eagerly ``warmup_steps`` times, capture it at the next call, and
    replay it from then on (Megatron's ``FullCudaGraphWrapper.__call__``).

    ``step_fn`` takes no arguments: it reads its inputs from static buffers (see
    :class:`StaticBatchLoader`), which is what makes it capturable. Each call returns
    ``step_fn``'s result: a fresh value during warm-up, then the graph's static output,
    the *same* tensors on every call, overwritten in place by each replay (``clone()``
    what you want to keep).

    * ``pool``: the memory pool to capture into; share it with the optimizer graph
      (``B.graph_pool_handle()``, Megatron's ``use_single_mempool``).
    * ``stream``: warm-up steps and the capture run on it (a side stream, as lesson 02
      does); replays run on the caller's stream.
    * ``generators``: custom ``torch.Generator``\\ s the step draws from, registered with
      the graph (the default generator is registered by CUDA graphs themselves).
    """

    def __init__(self, step_fn: Callable[[], Any], B, warmup_steps: int = 2, pool=None,
                 stream=None, generators: Iterable[torch.Generator] = (),
                 capture_error_mode: str = "thread_local", name: str = "step"):
        _check_count("warmup_steps", warmup_steps, minimum=0)
        if capture_error_mode not in ("global", "thread_local", "relaxed"):
            raise ValueError(f"capture_error_mode must be 'global', 'thread_local' or "
                             f"'relaxed', got {capture_error_mode!r}")
        self.step_fn = step_fn
        self.B = B
        self.warmup_steps = warmup_steps
        self.pool = pool
        self.stream = stream if stream is not None else B.Stream()
        self.generators = list(generators)
        self.capture_error_mode = capture_error_mode
        self.name = name
        self.graph = None
        self.result = None
        self.curr_iteration = 0
        self.captured_at: int | None = None
        self.calls = {"eager": 0, "capture": 0, "replay": 0}

    def _on_stream(self, fn):
        with on_side_stream(self.B, self.stream):
            return fn()

    def capture(self) -> None:
        """Capture ``step_fn`` into a new graph (records; computes nothing).

        A capture that raises leaves no graph and a usable process (default stream
        current, random ops allowed again); the error propagates unchanged.
        """
        B = self.B
        g = B.CUDAGraph()
        for gen in self.generators:
            g.register_generator_state(gen)
        B.synchronize()                 # the barrier before: nothing in flight is captured
        self.result = None              # a capture that raises leaves no result
        with cleanup_on_failure(B), own_cublas_workspace(B, g, self.pool), B.graph(
                g, pool=self.pool, stream=self.stream,
                capture_error_mode=self.capture_error_mode):
            self.result = self.step_fn()
        B.synchronize()                 # the barrier after: the capture has fully ended
        self.graph = g
        if self.pool is None:
            self.pool = g.pool()
        self.captured_at = self.curr_iteration
        self.calls["capture"] += 1

    def __call__(self):
        what = phase(self.curr_iteration, self.warmup_steps, self.graph is not None)
        if what == "eager":
            self.result = self._on_stream(self.step_fn)
            self.calls["eager"] += 1
        else:
            if what == "capture":
                self.capture()      # records the step, computes nothing...
            self.graph.replay()     # ...so this iteration replays too
            self.calls["replay"] += 1
        self.curr_iteration += 1
        return self.result

    def reset(self) -> None:
        """Drop the graph; the next call captures again (e.g. after the shapes change)."""
        if self.graph is not None:
            self.graph.reset()
        self.graph, self.result, self.captured_at = None, None, None
        self.curr_iteration = self.warmup_steps


class OptimizerCudaGraphWrapper(FullCudaGraphWrapper):
    """``optimizer.step()`` as a second graph, captured at the same step as the
    forward-backward graph and in the same pool (Megatron's ``OptimizerCudaGraphWrapper``).

    The optimizer must be capturable (see :func:`make_capturable_optimizer`). Replay it
    right after the forward-backward graph, the order in which the two were captured:
    graphs that share a pool are only safe when replayed in capture order.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, B, warmup_steps: int = 2, pool=None,
                 stream=None, **kw):
        self.optimizer = optimizer
        super().__init__(optimizer.step, B, warmup_steps, pool=pool, stream=stream,
                         name="optimizer", **kw)


class FullStepTrainer:
    """A training step as two graphs: forward+backward of all microbatches, then AdamW.

    ::

        trainer = FullStepTrainer(model, lm_loss, make_capturable_optimizer(...), B,
                                  num_microbatches=4, warmup_steps=2)
        for batch in data:                 # batch: a list of 4 microbatches
            loss = trainer.step(batch)     # eager, eager, capture+replay, replay, ...

    Each step: ``loader.load(batch)`` copies the data into the static buffers, then the
    forward-backward wrapper (zero grads in place, forward + backward of every
    microbatch, optionally the ``found_inf`` check) and the optimizer wrapper run: eagerly
    during warm-up, as graph replays after. Both graphs share one pool and one capture
    stream. The returned loss is the graph's static output after capture.

    ``check_finite=True`` keeps ``trainer.found_inf`` (a bool tensor) up to date *inside*
    the graph: true when any gradient of this step is inf or NaN. Read it after the step
    (``trainer.found_inf.item()``: one sync, outside the graph). With a
    :class:`CapturableAdamW` built with ``skip_if=trainer.found_inf`` (see
    ``skip_nonfinite``) such a step leaves the weights untouched, decided on the device.

    Misuse is refused before anything is captured, with what was given and what to do:
    ``num_microbatches`` < 1, an optimizer whose ``capturable`` is False, microbatches of
    the wrong count, structure or shape, token ids outside the model's vocabulary (checked
    on every step for tokens on the CPU; for tokens already on the GPU, on the eager and
    capturing steps only, since a check there costs a sync). A capture that fails anyway
    leaves no graph and a usable process.

    .. warning::
       The cuBLAS workspace. Both graphs are captured on the stream the warm-up ran on,
       where cuBLAS has already cached a workspace from the general memory pool. A
       ``torch.compile(mode="reduce-overhead")`` model frees every cached workspace around
       its warm-up and recording (cudagraph trees' ``clear_cublas_manager``); a graph that
       recorded the old workspace then writes into freed memory (seen on an H200 with
       torch 2.11 as "an illegal memory access was encountered", which poisons the CUDA
       context). So the capture first drops the cached workspaces, and the graph gets
       its own, from its pool (see :func:`labkit.capture.own_cublas_workspace`).
    """

    def __init__(self, model: nn.Module, loss_fn: Callable, optimizer: torch.optim.Optimizer,
                 B, num_microbatches: int, warmup_steps: int = 2, check_finite: bool = False,
                 found_inf: torch.Tensor | None = None,
                 generators: Iterable[torch.Generator] = ()):
        _check_count("num_microbatches", num_microbatches)
        _check_count("warmup_steps", warmup_steps, minimum=0)
        _check_capturable(optimizer, B)
        if warmup_steps == 0:
            _state_before_capture(optimizer)
        self.model, self.loss_fn, self.optimizer, self.B = model, loss_fn, optimizer, B
        self.vocab_size = _vocab_size(model)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.grads = ensure_grads(self.params)
        self.check_finite = check_finite or found_inf is not None
        self.found_inf = (found_inf if found_inf is not None
                          else torch.zeros((), dtype=torch.bool, device=B.device))
        self.stream = B.Stream()                    # one capture stream for both graphs
        self.pool = B.graph_pool_handle()           # one pool for both graphs
        self.loader = StaticBatchLoader(B, num_microbatches, stream=B.Stream())
        self.fwd_bwd = FullCudaGraphWrapper(self._forward_backward, B, warmup_steps,
                                            pool=self.pool, stream=self.stream,
                                            generators=generators, name="forward_backward")
        self.opt_step = OptimizerCudaGraphWrapper(optimizer, B, warmup_steps, pool=self.pool,
                                                  stream=self.stream)

    @classmethod
    def skip_nonfinite(cls, model, loss_fn, B, num_microbatches, warmup_steps=2, **adam_kw):
        """A trainer whose :class:`CapturableAdamW` skips steps with inf/NaN gradients."""
        flag = torch.zeros((), dtype=torch.bool, device=B.device)
        params = [p for p in model.parameters() if p.requires_grad]
        opt = CapturableAdamW(params, skip_if=flag, **adam_kw)
        return cls(model, loss_fn, opt, B, num_microbatches, warmup_steps, found_inf=flag)

    def _forward_backward(self) -> torch.Tensor:
        torch._foreach_zero_(self.grads)            # in place: same addresses every step
        loss = forward_backward(self.model, self.loss_fn, self.loader.buffers)
        if self.check_finite:
            self.found_inf.zero_()
            nonfinite_flag(self.found_inf, self.grads)
        return loss

    @property
    def iteration(self) -> int:
        return self.fwd_bwd.curr_iteration

    @property
    def captured(self) -> bool:
        return self.fwd_bwd.graph is not None

    @property
    def graphs(self) -> list:
        return [g for g in (self.fwd_bwd.graph, self.opt_step.graph) if g is not None]

    def _check_batch(self, microbatches) -> None:
        n = self.loader.num_microbatches
        if not isinstance(microbatches, (list, tuple)):
            raise TypeError(f"step() expects a list of {n} microbatches, got a "
                            f"{type(microbatches).__name__}")
        if len(microbatches) != n:
            raise ValueError(f"step() got {len(microbatches)} microbatches, the trainer was "
                             f"built with num_microbatches={n} (the captured schedule has a "
                             "fixed count): pass exactly that many")
        if self.loss_fn is not lm_loss:
            return
        for i, mb in enumerate(microbatches):
            if not isinstance(mb, (tuple, list)) or len(mb) != 2:
                what = (f"a {type(mb).__name__} of {len(mb)}" if isinstance(mb, (tuple, list))
                        else f"a {type(mb).__name__}")
                raise ValueError(f"microbatch {i} is {what}; lm_loss needs a pair "
                                 "(tokens, targets) for every microbatch")
            tokens, targets = mb
            if tokens.shape != targets.shape:
                raise ValueError(f"microbatch {i}: targets {tuple(targets.shape)} for tokens "
                                 f"{tuple(tokens.shape)}: every token needs its target")
            if self.vocab_size is None:
                continue
            check_values = tokens.device.type == "cpu" or not self.captured
            if not check_values:
                continue
            for name, t in (("tokens", tokens), ("targets", targets)):
                if t.numel() == 0:
                    continue
                lo, hi = (int(v) for v in torch.aminmax(t))
                if lo < 0 or hi >= self.vocab_size:
                    bad = lo if lo < 0 else hi
                    raise ValueError(
                        f"microbatch {i}: {name} hold the id {bad}, outside the model's "
                        f"vocabulary [0, {self.vocab_size}). A bad id would index past the "
                        "embedding (on a GPU: a device-side assert that ends the process). "
                        "Fix the data or build the model with a larger vocab_size.")

    def step(self, microbatches: Sequence) -> torch.Tensor:
        """One training step on ``microbatches``; returns the step's mean loss."""
        self._check_batch(microbatches)
        self.loader.load(microbatches)
        loss = self.fwd_bwd()
        self.opt_step()
        return loss


def _check_capturable(optimizer, B) -> None:
    """Refuse, before any capture, an optimizer whose ``step()`` cannot be captured."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got "
                        f"{type(optimizer).__name__}")
    if isinstance(optimizer, CapturableAdamW):
        return
    name = type(optimizer).__name__
    flags = [g.get("capturable") for g in optimizer.param_groups]
    if all(f is None for f in flags):
        return                      # an optimizer without the flag: its own business
    if not all(flags):
        fix = (f"build it with {name}(..., capturable=True)" if B.name == "cuda" else
               "on the emulator use FS.make_capturable_optimizer(params, B) "
               "(CapturableAdamW): torch's capturable=True needs a CUDA device")
        raise ValueError(
            f"{name} has capturable=False: its step count lives on the host and its bias "
            "corrections are Python floats, which a graph would bake in (torch refuses "
            f"such a step in capture). {fix[0].upper() + fix[1:]}, or use "
            "FS.make_capturable_optimizer(params, B).")
    if B.name != "cuda":
        raise ValueError(
            f"{name}(capturable=True) runs on CUDA devices only; on the emulator use "
            "FS.make_capturable_optimizer(params, B), which gives CapturableAdamW")


def _state_before_capture(optimizer) -> None:
    """With no eager warm-up step, the optimizer's state must exist before the capture."""
    if isinstance(optimizer, CapturableAdamW):
        optimizer.init_state()
        return
    stateful = any("capturable" in g or g.get("momentum", 0) for g in optimizer.param_groups)
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if stateful and any(not optimizer.state.get(p) for p in params):
        raise ValueError(
            f"warmup_steps=0, and the state of {type(optimizer).__name__} does not exist yet: "
            "the first step would create it inside the capture, and every replay would "
            "reset it to zeros (silently wrong training). Use warmup_steps >= 1, or run one "
            "eager optimizer step first.")


def _vocab_size(model: nn.Module) -> int | None:
    cfg = getattr(model, "cfg", None)
    if isinstance(cfg, LMConfig):
        return cfg.vocab_size
    for m in model.modules():
        if isinstance(m, nn.Embedding):
            return m.num_embeddings
    return None


class EagerTrainer:
    """The reference: the same step without graphs (``zero_grad``, forward and backward of
    every microbatch, ``optimizer.step()``), with ``torch.optim.AdamW`` by default."""

    def __init__(self, model: nn.Module, loss_fn: Callable,
                 optimizer: torch.optim.Optimizer | None = None, **adam_kw):
        self.model, self.loss_fn = model, loss_fn
        self.optimizer = optimizer or torch.optim.AdamW(model.parameters(), **adam_kw)

    def step(self, microbatches: Sequence) -> torch.Tensor:
        self.optimizer.zero_grad(set_to_none=False)
        loss = forward_backward(self.model, self.loss_fn, microbatches)
        self.optimizer.step()
        return loss

