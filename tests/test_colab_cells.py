"""The "Open in Colab" badge and the Colab setup cell (tools/colab_cells.py, make colab-cells).

Every notebook in notebooks/, solutions/ and exercises/ must start with a badge that opens
its own path and with the setup cell the generator makes from ``[tool.labkit]`` in
pyproject.toml now. The setup cell itself is executed here with a fake ``google.colab``
module and pip intercepted: on "Colab" it installs exactly what we expect, elsewhere it
does nothing.
"""

from __future__ import annotations

import importlib.util
import io
import json
import shutil
import subprocess
import sys
import types
from contextlib import redirect_stdout
from pathlib import Path

import nbformat
import pytest

from labkit import exercises as ex

ROOT = Path(__file__).resolve().parent.parent

_spec = importlib.util.spec_from_file_location("colab_cells", ROOT / "tools" / "colab_cells.py")
cc = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cc)

CFG = cc.config(ROOT)


def _all_notebooks():
    return cc.notebooks(ROOT) + sorted((ROOT / "exercises").glob(ex.PATTERN))


@pytest.mark.parametrize("path", _all_notebooks(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_notebook_has_the_badge_and_the_current_setup_cell(path):
    nb = nbformat.read(path, as_version=4)
    rel = path.relative_to(ROOT).as_posix()
    badge, setup = nb.cells[0], nb.cells[1]
    fix = "run `make colab-cells` (it restamps every notebook from [tool.labkit] in pyproject.toml)"
    assert badge.cell_type == "markdown" and badge.metadata.get("labkit") == {"colab": "badge"}, \
        f"{rel}: the first cell is not the Colab badge; {fix}"
    assert f"({cc.colab_url(rel, CFG)})" in badge.source, \
        f"{rel}: its badge does not open {cc.colab_url(rel, CFG)}; {fix}"
    assert cc.BADGE_IMAGE in badge.source
    assert setup.cell_type == "code" and setup.metadata.get("labkit") == {"colab": "setup"}, \
        f"{rel}: the second cell is not the Colab setup cell; {fix}"
    assert setup.source == cc.setup_source(CFG), \
        f"{rel}: its setup cell is not the one [tool.labkit] makes now; {fix}"
    assert not setup.get("outputs"), f"{rel}: the setup cell stored output (it prints nothing " \
                                     f"outside Colab)"
    kinds = [(c.metadata.get("labkit") or {}).get("colab") for c in nb.cells]
    assert kinds.count("badge") == 1 and kinds.count("setup") == 1, f"{rel}: stamped twice"


def test_generator_check_is_clean():
    stale = [p.relative_to(ROOT).as_posix() for p in cc.stale(ROOT)]
    assert stale == [], f"{stale}: run `make colab-cells`"


def _lab(tmp_path, repository="https://github.com/someone/fork", branch="dev"):
    (tmp_path / "notebooks").mkdir()
    (tmp_path / "solutions").mkdir()
    shutil.copy(ROOT / "notebooks" / "00_start_here.ipynb", tmp_path / "notebooks")
    text = (ROOT / "pyproject.toml").read_text()
    text = text.replace(f'repository = "{CFG["repository"]}"', f'repository = "{repository}"')
    text = text.replace(f'branch = "{CFG["branch"]}"', f'branch = "{branch}"')
    (tmp_path / "pyproject.toml").write_text(text)
    return tmp_path


def test_a_changed_config_without_restamping_fails_naming_make_colab_cells(tmp_path, capsys):
    root = _lab(tmp_path)
    nb = root / "notebooks" / "00_start_here.ipynb"
    assert cc.stale(root) == [nb]
    assert cc.main(["--check", "--root", str(root)]) == 1
    out = capsys.readouterr().out
    assert "stale: notebooks/00_start_here.ipynb" in out and "make colab-cells" in out
    # restamping points the badge and the install at the fork, and is idempotent
    assert cc.main(["--root", str(root)]) == 0
    first = nb.read_text()
    assert ("https://colab.research.google.com/github/someone/fork/blob/dev/"
            "notebooks/00_start_here.ipynb") in first
    cells = nbformat.reads(first, as_version=4).cells
    assert '"git+https://github.com/someone/fork@dev")' in cells[1].source
    assert cells[1].source == cc.setup_source(cc.config(root))
    assert cc.main(["--root", str(root)]) == 0 and nb.read_text() == first
    assert cc.stale(root) == []
    # every other cell (ids, outputs) kept as it was
    old = nbformat.read(ROOT / "notebooks" / "00_start_here.ipynb", as_version=4).cells[2:]
    new = nbformat.read(nb, as_version=4).cells[2:]
    assert old == new


@pytest.mark.parametrize("repository", ["https://gitlab.com/a/b", "github.com/a/b", "", 3])
def test_a_bad_repository_is_named(tmp_path, repository, capsys):
    root = _lab(tmp_path)
    text = (root / "pyproject.toml").read_text().replace(
        'repository = "https://github.com/someone/fork"', f"repository = {json.dumps(repository)}")
    (root / "pyproject.toml").write_text(text)
    with pytest.raises(cc.ConfigError, match=r"repository = .*expected \"https://github.com/"):
        cc.config(root)
    assert cc.main(["--root", str(root)]) == 1
    assert "error:" in capsys.readouterr().err


def test_the_exercise_badge_opens_the_exercise(tmp_path):
    (tmp_path / "solutions").mkdir()
    sol = tmp_path / "solutions" / "01_demo.ipynb"
    nb = nbformat.v4.new_notebook()
    badge, setup = cc._new_cells("solutions/01_demo.ipynb", CFG)
    nb.cells = [badge, setup, nbformat.v4.new_markdown_cell(
        "See [the solution](../solutions/01_demo.ipynb).")]
    nb.cells[2].id = "c2"
    sol.write_text(nbformat.writes(nb))
    out = nbformat.reads(ex.build_exercise(sol), as_version=4)
    assert f"({cc.colab_url('exercises/01_demo.ipynb', CFG)})" in out.cells[0].source
    assert "/solutions/" not in out.cells[0].source
    assert out.cells[1].source == cc.setup_source(CFG)
    assert out.cells[2].source == "See [the solution](../solutions/01_demo.ipynb)."  # untouched


# ---- the setup cell, executed ---------------------------------------------------------------

SETUP = cc.setup_source(CFG)


def _execute_setup(monkeypatch, *, colab: bool, install: str | None, returncode: int = 0):
    """Run the setup cell's code; pip is intercepted. Returns (pip calls, widget calls, stdout)."""
    pip_calls, widget_calls = [], []

    def fake_run(argv, **kwargs):
        pip_calls.append(list(argv))
        return subprocess.CompletedProcess(argv, returncode, "", "ERROR: no such file")

    monkeypatch.setattr(subprocess, "run", fake_run)
    if install is None:
        monkeypatch.delenv(cc.ENV_VAR, raising=False)
    else:
        monkeypatch.setenv(cc.ENV_VAR, install)
    monkeypatch.delitem(sys.modules, "google.colab", raising=False)
    monkeypatch.delitem(sys.modules, "google.colab.output", raising=False)
    if colab:
        google = types.ModuleType("google")
        google.__path__ = []
        colab_mod = types.ModuleType("google.colab")
        colab_mod.__path__ = []
        output = types.ModuleType("google.colab.output")
        output.enable_custom_widget_manager = lambda: widget_calls.append(True)
        colab_mod.output = output
        google.colab = colab_mod
        monkeypatch.setitem(sys.modules, "google", google)
        monkeypatch.setitem(sys.modules, "google.colab", colab_mod)
        monkeypatch.setitem(sys.modules, "google.colab.output", output)
    out = io.StringIO()
    with redirect_stdout(out):
        exec(compile(SETUP, "<setup cell>", "exec"), {"__name__": "__main__"})
    return pip_calls, widget_calls, out.getvalue()


def test_setup_cell_on_colab_installs_from_the_override(monkeypatch):
    pip_calls, widget_calls, out = _execute_setup(monkeypatch, colab=True, install=str(ROOT))
    assert pip_calls == [[sys.executable, "-m", "pip", "install", "-q", "--no-deps", str(ROOT)]]
    assert widget_calls == [True]
    import labkit.backend
    assert out == f"labkit backend: {labkit.backend.get('auto').name}\n"


def test_setup_cell_on_colab_installs_from_the_config_and_never_torch(monkeypatch):
    pip_calls, _, _ = _execute_setup(monkeypatch, colab=True, install=None)
    (argv,) = pip_calls
    assert argv[-1] == f"git+{CFG['repository']}@{CFG['branch']}"
    assert "--no-deps" in argv                    # Colab's torch is never replaced
    assert not any("torch" in a for a in argv)


def test_setup_cell_reports_a_failed_install_naming_the_source(monkeypatch):
    with pytest.raises(RuntimeError, match=r"pip could not install labkit from /nowhere.whl:\n"
                                           r"ERROR: no such file"):
        _execute_setup(monkeypatch, colab=True, install="/nowhere.whl", returncode=1)


@pytest.mark.parametrize("install", [None, "/some/where.whl"])
def test_setup_cell_outside_colab_does_nothing(monkeypatch, install):
    pip_calls, widget_calls, out = _execute_setup(monkeypatch, colab=False, install=install)
    assert pip_calls == [] and widget_calls == [] and out == ""
