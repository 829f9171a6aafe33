"""`python -m labkit exercises` never loses a learner's work.

Each case builds a small lab in a tmp dir (one solution, its exercise), puts the exercise
in one state (untouched, edited by the learner, run, unreadable, orphaned, old format)
and the solution in another (unchanged or changed by its author), then checks what
``--check``, a plain run and ``--force`` say and do.
"""

from __future__ import annotations

import json
import subprocess
import sys

import nbformat
import pytest

from labkit import exercises as ex

NAME = "01_demo.ipynb"


def _solution(body="return a * x + b", title="# 01 · demo"):
    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_markdown_cell(title),
        nbformat.v4.new_code_cell("def f(x, a, b):\n    ### BEGIN SOLUTION\n    "
                                  + body + "\n    ### END SOLUTION"),
        nbformat.v4.new_code_cell("print(f(1, 2, 3))"),
    ]
    for i, c in enumerate(nb.cells):
        c["id"] = f"c{i}"
    nb.metadata["kernelspec"] = {"name": "python3", "language": "python",
                                 "display_name": "Python 3"}
    return nbformat.writes(nb)


@pytest.fixture()
def lab(tmp_path):
    (tmp_path / "solutions").mkdir()
    (tmp_path / "exercises").mkdir()
    sol = tmp_path / "solutions" / NAME
    sol.write_text(_solution())
    exf = tmp_path / "exercises" / NAME
    exf.write_text(ex.build_exercise(sol))
    return tmp_path, sol, exf


def _learner_fills_in(exf, answer="    return a * x + b"):
    nb = json.loads(exf.read_text())
    src = nb["cells"][1]["source"]
    src = "".join(src) if isinstance(src, list) else src
    nb["cells"][1]["source"] = src.replace(
        "    # YOUR CODE HERE\n    raise NotImplementedError()", answer)
    exf.write_text(json.dumps(nb, indent=1))
    return exf.read_text()


def _learner_runs(exf):
    nb = json.loads(exf.read_text())
    nb["cells"][2]["execution_count"] = 1
    nb["cells"][2]["outputs"] = [{"output_type": "stream", "name": "stdout", "text": "5\n"}]
    exf.write_text(json.dumps(nb, indent=1))
    return exf.read_text()


def _sync(root, **kw):
    lines = []

    class Out:
        def write(self, s):
            lines.append(s)

    pending = ex.sync(root, out=Out(), **kw)
    return pending, "".join(lines)


def _backups(root):
    return sorted((root / "exercises" / ex.BACKUP_DIR).glob("*.ipynb"))


def test_untouched_and_up_to_date(lab):
    root, sol, exf = lab
    assert ex.classify(exf, ex.build_exercise(sol)).kind == "up to date"
    pending, out = _sync(root, check=True)
    assert pending == [] and "up to date (1 notebook)" in out


def test_solution_changed_untouched_exercise_is_rewritten(lab):
    root, sol, exf = lab
    sol.write_text(_solution(title="# 01 · demo, better explained"))
    pending, out = _sync(root, check=True)
    assert pending == [exf]
    assert "its solution changed since it was generated; nobody edited it" in out
    pending, out = _sync(root)
    assert pending == [] and "wrote exercises/01_demo.ipynb (its solution changed)" in out
    assert exf.read_text() == ex.build_exercise(sol)
    assert _backups(root) == []          # nothing of the learner's to save


def test_learner_edit_is_not_stale(lab):
    root, sol, exf = lab
    mine = _learner_fills_in(exf)
    st = ex.classify(exf, ex.build_exercise(sol))
    assert st.kind == "edited" and not st.needs_writing
    pending, out = _sync(root, check=True)
    assert pending == []                 # --check exits 0: a learner's work is not stale
    assert "yours: exercises/01_demo.ipynb (cells edited; its solution has not changed" in out
    assert "stale" not in out and "make exercises" not in out
    pending, out = _sync(root)           # a plain run leaves it alone
    assert pending == [] and exf.read_text() == mine
    pending, out = _sync(root, force=True)   # nothing to replace even with --force
    assert exf.read_text() == mine and _backups(root) == []


def test_learner_edit_survives_a_changed_solution(lab):
    root, sol, exf = lab
    mine = _learner_fills_in(exf)
    sol.write_text(_solution(title="# 01 · demo v2"))
    st = ex.classify(exf, ex.build_exercise(sol))
    assert st.kind == "edited, solution changed"
    pending, out = _sync(root, check=True)
    assert pending == [exf]
    assert "yours, and stale: exercises/01_demo.ipynb (cells edited" in out
    assert "--force" in out and "exercises/backup/" in out
    pending, out = _sync(root)
    assert pending == [exf] and exf.read_text() == mine          # refused, untouched
    assert "kept: exercises/01_demo.ipynb holds your work" in out
    assert "python -m labkit exercises --force" in out
    assert _backups(root) == []
    pending, out = _sync(root, force=True)
    assert pending == [] and exf.read_text() == ex.build_exercise(sol)
    (backup,) = _backups(root)
    assert backup.read_text() == mine                             # the learner's copy
    assert backup.name.startswith("01_demo-") and backup.name.endswith("Z.ipynb")
    assert f"saved your version of exercises/01_demo.ipynb to exercises/backup/{backup.name}" \
        in out


def test_run_outputs_count_as_the_learners(lab):
    root, sol, exf = lab
    ran = _learner_runs(exf)
    assert ex.classify(exf, ex.build_exercise(sol)).detail == "has outputs from a run"
    sol.write_text(_solution(title="# changed"))
    pending, out = _sync(root)
    assert pending == [exf] and exf.read_text() == ran
    _sync(root, force=True)
    assert [b.read_text() for b in _backups(root)] == [ran]


def test_two_forced_runs_keep_both_backups(lab):
    root, sol, exf = lab
    first = _learner_fills_in(exf, "    return x")
    sol.write_text(_solution(title="# v2"))
    _sync(root, force=True)
    second = _learner_fills_in(exf, "    return a")
    sol.write_text(_solution(title="# v3"))
    _sync(root, force=True)
    assert sorted(b.read_text() for b in _backups(root)) == sorted([first, second])


def test_unreadable_exercise_is_kept(lab):
    root, sol, exf = lab
    exf.write_text("{ half a notebook")
    sol.write_text(_solution(title="# v2"))
    pending, out = _sync(root, check=True)
    assert pending == [exf] and "unreadable: exercises/01_demo.ipynb" in out
    pending, out = _sync(root)
    assert pending == [exf] and exf.read_text() == "{ half a notebook"
    assert "is not a readable notebook" in out
    _sync(root, force=True)
    assert [b.read_text() for b in _backups(root)] == ["{ half a notebook"]
    assert exf.read_text() == ex.build_exercise(sol)


def test_orphans_untouched_removed_edited_kept(lab):
    root, sol, exf = lab
    sol.unlink()
    pending, out = _sync(root, check=True)
    assert pending == [exf] and "orphan: exercises/01_demo.ipynb" in out
    pending, out = _sync(root)
    assert not exf.exists() and "removed exercises/01_demo.ipynb" in out

    sol.write_text(_solution())
    _sync(root)
    mine = _learner_fills_in(exf)
    sol.unlink()
    pending, out = _sync(root)
    assert pending == [exf] and exf.read_text() == mine and "has no solution any more" in out
    _sync(root, force=True)
    assert not exf.exists() and [b.read_text() for b in _backups(root)] == [mine]


def test_older_format_without_hash(lab):
    root, sol, exf = lab
    nb = json.loads(exf.read_text())
    del nb["metadata"]["labkit"][ex.HASH_KEY]
    exf.write_text(nbformat.writes(nbformat.from_dict(nb)) + "\n")
    st = ex.classify(exf, ex.build_exercise(sol))
    assert st.kind == "solution changed" and st.untouched      # same cells: safe to rewrite
    _sync(root)
    assert exf.read_text() == ex.build_exercise(sol)
    # an old-format file with other cells cannot be told from a changed solution: kept
    nb["cells"][1]["source"] = "def f(x, a, b):\n    return 0"
    exf.write_text(json.dumps(nb))
    st = ex.classify(exf, ex.build_exercise(sol))
    assert st.kind == "edited, solution changed" and not st.untouched
    pending, out = _sync(root)
    assert pending == [exf] and "generated before labkit recorded a hash" in out
    assert json.loads(exf.read_text())["cells"][1]["source"] == "def f(x, a, b):\n    return 0"


def test_missing_exercise_is_written(lab):
    root, sol, exf = lab
    exf.unlink()
    pending, out = _sync(root, check=True)
    assert pending == [exf] and "missing: exercises/01_demo.ipynb" in out
    pending, out = _sync(root)
    assert pending == [] and "wrote exercises/01_demo.ipynb (new)" in out


def test_hash_ignores_outputs_ids_and_metadata(lab):
    root, sol, exf = lab
    nb = json.loads(exf.read_text())
    h = ex.cells_hash(nb["cells"])
    nb["cells"][0]["id"] = "other"
    nb["cells"][0]["metadata"] = {"tags": ["x"]}
    nb["cells"][2]["outputs"] = [{"output_type": "stream", "name": "stdout", "text": "1"}]
    assert ex.cells_hash(nb["cells"]) == h
    nb["cells"][1]["source"] = ["def f(x, a, b):\n", "    return 1"]
    assert ex.cells_hash(nb["cells"]) != h


@pytest.mark.parametrize("body, message", [
    ("    ### BEGIN SOLUTION\n    x = 1", "is never closed"),
    ("    ### END SOLUTION\n    x = 1", "without a '### BEGIN SOLUTION' above it"),
    ("    ### BEGIN SOLUTION\n    ### BEGIN SOLUTION\n    ### END SOLUTION",
     "a second '### BEGIN SOLUTION'"),
])
def test_bad_markers_name_the_file_and_cell(tmp_path, body, message):
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("def f():\n" + body)]
    path = tmp_path / "01_bad.ipynb"
    path.write_text(nbformat.writes(nb))
    with pytest.raises(ex.ExerciseError, match=message) as info:
        ex.build_exercise(path)
    assert str(path) in str(info.value) and "cell 1 (code)" in str(info.value)


def test_cli_force_and_check_exit_codes(lab):
    root, sol, exf = lab
    mine = _learner_fills_in(exf)
    sol.write_text(_solution(title="# v2"))
    cmd = [sys.executable, "-m", "labkit", "exercises", "--root", str(root)]
    r = subprocess.run(cmd + ["--check"], capture_output=True, text=True)
    assert r.returncode == 1 and "yours, and stale" in r.stdout
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 1 and "kept:" in r.stdout and exf.read_text() == mine
    r = subprocess.run(cmd + ["--force"], capture_output=True, text=True)
    assert r.returncode == 0 and "saved your version" in r.stdout
    r = subprocess.run(cmd + ["--check", "--force"], capture_output=True, text=True)
    assert r.returncode == 2 and "not allowed with argument" in r.stderr


def test_saved_by_jupyter_without_edits_is_not_called_a_changed_solution(lab):
    root, sol, exf = lab
    nb = json.loads(exf.read_text())
    nb["metadata"]["language_info"] = {"name": "python", "version": "3.11.7"}
    nb["cells"][0]["metadata"] = {"editable": True}
    exf.write_text(json.dumps(nb, indent=2))
    st = ex.classify(exf, ex.build_exercise(sol))
    assert st.kind == "solution changed" and st.untouched and st.detail == "metadata only"
    pending, out = _sync(root, check=True)
    assert "only its metadata or cell ids differ" in out and "solution changed since" not in out
    pending, out = _sync(root)
    assert pending == [] and "(metadata only; no edits)" in out and _backups(root) == []
    assert exf.read_text() == ex.build_exercise(sol)


def test_markers_follow_nbgraders_rule(tmp_path):
    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_markdown_cell("Why?\n### BEGIN SOLUTION\nBecause.\n### END SOLUTION"),
        nbformat.v4.new_code_cell("x = 1\n  ### BEGIN SOLUTION\n  y = 2\n  ### END SOLUTION\nz"),
        nbformat.v4.new_code_cell("answer = 42", metadata={"nbgrader": {"solution": True}}),
        nbformat.v4.new_code_cell("print(1)", execution_count=3, outputs=[
            nbformat.v4.new_output("stream", name="stdout", text="1\n")]),
    ]
    path = tmp_path / "01_x.ipynb"
    path.write_text(nbformat.writes(nb))
    cells = json.loads(ex.build_exercise(path))["cells"]
    src = ["".join(c["source"]) for c in cells]
    assert src[0] == "Why?\nYOUR ANSWER HERE"
    assert src[1] == "x = 1\n  # YOUR CODE HERE\n  raise NotImplementedError()\nz"
    assert src[2] == "# YOUR CODE HERE\nraise NotImplementedError()"
    assert cells[3]["outputs"] == [] and cells[3]["execution_count"] is None
