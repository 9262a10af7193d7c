"""Incremental detokenization that never emits half a UTF-8 character, plus stop strings.

Byte-level BPE splits multi-byte characters across tokens; decoding a suffix alone yields U+FFFD.
We decode a short window (from ``prefix_offset``) twice — with and without the new tokens — and
emit only the difference once it no longer ends in U+FFFD.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

from engine.sequence import Sequence
from engine.tokenizer import Tokenizer

# Tokens of left context kept so that merges/spaces across the boundary decode correctly.
_CONTEXT_TOKENS = 6
_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Streams text deltas. With stop strings, the last ``max_stop_len - 1`` characters are held
    back until they can no longer begin a stop string, so no emitted text is ever retracted."""

    def __init__(
        self, tokenizer: Tokenizer, prompt_token_ids: Seq[int], stop: tuple[str, ...] = ()
    ) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self._holdback = max((len(s) for s in stop), default=1) - 1
        self._ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self.stopped = False
        # Only the text not emitted yet (held back for stop strings, at most a delta more):
        # emitted text is never retracted, so keeping it all would only make each append
        # copy the whole output (quadratic over a long generation).
        self._pending = ""

    @classmethod
    def for_sequence(
        cls, tokenizer: Tokenizer, seq: Sequence, eos_token_ids: tuple[int, ...]
    ) -> IncrementalDetokenizer:
        """A sequence's detokenizer. A continued request replays its earlier output, so that a
        stop string spanning the handover is found exactly where one engine would find it."""
        detokenizer = cls(tokenizer, seq.prompt_token_ids, seq.params.stop_strings)
        for token_id in seq.output_token_ids:
            if not seq.params.is_stop_token(token_id, eos_token_ids):
                detokenizer.add_token(token_id)
        return detokenizer

    def add_token(self, token_id: int) -> tuple[str, bool]:
        """Append one token; returns (text ready to emit, a stop string was hit)."""
        if self.stopped:
            return "", True
        self._ids.append(token_id)
        self._append(self._decode_new(flush=False))
        return self._take(final=self.stopped), self.stopped

    def finish(self) -> str:
        """At the end of a request: pending bytes (as U+FFFD if incomplete) and held-back text."""
        if not self.stopped:
            self._append(self._decode_new(flush=True))
        return self._take(final=True)

    def _decode_new(self, flush: bool) -> str:
        prefix = self.tokenizer.decode(self._ids[self._prefix_offset : self._read_offset])
        full = self.tokenizer.decode(self._ids[self._prefix_offset :])
        if len(full) <= len(prefix) or (full.endswith(_REPLACEMENT) and not flush):
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return full[len(prefix) :]

    def _append(self, delta: str) -> None:
        if not delta:
            return
        # A stop string may straddle earlier text: search a window that covers both. The
        # last ``_holdback`` characters are never emitted before this, so they are pending.
        start = max(0, len(self._pending) - self._holdback)
        self._pending += delta
        hits = [i for i in (self._pending.find(s, start) for s in self.stop) if i >= 0]
        if hits:
            self._pending = self._pending[: min(hits)]
            self.stopped = True

    def _take(self, final: bool) -> str:
        end = len(self._pending) if final else max(0, len(self._pending) - self._holdback)
        delta, self._pending = self._pending[:end], self._pending[end:]
        return delta
