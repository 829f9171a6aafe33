"""Whole-step capture: the forward and backward of every microbatch as one graph, the
optimizer step as a second graph in the same pool (lesson 07; Megatron-LM's
``full_iteration`` CUDA graph, which excludes the optimizer step, plus its opt-in
``--optimizer-cuda-graph`` for that step).

Once captured, a training step is ``loader.load(batch)`` and two ``replay()`` calls.
Everything takes a backend ``B`` (``labkit.backend.get(...)``), so the same code runs on a
GPU and on labkit's CPU emulator. Names follow Megatron's ``megatron/core/full_cuda_graph.py``
and ``optimizer_cuda_graph.py``:

==================================  =================================================
labkit                              Megatron
==================================  =================================================
:class:`StaticBatchLoader`          ``StaticBufferLoader``
:class:`FullCudaGraphWrapper`       ``FullCudaGraphWrapper``
:class:`OptimizerCudaGraphWrapper`  ``OptimizerCudaGraphWrapper``
:func:`forward_backward`            ``forward_backward_func`` (no pipeline)
:class:`FullStepTrainer`            the wiring in ``training.py`` (``train``)
==================================  =================================================

Modules: :mod:`.loader` (static inputs), :mod:`.optimizer` (grads at fixed addresses,
torch's AdamW built to be captured), :mod:`.step` (the captured step), :mod:`.wrapper`
(warm up, capture, replay), :mod:`.trainer` (the two graphs wired together). The model
lesson 07 trains (``TinyLM`` and friends) lives in :mod:`labkit.core.models` and is
re-exported here.
"""

from labkit.core.models import (
    CONFIGS,
    Block,
    LMConfig,
    TinyLM,
    build_lm,
    lm_loss,
    random_microbatches,
)

from .loader import StaticBatchLoader, fill_static_buffers
from .optimizer import (
    check_found_inf,
    ensure_grads,
    make_capturable_optimizer,
    require_optimizer_state,
)
from .step import forward_backward, nonfinite_flag, phase
from .trainer import EagerTrainer, FullStepTrainer
from .wrapper import FullCudaGraphWrapper, OptimizerCudaGraphWrapper

__all__ = [
    "LMConfig", "CONFIGS", "Block", "TinyLM", "build_lm", "lm_loss", "random_microbatches",
    "StaticBatchLoader", "fill_static_buffers",
    "ensure_grads", "make_capturable_optimizer", "check_found_inf", "require_optimizer_state",
    "forward_backward", "nonfinite_flag", "phase",
    "FullCudaGraphWrapper", "OptimizerCudaGraphWrapper", "FullStepTrainer", "EagerTrainer",
]
