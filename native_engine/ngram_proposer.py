"""Prompt-lookup speculation: propose what followed the last n tokens where they occurred
before, in the prompt or the output so far (no extra model; pays on copy-heavy answers such as
code edits, quoting, summaries that repeat their source).

Each request's tokens are kept as packed int32 bytes, extended as tokens arrive, and searched
with ``bytes.rfind`` (C speed): a lookup costs microseconds on long contexts, so a request whose
suffix never recurs pays next to nothing.
"""

from __future__ import annotations

from array import array

from native_engine.proposer import ProposalRequest, Proposer

_ITEM = array("i").itemsize  # token ids < 2**31


def ngram_lookup(token_ids: list[int], ngram_min: int, ngram_max: int, k: int) -> list[int]:
    """Up to ``k`` tokens that followed the most recent earlier occurrence of the longest
    suffix of ``token_ids`` of length ``ngram_max`` down to ``ngram_min``; [] when none occurs.

    >>> ngram_lookup([1, 2, 3, 9, 1, 2], 1, 3, 2)
    [3, 9]
    """
    return _lookup(array("i", token_ids).tobytes(), token_ids, ngram_min, ngram_max, k)


def _lookup(
    packed: bytes | bytearray, token_ids: list[int], ngram_min: int, ngram_max: int, k: int
) -> list[int]:
    n_tokens = len(token_ids)
    # An occurrence must end before the last token (else it is the suffix itself).
    end = (n_tokens - 1) * _ITEM
    for n in range(min(ngram_max, n_tokens - 1), ngram_min - 1, -1):
        suffix = packed[(n_tokens - n) * _ITEM :]
        limit = end
        while (pos := packed.rfind(suffix, 0, limit)) >= 0:
            if pos % _ITEM == 0:  # a match at a token boundary, not across two tokens' bytes
                follow = pos // _ITEM + n
                return token_ids[follow : min(follow + k, n_tokens)]
            limit = pos + len(suffix) - 1
    return []


class NgramProposer(Proposer):
    def __init__(self, ngram_min: int, ngram_max: int) -> None:
        self.ngram_min, self.ngram_max = ngram_min, ngram_max
        self._packed: dict[str, bytearray] = {}  # request_id -> its token ids, packed

    def propose(self, requests: list[ProposalRequest]) -> list[list[int]]:
        proposals = []
        for r in requests:
            tokens = r.seq.token_ids
            packed = self._packed.setdefault(r.seq.request_id, bytearray())
            packed += array("i", tokens[len(packed) // _ITEM :]).tobytes()  # tokens only grow
            proposals.append(_lookup(packed, tokens, self.ngram_min, self.ngram_max, r.max_tokens))
        return proposals

    def release(self, request_id: str) -> None:
        self._packed.pop(request_id, None)
