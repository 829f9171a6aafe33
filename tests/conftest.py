"""Shared fixtures: ``B`` runs a test once per backend.

The emulated backend always runs; the cuda one runs where a GPU is present (marker
``cuda``) and is skipped elsewhere, so the same assertions check the emulator against the
real thing on a GPU machine (``pytest -m cuda``).
"""

import os

import pytest
import torch

from labkit import backend

BACKENDS = [
    pytest.param("emulated", id="emulated"),
    pytest.param("cuda", id="cuda", marks=[
        pytest.mark.cuda,
        pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    ]),
]


@pytest.fixture(params=BACKENDS)
def B(request):
    b = backend.get(request.param)
    b.set_stream(b.default_stream())
    yield b
    # a capture that failed leaves its stream current and the default generator in
    # capture mode (as torch.cuda does): put both back for the next test
    backend.recover(b)


@pytest.fixture
def E():
    """The emulated backend alone, for emulator-only details."""
    b = backend.get("emulated")
    b.set_stream(b.default_stream())
    yield b
    backend.recover(b)


@pytest.fixture
def one_thread():
    """Tiny tensors: one intra-op thread is several times faster than two on a CPU."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# tests/browser/ drives headless Chromium through `make lab` and the slides (about a minute,
# needs the system's chromium): `make test-browser` runs it, with LABKIT_BROWSER_TESTS=1
collect_ignore = [] if os.environ.get("LABKIT_BROWSER_TESTS") == "1" else ["browser"]
