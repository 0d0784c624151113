"""The penalties applied at each row's seen ids only (engine/penalty_state.py) against the
dense oracle (transformers' RepetitionPenaltyLogitsProcessor, then OpenAI's frequency and
presence formula) over many steps: the pool growing past its rows, the seen lists past
their width, sequences finishing and their rows reused, a sequence with an empty prompt."""

from __future__ import annotations

import torch
from loraplex.engine.sampler import Sampler
from loraplex.engine.sampling_params import SamplingParams
from loraplex.engine.sequence import Sequence
from loraplex.kernel_backends.torch import TorchBackend
from transformers import RepetitionPenaltyLogitsProcessor

VOCAB = 300


def oracle(logits: torch.Tensor, seq: Sequence) -> torch.Tensor:
    p = seq.params
    x = logits.unsqueeze(0).clone()
    seen = seq.prompt_token_ids + seq.output_token_ids
    if seen:
        x = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(torch.tensor([seen]), x)
    counts = torch.bincount(torch.tensor(seq.output_token_ids, dtype=torch.int64),
                            minlength=VOCAB).float()
    return x[0] - p.frequency_penalty * counts - p.presence_penalty * (counts > 0).float()


def test_sparse_penalties_equal_the_dense_formula_over_many_steps() -> None:
    g = torch.Generator().manual_seed(0)
    sampler = Sampler(0, TorchBackend(torch.device("cpu"), torch.float32), "processed_logits")

    def new_seq(i: int) -> Sequence:
        n = [0, 3, 200, 40][i % 4]  # an empty prompt; a prompt past the seen width (128)
        prompt = torch.randint(0, VOCAB, (n,), generator=g).tolist()
        rep, freq, pres = [(1.3, 0.5, 0.25), (0.7, -1.0, 1.5), (1.0, 0.0, 2.0),
                           (2.0, 1.0, 0.0)][i % 4]
        return Sequence(request_id=f"r{i}", prompt_token_ids=prompt, params=SamplingParams(
            temperature=0.0, logprobs=VOCAB, repetition_penalty=rep, frequency_penalty=freq,
            presence_penalty=pres))

    live = [new_seq(i) for i in range(12)]  # past the pool's first 8 rows
    made = 12
    for step in range(40):
        logits = torch.randn(len(live), VOCAB, generator=g) * 2
        logits[:, :8] += 6.0  # a few likely ids: generated again and again
        out = sampler(logits.clone(), live)
        for i, seq in enumerate(live):
            got = torch.tensor([v for _, v in sorted(out.logprobs[i].top)])
            torch.testing.assert_close(got, oracle(logits[i], seq), rtol=1e-6, atol=1e-6)
            assert out.tokens[i] == int(oracle(logits[i], seq).argmax())
            seq.output_token_ids.append(out.tokens[i])
        if step % 10 == 9:  # two finish; their rows go to new sequences
            for seq in live[:2]:
                sampler.forget(seq.seq_id)
            live = live[2:] + [new_seq(made), new_seq(made + 1)]
            made += 2
