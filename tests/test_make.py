"""`make lab` as a learner runs it: it starts (as root too), the URL it prints opens lesson
00, and the server loads no authoring tool (nbgrader's server and lab extensions stay off
even where an older .venv still has nbgrader installed).

Runs the real Makefile target against the environment running the tests (its stamps are
taken as up to date: nothing is installed), on a free port, and stops the server after.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
VENV = Path(sys.prefix)
JUPYTER = VENV / "bin" / "jupyter"

pytestmark = pytest.mark.skipif(
    shutil.which("make") is None or not JUPYTER.exists()
    or not (VENV / "bin" / "python").exists(),
    reason="needs make and jupyterlab in the environment running the tests (a venv)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str) -> str:
    # the URL is printed a moment before the socket accepts: retry a refused connection
    for _ in range(40):
        try:
            with urllib.request.urlopen(url, timeout=30) as r:
                return r.read().decode()
        except urllib.error.URLError as exc:
            if "Connection refused" not in str(exc):
                raise
            time.sleep(0.5)
    raise AssertionError(f"{url}: connection refused for 20 s")


@pytest.fixture(scope="module")
def lab():
    port = _free_port()
    cmd = ["make", "--no-print-directory", f"VENV={VENV}",
           "-o", f"{VENV}/.installed", "-o", f"{VENV}/bin/python", "lab",
           f"LAB_ARGS=--no-browser --port {port} --ServerApp.port_retries=0"]
    log = []
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    url = None
    try:
        deadline = time.time() + 90
        while time.time() < deadline:
            line = proc.stdout.readline()
            if not line:
                if proc.poll() is not None:
                    break
                continue
            log.append(line)
            m = re.search(rf"(http://127\.0\.0\.1:{port}/\S+)", line)
            if m:
                url = m.group(1)
                break
        assert url, "make lab printed no URL:\n" + "".join(log)
        page = _get(url)
        token = url.split("token=")[-1]
        sessions = json.loads(_get(f"http://127.0.0.1:{port}/api/sessions?token={token}"))
        yield {"url": url, "page": page, "log": "".join(log), "sessions": sessions,
               "cmd": " ".join(cmd)}
    finally:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _page_config(page: str) -> dict:
    m = re.search(r'<script id="jupyter-config-data" type="application/json">(.*?)</script>',
                  page, re.S)
    assert m, "no jupyter-config-data in the page"
    return json.loads(m.group(1))


def test_lab_starts_and_prints_the_lesson_00_url(lab):
    # as root too (GPU containers): no "Running as root is not recommended" stop
    assert "Running as root is not recommended" not in lab["log"]
    assert "/lab/tree/notebooks/00_start_here.ipynb?token=" in lab["url"]
    cfg = _page_config(lab["page"])
    assert cfg["treePath"] == "notebooks/00_start_here.ipynb"      # the file the page opens
    assert Path(cfg["serverRoot"]).resolve() == ROOT
    assert isinstance(lab["sessions"], list)


def test_lab_loads_no_nbgrader(lab):
    loaded = re.findall(r"\] (\S+) \| extension was successfully loaded", lab["log"])
    assert "jupyterlab" in loaded
    assert not [e for e in loaded if "nbgrader" in e], loaded
    cfg = _page_config(lab["page"])
    federated = {e["name"] for e in cfg.get("federated_extensions", [])}
    disabled = set(cfg.get("disabledExtensions", []))
    assert not {n for n in federated if "nbgrader" in n} - disabled


def test_lab_installs_no_test_or_authoring_tools():
    out = subprocess.run(["make", "-n", "--no-print-directory", f"VENV={VENV}",
                          f"STAMP={VENV}/.nonexistent-stamp", f"{VENV}/.nonexistent-stamp"],
                         cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    installs = [ln for ln in out.stdout.splitlines() if "pip install" in ln and " -e " in ln]
    assert installs and all(ln.rstrip().endswith("-e .") for ln in installs), installs


# ---- install policies, with a stand-in python that records what it is asked -------------

FAKE_PY = r"""#!/bin/sh
echo "$*" >> "$FAKE_LOG"
case "$*" in
  "-c import torch") [ -n "$FAKE_HAS_TORCH" ] && exit 0; exit 1 ;;
  "-c import nbconvert") [ -n "$FAKE_HAS_NBCONVERT" ] && exit 0; exit 1 ;;
  *"m.version(\"torch\")"*) echo "torch==2.13.0+cpu"; exit 0 ;;
  "-m pip install -q torch=="*"+cpu") [ -n "$FAKE_LOCAL_WHEEL" ] && exit 0; exit 1 ;;
esac
exit 0
"""


def _make_with_fake_python(tmp_path, target: str, **env) -> tuple[list[str], str]:
    """``make TARGET`` (``{venv}`` in it: the stand-in venv) with FAKE_PY as the venv's
    python; returns the python's calls (its arguments, one a line) and make's stdout.
    ``env``: FAKE_* go to the environment, upper-case others are make variables."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    py = venv / "bin" / "python"
    py.write_text(FAKE_PY)
    py.chmod(0o755)
    log = tmp_path / "log"
    log.write_text("")
    args = [f"{k}={v}" for k, v in env.items() if k.isupper() and not k.startswith("FAKE")]
    r = subprocess.run(["make", "--no-print-directory", f"VENV={venv}", *args,
                        target.format(venv=venv)], cwd=ROOT, capture_output=True, text=True,
                       env={**os.environ, "FAKE_LOG": str(log),
                            **{k: v for k, v in env.items() if k.startswith("FAKE")}})
    assert r.returncode == 0, r.stdout + r.stderr
    return log.read_text().splitlines(), r.stdout


def _install_with_fake_python(tmp_path, **env):
    calls, out = _make_with_fake_python(tmp_path, "{venv}/.installed", **env)
    return [ln for ln in calls if ln.startswith("-m pip install")], out


@pytest.mark.skipif(shutil.which("make") is None or sys.platform == "darwin",
                    reason="needs make; Linux policy")
def test_torch_policy_cpu_build_local_wheel_first(tmp_path):
    pip, out = _install_with_fake_python(tmp_path, FAKE_LOCAL_WHEEL="1")
    assert pip[0] == "-m pip install -q torch==2.13.0+cpu"
    assert "from a wheel pip finds on this machine" in out
    assert not any("download.pytorch.org" in p for p in pip)
    assert pip[-1].endswith("install -c " + str(tmp_path / "venv") + "/torch-constraint.txt -e .")


@pytest.mark.skipif(shutil.which("make") is None or sys.platform == "darwin",
                    reason="needs make; Linux policy")
def test_torch_policy_cpu_build_from_pytorch_index(tmp_path):
    pip, out = _install_with_fake_python(tmp_path)
    assert pip[:2] == ["-m pip install -q torch==2.13.0+cpu",
                       "-m pip install torch==2.13.0+cpu --extra-index-url "
                       "https://download.pytorch.org/whl/cpu"]
    # never a bare torch==X, which on Linux resolves to PyPI's CUDA build
    assert not any(re.search(r"torch==[\d.]+(\s|$)", p) for p in pip), pip


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_torch_policy_keeps_an_installed_torch_and_honours_torch_spec(tmp_path):
    pip, out = _install_with_fake_python(tmp_path, FAKE_HAS_TORCH="1")
    assert "keeping torch" in out and not any("torch==" in p for p in pip[:-1])
    pip, out = _install_with_fake_python(tmp_path / "b", TORCH_SPEC="torch==2.5.1")
    assert pip[0] == "-m pip install torch==2.5.1"


# ---- make slides: nbconvert alone, not the test environment -----------------------------------

@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
@pytest.mark.parametrize("has_nbconvert", [False, True])
def test_make_slides_installs_nbconvert_alone_when_missing(tmp_path, has_nbconvert):
    calls, _ = _make_with_fake_python(tmp_path, "slides",
                                      FAKE_HAS_NBCONVERT="1" if has_nbconvert else "")
    install = [] if has_nbconvert else ["-m pip install nbconvert"]
    assert calls == ["-c import nbconvert", *install, "tools/slides.py build"], calls
