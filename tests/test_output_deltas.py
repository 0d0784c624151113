"""Streams send deltas: each step's RequestOutput carries what is new (its size does not
grow with the answer), the finished output carries the whole answer, and the deltas of a
choice, joined in order, are that answer (tokens, text, logprobs) on the engine, the async
engine and the HTTP front's tool-call stream."""

from __future__ import annotations

import asyncio
from collections import defaultdict

import pytest
from loraplex import LLMEngine, SamplingParams
from loraplex.engine.async_engine import AsyncEngine
from loraplex.engine.output_processor import RequestOutput


@pytest.fixture(scope="module")
def engine(tiny_models) -> LLMEngine:
    return LLMEngine(model=tiny_models("llama"), dtype="float32", max_num_seqs=8,
                     max_num_batched_tokens=256, max_model_len=256)


def run(engine: LLMEngine, prompt: list[int], params: SamplingParams) -> list[RequestOutput]:
    rid = engine.add_request(prompt, params)
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.request_id == rid]
    return outs


def check_deltas(outs: list[RequestOutput]) -> dict[int, RequestOutput]:
    """Each choice: its steps hold only what is new, its deltas join to its finished output."""
    by_choice: dict[int, list[RequestOutput]] = defaultdict(list)
    for out in outs:
        by_choice[out.index].append(out)
    finals = {}
    for index, steps in by_choice.items():
        *before, final = steps
        assert final.finished and not any(o.finished for o in before), index
        count = 0
        for out in steps:
            count += len(out.new_token_ids)
            assert out.num_output_tokens == count
        for out in before:  # the whole answer only at the end
            assert (out.token_ids, out.text, out.logprobs) == ([], "", None)
            assert len(out.new_token_ids) <= 1  # one decode step: at most one new token
            assert out.new_logprobs is None or len(out.new_logprobs) == len(out.new_token_ids)
        assert [t for o in steps for t in o.new_token_ids] == final.token_ids
        assert "".join(o.new_text for o in steps) == final.text
        assert final.num_output_tokens == len(final.token_ids)
        if final.logprobs is not None:
            assert [lp for o in steps for lp in o.new_logprobs or []] == final.logprobs
        finals[index] = final
    return finals


def test_deltas_join_to_the_final_answer(engine: LLMEngine) -> None:
    params = SamplingParams(temperature=0.9, seed=7, max_new_tokens=48, ignore_eos=True,
                            logprobs=2)
    outs = run(engine, [5, 9, 30, 31, 32], params)
    assert len(outs) >= 48  # streamed a token a step
    final = check_deltas(outs)[0]
    assert len(final.token_ids) == 48 and len(final.logprobs) == 48
    assert final.text  # the tiny model's tokenizer decodes to text
    alone = engine.generate([[5, 9, 30, 31, 32]], params)[0]
    assert (alone.token_ids, alone.text) == (final.token_ids, final.text)


def test_a_step_holds_only_its_new_tokens_however_long_the_answer(engine: LLMEngine) -> None:
    """Per-step work does not grow with the length: the last unfinished output of a long
    answer is as small as the first."""
    outs = run(engine, [7, 8, 9], SamplingParams(temperature=0.0, max_new_tokens=160,
                                                 ignore_eos=True, logprobs=1))
    unfinished = [o for o in outs if not o.finished]
    sizes = {len(o.new_token_ids) + len(o.token_ids) + len(o.new_logprobs or [])
             + len(o.logprobs or []) for o in unfinished}
    assert sizes <= {0, 2}, sizes
    check_deltas(outs)


def test_deltas_with_a_stop_string_and_n_choices(engine: LLMEngine) -> None:
    greedy = engine.generate([[11, 12, 13]], SamplingParams(temperature=0.0, max_new_tokens=30,
                                                            ignore_eos=True))[0]
    stop = greedy.text[len(greedy.text) // 2:][:3]
    assert stop.strip()
    outs = run(engine, [11, 12, 13], SamplingParams(temperature=0.0, max_new_tokens=30,
                                                    ignore_eos=True, stop=[stop]))
    final = check_deltas(outs)[0]
    assert final.finish_reason == "stop" and stop not in final.text
    outs = run(engine, [11, 12, 13], SamplingParams(temperature=1.0, seed=3, n=3,
                                                    max_new_tokens=20, ignore_eos=True))
    assert sorted(check_deltas(outs)) == [0, 1, 2]


def test_the_async_engine_streams_deltas(engine: LLMEngine) -> None:
    async def main() -> list[RequestOutput]:
        async_engine = AsyncEngine(engine)
        async_engine.start()
        try:
            params = SamplingParams(temperature=0.0, max_new_tokens=24, ignore_eos=True, n=2,
                                    seed=1)
            return [o async for o in async_engine.generate([3, 4, 5], params)]
        finally:
            async_engine.shutdown()

    finals = check_deltas(asyncio.run(main()))
    assert sorted(finals) == [0, 1] and all(len(f.token_ids) == 24 for f in finals.values())


@pytest.mark.parametrize("mode", ["auto", "required"])
def test_the_tool_call_stream_reads_deltas(mode: str) -> None:
    """The HTTP front's tool-call stream is fed each output's new text: its content and
    argument deltas join to what the whole answer's message holds."""
    from loraplex.server.http.tool_calls import ToolCallStream, whole_message
    from loraplex.server.http.tools import ToolPlan

    plan = ToolPlan(mode, [], None)
    text = ('hi <tool_call>{"name": "f", "arguments": {"a": [1, "}"]}}</tool_call>'
            '<tool_call>{"name": "g", "arguments": {}}</tool_call>' if mode == "auto" else
            '[{"name": "f", "parameters": {"a": [1, "}"]}}, {"name": "g", "parameters": {}}]')
    stream = ToolCallStream(plan)
    content, names, arguments = "", {}, defaultdict(str)
    for i in range(0, len(text), 3):
        new_content, calls = stream.feed(text[i:i + 3])
        content += new_content
        for call in calls:
            if "id" in call:
                names[call["index"]] = call["function"]["name"]
            arguments[call["index"]] += call["function"]["arguments"]
    whole_content, whole_calls = whole_message(plan, text)
    assert content == (whole_content or "")
    assert [(names[i], arguments[i]) for i in sorted(names)] == \
        [(c["function"]["name"], c["function"]["arguments"]) for c in whole_calls]
    assert len(whole_calls) == 2
