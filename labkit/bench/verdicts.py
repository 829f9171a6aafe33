"""The comparisons the lessons quote, as verdicts over interleaved rounds, and the targets.

:data:`PAIRS` names, per suite, the pairs of variants a lesson, the README or the
instructor notes compare. :func:`comparisons` finds them among result rows and judges
each with :func:`labkit.bench.rounds.verdict`, once per timing method: "A is faster than
B" only when A wins at least 4 of 5 rounds, otherwise "level within the noise of this
host". Only rows of the same run (``row["run"]``, set by :func:`labkit.bench.make_row`)
are paired: rounds of different runs were not timed side by side.

``labkit_best`` stands for labkit's quickest decode row *for that method* (the lowest
median over rounds among the ``labkit_*`` variants at that batch size).

:func:`target_checks` reads the same rows against the targets of the benchmark issue
(decode and train) and of the piecewise suite, and says met or missed with the figures;
:func:`drift` lists one row's median in every run the results file holds.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Iterable, Sequence

from labkit.bench.rounds import METHODS, Verdict, format_us, verdict
from labkit.bench.variants import variant as declared_variant

__all__ = ["PAIRS", "BEST_LABKIT", "LABELS", "check_pairs", "Comparison", "comparisons",
           "target_checks", "drift", "spread", "rounds_of", "DRIFT_ROWS", "drift_section",
           "verdict_section"]

BEST_LABKIT = "labkit_best"

PAIRS: dict[str, tuple[tuple[str, str], ...]] = {
    "launch": (("graph", "eager"),),
    "decode": ((BEST_LABKIT, "compile_reduce_overhead_static"),
               ("labkit_graph", "reference_eager"),
               ("labkit_graph", "eager"),
               ("labkit_graph_compiled_staged", "labkit_graph_staged")),
    "serve": (("labkit_graph_overlap", "labkit_graph"),        # step and whole run
              ("labkit_graph", "eager"),
              ("labkit_graph_compiled_overlap", "labkit_graph_overlap"),
              ("labkit_graph_overlap_piecewise", "labkit_graph_overlap")),
    "train": (("labkit_bridge", "torch_make_graphed_callables"),
              ("labkit_bridge_no_clone", "torch_make_graphed_callables"),
              ("labkit_full_step", "eager"),
              ("labkit_full_step", "compile_reduce_overhead"),
              ("labkit_full_step_compiled", "labkit_full_step")),
    "capture": (("shared_pool", "separate_pools"),
                ("decode_runner_triton", "decode_runner_torch_native")),
    "piecewise": (("piecewise", "compile_dynamic"),
                  ("piecewise", "eager"),
                  ("full_graph", "piecewise")),
    "tp": (("tp2_graph", "tp2_eager"),
           ("tp2_graph", "labkit_graph"),
           ("tp1_graph", "labkit_graph"),
           ("labkit_graph", "eager")),
}


# what a method measured in a suite, where METHODS' name would mislead
LABELS = {("serve", "median_us"): "decode step"}


def check_pairs(suite: str, pairs: Iterable[tuple[str, str]]) -> list[tuple[str, str]]:
    """``pairs`` as a list, each name a declared variant of ``suite``
    (:mod:`labkit.bench.variants`) or :data:`BEST_LABKIT`;
    :class:`~labkit.bench.variants.UndeclaredVariant` otherwise (a mistyped name would
    compare nothing, in silence)."""
    out = []
    for pair in pairs:
        for name in pair:
            if name != BEST_LABKIT:
                declared_variant(suite, name)
        out.append(tuple(pair))
    return out


for _suite, _pairs in PAIRS.items():      # the lessons' comparisons name declared variants
    check_pairs(_suite, _pairs)


def rounds_of(row: dict, method: str) -> list[float] | None:
    """The row's per-round values for ``method`` (``"median_us"``, ``"back_to_back_us"``),
    or None if it was not timed in rounds."""
    vals = ((row.get("extra") or {}).get("rounds") or {}).get(method)
    return list(vals) if vals else None


@dataclass(frozen=True)
class Comparison:
    """One pair's verdict at one (config, batch size, device)."""

    suite: str
    config_name: str
    batch_size: int | None
    device: str
    verdict: Verdict

    def where(self) -> str:
        bs = "" if self.batch_size is None else f", batch {self.batch_size}"
        return f"{self.suite} · {self.config_name}{bs}"

    def text(self) -> str:
        return f"{self.where()} — {self.verdict.text()}"

    __str__ = text


def _best_labkit(rows: Sequence[dict], method: str) -> dict | None:
    cands = [r for r in rows if r["variant"].startswith("labkit_") and r.get(method)
             and rounds_of(r, method)]
    return min(cands, key=lambda r: r[method]) if cands else None


def _groups(rows: Iterable[dict]) -> dict[tuple, list[dict]]:
    out: dict[tuple, list[dict]] = {}
    for r in rows:
        out.setdefault((r["suite"], r["config_name"], r["batch_size"], r["device"],
                        r.get("run")), []).append(r)
    return out


def comparisons(rows: Iterable[dict], suite: str | None = None,
                methods: Sequence[str] = tuple(METHODS),
                pairs: Sequence[tuple[str, str]] | None = None) -> list[Comparison]:
    """The verdicts of :data:`PAIRS` among ``rows`` (pass :func:`report.latest` rows),
    one per pair, group and timing method that both rows were timed in, in rounds.
    ``pairs`` (with ``suite``) judges those ``(a, b)`` pairs instead of the suite's."""
    if pairs is not None and suite is None:
        raise ValueError("comparisons: pairs= names variants of one suite; pass suite= too")
    if pairs is not None:
        pairs = check_pairs(suite, pairs)
    out = []
    for (s, config, bs, device, run), group in _groups(rows).items():
        if (suite is not None and s != suite) or run is None:
            continue
        wanted = PAIRS.get(s, ()) if pairs is None else pairs
        by_variant = {r["variant"]: r for r in group}
        for a_name, b_name in wanted:
            for method in methods:
                a = (_best_labkit(group, method) if a_name == BEST_LABKIT
                     else by_variant.get(a_name))
                b = by_variant.get(b_name)
                if a is None or b is None or a is b:
                    continue
                ra, rb = rounds_of(a, method), rounds_of(b, method)
                if ra is None or rb is None or len(ra) != len(rb):
                    continue
                out.append(Comparison(s, config, bs, device,
                                      verdict(a["variant"], ra, b["variant"], rb,
                                              method=method,
                                              label=LABELS.get((s, method)))))
    return out


def _find(rows, suite, variant, bs=None, config=None):
    for r in rows:
        if (r["suite"] == suite and r["variant"] == variant and r.get("median_us")
                and (bs is None or r["batch_size"] == bs)
                and (config is None or r["config_name"] == config)):
            return r
    return None


def _ratio_check(label, a, b, method, limit, need_wins) -> str:
    ra, rb = rounds_of(a, method), rounds_of(b, method)
    ratio = a[method] / b[method]
    ok = ratio <= limit
    won = ""
    if ra and rb and len(ra) == len(rb):
        v = verdict(a["variant"], ra, b["variant"], rb, method=method)
        won = f", won {v.wins[0]} of {len(ra)} rounds"
        if need_wins:
            ok = ok and v.winner == a["variant"]
    wins_wanted = ", winning 4 of 5 rounds" if need_wins else ""
    return (f"{'met' if ok else 'MISSED'}: {label}, {METHODS[method]}: {a['variant']} is "
            f"{ratio:.3f}× {b['variant']} (target ≤ {limit:.2f}×{wins_wanted}){won}")


def _busy_check(label, row, limit) -> str | None:
    busy, b2b = row.get("gpu_busy_us"), row.get("back_to_back_us")
    if not busy or not b2b:
        return None
    ratio = b2b / busy
    return (f"{'met' if ratio <= limit else 'MISSED'}: {label}: {row['variant']} back to "
            f"back is {ratio:.3f}× its GPU busy time (target ≤ {limit:.2f}×)")


def target_checks(rows: Sequence[dict]) -> list[str]:
    """Each target the rows can be judged against, one line: ``met`` or ``MISSED``,
    with the figures (pass :func:`report.latest` rows of one device)."""
    out = []
    dec = [r for r in rows if r["suite"] == "decode"]
    for bs in sorted({r["batch_size"] for r in dec if r["batch_size"] is not None}):
        group = [r for r in dec if r["batch_size"] == bs]
        base = _find(group, "decode", "compile_reduce_overhead_static")
        for method, limit in (("back_to_back_us", 0.90), ("median_us", 1.00)):
            best = _best_labkit(group, method)
            if base and best and base.get(method):
                out.append(_ratio_check(f"decode batch {bs}", best, base, method, limit, True))
        graph = _find(group, "decode", "labkit_graph")
        line = graph and _busy_check(f"decode batch {bs}", graph, 1.15)
        if line:
            out.append(line)
    torch_mgc = _find(rows, "train", "torch_make_graphed_callables")
    for variant in ("labkit_bridge", "labkit_bridge_no_clone"):
        bridge = _find(rows, "train", variant)
        if bridge and torch_mgc:
            for method in METHODS:
                if bridge.get(method) and torch_mgc.get(method):
                    out.append(_ratio_check("train", bridge, torch_mgc, method, 1.05, False))
    full = _find(rows, "train", "labkit_full_step")
    line = full and _busy_check("train", full, 1.10)
    if line:
        out.append(line)
    out += _serve_checks(rows)
    for r in rows:
        if r["suite"] != "piecewise" or r["variant"] != "piecewise" or not r.get("median_us"):
            continue
        workload = r["config_name"].split(" · ", 1)[-1]
        comp = _find(rows, "piecewise", "compile_dynamic", config=r["config_name"])
        if comp and not workload.startswith("decode"):
            for method in METHODS:
                if r.get(method) and comp.get(method):
                    out.append(_ratio_check(f"piecewise {workload}", r, comp, method, 0.70,
                                            False))
        host, busy = (r.get("extra") or {}).get("host_us"), r.get("gpu_busy_us")
        if host and busy:
            out.append(f"{'met' if host <= 2 * busy else 'MISSED'}: piecewise {workload}: "
                       f"host time {host:.0f} µs is {host / busy:.1f}× GPU busy "
                       f"{busy:.0f} µs (target ≤ 2×)")
    return out


def _serve_checks(rows: Sequence[dict]) -> list[str]:
    """The serving loop against its limit: the best labkit row's end-to-end tokens/s ≥ 2×
    the overlapped loop with eager prefill, and its GPU busy ≥ 0.6 of the whole run."""
    serve = [r for r in rows if r["suite"] == "serve" and r["variant"].startswith("labkit")
             and (r.get("extra") or {}).get("tokens_per_s")]
    base = _find(rows, "serve", "labkit_graph_overlap")
    if not serve or not base:
        return []
    best = max(serve, key=lambda r: r["extra"]["tokens_per_s"])
    tps, base_tps = best["extra"]["tokens_per_s"], base["extra"]["tokens_per_s"]
    out = [f"{'met' if tps >= 2 * base_tps else 'MISSED'}: serve {best['variant']}: "
           f"{tps:,.0f} tokens/s end to end is {tps / base_tps:.2f}× labkit_graph_overlap's "
           f"{base_tps:,.0f} (target ≥ 2×)"]
    busy = best["extra"].get("gpu_busy_fraction")
    if busy is not None:
        out.append(f"{'met' if busy >= 0.6 else 'MISSED'}: serve {best['variant']}: the GPU is "
                   f"busy {busy:.2f} of the whole run (target ≥ 0.6)")
    return out


def drift(all_rows: Iterable[dict], suite: str, variant: str, batch_size: int | None,
          method: str = "median_us", device: str | None = None) -> list[tuple[str, float]]:
    """``[(date, median)]``: the newest row of one (suite, variant, batch size) in each run
    of the results history (a run = one date's rows, where rows carry no run id)."""
    per_run: dict[str, tuple[str, float]] = {}
    for r in all_rows:
        if (r["suite"], r["variant"], r["batch_size"]) != (suite, variant, batch_size):
            continue
        if device is not None and r["device"] != device:
            continue
        if not r.get(method):
            continue
        run = r.get("run") or r["date"][:10]
        if run not in per_run or r["date"] >= per_run[run][0]:
            per_run[run] = (r["date"], float(r[method]))
    return sorted(per_run.values())


def spread(values: Sequence[float]) -> float:
    """(max − min) / median, the relative spread of a few figures."""
    return (max(values) - min(values)) / statistics.median(values)


# the rows whose run-to-run drift the README shows: the baselines the lessons compare with
DRIFT_ROWS = (("decode", "compile_reduce_overhead_static", 1),
              ("decode", "compile_reduce_overhead_static", 8),
              ("train", "torch_make_graphed_callables", 4),
              ("piecewise", "compile_dynamic", 8))
for _suite, _variant, _ in DRIFT_ROWS:
    declared_variant(_suite, _variant)


def drift_section(all_rows: Sequence[dict]) -> list[str]:
    """How much the same row moved between runs on one device, from the file's history."""
    lines = []
    for dev in sorted({r["device"] for r in all_rows}):
        for suite, variant, bs in DRIFT_ROWS:
            for method in ("median_us", "back_to_back_us"):
                runs = drift(all_rows, suite, variant, bs, method, device=dev)
                if len(runs) < 2:
                    continue
                figs = ", ".join(f"{format_us(v)} ({d[:10]})" for d, v in runs)
                label = "synced" if method == "median_us" else "back to back"
                lines.append(f"- {dev}, {suite} `{variant}` batch {bs}, {label}: {figs}; "
                             f"spread {100 * spread([v for _, v in runs]):.0f} % of the "
                             "median")
    if not lines:
        return []
    return (["### How much a rerun may differ", "",
             "The same row in each run this file holds (runs on different days, "
             "the newest row of each). A shared GPU host drifts between runs, so one run's "
             "ranking of two close variants is not a fact; the verdicts below pair rows of "
             "one run, round by round.", ""] + lines + [""])


def verdict_section(rows: Sequence[dict]) -> list[str]:
    out = []
    for dev in sorted({r["device"] for r in rows}):
        drows = [r for r in rows if r["device"] == dev]
        comps = comparisons(drows)
        if comps:
            n = len(comps[0].verdict.a_rounds)
            out += [f"Verdicts on {dev} ({n} interleaved rounds):", ""]
            out += [f"- {c.text()}" for c in comps] + [""]
        checks = target_checks(drows)
        if checks:
            out += [f"Targets on {dev}:", ""] + [f"- {c}" for c in checks] + [""]
    return out
