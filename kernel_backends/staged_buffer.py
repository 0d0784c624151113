"""StagedBuffer: one fixed-size integer tensor of the step metadata on the device, and its
host twin that the step is written into (vLLM's ``CpuGpuBuffer``).

Both are allocated once, when the engine starts, and never again: the kernels read views
``device[:n]`` of the same storage every step (fixed addresses, which CUDA graphs need).
The host writes through ``np``, a numpy view of the host tensor (a list assigned into it
costs one C loop, no tensor made); ``upload(n)`` copies the first n rows up. On the CPU
the host twin *is* the device tensor and uploads copy nothing.

On CUDA the host twin is pinned and the copy is asynchronous. Invariant: the host is
written again only after the previous step's copies ran, which holds because every step
ends by reading its sampled tokens on the host (a sync after the forward that read them).
"""

from __future__ import annotations

import numpy as np
import torch

MAX_VIEWS = 1024  # device views kept per buffer (a step's sizes repeat: decode batches)


class StagedBuffer:
    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device):
        self.device_tensor = torch.zeros(shape, dtype=dtype, device=device)
        if device.type == "cpu":
            self.host = self.device_tensor
        else:
            self.host = torch.zeros(shape, dtype=dtype, pin_memory=device.type == "cuda")
        self.np: np.ndarray = self.host.numpy()
        self._views: dict[tuple[int, int], torch.Tensor] = {}  # (start, end) -> device view

    @property
    def capacity(self) -> int:
        """Rows the buffer holds (its first dimension)."""
        return self.device_tensor.shape[0]

    def upload(self, n: int, start: int = 0) -> torch.Tensor:
        """Rows ``start:start + n`` on the device (a view at a fixed address), copied up
        from the host where the two differ."""
        end = start + n
        view = self._views.get((start, end))
        if view is None:  # views of one storage stay valid: made once per range
            if len(self._views) >= MAX_VIEWS:
                self._views.clear()
            view = self._views[start, end] = self.device_tensor[start:end]
        if self.host is not self.device_tensor:
            view.copy_(self.host[start:end], non_blocking=True)
        return view
