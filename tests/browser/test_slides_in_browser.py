"""Every slide of every deck (``make slides``) fits the screen, in headless Chromium.

Run with ``make test-browser`` (not part of ``make test``: see tests/conftest.py), which
sets ``LABKIT_BROWSER_TESTS=1``; it uses the system's Chromium and chromedriver and never
downloads a browser. The decks in ``build/slides/`` are used when each is newer than its
notebook and than ``tools/slides.py`` and the ``tools/slide_*.py`` modules it runs; otherwise
``make slides`` builds them first.

Each deck (lessons 00-08 and the walkthrough) is opened from ``file://`` (as a presenter
double-clicks it) at 1280×720 and at 1920×1080, and paged through with reveal.js's own
``next()``, from the first slide as loaded to the last, as the arrow keys would. On each
slide, as it is first shown:

* everything on it ends inside the window, and nothing needs scrolling: no box on it
  (the slide's own included) scrolls (``overflow-y`` auto/scroll with more content than
  room); ``make slides`` cuts what is too tall into subslides (``tools/slides.py``);
* nothing reaches past the slide's right edge (or the window's), nothing sits in a box
  that scrolls sideways or cuts its content off;
* no style sheet imports anything from the network (web fonts).

A failure names the deck, the slide (reveal's ``h/v`` and its first heading) and the
window size, with what ran over. The run prints, per deck and size, which slides the
deck's script zoomed out to fit (``MIN_ZOOM`` in tools/slide_build.py). Screenshots of the
failing slides go to build/browser/.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

if os.environ.get("LABKIT_BROWSER_TESTS") != "1":
    pytest.skip("the browser tests run with LABKIT_BROWSER_TESTS=1 (make test-browser)",
                allow_module_level=True)

REPO = Path(__file__).resolve().parents[2]
SLIDES = REPO / "build" / "slides"
SHOTS = REPO / "build" / "browser"
NOTEBOOKS = sorted((REPO / "notebooks").glob("0*.ipynb")) + [REPO / "notebooks" /
                                                             "walkthrough.ipynb"]
SIZES = [(1280, 720), (1920, 1080)]


# --- fixtures ------------------------------------------------------------------------

def _fresh() -> bool:
    tools = max(p.stat().st_mtime for p in (REPO / "tools").glob("slide*.py"))
    if not (SLIDES / "vendor" / "reveal.js" / "package.json").exists():
        return False
    for nb in NOTEBOOKS:
        deck = SLIDES / f"{nb.stem}.slides.html"
        if not deck.exists() or deck.stat().st_mtime < max(nb.stat().st_mtime, tools):
            return False
    return True


@pytest.fixture(scope="module")
def decks():
    """``build/slides/``, rebuilt with ``make slides`` unless every deck is fresh."""
    if _fresh():
        print(f"\nslides: using the fresh decks in {SLIDES.relative_to(REPO)}/")
        return SLIDES
    t0 = time.monotonic()
    run = subprocess.run(["make", "--no-print-directory", "slides"], cwd=REPO,
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, f"make slides failed:\n{run.stdout[-3000:]}{run.stderr[-3000:]}"
    print(f"\nslides: make slides took {time.monotonic() - t0:.1f} s")
    return SLIDES


@pytest.fixture(scope="module")
def browser(start_chromium):
    # scrollbars shown, as on a presenter's screen: a scroll box's bar takes up its width
    return start_chromium("1920,1080", script_timeout=120)


# --- the check, in the page ----------------------------------------------------------

# reveal.js is an AMD module under require.js (no window.Reveal): take it from require's
# registry. Returns the deck's slides as [h, v, first heading] in paging order.
JS_OPEN = """
const done = arguments[arguments.length - 1];
const ready = () => document.querySelector('.reveal.ready .slides section.present');
const imgs = () => [...document.querySelectorAll('img')].every(i => i.complete);
const t0 = Date.now();
(function wait() {
  if (!(ready() && imgs())) {
    if (Date.now() - t0 > 30000) return done({error: 'reveal.js did not start in 30 s'});
    return setTimeout(wait, 50);
  }
  const defined = require.s.contexts._.defined;
  const R = Object.values(defined).find(m => m && m.getCurrentSlide && m.next);
  if (!R) return done({error: 'no reveal.js module in require.js'});
  window.__deck = R;
  const imports = [];
  for (const sheet of document.styleSheets) {
    let rules = [];
    try { rules = [...sheet.cssRules]; } catch (e) { continue; }
    for (const r of rules)
      if (r instanceof CSSImportRule && /^(https?:)?\\/\\//.test(r.href)) imports.push(r.href);
  }
  const slides = [];
  const top = [...document.querySelectorAll('.reveal .slides > section')];
  top.forEach((s, h) => {
    const subs = [...s.querySelectorAll(':scope > section')];
    (subs.length ? subs : [s]).forEach((x, v) => {
      const hd = x.querySelector('h1, h2, h3, h4');
      slides.push([h, v, hd ? hd.textContent.replace('¶', '').trim().slice(0, 60) : '']);
    });
  });
  done({slides: slides, imports: imports, indices: R.getIndices(),
        size: [window.innerWidth, window.innerHeight]});
})();
"""

# Page with next() from the slide shown at load to the last one; measure each slide on
# arrival (after two frames: reveal lays out on `slidechanged`, and so may a deck's own
# script). Returns one record per slide: [h, v, problems, scrolls, zoom].
JS_PAGE = """
const done = arguments[arguments.length - 1];
const n = arguments[0];
const R = window.__deck;
R.configure({transition: 'none', backgroundTransition: 'none'});
const W = window.innerWidth, H = window.innerHeight, TOL = 1;
const frame = () => new Promise(r => requestAnimationFrame(() => requestAnimationFrame(r)));
const text = e => e.textContent.trim().slice(0, 40);
const name = e => e.nodeType === 3 ? 'text "' + text(e) + '"'
  : e.tagName.toLowerCase()
    + (typeof e.className === 'string' && e.className.trim()
       ? '.' + e.className.trim().split(/\\s+/).slice(0, 2).join('.') : '')
    + (text(e) ? ' "' + text(e) + '"' : '');
const px = x => Math.round(x) + ' px';
function check(s) {
  const problems = [];
  const sr = s.getBoundingClientRect();
  const left = Math.max(0, sr.left), right = Math.min(W, sr.right);
  const cs = new Map();
  const style = e => { if (!cs.has(e)) cs.set(e, getComputedStyle(e)); return cs.get(e); };
  const hidden = e => style(e).display === 'none' || style(e).visibility === 'hidden';
  const els = [s, ...s.querySelectorAll('*')]
    .filter(e => !e.closest('aside.notes, script, style'));
  // boxes that scroll down (they must fit the window), boxes that clip or scroll sideways
  const scrollY = new Set();
  for (const e of els) {
    if (style(e).display === 'none') continue;
    const oy = style(e).overflowY, ox = style(e).overflowX;
    if (oy !== 'visible' && e.scrollHeight > e.clientHeight + TOL) {
      if (oy === 'auto' || oy === 'scroll') scrollY.add(e);
      else problems.push(['bottom', 'content cut off at the bottom of ' + name(e) + ' ('
        + px(e.scrollHeight) + ' of content in ' + px(e.clientHeight) + ')']);
    }
    if (ox !== 'visible' && e.scrollWidth > e.clientWidth + TOL)
      problems.push(['right', (ox === 'hidden' || ox === 'clip' ? 'cut off on the right: '
        : 'scrolls sideways: ') + name(e) + ' (' + px(e.scrollWidth) + ' of content in '
        + px(e.clientWidth) + ')']);
  }
  for (const b of scrollY) {
    const r = b.getBoundingClientRect();
    if (r.top < -TOL || r.bottom > H + TOL)
      problems.push(['bottom', 'scroll box ' + name(b) + ' spans ' + Math.round(r.top) + '..'
        + px(r.bottom) + ', the window ' + px(H)]);
  }
  const inBox = e => {
    for (let a = e; a && a !== s.parentElement; a = a.parentElement)
      if (scrollY.has(a)) return true;
    return false;
  };
  // what shows: every element box with a size, and every piece of text
  let low = null, wide = null;
  const consider = (node, r, owner) => {
    if (r.width <= 0 || r.height <= 0) return;
    if (!inBox(owner) && (r.bottom > H + TOL || r.top < -TOL) && (!low || r.bottom > low[1]))
      low = [node, r.bottom, r.top];
    if ((r.right > right + TOL || r.left < left - TOL) && (!wide || r.right > wide[1]))
      wide = [node, r.right];
  };
  for (const e of els) if (!hidden(e)) consider(e, e.getBoundingClientRect(), e);
  const walk = document.createTreeWalker(s, NodeFilter.SHOW_TEXT);
  const range = document.createRange();
  for (let t = walk.nextNode(); t; t = walk.nextNode()) {
    const p = t.parentElement;
    if (!t.textContent.trim() || p.closest('aside.notes, script, style') || hidden(p)) continue;
    range.selectNodeContents(t);
    consider(t, range.getBoundingClientRect(), p);
  }
  if (low) problems.push(['bottom', 'content runs past the ' + (low[1] > H ? 'bottom' : 'top')
    + ' of the window, outside any scroll box that fits: ' + name(low[0]) + ' spans '
    + Math.round(low[2]) + '..' + px(low[1]) + ', the window ' + px(H)]);
  if (wide) problems.push(['right', 'content reaches past the right edge (' + px(right)
    + '): ' + name(wide[0]) + ' ends at ' + px(wide[1])]);
  return [problems, scrollY.size > 0];
}
(async () => {
  const out = [];
  for (let i = 0; i < n; i++) {
    if (i) R.next();
    await frame();
    const idx = R.getIndices();
    const s = R.getCurrentSlide();
    out.push([idx.h, idx.v || 0, ...check(s), Number(s.dataset.zoom || 1)]);
  }
  done(out);
})().catch(e => done({error: String(e && e.stack || e)}));
"""


@pytest.mark.parametrize("size", SIZES, ids=[f"{w}x{h}" for w, h in SIZES])
@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_every_slide_fits_the_window(decks, browser, notebook, size):
    deck = decks / f"{notebook.stem}.slides.html"
    assert deck.exists(), f"{notebook.name} has no deck: make slides wrote no {deck.name}"
    w, h = size
    where = f"{notebook.stem} at {w}×{h}"
    browser.execute_cdp_cmd("Emulation.setDeviceMetricsOverride",
                            {"width": w, "height": h, "deviceScaleFactor": 1, "mobile": False})
    browser.get(deck.as_uri())      # the hash-less URI: the deck opens at its first slide
    opened = browser.execute_async_script(JS_OPEN)
    assert "error" not in opened, f"{where}: {opened['error']}"
    assert opened["size"] == [w, h], f"{where}: the window is {opened['size']}"
    assert not opened["imports"], f"{where}: the deck imports from the network: " \
                                  f"{opened['imports']}"
    slides = opened["slides"]
    assert opened["indices"]["h"] == 0 and not opened["indices"].get("v"), \
        f"{where}: the deck opened at {opened['indices']}, not its first slide"
    paged = browser.execute_async_script(JS_PAGE, len(slides))
    assert isinstance(paged, list), f"{where}: paging failed: {paged}"
    assert [p[:2] for p in paged] == [s[:2] for s in slides], \
        f"{where}: next() did not visit every slide in order"
    for p in paged:
        if p[3] and not any(q[0] == "bottom" for q in p[2]):
            p[2].append(["scroll", "needs scrolling: a box on it scrolls (cut it into "
                                   "subslides: tools/slides.py)"])
    bad = [(s, p[2]) for s, p in zip(slides, paged) if p[2]]
    kinds = {k: sum(1 for _, problems in bad if any(q[0] == k for q in problems))
             for k in ("bottom", "right", "scroll")}
    zoomed = [f"{p[0]}/{p[1]} {p[4]:.0%}" for p in paged if p[4] < 1]
    print(f"\n{where}: {len(slides)} slides; {len(bad)} do not fit ({kinds['bottom']} run "
          f"past the bottom, {kinds['right']} past the right edge, {kinds['scroll']} need "
          f"scrolling); {len(zoomed)} zoomed out to fit"
          + (f" ({', '.join(zoomed)})" if zoomed else ""))
    for (hh, vv, title), _ in bad[:3]:   # a picture of the first few that do not fit
        browser.execute_script(f"window.__deck.slide({hh}, {vv});")
        browser.save_screenshot(str(SHOTS / f"slide_{notebook.stem}_{hh}-{vv}_{w}x{h}.png"))
    if bad:
        pytest.fail(f"{len(bad)} of {len(slides)} slides of {notebook.stem} do not fit "
                    f"{w}×{h}:\n" + "\n".join(
                        f"  {notebook.stem} slide {hh}/{vv} ({title or 'no heading'!r}) at "
                        f"{w}×{h}: " + "; ".join(
                            next(q[1] for q in problems if q[0] == k)
                            for k in ("bottom", "right", "scroll")
                            if any(q[0] == k for q in problems))
                        for (hh, vv, title), problems in bad), pytrace=False)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v", "-s"]))
