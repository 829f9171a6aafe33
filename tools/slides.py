"""Reveal.js slides of every lesson and the walkthrough (``make slides``), and their slide tags.

An authoring tool, not part of ``labkit``. Two commands:

    python tools/slides.py tag [--check]   set metadata.slideshow.slide_type in the notebooks
    python tools/slides.py build [--cdn]   render build/slides/NAME.slides.html (make slides)

This file is the command line; the work lives in three modules beside it, each with its
rules in its docstring:

* ``tools/slide_tags.py``: which notebooks get a deck (``lessons``: ``notebooks/NN_*.ipynb``,
  then ``notebooks/walkthrough.ipynb``) and the slide tags of their cells, set from each
  cell's content (``tag`` is idempotent);
* ``tools/slide_layout.py``: at build time, each section cut into slides that fit the
  1280×720 slide area, by heights estimated from the text;
* ``tools/slide_build.py``: the nbconvert ``SlidesExporter`` render of the stored outputs
  (no kernel runs), the style sheet and script that fit each slide to the window, and
  reveal.js, require.js and jQuery copied once into ``build/slides/vendor/`` with
  ``npm pack`` (offline decks; ``--cdn`` or no npm: from the CDN).

``tests/browser/test_slides_in_browser.py`` pages through every slide of every deck in
Chromium at 1280×720 and 1920×1080 and fails on a slide that runs past the window or
needs scrolling.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the slide_*.py modules beside it
from slide_build import MIN_ZOOM, OUT, THEME, THEME_COPY, build, finish_page, vendor  # noqa: E402
from slide_layout import HIDE  # noqa: E402
from slide_tags import LONG, lessons, slide_tags, tag, tagged  # noqa: E402

__all__ = ["HIDE", "LONG", "MIN_ZOOM", "OUT", "THEME", "THEME_COPY", "build", "finish_page",
           "lessons", "main", "slide_tags", "tag", "tagged", "vendor"]


def main(argv: list[str] | None = None) -> int:
    """``tag [--check]`` or ``build [--cdn] [--out DIR]``; the exit status (argparse exits 2)."""
    parser = argparse.ArgumentParser(prog="python tools/slides.py",
                                     description="Slide tags for notebooks/NN_*.ipynb and "
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
