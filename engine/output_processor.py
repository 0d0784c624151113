"""OutputProcessor: appends sampled tokens, detokenizes, applies the stop rules and reports
each request's progress as a RequestOutput."""

from __future__ import annotations

from dataclasses import dataclass, field

from .detokenizer import detokenize, flush
from .logprobs import TokenLogprob
from .sequence import Sequence


@dataclass
class RequestOutput:
    """One report of one choice. Each step's output carries what is new since the previous
    one (``new_token_ids``, ``new_text``, ``new_logprobs``) and the count so far
    (``num_output_tokens``): its size does not grow with the answer. The whole answer
    (``token_ids``, ``text``, ``logprobs``) is in the finished output only; before it they
    are empty (``[]``, ``""``, None). The new parts of a choice's outputs, joined in order,
    are its whole answer."""

    request_id: str
    adapter: str | None
    prompt_token_ids: list[int]
    new_token_ids: list[int] = field(default_factory=list)  # since the previous output
    new_text: str = ""  # stable text since the previous output (no half characters)
    num_output_tokens: int = 0  # generated so far, this output's included
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "eos" | "length" | "abort" | "error"
    num_cached_tokens: int = 0
    error: str | None = None
    adapter_fault: bool = False  # the error is the adapter's data's (Sequence.adapter_fault)
    index: int = 0  # the choice (0..n-1); each choice ends with its own finished output
    # with params.logprobs set: those since the previous output (parallel to
    # new_token_ids); else None
    new_logprobs: list[TokenLogprob] | None = None
    # with params.prompt_logprobs set: one per prompt token, the first None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    cumulative_logprob: float | None = None  # the sum of the logprobs' values so far
    adapter_version: int | None = None  # the version of the adapter it ran on (None: base)
    # the whole answer, in the finished output only: every generated token, the text (stop
    # string cut) and, with params.logprobs set, one logprob per token
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[TokenLogprob] | None = None


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
        tokenizer = seq.tokenizer if seq.tokenizer is not None else self.tokenizer
        if tokenizer is not None:
            detokenize(tokenizer, seq)
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
        if reason is not None and tokenizer is not None:
            flush(tokenizer, seq)  # the text of a half character, as the full decode
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
        """What is new since the last report (the whole answer too once it finished): the
        work and the size do not grow with the answer but at its end."""
        new_tokens = seq.output_token_ids[seq.sent_tokens:]
        text = seq.text
        done = seq.is_finished
        stable = len(text) if done else len(text.rstrip("\ufffd"))  # no half chars
        new_text = text[seq.sent_text:stable] if stable > seq.sent_text else ""
        new_logprobs = None if seq.logprobs is None else seq.logprobs[seq.sent_tokens:]
        seq.sent_tokens = seq.num_output_tokens
        seq.sent_text = max(seq.sent_text, stable)
        return RequestOutput(
            request_id=seq.request_id, adapter=seq.adapter_name,
            prompt_token_ids=seq.prompt_token_ids, new_token_ids=new_tokens,
            new_text=new_text, num_output_tokens=seq.num_output_tokens,
            finished=done, finish_reason=seq.finish_reason,
            num_cached_tokens=seq.num_cached_tokens, error=seq.error,
            adapter_fault=seq.adapter_fault, index=seq.index, new_logprobs=new_logprobs,
            prompt_logprobs=seq.prompt_logprobs, cumulative_logprob=seq.cumulative_logprob,
            adapter_version=seq.adapter_version,
            token_ids=list(seq.output_token_ids) if done else [],
            text=text if done else "",
            logprobs=None if seq.logprobs is None else list(seq.logprobs) if done else None,
        )
