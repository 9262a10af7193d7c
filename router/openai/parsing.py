"""How an OpenAI body is read into what it asks for: the model it names is checked; a chat's
messages are checked and rendered by the model's chat template into one prompt (in a
tokenization slot: a template is code, and messages can be megabytes), with its tools'
plan; then the body becomes a ``ParsedRequest`` (``protocol.py``)."""

from __future__ import annotations

from dataclasses import dataclass

from router.openai import errors
from router.openai.flow_fields import flow_fields
from router.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ParsedRequest,
    chat_prompt,
    message_dicts,
    parse_chat,
    parse_completion,
)
from router.openai.responses import Kind
from router.openai.served_model import ServedModel
from router.openai.tools import NO_TOOLS, ToolPlan, template_messages, tool_plan
from router.request_core import RequestCore


@dataclass(frozen=True)
class Parsed:
    kind: Kind
    asked: ParsedRequest
    model_name: str  # the name the response gives (the served one)
    tools: ToolPlan = NO_TOOLS


async def parse(
    core: RequestCore, served: ServedModel, body: ChatCompletionRequest | CompletionRequest
) -> Parsed:
    """Raises ``ApiError`` or ``ValueError`` naming the field (``InvalidParameter``)."""
    if body.model is not None and body.model != served.name:
        raise errors.model_not_found(body.model, served.name)
    max_choices = core.config.limits.max_choices
    # Checked before a chat template renders (``parse_*`` reads them again).
    flow_fields(body.priority, body.service_tier, body.slo)
    if isinstance(body, CompletionRequest):
        return Parsed(Kind.COMPLETION, parse_completion(body, max_choices), served.name)
    template = served.template
    if template is None:
        raise errors.invalid(
            "this model has no chat_template (tokenizer_config.json or chat_template.jinja):"
            " use /v1/completions",
            "messages",
        )
    tools = tool_plan(body.tools, body.tool_choice, served.tool_parser)
    messages = template_messages(message_dicts(body))
    add_prompt = body.add_generation_prompt is not False
    tokenizer = core.tokenizer
    prompt = await core.prompts.in_thread(
        lambda: chat_prompt(template, tokenizer, messages, add_prompt, tools.tools)
    )
    asked = parse_chat(body, prompt, max_choices, tools.structured)
    return Parsed(Kind.CHAT, asked, served.name, tools)
