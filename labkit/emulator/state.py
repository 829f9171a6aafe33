"""Which capture is underway on this thread, and the errors CUDA raises about capture.

The bottom of the emulator: the recorder sets the active capture, the streams refuse a
synchronisation while there is one, and both raise CUDA's errors, made here.
"""

from __future__ import annotations

import threading

import torch

__all__ = ["active_capture", "set_active_capture", "capture_error", "refuse_sync",
           "CAPTURE_UNSUPPORTED", "CAPTURE_INVALIDATED"]

_CUDA_TAIL = (
    "\nSearch for `{code}' in https://docs.nvidia.com/cuda/cuda-runtime-api/"
    "group__CUDART__TYPES.html for more information.\n"
    "CUDA kernel errors might be asynchronously reported at some other API call, so the "
    "stacktrace below might be incorrect.\n"
)
CAPTURE_UNSUPPORTED = "CUDA error: operation not permitted when stream is capturing"
CAPTURE_INVALIDATED = "CUDA error: operation failed due to a previous error during capture"

_Accel = getattr(torch, "AcceleratorError", RuntimeError)

_state = threading.local()


def active_capture():
    """The capture underway on this thread (a ``recorder.Capture``), or None."""
    return getattr(_state, "capture", None)


def set_active_capture(capture) -> None:
    """Make ``capture`` (or None) the one underway on this thread."""
    _state.capture = capture


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
