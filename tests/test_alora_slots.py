"""An activated LoRA whose prompt does not hold its invocation runs the base model
throughout (PEFT's offset None, generated tokens included): it takes no LoRA slot (evicts
nothing, waits for none, reads nothing), its blocks are the base model's in the prefix
cache, and it still reports the adapter it asked for. Exact against PEFT's aLoRA; an
aLoRA with its own token rows (trainable tokens, which PEFT applies whatever the
invocation) keeps its slot and its own blocks."""

from __future__ import annotations

import pytest
from loraplex import LLMEngine, SamplingParams

from tests.conftest import ALL_TARGETS, make_adapter
from tests.test_alora import INVOKE, NEW, PROMPTS, Oracle, make_alora, params
from tests.test_token_rows import TOKENS, make_token_adapter

ABSENT = PROMPTS["absent"]  # the invocation's first two tokens, not the whole sequence


@pytest.fixture(scope="module")
def made(tiny_llama, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("alora_slots")
    return {"judge": make_alora(tiny_llama, root / "judge"),
            "plain": make_adapter(tiny_llama, root / "plain", seed=9, scale=0.3,
                                  target_modules=ALL_TARGETS)}


def one_slot_engine(base, made: dict, **kwargs) -> LLMEngine:
    return LLMEngine(model=base, dtype="float32", max_loras=1, max_lora_rank=8,
                     max_model_len=128, block_size=4, debug_checks=True,
                     lora_modules={n: str(p) for n, p in made.items()}, **kwargs)


def long_params() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_new_tokens=3 * NEW, min_new_tokens=3 * NEW)


def assert_no_leaks(engine: LLMEngine) -> None:
    engine.check()
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.num_used_blocks == 0
    assert engine.lora.slots_in_use == 0
    assert all(a.active == 0 and a.running == 0 for a in engine.lora.by_id.values())


def test_never_invoked_takes_no_slot_while_another_adapter_holds_it(tiny_llama, made):
    """max_loras=1, a plain LoRA running in the slot: the aLoRA request without its
    invocation starts at once, beside it, evicting nothing and reading nothing; its
    tokens are PEFT's aLoRA's (= the base model's), and it reports its adapter."""
    engine = one_slot_engine(tiny_llama, made)
    judge = engine.lora.names["judge"]
    plain_id = engine.add_request(PROMPTS["middle"], long_params(), "plain")
    while plain_id not in {s.request_id for s in engine.scheduler.running}:
        engine.step()  # its read from disk on a loader thread, then its slot
    assert engine.lora.on_device(engine.lora.lookup("plain"))
    counts = engine.lora.counts
    judge_id = engine.add_request(ABSENT, params(), "judge")
    outs = {}
    engine.step()  # admitted in the step it arrives: no wait for the slot
    running = {s.request_id: s for s in engine.scheduler.running}
    assert judge_id in running and plain_id in running
    assert running[judge_id].lora_id == 0 and running[judge_id].adapter_id == judge.adapter_id
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = out
        assert not engine.lora.on_device(judge.adapter_id)  # never placed, never read
        assert engine.lora.host.weights(judge) is None
    assert engine.lora.counts - counts == {}  # no device load, no lookup, no eviction
    assert engine.lora.on_device(engine.lora.lookup("plain"))  # the plain LoRA stayed
    tokens, lps = Oracle(tiny_llama, made["judge"]).greedy(ABSENT)
    assert outs[judge_id].token_ids == tokens == Oracle(tiny_llama, None).greedy(ABSENT)[0]
    assert [lp.logprob for lp in outs[judge_id].logprobs] == pytest.approx(lps, abs=2e-3)
    assert outs[judge_id].adapter == "judge"
    assert outs[plain_id].token_ids == Oracle(tiny_llama, made["plain"]).greedy(
        PROMPTS["middle"], 3 * NEW)[0]
    assert_no_leaks(engine)


def test_mixed_batch_on_one_slot_stays_exact(tiny_llama, made):
    """One slot; the plain LoRA, the aLoRA invoked and not, and the base model submitted
    together: the invoked aLoRA waits for the slot, the rest run, and every request equals
    PEFT's model of it token for token, logprobs within 2e-3."""
    engine = one_slot_engine(tiny_llama, made)
    items = [("plain", "middle"), ("judge", "absent"), (None, "absent"),
             ("judge", "middle"), ("judge", "absent"), (None, "middle")]
    outs = engine.generate([PROMPTS[k] for _, k in items], params(),
                           adapters=[a for a, _ in items])
    oracles = {a: Oracle(tiny_llama, made[a] if a else None) for a in ("judge", "plain", None)}
    for (a, k), out in zip(items, outs):
        tokens, lps = oracles[a].greedy(PROMPTS[k])
        assert out.token_ids == tokens, (a, k)
        assert [lp.logprob for lp in out.logprobs] == pytest.approx(lps, abs=2e-3)
        assert out.adapter == a
    assert outs[1].token_ids == outs[2].token_ids  # never invoked: the base model
    assert_no_leaks(engine)


def test_never_invoked_shares_the_base_models_blocks(tiny_llama, made):
    """Its blocks are keyed as the base model's: a base request's cached blocks serve it,
    and its own serve a later base request."""
    engine = one_slot_engine(tiny_llama, made)
    prompt = [(7 * i) % 300 + 4 for i in range(29)]  # 7 full blocks, no invocation
    full = (len(prompt) - 1) // 4

    def hits(adapter: str | None, ids: list[int]) -> int:
        before = engine.block_manager.prefix_hits
        engine.generate([ids], params(None), adapters=[adapter])
        return engine.block_manager.prefix_hits - before

    assert hits(None, prompt) == 0
    assert hits("judge", prompt) == full
    other = [i + 1 for i in prompt]
    assert hits("judge", other) == 0
    assert hits(None, other) == full
    assert hits("plain", other) == 0  # a plain LoRA's blocks are its own
    assert_no_leaks(engine)


def test_alora_with_token_rows_keeps_its_slot_and_blocks(tiny_llama, tmp_path):
    """An aLoRA with trainable tokens never invoked: PEFT masks its LoRA delta but applies
    its token rows, so it is not the base model: it takes its slot, its blocks are its own
    (no base request shares them), and its tokens equal PEFT's."""
    ad = make_token_adapter(tiny_llama, tmp_path / "t", 21, trainable_token_indices=TOKENS,
                            alora_invocation_tokens=INVOKE)
    prompt = [5, 7, 33, 9, 120, 7, 44, 3, 250, 11, 300, 12, 64, 301, 8]  # no invocation
    engine = LLMEngine(model=tiny_llama, dtype="float32", max_loras=1, max_lora_rank=8,
                       max_model_len=128, block_size=4, debug_checks=True,
                       lora_modules={"rows": str(ad)})
    (base,) = engine.generate([prompt], params(None))
    before = engine.block_manager.prefix_hits
    (out,) = engine.generate([prompt], params(), adapters=["rows"])
    assert engine.block_manager.prefix_hits == before  # the base's blocks are not its KV
    assert engine.lora.counts["loads_device"] == 1
    tokens, lps = Oracle(tiny_llama, ad).greedy(prompt)
    assert out.token_ids == tokens
    assert [lp.logprob for lp in out.logprobs] == pytest.approx(lps, abs=2e-3)
    assert tokens != base.token_ids  # the oracle tells it apart from the base model
    assert_no_leaks(engine)
