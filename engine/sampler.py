"""Sampler: one step's tokens from its logits, as whole-batch tensor work on the logits'
device (nano-vllm's layers/sampler.py, vLLM V1's sample/sampler.py).

In order: allowed-token and banned-token masks (min_new_tokens, bad words), logit bias,
penalties (counts on the device: PenaltyState), then greedy rows take the argmax; the others
take temperature, min-p, top-k and top-p, and an inverse-CDF draw from the resulting
distribution (one uniform a row: far cheaper on a CPU than a vocabulary of exponentials).
Only the chosen ids, the finite flags and the requested logprobs
go to the host.

A seeded sequence's uniform for its output token at position p is a counter-based draw,
``seeded_uniform(seed + choice index, p)``: a function of those two numbers and nothing else
(no generator state), so the sequence gets the same tokens alone or in any batch, with any
chunked-prefill split, after a prefix-cache hit and after preemption and recompute. The
others share the engine's generator.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..kernel_backends.backend import KernelBackend
from ..lora.token_rows_step import pad_columns
from .logprob_ops import token_logprobs
from .logprobs import TokenLogprob
from .penalty_state import PenaltyState
from .sampling_batch import SamplingBatch, build_batch
from .sequence import Sequence

NEG_INF = float("-inf")
_MASK64 = 2**64 - 1
TOP_K_SHORTCUT = 8  # top-k <= vocab / 8 in every row: top-p sorts only the kept tokens


@dataclass
class SamplerOutput:
    tokens: list[int | None]  # None: the row's logits were not finite (the request fails)
    logprobs: list[TokenLogprob | None]  # per row; None where not asked for


def finite_rows(logits: torch.Tensor) -> list[bool]:
    """Whether each row holds only finite values. A row's sum is finite unless the row
    holds NaN or ±Inf (or overflows): one fast reduction, and the exact test only when
    some sum is not."""
    ok = torch.isfinite(logits.sum(dim=-1)).tolist()
    return ok if all(ok) else torch.isfinite(logits).all(dim=-1).tolist()


def apply_top_k_top_p(x: torch.Tensor, k: torch.Tensor | None, p: torch.Tensor | None
                      ) -> torch.Tensor:
    """x: [R, vocab]; k: [R] in [1, vocab] or None; p: [R] in (0, 1] or None. Tokens below
    the k-th largest, and outside the smallest set whose probability reaches p (transformers'
    TopPLogitsWarper rule), become -inf."""
    if k is not None:
        k_max = int(k.max())
        if p is None or k_max * TOP_K_SHORTCUT <= x.shape[-1]:  # no top-p, or small ks
            kth = x.topk(k_max, dim=-1).values.gather(1, (k - 1).unsqueeze(1))
            x = x.masked_fill(x < kth, NEG_INF)
            return x if p is None else _top_p_of_the_kept(x, p)
    x_sort, order = x.sort(dim=-1, descending=False)
    if k is not None:
        kth = x_sort.gather(1, (x.shape[-1] - k).unsqueeze(1))
        x_sort = x_sort.masked_fill(x_sort < kth, NEG_INF)
    cum = x_sort.softmax(dim=-1).cumsum(dim=-1)
    drop = cum <= 1 - p.unsqueeze(1)
    drop[:, -1] = False  # the most likely token always stays
    x_sort = x_sort.masked_fill(drop, NEG_INF)
    return torch.empty_like(x).scatter_(-1, order, x_sort)


def _top_p_of_the_kept(x: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """Top-p over the tokens top-k kept (ties at the k-th included), without sorting the
    vocabulary: the same rule as the sorting path, on the few finite logits."""
    width = int(torch.isfinite(x).sum(dim=-1).max())
    vals, idx = x.topk(width, dim=-1)  # descending; rows with fewer finite pad with -inf
    asc, asc_idx = vals.flip(-1), idx.flip(-1)
    drop = asc.softmax(dim=-1).cumsum(dim=-1) <= 1 - p.unsqueeze(1)
    drop[:, -1] = False  # the most likely token always stays
    return x.scatter(-1, asc_idx, asc.masked_fill(drop, NEG_INF))


def apply_min_p(x: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Tokens whose probability is below min_p × the largest become -inf (transformers'
    MinPLogitsWarper)."""
    probs = x.softmax(dim=-1)
    low = probs < min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
    return x.masked_fill(low, NEG_INF)


def _on_rows(x: torch.Tensor, rows: torch.Tensor, fn, *args) -> None:
    x.index_copy_(0, rows, fn(x.index_select(0, rows), *args))


class Sampler:
    def __init__(self, seed: int, kernels: KernelBackend, logprobs_mode: str = "raw_logprobs"):
        self.kernels = kernels  # argmax_rows for greedy rows, logprob_rows
        self.device = kernels.device
        self.generator = torch.Generator(self.device).manual_seed(seed)  # unseeded requests
        self.penalties: PenaltyState | None = None  # made on the first penalised row
        self.processed = logprobs_mode.startswith("processed")
        self.mode_kind = logprobs_mode.rsplit("_", 1)[1]  # "logprobs" | "logits"

    def forget(self, seq_id: str) -> None:
        if self.penalties is not None:
            self.penalties.forget(seq_id)

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, seqs: list[Sequence],
                 grammar_mask: Callable[[torch.Tensor], None] | None = None,
                 vocab_rows: list[int] | None = None) -> SamplerOutput:
        """logits: [N, vocab] float32 on the device, one row per sequence that samples.
        ``grammar_mask`` sets the logits of tokens the constrained rows' grammars refuse to
        -inf, in place (structured/bitmask.py), before any other processing.
        ``vocab_rows``: each row's vocabulary size where rows differ (an adapter's
        tokenizer adds tokens: lora/adapter_vocab.py); the columns past a row's are -inf
        for it (``pad_columns``), after its finiteness is read."""
        batch = build_batch(seqs, logits.shape[-1], logits.device)
        ok = None
        if vocab_rows is not None:
            ok = finite_rows(logits)  # the padding's -inf is no fault of the row
            pad_columns(logits, vocab_rows)
        elif grammar_mask is None and batch.plain_greedy:  # one read: argmax and check
            tokens, finite = self.kernels.argmax_finite_rows(logits)
            return self._finish(logits, tokens, finite.tolist(), batch, None, seqs)
        if ok is None:
            ok = finite_rows(logits)  # before anything writes -inf into the rows
        if grammar_mask is not None:
            grammar_mask(logits)
        pen = self._penalty_rows(batch, logits.shape[-1], logits.device)
        # raw logprobs read ``logits`` after sampling: processing must then work on a copy
        keep = bool(batch.logprob_rows) and not self.processed
        x = self._process(logits, batch, pen, keep)
        x = self._warp(x, batch, owned=x is not logits or not keep)
        if batch.all_greedy:
            tokens = self.kernels.argmax_rows(x)
        else:  # sampled rows draw from x; greedy ones (if any) take the argmax
            tokens = self._draw(x, seqs)
            if batch.any_greedy:
                tokens = torch.where(batch.greedy, self.kernels.argmax_rows(x), tokens)
        return self._finish(logits if keep else x, tokens, ok, batch, pen, seqs)

    def _finish(self, raw: torch.Tensor, tokens: torch.Tensor,
                ok: list[bool], batch: SamplingBatch,
                pen: tuple[list[int], torch.Tensor] | None, seqs: list[Sequence]
                ) -> SamplerOutput:
        """The chosen ids to the host, the penalties' counts, the requested logprobs (read
        from ``raw``: the logits as the logprobs mode wants them)."""
        host = tokens.tolist()
        if pen is not None:
            rows, rows_t = pen
            rs = batch.penalties[1]
            self.penalties.add(rows, rows_t, tokens[rs.rows], [host[i] for i in rs.index],
                               [ok[i] for i in rs.index])
        logprobs: list[TokenLogprob | None] = [None] * len(seqs)
        if batch.logprob_rows:
            values = raw
            chosen = tokens
            if len(batch.logprob_rows) < len(seqs):  # only some rows asked
                lp_rows = torch.tensor(batch.logprob_rows, dtype=torch.int64,
                                       device=raw.device)
                values, chosen = values.index_select(0, lp_rows), tokens.index_select(0, lp_rows)
            for i, lp in zip(batch.logprob_rows, token_logprobs(
                    self.kernels, values, chosen, batch.logprob_ks, self.mode_kind)):
                logprobs[i] = lp
        return SamplerOutput([t if good else None for t, good in zip(host, ok)], logprobs)

    def _penalty_rows(self, batch: SamplingBatch, vocab: int, device: torch.device
                      ) -> tuple[list[int], torch.Tensor] | None:
        """The PenaltyState rows of the penalised rows (host list, device tensor)."""
        if batch.penalties is None:
            return None
        if self.penalties is None:
            self.penalties = PenaltyState(vocab, device)
        self.penalties.widen(vocab)  # an adapter's own, larger vocabulary
        rows = self.penalties.rows_of(batch.penalties[0])
        return rows, torch.tensor(rows, dtype=torch.int64, device=device)

    def _process(self, logits: torch.Tensor, batch: SamplingBatch,
                 pen: tuple[list[int], torch.Tensor] | None, keep: bool) -> torch.Tensor:
        """Masks, bias and penalties: in place on ``logits`` (which the caller gave up),
        or on a copy where ``keep``; ``logits`` itself where none applies."""
        if batch.allowed is None and batch.banned is None and batch.bias is None \
                and pen is None:
            return logits
        x = logits.clone() if keep else logits
        if batch.allowed is not None:
            rs, mask = batch.allowed
            _on_rows(x, rs.rows, lambda sub: sub.masked_fill(~mask, NEG_INF))
        if batch.banned is not None:
            x.index_put_(batch.banned, torch.tensor(NEG_INF, device=x.device))
        if batch.bias is not None:
            rows, cols, vals = batch.bias
            x.index_put_((rows, cols), vals, accumulate=True)
        if pen is not None:
            _, rs, rep, freq, pres = batch.penalties
            self.penalties.apply(x, rs.rows, pen[1], pen[0], rep, freq, pres)
        return x

    @staticmethod
    def _warp(x: torch.Tensor, batch: SamplingBatch, owned: bool) -> torch.Tensor:
        """Temperature (greedy rows: 1), min-p, top-k, top-p: the distribution sampled from.
        In place on ``x`` only where ``owned``."""
        if batch.temperature is not None:
            x, owned = x / batch.temperature.unsqueeze(1), True
        if not owned and (batch.min_p is not None or batch.top_k is not None
                          or batch.top_p is not None):
            x = x.clone()
        if batch.min_p is not None:
            rs, m = batch.min_p
            _on_rows(x, rs.rows, apply_min_p, m)
        if batch.top_k is not None or batch.top_p is not None:
            idx = sorted(set((batch.top_k[0].index if batch.top_k else [])
                             + (batch.top_p[0].index if batch.top_p else [])))
            rows = torch.tensor(idx, dtype=torch.int64, device=x.device)
            k = _spread(batch.top_k, idx, x.shape[-1], x.device, torch.int64)
            p = _spread(batch.top_p, idx, 1.0, x.device, torch.float32)
            _on_rows(x, rows, apply_top_k_top_p, k, p)
        return x

    def _draw(self, x: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """One token per row from softmax(x) by inverse CDF: one uniform u per row (a
        seeded row's from ``seeded_uniform`` of its seed, choice and output position), the
        first token whose float64 cumulative probability passes u × the total. A token of
        probability 0 is never drawn."""
        probs = x.softmax(dim=-1)
        seeded = [i for i, s in enumerate(seqs) if s.params.seed is not None]
        if len(seeded) == len(seqs):
            u = torch.tensor([_seeded_u(s) for s in seqs], dtype=torch.float64,
                             device=x.device).unsqueeze(1)
        else:
            u = torch.empty(len(seqs), 1, dtype=torch.float64, device=x.device)
            u.uniform_(generator=self.generator)
            if seeded:
                u[torch.tensor(seeded, dtype=torch.int64, device=x.device), 0] = torch.tensor(
                    [_seeded_u(seqs[i]) for i in seeded], dtype=torch.float64, device=x.device)
        cdf = probs.to(torch.float64).cumsum_(dim=-1)
        idx = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).clamp_(max=x.shape[-1] - 1)
        zero = probs.gather(1, idx) == 0  # u × total rounded up to the total: rare
        return torch.where(zero, probs.argmax(dim=-1, keepdim=True), idx).squeeze(1)


def _mix64(z: int) -> int:
    """SplitMix64's finaliser: a bijection of 64-bit integers that mixes every bit."""
    z = (z + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def seeded_uniform(stream: int, position: int) -> float:
    """The uniform in [0, 1) that stream ``stream`` draws for output position ``position``:
    a counter-based draw (SplitMix64 of the stream, then of that and the position), 53 bits
    as torch's float64 ``uniform_``. It depends on these two numbers only."""
    return (_mix64(_mix64(stream) ^ position) >> 11) * 2.0**-53


def _seeded_u(seq: Sequence) -> float:
    """A seeded row's uniform: stream seed + choice index (choice i of seed s is the single
    choice of seed s + i, vLLM's rule), at the position of the token it draws now."""
    return seeded_uniform((seq.params.seed + seq.index) % 2**63, seq.num_output_tokens)


def _spread(part: tuple | None, rows: list[int], neutral: float, device: torch.device,
            dtype: torch.dtype) -> torch.Tensor | None:
    """A filter's per-row values over ``rows`` (the neutral value where it is off)."""
    if part is None:
        return None
    rs, values = part
    out = torch.full((len(rows),), neutral, dtype=dtype, device=device)
    pos = {r: j for j, r in enumerate(rows)}
    out[torch.tensor([pos[r] for r in rs.index], dtype=torch.int64, device=device)] = \
        values.to(dtype)
    return out
