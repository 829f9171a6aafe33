"""Benchmark results: one JSON list of rows, rendered to Markdown tables and PNG plots.

Every measurement is one row, appended to ``docs/benchmarks/results.json``::

    {"suite": "train", "config_name": "bench", "config": {...}, "batch_size": 4,
     "variant": "labkit_full_step", "median_us": 7412.3, "gpu_busy_us": 6120.5,
     "device": "NVIDIA H200", "torch": "2.11.0+cu128", "date": "2026-05-09T10:12:03Z"}

(``gpu_busy_us`` only where it was measured; optional ``note`` says why a row has no
number, e.g. a variant the installed labkit cannot run; optional ``extra`` holds
suite-specific numbers such as pool memory, and ``extra.rounds`` the row's value in each
interleaved round, per method; optional ``run`` names the process that timed it, so that
only rows timed in the same rounds are compared.) A row is a :class:`labkit.bench.rows.Row`
written as this dict; its variant must be declared in :mod:`labkit.bench.variants`, which
also gives the tables their order and each suite its paragraph (:data:`SUITE_TEXT`). Rows
are only ever appended, so the file is
the history; :func:`latest` picks the newest row per (suite, config, batch size, variant,
device) for the tables.

labkit ships the committed rows as package data, ``labkit/bench/data/results.json``, a
byte-for-byte copy of ``docs/benchmarks/results.json``: an install from a wheel (Colab, a
plain ``pip install``) has no ``docs/``, and the lessons that read the tables
(``load_results()`` with no path, lessons 06 to 08) must read the same rows everywhere.
:func:`default_results_path` is the ``docs/`` file in a checkout and the packaged copy
elsewhere; :func:`append_results` to the checkout's file rewrites the copy with it
(``python -m labkit.bench`` appends there), and ``tests/test_bench.py`` checks that the
two are identical.

:func:`render` turns the file into ``README.md`` (one table per suite) and one PNG per
suite and device beside it. It reads nothing but the JSON file, so
``python -m labkit.bench --render`` works on any machine, and tests render synthetic rows
into a temporary directory (never into ``docs/``).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Iterable, Sequence

from labkit.bench.rounds import format_us
from labkit.bench.rows import REQUIRED_KEYS, Row
from labkit.bench.variants import SUITE_ORDER, SUITE_TEXT, rank
from labkit.bench.verdicts import (
    BEST_LABKIT,
    METHODS,
    PAIRS,
    comparisons,
    drift_section,
    rounds_of,
    verdict_section,
)

__all__ = ["REQUIRED_KEYS", "SUITE_ORDER", "ResultsError", "default_results_path",
           "checkout_results_path", "packaged_results_path", "load_results",
           "append_results", "validate_row", "latest", "speedups", "markdown_table",
           "render", "format_us", "quote"]

TARGETS = {
    "decode": "Targets (medians over rounds, one run): labkit's best row at most 0.90× "
              "`compile_reduce_overhead_static` back to back and at most 1.0× synced, winning "
              "at least 4 of 5 rounds in both; `labkit_graph` back to back at most 1.15× its "
              "GPU busy time.",
    "train": "Targets: `labkit_bridge` at most 1.05× `torch_make_graphed_callables`, synced "
             "and back to back; `labkit_full_step` back to back at most 1.10× its GPU busy "
             "time.",
    "serve": "Targets: the best labkit row at least 2× `labkit_graph_overlap`'s end-to-end "
             "tokens/s, with the GPU busy at least 0.6 of the whole run.",
    "piecewise": "Targets: `piecewise` at most 0.7× `compile_dynamic` on every prefill and "
                 "mixed workload, synced and back to back; its host time at most 2× its GPU "
                 "busy time.",
}

# extra keys too long for a table cell; they stay in results.json
_NOT_IN_TABLE = ("rounds", "top_kernels")


def _checkout_root() -> Path:
    """The folder above the ``labkit`` package: the checkout, when labkit runs from one."""
    return Path(__file__).resolve().parents[2]


def checkout_results_path() -> Path:
    """``docs/benchmarks/results.json`` of the checkout labkit runs from (whether or not
    there is one: see :func:`default_results_path`)."""
    return _checkout_root() / "docs" / "benchmarks" / "results.json"


def packaged_results_path() -> Path:
    """The copy of the committed results shipped inside the package (package data)."""
    return Path(__file__).resolve().parent / "data" / "results.json"


def _in_checkout() -> bool:
    root = _checkout_root()
    return (root / "pyproject.toml").is_file() and checkout_results_path().parent.is_dir()


def default_results_path() -> Path:
    """The results file read and appended to when no path is given.

    In a checkout (``pyproject.toml`` and ``docs/benchmarks/`` beside the ``labkit``
    package): ``docs/benchmarks/results.json``, the history ``python -m labkit.bench``
    appends to. Anywhere else (labkit installed from a wheel, e.g. on Colab): the copy
    shipped with the package, ``labkit/bench/data/results.json``, the same rows.
    """
    return checkout_results_path() if _in_checkout() else packaged_results_path()


def _same_file(a: Path, b: Path) -> bool:
    try:
        return a.resolve() == b.resolve()
    except OSError:
        return False


class ResultsError(ValueError):
    """A results file that is missing, unreadable or malformed; the message names it."""


def load_results(path: str | Path | None = None, *, missing_ok: bool = True) -> list[dict]:
    """All rows of a results file, each checked by :func:`validate_row`.

    Args:
        path: the results file (default: :func:`default_results_path`, i.e.
            ``docs/benchmarks/results.json`` in a checkout, the copy shipped with the
            package in an install without one).
        missing_ok: return ``[]`` for a file that does not exist yet (appending creates
            it); with ``False`` a missing file raises :class:`ResultsError`.

    Raises :class:`ResultsError` naming the file (and the row) when it cannot be read,
    is not JSON, is not a list of rows, or a row is malformed.

    .. warning::
        An unreadable file is never taken as "no results": appending to it or rendering
        from it would replace the history or the committed tables with nothing.
    """
    path = Path(path) if path is not None else default_results_path()
    if path.is_dir():
        raise ResultsError(f"results file {path} is a directory; give the results.json "
                           f"file itself")
    if not path.exists():
        if missing_ok:
            return []
        raise ResultsError(f"results file {path} does not exist (a typo? the default is "
                           f"{default_results_path()})")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ResultsError(f"results file {path} cannot be read: {exc}") from None
    try:
        rows = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ResultsError(f"results file {path} is not valid JSON (line {exc.lineno}, "
                           f"column {exc.colno}: {exc.msg}); restore it from git") from None
    if not isinstance(rows, list):
        raise ResultsError(f"results file {path} must hold a JSON list of rows, not a "
                           f"{type(rows).__name__}")
    for i, r in enumerate(rows):
        try:
            validate_row(r)
        except ValueError as exc:
            raise ResultsError(f"results file {path}: row {i}: {exc}") from None
    return rows


def validate_row(row: dict) -> None:
    """Raise ValueError if ``row`` lacks a required key, has an unknown one or a wrong type,
    or names an undeclared variant (:meth:`labkit.bench.rows.Row.from_dict`)."""
    Row.from_dict(row)


def append_results(rows: Iterable[dict], path: str | Path | None = None) -> Path:
    """Validate ``rows`` and append them to the results file (created if missing).

    Appending to the checkout's ``docs/benchmarks/results.json`` also writes the same bytes
    to the copy shipped with the package (:func:`packaged_results_path`), so that a wheel
    built afterwards carries the new rows; commit both files.
    """
    rows = list(rows)
    for r in rows:
        validate_row(r)
    path = Path(path) if path is not None else default_results_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    allrows = load_results(path) + rows
    text = json.dumps(allrows, indent=1, sort_keys=False) + "\n"
    path.write_text(text, encoding="utf-8")
    if _same_file(path, checkout_results_path()):
        packaged = packaged_results_path()
        packaged.parent.mkdir(parents=True, exist_ok=True)
        packaged.write_text(text, encoding="utf-8")
    return path


def _key(r: dict) -> tuple:
    return (r["suite"], r["config_name"], r["batch_size"], r["variant"], r["device"])


def _sort_key(r: dict) -> tuple:
    """Suite, device, config, batch size, then the declared variant order (an undeclared
    suite or variant raises :class:`~labkit.bench.variants.UndeclaredVariant`)."""
    variant_rank = rank(r["suite"], r["variant"])
    return (SUITE_ORDER.index(r["suite"]), r["device"], r["config_name"],
            r["batch_size"] if r["batch_size"] is not None else -1, variant_rank)


def latest(rows: Iterable[dict], suite: str | None = None) -> list[dict]:
    """The newest row per (suite, config, batch size, variant, device), sorted for tables.

    Newest = latest ``date`` (ISO 8601 strings compare in time order); on a tie, the row
    appended last.
    """
    best: dict[tuple, tuple[str, int, dict]] = {}
    for i, r in enumerate(rows):
        if suite is not None and r.get("suite") != suite:
            continue
        k = _key(r)
        cand = (str(r.get("date", "")), i, r)
        if k not in best or cand[:2] >= best[k][:2]:
            best[k] = cand
    return sorted((v[2] for v in best.values()), key=_sort_key)


def speedups(rows: Sequence[dict]) -> dict[int, float]:
    """``id(row) → eager median / row median`` for rows that have an eager twin."""
    eager = {}
    for r in rows:
        if r["variant"] == "eager" and r["median_us"]:
            eager[(r["suite"], r["config_name"], r["batch_size"], r["device"])] = r["median_us"]
    out = {}
    for r in rows:
        e = eager.get((r["suite"], r["config_name"], r["batch_size"], r["device"]))
        if e and r["median_us"]:
            out[id(r)] = e / r["median_us"]
    return out


def _extra_text(extra: dict | None) -> str:
    if not extra:
        return ""
    parts = []
    for k, v in extra.items():
        if k in _NOT_IN_TABLE:
            continue
        if isinstance(v, float):
            v = f"{v:.0f}" if abs(v) >= 1000 else f"{v:.3g}"
        parts.append(f"{k}={v}")
    return ", ".join(parts)


def format_rounds(row: dict, method: str) -> str:
    """``'628.6 µs (601.2 µs–655.0 µs)'``: the median over rounds and their range, or the
    plain figure for a row not timed in rounds."""
    vals = rounds_of(row, method)
    text = format_us(row.get(method))
    if vals and len(vals) > 1:
        text += f" ({format_us(min(vals))}–{format_us(max(vals))})"
    return text


def markdown_table(rows: Sequence[dict]) -> str:
    """A Markdown table of ``rows`` (use :func:`latest` first). A row timed in rounds
    shows its median over rounds and, in brackets, the fastest and slowest round."""
    sp = speedups(rows)
    head = ("| config | batch | variant | synced | back to back | GPU busy | vs eager | device "
            "| torch | date | notes |")
    lines = [head, "|---|---:|---|---:|---:|---:|---:|---|---|---|---|"]
    for r in rows:
        ratio = sp.get(id(r))
        notes = "; ".join(x for x in (r.get("note", ""), _extra_text(r.get("extra"))) if x)
        lines.append("| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |".format(
            r["config_name"], "" if r["batch_size"] is None else r["batch_size"],
            f"`{r['variant']}`", format_rounds(r, "median_us"),
            format_rounds(r, "back_to_back_us"),
            format_us(r.get("gpu_busy_us")),
            f"{ratio:.2f}×" if ratio else "", r["device"], r["torch"],
            str(r["date"])[:10], notes.replace("|", "/")))
    return "\n".join(lines)


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "device"


def plot_suite(rows: Sequence[dict], path: str | Path, title: str = "") -> Path:
    """Grouped bars: one group per (config, batch size), one bar per variant; log y; a
    whisker from the fastest to the slowest round where a row was timed in rounds.

    Rows timed both ways get two panels, *synced* and *back to back*. Where rows carry
    floors (``extra.kernel_floor_us`` per bar, ``extra.bytes_floor_us`` per group), each
    bar gets a black tick at its kernel-count floor and each group a dashed red line at
    its bytes floor: how close a row is to what no launch trick can remove."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    rows = [r for r in rows if r["median_us"]]
    groups = []
    for r in rows:
        g = (r["config_name"], r["batch_size"])
        if g not in groups:
            groups.append(g)
    variants = sorted({(rank(r["suite"], r["variant"]), r["variant"]) for r in rows})
    variants = [v for _, v in variants]
    by = {(r["config_name"], r["batch_size"], r["variant"]): r for r in rows}
    methods = [("median_us", "median per call")]
    if any(r.get("back_to_back_us") for r in rows):
        methods = [("median_us", "synced per step"), ("back_to_back_us", "back to back")]
    width = 0.8 / max(1, len(variants))
    fig_w = max(7.0, 0.32 * len(groups) * max(1, len(variants)) + 2)
    fig, axes = plt.subplots(len(methods), 1, squeeze=False, sharey=True,
                             figsize=(fig_w, 3.0 * len(methods) + 1.2))
    axes = axes.T                                   # one row of panels, stacked vertically
    floors_drawn = set()
    for ax, (key, label) in zip(axes[0], methods):
        for j, v in enumerate(variants):
            xs, ys, ticks, lo, hi = [], [], [], [], []
            for i, g in enumerate(groups):
                r = by.get((g[0], g[1], v))
                if r and r.get(key):
                    x = i + (j - (len(variants) - 1) / 2) * width
                    xs.append(x)
                    ys.append(r[key])
                    vals = rounds_of(r, key)
                    lo.append(r[key] - min(vals) if vals else 0.0)
                    hi.append(max(vals) - r[key] if vals else 0.0)
                    kf = (r.get("extra") or {}).get("kernel_floor_us")
                    if kf:
                        ticks.append((x, kf))
            ax.bar(xs, ys, width=width, label=v if key == "median_us" else None,
                   yerr=[lo, hi] if any(lo) or any(hi) else None, capsize=2,
                   error_kw={"elinewidth": 0.8, "ecolor": "0.3"})
            for x, kf in ticks:
                ax.plot([x - width / 2, x + width / 2], [kf, kf], color="black", lw=1.2,
                        label=None if "k" in floors_drawn else
                        "kernel-count floor (kernels × per-node time)")
                floors_drawn.add("k")
        for i, g in enumerate(groups):
            bf = [(by[(g[0], g[1], v)].get("extra") or {}).get("bytes_floor_us")
                  for v in variants if (g[0], g[1], v) in by]
            bf = [b for b in bf if b]
            if bf:
                ax.plot([i - 0.45, i + 0.45], [bf[0], bf[0]], color="tab:red", ls="--", lw=1.2,
                        label=None if "b" in floors_drawn else
                        "bytes floor (bytes read ÷ copy bandwidth)")
                floors_drawn.add("b")
        ax.set_xticks(range(len(groups)))
        ax.set_xticklabels([f"{c}\nbatch {b}" if b is not None else c for c, b in groups])
        ax.set_yscale("log")
        ax.set_title(label, fontsize=10)
        ax.grid(axis="y", alpha=0.3)
    axes[0][0].set_ylabel("time per call (µs, log)")
    fig.suptitle(title)
    handles, labels = [], []
    for ax in axes[0]:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            if lab not in labels:
                handles.append(h)
                labels.append(lab)
    ncol = max(1, min(4, len(labels), int(fig_w // 2.4)))
    fig.legend(handles, labels, fontsize=8, loc="lower center", ncol=ncol, frameon=False)
    rows_of_labels = (len(labels) + ncol - 1) // ncol
    fig.tight_layout(rect=(0, 0.16 * rows_of_labels / (3.0 * len(methods) + 1.2), 1, 1))
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def render(results_path: str | Path | None = None, out_dir: str | Path | None = None) -> list[Path]:
    """Write ``README.md`` and one PNG per suite and device into ``out_dir`` (default: the
    results file's folder) from the newest rows; return the paths written.

    Raises :class:`ResultsError` (writing nothing) when the results file is missing,
    malformed or holds no rows.

    .. warning::
        Rendering never replaces the tables with nothing: a mistyped ``results_path``
        used to render "No results yet" over the README beside it.
    """
    results_path = Path(results_path) if results_path is not None else default_results_path()
    out_dir = Path(out_dir) if out_dir is not None else results_path.parent
    rows = latest(load_results(results_path, missing_ok=False))
    if not rows:
        raise ResultsError(f"results file {results_path} holds no rows: nothing to render "
                           f"(the tables in {out_dir / 'README.md'} are left as they are)")
    if out_dir.exists() and not out_dir.is_dir():
        raise ResultsError(f"output folder {out_dir} is a file; give a folder for README.md "
                           f"and the plots")
    out_dir.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    md = ["# Benchmarks", "",
          "Generated by `python -m labkit.bench --render` from `results.json` (do not edit "
          "by hand). Measure on a GPU with `python -m labkit.bench [suite ...]`; every run "
          "appends rows, and these tables show the newest row per configuration, variant "
          "and device.", "",
          "Timing: CUDA events, warm-up first, random input data. Every suite builds all "
          "its variants, then times them in interleaved rounds (each round times every "
          "variant once, in a shuffled order): a figure is the median over rounds, with the "
          "fastest and slowest round in brackets. A comparison says \"faster\" only when "
          "one side wins at least 4 of 5 rounds, otherwise \"level within the noise of this "
          "host\". *GPU busy* = the union of kernel (and memcpy/memset) intervals of one "
          "call from `torch.profiler`; *median − GPU busy* is the time the GPU sat idle. "
          "*vs eager* = eager median ÷ this median.", ""]
    md += drift_section(load_results(results_path, missing_ok=False))
    for suite in SUITE_ORDER:
        srows = [r for r in rows if r["suite"] == suite]
        md += [f"## {suite}", "", SUITE_TEXT.get(suite, ""), ""]
        if suite in TARGETS:
            md += [TARGETS[suite], ""]
        if not srows:
            md += [f"No results yet: run `python -m labkit.bench {suite}` on a GPU.", ""]
            continue
        md += [markdown_table(srows), ""]
        md += verdict_section(srows)
        for dev in sorted({r["device"] for r in srows}):
            drows = [r for r in srows if r["device"] == dev]
            if not any(r["median_us"] for r in drows):
                continue
            name = f"{suite}-{_slug(dev)}.png"
            written.append(plot_suite(drows, out_dir / name, title=f"{suite} · {dev}"))
            md += [f"![{suite} on {dev}]({name})", ""]
    readme = out_dir / "README.md"
    readme.write_text("\n".join(md).rstrip() + "\n", encoding="utf-8")
    written.insert(0, readme)
    return written


def quote(suite: str, pairs: Sequence[tuple[str, str]] | None = None, *,
          labels: dict | None = None, device: str = "NVIDIA H200",
          rows: Iterable[dict] | None = None) -> list[str]:
    """The verdicts a lesson quotes, one short line each, from the committed results.

    Args:
        suite: the benchmark suite (``"decode"``, ``"train"``, ...).
        pairs: which ``(a, b)`` variant pairs (default: the suite's :data:`PAIRS`; any
            two variants of the suite may be paired); ``"labkit_best"`` stands for
            labkit's quickest row per method.
        labels: short names for variants in the lines.
        device: whose rows.
        rows: the rows to read (default: the newest of the committed results file).
    """
    if rows is None:
        rows = latest(load_results(), suite)
    rows = [r for r in rows if r["device"] == device and r["suite"] == suite]
    wanted = list(pairs) if pairs is not None else list(PAIRS.get(suite, ()))
    lines = []
    for a_name, b_name in wanted:
        for c in comparisons(rows, suite, pairs=[(a_name, b_name)]):
            v = c.verdict
            if v.b != b_name or (a_name != BEST_LABKIT and v.a != a_name):
                continue
            if a_name == BEST_LABKIT and not v.a.startswith("labkit_"):
                continue
            where = "" if c.batch_size is None else f"batch {c.batch_size:<3d} "
            if c.suite == "piecewise":
                where = f"{c.config_name.split(' · ', 1)[-1]:22s}"
            label = v.label or METHODS[v.method]
            lines.append(f"{where}{label + ':':13s} {v.short(labels)}")
    return lines
