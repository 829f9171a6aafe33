"""Run All on an untouched exercise notebook shows only "not done yet" (issue 10 §3).

Every ``exercises/NN_*.ipynb`` is executed exactly as generated (blanks not filled in) with
nbclient on the CPU emulator, errors allowed so that every cell runs. Then:

* no cell has an error output (no raw ``NotImplementedError``, no ``NameError`` cascade
  from a blank that later cells use);
* every checker cell (a cell that calls ``check_<exercise>(...)``) prints
  "not done yet" for each blank it checks, and never ✅.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

ROOT = Path(__file__).resolve().parent.parent
EXERCISES = sorted((ROOT / "exercises").glob("[0-9][0-9]_*.ipynb"))
CHECK_CALL = re.compile(r"^(?!\s*(?:from|import)\b).*\bcheck_\w+\(", re.M)


def _text(output) -> str:
    if output.get("output_type") == "stream":
        t = output.get("text", "")
        return "".join(t) if isinstance(t, list) else t
    if output.get("output_type") == "error":
        return f"{output.get('ename')}: {output.get('evalue')}"
    data = output.get("data", {})
    t = data.get("text/plain", "")
    return "".join(t) if isinstance(t, list) else t


def test_there_are_exercises():
    assert EXERCISES


@pytest.mark.parametrize("path", EXERCISES, ids=lambda p: p.name)
def test_untouched_exercise_runs_and_says_not_done_yet(path, monkeypatch):
    monkeypatch.setenv("LABKIT_BACKEND", "emulated")
    monkeypatch.setenv("MPLBACKEND", "Agg")
    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=120, kernel_name="python3",
                                     allow_errors=True,
                                     resources={"metadata": {"path": str(path.parent)}})
    start = time.perf_counter()
    client.execute()
    took = time.perf_counter() - start
    problems, checker_cells = _problems(nb)
    assert checker_cells, f"{path.name}: no checker cell found"
    assert not problems, f"{path.name} (ran in {took:.1f} s):\n  " + "\n  ".join(problems)


def _problems(nb) -> tuple[list[str], int]:
    """What is wrong in an executed untouched exercise, and how many checker cells it has."""
    problems = []
    checker_cells = 0
    for i, cell in enumerate(nb.cells, 1):
        if cell.cell_type != "code":
            continue
        src = cell.source
        errors = [o for o in cell.get("outputs", []) if o.get("output_type") == "error"]
        if errors:
            first = src.strip().splitlines()[0] if src.strip() else ""
            problems.append(f"cell {i} ({first[:60]!r}) raised {_text(errors[0])[:200]}")
        if CHECK_CALL.findall(src):
            checker_cells += 1
            text = "".join(_text(o) for o in cell.get("outputs", []))
            if "✅" in text or "not done yet" not in text:
                problems.append(f"checker cell {i} ({src.strip().splitlines()[-1][:60]!r}) "
                                f"printed {text.strip()[:200]!r} instead of 'not done yet'")
    return problems, checker_cells


def test_the_analysis_catches_what_it_must():
    # an executed notebook as a learner would see it: a raw traceback, a checker that
    # passes a blank, one that says something else, and one that is right
    v4 = nbformat.v4
    cells = [
        v4.new_code_cell("def f(x):\n    # YOUR CODE HERE\n    raise NotImplementedError()"),
        v4.new_code_cell("y = f(1)", outputs=[v4.new_output(
            "error", ename="NotImplementedError", evalue="", traceback=[])]),
        v4.new_code_cell("from labkit.checks.lesson00 import check_f\ncheck_f(f)",
                         outputs=[v4.new_output("stream", name="stdout",
                                                text="✅ f: passed 3 random trials\n")]),
        v4.new_code_cell("check_g(g)", outputs=[v4.new_output(
            "stream", name="stdout", text="❌ g: your function cannot be captured\n")]),
        v4.new_code_cell("check_h(h)", outputs=[v4.new_output(
            "stream", name="stdout", text="❌ h: not done yet: fill in the cell\n")]),
    ]
    nb = v4.new_notebook(cells=cells)
    problems, checkers = _problems(nb)
    assert checkers == 3
    assert [p.split(" (")[0] for p in problems] == ["cell 2", "checker cell 3",
                                                     "checker cell 4"]
    assert "raised NotImplementedError" in problems[0]
