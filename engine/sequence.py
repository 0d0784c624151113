"""Sequence: one request's tokens, progress, blocks and adapter. Pure Python."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from .activation import NEVER
from .bad_words import BadWords
from .logprobs import TokenLogprob
from .sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Sequence:
    """Invariants: ``num_computed_tokens <= num_tokens``; the KV of the first
    ``num_computed_tokens`` tokens lives in ``block_table``; ``len(block_table) * block_size``
    covers every token that has been scheduled."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams  # already resolved: no None fields left that matter
    adapter_name: str | None = None  # None = the base model
    adapter_id: int = 0  # 0 = base model; new for every adapter load
    adapter_version: int | None = None  # the adapter's version (rises with each load)
    # the first position the adapter's delta applies to (activation.py): 0, or an activated
    # LoRA's invocation start (activation.NEVER: nowhere); earlier tokens run the base model
    adapter_start: int = 0
    # the adapter has its own token rows (lora/token_rows.py), which apply from position 0
    # whatever adapter_start says (set by LLMEngine.add_sequence)
    own_rows: bool = False
    eos_token_ids: frozenset[int] = frozenset()
    # the adapter's own tokenizer (lora/adapter_vocab.py): its output is detokenized with
    # it; None: the engine's
    tokenizer: Any = None
    max_tokens: int = 0  # prompt + generated never exceeds this
    output_token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache on first schedule
    block_table: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "eos" | "length" | "abort" | "error"
    error: str | None = None
    # the error is the adapter's data's (NaN / Inf logits on it, or its files refused on a
    # re-read), not an engine fault: the servers answer FAILED_PRECONDITION, not INTERNAL
    adapter_fault: bool = False
    arrival_time: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    waiting_steps: int = 0  # steps overtaken while waiting (anti-starvation); 0 once running
    max_waiting_steps: int = 0  # the most waiting_steps reached (the fairness bound's measure)
    num_preemptions: int = 0
    text: str = ""  # detokenized output (stop strings already cut)
    sent_tokens: int = 0  # output tokens already reported to the caller
    sent_text: int = 0  # characters of ``text`` already reported
    prefix_offset: int = 0  # output tokens: the detokenizer's context starts here
    read_offset: int = 0  # output tokens: ``text`` holds the text up to here
    index: int = 0  # the choice (0..n-1) of the request this sequence samples
    forked: bool = False  # choice 0 of n > 1: choices 1..n-1 exist (forked at its 1st token)
    # with params.logprobs set: one per output token (else None), and their sum
    logprobs: list[TokenLogprob] | None = None
    cumulative_logprob: float | None = None
    # with params.prompt_logprobs set: one per prompt token computed so far, the first None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    bad_words: BadWords | None = None  # params.bad_words, tokenized and indexed (shared)
    # engine/row_tokens.py's RowTokens: the fixed token lists as tensors, made at the first
    # step and shared by the request's choices (engine thread only)
    row_tokens: Any = None
    # with params.structured_outputs: its structured.matcher.ConstraintMatcher (else None)
    matcher: Any = None

    def __post_init__(self) -> None:
        if self.params.logprobs is not None and self.logprobs is None:
            self.logprobs, self.cumulative_logprob = [], 0.0
        if self.params.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = [None]

    @property
    def seq_id(self) -> str:
        """Unique among live sequences: the request id, with ``/i`` for choice i > 0."""
        return self.request_id if self.index == 0 else f"{self.request_id}/{self.index}"

    @property
    def base_prefix(self) -> int:
        """Positions before this one compute exactly as the base model (their KV is the
        base's): an activated LoRA's adapter_start unless its adapter has own token rows."""
        return 0 if self.own_rows else self.adapter_start

    @property
    def lora_id(self) -> int:
        """The adapter whose weights must be in a device slot for this sequence: its
        adapter_id, or 0 (none) for the base model, for a request at lora_scale 0 (the
        base model exactly, its adapter's token rows included) and for an activated LoRA
        never invoked (activation.NEVER, no token rows of its own): those run the base
        model throughout and are scheduled and cached as base requests (they still report
        their adapter)."""
        if self.base_prefix == NEVER or not self.params.lora_scale:
            return 0
        return self.adapter_id

    @property
    def seats(self) -> int:
        """Running seats this sequence holds: n for choice 0 of n before it forks (its
        choices will run beside it), else 1."""
        return self.params.n if self.index == 0 and not self.forked else 1

    def fork(self, index: int) -> Sequence:
        """Choice ``index`` of this request: the same prompt and params, no tokens yet (the
        caller gives it blocks, progress and its first token)."""
        return Sequence(
            request_id=self.request_id, prompt_token_ids=self.prompt_token_ids,
            params=self.params, adapter_name=self.adapter_name, adapter_id=self.adapter_id,
            adapter_start=self.adapter_start, own_rows=self.own_rows,
            eos_token_ids=self.eos_token_ids, max_tokens=self.max_tokens,
            arrival_time=self.arrival_time, num_cached_tokens=self.num_cached_tokens,
            index=index, prompt_logprobs=self.prompt_logprobs, bad_words=self.bad_words,
            row_tokens=self.row_tokens, tokenizer=self.tokenizer,
            matcher=self.matcher)  # the parent's: the choice gets its own at its first step

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_slice(self, start: int, stop: int) -> list[int]:
        n = len(self.prompt_token_ids)
        if stop <= n:
            return self.prompt_token_ids[start:stop]
        if start >= n:
            return self.output_token_ids[start - n : stop - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[: stop - n]

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        if self.first_token_time is None:
            self.first_token_time = time.monotonic()

    def finish(self, reason: str) -> None:
        self.status = SequenceStatus.FINISHED
        self.finish_reason = reason
