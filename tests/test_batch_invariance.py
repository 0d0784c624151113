"""Batch invariance (issue 45, items 1, 3 and 5): a request's output tokens and every logprob
it reports (sampled, top-k, prompt logprobs) are the same bits alone or beside any other
requests (other adapters and lengths), with or without prefix-cache hits, whatever the
chunked-prefill split, after preemption, for each choice of n; and a sequence's decode
logprobs equal, bit for bit, the prompt logprobs of the same sequence sent back as a prompt
(an echo re-score).

The oracle is the probe alone, one request in an engine that computes its whole prompt in
one step without a prefix cache. The property test draws batch compositions from a seeded
generator (a fixed number of draws per backend and dtype, so a failure reproduces): the
probe's adapter, length and sampling (greedy or seeded, n), its neighbours' adapters and
lengths, the step's token budget (which sets the chunked-prefill split) and whether the
probe's prompt is already in the prefix cache.

The CPU backend keeps the guarantee in float32 and bfloat16 (docs/sampling.md says how);
the torch backend, the oracle of the kernels, is not batch-invariant (its GEMMs are
PyTorch's, whose rows depend on the batch) and is checked here only to say so.
"""

from __future__ import annotations

import random

import pytest
import torch
from loraplex import LLMEngine, SamplingParams
from loraplex.kernel_backends import cpu as cpu_backend
from loraplex.kernel_backends.cpu import attention as cpu_attention
from loraplex.kernel_backends.torch import attention as reference

from tests import invariance_draws as draws
from tests.kernel_fixtures import make_paged_cache

DRAWS = 12  # batch compositions per dtype (each: 1 + 0..5 neighbours, several steps)
DTYPES = ["float32", "bfloat16"]

needs_cpu = pytest.mark.skipif(not cpu_backend.available(),
                               reason="the CPU kernels do not build here")


# ---- the cause, at the attention kernel ----------------------------------------------------

@needs_cpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("softcap", "window"), [(0.0, 0), (30.0, 0), (0.0, 50)])
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 2), (9, 3), (7, 1), (8, 8)])
def test_a_positions_attention_is_the_same_bits_in_every_split(dtype, softcap, window, heads,
                                                               kv_heads):
    """A sequence of 150 tokens (past two 64-position key chunks), its queries computed as one
    prefill, in chunked-prefill pieces over the cached prefix (17, 1, 64, 2, ...), and one
    token at a time as decodes, beside another sequence: each position's output is the same
    bits every way (the decode kernel's two-pass softmax was not), and near the oracle. The
    KV-head groups of 2, 3, 7 and 1 query heads put a row in register tiles of every size
    (a decode's group is one tile of its own rows, a prefill's rows tiles of six)."""
    from loraplex.kernel_backends.cpu import extension

    ext = extension.load()
    total, other = 150, 70
    k_cache, v_cache, tables = make_paged_cache([total, other], 16, kv_heads, 64, dtype, seed=3)
    q = torch.randn(total + other, heads, 64,
                    generator=torch.Generator().manual_seed(4)).to(dtype)
    qa, qb = q[:total], q[total:]
    scale = 64**-0.5
    b_then_a = tables[[1, 0]].contiguous()

    def pieces(cuts: list[int]) -> torch.Tensor:
        """Sequence a's rows, in steps ending at ``cuts``, each beside all of sequence b."""
        rows, start = [], 0
        for end in cuts:
            n = end - start
            qs = torch.cat([qb, qa[start:end]])
            qsl = torch.tensor([0, other, other + n], dtype=torch.int32)
            lens = torch.tensor([other, end], dtype=torch.int32)
            out = cpu_attention.paged_attention_prefill(ext, qs, k_cache, v_cache, b_then_a,
                                                        qsl, lens, scale, softcap, window, True)
            rows.append(out[other:])
            start = end
        return torch.cat(rows)

    whole = pieces([total])
    want = reference.paged_attention_prefill(qa, k_cache, v_cache, tables[:1],
                                             torch.tensor([0, total], dtype=torch.int32),
                                             torch.tensor([total], dtype=torch.int32), scale,
                                             softcap, window)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(whole.float(), want.float(), rtol=tol, atol=tol)
    for cuts in ([17, 18, 82, 84, 150], [1, 2, 3, 64, 65, 128, 149, 150]):
        assert torch.equal(pieces(cuts), whole), cuts
    decodes = torch.cat([  # token t alone: a decode with context t + 1
        cpu_attention.paged_attention_decode(ext, qa[t:t + 1], k_cache, v_cache, tables[:1],
                                             torch.tensor([t + 1], dtype=torch.int32), scale,
                                             softcap, window, True)
        for t in range(total)])
    assert torch.equal(decodes, whole)


@needs_cpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 80, 20])
@pytest.mark.parametrize("group", [1, 2, 3, 4, 5, 6, 7])
def test_a_decode_is_its_rows_bits_in_prefill_tiles_of_every_size(dtype, head_dim, group):
    """Each of the last tokens of a 137-token context, as a one-token decode, gives the bits
    of its row in a prefill of the last n tokens over the cached rest, for n = 1..13, 33 and
    137: with query-head groups of 1-7 a row sits at every place of register tiles of every
    size (1-6 rows), among 1-64 key positions of its last chunk (padded to the score tile).
    head_dim 20 takes the scalar twin of the score order (not a multiple of 8); head_dim 80
    mixes P·V's column passes (a 1-3-row tile: 64 or 32 columns, then 16; 4-6 rows: 16)."""
    from loraplex.kernel_backends.cpu import extension

    ext = extension.load()
    total = 137
    k_cache, v_cache, tables = make_paged_cache([total], 16, 1, head_dim, dtype, seed=5)
    q = torch.randn(total, group, head_dim,
                    generator=torch.Generator().manual_seed(6)).to(dtype)
    scale = head_dim**-0.5
    decodes = torch.cat([
        cpu_attention.paged_attention_decode(ext, q[t:t + 1], k_cache, v_cache, tables,
                                             torch.tensor([t + 1], dtype=torch.int32), scale,
                                             0.0, 0, True)
        for t in range(total)])
    want = reference.paged_attention_prefill(q, k_cache, v_cache, tables,
                                             torch.tensor([0, total], dtype=torch.int32),
                                             torch.tensor([total], dtype=torch.int32), scale)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(decodes.float(), want.float(), rtol=tol, atol=tol)
    for n in [*range(1, 14), 33, total]:
        out = cpu_attention.paged_attention_prefill(
            ext, q[total - n:], k_cache, v_cache, tables,
            torch.tensor([0, n], dtype=torch.int32), torch.tensor([total], dtype=torch.int32),
            scale, 0.0, 0, True)
        assert torch.equal(out, decodes[total - n:]), n


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> str:
    """A tiny llama with 64-wide heads in groups of two (GQA): the kernels' vector paths
    (AVX-512 and VDPBF16PS over head_dim % 32 == 0) serve it, as they serve real models."""
    from tests.conftest import make_tiny_model

    return str(make_tiny_model(tmp_path_factory.mktemp("invariance_llama"), "llama",
                               hidden_size=128, num_attention_heads=2, num_key_value_heads=1))


@pytest.fixture(scope="module")
def adapters(tiny_llama, tmp_path_factory) -> dict[str, str]:
    """Two real PEFT adapters of different ranks and targets."""
    from tests.conftest import ALL_TARGETS, make_adapter

    root = tmp_path_factory.mktemp("invariance_adapters")
    return {"a0": str(make_adapter(tiny_llama, root / "a0", r=8, seed=1)),
            "a1": str(make_adapter(tiny_llama, root / "a1", r=16, seed=2,
                                   target_modules=ALL_TARGETS))}


def engine(tiny_llama, adapters, dtype: str, **kw) -> LLMEngine:
    kw.setdefault("max_model_len", 256)
    return LLMEngine(model=tiny_llama, dtype=dtype, max_lora_rank=16, lora_modules=adapters,
                     **kw)


def run_draws(tiny_llama, adapters, dtype: str, seed: int, first_only: bool = False
              ) -> list[str]:
    """The draws whose probe differs from the probe alone (empty when invariant); with
    ``first_only``, the first such draw only."""
    rng = random.Random(seed)
    return draws.run_draws(lambda **kw: engine(tiny_llama, adapters, dtype, **kw),
                           [draws.draw(rng) for _ in range(DRAWS)], first_only)


@needs_cpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_cpu_probe_is_the_same_bits_in_every_batch(tiny_llama, adapters, dtype, monkeypatch):
    monkeypatch.setenv("LORAPLEX_KERNELS", "cpu")
    assert run_draws(tiny_llama, adapters, dtype, seed=45) == []


@needs_cpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_cpu_probe_after_preemption(tiny_llama, adapters, dtype, monkeypatch):
    """Few KV blocks: the probe or its neighbours are preempted and recompute."""
    monkeypatch.setenv("LORAPLEX_KERNELS", "cpu")
    rng = random.Random(7)
    probe, p = draws.prompt(rng, 70), draws.params(rng, 2, greedy=False)
    alone = draws.choices(engine(tiny_llama, adapters, dtype, enable_prefix_caching=False)
                    .generate([probe], p, ["a1"])[0])
    busy = engine(tiny_llama, adapters, dtype, num_kv_blocks=12, max_num_batched_tokens=32,
                  enable_prefix_caching=False)
    others = [draws.prompt(rng, n) for n in (3, 40, 17, 90, 1, 33)]
    op = [SamplingParams(temperature=1.0, seed=i, max_new_tokens=40, min_new_tokens=40)
          for i in range(len(others))]
    outs = busy.generate([probe] + others, [p] + op, ["a1", "a0", None, "a1", "a0", None, "a0"])
    assert busy.stats()["prompt_tokens_computed"] > len(probe) + sum(map(len, others))
    assert draws.choices(outs[0]) == alone


@needs_cpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_long_segments_lora_is_the_same_bits_in_every_split(tiny_llama, adapters, dtype,
                                                              monkeypatch):
    """A 300-token prompt on the rank-16 adapter: in one step its segment's work (300 × 16)
    passes lora_routes.KERNEL_MAX_WORK, where the step's LoRA delta took the "loop" route
    (PyTorch's GEMMs) while 64-token chunks took the kernel, other sums: its prompt and
    decode logprobs moved with the split, and an echo re-score (the whole sequence in one
    step) differed from the decode logprobs. On, every step's delta runs the kernel."""
    from loraplex.kernel_backends.cpu import lora_routes

    monkeypatch.setenv("LORAPLEX_KERNELS", "cpu")
    rng = random.Random(300)
    probe = draws.prompt(rng, 300)
    assert len(probe) * 16 > lora_routes.KERNEL_MAX_WORK
    p = draws.params(rng, 2, greedy=False)
    alone = draws.choices(engine(tiny_llama, adapters, dtype, max_model_len=512,
                                 enable_prefix_caching=False).generate([probe], p, ["a1"])[0])
    chunked = engine(tiny_llama, adapters, dtype, max_model_len=512, max_num_batched_tokens=64)
    assert draws.choices(chunked.generate([probe], p, ["a1"])[0]) == alone
    whole = engine(tiny_llama, adapters, dtype, max_model_len=512)
    assert draws.rescore_mismatches(whole, [(300, "a1", False)]) == []


def rescore_mismatches(tiny_llama, adapters, dtype: str, **kw) -> list[str]:
    return draws.rescore_mismatches(engine(tiny_llama, adapters, dtype, **kw))


@needs_cpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("budget", [512, 16])
def test_cpu_decode_logprobs_equal_an_echo_rescore(tiny_llama, adapters, dtype, budget,
                                                    monkeypatch):
    monkeypatch.setenv("LORAPLEX_KERNELS", "cpu")
    assert rescore_mismatches(tiny_llama, adapters, dtype,
                              max_num_batched_tokens=budget) == []


def test_torch_backend_is_not_batch_invariant(tiny_llama, adapters, monkeypatch):
    """The torch backend (PyTorch's GEMMs and attention, the kernels' oracle) makes no such
    promise: a probe's float32 logprobs move with its batch (docs/sampling.md). This test
    documents the limit; if it starts failing, the backend became invariant and the docs
    should say so. One differing draw says it: the draws stop there (every one of the 12
    differed when run to the end, ~17 s of CPU at load ~9)."""
    monkeypatch.setenv("LORAPLEX_KERNELS", "torch")
    assert run_draws(tiny_llama, adapters, "float32", seed=45, first_only=True) != []


def test_batch_invariant_is_auto_on_or_off():
    from loraplex.engine.engine_config import EngineConfig

    assert EngineConfig().batch_invariant == "auto"
    assert EngineConfig(batch_invariant="off").batch_invariant == "off"
    with pytest.raises(ValueError, match="batch_invariant"):
        EngineConfig(batch_invariant="yes")


def test_auto_is_on_for_the_cpu_backends_and_the_triton_modes_own_default(monkeypatch):
    """--batch-invariant auto: on for the CPU and torch backends; the Triton backend keeps
    the mode it was given (LORAPLEX_BATCH_INVARIANT, off when unset); on / off override it,
    and on keeps a "rescore" asked for."""
    from loraplex.kernel_backends.torch import TorchBackend
    from loraplex.kernel_backends.triton import TritonBackend

    cpu = torch.device("cpu")
    for setting, expected in (("auto", True), ("on", True), ("off", False)):
        backend = TorchBackend(cpu, torch.float32)
        backend.set_batch_invariant(setting)
        assert backend.batch_invariant is expected
    monkeypatch.delenv("LORAPLEX_BATCH_INVARIANT", raising=False)
    for given, setting, mode in (("off", "auto", "off"), ("off", "on", "batch"),
                                 ("batch", "off", "off"), ("rescore", "on", "rescore"),
                                 ("rescore", "auto", "rescore"), (None, "auto", "off")):
        backend = TritonBackend(cpu, torch.float32, invariance=given)
        backend.set_batch_invariant(setting)
        assert (backend.invariance, backend.batch_invariant,
                backend.decode_as_prefill) == (mode, mode != "off", mode == "rescore")


@needs_cpu
def test_off_is_what_ran_before(tiny_llama, adapters, monkeypatch):
    """--batch-invariant off (the layouts measured fastest, the decode kernel): the echo
    re-score differs, as it did before issue 45; the test above can fail."""
    monkeypatch.setenv("LORAPLEX_KERNELS", "cpu")
    assert rescore_mismatches(tiny_llama, adapters, "float32", batch_invariant="off") != []


def test_the_draws_cover_the_cases():
    """The fixed draws reach every dimension the guarantee names."""
    rng = random.Random(45)
    assert draws.covers_the_cases([draws.draw(rng) for _ in range(DRAWS)]) == []
