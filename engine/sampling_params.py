"""Per-request sampling parameters, validated on construction (errors name the parameter)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from engine.structured_output import StructuredOutput

MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 300  # entries, as OpenAI's API allows
MAX_PENALTY = 2.0  # |presence_penalty|, |frequency_penalty| (OpenAI's range)
MAX_BAD_WORDS = 128  # token sequences
MAX_BAD_WORD_TOKENS = 32
_MIN_TEMPERATURE = 1e-5
# What pdserve's wire carries (proto/pdserve/v1/common.proto): every value a request is built
# with fits, so no frontend's request fails later, where its worker calls serialise it.
MAX_INT32 = (1 << 31) - 1  # max_tokens, top_k
MAX_TOKEN_ID = (1 << 32) - 1  # every token id
MAX_SEED = (1 << 64) - 1
MIN_PRIORITY, MAX_PRIORITY = -(1 << 31), MAX_INT32  # int32, as the wire and vLLM carry it


class InvalidField(ValueError):
    """A value a request carries is refused; ``field`` names it (as the message does), for a
    frontend that reports the field apart (the OpenAI API's ``param``)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: disabled
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] | list[str] | None = None
    stop_token_ids: tuple[int, ...] | list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None  # top-n logprobs per generated token (of the raw model logits)
    # Top-n logprobs per prompt token after the first (each token's own logprob always): the
    # worker that prefills computes them (native_engine/prompt_logprobs.py); None: none, no cost.
    prompt_logprobs: int | None = None
    # Logit processing (engine/sampling.py ``processed_logits``), on every path that samples:
    # penalties count the output (and, for repetition, the prompt) of the request so far,
    # earlier output carried by a continuation included.
    presence_penalty: float = 0.0  # subtracted once from every token already in the output
    frequency_penalty: float = 0.0  # subtracted per occurrence in the output
    repetition_penalty: float = 1.0  # divides positive (multiplies negative) logits of seen ids
    logit_bias: tuple[tuple[int, float], ...] | dict[int, float] | None = None  # id -> added
    min_tokens: int = 0  # stop tokens (EOS, stop_token_ids) masked until this many are out
    # vLLM's bad_words, as token sequences (the router tokenizes the words): a sequence's
    # last token is masked wherever the output ends with the rest of it (always, for one).
    bad_words: tuple[tuple[int, ...], ...] | list[list[int]] | None = None
    # Guided decoding: the output must match this (engine/guide.py masks every sampled row).
    structured: StructuredOutput | None = None
    # Scheduling, not sampling: lower is served first (vLLM's ``priority``); no token depends
    # on it. It rides here because every hop carries these parameters (prefill, decode, a
    # migration's continuation). The router sets the request's effective one (docs/slo.md).
    priority: int = 0

    def __post_init__(self) -> None:
        _check_int("max_tokens", self.max_tokens, minimum=1, maximum=MAX_INT32)
        if not _is_real(self.temperature) or not self.temperature >= 0:
            raise InvalidField(
                "temperature", f"temperature must be a finite number >= 0, got {self.temperature!r}"
            )
        if not _is_real(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise InvalidField("top_p", f"top_p must be in (0, 1], got {self.top_p!r}")
        _check_int("top_k", self.top_k, minimum=-1, maximum=MAX_INT32)
        if not _is_real(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise InvalidField("min_p", f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.seed is not None:
            _check_int("seed", self.seed, minimum=0, maximum=MAX_SEED)
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, minimum=0)
            if self.logprobs > MAX_LOGPROBS:
                raise InvalidField(
                    "logprobs", f"logprobs must be <= {MAX_LOGPROBS}, got {self.logprobs}"
                )
        if self.prompt_logprobs is not None:
            _check_int("prompt_logprobs", self.prompt_logprobs, minimum=0)
            if self.prompt_logprobs > MAX_LOGPROBS:
                raise InvalidField(
                    "prompt_logprobs",
                    f"prompt_logprobs must be <= {MAX_LOGPROBS}, got {self.prompt_logprobs}",
                )
        stop = (
            () if self.stop is None else (self.stop,) if isinstance(self.stop, str) else self.stop
        )
        if not isinstance(stop, list | tuple) or any(not isinstance(s, str) or not s for s in stop):
            raise InvalidField(
                "stop", f"stop must be a list of non-empty strings, got {self.stop!r}"
            )
        stop_ids = () if self.stop_token_ids is None else self.stop_token_ids
        if not isinstance(stop_ids, list | tuple):
            raise InvalidField(
                "stop_token_ids", f"stop_token_ids must be a list of ints, got {stop_ids!r}"
            )
        for token_id in stop_ids:
            _check_int("stop_token_ids", token_id, minimum=0, maximum=MAX_TOKEN_ID)
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_real(value) or not -MAX_PENALTY <= value <= MAX_PENALTY:
                raise InvalidField(
                    name, f"{name} must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got {value!r}"
                )
        if not _is_real(self.repetition_penalty) or not 0 < self.repetition_penalty <= 10:
            raise InvalidField(
                "repetition_penalty",
                f"repetition_penalty must be in (0, 10], got {self.repetition_penalty!r}",
            )
        _check_int("min_tokens", self.min_tokens, minimum=0)
        check_priority(self.priority)
        if self.min_tokens > self.max_tokens:
            raise InvalidField(
                "min_tokens",
                f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})",
            )
        if self.structured is not None and not isinstance(self.structured, StructuredOutput):
            raise InvalidField(
                "structured", f"structured must be a StructuredOutput, got {self.structured!r}"
            )
        bias = _logit_bias(self.logit_bias)
        object.__setattr__(self, "bad_words", _bad_words(self.bad_words))
        # Normalised to tuples so the object stays immutable and hashable.
        object.__setattr__(self, "stop", tuple(stop))
        object.__setattr__(self, "stop_token_ids", tuple(stop_ids))
        object.__setattr__(self, "logit_bias", bias)

    @property
    def greedy(self) -> bool:
        # Dividing logits by a near-zero temperature overflows fp32; it means greedy anyway.
        return self.temperature < _MIN_TEMPERATURE

    @property
    def processes_logits(self) -> bool:
        """Whether any penalty, bias or min_tokens changes the logits before sampling."""
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or self.logit_bias
            or self.min_tokens
            or self.bad_words
        )

    @property
    def bias(self) -> tuple[tuple[int, float], ...]:
        return tuple(self.logit_bias or ())  # type: ignore[arg-type]

    @property
    def stop_strings(self) -> tuple[str, ...]:
        return tuple(self.stop or ())

    @property
    def stop_ids(self) -> tuple[int, ...]:
        return tuple(self.stop_token_ids or ())

    def is_stop_token(self, token_id: int, eos_token_ids: tuple[int, ...]) -> bool:
        """Ends the request, and (as in vLLM) contributes no text. The engine and the router's
        detokenizer both ask this, so their texts agree."""
        return token_id in self.stop_ids or (not self.ignore_eos and token_id in eos_token_ids)


def check_continuation(
    num_tokens: int, num_generated_tokens: int, params: SamplingParams, max_model_len: int
) -> None:
    """A request continued elsewhere (migration) carries its earlier output at the end of its
    prompt; it must be one that could still have produced a token. Errors name the field."""
    _check_int("num_generated_tokens", num_generated_tokens, minimum=0)
    if num_generated_tokens >= num_tokens:
        raise InvalidField(
            "num_generated_tokens",
            f"num_generated_tokens ({num_generated_tokens}) must be < the {num_tokens} "
            "prompt_token_ids it is part of",
        )
    if num_generated_tokens >= params.max_tokens:
        raise InvalidField(
            "num_generated_tokens",
            f"num_generated_tokens ({num_generated_tokens}) must be < max_tokens "
            f"({params.max_tokens}): that request is already finished",
        )
    if num_generated_tokens and num_tokens >= max_model_len:
        raise InvalidField(
            "prompt_token_ids",
            f"prompt_token_ids has {num_tokens} tokens with num_generated_tokens > 0: at "
            f"max_model_len {max_model_len} that request is already finished",
        )


def _logit_bias(
    value: tuple[tuple[int, float], ...] | dict[int, float] | None,
) -> tuple[tuple[int, float], ...]:
    """Sorted (token id, bias) pairs; errors name ``logit_bias`` and the bad entry."""
    if value is None:
        return ()
    pairs = list(value.items()) if isinstance(value, dict) else list(value)
    if len(pairs) > MAX_LOGIT_BIAS:
        raise InvalidField(
            "logit_bias", f"logit_bias has {len(pairs)} entries, more than {MAX_LOGIT_BIAS}"
        )
    out: dict[int, float] = {}
    for pair in pairs:
        if not isinstance(pair, tuple | list) or len(pair) != 2:
            raise InvalidField(
                "logit_bias", f"logit_bias entries must be (token id, bias), got {pair!r}"
            )
        token_id, bias = pair
        _check_int("logit_bias token id", token_id, minimum=0, maximum=MAX_TOKEN_ID)
        if not _is_real(bias) or not -100 <= bias <= 100:
            raise InvalidField(
                "logit_bias", f"logit_bias[{token_id}] must be in [-100, 100], got {bias!r}"
            )
        out[token_id] = float(bias)
    return tuple(sorted(out.items()))


def _bad_words(
    value: tuple[tuple[int, ...], ...] | list[list[int]] | None,
) -> tuple[tuple[int, ...], ...]:
    if value is None:
        return ()
    if not isinstance(value, list | tuple) or len(value) > MAX_BAD_WORDS:
        raise InvalidField(
            "bad_words", f"bad_words must be a list of at most {MAX_BAD_WORDS} token sequences"
        )
    out = []
    for word in value:
        if not isinstance(word, list | tuple) or not 1 <= len(word) <= MAX_BAD_WORD_TOKENS:
            raise InvalidField(
                "bad_words", f"bad_words entries must be 1 to {MAX_BAD_WORD_TOKENS} token ids"
            )
        for token_id in word:
            _check_int("bad_words token id", token_id, minimum=0, maximum=MAX_TOKEN_ID)
        out.append(tuple(word))
    return tuple(out)


def _is_real(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def check_priority(priority: object) -> None:
    """Raises ``InvalidField`` naming ``priority`` unless it is an int32."""
    if (
        not isinstance(priority, int)
        or isinstance(priority, bool)
        or not MIN_PRIORITY <= priority <= MAX_PRIORITY
    ):
        raise InvalidField(
            "priority",
            f"priority must be an integer in [{MIN_PRIORITY}, {MAX_PRIORITY}], got {priority!r}",
        )


def _check_int(name: str, value: object, *, minimum: int, maximum: int | None = None) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise InvalidField(name.split()[0], f"{name} must be an integer, got {value!r}")
    if value < minimum:
        raise InvalidField(name.split()[0], f"{name} must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise InvalidField(name.split()[0], f"{name} must be <= {maximum}, got {value}")
