"""PenaltyState: each penalised sequence's generated-token counts and prompt-token mask,
kept on the logits' device and updated in place after every sample.

A row is given to a sequence the first time it samples with a penalty (built from its
tokens so far) and kept, through preemption, until the sequence finishes (``forget``).
The pool grows by doubling; nothing is copied to the host.
"""

from __future__ import annotations

import torch

from .sequence import Sequence


class PenaltyState:
    def __init__(self, vocab_size: int, device: torch.device, capacity: int = 8):
        self.vocab_size = vocab_size
        self.device = device
        self.rows: dict[str, int] = {}  # seq_id -> row
        self.free: list[int] = list(range(capacity))[::-1]
        self.counts = torch.zeros(capacity, vocab_size, dtype=torch.int32, device=device)
        self.in_prompt = torch.zeros(capacity, vocab_size, dtype=torch.bool, device=device)

    def rows_of(self, seqs: list[Sequence]) -> torch.Tensor:
        """The rows of ``seqs`` (each given one, filled from its tokens, on first use)."""
        out = []
        for seq in seqs:
            row = self.rows.get(seq.seq_id)
            if row is None:
                row = self._assign(seq)
            out.append(row)
        return torch.tensor(out, dtype=torch.int64, device=self.device)

    def _assign(self, seq: Sequence) -> int:
        if not self.free:
            self._grow()
        row = self.rows[seq.seq_id] = self.free.pop()
        self.counts[row].zero_()
        self.in_prompt[row].zero_()
        dev = self.device
        if seq.output_token_ids:
            out = torch.tensor(seq.output_token_ids, dtype=torch.int64, device=dev)
            self.counts[row].index_add_(0, out, torch.ones_like(out, dtype=torch.int32))
        self.in_prompt[row, torch.tensor(seq.prompt_token_ids, dtype=torch.int64,
                                         device=dev)] = True
        return row

    def _grow(self) -> None:
        old = self.counts.shape[0]
        self.counts = torch.cat([self.counts, torch.zeros_like(self.counts)])
        self.in_prompt = torch.cat([self.in_prompt, torch.zeros_like(self.in_prompt)])
        self.free.extend(range(2 * old - 1, old - 1, -1))

    def add(self, rows: torch.Tensor, tokens: torch.Tensor, ok: torch.Tensor) -> None:
        """After sampling: count ``tokens`` [R] in ``rows`` [R] where ``ok`` [R] (rows
        that sampled nothing count nothing)."""
        self.counts.index_put_((rows, tokens), ok.to(torch.int32), accumulate=True)

    def forget(self, seq_id: str) -> None:
        row = self.rows.pop(seq_id, None)
        if row is not None:
            self.free.append(row)


def apply_penalties(logits: torch.Tensor, counts: torch.Tensor, in_prompt: torch.Tensor,
                    repetition: torch.Tensor | None, frequency: torch.Tensor | None,
                    presence: torch.Tensor | None) -> torch.Tensor:
    """logits: [R, vocab]; counts [R, vocab] int32; in_prompt [R, vocab] bool; the rest [R]
    or None where no row uses it. Repetition over prompt + generated tokens (transformers'
    RepetitionPenaltyLogitsProcessor: a positive logit divided by the penalty, a negative
    one multiplied), then OpenAI's ``logit - frequency × count - presence × (count > 0)``
    over generated tokens."""
    generated = counts > 0
    if repetition is not None:
        rep = torch.where(generated | in_prompt, repetition.unsqueeze(1), 1.0)
        logits = torch.where(logits < 0, logits * rep, logits / rep)
    if frequency is not None:
        logits = logits - frequency.unsqueeze(1) * counts
    if presence is not None:
        logits = logits - presence.unsqueeze(1) * generated
    return logits
