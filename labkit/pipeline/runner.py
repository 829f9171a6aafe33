"""Which graph runner serves a call: the per-layer manager of Megatron's ``local`` path.

A :class:`CudaGraphManager` sits where a layer is called (Megatron hooks it into
``GraphableMegatronModule.__call__``, ``module.py``) and owns that layer's
:class:`~labkit.bridge.GraphRunner` objects (``CudaGraphManager``,
``megatron/core/transformer/cuda_graphs.py`` at e03878b5f). It has two phases, switched by the
shared :class:`~labkit.pipeline.record.GlobalRecord`:

* **record** (step 1, ``record.created`` is False): run the layer eagerly, put a
  :class:`~labkit.pipeline.record.RecordNode` on its outputs, and append the runner's
  first forward to the record (``record_graph_capture``);
* **replay** (after ``record.create_cudagraphs``): pick a runner and replay its graphs
  through the bridge (``replay_graph_capture``).

How many runners a layer needs depends on how many microbatches are in flight through
it (``reuse_cudagraphs = pp.size() == 1``; ``get_cudagraph_runner``):

* **PP == 1** (``reuse=True``): each microbatch's backward finishes before the next
  forward, so one runner per layer serves every microbatch; a new runner is made only
  if no existing one is ready for a forward with matching arguments;
* **PP > 1** (``reuse=False``): under 1F1B a layer runs forwards for microbatches
  ``m+1, m+2...`` before the backward of ``m``, and each needs its own static buffers. Step
  1 makes one runner per call (one per microbatch); later steps take them first-in
  first-out, which hands microbatch ``m`` the runner created for microbatch ``m``.

A graph replay does not run module hooks, so before a replay Megatron calls the layer's
DDP pre-forward hook (the async parameter all-gather) by hand and refuses any other
pre-forward hook (``call_ddp_preforward_hook``). Here a hook is allowed when
it is marked ``hook.graph_safe = True`` (see :func:`graph_safe`).
"""

from __future__ import annotations

from typing import Callable, Iterable

import torch

from labkit.backend import ensure
from labkit.bridge import ArgMeta, GraphRunner, GraphStatus, mismatch_errors
from labkit.pipeline.record import GlobalRecord, RecordNode, RunnerRecord

__all__ = ["CudaGraphManager", "graph_layers", "graph_safe"]


def graph_safe(hook: Callable) -> Callable:
    """Mark a forward pre-hook as one the manager may call by hand before a replay (like
    Mcore DDP's parameter all-gather hook): it must only launch work, not change what the
    layer computes."""
    if not callable(hook):
        raise TypeError(f"graph_safe marks a forward pre-hook function, got "
                        f"{type(hook).__name__}")
    hook.graph_safe = True
    return hook


def _check_manager_args(layer, record, reuse) -> None:
    if not isinstance(layer, torch.nn.Module):
        raise TypeError(f"CudaGraphManager wraps a torch.nn.Module (its parameters get the "
                        f"wgrads), got {type(layer).__name__}")
    if not isinstance(record, GlobalRecord):
        raise TypeError(f"record must be a GlobalRecord() shared by every manager of the "
                        f"model, got {type(record).__name__}")
    if not isinstance(reuse, bool):
        raise TypeError(f"reuse must be True (PP == 1: one runner per layer) or False "
                        f"(PP > 1: one runner per microbatch in flight), got {reuse!r}")


class CudaGraphManager(torch.nn.Module):
    """Wraps one layer: records in step 1, replays its runners afterwards.

    ``record`` is shared by every manager of the model (one per process, as in
    Megatron). ``reuse`` chooses PP == 1 behaviour (one runner per layer) or PP > 1
    (one runner per in-flight microbatch, FIFO). ``runner_kw`` goes to each
    :class:`~labkit.bridge.GraphRunner`.
    """

    def __init__(self, layer: torch.nn.Module, B, record: GlobalRecord, *, reuse: bool = True,
                 name: str | None = None, **runner_kw):
        super().__init__()
        _check_manager_args(layer, record, reuse)
        self.layer = layer
        self.B = ensure(B)
        self.record = record
        self.reuse = reuse
        self.name = name or type(layer).__name__
        self.runner_kw = runner_kw
        self.runners: list[GraphRunner] = []   # in the order get_runner will take them
        self.recorded: dict[GraphRunner, RunnerRecord] = {}   # what step 1 recorded
        self.replay_log: list[int] = []        # index of the runner each replay used

    def extra_repr(self) -> str:
        return f"name={self.name!r}, reuse={self.reuse}, runners={len(self.runners)}"

    def _new_runner(self) -> GraphRunner:
        index = len(self.runners)
        r = GraphRunner(self.layer, self.B, name=f"{self.name}#{index}", **self.runner_kw)
        self.runners.append(r)
        self.recorded[r] = RunnerRecord(r, index)
        return r

    def get_runner(self, args) -> GraphRunner:
        """The runner for this call (Megatron's ``get_cudagraph_runner``)."""
        created = self.record.created
        if created and not self.runners:
            raise RuntimeError(
                f"{self.name}: the graphs were created, but this layer was not called in "
                "step 1, so nothing was recorded for it. Call every graphed layer in the "
                "recorded step, or record again with a new GlobalRecord.")
        if self.reuse:
            metas = None
            for r in self.runners:
                if r.status != GraphStatus.FWD_READY:
                    continue
                metas = r.arg_metas if created else self.recorded[r].arg_metas
                if not mismatch_errors(metas, args):
                    return r
            if created:
                raise RuntimeError(self._no_runner_message(args))
            return self._new_runner()
        if created:
            r = self.runners[0]
            if r.status != GraphStatus.FWD_READY:
                raise RuntimeError(
                    f"{self.name}: more microbatches in flight than step 1 had runners for "
                    f"({len(self.runners)}): every runner is still waiting for its backward. "
                    "Run later steps with the same schedule and number of microbatches as "
                    "step 1, or record again with a new GlobalRecord.")
            self.runners = self.runners[1:] + self.runners[:1]     # first in, first out
            return r
        return self._new_runner()

    def _no_runner_message(self, args) -> str:
        ready = [r for r in self.runners if r.status == GraphStatus.FWD_READY]
        msg = (f"{self.name}: the graphs exist, but none of its {len(self.runners)} runners "
               f"can take this forward.")
        if not ready:
            return msg + (" Every runner's backward is still due: a forward before the "
                          "previous microbatch's backward needs one runner per microbatch in "
                          "flight (reuse=False), or run this forward under torch.no_grad().")
        lines = mismatch_errors(ready[0].arg_metas, args)
        return msg + (" The arguments differ from the ones captured (graphs were created "
                      "for step 1's shapes; record again with a new GlobalRecord for "
                      "others):\n  " + "\n  ".join(lines))

    def call_pre_forward_hooks(self, args) -> None:
        """Run the layer's graph-safe pre-forward hooks by hand (a replay would skip them);
        refuse any other hook (Megatron's ``call_ddp_preforward_hook``)."""
        for hook in self.layer._forward_pre_hooks.values():
            if not getattr(hook, "graph_safe", False):
                raise RuntimeError(
                    f"{self.name} has a forward pre-hook ({getattr(hook, '__name__', hook)}) "
                    "that a graph replay would not run. Only hooks marked graph_safe (such "
                    "as a data-parallel parameter all-gather) are called by hand.")
            hook(self.layer, args)

    def forward(self, *args, **kwargs):
        if kwargs:
            raise TypeError(f"{self.name}: a graphed layer takes positional arguments only "
                            f"(graphs are captured from positional sample arguments), got "
                            f"keyword argument(s) {', '.join(kwargs)}; pass them positionally")
        runner = self.get_runner(args)
        if self.record.created:
            self.call_pre_forward_hooks(args)
            self.replay_log.append(self.recorded[runner].index)
            return runner(*args)
        return self._record_call(runner, args)      # eager: the layer runs its own hooks

    def _record_call(self, runner: GraphRunner, args):
        """Step 1: run eagerly, mark the outputs, record the first forward."""
        out = self.layer(*args)
        single = isinstance(out, torch.Tensor)
        outs = (out,) if single else tuple(out)
        diff = [i for i, o in enumerate(outs) if isinstance(o, torch.Tensor) and o.requires_grad]
        state = self.recorded[runner]
        if torch.is_grad_enabled() and diff:
            marked = RecordNode.apply(state, self.record, *[outs[i] for i in diff])
            marked = (marked,) if len(diff) == 1 else marked
            outs = list(outs)
            for i, m in zip(diff, marked):
                outs[i] = m
            outs = tuple(outs)
            runner.status = GraphStatus.BWD_READY
        if not state.fwd_recorded:
            state.arg_metas = [ArgMeta.of(a) for a in args]
            self.record.record_fwd(runner, state.arg_metas)
            state.fwd_recorded = True
        return outs[0] if single else outs


def graph_layers(layers: Iterable[torch.nn.Module], B, record: GlobalRecord, *, reuse: bool,
                 prefix: str = "layer", **kw) -> list[CudaGraphManager]:
    """One manager per layer, sharing ``record``; names ``layer0``, ``layer1``..."""
    if isinstance(layers, torch.nn.Module) and not isinstance(
            layers, (torch.nn.ModuleList, torch.nn.Sequential)):
        raise TypeError(f"graph_layers takes a list of layers, got one "
                        f"{type(layers).__name__}: write graph_layers([layer], ...)")
    return [CudaGraphManager(layer, B, record, reuse=reuse, name=f"{prefix}{i}", **kw)
            for i, layer in enumerate(layers)]
