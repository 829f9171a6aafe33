"""Checkers for lesson 09 (piecewise CUDA graphs, speculative decoding), one module per
exercise.

    from labkit.checks.lesson09 import (check_split_labels, check_replay_piece,
                                        check_greedy_accept, check_capture_batch)
"""

from labkit.checks.lesson09.capture_batch import check_capture_batch, show_symptom
from labkit.checks.lesson09.greedy_accept import check_greedy_accept
from labkit.checks.lesson09.replay_piece import check_replay_piece
from labkit.checks.lesson09.split_labels import check_split_labels

__all__ = ["check_split_labels", "check_replay_piece", "check_greedy_accept",
           "check_capture_batch", "show_symptom"]
