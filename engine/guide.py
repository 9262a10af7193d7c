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

A grammar is the request's business: a matcher that fails (a step past its lexer budget), a
token outside it, or no token it allows left by the request's bans is a ``RequestError`` for
that request, never an exception that fails the engine's step. ``GuideCompiler.guide_for``
refuses, before any work, a request whose first position already allows nothing.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Collection, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from engine.request_error import OutsideGrammar, RequestError
from engine.sampling_params import SamplingParams
from engine.structured_output import StructuredOutput
from engine.token_bans import banned_ids, min_tokens_ids, no_token_message

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
    advances it by an output token and says whether the constraint is complete. Neither
    raises anything but ``RequestError``."""

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
        self._failure: str | None = None  # what failed computing a mask (then none allowed)
        self.num_accepted = 0  # tokens consumed: the output index of the next one

    def accept(self, token_id: int) -> bool:
        """Advances by ``token_id``; True once the output is complete (nothing more may
        follow). Raises ``RequestError`` when the matcher failed (a mask step past its lexer
        budget, say: llguidance then allows only EOS, and an output cut short by it must not
        pass for complete) and ``OutsideGrammar`` when the token is not one it allows."""
        index, matcher = self.num_accepted, self._matcher
        try:
            failed_before = self._failure or (self._failed(index) if matcher.is_error() else None)
            consumed = failed_before is None and matcher.consume_token(token_id)
            failed_now = consumed and matcher.is_error()
            stopped = bool(matcher.is_stopped())
        except Exception as exc:  # llguidance's own failure: this request's, not the step's
            raise RequestError(self._failed(index, repr(exc))) from None
        if failed_before is not None:
            raise RequestError(failed_before)
        if not consumed:
            raise OutsideGrammar(
                f"{self._field}: token {token_id} at output index {index} is outside the grammar"
            )
        if failed_now:
            raise RequestError(self._failed(index))
        self.num_accepted += 1
        return stopped

    def _failed(self, index: int, error: str | None = None) -> str:
        """The message of a matcher failure at ``index`` (llguidance's own error, unless
        ``error``)."""
        text = error if error is not None else self._matcher.get_error()
        first_line = (text.strip().splitlines() or ["unknown error"])[0]
        return f"{self._field}: the grammar's matcher failed at output index {index}: {first_line}"

    def allows_any(self, banned: Collection[int]) -> bool:
        """Whether the next position allows a token outside ``banned`` (what the request's own
        parameters ban there: ``engine/token_bans.py``)."""
        allowed = self.masks((), 1)[0]
        if banned:
            allowed[[t for t in banned if 0 <= t < self._vocab_size]] = False
        return bool(allowed.any())

    def masks(self, guesses: Sequence[int], num_rows: int) -> torch.Tensor:
        """``[num_rows, vocab]`` bool: row ``i`` allows what may follow the output plus the
        first ``i`` guesses (speculative verification). Rows after a guess the grammar rejects
        allow everything: that guess is rejected (its row cannot sample it), so they are never
        used. The matcher is left where it was. A matcher that fails here allows nothing: the
        token sampled from its row is refused by ``accept``, with the failure."""
        try:
            return self._masks(guesses, num_rows)
        except Exception as exc:  # llguidance's own failure: this request's, not the step's
            self._failure = self._failure or self._failed(self.num_accepted, repr(exc))
            return torch.zeros(num_rows, self._vocab_size, dtype=torch.bool)

    def _masks(self, guesses: Sequence[int], num_rows: int) -> torch.Tensor:
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
        return self._restrict(unpack_bitmask(words, self._vocab_size))

    def _restrict(self, allowed: torch.Tensor) -> torch.Tensor:
        """An ``ignore_eos`` request's EOS out of every row that allows anything else."""
        if self._banned_eos:
            others = allowed.sum(dim=-1) > allowed[:, self._banned_eos].sum(dim=-1)
            allowed[:, self._banned_eos] &= ~others[:, None]
        return allowed


_EXECUTOR: list[llguidance.LLExecutor] = []  # one per process, made at first use


def next_masks(guides: Sequence[Guide]) -> list[torch.Tensor]:
    """Each guide's mask of its next position (``Guide.masks((), 1)[0]``), all filled in one
    call: llguidance computes them on its own threads, outside the GIL, so a step with many
    guided requests pays for them in parallel and the event loop runs meanwhile (one at a
    time, each held the step thread). The guides are one engine's (one vocabulary)."""
    if len(guides) < 2:
        return [g.masks((), 1)[0] for g in guides]
    import llguidance
    import llguidance.torch as lgt

    vocab = guides[0]._vocab_size
    words = lgt.allocate_token_bitmask(len(guides), vocab)
    words.fill_(-1)
    live = [(g._matcher, row) for row, g in enumerate(guides) if g._failure is None]
    try:
        if not _EXECUTOR:
            _EXECUTOR.append(llguidance.LLExecutor())
        lgt.fill_next_token_bitmask_par(_EXECUTOR[0], live, words)
    except Exception:  # one matcher's failure: each guide's own call names its own
        return [g.masks((), 1)[0] for g in guides]
    allowed = unpack_bitmask(words, vocab)
    rows = []
    for row, g in enumerate(guides):
        if g._failure is not None:  # it allows nothing: accept() names the failure
            rows.append(torch.zeros(vocab, dtype=torch.bool))
        else:
            rows.append(g._restrict(allowed[row : row + 1])[0])
    return rows


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
        request's earlier output). Compiles first if the cache lost ``spec``. Raises
        ``RequestError`` when that output does not follow the grammar."""
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

    def guide_for(self, params: SamplingParams, output_ids: Sequence[int]) -> Guide:
        """A guided request's matcher, as an engine admits the request (``guide``, compiling
        first if need be): refused with a ``RequestError`` naming the fields when its first
        position already allows no token its own bans leave (a grammar that allows only a
        ``bad_words`` token, say). Slow on a cache miss or a long continuation: off the
        event loop."""
        assert params.structured is not None
        guide = self.guide(params.structured, output_ids, params.ignore_eos)
        banned = banned_ids(params, output_ids, min_tokens_ids(params, self._eos))
        if not guide.allows_any(banned):
            raise RequestError(no_token_message(params, len(output_ids)))
        return guide

    def warm(self) -> None:
        """Builds the token table, and imports llguidance's torch helpers, ahead of the first
        guided request (engines call it in a thread at start): otherwise that request's
        prefill would wait for them, and the import (seconds, holding the GIL) would stall
        every stream of the step thread it ran in."""
        import llguidance.torch  # noqa: F401

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
