"""EngineConfig: every knob of the engine, validated once in ``__post_init__``."""

from __future__ import annotations

from dataclasses import dataclass, field

DTYPES = ("auto", "float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda")
DEFAULT_CPU_KV_BYTES = 1 << 30  # 1 GiB, further capped by what max_num_seqs × max_model_len needs


def _check_range(name: str, value: float, low: float, high: float | None = None) -> None:
    if value < low or (high is not None and value > high):
        allowed = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ValueError(f"{name}={value!r} is out of range: must be {allowed}")


@dataclass
class EngineConfig:
    """Engine settings. ``model`` is a local Hugging Face directory, or None for the embedded
    default model. Field names follow vLLM's so users' habits carry over."""

    model: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 512
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    block_size: int = 16
    kv_cache_memory: int | None = None  # bytes; None: a fraction of free memory (CUDA) or a default
    gpu_memory_utilization: float = 0.92
    num_kv_blocks: int | None = None  # overrides the memory budget (tests force preemption with it)
    enable_prefix_caching: bool = True
    seed: int = 0
    # LoRA
    max_loras: int | str = "auto"  # "auto": sized from lora_memory (engine/lora_capacity.py)
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None  # None: 2 × max_loras (auto: 2 × max_num_seqs)
    lora_memory: int | None = None  # bytes of the device rank-row pool with max_loras "auto"
    max_adapter_reads: int = 4  # adapter reads from disk at once (loader threads)
    lora_modules: dict[str, str] = field(default_factory=dict)
    adapter_starvation_steps: int = 16  # a passed-over adapter gets the next free slot after this
    served_model_name: str | None = None
    debug_checks: bool = False  # assert the adapter pool's and KV blocks' books every step

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype!r} is not supported: choose one of {DTYPES}")
        if self.device not in DEVICES:
            raise ValueError(f"device={self.device!r} is not supported: choose one of {DEVICES}")
        _check_range("max_num_seqs", self.max_num_seqs, 1)
        _check_range("max_num_batched_tokens", self.max_num_batched_tokens, 1)
        _check_range("block_size", self.block_size, 1)
        if self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size={self.block_size} must be a power of two")
        if self.max_model_len is not None:
            _check_range("max_model_len", self.max_model_len, 2)
        if self.kv_cache_memory is not None:
            _check_range("kv_cache_memory", self.kv_cache_memory, 1)
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization={self.gpu_memory_utilization} must be in (0, 1]"
            )
        if self.num_kv_blocks is not None:
            _check_range("num_kv_blocks", self.num_kv_blocks, 1)
        self._check_loras()
        _check_range("adapter_starvation_steps", self.adapter_starvation_steps, 1)

    def _check_loras(self) -> None:
        auto = self.max_loras == "auto"
        if not auto:
            if isinstance(self.max_loras, str) and not self.max_loras.isdigit():
                raise ValueError(f"max_loras={self.max_loras!r} must be 'auto' or an integer")
            self.max_loras = int(self.max_loras)
            _check_range("max_loras", self.max_loras, 1)
        _check_range("max_lora_rank", self.max_lora_rank, 1)
        if self.lora_memory is not None:
            _check_range("lora_memory", self.lora_memory, 1)
        _check_range("max_adapter_reads", self.max_adapter_reads, 1)
        if self.max_cpu_loras is None:
            self.max_cpu_loras = 2 * (self.max_num_seqs if auto else self.max_loras)
        _check_range("max_cpu_loras", self.max_cpu_loras, 1)
        if not auto and self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"max_cpu_loras={self.max_cpu_loras} must be >= max_loras={self.max_loras}"
            )
