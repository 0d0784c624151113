"""What is served, front-neutral: the package's version and every capacity knob
(``describe``), read by gRPC's ServerInfo, HTTP's /version and the start-up log."""

from __future__ import annotations

from importlib import metadata
from typing import Any

from ..engine.llm_engine import LLMEngine
from .auth import Scope, required_tokens
from .server_options import ServerOptions


def version() -> str:
    try:
        return metadata.version("loraplex")
    except metadata.PackageNotFoundError:
        return "0+unknown"


def describe(engine: LLMEngine, options: ServerOptions) -> dict[str, Any]:
    """Every capacity knob, the KV-cache size in tokens and the pools' memory (reserved,
    and committed now): GetServerInfo's fields, also logged at start. Reads what is fixed
    once the engine is built, and the pools' page counts from the OS (any thread)."""
    cfg = engine.config
    memory = engine.memory_use()
    tokens = (options.api_token, options.admin_token)
    return {
        "version": version(), "model": str(engine.base.path),
        "served_model_name": cfg.served_model_name or "",
        "dtype": str(engine.base.dtype).removeprefix("torch."), "device": str(engine.base.device),
        "max_model_len": engine.max_model_len, "kv_cache_tokens": engine.kv_cache_tokens,
        "block_size": cfg.block_size, "max_num_seqs": cfg.max_num_seqs, "max_queue": options.max_queue,
        "max_num_batched_tokens": cfg.max_num_batched_tokens,
        "max_loras": engine.lora_capacity.max_loras, "max_loras_setting": str(cfg.max_loras),
        "lora_memory": engine.lora_capacity.pool_bytes,
        "lora_capacity": engine.lora_capacity.reason,
        "lora_memory_committed": memory.lora_committed, "kv_cache_bytes": memory.kv_reserved,
        "lora_extras_memory": memory.extras_reserved, "lora_extras_used": memory.extras_used,
        "kv_cache_committed": memory.kv_committed,
        "max_lora_rank": cfg.max_lora_rank, "max_cpu_loras": engine.resolved.max_cpu_loras,
        "kv_cache_memory": cfg.kv_cache_memory or 0,
        "gpu_memory_utilization": cfg.gpu_memory_utilization,
        "vocab_size": engine.base.hf_config.vocab_size,
        "weights_format": engine.base.weights.format,
        "weights_bits": engine.base.weights.bits,
        "weights_bytes": engine.base.weights.bytes,
        # does an API / admin route need a bearer token (server/auth.py's one rule)
        "api_token_required": required_tokens(Scope.API, *tokens) is not None,
        "admin_token_required": required_tokens(Scope.ADMIN, *tokens) is not None,
        "tls": options.tls,
        "adapter_roots": [str(r) for r in options.adapter_roots],
    }
