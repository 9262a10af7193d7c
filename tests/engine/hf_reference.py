"""HF transformers as the reference: greedy continuation and full-sequence logits."""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel


def load_hf(model_dir: Path, dtype: torch.dtype = torch.float32) -> PreTrainedModel:
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype)
    return model.eval()


def hf_greedy(model: PreTrainedModel, prompt: list[int], max_new_tokens: int) -> list[int]:
    """HF `generate`, greedy, with EOS disabled (ignore_eos) so every run has full length."""
    config = copy.deepcopy(model.generation_config)
    # An id the model cannot emit: generate() otherwise falls back to config.json's EOS.
    config.eos_token_id = model.config.vocab_size
    config.pad_token_id = 0
    config.do_sample = False
    config.max_new_tokens = max_new_tokens
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            generation_config=config,
        )
    # generate() may return fewer tokens only if it hit EOS, which is disabled here.
    tokens: list[int] = out[0, len(prompt) :].tolist()
    assert len(tokens) == max_new_tokens
    return tokens


def hf_logits(model: PreTrainedModel, token_ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([token_ids])).logits[0].float()  # [len, vocab]
