"""How ``labkit.bench`` times things: :mod:`labkit.core.timing` (the suites import it
there; this module keeps the names lesson 07 imports).

A row's ``median_us`` is :func:`measure_us` (``B.Event`` pairs on the device's clock, warm-up
first, synchronized before each sample, the median of many); its ``gpu_busy_us`` is
:func:`profile_gpu_busy_us` (the time ``torch.profiler`` saw kernels, copies and fills run
during one call). On the emulated backend the timer reads the host clock and
``profile_gpu_busy_us`` returns None: that is only for tests of the benchmark code itself;
no emulated number is a GPU result.
"""

from labkit.core.timing import (
                                 GPU_EVENT_CATEGORIES,
                                 device_name,
                                 measure_us,
                                 profile_gpu_busy_us,
                                 time_call,
)

__all__ = ["measure_us", "time_call", "profile_gpu_busy_us", "device_name",
           "GPU_EVENT_CATEGORIES"]
