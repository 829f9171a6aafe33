"""Reveal.js decks of the lessons and the walkthrough (``python tools/slides.py build``).

An authoring tool, not part of ``labkit``: ``make slides`` runs it and writes
``build/slides/NAME.slides.html`` for every notebook ``tools/slide_tags.py`` lists
(``lessons``), from the tags it set.

**Cutting into slides** happens on the copy of each notebook handed to nbconvert (the
notebooks are never rewritten by the build): ``tools/slide_layout.py`` cuts each section
into slides that fit the slide area (its docstring has the rules).

**Rendering** uses ``jupyter nbconvert``'s ``SlidesExporter`` on the stored outputs (no
kernel runs): whatever the notebooks hold, CPU or GPU outputs, is what the slides show.
A widget's output shows as the picture it stored beside itself (slides have no kernel to
drive a slider). The build adds a style sheet and a script (``SLIDE_CSS``, ``SLIDE_JS``):
a slide taller than the slide area shrinks its pictures (to half their size at most), then
its text (to ``MIN_ZOOM`` at most: the layout's estimates are a few lines off at times), and
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
"""

from __future__ import annotations

import copy
import re
import shutil
import subprocess
import tarfile
import tempfile
from pathlib import Path

from slide_layout import HEIGHT, HIDE, WIDTH, is_picture, paginate
from slide_tags import ROOT, lessons

OUT = Path("build/slides")
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"

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
# until the slide fits its HEIGHT, then the whole slide's content is zoomed out (to
# MIN_ZOOM at most: the build's height estimates are a few lines off at times); what still
# does not fit scrolls (SLIDE_CSS).
MIN_ZOOM = 0.9
SLIDE_JS = """
        (function fitPictures(Reveal) {
          var MIN = 0.5, MIN_ZOOM = %(zoom)s;
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
            var pad = parseFloat(getComputedStyle(s).paddingTop)
              + parseFloat(getComputedStyle(s).paddingBottom);
            for (var z = 0; z < 4; z++) {          // text: zoom out the slide's content
              var room = s.clientHeight - pad, need = s.scrollHeight - pad;
              var zoom = Number(s.dataset.zoom || 1);
              if (need <= room + 1 || zoom <= MIN_ZOOM) break;
              zoom = Math.max(MIN_ZOOM, Math.floor(100 * zoom * room / need) / 100);
              s.dataset.zoom = zoom;
              [].forEach.call(s.children, function (c) { c.style.zoom = zoom; });
            }
            Reveal.layout();
          }
          Reveal.addEventListener('ready', fit);
          Reveal.addEventListener('slidechanged', fit);
          if (Reveal.isReady()) fit();
        })(Reveal);
""" % {"zoom": MIN_ZOOM}


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
    """nbconvert's copy of ``nb``: cut into slides that fit (``tools/slide_layout.py``),
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
                if is_picture(o):
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


def finish_page(body: str, offline: bool) -> str:
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
        dest.write_text(finish_page(body, offline), encoding="utf-8")
        written.append(dest)
        print(f"wrote {dest.relative_to(root).as_posix() if dest.is_relative_to(root) else dest}")
    where = "offline (reveal.js in vendor/)" if offline else "from the CDN (needs the internet)"
    print(f"{len(written)} decks as slides, {where}: open {out / written[0].name} in a "
          f"browser; s opens the speaker notes" if written else "no lessons found")
    return written
