"""PenaltyState: each penalised sequence's generated-token counts and the ids it has seen,
kept on the logits' device and updated in place after every sample; the penalties are
applied only at those ids (a gather and a scatter of [rows, seen] values), not over the
vocabulary.

A row is given to a sequence the first time it samples with a penalty (built from its
tokens so far) and kept, through preemption, until the sequence finishes (``forget``).
The pool grows by doubling; only the sampled ids travel, host to device, to extend the
seen lists.

Invariants of a row r of the pool:
- ``counts[r, t]``: how many times t was generated (int32, over the vocabulary);
- ``seen[r, :length[r]]``: the distinct ids of the prompt and the output, in first-seen
  order; ``seen[r, length[r]:]`` repeats ``seen[r, 0]`` (0 when the row has seen nothing).
  Every penalised value is a function of (row, id) alone, so a repeated id gathers and
  scatters the same value twice: the padding changes nothing.
"""

from __future__ import annotations

import torch

from .sequence import Sequence


class PenaltyState:
    def __init__(self, vocab_size: int, device: torch.device, capacity: int = 8,
                 width: int = 128):
        self.vocab_size = vocab_size
        self.device = device
        self.rows: dict[str, int] = {}  # seq_id -> row
        self.free: list[int] = list(range(capacity))[::-1]
        self.known: dict[int, set[int]] = {}  # row -> its seen ids, on the host
        self.counts = torch.zeros(capacity, vocab_size, dtype=torch.int32, device=device)
        self.seen = torch.zeros(capacity, width, dtype=torch.int64, device=device)

    def widen(self, vocab_size: int) -> None:
        """Count over at least ``vocab_size`` ids (an adapter whose tokenizer adds tokens:
        its rows' logits are wider); the new ids' counts start at 0."""
        if vocab_size > self.vocab_size:
            extra = torch.zeros(self.counts.shape[0], vocab_size - self.vocab_size,
                                dtype=self.counts.dtype, device=self.device)
            self.counts = torch.cat([self.counts, extra], dim=1)
            self.vocab_size = vocab_size

    def rows_of(self, seqs: list[Sequence]) -> list[int]:
        """The rows of ``seqs`` (each given one, filled from its tokens, on first use)."""
        out = []
        for seq in seqs:
            row = self.rows.get(seq.seq_id)
            if row is None:
                row = self._assign(seq)
            out.append(row)
        return out

    def width_of(self, rows: list[int]) -> int:
        """The seen columns that hold every id of ``rows`` (at least 1)."""
        return max(1, max(len(self.known[r]) for r in rows))

    def _assign(self, seq: Sequence) -> int:
        if not self.free:
            self._grow_rows()
        row = self.rows[seq.seq_id] = self.free.pop()
        ids = list(dict.fromkeys([*seq.prompt_token_ids, *seq.output_token_ids]))
        self.known[row] = set(ids)
        self._fit(len(ids))
        dev = self.device
        self.counts[row].zero_()
        if seq.output_token_ids:
            out = torch.tensor(seq.output_token_ids, dtype=torch.int64, device=dev)
            self.counts[row].index_add_(0, out, torch.ones_like(out, dtype=torch.int32))
        self.seen[row].fill_(ids[0] if ids else 0)
        if ids:
            self.seen[row, :len(ids)] = torch.tensor(ids, dtype=torch.int64, device=dev)
        return row

    def _grow_rows(self) -> None:
        old = self.counts.shape[0]
        self.counts = torch.cat([self.counts, torch.zeros_like(self.counts)])
        self.seen = torch.cat([self.seen, torch.zeros_like(self.seen)])
        self.free.extend(range(2 * old - 1, old - 1, -1))

    def _fit(self, width: int) -> None:
        """Widen ``seen`` (doubling) to hold ``width`` ids; new columns repeat column 0."""
        old = self.seen.shape[1]
        if width <= old:
            return
        new = max(width, 2 * old)
        self.seen = torch.cat([self.seen, self.seen[:, :1].expand(-1, new - old)], dim=1)

    def add(self, rows: list[int], rows_t: torch.Tensor, tokens: torch.Tensor,
            host_tokens: list[int], ok: list[bool]) -> None:
        """After sampling: count ``tokens`` [R] (on the device) in ``rows_t`` [R] where
        ``ok`` (rows that sampled nothing count nothing), and append each new id to its
        row's seen list (``host_tokens``: the same tokens on the host)."""
        ok_t = torch.tensor(ok, dtype=torch.int32, device=self.device)
        self.counts.index_put_((rows_t, tokens), ok_t, accumulate=True)
        new_rows, new_cols, new_ids = [], [], []
        for row, token, good in zip(rows, host_tokens, ok):
            known = self.known[row]
            if good and token not in known:
                if not known:  # its first id: the padding repeats it from now on
                    self.seen[row].fill_(token)
                new_rows.append(row)
                new_cols.append(len(known))
                new_ids.append(token)
                known.add(token)
        if new_rows:
            self._fit(max(new_cols) + 1)
            dev = self.device
            self.seen.index_put_((torch.tensor(new_rows, device=dev),
                                  torch.tensor(new_cols, device=dev)),
                                 torch.tensor(new_ids, dtype=torch.int64, device=dev))

    def apply(self, x: torch.Tensor, x_rows: torch.Tensor, state: torch.Tensor,
              state_rows: list[int], repetition: torch.Tensor | None,
              frequency: torch.Tensor | None, presence: torch.Tensor | None) -> None:
        """Penalise rows ``x_rows`` [R] of the logits ``x`` in place, row i with pool row
        ``state[i]``, at the ids that row has seen only (every other logit is unchanged by
        the formulas: its count is 0 and it is in neither prompt nor output)."""
        ids = self.seen[state, :self.width_of(state_rows)]  # [R, S]
        at = (x_rows.unsqueeze(1), ids)
        counts = self.counts[state.unsqueeze(1), ids]
        if repetition is not None and any(not self.known[r] for r in state_rows):
            repetition = torch.where(  # a row that has seen nothing: its padding id 0 stays
                torch.tensor([bool(self.known[r]) for r in state_rows], device=x.device),
                repetition, 1.0)
        x.index_put_(at, penalise(x[at], counts, repetition, frequency, presence))

    def forget(self, seq_id: str) -> None:
        row = self.rows.pop(seq_id, None)
        if row is not None:
            self.known.pop(row, None)
            self.free.append(row)


def penalise(logits: torch.Tensor, counts: torch.Tensor, repetition: torch.Tensor | None,
             frequency: torch.Tensor | None, presence: torch.Tensor | None) -> torch.Tensor:
    """logits: [R, S] values of ids in each row's prompt or output; counts [R, S] int32
    (generated); the rest [R] or None where no row uses it. Repetition over prompt +
    generated tokens (transformers' RepetitionPenaltyLogitsProcessor: a positive logit
    divided by the penalty, a negative one multiplied), then OpenAI's
    ``logit - frequency × count - presence × (count > 0)`` over generated tokens."""
    if repetition is not None:
        rep = repetition.unsqueeze(1)
        logits = torch.where(logits < 0, logits * rep, logits / rep)
    if frequency is not None:
        logits = logits - frequency.unsqueeze(1) * counts
    if presence is not None:
        logits = logits - presence.unsqueeze(1) * (counts > 0)
    return logits
