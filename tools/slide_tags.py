"""Slide tags of the notebooks that get a deck (``python tools/slides.py tag``).

An authoring tool, not part of ``labkit``. The notebooks with a deck: ``notebooks/NN_*.ipynb``
(the lessons), then ``notebooks/walkthrough.ipynb`` (``lessons``).

Tagging sets ``metadata.slideshow.slide_type`` (and the ``hide-input`` cell tag) from each
cell's content alone, so it is idempotent: a second run changes nothing.

* a ``#`` or ``##`` heading starts a slide, a ``###`` heading a subslide; other Markdown
  continues the slide it is on;
* a code cell whose output has a picture gets a subslide of its own, so the picture leads;
  if its code is long (more than ``LONG`` lines) the code is hidden in the slides (cell
  tag ``hide-input``: the notebook itself still shows it);
* long code that prints nothing (definitions, setup) goes to the speaker notes;
  long code with text output keeps its output and hides its code;
* the Colab badge and setup cell are skipped (``tools/colab_cells.py`` tags them).

The tags are where ``tools/slide_layout.py`` starts at build time: it cuts each tagged
section into slides that fit, on a copy (the notebooks are never rewritten by the build).
"""

from __future__ import annotations

from pathlib import Path

from slide_layout import HIDE, heading_type, is_picture

ROOT = Path(__file__).resolve().parent.parent
LESSONS = "notebooks/[0-9][0-9]_*.ipynb"
WALKTHROUGH = "notebooks/walkthrough.ipynb"
LONG = 15                      # lines of code above which the code folds away


def _lines(source: str) -> int:
    return len([line for line in source.splitlines() if line.strip()])


def _has_picture(cell) -> bool:
    return any(map(is_picture, cell.get("outputs", [])))


def slide_tags(cell) -> tuple[str, bool]:
    """``(slide_type, hide_input)`` for one cell, from its content alone."""
    if (cell.get("metadata", {}).get("labkit") or {}).get("colab"):
        return "skip", False
    if cell.cell_type == "markdown":
        first = cell.source.lstrip().split("\n", 1)[0]
        return heading_type(first) or "-", False
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
