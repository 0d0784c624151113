"""The Inference service's request messages, built from Python values (client.py's
``generate(**kwargs)`` and ``generate_stream(**kwargs)`` take these keywords)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from json import dumps
from typing import Any

from ..proto import loraplex_pb2 as pb

# optional fields: None leaves them unset, so the server's default applies
_OPTIONAL = ("temperature", "top_p", "top_k", "seed", "max_new_tokens", "n", "logprobs",
             "prompt_logprobs", "presence_penalty", "frequency_penalty", "repetition_penalty",
             "min_p", "lora_scale")


def sampling_params(temperature: float | None = None, top_p: float | None = None,
                    top_k: int | None = None, seed: int | None = None,
                    max_new_tokens: int | None = None, min_new_tokens: int = 0,
                    stop: Sequence[str] = (), stop_token_ids: Sequence[int] = (),
                    ignore_eos: bool = False, n: int | None = None,
                    logprobs: int | None = None, prompt_logprobs: int | None = None,
                    presence_penalty: float | None = None,
                    frequency_penalty: float | None = None,
                    repetition_penalty: float | None = None,
                    logit_bias: Mapping[int, float] | None = None, min_p: float | None = None,
                    allowed_token_ids: Sequence[int] | None = None,
                    bad_words: Sequence[str] | None = None,
                    lora_scale: float | None = None) -> pb.SamplingParams:
    """A SamplingParams message; None leaves a field unset (the model's default; for
    ``max_new_tokens``: up to max_model_len, unlike ``loraplex generate``'s 256). The
    fields after ``ignore_eos`` are vLLM's (docs/sampling-api.md): ``n`` choices,
    ``logprobs`` / ``prompt_logprobs`` top-k (0 = the token's own logprob only, -1 = the
    whole vocabulary within the server's --max-logprobs), the penalties, ``logit_bias``
    (token id -> bias), ``min_p``, ``allowed_token_ids``, ``bad_words``; ``lora_scale``
    multiplies the adapter's delta for this request ([0, 4], 1 = as trained, 0 = the base
    model exactly; docs/adapters.md)."""
    msg = pb.SamplingParams(min_new_tokens=min_new_tokens, stop=list(stop),
                            stop_token_ids=list(stop_token_ids), ignore_eos=ignore_eos,
                            logit_bias=dict(logit_bias or {}),
                            allowed_token_ids=list(allowed_token_ids or ()),
                            bad_words=list(bad_words or ()))
    values = locals()
    for name in _OPTIONAL:
        if values[name] is not None:
            setattr(msg, name, values[name])
    return msg


def structured_outputs_message(json: Mapping[str, Any] | str | None = None, json_object: bool = False,
                       regex: str | None = None, choice: Sequence[str] | None = None,
                       grammar: str | None = None, max_whitespace: int | None = -1
                       ) -> pb.StructuredOutputs:
    """A StructuredOutputs message from vLLM's names (one of json, json_object, regex, choice,
    grammar); ``max_whitespace`` None allows any whitespace in JSON, -1 leaves the server's
    default."""
    msg = pb.StructuredOutputs(any_whitespace=max_whitespace is None)
    if max_whitespace is not None and max_whitespace >= 0:
        msg.max_whitespace = max_whitespace
    if json is not None:
        msg.json_schema = json if isinstance(json, str) else dumps(json)
    elif json_object:
        msg.json_object = True
    elif regex is not None:
        msg.regex = regex
    elif choice is not None:
        msg.choice.SetInParent()  # set even when empty (the server says so)
        msg.choice.choices.extend(choice)
    elif grammar is not None:
        msg.grammar = grammar
    return msg


def generate_request(prompt: str | None = None, *, prompt_token_ids: Sequence[int] | None = None,
                     adapter: str = "", request_id: str = "", apply_chat_template: bool = False,
                     messages: Sequence[Mapping[str, str]] | None = None,
                     structured_outputs: Mapping[str, Any] | None = None,
                     **sampling: object) -> pb.GenerateRequest:
    """``messages`` ({"role", "content"} dicts, as OpenAI's) go through the chat template:
    the way to prompt an Instruct model. ``structured_outputs``: vLLM's dict (``{"json":
    schema}``, ``{"regex": ...}``, ``{"choice": [...]}``, ``{"grammar": ...}``)."""
    turns = [pb.ChatMessage(role=m["role"], content=m["content"]) for m in messages or ()]
    request = pb.GenerateRequest(
        request_id=request_id, adapter=adapter, prompt=prompt or "",
        prompt_token_ids=list(prompt_token_ids or ()), apply_chat_template=apply_chat_template,
        messages=turns, params=sampling_params(**sampling))  # type: ignore[arg-type]
    if structured_outputs is not None:
        request.structured_outputs.CopyFrom(structured_outputs_message(**structured_outputs))
    return request

