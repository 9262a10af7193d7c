"""vLLM's ``bad_words``: words the output must not contain, as the token sequences the engine
masks (``SamplingParams.bad_words``). Each word is tokenized as vLLM does: as written (leading
spaces stripped) and with one leading space, since either may follow earlier text."""

from __future__ import annotations

from engine.sampling_params import MAX_BAD_WORD_TOKENS, MAX_BAD_WORDS
from engine.tokenizer import Tokenizer
from router.openai.invalid_parameter import InvalidParameter

MAX_WORD_CHARS = 256


def bad_words_ids(words: list[str], tokenizer: Tokenizer | None) -> list[list[int]]:
    """Raises InvalidParameter naming ``bad_words``: checked before anything is tokenized."""
    if tokenizer is None:
        raise InvalidParameter("bad_words", "bad_words need a tokenizer; this model has none")
    if len(words) > MAX_BAD_WORDS // 2:
        raise InvalidParameter("bad_words", f"bad_words has more than {MAX_BAD_WORDS // 2} words")
    for i, word in enumerate(words):
        if not word.strip() or len(word) > MAX_WORD_CHARS:
            raise InvalidParameter(
                f"bad_words[{i}]", f"bad_words[{i}] must be 1 to {MAX_WORD_CHARS} characters"
            )
    out: list[list[int]] = []
    for i, word in enumerate(words):
        for text in (word.lstrip(), " " + word.lstrip()):
            ids = tokenizer.encode_as_text(text)
            if len(ids) > MAX_BAD_WORD_TOKENS:
                raise InvalidParameter(
                    f"bad_words[{i}]", f"bad_words[{i}] is more than {MAX_BAD_WORD_TOKENS} tokens"
                )
            if ids and ids not in out:
                out.append(ids)
    return out
