"""Prompt validation shared by the engine and the router (torch-free): errors name the field."""

from __future__ import annotations

from collections.abc import Sequence

from engine.sampling_params import SamplingParams
from engine.token_bans import check_bans_leave_a_token
from engine.tokenizer import Tokenizer


def validate_token_ids(token_ids: list[int], vocab_size: int, name: str) -> None:
    bad = [t for t in token_ids if not isinstance(t, int) or not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"{name} has ids outside the vocabulary [0, {vocab_size}): {bad[:5]}")


def validate_sampling(
    params: SamplingParams, vocab_size: int, eos_token_ids: Sequence[int]
) -> None:
    """Every token id the sampling parameters carry is in the vocabulary, and their bans leave
    a token (``engine/token_bans.py``). The one check of a client's ids before admission: the
    router's, and each engine's (a worker's callers are not all routers). Errors name the
    field."""
    validate_token_ids(list(params.stop_ids), vocab_size, "stop_token_ids")
    validate_token_ids([token_id for token_id, _ in params.bias], vocab_size, "logit_bias")
    bad_words = [token_id for word in params.bad_words or () for token_id in word]
    validate_token_ids(bad_words, vocab_size, "bad_words")
    check_bans_leave_a_token(params, vocab_size, eos_token_ids)


def validate_prompt(
    prompt: str | list[int],
    tokenizer: Tokenizer | None,
    vocab_size: int,
    max_model_len: int,
    name: str | None = None,
) -> list[int]:
    """Token ids of a text or token-id prompt that fits ``max_model_len``. ``name``: the field
    errors name (default: ``prompt`` for text, ``prompt_token_ids`` for ids)."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError(
                "prompt is text but the model has no tokenizer.json; pass prompt_token_ids"
            )
        if not prompt:
            # Checked before encoding: a tokenizer that adds BOS would make it non-empty.
            raise ValueError("prompt is empty")
        token_ids = tokenizer.encode(prompt)
        name = name or "prompt"
    else:
        token_ids = list(prompt)
        name = name or "prompt_token_ids"
    if not token_ids:
        raise ValueError(f"{name} is empty")
    # The length first: refusing a huge prompt must not cost a scan of its ids.
    if len(token_ids) > max_model_len:
        raise ValueError(
            f"{name} has {len(token_ids)} tokens, more than max_model_len {max_model_len}"
        )
    # Added tokens of a tokenizer can lie past the model's vocabulary, so text is checked too.
    validate_token_ids(token_ids, vocab_size, name)
    return token_ids
