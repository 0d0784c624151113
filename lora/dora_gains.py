"""DoRA (PEFT's ``use_dora=True``) at serving time: per output row one gain.

PEFT's DoRA layer (peft/tuners/lora/dora.py, ``DoraLinearLayer.forward``, eval) computes

    y = base(x) + (g - 1) ⊙ (W x) + g ⊙ (s · B A x),    g = m / ||W + s · B A||_row

(``m``: the adapter's ``lora_magnitude_vector``, ``s``: its scaling, ``W x`` without the
base's bias), i.e. ``y = g ⊙ (W x + s · B A x) + bias``. The row norm does not depend on
x, so it is computed once, when the adapter is written into a device slot, and the
LoRALinear keeps ``g`` per slot and output row (layers.py).

The norm is taken without the base weight in row-major form (the CPU backend packs it and
frees the rows): ``||W_i + (sB)_i A||² = ||W_i||² + 2 (sB)_i · (A W_iᵀ) + (sB)_i (A Aᵀ) (sB)_iᵀ``
with ``||W_i||²`` read once from the unpacked weight (``row_sq_norms``) and ``A Wᵀ`` the
base linear run on the r rows of A (its bias taken off): O(r · (in + out) + r · in · out)
for the whole module, the cost of a prefill of r tokens.
"""

from __future__ import annotations

import torch

from ..kernel_backends.lora_segments import LoRASegments


def row_sq_norms(weight: torch.Tensor) -> torch.Tensor:
    """``||W_i||²`` per output row, float64 (read once, before the weight is packed)."""
    return torch.linalg.vector_norm(weight.detach(), dim=1, dtype=torch.float64).square()


def dora_gain(magnitude: torch.Tensor, w_sq: torch.Tensor, a_w: torch.Tensor,
              a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``g = m / ||W + B A||_row`` (float32, [out]) for ``B`` with the scaling multiplied
    in ([out, r]), ``A`` [r, in], ``a_w`` = A Wᵀ [r, out] and ``w_sq`` = ||W_i||², in
    float64 (PEFT takes the norm of the float weight in its dtype; float64 here so the
    expansion loses nothing to cancellation)."""
    a, b, a_w = a.double(), b.double(), a_w.double()
    cross = (b * a_w.t()).sum(1)  # (sB)_i · (A W_iᵀ)
    quad = ((b @ (a @ a.t())) * b).sum(1)  # ||(sB)_i A||²
    norm = (w_sq.double() + 2 * cross + quad).clamp_min(0).sqrt()
    return (magnitude.double() / norm).float()


class DoraSlots:
    """The device slots whose adapter is DoRA, shared by every LoRALinear of a model (an
    adapter is DoRA in every layer or in none: ``use_dora`` is the config's): each such slot
    has a row of the layers' gain tables (the same row in every layer, the lowest free one,
    so a table holds as many rows as DoRA adapters are resident at once, at most
    ``max_loras``), and per step the token rows of those slots with their gain rows
    (computed once per step for every layer). A slot's row stays when compaction moves
    the slot."""

    def __init__(self) -> None:
        self.slots: dict[int, int] = {}  # slot -> gain row
        self._version = 0  # bumped on every change of ``slots``
        self._key: tuple[object, object, int] | None = None
        self._rows: tuple[torch.Tensor, torch.Tensor] | None = None

    def add(self, slot: int) -> int:
        """The slot's gain row (a new one, the lowest free, if the slot had none)."""
        if slot not in self.slots:
            taken = set(self.slots.values())
            self.slots[slot] = next(r for r in range(len(taken) + 1) if r not in taken)
            self._version += 1
        return self.slots[slot]

    def discard(self, slot: int) -> None:
        if self.slots.pop(slot, None) is not None:
            self._version += 1

    def move(self, src: int, dst: int) -> None:
        """Compaction moved ``src`` to ``dst``: its gain row goes with it (every layer
        calls this; the first moves it)."""
        if src in self.slots:
            self.slots[dst] = self.slots.pop(src)
            self._version += 1

    def rows(self, seg: LoRASegments) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(token rows, their gain rows) of the step's tokens on DoRA slots, or None. Cached
        while the step's host lists are the same objects (a refill makes new ones; the
        cache holds the old ones, so their ids are not reused) and ``slots`` unchanged."""
        starts, seg_slots = seg.seg_starts_host, seg.seg_slots_host
        key = self._key
        if key is not None and key[0] is starts and key[1] is seg_slots \
                and key[2] == self._version:
            return self._rows
        runs = [(starts[i], starts[i + 1], self.slots[slot])
                for i, slot in enumerate(seg_slots) if slot in self.slots]
        rows = None
        if runs:
            index = seg.token_indices
            token_rows = torch.cat([index[lo:hi] for lo, hi, _ in runs])
            gain_rows = torch.tensor([row for lo, hi, row in runs for _ in range(hi - lo)],
                                     dtype=torch.int64).to(index.device, non_blocking=True)
            rows = (token_rows, gain_rows)
        self._key, self._rows = (starts, seg_slots, self._version), rows
        return rows
