"""GPU presets and the roofline model that turns a kernel's work into its duration."""

from __future__ import annotations

import math
import re
import warnings
from dataclasses import dataclass

import torch

from labkit.core.validate import check_int
from labkit.timeline.model import _check_dtype, _check_us

__all__ = ["GPUPreset", "UnknownPresetError", "GPU_PRESETS", "REFERENCE_H200", "get_preset",
           "preset_for", "roofline_kernel_us", "add_chain_cost"]

# The lesson's reference measurement (lead's run, torch 2.11, one H200, 100 tiny adds).
REFERENCE_H200 = {
    "device": "NVIDIA H200", "torch": "2.11", "n_ops": 100,
    "eager_us_per_kernel": 10.5, "graph_us_per_kernel": 1.1, "speedup": 9.5,
}


class UnknownPresetError(KeyError, ValueError):
    """An unknown GPU preset name (a KeyError for old callers, a ValueError by kind)."""

    def __str__(self):
        return str(self.args[0]) if self.args else ""


@dataclass(frozen=True)
class GPUPreset:
    """What a roofline needs to know about a GPU.

    Args:
        name: how lessons and plot titles call it ("H200").
        fp16_tflops: dense tensor-core peak, without sparsity (what matmuls can reach).
        fp32_tflops: CUDA-core peak (what element-wise fp32 kernels use).
        hbm_gbps: memory bandwidth.
        kernel_floor_us: the shortest time any kernel takes (block scheduling, the tail of
            the launch on the device).
        kernel_gap_us: the device's gap between two consecutive kernels of one stream.
        memory: the memory, for display.

    .. warning::
        The peaks come from vendor datasheets; ``kernel_floor_us`` and ``kernel_gap_us``
        do not. They are rough, chosen so that a simulated graphed chain on the H200
        matches :data:`REFERENCE_H200` (``tests/test_timeline.py`` checks it), and they
        move every kernel's time in a simulation: a picture built from them is a model.
    """

    name: str
    fp16_tflops: float
    fp32_tflops: float
    hbm_gbps: float
    kernel_floor_us: float
    kernel_gap_us: float = 0.1
    memory: str = ""

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name:
            raise TypeError(f"GPUPreset.name must be a non-empty str, got {self.name!r}")
        for f in ("fp16_tflops", "fp32_tflops", "hbm_gbps"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, (int, float)) \
                    or not (math.isfinite(v) and v > 0):
                raise ValueError(f"GPUPreset.{f} must be a finite number > 0 (a datasheet "
                                 f"peak), got {v!r}")
        _check_us("GPUPreset.kernel_floor_us", self.kernel_floor_us)
        _check_us("GPUPreset.kernel_gap_us", self.kernel_gap_us)

    def peak_flops(self, dtype: str = "fp32") -> float:
        if dtype in ("fp16", "bf16", "half", "float16", "bfloat16"):
            return self.fp16_tflops * 1e12
        if dtype in ("fp32", "float", "float32"):
            return self.fp32_tflops * 1e12
        raise ValueError(f"dtype must be one of 'fp16', 'bf16', 'half', 'float16', 'bfloat16', "
                         f"'fp32', 'float', 'float32', not {dtype!r}")


GPU_PRESETS: dict[str, GPUPreset] = {
    p.name: p for p in (
        GPUPreset("H200", fp16_tflops=989, fp32_tflops=67, hbm_gbps=4800,
                  kernel_floor_us=0.9, memory="141 GB HBM3e (SXM)"),
        GPUPreset("H100", fp16_tflops=989, fp32_tflops=67, hbm_gbps=3350,
                  kernel_floor_us=0.9, memory="80 GB HBM3 (SXM)"),
        GPUPreset("A100", fp16_tflops=312, fp32_tflops=19.5, hbm_gbps=2039,
                  kernel_floor_us=1.5, memory="80 GB HBM2e (SXM)"),
        GPUPreset("L4", fp16_tflops=121, fp32_tflops=30.3, hbm_gbps=300,
                  kernel_floor_us=2.0, memory="24 GB GDDR6"),
        GPUPreset("T4", fp16_tflops=65, fp32_tflops=8.1, hbm_gbps=320,
                  kernel_floor_us=2.5, memory="16 GB GDDR6"),
    )
}


def get_preset(preset: str | GPUPreset) -> GPUPreset:
    """A preset by name (case-insensitive), or the preset itself.

    Raises:
        UnknownPresetError: an unknown name (a ValueError, and a KeyError for callers
            written against older labkit), listing the names of :data:`GPU_PRESETS`.
    """
    if isinstance(preset, GPUPreset):
        return preset
    if not isinstance(preset, str):
        raise TypeError(f"preset must be a preset name or a GPUPreset, got "
                        f"{type(preset).__name__}; choose one of {', '.join(GPU_PRESETS)}")
    for name, p in GPU_PRESETS.items():
        if name.lower() == preset.lower():
            return p
    raise UnknownPresetError(f"no GPU preset {preset!r}; choose one of {', '.join(GPU_PRESETS)}")


# A name that says it is no GPU: labkit's emulator label ("CPU (emulated CUDA graphs)").
_CPU_NAME = re.compile(r"(?<![A-Za-z0-9])cpu(?![A-Za-z0-9])|emulat", re.I)


def preset_for(device_name: str, default: str = "H200") -> GPUPreset:
    """The preset whose name appears in a device name ("NVIDIA A100-SXM4-80GB" → A100),
    else ``default``: a simulation next to a measurement should model the same GPU.

    Any other name (a GPU without a preset, whatever its vendor prefix: "NVIDIA B200",
    "H800", "Graphics Device") gets ``default`` with a warning that names it, the preset
    chosen and why; only a name that says CPU (labkit's emulator label, "CPU (emulated CUDA
    graphs)": no GPU to model) gets ``default`` silently.
    """
    if not isinstance(device_name, str):
        raise TypeError(f"device_name must be a str such as 'NVIDIA H200', got {device_name!r}")
    if not device_name.strip():
        raise ValueError("preset_for: device_name is empty: pass the GPU's name "
                         "(torch.cuda.get_device_name()) or labkit.core.timing.device_name(B)")
    chosen = get_preset(default)  # an unknown default fails here, naming the presets
    for name, p in GPU_PRESETS.items():
        if re.search(rf"(?<![A-Za-z0-9]){name}(?![0-9])", device_name, re.IGNORECASE):
            return p
    if not _CPU_NAME.search(device_name):
        warnings.warn(
            f"preset_for: no GPU preset matches {device_name!r} (presets: "
            f"{', '.join(GPU_PRESETS)}), so simulations model the {chosen.name} "
            f"(default={default!r}) instead of this GPU. Pass default= to pick the closest "
            f"preset, or add a GPUPreset for it to labkit.timeline.GPU_PRESETS.",
            stacklevel=2)
    return chosen


def roofline_kernel_us(flops: float, bytes: float, preset: str | GPUPreset = "H200",
                       dtype: str = "fp32") -> float:
    """How long one kernel takes on ``preset``, by the roofline model, in µs.

    ``max(kernel_floor_us, flops / peak, bytes / bandwidth)``.

    Args:
        flops: the kernel's arithmetic.
        bytes: what it reads and writes in memory (:func:`add_chain_cost` gives both for
            the lesson's chain).
        preset: a name from :data:`GPU_PRESETS` or a :class:`GPUPreset`.
        dtype: ``"fp32"`` (CUDA-core peak) or ``"fp16"``/``"bf16"`` (tensor-core peak).

    .. warning::
        Peaks are never reached, so this is a lower bound on a kernel's time. That makes
        the launch cost look as large as the hardware allows, never larger.
    """
    p = get_preset(preset)
    flops, bytes = _check_amount("flops", flops), _check_amount("bytes", bytes)
    compute_us = flops / p.peak_flops(dtype) * 1e6
    memory_us = bytes / (p.hbm_gbps * 1e9) * 1e6
    return max(p.kernel_floor_us, compute_us, memory_us)


def add_chain_cost(numel: int, dtype: torch.dtype = torch.float32) -> tuple[float, float]:
    """(flops, bytes) of one ``y = y + 1`` kernel on ``numel`` elements: read y, write y'."""
    check_int("numel", numel, 0)
    itemsize = _check_dtype(dtype).itemsize   # no tensor: nothing on any device
    return float(numel), float(2 * numel * itemsize)


def _check_amount(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {value!r} ({type(value).__name__})")
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"{name} must be a finite number >= 0, got {value}; "
                         "add_chain_cost(numel) gives both for the lesson's chain")
    return float(value)
