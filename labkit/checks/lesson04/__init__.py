"""Checkers for lesson 04 (the fwd/bwd bridge), one module per exercise, each checked
against :mod:`labkit.bridge`:

* :mod:`.connected_params`: ``check_connected_params``, the parameters a backward graph
  computes wgrads for;
* :mod:`.bridge_backward`: ``check_bridge_backward``, the backward half of the bridge;
* :mod:`.graph_stage`: ``check_graph_stage``, the diagnosis of a stage graphed from
  samples that lost ``requires_grad``.

:mod:`._common` compares gradients with eager autograd's. Every trial randomizes what the
exercise leaves free and plants the traps the exercise text warns about. A failure names
the mistake it saw and where to look; ``labkit.checks.hint()`` then gives further hints,
one at a time.
"""

from labkit.checks.lesson04.bridge_backward import check_bridge_backward
from labkit.checks.lesson04.connected_params import check_connected_params
from labkit.checks.lesson04.graph_stage import check_graph_stage

__all__ = ["check_connected_params", "check_bridge_backward", "check_graph_stage"]
