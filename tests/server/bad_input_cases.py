"""The bad-input tables of tests/server/test_bad_inputs.py, as data: ``Case(id, call, kwargs,
code, fragment)`` for gRPC (``call`` is ``generate``, sent unary and streaming, ``load`` or
``unload``; a ``load`` path written ``@name`` is the broken adapter dir ``name``,
broken_adapters.py) and ``HttpCase(id, path, body, status, fragment)`` for the HTTP front of
the same server."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from loraplex.lora.adapter_vocab import MAX_TOKENIZER_FILE_BYTES

from tests.server.broken_adapters import CONFIG, WEIGHTS

ALIAS = "tiny-base"
GOOD = "good"
VOCAB = 384  # tests/conftest.py TINY_COMMON
MAX_MODEL_LEN = 256  # tests/server/conftest.py ENGINE_KW
MAX_NUM_SEQS = 32  # tests/server/conftest.py ENGINE_KW
MAX_LOGPROBS = 20  # the engine's default --max-logprobs


@dataclass(frozen=True)
class Case:
    id: str
    call: str  # generate | load | unload
    kwargs: dict[str, Any] = field(hash=False)
    code: str  # grpc.StatusCode name
    fragment: str  # the message must contain it


def gen(id: str, code: str, fragment: str, **kwargs: Any) -> Case:
    kwargs.setdefault("prompt", "the cat")
    return Case(id, "generate", kwargs, code, fragment)


def load(id: str, code: str, fragment: str, name: str = "new", path: str = "@ok",
         **kwargs: Any) -> Case:
    return Case(id, "load", {"name": name, "path": path, **kwargs}, code, fragment)


INVALID, NOT_FOUND = "INVALID_ARGUMENT", "NOT_FOUND"
BAD_SCHEMA = {"type": "object", "properties": {"a": {"type": "strin"}}}  # no such type
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
NAN, INF = math.nan, math.inf

GENERATE_CASES = [
    # SamplingParams, field by field
    gen("temperature-negative", INVALID, "temperature", temperature=-0.5),
    gen("temperature-nan", INVALID, "temperature", temperature=NAN),
    gen("temperature-inf", INVALID, "temperature", temperature=INF),
    gen("top_p-zero", INVALID, "top_p", top_p=0.0),
    gen("top_p-negative", INVALID, "top_p", top_p=-0.1),
    gen("top_p-above-one", INVALID, "top_p", top_p=1.5),
    gen("top_p-nan", INVALID, "top_p", top_p=NAN),
    gen("top_k-minus-two", INVALID, "top_k", top_k=-2),
    gen("top_k-int32-min", INVALID, "top_k", top_k=-(2**31)),
    gen("seed-2**63", INVALID, "seed", seed=2**63),
    gen("seed-uint64-max", INVALID, "seed", seed=2**64 - 1),
    gen("max_new_tokens-zero", INVALID, "max_new_tokens", max_new_tokens=0),
    gen("max_new_tokens-uint32-max", INVALID, "does not fit", max_new_tokens=2**32 - 1),
    gen("max_new_tokens-past-max_model_len", INVALID, "at most",
        prompt_token_ids=[5] * 250, prompt=None, max_new_tokens=10),
    gen("min_new_tokens-above-max_new_tokens", INVALID, "min_new_tokens", max_new_tokens=2,
        min_new_tokens=5),
    gen("min_new_tokens-huge-no-max", INVALID, "min_new_tokens", min_new_tokens=2**32 - 1),
    gen("stop-empty-string", INVALID, "stop strings", stop=["ok", ""]),
    gen("stop_token_ids-equal-vocab", INVALID, "stop_token_ids", stop_token_ids=[VOCAB],
        min_new_tokens=1),
    gen("stop_token_ids-uint32-max", INVALID, "stop_token_ids", stop_token_ids=[2**32 - 1],
        min_new_tokens=2),
    # the sampling outputs and processors (issue 29)
    gen("logprobs-over-max_logprobs", INVALID, "logprobs", logprobs=MAX_LOGPROBS + 1),
    gen("prompt_logprobs-over-max_logprobs", INVALID, "prompt_logprobs",
        prompt_logprobs=MAX_LOGPROBS + 1),
    gen("n-zero", INVALID, "n=0", n=0),
    gen("n-over-max_num_seqs", INVALID, f"n={MAX_NUM_SEQS + 1}", n=MAX_NUM_SEQS + 1),
    gen("logit_bias-key-equal-vocab", INVALID, "logit_bias", logit_bias={VOCAB: 1.0}),
    gen("logit_bias-value-over-100", INVALID, "logit_bias", logit_bias={5: 100.5}),
    gen("logit_bias-value-nan", INVALID, "logit_bias", logit_bias={5: NAN}),
    gen("presence_penalty-over-2", INVALID, "presence_penalty", presence_penalty=2.5),
    gen("frequency_penalty-under-minus-2", INVALID, "frequency_penalty",
        frequency_penalty=-2.5),
    gen("repetition_penalty-zero", INVALID, "repetition_penalty", repetition_penalty=0.0),
    gen("min_p-negative", INVALID, "min_p", min_p=-0.1),
    gen("min_p-over-one", INVALID, "min_p", min_p=1.5),
    # the per-request adapter scale (issue 46)
    gen("lora_scale-negative", INVALID, "lora_scale", lora_scale=-0.5, adapter=GOOD),
    gen("lora_scale-over-4", INVALID, "lora_scale", lora_scale=4.5, adapter=GOOD),
    gen("lora_scale-nan", INVALID, "lora_scale", lora_scale=NAN, adapter=GOOD),
    gen("lora_scale-inf", INVALID, "lora_scale", lora_scale=INF, adapter=GOOD),
    gen("allowed_token_ids-equal-vocab", INVALID, "allowed_token_ids",
        allowed_token_ids=[5, VOCAB]),
    # structured outputs (issue 30)
    gen("structured_outputs-json-does-not-compile", INVALID, "does not compile",
        structured_outputs={"json": BAD_SCHEMA}),
    gen("structured_outputs-json-not-json", INVALID, "not valid JSON",
        structured_outputs={"json": '{"type": '}),
    gen("structured_outputs-bad-regex", INVALID, "regex does not compile",
        structured_outputs={"regex": "[0-9"}),
    gen("structured_outputs-empty-choice", INVALID, "choice is empty",
        structured_outputs={"choice": []}),
    gen("structured_outputs-bad-grammar", INVALID, "grammar", structured_outputs={
        "grammar": "root ::= nothing"}),
    gen("structured_outputs-no-constraint", INVALID, "no constraint", structured_outputs={}),
    gen("structured_outputs-with-ignore_eos", INVALID, "ignore_eos",
        structured_outputs={"regex": "[a-z]+"}, ignore_eos=True),
    # prompts
    gen("prompt-missing", INVALID, "no prompt", prompt=None),
    gen("prompt-only-spaces", INVALID, "prompt is empty", prompt="   "),
    gen("prompt-ids-over-max_model_len", INVALID, "max_model_len", prompt=None,
        prompt_token_ids=[5] * MAX_MODEL_LEN),
    gen("prompt-text-over-max_model_len", INVALID, "max_model_len", prompt="the " * 300),
    gen("prompt-and-prompt_token_ids", INVALID, "exactly one", prompt_token_ids=[5, 6]),
    gen("token-id-equal-vocab", INVALID, "out of range", prompt=None,
        prompt_token_ids=[5, VOCAB]),
    gen("token-id-uint32-max", INVALID, "out of range", prompt=None,
        prompt_token_ids=[2**32 - 1]),
    gen("chat-template-on-token-ids", INVALID, "apply_chat_template", prompt=None,
        prompt_token_ids=[5], apply_chat_template=True),
    gen("request_id-over-long", INVALID, "request_id", request_id="r" * 257),
    gen("messages-and-prompt", INVALID, "exactly one",
        messages=[{"role": "user", "content": "the cat"}]),
    gen("messages-role-unknown", INVALID, "role", prompt=None,
        messages=[{"role": "wizard", "content": "the cat"}]),
    gen("messages-over-max_model_len", INVALID, "max_model_len", prompt=None,
        messages=[{"role": "user", "content": "the " * 300}]),
    # adapter names
    gen("adapter-unknown", NOT_FOUND, "'nope'", adapter="nope"),
    gen("adapter-over-long", NOT_FOUND, "unknown adapter", adapter="x" * 20000),
    gen("adapter-control-chars", NOT_FOUND, "unknown adapter", adapter="a\x00b\n\x1b[2J"),
    # a path-like name is not canonical (issue 42): INVALID_ARGUMENT, not NOT_FOUND
    gen("adapter-unloaded-never-loaded-path", INVALID, "'..' segment",
        adapter="../../etc/passwd"),
]

# ---- bounded request fields, logprobs -1, unknown models (issue 42: helper c) ----------------
# The caps of engine/engine_config.py's request limits (defaults), one check for every front; each
# message names the field, the cap and the flag. -1 asks for the whole vocabulary (384),
# over the default --max-logprobs 20. gRPC refuses a message over --max-request-bytes.
BIG = 5 << 20  # over the default --max-request-bytes (4 MiB)
LIMIT_CASES = [
    gen("stop-over-max-stop-strings", INVALID, "at most 64 (--max-stop-strings)",
        stop=[f"s{i}" for i in range(65)]),
    gen("stop-string-over-max-word-chars", INVALID, "stop[1] has 1025 characters",
        stop=["ok", "x" * 1025]),
    gen("stop_token_ids-over-max-stop-token-ids", INVALID, "(--max-stop-token-ids)",
        stop_token_ids=[5] * 257),
    gen("bad_words-over-max-bad-words", INVALID, "at most 1024 (--max-bad-words)",
        bad_words=["cat"] * 1025),
    gen("bad_words-300000", INVALID, "bad_words has 300000 words", bad_words=["cat"] * 300_000),
    gen("bad_word-over-max-word-chars", INVALID, "(--max-word-chars)",
        bad_words=["y" * 1025]),
    gen("bad_words-over-max-bad-words-chars", INVALID, "(--max-bad-words-chars)",
        bad_words=["z" * 1000] * 100),
    gen("logit_bias-over-max-logit-bias", INVALID, "at most 1024 (--max-logit-bias)",
        logit_bias={i: 1.0 for i in range(1025)}),
    gen("allowed_token_ids-over-the-vocabulary", INVALID,
        f"at most {VOCAB} (--max-allowed-token-ids)", allowed_token_ids=[5] * (VOCAB + 1)),
    gen("logprobs-minus-one-over-max_logprobs", INVALID,
        f"logprobs=-1 asks for all {VOCAB} tokens", logprobs=-1),
    gen("prompt_logprobs-minus-one-over-max_logprobs", INVALID,
        f"at most {MAX_LOGPROBS} (--max-logprobs", prompt_logprobs=-1),
    gen("logprobs-minus-two", INVALID, "logprobs=-2", logprobs=-2),
    gen("message-over-max-request-bytes", "RESOURCE_EXHAUSTED", "larger than max",
        prompt="x" * BIG),
    gen("adapter-unknown-names-the-base-model", NOT_FOUND,
        f"the base model is '{ALIAS}' (or an empty name)", adapter="nope"),
]
GENERATE_CASES += LIMIT_CASES

# ---- the grammar compiler's limits (issue 42, items 6 and 15): refused before any compile
def nested_schema(levels: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "integer"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


DEEP_SCHEMA = nested_schema(400)  # "maximum recursion depth exceeded" before issue 42
DEEP_TEXT = '{"a":' * 5000 + "1" + "}" * 5000  # past Python's own parser
BIG_SCHEMA = {"type": "string", "description": "x" * 70_000}  # past --max-grammar-bytes
NESTED_PATTERN = {"type": "string", "pattern": "^([a-z]{1,20}){1,20}$"}  # ~15 s to compile
GENERATE_CASES += [
    gen("structured_outputs-json-400-deep", INVALID, "nests more than 64 levels",
        structured_outputs={"json": DEEP_SCHEMA}),
    gen("structured_outputs-json-text-5000-deep", INVALID, "nests too deeply",
        structured_outputs={"json": DEEP_TEXT}),
    gen("structured_outputs-json-over-max-grammar-bytes", INVALID, "--max-grammar-bytes",
        structured_outputs={"json": BIG_SCHEMA}),
    gen("structured_outputs-regex-over-max-grammar-bytes", INVALID, "regex takes 70000 bytes",
        structured_outputs={"regex": "a" * 70_000}),
    gen("structured_outputs-choice-over-max-grammar-bytes", INVALID, "choice takes",
        structured_outputs={"choice": ["x" * 99] * 700}),
    gen("structured_outputs-grammar-over-max-grammar-bytes", INVALID, "grammar takes",
        structured_outputs={"grammar": "root ::= " + '"a" ' * 20_000}),
    gen("structured_outputs-pattern-nested-repetition", INVALID, "multiply to 400",
        structured_outputs={"json": NESTED_PATTERN}),
]

LOAD_CASES = [
    # names
    load("name-empty", INVALID, "name is empty", name=""),
    load("name-over-long", INVALID, "1 to 128 characters", name="n" * 129),
    load("name-control-char", INVALID, "not allowed", name="bad\x07name"),
    load("name-newline", INVALID, "not allowed", name="bad\nname"),
    load("name-leading-dot", INVALID, "not allowed", name=".hidden"),
    load("name-is-served-model-name", INVALID, "served model name", name=ALIAS),
    load("name-duplicate", "ALREADY_EXISTS", "already exists", name=GOOD),
    # paths
    load("path-empty", INVALID, "path is empty", path=""),
    load("path-missing", INVALID, "does not exist", path="@missing"),
    load("path-dotdot-escape", "PERMISSION_DENIED", "outside the adapter roots",
         path="@ok/../../outside"),
    load("path-relative-escape", "PERMISSION_DENIED", "outside the adapter roots",
         path="../../../../../../etc"),
    load("path-symlink-out-of-root", "PERMISSION_DENIED", "outside the adapter roots",
         path="@symlink-out"),
    load("path-is-a-file", INVALID, "is a file", path=f"@ok/{CONFIG}"),
    # contents
    load("no-config", INVALID, f"{CONFIG} is missing", path="@no-config"),
    load("config-without-weights", INVALID, f"{WEIGHTS} is missing", path="@no-weights"),
    load("config-unparsable-json", INVALID, "not readable JSON", path="@bad-json"),
    load("config-json-list", INVALID, "JSON object", path="@json-list"),
    load("config-zero-bytes", INVALID, "is empty", path="@empty-config"),
    load("config-not-lora", INVALID, "not a LoRA adapter", path="@prefix-tuning"),
    load("config-dora-without-magnitudes", INVALID,
         "no lora_magnitude_vector, but adapter_config.json has use_dora=true", path="@dora"),
    load("config-bias", INVALID, "bias='all'", path="@bias"),
    load("config-modules_to_save", INVALID, "modules_to_save", path="@modules-to-save"),
    load("config-target-embed_tokens", INVALID, "cannot be wrapped", path="@embed-target"),
    load("alora-invocation-outside-vocab", INVALID, "alora_invocation_tokens",
         path="@alora-vocab"),
    # an adapter's own token rows (issue 46): other modules_to_save, another vocabulary
    load("config-modules_to_save-norm", INVALID, "modules_to_save=['norm'] is not supported",
         path="@modules-to-save-norm"),
    load("modules_to_save-other-vocabulary", INVALID,
         "its vocabulary of 388 tokens differs from the base model's 384",
         path="@head-other-vocab"),
    load("adapter-tokenizer-moves-base-ids", INVALID,
         "its tokenizer does not extend the base model's", path="@tokenizer-moves-base-ids"),
    load("adapter-tokenizer-too-large", INVALID,
         f"tokenizer.json is {MAX_TOKENIZER_FILE_BYTES + 1} bytes, over the "
         f"{MAX_TOKENIZER_FILE_BYTES} bytes (64 MiB)", path="@tokenizer-too-large"),
    load("adapter-tokenizer-other-table", INVALID,
         "its vocabulary of 388 tokens differs from its tokenizer's 386",
         path="@tokenizer-other-table"),
    load("rank-over-limit", INVALID, "above max_lora_rank", path="@rank-32"),
    load("another-base-model", INVALID, "differs from the served base", path="@other-base"),
    load("wrong-shapes", INVALID, "has shape", path="@wrong-shape"),
    load("pickle-bin-only", INVALID, "pickle", path="@pickle-only"),
    load("truncated-safetensors", INVALID, "truncated or corrupt", path="@truncated"),
    load("garbage-safetensors", INVALID, "truncated or corrupt", path="@garbage"),
    load("weights-zero-bytes", INVALID, "is empty (0 bytes)", path="@empty-weights"),
    load("nan-weights", INVALID, "NaN or Inf", path="@nan"),
    load("inf-weights", INVALID, "NaN or Inf", path="@inf"),
    load("integer-weights", INVALID, "floating point", path="@int-weights"),
    load("lora_A-without-lora_B", INVALID, "no matching lora_B", path="@a-only"),
    load("layer-out-of-range", INVALID, "the base model has 2 layers", path="@layer-9"),
    load("non-lora-tensor", INVALID, "not a LoRA weight", path="@base-tensor"),
    load("replace-with-broken-keeps-old", INVALID, "NaN or Inf", name=GOOD, path="@nan",
         replace=True),
]

UNLOAD_CASES = [
    Case("unload-empty-name", "unload", {"name": ""}, INVALID, "name is empty"),
    Case("unload-unknown", "unload", {"name": "nope"}, NOT_FOUND, "unknown adapter 'nope'"),
    Case("unload-control-chars", "unload", {"name": "a\x00b"}, NOT_FOUND, "unknown adapter"),
]

# ---- issue 42 item 9: weights that overflow the serving dtype once applied ---------------
LOAD_CASES += [
    load("weights-1e30-overflow", INVALID, "adapter 'new': model.layers.0.", path="@overflow-1e30"),
    load("weights-product-overflows", INVALID, "would overflow float32 once applied",
         path="@overflow-product"),
    load("replace-with-overflowing-keeps-old", INVALID, "above the bound", name=GOOD,
         path="@overflow-product", replace=True),
]

# ---- uploads (issue 42, item 8): AdapterAdmin/UploadAdapter's stream ----------------------
# ``upload(id, ...)`` sends the files of ``path`` (``@name``: a broken dir, as ``load``'s) as
# the client does (header, then 1 KiB chunks), changed by: ``first="chunk"`` (no header
# first), ``messages="none"``, ``config`` (header.adapter_config's text), ``size_bytes``
# (declared), ``extra_header`` (a second header after the first chunk). The message never
# shows the store's paths (test_bad_inputs.py checks).
def upload(id: str, code: str, fragment: str, name: str = "up-new", path: str = "@ok",
           **kwargs: Any) -> Case:
    return Case(id, "upload", {"name": name, "path": path, **kwargs}, code, fragment)


UPLOAD_CASES = [
    upload("upload-chunk-before-header", INVALID, "must be the header", first="chunk"),
    upload("upload-no-messages", INVALID, "must be the header", messages="none"),
    upload("upload-config-empty", INVALID, "adapter_config is empty", config=" "),
    upload("upload-size_bytes-over-max", "RESOURCE_EXHAUSTED", "--max-upload-bytes",
           size_bytes=2**40),
    upload("upload-ends-short-of-size_bytes", INVALID, "ended after", size_bytes=10**6),
    upload("upload-longer-than-size_bytes", INVALID, "header.size_bytes", size_bytes=100),
    upload("upload-second-header", INVALID, "one header", extra_header=True),
    upload("upload-no-weights", INVALID, "carried no weights", path="@empty-weights"),
    upload("upload-name-taken", "ALREADY_EXISTS", "already exists", name=GOOD),
    upload("upload-name-is-served-model-name", INVALID, "served model name", name=ALIAS),
    upload("upload-name-empty", INVALID, "name is empty", name=""),
    upload("upload-config-not-json", INVALID, "not readable JSON", path="@bad-json"),
    upload("upload-config-not-lora", INVALID, "not a LoRA adapter", path="@prefix-tuning"),
    upload("upload-garbage-safetensors", INVALID, "truncated or corrupt", path="@garbage"),
    upload("upload-nan-weights", INVALID, "NaN or Inf", path="@nan"),
    upload("upload-rank-over-limit", INVALID, "above max_lora_rank", path="@rank-32"),
    upload("upload-replace-with-broken-keeps-old", INVALID, "NaN or Inf", name=GOOD,
           path="@nan", replace=True),
]

ALL_CASES = GENERATE_CASES + LOAD_CASES + UNLOAD_CASES + UPLOAD_CASES


# ---- the HTTP front -----------------------------------------------------------------------
@dataclass(frozen=True)
class HttpCase:
    id: str
    path: str
    body: Any = field(hash=False)  # a dict is sent as JSON; bytes as they are
    status: int = 400
    fragment: str = ""  # the error message must contain it


def completion(id: str, status: int, fragment: str, **fields: Any) -> HttpCase:
    return HttpCase(id, "/v1/completions",
                    {"model": GOOD, "prompt": "the cat", "max_tokens": 2, **fields},
                    status, fragment)


def chat(id: str, status: int, fragment: str, **fields: Any) -> HttpCase:
    body = {"model": GOOD, "messages": [{"role": "user", "content": "the cat"}],
            "max_tokens": 2, **fields}
    return HttpCase(id, "/v1/chat/completions", body, status, fragment)


HTTP_CASES = [
    HttpCase("malformed-json", "/v1/completions", b'{"model": "good", "prompt": ', 400,
             "not valid JSON"),
    HttpCase("body-not-an-object", "/v1/completions", b"[1, 2]", 400, "body"),
    completion("wrong-type-max_tokens", 400, "max_tokens", max_tokens="ten"),
    completion("wrong-type-prompt", 400, "prompt", prompt=5),
    completion("wrong-type-temperature", 400, "temperature", temperature="hot"),
    completion("wrong-type-stream", 400, "stream", stream="yes"),
    chat("wrong-type-messages", 400, "messages", messages="the cat"),
    completion("n-zero", 400, "n=0", n=0),
    chat("chat-n-over-max_num_seqs", 400, f"n={MAX_NUM_SEQS + 1}", n=MAX_NUM_SEQS + 1),
    completion("logprobs-over-max_logprobs", 400, "logprobs", logprobs=MAX_LOGPROBS + 1),
    chat("chat-top_logprobs-over-max_logprobs", 400, "logprobs", logprobs=True,
         top_logprobs=MAX_LOGPROBS + 1),
    chat("chat-top_logprobs-without-logprobs", 400, "top_logprobs", top_logprobs=2),
    completion("prompt_logprobs-over-max_logprobs", 400, "prompt_logprobs",
               prompt_logprobs=MAX_LOGPROBS + 1),
    completion("prompt_logprobs-with-stream", 400, "prompt_logprobs", prompt_logprobs=1,
               stream=True),
    completion("logit_bias-key-not-a-token-id", 400, "logit_bias", logit_bias={"cat": 5}),
    completion("logit_bias-key-equal-vocab", 400, "logit_bias", logit_bias={str(VOCAB): 5}),
    chat("chat-logit_bias-value-over-100", 400, "logit_bias", logit_bias={"5": 101}),
    completion("presence_penalty-over-2", 400, "presence_penalty", presence_penalty=3.0),
    chat("chat-frequency_penalty-under-minus-2", 400, "frequency_penalty",
         frequency_penalty=-3.0),
    completion("repetition_penalty-negative", 400, "repetition_penalty",
               repetition_penalty=-1.0),
    completion("min_p-over-one", 400, "min_p", min_p=1.5),
    chat("chat-min_p-negative", 400, "min_p", min_p=-0.5),
    completion("lora_scale-over-4", 400, "lora_scale", lora_scale=5.0, model=GOOD),
    chat("chat-lora_scale-negative", 400, "lora_scale", lora_scale=-1.0, model=GOOD),
    completion("best_of-2", 400, "best_of", best_of=2),
    completion("max_tokens-zero-without-echo", 400, "max_tokens", max_tokens=0),
    completion("max_tokens-past-max_model_len", 400, "max_tokens=250 is too large",
               prompt=[5] * 10, max_tokens=250),
    chat("chat-max_completion_tokens-past-max_model_len", 400, "max_completion_tokens",
         max_completion_tokens=MAX_MODEL_LEN),
    # structured outputs and tool calls (issue 30)
    completion("response_format-schema-does-not-compile", 400, "does not compile",
               response_format={"type": "json_schema",
                                "json_schema": {"name": "x", "schema": BAD_SCHEMA}}),
    chat("chat-response_format-json_schema-missing", 400, "json_schema",
         response_format={"type": "json_schema"}),
    chat("chat-response_format-type-unknown", 400, "response_format",
         response_format={"type": "yaml"}),
    chat("chat-structured_outputs-bad-regex", 400, "regex does not compile",
         structured_outputs={"regex": "[0-9"}),
    completion("structured_outputs-empty-choice", 400, "choice is empty",
               structured_outputs={"choice": []}),
    completion("structured_outputs-two-constraints", 400, "exactly one",
               structured_outputs={"regex": "a", "choice": ["a"]}),
    completion("structured_outputs-unknown-field", 400, "jsonschema",
               structured_outputs={"jsonschema": {}}),
    completion("structured_outputs-whitespace_pattern", 400, "whitespace_pattern",
               structured_outputs={"json_object": True, "whitespace_pattern": " ?"}),
    completion("structured_outputs-and-response_format", 400, "give one of them",
               structured_outputs={"regex": "a"}, response_format={"type": "json_object"}),
    completion("guided_json-replaced", 400, "structured_outputs.json", guided_json={}),
    chat("chat-tool_choice-not-among-tools", 400, "not among tools", tools=[TOOL],
         tool_choice={"type": "function", "function": {"name": "get_time"}}),
    chat("chat-tool_choice-without-tools", 400, "tools is empty", tool_choice="required"),
    chat("chat-tool_choice-unknown", 400, "tool_choice", tools=[TOOL],
         tool_choice="sometimes"),
    chat("chat-tools-auto-without-the-flag", 400, "--enable-auto-tool-choice", tools=[TOOL]),
    chat("chat-tools-duplicate-names", 400, "two functions", tools=[TOOL, TOOL],
         tool_choice="required"),
    chat("chat-tool_choice-and-response_format", 400, "leave response_format", tools=[TOOL],
         tool_choice="required", response_format={"type": "json_object"}),
    chat("chat-tool_calls-arguments-not-json", 400, "not valid JSON", messages=[
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function",
             "function": {"name": "get_weather", "arguments": "{bad"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]),
    completion("max_tokens-negative", 400, "max_tokens", max_tokens=-1),
    completion("prompt-over-max_model_len", 400, "max_model_len", prompt="the " * 300),
    completion("prompt-ids-over-max_model_len", 400, "max_model_len",
               prompt=[5] * MAX_MODEL_LEN),
    completion("stream-prompt-over-max_model_len", 400, "max_model_len",
               prompt="the " * 300, stream=True),
    chat("role-unknown", 400, "role", messages=[{"role": "wizard", "content": "hi"}]),
    chat("content-part-unknown", 400, "content",
         messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]),
    completion("temperature-negative", 400, "temperature", temperature=-1.0),
    completion("stream-temperature-negative", 400, "temperature", temperature=-1.0,
               stream=True),
    completion("token-id-equal-vocab", 400, "out of range", prompt=[5, VOCAB]),
    completion("several-prompts", 400, "one prompt", prompt=["a", "b"]),
    completion("unsupported-suffix", 400, "suffix", suffix=" the end"),
    completion("stream_options-without-stream", 400, "stream_options",
               stream_options={"include_usage": True}),
    completion("model-unknown", 404, "'nope'", model="nope"),
    chat("chat-model-unknown", 404, "'nope'", model="nope"),
    HttpCase("load-name-not-allowed", "/v1/load_lora_adapter",
             {"lora_name": ".hidden", "lora_path": "@ok"}, 400, "not allowed"),
    HttpCase("load-duplicate", "/v1/load_lora_adapter",
             {"lora_name": GOOD, "lora_path": "@ok"}, 400, "already exists"),
    HttpCase("load-outside-root", "/v1/load_lora_adapter",
             {"lora_name": "new", "lora_path": "../../../../../../etc"}, 403,
             "outside the adapter roots"),
    HttpCase("load-broken", "/v1/load_lora_adapter",
             {"lora_name": "new", "lora_path": "@nan"}, 400, "NaN or Inf"),
    HttpCase("load-tokenizer-too-large", "/v1/load_lora_adapter",
             {"lora_name": "new", "lora_path": "@tokenizer-too-large"}, 400,
             f"tokenizer.json is {MAX_TOKENIZER_FILE_BYTES + 1} bytes"),
    HttpCase("load-missing-field", "/v1/load_lora_adapter", {"lora_name": "new"}, 400,
             "lora_path"),
    HttpCase("unload-unknown", "/v1/unload_lora_adapter", {"lora_name": "nope"}, 404,
             "unknown adapter 'nope'"),
]


# ---- issue 42 (a): canonical adapter names, files confined to their root ------------------
# (a name with '.', '..' or empty segments, or a backslash, is a 400 wherever it comes in; an
# adapter dir inside the root whose files link out of it is PERMISSION_DENIED)
NAMES_AND_CONFINEMENT = [
    load("name-dotdot-segment", INVALID, "'..' segment", name="a/../b"),
    load("name-dot-segment", INVALID, "'.' or '..' segment", name="a/./b"),
    load("name-empty-segment", INVALID, "empty segment", name="a//b"),
    load("name-trailing-slash", INVALID, "empty segment", name="a/"),
    load("name-backslash", INVALID, "backslash", name="a\\b"),
    load("files-linked-out-of-root", "PERMISSION_DENIED", "outside", path="@links-out"),
    load("weights-linked-out-of-root", "PERMISSION_DENIED", "outside",
         path="@weights-link-out"),
    load("path-symlink-loop", INVALID, "dangling symlink", path="@symlink-loop"),
    gen("adapter-dotdot-segment", INVALID, "'..' segment", adapter=f"x/../{GOOD}"),
    gen("adapter-empty-segment", INVALID, "empty segment", adapter=f"{GOOD}//"),
    gen("adapter-backslash", INVALID, "backslash", adapter=f"x\\{GOOD}"),
]
NAMES_AND_CONFINEMENT_HTTP = [
    completion("model-dotdot-segment", 400, "'..' segment", model=f"x/../{GOOD}"),
    chat("chat-model-dot-segment", 400, "'.' or '..' segment", model=f"./{GOOD}"),
    completion("model-backslash", 400, "backslash", model=f"x\\{GOOD}"),
    HttpCase("tokenize-model-dotdot-segment", "/tokenize",
             {"model": f"x/../{GOOD}", "prompt": "hi"}, 400, "'..' segment"),
    HttpCase("load-name-dotdot-segment", "/v1/load_lora_adapter",
             {"lora_name": "a/../b", "lora_path": "@ok"}, 400, "'..' segment"),
    HttpCase("load-name-backslash", "/v1/load_lora_adapter",
             {"lora_name": "a\\b", "lora_path": "@ok"}, 400, "backslash"),
    HttpCase("load-files-linked-out-of-root", "/v1/load_lora_adapter",
             {"lora_name": "new", "lora_path": "@links-out"}, 403, "outside"),
    HttpCase("load-weights-linked-out-of-root", "/v1/load_lora_adapter",
             {"lora_name": "new", "lora_path": "@weights-link-out"}, 403, "outside"),
]
GENERATE_CASES += [c for c in NAMES_AND_CONFINEMENT if c.call == "generate"]
ALL_CASES += NAMES_AND_CONFINEMENT
HTTP_CASES += NAMES_AND_CONFINEMENT_HTTP
# ---- issue 42 items 9, 10: overflowing adapters; chat messages as the openai SDK sends them --
HTTP_CASES += [
    HttpCase("load-weights-product-overflows", "/v1/load_lora_adapter",
             {"lora_name": "new", "lora_path": "@overflow-product"}, 400, "would overflow"),
    chat("chat-tool_calls-without-function", 400, "function.name", messages=[
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function"}]}]),
    chat("chat-message-name-not-a-string", 400, "name",
         messages=[{"role": "user", "content": "hi", "name": 5}]),
    chat("chat-content-part-input_audio", 400, "content", messages=[{"role": "user", "content": [
        {"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}]}]),
    chat("chat-refusal-part-not-a-string", 400, "refusal", messages=[
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": [{"type": "refusal", "refusal": None}]}]),
]

# ---- bounded request fields, logprobs -1, unknown models (issue 42: helper c) ----------------
HTTP_CASES += [
    completion("stop-over-max-stop-strings", 400, "(--max-stop-strings)",
               stop=[f"s{i}" for i in range(65)]),
    chat("chat-stop-string-over-max-word-chars", 400, "(--max-word-chars)", stop="x" * 1025),
    completion("stop_token_ids-over-max-stop-token-ids", 400, "(--max-stop-token-ids)",
               stop_token_ids=[5] * 257),
    completion("bad_words-over-max-bad-words", 400, "(--max-bad-words)",
               bad_words=["cat"] * 1025),
    chat("chat-bad_words-300000", 400, "bad_words has 300000 words",
         bad_words=["cat"] * 300_000),
    completion("bad_word-over-max-word-chars", 400, "bad_words[0] has 1025 characters",
               bad_words=["y" * 1025]),
    chat("chat-bad_words-over-max-bad-words-chars", 400,
         "bad_words has 100000 characters in all", bad_words=["z" * 1000] * 100),
    completion("logit_bias-over-max-logit-bias", 400, "(--max-logit-bias)",
               logit_bias={str(i): 1 for i in range(1025)}),
    chat("chat-allowed_token_ids-over-the-vocabulary", 400, "(--max-allowed-token-ids)",
         allowed_token_ids=[5] * (VOCAB + 1)),
    completion("logprobs-minus-one-over-max_logprobs", 400,
               f"logprobs=-1 asks for all {VOCAB} tokens of the vocabulary; the server allows "
               f"at most {MAX_LOGPROBS} (--max-logprobs", logprobs=-1),
    completion("logprobs-minus-two", 400, "logprobs=-2 must be >= 0", logprobs=-2),
    chat("chat-top_logprobs-minus-one-over-max_logprobs", 400, "logprobs=-1 asks for all",
         logprobs=True, top_logprobs=-1),
    chat("chat-top_logprobs-minus-one-without-logprobs", 400, "needs logprobs=true",
         top_logprobs=-1),
    chat("chat-top_logprobs-minus-two", 400, "top_logprobs=-2", logprobs=True,
         top_logprobs=-2),
    completion("prompt_logprobs-minus-one-over-max_logprobs", 400,
               "prompt_logprobs=-1 asks for all", prompt_logprobs=-1),
    completion("guided_whitespace_pattern-refused", 400, "structured_outputs.max_whitespace",
               guided_whitespace_pattern=" ?"),
    HttpCase("body-over-max-request-bytes", "/v1/completions",
             b'{"model": "good", "prompt": "' + b"x" * BIG + b'"}', 413,
             f"at most {4 << 20} bytes (--max-request-bytes)"),
    completion("model-unknown-names-the-base-model", 404,
               f"the base model is '{ALIAS}' (or an empty name)", model="nope"),
    chat("chat-model-unknown-names-the-base-model", 404, "GET /v1/models or gRPC ListAdapters",
         model="nope"),
]

# ---- the grammar compiler's limits (issue 42, items 6 and 15), HTTP: every way a
# constraint comes in (structured_outputs, response_format, a tool's parameters)
def _format(schema: Any) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


def _tool(parameters: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"type": "function", "function": {"name": "f", "parameters": parameters}}]


HTTP_CASES += [
    completion("structured_outputs-json-400-deep", 400, "nests more than 64 levels",
               structured_outputs={"json": DEEP_SCHEMA}),
    completion("structured_outputs-json-text-5000-deep", 400, "nests too deeply",
               structured_outputs={"json": DEEP_TEXT}),
    chat("response_format-json-400-deep", 400, "(--max-schema-depth)",
         response_format=_format(DEEP_SCHEMA)),
    chat("tools-parameters-400-deep", 400, "nest too deeply for the chat template",
         tools=_tool(DEEP_SCHEMA), tool_choice="required"),
    chat("tools-parameters-70-deep", 400, "nests more than 64 levels",
         tools=_tool(nested_schema(70)), tool_choice="required"),
    chat("tools-named-over-max-grammar-bytes", 400, "--max-grammar-bytes",
         tools=_tool(BIG_SCHEMA), tool_choice={"type": "function", "function": {"name": "f"}}),
    completion("structured_outputs-json-over-max-grammar-bytes", 400, "--max-grammar-bytes",
               structured_outputs={"json": BIG_SCHEMA}),
    completion("structured_outputs-regex-over-max-grammar-bytes", 400,
               "regex takes 70000 bytes", structured_outputs={"regex": "a" * 70_000}),
    chat("chat-structured_outputs-choice-over-max-grammar-bytes", 400, "choice takes",
         structured_outputs={"choice": ["x" * 99] * 700}),
    completion("structured_outputs-grammar-over-max-grammar-bytes", 400, "grammar takes",
               structured_outputs={"grammar": "root ::= " + '"a" ' * 20_000}),
    completion("structured_outputs-pattern-nested-repetition", 400, "multiply to 400",
               structured_outputs={"json": NESTED_PATTERN}),
    chat("response_format-pattern-nested-repetition", 400, "multiply to 400",
         response_format=_format(NESTED_PATTERN)),
]
