"""EngineConfig: every knob of the engine, frozen, validated once in ``__post_init__``.

Each field that is a flag declares it here (loraplex.flag): ``loraplex serve``, ``serve --ray``
and ``generate --model`` derive their engine flags from these fields, so the flags' names,
defaults and help are the same on every command and the same as ``LLMEngine(model,
**fields)``'s. What is only known once the model loads (``max_model_len`` from the model,
the dtype, the LoRA capacity, ``max_cpu_loras``' default) is in engine/resolved_config.py's
ResolvedConfig; nothing is written back here.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..flag import flag
from .logprobs import LOGPROBS_MODES

DTYPES = ("auto", "float32", "bfloat16", "float16")
BATCH_INVARIANT = ("auto", "on", "off")  # --batch-invariant (docs/sampling.md)
DEVICES = ("auto", "cpu", "cuda")
QUANTIZATIONS = ("auto", "none", "int8", "int4")  # vLLM's --quantization flag, these values
QUANTIZE_ON_LOAD = ("int8", "int4")  # the values that quantize a float checkpoint on load
DEFAULT_CPU_KV_BYTES = 1 << 30  # 1 GiB, further capped by what max_num_seqs × max_model_len needs
MODEL = "model"
CAPACITY = "capacity"
LORA = "LoRA adapters"
SAMPLING = "sampling"
REQUEST_LIMITS = "request limits"
STRUCTURED = "structured outputs"


def _check_range(name: str, value: float, low: float, high: float | None = None) -> None:
    if value < low or (high is not None and value > high):
        allowed = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ValueError(f"{name}={value!r} is out of range: must be {allowed}")


@dataclass(frozen=True)
class EngineConfig:
    """Engine settings. ``model`` is a local Hugging Face directory, a .gguf file, or None
    for the embedded default model. Field names follow vLLM's so users' habits carry over."""

    model: str | None = flag(
        None, group=MODEL, help="local Hugging Face model dir or .gguf file (default: the "
        "embedded SmolLM2-135M-Instruct; `serve` then also loads the demo adapters)")
    dtype: str = flag("auto", group=MODEL, choices=DTYPES,
                      help="auto: the kernels' choice for the checkpoint's dtype")
    device: str = flag("auto", group=MODEL, choices=DEVICES,
                       help="auto: cuda when there is one, else cpu")
    quantization: str = flag(
        "auto", group=MODEL, choices=QUANTIZATIONS,
        help="auto: the checkpoint as stored (a .gguf file, GPTQ or AWQ in its own "
        "quantization; the embedded default from its Q4_1 GGUF); none: float weights (the "
        "embedded default's or a .gguf's float32 conversion, made once); int8 / int4: "
        "quantize a 16/32-bit checkpoint's linears on load (weight-only; int8 per output "
        "channel, int4 in groups with zero points)")
    quantize_lm_head: bool = flag(  # engine/models/quantized_head.py
        False, group=MODEL,
        help="with --quantization int8|int4, serve the logits head in int8 per output "
        "channel too (a tied head gets its own int8 copy; the embedding stays float for "
        "lookups); default: the head stays float, as vLLM keeps it")
    max_num_seqs: int = flag(32, group=CAPACITY, help="requests running in a step")
    max_num_batched_tokens: int = flag(512, group=CAPACITY, help="token budget per step")
    max_model_len: int | None = flag(None, group=CAPACITY,  # None: max_position_embeddings
                                     help="prompt + output tokens (default: the model's limit)")
    block_size: int = flag(16, group=CAPACITY, help="tokens per KV block (a power of two)")
    kv_cache_memory: int | None = flag(  # None: a fraction of free memory (CUDA) or a default
        None, group=CAPACITY, kind="bytes", metavar="BYTES",
        help="KV-cache size (e.g. 4GiB); default: --gpu-memory-utilization")
    gpu_memory_utilization: float = flag(
        0.92, group=CAPACITY, help="fraction of device memory for weights + KV cache (CUDA only)")
    num_kv_blocks: int | None = None  # overrides the memory budget (tests force preemption with it)
    enable_prefix_caching: bool = True
    seed: int = 0
    # LoRA
    max_loras: int | str = flag(  # "auto": sized from lora_memory (engine/lora_capacity.py)
        "auto", group=LORA, kind="max_loras", metavar="auto|N",
        help="adapters on the device at once: 'auto' (as many as --lora-memory holds, at most "
        "--max-num-seqs) or N (vLLM's meaning)")
    max_lora_rank: int = flag(64, group=LORA, help="the largest adapter rank served")
    max_cpu_loras: int | None = flag(  # None: ResolvedConfig's 2 × max_loras (or max_num_seqs)
        None, group=LORA,
        help="adapters in host memory (default: 2×max-loras; 2×max-num-seqs with auto)")
    lora_memory: int | None = flag(  # bytes of the device rank-row pool with max_loras "auto"
        None, group=LORA, kind="bytes", metavar="BYTES",
        help="device memory for adapters with --max-loras auto (e.g. 512MiB); default: 10%% "
        "of what is left after weights and a minimum KV cache")
    max_lora_token_rows: int | None = flag(  # engine/lora_extras.py: reserved per LoRA slot
        None, group=LORA, metavar="ROWS",
        help="the most embedding / head rows one adapter's own token rows may hold on the "
        "device (a modules_to_save table: vocab_size rows; trainable tokens: one per token); "
        "each LoRA slot reserves that much at start and a larger adapter is refused; "
        "default: the most of the --lora-modules adapters on a GPU, no bound on the CPU")
    max_adapter_reads: int = flag(  # loader threads
        4, group=LORA, help="adapter reads from disk at once, ahead of the queue")
    lora_modules: dict[str, str] = flag(  # noqa: RUF009
        default_factory=dict, group=MODEL, kind="lora_module", metavar="NAME=PATH",
        help='adapters loaded at start: name=path or \'{"name": ..., "path": ..., '
        '"base_model_name": ...}\'')
    adapter_starvation_steps: int = 16  # a passed-over adapter gets the next free slot after this
    # stored here only: the server reads it from the engine (ServerState.served_model_name)
    served_model_name: str | None = flag(
        None, group=MODEL, help="alias requests may use for the base model")
    max_logprobs: int = flag(  # vLLM's: -1 = no cap (the whole vocabulary)
        20, group=SAMPLING, help="the most logprobs / prompt_logprobs a request may ask for "
        "(-1: no cap, a request's -1 then gets the whole vocabulary)")
    batch_invariant: str = flag(
        "auto", group=SAMPLING, choices=BATCH_INVARIANT,
        help="on: a request's tokens and logprobs are the same bits alone or in any batch "
        "(the CPU backend: row-invariant GEMMs, one attention order, and decode logprobs equal an "
        "echo re-score; the Triton backend: its invariant kernels; docs/sampling.md); off: "
        "the kernels measured fastest; auto: on for the CPU backend, the Triton backend's "
        "LORAPLEX_BATCH_INVARIANT (off when unset)")
    logprobs_mode: str = flag(
        "raw_logprobs", group=SAMPLING, choices=LOGPROBS_MODES,
        help="what logprobs report: the model's distribution (raw_*) or the one sampled "
        "from (processed_*: after penalties, bias, temperature, top-k/p, min-p), as "
        "log-probabilities or logits")
    # caps on a request's list fields (vLLM has none; OpenAI allows 4 stop strings and ~300
    # logit_bias entries): each is checked once, by the engine, for every front
    max_stop_strings: int = flag(
        64, group=REQUEST_LIMITS, help="the most `stop` strings a request may give")
    max_stop_token_ids: int = flag(
        256, group=REQUEST_LIMITS, help="the most `stop_token_ids` a request may give")
    max_bad_words: int = flag(
        1024, group=REQUEST_LIMITS, help="the most `bad_words` a request may give")
    max_logit_bias: int = flag(
        1024, group=REQUEST_LIMITS, help="the most `logit_bias` entries a request may give")
    max_allowed_token_ids: int | None = flag(  # None: the vocabulary size
        None, group=REQUEST_LIMITS,
        help="the most `allowed_token_ids` a request may give (default: the vocabulary size)")
    max_word_chars: int = flag(
        1024, group=REQUEST_LIMITS,
        help="the most characters of one `stop` string or one `bad_words` entry")
    max_bad_words_chars: int = flag(  # bounds their tokenizing and the index they make
        65536, group=REQUEST_LIMITS,
        help="the most characters of a request's `bad_words`, all together")
    # structured outputs: the grammar compiler's bounds (structured/compiler.py, limits.py)
    grammar_compile_timeout: float = flag(
        10.0, group=STRUCTURED, metavar="SECONDS",
        help="how long one grammar compile may run (its wait in the queue not counted); past "
        "it its worker process is killed and the request gets a 400")
    max_pending_grammars: int = flag(
        16, group=STRUCTURED, help="grammar compiles queued or running at once; a new "
        "constraint gets RESOURCE_EXHAUSTED / 429 beyond (large ones: half of it)")
    grammar_compile_workers: int = flag(
        2, group=STRUCTURED, help="worker processes compiling grammars (one more is kept "
        "for small constraints)")
    grammar_compile_memory: int = flag(
        1 << 30, group=STRUCTURED, kind="bytes", metavar="BYTES",
        help="memory one grammar compile may take in its worker (e.g. 1GiB); a 400 beyond")
    max_compiled_grammar_bytes: int = flag(
        16 << 20, group=STRUCTURED, kind="bytes", metavar="BYTES",
        help="a compiled grammar's serialized size (e.g. 16MiB); a 400 beyond")
    max_grammar_bytes: int = flag(
        64 << 10, group=STRUCTURED, kind="bytes", metavar="BYTES",
        help="a constraint's source: a schema's compact JSON, a regex, a grammar, the "
        "choices together (e.g. 64KiB); a 400 beyond")
    max_schema_depth: int = flag(
        64, group=STRUCTURED, help="how deep a JSON schema's objects and arrays may nest")
    max_pattern_repetition: int = 64  # a schema pattern's nested {m,n} counts, multiplied
    debug_checks: bool = False  # assert the adapter pool's and KV blocks' books every step

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype!r} is not supported: choose one of {DTYPES}")
        if self.device not in DEVICES:
            raise ValueError(f"device={self.device!r} is not supported: choose one of {DEVICES}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization={self.quantization!r} is not supported: choose "
                             f"one of {QUANTIZATIONS}")
        if self.quantize_lm_head and self.quantization not in QUANTIZE_ON_LOAD:
            raise ValueError(f"--quantize-lm-head (quantize_lm_head=True) quantizes the head "
                             f"of a checkpoint quantized on load: it needs --quantization "
                             f"int8 or int4, not {self.quantization!r} (a GGUF, GPTQ or AWQ "
                             f"file decides its own head)")
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
        _check_range("max_logprobs", self.max_logprobs, -1)
        for name in ("max_stop_strings", "max_stop_token_ids", "max_bad_words",
                     "max_logit_bias", "max_word_chars", "max_bad_words_chars"):
            _check_range(name, getattr(self, name), 1)
        if self.max_allowed_token_ids is not None:
            _check_range("max_allowed_token_ids", self.max_allowed_token_ids, 1)
        if self.batch_invariant not in BATCH_INVARIANT:
            raise ValueError(f"batch_invariant={self.batch_invariant!r} is not supported: "
                             f"choose one of {BATCH_INVARIANT}")
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode={self.logprobs_mode!r} is not supported: choose "
                             f"one of {LOGPROBS_MODES}")
        self._check_structured()
        # the caller's dict is copied: a later change to it does not reach the engine
        object.__setattr__(self, "lora_modules", dict(self.lora_modules))

    def _check_loras(self) -> None:
        if self.max_loras != "auto":
            if isinstance(self.max_loras, str) and not self.max_loras.isdigit():
                raise ValueError(f"max_loras={self.max_loras!r} must be 'auto' or an integer")
            # the one normalisation: "8" (a flag's text) and 8 are the same setting
            object.__setattr__(self, "max_loras", int(self.max_loras))
            _check_range("max_loras", self.max_loras, 1)
        _check_range("max_lora_rank", self.max_lora_rank, 1)
        if self.lora_memory is not None:
            _check_range("lora_memory", self.lora_memory, 1)
        if self.max_lora_token_rows is not None:
            _check_range("max_lora_token_rows", self.max_lora_token_rows, 0)
        _check_range("max_adapter_reads", self.max_adapter_reads, 1)
        if self.max_cpu_loras is not None:
            _check_range("max_cpu_loras", self.max_cpu_loras, 1)
        if self.max_loras != "auto" and self.host_loras < self.max_loras:
            raise ValueError(
                f"max_cpu_loras={self.host_loras} must be >= max_loras={self.max_loras}"
            )

    def _check_structured(self) -> None:
        if not self.grammar_compile_timeout > 0:
            raise ValueError(f"grammar_compile_timeout={self.grammar_compile_timeout!r} is out "
                             "of range: must be > 0 seconds")
        _check_range("max_pending_grammars", self.max_pending_grammars, 1)
        _check_range("grammar_compile_workers", self.grammar_compile_workers, 1, 64)
        _check_range("grammar_compile_memory", self.grammar_compile_memory, 64 << 20)
        _check_range("max_compiled_grammar_bytes", self.max_compiled_grammar_bytes, 1 << 10)
        _check_range("max_grammar_bytes", self.max_grammar_bytes, 1)
        _check_range("max_schema_depth", self.max_schema_depth, 1, 512)
        _check_range("max_pattern_repetition", self.max_pattern_repetition, 1)

    @property
    def host_loras(self) -> int:
        """Adapters the host tier holds: ``max_cpu_loras``, else 2 × ``max_loras`` (2 ×
        ``max_num_seqs`` with auto). Derived from the fields alone, so the Ray launcher reads
        it before any model loads; ResolvedConfig.max_cpu_loras is this value."""
        if self.max_cpu_loras is not None:
            return self.max_cpu_loras
        return 2 * (self.max_num_seqs if self.max_loras == "auto" else int(self.max_loras))

    def kwargs(self) -> dict[str, object]:
        """Every field by name, as ``LLMEngine(**kwargs)`` takes them."""
        return {name: getattr(self, name) for name in self.__dataclass_fields__}
