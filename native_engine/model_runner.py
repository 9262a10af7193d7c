"""Turns one scheduled step into tensors, runs the model, and samples.

Per-step host work is the enemy of decode throughput, so inputs are built with a handful of
list operations and one tensor conversion each; the logits are computed only for the rows that
sample: the last token of sequences whose known tokens are all computed after this step, and
every row of a verified one (its last token and each guess: ``native_engine/speculator.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.config import AttentionBackend
from engine.guide import next_masks
from engine.sampling import SampleRequest
from engine.sequence import TokenLogprobs
from engine.token_bans import min_tokens_ids
from native_engine import prompt_logprobs
from native_engine.attention import (
    AttentionMetadata,
    PrefillSpan,
    PrefillTables,
    decode_gather_inputs,
)
from native_engine.kv_cache import KVCache
from native_engine.kv_quant import slot_positions
from native_engine.models.llama import LlamaFamilyForCausalLM
from native_engine.sampler import Sampler
from native_engine.scheduler import ScheduledSeq


@dataclass(frozen=True)
class SeqSamples:
    """What one scheduled sequence sampled this step, one entry per sampled row."""

    scheduled: ScheduledSeq
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]


class ModelRunner:
    def __init__(
        self,
        model: LlamaFamilyForCausalLM,
        kv_cache: KVCache,
        device: torch.device,
        backend: AttentionBackend,
        seed: int = 0,
        eos_token_ids: tuple[int, ...] = (),
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.device = device
        self.block_size = kv_cache.layout.block_size
        self.quantized = kv_cache.layout.kv_cache_dtype.quantized
        self.backend = backend
        self.sampler = Sampler(device, seed)
        self.eos_token_ids = eos_token_ids  # what min_tokens masks, besides stop ids

    def execute(self, scheduled: list[ScheduledSeq]) -> list[SeqSamples]:
        """Runs the step; returns, in row order, the samples of each sequence that sampled:
        one for a plain step, ``1 + len(spec_token_ids)`` for a verified one (the token after
        each of its positions, each from the request's own sampler at its output index).

        Reads each sequence's ``num_computed_tokens`` as it was *before* this step.
        """
        ordered, hidden = self._forward(scheduled)
        if any(s.seq.needs_prompt_logprobs for s in ordered):
            with torch.inference_mode():
                prompt_logprobs.collect(self.model, ordered, hidden)
        sample_rows: list[int] = []
        requests: list[SampleRequest] = []
        samplers: list[ScheduledSeq] = []
        # The guided rows that sample one token: their masks are filled together.
        single = [
            (s, s.seq.guide)
            for s in ordered
            if s.num_sampled and s.seq.guide is not None and not s.spec_token_ids
        ]
        filled = next_masks([guide for _, guide in single if guide is not None])
        masks = {id(s): mask for (s, _), mask in zip(single, filled, strict=True)}
        row = 0
        for s in ordered:
            row += s.num_new_tokens
            num_sampled = s.num_sampled
            if not num_sampled:
                continue
            samplers.append(s)
            sample_rows.extend(range(row - num_sampled, row))
            requests.extend(self._sample_requests(s, num_sampled, masks.get(id(s))))
        if not samplers:
            return []
        with torch.inference_mode():
            rows = torch.tensor(sample_rows, device=self.device)
            logits = self.model.compute_logits(hidden[rows])  # [num_sample_rows, vocab]
            out = self.sampler(logits, requests)
        results: list[SeqSamples] = []
        start = 0
        for s in samplers:
            end = start + s.num_sampled
            results.append(SeqSamples(s, out.token_ids[start:end], out.logprobs[start:end]))
            start = end
        return results

    def _sample_requests(
        self, s: ScheduledSeq, num_sampled: int, mask: torch.Tensor | None = None
    ) -> list[SampleRequest]:
        """One per sampled row, at its output index. With logit processing or a grammar, row
        ``i`` of a verified sequence counts the guesses before it as output: it is kept only
        if they were, so its sample is the one a step at a time would have drawn. ``mask``:
        a one-row guided sequence's mask, filled with the others' (``next_masks``)."""
        seq, params = s.seq, s.seq.params
        first = seq.num_output_tokens  # the output index of the first sampled row
        allowed: list[torch.Tensor | None] | torch.Tensor = [None] * num_sampled
        if mask is not None:
            allowed = [mask]
        elif seq.guide is not None:
            allowed = seq.guide.masks(s.spec_token_ids, num_sampled)
        if not params.processes_logits:
            return [
                SampleRequest(params, first + i, allowed=allowed[i]) for i in range(num_sampled)
            ]
        output = seq.token_ids[seq.num_prompt_tokens :]
        stop_ids = min_tokens_ids(params, self.eos_token_ids)
        return [
            SampleRequest(
                params,
                first + i,
                seq.prompt_token_ids,
                [*output, *s.spec_token_ids[:i]],
                stop_ids,
                allowed[i],
            )
            for i in range(num_sampled)
        ]

    def forward_logits(
        self, scheduled: list[ScheduledSeq]
    ) -> tuple[list[ScheduledSeq], torch.Tensor]:
        """Logits of every scheduled token (prompt logprobs, tests), rows in returned order."""
        ordered, hidden = self._forward(scheduled)
        with torch.inference_mode():
            return ordered, self.model.compute_logits(hidden)  # [num_tokens, vocab]

    def _forward(self, scheduled: list[ScheduledSeq]) -> tuple[list[ScheduledSeq], torch.Tensor]:
        # Prefill chunks first, then decode rows: the decode part is one batched call. A
        # verified sequence is 1 + k decode rows, row i seeing the first num_computed + 1 + i
        # cache slots: every new K/V is stored before attention, so that is exactly causal
        # attention, through the same kernel (and numerics) as plain decoding.
        prefills = [s for s in scheduled if s.num_new_tokens > 1 and not s.spec_token_ids]
        decodes = [s for s in scheduled if s.num_new_tokens == 1 or s.spec_token_ids]
        ordered = prefills + decodes
        input_ids, positions, slots = self._flatten(ordered)
        meta = self._metadata(prefills, decodes, slots)
        with torch.inference_mode():
            return ordered, self.model(input_ids, positions, self.kv_cache.layers, meta)

    def _flatten(
        self, ordered: list[ScheduledSeq]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        bs = self.block_size
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        for s in ordered:
            seq, start = s.seq, s.seq.num_computed_tokens
            end = start + s.num_new_tokens
            # The uncomputed known tokens, then the guesses at the positions after them.
            ids.extend(seq.token_ids[start : end - len(s.spec_token_ids)])
            ids.extend(s.spec_token_ids)
            if s.num_new_tokens == 1:
                pos.append(start)
                slots.append(seq.block_table[start // bs] * bs + start % bs)
                continue
            positions = range(start, end)
            pos.extend(positions)
            table = seq.block_table
            slots.extend(table[p // bs] * bs + p % bs for p in positions)
        dev = self.device
        return (
            torch.tensor(ids, dtype=torch.long, device=dev),
            torch.tensor(pos, dtype=torch.long, device=dev),
            torch.tensor(slots, dtype=torch.long, device=dev),
        )

    def _metadata(
        self, prefills: list[ScheduledSeq], decodes: list[ScheduledSeq], slots: torch.Tensor
    ) -> AttentionMetadata:
        spans: list[PrefillSpan] = []
        start = 0
        for s in prefills:
            context_len = s.seq.num_computed_tokens + s.num_new_tokens
            block_ids = s.seq.block_table[: -(-context_len // self.block_size)]
            spans.append(
                PrefillSpan(
                    query_start=start,
                    query_len=s.num_new_tokens,
                    context_len=context_len,
                    block_ids=torch.tensor(block_ids, dtype=torch.long, device=self.device),
                )
            )
            start += s.num_new_tokens
        # (sequence, context length) per decode row
        rows = [
            (s.seq, s.seq.num_computed_tokens + 1 + i)
            for s in decodes
            for i in range(s.num_new_tokens)
        ]
        context_lens = [context_len for _, context_len in rows]
        max_context = max(context_lens, default=0)
        width = max(-(-max_context // self.block_size), 1)
        tables = [
            seq.block_table[:width] + [0] * (width - len(seq.block_table[:width]))
            for seq, _ in rows
        ]
        block_tables = torch.tensor(tables, dtype=torch.int32, device=self.device).view(
            len(rows), width
        )
        lens = torch.tensor(context_lens, dtype=torch.int32, device=self.device)
        gather_table = mask = None
        if decodes and self.backend is AttentionBackend.TORCH:
            gather_table, mask = decode_gather_inputs(
                block_tables, lens, max_context, self.block_size
            )
        return AttentionMetadata(
            slot_mapping=slots,
            prefills=tuple(spans),
            num_prefill_tokens=start,
            decode_block_tables=block_tables,
            decode_context_lens=lens,
            backend=self.backend,
            decode_gather_table=gather_table,
            decode_mask=mask,
            slot_positions=slot_positions(slots, self.block_size) if self.quantized else None,
            prefill_tables=(
                PrefillTables.of(spans) if spans and self.backend is AttentionBackend.CPU else None
            ),
        )
