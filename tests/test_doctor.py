"""labkit doctor: what backend and versions are in use, and advice when something is missing."""

from __future__ import annotations

import json
import subprocess
import sys

import torch

from labkit import doctor as D


def test_doctor_reports_torch_backend_and_packages():
    report, info = D.doctor()
    assert info["torch"] == torch.__version__
    assert info["backend"] == ("cuda" if torch.cuda.is_available() else "emulated")
    assert f"torch               {torch.__version__}" in report
    assert "triton" in report and 'backend "auto"' in report
    for name in D.PACKAGES:
        assert name in info["packages"]
    for name in D.TOOLS:
        assert name in info["tools"]
    assert "nbgrader" not in report            # an authoring tool: no learner needs it


def test_doctor_says_what_to_do_about_a_missing_lesson_package(monkeypatch):
    real = D._version
    monkeypatch.setattr(D, "_version", lambda dist: None if dist == "matplotlib" else real(dist))
    report, info = D.doctor()
    assert info["packages"]["matplotlib"] is None
    assert "What to do:" in report
    assert "matplotlib is missing and the lessons import it: `make lab` or `make test` " \
           "installs it" in report


def test_a_missing_tool_is_a_fact_not_a_problem(monkeypatch):
    # a kernel started without jupyterlab (nbconvert, VS Code, a GPU box running nbval):
    # the lessons run; the report says what the tool is for and asks for nothing
    real = D._version
    gone = {"jupyterlab", "nbconvert", "nbval", "pytest"}
    monkeypatch.setattr(D, "_version", lambda dist: None if dist in gone else real(dist))
    report, info = D.doctor()
    assert "missing" not in report.lower() and "What to do:" not in report
    assert "jupyterlab          not installed (used for: opens the lessons in a browser)" \
        in report
    assert "Everything the lessons need is here." in report
    assert info["tools"]["jupyterlab"] is None and info["advice"] == []


def test_cli_json_and_text():
    r = subprocess.run([sys.executable, "-m", "labkit", "doctor", "--json"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert info["torch"] == torch.__version__ and "packages" in info and "tools" in info
    r = subprocess.run([sys.executable, "-m", "labkit", "doctor"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.startswith("labkit doctor:")
    r = subprocess.run([sys.executable, "-m", "labkit", "doctor", "--jsn"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "unrecognized arguments: --jsn" in r.stderr
    assert "Traceback" not in r.stderr
