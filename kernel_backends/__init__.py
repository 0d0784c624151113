"""The kernels: three backends behind one interface (``backend.KernelBackend``), one of
them chosen when the engine is built.

- ``triton``: Triton kernels; the default on CUDA.
- ``cpu``: the C++ CPU kernels, CPU LoRA routes and packed linears; the default on CPU
  where the kernels build.
- ``torch``: plain torch, the oracle every other backend is tested against; the default on
  CPU where the C++ kernels cannot be built (or ``kernel_backends/cpu`` is absent).

``LORAPLEX_KERNELS=triton|torch|cpu`` overrides the choice (tests run the Triton kernels on
CPU with ``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import importlib
import logging
import os

import torch

from .backend import KernelBackend

log = logging.getLogger(__name__)

BACKENDS = ("triton", "cpu", "torch")
_CLASSES = {"triton": ("triton", "TritonBackend"), "cpu": ("cpu", "CPUBackend"),
            "torch": ("torch", "TorchBackend")}


def backend_class(name: str) -> type[KernelBackend]:
    package, cls = _CLASSES[name]
    return getattr(importlib.import_module(f"{__name__}.{package}"), cls)


def backend_name(device: torch.device) -> str:
    """``LORAPLEX_KERNELS`` if set, else triton on CUDA, cpu on CPU where the C++ kernels
    load, torch otherwise."""
    choice = os.environ.get("LORAPLEX_KERNELS", "").lower()
    if choice:
        if choice not in BACKENDS:
            raise ValueError(f"LORAPLEX_KERNELS={choice!r}; allowed: {', '.join(BACKENDS)}, "
                             "or unset")
        return choice
    if device.type == "cuda":
        return "triton"
    if device.type == "cpu" and _cpu_kernels_load():
        return "cpu"
    return "torch"


def _cpu_kernels_load() -> bool:
    try:
        cpu = importlib.import_module(f"{__name__}.cpu")
    except ImportError:
        log.warning("kernel_backends/cpu is not installed: serving with the torch kernels")
        return False
    if not cpu.available():
        log.warning("the C++ CPU kernels could not be built: serving with the torch kernels")
        return False
    return True


def select_backend(device: torch.device, dtype: torch.dtype,
                   name: str | None = None) -> KernelBackend:
    """The backend ``name`` (default: ``backend_name(device)``) for ``device`` and
    ``dtype``."""
    return backend_class(name or backend_name(device))(device, dtype)
