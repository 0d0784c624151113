"""Proto messages <-> engine values: a GenerateRequest translated into the engine's
RequestInput (the prompt rules and the oneofs checked here); every value check is the
engine's InputProcessor's (engine/input_processor.py)."""

from __future__ import annotations

from typing import Any

from ...engine.input_processor import RequestInput
from ...engine.sampling_params import SamplingParams
from ...proto import loraplex_pb2 as pb
from ...structured.constraint import DEFAULT_MAX_WHITESPACE, StructuredOutputs
from ..chat import ChatTurn
from ..prompt import Prompt, resolve_prompt

_OPTIONAL_PARAMS = ("temperature", "top_p", "top_k", "seed", "max_new_tokens")
# set only when given: unset, the engine's SamplingParams defaults apply (n 1, no logprobs,
# penalties off, min_p 0, lora_scale 1)
_GIVEN_PARAMS = ("n", "logprobs", "prompt_logprobs", "presence_penalty", "frequency_penalty",
                 "repetition_penalty", "min_p", "lora_scale")
MAX_REQUEST_ID_LEN = 256


def sampling_params(msg: pb.SamplingParams,
                    constraint: StructuredOutputs | None = None) -> SamplingParams:
    """Unset optional fields stay None, so the model's defaults apply."""
    optional = {name: getattr(msg, name) if msg.HasField(name) else None
                for name in _OPTIONAL_PARAMS}
    given = {name: getattr(msg, name) for name in _GIVEN_PARAMS if msg.HasField(name)}
    return SamplingParams(**optional, **given, min_new_tokens=msg.min_new_tokens,
                          stop=list(msg.stop), stop_token_ids=list(msg.stop_token_ids),
                          ignore_eos=msg.ignore_eos,
                          logit_bias=dict(msg.logit_bias) or None,
                          allowed_token_ids=list(msg.allowed_token_ids) or None,
                          bad_words=list(msg.bad_words) or None,
                          structured_outputs=constraint)


def structured_outputs(msg: pb.StructuredOutputs) -> StructuredOutputs:
    """The oneof as the engine's constraint (the engine checks and compiles it)."""
    kind = msg.WhichOneof("constraint")
    if kind is None:
        raise ValueError("structured_outputs gives no constraint: set one of json_schema, "
                         "json_object, regex, choice, grammar")
    max_ws = None if msg.any_whitespace else (
        msg.max_whitespace if msg.HasField("max_whitespace") else DEFAULT_MAX_WHITESPACE)
    value = {"json_schema": ("json", msg.json_schema), "json_object": ("json_object",
             msg.json_object), "regex": ("regex", msg.regex),
             "choice": ("choice", list(msg.choice.choices)), "grammar": ("grammar", msg.grammar)
             }[kind]
    if kind == "json_object" and not msg.json_object:
        raise ValueError("structured_outputs.json_object must be true when set")
    return StructuredOutputs(**{value[0]: value[1]}, max_whitespace=max_ws)


def prompt_of(request: pb.GenerateRequest, tokenizer: Any | None) -> Prompt:
    """The prompt as text or token ids; exactly one of prompt, prompt_token_ids and
    messages must be set."""
    turns = [ChatTurn(m.role, m.content) for m in request.messages]
    return resolve_prompt(tokenizer, request.prompt, list(request.prompt_token_ids), turns,
                          request.apply_chat_template)


def request_id_of(request: pb.GenerateRequest) -> str | None:
    rid = request.request_id
    if len(rid) > MAX_REQUEST_ID_LEN:
        raise ValueError(f"request_id has {len(rid)} characters; at most {MAX_REQUEST_ID_LEN}")
    return rid or None


def generate_input(request: pb.GenerateRequest, tokenizer: Any | None) -> RequestInput:
    """A GenerateRequest translated for the engine's InputProcessor (server/generation.py)."""
    constraint = structured_outputs(request.structured_outputs) \
        if request.HasField("structured_outputs") else None
    params = sampling_params(request.params, constraint)
    return RequestInput(prompt_of(request, tokenizer), params, request.adapter,
                        request_id_of(request))


def state_number(state: str) -> int:
    """The proto's AdapterInfo.State for the cache's state name (ON_DISK, ..., FAILED);
    STATE_UNSPECIFIED for any other."""
    values = pb.AdapterInfo.State.DESCRIPTOR.values_by_name
    return values[state].number if state in values else pb.AdapterInfo.STATE_UNSPECIFIED


def adapter_info(info: Any) -> pb.AdapterInfo:
    """From the engine's AdapterInfo dataclass (name, path, state, rank, ...)."""
    return pb.AdapterInfo(
        name=info.name, path=str(info.path), state=state_number(info.state), rank=info.rank or 0,
        target_modules=list(info.target_modules or []), size_bytes=info.size_bytes or 0,
        active_requests=info.active_requests or 0, pinned=bool(info.pinned),
        preloaded=bool(info.preloaded), error=info.error or "",
        version=getattr(info, "version", 0) or 0)
