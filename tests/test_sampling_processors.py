"""The batched sampler's processing against transformers' logits processors (or OpenAI's
formula where transformers has none), at the sampler: processed values are those of the
distribution sampled from."""

from __future__ import annotations

import pytest
import torch
from loraplex.engine.bad_words import BadWords
from loraplex.engine.sampler import Sampler
from loraplex.engine.sampling_params import SamplingParams
from loraplex.engine.sequence import Sequence
from loraplex.kernel_backends.torch import TorchBackend
from transformers import (
    MinPLogitsWarper,
    NoBadWordsLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

VOCAB = 64
INF = float("-inf")


def seq(i: int, prompt: list[int], out: list[int], **fields) -> Sequence:
    s = Sequence(request_id=f"r{i}", prompt_token_ids=prompt,
                 params=SamplingParams(logprobs=VOCAB, **fields))
    s.output_token_ids = list(out)
    return s


def sampler(mode: str = "processed_logits") -> Sampler:
    return Sampler(0, TorchBackend(torch.device("cpu"), torch.float32), mode)


def processed(seqs: list[Sequence], logits: torch.Tensor, mode: str = "processed_logits"
              ) -> tuple[list[int | None], torch.Tensor]:
    """(sampled tokens, [N, vocab] processed values) from the sampler's full top-VOCAB."""
    out = sampler(mode)(logits.clone(), seqs)
    values = torch.full((len(seqs), VOCAB), INF)
    for i, lp in enumerate(out.logprobs):
        for t, v in lp.top:
            values[i, t] = v
    return out.tokens, values


def same(a: torch.Tensor, b: torch.Tensor) -> None:
    assert torch.equal(torch.isinf(a), torch.isinf(b))
    fin = torch.isfinite(b)
    torch.testing.assert_close(a[fin], b[fin], rtol=1e-5, atol=1e-5)


@pytest.fixture()
def logits() -> torch.Tensor:
    return torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(0)) * 3


def test_repetition_penalty_is_transformers(logits):
    prompts, outs = [[1, 2, 3], [4, 4, 5], [6], [7, 8]], [[9, 1], [], [6, 6, 10], [11]]
    pens = [1.3, 0.7, 2.0, 1.0]
    seqs = [seq(i, p, o, temperature=0.0, repetition_penalty=r)
            for i, (p, o, r) in enumerate(zip(prompts, outs, pens))]
    _, got = processed(seqs, logits)
    for i, (p, o, r) in enumerate(zip(prompts, outs, pens)):
        want = RepetitionPenaltyLogitsProcessor(r)(torch.tensor([p + o]), logits[i:i + 1])
        same(got[i], want[0])


def test_presence_and_frequency_are_openai(logits):
    """logit - count × frequency - (count > 0) × presence, over generated tokens only."""
    outs = [[3, 3, 3, 9], [], [5], [1, 2, 1]]
    pens = [(0.5, 0.25), (2.0, -2.0), (-1.0, 1.5), (0.0, 1.0)]
    seqs = [seq(i, [3, 5, 1], o, temperature=0.0, presence_penalty=p, frequency_penalty=f)
            for i, (o, (p, f)) in enumerate(zip(outs, pens))]
    _, got = processed(seqs, logits)
    for i, (o, (p, f)) in enumerate(zip(outs, pens)):
        counts = torch.bincount(torch.tensor(o, dtype=torch.int64), minlength=VOCAB).float()
        same(got[i], logits[i] - f * counts - p * (counts > 0).float())


def test_counts_follow_the_sampled_tokens(logits):
    """The device counts are updated in place after each sample: a second step sees the
    first step's token."""
    s = sampler()
    one = seq(0, [1], [], temperature=0.0, frequency_penalty=1.0)
    first = s(logits[:1].clone(), [one]).tokens[0]
    one.output_token_ids.append(first)
    out = s(logits[:1].clone(), [one]).logprobs[0]
    values = dict(out.top)
    assert values[first] == pytest.approx(logits[0, first].item() - 1.0, abs=1e-5)


def test_logit_bias_is_transformers(logits):
    bias = {3: 5.0, 60: -100.0, 7: 0.5}
    seqs = [seq(0, [1], [], temperature=0.0, logit_bias=bias), seq(1, [1], [], temperature=0.0)]
    _, got = processed(seqs, logits[:2])
    proc = SequenceBiasLogitsProcessor({(t,): b for t, b in bias.items()})
    same(got[0], proc(torch.tensor([[1]]), logits[:1].clone())[0])
    same(got[1], logits[1])  # the neighbour row is untouched


def test_min_p_is_transformers(logits):
    seqs = [seq(i, [1], [], temperature=t, min_p=m, seed=i)
            for i, (t, m) in enumerate([(1.0, 0.1), (0.7, 0.3), (1.0, 0.0), (2.0, 1.0)])]
    tokens, got = processed(seqs, logits)
    for i, (t, m) in enumerate([(1.0, 0.1), (0.7, 0.3), (1.0, 0.0), (2.0, 1.0)]):
        want = TemperatureLogitsWarper(t)(None, logits[i:i + 1].clone())
        if m:
            want = MinPLogitsWarper(m)(None, want)
        same(got[i], want[0])
        assert torch.isfinite(got[i, tokens[i]])  # drawn from the support


def test_top_k_top_p_are_transformers(logits):
    cfg = [(0.8, 5, 1.0), (1.0, None, 0.7), (1.3, 10, 0.5), (1.0, 1, 0.9)]
    seqs = [seq(i, [1], [], temperature=t, top_k=k, top_p=p, seed=i)
            for i, (t, k, p) in enumerate(cfg)]
    tokens, got = processed(seqs, logits)
    for i, (t, k, p) in enumerate(cfg):
        want = TemperatureLogitsWarper(t)(None, logits[i:i + 1].clone())
        if k:
            want = TopKLogitsWarper(k)(None, want)
        want = TopPLogitsWarper(p)(None, want) if p < 1 else want
        same(got[i], want[0])
        assert torch.isfinite(got[i, tokens[i]])


def test_bad_words_are_transformers(logits):
    """vLLM's meaning: a word's last token is banned where its other tokens end the output."""
    bad = [[5], [7, 8], [9, 10, 11]]
    outputs = [[1, 7], [9, 10], [3, 9]]
    for i, out in enumerate(outputs):
        s = seq(i, [2], out, temperature=0.0)
        s.bad_words = BadWords(bad)
        _, got = processed([s], logits[i:i + 1])
        want = NoBadWordsLogitsProcessor(bad, eos_token_id=2)(torch.tensor([out]),
                                                               logits[i:i + 1].clone())
        same(got[0], want[0])


def test_allowed_token_ids_mask_the_rest(logits):
    allowed = [4, 9, 33]
    tokens, got = processed([seq(0, [1], [], temperature=1.0, seed=3,
                                 allowed_token_ids=allowed)], logits[:1])
    assert tokens[0] in allowed
    assert torch.isfinite(got[0]).nonzero().flatten().tolist() == allowed


def test_processed_logprobs_are_the_distribution_sampled_from(logits):
    """2,000 draws of one row, each its own seed: their frequencies match the reported
    processed probabilities (total variation < 0.05)."""
    s = sampler("processed_logprobs")
    row = logits[:1] / 2
    counts = torch.zeros(VOCAB)
    reported = None
    for draw in range(2000):
        one = seq(draw, [1], [], temperature=0.9, top_p=0.9, top_k=12, min_p=0.02,
                  seed=draw, repetition_penalty=1.2)
        out = s(row.clone(), [one])
        counts[out.tokens[0]] += 1
        reported = out.logprobs[0]
        s.forget(one.seq_id)
    probs = torch.zeros(VOCAB)
    for t, v in reported.top:
        probs[t] = torch.tensor(v).exp()
    assert probs.sum().item() == pytest.approx(1.0, abs=1e-4)
    assert 0.5 * (counts / counts.sum() - probs).abs().sum() < 0.05


def test_greedy_rows_beside_processed_rows_are_the_argmax(logits):
    seqs = [seq(0, [1], [], temperature=0.0), seq(1, [1], [], temperature=1.0, seed=0,
                                                  repetition_penalty=1.5, top_k=3),
            seq(2, [1], [], temperature=0.0)]
    tokens, _ = processed(seqs, logits[:3])
    assert tokens[0] == int(logits[0].argmax()) and tokens[2] == int(logits[2].argmax())


def test_a_non_finite_row_samples_nothing(logits):
    bad = logits[:2].clone()
    bad[1, 5] = float("nan")
    out = sampler()(bad, [seq(0, [1], [], temperature=0.0),
                          seq(1, [1], [], temperature=1.0, seed=1, presence_penalty=1.0)])
    assert out.tokens[0] == int(logits[0].argmax()) and out.tokens[1] is None


def test_top_p_over_ties_at_the_k_th(logits):
    """Top-k keeps every token tied with the k-th (as TopKLogitsWarper); top-p then runs on
    the kept ones, the shortcut path (small k) and the sorting path (k large) alike."""
    tied = logits[:2].clone()
    tied[:, :6] = 2.0  # six tokens tied at the top
    for k in (3, 40):
        seqs = [seq(i, [1], [], temperature=1.0, top_k=k, top_p=0.8, seed=i) for i in range(2)]
        _, got = processed(seqs, tied)
        for i in range(2):
            want = TopPLogitsWarper(0.8)(None, TopKLogitsWarper(k)(None, tied[i:i + 1].clone()))
            same(got[i], want[0])
