"""Stamp the "Open in Colab" badge, the Colab setup cell and Colab links into notebooks.

An authoring tool (``make colab-cells``), not part of ``labkit``: the learner's lab never
imports it. Every notebook in ``notebooks/`` (the lessons, and the walkthrough when it is
there) and ``solutions/`` gets, first:

1. a Markdown cell with an "Open in Colab" badge pointing at the notebook's own path in
   the repository;
2. the setup cell, the same code in every notebook: outside Colab it does nothing; on
   Colab it pip-installs labkit without its dependencies (Colab already has torch,
   matplotlib, ipywidgets, numpy and nbformat, and ``--no-deps`` is what guarantees its
   torch is never replaced), turns on Colab's widget manager and prints which backend
   runs. ``LABKIT_INSTALL`` (a wheel, a folder or any pip requirement) overrides where
   labkit comes from, so the cell can be tested without the internet. When pip fails the
   cell raises with pip's message (colour codes stripped), says whether the default
   source is still the placeholder repository, and how to set ``LABKIT_INSTALL`` with
   ``%env``.

3. **Colab links** (:data:`LINKED`: the walkthrough, and the solutions, hence the
   exercises): a relative link to a notebook, such as ``[01 · timeline](01_x.ipynb)`` or
   ``[lesson 06 §2](../notebooks/06_x.ipynb#2-·-Buckets)``, opens nothing on Colab, which
   shows one notebook from GitHub. Each one is followed by ``([on Colab](<that
   notebook's Colab URL>))``, the URL its own badge opens (no ``#section``: Colab does
   not scroll to a heading). The relative link stays, for JupyterLab. Restamping rewrites
   the Colab link after every relative one, so a changed repository or branch moves them
   with the badges.

``exercises/`` is generated from ``solutions/`` by ``python -m labkit exercises``, which
points the exercise's badge at ``exercises/`` (``labkit/exercises.py``); ``make
colab-cells`` runs it after stamping.

Where the package comes from is one config value, ``[tool.labkit]`` in ``pyproject.toml``::

    repository = "https://github.com/<owner>/<repo>"
    branch = "main"

A fork changes those two lines and runs ``make colab-cells``; ``tests/test_colab_cells.py``
fails (naming ``make colab-cells``) while any notebook still carries the old ones (a badge,
a setup cell or a Colab link).

:data:`PLACEHOLDER_REPOSITORY` is the repository ``pyproject.toml`` names before the lab is
published: while the config still names it, the setup cell's error says that the URL is a
placeholder. The publisher sets it to ``None`` (and restamps) once the lab is there.

    python tools/colab_cells.py            stamp notebooks/ and solutions/
    python tools/colab_cells.py --check    write nothing; exit 1 naming each notebook that is stale

No lesson reads a file that sits beside it (lesson 01 writes its traces itself, lesson 07's
child process finds labkit through ``labkit.__file__``), so the setup cell fetches no
companion files.

.. warning::
    The cells are recognised by ``metadata.labkit.colab`` ("badge" / "setup"), not by
    their position: restamping replaces them wherever they are and leaves every other cell,
    its outputs and its id, exactly as it was (in a :data:`LINKED` notebook, a Markdown
    cell's Colab links are rewritten, nothing else).
"""

from __future__ import annotations

import argparse
import posixpath
import re
import string
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = ("notebooks", "solutions")
BADGE_IMAGE = "https://colab.research.google.com/assets/colab-badge.svg"
COLAB_URL = "https://colab.research.google.com/github/{owner}/{repo}/blob/{branch}/{path}"
ENV_VAR = "LABKIT_INSTALL"
KEY = "colab"                      # metadata.labkit.colab = "badge" | "setup"
IDS = {"badge": "colab-badge", "setup": "colab-setup"}
SKIP = {"slide_type": "skip"}      # neither cell belongs in the slides

# The repository pyproject.toml names until the lab is published (README "On Colab"): while
# the config names it, the setup cell's error says so. Set to None once the lab is there.
PLACEHOLDER_REPOSITORY = "https://github.com/cuda-graphs-lab/cuda-graphs-lab"

# Notebooks whose relative links to other notebooks get a Colab link beside them: the
# walkthrough (Colab's entry point: its sections link to the full lessons) and the
# solutions, whose `../notebooks/...` links the exercises inherit.
LINKED = ("notebooks/walkthrough.ipynb", "solutions/*.ipynb")
COLAB_LINK = " ([on Colab]({url}))"
# [text](relative/path.ipynb#fragment), then the Colab link a previous stamp put after it
_LINK = re.compile(
    r"\[(?P<text>[^\[\]\n]+)\]"
    r"\((?P<target>(?![A-Za-z][A-Za-z0-9+.-]*:|/|#)[^()\s#]+\.ipynb)(?P<frag>#[^()\s]*)?\)"
    r"(?P<colab> \(\[on Colab\]\(https://colab\.research\.google\.com/[^()\s]*\)\))?")

# string.Template: $name is filled in, $$ would be a literal dollar sign
SETUP = string.Template(r'''
# Colab setup. Outside Colab this cell does nothing. On Colab it installs labkit (Colab
# already has torch, matplotlib and ipywidgets: --no-deps keeps its torch), turns on
# widgets and prints which backend runs: a GPU runtime -> cuda, a CPU runtime -> emulated.
# $env (a wheel, a folder or a pip requirement) overrides where labkit comes from:
# run `%env $env=...` in a cell of its own, then this cell.
import sys

if "google.colab" in sys.modules:
    import importlib
    import os
    import re
    import subprocess

    default = "$spec"
    src = os.environ.get("$env", default)
    pip = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps",
                          "--no-color", src], capture_output=True, text=True)
    if pip.returncode:
        # pip's message without terminal colour codes, then what to do
        err = re.sub(r"\x1b(\[[0-?]*[ -/]*[@-~]|\][^\x07\x1b]*(\x07|\x1b\\)?)", "",
                     pip.stderr).strip()
        why = ($why
               if src == default else
               f"$env={src} is set in this kernel: check that path or requirement.")
        raise RuntimeError(
            f"pip could not install labkit from {src}:\n{err}\n\n{why}\n"
            "To install labkit from a wheel instead: build one where you have the lab's "
            "checkout (python -m pip wheel --no-deps . -w build/wheel), upload it with "
            "Colab's Files panel (it lands in /content), run\n"
            "    %env $env=/content/$wheel\n"
            "in a new cell, then this cell again. $env also takes a folder or any "
            "pip requirement (git+https://github.com/<you>/<fork>@<branch>).") from None
    importlib.invalidate_caches()
    from google.colab import output
    output.enable_custom_widget_manager()
    import labkit.backend
    print("labkit backend:", labkit.backend.get("auto").name)'''[1:])

# the setup cell's `why` for the default source (Python literals, indented to sit in the cell)
WHY_PLACEHOLDER = ('"$repository is a placeholder "\n'
                   '               "until the lab is published there: installing from it fails '
                   'until then."')
WHY_REPOSITORY = ('"Is $repository public, and can this runtime "\n'
                  '               "reach GitHub? (Colab\'s pip has no GitHub login.)"')

BADGE = ("[![Open In Colab]({image})]({url})\n\n"
         "On Colab, run the setup cell below first (it installs `labkit`); anywhere else it "
         "does nothing.")


class ConfigError(ValueError):
    """``[tool.labkit]`` in pyproject.toml is missing or malformed (names the value)."""


def _toml(path: Path) -> dict:
    try:
        import tomllib
    except ImportError:  # Python 3.10
        try:
            import tomli as tomllib
        except ImportError:
            raise ConfigError("reading pyproject.toml needs Python >= 3.11 or the tomli "
                              "package (pip install tomli)") from None
    with open(path, "rb") as f:
        return tomllib.load(f)


def config(root: Path = ROOT) -> dict:
    """``{"repository", "branch", "owner", "repo"}`` from ``[tool.labkit]`` in pyproject.toml."""
    path = Path(root) / "pyproject.toml"
    table = _toml(path).get("tool", {}).get("labkit")
    if not isinstance(table, dict):
        raise ConfigError(f"{path}: no [tool.labkit] table; add repository = "
                          f'"https://github.com/<owner>/<repo>" and branch = "main"')
    repository = table.get("repository")
    branch = table.get("branch", "main")
    m = re.fullmatch(r"https://github\.com/([\w.-]+)/([\w.-]+?)(?:\.git)?/?",
                     repository if isinstance(repository, str) else "")
    if m is None:
        raise ConfigError(f"{path}: [tool.labkit] repository = {repository!r}; expected "
                          f'"https://github.com/<owner>/<repo>" (the badges open '
                          f"notebooks from that GitHub repository)")
    if not isinstance(branch, str) or not re.fullmatch(r"[\w./-]+", branch):
        raise ConfigError(f"{path}: [tool.labkit] branch = {branch!r}; expected a branch "
                          f'name such as "main"')
    owner, repo = m.groups()
    return {"repository": f"https://github.com/{owner}/{repo}", "branch": branch,
            "owner": owner, "repo": repo}


def colab_url(rel_path: str, cfg: dict) -> str:
    """The URL that opens ``rel_path`` (relative to the repository root) in Colab."""
    return COLAB_URL.format(owner=cfg["owner"], repo=cfg["repo"], branch=cfg["branch"],
                            path=rel_path)


def install_spec(cfg: dict) -> str:
    """What pip installs on Colab when ``LABKIT_INSTALL`` is not set."""
    return f"git+{cfg['repository']}@{cfg['branch']}"


def badge_source(rel_path: str, cfg: dict) -> str:
    return BADGE.format(image=BADGE_IMAGE, url=colab_url(rel_path, cfg))


def _version(root: Path = ROOT) -> str:
    """labkit's version in ``root`` (or, where ``root`` holds no labkit, in this checkout)."""
    init = Path(root) / "labkit" / "__init__.py"
    if not init.is_file():
        init = ROOT / "labkit" / "__init__.py"
    m = re.search(r'^__version__ = "([^"]+)"', init.read_text(encoding="utf-8"), re.M)
    if m is None:
        raise ConfigError(f'{init}: no __version__ = "..." line')
    return m.group(1)


def setup_source(cfg: dict, root: Path = ROOT) -> str:
    """The setup cell's code for ``cfg`` (its error names the wheel of ``root``'s version)."""
    placeholder = PLACEHOLDER_REPOSITORY is not None and cfg["repository"] == PLACEHOLDER_REPOSITORY
    why = string.Template(WHY_PLACEHOLDER if placeholder else WHY_REPOSITORY).substitute(
        repository=cfg["repository"])
    wheel = f"labkit-{_version(root)}-py3-none-any.whl"
    return SETUP.substitute(env=ENV_VAR, spec=install_spec(cfg), why=why, wheel=wheel)


def links_colab(rel_path: str) -> bool:
    """Whether the notebook at ``rel_path`` gets Colab links (:data:`LINKED`)."""
    from fnmatch import fnmatchcase

    return any(fnmatchcase(rel_path, pattern) for pattern in LINKED)


def link_target(rel_path: str, target: str) -> str | None:
    """The repository path a relative link in the notebook ``rel_path`` points at (``None``
    when it leaves the repository)."""
    path = posixpath.normpath(posixpath.join(posixpath.dirname(rel_path), target))
    return None if path == ".." or path.startswith("../") else path


def with_colab_links(text: str, rel_path: str, cfg: dict) -> str:
    """``text`` (Markdown of the notebook ``rel_path``) with ``([on Colab](URL))`` after
    every relative link to a notebook, replacing the one a previous stamp put there."""
    def put(m: re.Match) -> str:
        link = f"[{m['text']}]({m['target']}{m['frag'] or ''})"
        path = link_target(rel_path, m["target"])
        return link if path is None else link + COLAB_LINK.format(url=colab_url(path, cfg))

    return _LINK.sub(put, text)


def notebooks(root: Path = ROOT) -> list[Path]:
    """Every notebook the generator stamps: ``notebooks/*.ipynb`` and ``solutions/*.ipynb``."""
    root = Path(root)
    return sorted(p for folder in FOLDERS for p in (root / folder).glob("*.ipynb"))


def _new_cells(rel_path: str, cfg: dict, root: Path = ROOT):
    import nbformat

    badge = nbformat.v4.new_markdown_cell(badge_source(rel_path, cfg))
    badge.id = IDS["badge"]
    badge.metadata = {"labkit": {KEY: "badge"}, "slideshow": dict(SKIP)}
    setup = nbformat.v4.new_code_cell(setup_source(cfg, root))
    setup.id = IDS["setup"]
    setup.metadata = {"labkit": {KEY: "setup"}, "slideshow": dict(SKIP)}
    return badge, setup


def _kind(cell) -> str | None:
    return (cell.get("metadata", {}).get("labkit") or {}).get(KEY)


def stamped(path: Path, root: Path = ROOT, cfg: dict | None = None) -> tuple[str, str]:
    """``(current text, stamped text)`` of one notebook."""
    import nbformat

    cfg = cfg or config(root)
    path = Path(path)
    rel = path.resolve().relative_to(Path(root).resolve()).as_posix()
    text = path.read_text(encoding="utf-8")
    nb = nbformat.reads(text, as_version=4)
    old = {_kind(c): c for c in nb.cells if _kind(c) in IDS}
    badge, setup = _new_cells(rel, cfg, root)
    # an unchanged setup cell keeps what it had (an execution count); only its code matters
    if "setup" in old and old["setup"].source == setup.source:
        setup = old["setup"]
        setup.metadata = {**setup.metadata, "labkit": {KEY: "setup"}, "slideshow": dict(SKIP)}
    nb.cells = [badge, setup] + [c for c in nb.cells if _kind(c) not in IDS]
    if links_colab(rel):
        for cell in nb.cells[2:]:
            if cell.cell_type == "markdown":
                cell.source = with_colab_links(cell.source, rel, cfg)
    out = nbformat.writes(nb, version=4)
    return text, out if out.endswith("\n") else out + "\n"


def stale(root: Path = ROOT) -> list[Path]:
    """The notebooks whose badge, setup cell or Colab links differ from what the config
    makes now."""
    cfg = config(root)
    return [p for p in notebooks(root) if len(set(stamped(p, root, cfg))) == 2]


def stamp(root: Path = ROOT, out=sys.stdout) -> list[Path]:
    """Write the badge and setup cell into every notebook that needs them; return those."""
    cfg = config(root)
    written = []
    for p in notebooks(root):
        text, new = stamped(p, root, cfg)
        if new != text:
            p.write_text(new, encoding="utf-8")
            written.append(p)
            print(f"stamped {p.relative_to(root).as_posix()}", file=out)
    print(f"{len(written)} of {len(notebooks(root))} notebooks stamped "
          f"(badges -> {cfg['repository']} @ {cfg['branch']})", file=out)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python tools/colab_cells.py",
        description="Stamp the Open-in-Colab badge and the Colab setup cell into "
                    "notebooks/*.ipynb and solutions/*.ipynb, and Colab links beside the "
                    "relative notebook links of the walkthrough and the solutions, from "
                    "[tool.labkit] in pyproject.toml.")
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 if a notebook needs restamping")
    parser.add_argument("--root", type=Path, default=ROOT, help="repository root")
    args = parser.parse_args(argv)
    try:
        if args.check:
            bad = stale(args.root)
            for p in bad:
                print(f"stale: {p.relative_to(args.root).as_posix()} (its Colab badge, "
                      f"setup cell or Colab links differ from [tool.labkit] in pyproject.toml)")
            if bad:
                print("run `make colab-cells` to restamp them")
            return 1 if bad else 0
        stamp(args.root)
    except (ConfigError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
