"""Cutting a deck's cells into slides that fit (``tools/slides.py build``, at build time).

An authoring tool, not part of ``labkit``: ``tools/slide_build.py`` hands the copy of each
notebook it renders to ``paginate`` (the notebooks are never rewritten). The heights that
decide what fits are estimated here too (``md_height``, ``cell_height``).

The rules, on the cells as ``tools/slides.py tag`` (``tools/slide_tags.py``) tagged them:

* a Markdown cell is cut at its ``#``, ``##`` and ``###`` headings (outside fenced code):
  each heading starts a slide or subslide by the tagging rules (``tools/slide_tags.py``),
  wherever it sits in a cell;
* a slide (a ``WIDTH`` × ``HEIGHT`` area, 16:9, which reveal.js scales to fit the window)
  whose content is estimated taller than the area continues on a subslide below it
  (heights are estimated from the text, calibrated on Chromium's layout): Markdown is
  cut at paragraph boundaries (a paragraph ending in ``:`` moves with what follows), a
  code cell moves whole; a code cell whose picture does not fit beside its code and text
  output shows the picture on the next subslide (``split_pictures``); a code cell taller
  than a slide continues on subslides below it, its input hidden there
  (``split_outputs``): its outputs are cut between outputs, a long text output between
  lines (after a blank line if it can, else before its least indented line, never right
  after a line that introduces what follows: one ending in ``:``, a ``#`` comment), the
  pieces about as full as each other; what still does not fit (one picture, one table,
  code alone taller than a slide) stays whole;
* a Markdown line that starts with ``#`` and no space (``#181723,``: an issue number
  wrapped to the line's start) is escaped: it is text, not an ``<h1>``.

The heights are estimates (no browser runs at build time); ``SLIDE_JS`` in
``tools/slide_build.py`` zooms out a slide the estimates let run a little long.
"""

from __future__ import annotations

import base64
import copy
import re
import struct

HIDE = "hide-input"            # cell tag: the slides show the output only
PICTURES = ("image/png", "image/jpeg", "image/svg+xml")

# the slide area, in CSS px before reveal.js scales it to the window: 16:9, like the
# screens and projectors the slides are shown on (nbconvert's default is 960 × 700)
WIDTH, HEIGHT = 1280, 720
PADDING = 20                   # reveal.js's padding above and below a slide's content
ROOM = HEIGHT - 2 * PADDING    # what a slide's content may fill before it continues below


def is_picture(output) -> bool:
    """Whether a code cell's output holds a picture (PNG, JPEG or SVG)."""
    return any(k in output.get("data", {}) for k in PICTURES)


def heading_type(line: str) -> str | None:
    """``slide`` for a ``#``/``##`` heading line, ``subslide`` for ``###``, else None."""
    if re.match(r"#{1,2} ", line):
        return "slide"
    if line.startswith("### "):
        return "subslide"
    return None


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
            if blocks and cur[0][:1] in (" ", "\t") and not heading_type(blocks[-1][0]):
                blocks[-1] += [""] + cur
            else:
                blocks.append(cur)
        cur = []

    for line in source.split("\n"):
        fence, code = _fence(line, fence)
        if not code and not line.strip():
            flush()
        elif not code and heading_type(line):
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
            2: (54, 81, 50),
            3: (70, 56, 40)}
CODE_CHARS, CODE_LINE = 105, 23                    # code and text output: chars a line, px a line
OUTPUT_CHARS = 95                                  # text output sits indented: chars a line
MIN_LINES = 3                                      # the fewest lines of a cut text output
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


def input_height(cell) -> int:
    """Estimated height of a code cell on a slide without its outputs: its code, unless
    hidden."""
    height = CODE_CELL
    if HIDE not in cell.get("metadata", {}).get("tags", []):
        height += CODE_INPUT + CODE_LINE * _wrapped(cell.source.rstrip("\n"), CODE_CHARS)
    return height


def output_height(o) -> int:
    """Estimated height of one output of a code cell."""
    data = o.get("data", {})
    height = OUTPUT
    if is_picture(o):
        height += _picture_height(o)
    elif o.get("output_type") == "stream":
        height += CODE_LINE * _wrapped(_text(o.get("text", "")).rstrip("\n"), OUTPUT_CHARS)
    elif o.get("output_type") == "error":
        tb = re.sub(r"\x1b\[[0-9;]*m", "", "\n".join(o.get("traceback", [])))
        height += CODE_LINE * _wrapped(tb, OUTPUT_CHARS)
    elif "text/markdown" in data:
        height += sum(md_height(b) for b in md_blocks(_text(data["text/markdown"])))
    elif "text/html" in data:
        html = _text(data["text/html"])
        height += TABLE_ROW + TABLE_LINE * max(1, len(re.findall(r"<(?:tr|br|p|li)\b", html)))
    elif "text/plain" in data:
        height += CODE_LINE * _wrapped(_text(data["text/plain"]).rstrip("\n"), OUTPUT_CHARS)
    return height


def cell_height(cell) -> int:
    """Estimated height of a code cell on a slide: its code (unless hidden), its outputs."""
    return input_height(cell) + sum(map(output_height, cell.get("outputs", [])))


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
    first = next((i for i, o in enumerate(outs) if is_picture(o)), None)
    tags = cell.get("metadata", {}).get("tags", [])
    if first is None or (first == 0 and HIDE in tags) or cell_height(cell) <= room:
        return [cell]
    head, tail = copy.deepcopy(cell), copy.deepcopy(cell)
    head.outputs, tail.outputs, tail.source = outs[:first], outs[first:], ""
    tail.metadata["tags"] = [t for t in tags if t != HIDE] + [HIDE]
    if cell.get("id"):
        tail.id = f"{cell.id}-pictures"
    return [head, tail]


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def cut_text(text: str, left: int, target: int) -> tuple[str, str, bool] | None:
    """``text`` (a text output) cut in two at a line boundary: ``(head, rest, clean)``,
    the head estimated at most ``left`` px tall with its output's margin, ``clean`` if
    the cut is at a blank line; None where that leaves either fewer than ``MIN_LINES``
    lines.

    Of the cuts that leave the head at least 60 % of ``target`` px (what the head should
    fill), the best is taken: after a blank line; else before the least indented line (a
    list's next item, a function's next statement), best after a more indented one (the
    end of a group); not right after a line that introduces what follows (one ending in
    ``:``, a ``#`` comment); then the one nearest ``target``. Blank lines at the cut are
    dropped.
    """
    lines = text.splitlines(keepends=True)
    cum = [0]
    for line in lines:
        cum.append(cum[-1] + CODE_LINE * _wrapped(line.rstrip("\n"), OUTPUT_CHARS))
    fit = max((i for i in range(len(lines) - MIN_LINES + 1) if OUTPUT + cum[i] <= left),
              default=0)
    least = next((i for i in range(fit + 1) if cum[i] >= 0.6 * target), fit)
    cuts = [i for i in range(max(least, MIN_LINES), fit + 1) if lines[i].strip()]
    if not cuts:
        return None

    def score(i):
        before = lines[i - 1].strip()
        leads = before.endswith(":") or before.startswith("#")
        return (not before, -_indent(lines[i]), _indent(lines[i - 1]) > _indent(lines[i]),
                not leads, -abs(cum[i] - target))

    i = max(cuts, key=score)
    head = "".join(lines[:i]).rstrip() + "\n"
    rest = "".join(lines[i:]).lstrip("\n")
    return (head, rest, not lines[i - 1].strip()) if head.strip() and rest.strip() else None


def _pieces(cell, room: int, first: int) -> tuple[list[list], bool]:
    """The outputs of ``cell`` in pieces that fit (see ``split_outputs``), and whether the
    first cut made inside a text output is at a blank line (True if there is none)."""
    fresh = room - CODE_CELL                     # a continuation: outputs only
    pieces: list[list] = [[]]
    left = first - input_height(cell)
    clean = None
    todo = list(cell.get("outputs", []))
    while todo:
        o = todo.pop(0)
        h = output_height(o)
        stream = o.get("output_type") == "stream"
        if h <= left:
            pieces[-1].append(o)
            left -= h
            continue
        if pieces[-1] and (h <= fresh or not stream):   # between two outputs: the best cut
            pieces.append([])
            left = fresh
            todo.insert(0, o)
            continue
        cut = None
        if stream:
            before = (first if len(pieces) == 1 else fresh) - left   # already on this slide
            target = left if h > left + fresh else (h - before) // 2
            cut = cut_text(_text(o.get("text", "")), left, target)
        if cut:
            head, rest = copy.deepcopy(o), copy.deepcopy(o)
            head.text, rest.text, at_blank = cut
            clean = at_blank if clean is None else clean
            pieces[-1].append(head)
            pieces.append([])
            left = fresh
            todo.insert(0, rest)
        elif (pieces[-1] or len(pieces) == 1) and left < fresh:
            pieces.append([])                    # code or text above it: try a slide of its own
            left = fresh
            todo.insert(0, o)
        else:
            pieces[-1].append(o)                 # taller than a slide on its own: stays whole
            left -= h
    return pieces, clean is not False


def split_outputs(cell, room: int = ROOM, first: int | None = None) -> list:
    """A code cell taller than a slide as cells that each fit one (as far as the outputs
    allow): its code and the first outputs, then the other outputs, input hidden.

    Outputs move whole to the next piece while a piece holds any; a text output (a
    ``stream``) taller than what is left is cut between lines (``cut_text``), and where
    two pieces are enough the cut leaves them about as full. ``first`` is the room the
    first piece gets when text before the cell moves along with it (a paragraph ending
    in ``:``); if that forces a cut inside a paragraph of the text where a whole slide
    would not, the cell takes whole slides and the text stays behind. A picture, a
    table or code taller than a slide stays whole.
    """
    if cell.cell_type != "code" or cell_height(cell) <= room:
        return [cell]
    first = room if first is None else first
    pieces, clean = _pieces(cell, room, first)
    if first < room and not clean:
        whole, clean = _pieces(cell, room, room)
        pieces = whole if clean else pieces
    shown = HIDE not in cell.get("metadata", {}).get("tags", [])
    out = []
    for k, outs in enumerate(pieces):
        part = copy.deepcopy(cell)
        part.outputs = outs
        if k:
            part.source = ""
            part.metadata["tags"] = [t for t in part.metadata.get("tags", []) if t != HIDE] \
                + [HIDE]
            if cell.get("id"):
                part.id = f"{cell.id}-{k}"
        if outs or (k == 0 and shown):
            out.append(part)
    return out


def _lead_in(units_so_far: list[_Unit]) -> int:
    """Height of the units at the end of ``units_so_far`` that move along with what comes
    next (``keep``: a paragraph ending in ``:``; speaker notes)."""
    lead, md = 0, False
    for u in reversed(units_so_far):
        if u.start or not (u.keep or not u.height):
            break
        lead += u.height
        md = md or (u.source is not None and u.height > 0)
    return lead + (MD_CELL if md else 0)


def units(cells, room: int = ROOM) -> list[_Unit]:
    """The pieces ``pages`` lays out: Markdown blocks, cells (a tall picture cell in two)."""
    out = []
    for cell in cells:
        kind = _slide_type(cell)
        if cell.cell_type == "markdown" and kind != "skip":
            for i, block in enumerate(md_blocks(cell.source)):
                head = heading_type(block)
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
            head, *tail = split_pictures(cell, room)
            parts = split_outputs(head, room, room - _lead_in(out)) \
                + [p for t in tail for p in split_outputs(t, room)]
            for i, part in enumerate(parts):
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
