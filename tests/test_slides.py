"""Slide tags of the lessons and their reveal.js rendering (tools/slides.py, make slides)."""

from __future__ import annotations

import importlib.util
import re
import shutil
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("slides", ROOT / "tools" / "slides.py")
sl = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sl)


def test_every_lesson_is_tagged_and_tagging_is_idempotent():
    assert sl.lessons(ROOT), "no lessons found"
    for p in sl.lessons(ROOT):
        text, new = sl.tagged(p)
        assert new == text, f"{p.name}: slide tags not current: run `python tools/slides.py tag`"


def _code(source, outputs=()):
    cell = nbformat.v4.new_code_cell(source)
    cell.outputs = list(outputs)
    return cell


PNG = nbformat.v4.new_output("display_data", data={"image/png": "iVBORw0KGgo=",
                                                   "text/plain": "<Figure>"})
TEXT = nbformat.v4.new_output("stream", name="stdout", text="42\n")
LONG = "\n".join(f"x{i} = {i}" for i in range(sl.LONG + 1))


@pytest.mark.parametrize("cell, want", [
    (nbformat.v4.new_markdown_cell("# 01 · Title"), ("slide", False)),
    (nbformat.v4.new_markdown_cell("## 2 · Section\n\ntext"), ("slide", False)),
    (nbformat.v4.new_markdown_cell("### A detail"), ("subslide", False)),
    (nbformat.v4.new_markdown_cell("Plain prose with a # inside"), ("-", False)),
    (_code("plt.show()", [PNG]), ("subslide", False)),       # the picture leads
    (_code(LONG, [PNG]), ("subslide", True)),                # ... and long code folds away
    (_code(LONG), ("notes", False)),                         # long code, nothing shown
    (_code(LONG, [TEXT]), ("-", True)),
    (_code("print(42)", [TEXT]), ("-", False)),
])
def test_slide_tag_rules(cell, want):
    assert sl.slide_tags(cell) == want


def test_colab_cells_are_skipped():
    for p in sl.lessons(ROOT):
        nb = nbformat.read(p, as_version=4)
        for cell in nb.cells[:2]:
            assert cell.metadata["slideshow"] == {"slide_type": "skip"}, p.name


def test_build_renders_stored_pictures_without_a_kernel(tmp_path, monkeypatch):
    (tmp_path / "notebooks").mkdir()
    shutil.copy(ROOT / "notebooks" / "05_1f1b_capture.ipynb", tmp_path / "notebooks")
    monkeypatch.setattr(sl, "vendor", lambda out: False)      # no npm here: CDN mode
    (html,) = sl.build(tmp_path, tmp_path / "out", cdn=True)
    text = html.read_text()
    assert html.name == "05_1f1b_capture.slides.html"
    assert text.count("<section") > 3
    assert re.search(r'<img[^>]+src="data:image/png;base64,', text)
    assert "# NBVAL_CHECK_OUTPUT</span>" not in text          # test markers out of the code
    assert "# NBVAL_CHECK_OUTPUT" in (ROOT / "notebooks" / "05_1f1b_capture.ipynb").read_text()
    assert "colab-badge.svg" not in text                      # the badge cell is skipped
