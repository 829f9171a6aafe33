"""Reveal.js slides of every lesson and the walkthrough (``make slides``), and their slide tags.

An authoring tool, not part of ``labkit``. Two commands:

    python tools/slides.py tag [--check]   set metadata.slideshow.slide_type in the notebooks
    python tools/slides.py build [--cdn]   render build/slides/NAME.slides.html (make slides)

The notebooks with a deck: ``notebooks/0*.ipynb`` (the lessons), then
``notebooks/walkthrough.ipynb``.

**Tagging** (idempotent: the tags follow from the cells, so a second run changes nothing):

* a ``#`` or ``##`` heading starts a slide, a ``###`` heading a subslide; other Markdown
  continues the slide it is on;
* a code cell whose output has a picture gets a subslide of its own, so the picture leads;
  if its code is long (more than ``LONG`` lines) the code is hidden in the slides (cell
  tag ``hide-input``: the notebook itself still shows it);
* long code that prints nothing (definitions, setup) goes to the speaker notes;
  long code with text output keeps its output and hides its code;
* the Colab badge and setup cell are skipped (``tools/colab_cells.py`` tags them).

**Cutting into slides** happens at build time, on the copy of each notebook handed to
nbconvert (the notebooks are never rewritten by ``build``):

* a Markdown cell is cut at its ``#``, ``##`` and ``###`` headings (outside fenced code):
  each heading starts a slide or subslide by the rules above, wherever it sits in a cell;
* a slide (a ``WIDTH`` × ``HEIGHT`` area, 16:9, which reveal.js scales to fit the window)
  whose content is estimated taller than the area continues on a subslide below it
  (heights are estimated from the text, calibrated on Chromium's layout): Markdown is
  cut at paragraph boundaries (a paragraph ending in ``:`` moves with what follows), a
  code cell moves whole; a code cell whose picture does not fit beside its code and text
  output shows the picture on the next subslide (``split_pictures``); a cell still taller
  than a slide stays whole, and scrolls;
* a Markdown line that starts with ``#`` and no space (``#181723,``: an issue number
  wrapped to the line's start) is escaped: it is text, not an ``<h1>``.

**Rendering** uses ``jupyter nbconvert``'s ``SlidesExporter`` on the stored outputs (no
kernel runs): whatever the notebooks hold, CPU or GPU outputs, is what the slides show.
A widget's output shows as the picture it stored beside itself (slides have no kernel to
drive a slider). The build adds a style sheet and a script (``SLIDE_CSS``, ``SLIDE_JS``):
a slide taller than the slide area shrinks its pictures (to half their size at most) and
otherwise scrolls inside a box exactly as tall as the slide area, so its end can be
reached at any window size (nbconvert's own scroll box is turned off: it was taller than
the window); code, output and table text wraps instead of running off the right edge;
text is set in the system's fonts. reveal.js, require.js and jQuery are copied once into
``build/slides/vendor/`` with ``npm pack`` (the npm registry), and beside them a copy of
reveal.js's ``simple`` theme less its ``@import`` of web fonts, so the slides work offline
from ``file://`` and fetch nothing; without npm, or with ``--cdn``, they load from unpkg /
cdnjs like nbconvert's default and need the internet. The lessons use no TeX, so MathJax
is replaced by a no-op (the build refuses a lesson with ``$...$`` math in offline mode),
and the import of mermaid's module from its CDN is dropped (no lesson draws a mermaid
diagram).

``tests/browser/test_slides_in_browser.py`` pages through every slide of every deck in
Chromium at 1280×720 and 1920×1080 and fails on a slide that runs past the window.
"""

from __future__ import annotations

import argparse
import base64
import copy
import re
import shutil
import struct
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LESSONS = "notebooks/0*.ipynb"
WALKTHROUGH = "notebooks/walkthrough.ipynb"
OUT = Path("build/slides")
LONG = 15                      # lines of code above which the code folds away
HIDE = "hide-input"            # cell tag: the slides show the output only
PICTURES = ("image/png", "image/jpeg", "image/svg+xml")
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"

# the slide area, in CSS px before reveal.js scales it to the window: 16:9, like the
# screens and projectors the slides are shown on (nbconvert's default is 960 × 700)
WIDTH, HEIGHT = 1280, 720
PADDING = 20                   # reveal.js's padding above and below a slide's content
ROOM = HEIGHT - 2 * PADDING    # what a slide's content may fill before it continues below

# offline assets: (npm package, folder under vendor/)
REVEAL = ("reveal.js@4.0.2", "reveal.js")        # the version nbconvert's template is written for
REQUIRE = ("requirejs@2.3.6", "requirejs")
JQUERY = ("jquery@3.5.1", "jquery")
THEME = "simple"               # reveal.js theme; vendor/ holds a copy less its web fonts
THEME_COPY = "reveal-theme.css"
NO_MATHJAX = ("// The lessons use no TeX: the slide template's MathJax hooks get no-ops.\n"
              "window.MathJax = {Hub: {Config: function () {}, Queue: function () {},\n"
              "  getAllJax: function () { return []; }, Rerender: function () {}}};\n")
MERMAID = re.compile(r'<script type="module">\s*import mermaid from [^<]*</script>\s*')
MATH = re.compile(r"(?<![\\$])\$[^$\s][^$\n]*\$")
IMPORT = re.compile(r"@import\s+url\([^)]*\)\s*;?[ \t]*\n?")
THEME_LINK = re.compile(r'<link[^>]*id="theme"[^>]*>')
INITIALIZE = re.compile(r"(Reveal\.initialize\(\{.*?\}\);)", re.S)


# ---- tagging ------------------------------------------------------------------------------

def _lines(source: str) -> int:
    return len([line for line in source.splitlines() if line.strip()])


def _is_picture(output) -> bool:
    return any(k in output.get("data", {}) for k in PICTURES)


def _has_picture(cell) -> bool:
    return any(map(_is_picture, cell.get("outputs", [])))


def _heading_type(line: str) -> str | None:
    """``slide`` for a ``#``/``##`` heading line, ``subslide`` for ``###``, else None."""
    if re.match(r"#{1,2} ", line):
        return "slide"
    if line.startswith("### "):
        return "subslide"
    return None


def slide_tags(cell) -> tuple[str, bool]:
    """``(slide_type, hide_input)`` for one cell, from its content alone."""
    if (cell.get("metadata", {}).get("labkit") or {}).get("colab"):
        return "skip", False
    if cell.cell_type == "markdown":
        first = cell.source.lstrip().split("\n", 1)[0]
        return _heading_type(first) or "-", False
    if cell.cell_type != "code":
        return "skip", False
    long = _lines(cell.source) > LONG
    if _has_picture(cell):
        return "subslide", long
    if not cell.get("outputs"):
        return ("notes" if long else "-"), False
    return "-", long


def tagged(path: Path) -> tuple[str, str]:
    """``(current text, tagged text)`` of one deck's notebook."""
    import nbformat

    text = Path(path).read_text(encoding="utf-8")
    nb = nbformat.reads(text, as_version=4)
    for cell in nb.cells:
        kind, hide = slide_tags(cell)
        cell.metadata["slideshow"] = {"slide_type": kind}
        tags = [t for t in cell.metadata.get("tags", []) if t != HIDE]
        if hide:
            tags.append(HIDE)
        if tags:
            cell.metadata["tags"] = tags
        else:
            cell.metadata.pop("tags", None)
    out = nbformat.writes(nb, version=4)
    return text, out if out.endswith("\n") else out + "\n"


def lessons(root: Path = ROOT) -> list[Path]:
    """The notebooks that get a deck: the lessons, then the walkthrough."""
    root = Path(root)
    return sorted(root.glob(LESSONS)) + [p for p in [root / WALKTHROUGH] if p.exists()]


def tag(root: Path = ROOT, check: bool = False) -> list[Path]:
    """Tag every deck's notebook (or, with ``check``, list those whose tags are not current)."""
    changed = []
    for p in lessons(root):
        text, new = tagged(p)
        if new != text:
            changed.append(p)
            if not check:
                p.write_text(new, encoding="utf-8")
            print(f"{'untagged' if check else 'tagged'}: {p.relative_to(root).as_posix()}")
    if check and changed:
        print("run `python tools/slides.py tag` to tag them")
    return changed


# ---- cutting into slides (build time, on nbconvert's copy) --------------------------------

FENCE = re.compile(r" {0,3}(`{3,}|~{3,})")
# '#' then neither a space nor another '#': CommonMark's text, but nbconvert's Markdown
# makes it an <h1> (lesson 04's "issue\n#181723, ...")
NOT_A_HEADING = re.compile(r"^( {0,3})(#+)(?=[^#\s])", re.M)


def _fence(line: str, fence: str) -> tuple[str, bool]:
    """``(fence open after line, line is fenced code or a fence)`` for one Markdown line."""
    m = FENCE.match(line)
    if fence:
        closes = m and m.group(1)[0] == fence[0] and len(m.group(1)) >= len(fence) \
            and not line.strip().strip(fence[0])
        return ("" if closes else fence), True
    return (m.group(1), True) if m else ("", False)


def md_blocks(source: str) -> list[str]:
    """Markdown ``source`` as blocks: paragraphs, lists, tables, fenced code, headings.

    Blocks end at blank lines and after a heading line, never inside fenced code; a block
    whose first line is indented continues the one before it (a list item's second
    paragraph), so the two never land on different slides.
    """
    blocks: list[list[str]] = []
    cur: list[str] = []
    fence = ""

    def flush():
        nonlocal cur
        if cur:
            if blocks and cur[0][:1] in (" ", "\t") and not _heading_type(blocks[-1][0]):
                blocks[-1] += [""] + cur
            else:
                blocks.append(cur)
        cur = []

    for line in source.split("\n"):
        fence, code = _fence(line, fence)
        if not code and not line.strip():
            flush()
        elif not code and _heading_type(line):
            flush()
            cur.append(line)
            flush()
        else:
            cur.append(line)
    flush()
    return ["\n".join(b) for b in blocks]


def escape_hash_lines(source: str) -> str:
    """``#181723, ...`` at a line's start stays text (fenced code is left alone)."""
    out, fence = [], ""
    for line in source.split("\n"):
        fence, code = _fence(line, fence)
        out.append(line if code else
                   NOT_A_HEADING.sub(lambda h: h.group(1) + "\\" + h.group(2), line))
    return "\n".join(out)


# Heights in CSS px of the slide area, estimated from the text (there is no browser at build
# time) and calibrated against Chromium's layout of these notebooks; an estimate that is
# off costs a slide cut early or a slide that scrolls, nothing worse.
PROSE_CHARS, PROSE_LINE, PROSE_GAP = 125, 26, 20   # chars a line, px a line, px between blocks
LIST_CHARS, LIST_ITEM = 95, 4                      # list items: chars a line, px between items
MD_CELL = 22                                       # a Markdown cell's own padding and margins
HEADINGS = {1: (34, 154, 90),                      # by level: chars a line, px, px a line more
            2: (60, 81, 50),
            3: (70, 56, 40)}
CODE_CHARS, CODE_LINE = 105, 23                    # code and text output: chars a line, px a line
CODE_CELL, CODE_INPUT, OUTPUT = 14, 28, 17         # px: a code cell, its input box, each output
TABLE_CHARS, TABLE_ROW, TABLE_LINE = 150, 12, 19   # table width in chars, px a row, px a line
PICTURE = 34                                       # px around a picture
SLIDE_WIDTH = WIDTH - 43                           # px a cell spans: a wider picture shrinks


def _wrapped(text: str, chars: int) -> int:
    """Lines ``text`` takes when its lines wrap at spaces after ``chars`` characters."""
    n = 0
    for line in text.split("\n"):
        lines, width = 1, 0
        for word in line.split(" "):
            need = len(word) + (1 if width else 0)
            if width and width + need > chars:
                lines, width, need = lines + 1, 0, len(word)
            width += need
            while width > chars:                 # a word longer than a line breaks anywhere
                lines, width = lines + 1, width - chars
        n += lines
    return n


def _shown(md: str) -> str:
    """What a line of Markdown shows, roughly: link text, no emphasis marks; code spans
    widened (monospace is wider than prose)."""
    md = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", md)
    md = re.sub(r"`([^`]*)`",
                lambda m: m.group(1).replace(" ", "x") + "x" * (len(m.group(1)) // 3), md)
    return re.sub(r"[*_]{1,2}(?=\S)|(?<=\S)[*_]{1,2}", "", md)


def md_height(block: str) -> int:
    """Estimated height of one Markdown block (see ``md_blocks``), its cell's own
    padding (``MD_CELL``) left out."""
    first = block.split("\n", 1)[0]
    level = len(first) - len(first.lstrip("#"))
    if level and first[level:level + 1] == " ":
        chars, px, more = HEADINGS.get(level, (PROSE_CHARS, PROSE_LINE + PROSE_GAP, PROSE_LINE))
        return px + more * (_wrapped(_shown(first[level + 1:]), chars) - 1)
    if FENCE.match(first):
        return PROSE_GAP + CODE_LINE * _wrapped("\n".join(block.split("\n")[1:-1]), CODE_CHARS)
    if first.lstrip().startswith("|"):
        return _table_height(block)
    text = _shown(block)
    items = re.split(r"\n(?=\s*(?:[-*+]|\d+\.) )", text)       # list items start new lines
    if re.match(r"\s*(?:[-*+]|\d+\.) ", text):
        return PROSE_GAP + sum(PROSE_LINE * _wrapped(" ".join(i.split()), LIST_CHARS)
                               + LIST_ITEM for i in items)
    return PROSE_GAP + PROSE_LINE * _wrapped(" ".join(text.split()), PROSE_CHARS)


def _table_height(block: str) -> int:
    """A Markdown table: its columns share the width in proportion to their longest cell
    (as a browser's auto layout roughly does), each row as tall as its longest cell wraps."""
    rows = [[_shown(c.strip()) for c in r.strip().strip("|").split("|")]
            for r in block.split("\n")
            if r.strip() and not re.fullmatch(r"\s*\|?[\s:|-]+\|?\s*", r)]
    cols = max(len(r) for r in rows)
    rows = [r + [""] * (cols - len(r)) for r in rows]
    longest = [max(len(c) for c in col) + 2 for col in zip(*rows)]
    share = [max(1, int(n * TABLE_CHARS / sum(longest)) if sum(longest) > TABLE_CHARS else n)
             for n in longest]
    return sum(TABLE_ROW + TABLE_LINE * max(_wrapped(c, w) for c, w in zip(r, share))
               for r in rows)


def _picture_height(output) -> int:
    """A picture's height as shown: its stored size, no wider than the slide."""
    data, meta = output.get("data", {}), output.get("metadata", {}) or {}
    size = None
    if "image/png" in data:
        head = data["image/png"][:32]
        raw = base64.b64decode(head + "=" * (-len(head) % 4))
        if raw[12:16] == b"IHDR":
            size = struct.unpack(">II", raw[16:24])
    for kind in PICTURES:                       # width/height the output asks for
        m = meta.get(kind) or {}
        if m.get("width") and m.get("height"):
            size = (m["width"], m["height"])
    if not size:
        return 400 + PICTURE
    w, h = size
    return int(h * min(1.0, SLIDE_WIDTH / w)) + PICTURE


def _text(value) -> str:
    return value if isinstance(value, str) else "".join(value)


def cell_height(cell) -> int:
    """Estimated height of a code cell on a slide: its code (unless hidden), its outputs."""
    height = CODE_CELL
    if HIDE not in cell.get("metadata", {}).get("tags", []):
        height += CODE_INPUT + CODE_LINE * _wrapped(cell.source.rstrip("\n"), CODE_CHARS)
    for o in cell.get("outputs", []):
        data = o.get("data", {})
        height += OUTPUT
        if _is_picture(o):
            height += _picture_height(o)
        elif o.get("output_type") == "stream":
            height += CODE_LINE * _wrapped(_text(o.get("text", "")).rstrip("\n"), CODE_CHARS)
        elif o.get("output_type") == "error":
            tb = re.sub(r"\x1b\[[0-9;]*m", "", "\n".join(o.get("traceback", [])))
            height += CODE_LINE * _wrapped(tb, CODE_CHARS)
        elif "text/markdown" in data:
            height += sum(md_height(b) for b in md_blocks(_text(data["text/markdown"])))
        elif "text/html" in data:
            html = _text(data["text/html"])
            height += TABLE_ROW + TABLE_LINE * max(1, len(re.findall(r"<(?:tr|br|p|li)\b",
                                                                    html)))
        elif "text/plain" in data:
            height += CODE_LINE * _wrapped(_text(data["text/plain"]).rstrip("\n"), CODE_CHARS)
    return height


def _slide_type(cell) -> str:
    return (cell.get("metadata", {}).get("slideshow") or {}).get("slide_type", "-")


class _Unit:
    """What moves between slides as one piece: a Markdown block, or a whole other cell."""

    def __init__(self, cell, source, start, height, keep=False, join="\n\n"):
        self.cell, self.source, self.start = cell, source, start
        self.height, self.keep = height, keep      # keep: moves with what follows
        self.join = join                           # what goes before it in a merged cell


ITEM = re.compile(r"(?:[-*+]|\d+[.)]) ")


def list_items(block: str) -> list[str]:
    """A Markdown list block as its top-level items (each with its indented lines)."""
    items: list[list[str]] = []
    for line in block.split("\n"):
        if ITEM.match(line) or not items:
            items.append([line])
        else:
            items[-1].append(line)
    return ["\n".join(i) for i in items]


def split_pictures(cell, room: int = ROOM) -> list:
    """A code cell with a picture that is too tall for one slide, as two cells: its code
    and the outputs before its first picture, then (input hidden) the pictures on."""
    outs = cell.get("outputs", [])
    first = next((i for i, o in enumerate(outs) if _is_picture(o)), None)
    tags = cell.get("metadata", {}).get("tags", [])
    if first is None or (first == 0 and HIDE in tags) or cell_height(cell) <= room:
        return [cell]
    head, tail = copy.deepcopy(cell), copy.deepcopy(cell)
    head.outputs, tail.outputs, tail.source = outs[:first], outs[first:], ""
    tail.metadata["tags"] = [t for t in tags if t != HIDE] + [HIDE]
    if cell.get("id"):
        tail.id = f"{cell.id}-pictures"
    return [head, tail]


def units(cells, room: int = ROOM) -> list[_Unit]:
    """The pieces ``pages`` lays out: Markdown blocks, cells (a tall picture cell in two)."""
    out = []
    for cell in cells:
        kind = _slide_type(cell)
        if cell.cell_type == "markdown" and kind != "skip":
            for i, block in enumerate(md_blocks(cell.source)):
                head = _heading_type(block)
                start = head or (kind if i == 0 and kind in ("slide", "subslide") else None)
                keep = block.rstrip().endswith(":") or (block.startswith("#") and not head)
                if ITEM.match(block) and md_height(block) > room:    # a list taller than
                    for j, item in enumerate(list_items(block)):     # a slide: by items
                        out.append(_Unit(cell, escape_hash_lines(item), start if j == 0
                                         else None, md_height(item) - (j > 0) * PROSE_GAP,
                                         join="\n\n" if j == 0 else "\n"))
                    continue
                out.append(_Unit(cell, escape_hash_lines(block), start,
                                 md_height(block), keep))
        elif cell.cell_type == "code" and kind not in ("notes", "skip"):
            start = kind if kind in ("slide", "subslide") else None
            for i, part in enumerate(split_pictures(cell, room)):
                out.append(_Unit(part, None, start if i == 0 else None, cell_height(part)))
        else:
            out.append(_Unit(cell, None, kind if kind in ("slide", "subslide") else None, 0))
    return out


def pages(items: list[_Unit], room: int = ROOM) -> list[list[_Unit]]:
    """Units grouped into slides: a heading starts one (as tagged); a unit that would
    overflow ``room`` starts a continuation subslide, taking along the units before it
    that stay with what follows (``keep``, or nothing to show: speaker notes)."""
    def cost(page):   # Markdown blocks of one cell on one slide share one cell's padding
        return sum(u.height + (MD_CELL if u.source is not None and u.height
                               and (i == 0 or page[i - 1].cell is not u.cell) else 0)
                   for i, u in enumerate(page))

    out: list[list[_Unit]] = []
    for u in items:
        if u.start or not out:
            out.append([u])
            continue
        page = out[-1]
        if u.height and cost(page + [u]) > room and cost(page) > 0:
            carry = []
            while len(page) > 1 and (page[-1].keep or not page[-1].height) \
                    and any(x.height for x in page[:-1]):
                carry.insert(0, page.pop())
            if not any(x.height and not x.keep for x in page) \
                    or cost(carry + [u]) > room:   # nothing would be left, or no room
                page.extend(carry)
                carry = []
            out.append(carry + [u])
            continue
        page.append(u)
    return out


def paginate(cells, room: int = ROOM, merge: bool = True):
    """The cells of one notebook cut into slides that fit (see the module's docstring).

    A Markdown cell's blocks that stay on one slide are one cell again (``merge``)."""
    import nbformat

    out = []
    piece: dict[int, int] = {}          # how many pieces of a Markdown cell so far
    for n, page in enumerate(pages(units(cells, room), room)):
        first = True
        for u in page:
            shown = _slide_type(u.cell) not in ("notes", "skip")
            if first and shown:
                kind = "slide" if (u.start == "slide" or n == 0) else "subslide"
                first = False
            else:
                kind = _slide_type(u.cell)
                kind = "-" if kind in ("slide", "subslide") else kind
            if u.source is None:
                cell = u.cell
            elif merge and out and out[-1].get("_from") is u.cell and kind == "-":
                out[-1].source += u.join + u.source      # the same cell, the same slide
                continue
            else:
                k = piece[id(u.cell)] = piece.get(id(u.cell), -1) + 1
                cell = nbformat.v4.new_markdown_cell(u.source)
                cell.metadata = copy.deepcopy(u.cell.metadata)
                if u.cell.get("attachments"):
                    cell.attachments = copy.deepcopy(u.cell.attachments)
                if u.cell.get("id"):                     # else new_markdown_cell's own
                    cell.id = u.cell.id + (f"-{k}" if k else "")
                cell["_from"] = u.cell
            cell.metadata["slideshow"] = {"slide_type": kind}
            out.append(cell)
    for cell in out:
        cell.pop("_from", None)
    return out


# ---- rendering ----------------------------------------------------------------------------

FONTS = ('system-ui, -apple-system, "Segoe UI", Roboto, Ubuntu, Cantarell, "Noto Sans", '
         '"Liberation Sans", "DejaVu Sans", Helvetica, Arial, sans-serif')

# After nbconvert's and the theme's styles. reveal.js lays a slide out in a WIDTH × HEIGHT
# area and scales that to the window: a slide at most HEIGHT tall (border box) fits any
# window; a taller one scrolls inside itself. Text wraps instead of running off the right
# edge (code, outputs, table cells); pictures never get wider than the slide.
SLIDE_CSS = """<style>
html:not(.print-pdf) .reveal .slides > section > section,
html:not(.print-pdf) .reveal .slides > section:not(.stack) {
  box-sizing: border-box; max-height: %(height)dpx; overflow-y: auto; scrollbar-width: thin;
}
.reveal, .reveal h1, .reveal h2, .reveal h3, .reveal h4, .reveal h5, .reveal h6 {
  font-family: %(fonts)s;
}
.reveal pre, .reveal pre code, .reveal .jp-OutputArea-output pre {
  white-space: pre-wrap; white-space: break-spaces; overflow-wrap: break-word;
  word-break: normal;
}
.reveal pre { box-sizing: border-box; max-width: 100%%; }
.reveal .jp-RenderedMarkdown pre, .reveal .jp-RenderedMarkdown pre code {
  font-size: var(--jp-code-font-size); line-height: 1.2;
}
.reveal .jp-RenderedHTMLCommon table {
  table-layout: auto; max-width: 100%%; font-size: 0.8em;
}
.reveal .jp-RenderedHTMLCommon th, .reveal .jp-RenderedHTMLCommon td {
  white-space: normal; overflow-wrap: break-word; word-break: normal; max-width: none;
  padding: 0.3em 0.5em;
}
.reveal .jp-RenderedHTMLCommon td code, .reveal .jp-RenderedHTMLCommon th code {
  white-space: normal; overflow-wrap: anywhere;
}
.reveal img, .reveal svg { max-width: 100%%; }
</style>
""" % {"height": HEIGHT, "fonts": FONTS}

# Run by the template's reveal.js callback, right after Reveal.initialize(): on the slide
# shown at load and on each slide moved to, pictures shrink (to MIN of their size at most)
# until the slide fits its HEIGHT; what still does not fit scrolls (SLIDE_CSS).
SLIDE_JS = """
        (function fitPictures(Reveal) {
          var MIN = 0.5;
          function fit() {
            var s = Reveal.getCurrentSlide();
            if (!s) return;
            var imgs = [].slice.call(s.querySelectorAll('.jp-OutputArea-output img'));
            imgs = imgs.filter(function (i) {     // one not decoded yet: again once it is
              if (!i.complete) i.addEventListener('load', fit, {once: true});
              return i.complete && i.offsetHeight > 0;
            });
            for (var k = 0; k < 4 && imgs.length; k++) {
              var over = s.scrollHeight - s.clientHeight;
              if (over <= 1) break;
              var total = 0;
              imgs.forEach(function (i) {
                if (!i.dataset.fullHeight) i.dataset.fullHeight = i.offsetHeight;
                total += i.offsetHeight;
              });
              if (!total) break;
              imgs.forEach(function (i) {
                var h = i.offsetHeight;
                var least = MIN * Number(i.dataset.fullHeight);
                i.style.maxHeight = Math.max(least, h - over * h / total - 1) + 'px';
                i.style.width = 'auto';
              });
            }
            Reveal.layout();
          }
          Reveal.addEventListener('ready', fit);
          Reveal.addEventListener('slidechanged', fit);
          if (Reveal.isReady()) fit();
        })(Reveal);
"""


def _npm_pack(spec: str, dest: Path) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        r = subprocess.run(["npm", "pack", "--silent", spec], cwd=tmp, capture_output=True,
                           text=True, timeout=300)
        tgz = sorted(Path(tmp).glob("*.tgz"))
        if r.returncode or not tgz:
            raise RuntimeError(f"npm pack {spec} failed: {(r.stderr or r.stdout).strip()[-500:]}")
        with tarfile.open(tgz[0]) as tar:
            tar.extractall(tmp, filter="data") if hasattr(tarfile, "data_filter") \
                else tar.extractall(tmp)
        shutil.rmtree(dest, ignore_errors=True)
        shutil.move(str(Path(tmp) / "package"), dest)


def vendor(out: Path) -> bool:
    """Copy reveal.js, require.js and jQuery into ``out/vendor`` once; False if that fails.

    Also writes the no-op MathJax and ``THEME_COPY``: reveal.js's ``THEME`` theme without
    its ``@import`` of web fonts (the slides use the system's fonts, offline).
    """
    folder = out / "vendor"
    need = [(spec, name) for spec, name in (REVEAL, REQUIRE, JQUERY)
            if not (folder / name / "package.json").exists()]
    if need and shutil.which("npm") is None:
        print("note: npm not found: the slides load reveal.js from unpkg.com (they need the "
              "internet); install npm (Node.js) for offline slides")
        return False
    folder.mkdir(parents=True, exist_ok=True)
    for spec, name in need:
        try:
            print(f"fetching {spec} into {(folder / name).as_posix()} (npm pack, once)")
            _npm_pack(spec, folder / name)
        except (RuntimeError, OSError, subprocess.TimeoutExpired) as exc:
            print(f"note: {exc}; the slides load reveal.js from unpkg.com (they need the "
                  f"internet)")
            return False
    (folder / "no-mathjax.js").write_text(NO_MATHJAX)
    theme = (folder / REVEAL[1] / "dist" / "theme" / f"{THEME}.css").read_text(encoding="utf-8")
    (folder / THEME_COPY).write_text(IMPORT.sub("", theme), encoding="utf-8")
    return True


def _for_slides(nb):
    """nbconvert's copy of ``nb``: cut into slides that fit (see the module's docstring),
    widget outputs showing the picture they stored (no kernel in slides), no test markers."""
    nb = copy.deepcopy(nb)
    nb.metadata.pop("widgets", None)
    for cell in nb.cells:
        if cell.cell_type == "code":   # the test suite's markers are no news to the room
            cell.source = "\n".join(line for line in cell.source.split("\n")
                                    if not line.strip().startswith("# NBVAL_"))
        for o in cell.get("outputs", []):
            data = o.get("data", {})
            if WIDGET_VIEW in data:
                data.pop(WIDGET_VIEW)
                if _is_picture(o):
                    data.pop("text/html", None)
    nb.cells = paginate(nb.cells)
    return nb


def _exporter(offline: bool):
    from nbconvert import SlidesExporter
    from traitlets.config import Config

    c = Config()
    c.TagRemovePreprocessor.enabled = True
    c.TagRemovePreprocessor.remove_input_tags = {HIDE}
    c.SlidesExporter.exclude_input_prompt = True
    c.SlidesExporter.exclude_output_prompt = True
    c.SlidesExporter.reveal_width = str(WIDTH)
    c.SlidesExporter.reveal_height = str(HEIGHT)
    c.SlidesExporter.reveal_theme = THEME
    # nbconvert's scroll box is calc(95vh) inside the scaled slide area, taller than the
    # window: SLIDE_CSS makes a long slide scroll inside a box that fits instead
    c.SlidesExporter.reveal_scroll = False
    if offline:
        c.SlidesExporter.reveal_url_prefix = "vendor/reveal.js"
        c.SlidesExporter.require_js_url = "vendor/requirejs/require.js"
        c.SlidesExporter.jquery_url = "vendor/jquery/dist/jquery.min.js"
        c.SlidesExporter.mathjax_url = "vendor/no-mathjax.js"
        c.SlidesExporter.font_awesome_url = ""
    return SlidesExporter(config=c)


def _finish(body: str, offline: bool) -> str:
    """nbconvert's page plus SLIDE_CSS and SLIDE_JS; offline, the theme without web fonts."""
    if offline:   # no lesson draws mermaid diagrams: drop the import of its CDN module
        body = MERMAID.sub("", body)
        body, n = THEME_LINK.subn(f'<link rel="stylesheet" href="vendor/{THEME_COPY}" '
                                  f'id="theme"/>', body, count=1)
        if n != 1:
            raise RuntimeError("nbconvert's slide template has no theme <link id=\"theme\">")
    body = body.replace("</head>", SLIDE_CSS + "</head>", 1)
    body, n = INITIALIZE.subn(lambda m: m.group(1) + SLIDE_JS, body, count=1)
    if n != 1:
        raise RuntimeError("nbconvert's slide template has no Reveal.initialize({...});")
    return body


def build(root: Path = ROOT, out: Path | None = None, cdn: bool = False) -> list[Path]:
    """Render every deck to ``out/NAME.slides.html``; return the files written."""
    import nbformat

    root = Path(root)
    out = Path(out) if out is not None else root / OUT
    out.mkdir(parents=True, exist_ok=True)
    offline = False if cdn else vendor(out)
    exporter = _exporter(offline)
    written = []
    for p in lessons(root):
        nb = nbformat.read(p, as_version=4)
        if offline and any(c.cell_type == "markdown" and MATH.search(c.source) for c in nb.cells):
            raise SystemExit(f"error: {p.name} has TeX math, which offline slides cannot "
                             f"typeset (no MathJax is vendored): run with --cdn")
        body, _ = exporter.from_notebook_node(_for_slides(nb),
                                              resources={"metadata": {"name": p.stem}})
        dest = out / f"{p.stem}.slides.html"
        dest.write_text(_finish(body, offline), encoding="utf-8")
        written.append(dest)
        print(f"wrote {dest.relative_to(root).as_posix() if dest.is_relative_to(root) else dest}")
    where = "offline (reveal.js in vendor/)" if offline else "from the CDN (needs the internet)"
    print(f"{len(written)} decks as slides, {where}: open {out / written[0].name} in a "
          f"browser; s opens the speaker notes" if written else "no lessons found")
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python tools/slides.py",
                                     description="Slide tags for notebooks/0*.ipynb and "
                                                 "the walkthrough, and reveal.js slides "
                                                 "of them.")
    sub = parser.add_subparsers(dest="cmd", required=True)
    p_tag = sub.add_parser("tag", help="set metadata.slideshow in every deck's notebook")
    p_tag.add_argument("--check", action="store_true",
                       help="write nothing; exit 1 if a notebook's tags are not current")
    p_build = sub.add_parser("build", help="render build/slides/*.slides.html")
    p_build.add_argument("--cdn", action="store_true",
                         help="load reveal.js from unpkg.com instead of vendor/ (no npm)")
    p_build.add_argument("--out", type=Path, default=None, help=f"folder (default {OUT})")
    args = parser.parse_args(argv)
    if args.cmd == "tag":
        changed = tag(check=args.check)
        return 1 if (args.check and changed) else 0
    build(out=args.out, cdn=args.cdn)
    return 0


if __name__ == "__main__":
    sys.exit(main())
