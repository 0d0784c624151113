"""Request bodies of the OpenAI-compatible routes, as pydantic models (vLLM's field names).

Types are strict: a string where a number belongs is a 400, not a silent conversion.
Fields that loraplex does not implement are not declared here: fields.py's table refuses
them unless their value is neutral, and warns about names it does not know (vLLM ignores
those too). Value ranges beyond what the types say (temperature, top_p, penalties, n,
logprobs, lengths) are the engine's checks, shared with gRPC.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from .response_format import ResponseFormat
from .tools import Tool, ToolChoice

TokenId = Annotated[int, Field(ge=0)]
Stop = str | list[str] | None


class RequestBody(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM: usage in every chunk


class SamplingFields(RequestBody):
    """The fields completions and chat share (those the field table of fields.py refuses
    or ignores are not declared: they arrive in ``model_extra``)."""

    model: str | None = None  # an adapter name or the base model's; None = the base
    temperature: float | None = None
    top_p: float | None = None
    seed: Annotated[int, Field(ge=0)] | None = None
    stop: Stop = None
    n: int | None = 1  # checked by the engine (>= 1, <= max_num_seqs), as over gRPC
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None  # token id (JSON keys are strings) -> bias
    # vLLM's extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: Annotated[int, Field(ge=0)] = 0
    ignore_eos: bool = False
    stop_token_ids: list[TokenId] | None = None
    allowed_token_ids: list[TokenId] | None = None
    bad_words: list[str] | None = None
    prompt_logprobs: int | None = None
    return_tokens_as_token_ids: bool | None = None
    # loraplex's: multiplies the adapter's delta (vLLM's LoRARequest.lora_scale), [0, 4]
    lora_scale: float | None = None
    # what the answer must match (response_format.py): OpenAI's and vLLM's forms
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None


class CompletionRequest(SamplingFields):
    prompt: str | list[TokenId] | list[str] | list[list[TokenId]]
    # OpenAI's and vLLM's default; 0 only with echo (the prompt alone comes back)
    max_tokens: Annotated[int, Field(ge=0)] | None = 16
    echo: bool | None = False
    logprobs: int | None = None  # top-k per token (0 = the token's own); vLLM: -1 = all
    best_of: int | None = None


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    type: Literal["text"]
    text: str


class RefusalPart(BaseModel):  # OpenAI's: an assistant turn's refusal, as text
    model_config = ConfigDict(strict=True, extra="allow")
    type: Literal["refusal"]
    refusal: str


ContentPart = Annotated[TextPart | RefusalPart, Field(discriminator="type")]


class ChatMessage(BaseModel):
    """One of OpenAI's chat messages, as its SDK sends them: ``content`` a string, a list of
    text (or refusal) parts, or null / missing (an assistant turn with ``tool_calls``);
    other fields the SDK echoes back (``refusal``, ``audio``, ``annotations``, ...) are
    accepted and left out of the prompt, as vLLM does."""

    model_config = ConfigDict(strict=True, extra="allow")
    role: str
    content: str | list[ContentPart] | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant turn's calls
    tool_call_id: str | None = None  # a tool turn's answer to that call
    name: str | None = None

    def text(self) -> str:
        """The content as the template reads it (vLLM's rule): parts joined by newlines,
        null or missing as the empty string (templates read ``message.content``)."""
        if isinstance(self.content, list):
            return "\n".join(p.text if isinstance(p, TextPart) else p.refusal
                             for p in self.content)
        return self.content or ""


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage]
    max_tokens: Annotated[int, Field(ge=1)] | None = None  # None: up to max_model_len
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None  # with logprobs: the k most likely per token
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None  # None: "auto" with tools, else "none"
    parallel_tool_calls: bool | None = None  # false: at most one call (required: exactly one)


class LoadLoRAAdapterRequest(RequestBody):
    lora_name: str
    lora_path: str
    load_inplace: bool = False  # vLLM's: swap a loaded name for a new version


class UnloadLoRAAdapterRequest(RequestBody):
    lora_name: str


class TokenizeRequest(RequestBody):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True  # for a prompt; chat templates write their own


class DetokenizeRequest(RequestBody):
    model: str | None = None
    tokens: list[TokenId]
