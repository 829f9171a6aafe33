"""The Colab walkthrough runs from an empty folder in a Colab-like clean environment.

What the test does, without the internet and without Colab:

1. **A wheel of the checkout.** ``pyproject.toml``, ``README.md`` and ``labkit/`` are copied
   into a temporary folder (so the build writes no ``build/`` or ``*.egg-info`` into the
   checkout) and built with ``pip wheel --no-deps --no-build-isolation``: the build backend
   already installed here (setuptools), no index, no network. A real build, so a
   subpackage the packaging config misses is missing from the wheel too. Where setuptools
   is not installed (a Python >= 3.12 venv), :func:`zip_wheel` zips the same package list.
2. **A clean environment with only what Colab preinstalls.** ``python -m venv
   --without-pip`` from the base interpreter of the running Python (same version, so the
   same binary wheels fit), without system site-packages. Colab's preinstalled packages
   are *not* reinstalled (no index here, and torch is gigabytes): the packages already
   installed where this test runs are linked instead. The roots are Colab's: ``torch``,
   ``matplotlib``, ``ipywidgets``, ``ipykernel``, ``nbclient``, ``nbformat`` and ``pip``
   (the setup cell runs ``python -m pip``). Their dependency closure is computed from the
   installed metadata (``Requires-Dist`` with its environment markers, extras left out),
   and for each distribution in it every top-level entry of its ``RECORD`` (packages,
   modules, extension files) and its ``.dist-info`` is symlinked into one folder,
   ``colab-site``. A ``.pth`` file in the venv's site-packages puts that folder (and the
   fake ``google.colab``) on ``sys.path``. A ``.pth`` path line does not make a *site
   dir*: the ``.pth`` files of the original environment (labkit's editable install,
   coverage hooks) are not run, so the checkout's ``labkit`` cannot be imported, and
   nothing outside the closure (pytest, jupyterlab, nbgrader, tqdm...) is there.
3. **Colab, faked.** A ``google.colab`` package whose ``output.enable_custom_widget_manager``
   records its call and does nothing, imported at kernel start by an IPython startup file
   (``IPYTHONDIR``), as Colab's kernel has it imported: the setup cell tests
   ``"google.colab" in sys.modules``, so it really runs its install.
4. **Only the notebook.** ``notebooks/walkthrough.ipynb`` is copied alone into an empty
   folder; ``LABKIT_INSTALL`` is set to the wheel (the setup cell's override), pip is told
   to use no index. nbclient runs *inside the clean venv* (so its kernel is that venv's
   Python: the native ``python3`` kernel, with the Jupyter data, config and runtime dirs
   pointed at temporary folders so no installed kernelspec can redirect it) with the
   folder as the working directory, and executes every cell. One probe cell is appended in
   memory (never written to the notebook) to report where ``labkit`` was imported from.

Asserted: every cell ran without an error; the setup cell installed the wheel into the
clean venv's site-packages (``labkit.__file__`` there, and neither the checkout nor its
environment on ``sys.path``); it called the widget manager and printed the backend; the
walkthrough's own backend line was printed; and the folder held only the notebook.

It is skipped only when a prerequisite is missing here, naming it: the base interpreter,
the ``venv`` module, or one of the packages to link.

The same procedure runs on a GPU machine for the stored outputs (no pytest there):
``python tests/test_walkthrough_colab.py --out executed.ipynb [--wheel labkit.whl]``
(``scratch/gpu/walkthrough.sh``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOK = ROOT / "notebooks" / "walkthrough.ipynb"
# What Colab preinstalls that the walkthrough and its setup cell use (the closure of these
# is linked; labkit itself is installed by the setup cell, with --no-deps).
COLAB_ROOTS = ("torch", "matplotlib", "ipywidgets", "ipykernel", "nbclient", "nbformat", "pip")
PROBE = ("import json, sys, labkit, google.colab.output as _o\n"
         "print('WALKTHROUGH-PROBE ' + json.dumps({'labkit': labkit.__file__, "
         "'executable': sys.executable, 'path': sys.path, 'widget_manager': _o.calls}))")


class Missing(Exception):
    """A prerequisite of the clean environment is not on this machine (names it)."""


# ------------------------------------------------------------------------ the closure

def _requirement_cls():
    try:
        from packaging.requirements import Requirement
    except ImportError:  # pip vendors it
        from pip._vendor.packaging.requirements import Requirement
    return Requirement


def _canon(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def closure(roots=COLAB_ROOTS) -> dict:
    """``{canonical name: Distribution}`` for ``roots`` and everything they require here."""
    import importlib.metadata as md

    Requirement = _requirement_cls()
    found, todo = {}, list(roots)
    while todo:
        name = todo.pop()
        if _canon(name) in found:
            continue
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            raise Missing(f"the package {name!r} is not installed in {sys.prefix} "
                          "(the clean environment links it from here)") from None
        found[_canon(name)] = dist
        for spec in dist.requires or []:
            req = Requirement(spec)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return found


def _top_level(dist) -> set[str]:
    """The names directly under site-packages that a distribution installed."""
    names = set()
    for f in dist.files or []:
        parts = Path(str(f)).parts
        if parts and parts[0] not in ("..", "__pycache__") and not parts[0].endswith(".pth"):
            names.add(parts[0])
    if not names:  # no RECORD: fall back to top_level.txt
        for n in (dist.read_text("top_level.txt") or "").split():
            names.update({n, n + ".py"})
    return names


def link_site(target: Path, roots=COLAB_ROOTS) -> list[str]:
    """Symlink the closure of ``roots`` into ``target``; return the distributions linked."""
    target.mkdir(parents=True, exist_ok=True)
    dists = closure(roots)
    for dist in dists.values():
        base = Path(dist.locate_file(""))
        for name in _top_level(dist):
            src, dst = base / name, target / name
            if src.exists() and not dst.exists():
                dst.symlink_to(src, target_is_directory=src.is_dir())
    return sorted(dists)


# ------------------------------------------------------------------------ the pieces

def build_wheel(dest: Path, root: Path = ROOT) -> Path:
    """A wheel of the checkout, built offline from a copy of its packaging files.

    With setuptools installed here (the build backend of ``pyproject.toml``, with its
    ``bdist_wheel``): ``pip wheel --no-build-isolation``, the real packaging. Without it (a
    Python >= 3.12 venv has no setuptools, and build isolation would need an index):
    :func:`zip_wheel`.
    """
    import importlib.util

    # the build backend, used without isolation; bdist_wheel is setuptools' own from 70.1 on,
    # the `wheel` package's before that
    if importlib.util.find_spec("setuptools") is None or (
            importlib.util.find_spec("setuptools.command.bdist_wheel") is None
            and importlib.util.find_spec("wheel") is None):
        return zip_wheel(dest / "wheel", root)
    src = dest / "src"
    src.mkdir(parents=True)
    for f in ("pyproject.toml", "README.md"):
        shutil.copy2(root / f, src / f)
    shutil.copytree(root / "labkit", src / "labkit",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    out = dest / "wheel"
    p = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                        "--no-index", "-q", "-w", str(out), str(src)],
                       capture_output=True, text=True, env=_pip_env())
    wheels = sorted(out.glob("labkit-*.whl"))
    if p.returncode or not wheels:
        raise RuntimeError(f"building the labkit wheel failed:\n{p.stdout}\n{p.stderr}")
    return wheels[0]


def _package_data(root: Path) -> dict:
    """``[tool.setuptools.package-data]`` of ``pyproject.toml``: ``{package: [glob, ...]}``."""
    try:
        import tomllib
    except ImportError:  # Python 3.10
        import tomli as tomllib
    with open(root / "pyproject.toml", "rb") as f:
        return tomllib.load(f).get("tool", {}).get("setuptools", {}).get("package-data", {})


def zip_wheel(out: Path, root: Path = ROOT) -> Path:
    """A pure-Python wheel (PEP 427) of what ``[tool.setuptools.packages.find]`` includes:
    ``labkit`` and every ``labkit.*`` package (a folder with ``__init__.py`` whose parents
    are packages), their ``.py`` files, and the files ``[tool.setuptools.package-data]``
    names (the committed benchmark results). The setup cell installs it with
    ``--no-deps``, so the metadata holds name and version only."""
    import base64
    import hashlib
    import zipfile

    text = (root / "labkit" / "__init__.py").read_text()
    version = re.search(r'^__version__ = "([^"]+)"', text, re.M).group(1)
    info = f"labkit-{version}.dist-info"
    files = {}
    for init in sorted((root / "labkit").rglob("__init__.py")):
        pkg = init.parent
        rel = pkg.relative_to(root)
        if all((root / Path(*rel.parts[:i]) / "__init__.py").exists()
               for i in range(1, len(rel.parts) + 1)):
            for f in sorted(pkg.glob("*.py")):
                files[f.relative_to(root).as_posix()] = f.read_bytes()
    for package, patterns in _package_data(root).items():
        pkg = root / Path(*package.split("."))
        for pattern in patterns:
            for f in sorted(pkg.glob(pattern)):
                if f.is_file():
                    files[f.relative_to(root).as_posix()] = f.read_bytes()
    files[f"{info}/METADATA"] = (f"Metadata-Version: 2.1\nName: labkit\nVersion: {version}\n"
                                 ).encode()
    files[f"{info}/WHEEL"] = (b"Wheel-Version: 1.0\nGenerator: tests/test_walkthrough_colab.py"
                              b"\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
    record = []
    for name, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append(f"{name},sha256={digest},{len(data)}")
    files[f"{info}/RECORD"] = ("\n".join(record + [f"{info}/RECORD,,"]) + "\n").encode()
    out.mkdir(parents=True, exist_ok=True)
    wheel = out / f"labkit-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, data in files.items():
            zf.writestr(name, data)
    return wheel


def _pip_env() -> dict:
    env = dict(os.environ)
    env.update(PIP_NO_INDEX="1", PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_CACHE_DIR="1")
    return env


def make_venv(dest: Path, site: Path, fake: Path) -> Path:
    """A venv without pip and without system site-packages that sees ``site`` and ``fake``."""
    base = getattr(sys, "_base_executable", None) or sys.executable
    if not Path(base).exists():
        raise Missing(f"the base interpreter {base} of this Python is not there")
    p = subprocess.run([base, "-m", "venv", "--without-pip", str(dest)],
                       capture_output=True, text=True)
    if p.returncode:
        raise Missing(f"{base} -m venv failed (is the venv module installed?): {p.stderr}")
    python = dest / "bin" / "python"
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
        capture_output=True, text=True, check=True).stdout.strip()
    Path(purelib, "_colab_preinstalled.pth").write_text(f"{site}\n{fake}\n")
    return python


FAKE_OUTPUT = '''\
"""google.colab.output, faked for the walkthrough test: the widget manager is a no-op."""
calls = 0


def enable_custom_widget_manager():
    global calls
    calls += 1
'''


def make_fake_colab(dest: Path, ipython_dir: Path) -> None:
    """``google.colab`` (``google`` a namespace package) and a startup file importing it."""
    pkg = dest / "google" / "colab"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text('"""A stand-in for Colab\'s google.colab (tests only)."""\n')
    (pkg / "output.py").write_text(FAKE_OUTPUT)
    startup = ipython_dir / "profile_default" / "startup"
    startup.mkdir(parents=True)
    (startup / "00-colab.py").write_text("import google.colab  # as on Colab: imported at start\n")


RUNNER = '''\
import json, sys, time
import nbformat
from nbclient import NotebookClient

nb_path, out_path, probe = sys.argv[1], sys.argv[2], sys.argv[3]
nb = nbformat.read(nb_path, as_version=4)
n = len(nb.cells)
nb.cells.append(nbformat.v4.new_code_cell(probe))
client = NotebookClient(nb, timeout=600, kernel_name="python3", record_timing=False,
                        resources={"metadata": {"path": sys.argv[4]}})
t0 = time.perf_counter()
error = None
try:
    client.execute()
except Exception as exc:
    error = f"{type(exc).__name__}: {exc}"
seconds = time.perf_counter() - t0
probe_cell = nb.cells.pop()
nbformat.write(nb, out_path)
print("RUNNER-RESULT " + json.dumps({"error": error, "seconds": seconds, "cells": n,
                                     "probe": [o.get("text", "") for o in probe_cell.outputs]}))
'''


def run_walkthrough(tmp: Path, wheel: Path | None = None, notebook: Path = NOTEBOOK,
                    out: Path | None = None) -> dict:
    """Everything above, in ``tmp``; returns what the assertions need.

    ``wheel``: a prebuilt labkit wheel (default: build one from the checkout). ``out``:
    where to write the executed notebook (default: next to the copy, in the empty folder).
    """
    tmp = Path(tmp)
    t0 = time.perf_counter()
    wheel = Path(wheel) if wheel else build_wheel(tmp / "build")
    t_wheel = time.perf_counter() - t0
    site, fake, ipython = tmp / "colab-site", tmp / "fake-colab", tmp / "ipython"
    linked = link_site(site)
    make_fake_colab(fake, ipython)
    python = make_venv(tmp / "venv", site, fake)
    folder = tmp / "empty"
    folder.mkdir()
    nb_copy = folder / notebook.name
    shutil.copy2(notebook, nb_copy)
    executed = Path(out) if out else folder / notebook.name
    runner = tmp / "runner.py"
    runner.write_text(RUNNER)

    env = {k: v for k, v in _pip_env().items()
           if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PYTHONSTARTUP")
           and not k.startswith("LABKIT_") and not k.startswith("JUPYTER")
           and not k.startswith("COV_") and not k.startswith("COVERAGE_")}
    env.update(LABKIT_INSTALL=str(wheel), IPYTHONDIR=str(ipython),
               JUPYTER_DATA_DIR=str(tmp / "jupyter-data"),
               JUPYTER_CONFIG_DIR=str(tmp / "jupyter-config"),
               JUPYTER_RUNTIME_DIR=str(tmp / "jupyter-runtime"),
               JUPYTER_PLATFORM_DIRS="1", PYDEVD_DISABLE_FILE_VALIDATION="1",
               PATH=f"{python.parent}{os.pathsep}{os.environ.get('PATH', '')}")
    t1 = time.perf_counter()
    p = subprocess.run([str(python), str(runner), str(nb_copy), str(executed), PROBE,
                        str(folder)], capture_output=True, text=True, env=env, cwd=folder)
    result = next((json.loads(line.split(" ", 1)[1]) for line in p.stdout.splitlines()
                   if line.startswith("RUNNER-RESULT ")), None)
    if result is None:
        raise RuntimeError(f"the runner in the clean venv did not report (exit {p.returncode}):"
                           f"\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    probe = next((json.loads(t.split(" ", 1)[1]) for t in result["probe"]
                  if t.startswith("WALKTHROUGH-PROBE ")), None)
    import nbformat

    nb = nbformat.read(executed, as_version=4)
    result.update(
        probe=probe, wheel=str(wheel), linked=linked, python=str(python),
        purelib=str(Path(probe["labkit"]).parent.parent) if probe else None,
        venv=str(tmp / "venv"), folder_files=sorted(f.name for f in folder.iterdir()),
        wheel_seconds=t_wheel, run_seconds=time.perf_counter() - t1,
        outputs=[(c.get("metadata", {}).get("labkit", {}).get("colab"), _text(c))
                 for c in nb.cells if c.cell_type == "code"],
        errors=[_text(c) for c in nb.cells if c.cell_type == "code"
                and any(o.output_type == "error" for o in c.outputs)])
    return result


def _text(cell) -> str:
    return "".join(o.get("text", "") for o in cell.get("outputs", [])
                   if o.get("output_type") == "stream")


# ------------------------------------------------------------------------ the test

def problems(r: dict, backend: str) -> list[str]:
    """What is wrong with a run of :func:`run_walkthrough` (empty: nothing)."""
    if r["error"] is not None:
        plain = re.sub(r"\x1b\[[0-9;]*m", "", r["error"])      # no terminal colours
        return [f"the walkthrough failed in the clean env: ...{plain[-2500:]}"]
    if r["errors"]:
        return [f"error outputs: {r['errors']}"]
    probe = r["probe"]
    if probe is None:
        return ["the probe cell printed nothing"]
    venv, out = Path(r["venv"]), []
    if Path(probe["executable"]).parent.parent != venv:
        out.append(f"the kernel ran {probe['executable']}, not the clean venv's Python")
    labkit_file = Path(probe["labkit"])
    if venv not in labkit_file.parents or "site-packages" not in labkit_file.parts:
        out.append(f"labkit was imported from {labkit_file}, not the clean venv's site-packages")
    if any(p == str(ROOT) or p.startswith(str(ROOT) + os.sep) for p in probe["path"]):
        out.append(f"the checkout is on the kernel's sys.path: {probe['path']}")
    if probe["widget_manager"] != 1:
        out.append(f"google.colab.output.enable_custom_widget_manager was called "
                   f"{probe['widget_manager']} times, not once: the setup cell's Colab branch")
    setup = [text for kind, text in r["outputs"] if kind == "setup"]
    if not setup:
        out.append("the walkthrough has no setup cell (metadata.labkit.colab == 'setup'): "
                   "run `make colab-cells`")
    elif f"labkit backend: {backend}" not in setup[0]:
        out.append(f"the setup cell printed {setup[0]!r}, not 'labkit backend: {backend}'")
    if not any(text.startswith(f"backend: {backend} | device: ") for _, text in r["outputs"]):
        out.append(f"the walkthrough's line 'backend: {backend} | device: ...' is missing")
    if len(r["folder_files"]) != 1 or not r["folder_files"][0].endswith(".ipynb"):
        out.append(f"the folder held {r['folder_files']}, not the notebook alone")
    if r["cells"] < 20:
        out.append(f"only {r['cells']} cells ran")
    return out


def _backend() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "emulated"


def test_walkthrough_runs_from_an_empty_folder_in_a_colab_like_env(tmp_path):
    import pytest

    try:
        r = run_walkthrough(tmp_path)
    except Missing as exc:
        pytest.skip(f"prerequisite missing: {exc}")
    assert not problems(r, _backend()), "\n".join(problems(r, _backend()))


# ------------------------------------------------------------------------ GPU machine

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="Run notebooks/walkthrough.ipynb from an empty "
                                             "folder in a Colab-like clean venv.")
    ap.add_argument("--out", type=Path, required=True, help="where the executed notebook goes")
    ap.add_argument("--wheel", type=Path, help="a prebuilt labkit wheel (default: build one)")
    ap.add_argument("--notebook", type=Path, default=NOTEBOOK, help="the notebook to run")
    ap.add_argument("--keep", type=Path, help="work folder to keep (default: a temp folder)")
    args = ap.parse_args(argv)
    work = args.keep or Path(tempfile.mkdtemp(prefix="walkthrough-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        r = run_walkthrough(work, wheel=args.wheel.resolve() if args.wheel else None,
                            notebook=args.notebook.resolve(), out=args.out.resolve())
    except (Missing, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    summary = {k: r[k] for k in ("error", "seconds", "run_seconds", "wheel_seconds", "cells",
                                 "probe", "folder_files", "errors")}
    summary["setup_output"] = [t for k, t in r["outputs"] if k == "setup"]
    summary["python"] = sysconfig.get_python_version()
    summary["problems"] = problems(r, _backend())
    print(json.dumps(summary, indent=1))
    return 1 if summary["problems"] else 0


if __name__ == "__main__":
    sys.exit(main())
