"""The "Open in Colab" badge, the Colab setup cell and the Colab links (tools/colab_cells.py,
make colab-cells).

Every notebook in notebooks/, solutions/ and exercises/ must start with a badge that opens
its own path and with the setup cell the generator makes from ``[tool.labkit]`` in
pyproject.toml now; in the walkthrough, the solutions and the exercises every relative link
to a notebook must be followed by that notebook's Colab link, as the config makes it now.
The setup cell itself is executed here with a fake ``google.colab`` module and pip
intercepted (or replaced by a fake ``pip`` that fails the way an unreachable repository
does): on "Colab" it installs exactly what we expect, or explains the failure, elsewhere it
does nothing.
"""

from __future__ import annotations

import importlib.util
import io
import json
import re
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


def _linked_notebooks():
    return [p for p in _all_notebooks()
            if cc.links_colab(p.relative_to(ROOT).as_posix().replace("exercises/", "solutions/"))]


def test_the_walkthrough_and_the_exercises_carry_colab_links():
    rels = [p.relative_to(ROOT).as_posix() for p in _linked_notebooks()]
    assert "notebooks/walkthrough.ipynb" in rels
    assert any(r.startswith("exercises/") for r in rels)
    assert any(r.startswith("solutions/") for r in rels)
    walkthrough = nbformat.read(ROOT / "notebooks" / "walkthrough.ipynb", as_version=4)
    full = [c.source for c in walkthrough.cells if "*Full lesson" in c.source]
    assert len(full) == 4 and all("([on Colab](https://colab.research.google.com/" in s
                                  for s in full)


@pytest.mark.parametrize("path", _linked_notebooks(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_relative_notebook_link_has_its_current_colab_link(path):
    """A relative link opens nothing on Colab: each is followed by the Colab URL of the
    notebook it points at, as [tool.labkit] makes it now (a stale one fails here)."""
    rel = path.relative_to(ROOT).as_posix()
    fix = ("run `make colab-cells` (it restamps the Colab links from [tool.labkit] in "
           "pyproject.toml)")
    nb = nbformat.read(path, as_version=4)
    for i, cell in enumerate(nb.cells[2:], 2):
        if cell.cell_type != "markdown":
            continue
        for m in cc._LINK.finditer(cell.source):
            target = cc.link_target(rel, m["target"])
            assert target is not None and (ROOT / target).is_file(), \
                f"{rel}, cell {i}: the link {m[0]!r} points at no notebook of the repository"
            want = cc.COLAB_LINK.format(url=cc.colab_url(target, CFG))
            assert m["colab"] == want, (f"{rel}, cell {i}: the link {m[0]!r} is not followed by "
                                        f"its Colab link {want.strip()!r}; {fix}")
        # no Colab link left behind without the relative link it belongs to
        bare = len(re.findall(r"\(\[on Colab\]\(", cell.source))
        assert bare == len([m for m in cc._LINK.finditer(cell.source) if m["colab"]]), \
            f"{rel}, cell {i}: an `on Colab` link that follows no relative link; {fix}"


def test_generator_check_is_clean():
    stale = [p.relative_to(ROOT).as_posix() for p in cc.stale(ROOT)]
    assert stale == [], f"{stale}: run `make colab-cells`"


def _lab(tmp_path, repository="https://github.com/someone/fork", branch="dev", *more):
    (tmp_path / "notebooks").mkdir()
    (tmp_path / "solutions").mkdir()
    shutil.copy(ROOT / "notebooks" / "00_start_here.ipynb", tmp_path / "notebooks")
    for rel in more:
        shutil.copy(ROOT / rel, tmp_path / rel)
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
    assert 'default = "git+https://github.com/someone/fork@dev"' in cells[1].source
    assert "placeholder" not in cells[1].source
    assert cells[1].source == cc.setup_source(cc.config(root))
    assert cc.main(["--root", str(root)]) == 0 and nb.read_text() == first
    assert cc.stale(root) == []
    # every other cell (ids, outputs) kept as it was
    old = nbformat.read(ROOT / "notebooks" / "00_start_here.ipynb", as_version=4).cells[2:]
    new = nbformat.read(nb, as_version=4).cells[2:]
    assert old == new


def test_a_changed_config_moves_the_colab_links_and_a_stale_link_is_named(tmp_path, capsys):
    wt, sol = "notebooks/walkthrough.ipynb", "solutions/06_decode_bucketing.ipynb"
    root = _lab(tmp_path, "https://github.com/someone/fork", "dev", wt, sol)
    assert sorted(cc.stale(root)) == sorted(root / r for r in
                                            ("notebooks/00_start_here.ipynb", wt, sol))
    assert cc.main(["--root", str(root)]) == 0
    fork = "https://colab.research.google.com/github/someone/fork/blob/dev/notebooks/"
    text = (root / wt).read_text()
    assert ("[01 · the launch-bound timeline](01_launch_bound_timeline.ipynb) "
            f"([on Colab]({fork}01_launch_bound_timeline.ipynb))") in text
    assert "cuda-graphs-lab/cuda-graphs-lab/blob" not in text
    text = (root / sol).read_text()
    assert ("[lesson 06 §2](../notebooks/06_decode_bucketing.ipynb#2-·-Buckets-and-padding) "
            f"([on Colab]({fork}06_decode_bucketing.ipynb))") in text
    assert cc.stale(root) == []
    # only the markdown of the linked notebooks changed: every code cell, output and id kept
    for rel in (wt, sol):
        old = nbformat.read(ROOT / rel, as_version=4).cells
        new = nbformat.read(root / rel, as_version=4).cells
        assert [c.id for c in old] == [c.id for c in new]
        assert [c for c in old if c.cell_type == "code"][1:] == \
               [c for c in new if c.cell_type == "code"][1:]
    # a link edited by hand (here: pointed at another branch) is stale, and restamped
    nb = root / wt
    nb.write_text(nb.read_text().replace(f"{fork}03_pitfalls", fork.replace("/dev/", "/old/")
                                         + "03_pitfalls", 1))
    assert cc.main(["--check", "--root", str(root)]) == 1
    assert "stale: notebooks/walkthrough.ipynb" in capsys.readouterr().out
    cc.main(["--root", str(root)])
    assert cc.stale(root) == [] and "/old/" not in nb.read_text()


def test_colab_links_follow_relative_notebook_links_only():
    cfg = {"owner": "o", "repo": "r", "branch": "b", "repository": "https://github.com/o/r"}
    url = "https://colab.research.google.com/github/o/r/blob/b/"
    text = ("[a](01_x.ipynb), [b](../notebooks/02_y.ipynb#3-·-Part), [c](https://x.org/a.ipynb), "
            "[d](/abs.ipynb), [e](#here), [f](../../out.ipynb), [g](notes.md)")
    got = cc.with_colab_links(text, "solutions/01_z.ipynb", cfg)
    assert got == (f"[a](01_x.ipynb) ([on Colab]({url}solutions/01_x.ipynb)), "
                   f"[b](../notebooks/02_y.ipynb#3-·-Part) "
                   f"([on Colab]({url}notebooks/02_y.ipynb)), "
                   "[c](https://x.org/a.ipynb), [d](/abs.ipynb), [e](#here), [f](../../out.ipynb), "
                   "[g](notes.md)")
    assert cc.with_colab_links(got, "solutions/01_z.ipynb", cfg) == got          # idempotent
    other = {**cfg, "branch": "dev"}
    assert cc.with_colab_links(got, "solutions/01_z.ipynb", other) == \
        cc.with_colab_links(text, "solutions/01_z.ipynb", other)                 # replaced
    assert not cc.links_colab("notebooks/01_launch_bound_timeline.ipynb")
    assert cc.links_colab("notebooks/walkthrough.ipynb")
    assert cc.links_colab("solutions/06_decode_bucketing.ipynb")


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


def _execute_setup(monkeypatch, *, colab: bool, install: str | None, returncode: int = 0,
                   stderr: str = "ERROR: no such file", source: str = SETUP,
                   intercept: bool = True):
    """Run the setup cell's code; pip is intercepted (unless ``intercept`` is False).
    Returns (pip calls, widget calls, stdout)."""
    pip_calls, widget_calls = [], []

    def fake_run(argv, **kwargs):
        pip_calls.append(list(argv))
        return subprocess.CompletedProcess(argv, returncode, "", stderr)

    if intercept:
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
        exec(compile(source, "<setup cell>", "exec"), {"__name__": "__main__"})
    return pip_calls, widget_calls, out.getvalue()


def test_setup_cell_on_colab_installs_from_the_override(monkeypatch):
    pip_calls, widget_calls, out = _execute_setup(monkeypatch, colab=True, install=str(ROOT))
    assert pip_calls == [[sys.executable, "-m", "pip", "install", "-q", "--no-deps",
                          "--no-color", str(ROOT)]]
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
                                           r"ERROR: no such file") as info:
        _execute_setup(monkeypatch, colab=True, install="/nowhere.whl", returncode=1)
    msg = str(info.value)
    assert "LABKIT_INSTALL=/nowhere.whl is set in this kernel" in msg
    assert "placeholder" not in msg                 # the override failed, not the default
    assert "%env LABKIT_INSTALL=/content/labkit-" in msg


# what pip prints when git cannot reach the repository, with the colour codes pip's rich
# console and git emit on a terminal (and, on Colab, in captured output)
GIT_FAILURE = (
    "  \x1b[1;31merror\x1b[0m: \x1b[1msubprocess-exited-with-error\x1b[0m\n\n"
    "  \x1b[31m×\x1b[0m \x1b[32mgit clone --\x1b[0m\x1b[32mfilter=blob:none --quiet "
    "\x1b[0m\x1b[4;32mhttps://github.com/cuda-graphs-lab/cuda-graphs-lab\x1b[0m did not run "
    "successfully.\n  \x1b[31m│\x1b[0m exit code: \x1b[1;36m128\x1b[0m\n"
    "  \x1b[31m╰─>\x1b[0m fatal: unable to access 'https://github.com/cuda-graphs-lab/"
    "cuda-graphs-lab/': Could not resolve host: github.com\n"
    "\x1b]8;id=1;https://pip.pypa.io\x1b\\pip\x1b]8;;\x1b\\ \x1b[2mnote\x1b[0m\n")


def _fork_setup(repository="https://github.com/someone/fork"):
    cfg = {**CFG, "repository": repository}
    return cc.setup_source(cfg)


def test_setup_cell_says_the_default_repository_is_a_placeholder_without_escape_codes(
        monkeypatch):
    with pytest.raises(RuntimeError) as info:
        _execute_setup(monkeypatch, colab=True, install=None, returncode=1, stderr=GIT_FAILURE)
    msg = str(info.value)
    assert "\x1b" not in msg and "[0m" not in msg and "]8;" not in msg, msg
    assert msg.startswith(f"pip could not install labkit from git+{CFG['repository']}@"
                          f"{CFG['branch']}:\n")
    assert "fatal: unable to access" in msg and "Could not resolve host: github.com" in msg
    assert "exit code: 128" in msg and "× git clone --filter=blob:none --quiet" in msg
    assert CFG["repository"] == cc.PLACEHOLDER_REPOSITORY
    assert (f"{cc.PLACEHOLDER_REPOSITORY} is a placeholder until the lab is published there"
            in msg)
    version = re.search(r'__version__ = "(.+)"', (ROOT / "labkit" / "__init__.py").read_text())[1]
    assert f"\n    %env LABKIT_INSTALL=/content/labkit-{version}-py3-none-any.whl\n" in msg
    assert "then this cell again" in msg


def test_setup_cell_of_a_fork_does_not_call_it_a_placeholder(monkeypatch):
    with pytest.raises(RuntimeError) as info:
        _execute_setup(monkeypatch, colab=True, install=None, returncode=1, stderr=GIT_FAILURE,
                       source=_fork_setup())
    msg = str(info.value)
    assert msg.startswith("pip could not install labkit from git+https://github.com/someone/fork@")
    assert "placeholder" not in msg
    assert "Is https://github.com/someone/fork public, and can this runtime reach GitHub?" in msg
    assert "%env LABKIT_INSTALL=" in msg


FAKE_PIP = """\
import json, os, sys
with open(os.environ["FAKE_PIP_LOG"], "a") as f:
    f.write(json.dumps(sys.argv[1:]) + "\\n")
sys.stderr.write({failure!r})
sys.exit(1)
"""


def test_setup_cell_with_a_failing_pip_process(monkeypatch, tmp_path):
    """Not intercepted: the cell runs ``python -m pip`` for real, and finds a fake ``pip``
    first on PYTHONPATH that fails as pip does when github.com cannot be resolved."""
    fake = tmp_path / "fake" / "pip"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    (fake / "__main__.py").write_text(FAKE_PIP.format(failure=GIT_FAILURE))
    log = tmp_path / "pip.log"
    monkeypatch.setenv("PYTHONPATH", str(fake.parent))
    monkeypatch.setenv("FAKE_PIP_LOG", str(log))
    with pytest.raises(RuntimeError) as info:
        _execute_setup(monkeypatch, colab=True, install=None, intercept=False)
    (argv,) = [json.loads(line) for line in log.read_text().splitlines()]
    assert argv == ["install", "-q", "--no-deps", "--no-color",
                    f"git+{CFG['repository']}@{CFG['branch']}"]
    msg = str(info.value)
    assert "\x1b" not in msg and "Could not resolve host: github.com" in msg
    assert "is a placeholder until the lab is published there" in msg
    assert "%env LABKIT_INSTALL=/content/labkit-" in msg


@pytest.mark.parametrize("install", [None, "/some/where.whl"])
def test_setup_cell_outside_colab_does_nothing(monkeypatch, install):
    pip_calls, widget_calls, out = _execute_setup(monkeypatch, colab=False, install=install)
    assert pip_calls == [] and widget_calls == [] and out == ""
