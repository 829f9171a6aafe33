"""The toy transformer block of lessons 04 and 05: it lives in :mod:`labkit.core.models`."""

from labkit.core.models import CallCounter, TransformerBlock, make_blocks

__all__ = ["TransformerBlock", "make_blocks", "CallCounter"]
