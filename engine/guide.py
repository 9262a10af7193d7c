"""Guided decoding: a request's ``StructuredOutput`` compiled (llguidance) into a matcher that
masks the tokens its output may take next.

``GuideCompiler`` (one per engine) owns the model's token table for llguidance and a bounded
cache of compiled grammars: ``compile`` is the slow part (llguidance builds the grammar with
the GIL released, bounded by ``LIMITS``) and runs off the event loop before the request is
admitted (``AsyncEngine``); ``guide`` is then a cheap copy of the cached matcher. A ``Guide``
belongs to one ``Sequence``: the engine feeds it every token the request outputs, the earlier
output of a continued request included (replayed on creation), so a migrated or disaggregated
stream's masks are exactly the uninterrupted stream's. Why llguidance over xgrammar: measured
in ``benchmarks/structured.py`` (docs/openai.md).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from engine.structured_output import StructuredOutput

if TYPE_CHECKING:
    import llguidance

CACHE_SIZE = 64  # compiled grammars kept per engine
# Bounds on one grammar's construction and on each mask step (llguidance's own units: a
# compile at these limits costs well under a second on one core).
_MAX_GRAMMAR_SIZE = 200_000
_INITIAL_LEXER_FUEL = 1_000_000
_STEP_LEXER_FUEL = 200_000


class Guide:
    """One request's matcher. ``masks`` computes the rows the sampler applies; ``accept``
    advances it by an output token and says whether the constraint is complete."""

    def __init__(
        self,
        matcher: llguidance.LLMatcher,
        vocab_size: int,
        field: str,
        banned_eos: tuple[int, ...] = (),
    ) -> None:
        """``banned_eos``: an ``ignore_eos`` request's EOS ids, kept out of every mask that
        allows anything else (the grammar could end there, the request does not)."""
        self._matcher = matcher
        self._vocab_size = vocab_size
        self._field = field
        self._banned_eos = list(banned_eos)

    def accept(self, token_id: int) -> bool:
        """Advances by ``token_id``; True once the output is complete (nothing more may
        follow). A token the mask did not allow is a bug upstream, not a user error."""
        if not self._matcher.consume_token(token_id):
            raise RuntimeError(f"{self._field}: token {token_id} was outside the grammar")
        return bool(self._matcher.is_stopped())

    def masks(self, guesses: Sequence[int], num_rows: int) -> torch.Tensor:
        """``[num_rows, vocab]`` bool: row ``i`` allows what may follow the output plus the
        first ``i`` guesses (speculative verification). Rows after a guess the grammar rejects
        allow everything: that guess is rejected (its row cannot sample it), so they are never
        used. The matcher is left where it was."""
        import llguidance.torch as lgt

        words = lgt.allocate_token_bitmask(num_rows, self._vocab_size)
        words.fill_(-1)
        consumed = 0
        for row in range(num_rows):
            lgt.fill_next_token_bitmask(self._matcher, words, row)
            if row == num_rows - 1 or row >= len(guesses):
                break
            if not self._matcher.try_consume_tokens([guesses[row]]):
                break
            consumed += 1
        if consumed:
            self._matcher.rollback(consumed)
        allowed = unpack_bitmask(words, self._vocab_size)
        if self._banned_eos:
            others = allowed.sum(dim=-1) > allowed[:, self._banned_eos].sum(dim=-1)
            allowed[:, self._banned_eos] &= ~others[:, None]
        return allowed


_SHARED: dict[tuple[str, int, tuple[int, ...]], GuideCompiler] = {}
_SHARED_LOCK = threading.Lock()


class GuideCompiler:
    """The engine's grammar compiler and cache; thread-safe (``compile`` runs in worker
    threads, ``guide`` in the step thread). ``shared``: one per model in a process, so the
    pieces of one engine (vLLM's logits processor and pdserve's side of it) build the token
    table and compile each grammar once."""

    @classmethod
    def shared(
        cls, model_dir: Path, vocab_size: int, eos_token_ids: tuple[int, ...]
    ) -> GuideCompiler:
        key = (str(model_dir), vocab_size, tuple(eos_token_ids))
        with _SHARED_LOCK:
            if key not in _SHARED:
                _SHARED[key] = cls(model_dir, vocab_size, eos_token_ids)
            return _SHARED[key]

    def __init__(self, model_dir: Path, vocab_size: int, eos_token_ids: tuple[int, ...]) -> None:
        self._model_dir = model_dir
        self._vocab_size = vocab_size
        self._eos = list(eos_token_ids)
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._cache: OrderedDict[StructuredOutput, llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()
        self.num_compiled = 0

    def compile(self, spec: StructuredOutput) -> None:
        """Compiles ``spec`` into the cache unless it is there. Raises ValueError naming the
        field when the grammar is invalid or over the limits. Slow: call it off the loop."""
        with self._lock:
            if spec in self._cache:
                self._cache.move_to_end(spec)
                return
        import llguidance

        tokenizer = self._token_table()
        limits = llguidance.LLParserLimits(
            max_grammar_size=_MAX_GRAMMAR_SIZE,
            initial_lexer_fuel=_INITIAL_LEXER_FUEL,
            step_lexer_fuel=_STEP_LEXER_FUEL,
        )
        try:
            grammar = spec.grammar()
        except ValueError as e:
            raise ValueError(f"{spec.field}: {e}") from None
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0, limits=limits)
        if matcher.is_error():
            reason = matcher.get_error().strip().splitlines()[0]
            raise ValueError(f"{spec.field} cannot be compiled: {reason}")
        with self._lock:
            self._cache[spec] = matcher
            self.num_compiled += 1
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)

    def guide(
        self, spec: StructuredOutput, output_ids: Sequence[int], ignore_eos: bool = False
    ) -> Guide:
        """A fresh matcher for one request, advanced past ``output_ids`` (a continued
        request's earlier output). Compiles first if the cache lost ``spec``."""
        with self._lock:
            cached = self._cache.get(spec)
        if cached is None:
            self.compile(spec)
            return self.guide(spec, output_ids, ignore_eos)
        banned = tuple(self._eos) if ignore_eos else ()
        guide = Guide(cached.deep_copy(), self._vocab_size, spec.field, banned)
        for token_id in output_ids:
            guide.accept(token_id)
        return guide

    def warm(self) -> None:
        """Builds the token table ahead of the first guided request (engines call it in a
        thread at start): otherwise that request's prefill would wait for it."""
        if (self._model_dir / "tokenizer.json").is_file():
            self._token_table()

    def _token_table(self) -> llguidance.LLTokenizer:
        """llguidance's view of the model's tokenizer (from tokenizer.json, by the Rust
        tokenizers library: no transformers import), built once (~0.3 s)."""
        with self._lock:
            if self._tokenizer is None:
                import llguidance

                path = self._model_dir / "tokenizer.json"
                if not path.is_file():
                    raise ValueError("structured outputs need a tokenizer; this model has none")
                self._tokenizer = llguidance.LLTokenizer(
                    str(path), n_vocab=self._vocab_size, eos_token=list(self._eos) or None
                )
            return self._tokenizer


def unpack_bitmask(words: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """llguidance's ``[rows, ceil(vocab/32)]`` int32 bitmask as ``[rows, vocab]`` bool."""
    bits = torch.arange(32, dtype=torch.int32)
    unpacked = (words[:, :, None] >> bits) & 1
    return unpacked.reshape(words.shape[0], -1)[:, :vocab_size].bool()
