"""The bad-input tables of tests/server/test_bad_inputs.py, as data: ``Case(id, call, kwargs,
code, fragment)`` for gRPC (``call`` is ``generate``, sent unary and streaming, ``load`` or
``unload``; a ``load`` path written ``@name`` is the broken adapter dir ``name``,
broken_adapters.py); the HTTP front's table, on the same server, is bad_http_cases.py."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from loraplex.lora.adapter_files import MAX_CONFIG_FILE_BYTES
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
    load("adapter-config-too-large", INVALID,
         f"adapter_config.json is {MAX_CONFIG_FILE_BYTES + 1} bytes, over the "
         f"{MAX_CONFIG_FILE_BYTES} bytes (4 MiB) a config file may hold",
         path="@config-too-large"),
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
GENERATE_CASES += [c for c in NAMES_AND_CONFINEMENT if c.call == "generate"]
ALL_CASES += NAMES_AND_CONFINEMENT
