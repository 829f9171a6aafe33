"""labkit doctor: what backend and versions are in use, and advice when something is missing."""

from __future__ import annotations

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


def test_doctor_says_what_to_do_about_a_missing_package(monkeypatch):
    real = D._version
    monkeypatch.setattr(D, "_version", lambda dist: None if dist == "nbval" else real(dist))
    report, info = D.doctor()
    assert info["packages"]["nbval"] is None
    assert "What to do:" in report and "nbval is missing: `make test` installs it" in report
