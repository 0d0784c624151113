"""A request's n choices: which sequences fork this step, and the outputs of a request
that ends before it forked. Pure Python.

Choice 0 of a request with n > 1 runs alone until its prompt is computed; in that step
choices 1..n-1 are made (``Sequence.fork``), sample from its logits row, and then share
its blocks (``Scheduler.fork``).
"""

from __future__ import annotations

from collections.abc import Callable

from tqdm import tqdm

from .output_processor import OutputProcessor, RequestOutput
from .scheduler import ScheduledBatch
from .sequence import Sequence


def choices_to_fork(batch: ScheduledBatch) -> dict[str, list[Sequence]]:
    """seq_id -> choices 1..n-1, for each sequence of the batch whose prompt completes in
    this step and that has not forked yet."""
    return {seq.seq_id: [seq.fork(i) for i in range(1, seq.params.n)]
            for seq, n in batch.entries
            if seq.seats > 1 and seq.num_computed_tokens + n == seq.num_tokens}


def report_choices(outputs: OutputProcessor, seq: Sequence) -> list[RequestOutput]:
    """``seq``'s output; a request that ends before its choices forked (an error, an
    adapter that failed) reports each of its n choices finished, so every stream ends."""
    out = [outputs.report(seq)]
    if seq.is_finished and seq.seats > 1:
        for i in range(1, seq.params.n):
            choice = seq.fork(i)
            choice.finish(seq.finish_reason or "abort")
            choice.error, choice.adapter_fault = seq.error, seq.adapter_fault
            out.append(outputs.report(choice))
    return out


def run_to_completion(step: Callable[[], list[RequestOutput]], seqs: list[Sequence],
                      use_tqdm: bool) -> list[RequestOutput | list[RequestOutput]]:
    """Step until every choice of ``seqs`` (added already) has finished: per sequence, its
    finished output for n == 1, the list of its n finished choices (index order) for n > 1."""
    total = sum(s.params.n for s in seqs)
    done: dict[tuple[str, int], RequestOutput] = {}
    with tqdm(total=total, disable=not use_tqdm, desc="generating") as bar:
        while len(done) < total:
            for out in step():
                if out.finished:
                    done[out.request_id, out.index] = out
                    bar.update(1)
    return [done[s.request_id, 0] if s.params.n == 1 else
            [done[s.request_id, i] for i in range(s.params.n)] for s in seqs]
