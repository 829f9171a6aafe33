"""The benchmark variants, declared once: what each suite times, in the order it is shown.

A variant is one :class:`Variant` record: its suite, its name (the ``variant`` of a result
row), one line saying what it runs, and, where it cannot run without a GPU, why. The suite
modules build the variants they declare (their ``VARIANTS`` default and ``GPU_ONLY`` come
from here), :func:`labkit.bench.make_row` refuses a row of an undeclared variant, and
:mod:`labkit.bench.report` orders the tables and plots by the declaration order (it
replaces the ``VARIANT_ORDER`` table) and describes each suite with :data:`SUITE_TEXT`.

.. warning::
    A variant name is data in ``docs/benchmarks/results.json``: renaming or removing a
    declared variant makes the committed rows of that name unrenderable
    (:class:`UndeclaredVariant`). Add a new name instead; declare it here before a suite
    records it.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Variant", "UndeclaredVariant", "DECLARED", "SUITE_ORDER", "SUITE_TEXT",
           "declared", "names", "variant", "rank", "check_names", "defaults", "gpu_only"]

SUITE_ORDER = ("launch", "decode", "serve", "train", "capture", "piecewise", "tp")


# the paragraph above each suite's table in docs/benchmarks/README.md
SUITE_TEXT = {
    "launch": (
        "Launch cost: a chain of 100 dependent tiny adds (256 floats each), eager vs one "
        "graph replay. `median_us` is the whole chain; per kernel = median / 100. Lesson 01."),
    "decode": (
        "Decode step of an 8-layer, d=512, 8-head fp16 GPT (`labkit.decode`) at batch sizes "
        "1, 8, 64, each row timed two ways in one run: **synced** = the device synchronized "
        "before every call (a loop that needs each step's tokens on the host; the *synced* "
        "column), **back to back** = 50 calls between two events, no sync between them (a "
        "loop whose next input stays on the device). `eager` = `EagerRunner` with stock "
        "torch attention (gather + SDPA), `eager_triton` = with the Triton decode kernel; "
        "`reference_eager` = the baseline's model (below) run eagerly, a plain model's eager "
        "step; "
        "`labkit_graph` = `DecodeGraphRunner` (pad to bucket, fill static buffers, page "
        "table out of graph, replay, slice) with the Triton kernel; "
        "`*_staged` = the same graphs through the serving loop's path: `runner.stage(...)` "
        "from host ints (one pinned buffer, one non-blocking copy) + `replay_staged()`; "
        "`labkit_graph_torch_attn` = the same runner with stock torch attention; "
        "`labkit_graph_compiled` = the model compiled (`mode=\"default\"`, no cudagraphs) "
        "then captured by the runner (SGLang's compile-then-capture); "
        "`compile_reduce_overhead` = `torch.compile(mode=\"reduce-overhead\")` on labkit's "
        "eager path; `compile_reduce_overhead_static` = the baseline to beat: the same "
        "weights in gpt-fast's shape (dense KV cache as buffers, positions on the device, "
        "SDPA) under `torch.compile(mode=\"reduce-overhead\")`, one callable per batch "
        "size (`labkit.bench.reference`). Floors (in *notes*, drawn on the plot): "
        "`bytes_floor_us` = weights + KV entries in use ÷ the measured copy bandwidth; "
        "`kernel_floor_us` = the call's kernels × the measured time per node of a graph of "
        "tiny kernels. Lesson 06."),
    "serve": (
        "`labkit.decode.serve` over a seeded workload (Poisson arrivals, prompts and "
        "outputs of varied length, up to 64 requests at once) on the decode suite's model: "
        "*synced* = the median decode step of the loop (host wall clock); notes: decode "
        "tokens/s over the run, end-to-end tokens/s. `_overlap` = `serve(..., "
        "overlap=True)`: the next step is staged with one copy and queued before the last "
        "step's tokens are read back; an admission's first token stays on the device too. "
        "`_piecewise` = admissions prefilled through a `PiecewiseGraphRunner` "
        "(`serve(..., prefill=...)`, token buckets up to 256, one Triton attention kernel "
        "per layer). Notes also hold `gpu_busy_fraction`: GPU busy time of one profiled run "
        "over the median wall time of the rounds. Variants that run the same kernels are "
        "checked to generate the same tokens (the plain graphs against `eager`, the "
        "compiled pair against each other; a piecewise row records the share of requests "
        "whose tokens equal its family's without piecewise prefill). Lesson 06."),
    "train": (
        "One training step of a 6-layer, d=256 transformer LM, 4 microbatches of 4×64 "
        "tokens, AdamW (`labkit.full_step`, config \"bench\"): eager; `labkit_bridge` = "
        "per-layer fwd/bwd graphs from `labkit.bridge` (lesson 04), each weight gradient "
        "cloned as Megatron does; `labkit_bridge_no_clone` = the same returning the static "
        "buffers (`clone_wgrads=False`), as torch's function does; "
        "`torch_make_graphed_callables` = the same per layer with torch's function "
        "(these two train wrongly: under gradient accumulation `.grad` aliases a static "
        "buffer the next replay overwrites, pytorch#181723; `max_abs_diff_vs_eager` in the "
        "notes is each variant's largest weight difference from eager after the same steps); "
        "`labkit_full_step` = fwd+bwd of all microbatches as one graph + AdamW(capturable) "
        "as a second (lesson 07); `labkit_full_step_compiled` = the same around "
        "`torch.compile(model)` (compile-then-capture); `compile_reduce_overhead` = the "
        "model under `torch.compile(mode=\"reduce-overhead\")`. Synced and back to back "
        "(20 steps) as for decode. Batch size = sequences per microbatch."),
    "capture": (
        "Capturing N graphs one after another (the forward of each of 6 transformer layers, "
        "fp16, batch × 64 tokens): `median_us` = capture time per graph; `extra` = pool "
        "memory after all captures, one shared pool vs a private pool per graph. Lesson 05. "
        "`decode_runner_*`: every SGLang bucket of max_bs=256 (batch column) for the decode "
        "model, captured largest first into one pool by `DecodeGraphRunner` with each "
        "attention backend; `median_us` = time per bucket (2 warm-ups + capture), `extra` = "
        "graphs, total seconds, pool memory. Lesson 06."),
    "piecewise": (
        "Prefill and mixed prefill + decode batches on the decode suite's model, one table "
        "row per workload (config column: its prompt lengths and decode requests; batch = "
        "requests): `eager` = `EagerRunner` (every request's queries padded into one SDPA per "
        "layer); `piecewise` = "
        "`PiecewiseGraphRunner` (the pieces between attentions replayed per token bucket, "
        "vLLM's sizes; attention eager on the real tokens, one Triton kernel per layer "
        "(`attention=\"auto\"`) in rows from 2026-12-03 17:00 on, stock torch ops "
        "before); `compile_dynamic` = the model "
        "under `torch.compile(dynamic=True)`; `full_graph` = lesson 06's "
        "`DecodeGraphRunner`, for the pure decode batch only. GPU busy = the union of the "
        "call's kernel intervals. Lesson 09."),
    "tp": (
        "A decode step of the decode suite's model split tensor-parallel over N GPUs "
        "(`labkit.tp`: column-parallel QKV and MLP-up, row-parallel output and MLP-down, two "
        "NCCL all-reduces per layer), one process per GPU: `eager` / `labkit_graph` = the "
        "1-rank model (lesson 06's runner); `tpN_eager` / `tpN_graph` = the split model, "
        "eager or replayed with its all-reduces inside the graph (config `ranks`). Rank 0's "
        "times, all ranks timing the same variants in the same rounds. `tp1_*`: one NCCL "
        "rank, the cost of the collective alone. Lesson 10."),
}


@dataclass(frozen=True)
class Variant:
    """One benchmark variant of one suite.

    Args:
        suite: the suite that times it (one of :data:`SUITE_ORDER`).
        name: the ``variant`` of its rows.
        text: what it runs, one line.
        gpu_only: why it cannot run without a GPU (the ``SuiteSkip`` message), or None.
        staged_of: for a variant timed on another variant's runner through
            ``stage()`` + ``replay_staged()`` (decode's ``*_staged``), that variant's name;
            such a variant is built with it, never asked for by itself.
        options: ``(key, value)`` pairs the suite's code builds the variant from (read
            with :meth:`option`), e.g. serve's ``overlap``, decode's ``attention``.
    """

    suite: str
    name: str
    text: str
    gpu_only: str | None = None
    staged_of: str | None = None
    options: tuple = ()

    def option(self, key: str, default=None):
        """The value of one of :attr:`options`, ``default`` where the variant sets none."""
        return dict(self.options).get(key, default)


class UndeclaredVariant(ValueError):
    """A row, a request or an ordering named a variant that :data:`DECLARED` lacks."""


def _v(suite, *specs) -> tuple[Variant, ...]:
    """Records from ``(name, text[, gpu_only[, staged_of]][, {options}])`` tuples."""
    out = []
    for spec in specs:
        if isinstance(spec, Variant):
            out.append(spec)
            continue
        opts = spec[-1] if isinstance(spec[-1], dict) else {}
        args = spec[:-1] if opts else spec
        out.append(Variant(suite, *args, options=tuple(opts.items())))
    return tuple(out)


_REDUCE = "reduce-overhead records CUDA graphs only on a GPU"
_COMPILED = "compiling before capture is measured on a GPU only"
_TP = tuple(v for n in (1, 2, 4, 8) for v in (
    Variant("tp", f"tp{n}_eager", f"the model split over {n} rank(s), all-reduces issued "
                                  "one by one"),
    Variant("tp", f"tp{n}_graph", f"the model split over {n} rank(s), all-reduces inside "
                                  "the graphs")))

DECLARED: dict[str, tuple[Variant, ...]] = {
    "launch": _v("launch",
                 ("eager", "a chain of 100 tiny dependent adds, launched one by one"),
                 ("graph", "the same chain captured once, one graph replay")),
    "decode": _v("decode",
                 ("eager", "EagerRunner.forward with stock torch attention (gather + SDPA)",
                  {"runs": "eager", "attention": "torch_native"}),
                 ("eager_triton", "EagerRunner.forward with the Triton decode kernel",
                  "the Triton kernel needs CUDA", {"runs": "eager", "attention": "triton"}),
                 ("reference_eager", "ReferenceGPT (gpt-fast's shape) run eagerly",
                  {"runs": "reference"}),
                 ("labkit_graph", "DecodeGraphRunner.forward: pad, fill, metadata, replay, "
                                  "slice", {"runs": "graph", "attention": "auto"}),
                 ("labkit_graph_staged", "labkit_graph's graphs through stage() + "
                                         "replay_staged()", None, "labkit_graph"),
                 ("labkit_graph_torch_attn", "DecodeGraphRunner with stock torch attention",
                  {"runs": "graph", "attention": "torch_native"}),
                 ("labkit_graph_compiled", "the model compiled (no cudagraphs), then captured "
                                           "by the runner",
                  "compiling before capture is measured on a GPU only",
                  {"runs": "graph", "attention": "auto", "compiled": True}),
                 ("labkit_graph_compiled_staged", "labkit_graph_compiled's graphs through "
                                                  "stage() + replay_staged()",
                  None, "labkit_graph_compiled"),
                 ("compile_reduce_overhead", "EagerRunner.forward, the model under "
                                             "torch.compile(mode='reduce-overhead')", _REDUCE,
                  {"runs": "compile"}),
                 ("compile_reduce_overhead_static", "ReferenceGPT under torch.compile("
                                                    "mode='reduce-overhead'), one callable "
                                                    "per batch size", _REDUCE,
                  {"runs": "reference", "compiled": True})),
    "serve": _v("serve",
                ("eager", "serve() with EagerRunner", {"runs": "eager"}),
                ("labkit_graph", "serve() with DecodeGraphRunner", {"runs": "graph"}),
                ("labkit_graph_overlap", "serve(..., overlap=True): the next step staged "
                                         "before the last one's tokens are read",
                 {"runs": "graph", "overlap": True}),
                ("labkit_graph_overlap_piecewise", "the overlapped loop, admissions "
                                                   "prefilled through a PiecewiseGraphRunner",
                 {"runs": "graph", "overlap": True, "piecewise": True}),
                ("labkit_graph_compiled", "serve() with the compiled-then-captured runner",
                 _COMPILED, {"runs": "graph", "compiled": True}),
                ("labkit_graph_compiled_overlap", "the compiled-then-captured runner, "
                                                  "overlapped", _COMPILED,
                 {"runs": "graph", "compiled": True, "overlap": True})),
    "train": _v("train",
                ("eager", "the training step, eagerly"),
                ("labkit_bridge", "per-layer graphs through labkit's autograd bridge"),
                ("labkit_bridge_no_clone", "labkit_bridge without cloning weight gradients"),
                ("torch_make_graphed_callables", "per-layer graphs through "
                                                 "torch.cuda.make_graphed_callables"),
                ("labkit_full_step", "forward, backward and AdamW as one graph"),
                ("labkit_full_step_compiled", "labkit_full_step with the model compiled "
                                              "before capture", _COMPILED),
                ("compile_reduce_overhead", "torch.compile(mode='reduce-overhead') on the "
                                            "step", _REDUCE)),
    "capture": _v("capture",
                  ("separate_pools", "a chain of graphs, each in its own memory pool",
                   {"shared": False}),
                  ("shared_pool", "the same graphs sharing one pool", {"shared": True}),
                  ("decode_runner_torch_native", "DecodeGraphRunner.capture() with stock "
                                                 "torch attention",
                   {"attention": "torch_native"}),
                  ("decode_runner_triton", "DecodeGraphRunner.capture() with the Triton "
                                           "kernel", {"attention": "triton"})),
    "piecewise": _v("piecewise",
                    ("eager", "the model eagerly on mixed prefill/decode batches"),
                    ("piecewise", "PiecewiseGraphRunner: graphs around attention"),
                    ("compile_dynamic", "torch.compile(dynamic=True) on the model",
                     "torch.compile is measured on a GPU only"),
                    ("full_graph", "one full graph per token bucket")),
    "tp": _v("tp",
             ("eager", "the 1-rank model eagerly, on each rank's GPU"),
             ("labkit_graph", "the 1-rank model through DecodeGraphRunner"),
             *_TP),
}


def declared(suite: str) -> tuple[Variant, ...]:
    """The variants of ``suite``, in the order tables and plots show them."""
    if suite not in DECLARED:
        raise UndeclaredVariant(f"unknown bench suite {suite!r}: the declared suites are "
                                f"{', '.join(SUITE_ORDER)} (labkit/bench/variants.py)")
    return DECLARED[suite]


def names(suite: str) -> tuple[str, ...]:
    """The names of ``suite``'s declared variants, in order."""
    return tuple(v.name for v in declared(suite))


def variant(suite: str, name: str) -> Variant:
    """The declared record of ``name`` in ``suite``; :class:`UndeclaredVariant` naming
    the variant, the suite and the declared ones otherwise."""
    for v in declared(suite):
        if v.name == name:
            return v
    raise UndeclaredVariant(f"undeclared bench variant {name!r} in suite {suite!r}: the "
                            f"declared ones are {', '.join(names(suite))}; declare it in "
                            "labkit/bench/variants.py before recording rows of it")


def rank(suite: str, name: str) -> int:
    """Where ``name`` sorts among ``suite``'s variants (its declaration order)."""
    return names(suite).index(variant(suite, name).name)


def check_names(suite: str, requested) -> tuple[str, ...]:
    """``requested`` as a tuple, each name checked to be a declared variant of ``suite``
    that can be asked for (not a ``staged_of`` variant, which comes with its runner)."""
    out = tuple(requested)
    for name in out:
        v = variant(suite, name)
        if v.staged_of is not None:
            raise UndeclaredVariant(f"variant {name!r} of suite {suite!r} is timed with "
                                    f"{v.staged_of!r} (the same runner through stage()): ask "
                                    f"for {v.staged_of!r} instead")
    return out


def defaults(suite: str) -> tuple[str, ...]:
    """The variants a suite builds when none are named: every declared one but those timed
    with another's runner."""
    return tuple(v.name for v in declared(suite) if v.staged_of is None)


def gpu_only(suite: str) -> dict[str, str]:
    """``{name: why}`` for ``suite``'s variants that cannot run without a GPU."""
    return {v.name: v.gpu_only for v in declared(suite) if v.gpu_only}
