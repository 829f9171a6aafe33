"""labkit.piecewise.profile: the host-time parts of one piecewise replay."""

import matplotlib
import pytest

from labkit import backend
from labkit import decode as D
from labkit import piecewise as P
from labkit.piecewise.profile import PARTS, host_breakdown, plot_breakdowns, stored_breakdowns

matplotlib.use("Agg")


@pytest.fixture(scope="module")
def runner():
    B = backend.get("emulated")
    model = D.build_model("tiny", max_requests=4, device=B.device)
    pw = P.PiecewiseGraphRunner(model, B, max_num_tokens=16, buckets=[8, 16], progress=False)
    pw.capture()
    yield pw
    pw.backend.cleanup()


def test_parts_add_up_and_the_wrappers_are_removed(runner):
    batch = D.make_extend_batch(runner.model, [1, 2], [[5] * 6, [3] * 4])
    parts = host_breakdown(runner, batch, repeats=3)
    assert set(parts) == set(PARTS) | {"total"}
    assert all(parts[p] > 0 for p in PARTS[:3])
    assert parts["total"] == pytest.approx(sum(parts[p] for p in PARTS), abs=0.5)
    for m in runner.split.split_gm.children():
        assert "forward" not in vars(m), "a timing wrapper was left on a module"
    assert "init_forward_metadata" not in vars(runner.attn)
    assert runner.stats["piecewise"] >= 4           # one warm-up and three timed replays


def test_bad_input_is_refused(runner):
    batch = D.make_extend_batch(runner.model, [1], [[5] * 20])
    with pytest.raises(ValueError, match=r"20 tokens, above the largest bucket \(16\)"):
        host_breakdown(runner, batch)
    small = D.make_extend_batch(runner.model, [1], [[5] * 4])
    with pytest.raises(ValueError, match="repeats"):
        host_breakdown(runner, small, repeats=0)
    with pytest.raises(TypeError, match="captured PiecewiseGraphRunner, got EagerRunner"):
        host_breakdown(D.EagerRunner(runner.model), small)


def test_stored_breakdowns_plot():
    stored = stored_breakdowns()
    runs = stored["runs"]
    assert set(runs) == {"before", "after"}
    for run in runs.values():
        for parts in run["workloads"].values():
            assert parts["total"] == pytest.approx(sum(parts[p] for p in PARTS), abs=0.5)
    ax = plot_breakdowns(runs)
    assert len(ax.get_yticklabels()) == 2 * len(runs["before"]["workloads"])
