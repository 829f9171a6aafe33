"""tools/rerun_cells.py: only the named cells' outputs change; a failing run writes nothing;
the GPU's printed output can be stored in a GPU-only cell's CPU branch."""

import importlib.util
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("rerun_cells", ROOT / "tools" / "rerun_cells.py")
RC = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(RC)


def _notebook(tmp_path, sources):
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                 "language": "python"}
    for i, src in enumerate(sources):
        c = nbformat.v4.new_code_cell(src)
        c.id = f"c{i}"
        c.execution_count = i + 1
        c.outputs = [nbformat.v4.new_output("stream", name="stdout", text="stored\n")]
        nb.cells.append(c)
    path = tmp_path / "nb.ipynb"
    nbformat.write(nb, path)
    return path


def _texts(path):
    nb = nbformat.read(path, as_version=4)
    return ["".join(o.text for o in c.outputs) for c in nb.cells]


def test_only_the_named_cells_get_new_outputs(tmp_path):
    path = _notebook(tmp_path, ["x = 6", "print(x * 7)", "open('ran.txt', 'w').close()"])
    assert RC.main([str(path), "c1"]) == 0
    assert _texts(path) == ["stored\n", "42\n", "stored\n"], "c0 ran (c1 needs x), kept its output"
    assert not (tmp_path / "ran.txt").exists(), "c2, after the last named cell, did not run"


def test_setup_runs_only_the_cells_named_before(tmp_path):
    path = _notebook(tmp_path, ["x = 6", "open('ran.txt', 'w').close()", "print(x * 7)"])
    assert RC.main([str(path), "c2", "--setup", "c0"]) == 0
    assert _texts(path) == ["stored\n", "stored\n", "42\n"]
    assert not (tmp_path / "ran.txt").exists(), "c1 is not a setup cell: not run"


@pytest.mark.parametrize("sources, cells, words", [
    (["print(1)"], ["c9"], "no cell with id 'c9'; its code cells are c0"),
    (["import sys; print('oops', file=sys.stderr)"], ["c0"], "cell c0 wrote to stderr"),
])
def test_bad_requests_write_nothing(tmp_path, capsys, sources, cells, words):
    path = _notebook(tmp_path, sources)
    before = path.read_text()
    assert RC.main([str(path), *cells]) == 2
    assert words in capsys.readouterr().err
    assert path.read_text() == before


def test_a_failing_cell_writes_nothing(tmp_path, capsys):
    path = _notebook(tmp_path, ["raise RuntimeError('boom')", "print(2)"])
    before = path.read_text()
    assert RC.main([str(path), "c1"]) == 1
    assert "a cell failed" in capsys.readouterr().err and path.read_text() == before


def test_a_missing_notebook_is_an_argparse_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        RC.main([str(tmp_path / "nope.ipynb"), "c0"])
    assert e.value.code == 2 and "no such notebook" in capsys.readouterr().err


def test_store_in_source_replaces_the_stored_gpu_output(monkeypatch):
    monkeypatch.setattr(RC, "torch_version", lambda: "2.11")
    src = ('if ON_GPU:\n    print(run())\nelse:\n'
           '    print("""[GPU only: the output of this cell on an NVIDIA H200, torch 2.10, '
           'stored]\nold 1\nold 2""")')
    new = RC.store_in_source(src, "new 1\nnew 2\n", "NVIDIA H200")
    assert new.endswith('torch 2.11, stored]\nnew 1\nnew 2""")')
    assert new.startswith("if ON_GPU:\n    print(run())\nelse:\n")
    with pytest.raises(ValueError, match="no stored GPU output"):
        RC.store_in_source("print(1)", "x", "NVIDIA H200")
    with pytest.raises(ValueError, match="by hand"):
        RC.store_in_source(src, 'a """ b', "NVIDIA H200")
