"""A loop as a trainer drives it: twenty versions of a rank-16 adapter are swapped in
place (loaded from disk and uploaded, in turn) while 8 clients sample continuously from a
real server. Every response's tokens are exact against PEFT on the version named in its
response, and so are its logprobs (PEFT's float32 log_softmax), no stream mixes versions, a request sent after a load answered runs on that
version or a later one, and no KV block, pool row, retired adapter or upload is left over."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from loraplex.client import AsyncClient

from tests.conftest import ALL_TARGETS, make_adapter, one_thread

VERSIONS = 20
CLIENTS = 8
NEW = 6
PROMPTS = [[10, 20, 30], [40, 41, 42, 43, 44], [7, 8, 9, 11], [100, 101, 102, 103, 104, 105]]
PER_VERSION = 3  # responses on a version before the trainer moves on


@pytest.fixture(scope="module")
def versions(tiny_llama: Path, tmp_path_factory) -> list[Path]:
    root = tmp_path_factory.mktemp("policy")
    return [make_adapter(tiny_llama, root / f"v{i}", r=16, target_modules=ALL_TARGETS,
                         seed=100 + i) for i in range(VERSIONS)]


def peft_tokens(base: Path, adapter: Path, prompt: list[int]
                ) -> tuple[list[int], list[float]]:
    """PEFT's greedy tokens and each one's float32 log_softmax value."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    model = PeftModel.from_pretrained(model, adapter).eval()
    seq = torch.tensor([prompt])  # greedy with EOS allowed, as ignore_eos samples
    logprobs: list[float] = []
    with torch.no_grad(), one_thread():
        for _ in range(NEW):
            logits = model(seq).logits[0, -1].float()
            token = logits.argmax()
            logprobs.append(torch.log_softmax(logits, dim=-1)[token].item())
            seq = torch.cat([seq, token.view(1, 1)], dim=1)
    return seq[0, len(prompt):].tolist(), logprobs


async def trainer_loop(target: str, versions: list[Path], served: dict[int, int],
                       loaded: list[int]) -> None:
    """Load each version in place (odd ones uploaded), once the last has served a few."""
    async with AsyncClient(target) as c:
        for i, path in enumerate(versions):
            if i % 2:
                info = await c.upload_adapter("policy", path, replace=i > 0)
            else:
                info = await c.load_adapter("policy", str(path), replace=i > 0)
            assert info.version == i + 1
            loaded.append(info.version)
            deadline = time.monotonic() + 120
            while served.get(info.version, 0) < PER_VERSION:
                assert time.monotonic() < deadline, f"version {info.version} got no traffic"
                await asyncio.sleep(0.01)


async def sampler(target: str, k: int, loaded: list[int], served: dict[int, int],
                  results: list[tuple], stop: asyncio.Event) -> None:
    async with AsyncClient(target) as c:
        n = 0
        while not stop.is_set():
            prompt = PROMPTS[(k + n) % len(PROMPTS)]
            n += 1
            floor = loaded[-1] if loaded else 0  # the version a load has answered with
            if not floor:
                await asyncio.sleep(0.01)
                continue
            msgs = [m async for m in c.generate_stream(
                prompt_token_ids=prompt, adapter="policy", temperature=0.0,
                max_new_tokens=NEW, ignore_eos=True, logprobs=0)]
            seen = {m.adapter_version for m in msgs}
            results.append((floor, seen, prompt, [t for m in msgs for t in m.token_ids],
                            [lp.logprob for m in msgs for lp in m.logprobs]))
            if len(seen) == 1:
                v = next(iter(seen))
                served[v] = served.get(v, 0) + 1


async def drive(target: str, versions: list[Path]) -> list[tuple]:
    loaded: list[int] = []
    served: dict[int, int] = {}
    results: list[tuple] = []
    stop = asyncio.Event()
    clients = [asyncio.create_task(sampler(target, k, loaded, served, results, stop))
               for k in range(CLIENTS)]
    try:
        await trainer_loop(target, versions, served, loaded)
    finally:
        stop.set()
        await asyncio.gather(*clients)
    return results


def test_twenty_versions_in_place_under_eight_samplers(serve, make_engine, tiny_llama,
                                                       versions) -> None:
    server = serve(lambda: make_engine(tiny_llama))
    results = asyncio.run(drive(server.target, versions))
    assert all(len(r[1]) == 1 for r in results)  # no stream mixes versions
    by_version: dict[int, set[tuple[int, ...]]] = {}
    for floor, seen, prompt, toks, _ in results:
        v = next(iter(seen))
        assert floor <= v <= VERSIONS  # accepted after load ``floor`` answered: not older
        assert len(toks) == NEW
        by_version.setdefault(v, set()).add(tuple(prompt))
    assert set(by_version) == set(range(1, VERSIONS + 1))
    refs = {(v, p): peft_tokens(tiny_llama, versions[v - 1], list(p))
            for v, prompts in by_version.items() for p in prompts}
    for _, seen, prompt, toks, logprobs in results:
        ref_toks, ref_logprobs = refs[(next(iter(seen)), tuple(prompt))]
        assert toks == ref_toks
        assert logprobs == pytest.approx(ref_logprobs, abs=2e-4)
    engine: Any = server.engine
    assert engine.block_manager.num_used_blocks == 0
    assert len(engine.lora.by_id) == len(engine.lora.names) == 1  # no retired version kept
    assert engine.lora.pool.used_units <= engine.lora.pool.units_for(16)  # one copy at most
    assert len(list(engine.uploads.root.iterdir())) == 1  # the last version's upload only
    engine.check()
