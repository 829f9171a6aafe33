"""The shared layer under the lesson modules.

What several lessons use lives here, once: argument metadata and its errors
(:mod:`~labkit.core.signature`), the rules of capture that the emulator and the linter
both read (:mod:`~labkit.core.rules`), timing and trace reading
(:mod:`~labkit.core.timing`), the toy models (:mod:`~labkit.core.models`), Megatron-style
``main_grad`` helpers (:mod:`~labkit.core.main_grad`), error chains and whose code
raised (:mod:`~labkit.core.errors`) and argument checks (:mod:`~labkit.core.validate`).

A module here imports torch and the standard library, and from labkit only other
modules of this package: everything else in labkit sits above it
(``tests/test_layers.py`` holds the order).
"""
