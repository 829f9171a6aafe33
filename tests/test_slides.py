"""Slide tags of the lessons and their reveal.js rendering (tools/slides.py, make slides)."""

from __future__ import annotations

import base64
import importlib.util
import re
import shutil
import struct
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


def _build_one(tmp_path, monkeypatch, name: str):
    """``build`` of one lesson (copied into ``tmp_path``) in CDN mode: (its deck, the text)."""
    (tmp_path / "notebooks").mkdir()
    shutil.copy(ROOT / "notebooks" / name, tmp_path / "notebooks")
    monkeypatch.setattr(sl, "vendor", lambda out: False)      # no npm here: CDN mode
    (html,) = sl.build(tmp_path, tmp_path / "out", cdn=True)
    return html, html.read_text()


def test_build_renders_stored_pictures_without_a_kernel(tmp_path, monkeypatch):
    html, text = _build_one(tmp_path, monkeypatch, "05_1f1b_capture.ipynb")
    assert html.name == "05_1f1b_capture.slides.html"
    assert text.count("<section") > 3
    assert re.search(r'<img[^>]+src="data:image/png;base64,', text)
    assert "# NBVAL_CHECK_OUTPUT</span>" not in text          # test markers out of the code
    assert "# NBVAL_CHECK_OUTPUT" in (ROOT / "notebooks" / "05_1f1b_capture.ipynb").read_text()
    assert "colab-badge.svg" not in text                      # the badge cell is skipped


# ---- the decks, and cutting them into slides that fit (build time) ---------------------------

def test_the_decks_are_the_lessons_then_the_walkthrough():
    names = [p.name for p in sl.lessons(ROOT)]
    assert names[-1] == "walkthrough.ipynb"
    assert names[:-1] == sorted(p.name for p in (ROOT / "notebooks").glob("0*.ipynb"))


def _tagged(cell):
    cell.metadata["slideshow"] = {"slide_type": sl.slide_tags(cell)[0]}
    return cell


def _md(source):
    return _tagged(nbformat.v4.new_markdown_cell(source))


def _slides(cells):
    """The cells grouped as nbconvert groups them: a new group at each slide or subslide."""
    out = []
    for c in cells:
        kind = c.metadata["slideshow"]["slide_type"]
        if kind in ("slide", "subslide") or not out:
            out.append([])
        out[-1].append(c)
    return out


def test_headings_anywhere_in_a_cell_start_slides_and_subslides():
    cell = _md("## 3 · A section\n\nText.\n\n### A detail\n\nMore.\n\n"
               "```python\n# a comment\n## not a heading either\n```\n\n## 4 · Next\n\nEnd.")
    out = sl.paginate([cell])
    assert [(c.metadata["slideshow"]["slide_type"], c.source.split("\n")[0]) for c in out] == [
        ("slide", "## 3 · A section"), ("subslide", "### A detail"), ("slide", "## 4 · Next")]
    assert out[1].source.endswith("## not a heading either\n```")     # fenced code stays whole
    assert [c.id for c in out] == [cell.id, f"{cell.id}-1", f"{cell.id}-2"]
    assert cell.source.startswith("## 3") and "slideshow" in cell.metadata  # input untouched


def test_markdown_blocks_never_split_fenced_code_or_a_list_item():
    blocks = sl.md_blocks("Intro:\n\n```\na\n\nb\n```\n\n1. item\n\n   its second paragraph\n"
                          "2. next\n\n# Title\nright after")
    assert blocks == ["Intro:", "```\na\n\nb\n```",
                      "1. item\n\n   its second paragraph\n2. next", "# Title", "right after"]


def test_a_line_starting_with_hash_and_a_number_stays_text():
    source = "pytorch issue\n#181723, \"...\"\n## A heading\n```\n#2937\n```\n#2937). done"
    assert sl.escape_hash_lines(source) == (
        "pytorch issue\n\\#181723, \"...\"\n## A heading\n```\n#2937\n```\n\\#2937). done")


def test_a_long_section_continues_on_subslides_that_fit():
    paragraphs = [f"Paragraph {i}: " + "word " * 90 + "end." for i in range(14)]
    cell = _md("## Long\n\n" + "\n\n".join(paragraphs))
    out = sl.paginate([cell])
    kinds = [c.metadata["slideshow"]["slide_type"] for c in out]
    assert kinds[0] == "slide" and len(kinds) >= 3 and set(kinds[1:]) == {"subslide"}
    assert "\n\n".join(c.source for c in out) == cell.source        # all of it, in order
    for c in out:
        blocks = sl.md_blocks(c.source)
        assert sl.MD_CELL + sum(map(sl.md_height, blocks)) <= sl.ROOM, c.source[:40]


def test_a_paragraph_ending_in_a_colon_moves_with_the_code_it_introduces():
    prose = "\n\n".join("word " * 110 for _ in range(3))
    intro = _md(f"## Section\n\n{prose}\n\nWatch it happen:")
    code = _tagged(_code("\n".join(f"x{i} = {i}" for i in range(14)), [TEXT]))
    slides = _slides(sl.paginate([intro, code]))
    assert len(slides) == 2, [[c.source[:20] for c in s] for s in slides]
    assert [c.source for c in slides[1]] == ["Watch it happen:", code.source]


def _png(width, height):
    head = b"\x89PNG\r\n\x1a\n" + b"\x00\x00\x00\rIHDR" + struct.pack(">II", width, height)
    return base64.b64encode(head + b"\x08\x06\x00\x00\x00" + b"\x00" * 8).decode()


def test_a_picture_too_tall_to_share_a_slide_with_its_code_gets_the_next_subslide():
    pic = nbformat.v4.new_output("display_data", data={"image/png": _png(1000, 560),
                                                      "text/plain": "<Figure>"})
    text = nbformat.v4.new_output("stream", name="stdout", text="a line\n" * 6)
    cell = _tagged(_code("\n".join(f"y{i} = {i}" for i in range(8)), [text, pic]))
    assert sl.cell_height(cell) > sl.ROOM
    out = sl.paginate([_md("## Pictures"), cell])[1:]
    assert [c.metadata["slideshow"]["slide_type"] for c in out] == ["subslide", "subslide"]
    assert out[0].outputs == [text] and out[0].source == cell.source
    assert out[1].outputs == [pic] and sl.HIDE in out[1].metadata["tags"]
    small = _tagged(_code("plt.show()", [nbformat.v4.new_output(
        "display_data", data={"image/png": _png(1000, 300), "text/plain": "<Figure>"})]))
    assert len(sl.paginate([_md("## Pictures"), small])) == 2      # fits: stays whole


def test_the_estimates_grow_with_the_text():
    assert sl.md_height("word " * 400) > sl.md_height("word " * 100) > sl.md_height("word")
    assert sl.md_height("# " + "long title " * 8) > sl.md_height("# Short")
    wide = "| a | b |\n|---|---|\n| " + "x " * 200 + "| y |"
    assert sl._table_height(wide) > sl._table_height("| a | b |\n|---|---|\n| x | y |")
    assert sl.cell_height(_code("\n".join("z" for _ in range(10)))) > sl.cell_height(_code("z"))


def test_build_fits_slides_to_the_window_and_fetches_no_web_fonts(tmp_path, monkeypatch):
    _, text = _build_one(tmp_path, monkeypatch, "04_fwd_bwd_bridge.ipynb")
    assert "max-height: 720px; overflow-y: auto" in text       # a long slide scrolls in a box
    assert "var scroll = false" in text                        # ... not nbconvert's 95vh one
    assert re.search(r"width: 1280,\s*height: 720,", text)
    assert "fitPictures" in text and "Reveal.addEventListener('ready', fit)" in text
    assert "font-family: system-ui" in text
    assert not re.search(r"<h1[^>]*>\s*181723", text)          # '#181723,' is text
    assert "#181723," in text
    nb = nbformat.read(ROOT / "notebooks" / "04_fwd_bwd_bridge.ipynb", as_version=4)
    tagged = sum(c.metadata["slideshow"]["slide_type"] in ("slide", "subslide") for c in nb.cells)
    assert text.count("<section") > 2 * tagged                 # long sections were cut


def test_offline_theme_has_no_web_fonts(tmp_path):
    vendor = tmp_path / "vendor"
    for name in ("reveal.js", "requirejs", "jquery"):
        (vendor / name).mkdir(parents=True)
        (vendor / name / "package.json").write_text("{}")
    theme = vendor / "reveal.js" / "dist" / "theme"
    theme.mkdir(parents=True)
    (theme / f"{sl.THEME}.css").write_text(
        "@import url(https://fonts.googleapis.com/css?family=News+Cycle:400,700);\n"
        "@import url(https://fonts.googleapis.com/css?family=Lato:400,700);\n"
        ".reveal { font-family: 'Lato', sans-serif; }\n")
    assert sl.vendor(tmp_path)
    copy = (vendor / sl.THEME_COPY).read_text()
    assert "@import" not in copy and ".reveal { font-family" in copy
    page = ('<head><link href="vendor/reveal.js/dist/theme/simple.css" id="theme" '
            'rel="stylesheet"/></head><script>Reveal.initialize({\n width: 1280,\n});</script>')
    out = sl._finish(page, offline=True)
    assert f'href="vendor/{sl.THEME_COPY}" id="theme"' in out and "dist/theme" not in out
