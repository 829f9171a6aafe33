"""labkit.speculative under misuse (issue 29 §3): each wrong input is an error that names what
was given, what was expected and what to do, never a silent wrong acceptance or a traceback
from the command line. Cases already in tests/test_speculative.py (runner and generate
arguments) are not repeated.
"""

from __future__ import annotations

import re
import sys

import pytest
import torch

from labkit import backend
from labkit.decode import build_model
from labkit.speculative import (
    DraftGraphRunner,
    draft_layers,
    format_table,
    graph_savings,
    greedy_accept,
    make_draft,
    measure,
)

pytestmark = pytest.mark.usefixtures("one_thread")
V = 128


def _raises(err, words, call):
    with pytest.raises(err, match=re.escape(words)):
        call()


def _ids(*shape, device="cpu"):
    return torch.zeros(shape, dtype=torch.int64, device=device)


# ---- greedy_accept -------------------------------------------------------------------------


def test_logits_without_the_newest_row_are_refused_not_reshaped():
    """Before: 6 rows for bs 2, k 3 were viewed as (2, 4, 96): a vocabulary of 96 and a wrong
    acceptance, silently."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(8, V, generator=g)
    drafts = logits.view(2, 4, V).argmax(-1)[:, :3]       # every draft agrees: accept 3 each
    assert greedy_accept(drafts, logits)[0].tolist() == [3, 3]
    _raises(ValueError, "greedy_accept: target_logits has shape (6, 128); for bs=2 requests of "
                        "k=3 draft tokens it must be (8, vocab): bs * (k + 1) rows, the logits "
                        "of [newest, d1, ..., dk] of each request in that order. Pass the verify "
                        "step's logits whole (the newest token's row included)",
            lambda: greedy_accept(drafts, logits[[1, 2, 3, 5, 6, 7]]))


@pytest.mark.parametrize("drafts, logits, err, words", [
    (_ids(3), torch.randn(4, V), ValueError,
     "draft_tokens must be (bs, k), one row of k draft tokens per request, got shape (3,): for "
     "one request pass draft_tokens.view(1, -1)"),
    (torch.zeros(2, 3), torch.randn(8, V), TypeError,
     "draft_tokens must hold token ids (an integer tensor, the draft's argmax), got "
     "torch.float32"),
    (_ids(2, 3), torch.randn(2, 4, V), ValueError,
     "target_logits has shape (2, 4, 128); for bs=2 requests of k=3 draft tokens it must be "
     "(8, vocab)"),
    (_ids(2, 3), _ids(8, V), TypeError,
     "target_logits must be the target's logits (floating point), got torch.int64"),
    ([[1, 2]], torch.randn(3, V), TypeError,
     "greedy_accept: draft_tokens must be a tensor on the device, got list"),
    (_ids(1, 2), [[0.5] * 4] * 3, TypeError, "target_logits must be a tensor on the device"),
])
def test_greedy_accept_inputs(drafts, logits, err, words):
    """Before: "not enough values to unpack", silent float comparisons, AttributeError."""
    _raises(err, words, lambda: greedy_accept(drafts, logits))


def test_greedy_accept_on_two_devices(E):
    """Before: torch's "Expected all tensors to be on the same device"."""
    _raises(ValueError, "draft_tokens is on cpu, target_logits on emu:0: both come from the "
                        "device", lambda: greedy_accept(_ids(2, 3), torch.randn(8, V,
                                                                                 device=E.device)))


# ---- the draft and its runner ----------------------------------------------------------------


def test_draft_layers_needs_a_model():
    """Before: AttributeError 'object' object has no attribute 'layers'."""
    _raises(TypeError, "draft_layers(draft): model must be a labkit.decode Transformer with "
                       "caches set up (build_model(...)), got object",
            lambda: draft_layers(object()))


@pytest.mark.parametrize("bs, err, words", [
    ("2", TypeError, "DraftGraphRunner.can_run: bs must be an int >= 0, got '2' (str): the "
                     "number of requests"),
    (-1, ValueError, "bs must be >= 0, got -1"),
])
def test_draft_runner_can_run_takes_a_count(E, bs, err, words):
    """Before: can_run('2') answered False (eager) without a word."""
    target = build_model("tiny", max_requests=2, device=E.device, dtype=torch.float32)
    runner = DraftGraphRunner(make_draft(target, n_layer=1), E, 2)
    _raises(err, words, lambda: runner.can_run(bs))


# ---- measure: checked before anything runs ---------------------------------------------------

_FAST = {"batch_size": 1, "num_steps": 2, "max_new_tokens": 4, "noises": (0.0,), "rounds": 1}


@pytest.mark.parametrize("kw, err, words", [
    ({"num_steps": 70}, ValueError,
     "measure: num_steps must be in 1..62, got 70: a round verifies k + 1 tokens and drafts up "
     "to position p + k, within the target's max_seq_len=64"),
    ({"num_steps": 0}, ValueError, "measure: num_steps must be >= 1, got 0"),
    ({"noises": 0.1}, TypeError,
     "measure: noises must be a list of noise levels, one draft each, e.g. (0.0, 0.1), got 0.1 "
     "(float)"),
    ({"noises": (0.0, -0.5)}, ValueError,
     "measure: noises[1] = -0.5: each noise level is a finite number >= 0"),
    ({"noises": (float("nan"),)}, ValueError, "noises[0] = nan"),
    ({"modes": "eager"}, TypeError,
     "measure: modes must be a tuple of mode names, e.g. ('eager', 'graphed') or ('graphed',), "
     "got 'eager' (str)"),
    ({"modes": ("eager", "cuda")}, ValueError, "modes must be a non-empty subset of"),
    ({"draft_layers": 5}, ValueError,
     "measure: draft_layers must be in 1..2, got 5: the draft keeps the first blocks of the "
     "target's 2"),
    ({"prompt_len": 40, "max_new_tokens": 32}, ValueError,
     "measure: a request needs prompt_len + max_new_tokens - 1 + num_steps = 40 + 32 - 1 + 2 = "
     "73 positions, more than the target's max_seq_len=64: lower one of them"),
    ({"max_new_tokens": 0}, ValueError, "measure: max_new_tokens must be >= 1, got 0"),
    ({"rounds": 0}, ValueError, "measure: rounds must be >= 1, got 0: a verdict wants at least 5"),
])
def test_measure_checks_before_it_runs(E, kw, err, words, monkeypatch):
    """Before: num_steps=70 failed in the verify runner ("num_tokens_per_bs must be in 1..64")
    after the plain runs, noises=0.1 with "'float' object is not iterable", modes='eager' as
    ('e', 'a', 'g', 'e', 'r'), draft_layers and the prompt only after the plain runs."""
    M = sys.modules["labkit.speculative.measure"]      # the module (the package exports the
                                                       # function under the same name)
    def no_runs(*a, **k):
        raise AssertionError("a run started before the arguments were checked")
    monkeypatch.setattr(M, "DecodeGraphRunner", no_runs)
    _raises(err, words, lambda: measure(E, **{**_FAST, **kw}))


@pytest.mark.parametrize("call, err, words", [
    (lambda: format_table([{"a": 1, "b": 2}], "ab"), TypeError,
     "format_table: columns must be a list of column names (str), got 'ab': e.g. ['method', "
     "'mode', 'tokens_per_s']"),
    (lambda: format_table({"a": 1}), TypeError,
     "format_table: rows must be a list of dicts (the rows measure() returns), got dict: wrap "
     "one row as [row]"),
    (lambda: format_table([{"a": 1}, 3]), TypeError,
     "format_table: rows[1] is 3 (int), not a dict"),
    (lambda: graph_savings([{"a": 1}]), ValueError,
     "graph_savings: rows[0] lacks 'batch', 'tail_scale', 'method', 'draft', 'mode', 'round_ms'"),
])
def test_tables_of_rows(call, err, words):
    """Before: a table of the characters of 'ab' as columns, silently; KeyError 0; KeyError
    'batch'."""
    _raises(err, words, call)


def test_tables_still_print_measure_rows():
    rows = [{"batch": 1, "tail_scale": 1.0, "method": "greedy", "draft": "-", "mode": m,
             "round_ms": t, **{f"{p}_ms": None for p in ("draft", "verify", "accept", "host")}}
            for m, t in (("eager", 2.0), ("graphed", 1.0))]
    assert graph_savings(rows)[0]["saved_ms"] == 1.0
    assert format_table(rows, ["mode", "round_ms"]).splitlines()[2] == "| eager | 2 |"
    assert format_table([]) == "(no rows)"


# ---- the command line ---------------------------------------------------------------------


@pytest.mark.parametrize("argv, words", [
    (["--num-steps", "70"],
     "argument --num-steps: 70 draft tokens do not fit the tiny target's max_seq_len=64 (a round "
     "drafts up to position p + k and verifies k + 1 tokens): use 1..62"),
    (["--prompt-len", "60"],
     "--prompt-len 60 + --max-new-tokens 32 - 1 + --num-steps 4 = 95 positions, more than the "
     "tiny target's max_seq_len=64: lower one of them"),
    (["--config", "small", "--num-steps", "255"], "use 1..254"),
])
def test_cli_refuses_what_does_not_fit(argv, words, capsys):
    """Before: ``--num-steps 70`` ran the plain decodes, then ended in a traceback about
    num_tokens_per_bs; ``--prompt-len 60`` in one from greedy_generate."""
    from labkit.speculative.__main__ import main
    with pytest.raises(SystemExit) as e:
        main(["--backend", "emulated", *argv])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert words in err and "Traceback" not in err, err


def test_cli_largest_k_that_fits_runs(capsys):
    from labkit.speculative.__main__ import main
    rows = main(["--backend", "emulated", "--batch-size", "1", "--num-steps", "62",
                 "--prompt-len", "1", "--max-new-tokens", "2", "--noises", "0", "--rounds", "1"])
    assert all(r["same_tokens"] for r in rows)
    capsys.readouterr()


def test_measure_still_runs_on_the_emulator():
    rows = measure(backend.get("emulated"), **_FAST)
    assert [r["method"] for r in rows] == ["greedy"] * 2 + ["speculative"] * 2
