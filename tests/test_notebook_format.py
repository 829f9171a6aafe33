"""Every notebook the lab ships is valid nbformat: a malformed cell (a markdown cell with
``outputs``, say) loads in JupyterLab but stops nbconvert, so ``make slides`` fails."""

from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted(p for d in ("notebooks", "solutions", "exercises")
                   for p in (ROOT / d).glob("*.ipynb"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_notebook_is_valid_nbformat(path):
    nbformat.validate(nbformat.read(path, as_version=4))


def test_there_are_notebooks():
    assert len(NOTEBOOKS) >= 30
