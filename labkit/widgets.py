"""What the live panels of lessons 01 and 06 share: a picture that ipywidgets redraws.

A panel is displayed as one bundle that carries both its widget view and a static view
(a PNG, maybe an HTML table). Jupyter with ipywidgets renders the widget; nbconvert HTML,
GitHub, a terminal, or ``LABKIT_WIDGETS=0`` fall back to the picture, so a notebook never
depends on widgets to show something (nor under nbval).
"""

from __future__ import annotations

import io
import os


def widgets_wanted(widgets: bool | None) -> bool:
    """``widgets`` if given, else whether ``LABKIT_WIDGETS`` allows them (default: yes)."""
    if widgets is not None:
        return widgets
    return os.environ.get("LABKIT_WIDGETS", "1") not in ("0", "false", "no")


def figure_png(fig) -> bytes:
    """The PNG bytes of a matplotlib figure, which is then closed (it is shown as an image)."""
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=80)
    plt.close(fig)
    return buf.getvalue()


def mimebundle(static: dict, widget) -> dict:
    """``static`` plus the widget's own views (its ``text/plain`` left out), if any."""
    bundle = dict(static)
    if widget is not None and hasattr(widget, "_repr_mimebundle_"):
        wb = widget._repr_mimebundle_() or {}
        bundle.update({k: v for k, v in wb.items() if k != "text/plain"})
    return bundle
