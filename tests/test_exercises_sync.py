"""exercises/ must be what solutions/ generates (`make exercises`), with no answers in it."""

from __future__ import annotations

import json
import subprocess

import pytest

from labkit import exercises as ex

ROOT = ex.repo_root()
SOLUTIONS = ex.find_solutions(ROOT)


def _committed(path):
    """The file as of git HEAD, or None (not a git checkout, or not committed)."""
    try:
        rel = path.relative_to(ROOT).as_posix()
        out = subprocess.run(["git", "-C", str(ROOT), "show", f"HEAD:{rel}"],
                             capture_output=True, check=False)
    except (OSError, ValueError):
        return None
    return out.stdout.decode("utf-8") if out.returncode == 0 else None


def test_there_are_solutions():
    assert SOLUTIONS, "solutions/ has no NN_*.ipynb notebooks"


@pytest.mark.parametrize("solution", SOLUTIONS, ids=lambda p: p.name)
def test_exercise_is_up_to_date(solution):
    target = ex.exercise_path(solution)
    assert target.exists(), f"exercises/{target.name} is missing: run `make exercises`"
    wanted = ex.build_exercise(solution)
    # A learner filling in exercises/ changes the working copy; what must match is either
    # the working copy (an author who just ran `make exercises`) or the committed file.
    if target.read_text(encoding="utf-8") != wanted and _committed(target) != wanted:
        pytest.fail(f"exercises/{target.name} is stale: run `make exercises` and commit it")


def test_no_orphan_exercises():
    names = {s.name for s in SOLUTIONS}
    orphans = [p.name for p in (ROOT / "exercises").glob(ex.PATTERN) if p.name not in names]
    assert not orphans, f"exercises without a solution: {orphans}; run `make exercises`"


def _solution_blocks(nb_text):
    """The lines between BEGIN/END SOLUTION markers in a notebook's cells."""
    blocks = []
    for cell in json.loads(nb_text)["cells"]:
        src = "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]
        inside = False
        for line in src.split("\n"):
            if "BEGIN SOLUTION" in line:
                inside = True
            elif "END SOLUTION" in line:
                inside = False
            elif inside and line.strip():
                blocks.append(line.strip())
    return blocks


@pytest.mark.parametrize("solution", SOLUTIONS, ids=lambda p: p.name)
def test_exercise_hides_the_solution(solution):
    exercise = ex.build_exercise(solution)
    answers = _solution_blocks(solution.read_text(encoding="utf-8"))
    assert answers, f"{solution.name} has no ### BEGIN SOLUTION block"
    nb = json.loads(exercise)
    sources = ["".join(c["source"]) if isinstance(c["source"], list) else c["source"]
               for c in nb["cells"]]
    text = "\n".join(sources)
    assert "BEGIN SOLUTION" not in text and "END SOLUTION" not in text
    assert "# YOUR CODE HERE\nraise NotImplementedError()" in text.replace("    ", "")
    code_lines = {ln.strip() for s in sources for ln in s.split("\n")}
    leaked = [a for a in answers if a in code_lines]
    assert not leaked, f"solution lines left in the exercise: {leaked}"
    assert all(not c.get("outputs") for c in nb["cells"] if c["cell_type"] == "code")


def test_generation_is_deterministic(tmp_path):
    # same bytes twice, and --check on a fresh copy reports nothing stale
    for sol in SOLUTIONS:
        assert ex.build_exercise(sol) == ex.build_exercise(sol)
    (tmp_path / "solutions").mkdir()
    for sol in SOLUTIONS:
        (tmp_path / "solutions" / sol.name).write_bytes(sol.read_bytes())
    assert ex.sync(tmp_path, check=True)  # nothing generated yet: all stale
    assert not ex.sync(tmp_path) and not ex.sync(tmp_path, check=True)
    for sol in SOLUTIONS:
        assert ex.exercise_path(tmp_path / "solutions" / sol.name).read_text() == \
            ex.build_exercise(sol)
    orphan = tmp_path / "exercises" / "99_orphan.ipynb"
    orphan.write_text("{}")
    assert ex.sync(tmp_path, check=True) == [orphan]


@pytest.mark.parametrize("solution", SOLUTIONS, ids=lambda p: p.name)
def test_exercise_records_the_hash_of_its_cells(solution):
    nb = json.loads(ex.build_exercise(solution))
    meta = nb["metadata"]["labkit"]
    assert meta["generated_from"] == f"solutions/{solution.name}"
    assert meta[ex.HASH_KEY] == ex.cells_hash(nb["cells"])
