"""Assertions several test modules share (importable: pytest puts tests/ on sys.path)."""

import torch

from labkit.capture import capture


def assert_usable(B, stream_before=None):
    """After a failed capture the process is usable: the stream that was current
    (``stream_before``; default: the default stream) is current again, nothing is capturing,
    and a new capture, its replay and a random op outside any capture all work."""
    assert B.current_stream() == (stream_before if stream_before is not None
                                  else B.default_stream())
    assert not B.is_current_stream_capturing()
    x = torch.ones(4, device=B.device)
    g, y = capture(lambda t: t * 3, x, B=B, warmup=1)
    x.fill_(2.0)
    g.replay()
    B.synchronize()
    assert y.tolist() == [6.0] * 4
    torch.rand(2, device=B.device)           # raises if the generator is left in capture mode
