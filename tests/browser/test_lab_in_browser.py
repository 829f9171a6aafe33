"""The lab as a learner sees it: lessons 01 and 06 in JupyterLab, and lesson 01's slides, in
Chromium.

Run with ``make test-browser`` (not part of ``make test``: see tests/conftest.py). It needs
the system's Chromium and chromedriver (Debian: ``apt-get install chromium chromium-driver``)
and selenium in .venv; nothing downloads a browser or a driver.

1. ``make lab`` itself is started (the product's own command, with LAB_ARGS for a free port, a
   token and no browser), lesson 01 is opened, its outputs cleared and Run > Run All Cells
   (``runmenu:run-all``) run; then: no error or stderr output, every code cell ran, the kernel
   is .venv's Python, each cell that stores a matplotlib figure shows it as an image that
   decoded, the timeline panel is a live widget (three sliders and a picture, not its text
   fallback), showing it keeps the lesson's start values, its readouts are visible and it
   does not scroll sideways, and moving the ``kernels`` slider with the keyboard redraws the
   picture and the label with exactly what ``TimelinePanel`` computes for the new value; a
   burst of moves over all three sliders ends on exactly the picture and label a fresh panel
   draws for the sliders' values, no two pictures drawn at once (issue 19).
1b. Lesson 06, Run All, then right away a burst of ``max_bs`` slider moves and bucket
   dropdown choices: the bucket explorer ends on exactly the picture and table a fresh
   panel draws for the controls' values, no two pictures drawn at once (issue 19: with
   ipykernel 7 the redraws ran on the main thread and a subshell's at the same time, and the
   picture came out broken).
2. Lesson 01's reveal.js slides (``make slides`` where the Makefile has it, else
   ``jupyter nbconvert --to slides``), served over http://127.0.0.1 and opened as a file:
   every picture decodes, reveal.js starts, and the first picture slide shows its picture.

Screenshots go to build/browser/ (git-ignored).

.. warning::
    JupyterLab runs with autosave off (a settings dir of its own) and the test fails if the
    server logged any save: running a lesson must never rewrite the stored GPU outputs with
    this machine's. The test never writes a notebook itself.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import http.server
import json
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from selenium.webdriver.common.by import By  # selenium: conftest.py says if it is missing
from selenium.webdriver.common.keys import Keys

REPO = Path(__file__).resolve().parents[2]
LESSON = "notebooks/01_launch_bound_timeline.ipynb"
PANEL_SOURCE = "T.timeline_panel("          # the cell that shows the live panel
SHOTS = REPO / "build" / "browser"

# --- helpers -------------------------------------------------------------------------

def wait_for(what: str, fn, timeout: float, every: float = 0.5):
    """Poll ``fn`` until it returns something truthy; fail naming ``what`` and the last value."""
    end = time.monotonic() + timeout
    last = None
    while time.monotonic() < end:
        last = fn()
        if last:
            return last
        time.sleep(every)
    pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}; last seen: {last!r}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stored_notebook() -> dict:
    return json.loads((REPO / LESSON).read_text())


def source(cell: dict) -> str:
    """A cell's source as one string (the file stores a list of lines)."""
    s = cell["source"]
    return s if isinstance(s, str) else "".join(s)


# --- fixtures ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def browser(start_chromium):
    return start_chromium("1400,1000", script_timeout=60)


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """``make lab`` on a free port with a token; yields its base URL and token."""
    tmp = tmp_path_factory.mktemp("lab")
    settings = tmp / "settings"
    # the learner's lab autosaves; this one must not write CPU outputs into the lesson
    for plugin, value in (("@jupyterlab/docmanager-extension/plugin", {"autosave": False}),
                          ("@jupyterlab/apputils-extension/notification",
                           {"fetchNews": "false", "checkForUpdates": False})):
        f = settings / f"{plugin}.jupyterlab-settings"
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(json.dumps(value))
    port, token = free_port(), secrets.token_hex(16)
    lab_args = " ".join([
        "--no-browser", "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={port}",
        "--ServerApp.port_retries=0", f"--IdentityProvider.token={token}",
        "--LabApp.expose_app_in_browser=True",       # window.jupyterapp, to run commands
        f"--LabApp.user_settings_dir={settings}", f"--LabApp.workspaces_dir={tmp / 'ws'}",
    ])
    log = open(tmp / "lab.log", "w")
    proc = subprocess.Popen(["make", "--no-print-directory", "lab", f"LAB_ARGS={lab_args}"],
                            cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)   # its own process group: stopped as one
    base = f"http://127.0.0.1:{port}"

    def up():
        if proc.poll() is not None:
            pytest.fail(f"make lab exited with {proc.returncode}:\n{(tmp / 'lab.log').read_text()}")
        try:
            with urllib.request.urlopen(f"{base}/api/status?token={token}", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    try:
        wait_for("make lab to serve", up, timeout=180)
        yield {"base": base, "token": token, "log": tmp / "lab.log"}
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        log.close()


JS_NOTEBOOK = "const w = window.jupyterapp && window.jupyterapp.shell.currentWidget;"

JS_NOTEBOOK_PATH = JS_NOTEBOOK + "return w && w.context ? w.context.path : null;"

JS_KERNEL_STATUS = JS_NOTEBOOK + """
if (!w || !w.sessionContext || !w.content) return null;
const s = w.sessionContext.session; const k = s && s.kernel;
return k ? k.status : null;"""

# every code cell's execution count (null: not run), and whether one still runs
JS_COUNTS = JS_NOTEBOOK + """
const cells = w.content.model.cells; const out = [];
for (let i = 0; i < cells.length; i++) {
  const c = cells.get(i); if (c.type === 'code') out.push(c.executionCount);
}
return out;"""

JS_RUN_IN_KERNEL = JS_NOTEBOOK + """
const done = arguments[arguments.length - 1];
const kernel = w.sessionContext.session.kernel; let text = '';
const future = kernel.requestExecute({code: arguments[0], store_history: false, silent: false});
future.onIOPub = (msg) => {
  if (msg.header.msg_type === 'stream') text += msg.content.text;
  if (msg.header.msg_type === 'error') text += 'ERROR ' + msg.content.ename;
};
future.done.then(() => done(text), (e) => done('FAILED ' + e));"""


def open_and_run_all(lab, browser, lesson: str, shot: str, until=None) -> float:
    """Open ``lesson`` in ``make lab``, clear its outputs and Run > Run All Cells.

    Returns the seconds it took. ``until`` (driver -> bool) ends the wait early: the run
    is then still going (a learner who starts using a panel before the last cell ran).
    """
    t0 = time.monotonic()
    browser.get(f"{lab['base']}/lab/tree/{lesson}?token={lab['token']}")
    wait_for(f"JupyterLab to open {lesson} with an idle kernel",
             lambda: (browser.execute_script(JS_NOTEBOOK_PATH) == lesson
                      and browser.execute_script(JS_KERNEL_STATUS) == "idle"), timeout=120)
    app = browser.execute_script("return !!window.jupyterapp")
    assert app, "window.jupyterapp missing: LabApp.expose_app_in_browser had no effect"
    # cleared first, so every output checked below comes from this run, not from the file
    browser.execute_script("return window.jupyterapp.commands.execute("
                           "'notebook:clear-all-cell-outputs')")
    counts = browser.execute_script(JS_COUNTS)
    assert counts and all(c is None for c in counts), f"outputs not cleared: {counts}"
    assert browser.execute_script("return window.jupyterapp.commands.hasCommand('runmenu:run-all')")
    browser.execute_script("return window.jupyterapp.commands.execute('runmenu:run-all')")
    wait_for("Run > Run All Cells to finish (every code cell numbered, kernel idle)",
             lambda: ((until is not None and until(browser))
                      or (all(c is not None for c in browser.execute_script(JS_COUNTS))
                          and browser.execute_script(JS_KERNEL_STATUS) == "idle")),
             timeout=600, every=0.5)
    took = time.monotonic() - t0
    browser.save_screenshot(str(SHOTS / shot))
    return took


def no_saves(lab):
    # JupyterLab logs every save; the lesson file itself may change meanwhile (an author
    # committing), so the log, not the file's bytes, says whether this lab wrote it
    saves = [ln for ln in lab["log"].read_text().splitlines() if "Saving file at" in ln]
    assert not saves, f"JupyterLab saved a file while the test ran (autosave?): {saves}"


@pytest.fixture(scope="module")
def lesson01(lab, browser):
    """Lesson 01 opened in ``make lab``, outputs cleared, all cells run; yields the driver."""
    took = open_and_run_all(lab, browser, LESSON, "lesson01_after_run_all.png")
    print(f"\nlesson 01: opened and ran all cells in {took:.1f} s")
    yield browser
    no_saves(lab)


def notebook_json(driver) -> dict:
    return driver.execute_script(JS_NOTEBOOK + "return w.content.model.toJSON();")


def cell_node_script(index: int) -> str:
    return JS_NOTEBOOK + f"const n = w.content.widgets[{index}].node;"


# --- 1. lesson 01 in JupyterLab ------------------------------------------------------

def test_lesson01_runs_without_errors(lesson01):
    nb = notebook_json(lesson01)
    problems = []
    for i, cell in enumerate(nb["cells"]):
        if cell["cell_type"] != "code":
            continue
        if cell.get("execution_count") is None:
            problems.append(f"cell {i} ({cell.get('id')}) did not run")
        for out in cell.get("outputs", []):
            if out["output_type"] == "error":
                problems.append(f"cell {i} ({cell.get('id')}) raised "
                                f"{out['ename']}: {out['evalue']}")
            if out["output_type"] == "stream" and out["name"] == "stderr":
                problems.append(f"cell {i} ({cell.get('id')}) wrote to stderr: "
                                f"{''.join(out['text'])[:300]!r}")
    rendered_errors = lesson01.execute_script(
        "return [...document.querySelectorAll('.jp-OutputArea-output[data-mime-type="
        "\"application/vnd.jupyter.stderr\"]')].map(e => e.textContent.slice(0, 300));")
    problems += [f"error output shown: {t!r}" for t in rendered_errors]
    assert not problems, "\n".join(problems)


def test_kernel_is_the_venv_python(lesson01):
    text = lesson01.execute_async_script(
        JS_RUN_IN_KERNEL, "import sys, labkit; print(sys.prefix); print(labkit.__file__)")
    prefix, labkit_file = text.split()
    assert Path(prefix).resolve() == (REPO / ".venv").resolve(), \
        f"the lab's kernel runs {prefix}, not this checkout's .venv: {text!r}"
    assert Path(labkit_file).resolve().is_relative_to(REPO / "labkit"), \
        f"the kernel imports labkit from {labkit_file}, not this checkout"


def test_figures_render_as_images(lesson01):
    """Every cell whose stored outputs hold a matplotlib PNG shows a decoded image now."""
    stored = stored_notebook()["cells"]
    live = notebook_json(lesson01)["cells"]
    want = [i for i, c in enumerate(stored) if c["cell_type"] == "code"
            and not source(c).startswith(PANEL_SOURCE)
            and any("image/png" in o.get("data", {}) for o in c.get("outputs", []))]
    assert want, f"{LESSON} stores no figure: nothing to check"
    for i in want:
        assert [c["id"] for c in live][i] == stored[i]["id"], "cell order differs from the file"
        imgs = lesson01.execute_script(cell_node_script(i) + """
            n.scrollIntoView();
            return [...n.querySelectorAll(
                '.jp-OutputArea-output[data-mime-type="image/png"] img')].map(
                e => [e.complete, e.naturalWidth, e.naturalHeight]);""")
        kinds = [list(o.get("data", {o["output_type"]: 0})) for o in live[i]["outputs"]]
        assert imgs, (f"cell {i} ({stored[i]['id']}) shows no image/png output in the browser; "
                      f"its outputs: {kinds}")
        bad = [x for x in imgs if not (x[0] and x[1] > 0 and x[2] > 0)]
        assert not bad, f"cell {i} ({stored[i]['id']}): image(s) did not decode: {imgs}"
        if i == want[0]:
            lesson01.execute_script(cell_node_script(i) + "n.scrollIntoView();")
            lesson01.execute_script(cell_node_script(i) + "return n;").screenshot(
                str(SHOTS / "lesson01_first_figure.png"))


def panel_state(driver, index: int) -> dict:
    return driver.execute_async_script(cell_node_script(index) + """
        const done = arguments[arguments.length - 1];
        const out = n.querySelector('.jp-Cell-outputArea');
        const img = out.querySelector('.widget-image');
        const state = {
          text: out.innerText,
          widgets: out.querySelectorAll('.jupyter-widgets').length,
          sliders: [...out.querySelectorAll('.widget-slider')].map(
              s => [s.querySelector('.widget-label').textContent,
                    s.querySelector('.widget-readout').textContent]),
          label: (out.querySelector('.widget-html-content') || {}).textContent,
          para: (out.querySelector('.widget-html-content p') || {}).textContent,
          dropdowns: [...out.querySelectorAll('.widget-dropdown select')].map(s => s.value),
          img: img && [img.complete, img.naturalWidth, img.naturalHeight, img.src.slice(0, 5)],
          src: img && img.src, bytes: null,
        };
        if (!img) { done(state); return; }
        fetch(img.src).then(r => r.arrayBuffer()).then(b => {
          const u = new Uint8Array(b); let s = '';
          for (let i = 0; i < u.length; i += 8192)
            s += String.fromCharCode(...u.subarray(i, i + 8192));
          state.bytes = btoa(s); done(state);
        }, e => { state.bytes = 'FAILED ' + e; done(state); });""")


PANEL_SETTINGS = """
import json
_p = [o for o in Out.values() if type(o).__name__ == "TimelinePanel"][-1]
print(json.dumps([_p.launch_us, _p.kernel_us, _p.n_kernels]))
del _p
"""


def panel_index(driver, prefix: str = PANEL_SOURCE) -> int:
    nb = notebook_json(driver)
    return next(i for i, c in enumerate(nb["cells"])
                if c["cell_type"] == "code" and source(c).startswith(prefix))


def shown_panel(driver, prefix: str = PANEL_SOURCE) -> tuple[int, dict]:
    index = panel_index(driver, prefix)
    end = time.monotonic() + 30
    while True:
        state = panel_state(driver, index)
        if state["sliders"] and state["img"] and state["img"][1] > 0:
            return index, state
        if time.monotonic() > end:
            kinds = driver.execute_script(cell_node_script(index) + """
                return [...n.querySelectorAll('.jp-OutputArea-output')].map(
                    e => e.getAttribute('data-mime-type'));""")
            pytest.fail(f"the panel ({prefix}...) did not render as a widget within 30 s: its "
                        f"outputs are {kinds}, {len(state['sliders'])} sliders, widget image "
                        f"{state['img']}; it shows {state['text'][:300]!r}")
        time.sleep(0.5)


def kernel_panel_settings(driver) -> list:
    """(launch_us, kernel_us, n_kernels) of the panel object in the kernel."""
    return json.loads(driver.execute_async_script(JS_RUN_IN_KERNEL, PANEL_SETTINGS))


def test_timeline_panel_keeps_its_start_values(lesson01):
    """Showing the panel must not change what the lesson asked for (10 µs, 2 µs, 12)."""
    from labkit.timeline import TimelinePanel

    # runs before test_timeline_panel_is_a_live_widget moves the kernels slider
    _, state = shown_panel(lesson01)
    launch_us, kernel_us, _n = kernel_panel_settings(lesson01)
    asked = TimelinePanel(10.0, 2.0, 12, widgets=False)
    assert (launch_us, kernel_us) == (10.0, 2.0), (
        f"showing the panel in the browser changed its settings from launch 10.0 µs, kernel "
        f"2.0 µs to {launch_us!r}, {kernel_us!r} (the log sliders' step grid): the readouts "
        f"say {state['sliders']}, while the label says {state['label']!r} and the lesson "
        f"asked for {asked.text()!r}")


def test_timeline_panel_is_a_live_widget(lesson01):
    """Sliders and a picture (not the text fallback); a slider move redraws both."""
    from labkit.timeline import TimelinePanel

    index, state = shown_panel(lesson01)
    for wrong in ("TimelinePanel", "Loading widget", "Error displaying widget",
                  "Error rendering", "Widget Javascript not detected"):
        assert wrong not in state["text"], \
            f"the panel shows {wrong!r} instead of a widget: {state['text'][:300]!r}"
    names = [s[0] for s in state["sliders"]]
    assert names == ["launch cost µs", "kernel time µs", "kernels"], state["sliders"]
    assert dict(state["sliders"])["kernels"] == "12", state["sliders"]
    launch_us, kernel_us, n = kernel_panel_settings(lesson01)
    assert n == 12
    assert state["label"] == TimelinePanel(launch_us, kernel_us, n, widgets=False).text()
    lesson01.execute_script(cell_node_script(index) + "n.scrollIntoView();")
    panel = lesson01.execute_script(cell_node_script(index)
                                    + "return n.querySelector('.jp-Cell-outputArea');")
    panel.screenshot(str(SHOTS / "lesson01_panel_before.png"))

    # move the `kernels` slider with the keyboard, as a learner can: 5 steps right
    handles = panel.find_elements(By.CSS_SELECTOR, ".widget-slider .noUi-handle")
    assert len(handles) == 3, f"expected 3 slider handles, found {len(handles)}"
    handles[2].click()
    for _ in range(5):
        handles[2].send_keys(Keys.ARROW_RIGHT)

    end = time.monotonic() + 30
    while True:
        after = panel_state(lesson01, index)
        moved = int(dict(after["sliders"])["kernels"])
        want = TimelinePanel(launch_us, kernel_us, moved, widgets=False).text()
        new_picture = after["bytes"] != state["bytes"]
        if moved != 12 and after["label"] == want and new_picture:
            break
        if time.monotonic() > end:
            pytest.fail(f"the panel did not redraw within 30 s of moving the kernels slider: "
                        f"slider 12 -> {moved}, picture changed: {new_picture}, label "
                        f"{after['label']!r} (want {want!r})")
        time.sleep(0.5)
    moved = int(dict(after["sliders"])["kernels"])
    assert moved == 17, f"5 × ARROW_RIGHT moved the kernels slider from 12 to {moved}"
    assert kernel_panel_settings(lesson01)[2] == 17, "the kernel's panel did not follow the slider"
    assert after["img"][0] and after["img"][1] > 0, \
        f"the redrawn picture did not decode: {after['img']}"
    png = base64.b64decode(after["bytes"])
    assert png[:8] == b"\x89PNG\r\n\x1a\n", "the redrawn picture is not a PNG"
    assert hashlib.sha256(png).digest() != hashlib.sha256(base64.b64decode(state["bytes"])).digest()
    print(f"panel: kernels 12 -> {moved}; label now {after['label']!r}")
    panel.screenshot(str(SHOTS / "lesson01_panel_after_slider.png"))


JS_PANEL_LAYOUT = """
const out = n.querySelector('.jp-Cell-outputArea');
const box = e => {
  const r = e.getBoundingClientRect(); return [Math.round(r.left), Math.round(r.right)]; };
const clipped = [];
for (const e of out.querySelectorAll('.jupyter-widgets, .jp-OutputArea-output')) {
  if (e.scrollWidth > e.clientWidth + 1 && getComputedStyle(e).overflowX !== 'visible')
    clipped.push([e.className.slice(0, 60), e.clientWidth, e.scrollWidth]);
}
const readouts = [...out.querySelectorAll('.widget-slider')].map(s => {
  const r = s.querySelector('.widget-readout');
  let p = r.parentElement, hidden = null;
  const rr = r.getBoundingClientRect();
  while (p && p !== out) {
    const pr = p.getBoundingClientRect(), st = getComputedStyle(p);
    if (st.overflowX !== 'visible' && (rr.right > pr.right + 1 || rr.left < pr.left - 1)) {
      hidden = [p.className.slice(0, 60), box(p)]; break; }
    p = p.parentElement;
  }
  return [s.querySelector('.widget-label').textContent, r.textContent, box(r), hidden];
});
const img = out.querySelector('.widget-image');
return {clipped, readouts, output: box(out), img: img && [box(img), img.naturalWidth]};
"""


def test_timeline_panel_fits_its_cell(lesson01):
    """The sliders' readouts are visible and nothing in the panel scrolls sideways."""
    index, _ = shown_panel(lesson01)
    lesson01.execute_script(cell_node_script(index) + "n.scrollIntoView();")
    layout = lesson01.execute_script(cell_node_script(index) + JS_PANEL_LAYOUT)
    hidden = [r for r in layout["readouts"] if r[3]]
    assert not hidden, (
        "slider readouts cut off (label, readout, readout's x range, the box that clips it): "
        f"{hidden}; the panel's output area spans x {layout['output']}")
    assert not layout["clipped"], (
        f"parts of the panel scroll sideways (class, visible width, content width): "
        f"{layout['clipped']}; picture {layout['img']}, output area {layout['output']}")


# --- a burst of input: the picture shown is the picture of the last value -------------
#
# Issue 19: right after Run All, a quick burst of slider and dropdown changes left lesson
# 06's bucket explorer showing a broken picture (grey bars and a stray 0..1 axis; no
# staircase, axes, title or legend), 3 of 3 tries. JupyterLab 4.6 sends comm messages on a
# subshell and ipykernel 7 routes a comm's messages to the thread that last published on it,
# so right after Run All one control's change is handled on the main thread while the
# other's is handled on the subshell's: two redraws at once, through pyplot's global state.
# After a burst the panel must show exactly what a fresh panel draws for the values its
# controls show, and no two pictures may have been drawn at the same time (a probe on
# matplotlib in the kernel times each figure from its creation to its PNG): a collision
# that corrupts a picture is rare, drawing two at once is what lets it happen.

PROBE_ON = """
class _LabkitDrawProbe:
    def __init__(self):
        import functools, threading, time
        import matplotlib.figure as mf
        from matplotlib.backends import backend_agg as ba
        self.mf, self.ba, self.born, self.spans = mf, ba, {}, []
        self.init, self.png = mf.Figure.__init__, ba.FigureCanvasAgg.print_png
        probe = self
        @functools.wraps(self.init)   # matplotlib reads the print method's module and signature
        def init(fig, *a, **k):
            probe.born[id(fig)] = (threading.current_thread().name, time.perf_counter())
            return probe.init(fig, *a, **k)
        @functools.wraps(self.png)
        def png(canvas, *a, **k):
            try:
                return probe.png(canvas, *a, **k)
            finally:
                who, t0 = probe.born.pop(id(canvas.figure), ("?", None))
                if t0 is not None:
                    probe.spans.append((who, t0, time.perf_counter()))
        mf.Figure.__init__, ba.FigureCanvasAgg.print_png = init, png
    def off(self):
        self.mf.Figure.__init__, self.ba.FigureCanvasAgg.print_png = self.init, self.png
        return self.spans
_labkit_probe = _LabkitDrawProbe()
del _LabkitDrawProbe
print("on")
"""

PROBE_OFF = """
import json as _j
print(_j.dumps(_labkit_probe.off()))
del _j, _labkit_probe
"""


def probe_on(driver):
    assert driver.execute_async_script(JS_RUN_IN_KERNEL, PROBE_ON).strip() == "on"


def drawn_at_once(driver) -> tuple[int, list]:
    """(pictures drawn since probe_on, the pairs of them drawn at the same time)."""
    spans = sorted(json.loads(driver.execute_async_script(JS_RUN_IN_KERNEL, PROBE_OFF)),
                   key=lambda s: s[1])
    at_once = [(a[0], b[0], round(a[2] - b[1], 3)) for i, a in enumerate(spans)
               for b in spans[i + 1:] if b[1] < a[2]]
    return len(spans), at_once


FRESH_TIMELINE = """
import hashlib as _h, json as _j
from labkit.timeline import TimelinePanel as _TP
from labkit.widgets import figure_png as _fp
_p = [o for o in Out.values() if type(o).__name__ == "TimelinePanel"][-1]
_f = _TP(_p.launch_us, _p.kernel_us, _p.n_kernels, preset=_p.preset, widgets=False)
print(_j.dumps({"kernel": [_p.launch_us, _p.kernel_us, _p.n_kernels], "text": _f.text(),
                "sha": _h.sha256(_fp(_f.figure())).hexdigest()}))
del _h, _j, _TP, _fp, _p, _f
"""

FRESH_BUCKETS = """
import hashlib as _h, json as _j
from labkit.decode.plots import BucketPanel as _BP
from labkit.widgets import figure_png as _fp
_p = [o for o in Out.values() if type(o).__name__ == "BucketPanel"][-1]
_f = _BP(_p.workload, max_bs={max_bs}, scheme={scheme!r}, slider_max=_p.slider_max,
         widgets=False, **_p.explore_kwargs)
print(_j.dumps({{"kernel": [_p.max_bs, _p.scheme], "text": _f.text(),
                 "sha": _h.sha256(_fp(_f.figure())).hexdigest()}}))
del _h, _j, _BP, _fp, _p, _f
"""


# A burst within one frame: key presses on slider handles and dropdown choices dispatched
# in one script, as fast as input can come (Selenium's round trips, 50-100 ms each, spread
# it over half a second and made the two threads' redraws overlap only some of the time).
JS_BURST = JS_NOTEBOOK + """
const n = w.content.widgets[arguments[0]].node;
const handles = [...n.querySelectorAll('.widget-slider .noUi-handle')];
const selects = [...n.querySelectorAll('.widget-dropdown select')];
for (const [kind, i, what, times] of arguments[1]) {
  for (let k = 0; k < times; k++) {
    if (kind === 'key') {
      handles[i].focus();
      handles[i].dispatchEvent(new KeyboardEvent('keydown', {key: what, bubbles: true}));
    } else {
      selects[i].selectedIndex = [...selects[i].options].findIndex(o => o.textContent === what);
      selects[i].dispatchEvent(new Event('change', {bubbles: true}));
    }
  }
}
return [handles.length, selects.length];"""


def burst(driver, index: int, steps) -> float:
    """Fire ``steps`` ((``"key"``, handle, key, times) or (``"choose"``, dropdown, option,
    1)) in one go; returns the seconds it took the browser."""
    t0 = time.monotonic()
    found = driver.execute_script(JS_BURST, index, [list(x) for x in steps])
    used = max(i for _, i, _, _ in steps) + 1
    assert found[0] >= used or found[1] >= used, f"controls found: {found}"
    return time.monotonic() - t0


def settled(driver, index: int, ready, what: str, timeout: float = 120) -> dict:
    """The panel's state once ``ready(state)`` holds, the kernel is idle and the picture and
    text have not changed for 3 s (a burst's last redraw has landed)."""
    end, last, since = time.monotonic() + timeout, None, None
    while True:
        state = panel_state(driver, index)
        key = (state["bytes"], state["label"], tuple(map(tuple, state["sliders"])),
               tuple(state["dropdowns"]))
        if key != last:
            last, since = key, time.monotonic()
        elif (ready(state) and driver.execute_script(JS_KERNEL_STATUS) == "idle"
              and time.monotonic() - since >= 3):
            return state
        if time.monotonic() > end:
            pytest.fail(f"{what}: the panel did not settle within {timeout:.0f} s; it shows "
                        f"sliders {state['sliders']}, dropdowns {state['dropdowns']}, "
                        f"label {(state['label'] or '')[:200]!r}")
        time.sleep(0.5)


def png_summary(png: bytes) -> str:
    """Size and colours of a PNG, for a failure message (Pillow comes with matplotlib)."""
    try:
        import io

        from PIL import Image
        im = Image.open(io.BytesIO(png)).convert("RGB")
        px = list(im.get_flattened_data() if hasattr(im, "get_flattened_data")
                  else im.getdata())
        ink = [p for p in px if p != (255, 255, 255)]
        grey = sum(1 for p in ink if max(p) - min(p) < 8)
        return (f"{im.size[0]}×{im.size[1]} px, {len(ink) / len(px):.0%} not white, "
                f"{grey / max(1, len(ink)):.0%} of that grey")
    except Exception as e:  # only ever a message
        return f"{len(png)} bytes ({e})"


def check_shows_fresh_picture(driver, state: dict, fresh: dict, what: str, shot: str):
    png = base64.b64decode(state["bytes"])
    (SHOTS / shot).write_bytes(png)
    assert png[:8] == b"\x89PNG\r\n\x1a\n", f"{what}: the picture shown is not a PNG"
    assert state["img"][0] and state["img"][1] > 0, f"{what}: picture did not decode {state['img']}"
    got = hashlib.sha256(png).hexdigest()
    assert got == fresh["sha"], (
        f"{what}: the picture shown ({png_summary(png)}; saved to {SHOTS / shot}) is not the "
        f"picture a fresh panel draws for the values the controls show")


def test_timeline_panel_survives_a_burst_of_input(lesson01):
    """Lesson 01's panel: a quick burst over all three sliders ends on the right picture."""
    index, _ = shown_panel(lesson01)
    lesson01.execute_script(cell_node_script(index) + "n.scrollIntoView({block: 'center'});")
    panel = lesson01.execute_script(cell_node_script(index)
                                    + "return n.querySelector('.jp-Cell-outputArea');")
    handles = panel.find_elements(By.CSS_SELECTOR, ".widget-slider .noUi-handle")
    assert len(handles) == 3, f"expected 3 slider handles, found {len(handles)}"
    before = panel_state(lesson01, index)
    n0 = int(dict(before["sliders"])["kernels"])
    probe_on(lesson01)
    # a slider's first change is handled on the main thread, its later ones on the subshell:
    # one move of `launch` first, then moves of all three while that thread switch is fresh
    handles[0].click()
    handles[0].send_keys(Keys.ARROW_RIGHT)
    wait_for("the first slider move to redraw the panel",
             lambda: panel_state(lesson01, index)["label"] != before["label"], timeout=30,
             every=0.1)
    steps = (("key", 0, "ArrowRight", 2), ("key", 1, "ArrowRight", 3),
             ("key", 2, "ArrowLeft", 4), ("key", 0, "ArrowRight", 1),
             ("key", 2, "ArrowLeft", 2), ("key", 1, "ArrowRight", 1))
    fired = burst(lesson01, index, steps)
    want_n = n0 - 6
    state = settled(lesson01, index,
                    lambda st: dict(st["sliders"])["kernels"] == str(want_n), "lesson 01 burst")
    drawn, at_once = drawn_at_once(lesson01)
    fresh = json.loads(lesson01.execute_async_script(JS_RUN_IN_KERNEL, FRESH_TIMELINE))
    print(f"lesson 01 burst: 1 key press, then {sum(x[3] for x in steps)} in {fired:.2f} s, "
          f"{drawn} pictures drawn, {len(at_once)} pairs at once; settled on {fresh['kernel']}")
    assert fresh["kernel"][2] == want_n, (fresh["kernel"], state["sliders"])
    assert state["label"] == fresh["text"], (state["label"], fresh["text"])
    check_shows_fresh_picture(lesson01, state, fresh, "lesson 01's panel after a burst",
                              "lesson01_panel_after_burst.png")
    assert not at_once, (f"lesson 01's panel drew pictures at the same time (threads, "
                         f"seconds of overlap): {at_once}")


# --- 1b. lesson 06's bucket explorer -------------------------------------------------

LESSON06 = "notebooks/06_decode_bucketing.ipynb"
BUCKETS_SOURCE = "plots.bucket_panel("


@pytest.fixture(scope="module")
def lesson06(lab, browser):
    """Lesson 06 opened in ``make lab``, outputs cleared, all cells run; yields the driver."""
    took = open_and_run_all(lab, browser, LESSON06, "lesson06_after_run_all.png")
    print(f"\nlesson 06: opened and ran all cells in {took:.1f} s")
    yield browser
    no_saves(lab)


def test_bucket_explorer_survives_a_burst_right_after_run_all(lesson06):
    """Right after Run All: slider and dropdown changes in quick succession, then the
    picture and table shown are those of the last values (issue 19)."""
    index, start = shown_panel(lesson06, BUCKETS_SOURCE)
    lesson06.execute_script(cell_node_script(index) + "n.scrollIntoView({block: 'center'});")
    panel = lesson06.execute_script(cell_node_script(index)
                                    + "return n.querySelector('.jp-Cell-outputArea');")
    handle = panel.find_element(By.CSS_SELECTOR, ".widget-slider .noUi-handle")
    m0 = int(start["sliders"][0][1])
    probe_on(lesson06)
    # a control's first change is handled on the main thread, its later ones on the subshell:
    # one slider move first, then slider and dropdown changes while that switch is fresh
    handle.click()
    handle.send_keys(Keys.ARROW_LEFT)
    wait_for("the first slider move to redraw the panel",
             lambda: f"max_bs {m0 - 1}," in (panel_state(lesson06, index)["para"] or ""),
             timeout=30, every=0.1)
    steps = (("key", 0, "ArrowLeft", 3), ("choose", 0, "pow2", 1), ("key", 0, "ArrowRight", 5),
             ("choose", 0, "every", 1), ("key", 0, "ArrowLeft", 4))
    fired = burst(lesson06, index, steps)
    want = (m0 - 3, "every")
    state = settled(lesson06, index,
                    lambda st: (int(st["sliders"][0][1]), st["dropdowns"][0]) == want,
                    "lesson 06 burst")
    lesson06.execute_script(cell_node_script(index) + "n.scrollIntoView();")
    panel.screenshot(str(SHOTS / "lesson06_bucket_panel_after_burst_screen.png"))
    drawn, at_once = drawn_at_once(lesson06)
    fresh = json.loads(lesson06.execute_async_script(
        JS_RUN_IN_KERNEL, FRESH_BUCKETS.format(max_bs=want[0], scheme=want[1])))
    print(f"lesson 06 burst: 1 key press, then 12 and 2 dropdown changes in {fired:.2f} s, "
          f"{drawn} pictures drawn, {len(at_once)} pairs at once; max_bs {m0} -> {want[0]}, "
          f"scheme {want[1]}")
    assert tuple(fresh["kernel"]) == want, \
        f"the kernel's panel holds {fresh['kernel']}, the controls show {want}"
    assert state["para"] == fresh["text"], (state["para"], fresh["text"])
    check_shows_fresh_picture(lesson06, state, fresh, "lesson 06's bucket explorer after a burst",
                              "lesson06_bucket_panel_after_burst.png")
    assert not at_once, (f"the bucket explorer drew pictures at the same time (threads, seconds "
                         f"of overlap): {at_once}; two redraws at once through pyplot's global "
                         f"state are what broke its picture (issue 19)")


# --- 2. slides -----------------------------------------------------------------------

class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


def make_has(target: str) -> bool:
    return re.search(rf"^{re.escape(target)}:", (REPO / "Makefile").read_text(), re.M) is not None


@pytest.fixture(scope="module")
def slides(tmp_path_factory):
    """Lesson 01's slides: from ``make slides`` if the Makefile has it, else nbconvert."""
    stem = Path(LESSON).stem
    if make_has("slides"):
        started = time.time()
        run = subprocess.run(["make", "--no-print-directory", "slides"], cwd=REPO,
                             capture_output=True, text=True, timeout=600)
        assert run.returncode == 0, f"make slides failed:\n{run.stdout[-3000:]}{run.stderr[-3000:]}"
        found = sorted(p for p in REPO.glob(f"build/**/{stem}*.html")
                       if p.stat().st_mtime >= started - 1)
        assert found, (f"make slides ran but wrote no build/**/{stem}*.html:\n"
                       f"{run.stdout[-2000:]}")
        how = "make slides"
        page = found[0]
    else:
        out = tmp_path_factory.mktemp("slides")
        run = subprocess.run([str(REPO / ".venv/bin/jupyter"), "nbconvert", "--to", "slides",
                              "--output-dir", str(out), str(REPO / LESSON)],
                             cwd=REPO, capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, f"nbconvert --to slides failed:\n{run.stderr[-3000:]}"
        how = "jupyter nbconvert --to slides (the Makefile has no slides target yet)"
        page = out / f"{stem}.slides.html"
    print(f"\nslides: {how} -> {page}")
    handler = functools.partial(QuietHandler, directory=str(page.parent))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield {"http": f"http://127.0.0.1:{server.server_address[1]}/{page.name}",
               "file": page.as_uri()}
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize("how", ["http", "file"])
def test_slides_show_pictures_and_reveal_starts(slides, browser, how):
    """Served over http://127.0.0.1, and opened as a file (a presenter double-clicks it)."""
    browser.get(slides[how])
    wait_for("the slides page to load", lambda: browser.execute_script(
        "return document.readyState") == "complete", timeout=60)
    imgs = wait_for("the slides' pictures to decode", lambda: (x := browser.execute_script(
        "return [...document.querySelectorAll('img')].map("
        "e => [e.complete, e.naturalWidth, e.src.slice(0, 22)]);"))
        and all(i[0] for i in x) and x, timeout=30)
    stored = [o for c in stored_notebook()["cells"] if c["cell_type"] == "code"
              and c.get("metadata", {}).get("slideshow", {}).get("slide_type") != "skip"
              for o in c.get("outputs", []) if "image/png" in o.get("data", {})]
    assert len(imgs) >= len(stored), \
        f"the slides show {len(imgs)} pictures, the lesson stores {len(stored)} figures"
    broken = [i for i in imgs if i[1] == 0]
    assert not broken, f"{len(broken)} of {len(imgs)} pictures in the slides did not decode"

    # reveal.js: nbconvert's template loads jQuery and require.js, and through require.js
    # reveal.js (an AMD module: no window.Reveal), from the URLs in the page (a CDN unless
    # make slides ships copies); reveal.js marks its root `.reveal.ready` once initialised
    ready_js = "return !!document.querySelector('.reveal.ready .slides section.present')"
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and not browser.execute_script(ready_js):
        time.sleep(0.5)
    ready = browser.execute_script(ready_js)
    if ready:
        # the first slide that shows a picture, through reveal's history hash (#/h/v)
        where = browser.execute_script("""
            const top = [...document.querySelectorAll('.reveal .slides > section')];
            for (let h = 0; h < top.length; h++) {
              const subs = [...top[h].querySelectorAll(':scope > section')];
              const all = subs.length ? subs : [top[h]];
              for (let v = 0; v < all.length; v++)
                if (all[v].querySelector('img')) return subs.length ? [h, v] : [h, 0];
            }
            return null;""")
        assert where, "no slide holds a picture"
        browser.execute_script(f"location.hash = '#/{where[0]}/{where[1]}';")
        shown = wait_for(f"slide {where} with its picture to show", lambda: browser.execute_script(
            "const s = document.querySelector('.reveal .slides section.present:not(.stack)');"
            "const i = s && s.querySelector('img');"
            "const r = i && i.getBoundingClientRect();"
            "return r && r.width > 0 && r.height > 0"
            "       && [Math.round(r.width), Math.round(r.height)];"),
            timeout=10)
        print(f"slides ({how}): reveal.js ready, slide {where} shows a "
              f"{shown[0]}×{shown[1]} picture")
    browser.save_screenshot(str(SHOTS / f"slides_lesson01_{how}.png"))
    if not ready:
        loaded = browser.execute_script(
            "return {jQuery: !!window.jQuery, require: !!window.require}")
        urls = browser.execute_script(
            "return [...document.querySelectorAll('script[src], link[rel=stylesheet]')]"
            ".map(e => e.src || e.href);")
        reveal_js = re.findall(r'"([^"]+/dist/reveal\.js)"', browser.page_source)
        urls += reveal_js
        remote = sorted({u for u in urls if re.match(r"https?://(?!127\.0\.0\.1)", u)})
        pytest.fail(
            "reveal.js did not start in the slides (no `.reveal.ready`), so they show as one "
            f"long page, not slides. Loaded: {loaded}; reveal.js from {reveal_js}. "
            + (f"The page loads these from outside this machine: {remote}; offline (as here) "
               "they cannot load: make slides should ship local copies (reveal.js, require.js, "
               "jQuery) and point nbconvert at them." if remote else
               "Every script is local: look at the browser console."))


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v", "-s"]))
