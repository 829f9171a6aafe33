"""What the live panels of lessons 01 and 06 share: a picture that ipywidgets redraws.

A panel is displayed as one bundle that carries both its widget view and a static view
(a PNG, maybe an HTML table). Jupyter with ipywidgets renders the widget; nbconvert HTML,
GitHub, a terminal, or ``LABKIT_WIDGETS=0`` fall back to the picture, so a notebook never
depends on widgets to show something (nor under nbval).

The picture in a widget is shown at its own size, never stretched: an ``ipywidgets.Image``
in a ``VBox`` is stretched to the box's full width by default (flexbox), so an 800 px
figure showed blurred at the cell's ~1150 px. :func:`image_widget` pins the image to its
pixel width (shrinking with ``max-width: 100%`` in a narrower cell) and :func:`column`
stacks widgets without stretching them.

A panel redraws from whatever thread delivers a control's change. With ipykernel 7 and
JupyterLab 4.6 that is not always the main thread: comm messages go to a subshell, and a
comm's messages go to the thread that last published on it, so right after Run All one
control's change runs on the main thread while another's runs on the subshell's (issue 19:
a burst of input left lesson 06's picture broken). Panels therefore draw each picture on a
figure of their own, outside pyplot (:func:`new_figure`), render it under one lock
(:func:`draw_png`), and let :class:`Redraw` run one redraw at a time, a burst coalesced to
the controls' latest values.
"""

from __future__ import annotations

import io
import os
import struct
import threading

FIGURE_DPI = 100  # a 9-inch figure is 900 px: fits a JupyterLab cell (about 1000 px and up)
MAX_FIGURE_INCHES = 9.0  # the widest figure labkit draws for a notebook (900 px at FIGURE_DPI)

# Every panel picture is built and rendered holding this lock: matplotlib is not thread-safe
# (shared font and text caches), and redraws may arrive on two threads (see above).
_DRAW_LOCK = threading.RLock()

# What LABKIT_WIDGETS may say (case-insensitive); anything else is refused, not guessed.
_ENV_ON = ("1", "true", "yes", "on", "")
_ENV_OFF = ("0", "false", "no", "off")


def _check_png(png) -> bytes:
    # ipywidgets.Image.value comes back as a memoryview
    if not isinstance(png, (bytes, bytearray, memoryview)):
        raise TypeError(f"expected PNG bytes (from figure_png), got {type(png).__name__}; "
                        "pass figure_png(fig), not the figure or a file name")
    return bytes(png)


def _check_widget(obj, what: str, needs: str = "layout"):
    if not hasattr(obj, needs):
        raise TypeError(f"{what} must be an ipywidgets widget, got {type(obj).__name__}"
                        + ("; make it with image_widget(png)" if what == "image" else ""))
    return obj


def widgets_wanted(widgets: bool | None) -> bool:
    """``widgets`` if given, else whether ``LABKIT_WIDGETS`` allows them (default: yes).

    ``LABKIT_WIDGETS`` takes a fixed set (any case): ``1/true/yes/on`` or empty turn
    widgets on, ``0/false/no/off`` turn them off.

    .. warning::
        Any other value raises ValueError instead of being read as "on": a typo such as
        ``LABKIT_WIDGETS=of`` would otherwise silently keep widgets in a notebook that
        was meant to render static pictures.
    """
    if widgets is not None:
        if not isinstance(widgets, bool):
            raise TypeError(f"widgets must be True, False or None (follow LABKIT_WIDGETS), "
                            f"got {widgets!r}")
        return widgets
    value = os.environ.get("LABKIT_WIDGETS", "1").strip().lower()
    if value in _ENV_ON:
        return True
    if value in _ENV_OFF:
        return False
    raise ValueError(f"LABKIT_WIDGETS={value!r} is not understood; set it to one of "
                     f"{', '.join(repr(v) for v in _ENV_ON[:-1] + _ENV_OFF)} "
                     "(0/false/no/off turn widgets off)")


def new_figure(figsize: tuple[float, float]):
    """A matplotlib ``Figure`` on its own Agg canvas, outside pyplot.

    No pyplot state is touched (no figure number, no current figure, nothing the inline
    backend shows or closes after a cell), so two threads can each build one. Draw on it
    with ``fig.subplots(...)`` and render it with :func:`figure_png`.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    w, h = figsize
    if not (0 < w <= MAX_FIGURE_INCHES and 0 < h):
        raise ValueError(f"figsize must be (width, height) in inches with 0 < width <= "
                         f"{MAX_FIGURE_INCHES} (the notebook's width), got {figsize!r}")
    fig = Figure(figsize=(w, h))
    FigureCanvasAgg(fig)
    return fig


def figure_png(fig) -> bytes:
    """The PNG bytes of a matplotlib figure; a pyplot figure is then closed (it is shown as
    an image), a :func:`new_figure` one is simply dropped."""
    if not hasattr(fig, "savefig"):
        raise TypeError(f"figure_png needs a matplotlib Figure, got {type(fig).__name__}; "
                        "for an Axes pass ax.figure")
    buf = io.BytesIO()
    with _DRAW_LOCK:
        fig.savefig(buf, format="png", dpi=FIGURE_DPI)
    if getattr(fig.canvas, "manager", None) is not None:  # made through pyplot
        import matplotlib.pyplot as plt

        plt.close(fig)
    return buf.getvalue()


def draw_png(make_figure) -> bytes:
    """``figure_png(make_figure())``, building and rendering under the lock all panels share.

    ``make_figure`` should draw on a :func:`new_figure`, never through pyplot.
    """
    if not callable(make_figure):
        raise TypeError(f"draw_png takes a function that returns a Figure (such as "
                        f"panel.figure), got {type(make_figure).__name__}")
    with _DRAW_LOCK:
        return figure_png(make_figure())


class Redraw:
    """Call ``draw()`` for each change of a panel's controls, one call at a time.

    Use an instance as the controls' observer. ``draw`` must read the controls' values when
    it runs. A call that arrives while another thread is drawing returns at once, and the
    drawing thread draws again when it is done: a burst of changes ends with one drawing of
    the latest values, and no two drawings of one panel ever overlap.
    """

    def __init__(self, draw):
        if not callable(draw):
            raise TypeError(f"Redraw takes the function that redraws, got {type(draw).__name__}")
        self._draw = draw
        self._drawing = threading.Lock()   # held by the one thread drawing now
        self._state = threading.Lock()     # guards _pending
        self._pending = False

    def __call__(self, _change=None) -> None:
        with self._state:
            self._pending = True
        while True:
            # read after the drawing thread let go: a change that came meanwhile is seen
            with self._state:
                if not self._pending:
                    return
            if not self._drawing.acquire(blocking=False):
                return  # the thread drawing now sees _pending and draws again
            try:
                with self._state:
                    if not self._pending:
                        continue
                    self._pending = False
                self._draw()
            finally:
                self._drawing.release()


class ImagePanel:
    """What every labkit panel shares: controls over a picture and an HTML label.

    A subclass draws :meth:`figure` on a :func:`new_figure`, writes :meth:`_label_html`,
    names the attributes its controls set in ``_SETTINGS`` and reads the controls in
    :meth:`_control_values` (same order). Its ``_build`` calls :meth:`_live` with the
    controls, which makes ``_image`` and ``_label`` and redraws them through one
    :class:`Redraw`: one drawing at a time, a burst ending on the controls' latest values.
    """

    _SETTINGS: tuple[str, ...] = ()

    def figure(self):
        raise NotImplementedError

    def _label_html(self) -> str:
        raise NotImplementedError

    def _control_values(self) -> tuple:
        raise NotImplementedError

    def png(self) -> bytes:
        """The current settings' picture as PNG bytes."""
        return draw_png(self.figure)

    def _live(self, controls) -> None:
        """Make ``_image`` and ``_label`` and redraw them on every change of ``controls``."""
        import ipywidgets as w

        self._image = image_widget(self.png())  # at its own size, not stretched
        self._label = w.HTML(self._label_html())
        self._redraw = Redraw(self._draw_latest)
        for c in controls:
            c.observe(self._redraw, names="value")

    def _draw_latest(self) -> None:
        """Show the controls' values now (run by :class:`Redraw`)."""
        new = tuple(self._control_values())
        if new == tuple(getattr(self, name) for name in self._SETTINGS):
            return
        for name, value in zip(self._SETTINGS, new):
            setattr(self, name, value)
        png, label = self.png(), self._label_html()
        set_image(self._image, png)
        self._label.value = label


def png_size(png: bytes) -> tuple[int, int]:
    """(width, height) in pixels of PNG bytes, read from the IHDR chunk.

    Raises ValueError when ``png`` does not start with the PNG signature.
    """
    png = _check_png(png)
    if len(png) < 24 or png[:8] != b"\x89PNG\r\n\x1a\n":
        raise ValueError(f"expected PNG bytes (from figure_png), got {len(png)} bytes "
                         f"starting {png[:8]!r}")
    return struct.unpack(">II", png[16:24])


def image_widget(png: bytes):
    """An ``ipywidgets.Image`` of ``png`` shown at its own pixel width, at most the cell's.

    .. warning::
        Put it in :func:`column`, not a bare ``VBox``: a ``VBox`` stretches its children
        to its full width, which scales the picture up (blurred) past its pixel size.
    """
    import ipywidgets as w

    width, _ = png_size(png)
    # margin 0: ipywidgets' 2 px margins on top of max-width 100% made the panel scroll sideways
    return w.Image(value=png, format="png",
                   layout=w.Layout(width=f"{width}px", max_width="100%", height="auto",
                                   margin="0"))


def set_image(image, png: bytes) -> None:
    """Show new ``png`` bytes in an :func:`image_widget`, keeping it at its own size."""
    _check_widget(image, "image")
    width = png_size(png)[0]
    image.value = png
    image.layout.width = f"{width}px"


def column(children):
    """A ``VBox`` of ``children`` that keeps each at its own width (no stretching)."""
    import ipywidgets as w

    if isinstance(children, w.Widget) or not isinstance(children, (list, tuple)):
        raise TypeError(f"column takes a list of widgets, got {type(children).__name__}; "
                        "wrap a single widget as [widget]")
    bad = [c for c in children if not isinstance(c, w.Widget)]
    if bad:
        raise TypeError(f"column takes ipywidgets widgets only, got {type(bad[0]).__name__}; "
                        "show a picture with image_widget(png)")
    return w.VBox(children, layout=w.Layout(align_items="flex-start", width="100%"))


def mimebundle(static: dict, widget) -> dict:
    """``static`` plus the widget's own views (its ``text/plain`` left out), if any."""
    if not isinstance(static, dict):
        raise TypeError(f"static must be a dict of MIME type to data, such as "
                        f"{{'text/plain': ...}}, got {type(static).__name__}")
    bundle = dict(static)
    if widget is not None and hasattr(widget, "_repr_mimebundle_"):
        wb = widget._repr_mimebundle_() or {}
        bundle.update({k: v for k, v in wb.items() if k != "text/plain"})
    return bundle
