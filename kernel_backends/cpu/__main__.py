"""`make kernels`: build (or find) the C++ CPU kernels and say where they are."""

import logging

from .extension import KernelBuildError, load

logging.basicConfig(level=logging.INFO, format="%(message)s")
try:
    print(f"CPU kernels: {load().__file__}")
except KernelBuildError as exc:  # not fatal: the engine serves with the torch backend
    print(f"CPU kernels: not built ({exc}); the engine will use the torch backend")
