"""The C++ CPU kernels (kernel_backends/cpu/extension.py, kernel_backends/cpu/attention.py) against the
torch backend's ops: paged decode and prefill attention and argmax here; the LoRA kernel is
one of the routes in test_lora_twin.py."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from loraplex.kernel_backends import backend_name, select_backend
from loraplex.kernel_backends.cpu import attention as cpu_attention
from loraplex.kernel_backends.cpu import extension
from loraplex.kernel_backends.torch import attention as reference
from loraplex.kernel_backends.torch.logprob_rows import logprob_rows as twin_logprob_rows

from tests.kernel_fixtures import make_paged_cache

CPU = torch.device("cpu")

TOL = {torch.float32: {"rtol": 1e-5, "atol": 1e-5}, torch.bfloat16: {"rtol": 2e-2, "atol": 2e-2},
       torch.float16: {"rtol": 2e-3, "atol": 2e-3}}


@pytest.fixture(scope="module")
def kernels():
    assert extension.available(), "the C++ CPU kernels did not build on this machine"
    return extension.load()


def _inputs(context_lens: list[int], block_size: int, kv_heads: int, group: int,
            head_dim: int, dtype: torch.dtype, seed: int = 0):
    k_cache, v_cache, tables = make_paged_cache(context_lens, block_size, kv_heads, head_dim,
                                                dtype, seed=seed)
    q = torch.randn(len(context_lens), kv_heads * group, head_dim,
                    generator=torch.Generator().manual_seed(seed + 1)).to(dtype)
    return q, k_cache, v_cache, tables, torch.tensor(context_lens, dtype=torch.int32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("block_size", "kv_heads", "group", "head_dim"),
                         [(16, 2, 1, 40), (16, 3, 3, 64), (32, 1, 4, 8), (1, 2, 2, 16),
                          (16, 2, 2, 96), (16, 1, 2, 128)])
def test_decode_matches_twin(kernels, dtype: torch.dtype, block_size: int, kv_heads: int,
                             group: int, head_dim: int) -> None:
    # ending mid-block, one token, past several 64-position windows (one ending on a window)
    lens = [1, block_size + 1, 3 * block_size - 1, 77, 128, 203]
    q, k_cache, v_cache, tables, context_lens = _inputs(lens, block_size, kv_heads, group,
                                                        head_dim, dtype)
    scale = head_dim**-0.5
    got = kernels.paged_attention_decode(q, k_cache, v_cache, tables, context_lens, scale)
    want = reference.paged_attention_decode(q, k_cache, v_cache, tables, context_lens, scale)
    assert got.dtype == dtype and got.shape == q.shape
    torch.testing.assert_close(got.float(), want.float(), **TOL[dtype])


@pytest.mark.parametrize("scale", [1e-4, 3.0, 40.0])
def test_decode_softmax_from_flat_to_one_hot(kernels, scale: float) -> None:
    """Scores from nearly equal to thousands apart (exp underflows to 0 for all but one)."""
    lens = [7, 64, 100]
    q, k_cache, v_cache, tables, context_lens = _inputs(lens, 16, 3, 3, 64, torch.float32)
    got = kernels.paged_attention_decode(q, k_cache, v_cache, tables, context_lens, scale)
    want = reference.paged_attention_decode(q, k_cache, v_cache, tables, context_lens, scale)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_decode_never_reads_past_a_context(kernels) -> None:
    """Cache rows past each context (another request's, or stale) may be NaN: unseen."""
    lens = [5, 20, 33]
    q, k_cache, v_cache, tables, context_lens = _inputs(lens, 16, 2, 2, 32, torch.float32)
    want = reference.paged_attention_decode(q, k_cache, v_cache, tables, context_lens, 0.2)
    for b, n in enumerate(lens):
        for pos in range(n, tables.shape[1] * 16):
            block = int(tables[b, pos // 16])
            if pos // 16 < (n + 15) // 16:  # the tail of the last block a context uses
                k_cache[block, pos % 16] = float("nan")
                v_cache[block, pos % 16] = float("inf")
    got = kernels.paged_attention_decode(q, k_cache, v_cache, tables, context_lens, 0.2)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_dispatch_uses_the_kernel_on_cpu(kernels, monkeypatch: pytest.MonkeyPatch) -> None:
    q, k_cache, v_cache, tables, context_lens = _inputs([9, 40], 16, 2, 3, 16, torch.float32)
    calls = []
    real = kernels.paged_attention_decode
    monkeypatch.setattr(extension, "load", lambda: type("M", (), {
        "paged_attention_decode": staticmethod(lambda *a: calls.append(1) or real(*a))}))
    backend = select_backend(CPU, torch.float32)
    backend.batch_invariant = False  # else decodes run through the tiled prefill kernel
    assert backend.name == "cpu"
    got = backend.paged_attention_decode(q, k_cache, v_cache, tables, context_lens, 0.25)
    assert calls == [1]
    want = reference.paged_attention_decode(q, k_cache, v_cache, tables, context_lens, 0.25)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_dispatch_falls_back_to_the_twin(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the kernels (LORAPLEX_CPU_KERNEL=0, or no compiler) CPU serves with the
    torch backend."""
    q, k_cache, v_cache, tables, context_lens = _inputs([9, 40], 16, 2, 3, 16, torch.float32)
    monkeypatch.setenv("LORAPLEX_CPU_KERNEL", "0")
    with pytest.raises(extension.KernelBuildError):
        extension.load()
    assert backend_name(CPU) == "torch"
    backend = select_backend(CPU, torch.float32)
    assert backend.name == "torch"
    got = backend.paged_attention_decode(q, k_cache, v_cache, tables, context_lens, 0.25)
    want = reference.paged_attention_decode(q, k_cache, v_cache, tables, context_lens, 0.25)
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize(("lens", "table_value", "message"), [
    ([0], 0, "context length 0 does not fit"),
    ([40], 0, "context length 40 does not fit"),  # 3 blocks needed, the table has 2
    ([5], 99, "block 99 out of range"),
])
def test_decode_refuses_out_of_range_inputs(kernels, lens: list[int], table_value: int,
                                            message: str) -> None:
    k_cache = torch.zeros(4, 16, 1, 8)
    tables = torch.full((1, 2), table_value, dtype=torch.int32)
    with pytest.raises(RuntimeError, match=message):
        kernels.paged_attention_decode(torch.zeros(1, 1, 8), k_cache, k_cache.clone(), tables,
                                       torch.tensor(lens, dtype=torch.int32), 1.0)


def test_decode_refuses_a_block_size_that_is_no_power_of_two(kernels) -> None:
    """The kernel finds a position's block by a shift (the engine's block sizes are powers
    of two): any other size is refused, not read wrongly."""
    k_cache = torch.zeros(4, 12, 1, 8)
    with pytest.raises(RuntimeError, match="block size 12 is not a power of two"):
        kernels.paged_attention_decode(torch.zeros(1, 1, 8), k_cache, k_cache.clone(),
                                       torch.zeros(1, 2, dtype=torch.int32),
                                       torch.tensor([5], dtype=torch.int32), 1.0)


# (cached prefix, new tokens) per sequence: fresh prompts, a chunk after a cached prefix,
# one new token after a block-aligned prefix, a sequence with no new tokens this step
PREFILL_SEQS = [(0, 19), (13, 20), (32, 1), (5, 0), (0, 64)]


def _prefill_inputs(seqs: list[tuple[int, int]], block_size: int, kv_heads: int, group: int,
                    head_dim: int, dtype: torch.dtype):
    context_lens = [p + n for p, n in seqs]
    q_lens = [n for _, n in seqs]
    k_cache, v_cache, tables = make_paged_cache(context_lens, block_size, kv_heads, head_dim,
                                                dtype, seed=3)
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    q = torch.randn(sum(q_lens), kv_heads * group, head_dim,
                    generator=torch.Generator().manual_seed(4)).to(dtype)
    lens = torch.tensor(context_lens, dtype=torch.int32)
    return q, k_cache, v_cache, tables, qsl, lens


# longer than a query tile (32 tokens) and a key chunk (64 positions), tile and chunk edges
# off the block edges, next to one-token sequences of a mixed step
LONG_PREFILL_SEQS = [(0, 200), (70, 33), (1, 1), (129, 64), (0, 2), (300, 1), (17, 95)]


@pytest.mark.parametrize(("block_size", "kv_heads", "group", "head_dim"),
                         [(16, 3, 3, 64), (4, 2, 1, 40), (1, 1, 4, 16), (32, 2, 4, 128),
                          (16, 1, 8, 72)])
def test_tiled_prefill_matches_twin_on_long_sequences(kernels, block_size: int, kv_heads: int,
                                                      group: int, head_dim: int) -> None:
    args = (*_prefill_inputs(LONG_PREFILL_SEQS, block_size, kv_heads, group, head_dim,
                             torch.float32), head_dim**-0.5)
    got = cpu_attention.paged_attention_prefill(kernels, *args)
    torch.testing.assert_close(got, reference.paged_attention_prefill(*args),
                               **TOL[torch.float32])


def test_tiled_prefill_skips_one_token_sequences_and_never_reads_past_a_context(kernels) -> None:
    """The kernel alone leaves one-token sequences' rows unwritten (cpu/attention.py runs
    them as decodes) and never reads a cache row past a tile's last token: NaN there changes
    nothing."""
    seqs = [(0, 40), (3, 1), (10, 70)]
    q, k_cache, v_cache, tables, qsl, lens = _prefill_inputs(seqs, 16, 2, 2, 32, torch.float32)
    want = reference.paged_attention_prefill(q, k_cache, v_cache, tables, qsl, lens, 0.2)
    for s, n in enumerate(lens.tolist()):
        for pos in range(n, (n + 15) // 16 * 16):  # the tail of each context's last block
            k_cache[int(tables[s, pos // 16]), pos % 16] = float("nan")
            v_cache[int(tables[s, pos // 16]), pos % 16] = float("inf")
    got = kernels.paged_attention_prefill(q, k_cache, v_cache, tables, qsl, lens, 0.2)
    mine = torch.ones(q.shape[0], dtype=torch.bool)
    mine[40] = False  # the one-token sequence's row
    torch.testing.assert_close(got[mine], want[mine], rtol=1e-5, atol=1e-5)
    full = cpu_attention.paged_attention_prefill(kernels, q, k_cache, v_cache, tables, qsl,
                                                 lens, 0.2)
    torch.testing.assert_close(full, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("block_size", "kv_heads", "group", "head_dim"),
                         [(16, 3, 3, 64), (4, 2, 1, 40), (1, 1, 4, 16)])
def test_prefill_through_the_decode_kernel_matches_twin(kernels, dtype: torch.dtype,
                                                        block_size: int, kv_heads: int,
                                                        group: int, head_dim: int) -> None:
    args = (*_prefill_inputs(PREFILL_SEQS, block_size, kv_heads, group, head_dim, dtype),
            head_dim**-0.5)
    got = cpu_attention.paged_attention_prefill(kernels, *args)
    torch.testing.assert_close(got.float(), reference.paged_attention_prefill(*args).float(),
                               **TOL[dtype])


@pytest.mark.parametrize("vocab", [1, 5, 8, 13, 49152])
def test_argmax_rows_matches_torch_including_ties(kernels, vocab: int) -> None:
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randint(-3, 4, (16, vocab), generator=g).float()  # many ties
    logits[0] = -float("inf")  # all -inf: index 0
    logits[1, -1] = 100.0  # the maximum in the scalar tail
    logits[2, vocab // 2] = 50.0
    logits[2, -1] = 50.0  # a tie between the vector body and the tail: the first wins
    got = kernels.argmax_rows(logits)
    assert got.dtype == torch.int64
    assert got.tolist() == logits.argmax(dim=-1).tolist()


@pytest.mark.parametrize("vocab", [1, 7, 8, 13, 49152])
def test_argmax_finite_rows_matches_its_twin(kernels, vocab: int) -> None:
    """The index as torch.argmax and the finiteness as torch.isfinite, in one read: a NaN,
    +inf or -inf anywhere (vector body or scalar tail) makes the row non-finite."""
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(8, vocab, generator=g) * 1e30  # huge but finite: x - x is still 0
    logits[1, -1] = float("nan")
    logits[2, 0] = float("inf")
    logits[3, vocab // 2] = -float("inf")
    logits[4] = -float("inf")
    idx, finite = kernels.argmax_finite_rows(logits)
    assert finite.tolist() == torch.isfinite(logits).all(dim=-1).tolist()
    ok = finite.tolist()
    want = logits.argmax(dim=-1).tolist()
    assert [i for i, f in zip(idx.tolist(), ok) if f] == [w for w, f in zip(want, ok) if f]


def test_sampler_greedy_uses_the_kernel(kernels, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    monkeypatch.setattr(extension, "load", lambda: type("M", (), {
        "argmax_rows": staticmethod(lambda x: calls.append(1) or kernels.argmax_rows(x))}))
    backend = select_backend(CPU, torch.float32)  # the sampler's kernels on CPU
    assert backend.name == "cpu"
    logits = torch.randn(3, 300)
    assert backend.argmax_rows(logits).tolist() == logits.argmax(-1).tolist()
    assert calls == [1]


def test_build_is_keyed_by_content_not_by_checkout(tmp_path) -> None:
    """Two checkouts with identical sources share one cached build; a changed source gets
    an entry of its own (no checkout rebuilds over another's)."""
    files = extension.SOURCES + extension.HEADERS
    copies = []
    for f in files:
        copies.append(tmp_path / f.name)
        copies[-1].write_bytes(f.read_bytes())
    assert extension.build_name(copies) == extension.build_name(files)
    copies[0].write_bytes(copies[0].read_bytes() + b"\n// changed\n")
    assert extension.build_name(copies) != extension.build_name(files)


def test_build_is_keyed_by_the_cpus_features(monkeypatch) -> None:
    """-march=native code of one "avx512" CPU (say with AMX) must not load on another
    (without it): the entry's name carries the CPU's feature flags."""
    files = extension.SOURCES + extension.HEADERS
    here = extension.build_name(files)
    assert len(extension.cpu_flags_digest()) == 8 or extension.cpu_flags_digest() == "any"
    monkeypatch.setattr(extension, "cpu_flags_digest", lambda: "0badf00d")
    assert extension.build_name(files) != here


def test_a_built_library_loads_past_a_stale_lock(tmp_path) -> None:
    """A process killed while torch held a cache entry's lock file leaves it behind; a built
    entry must still load (torch's own load waits on that lock forever)."""
    from torch.utils.cpp_extension import _get_build_directory

    extension.load()  # built (make kernels), so the entry holds its library
    name = extension.build_name(extension.SOURCES + extension.HEADERS)
    entry = tmp_path / name
    entry.mkdir()
    shutil.copy(Path(_get_build_directory(name, verbose=False)) / f"{name}.so", entry)
    (entry / "lock").touch()  # the stale lock
    code = ("from loraplex.kernel_backends.cpu import extension; m = extension.load(); "
            "print(m.__file__)")
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=False,
                         timeout=300)  # a hang guard only: the load takes about a second
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(entry / f"{name}.so")


@pytest.mark.parametrize("vocab", [1, 5, 8, 13, 100, 49152])
@pytest.mark.parametrize("normalize", [True, False])
def test_logprob_rows_matches_twin(kernels, vocab: int, normalize: bool) -> None:
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(7, vocab, generator=g) * 4
    logits[1] += 30.0  # a shifted row (log-sum-exp far from 0)
    if vocab > 3:
        logits[2, ::3] = -float("inf")  # processed rows: masked tokens
    tokens = torch.randint(0, vocab, (7,), generator=g)
    tokens[2] = 1 if vocab > 3 else 0  # a finite one
    for k in sorted({0, 1, min(5, vocab), min(20, vocab), vocab}):
        got = kernels.logprob_rows(logits, tokens, k, normalize)
        want = twin_logprob_rows(logits, tokens, k, normalize)
        torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
        assert got[1].tolist() == want[1].tolist()  # ranks
        torch.testing.assert_close(got[2], want[2], rtol=1e-5, atol=1e-5)
        # the ids in a stable sort's order (the twin's topk leaves ties in any order)
        stable = logits.sort(dim=-1, descending=True, stable=True).indices[:, :k]
        assert got[3].tolist() == stable.tolist()


def test_logprob_rows_ties_rank_ahead_and_keep_index_order(kernels) -> None:
    """Ties count ahead of the chosen token in its rank (vLLM's rank), and tied values in
    the top k come in index order (a stable sort's)."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randint(-3, 4, (9, 1000), generator=g).float()  # many ties
    logits[0] = -float("inf")
    tokens = torch.randint(0, 1000, (9,), generator=g)
    got = kernels.logprob_rows(logits, tokens, 20, True)
    want = twin_logprob_rows(logits, tokens, 20, True)
    assert got[1].tolist() == want[1].tolist()
    assert got[1][0] == 1000  # every -inf ties with the chosen -inf
    torch.testing.assert_close(got[2][1:], want[2][1:], rtol=1e-5, atol=1e-5)
    stable = logits.sort(dim=-1, descending=True, stable=True).indices[:, :20]
    assert got[3].tolist() == stable.tolist()


def test_sampler_logprobs_use_the_kernel(kernels, monkeypatch: pytest.MonkeyPatch) -> None:
    from loraplex.engine.sampler import Sampler
    from loraplex.engine.sampling_params import SamplingParams
    from loraplex.engine.sequence import Sequence

    calls = []
    monkeypatch.setattr(extension, "load", lambda: type("M", (), {
        "argmax_rows": staticmethod(kernels.argmax_rows),
        "logprob_rows": staticmethod(lambda *a: calls.append(1) or kernels.logprob_rows(*a))}))
    backend = select_backend(CPU, torch.float32)
    seqs = [Sequence(request_id=f"r{i}", prompt_token_ids=[1],
                     params=SamplingParams(temperature=1.0, seed=i, logprobs=3))
            for i in range(3)]
    logits = torch.randn(3, 300)
    out = Sampler(0, backend)(logits.clone(), seqs)
    want = torch.log_softmax(logits, dim=-1)
    for i, lp in enumerate(out.logprobs):
        assert lp.logprob == pytest.approx(want[i, out.tokens[i]].item(), abs=1e-5)
    assert calls == [1]
