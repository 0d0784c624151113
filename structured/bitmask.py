"""StepBitmask: the packed token bitmask of one step, filled on a worker thread while the
forward pass runs, applied to the logits on their device by xgrammar's helper.

The engine thread calls ``start`` once the step's batch is known (before the forward),
then ``apply`` to the logits before sampling, then advances the matchers with the sampled
tokens. ``apply`` joins the fill first, so the matchers are only read by the worker while
the engine thread runs the forward, and only written by the engine thread after it.

Rows of free (unconstrained) sequences are never written nor applied: their logits are
untouched, so their tokens are what they would be alone.
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import xgrammar

from ..kernel_backends import intra_op
from .matcher import ConstraintMatcher


@dataclass
class PendingMask:
    future: concurrent.futures.Future  # the fill, on the worker
    rows: list[int]  # the constrained rows of the step's logits
    seconds: float = 0.0  # the fill's own time (set when it ends)


@dataclass(frozen=True)
class MaskTiming:
    """One step's mask: rows filled, the fill's time on the worker, how long the engine
    thread waited for it at the join (0 when it overlapped the forward), the apply's time."""

    rows: int
    fill_s: float
    wait_s: float
    apply_s: float


class StepBitmask:
    def __init__(self, vocab_size: int, rows: int = 8):
        self.vocab_size = vocab_size
        self.bitmask = xgrammar.allocate_token_bitmask(max(rows, 1), vocab_size)  # [R, W]
        self._batch = xgrammar.BatchGrammarMatcher(max_threads=1)
        self._pool = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="loraplex-mask", initializer=intra_op.serial_thread)
        self.timings: list[MaskTiming] = []  # the latest steps', for benches (bounded)

    def start(self, matchers: Sequence[ConstraintMatcher | None]) -> PendingMask | None:
        """Start filling the rows of the constrained sequences (``matchers[i]`` is row i's,
        None where row i is free); None when no row is constrained."""
        rows = [i for i, m in enumerate(matchers) if m is not None]
        if not rows:
            return None
        if len(matchers) > self.bitmask.shape[0]:  # grown on the engine thread, never shrunk
            self.bitmask = xgrammar.allocate_token_bitmask(len(matchers), self.vocab_size)
        handles = [matchers[i].handle for i in rows]
        pending = PendingMask(concurrent.futures.Future(), rows)
        pending.future = self._pool.submit(self._fill, handles, self.bitmask, rows, pending)
        return pending

    def _fill(self, handles: list[xgrammar.GrammarMatcher], bitmask: torch.Tensor,
              rows: list[int], pending: PendingMask) -> None:
        start = time.perf_counter()
        self._batch.batch_fill_next_token_bitmask(handles, bitmask, rows)
        pending.seconds = time.perf_counter() - start

    def apply(self, logits: torch.Tensor, pending: PendingMask | None) -> None:
        """Join the fill and mask ``logits`` ([N, vocab], the step's sampled rows) in place:
        a disallowed token's logit becomes -inf, on the logits' device."""
        if pending is None:
            return
        start = time.perf_counter()
        pending.future.result()
        joined = time.perf_counter()
        mask = self.bitmask[: logits.shape[0]]
        if mask.device != logits.device:
            mask = mask.to(logits.device, non_blocking=True)
        xgrammar.apply_token_bitmask_inplace(logits, mask, vocab_size=self.vocab_size,
                                             indices=pending.rows)
        if len(self.timings) >= 100_000:
            del self.timings[:50_000]
        self.timings.append(MaskTiming(len(pending.rows), pending.seconds, joined - start,
                                       time.perf_counter() - joined))

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
