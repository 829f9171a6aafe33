"""Which capture is underway on this thread, and the errors CUDA raises about capture.

The bottom of the emulator: the recorder sets the active capture, the streams refuse a
synchronisation while there is one, and both raise CUDA's errors, made here.

A capture watches its own thread, with one exception that does not depend on the
capture's ``capture_error_mode``: a device-wide ``synchronize()`` from *another* thread
waits for the capturing stream too. On an H200 (torch 2.11) it raised "operation not
permitted when stream is capturing" in the calling thread and invalidated the capture, in
the "global", "thread_local" and "relaxed" modes alike (:func:`refuse_device_sync`).
"""

from __future__ import annotations

import threading

import torch

__all__ = ["active_capture", "set_active_capture", "captures_underway", "capture_error",
           "refuse_sync", "refuse_device_sync", "refuse_read_during_capture",
           "CAPTURE_UNSUPPORTED", "CAPTURE_INVALIDATED", "CAPTURE_UNJOINED"]

_CUDA_TAIL = (
    "\nSearch for `{code}' in https://docs.nvidia.com/cuda/cuda-runtime-api/"
    "group__CUDART__TYPES.html for more information.\n"
    "CUDA kernel errors might be asynchronously reported at some other API call, so the "
    "stacktrace below might be incorrect.\n"
)
DEVICE_TYPE = "emu"      # the emulated device's type: torch.device("emu", 0)


class _ThreadStream(threading.local):
    """Each thread's current stream; the class attribute is every thread's default (so
    reading it never raises AttributeError inside getattr: this is read on every op).
    :mod:`~labkit.emulator.streams` sets the default and changes it; it lives here so that
    modules below the streams (the allocator) can read it."""

    stream = None


thread_stream = _ThreadStream()

CAPTURE_UNSUPPORTED = "CUDA error: operation not permitted when stream is capturing"
CAPTURE_INVALIDATED = "CUDA error: operation failed due to a previous error during capture"
CAPTURE_UNJOINED = "CUDA error: capturing stream has unjoined work"

_Accel = getattr(torch, "AcceleratorError", RuntimeError)


class _ThreadCapture(threading.local):
    capture = None          # a class default: reading it never raises inside getattr


_state = _ThreadCapture()
_lock = threading.Lock()
_underway: dict[int, object] = {}      # thread id -> its capture, for every thread


def active_capture():
    """The capture underway on this thread (a ``recorder.Capture``), or None."""
    return _state.capture


def set_active_capture(capture) -> None:
    """Make ``capture`` (or None) the one underway on this thread."""
    _state.capture = capture
    with _lock:
        if capture is None:
            _underway.pop(threading.get_ident(), None)
        else:
            _underway[threading.get_ident()] = capture


def captures_underway() -> list:
    """Every capture underway in the process, on any thread."""
    if not _underway:               # the common case, without the lock
        return []
    with _lock:
        return list(_underway.values())


def capture_error(message: str, code: str, why: str = "") -> RuntimeError:
    """The error CUDA raises (same class and first line), plus a line saying why.

    Args:
        message: CUDA's first line, e.g. :data:`CAPTURE_UNSUPPORTED`.
        code: the ``cudaError`` name CUDA's message points to.
        why: the emulator's explanation, on a line tagged ``[labkit emulator]``.
    """
    text = message + _CUDA_TAIL.format(code=code)
    if why:
        text += f"[labkit emulator] {why}\n"
    try:
        return _Accel(text)
    except TypeError:   # AcceleratorError may not be constructible from Python
        return RuntimeError(text)


def refuse_sync(what: str) -> None:
    """Raise CUDA's error (and invalidate the capture) if ``what`` syncs during capture."""
    cap = active_capture()
    if cap is not None:
        cap.invalidate()
        raise capture_error(
            CAPTURE_UNSUPPORTED, "cudaErrorStreamCaptureUnsupported",
            f"{what} waits for the GPU to finish, but during capture nothing runs: "
            "move it out of the captured region.",
        )


def refuse_read_during_capture(what: str) -> None:
    """Reading a device tensor's values on the host (printing it) while this thread captures."""
    cap = active_capture()
    if cap is not None and cap.records_now():
        cap.invalidate(what)
        raise capture_error(
            CAPTURE_UNSUPPORTED, "cudaErrorStreamCaptureUnsupported",
            f"{what} reads its values on the host, so the CPU waits for the GPU; nothing "
            "inside a captured region may wait for the GPU.")


def refuse_device_sync(what: str) -> None:
    """A device-wide synchronisation: refused during a capture on *any* thread.

    On this thread it is :func:`refuse_sync`. From another thread, CUDA refuses it as
    well (the device includes the capturing stream) and invalidates that capture,
    whatever its ``capture_error_mode``: observed on an H200 with torch 2.11.
    """
    refuse_sync(what)
    others = captures_underway()
    if others:
        for cap in others:
            cap.invalidate(f"{what} on another thread")
        raise capture_error(
            CAPTURE_UNSUPPORTED, "cudaErrorStreamCaptureUnsupported",
            f"{what} waits for the whole device, and another thread is capturing on it: "
            "in every capture_error_mode this is refused and that capture invalidated.",
        )
