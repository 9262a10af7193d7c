"""How a parsed OpenAI request (``parsing.py``) becomes the requests its choices run as: each
prompt is read as the gRPC API reads one (``RequestCore.read``: the same limits and
tokenization), and each of its ``n`` choices becomes a ``Request`` of its own. What the
response could grow to is bounded here, before any work."""

from __future__ import annotations

import dataclasses
import time
import uuid

from engine.sampling_params import InvalidField
from router.limits import check_output, prompt_bytes
from router.openai.bad_words import bad_words_ids
from router.openai.choices import Choice
from router.openai.invalid_parameter import InvalidParameter
from router.openai.parsing import Parsed
from router.openai.protocol import ParsedRequest
from router.openai.responses import ChoiceOutput, Envelope, Kind
from router.openai.tools import NO_TOOLS, ToolPlan
from router.request import Request
from router.request_class import Tenant
from router.request_core import RequestCore, ResourceError


@dataclasses.dataclass
class Prepared:
    """A request ready to run: its choices and the envelope of its response."""

    asked: ParsedRequest
    env: Envelope
    choices: list[Choice]
    outputs: list[ChoiceOutput]
    client_id: str
    tools: ToolPlan = NO_TOOLS


@dataclasses.dataclass(frozen=True)
class Arrival:
    """Who asked, and when: the request's id (the client's ``X-Request-Id`` or a fresh one),
    whose it is (``RequestCore.tenant``), its arrival on the router's clock."""

    client_id: str
    tenant: Tenant
    start_s: float


def new_client_id(header: str | None) -> str:
    """The client's ``X-Request-Id`` (length-checked with the request), or a fresh one."""
    return header if header else uuid.uuid4().hex


async def prepare(core: RequestCore, parsed: Parsed, arrival: Arrival) -> Prepared:
    """Raises ``ValueError`` naming a field (``InvalidParameter``) or ``ResourceError`` for a
    request refused before any work."""
    kind, asked, tools = parsed.kind, parsed.asked, parsed.tools
    limits = core.config.limits
    client_id = arrival.client_id
    sampling = asked.sampling
    if asked.bad_words:
        ids = bad_words_ids(list(asked.bad_words), core.tokenizer)
        sampling = dataclasses.replace(sampling, bad_words=ids)
    choices: list[Choice] = []
    outputs: list[ChoiceOutput] = []
    for p, prompt in enumerate(asked.prompts):
        one = Request(
            client_id,
            sampling,
            arrival.tenant.caller,
            arrival.start_s,
            prompt.text,
            prompt.token_ids,
            # A chat prompt is rendered whole by its template, special tokens included.
            add_special_tokens=kind is Kind.COMPLETION,
            tenant=arrival.tenant,
            service_class=asked.service_class,
            priority=asked.priority,
            slo=asked.slo,
        )
        try:
            core.tag(one)  # OpenAI's name for the class: service_tier
        except InvalidField as exc:
            message = str(exc).replace("service_class", "service_tier", 1)
            raise InvalidParameter("service_tier", message) from None
        read = await core.read(one)
        params = read.params
        if asked.fill_context:
            room = max(1, core.max_model_len - read.num_prompt_tokens)
            if params.min_tokens > room:
                raise InvalidParameter(
                    "min_tokens",
                    f"min_tokens ({params.min_tokens}) is more than the {room} tokens the "
                    f"context has left after the prompt ({read.num_prompt_tokens} tokens, "
                    f"max_model_len {core.max_model_len})",
                )
            params = dataclasses.replace(params, max_tokens=room)
        for i in range(asked.n):
            index = p * asked.n + i
            seed = asked.seed + i if asked.seed is not None else None
            # A prompt's logprobs are computed once, by its first choice (the others copy
            # them, and may take prefix-cache hits: a request that wants them takes none).
            first = i == 0 or params.prompt_logprobs is None
            choice_params = dataclasses.replace(
                params, seed=seed, prompt_logprobs=params.prompt_logprobs if first else None
            )
            # Each choice is a request of its own on the workers (its own id in logs).
            choice_id = client_id if asked.num_choices == 1 else f"{client_id}-{index}"
            request = dataclasses.replace(read, client_id=choice_id, params=choice_params)
            choices.append(Choice(index, request))
            prompt_ids = list(read.prompt_token_ids)
            outputs.append(ChoiceOutput(index, p, prompt_ids, prompt_text=prompt.text))
    repeated = prompt_bytes(
        [c.request.num_prompt_tokens for c in choices],
        asked.echo,
        asked.logprobs,
        asked.prompt_logprobs,
    )
    # Bounded before any work: a whole response is held until its last token; what each
    # choice repeats of its prompt is one piece even when streamed.
    generated = [] if asked.stream else [c.request.params.max_tokens for c in choices]
    try:
        check_output(generated, asked.logprobs, limits, repeated)
    except ValueError as exc:
        raise ResourceError(str(exc)) from None
    env = Envelope(
        kind,
        f"{kind.id_prefix}{client_id}",
        int(time.time()),
        parsed.model_name,
        asked.logprobs is not None,
        asked.return_token_ids,
        echo=asked.echo,
        prompt_logprobs=asked.prompt_logprobs is not None,
    )
    return Prepared(asked, env, choices, outputs, client_id, tools)
