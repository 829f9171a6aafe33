"""Guards against the pitfalls of CUDA graphs (lesson 03): check before you replay.

* :mod:`~labkit.guards.graphs`: :class:`GuardedGraph`, a ``StaticGraph`` that checks every
  call against what was captured (:mod:`labkit.core.signature`) before it copies or replays;
* :mod:`~labkit.guards.lint`: :func:`lint_capture`, which runs a function eagerly and reports
  every hazard a capture would hit (the rules in :mod:`labkit.core.rules`);
* :mod:`~labkit.guards.errors`: :class:`expect_error`, :func:`error_lines`,
  :func:`error_text`, for showing errors in a notebook the same way on every backend.
"""

from labkit.core.signature import (  # noqa: F401
    ArgMetadata,
    GraphArgumentError,
    get_mismatch_errors,
    leaf_pairs,
    metadata_tree,
)
from labkit.core.signature import fmt_shape as _fmt_shape  # noqa: F401
from labkit.core.signature import values_equal as _values_equal  # noqa: F401
from labkit.guards.errors import error_lines, error_text, expect_error
from labkit.guards.graphs import GuardedGraph
from labkit.guards.lint import HAZARDS, Finding, LintReport, lint_capture

_leaf_pairs = leaf_pairs

__all__ = [
    "ArgMetadata", "metadata_tree", "get_mismatch_errors", "GraphArgumentError",
    "GuardedGraph", "expect_error", "error_lines", "error_text",
    "lint_capture", "LintReport", "Finding", "HAZARDS",
]
