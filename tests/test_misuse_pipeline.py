"""Misuse of labkit.pipeline (lesson 05's engine): each case asserts the error type and the
words that make the message clear, or the correct result (issue 11). Tests that take
``B`` also run on a GPU (``pytest -m cuda``)."""

import re

import pytest
import torch
from helpers import assert_usable

from labkit.guards import error_text
from labkit.pipeline import schedule as S
from labkit.pipeline.models import make_blocks
from labkit.pipeline.record import GlobalRecord, reorder
from labkit.pipeline.runner import CudaGraphManager, graph_layers
from labkit.pipeline.step import Stage, split_stages, train_step
from labkit.pipeline.te_style import TEStyleLayer, make_te_style_layers, zero_grads_in_place

pytestmark = pytest.mark.usefixtures("one_thread")

SHAPE = (2, 4, 16)


def _blocks(B, n=2):
    return make_blocks(n, seed=0, hidden=16, heads=2, ffn=32, device=B.device)


def _data(B, M):
    g = torch.Generator().manual_seed(1)
    return ([torch.randn(SHAPE, generator=g).to(B.device) for _ in range(M)],
            [torch.randn(SHAPE, generator=g).to(B.device) for _ in range(M)])



# ---- schedules --------------------------------------------------------------------------------

@pytest.mark.parametrize("fn", [S.one_f_one_b, S.gpipe])
def test_schedules_need_a_stage_and_a_microbatch(fn):
    with pytest.raises(ValueError, match=re.escape("M (the number of microbatches) must be "
                                                   ">= 1, got 0")):
        fn(2, 0)
    with pytest.raises(ValueError, match=re.escape("P (the number of pipeline stages) must "
                                                   "be >= 1, got -1")):
        fn(-1, 4)
    with pytest.raises(TypeError, match=re.escape("P (the number of pipeline stages) must be "
                                                  "an int >= 1, got 2.0 (float)")):
        fn(2.0, 4)
    with pytest.raises(TypeError, match=re.escape("must be an int >= 1, got True (bool)")):
        fn(2, True)


def test_num_warmup_microbatches_stage_range():
    with pytest.raises(ValueError, match=re.escape("stage must be in 0..1, got 2: there are "
                                                   "P=2 stages")):
        S.num_warmup_microbatches(2, 4, 2)
    assert S.num_warmup_microbatches(2, 4, 0) == 1


@pytest.mark.parametrize("order, exc, words", [
    ([("f", 0), ("b", 0)], ValueError, "order[0] is ('f', 0): each op must be ('F', m) or "
                                       "('B', m)"),
    ([("F", 0), ("B", 0), ("F", 0)], ValueError, "order[2]: F0 appears twice"),
    ([("B", 0), ("F", 0)], ValueError, "order[0]: B0 comes before F0"),
    ([("F", -1)], ValueError, "m a microbatch index >= 0"),
    ("F0 B0", TypeError, "order must be a list of ('F', m) / ('B', m) pairs"),
])
def test_max_in_flight_refuses_a_malformed_order(order, exc, words):
    with pytest.raises(exc, match=re.escape(words)):
        S.max_in_flight(order)


def test_simulate_and_plot_arguments():
    with pytest.raises(TypeError, match="orders must be a non-empty list with one order per "
                                        "stage"):
        S.simulate([])
    with pytest.raises(ValueError, match=re.escape("orders[1][0] is ('X', 0)")):
        S.simulate([[("F", 0), ("B", 0)], [("X", 0)]])
    with pytest.raises(ValueError, match="t_fwd must be a positive number of time units, "
                                         "got 0"):
        S.simulate(S.one_f_one_b(2, 2), t_fwd=0)
    with pytest.raises(ValueError, match=re.escape("needs the non-empty list of events that "
                                                   "simulate(orders) returns")):
        S.plot_schedule([])


# ---- train_step -------------------------------------------------------------------------------

def _stages(B, P=2):
    return split_stages(list(_blocks(B, 2)), P)


@pytest.mark.parametrize("schedule, words", [
    ("1F1B", "unknown schedule '1F1B': choose one of '1f1b', 'gpipe'. Did you mean '1f1b'? "
             "Names are lower case."),
    ("GPipe", "Did you mean 'gpipe'?"),
    ("1f1b ", "Did you mean '1f1b'?"),
    ("zigzag", "unknown schedule 'zigzag': choose one of '1f1b', 'gpipe'."),
    (None, "unknown schedule None"),
    (["1f1b"], "unknown schedule ['1f1b']"),
])
def test_schedule_names_are_a_fixed_set(B, schedule, words):
    xs, ts = _data(B, 2)
    trace = []
    with pytest.raises(ValueError, match=re.escape(words)):
        train_step(_stages(B), xs, ts, schedule=schedule, trace=trace)
    assert trace == []                       # refused before anything ran


def test_gpipe_schedule_runs_gpipe(B):
    xs, ts = _data(B, 3)
    trace = []
    train_step(_stages(B), xs, ts, schedule="gpipe", trace=trace)
    stage0 = [(k, m) for s, k, m in trace if s == 0]
    assert stage0 == S.gpipe(2, 3)[0]


@pytest.mark.parametrize("n_inputs, n_targets, exc, words", [
    (3, 2, ValueError, "3 input microbatches but 2 targets; give one target per microbatch"),
    (2, 3, ValueError, "2 input microbatches but 3 targets"),
    (0, 0, ValueError, "needs at least one microbatch: inputs is empty"),
])
def test_microbatch_counts(B, n_inputs, n_targets, exc, words):
    xs, _ = _data(B, n_inputs)
    _, ts = _data(B, n_targets)
    with pytest.raises(exc, match=re.escape(words)):
        train_step(_stages(B), xs, ts)


def test_other_train_step_arguments(B):
    xs, ts = _data(B, 2)
    st = _stages(B)
    with pytest.raises(TypeError, match=re.escape("inputs must be a list (one entry per "
                                                  "microbatch), got one Tensor of shape "
                                                  "(2, 4, 16); for one microbatch write [x]")):
        train_step(st, xs[0], ts)
    with pytest.raises(TypeError, match=re.escape("inputs[1] is a float, not a tensor")):
        train_step(st, [xs[0], 1.0], ts)
    with pytest.raises(ValueError, match="at least one stage"):
        train_step([], xs, ts)
    with pytest.raises(ValueError, match=re.escape("needs the backend: pass B=B")):
        train_step(st, xs, ts, record=GlobalRecord())
    with pytest.raises(TypeError, match="record must be a GlobalRecord, got dict"):
        train_step(st, xs, ts, record={}, B=B)
    with pytest.raises(TypeError, match="create_graphs is a dict of keyword arguments"):
        train_step(st, xs, ts, record=GlobalRecord(), B=B, create_graphs="shared")
    with pytest.raises(TypeError, match="trace must be a list to append to, got tuple"):
        train_step(st, xs, ts, trace=())


def test_split_stages_and_stage(B):
    layers = list(_blocks(B, 2))
    with pytest.raises(ValueError, match=re.escape("cannot split 2 layers into 3 stages: each "
                                                   "stage needs at least one layer, so P must "
                                                   "be in 1..2")):
        split_stages(layers, 3)
    with pytest.raises(TypeError, match=re.escape("P (the number of stages) must be an int "
                                                  ">= 1, got '2' (str)")):
        split_stages(layers, "2")
    with pytest.raises(TypeError, match=re.escape("Stage takes a list of layers, got one "
                                                  "TransformerBlock: write Stage([layer])")):
        Stage(layers[0])
    with pytest.raises(TypeError, match=re.escape("layers[1] is a int, not a module")):
        Stage([layers[0], 3])


# ---- the record and its managers --------------------------------------------------------------

def test_create_cudagraphs_options(B):
    rec = GlobalRecord()
    with pytest.raises(ValueError, match=re.escape("unknown pool 'Shared': choose one of "
                                                   "'shared', 'per_graph'")):
        rec.create_cudagraphs(B, pool="Shared")
    with pytest.raises(ValueError, match="a pool handle is not accepted here"):
        rec.create_cudagraphs(B, pool=B.graph_pool_handle())
    with pytest.raises(TypeError, match=re.escape("B must be the backend namespace that "
                                                  "labkit.backend.get() returns, got str "
                                                  "'cuda': write B = labkit.backend.get('cuda')")):
        rec.create_cudagraphs("cuda")
    with pytest.raises(ValueError, match="nothing was recorded.*graph_layers"):
        rec.create_cudagraphs(B)
    with pytest.raises(ValueError, match=re.escape("unknown order 'recoded': choose one of "
                                                   "'recorded', 'grouped', 'torch'")):
        reorder([], "recoded")
    assert not rec.created


def test_manager_arguments(B):
    layer = _blocks(B, 1)[0]
    with pytest.raises(TypeError, match=re.escape("reuse must be True (PP == 1: one runner "
                                                  "per layer) or False")):
        CudaGraphManager(layer, B, GlobalRecord(), reuse="yes")
    with pytest.raises(TypeError, match="record must be a GlobalRecord"):
        CudaGraphManager(layer, B, None)
    with pytest.raises(TypeError, match="wraps a torch.nn.Module .*got function"):
        CudaGraphManager(lambda x: x, B, GlobalRecord())
    m = CudaGraphManager(layer, B, GlobalRecord())
    with pytest.raises(TypeError, match=re.escape("keyword argument(s) x; pass them "
                                                  "positionally")):
        m(x=torch.randn(SHAPE, device=B.device))


def test_managers_after_creation_name_what_differs(B):
    rec = GlobalRecord()
    calls = graph_layers(_blocks(B, 2), B, rec, reuse=True, num_warmup=1)
    unused = CudaGraphManager(_blocks(B, 1)[0], B, rec, name="unused")
    xs, ts = _data(B, 1)
    train_step(split_stages(calls, 1), xs, ts, record=rec, B=B)
    with pytest.raises(RuntimeError, match=r"(?s)arguments differ from the ones captured.*"
                                           r"received shape \(2, 5, 16\), captured \(2, 4, 16\)"):
        calls[0](torch.randn(2, 5, 16, device=B.device))
    with pytest.raises(RuntimeError, match="was not called in step 1, so nothing was "
                                           "recorded for it"):
        unused(xs[0])


# ---- TE-style graphs --------------------------------------------------------------------------

@pytest.mark.parametrize("slots, exc, words", [
    (0, ValueError, "num_slots (graph slots per layer, >= microbatches in flight) must be >= 1"
                    ", got 0"),
    (1.5, TypeError, "num_slots (graph slots per layer, >= microbatches in flight) must be an "
                     "int >= 1, got 1.5 (float)"),
])
def test_te_style_slot_count(B, slots, exc, words):
    with pytest.raises(exc, match=re.escape(words)):
        make_te_style_layers(list(_blocks(B, 1)), torch.zeros(SHAPE, device=B.device), B,
                             slots)


def test_te_style_other_arguments(B):
    layers = list(_blocks(B, 1))
    x = torch.zeros(SHAPE, device=B.device)
    with pytest.raises(ValueError, match="layers is empty"):
        make_te_style_layers([], x, B, 1)
    with pytest.raises(TypeError, match=re.escape("got one TransformerBlock: write [layer]")):
        make_te_style_layers(layers[0], x, B, 1)
    with pytest.raises(TypeError, match="sample_input must be a tensor of the stage's input "
                                        "shape, got tuple"):
        make_te_style_layers(layers, SHAPE, B, 1)
    with pytest.raises(ValueError, match="sample_input is on meta"):
        make_te_style_layers(layers, torch.zeros(SHAPE, device="meta"), B, 1)
    with pytest.raises(TypeError, match=re.escape("pass model.parameters()")):
        zero_grads_in_place(layers[0])
    with pytest.raises(ValueError, match="at least one graphed callable"):
        TEStyleLayer(layers[0], [])


def _te_run(B, slots, *, P=2, M=4, steps=2, first_grad=True, drive=None):
    blocks = _blocks(B, 4)
    sample = torch.zeros(SHAPE, device=B.device)
    stages = [Stage(make_te_style_layers(st.layers, sample, B, slots,
                                         first_input_requires_grad=first_grad and s > 0,
                                         num_warmup_iters=1))
              for s, st in enumerate(split_stages(list(blocks), P))]
    opt = torch.optim.SGD(blocks.parameters(), lr=0.1)
    for _ in range(steps):
        zero_grads_in_place(blocks.parameters())
        (drive or train_step)(stages, *_data(B, M))
        opt.step()
    return [p.detach().clone() for p in blocks.parameters()]


def test_te_style_with_too_few_slots_is_refused_before_running(B):
    """It used to run, with gradients up to 0.148 off eager (as issue 11 measured), silently."""
    with pytest.raises(ValueError, match=re.escape(
            "stage 0 holds up to 2 microbatches in flight under this schedule, but its "
            "TE-style layers have num_slots=1") + ".*" + re.escape("num_slots >= "
                                                                   "max_in_flight(order) = 2")):
        _te_run(B, 1)


def test_te_style_layer_refuses_a_busy_slot(B):
    """Outside train_step (no up-front check) the layer itself refuses the replay."""
    def f0_f1(stages, xs, ts):
        layer = stages[0].layers[0]
        layer.set_current_microbatch(0)
        y0 = layer(xs[0])
        with torch.no_grad():                 # a forward without backward: no slot taken
            layer.set_current_microbatch(1)
            layer(xs[1])
        layer.set_current_microbatch(1)
        with pytest.raises(RuntimeError, match=re.escape(
                "microbatch 1 needs graph slot 0 (= 1 % 1), but that slot's backward for "
                "microbatch 0 has not run yet") + ".*num_slots >= max_in_flight"):
            layer(xs[1])
        y0.sum().backward()                   # the slot is free again
        layer(xs[1]).sum().backward()
        del y0
        layer.set_current_microbatch(2)
        layer(xs[2])                          # dropped without backward: freed with its graph
        layer.set_current_microbatch(3)
        layer(xs[3]).sum().backward()

    _te_run(B, 1, steps=1, drive=f0_f1)


def test_te_style_refuses_an_input_requiring_grad_its_sample_did_not(B):
    """Stage 1's input requires grad; built without first_input_requires_grad, torch's graphed
    callable would hand stage 0 no gradient and stage 0 would never train."""
    with pytest.raises(RuntimeError, match=re.escape("first_input_requires_grad=True")):
        _te_run(B, 2, first_grad=False, steps=1)


def test_te_style_with_enough_slots_equals_eager(B):
    def eager():
        blocks = _blocks(B, 4)
        opt = torch.optim.SGD(blocks.parameters(), lr=0.1)
        for _ in range(2):
            zero_grads_in_place(blocks.parameters())
            train_step(split_stages(list(blocks), 2), *_data(B, 4))
            opt.step()
        return [p.detach().clone() for p in blocks.parameters()]

    torch.testing.assert_close(_te_run(B, 2), eager())


# ---- a failed capture leaves a usable process (both backends) ------------------------------

class _HostRead(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(16, 16)

    def forward(self, x):
        return self.lin(x) * float(x.sum().item())     # eager: fine; captured: refused


def test_failed_record_creation_leaves_a_usable_process(B):
    before = B.current_stream()
    rec = GlobalRecord()
    calls = graph_layers([_HostRead().to(B.device)], B, rec, reuse=True, num_warmup=1)
    xs, ts = _data(B, 1)
    with pytest.raises(RuntimeError) as err:
        train_step(split_stages(calls, 1), xs, ts, record=rec, B=B)
    assert "operation not permitted when stream is capturing" in error_text(err.value)
    assert not rec.created
    assert_usable(B, before)


def test_failed_te_style_capture_leaves_a_usable_process(B):
    before = B.current_stream()
    with pytest.raises(RuntimeError) as err:
        make_te_style_layers([_HostRead().to(B.device)], torch.zeros(SHAPE, device=B.device),
                             B, 1, num_warmup_iters=1)
    assert "operation not permitted when stream is capturing" in error_text(err.value)
    assert_usable(B, before)


# ---- the rest of the package ------------------------------------------------------------------

def test_a_stage_that_cuts_the_graph_is_named(B):
    """A layer that detaches its input: the stages before it would never train."""
    blocks = _blocks(B, 2)
    stages = [Stage([blocks[0]]), Stage([lambda x: x.detach(), blocks[1]])]
    with pytest.raises(RuntimeError, match=re.escape("stage 1 computed no gradient for its "
                                                     "input of microbatch 0, so stages 0..0 "
                                                     "would never train")):
        train_step(stages, *_data(B, 2))


@pytest.mark.parametrize("kw, exc, words", [
    ({"P": 3, "layers": 2}, ValueError, "layers=2 cannot fill P=3 stages"),
    ({"M": 0}, ValueError, "PipelineConfig.M must be >= 1, got 0"),
    ({"hidden": 30}, ValueError, "hidden=30 must be a multiple of the 4 attention heads"),
    ({"lr": 0}, ValueError, "lr must be a positive number, got 0"),
    ({"backend": "gpu"}, ValueError, "unknown backend 'gpu': choose one of 'auto', 'cuda', "
                                     "'emulated'"),
    ({"steps": "3"}, TypeError, "PipelineConfig.steps must be an int >= 1, got '3' (str)"),
    ({"graphs": "no"}, TypeError, "graphs must be True or False, got 'no'"),
])
def test_pipeline_config(kw, exc, words):
    from labkit.pipeline.distributed import PipelineConfig

    with pytest.raises(exc, match=re.escape(words)):
        PipelineConfig(**kw)


def test_run_pipeline_arguments():
    from labkit.pipeline.distributed import PipelineConfig, run_pipeline

    with pytest.raises(TypeError, match="run_pipeline takes a PipelineConfig, got dict"):
        run_pipeline({"P": 2})
    with pytest.raises(ValueError, match="unknown dist_backend 'mpi': choose 'gloo', 'nccl'"):
        run_pipeline(PipelineConfig(backend="emulated"), dist_backend="mpi")
    with pytest.raises(ValueError, match="timeout must be a positive number of seconds"):
        run_pipeline(PipelineConfig(backend="emulated"), timeout=0)


def test_partially_graphed_moe_arguments(B):
    from labkit.pipeline.moe import PartiallyGraphedMoE

    with pytest.raises(TypeError, match=r"needs a module with route\(\) \(graphed\) and "
                                        r"dispatch\(\) \(eager\), like ToyMoE; got Linear"):
        PartiallyGraphedMoE(torch.nn.Linear(16, 16), B, torch.zeros(SHAPE, device=B.device))


def _recorded_run(B, Ms, *, P, reuse, graphs=True):
    blocks = _blocks(B, 4)
    rec = GlobalRecord()
    calls = graph_layers(blocks, B, rec, reuse=reuse, num_warmup=1) if graphs else list(blocks)
    stages = split_stages(calls, P)
    opt = torch.optim.SGD(blocks.parameters(), lr=0.1)
    for M in Ms:
        opt.zero_grad()
        train_step(stages, *_data(B, M), record=rec if graphs else None, B=B)
        opt.step()
    return [p.detach().clone() for p in blocks.parameters()]


def test_a_later_step_of_another_shape_is_refused(B):
    """With one runner per microbatch (PP > 1) in one shared pool, a step with fewer
    microbatches used to replay the graphs out of their recorded order: parameters ~0.005
    off eager after the next step, silently."""
    with pytest.raises(ValueError, match=re.escape(
            "recorded from a step of P=2 stages, M=4 microbatches, schedule '1f1b'; this "
            "step has P=2, M=2") + ".*" + re.escape("record again with a new GlobalRecord")):
        _recorded_run(B, [4, 2], P=2, reuse=False)


def test_pp1_steps_may_change_the_microbatch_count(B):
    """One runner per layer (reuse=True): each microbatch replays fwd then bwd, in order."""
    torch.testing.assert_close(_recorded_run(B, [3, 2, 3], P=1, reuse=True),
                               _recorded_run(B, [3, 2, 3], P=1, reuse=True, graphs=False))


def test_graph_layers_takes_a_list(B):
    with pytest.raises(TypeError, match=re.escape("got one TransformerBlock: write "
                                                  "graph_layers([layer], ...)")):
        graph_layers(_blocks(B, 1)[0], B, GlobalRecord(), reuse=True)


def test_a_backend_name_where_the_namespace_belongs(B):
    layer = _blocks(B, 1)[0]
    words = re.escape("must be the backend namespace that labkit.backend.get() returns, got "
                      "str 'emulated': write B = labkit.backend.get('emulated')")
    with pytest.raises(TypeError, match=words):
        CudaGraphManager(layer, "emulated", GlobalRecord())
    with pytest.raises(TypeError, match=words):
        make_te_style_layers([layer], torch.zeros(SHAPE, device=B.device), "emulated", 1)
    with pytest.raises(TypeError, match=words):
        train_step(_stages(B), *_data(B, 1), record=GlobalRecord(), B="emulated")


@pytest.mark.parametrize("kw, exc, words", [
    ({"hidden": 30, "heads": 4}, ValueError, "hidden=30 must be a multiple of heads=4"),
    ({"dropout": 1.0}, ValueError, "dropout is a probability in [0, 1), got 1.0"),
    ({"heads": 0}, ValueError, "heads must be >= 1, got 0"),
    ({"generator": 0}, TypeError, "generator must be a torch.Generator or None, got int"),
])
def test_toy_model_arguments(kw, exc, words):
    from labkit.pipeline.models import TransformerBlock

    with pytest.raises(exc, match=re.escape(words)):
        TransformerBlock(**kw)


def test_toy_model_helpers():
    from labkit.pipeline.models import CallCounter
    from labkit.pipeline.moe import ToyMoE
    from labkit.pipeline.runner import graph_safe

    with pytest.raises(ValueError, match=re.escape("n (the number of blocks) must be >= 1, "
                                                   "got 0")):
        make_blocks(0)
    with pytest.raises(TypeError, match="CallCounter wraps a module, got function"):
        CallCounter(lambda x: x)
    with pytest.raises(ValueError, match="topk=3 cannot exceed experts=2"):
        ToyMoE(experts=2, topk=3)
    with pytest.raises(TypeError, match="graph_safe marks a forward pre-hook function, got str"):
        graph_safe("hook")
    with pytest.raises(ValueError, match=re.escape("orders[0][0] is ('F', 'x')")):
        S.describe([[("F", "x")]])


def test_pp1_manager_refuses_a_second_forward_before_the_backward(B):
    rec = GlobalRecord()
    calls = graph_layers(_blocks(B, 1), B, rec, reuse=True, num_warmup=1)
    xs, ts = _data(B, 2)
    train_step(split_stages(calls, 1), xs[:1], ts[:1], record=rec, B=B)
    y = calls[0](xs[0])
    with pytest.raises(RuntimeError, match=re.escape("Every runner's backward is still due: "
                                                     "a forward before the previous "
                                                     "microbatch's backward needs one runner "
                                                     "per microbatch in flight (reuse=False)")):
        calls[0](xs[1])
    y.sum().backward()
    calls[0](xs[1]).sum().backward()              # in turn: fine
