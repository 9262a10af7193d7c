"""Offline API (vLLM-like): ``LLM(model).generate(prompts, sampling_params)``."""

from __future__ import annotations

from collections.abc import Sequence

from engine.config import (
    AttentionBackend,
    CacheConfig,
    EngineConfig,
    SchedulerConfig,
    SchedulingPolicy,
    SpecMethod,
    SpeculativeConfig,
)
from engine.kv_layout import KVCacheDtype
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from native_engine.llm_engine import LLMEngine


class LLM:
    def __init__(
        self,
        model: str,
        *,
        dtype: str = "auto",
        block_size: int = 16,
        num_blocks: int | None = None,
        kv_cache_bytes: int | None = None,
        max_model_len: int | None = None,
        enable_prefix_caching: bool = True,
        host_cache_gib: float = 0.0,
        kv_cache_dtype: str = "auto",
        device: str | None = None,
        max_num_seqs: int = 128,
        max_num_batched_tokens: int = 2048,
        scheduling_policy: str = "fcfs",
        attention_backend: str | None = None,
        speculative_method: str | None = None,
        num_speculative_tokens: int = 3,
        spec_draft_model: str | None = None,
        spec_ngram_min: int = 2,
        spec_ngram_max: int = 4,
        spec_min_acceptance: float = 0.3,
        spec_max_batch_size: int = 16,
    ) -> None:
        speculative = None
        if speculative_method is not None:
            speculative = SpeculativeConfig(
                method=SpecMethod(speculative_method),
                num_speculative_tokens=num_speculative_tokens,
                ngram_min=spec_ngram_min,
                ngram_max=spec_ngram_max,
                draft_model=str(spec_draft_model) if spec_draft_model is not None else None,
                min_acceptance=spec_min_acceptance,
                max_batch_size=spec_max_batch_size,
            )
        elif spec_draft_model is not None:
            raise ValueError("spec_draft_model needs speculative_method 'draft'")
        self.engine = LLMEngine(
            EngineConfig(
                model=str(model),
                dtype=dtype,
                max_model_len=max_model_len,
                device=device,
                cache=CacheConfig(
                    block_size=block_size,
                    num_blocks=num_blocks,
                    kv_cache_bytes=kv_cache_bytes,
                    enable_prefix_caching=enable_prefix_caching,
                    host_cache_gib=host_cache_gib,
                    kv_cache_dtype=KVCacheDtype.parse(kv_cache_dtype),
                ),
                scheduler=SchedulerConfig(
                    max_num_seqs=max_num_seqs,
                    max_num_batched_tokens=max_num_batched_tokens,
                    scheduling_policy=SchedulingPolicy(scheduling_policy),
                ),
                attention_backend=(
                    AttentionBackend(attention_backend) if attention_backend else None
                ),
                speculative=speculative,
            )
        )

    def generate(
        self,
        prompts: Sequence[str] | Sequence[list[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        if isinstance(prompts, str):
            raise ValueError("prompts must be a list of prompts, not one string")
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(
                    f"sampling_params has {len(params_list)} entries for {len(prompts)} prompts"
                )
        outputs: dict[str, RequestOutput] = {}
        order: list[str] = []
        try:
            prompt_list: list[str | list[int]] = list(prompts)
            for prompt, params in zip(prompt_list, params_list, strict=True):
                token_ids = self.engine.intake.validate_prompt(prompt)
                request_id = self.engine.add_request(token_ids, params)
                outputs[request_id] = RequestOutput(request_id, token_ids)
                order.append(request_id)
            while self.engine.has_unfinished_requests():
                for update in self.engine.step():
                    outputs[update.request_id].apply(update)
        except BaseException:
            for request_id in order:
                self.engine.abort(request_id)
            raise
        return [outputs[r] for r in order]
