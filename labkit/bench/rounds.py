"""Interleaved rounds and the verdict rule. Their home is :mod:`labkit.core.rounds`, below
every lesson package, so that ``labkit.speculative`` times its ways with them too; the
bench suites import them from here."""

from labkit.core.rounds import *  # noqa: F401,F403
from labkit.core.rounds import __all__  # noqa: F401
