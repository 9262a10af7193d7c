"""Which tokens a request's own parameters ban at an output position, and whether they could
ban every token.

Two parameters ban tokens outright (``-inf`` logits): ``bad_words`` (a word's last token,
wherever the output ends with the rest of it; always, for a one-token word) and ``min_tokens``
(its stop ids and, unless ``ignore_eos``, EOS, while fewer tokens are out). A grammar (guided
decoding) allows some tokens at each position. One rule, two users: the sampler masks what
``banned_ids`` names (``engine/sampling.py``), and a request's output refuses a token among them
(``engine/request_state.py``). A sampler only picks such a token when its row had no token left
at all (every token the grammar allows is banned): that is the request's error
(``RequestError``, named by ``no_token_message``), never the engine's. Before admission,
``check_bans_leave_a_token`` refuses parameters that could ban the whole vocabulary without
any grammar; a grammar's first position is checked by ``engine/guide.py``.

Pure and torch-free.
"""

from __future__ import annotations

from collections.abc import Sequence

from engine.sampling_params import SamplingParams


def min_tokens_ids(params: SamplingParams, eos_token_ids: Sequence[int]) -> tuple[int, ...]:
    """What ``min_tokens`` masks while fewer tokens are out: the stop ids and (unless
    ``ignore_eos``) EOS."""
    eos = () if params.ignore_eos else tuple(eos_token_ids)
    return (*params.stop_ids, *eos)


def banned_ids(
    params: SamplingParams, output_ids: Sequence[int], stop_ids: Sequence[int]
) -> set[int]:
    """The ids banned as the next token after ``output_ids`` (the request's whole output so
    far, a continuation's earlier output included); ``stop_ids``: ``min_tokens_ids``."""
    banned: set[int] = set()
    done = len(output_ids)
    if done < params.min_tokens:
        banned.update(stop_ids)
    for word in params.bad_words or ():
        head = word[:-1]
        if done >= len(head) and tuple(output_ids[done - len(head) :]) == head:
            banned.add(word[-1])
    return banned


def bans_anything(params: SamplingParams, num_output_tokens: int) -> bool:
    """Whether ``banned_ids`` can name any id at this position (cheap: the per-token check of
    a request's output is skipped for the rest)."""
    return bool(params.bad_words) or num_output_tokens < params.min_tokens


def check_bans_leave_a_token(
    params: SamplingParams, vocab_size: int, eos_token_ids: Sequence[int]
) -> None:
    """Refuses (ValueError naming the fields) parameters whose bans could leave no token at
    some position: every ``bad_words`` last token and every id ``min_tokens`` masks together
    cover the vocabulary. Anything less always leaves a token (bans are the only ``-inf``s
    without a grammar)."""
    worst = {word[-1] for word in params.bad_words or ()}
    if params.min_tokens:
        worst.update(min_tokens_ids(params, eos_token_ids))
    if len({t for t in worst if 0 <= t < vocab_size}) >= vocab_size:
        raise ValueError(
            f"bad_words and min_tokens ({params.min_tokens}: stop_token_ids and EOS) could ban "
            f"all {vocab_size} tokens of the vocabulary"
        )


def no_token_message(params: SamplingParams, output_index: int) -> str:
    """Why nothing may follow at ``output_index``, naming the fields that rule it out."""
    bans = ["bad_words"] if params.bad_words else []
    if output_index < params.min_tokens:
        bans.append(f"min_tokens ({params.min_tokens}: stop_token_ids and EOS)")
    banned_by = " and ".join(bans) or "the sampling parameters"
    where = f"no token may follow at output index {output_index}"
    if params.structured is not None:
        field = params.structured.field
        return f"{where}: every token {field} allows there is banned by {banned_by}"
    return f"{where}: {banned_by} ban every token"
