"""LoRAExtras: the device bytes an adapter may need beside its rank rows, reserved per LoRA
slot by the start-up budget (engine/lora_capacity.py), so that none of them is allocated
out of memory the KV cache already took (on CUDA the KV cache takes what is left).

Per slot (``max_loras`` slots), for any adapter that may be placed in it:
- lora_B's bias row (``lora_bias=True``): Σ out_i of every LoRA-wrapped linear, in the pool
  dtype (lora/layers.py: one row per resident adapter with a bias);
- DoRA's gain row (``use_dora=True``): Σ out_i, float32; only where DoRA is served (a
  float base: lora/dora_gains.py);
- the device copy of its own token rows (lora/token_rows.py: ``DeviceRows``, one per slot):
  ``token_rows`` rows of ``hidden_size`` in the pool dtype and their int64 indices. A
  ``modules_to_save`` table is ``vocab_size`` rows (both embed_tokens and lm_head: twice
  that); ``trainable_token_indices`` of k tokens, k rows (tied with the embedding on a
  tied base: the head reuses them).

The rule for the token rows (``--max-lora-token-rows``): the number given; by default on a
GPU the most rows of the adapters given at launch (``--lora-modules``, 0 when none has
token rows); on the CPU no bound (the device copies are the host copies: nothing to
reserve). An adapter whose token rows exceed the bound is refused when it is registered
(``check``), never at a step. Bias and gain rows are always reserved: they cost about one
rank row per slot each.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from ..lora.peft_checks import AdapterError
from ..lora.peft_format import AdapterMeta
from .engine_config import EngineConfig

GIB = 1 << 30
INDEX_BYTES = 8  # a token row's int64 index (trainable tokens), counted for every row


@dataclass(frozen=True)
class LoRAExtras:
    bias_bytes: int  # one slot's lora_B bias row over every wrapped linear
    gain_bytes: int  # one slot's DoRA gain row (0 where DoRA is not served)
    max_token_rows: int | None  # the most token rows an adapter may have; None: no bound
    token_row_bytes: int  # the device bytes of one token row (0: the host copy serves)
    rule: str  # where max_token_rows came from, for the log

    @property
    def per_slot(self) -> int:
        """Device bytes reserved per LoRA slot."""
        rows = self.max_token_rows or 0
        return self.bias_bytes + self.gain_bytes + rows * self.token_row_bytes

    def describe(self, slots: int) -> str:
        rows = "no bound" if self.max_token_rows is None else f"{self.max_token_rows}"
        return (f"{_mib(slots * self.per_slot)} for {slots} slots' extras (lora_bias "
                f"{_mib(self.bias_bytes)}, DoRA {_mib(self.gain_bytes)}, token rows "
                f"{rows} × {self.token_row_bytes} B per slot: {self.rule})")

    def check(self, meta: AdapterMeta) -> None:
        """Refuse an adapter whose own token rows exceed what each slot reserves."""
        rows = token_rows(meta)
        if self.max_token_rows is not None and rows > self.max_token_rows:
            raise AdapterError(
                f"{meta.files.label()}: its own token rows (modules_to_save / "
                f"trainable_token_indices: {rows} rows of hidden_size) exceed the "
                f"{self.max_token_rows} rows each LoRA slot reserves on the device "
                f"({self.rule}); restart with --max-lora-token-rows {rows} or more, or name "
                "the adapter in --lora-modules")


def token_rows(meta: AdapterMeta) -> int:
    """Rows of hidden_size an adapter's own token rows hold (each tensor once: a tied head
    reuses the embedding's)."""
    if meta.tokens is None:
        return 0
    return sum(shape[0] for _, shape, _ in meta.tokens.at.values())


def lora_extras(cfg: EngineConfig, targets: Iterable, dtype: torch.dtype,
                device: torch.device, launch: Iterable[AdapterMeta],
                hidden_size: int) -> LoRAExtras:
    """The per-slot extras for a model's LoRA ``targets`` (``lora_targets()``: (layer,
    parent, attr, slices, sizes)) in the pool ``dtype``; ``launch``: the adapters given at
    launch, inspected (their token rows set the default bound on a GPU)."""
    elem = torch.tensor([], dtype=dtype).element_size()
    outs, floats = 0, True
    for _, parent, attr, _, sizes in targets:
        outs += sum(sizes)
        weight = getattr(getattr(parent, attr), "weight", None)
        floats &= isinstance(weight, torch.Tensor) and weight.is_floating_point()
    copies = device.type != "cpu"
    if cfg.max_lora_token_rows is not None:
        rows, rule = cfg.max_lora_token_rows, f"--max-lora-token-rows {cfg.max_lora_token_rows}"
    elif copies:
        rows = max((token_rows(m) for m in launch), default=0)
        rule = "the most of the --lora-modules adapters"
    else:
        rows, rule = None, "the CPU: the host copies serve"
    return LoRAExtras(outs * elem, outs * 4 if floats else 0, rows,
                      (hidden_size * elem + INDEX_BYTES) if copies else 0, rule)


def _mib(n: int) -> str:
    return f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / (1 << 20):.1f} MiB"
