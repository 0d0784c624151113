"""LLMEngine: add_request / step / abort / generate over one base model (and its adapters)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from collections.abc import Sequence as Seq
from dataclasses import replace
from pathlib import Path
from typing import Any

from ..errors import AdapterNotFoundError, InvalidRequestError
from ..lora.base_shapes import BaseShapes
from ..lora.cache import AdapterCache
from ..lora.layers import attach_lora, rank_row_bytes
from ..lora.rank_pool import RankPool
from ..lora.slots import SlotBuffers
from ..lora.upload_store import UploadStore
from .base_model import BaseModel, load_base_model
from .base_model_names import base_model_hint, names_base_model
from .block_manager import BlockManager
from .choices import choices_to_fork, report_choices, run_to_completion
from .constraints import Constraints
from .engine_adapters import EngineAdapters
from .engine_config import EngineConfig
from .input_processor import EngineRequest, InputProcessor, Prompt, RequestInput
from .lora_capacity import LoRACapacity
from .memory_use import MemoryUse, memory_use
from .model_runner import ModelRunner, num_kv_blocks
from .output_processor import OutputProcessor, RequestOutput
from .resolved_config import resolve_config
from .sampling_params import SamplingParams
from .scheduler import ScheduledBatch, Scheduler
from .sequence import Sequence

log = logging.getLogger(__name__)

__all__ = ["LLMEngine", "Prompt"]


class LLMEngine(EngineAdapters):
    """``LLMEngine(model, **EngineConfig fields)``, or ``LLMEngine.from_config(config)``;
    the adapter methods (add_adapter, remove_adapter, ...) are engine_adapters.py's."""

    def __init__(self, model: str | Path | None = None, progress: bool = False, **kwargs):
        self.config = cfg = EngineConfig(model=None if model is None else str(model), **kwargs)
        # (tier, seconds) per adapter load: "host" = disk -> host memory, "device" = host ->
        # slot; called on whichever thread loaded (engine, loader, a server worker)
        self.adapter_load_observers: list[Callable[[str, float], None]] = []
        self.base: BaseModel = load_base_model(cfg, progress)
        self.tokenizer = self.base.tokenizer
        kernels = self.base.kernels
        # read by the kernels that have an invariant mode (CPU, Triton), before any step
        kernels.set_batch_invariant(cfg.batch_invariant)
        targets = list(self.base.model.lora_targets())
        self.base_shapes = replace(BaseShapes.from_hf_config(  # the tokenizer: adapter_vocab.py
            self.base.hf_config, str(self.base.path)), tokenizer=self.tokenizer)
        self.lora_dtype = kernels.dtype  # the pools'; host copies are read in it on loader
        # threads, so the copy onto the device only moves bytes
        self.resolved = resolve_config(cfg, self.base, rank_row_bytes(targets, self.base.dtype),
                                       self.slot_extras(targets))
        self.max_model_len: int = self.resolved.max_model_len
        self.lora_capacity: LoRACapacity = self.resolved.lora
        self.slot_buffers = SlotBuffers(attach_lora(targets, self.lora_capacity.num_units,
                                                    cfg.max_lora_rank, kernels))
        # after the pools: on CUDA the KV cache takes what they and the slots' extras left
        blocks = num_kv_blocks(cfg, self.base.hf_config, self.base.dtype, self.base.device,
                               self.max_model_len, self.lora_capacity.extras_bytes)
        self.block_manager = BlockManager(blocks, cfg.block_size, cfg.enable_prefix_caching)
        self.runner = ModelRunner(self.base.model, cfg, blocks, kernels, self.max_model_len)
        # the float linears (a float head, a GGUF's float tensors); the quantized ones, a
        # quantized head among them, run as they are (kernels.quantized_linear)
        kernels.prepare_model(self.base.model, cfg.max_num_batched_tokens, cfg.max_num_seqs)
        self.uploads = UploadStore()  # adapters given as tensors or bytes, as PEFT dirs
        self.lora = AdapterCache(self.lora_capacity.max_loras, self.resolved.max_cpu_loras,
                                 RankPool(self.lora_capacity.num_units, kernels.rank_unit),
                                 # re-reads are confined as the first read was
                                 read=lambda meta: self.read_adapter(
                                     meta.path, meta.name, meta, root=meta.root,
                                     shown=meta.shown),
                                 load_slot=self._load_slot, clear_slot=self._clear_slot,
                                 move_slot=self._move_slot,
                                 max_concurrent_reads=cfg.max_adapter_reads,
                                 on_drop=self._dropped)
        self.runner.rows_of = self.lora.token_rows  # adapters' own embedding / head rows
        self.scheduler = Scheduler(self.block_manager, cfg.max_num_seqs,
                                   cfg.max_num_batched_tokens, self.lora,
                                   cfg.adapter_starvation_steps)
        self.outputs = OutputProcessor(self.tokenizer)
        self.constraints = Constraints(self.tokenizer, self.base.hf_config.vocab_size,
                                       self.base.eos_token_ids, cfg)  # structured outputs
        self.requests: dict[str, list[Sequence]] = {}  # request id -> its live choices
        # the names that run the base model besides "" (``names_base_model``), as NOT_FOUND
        # messages show them; a server sets its own (ServerState.attach)
        self.base_model_names: list[str] = list(dict.fromkeys(
            n for n in (cfg.served_model_name, self.model_name) if n))
        self.input_processor = InputProcessor(self)  # every request check, once
        for name, path in cfg.lora_modules.items():
            self.add_adapter(name, path, preloaded=True)
        log.info("engine ready: %s, %s on %s, %s kernels, %d KV blocks of %d tokens, "
                 "max_model_len %d; weights: %s; LoRA: %s; memory: %s", self.base.path,
                 self.base.dtype, self.base.device, kernels.name, blocks, cfg.block_size,
                 self.max_model_len, self.base.weights.describe(), self.lora_capacity.reason,
                 self.memory_use().describe())

    @classmethod
    def from_config(cls, config: EngineConfig, progress: bool = False) -> LLMEngine:
        return cls(progress=progress, **config.kwargs())

    # ---- requests -----------------------------------------------------------------------
    @property
    def kv_cache_tokens(self) -> int:
        return self.block_manager.num_blocks * self.block_manager.block_size

    def tokenize(self, prompt: Prompt, adapter: str | None = None) -> list[int]:
        """``prompt``'s ids, with ``adapter``'s own tokenizer if it brings one."""
        return self.input_processor.tokenize(prompt, self.tokenizer_for(adapter))

    def tokenizer_for(self, adapter: str | None) -> Any:
        """The tokenizer of requests on ``adapter`` (its own, else the base model's)."""
        return self.input_processor.tokenizer_for(adapter)

    def make_sequence(self, prompt: Prompt, params: SamplingParams | None = None,
                      adapter: str | None = None, request_id: str | None = None,
                      grammar: object | None = None) -> Sequence:
        """Check a request (the InputProcessor: every check once, the adapter looked up)
        and build its Sequence (does not touch engine state). A constrained request's
        grammar is compiled last, once every other check passed (blocking), unless
        ``grammar``, its compiled grammar, is given."""
        request = self.input_processor.process(RequestInput(prompt, params, adapter,
                                                            request_id))
        request = replace(request, grammar=grammar) if grammar is not None else \
            self.input_processor.compile(request)  # the expensive part, after every check
        return self.sequence_of(request)

    def sequence_of(self, request: EngineRequest) -> Sequence:
        """The Sequence of a checked request, its grammar's matcher attached (any thread;
        ``add_sequence`` adds it on the engine thread)."""
        assert request.adapter_id is not None, "an unresolved adapter: InputProcessor.bind"
        seq = Sequence(
            request_id=request.request_id, prompt_token_ids=list(request.prompt_token_ids),
            params=request.params, adapter_name=request.adapter_name,
            adapter_id=request.adapter_id,  # add_sequence binds it and sets adapter_version
            adapter_start=request.adapter_start,
            eos_token_ids=self.base.eos_token_ids, max_tokens=request.max_tokens,
            bad_words=request.bad_words, tokenizer=request.tokenizer)
        self.constraints.attach(seq, request.grammar)
        return seq

    @property
    def model_name(self) -> str:
        """The base model's name for clients (vLLM's rule): the served model name, else the
        --model argument as given, else (the embedded default) its directory name."""
        return self.config.served_model_name or self.config.model or self.base.path.name

    def is_base_model(self, name: str | None) -> bool:
        """Whether ``name`` names the base model (``names_base_model``)."""
        return names_base_model(name, self.config.served_model_name, self.model_name)

    def prefetch_adapter(self, request: EngineRequest) -> None:
        """Any thread: start reading a checked request's adapter from disk ahead of it,
        while it is on its way to the engine thread (``AdapterCache.prefetch``); no-op for
        the base model, lora_scale 0 and an aLoRA never invoked."""
        if request.params.lora_scale and self.needs_adapter(request.adapter_id,
                                                            request.adapter_start):
            self.lora.prefetch(request.adapter_name)  # type: ignore[arg-type]

    def unknown_adapter(self, name: str) -> AdapterNotFoundError:
        """NOT_FOUND for a model name that is neither the base model nor a loaded adapter:
        the name asked for (its first 128 characters), and what is valid."""
        shown = repr(name[:128]) + ("..." if len(name) > 128 else "")
        return AdapterNotFoundError(f"unknown adapter {shown}; {self.base_model_hint()}")

    def base_model_hint(self) -> str:
        return base_model_hint(self.base_model_names, len(self.lora.names))

    def add_sequence(self, seq: Sequence) -> str:
        if seq.request_id in self.requests:
            raise InvalidRequestError(f"request_id {seq.request_id!r} is already in use")
        if seq.adapter_id:
            self.bind_sequence(seq)
        self.requests[seq.request_id] = [seq]
        self.scheduler.add(seq)
        return seq.request_id

    def add_request(self, prompt: Prompt, params: SamplingParams | None = None,
                    adapter: str | None = None, request_id: str | None = None,
                    grammar: object | None = None) -> str:
        return self.add_sequence(self.make_sequence(prompt, params, adapter, request_id,
                                                    grammar))

    def abort(self, request_id: str) -> bool:
        """Stop every choice of a request and free their KV blocks; False if none runs."""
        choices = self.requests.get(request_id)
        if not choices:
            return False
        for seq in list(choices):
            self._finish(seq, "abort")
        return True

    def _finish(self, seq: Sequence, reason: str) -> None:
        self.scheduler.finish(seq, reason)
        self.runner.sampler.forget(seq.seq_id)
        choices = self.requests.get(seq.request_id, [])
        if seq in choices:
            choices.remove(seq)
        if not choices:  # the request's last live choice
            self.requests.pop(seq.request_id, None)
            if seq.adapter_id:
                self.lora.request_done(seq.adapter_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.num_unfinished > 0

    # ---- the step -----------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        outputs = self._fail_broken_adapters()
        batch = self.scheduler.schedule()
        if batch.empty:  # requests wait on adapter reads: block briefly rather than spin
            self.lora.wait_for_loads(0.01)
            return outputs
        batch.forks = choices_to_fork(batch)
        seqs, sampled = self.runner.run(batch, self._adapter_slots(batch))
        self.scheduler.postprocess(batch)
        for parent_id, children in batch.forks.items():
            parent = next(s for s in seqs if s.seq_id == parent_id)
            self.runner.copy_blocks(self.scheduler.fork(parent, children))
            self.requests[parent.request_id] += children
        if self.config.debug_checks:
            self.check()
        for seq, token, logprob in zip(seqs, sampled.tokens, sampled.logprobs):
            reason = self._fail_non_finite(seq) if token is None else \
                self.constraints.advance(seq, token) or \
                self.outputs.append(seq, token, logprob)
            if reason is not None:
                self._finish(seq, reason)
            outputs += report_choices(self.outputs, seq)
        return outputs

    @staticmethod
    def _fail_non_finite(seq: Sequence) -> str:
        """On an adapter, the adapter's fault (its weights overflow on this input, or its
        data was corrupted after the load checks); on the base model, an engine fault."""
        tokens = f"after {seq.num_output_tokens} generated tokens"
        if seq.adapter_name:
            seq.adapter_fault = True
            seq.error = (f"adapter {seq.adapter_name!r} cannot serve this request: its logits "
                         f"hold NaN or Inf {tokens} (its weights overflow on this input, or "
                         "its data is corrupt); replace or unload the adapter. Requests on "
                         "other adapters and the base model are unaffected")
        else:
            seq.error = (f"its logits hold NaN or Inf {tokens} (the base model); no token "
                         "can be sampled from them")
        return "error"

    def generate(self, prompts: Seq[Prompt], params: SamplingParams | Seq[SamplingParams] | None
                 = None, adapters: Seq[str | None] | None = None, use_tqdm: bool = False
                 ) -> list[RequestOutput | list[RequestOutput]]:
        """Run ``prompts`` to completion (one adapter per prompt, None = base model). One
        finished RequestOutput per prompt; for a prompt whose params have n > 1, the list of
        its n finished choices, in index order."""
        count = len(prompts)
        params_list = list(params) if isinstance(params, Seq) else [params] * count
        adapter_list = list(adapters) if adapters is not None else [None] * count
        if len(params_list) != count or len(adapter_list) != count:
            raise InvalidRequestError("params and adapters must have one entry per prompt")
        seqs = [self.make_sequence(p, sp, a) for p, sp, a in zip(prompts, params_list,
                                                                    adapter_list)]
        for seq in seqs:
            self.add_sequence(seq)
        return run_to_completion(self.step, seqs, use_tqdm)

    def _fail_broken_adapters(self) -> list[RequestOutput]:
        """Waiting requests whose adapter could not be reloaded from disk end with an error."""
        outputs = []
        for seq in list(self.scheduler.waiting):
            error = seq.lora_id and self.lora.failed(seq.lora_id)
            if error:
                seq.error, seq.adapter_fault = error, True
                self._finish(seq, "error")
                outputs += report_choices(self.outputs, seq)
        return outputs

    def _adapter_slots(self, batch: ScheduledBatch) -> dict[int, int]:
        """The device slot of every adapter the batch needs (the scheduler placed them)."""
        return {a: self.lora.slot_of(a) for a in {s.lora_id for s, _ in batch.entries} if a}

    # ---- introspection ------------------------------------------------------------------
    def stats(self) -> dict[str, int]:
        bm = self.block_manager
        return {
            "num_waiting": len(self.scheduler.waiting),
            # ever; prefix-cache hits and forked choices are not computed, recomputes are
            "prompt_tokens_computed": self.runner.prompt_tokens_computed,
            "num_running": len(self.scheduler.running),
            "kv_blocks_total": bm.num_blocks,
            "kv_blocks_used": bm.num_used_blocks,
            "prefix_cache_hits": bm.prefix_hits,
            "prefix_cache_queries": bm.prefix_queries,
            "lora_slots_total": self.lora.max_loras,
            "lora_slots_in_use": self.lora.slots_in_use,
            "adapters_loaded": len(self.lora.names),
            "adapters_on_device": self.lora.resident_count,
            "adapters_in_host": self.lora.host_count,
            "lora_pool_units_total": self.lora.pool.num_units,
            "lora_pool_units_used": self.lora.pool.used_units,
        }

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix block: no later request reuses KV computed before
        (engine thread)."""
        self.block_manager.reset_prefix_cache()

    def memory_use(self) -> MemoryUse:
        """What the LoRA pools and the KV cache reserve and have committed, and the device
        copies of adapters' token rows, read now."""
        return memory_use(self.slot_buffers, self.base.model, self.runner.token_rows.slots.nbytes,
                          self.lora_capacity.extras_bytes)

    def check(self) -> None:
        """Assert the books of the adapter cache and pool and of the KV blocks (the engine
        runs this after every step with ``debug_checks``)."""
        self.lora.check()
        self.block_manager.check(self.scheduler.running)

    def adapters_in_use(self) -> tuple[list[str], list[str]]:
        """(running, waiting): the sorted names of adapters with a running / a waiting
        request (the base model is not named). Engine thread only."""
        def names(seqs: Iterable[Sequence]) -> list[str]:
            return sorted({s.adapter_name for s in seqs if s.adapter_name})

        return names(self.scheduler.running), names(self.scheduler.waiting)

    def __repr__(self) -> str:
        return f"LLMEngine({self.base.path}, {self.base.dtype}, {self.base.device})"

