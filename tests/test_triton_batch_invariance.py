"""The Triton backend's batch-invariant mode (kernel_backends/triton, under the interpreter):
a probe row's result is the same bits alone and beside other rows (other adapters, ranks,
lengths, row offsets), decoded with or without split-KV, and prefilled whole or in chunks;
and still the torch backend's answer (the oracle) within tolerance."""

from __future__ import annotations

import itertools
import os

import pytest
import torch
from loraplex import LLMEngine, SamplingParams
from loraplex.benchmarks.invariance_cost import Cost
from loraplex.kernel_backends.torch import attention as reference
from loraplex.kernel_backends.torch import layer_ops
from loraplex.kernel_backends.torch.quantized_linear import quantized_linear
from loraplex.kernel_backends.triton import (
    ENV_BATCH_INVARIANT,
    TritonBackend,
    attention,
    attention_prefill,
    invariance_from_env,
    invariant_rows,
    sgmv,
)
from loraplex.kernel_backends.triton.triton_lora_segments import TritonLoRASegments
from loraplex.kernel_backends.weight_quantization import quantize_weight

from tests.conftest import ALL_TARGETS, make_adapter
from tests.kernel_fixtures import make_lora_pools, make_paged_cache

pytestmark = pytest.mark.triton

DEVICE = torch.device("cuda" if os.environ.get("TRITON_INTERPRET") == "0" else "cpu")
HEAD_DIM = 40  # padded to 64 and masked by the kernels
NUM_KV_HEADS = 2
GQA = 3
SPLIT_LEN = 64  # INVARIANT_SPLIT_LEN in these tests: contexts of a few hundred split
TOL = {torch.float32: {"rtol": 1e-4, "atol": 1e-4}, torch.bfloat16: {"rtol": 2e-2, "atol": 2e-2}}


@pytest.fixture
def short_splits(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(attention, "INVARIANT_SPLIT_LEN", SPLIT_LEN)


def _decode(q, k_cache, v_cache, tables, lens: list[int], rows: list[int], window: int,
            softcap: float, max_context_len: int | None = None) -> torch.Tensor:
    """Batch-invariant decode of the sequences ``rows`` (their q rows, table rows, lengths)."""
    ctx = torch.tensor([lens[r] for r in rows], dtype=torch.int32, device=DEVICE)
    return attention.paged_attention_decode(
        q[rows], k_cache, v_cache, tables[rows], ctx, HEAD_DIM**-0.5, softcap, window,
        max_context_len=max_context_len or max(lens[r] for r in rows), batch_invariant=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("softcap, window", [(0.0, 0), (5.0, 0), (0.0, 100)],
                         ids=["plain", "softcap", "window"])
def test_decode_rows_equal_alone_and_in_any_batch(short_splits: None, dtype: torch.dtype,
                                                  softcap: float, window: int) -> None:
    """Probes of 40 (one split) and 150 (three splits) positions decoded alone, beside
    sequences of 1 to 300 positions (the batch splits), and with a longer host maximum (more
    split programs, empty for them): the same bits each time, and the torch answer."""
    lens = [40, 150, 1, 300, 64, 129]
    k_cache, v_cache, tables = make_paged_cache(lens, 16, NUM_KV_HEADS, HEAD_DIM, dtype,
                                                DEVICE, seed=7)
    g = torch.Generator().manual_seed(3)
    q = torch.randn(len(lens), NUM_KV_HEADS * GQA, HEAD_DIM, generator=g).to(dtype).to(DEVICE)
    batch = _decode(q, k_cache, v_cache, tables, lens, [2, 0, 3, 1, 4, 5], window, softcap)
    wider = _decode(q, k_cache, v_cache, tables, lens, [1, 0], window, softcap,
                    max_context_len=700)
    for probe, at_batch, at_wider in ((0, 1, 1), (1, 3, 0)):
        alone = _decode(q, k_cache, v_cache, tables, lens, [probe], window, softcap)[0]
        assert torch.equal(alone, batch[at_batch]), f"probe {probe} beside others"
        assert torch.equal(alone, wider[at_wider]), f"probe {probe} with more splits"
    ctx = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    want = reference.paged_attention_decode(q, k_cache, v_cache, tables, ctx,
                                            HEAD_DIM**-0.5, softcap, window)
    torch.testing.assert_close(batch, want[[2, 0, 3, 1, 4, 5]], **TOL[dtype])


def test_invariant_decode_splits_only_by_absolute_positions(short_splits: None) -> None:
    """The mode picks its splits itself: an explicit num_splits is refused."""
    lens = [100]
    k_cache, v_cache, tables = make_paged_cache(lens, 16, NUM_KV_HEADS, HEAD_DIM,
                                                torch.float32, DEVICE)
    q = torch.randn(1, NUM_KV_HEADS, HEAD_DIM).to(DEVICE)
    ctx = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="num_splits"):
        attention.paged_attention_decode(q, k_cache, v_cache, tables, ctx, 0.1,
                                         max_context_len=100, num_splits=2,
                                         batch_invariant=True)


def _prefill(q_rows: torch.Tensor, k_cache, v_cache, tables, chunks: list[tuple[int, int, int]],
             window: int) -> torch.Tensor:
    """Batch-invariant prefill of ``chunks``: (table row, first position, end position),
    each chunk's queries the rows first..end-1 of ``q_rows[table row]``."""
    q = torch.cat([q_rows[s][lo:hi] for s, lo, hi in chunks])
    qsl = torch.tensor([0] + torch.tensor([hi - lo for _, lo, hi in chunks]).cumsum(0).tolist(),
                       dtype=torch.int32, device=DEVICE)
    ctx = torch.tensor([hi for _, _, hi in chunks], dtype=torch.int32, device=DEVICE)
    return attention_prefill.paged_attention_prefill(
        q, k_cache, v_cache, tables[[s for s, _, _ in chunks]], qsl, ctx, HEAD_DIM**-0.5,
        window=window, max_q_len=max(hi - lo for _, lo, hi in chunks), batch_invariant=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [0, 45])
def test_prefill_rows_equal_whole_chunked_and_beside_others(dtype: torch.dtype,
                                                             window: int) -> None:
    """A 100-token prompt prefilled whole, in chunks of 30 / 47 / 23 (each chunk sees the
    earlier ones as a cached prefix), and as one chunk beside two other sequences' chunks
    of 5 and 70 tokens: every query row the same bits; the whole prompt the torch answer."""
    lens = [100, 5, 90]
    k_cache, v_cache, tables = make_paged_cache(lens, 16, NUM_KV_HEADS, HEAD_DIM, dtype,
                                                DEVICE, seed=5)
    g = torch.Generator().manual_seed(4)
    q_rows = [torch.randn(n, NUM_KV_HEADS * GQA, HEAD_DIM, generator=g).to(dtype).to(DEVICE)
              for n in lens]
    whole = _prefill(q_rows, k_cache, v_cache, tables, [(0, 0, 100)], window)
    chunked = torch.cat([_prefill(q_rows, k_cache, v_cache, tables, [(0, lo, hi)], window)
                         for lo, hi in ((0, 30), (30, 77), (77, 100))])
    beside = _prefill(q_rows, k_cache, v_cache, tables, [(1, 0, 5), (0, 30, 77), (2, 20, 90)],
                      window)
    assert torch.equal(whole, chunked)
    assert torch.equal(whole[30:77], beside[5:52])
    qsl = torch.tensor([0, 100], dtype=torch.int32, device=DEVICE)
    ctx = torch.tensor([100], dtype=torch.int32, device=DEVICE)
    want = reference.paged_attention_prefill(q_rows[0], k_cache, v_cache, tables[:1], qsl, ctx,
                                             HEAD_DIM**-0.5, window=window)
    torch.testing.assert_close(whole, want, **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lora_rows_equal_alone_and_beside_other_adapters(dtype: torch.dtype) -> None:
    """Five probe tokens of a rank-8 adapter through a fused 3-slice layer: alone, then
    after 3 earlier tokens of their adapter (other offsets in the 16-row tiles) among tokens
    of adapters of ranks 1 to 16 and base tokens, then split across two row blocks: the
    probe rows of ``out`` are the same bits each time, and the adapters' own formula."""
    outs, ranks = [72, 40, 40], [[8, 16, 1, 4], [8, 3, 16, 0], [8, 7, 2, 13]]
    pools = make_lora_pools(96, outs, ranks, 16, dtype, DEVICE, seed=9, unit=8,
                            r_major_b=True, first_unit=40, gap_units=1)
    g = torch.Generator().manual_seed(6)
    probe_x = torch.randn(5, 96, generator=g).to(dtype).to(DEVICE)
    probe_base = torch.randn(5, sum(outs), generator=g).to(dtype).to(DEVICE)

    def probe_out(before: list[int], after: list[int], lead: int) -> torch.Tensor:
        """out rows of the probe placed after ``lead`` tokens of its own adapter."""
        adapters = before + [0] * (lead + 5) + after
        n = len(adapters)
        x = torch.randn(n, 96, generator=g).to(dtype).to(DEVICE)
        out = torch.randn(n, sum(outs), generator=g).to(dtype).to(DEVICE)
        at = len(before) + lead
        x[at : at + 5], out[at : at + 5] = probe_x, probe_base
        slots = pools.token_slots(adapters)
        seg = TritonLoRASegments.from_token_slots(slots, DEVICE)
        sgmv.add_lora(out, x, pools.lora_a, pools.lora_b, pools.ranks, seg)
        return out[at : at + 5]

    alone = probe_out([], [], 0)
    for before, after, lead in (([1, 2, -1, 3], [2, 1, -1], 3), ([3] * 20 + [1], [2] * 9, 13),
                                ([-1, 2], [0, 1], 0)):
        assert torch.equal(alone, probe_out(before, after, lead)), (before, after, lead)
    want = probe_base.float() + pools.oracle(probe_x, pools.token_slots([0] * 5))
    torch.testing.assert_close(alone.float(), want, **TOL[dtype])


def test_backend_mode_from_argument_or_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_BATCH_INVARIANT, raising=False)
    assert not TritonBackend(DEVICE, torch.float32).batch_invariant
    backend = TritonBackend(DEVICE, torch.float32, invariance="batch")
    assert backend.batch_invariant and not backend.decode_as_prefill
    monkeypatch.setenv(ENV_BATCH_INVARIANT, "1")
    assert TritonBackend(DEVICE, torch.float32).invariance == "batch"
    assert not TritonBackend(DEVICE, torch.float32, invariance="off").batch_invariant
    monkeypatch.setenv(ENV_BATCH_INVARIANT, "rescore")
    backend = TritonBackend(DEVICE, torch.float32)
    assert backend.batch_invariant and backend.decode_as_prefill
    monkeypatch.setenv(ENV_BATCH_INVARIANT, "maybe")
    with pytest.raises(ValueError, match=ENV_BATCH_INVARIANT):
        invariance_from_env()
    with pytest.raises(ValueError, match="invariance="):
        TritonBackend(DEVICE, torch.float32, invariance="on")


@pytest.mark.parametrize("window", [0, 45])
def test_decode_as_prefill_rows_equal_the_prompts_rows(window: int) -> None:
    """The "rescore" mode's decode: each of three sequences' last token decoded (one row
    each, beside each other) is bitwise that token's row of its whole prompt's prefill;
    and the torch decode's answer."""
    lens = [100, 37, 70]
    k_cache, v_cache, tables = make_paged_cache(lens, 16, NUM_KV_HEADS, HEAD_DIM,
                                                torch.float32, DEVICE, seed=11)
    g = torch.Generator().manual_seed(13)
    q_rows = [torch.randn(n, NUM_KV_HEADS * GQA, HEAD_DIM, generator=g).to(DEVICE)
              for n in lens]
    q = torch.stack([rows[-1] for rows in q_rows])
    ctx = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    got = attention_prefill.decode_as_prefill(q, k_cache, v_cache, tables, ctx,
                                              HEAD_DIM**-0.5, window=window)
    for s, n in enumerate(lens):
        whole = _prefill(q_rows, k_cache, v_cache, tables, [(s, 0, n)], window)
        assert torch.equal(got[s], whole[-1]), s
    want = reference.paged_attention_decode(q, k_cache, v_cache, tables, ctx, HEAD_DIM**-0.5,
                                            window=window)
    torch.testing.assert_close(got, want, **TOL[torch.float32])


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_invariant_quantized_linear_rows_equal_for_any_row_count(method: str) -> None:
    """The backend's quantized linear in the mode: a probe row alone and among 40 rows gives
    the same bits; and the torch twin's answer (dequantize, then F.linear)."""
    g = torch.Generator().manual_seed(12)
    weight = quantize_weight(torch.randn(72, 256, generator=g).to(DEVICE), method)
    backend = TritonBackend(DEVICE, torch.float32, invariance="batch")
    x = torch.randn(40, 256, generator=g).to(DEVICE)
    alone = backend.quantized_linear(x[17:18], weight)
    assert torch.equal(backend.quantized_linear(x, weight)[17:18], alone)
    torch.testing.assert_close(alone, quantized_linear(x[17:18], weight),
                               **TOL[torch.float32])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_invariant_rms_norm_and_logsumexp_rows_equal_for_any_row_count(
        dtype: torch.dtype) -> None:
    """RMSNorm of a probe row (1500 columns: two chunks) and the log-sum-exp of a logits row
    alone and among 6 rows: the same bits; the torch backend's rms_norm and
    torch.logsumexp within tolerance."""
    g = torch.Generator().manual_seed(10)
    weight = torch.randn(1500, generator=g).to(dtype).to(DEVICE)
    rows = torch.randn(6, 1500, generator=g).to(dtype).to(DEVICE)
    alone = invariant_rows.rms_norm(rows[4:5], weight, 1e-6)
    assert torch.equal(invariant_rows.rms_norm(rows, weight, 1e-6)[4:5], alone)
    torch.testing.assert_close(alone, layer_ops.rms_norm(rows[4:5], weight, 1e-6),
                               **TOL[dtype])
    logits = torch.randn(6, 1500, generator=g).to(DEVICE) * 4
    logits[2, :700] = float("-inf")  # a masked row
    lse = invariant_rows.logsumexp_rows(logits)
    assert torch.equal(invariant_rows.logsumexp_rows(logits[2:3]), lse[2:3])
    torch.testing.assert_close(lse, torch.logsumexp(logits, -1, keepdim=True), rtol=1e-5,
                               atol=1e-5)


def test_engine_probe_alone_equals_probe_in_a_batch(monkeypatch: pytest.MonkeyPatch,
                                                    tiny_llama, tmp_path) -> None:
    """Through the engine on the Triton backend in its batch-invariant mode (float32): a
    probe request of an adapter gives the same tokens and the same logprob bits (sampled and
    top 3) alone and beside requests of other adapters and lengths whose tokens change how
    its prompt is chunked, its first block then a prefix-cache hit; its tokens are PEFT's
    greedy tokens."""
    from peft import PeftModel  # here: the GPU check runs this file without peft
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("LORAPLEX_KERNELS", "triton")
    monkeypatch.setenv(ENV_BATCH_INVARIANT, "1")
    adapters = {
        "qv": make_adapter(tiny_llama, tmp_path / "qv", r=4, target_modules=["q_proj", "v_proj"]),
        "all": make_adapter(tiny_llama, tmp_path / "all", r=16, target_modules=ALL_TARGETS,
                            seed=1),
    }
    engine = LLMEngine(model=tiny_llama, dtype="float32", max_lora_rank=16, max_model_len=96,
                       max_num_batched_tokens=24,
                       lora_modules={k: str(v) for k, v in adapters.items()})
    assert engine.runner.kernels.batch_invariant
    params = SamplingParams(temperature=0.0, max_new_tokens=4, min_new_tokens=4, logprobs=3)
    probe = list(range(30, 58))
    alone = engine.generate([probe], params, adapters=["all"])[0]
    batch = engine.generate([[7, 8, 9], list(range(60, 79)), probe, [5, 6]], params,
                            adapters=["qv", None, "all", "all"])
    assert batch[2].num_cached_tokens > 0 and alone.num_cached_tokens == 0
    assert batch[2].token_ids == alone.token_ids
    assert batch[2].logprobs == alone.logprobs  # dataclass equality: every float's bits
    model = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32), adapters["all"])
    ref = model.eval().generate(torch.tensor([probe]), max_new_tokens=4, min_new_tokens=4,
                                do_sample=False, pad_token_id=0)
    assert alone.token_ids == ref[0, len(probe):].tolist()


def test_invariance_cost_verdict_fails_on_a_row_that_moves() -> None:
    """benchmarks/invariance_cost.py's verdict (gpu_check's): FAIL when an op's probe row
    differs alone and in the batch, or from the default op beyond tolerance."""
    cost = Cost(DEVICE, torch.float32, timed=False)
    cost.same("equal", torch.ones(3), torch.ones(3))
    cost.close("close", torch.ones(3), torch.ones(3) + 1e-6)
    assert cost.verdict().startswith("PASS")
    cost.same("moved", torch.ones(3), torch.ones(3) + 1e-6)
    cost.close("far", torch.ones(3), torch.zeros(3))
    assert cost.verdict().startswith("FAIL")
    assert [f.split(":")[0] for f in cost.failures] == ["moved", "far"]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_batch_compositions_keep_a_probes_decode_and_prefill_bits(
        short_splits: None, seed: int) -> None:
    """Random batches (2 to 5 other sequences of 1 to 260 positions, the probe at a random
    place, a random window) and a random chunking of the probe's prompt: its decode row and
    its prompt rows are the bits it has alone and whole."""
    g = torch.Generator().manual_seed(100 + seed)
    others = torch.randint(1, 261, (int(torch.randint(2, 6, (1,), generator=g)),),
                           generator=g).tolist()
    probe_len = int(torch.randint(1, 200, (1,), generator=g))
    at = int(torch.randint(0, len(others) + 1, (1,), generator=g))
    lens = others[:at] + [probe_len] + others[at:]
    window = [0, 37][int(torch.randint(0, 2, (1,), generator=g))]
    k_cache, v_cache, tables = make_paged_cache(lens, 16, NUM_KV_HEADS, HEAD_DIM,
                                                torch.float32, DEVICE, seed=seed)
    q = torch.randn(len(lens), NUM_KV_HEADS * GQA, HEAD_DIM, generator=g).to(DEVICE)
    alone = _decode(q, k_cache, v_cache, tables, lens, [at], window, 0.0)
    batch = _decode(q, k_cache, v_cache, tables, lens, list(range(len(lens))), window, 0.0)
    assert torch.equal(alone[0], batch[at]), (lens, at, window)
    q_rows = [torch.randn(n, NUM_KV_HEADS * GQA, HEAD_DIM, generator=g).to(DEVICE)
              for n in lens]
    cuts = sorted({0, probe_len, *torch.randint(1, probe_len + 1, (2,), generator=g).tolist()})
    whole = _prefill(q_rows, k_cache, v_cache, tables, [(at, 0, probe_len)], window)
    chunks = [(at, lo, hi) for lo, hi in itertools.pairwise(cuts)]
    neighbour = (at + 1) % len(lens)
    chunked = torch.cat([_prefill(q_rows, k_cache, v_cache, tables,
                                  [(neighbour, 0, lens[neighbour]), chunk], window)
                         [lens[neighbour]:] for chunk in chunks])
    assert torch.equal(whole, chunked), (lens, at, window, cuts)


def test_engine_decode_logprobs_equal_a_rescore_in_rescore_mode(
        monkeypatch: pytest.MonkeyPatch, tiny_llama, tmp_path) -> None:
    """``LORAPLEX_BATCH_INVARIANT=rescore`` (float32, an adapter on every linear): the
    logprobs a greedy request reports for its sampled tokens are bitwise the
    prompt_logprobs of the same sequence sent back as a prompt (echo)."""
    monkeypatch.setenv("LORAPLEX_KERNELS", "triton")
    monkeypatch.setenv(ENV_BATCH_INVARIANT, "rescore")
    adapter = make_adapter(tiny_llama, tmp_path / "all", r=16, target_modules=ALL_TARGETS,
                           seed=1)
    engine = LLMEngine(model=tiny_llama, dtype="float32", max_lora_rank=16, max_model_len=96,
                       max_num_batched_tokens=24, lora_modules={"all": str(adapter)})
    probe = list(range(30, 58))
    out = engine.generate([probe], SamplingParams(temperature=0.0, max_new_tokens=4,
                                                  min_new_tokens=4, logprobs=0),
                          adapters=["all"])[0]
    echo = engine.generate([probe + out.token_ids],
                           SamplingParams(temperature=0.0, max_new_tokens=1, prompt_logprobs=0),
                           adapters=["all"])[0]
    assert [lp.logprob for lp in out.logprobs] == \
        [lp.logprob for lp in echo.prompt_logprobs[len(probe):]]
