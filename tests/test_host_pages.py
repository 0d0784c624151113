"""Pools committed as written (issue 28): on the CPU the LoRA rank-row pools and the KV cache
reserve their budget as address space and take memory page by page as they are written."""

from __future__ import annotations

import torch
from loraplex.engine.llm_engine import LLMEngine
from loraplex.engine.sampling_params import SamplingParams
from loraplex.kernel_backends import host_pages

CPU = torch.device("cpu")


def test_zeros_reads_zero_and_commits_only_written_pages() -> None:
    t = host_pages.zeros((1024, 1024), torch.float32, CPU)  # 4 MiB reserved
    assert host_pages.reserved_bytes([t]) == 4 << 20
    assert host_pages.committed_bytes([t]) == 0
    t[5, :10] = 1.0
    t[700].fill_(2.0)
    committed = host_pages.committed_bytes([t, t[5]])  # a view's storage counts once
    assert host_pages.PAGE <= committed <= 4 * host_pages.PAGE
    assert t.sum().item() == 10 + 2 * 1024  # every other page reads as zero


def test_engine_pools_commit_as_adapters_and_tokens_arrive(tiny_llama, adapter_factory) -> None:
    engine = LLMEngine(model=tiny_llama, dtype="float32", device="cpu", max_num_seqs=16,
                       max_lora_rank=64, max_model_len=256)
    start = engine.memory_use()
    assert start.lora_reserved >= 16 * 64 * engine.lora_capacity.bytes_per_rank_row
    assert start.lora_committed == 0 and start.kv_committed == 0 < start.kv_reserved
    engine.add_adapter("a", adapter_factory(tiny_llama, "a", r=8))
    params = SamplingParams(temperature=0.0, max_new_tokens=4)
    engine.generate([[5, 6, 7]], params, adapters=["a"])
    after = engine.memory_use()
    assert 0 < after.lora_committed < after.lora_reserved // 8  # one rank-8 adapter's pages
    assert 0 < after.kv_committed < after.kv_reserved
    assert "committed" in after.describe()
