"""Slide tags of the lessons and their reveal.js rendering (tools/slides.py, make slides)."""

from __future__ import annotations

import base64
import importlib.util
import re
import shutil
import struct
import sys
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("slides", ROOT / "tools" / "slides.py")
sl = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sl)
lay = sys.modules["slide_layout"]          # tools/slide_layout.py, which slides.py imports


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
    assert names[:-1] == sorted(p.name for p in (ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))


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
    out = lay.paginate([cell])
    assert [(c.metadata["slideshow"]["slide_type"], c.source.split("\n")[0]) for c in out] == [
        ("slide", "## 3 · A section"), ("subslide", "### A detail"), ("slide", "## 4 · Next")]
    assert out[1].source.endswith("## not a heading either\n```")     # fenced code stays whole
    assert [c.id for c in out] == [cell.id, f"{cell.id}-1", f"{cell.id}-2"]
    assert cell.source.startswith("## 3") and "slideshow" in cell.metadata  # input untouched


def test_markdown_blocks_never_split_fenced_code_or_a_list_item():
    blocks = lay.md_blocks("Intro:\n\n```\na\n\nb\n```\n\n1. item\n\n   its second paragraph\n"
                          "2. next\n\n# Title\nright after")
    assert blocks == ["Intro:", "```\na\n\nb\n```",
                      "1. item\n\n   its second paragraph\n2. next", "# Title", "right after"]


def test_a_line_starting_with_hash_and_a_number_stays_text():
    source = "pytorch issue\n#181723, \"...\"\n## A heading\n```\n#2937\n```\n#2937). done"
    assert lay.escape_hash_lines(source) == (
        "pytorch issue\n\\#181723, \"...\"\n## A heading\n```\n#2937\n```\n\\#2937). done")


def test_a_long_section_continues_on_subslides_that_fit():
    paragraphs = [f"Paragraph {i}: " + "word " * 90 + "end." for i in range(14)]
    cell = _md("## Long\n\n" + "\n\n".join(paragraphs))
    out = lay.paginate([cell])
    kinds = [c.metadata["slideshow"]["slide_type"] for c in out]
    assert kinds[0] == "slide" and len(kinds) >= 3 and set(kinds[1:]) == {"subslide"}
    assert "\n\n".join(c.source for c in out) == cell.source        # all of it, in order
    for c in out:
        blocks = lay.md_blocks(c.source)
        assert lay.MD_CELL + sum(map(lay.md_height, blocks)) <= lay.ROOM, c.source[:40]


def test_a_paragraph_ending_in_a_colon_moves_with_the_code_it_introduces():
    prose = "\n\n".join("word " * 110 for _ in range(3))
    intro = _md(f"## Section\n\n{prose}\n\nWatch it happen:")
    code = _tagged(_code("\n".join(f"x{i} = {i}" for i in range(14)), [TEXT]))
    slides = _slides(lay.paginate([intro, code]))
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
    assert lay.cell_height(cell) > lay.ROOM
    out = lay.paginate([_md("## Pictures"), cell])[1:]
    assert [c.metadata["slideshow"]["slide_type"] for c in out] == ["subslide", "subslide"]
    assert out[0].outputs == [text] and out[0].source == cell.source
    assert out[1].outputs == [pic] and sl.HIDE in out[1].metadata["tags"]
    small = _tagged(_code("plt.show()", [nbformat.v4.new_output(
        "display_data", data={"image/png": _png(1000, 300), "text/plain": "<Figure>"})]))
    assert len(lay.paginate([_md("## Pictures"), small])) == 2      # fits: stays whole


def test_the_estimates_grow_with_the_text():
    assert lay.md_height("word " * 400) > lay.md_height("word " * 100) > lay.md_height("word")
    assert lay.md_height("# " + "long title " * 8) > lay.md_height("# Short")
    wide = "| a | b |\n|---|---|\n| " + "x " * 200 + "| y |"
    assert lay._table_height(wide) > lay._table_height("| a | b |\n|---|---|\n| x | y |")
    assert lay.cell_height(_code("\n".join("z" for _ in range(10)))) > lay.cell_height(_code("z"))


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
    out = sl.finish_page(page, offline=True)
    assert f'href="vendor/{sl.THEME_COPY}" id="theme"' in out and "dist/theme" not in out


def _stream(text):
    return nbformat.v4.new_output("stream", name="stdout", text=text)


def _texts(cells):
    return ["".join(o.text for o in c.outputs) for c in cells]


def test_a_text_output_taller_than_a_slide_continues_on_subslides_cut_at_a_blank_line():
    paragraphs = ["\n".join(f"part {p} line {i}" for i in range(12)) for p in range(3)]
    cell = _tagged(_code("print(report)", [_stream("\n\n".join(paragraphs) + "\n")]))
    assert lay.cell_height(cell) > lay.ROOM
    out = lay.paginate([_md("## Report"), cell])[1:]
    assert [c.metadata["slideshow"]["slide_type"] for c in out] == ["-", "subslide"]
    assert out[0].source == cell.source and sl.HIDE not in out[0].metadata.get("tags", [])
    assert out[1].source == "" and sl.HIDE in out[1].metadata["tags"]
    assert out[1].id == f"{cell.id}-1"
    texts = _texts(out)                                       # cut at a blank line, nothing lost
    assert texts[0].rstrip().endswith("line 11") and texts[1].startswith("part ")
    assert "\n\n".join(t.rstrip("\n") for t in texts) + "\n" == cell.outputs[0].text
    assert all(lay.cell_height(c) <= lay.ROOM for c in out)
    assert cell.outputs[0].text.startswith("part 0") and len(cell.outputs) == 1   # untouched


def test_a_text_output_without_blank_lines_is_cut_between_its_least_indented_lines():
    items = [f"{n:2d}. finding {n}:\n" + "      why: " + "word " * 30 + "\n      fix: do x\n"
             for n in range(1, 16)]
    text = "report: 15 findings\n" + "".join(items)
    out = lay.split_outputs(_tagged(_code("print(report)", [_stream(text)])))
    texts = _texts(out)
    assert len(out) >= 2 and "".join(texts) == text
    for t in texts[1:]:
        assert re.match(r"\s?\d+\. finding", t), t[:40]         # each piece starts an item
    for c in out:
        assert lay.cell_height(c) <= lay.ROOM


def test_a_cut_never_follows_a_line_that_introduces_what_comes_next():
    lines = [f"    x{i} = {i}" for i in range(40)]
    lines[20] = "    # the next statement, explained:"
    lines[21] = "    if x:"
    text = "def f():\n" + "\n".join(lines) + "\n"
    head, rest, at_blank = lay.cut_text(text, lay.ROOM, 22 * lay.CODE_LINE)
    assert not at_blank and head + rest == text
    assert not head.rstrip().endswith(":") and not head.rstrip().split("\n")[-1].strip() \
        .startswith("#")


def test_outputs_move_whole_to_the_next_piece_before_a_text_output_is_cut():
    table = nbformat.v4.new_output("display_data", data={
        "text/markdown": "| a | b |\n|---|---|\n" + "| x | y |\n" * 14, "text/plain": "t"})
    verdicts = _stream("".join(f"verdict {i}\n" for i in range(14)))
    cell = _tagged(_code("\n".join(f"z{i} = {i}" for i in range(12)),
                         [_stream("the rows:\n"), table, verdicts]))
    assert lay.cell_height(cell) > lay.ROOM
    out = lay.split_outputs(cell)
    assert [len(c.outputs) for c in out] == [1, 1, 1]
    assert out[1].outputs == [table] and out[2].outputs == [verdicts]


def test_a_cell_that_fits_and_a_picture_too_tall_stay_whole():
    small = _tagged(_code("print(1)", [_stream("1\n")]))
    assert lay.split_outputs(small) == [small]
    pic = nbformat.v4.new_output("display_data", data={"image/png": _png(800, 2000),
                                                      "text/plain": "<Figure>"})
    tall = _tagged(_code("plot()", [pic]))
    tall.metadata["tags"] = [sl.HIDE]
    assert lay.split_outputs(tall) == [tall]
    shown = _tagged(_code("plot()", [pic]))                   # its code on the slide before
    assert [(c.source, c.outputs) for c in lay.split_outputs(shown)] == [("plot()", []),
                                                                        ("", [pic])]


def test_text_before_a_cell_stays_behind_rather_than_force_a_cut_inside_a_paragraph():
    # the lead-in leaves room for part of the first paragraph only: the cell takes whole
    # slides, each paragraph on one, and the lead-in stays on the slide before
    paragraphs = ["\n".join(f"p{p} row {i}" for i in range(27)) for p in range(2)]
    cell = _tagged(_code("show()", [_stream("\n\n".join(paragraphs) + "\n")]))
    cell.metadata["tags"] = [sl.HIDE]
    prose = "word " * 250
    slides = _slides(lay.paginate([_md(f"## Rows\n\n{prose}\n\nThe rows:"), cell]))
    texts = [_texts([c])[0] for s in slides for c in s if c.cell_type == "code"]
    assert [t.split("\n")[0] for t in texts] == ["p0 row 0", "p1 row 0"]
    assert texts[0].rstrip().endswith("p0 row 26")
    assert slides[0][-1].source.endswith("The rows:")            # stayed behind


def test_build_zooms_out_what_the_estimates_missed_and_no_further_than_min_zoom(tmp_path,
                                                                               monkeypatch):
    _, text = _build_one(tmp_path, monkeypatch, "00_start_here.ipynb")
    assert f"MIN_ZOOM = {sl.MIN_ZOOM}" in text and "c.style.zoom = zoom" in text
    assert 0.8 <= sl.MIN_ZOOM < 1
