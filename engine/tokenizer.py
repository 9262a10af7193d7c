"""Tokenizer loaded from ``tokenizer.json`` (HF fast-tokenizer format) with the `tokenizers` lib.

Optional: a model directory without tokenizer files still serves token-id prompts.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer


class Tokenizer:
    def __init__(self, tokenizer: HFTokenizer, add_bos_token_id: int | None = None) -> None:
        self._tok = tokenizer
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        # Set when tokenizer_config asks for a BOS that tokenizer.json's post-processor lacks.
        self._add_bos_token_id = add_bos_token_id
        added = tokenizer.get_added_tokens_decoder().items()
        self.special_token_ids = frozenset(token_id for token_id, a in added if a.special)
        # The strings a plain ``encode`` turns into control tokens ("<|im_end|>"), and a copy of
        # the tokenizer that reads them as text: for what users wrote (``encode_as_text``).
        self.special_strings = frozenset(a.content for _, a in added if a.special and a.content)
        self._special_sorted = sorted(self.special_strings)
        self._as_text = HFTokenizer.from_str(tokenizer.to_str())
        self._as_text.encode_special_tokens = True

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> Tokenizer | None:
        path = Path(model_dir)
        if not (path / "tokenizer.json").is_file():
            return None
        tok = HFTokenizer.from_file(str(path / "tokenizer.json"))
        add_bos: int | None = None
        config_path = path / "tokenizer_config.json"
        if config_path.is_file():
            config = json.loads(config_path.read_text())
            bos = config.get("bos_token")
            bos_text = bos.get("content") if isinstance(bos, dict) else bos
            if config.get("add_bos_token") and isinstance(bos_text, str):
                add_bos = tok.token_to_id(bos_text)
        return cls(tok, add_bos)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``. Releases the GIL while it works (``encode_batch`` does, plain
        ``encode`` does not), so a long prompt encoded in a thread does not stall asyncio.
        ``add_special_tokens=False``: a rendered chat template, which wrote its own."""
        encoded = self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0]
        ids: list[int] = encoded.ids
        bos = self._add_bos_token_id
        if add_special_tokens and bos is not None and (not ids or ids[0] != bos):
            ids.insert(0, bos)
        return ids

    def encode_as_text(self, text: str) -> list[int]:
        """Token ids of ``text`` with no special tokens added, and none recognised in it:
        "<|im_end|>" written by a user is those characters, not the end of their turn."""
        ids: list[int] = self._as_text.encode_batch([text], add_special_tokens=False)[0].ids
        return ids

    def has_special_string(self, text: str) -> str | None:
        """The first control-token string found in ``text``, or None."""
        return next((s for s in self._special_sorted if s in text), None)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        # Ids past the tokenizer's vocabulary (padded embedding rows) carry no text.
        known = [t for t in token_ids if 0 <= t < self.vocab_size]
        text: str = self._tok.decode(known, skip_special_tokens=skip_special_tokens)
        return text
