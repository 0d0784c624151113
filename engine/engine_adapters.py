"""EngineAdapters: LLMEngine's adapter methods (register from a directory, from tensors in
memory, replace in place, remove, list), kept apart from the request path. Every way in
ends in the same checks (``peft_format``) and ``AdapterCache.register``."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import InvalidRequestError
from ..kernel_backends import intra_op
from ..lora.base_shapes import BaseShapes
from ..lora.cache import AdapterCache
from ..lora.cached_adapter import AdapterInfo
from ..lora.peft_format import (
    AdapterError,
    AdapterMeta,
    LoRAWeights,
    inspect_peft_adapter,
    read_peft_adapter,
)
from ..lora.slots import SlotBuffers
from ..lora.upload_store import UploadStore
from .activation import activation_start, needs_adapter
from .lora_extras import LoRAExtras, lora_extras

if TYPE_CHECKING:
    import torch

    from .base_model import BaseModel
    from .engine_config import EngineConfig
    from .resolved_config import ResolvedConfig
    from .sequence import Sequence


class EngineAdapters:
    """Mixed into LLMEngine, which sets these attributes."""

    config: EngineConfig
    lora: AdapterCache
    base_shapes: BaseShapes
    lora_dtype: torch.dtype
    slot_buffers: SlotBuffers
    base: BaseModel
    resolved: ResolvedConfig
    uploads: UploadStore
    adapter_load_observers: list[Callable[[str, float], None]]
    is_base_model: Callable[[str | None], bool]

    def read_adapter(self, path: str | Path, name: str = "",
                     meta: AdapterMeta | None = None, *, root: Path | None = None,
                     shown: str = "") -> LoRAWeights:
        """Read and validate a PEFT adapter dir for this base model (safe on any thread; the
        loader threads' read of a registered adapter passes its ``meta``, so its checks are
        not redone while the files are unchanged). ``root``: every file read must lie under
        it (a server's confinement; None for an operator's path); ``shown``: how messages
        name the directory. Timed for ``adapter_load_observers``."""
        start = time.perf_counter()
        with intra_op.serial():  # callers' threads start no OpenMP pool (kernel_backends/intra_op.py)
            weights = read_peft_adapter(path, self.base_shapes, self.config.max_lora_rank,
                                        name, meta=meta, dtype=self.lora_dtype, root=root,
                                        shown=shown)
        self._observe_adapter_load("host", time.perf_counter() - start)
        return weights

    def slot_extras(self, targets: list) -> LoRAExtras:
        """What each LoRA slot reserves beside its rank rows (engine/lora_extras.py); the
        --lora-modules adapters are inspected (not read) only where their token rows set
        the bound."""
        launch = (inspect_peft_adapter(path, self.base_shapes, self.config.max_lora_rank, name,
                                       self.lora_dtype)
                  for name, path in self.config.lora_modules.items())
        return lora_extras(self.config, targets, self.lora_dtype, self.base.device, launch,
                           self.base_shapes.hidden_size)

    def bind_sequence(self, seq: Sequence) -> None:
        """Engine thread, as ``seq`` (on an adapter) is added: the load it runs on (a load
        in place since the request was checked moves it there, with that load's invocation)
        and its request counted; one at lora_scale 0 or an aLoRA never invoked
        (``seq.lora_id`` 0) reads nothing and takes no slot."""
        adapter = self.lora.bind(seq.adapter_id, seq.adapter_name or "")
        if adapter.adapter_id != seq.adapter_id:
            seq.adapter_start = activation_start(seq.prompt_token_ids,
                                                 adapter.meta.invocation_tokens)
        seq.adapter_id, seq.adapter_version = adapter.adapter_id, adapter.version
        seq.own_rows = adapter.meta.tokens is not None
        self.lora.request_started(seq.adapter_id, needs_weights=bool(seq.lora_id))

    def needs_adapter(self, adapter_id: int | None, start: int) -> bool:
        """Any thread: whether a checked request on load ``adapter_id`` whose delta applies
        from ``start`` needs the adapter's weights (``activation.needs_adapter``)."""
        adapter = self.lora.by_id.get(adapter_id) if adapter_id else None
        return adapter is not None and needs_adapter(start, adapter.meta.tokens is not None)

    def _load_slot(self, slot: int, weights: LoRAWeights) -> None:
        start = time.perf_counter()
        self.slot_buffers.load(slot, weights)
        self._observe_adapter_load("device", time.perf_counter() - start)

    def _clear_slot(self, slot: int) -> None:
        self.slot_buffers.clear(slot)
        self.runner.token_rows.slots.drop(slot)  # its device copy of token rows, if any

    def _move_slot(self, src: int, dst: int, rows: int) -> None:
        self.slot_buffers.move(src, dst, rows)
        self.runner.token_rows.slots.move(src, dst)

    def _observe_adapter_load(self, tier: str, seconds: float) -> None:
        for observe in self.adapter_load_observers:
            observe(tier, seconds)

    def _dropped(self, path: Path) -> None:
        """The cache dropped the last load of ``path``: an upload's directory goes too."""
        self.uploads.discard(path)

    def write_upload(self, name: str, tensors: Mapping[str, Any], config: Any) -> Path:
        """Write ``tensors`` (PEFT state-dict names -> tensors) and ``config`` (a dict or a
        peft LoraConfig) as an adapter directory of this engine's upload store (any
        thread); ``add_adapter(..., owned=True)`` registers it."""
        if self.is_base_model(name):
            raise InvalidRequestError(f"adapter name {name!r} is empty or the base model's")
        with intra_op.serial():
            return self.uploads.write_tensors(name, tensors, config)

    def add_adapter(self, name: str, path: str | Path | None = None, replace: bool = False,
                    pin: bool = False, preloaded: bool = False,
                    weights: LoRAWeights | None = None, *,
                    tensors: Mapping[str, Any] | None = None, config: Any = None,
                    owned: bool = False, version: int | None = None) -> AdapterInfo:
        """Register an adapter: from the PEFT dir ``path``, or from ``tensors`` (a PEFT
        state dict: ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`` ->
        tensor) with ``config`` (adapter_config.json's dict, or a peft LoraConfig), checked
        exactly as a directory is. ``replace`` swaps a registered name for a new version
        (requests in flight finish on the old one). Without ``weights`` (already read by
        ``read_adapter``) or ``tensors`` this validates the config and safetensors header
        only: the weights are read when a request needs them. ``owned``: ``path`` is an
        upload of this engine's store, removed once its adapter is dropped. ``version``:
        a cluster's number for this load (else one above the name's last)."""
        if self.is_base_model(name):
            raise InvalidRequestError(f"adapter name {name!r} is empty or the base model's")
        if tensors is not None:
            if path is not None or weights is not None or config is None:
                raise InvalidRequestError("give tensors with config, and no path or weights")
            self.lora.check_name(name, replace)  # before any write
            path, owned = self.write_upload(name, tensors, config), True
        elif path is None:
            raise InvalidRequestError("give the adapter's path, or tensors and config")
        try:
            if tensors is not None:
                weights = self.read_adapter(path, name)
            meta = weights.meta if weights is not None else inspect_peft_adapter(
                path, self.base_shapes, self.config.max_lora_rank, name, self.lora_dtype)
            self._check_dora(meta)
            self.resolved.extras.check(meta)  # its token rows fit what a slot reserves
            return self.lora.register(name, meta, replace=replace, pin=pin,
                                      preloaded=preloaded, weights=weights, owned=owned,
                                      version=version)
        except BaseException:
            if owned:
                self.uploads.discard(path)
            raise

    def _check_dora(self, meta: AdapterMeta) -> None:
        """A DoRA adapter needs the base's float weights (their row norms): refused over a
        quantized base, naming the adapter."""
        if meta.use_dora and not self.slot_buffers.serves_dora:
            raise AdapterError(f"{meta.files.label()}: DoRA (use_dora=true) is not served "
                               "over a quantized base model (its weight norms need the float "
                               "weights); serve the float base, or merge the adapter")

    def remove_adapter(self, name: str) -> None:
        self.lora.remove(name)

    def list_adapters(self) -> list[AdapterInfo]:
        return self.lora.list()
