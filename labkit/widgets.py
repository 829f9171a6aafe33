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
"""

from __future__ import annotations

import io
import os
import struct

FIGURE_DPI = 100  # a 10-inch figure is 1000 px: about a JupyterLab cell's width

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


def figure_png(fig) -> bytes:
    """The PNG bytes of a matplotlib figure, which is then closed (it is shown as an image)."""
    import matplotlib.pyplot as plt

    if not hasattr(fig, "savefig"):
        raise TypeError(f"figure_png needs a matplotlib Figure, got {type(fig).__name__}; "
                        "for an Axes pass ax.figure")
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=FIGURE_DPI)
    plt.close(fig)
    return buf.getvalue()


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
