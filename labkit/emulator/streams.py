"""Streams, events and synchronisation for the emulator.

On a CPU there is one timeline, so a stream here orders nothing: work runs when it is
called. What streams still decide is *capture*: ``capture_begin`` refuses the default
stream, ``is_current_stream_capturing()`` is true only on the capturing stream, and any
synchronisation during capture is an error, exactly as on a GPU.
"""

from __future__ import annotations

import itertools
import time

import torch

from labkit.emulator.state import (  # noqa: F401  (old names)
    CAPTURE_INVALIDATED,
    CAPTURE_UNSUPPORTED,
    active_capture,
    capture_error,
    refuse_device_sync,
    refuse_sync,
    thread_stream,
)

__all__ = ["Stream", "Event", "stream", "set_stream", "current_stream", "default_stream",
           "synchronize",
           "capture_error", "CAPTURE_UNSUPPORTED", "CAPTURE_INVALIDATED"]

_ids = itertools.count()


_tls = thread_stream        # each thread's current stream (held in state)
_ThreadStream = type(thread_stream)


class Stream:
    """A stand-in for ``torch.cuda.Stream``: an identity, and the ordering methods."""

    def __init__(self, device=None, priority: int = 0, **kwargs):
        self.stream_id = next(_ids)
        self.priority = priority

    @property
    def device(self) -> torch.device:
        from labkit.emulator.device import install
        return install()

    def wait_stream(self, other: "Stream") -> None:
        """Later work on this stream waits for the work issued so far on ``other``.

        During a capture that is how a stream joins it (``side.wait_stream(capturing)``,
        a fork) and how its work is joined back (``capturing.wait_stream(side)``).
        """
        check_stream(other, "Stream.wait_stream(other)", allow_none=False)
        cap = active_capture()
        if cap is not None and other in cap.members:
            cap.join(self, other)

    def wait_event(self, event: "Event") -> None:
        """Later work on this stream waits for ``event`` (a fork or join during capture)."""
        if not isinstance(event, Event):
            raise TypeError(f"Stream.wait_event(event) takes an Event, got "
                            f"{type(event).__name__}")
        cap = active_capture()
        if cap is not None and event._captured is not None and event._captured[0] is cap:
            cap.join_deps(self, event._captured[1])

    def record_event(self, event: "Event | None" = None) -> "Event":
        event = event or Event()
        event.record(self)
        return event

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        refuse_sync("Stream.synchronize()")

    def __eq__(self, other):
        return isinstance(other, Stream) and other.stream_id == self.stream_id

    def __hash__(self):
        return hash(("labkit-stream", self.stream_id))

    def __repr__(self):
        kind = "default" if self.stream_id == 0 else "side"
        return f"<emulated Stream id={self.stream_id} ({kind})>"


_DEFAULT = Stream()
_ThreadStream.stream = _DEFAULT


def check_stream(s, where: str, *, allow_none: bool) -> None:
    """A TypeError naming what was passed where a ``B.Stream()`` belongs."""
    if s is None and allow_none:
        return
    if not isinstance(s, Stream):
        none = " (or None)" if allow_none else ""
        raise TypeError(f"{where}: expected a stream made by B.Stream(){none}, got "
                        f"{type(s).__name__} {s!r:.60}. On the emulated backend streams "
                        f"come from B.Stream(), B.current_stream() or B.default_stream().")


def default_stream(device=None) -> Stream:
    return _DEFAULT


def current_stream(device=None) -> Stream:
    return _tls.stream


def set_stream(s: Stream) -> None:
    """Make ``s`` the current stream (like ``torch.cuda.set_stream``)."""
    check_stream(s, "set_stream(s)", allow_none=False)
    _tls.stream = s


class stream:
    """Context manager that makes ``s`` the current stream (``None`` is a no-op)."""

    def __init__(self, s: Stream | None):
        check_stream(s, "stream(s)", allow_none=True)
        self.s = s

    def __enter__(self):
        self.prev = current_stream()
        if self.s is not None:
            _tls.stream = self.s
        return self.s

    def __exit__(self, *exc):
        _tls.stream = self.prev


def synchronize(device=None) -> None:
    """Wait for all work (a no-op on a CPU), but an error during capture, as on a GPU.

    Also from another thread while some thread captures: the device includes the
    capturing stream, so CUDA refuses it and invalidates that capture, in every
    ``capture_error_mode``.
    """
    refuse_device_sync("synchronize()")


class Event:
    """A timing event: ``record()`` notes the host clock, ``elapsed_time`` gives ms.

    On a CPU everything has already run when ``record`` is called, so the host clock
    measures what a CUDA event would.
    """

    def __init__(self, enable_timing: bool = False, blocking: bool = False,
                 interprocess: bool = False):
        self.enable_timing = enable_timing
        self._t: int | None = None
        self._captured = None     # (capture, the work it marks) when recorded in a capture

    def record(self, stream: Stream | None = None) -> None:
        self._t = time.perf_counter_ns()
        s = stream if stream is not None else current_stream()
        cap = active_capture()
        self._captured = (cap, cap.members[s]) if cap is not None and s in cap.members \
            else None

    def wait(self, stream: Stream | None = None) -> None:
        (stream if stream is not None else current_stream()).wait_event(self)

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        refuse_sync("Event.synchronize()")

    def elapsed_time(self, end: "Event") -> float:
        if not isinstance(end, Event):
            raise TypeError(f"elapsed_time(end) takes the Event recorded at the end, got "
                            f"{type(end).__name__}")
        if self._t is None or end._t is None:
            raise RuntimeError("Both events must be recorded before calculating elapsed time.")
        return (end._t - self._t) / 1e6
