"""OutputProcessor: appends sampled tokens, detokenizes, applies the stop rules and reports
each request's progress as a RequestOutput."""

from __future__ import annotations

from dataclasses import dataclass, field

from .detokenizer import detokenize, flush
from .logprobs import TokenLogprob
from .sequence import Sequence


@dataclass
class RequestOutput:
    request_id: str
    adapter: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]  # every generated token so far
    text: str  # generated text so far (stop string cut)
    new_token_ids: list[int] = field(default_factory=list)  # since the previous output
    new_text: str = ""
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "eos" | "length" | "abort" | "error"
    num_cached_tokens: int = 0
    error: str | None = None
    adapter_fault: bool = False  # the error is the adapter's data's (Sequence.adapter_fault)
    index: int = 0  # the choice (0..n-1); each choice ends with its own finished output
    # with params.logprobs set: one per generated token so far, and those since the last
    # output (parallel to new_token_ids); else None
    logprobs: list[TokenLogprob] | None = None
    new_logprobs: list[TokenLogprob] | None = None
    # with params.prompt_logprobs set: one per prompt token, the first None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    cumulative_logprob: float | None = None  # the sum of ``logprobs``' values
    adapter_version: int | None = None  # the version of the adapter it ran on (None: base)


class OutputProcessor:
    def __init__(self, tokenizer: object | None):
        self.tokenizer = tokenizer

    def append(self, seq: Sequence, token: int, logprob: TokenLogprob | None = None
               ) -> str | None:
        """Add ``token`` (and its logprob, when asked for) to ``seq``; return the finish
        reason if it must stop now."""
        seq.append_token(token)
        if seq.logprobs is not None and logprob is not None:
            seq.logprobs.append(logprob)
            seq.cumulative_logprob += logprob.logprob
        p = seq.params
        if self.tokenizer is not None:
            detokenize(self.tokenizer, seq)
        allowed_to_stop = seq.num_output_tokens >= p.min_new_tokens
        reason = None
        if allowed_to_stop and not p.ignore_eos and token in seq.eos_token_ids:
            reason = "eos"
        elif allowed_to_stop and token in p.stop_token_ids:
            reason = "stop"
        elif allowed_to_stop and p.stop and self._cut_stop_string(seq):
            return "stop"
        elif seq.num_output_tokens >= p.max_new_tokens or seq.num_tokens >= seq.max_tokens:
            reason = "length"
        if reason is not None and self.tokenizer is not None:
            flush(self.tokenizer, seq)  # the text of a half character, as the full decode
        return reason

    @staticmethod
    def _cut_stop_string(seq: Sequence) -> bool:
        """Cut the text at the first stop string; only the tail can hold a new match."""
        longest = max(len(s) for s in seq.params.stop)
        start = max(0, seq.sent_text - longest)
        hits = [i for s in seq.params.stop if (i := seq.text.find(s, start)) >= 0]
        if not hits:
            return False
        seq.text = seq.text[: min(hits)]
        return True

    @staticmethod
    def report(seq: Sequence) -> RequestOutput:
        """The request's state, with what is new since the last report."""
        new_tokens = seq.output_token_ids[seq.sent_tokens:]
        text = seq.text
        stable = len(text) if seq.is_finished else len(text.rstrip("\ufffd"))  # no half chars
        new_text = text[seq.sent_text:stable] if stable > seq.sent_text else ""
        new_logprobs = None if seq.logprobs is None else seq.logprobs[seq.sent_tokens:]
        seq.sent_tokens = seq.num_output_tokens
        seq.sent_text = max(seq.sent_text, stable)
        return RequestOutput(
            request_id=seq.request_id, adapter=seq.adapter_name,
            prompt_token_ids=seq.prompt_token_ids, token_ids=list(seq.output_token_ids),
            text=text, new_token_ids=new_tokens, new_text=new_text,
            finished=seq.is_finished, finish_reason=seq.finish_reason,
            num_cached_tokens=seq.num_cached_tokens, error=seq.error,
            adapter_fault=seq.adapter_fault, index=seq.index,
            logprobs=None if seq.logprobs is None else list(seq.logprobs),
            new_logprobs=new_logprobs, prompt_logprobs=seq.prompt_logprobs,
            cumulative_logprob=seq.cumulative_logprob, adapter_version=seq.adapter_version,
        )
