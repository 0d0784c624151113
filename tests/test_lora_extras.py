"""What each LoRA slot reserves beside its rank rows (engine/lora_extras.py): lora_B's bias
rows, DoRA's gain rows and the device copy of an adapter's own token rows, counted by the
start-up budget (the pool with --max-loras auto, the KV cache on CUDA), reported, and an
adapter whose token rows exceed the reserve refused at registration. The accounting is
device-independent: the numbers are checked against what the slots really allocate (the
layers' tables, the adapters' TokenRows) and the budgets they resolve to."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from loraplex import LLMEngine, SamplingParams
from loraplex.engine import model_runner
from loraplex.engine.engine_config import EngineConfig
from loraplex.engine.lora_capacity import resolve
from loraplex.engine.lora_extras import LoRAExtras, lora_extras, token_rows
from loraplex.engine.memory_use import MemoryUse
from loraplex.engine.model_runner import num_kv_blocks
from loraplex.lora.peft_checks import AdapterError
from loraplex.lora.peft_format import inspect_peft_adapter, read_peft_adapter
from transformers import AutoConfig

from tests.conftest import ALL_TARGETS, make_adapter
from tests.test_token_rows import KINDS, TOKENS, make_token_adapter

ROW = 1000  # bytes of one rank row
PROMPT = [5, 17, 33, 9, 120, 7, 44, 3]


@pytest.fixture(scope="module")
def made(tiny_llama, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("extras")
    ads = {f"bias{i}": make_adapter(tiny_llama, root / f"bias{i}", seed=i, lora_bias=True,
                                    target_modules=ALL_TARGETS) for i in range(2)}
    ads |= {f"dora{i}": make_adapter(tiny_llama, root / f"dora{i}", seed=5 + i, use_dora=True,
                                     target_modules=ALL_TARGETS) for i in range(2)}
    ads |= {kind: make_token_adapter(tiny_llama, root / kind, 11, **KINDS[kind])
            for kind in ("tokens", "head")}
    return ads


def engine(base, made: dict, names: tuple[str, ...], **kw) -> LLMEngine:
    return LLMEngine(model=base, dtype="float32", max_loras=2, max_lora_rank=8,
                     max_model_len=64, debug_checks=True,
                     lora_modules={n: str(made[n]) for n in names}, **kw)


def run(eng: LLMEngine, adapters: list[str]) -> None:
    eng.generate([PROMPT] * len(adapters), SamplingParams(temperature=0.0, max_new_tokens=2),
                 adapters=adapters)


def test_the_reserve_is_what_full_slots_allocate(tiny_llama, made):
    """Both slots holding lora_bias adapters, then DoRA ones: the layers' bias and gain
    tables reach exactly max_loras × the per-slot reserve, and MemoryUse says so."""
    eng = engine(tiny_llama, made, ("bias0", "bias1", "dora0", "dora1"))
    extras = eng.resolved.extras
    assert eng.lora_capacity.extras_per_slot == extras.per_slot > 0
    run(eng, ["bias0", "bias1"])
    assert eng.slot_buffers.extras_bytes == 2 * extras.bias_bytes
    run(eng, ["dora0", "dora1"])
    assert eng.slot_buffers.extras_bytes == 2 * (extras.bias_bytes + extras.gain_bytes)
    use = eng.memory_use()
    assert use.extras_used == use.extras_reserved == eng.lora_capacity.extras_bytes
    assert "slots' extras" in use.describe() and "reserved beside the pool" in \
        eng.lora_capacity.reason


def test_token_rows_over_the_reserve_are_refused(tiny_llama, made):
    """--max-lora-token-rows 4: the trainable-tokens adapter (4 rows) is served, the
    lm_head table (vocab_size rows) is refused at registration, naming the rows and the
    flag, and nothing of it is kept."""
    eng = engine(tiny_llama, made, ("tokens",), max_lora_token_rows=len(TOKENS))
    run(eng, ["tokens"])
    with pytest.raises(AdapterError, match=r"384 rows of hidden_size\) exceed the 4 rows each "
                                           r"LoRA slot reserves.*--max-lora-token-rows 384"):
        eng.add_adapter("head", made["head"])
    assert [a.name for a in eng.list_adapters()] == ["tokens"]
    with pytest.raises(ValueError, match="max_lora_token_rows=-1 is out of range"):
        EngineConfig(max_lora_token_rows=-1)


def test_on_a_gpu_the_launch_adapters_set_the_token_reserve(tiny_llama, made):
    """The default bound on a GPU is the most rows of the --lora-modules adapters, and a
    slot's reserve for them holds the device copy of their TokenRows; on the CPU (host
    copies serve) there is no bound and nothing reserved for them."""
    eng = engine(tiny_llama, made, ())
    targets = [(0, SimpleNamespace(proj=torch.nn.Linear(64, 384)), "proj", ("proj",), [384])]
    hidden = AutoConfig.from_pretrained(tiny_llama).hidden_size
    metas = {k: inspect_peft_adapter(made[k], eng.base_shapes, 8, k) for k in ("tokens", "head")}
    cfg = EngineConfig(lora_modules={"tokens": str(made["tokens"])})
    gpu = lora_extras(cfg, targets, torch.float32, torch.device("cuda"), [metas["tokens"]],
                      hidden)
    held = read_peft_adapter(made["tokens"], eng.base_shapes, 8).tokens
    assert gpu.max_token_rows == token_rows(metas["tokens"]) == len(TOKENS)
    assert gpu.max_token_rows * gpu.token_row_bytes == held.nbytes  # rows and their ids
    assert gpu.bias_bytes == 384 * 4 and gpu.gain_bytes == 384 * 4
    with pytest.raises(AdapterError, match="exceed the 4 rows"):
        gpu.check(metas["head"])
    both = lora_extras(cfg, targets, torch.float32, torch.device("cuda"), metas.values(), hidden)
    head = read_peft_adapter(made["head"], eng.base_shapes, 8).tokens
    assert both.max_token_rows == 384 and both.max_token_rows * both.token_row_bytes >= \
        head.nbytes
    cpu = lora_extras(cfg, targets, torch.float32, torch.device("cpu"), metas.values(), hidden)
    assert cpu.max_token_rows is None and cpu.per_slot == cpu.bias_bytes + cpu.gain_bytes
    cpu.check(metas["head"])


def test_the_extras_are_reserved_beside_the_pool():
    """The budget sizes the pool as before; each slot's extras are on top: with --max-loras
    auto as many slots as leave the pool, their extras and the minimum KV cache within what
    is left after the weights; with N, N × per slot."""
    extras = LoRAExtras(4 * ROW, 6 * ROW, None, 0, "test")  # 10 rows' worth per slot
    cfg = EngineConfig(max_num_seqs=32, max_lora_rank=16, lora_memory=100 * ROW)
    cap = resolve(cfg, ROW, 1, 300 * ROW, 100 * ROW, extras)
    assert cap.num_units == 100 and cap.max_loras == (300 - 100 - 100) // 10 == 10
    assert cap.extras_bytes == 100 * ROW and "the slots' extras" in cap.reason
    assert cap.pool_bytes + cap.extras_bytes + 100 * ROW <= 300 * ROW
    roomy = resolve(cfg, ROW, 1, 10 * 1 << 30, 0, extras)
    assert (roomy.max_loras, roomy.num_units) == (32, 100)  # the cap binds, not the extras
    assert roomy.extras_bytes == 32 * 10 * ROW
    fixed = resolve(EngineConfig(max_loras=3, max_lora_rank=16), ROW, 1, 0, 0, extras)
    assert fixed.extras_bytes == 30 * ROW and fixed.pool_bytes == 48 * ROW
    with pytest.raises(ValueError, match="no LoRA slot's extras.*--max-lora-token-rows"):
        resolve(cfg, ROW, 1, 205 * ROW, 100 * ROW, extras)


def test_the_cuda_kv_cache_leaves_the_extras_reserve(tiny_llama, monkeypatch):
    """On CUDA the KV cache takes what is left within --gpu-memory-utilization, less the
    slots' extras (allocated later, as adapters need them)."""
    config = AutoConfig.from_pretrained(tiny_llama)
    cfg = EngineConfig(gpu_memory_utilization=0.5)
    per_block = model_runner.kv_bytes_per_block(config, cfg.block_size, torch.float32)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (900 * per_block,
                                                                         1000 * per_block))
    cuda = torch.device("cuda")
    assert num_kv_blocks(cfg, config, torch.float32, cuda, 64) == 400
    assert num_kv_blocks(cfg, config, torch.float32, cuda, 64, 150 * per_block) == 250
    assert MemoryUse(0, 0, 0, 0, 0, 0, 0).describe().count("extras") == 0
