"""The HTTP front's bad-input table of tests/server/test_bad_inputs.py, as data:
``HttpCase(id, path, body, status, fragment)``, sent to the same server as the gRPC table
(bad_input_cases.py, whose adapter dirs and limits it shares); a ``lora_path`` written
``@name`` is the broken adapter dir ``name`` (broken_adapters.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from loraplex.lora.adapter_files import MAX_CONFIG_FILE_BYTES
from loraplex.lora.adapter_vocab import MAX_TOKENIZER_FILE_BYTES

from tests.server.bad_input_cases import (
    ALIAS,
    BAD_SCHEMA,
    BIG,
    BIG_SCHEMA,
    DEEP_SCHEMA,
    DEEP_TEXT,
    GOOD,
    MAX_LOGPROBS,
    MAX_MODEL_LEN,
    MAX_NUM_SEQS,
    NESTED_PATTERN,
    TOOL,
    VOCAB,
    nested_schema,
)


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
    HttpCase("load-config-too-large", "/v1/load_lora_adapter",
             {"lora_name": "new", "lora_path": "@config-too-large"}, 400,
             f"adapter_config.json is {MAX_CONFIG_FILE_BYTES + 1} bytes"),
    HttpCase("load-missing-field", "/v1/load_lora_adapter", {"lora_name": "new"}, 400,
             "lora_path"),
    HttpCase("unload-unknown", "/v1/unload_lora_adapter", {"lora_name": "nope"}, 404,
             "unknown adapter 'nope'"),
]


# ---- issue 42 (a): canonical adapter names, files confined to their root, over HTTP
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
