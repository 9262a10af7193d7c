"""Incremental detokenization: multi-byte safe, equal to one-shot decode, stop strings held back."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.detokenizer import IncrementalDetokenizer
from engine.tokenizer import Tokenizer

TEXTS = ["plain ascii words, numbers 12345.", "Crème brûlée — 5 € 🙂🙂 日本語 ok", "🙂"]


@pytest.fixture(scope="module")
def tokenizer(llama_dir: Path) -> Tokenizer:
    tok = Tokenizer.from_dir(llama_dir)
    assert tok is not None
    return tok


@pytest.mark.parametrize("text", TEXTS)
def test_stream_equals_decode_and_never_splits_characters(tokenizer: Tokenizer, text: str) -> None:
    prompt = tokenizer.encode("Prefix:")
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer, prompt)
    deltas = [detok.add_token(t)[0] for t in ids]
    deltas.append(detok.finish())
    assert "".join(deltas) == tokenizer.decode(ids) == text
    assert all("\ufffd" not in d for d in deltas)
    if any(len(c.encode()) > 1 for c in text):
        # Some token carried only part of a character, and nothing was emitted for it.
        assert "" in deltas[:-1] or len(ids) == len(text)


def test_incomplete_character_at_end_is_flushed_as_replacement(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("🙂")
    assert len(ids) > 1, "the emoji must span several byte-level tokens"
    detok = IncrementalDetokenizer(tokenizer, [])
    assert detok.add_token(ids[0]) == ("", False)
    assert "\ufffd" in detok.finish()


def test_stop_string_is_cut_and_never_streamed(tokenizer: Tokenizer) -> None:
    text = "alpha beta STOP gamma"
    detok = IncrementalDetokenizer(tokenizer, [], stop=("STOP",))
    streamed = ""
    stopped = False
    for token_id in tokenizer.encode(text):
        delta, stopped = detok.add_token(token_id)
        streamed += delta
        if stopped:
            break
    assert stopped
    streamed += detok.finish()
    assert streamed == "alpha beta "


def test_a_long_output_keeps_only_its_unemitted_tail(tokenizer: Tokenizer) -> None:
    """Each append copies only what is held back (a stop string's length), never the whole
    output: before, ``text += delta`` on the whole output made a 128k-token stream quadratic
    (seconds of the router's event loop)."""
    stop = ("NEVER-SEEN",)
    detok = IncrementalDetokenizer(tokenizer, [], stop=stop)
    ids = tokenizer.encode("word " * 2000, add_special_tokens=False)
    streamed = []
    for token_id in ids:
        streamed.append(detok.add_token(token_id)[0])
        assert len(detok._pending) <= len(stop[0]) + 16  # the holdback and one delta
    streamed.append(detok.finish())
    assert "".join(streamed) == tokenizer.decode(ids)


def test_ids_outside_tokenizer_vocab_decode_to_nothing(tokenizer: Tokenizer) -> None:
    assert tokenizer.decode([tokenizer.vocab_size + 5]) == ""
