"""Request bodies of the OpenAI-compatible routes, as pydantic models (vLLM's field names).

Types are strict: a string where a number belongs is a 400, not a silent conversion.
Unknown fields are ignored as vLLM does (clients send ``user`` and the like); fields of
OpenAI's API that loraplex does not implement are refused when set (``unsupported``), so a
client never silently loses, say, its logprobs. Value ranges beyond what the types say
(temperature, top_p, top_k, lengths) are the engine's checks, shared with gRPC.
"""

from __future__ import annotations

from typing import Annotated, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

TokenId = Annotated[int, Field(ge=0)]
Stop = str | list[str] | None


class RequestBody(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")

    UNSUPPORTED: ClassVar[tuple[str, ...]] = ()  # set fields of these names are refused

    def unsupported(self) -> list[str]:
        """The names of unsupported fields the client set to something other than off."""
        extra = self.model_extra or {}
        return [name for name in self.UNSUPPORTED
                if extra.get(name) not in (None, False, 0, [], {}, "none")]


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    include_usage: bool = False


class SamplingFields(RequestBody):
    """The fields completions and chat share."""

    model: str | None = None  # an adapter name or the base model's; None = the base
    temperature: float | None = None
    top_p: float | None = None
    seed: Annotated[int, Field(ge=0)] | None = None
    stop: Stop = None
    n: Annotated[int, Field(ge=1)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    # vLLM's extras
    top_k: int | None = None
    min_tokens: Annotated[int, Field(ge=0)] = 0
    ignore_eos: bool = False
    stop_token_ids: list[TokenId] | None = None


class CompletionRequest(SamplingFields):
    UNSUPPORTED: ClassVar[tuple[str, ...]] = ("echo", "logprobs", "suffix", "presence_penalty", "frequency_penalty",
                   "repetition_penalty", "logit_bias", "best_of", "guided_json",
                   "guided_regex", "guided_choice", "response_format")

    prompt: str | list[TokenId] | list[str] | list[list[TokenId]]
    max_tokens: Annotated[int, Field(ge=1)] | None = 16  # OpenAI's and vLLM's default


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    role: str
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(SamplingFields):
    UNSUPPORTED: ClassVar[tuple[str, ...]] = ("tools", "tool_choice", "functions", "function_call", "logprobs",
                   "top_logprobs", "response_format", "presence_penalty",
                   "frequency_penalty", "repetition_penalty", "logit_bias", "echo",
                   "guided_json", "guided_regex", "guided_choice")

    messages: list[ChatMessage]
    max_tokens: Annotated[int, Field(ge=1)] | None = None  # None: up to max_model_len
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None


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
