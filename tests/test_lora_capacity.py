"""--max-loras auto|N and --lora-memory: what they resolve to, and why."""

from __future__ import annotations

import pytest
from loraplex import LLMEngine
from loraplex.engine.engine_config import EngineConfig
from loraplex.engine.lora_capacity import LORA_MEMORY_SHARE, resolve

ROW = 1000  # bytes of one rank row
GIB = 1 << 30


def test_an_explicit_max_loras_keeps_vllms_meaning():
    cap = resolve(EngineConfig(max_loras=4, max_lora_rank=16), ROW, 1, 10 * GIB, 0)
    assert (cap.max_loras, cap.num_units) == (4, 64)
    assert cap.pool_bytes == 64 * ROW and "--max-loras 4" in cap.reason


def test_auto_fills_the_budget_up_to_max_num_seqs_adapters_of_max_rank():
    cfg = EngineConfig(max_num_seqs=32, max_lora_rank=16, lora_memory=100 * 16 * ROW)
    cap = resolve(cfg, ROW, 1, 10 * GIB, 0)
    assert cap.max_loras == 32 and cap.num_units == 32 * 16  # the cap binds, not the budget
    small = resolve(EngineConfig(max_num_seqs=32, max_lora_rank=16, lora_memory=40 * ROW),
                    ROW, 8, 10 * GIB, 0)
    assert small.max_loras == 32 and small.num_units == 5  # 40 rows in units of 8
    assert "40 rank rows" in small.reason and "--lora-memory" in small.reason


def test_auto_defaults_to_a_share_of_what_is_left_after_a_minimum_kv_cache():
    cfg = EngineConfig(max_num_seqs=1000, max_lora_rank=8)
    cap = resolve(cfg, ROW, 1, left_bytes=1_000_000, min_kv_bytes=200_000)
    assert cap.num_units == int(800_000 * LORA_MEMORY_SHARE) // ROW
    assert f"{LORA_MEMORY_SHARE:.0%}" in cap.reason and "minimum KV cache" in cap.reason


def test_auto_never_exceeds_the_host_tier():
    cfg = EngineConfig(max_num_seqs=32, max_cpu_loras=8, lora_memory=GIB)
    cap = resolve(cfg, ROW, 1, 10 * GIB, 0)
    assert cap.max_loras == 8 and "max_cpu_loras" in cap.reason


def test_a_budget_that_holds_no_adapter_of_max_rank_is_refused_with_the_way_out():
    with pytest.raises(ValueError, match="holds no adapter of max_lora_rank 64.*--lora-memory"):
        resolve(EngineConfig(max_lora_rank=64, lora_memory=10 * ROW), ROW, 1, 10 * GIB, 0)


@pytest.mark.parametrize("kwargs, match", [
    ({"max_loras": "many"}, "'auto' or an integer"),
    ({"max_loras": 0}, "max_loras"),
    ({"lora_memory": 0}, "lora_memory"),
    ({"max_adapter_reads": 0}, "max_adapter_reads"),
])
def test_bad_settings_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(**kwargs)


def test_auto_is_the_default_and_the_host_tier_follows_it():
    cfg = EngineConfig(max_num_seqs=16)  # the config stays as given; the host tier's size
    assert cfg.max_loras == "auto" and cfg.max_cpu_loras is None and cfg.host_loras == 32
    assert EngineConfig(max_loras="6").max_loras == 6


def test_the_engine_says_what_auto_resolved_to(tiny_llama):
    engine = LLMEngine(model=tiny_llama, dtype="float32", max_num_seqs=4, max_lora_rank=8)
    cap = engine.lora_capacity
    assert cap.max_loras == 4 and engine.lora.max_loras == 4
    assert cap.num_units * cap.rank_unit == 4 * 8  # 4 adapters of max rank; RAM is plenty
    assert engine.stats()["lora_pool_units_total"] == cap.num_units
    assert cap.reason.startswith("--max-loras auto")
