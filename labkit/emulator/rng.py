"""Random numbers on the emulated device: its generators and its seed.

The device's kernels run on host data and draw from host generators, so its random
numbers are the host's. Two things still follow CUDA: a generator for the device is made
with ``B.Generator(device=B.device)`` (:func:`generator`), and a seed set during a capture
is checked as ``CUDAGeneratorImpl::set_current_seed`` checks it (:func:`set_device_seed`).
"""

from __future__ import annotations

import torch

from labkit.emulator.state import active_capture

__all__ = ["generator", "set_device_seed", "SEED_DURING_CAPTURE"]


def generator(device=None) -> torch.Generator:
    """``B.Generator(device=B.device)`` on the emulator: a host generator.

    The device's kernels run on host data and draw from host generators, so a generator
    for ``emu`` random ops is a ``torch.Generator()``: seed it, pass it as
    ``generator=``, register it with ``g.register_generator_state`` as on a GPU. Any other
    ``device`` gives what ``torch.Generator(device=...)`` gives.

    .. warning::
        ``torch.Generator(device=B.device)`` itself raises NotImplementedError on the
        emulator, and no Python code can change that. ``THPGenerator_pynew`` asks the
        device's ``PrivateUse1HooksInterface::getNewGenerator`` for a non-CPU device, and
        the hooks a Python backend registers (``torch._C._acc.PrivateUse1Hooks``,
        ``PythonHooks`` in ``torch/csrc/acc/Module.cpp``) forward only
        ``is_available``, ``is_built`` and ``has_primary_context`` to Python: their
        ``getNewGenerator`` and ``getDefaultGenerator`` call the base class, which raises
        ("not supported from python yet", says the source). A device generator needs a
        C++ ``GeneratorImpl`` registered from C++. Write ``B.Generator(...)``.
    """
    from labkit.emulator.state import DEVICE_TYPE
    if device is not None:
        d = torch.device(device)
        if d.type != DEVICE_TYPE:
            return torch.Generator(device=d)
    return torch.Generator()


#: The seed of the device's generator as CUDA would hold it (None: never set, which on a
#: GPU means a seed drawn at random), kept apart from the host generator's own seed
_device_seed: list = [None]

SEED_DURING_CAPTURE = ("CUDAGeneratorImpl::set_current_seed can be called during stream "
                       "capture only if new seed is the same as the original seed.")


def set_device_seed(seed: int) -> None:
    """``CUDAGeneratorImpl::set_current_seed`` (torch 2.10 and later): during a capture on
    the current stream only the seed the generator already has is accepted (a no-op);
    another seed raises, without invalidating the capture."""
    seed = int(seed) & 0xFFFF_FFFF_FFFF_FFFF
    cap = active_capture()
    if cap is not None and cap.records_now():
        if seed != _device_seed[0]:
            raise RuntimeError(
                SEED_DURING_CAPTURE + f"\n[labkit emulator] the seed is {_device_seed[0]}, "
                f"and {seed} was asked for during a capture: seed before the capture (a "
                "graph replays its random ops from the generator's state at each replay).")
        return
    _device_seed[0] = seed
