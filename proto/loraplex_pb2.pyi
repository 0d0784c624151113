from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "seed", "max_new_tokens", "min_new_tokens", "stop", "stop_token_ids", "ignore_eos", "n", "logprobs", "prompt_logprobs", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "min_p", "allowed_token_ids", "bad_words", "lora_scale")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MIN_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    ALLOWED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BAD_WORDS_FIELD_NUMBER: _ClassVar[int]
    LORA_SCALE_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    seed: int
    max_new_tokens: int
    min_new_tokens: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    n: int
    logprobs: int
    prompt_logprobs: int
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    logit_bias: _containers.ScalarMap[int, float]
    min_p: float
    allowed_token_ids: _containers.RepeatedScalarFieldContainer[int]
    bad_words: _containers.RepeatedScalarFieldContainer[str]
    lora_scale: float
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., max_new_tokens: _Optional[int] = ..., min_new_tokens: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., n: _Optional[int] = ..., logprobs: _Optional[int] = ..., prompt_logprobs: _Optional[int] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., min_p: _Optional[float] = ..., allowed_token_ids: _Optional[_Iterable[int]] = ..., bad_words: _Optional[_Iterable[str]] = ..., lora_scale: _Optional[float] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class StructuredOutputs(_message.Message):
    __slots__ = ("json_schema", "json_object", "regex", "choice", "grammar", "max_whitespace", "any_whitespace")
    class Choices(_message.Message):
        __slots__ = ("choices",)
        CHOICES_FIELD_NUMBER: _ClassVar[int]
        choices: _containers.RepeatedScalarFieldContainer[str]
        def __init__(self, choices: _Optional[_Iterable[str]] = ...) -> None: ...
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    CHOICE_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    MAX_WHITESPACE_FIELD_NUMBER: _ClassVar[int]
    ANY_WHITESPACE_FIELD_NUMBER: _ClassVar[int]
    json_schema: str
    json_object: bool
    regex: str
    choice: StructuredOutputs.Choices
    grammar: str
    max_whitespace: int
    any_whitespace: bool
    def __init__(self, json_schema: _Optional[str] = ..., json_object: _Optional[bool] = ..., regex: _Optional[str] = ..., choice: _Optional[_Union[StructuredOutputs.Choices, _Mapping]] = ..., grammar: _Optional[str] = ..., max_whitespace: _Optional[int] = ..., any_whitespace: _Optional[bool] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "adapter", "prompt", "prompt_token_ids", "params", "apply_chat_template", "messages", "structured_outputs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    APPLY_CHAT_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    adapter: str
    prompt: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    params: SamplingParams
    apply_chat_template: bool
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    structured_outputs: StructuredOutputs
    def __init__(self, request_id: _Optional[str] = ..., adapter: _Optional[str] = ..., prompt: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., params: _Optional[_Union[SamplingParams, _Mapping]] = ..., apply_chat_template: _Optional[bool] = ..., messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., structured_outputs: _Optional[_Union[StructuredOutputs, _Mapping]] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "cached_prompt_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_prompt_tokens: _Optional[int] = ...) -> None: ...

class TopLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "rank")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    rank: int
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., rank: _Optional[int] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "rank", "top")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    rank: int
    top: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., rank: _Optional[int] = ..., top: _Optional[_Iterable[_Union[TopLogprob, _Mapping]]] = ...) -> None: ...

class Choice(_message.Message):
    __slots__ = ("index", "text", "token_ids", "finish_reason", "logprobs", "cumulative_logprob")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    CUMULATIVE_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    index: int
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: str
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    cumulative_logprob: float
    def __init__(self, index: _Optional[int] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[str] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., cumulative_logprob: _Optional[float] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "adapter", "text", "token_ids", "finish_reason", "usage", "choices", "prompt_logprobs", "logprobs", "cumulative_logprob", "adapter_version")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    CHOICES_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    CUMULATIVE_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_VERSION_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    adapter: str
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: str
    usage: Usage
    choices: _containers.RepeatedCompositeFieldContainer[Choice]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    cumulative_logprob: float
    adapter_version: int
    def __init__(self, request_id: _Optional[str] = ..., adapter: _Optional[str] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[str] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., choices: _Optional[_Iterable[_Union[Choice, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., cumulative_logprob: _Optional[float] = ..., adapter_version: _Optional[int] = ...) -> None: ...

class GenerateStreamResponse(_message.Message):
    __slots__ = ("request_id", "adapter", "text", "token_ids", "finish_reason", "usage", "finished", "index", "logprobs", "prompt_logprobs", "cumulative_logprob", "adapter_version")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    CUMULATIVE_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_VERSION_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    adapter: str
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: str
    usage: Usage
    finished: bool
    index: int
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    cumulative_logprob: float
    adapter_version: int
    def __init__(self, request_id: _Optional[str] = ..., adapter: _Optional[str] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[str] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., finished: _Optional[bool] = ..., index: _Optional[int] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., cumulative_logprob: _Optional[float] = ..., adapter_version: _Optional[int] = ...) -> None: ...

class AdapterInfo(_message.Message):
    __slots__ = ("name", "path", "state", "rank", "target_modules", "size_bytes", "active_requests", "pinned", "preloaded", "error", "replicas", "version")
    class State(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        STATE_UNSPECIFIED: _ClassVar[AdapterInfo.State]
        ON_DISK: _ClassVar[AdapterInfo.State]
        LOADING: _ClassVar[AdapterInfo.State]
        ON_CPU: _ClassVar[AdapterInfo.State]
        ON_DEVICE: _ClassVar[AdapterInfo.State]
        FAILED: _ClassVar[AdapterInfo.State]
    STATE_UNSPECIFIED: AdapterInfo.State
    ON_DISK: AdapterInfo.State
    LOADING: AdapterInfo.State
    ON_CPU: AdapterInfo.State
    ON_DEVICE: AdapterInfo.State
    FAILED: AdapterInfo.State
    NAME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    TARGET_MODULES_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    PINNED_FIELD_NUMBER: _ClassVar[int]
    PRELOADED_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    name: str
    path: str
    state: AdapterInfo.State
    rank: int
    target_modules: _containers.RepeatedScalarFieldContainer[str]
    size_bytes: int
    active_requests: int
    pinned: bool
    preloaded: bool
    error: str
    replicas: _containers.RepeatedCompositeFieldContainer[ReplicaAdapter]
    version: int
    def __init__(self, name: _Optional[str] = ..., path: _Optional[str] = ..., state: _Optional[_Union[AdapterInfo.State, str]] = ..., rank: _Optional[int] = ..., target_modules: _Optional[_Iterable[str]] = ..., size_bytes: _Optional[int] = ..., active_requests: _Optional[int] = ..., pinned: _Optional[bool] = ..., preloaded: _Optional[bool] = ..., error: _Optional[str] = ..., replicas: _Optional[_Iterable[_Union[ReplicaAdapter, _Mapping]]] = ..., version: _Optional[int] = ...) -> None: ...

class ReplicaAdapter(_message.Message):
    __slots__ = ("replica", "state", "active_requests")
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    replica: str
    state: AdapterInfo.State
    active_requests: int
    def __init__(self, replica: _Optional[str] = ..., state: _Optional[_Union[AdapterInfo.State, str]] = ..., active_requests: _Optional[int] = ...) -> None: ...

class LoadAdapterRequest(_message.Message):
    __slots__ = ("name", "path", "replace", "pin")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    REPLACE_FIELD_NUMBER: _ClassVar[int]
    PIN_FIELD_NUMBER: _ClassVar[int]
    name: str
    path: str
    replace: bool
    pin: bool
    def __init__(self, name: _Optional[str] = ..., path: _Optional[str] = ..., replace: _Optional[bool] = ..., pin: _Optional[bool] = ...) -> None: ...

class UploadAdapterRequest(_message.Message):
    __slots__ = ("header", "chunk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: UploadAdapterHeader
    chunk: bytes
    def __init__(self, header: _Optional[_Union[UploadAdapterHeader, _Mapping]] = ..., chunk: _Optional[bytes] = ...) -> None: ...

class UploadAdapterHeader(_message.Message):
    __slots__ = ("name", "adapter_config", "replace", "pin", "size_bytes")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_CONFIG_FIELD_NUMBER: _ClassVar[int]
    REPLACE_FIELD_NUMBER: _ClassVar[int]
    PIN_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    name: str
    adapter_config: str
    replace: bool
    pin: bool
    size_bytes: int
    def __init__(self, name: _Optional[str] = ..., adapter_config: _Optional[str] = ..., replace: _Optional[bool] = ..., pin: _Optional[bool] = ..., size_bytes: _Optional[int] = ...) -> None: ...

class ResetPrefixCacheRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ResetPrefixCacheResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class UnloadAdapterRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class UnloadAdapterResponse(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class ListAdaptersRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListAdaptersResponse(_message.Message):
    __slots__ = ("adapters",)
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    adapters: _containers.RepeatedCompositeFieldContainer[AdapterInfo]
    def __init__(self, adapters: _Optional[_Iterable[_Union[AdapterInfo, _Mapping]]] = ...) -> None: ...

class GetServerInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetServerInfoResponse(_message.Message):
    __slots__ = ("version", "model", "served_model_name", "dtype", "device", "max_model_len", "kv_cache_tokens", "block_size", "max_num_seqs", "max_queue", "max_num_batched_tokens", "max_loras", "max_lora_rank", "max_cpu_loras", "kv_cache_memory", "gpu_memory_utilization", "vocab_size", "api_token_required", "admin_token_required", "tls", "adapter_roots", "status", "max_loras_setting", "lora_memory", "lora_capacity", "lora_memory_committed", "kv_cache_bytes", "kv_cache_committed", "weights_format", "weights_bits", "weights_bytes", "lora_extras_memory", "lora_extras_used")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    SERVED_MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_SEQS_FIELD_NUMBER: _ClassVar[int]
    MAX_QUEUE_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_BATCHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_LORAS_FIELD_NUMBER: _ClassVar[int]
    MAX_LORA_RANK_FIELD_NUMBER: _ClassVar[int]
    MAX_CPU_LORAS_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_MEMORY_FIELD_NUMBER: _ClassVar[int]
    GPU_MEMORY_UTILIZATION_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    API_TOKEN_REQUIRED_FIELD_NUMBER: _ClassVar[int]
    ADMIN_TOKEN_REQUIRED_FIELD_NUMBER: _ClassVar[int]
    TLS_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_ROOTS_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    MAX_LORAS_SETTING_FIELD_NUMBER: _ClassVar[int]
    LORA_MEMORY_FIELD_NUMBER: _ClassVar[int]
    LORA_CAPACITY_FIELD_NUMBER: _ClassVar[int]
    LORA_MEMORY_COMMITTED_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_COMMITTED_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FORMAT_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_BITS_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_BYTES_FIELD_NUMBER: _ClassVar[int]
    LORA_EXTRAS_MEMORY_FIELD_NUMBER: _ClassVar[int]
    LORA_EXTRAS_USED_FIELD_NUMBER: _ClassVar[int]
    version: str
    model: str
    served_model_name: str
    dtype: str
    device: str
    max_model_len: int
    kv_cache_tokens: int
    block_size: int
    max_num_seqs: int
    max_queue: int
    max_num_batched_tokens: int
    max_loras: int
    max_lora_rank: int
    max_cpu_loras: int
    kv_cache_memory: int
    gpu_memory_utilization: float
    vocab_size: int
    api_token_required: bool
    admin_token_required: bool
    tls: bool
    adapter_roots: _containers.RepeatedScalarFieldContainer[str]
    status: str
    max_loras_setting: str
    lora_memory: int
    lora_capacity: str
    lora_memory_committed: int
    kv_cache_bytes: int
    kv_cache_committed: int
    weights_format: str
    weights_bits: float
    weights_bytes: int
    lora_extras_memory: int
    lora_extras_used: int
    def __init__(self, version: _Optional[str] = ..., model: _Optional[str] = ..., served_model_name: _Optional[str] = ..., dtype: _Optional[str] = ..., device: _Optional[str] = ..., max_model_len: _Optional[int] = ..., kv_cache_tokens: _Optional[int] = ..., block_size: _Optional[int] = ..., max_num_seqs: _Optional[int] = ..., max_queue: _Optional[int] = ..., max_num_batched_tokens: _Optional[int] = ..., max_loras: _Optional[int] = ..., max_lora_rank: _Optional[int] = ..., max_cpu_loras: _Optional[int] = ..., kv_cache_memory: _Optional[int] = ..., gpu_memory_utilization: _Optional[float] = ..., vocab_size: _Optional[int] = ..., api_token_required: _Optional[bool] = ..., admin_token_required: _Optional[bool] = ..., tls: _Optional[bool] = ..., adapter_roots: _Optional[_Iterable[str]] = ..., status: _Optional[str] = ..., max_loras_setting: _Optional[str] = ..., lora_memory: _Optional[int] = ..., lora_capacity: _Optional[str] = ..., lora_memory_committed: _Optional[int] = ..., kv_cache_bytes: _Optional[int] = ..., kv_cache_committed: _Optional[int] = ..., weights_format: _Optional[str] = ..., weights_bits: _Optional[float] = ..., weights_bytes: _Optional[int] = ..., lora_extras_memory: _Optional[int] = ..., lora_extras_used: _Optional[int] = ...) -> None: ...

class GetStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetStatsResponse(_message.Message):
    __slots__ = ("num_waiting", "num_running", "num_in_flight", "kv_blocks_total", "kv_blocks_used", "prefix_cache_hits", "prefix_cache_queries", "num_adapters", "requests_total", "lora_slots_total", "lora_slots_in_use", "adapters_loaded", "adapters_on_device", "adapters_in_host", "lora_pool_units_total", "lora_pool_units_used")
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_USED_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_QUERIES_FIELD_NUMBER: _ClassVar[int]
    NUM_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    LORA_SLOTS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    LORA_SLOTS_IN_USE_FIELD_NUMBER: _ClassVar[int]
    ADAPTERS_LOADED_FIELD_NUMBER: _ClassVar[int]
    ADAPTERS_ON_DEVICE_FIELD_NUMBER: _ClassVar[int]
    ADAPTERS_IN_HOST_FIELD_NUMBER: _ClassVar[int]
    LORA_POOL_UNITS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    LORA_POOL_UNITS_USED_FIELD_NUMBER: _ClassVar[int]
    num_waiting: int
    num_running: int
    num_in_flight: int
    kv_blocks_total: int
    kv_blocks_used: int
    prefix_cache_hits: int
    prefix_cache_queries: int
    num_adapters: int
    requests_total: int
    lora_slots_total: int
    lora_slots_in_use: int
    adapters_loaded: int
    adapters_on_device: int
    adapters_in_host: int
    lora_pool_units_total: int
    lora_pool_units_used: int
    def __init__(self, num_waiting: _Optional[int] = ..., num_running: _Optional[int] = ..., num_in_flight: _Optional[int] = ..., kv_blocks_total: _Optional[int] = ..., kv_blocks_used: _Optional[int] = ..., prefix_cache_hits: _Optional[int] = ..., prefix_cache_queries: _Optional[int] = ..., num_adapters: _Optional[int] = ..., requests_total: _Optional[int] = ..., lora_slots_total: _Optional[int] = ..., lora_slots_in_use: _Optional[int] = ..., adapters_loaded: _Optional[int] = ..., adapters_on_device: _Optional[int] = ..., adapters_in_host: _Optional[int] = ..., lora_pool_units_total: _Optional[int] = ..., lora_pool_units_used: _Optional[int] = ...) -> None: ...
