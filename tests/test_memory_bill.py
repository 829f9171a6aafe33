"""labkit.decode.memory: the memory bill of many buckets, on both backends.

Behaviour checked: a private pool per bucket reserves more than one shared pool; captured
largest first, the shared pool grows only at the first (largest) bucket when every
smaller graph fits the blocks it freed; aliased outputs leave the pools' allocated bytes
without the graphs' logits; every bucket is captured once, in the order asked; bad options
are refused by name. On a GPU (``-m cuda``) the same assertions run on torch.cuda's pools.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from labkit.decode import ModelArgs, build_model
from labkit.decode.memory import (
    Bill,
    bill_table,
    bucket_lists,
    custom_buckets,
    measure_bill,
    stored_sweep,
)

ROOT = Path(__file__).resolve().parents[1]
# logits of 64 x 8192 fp32 = 2 MiB: large enough to leave the 2 MiB small segments
WIDE = ModelArgs(vocab_size=8192, n_layer=1, n_head=4, n_local_heads=2, dim=64,
                 intermediate_size=128, max_seq_len=32)


@pytest.fixture(scope="module")
def wide_models():
    return {}


def _model(B, cache):
    if B.name not in cache:
        cache[B.name] = build_model(WIDE, max_requests=64, device=B.device, dtype=torch.float32)
    return cache[B.name]


def test_bucket_lists_and_custom():
    lists = bucket_lists(64)
    assert lists["sglang"] == [1, 2, 4, 8, 12, 16, 24, 32, 40, 48, 56, 64]
    assert lists["pow2"] == [1, 2, 4, 8, 16, 32, 64]
    assert lists["custom"] == [1, 4, 16, 64]
    assert custom_buckets(20) == [1, 4, 16, 20]
    assert custom_buckets(1) == [1]


def test_private_pools_cost_more_than_one_shared_pool(B, wide_models):
    m = _model(B, wide_models)
    shared = measure_bill(m, B, [8, 32, 64], pools="shared")
    private = measure_bill(m, B, [8, 32, 64], pools="private")
    assert shared.num_pools == 1 and private.num_pools == 3
    if B.name == "cuda":   # device-wide: other pools freed meanwhile count too, so no bound
        assert isinstance(private.device_reserved_delta_bytes, int)
    else:
        assert shared.device_reserved_delta_bytes is None
    assert private.reserved_bytes > shared.reserved_bytes
    # the same graphs keep the same live tensors either way (the H200, torch 2.11, measured
    # the two equal: 36975616 bytes each for this model)
    assert private.allocated_bytes == shared.allocated_bytes


def test_largest_first_reuses_the_first_graphs_blocks(B, wide_models):
    m = _model(B, wide_models)
    bill = measure_bill(m, B, [4, 16, 64], pools="shared", order="largest_first")
    assert [r.bs for r in bill.rows] == [64, 16, 4]
    first = bill.rows[0].reserved_delta_bytes
    assert first > 0
    # the smaller graphs live in the blocks the first one freed (a small segment at most)
    assert sum(r.reserved_delta_bytes for r in bill.rows[1:]) <= first / 4
    small_first = measure_bill(m, B, [4, 16, 64], pools="shared", order="smallest_first")
    assert [r.bs for r in small_first.rows] == [4, 16, 64]
    assert small_first.reserved_bytes >= bill.reserved_bytes


def test_outputs_kept_per_graph_unless_aliased(B, wide_models):
    m = _model(B, wide_models)
    plain = measure_bill(m, B, [16, 64], pools="shared")
    aliased = measure_bill(m, B, [16, 64], pools="shared", alias_outputs=True)
    logits = sum(r.output_bytes for r in plain.rows)
    assert logits == (16 + 64) * 8192 * 4
    assert plain.allocated_bytes - aliased.allocated_bytes >= logits
    assert aliased.outside_bytes == 64 * 8192 * 4 and plain.outside_bytes == 0


def test_bill_row_and_table(E, wide_models):
    m = _model(E, wide_models)
    bill = measure_bill(m, E, [1, 2], model_name="wide")
    row = json.loads(json.dumps(bill.as_row()))
    assert row["graphs"] == 2 and row["pools"] == "shared" and row["model"] == "wide"
    assert [r["bs"] for r in row["per_bucket"]] == [2, 1]
    assert row["reserved_bytes"] == bill.reserved_bytes == bill.rows[-1].reserved_bytes
    table = bill_table([bill])
    assert "shared pool, largest_first" in table.splitlines()[1]
    assert isinstance(bill, Bill) and bill.capture_seconds > 0


@pytest.mark.parametrize("kw, match", [
    ({"pools": "per_graph"}, "pools='per_graph'"),
    ({"order": "random"}, "order='random'"),
    ({"alias_outputs": "yes"}, "alias_outputs must be True or False"),
    ({"num_warmups": 0}, "num_warmups"),
])
def test_bad_options_are_named(E, wide_models, kw, match):
    m = _model(E, wide_models)
    with pytest.raises((ValueError, TypeError), match=match):
        measure_bill(m, E, [1, 2], **kw)


def test_a_bucket_beyond_the_models_slots_is_refused(E, wide_models):
    m = _model(E, wide_models)
    with pytest.raises(ValueError, match="exceeds max_bs=64"):
        measure_bill(m, E, [1, 128])


def test_not_a_model_is_refused(E):
    with pytest.raises(TypeError):
        measure_bill("tiny", E, [1])


def test_stored_sweep_reads_a_file(tmp_path):
    assert stored_sweep(tmp_path / "none.json") is None
    p = tmp_path / "m.json"
    p.write_text(json.dumps({"info": {"device": "X"}, "bills": []}))
    assert stored_sweep(p)["info"]["device"] == "X"


def test_sweep_tool_runs_on_the_emulator(tmp_path):
    out = tmp_path / "m.json"
    p = subprocess.run([sys.executable, str(ROOT / "tools" / "memory_sweep.py"), "--backend",
                        "emulated", "--quick", "--models", "small", "--out", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr
    data = json.loads(out.read_text())
    assert data["info"]["backend"] == "emulated"
    kinds = {(b["scheme"], b["pools"], b["order"], b["alias_outputs"]) for b in data["bills"]}
    assert ("sglang", "shared", "largest_first", False) in kinds
    assert ("sglang", "private", "largest_first", False) in kinds
    assert ("sglang", "shared", "smallest_first", False) in kinds
    assert ("sglang", "shared", "largest_first", True) in kinds


def test_sweep_tool_misuse(tmp_path):
    tool = str(ROOT / "tools" / "memory_sweep.py")
    p = subprocess.run([sys.executable, tool, "--models", "huge"], capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 2 and "invalid choice: 'huge'" in p.stderr
    assert "Traceback" not in p.stderr
    if not torch.cuda.is_available():
        p = subprocess.run([sys.executable, tool], capture_output=True, text=True, timeout=120)
        assert p.returncode == 2 and "needs CUDA" in p.stderr and "Traceback" not in p.stderr
    p = subprocess.run([sys.executable, tool, "--backend", "emulated", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "is a folder" in p.stderr


def test_stored_sweep_copies_agree():
    docs = ROOT / "docs" / "benchmarks" / "memory.json"
    pkg = ROOT / "labkit" / "bench" / "data" / "memory.json"
    assert docs.exists() == pkg.exists(), "tools/memory_sweep.py writes both files"
    if docs.exists():
        assert docs.read_bytes() == pkg.read_bytes()
        data = stored_sweep()
        assert data["info"]["backend"] == "cuda" and data["bills"]
