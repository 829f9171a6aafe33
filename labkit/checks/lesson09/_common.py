"""What lesson 09's checkers share."""

from __future__ import annotations

from labkit.checks import short_description  # noqa: F401  (lesson 09's checkers use it)
from labkit.checks.budget import one_thread  # noqa: F401  (likewise)
from labkit.checks.host_reads import HostReads  # noqa: F401  (likewise)
