"""The model as the OpenAI API serves it: the name clients ask for, its chat template, how a
token id reads as text, and how ``auto`` tool calls are read back. Loaded once, when the app is
built (a bad template or parser name fails the router's start, not a request)."""

from __future__ import annotations

from dataclasses import dataclass

from engine.tokenizer import Tokenizer
from router.config import RouterConfig
from router.openai.chat_template import ChatTemplate
from router.openai.responses import TokenText
from router.openai.tool_parsers import PARSERS, detect_parser


@dataclass(frozen=True)
class ServedModel:
    name: str  # --served-model-name: never the model's path on the router's disk
    template: ChatTemplate | None  # None: no chat template (chat completions are refused)
    token_text: TokenText
    tool_parser: str | None  # how ``auto`` tool calls are read back (None: not at all)

    @classmethod
    def load(cls, config: RouterConfig, tokenizer: Tokenizer | None, name: str) -> ServedModel:
        """Raises ValueError naming the parsers there are, for a ``tool_call_parser`` that is
        none of them."""
        parser = config.tool_call_parser
        if parser is not None and parser not in PARSERS:
            raise ValueError(f"tool_call_parser must be one of {sorted(PARSERS)}, got {parser!r}")
        template = ChatTemplate.from_dir(config.model)
        detected = parser or detect_parser(template.source if template else None)
        return cls(name, template, TokenText(tokenizer), detected)
