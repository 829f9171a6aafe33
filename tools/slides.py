"""Reveal.js slides of every lesson (``make slides``), and the slide tags they follow.

An authoring tool, not part of ``labkit``. Two commands:

    python tools/slides.py tag [--check]   set metadata.slideshow.slide_type in notebooks/0*.ipynb
    python tools/slides.py build [--cdn]   render build/slides/NN_name.slides.html (make slides)

**Tagging** (idempotent: the tags follow from the cells, so a second run changes nothing):

* a ``#`` or ``##`` heading starts a slide, a ``###`` heading a subslide; other Markdown
  continues the slide it is on;
* a code cell whose output has a picture gets a subslide of its own, so the picture leads;
  if its code is long (more than ``LONG`` lines) the code is hidden in the slides (cell
  tag ``hide-input``: the notebook itself still shows it);
* long code that prints nothing (definitions, setup) goes to the speaker notes;
  long code with text output keeps its output and hides its code;
* the Colab badge and setup cell are skipped (``tools/colab_cells.py`` tags them).

**Rendering** uses ``jupyter nbconvert``'s ``SlidesExporter`` on the stored outputs (no
kernel runs): whatever the notebooks hold, CPU or GPU outputs, is what the slides show.
A widget's output shows as the picture it stored beside itself (slides have no kernel to
drive a slider). reveal.js, require.js and jQuery are copied once into
``build/slides/vendor/`` with ``npm pack`` (the npm registry), so the slides work offline
from ``file://``; without npm, or with ``--cdn``, they load from unpkg / cdnjs like
nbconvert's default and need the internet. The lessons use no TeX, so MathJax is replaced
by a no-op (the build refuses a lesson with ``$...$`` math in offline mode), and the
import of mermaid's module from its CDN is dropped (no lesson draws a mermaid diagram).
"""

from __future__ import annotations

import argparse
import copy
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LESSONS = "notebooks/0*.ipynb"
OUT = Path("build/slides")
LONG = 15                      # lines of code above which the code folds away
HIDE = "hide-input"            # cell tag: the slides show the output only
PICTURES = ("image/png", "image/jpeg", "image/svg+xml")
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"

# offline assets: (npm package, folder under vendor/)
REVEAL = ("reveal.js@4.0.2", "reveal.js")        # the version nbconvert's template is written for
REQUIRE = ("requirejs@2.3.6", "requirejs")
JQUERY = ("jquery@3.5.1", "jquery")
NO_MATHJAX = ("// The lessons use no TeX: the slide template's MathJax hooks get no-ops.\n"
              "window.MathJax = {Hub: {Config: function () {}, Queue: function () {},\n"
              "  getAllJax: function () { return []; }, Rerender: function () {}}};\n")
MERMAID = re.compile(r'<script type="module">\s*import mermaid from [^<]*</script>\s*')
MATH = re.compile(r"(?<![\\$])\$[^$\s][^$\n]*\$")


# ---- tagging ------------------------------------------------------------------------------

# a slide is narrower than a notebook: long code and output lines wrap (at spaces where
# they can) instead of running off the slide's right edge
SLIDE_CSS = """<style>
.reveal pre, .reveal pre code, .reveal .jp-OutputArea-output pre {
  white-space: pre-wrap; overflow-wrap: break-word; word-break: normal;
}
</style>
"""


def _lines(source: str) -> int:
    return len([line for line in source.splitlines() if line.strip()])


def _has_picture(cell) -> bool:
    return any(any(k in o.get("data", {}) for k in PICTURES) for o in cell.get("outputs", []))


def slide_tags(cell) -> tuple[str, bool]:
    """``(slide_type, hide_input)`` for one cell, from its content alone."""
    if (cell.get("metadata", {}).get("labkit") or {}).get("colab"):
        return "skip", False
    if cell.cell_type == "markdown":
        first = cell.source.lstrip().split("\n", 1)[0]
        if re.match(r"#{1,2} ", first):
            return "slide", False
        if first.startswith("### "):
            return "subslide", False
        return "-", False
    if cell.cell_type != "code":
        return "skip", False
    long = _lines(cell.source) > LONG
    if _has_picture(cell):
        return "subslide", long
    if not cell.get("outputs"):
        return ("notes" if long else "-"), False
    return "-", long


def tagged(path: Path) -> tuple[str, str]:
    """``(current text, tagged text)`` of one lesson notebook."""
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
    return sorted(Path(root).glob(LESSONS))


def tag(root: Path = ROOT, check: bool = False) -> list[Path]:
    """Tag every lesson (or, with ``check``, list those whose tags are not current)."""
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


# ---- rendering ----------------------------------------------------------------------------

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
    """Copy reveal.js, require.js and jQuery into ``out/vendor`` once; False if that fails."""
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
    return True


def _for_slides(nb):
    """A copy whose widget outputs show the picture they stored (no kernel in slides)."""
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
                if any(k in data for k in PICTURES):
                    data.pop("text/html", None)
    return nb


def _exporter(offline: bool):
    from nbconvert import SlidesExporter
    from traitlets.config import Config

    c = Config()
    c.TagRemovePreprocessor.enabled = True
    c.TagRemovePreprocessor.remove_input_tags = {HIDE}
    c.SlidesExporter.exclude_input_prompt = True
    c.SlidesExporter.exclude_output_prompt = True
    c.SlidesExporter.reveal_scroll = True          # a long slide scrolls instead of overflowing
    if offline:
        c.SlidesExporter.reveal_url_prefix = "vendor/reveal.js"
        c.SlidesExporter.require_js_url = "vendor/requirejs/require.js"
        c.SlidesExporter.jquery_url = "vendor/jquery/dist/jquery.min.js"
        c.SlidesExporter.mathjax_url = "vendor/no-mathjax.js"
        c.SlidesExporter.font_awesome_url = ""
    return SlidesExporter(config=c)


def build(root: Path = ROOT, out: Path | None = None, cdn: bool = False) -> list[Path]:
    """Render every lesson to ``out/NN_name.slides.html``; return the files written."""
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
        if offline:   # no lesson draws mermaid diagrams: drop the import of its CDN module
            body = MERMAID.sub("", body)
        body = body.replace("</head>", SLIDE_CSS + "</head>", 1)
        dest = out / f"{p.stem}.slides.html"
        dest.write_text(body, encoding="utf-8")
        written.append(dest)
        print(f"wrote {dest.relative_to(root).as_posix() if dest.is_relative_to(root) else dest}")
    where = "offline (reveal.js in vendor/)" if offline else "from the CDN (needs the internet)"
    print(f"{len(written)} lessons as slides, {where}: open {out / written[0].name} in a "
          f"browser; s opens the speaker notes" if written else "no lessons found")
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python tools/slides.py",
                                     description="Slide tags for notebooks/0*.ipynb and "
                                                 "reveal.js slides of them.")
    sub = parser.add_subparsers(dest="cmd", required=True)
    p_tag = sub.add_parser("tag", help="set metadata.slideshow in every lesson")
    p_tag.add_argument("--check", action="store_true",
                       help="write nothing; exit 1 if a lesson's tags are not current")
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
