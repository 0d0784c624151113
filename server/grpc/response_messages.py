"""The engine's RequestOutputs as the Inference service's messages: a GenerateResponse with
every choice of a request, or one GenerateStreamResponse per output, naming the choice it
extends; per-token logprobs as TokenLogprob messages; usage counted over every choice (the
prompt once)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from ...engine.output_processor import RequestOutput
from ...proto import loraplex_pb2 as pb


def token_logprob(lp: object) -> pb.TokenLogprob:
    """The engine's TokenLogprob (token_id, logprob, rank, top [(id, logprob)] by rank)."""
    return pb.TokenLogprob(
        token_id=lp.token_id, logprob=lp.logprob, rank=lp.rank,  # type: ignore[attr-defined]
        top=[pb.TopLogprob(token_id=t, logprob=v, rank=i + 1)
             for i, (t, v) in enumerate(lp.top)])  # type: ignore[attr-defined]


def token_logprobs(lps: Iterable[object] | None) -> list[pb.TokenLogprob]:
    return [token_logprob(lp) for lp in lps or ()]


def prompt_logprobs(out: RequestOutput) -> list[pb.TokenLogprob]:
    """Entry i is prompt token i+1's: the first prompt token has none (nothing precedes it)."""
    return token_logprobs(lp for lp in (out.prompt_logprobs or ())[1:] if lp is not None)


class Usage:
    """Token counts over every choice of one request: the prompt once."""

    def __init__(self) -> None:
        self.completion: dict[int, int] = {}  # choice index -> its tokens so far

    def add(self, out: RequestOutput) -> pb.Usage:
        self.completion[out.index] = out.num_output_tokens
        return pb.Usage(prompt_tokens=len(out.prompt_token_ids),
                        completion_tokens=sum(self.completion.values()),
                        cached_prompt_tokens=out.num_cached_tokens)


def _choice(out: RequestOutput) -> pb.Choice:
    return pb.Choice(index=out.index, text=out.text, token_ids=out.token_ids,
                     finish_reason=out.finish_reason or "",
                     logprobs=token_logprobs(out.logprobs),
                     cumulative_logprob=out.cumulative_logprob or 0.0)


def generate_response(finals: Sequence[RequestOutput], adapter: str) -> pb.GenerateResponse:
    """``finals``: each choice's last output, by index (choices[0] fills the flat fields)."""
    usage = Usage()
    for out in finals:
        counted = usage.add(out)
    first = _choice(finals[0])
    return pb.GenerateResponse(
        request_id=finals[0].request_id, adapter=adapter, text=first.text,
        token_ids=first.token_ids, finish_reason=first.finish_reason, usage=counted,
        choices=[_choice(out) for out in finals], prompt_logprobs=prompt_logprobs(finals[0]),
        logprobs=first.logprobs, cumulative_logprob=first.cumulative_logprob,
        adapter_version=finals[0].adapter_version)


def stream_response(out: RequestOutput, adapter: str, usage: Usage, first: bool
                    ) -> pb.GenerateStreamResponse:
    """One output of one choice; ``first``: the request's first message (it carries the
    prompt logprobs)."""
    return pb.GenerateStreamResponse(
        request_id=out.request_id, adapter=adapter, text=out.new_text,
        token_ids=out.new_token_ids, finish_reason=out.finish_reason or "",
        usage=usage.add(out), finished=out.finished, index=out.index,
        logprobs=token_logprobs(out.new_logprobs),
        prompt_logprobs=prompt_logprobs(out) if first else [],
        cumulative_logprob=out.cumulative_logprob or 0.0,
        adapter_version=out.adapter_version)
