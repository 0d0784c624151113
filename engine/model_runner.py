"""ModelRunner: owns the model, the KV cache and the step metadata; turns a ScheduledBatch
into one forward pass and samples. The StepMetadata (flat tokens, positions, slot mapping,
block tables, LoRA segments) is allocated once, for max_num_batched_tokens tokens and
max_num_seqs sequences, and bound to the model's attention and LoRA layers; ``prepare``
refills it in place every step (fixed addresses)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from transformers import PretrainedConfig

from ..kernel_backends import host_pages
from ..kernel_backends.attention_metadata import AttentionMetadata
from ..kernel_backends.backend import KernelBackend
from ..kernel_backends.staged_buffer import StagedBuffer
from ..kernel_backends.step_metadata import StepMetadata, bind_step
from ..lora.token_rows import TokenRows
from ..lora.token_rows_step import TokenRowsStep, fix_logits
from ..structured.bitmask import StepBitmask
from ..structured.matcher import ConstraintMatcher
from .engine_config import DEFAULT_CPU_KV_BYTES, EngineConfig
from .logprob_ops import token_logprobs
from .models.llama import LlamaForCausalLM, head_dim_of, kv_heads_of
from .sampler import Sampler, SamplerOutput
from .scheduler import ScheduledBatch
from .sequence import Sequence

log = logging.getLogger(__name__)


@dataclass
class StepInputs:
    """What ``prepare`` gives ``run`` besides the StepMetadata it refilled."""

    sample_rows: list[int]  # rows of the flat batch whose logits are sampled
    sample_seqs: list[Sequence]
    # adapter id -> (slot, rows, its seqs' sample rows) of the step's adapters with their
    # own token rows (lora/token_rows.py)
    head_rows: dict[int, tuple[int, TokenRows, list[int]]]
    # (seq, first flat row, first position): rows whose logits give seq's prompt logprobs
    prompt_lp: list[tuple[Sequence, int, int, int]]  # (seq, row, position, count)


PROMPT_LOGPROB_ROWS = 256  # prompt-logprob rows turned into logits at once (memory bound)


def prompt_logprob_span(seq: Sequence, c: int, n: int) -> tuple[int, int]:
    """The positions p in [c, c + n) whose logits give the prompt logprob of token p + 1
    that ``seq`` still lacks: (first position, count). Its ``prompt_logprobs`` holds the
    tokens 0..L-1 (the first None), so p runs from L - 1 up to the prompt's last but one."""
    if seq.prompt_logprobs is None:
        return c, 0
    first = max(c, len(seq.prompt_logprobs) - 1)
    end = min(c + n, len(seq.prompt_token_ids) - 1)
    return first, max(0, end - first)


def kv_bytes_per_block(config: PretrainedConfig, block_size: int, dtype: torch.dtype) -> int:
    elem = torch.tensor([], dtype=dtype).element_size()
    return 2 * config.num_hidden_layers * block_size * kv_heads_of(config) \
        * head_dim_of(config) * elem


def num_kv_blocks(cfg: EngineConfig, config: PretrainedConfig, dtype: torch.dtype,
                  device: torch.device, max_model_len: int, reserve: int = 0) -> int:
    """Blocks that fit the KV budget: ``num_kv_blocks``, else ``kv_cache_memory`` bytes, else
    a fraction of free CUDA memory less ``reserve`` (what is allocated later: the LoRA
    slots' extras, LoRACapacity.extras_bytes), else (CPU) enough for every sequence at full
    length, capped at DEFAULT_CPU_KV_BYTES."""
    if cfg.num_kv_blocks is not None:
        return cfg.num_kv_blocks
    per_block = kv_bytes_per_block(config, cfg.block_size, dtype)
    if cfg.kv_cache_memory is not None:
        budget = cfg.kv_cache_memory
    elif device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        budget = int(total * cfg.gpu_memory_utilization) - (total - free) - reserve
    else:
        blocks_per_seq = -(-max_model_len // cfg.block_size)
        budget = min(DEFAULT_CPU_KV_BYTES, cfg.max_num_seqs * blocks_per_seq * per_block)
    blocks = budget // per_block
    if blocks < 1:
        raise ValueError(f"KV cache budget of {budget} bytes holds no block of {per_block} bytes")
    return int(blocks)


def _token_slots(slot: int, start: int, first: int, n: int) -> list[int]:
    """The LoRA slots of positions ``first .. first + n - 1`` of a sequence on ``slot``
    whose adapter applies from position ``start`` on (activated LoRA); -1 before it: the
    base path, so those tokens' KV is exactly the base model's."""
    if slot < 0 or start <= first:
        return [slot] * n
    base = min(n, start - first)
    return [-1] * base + [slot] * (n - base)


def _check_entry(seq: Sequence, n: int, block_size: int) -> None:
    """The kernels' preconditions for one sequence of the step, checked on the host once per
    step (a kernel fed less would read unwritten KV or mask whole rows into NaN): at least
    one new token, all of them within the sequence and within its allocated blocks."""
    end = seq.num_computed_tokens + n
    if n < 1 or end > seq.num_tokens or end > len(seq.block_table) * block_size:
        raise RuntimeError(
            f"invalid step for {seq.request_id}: {n} new tokens after "
            f"{seq.num_computed_tokens} computed, {seq.num_tokens} tokens, "
            f"{len(seq.block_table)} blocks of {block_size}")


def _matchers(seqs: list[Sequence]) -> list[ConstraintMatcher | None]:
    """Each sampling sequence's matcher (None: free), its own (a forked sequence that holds
    its parent's gets one) and level with its output tokens (rebuilt from them if behind)."""
    for seq in seqs:
        if seq.matcher is not None:
            seq.matcher = seq.matcher.own(seq.seq_id, seq.output_token_ids)
            seq.matcher.sync(seq.output_token_ids)
    return [seq.matcher for seq in seqs]


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, cfg: EngineConfig, num_blocks: int,
                 kernels: KernelBackend, max_model_len: int):
        self.model = model
        self.cfg = cfg
        self.kernels = kernels
        self.device = device = kernels.device
        dtype = kernels.dtype
        self.block_size = cfg.block_size
        self.sampler = Sampler(cfg.seed, kernels, cfg.logprobs_mode)
        # constrained rows' bitmask, filled on a worker while the forward runs
        self.grammar_bitmask = StepBitmask(model.config.vocab_size, cfg.max_num_seqs)
        self.prompt_tokens_computed = 0  # prompt positions run through the model, ever
        for attn in model.attention_layers():
            shape = (num_blocks, cfg.block_size, attn.num_kv_heads, attn.head_dim)
            # on the CPU a block's pages are committed when it is first written
            attn.k_cache = host_pages.zeros(shape, dtype, device)
            attn.v_cache = host_pages.zeros(shape, dtype, device)
        # the step metadata, once: a step has at most max_num_batched_tokens tokens of at
        # most max_num_seqs sequences (so at most that many LoRA segments), each sequence at
        # most max_model_len tokens
        tokens, seqs = cfg.max_num_batched_tokens, cfg.max_num_seqs
        self.meta = StepMetadata(
            AttentionMetadata(tokens, seqs, -(-max_model_len // cfg.block_size), device),
            kernels.lora_segments(tokens, seqs), device)
        bind_step(model, self.meta)
        self.sample_rows = StagedBuffer((seqs,), torch.int64, device)
        # adapters' own embedding / head rows (lora/token_rows.py): the engine sets rows_of
        self.rows_of: Callable[[int], TokenRows | None] = lambda adapter_id: None
        self.token_rows = TokenRowsStep(device, model.config.vocab_size)
        model.model.embed_tokens.register_forward_pre_hook(self.token_rows.embed_pre_hook)
        model.model.embed_tokens.register_forward_hook(self.token_rows.embed_hook)

    def prepare(self, batch: ScheduledBatch, adapter_slots: Mapping[int, int]) -> StepInputs:
        """The step's inputs; ``adapter_slots`` maps the ``lora_id`` of every sequence in
        the batch that has one to its device slot."""
        prefills = [(s, n) for s, n in batch.entries if n > 1]
        decodes = [(s, n) for s, n in batch.entries if n == 1]
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        token_slots: list[int] = []  # [T], LoRA slot of every token, -1 = base
        token_scales: list[float] = []  # [T], its request's lora_scale
        sample_rows: list[int] = []
        sample_seqs: list[Sequence] = []
        prompt_lp: list[tuple[Sequence, int, int, int]] = []
        starts = [0]
        # adapter id -> (slot, its rows, its tokens' flat rows, its sample rows' indices)
        with_rows: dict[int, tuple[int, TokenRows, list[int], list[int]]] = {}
        for seq, n in prefills + decodes:
            _check_entry(seq, n, self.block_size)
            c = seq.num_computed_tokens
            self.prompt_tokens_computed += max(0, min(c + n, len(seq.prompt_token_ids)) - c)
            first, count = prompt_logprob_span(seq, c, n)
            if count:
                prompt_lp.append((seq, len(ids) + first - c, first, count))
            ids += seq.token_slice(c, c + n)
            positions += range(c, c + n)
            bt, bs = seq.block_table, self.block_size
            slots += [bt[p // bs] * bs + p % bs for p in range(c, c + n)]
            scale = seq.params.lora_scale
            # lora_id 0 (scale 0 among them) takes the base path: exactly the base model's
            slot = adapter_slots[seq.lora_id] if seq.lora_id else -1
            token_slots += _token_slots(slot, seq.adapter_start, c, n)
            token_scales += [scale] * n
            group = self._rows_group(with_rows, seq, adapter_slots)
            if group is not None:
                group[2].extend(range(len(ids) - n, len(ids)))
            if c + n == seq.num_tokens:  # all its tokens computed: the last one samples
                if group is not None:
                    group[3].append(len(sample_rows))
                sample_rows.append(len(ids) - 1)
                sample_seqs.append(seq)
            starts.append(len(ids))
        entries = prefills + decodes
        meta = self.meta
        meta.fill_tokens(ids, positions)
        meta.attn.fill(slots, [s.block_table for s, _ in entries],
                       [s.num_computed_tokens + n for s, n in entries], starts, len(prefills))
        meta.lora.fill(token_slots, token_scales)
        self.token_rows.set_tokens((slot, rows, at) for slot, rows, at, _ in with_rows.values())
        return StepInputs(sample_rows=sample_rows, sample_seqs=sample_seqs, prompt_lp=prompt_lp,
                          head_rows={a: (slot, rows, sampled)
                                     for a, (slot, rows, _, sampled) in with_rows.items()})

    def _rows_group(self, groups: dict[int, tuple[int, TokenRows, list[int], list[int]]],
                    seq: Sequence, adapter_slots: Mapping[int, int]
                    ) -> tuple[int, TokenRows, list[int], list[int]] | None:
        """The group of ``seq``'s adapter if it has its own token rows (None: the base's
        rows; lora_scale 0 is the base model, rows included, as the prefix cache keys it)."""
        adapter_id = seq.lora_id  # 0: no adapter on the device (the base's rows)
        if not adapter_id:
            return None
        if adapter_id not in groups:
            rows = self.rows_of(adapter_id)
            if rows is None:
                return None
            groups[adapter_id] = (adapter_slots[adapter_id], rows, [], [])
        return groups[adapter_id]

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch, adapter_slots: Mapping[int, int]
            ) -> tuple[list[Sequence], SamplerOutput]:
        """One forward pass; returns the sequences that sampled and what they sampled (a
        None token where the sequence's logits were not finite). ``batch.forks``' choices
        sample from their parent's logits row, after it."""
        inputs = self.prepare(batch, adapter_slots)
        seqs, forks = inputs.sample_seqs, batch.forks
        expand = [i for i, s in enumerate(seqs) for _ in range(1 + len(forks.get(s.seq_id, ())))]
        if forks:
            seqs = [c for s in seqs for c in [s, *forks.get(s.seq_id, ())]]
        pending = self.grammar_bitmask.start(_matchers(seqs))  # forks included
        hidden = self.model(self.meta.input_ids, self.meta.positions)
        for seq, row, first, count in inputs.prompt_lp:
            self._prompt_logprobs(hidden, seq, row, first, count,  # lora_id 0: the base's
                                  inputs.head_rows.get(seq.lora_id))
        if not inputs.sample_rows:
            return [], SamplerOutput([], [])
        n = len(inputs.sample_rows)
        self.sample_rows.np[:n] = inputs.sample_rows
        rows = self.sample_rows.upload(n)
        vocab_rows = self._vocab_rows(inputs)  # None: every row the base's vocabulary
        fix = fix_logits(self.token_rows.head_groups(inputs.head_rows.values()),
                         max(vocab_rows) if vocab_rows else 0)
        logits = self.model.compute_logits(hidden[rows], fix)  # [N, vocab] float32
        if forks:
            logits = logits.index_select(0, torch.tensor(expand, device=self.device))
            vocab_rows = None if vocab_rows is None else [vocab_rows[i] for i in expand]
        mask = None if pending is None else \
            (lambda lg: self.grammar_bitmask.apply(lg, pending))
        return seqs, self.sampler(logits, seqs, mask, vocab_rows)

    def _vocab_rows(self, inputs: StepInputs) -> list[int] | None:
        """Each sampled row's vocabulary size where an adapter in the step adds tokens (its
        rows' logits are wider: lora/adapter_vocab.py); None where none does."""
        if not inputs.head_rows:  # most steps
            return None
        base = self.model.config.vocab_size
        wide = {i: rows.vocab for _, rows, at in inputs.head_rows.values() if rows.vocab > base
                for i in at}
        return [wide.get(i, base) for i in range(len(inputs.sample_rows))] if wide else None

    def _prompt_logprobs(self, hidden: torch.Tensor, seq: Sequence, row: int, first: int,
                         count: int, rows: tuple[int, TokenRows, list[int]] | None) -> None:
        """Append the logprobs of prompt tokens first+1 .. first+count to ``seq``'s, from
        the hidden rows ``row`` .. ``row + count - 1`` (raw values: no sampling happened);
        ``rows``: its adapter's own token rows, if any (slot, rows, -)."""
        k = seq.params.prompt_logprobs
        prompt = seq.prompt_token_ids
        for off in range(0, count, PROMPT_LOGPROB_ROWS):
            m = min(PROMPT_LOGPROB_ROWS, count - off)
            fix = None if rows is None else fix_logits(self.token_rows.head_groups(
                [(rows[0], rows[1], list(range(m)))]), rows[1].vocab)
            logits = self.model.compute_logits(hidden[row + off: row + off + m], fix)
            targets = torch.tensor(prompt[first + off + 1: first + off + m + 1],
                                   dtype=torch.int64, device=self.device)
            seq.prompt_logprobs.extend(token_logprobs(self.sampler.kernels, logits, targets,
                                                      [k] * m, self.sampler.mode_kind))

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy the KV of block src into block dst, in every layer (copy on write)."""
        if not pairs:
            return
        src = torch.tensor([s for s, _ in pairs], dtype=torch.int64, device=self.device)
        dst = torch.tensor([d for _, d in pairs], dtype=torch.int64, device=self.device)
        for attn in self.model.attention_layers():
            attn.k_cache.index_copy_(0, dst, attn.k_cache.index_select(0, src))
            attn.v_cache.index_copy_(0, dst, attn.v_cache.index_select(0, src))
