"""Host memory committed as it is written: the big pools the engine sizes at start (the
LoRA rank-row pools, the KV cache) reserve their whole budget as address space, and the
operating system backs a page only when something first writes to it.

On the CPU, ``zeros`` maps anonymous private memory (``mmap``): every page reads as zero
and takes no memory until written, so a pool sized for 32 adapters of rank 64 costs what
the adapters placed in it so far wrote (benchmarks/memory.py measures it). Transparent huge
pages are turned off for these mappings, so a write commits one small page, not 2 MiB.
On other devices ``zeros`` is ``torch.zeros``: reserved and committed are the same.

``committed_bytes`` counts the pages a tensor's storage has backed (``mincore``): those
written, and those only read (they map the kernel's shared zero page, which takes no
memory: an upper bound, then).
"""

from __future__ import annotations

import ctypes
import math
import mmap

import torch

PAGE = mmap.PAGESIZE
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero tensor; on the CPU its pages are committed when first written."""
    numel = math.prod(shape)
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if device.type != "cpu" or nbytes == 0:
        return torch.zeros(shape, dtype=dtype, device=device)
    mem = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):
        mem.madvise(mmap.MADV_NOHUGEPAGE)
    # the tensor keeps the mapping alive; unmapped when the last view of it goes
    return torch.frombuffer(mem, dtype=dtype).view(shape)


def committed_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes of the tensors' storages backed by memory now (each storage counted once):
    the pages written so far on the CPU; the whole storage on other devices."""
    seen: set[int] = set()
    total = 0
    for t in tensors:
        storage = t.untyped_storage()
        if storage.data_ptr() in seen or storage.nbytes() == 0:
            continue
        seen.add(storage.data_ptr())
        total += (_resident(storage.data_ptr(), storage.nbytes()) if t.device.type == "cpu"
                  else storage.nbytes())
    return total


def reserved_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes of the tensors' storages (each counted once): what they may commit."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def _resident(addr: int, nbytes: int) -> int:
    start = addr - addr % PAGE
    length = addr + nbytes - start
    pages = -(-length // PAGE)
    vec = (ctypes.c_ubyte * pages)()
    if _libc.mincore(start, length, vec) != 0:
        raise OSError(ctypes.get_errno(), "mincore failed")
    return (pages - bytes(vec).count(0)) * PAGE
